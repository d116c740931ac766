//! The handler an agent's sessions run with: the workspace tools, shell-command tools, the
//! agent's MCP servers and its configured front-end tools. It names the calls that need the
//! user's approval ([`Handler::needs_approval`]); the session engine holds them and
//! `tether_agui::ThreadAgent` turns them into approval interrupts.
//!
//! Command tools run through the same runner and sandbox as the workspace's `run_command`
//! (`tether::sandbox`): confined per the agent's `[sandbox]`, output capped, the whole process
//! group killed at the tool timeout or when the call is cancelled.

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};
use std::sync::Arc;

use tether::sandbox::{CommandSpec, Sandbox};
use tether::source::{CallContext, ToolEvents, ToolSources};
use tether::workspace::{Access, Policy, Workspace};
use tether::{ChatModel, Handler, SessionInfo, ToolOutput, ToolSpec, ToolUse};

use crate::config::{AccessConfig, AgentConfig, CommandTool};

const OUTPUT_CAP: usize = 64 * 1024;

pub(crate) struct ServeHandler {
    workspace: Option<Workspace>,
    ask_reads: bool,
    ask_writes: bool,
    ask_commands: bool,
    commands: Vec<(CommandTool, PathBuf)>,
    frontend: Vec<ToolSpec>,
    tool_timeout: Duration,
    sandbox: Sandbox,
    /// The agent's MCP servers (started at server start), and the names the handler serves
    /// itself, which they may not take.
    mcp: Option<(ToolSources, Vec<String>)>,
}

/// Starts an agent's MCP servers (once; later calls reuse them). The roots they are given are
/// the workspace root; sampling, where an entry allows it, is answered by the agent's model. A
/// server that does not start is the error, naming it and its stderr.
pub(crate) async fn start_mcp(cfg: &AgentConfig) -> Result<(), String> {
    if cfg.mcp.is_empty() || cfg.mcp_running.0.get().is_some() {
        return Ok(());
    }
    // The agent's own model (as `server::start` resolves it), for servers allowed to sample.
    let base_url = cfg
        .base_url
        .clone()
        .or_else(|| std::env::var("OPENAI_BASE_URL").ok())
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| "http://127.0.0.1:8080/v1".into());
    let key_env = cfg.api_key_env.clone().unwrap_or_else(|| "OPENAI_API_KEY".into());
    let api_key = std::env::var(&key_env).ok().filter(|s| !s.is_empty());
    let model_name = cfg
        .model
        .clone()
        .or_else(|| std::env::var("TETHER_MODEL").ok())
        .unwrap_or_default();
    let model: Arc<dyn ChatModel> = crate::model::openai(&base_url, api_key, &model_name, false)?;
    let root = match &cfg.workspace {
        Some(w) => w.root.clone(),
        None => std::env::current_dir().map_err(|e| format!("cannot read the current directory: {e}"))?,
    };
    let sampling = tether_mcp::SamplingModel::new(model, model_name);
    let (sources, _servers) = tether_mcp::config::connect_all(&cfg.mcp, &[root], Some(sampling))
        .await
        .map_err(|e| e.to_string())?;
    let _ = cfg.mcp_running.0.set(sources);
    Ok(())
}

fn policy_access(a: AccessConfig) -> Access {
    match a {
        // The gate below asks; the workspace itself then allows.
        AccessConfig::Allow | AccessConfig::Ask => Access::Allow,
        AccessConfig::Deny => Access::Deny,
    }
}

