//! Configuring servers: the `mcpServers` JSON of Claude Desktop, Claude Code and Cursor,
//! `--mcp NAME=COMMAND`, and [`Entry`], the one shape both become (and `tether.toml`'s
//! `[[agents.X.mcp]]` deserializes into).
//!
//! Values may name environment variables as `${VAR}` (in `env`, `headers`, `url` and `args`): a
//! secret stays in the environment, not in the file. An unset variable is an error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tether::source::{ApprovalRule, Prefix, SourceOptions, ToolSources};

use crate::{McpError, McpServer, SamplingModel, ServerConfig, Transport};

/// When a server's tools are prefixed with its name (`name__tool`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefixConfig {
    /// Never (a name another tool has is a configuration error).
    #[default]
    Never,
    /// Always.
    Always,
    /// Only the names another server or the workspace also has.
    OnCollision,
}

/// Which tools are asked for: `"always"`, `"never"`, or a list of tool names (`*` wildcards).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum ApprovalConfig {
    /// `"always"` or `"never"`.
    Word(String),
    /// These tools.
    Tools(Vec<String>),
}

impl Default for ApprovalConfig {
    fn default() -> Self {
        ApprovalConfig::Word("never".into())
    }
}

impl ApprovalConfig {
    fn rule(&self) -> Result<ApprovalRule, McpError> {
        match self {
            ApprovalConfig::Word(w) if w == "always" => Ok(ApprovalRule::Always),
            ApprovalConfig::Word(w) if w == "never" => Ok(ApprovalRule::Never),
            ApprovalConfig::Word(w) => Err(McpError::Config(format!(
                "approval must be \"always\", \"never\" or a list of tool names, not {w:?}"
            ))),
            ApprovalConfig::Tools(t) => Ok(ApprovalRule::Tools(t.clone())),
        }
    }
}

/// One server as configured: a command (stdio) or a URL (streamable HTTP), and how its tools
/// are exposed. Unknown fields are refused (a misspelt `aproval` must not pass silently).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Entry {
    /// The server's name (in `mcpServers` JSON, the key).
    #[serde(default)]
    pub name: String,
    /// The program of a stdio server.
    #[serde(default)]
    pub command: Option<String>,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Variables set for it.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Its working directory.
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    /// The URL of an HTTP server.
    #[serde(default)]
    pub url: Option<String>,
    /// `stdio`, `http` or `streamable-http` (optional: implied by `command` / `url`).
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// Headers for an HTTP server.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Prefix rule.
    #[serde(default)]
    pub prefix: PrefixConfig,
    /// Only these tools (names, `*` wildcards).
    #[serde(default)]
    pub allow: Option<Vec<String>>,
    /// Never these tools.
    #[serde(default)]
    pub deny: Vec<String>,
    /// Which tools are asked for.
    #[serde(default)]
    pub approval: ApprovalConfig,
    /// Seconds one call may take (default 60), not counting the time an elicitation of the call
    /// waits for the user.
    #[serde(default)]
    pub timeout_secs: Option<u64>,
    /// Seconds an elicitation of the server may wait for the user's answer (default 900; then it
    /// is answered `cancel`).
    #[serde(default)]
    pub elicitation_timeout_secs: Option<u64>,
    /// Whether the server may sample the session's model (default: refused).
    #[serde(default)]
    pub sampling: bool,
    /// Claude Desktop's switch to leave a server out.
    #[serde(default)]
    pub disabled: bool,
}

