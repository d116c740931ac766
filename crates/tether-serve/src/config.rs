//! The `tether.toml` configuration: server limits and the agents it serves.
//!
//! ```toml
//! [server]
//! max_body_bytes = 1048576     # 413 past this
//! run_timeout_secs = 600       # a run past this ends in RUN_ERROR{code: "RUN_TIMEOUT"}
//! max_concurrent_runs = 256    # 429 past this
//!
//! [agents.local]
//! provider = "gguf"            # a GGUF model run in-process: no server, no key
//! gguf = "models/qwen2.5-1.5b-instruct-q4_k_m.gguf"   # default: $TETHER_GGUF, else SmolLM2-135M
//!                                                      # (fetched into ~/.cache/tether/models)
//!
//! [agents.coder]
//! provider = "openai"          # any OpenAI-compatible /v1/chat/completions endpoint
//! base_url = "http://127.0.0.1:8080/v1"   # default: $OPENAI_BASE_URL
//! api_key_env = "OPENAI_API_KEY"          # the variable holding the key (default OPENAI_API_KEY)
//! model = "qwen3"                         # default: $TETHER_MODEL
//! system_prompt = "You are a careful coding agent."
//! max_turns = 20
//!
//! [agents.coder.workspace]     # read_file, list_dir, search_files, write_file, edit_file, run_command
//! root = "."
//! reads = "allow"              # allow | ask | deny
//! writes = "ask"
//! commands = "ask"
//!
//! [[agents.coder.commands]]    # a shell-command tool
//! name = "append_line"
//! description = "Append a line to notes.txt"
//! command = 'printf "%s\n" "$TETHER_ARG_LINE" >> notes.txt'
//! parameters = { type = "object", properties = { line = { type = "string" } }, required = ["line"] }
//! approve = false              # true: ask the user before each run
//!
//! [[agents.coder.frontend_tools]]   # tools the browser runs (besides RunAgentInput.tools)
//! name = "confirm"
//! description = "Ask the user a yes/no question"
//!
//! [agents.coder.terminal_tool]      # the run ends when the model calls it
//! name = "final_answer"
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read the config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What is wrong, with the location.
        message: String,
    },
    /// The file parsed but says something impossible.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong and how to fix it.
        message: String,
    },
}

/// The whole file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Server-wide limits.
    #[serde(default)]
    pub server: ServerSection,
    /// The agents, by name (the `{agent}` of `/v1/agents/{agent}/run`).
    #[serde(default)]
    pub agents: BTreeMap<String, AgentConfig>,
}

/// `[server]`: limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSection {
    /// Largest accepted request body in bytes (default 1 MiB).
    #[serde(default = "default_body")]
    pub max_body_bytes: usize,
    /// Longest a run may take, in seconds (default 600).
    #[serde(default = "default_run_timeout")]
    pub run_timeout_secs: u64,
    /// Most runs at once over all agents (default 256).
    #[serde(default = "default_concurrency")]
    pub max_concurrent_runs: usize,
    /// Seconds running turns get to finish on shutdown (default 30).
    #[serde(default = "default_grace")]
    pub shutdown_grace_secs: u64,
}

fn default_body() -> usize {
    1 << 20
}
fn default_run_timeout() -> u64 {
    600
}
fn default_concurrency() -> usize {
    256
}
fn default_grace() -> u64 {
    30
}

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection {
            max_body_bytes: default_body(),
            run_timeout_secs: default_run_timeout(),
            max_concurrent_runs: default_concurrency(),
            shutdown_grace_secs: default_grace(),
        }
    }
}

/// Whether an action class is allowed, asked about (an interrupt in the browser), or refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AccessConfig {
    /// Done without asking.
    Allow,
    /// The run stops with an approval interrupt; the user's answer resumes it.
    Ask,
    /// Refused.
    Deny,
}