impl ServeHandler {
    /// The handler of an agent's sessions.
    pub(crate) fn new(cfg: &AgentConfig) -> Result<Self, String> {
        let sandbox = cfg.sandbox.sandbox();
        let (workspace, ask) = match &cfg.workspace {
            Some(w) => {
                let ws = Workspace::new(&w.root)
                    .map_err(|e| format!("the workspace root {} is not usable: {e}", w.root.display()))?
                    .policy(Policy::new(
                        policy_access(w.reads),
                        policy_access(w.writes),
                        policy_access(w.commands),
                    ))
                    .command_timeout(Duration::from_secs(cfg.tool_timeout_secs.max(1)))
                    .sandbox(sandbox.clone());
                (
                    Some(ws),
                    (
                        w.reads == AccessConfig::Ask,
                        w.writes == AccessConfig::Ask,
                        w.commands == AccessConfig::Ask,
                    ),
                )
            }
            None => (None, (false, false, false)),
        };
        let default_dir = workspace
            .as_ref()
            .map(|w| w.root().to_path_buf())
            .unwrap_or_else(|| PathBuf::from("."));
        let commands: Vec<(CommandTool, PathBuf)> = cfg
            .commands
            .iter()
            .map(|c| (c.clone(), c.cwd.clone().unwrap_or_else(|| default_dir.clone())))
            .collect();
        let fe: Vec<ToolSpec> = cfg
            .frontend_tools
            .iter()
            .map(|t| ToolSpec::new(&t.name, &t.description, schema_or_empty(t.parameters.clone())))
            .collect();
        let mut own: Vec<String> = workspace
            .as_ref()
            .map(|w| w.tools().into_iter().map(|t| t.name).collect())
            .unwrap_or_default();
        own.extend(commands.iter().map(|(c, _)| c.name.clone()));
        own.extend(fe.iter().map(|t| t.name.clone()));
        own.extend(cfg.terminal_tool.iter().map(|t| t.name.clone()));
        let mcp = match cfg.mcp_running.0.get() {
            Some(sources) => {
                // A name an MCP tool shares with one of the agent's own is a configuration error
                // (checked at start; a front-end tool of a request can collide too).
                sources.check(&own).map_err(|e| format!("MCP servers: {e}"))?;
                Some((sources.clone(), own))
            }
            None => None,
        };
        Ok(ServeHandler {
            mcp,
            workspace,
            ask_reads: ask.0,
            ask_writes: ask.1,
            ask_commands: ask.2,
            commands,
            frontend: fe,
            tool_timeout: Duration::from_secs(cfg.tool_timeout_secs.max(1)),
            sandbox,
        })
    }

    /// Whether `name` is run by the browser.
    pub(crate) fn is_frontend(&self, name: &str) -> bool {
        self.frontend.iter().any(|t| t.name == name)
    }

    /// Whether a call needs the user's approval before it runs (and what to tell them).
    pub(crate) fn approval_need(&self, u: &ToolUse) -> Option<String> {
        let arg = |k: &str| u.input.get(k).and_then(Value::as_str).unwrap_or("?").to_owned();
        match u.name.as_str() {
            "write_file" | "edit_file" if self.workspace.is_some() && self.ask_writes => {
                Some(format!("{} {}", u.name, arg("path")))
            }
            "run_command" if self.workspace.is_some() && self.ask_commands => {
                Some(format!("run `{}`", arg("command")))
            }
            "read_file" | "list_dir" | "search_files" if self.workspace.is_some() && self.ask_reads => {
                Some(format!("{} {}", u.name, arg("path")))
            }
            n => self
                .commands
                .iter()
                .find(|(c, _)| c.name == n && c.approve)
                .map(|(c, _)| format!("{} {}", c.name, u.input))
                .or_else(|| {
                    let (sources, own) = self.mcp.as_ref()?;
                    let route = sources.route(n, own).filter(|r| r.asks)?;
                    Some(format!(
                        "{n} (tool `{}` of MCP server `{}`) {}",
                        route.tool, route.source_name, u.input
                    ))
                }),
        }
    }

    async fn run_command_tool(
        &self,
        c: &CommandTool,
        cwd: &Path,
        call: &ToolUse,
        info: &SessionInfo,
    ) -> ToolOutput {
        let args = call.input.to_string();
        let mut env: Vec<(std::ffi::OsString, std::ffi::OsString)> = vec![
            ("TETHER_TOOL_USE_ID".into(), call.id.clone().into()),
            ("TETHER_SESSION_ID".into(), info.session_id.clone().into()),
            ("TETHER_ARGS".into(), args.clone().into()),
        ];
        if let Some(obj) = call.input.as_object() {
            for (k, v) in obj {
                let key: String = k
                    .chars()
                    .map(|ch| {
                        if ch.is_ascii_alphanumeric() {
                            ch.to_ascii_uppercase()
                        } else {
                            '_'
                        }
                    })
                    .collect();
                let val = match v {
                    Value::String(s) => s.clone(),
                    Value::Number(_) | Value::Bool(_) => v.to_string(),
                    _ => continue,
                };
                env.push((format!("TETHER_ARG_{key}").into(), val.into()));
            }
        }
        let mut writable = vec![cwd.to_path_buf()];
        if let Some(w) = &self.workspace {
            writable.push(w.root().to_path_buf());
        }
        let spec = CommandSpec::shell(&c.command, cwd)
            .with_env(env)
            .with_writable(writable)
            .with_stdin(args.into_bytes())
            .with_output_cap(OUTPUT_CAP)
            .with_timeout(self.tool_timeout);
        match self.sandbox.run(&spec).await {
            // As the workspace's `run_command` reports it (a failure is its `HandlerError`).
            Ok(out) => match out.report(&format!("tool `{}`", c.name), &spec) {
                Ok(text) => ToolOutput::Ok(text),
                Err(text) => ToolOutput::Error(tether::HandlerError::Failed(text).to_string()),
            },
            Err(e) => ToolOutput::Error(format!("tool `{}`: {e}", c.name)),
        }
    }
}