/// Replaces each `${VAR}` in `s` with the variable's value.
pub fn expand(s: &str, what: &str) -> Result<String, McpError> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 2..];
        let Some(end) = after.find('}') else {
            return Err(McpError::Config(format!("{what}: `${{` without a closing `}}`")));
        };
        let var = &after[..end];
        match std::env::var(var) {
            Ok(v) => out.push_str(&v),
            Err(_) => {
                return Err(McpError::Config(format!(
                    "{what} names the environment variable `{var}`, which is not set"
                )));
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn valid_name(name: &str) -> Result<(), McpError> {
    if name.is_empty()
        || name.len() > 48
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(McpError::Config(format!(
            "server name {name:?}: use 1 to 48 letters, digits, `_` or `-` (it prefixes tool names)"
        )));
    }
    Ok(())
}

impl Entry {
    /// The transport, with `${VAR}`s expanded.
    pub fn transport(&self) -> Result<Transport, McpError> {
        let n = &self.name;
        let kind = self.kind.as_deref().unwrap_or("");
        match (&self.command, &self.url) {
            (Some(_), Some(_)) => Err(McpError::Config(format!(
                "server `{n}` has both `command` and `url`; give one"
            ))),
            (Some(c), None) if kind.is_empty() || kind == "stdio" => Ok(Transport::Stdio {
                command: expand(c, &format!("server `{n}` command"))?,
                args: self
                    .args
                    .iter()
                    .map(|a| expand(a, &format!("server `{n}` args")))
                    .collect::<Result<_, _>>()?,
                env: self
                    .env
                    .iter()
                    .map(|(k, v)| Ok((k.clone(), expand(v, &format!("server `{n}` env {k}"))?)))
                    .collect::<Result<_, McpError>>()?,
                cwd: self.cwd.clone(),
            }),
            (None, Some(u))
                if kind.is_empty()
                    || kind == "http"
                    || kind == "streamable-http"
                    || kind == "streamableHttp" =>
            {
                let url = expand(u, &format!("server `{n}` url"))?;
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(McpError::Config(format!(
                        "server `{n}`: url must start with http:// or https://, not {url:?}"
                    )));
                }
                Ok(Transport::Http {
                    url,
                    headers: self
                        .headers
                        .iter()
                        .map(|(k, v)| Ok((k.clone(), expand(v, &format!("server `{n}` header {k}"))?)))
                        .collect::<Result<_, McpError>>()?,
                })
            }
            (None, None) => Err(McpError::Config(format!(
                "server `{n}` needs `command` (a stdio server) or `url` (streamable HTTP)"
            ))),
            _ => Err(McpError::Config(format!(
                "server `{n}`: type {kind:?} is not served (stdio and http are; the old SSE transport is not)"
            ))),
        }
    }

    /// How its tools are exposed.
    pub fn source_options(&self) -> Result<SourceOptions, McpError> {
        let mut o = SourceOptions::new(&self.name)
            .prefix(match self.prefix {
                PrefixConfig::Never => Prefix::Never,
                PrefixConfig::Always => Prefix::Always,
                PrefixConfig::OnCollision => Prefix::OnCollision,
            })
            .deny(self.deny.clone())
            .approval(self.approval.rule()?);
        if let Some(a) = &self.allow {
            o = o.allow(a.clone());
        }
        Ok(o)
    }

    /// The server's configuration: `roots` for `roots/list`, `sampling` used only when the entry
    /// allows it.
    pub fn server_config(
        &self,
        roots: &[PathBuf],
        sampling: Option<SamplingModel>,
    ) -> Result<ServerConfig, McpError> {
        valid_name(&self.name)?;
        let mut c = ServerConfig::new(&self.name, self.transport()?).roots(roots.to_vec());
        if let Some(s) = self.timeout_secs {
            c = c.call_timeout(Duration::from_secs(s.max(1)));
        }
        if let Some(s) = self.elicitation_timeout_secs {
            c = c.elicitation_timeout(Duration::from_secs(s.max(1)));
        }
        if self.sampling {
            match sampling {
                Some(s) => c = c.sampling(s),
                None => {
                    return Err(McpError::Config(format!(
                        "server `{}` allows sampling, but this front-end has no model to answer it",
                        self.name
                    )));
                }
            }
        }
        Ok(c)
    }
}

/// Parses `--mcp NAME=COMMAND`: the command line is split on whitespace, with `'…'` and `"…"`
/// quoting.
pub fn parse_flag(s: &str) -> Result<Entry, McpError> {
    let Some((name, cmd)) = s.split_once('=') else {
        return Err(McpError::Config(format!(
            "--mcp {s:?}: expected NAME=COMMAND, e.g. --mcp fs='npx -y @modelcontextprotocol/server-filesystem .'"
        )));
    };
    let words = split_words(cmd).map_err(|m| McpError::Config(format!("--mcp {name}: {m}")))?;
    let Some((command, args)) = words.split_first() else {
        return Err(McpError::Config(format!("--mcp {name}: the command is empty")));
    };
    let e = Entry {
        name: name.trim().to_owned(),
        command: Some(command.clone()),
        args: args.to_vec(),
        ..Entry::default()
    };
    valid_name(&e.name)?;
    Ok(e)
}

fn split_words(s: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    for c in s.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => cur.push(c),
            None if c == '\'' || c == '"' => {
                quote = Some(c);
                in_word = true;
            }
            None if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            None => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if quote.is_some() {
        return Err("a quote is not closed".into());
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

/// Reads a Claude-style `{"mcpServers": {"name": {...}}}` file (servers marked `disabled` are
/// left out).
pub fn read_file(path: &Path) -> Result<Vec<Entry>, McpError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| McpError::Config(format!("cannot read {}: {e}", path.display())))?;
    parse_json(&text).map_err(|e| match e {
        McpError::Config(m) => McpError::Config(format!("{}: {m}", path.display())),
        other => other,
    })
}