/// One agent.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// The provider: `openai` (an OpenAI-compatible chat-completions endpoint) or `gguf` (a
    /// GGUF model run in-process).
    #[serde(default = "default_provider")]
    pub provider: String,
    /// For `gguf`: the model file (relative to the config file; default: `$TETHER_GGUF`, else the
    /// default model, SmolLM2-135M-Instruct, fetched into the user's cache on first use).
    #[serde(default)]
    pub gguf: Option<PathBuf>,
    /// The endpoint's base URL, with `/v1` (default: `$OPENAI_BASE_URL`).
    #[serde(default)]
    pub base_url: Option<String>,
    /// The environment variable holding the API key (default `OPENAI_API_KEY`).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// The model name (default: `$TETHER_MODEL`, else the server's default).
    #[serde(default)]
    pub model: Option<String>,
    /// Whether to stream model responses (default true).
    #[serde(default = "default_true")]
    pub stream: bool,
    /// A description shown in the UI.
    #[serde(default)]
    pub description: String,
    /// The system prompt.
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// Most turns per request (default 20).
    #[serde(default = "default_turns")]
    pub max_turns: u32,
    /// How long one tool may run, in seconds (default 120).
    #[serde(default = "default_tool_timeout")]
    pub tool_timeout_secs: u64,
    /// The workspace tools over a directory.
    #[serde(default)]
    pub workspace: Option<WorkspaceConfig>,
    /// Shell-command tools.
    #[serde(default)]
    pub commands: Vec<CommandTool>,
    /// Tools the browser runs.
    #[serde(default)]
    pub frontend_tools: Vec<ToolDecl>,
    /// The tool that ends the run.
    #[serde(default)]
    pub terminal_tool: Option<ToolDecl>,
}

fn default_provider() -> String {
    "openai".into()
}
fn default_true() -> bool {
    true
}
fn default_turns() -> u32 {
    20
}
fn default_tool_timeout() -> u64 {
    120
}

/// `[agents.NAME.workspace]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkspaceConfig {
    /// The root directory (relative paths are from the config file's directory).
    #[serde(default = "default_root")]
    pub root: PathBuf,
    /// Reading, listing, searching (default allow).
    #[serde(default = "allow")]
    pub reads: AccessConfig,
    /// Writing and editing (default ask).
    #[serde(default = "ask")]
    pub writes: AccessConfig,
    /// Running commands (default ask).
    #[serde(default = "ask")]
    pub commands: AccessConfig,
}

fn default_root() -> PathBuf {
    PathBuf::from(".")
}
fn allow() -> AccessConfig {
    AccessConfig::Allow
}
fn ask() -> AccessConfig {
    AccessConfig::Ask
}

/// `[[agents.NAME.commands]]`: a tool that runs `sh -c command`.
///
/// The command sees the call's arguments as JSON on stdin and in `$TETHER_ARGS`, each top-level
/// scalar argument as `$TETHER_ARG_<NAME>` (upper-cased), and the call's id as
/// `$TETHER_TOOL_USE_ID` (an idempotency key: tether never runs a recorded call again, but a
/// crash between the command's effect and the record can re-run it once).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandTool {
    /// The tool's name.
    pub name: String,
    /// What it does, for the model.
    #[serde(default)]
    pub description: String,
    /// The shell command.
    pub command: String,
    /// JSON Schema of the arguments (default: an object with no properties).
    #[serde(default)]
    pub parameters: Option<Value>,
    /// The working directory (default: the workspace root, else the config file's directory).
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    /// Ask the user before each run.
    #[serde(default)]
    pub approve: bool,
}

/// A declared tool: name, description, JSON Schema.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolDecl {
    /// The tool's name.
    pub name: String,
    /// What it does.
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments.
    #[serde(default)]
    pub parameters: Option<Value>,
}