/// The most of a write's content an approval question shows (the rest is counted, not shown).
const SHOWN_CONTENT: usize = 4096;

/// Asks the user, through the [`tether_agui::ThreadAgent`] serving this request
/// ([`tether_agui::thread::asking_handler`]), whether an agent's direct request may go ahead:
/// the run ends with an approval interrupt and the request waits for the next request's
/// `resume[]`. Only an approval allows (fail closed): a denial, a cancelled or dropped question,
/// and a request served outside a `ThreadAgent` (nobody to ask) are refusals.
async fn ask_user(
    kind: &str,
    title: String,
    input: Value,
    info: &SessionInfo,
) -> Result<(), tether::HandlerError> {
    let Some(asker) = tether_agui::thread::asking_handler() else {
        return Err(tether::HandlerError::Refused(format!(
            "{title}: the workspace policy asks the user first, and nobody can be asked here"
        )));
    };
    // The question is bound (by the interrupt's record) to exactly this request: its id is a
    // digest of what it asks, so an answer cannot be replayed onto another request.
    let id = format!(
        "{kind}-{}",
        tether_agui::approval::digest(&json!([&title, &input]))
    );
    let req = tether::PermissionRequest::new(id, title.clone())
        .with_input(input)
        .with_kind(kind.to_owned())
        .with_options(vec![
            tether::PermissionOption::new("allow_once", "Allow once", tether::PermissionKind::AllowOnce),
            tether::PermissionOption::new("reject_once", "Reject", tether::PermissionKind::RejectOnce),
        ]);
    match asker.request_permission(&req, info).await {
        tether::PermissionOutcome::Selected { option_id } if option_id == "allow_once" => Ok(()),
        _ => Err(tether::HandlerError::Refused(format!(
            "{title}: not approved by the user"
        ))),
    }
}

/// A path as the user should see it: relative to the workspace root when inside it.
fn shown_path(root: Option<&Path>, p: &Path) -> String {
    root.and_then(|r| p.strip_prefix(r).ok())
        .map(|r| r.display().to_string())
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| p.display().to_string())
}

pub(crate) fn schema_or_empty(v: Option<Value>) -> Value {
    match v {
        Some(v @ Value::Object(_)) => v,
        _ => json!({"type": "object", "properties": {}}),
    }
}

impl ServeHandler {
    /// Runs a call (the engine held it until approved, when it needs approval).
    async fn run(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        if self.is_frontend(&call.name) {
            return ToolOutput::Pending;
        }
        if let Some((c, cwd)) = self.commands.iter().find(|(c, _)| c.name == call.name) {
            return self.run_command_tool(c, cwd, call, info).await;
        }
        if let Some((sources, own)) = &self.mcp
            && let Some(route) = sources.route(&call.name, own)
        {
            // A server's elicitation asks the browser through the ThreadAgent running the call:
            // the run ends with an elicitation interrupt, the call waits for the answer.
            let handler = tether_agui::thread::asking_handler().unwrap_or_else(|| Arc::new(tether::NoTools));
            let cx = CallContext::new(info.clone(), handler).with_events(ToolEvents::current());
            return sources.call_routed(&route, call, cx).await;
        }
        match &self.workspace {
            Some(w) => w.call_tool(call, info).await,
            None => ToolOutput::Error(format!("no tool named `{}`", call.name)),
        }
    }
}