/// Parses the `mcpServers` JSON.
pub fn parse_json(text: &str) -> Result<Vec<Entry>, McpError> {
    #[derive(Deserialize)]
    struct File {
        #[serde(rename = "mcpServers")]
        mcp_servers: Option<BTreeMap<String, serde_json::Value>>,
    }
    let f: File = serde_json::from_str(text).map_err(|e| McpError::Config(format!("not valid JSON: {e}")))?;
    let Some(servers) = f.mcp_servers else {
        return Err(McpError::Config("no `mcpServers` object".into()));
    };
    let mut out = Vec::new();
    for (name, v) in servers {
        let mut e: Entry =
            serde_json::from_value(v).map_err(|e| McpError::Config(format!("server `{name}`: {e}")))?;
        e.name = name;
        valid_name(&e.name)?;
        if !e.disabled {
            out.push(e);
        }
    }
    Ok(out)
}

/// Starts every entry's server (in order; the first that fails is the error) and returns them as
/// tool sources.
pub async fn connect_all(
    entries: &[Entry],
    roots: &[PathBuf],
    sampling: Option<SamplingModel>,
) -> Result<(ToolSources, Vec<McpServer>), McpError> {
    let mut sources = ToolSources::new();
    let mut servers = Vec::new();
    for e in entries {
        let cfg = e.server_config(roots, sampling.clone())?;
        let opts = e.source_options()?;
        let server = McpServer::connect(cfg).await?;
        sources
            .push(Arc::new(server.clone()), opts)
            .map_err(|e| McpError::Config(e.to_string()))?;
        servers.push(server);
    }
    Ok((sources, servers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claude_desktop_files_parse() {
        let v = parse_json(
            r#"{"mcpServers": {
                "fs": {"command": "npx", "args": ["-y", "x"], "env": {"A": "b"}},
                "web": {"type": "http", "url": "https://h/mcp", "headers": {"X-Key": "k"}},
                "off": {"command": "x", "disabled": true}
            }}"#,
        )
        .unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].name, "fs");
        assert!(
            matches!(v[0].transport().unwrap(), Transport::Stdio { ref args, .. } if args == &["-y", "x"])
        );
        assert!(
            matches!(v[1].transport().unwrap(), Transport::Http { ref url, .. } if url == "https://h/mcp")
        );
    }

    #[test]
    fn mistakes_are_named() {
        let e = parse_json(r#"{"mcpServers": {"a": {"command": "x", "aproval": "always"}}}"#).unwrap_err();
        assert!(e.to_string().contains("aproval"), "{e}");
        let e = parse_json(r#"{"mcpServers": {"a": {}}}"#).unwrap()[0]
            .transport()
            .unwrap_err();
        assert!(e.to_string().contains("command"), "{e}");
        let e = parse_json(r#"{"mcpServers": {"a b": {"command": "x"}}}"#).unwrap_err();
        assert!(e.to_string().contains("a b"), "{e}");
        let e = parse_json(r#"{"mcpServers": {"a": {"url": "file:///etc/passwd"}}}"#).unwrap()[0]
            .transport()
            .unwrap_err();
        assert!(e.to_string().contains("http"), "{e}");
        let e = Entry {
            approval: ApprovalConfig::Word("sometimes".into()),
            ..Entry::default()
        }
        .source_options()
        .unwrap_err();
        assert!(e.to_string().contains("sometimes"), "{e}");
    }

    #[test]
    fn flags_split_like_a_shell() {
        let e = parse_flag("fs=node 'my server.js' --root \"a b\"").unwrap();
        assert_eq!(e.name, "fs");
        assert_eq!(e.command.as_deref(), Some("node"));
        assert_eq!(e.args, vec!["my server.js", "--root", "a b"]);
        assert!(parse_flag("nocommand").is_err());
        assert!(parse_flag("x=").is_err());
        assert!(parse_flag("x='open").is_err());
    }

    #[test]
    fn variables_expand_and_unset_ones_fail() {
        // SAFETY: not a concern here: a test-only variable with a unique name.
        unsafe { std::env::set_var("TETHER_MCP_TEST_TOKEN", "s3cret") };
        assert_eq!(
            expand("Bearer ${TETHER_MCP_TEST_TOKEN}", "h").unwrap(),
            "Bearer s3cret"
        );
        let e = expand("${TETHER_MCP_TEST_UNSET_VAR}", "header X").unwrap_err();
        assert!(e.to_string().contains("TETHER_MCP_TEST_UNSET_VAR"), "{e}");
    }
}