impl Config {
    /// Parses a configuration; relative paths are resolved against `base_dir`.
    pub fn parse(text: &str, origin: &str, base_dir: &Path) -> Result<Config, ConfigError> {
        let mut cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.into(),
            message: e.to_string(),
        })?;
        let invalid = |message: String| ConfigError::Invalid {
            path: origin.into(),
            message,
        };
        if cfg.agents.is_empty() {
            return Err(invalid(
                "no agents defined: add an [agents.NAME] table (see `tether serve --help`)".into(),
            ));
        }
        if cfg.server.max_concurrent_runs == 0
            || cfg.server.max_body_bytes == 0
            || cfg.server.run_timeout_secs == 0
        {
            return Err(invalid(
                "[server] limits must be positive (max_body_bytes, run_timeout_secs, max_concurrent_runs)"
                    .into(),
            ));
        }
        for (name, a) in cfg.agents.iter_mut() {
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(invalid(format!(
                    "agent name `{name}`: use letters, digits, `-` and `_` only (it becomes a URL path segment)"
                )));
            }
            if a.provider != "openai" && a.provider != "gguf" {
                return Err(invalid(format!(
                    "agent `{name}`: provider `{}` is not supported by `tether serve`; use `openai` (any OpenAI-compatible endpoint) or `gguf` (a GGUF model run in-process)",
                    a.provider
                )));
            }
            if let Some(g) = &mut a.gguf
                && g.is_relative()
            {
                *g = base_dir.join(&*g);
            }
            if a.max_turns == 0 {
                return Err(invalid(format!("agent `{name}`: max_turns must be at least 1")));
            }
            if let Some(w) = &mut a.workspace
                && w.root.is_relative()
            {
                w.root = base_dir.join(&w.root);
            }
            let mut names = std::collections::HashSet::new();
            if a.workspace.is_some() {
                for t in [
                    "read_file",
                    "list_dir",
                    "search_files",
                    "write_file",
                    "edit_file",
                    "run_command",
                ] {
                    names.insert(t.to_owned());
                }
            }
            for c in a.commands.iter_mut() {
                if let Some(d) = &c.cwd
                    && d.is_relative()
                {
                    c.cwd = Some(base_dir.join(d));
                }
            }
            let declared = a
                .commands
                .iter()
                .map(|c| &c.name)
                .chain(a.frontend_tools.iter().map(|t| &t.name))
                .chain(a.terminal_tool.iter().map(|t| &t.name));
            for n in declared {
                if n.is_empty() {
                    return Err(invalid(format!("agent `{name}`: a tool has an empty name")));
                }
                if !names.insert(n.clone()) {
                    return Err(invalid(format!(
                        "agent `{name}`: tool `{n}` is declared twice (tool names must be unique per agent)"
                    )));
                }
            }
        }
        Ok(cfg)
    }

    /// Reads and parses a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: shown.clone(),
            source,
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let base = if base.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            base
        };
        Config::parse(&text, &shown, &base)
    }

    /// The configuration used without a file: one agent, `default`, on the OpenAI-compatible
    /// endpoint from the environment (`OPENAI_BASE_URL`), else on the embedded GGUF model, with
    /// the workspace tools over `cwd`, read-only unless the user approves each write or command.
    pub fn default_for(cwd: &Path) -> Config {
        let endpoint = std::env::var("OPENAI_BASE_URL").is_ok_and(|v| !v.trim().is_empty());
        let mut agents = BTreeMap::new();
        agents.insert(
            "default".to_owned(),
            AgentConfig {
                provider: if endpoint {
                    default_provider()
                } else {
                    "gguf".into()
                },
                gguf: None,
                base_url: None,
                api_key_env: None,
                model: None,
                stream: true,
                description: format!("The workspace tools over {}", cwd.display()),
                system_prompt: Some(
                    "You are a helpful assistant with tools over the user's workspace. \
                     Writes and commands need the user's approval."
                        .into(),
                ),
                max_turns: default_turns(),
                tool_timeout_secs: default_tool_timeout(),
                workspace: Some(WorkspaceConfig {
                    root: cwd.to_path_buf(),
                    reads: AccessConfig::Allow,
                    writes: AccessConfig::Ask,
                    commands: AccessConfig::Ask,
                }),
                commands: Vec::new(),
                frontend_tools: Vec::new(),
                terminal_tool: None,
            },
        );
        Config {
            server: ServerSection::default(),
            agents,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_file_parses_and_resolves_paths() {
        let text = r#"
[server]
max_body_bytes = 4096
[agents.coder]
model = "m"
max_turns = 3
[agents.coder.workspace]
root = "ws"
writes = "deny"
[[agents.coder.commands]]
name = "append_line"
command = "true"
cwd = "out"
approve = true
[[agents.coder.frontend_tools]]
name = "confirm"
"#;
        let c = Config::parse(text, "t.toml", Path::new("/base")).unwrap();
        assert_eq!(c.server.max_body_bytes, 4096);
        let a = &c.agents["coder"];
        let w = a.workspace.as_ref().unwrap();
        assert_eq!(w.root, Path::new("/base/ws"));
        assert_eq!(
            (w.reads, w.writes, w.commands),
            (AccessConfig::Allow, AccessConfig::Deny, AccessConfig::Ask)
        );
        assert_eq!(a.commands[0].cwd.as_deref(), Some(Path::new("/base/out")));
        assert!(a.commands[0].approve);
    }

    #[test]
    fn mistakes_get_actionable_errors() {
        let base = Path::new(".");
        let e = Config::parse("", "t.toml", base).unwrap_err().to_string();
        assert!(e.contains("no agents defined"), "{e}");
        let e = Config::parse("[agents.a]\nprovider = \"x\"", "t.toml", base)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not supported"), "{e}");
        let e = Config::parse("[agents.a]\nmodle = \"x\"", "t.toml", base)
            .unwrap_err()
            .to_string();
        assert!(e.contains("modle"), "{e}");
        let e = Config::parse("[agents.\"a b\"]", "t.toml", base)
            .unwrap_err()
            .to_string();
        assert!(e.contains("URL path segment"), "{e}");
        let dup =
            "[agents.a]\n[agents.a.workspace]\n[[agents.a.commands]]\nname = \"read_file\"\ncommand = \"x\"";
        let e = Config::parse(dup, "t.toml", base).unwrap_err().to_string();
        assert!(e.contains("declared twice"), "{e}");
    }
}