#[async_trait]
impl Handler for ServeHandler {
    fn tools(&self) -> Vec<ToolSpec> {
        let mut out = self.workspace.as_ref().map(|w| w.tools()).unwrap_or_default();
        for (c, _) in &self.commands {
            out.push(ToolSpec::new(
                &c.name,
                &c.description,
                schema_or_empty(c.parameters.clone()),
            ));
        }
        out.extend(self.frontend.iter().cloned());
        if let Some((sources, own)) = &self.mcp {
            out.extend(sources.tools(own));
        }
        out
    }

    /// The workspace's, the commands' and the front-end tools are fixed when the agent is
    /// built; only the MCP servers' lists change.
    fn tools_version(&self) -> Option<u64> {
        match &self.mcp {
            Some((sources, _)) => sources.tools_version(),
            None => Some(0),
        }
    }

    async fn call_tool(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        self.run(call, info).await
    }

    fn needs_approval(&self, call: &ToolUse) -> Option<String> {
        if self.is_frontend(&call.name) {
            return None;
        }
        self.approval_need(call)
    }

    // A remote loop's file and terminal requests (an ACP agent's `fs/*`, `terminal/*`) are
    // served by the workspace, under its policy; without a workspace they are refused. A kind of
    // access the policy says to ask about is asked of the user (`ask_user`: an approval
    // interrupt in the browser while the request waits); only an approval lets it through.

    async fn read_text_file(
        &self,
        req: &tether::ReadTextFile,
        info: &SessionInfo,
    ) -> Result<String, tether::HandlerError> {
        let Some(w) = &self.workspace else {
            return Err(tether::HandlerError::Unsupported(
                "reading files (no workspace)".into(),
            ));
        };
        if self.ask_reads {
            let path = shown_path(Some(w.root()), &req.path);
            ask_user(
                "read",
                format!("read {path}"),
                json!({"path": path, "line": req.line, "limit": req.limit}),
                info,
            )
            .await?;
        }
        w.read_text_file(req, info).await
    }

    async fn write_text_file(
        &self,
        req: &tether::WriteTextFile,
        info: &SessionInfo,
    ) -> Result<(), tether::HandlerError> {
        let Some(w) = &self.workspace else {
            return Err(tether::HandlerError::Unsupported(
                "writing files (no workspace)".into(),
            ));
        };
        if self.ask_writes {
            let path = shown_path(Some(w.root()), &req.path);
            let bytes = req.content.len();
            let mut shown: String = req.content.chars().take(SHOWN_CONTENT).collect();
            if shown.len() < bytes {
                shown.push_str("\n[…]");
            }
            ask_user(
                "edit",
                format!("write {path} ({bytes} bytes)"),
                // The digest of the whole content binds the answer to this exact write.
                json!({"path": path, "bytes": bytes, "content": shown,
                       "digest": tether_agui::approval::digest(&json!(req.content))}),
                info,
            )
            .await?;
        }
        w.write_text_file(req, info).await
    }

    async fn terminal(
        &self,
        req: &tether::TerminalRequest,
        info: &SessionInfo,
    ) -> Result<tether::TerminalResponse, tether::HandlerError> {
        let Some(w) = &self.workspace else {
            return Err(tether::HandlerError::Unsupported(
                "terminals (no workspace)".into(),
            ));
        };
        // Only starting a command is asked about: reading, waiting on, killing and releasing a
        // terminal the user allowed are part of that command.
        if self.ask_commands
            && let tether::TerminalRequest::Create {
                command,
                args,
                env,
                cwd,
                ..
            } = req
        {
            let shown = std::iter::once(command.as_str())
                .chain(args.iter().map(String::as_str))
                .collect::<Vec<_>>()
                .join(" ");
            ask_user(
                "execute",
                format!("run `{shown}`"),
                json!({"command": command, "args": args, "env": env,
                       "cwd": cwd.as_ref().map(|c| shown_path(Some(w.root()), c))}),
                info,
            )
            .await?;
        }
        w.terminal(req, info).await
    }

    fn capabilities(&self) -> tether::Capabilities {
        match &self.workspace {
            Some(w) => w.capabilities(),
            None => tether::Capabilities::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gated(dir: &std::path::Path, writes: &str) -> ServeHandler {
        let text = format!(
            "[agents.a]\nprovider = \"acp\"\ncommand = [\"agent\"]\n[agents.a.workspace]\nroot = \"{}\"\nwrites = \"{writes}\"\n",
            dir.display()
        );
        let cfg = crate::config::Config::parse(&text, "t.toml", dir).unwrap();
        ServeHandler::new(&cfg.agents["a"]).unwrap()
    }

    /// An ACP agent's direct `fs/write_text_file` under `writes = "ask"` served outside a
    /// `ThreadAgent` (nobody to ask: no asking handler) is refused, nothing is written; under a
    /// `ThreadAgent` it is an approval interrupt (`tests/acp_ask.rs`). The same request under
    /// `allow` is served by the workspace; reads are served under `allow`.
    #[tokio::test]
    async fn an_agents_direct_write_under_ask_with_nobody_to_ask_is_refused_fail_closed() {
        let dir = tempfile::tempdir().unwrap();
        let info = SessionInfo::new("s", "acp");
        let write = tether::WriteTextFile::new(dir.path().join("x.txt"), "hi");
        let h = gated(dir.path(), "ask");
        let e = h.write_text_file(&write, &info).await.unwrap_err();
        assert!(matches!(e, tether::HandlerError::Refused(_)), "{e}");
        assert!(!dir.path().join("x.txt").exists(), "nothing written");
        // The same write as a tool call is an approval the engine asks for.
        let call = ToolUse::new("c1", "write_file", json!({"path": "x.txt", "content": "hi"}));
        assert!(h.needs_approval(&call).is_some());

        let h = gated(dir.path(), "allow");
        h.write_text_file(&write, &info).await.unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join("x.txt")).unwrap(), "hi");
        let read = tether::ReadTextFile::new(dir.path().join("x.txt"));
        assert_eq!(h.read_text_file(&read, &info).await.unwrap(), "hi");
        assert!(h.needs_approval(&call).is_none());
    }

    /// Issue 12 item 4: a command tool of the config and the workspace's `run_command` run the
    /// same script through one runner and report it in one format: the exit status first, the
    /// output, the truncation note at the same cap; an error exactly when the exit code is not 0.
    #[tokio::test]
    async fn command_tools_and_run_command_report_in_one_format() {
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            r#"[agents.a]
[agents.a.workspace]
root = "{root}"
commands = "allow"
[[agents.a.commands]]
name = "fails"
command = 'printf "err\n" >&2; exit 3'
[[agents.a.commands]]
name = "works"
command = 'printf "fine\n"'
[[agents.a.commands]]
name = "floods"
command = 'head -c 70000 /dev/zero | tr "\0" a; printf "END\n"'
"#,
            root = dir.path().display()
        );
        let cfg = crate::config::Config::parse(&text, "t.toml", dir.path()).unwrap();
        let h = ServeHandler::new(&cfg.agents["a"]).unwrap();
        let info = SessionInfo::new("s", "local");
        for (tool, script) in [
            ("fails", r#"printf "err\n" >&2; exit 3"#),
            ("works", r#"printf "fine\n""#),
            ("floods", r#"head -c 70000 /dev/zero | tr "\0" a; printf "END\n""#),
        ] {
            let own = h.call_tool(&ToolUse::new("c1", tool, json!({})), &info).await;
            let ws = h
                .call_tool(
                    &ToolUse::new("c2", "run_command", json!({"command": script})),
                    &info,
                )
                .await;
            assert_eq!(own, ws, "{tool}");
            let text = match &own {
                ToolOutput::Ok(t) | ToolOutput::Error(t) => t.clone(),
                other => panic!("{other:?}"),
            };
            match tool {
                "fails" => {
                    assert!(matches!(own, ToolOutput::Error(_)));
                    assert_eq!(text, "failed: exit code: 3\nerr\n");
                }
                "works" => assert_eq!(own, ToolOutput::Ok("exit code: 0\nfine\n".into())),
                _ => {
                    assert!(text.starts_with("exit code: 0\n"), "{}", &text[..40]);
                    assert!(
                        text.ends_with("END\n\n[output truncated: only the last 65536 bytes kept]"),
                        "{}",
                        &text[text.len() - 80..]
                    );
                }
            }
        }
    }
}
