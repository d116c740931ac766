//! `tether acp [--cwd DIR] [--yes] -- <agent command…>`: an interactive terminal client for an
//! ACP agent (Gemini CLI `--acp`, Claude Code via `claude-agent-acp`, Codex via `codex-acp`, …).
//!
//! A prompt line on stdin starts a turn; the agent's text streams to stdout with a status line per
//! tool call; permission questions (and writes/commands the agent asks the client to perform) are
//! answered at the prompt unless `--yes`; Ctrl-C cancels the running turn, not the program; end of
//! input (Ctrl-D) quits. Files and terminals are served by tether's `Workspace` over `--cwd`.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tether::workspace::{Approval, ApprovalRequest, Approver, Policy, Workspace};
use tether_acp::schema::{
    ContentBlock, NewSessionRequest, ReadTextFileRequest, ReadTextFileResponse, RequestId,
    RequestPermissionOutcome, RequestPermissionRequest, SessionUpdate, TextContent, WriteTextFileRequest,
    WriteTextFileResponse,
};
use tether_acp::{
    AcpClient, AcpUpdate, AgentCommand, ClientHandler, ClientOptions, HandlerBridge, HandlerError,
    HandlerSupport, SessionUpdateEvent, TerminalRequest, TerminalResponse,
};
use tokio::sync::mpsc;

use crate::term::{Inert, inert};

/// Options of `tether acp`.
#[derive(clap::Args, Debug)]
pub struct AcpArgs {
    /// The session's working directory; files and terminals are confined to it (default: the
    /// current directory).
    #[arg(long)]
    pub cwd: Option<PathBuf>,
    /// Allow every permission request, write and command without asking.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// The agent command and its arguments, after `--` (e.g. `-- gemini --acp`).
    #[arg(last = true, required = true, num_args = 1..)]
    pub agent: Vec<String>,
}

type Lines = Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<String>>>;

/// Reads stdin lines on a thread (stdin is blocking) into a channel shared by the prompt loop and
/// the permission questions.
fn stdin_lines() -> Lines {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        let mut line = String::new();
        loop {
            line.clear();
            match stdin.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if tx.send(line.trim_end_matches(['\n', '\r']).to_owned()).is_err() {
                        break;
                    }
                }
            }
        }
    });
    Arc::new(tokio::sync::Mutex::new(rx))
}

/// Console output shared by the handler and the prompt loop. Everything goes out inert: the
/// agent's text as prose, every status line (which quotes the agent's titles, ids, reasons) as one
/// escaped line.
#[derive(Default)]
struct Console {
    mid_line: bool,
}

impl Console {
    fn text(&mut self, s: &str) {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(inert(s, Inert::Prose).as_bytes());
        let _ = out.flush();
        self.mid_line = !s.ends_with('\n');
    }
    fn line(&mut self, s: &str) {
        let mut out = std::io::stdout().lock();
        if self.mid_line {
            let _ = out.write_all(b"\n");
        }
        let _ = writeln!(out, "{}", inert(s, Inert::Line));
        let _ = out.flush();
        self.mid_line = false;
    }
}

/// An error (which may quote the agent) on standard error, inert.
fn complain(msg: impl std::fmt::Display) {
    eprintln!("tether acp: {}", inert(&msg.to_string(), Inert::Prose));
}

/// Asks at the prompt.
struct PromptApprover {
    lines: Lines,
    console: Arc<Mutex<Console>>,
}

#[async_trait]
impl Approver for PromptApprover {
    async fn approve(&self, req: &ApprovalRequest) -> Approval {
        if let Ok(mut c) = self.console.lock() {
            c.line(&format!(
                "? allow {}? [y]es / [a]lways / [N]o",
                inert(&req.summary, Inert::Exact)
            ));
        }
        let answer = self.lines.lock().await.recv().await;
        let decision = match answer.as_deref().map(|s| s.trim().to_ascii_lowercase()) {
            Some(a) if a == "y" || a == "yes" => Approval::Once,
            Some(a) if a == "a" || a == "always" => Approval::Always,
            _ => Approval::Deny,
        };
        if let Ok(mut c) = self.console.lock() {
            c.line(match decision {
                Approval::Once => "  allowed once",
                Approval::Always => "  allowed for this session",
                _ => "  refused",
            });
        }
        decision
    }
}

/// Prints updates and serves requests through the workspace.
struct CliHandler {
    bridge: HandlerBridge,
    console: Arc<Mutex<Console>>,
    titles: Mutex<HashMap<String, String>>,
}

/// The wire (snake_case) name of a protocol enum value.
macro_rules! snake {
    ($v:expr) => {
        serde_json::to_value($v)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default()
    };
}

impl CliHandler {
    fn say(&self, f: impl FnOnce(&mut Console)) {
        if let Ok(mut c) = self.console.lock() {
            f(&mut c);
        }
    }
}

#[async_trait]
impl ClientHandler for CliHandler {
    fn supports(&self) -> HandlerSupport {
        self.bridge.supports()
    }

    async fn session_update(&self, event: &SessionUpdateEvent) {
        let AcpUpdate::Known(update) = &event.update else {
            return;
        };
        match update.as_ref() {
            SessionUpdate::AgentMessageChunk(c) => {
                if let ContentBlock::Text(t) = &c.content {
                    self.say(|con| con.text(&t.text));
                }
            }
            SessionUpdate::ToolCall(tc) => {
                let title = tc.title.clone();
                if let Ok(mut m) = self.titles.lock() {
                    m.insert(tc.tool_call_id.to_string(), title.clone());
                }
                let line = format!("[tool] {title} ({}): {}", snake!(&tc.kind), snake!(&tc.status));
                self.say(|con| con.line(&line));
            }
            SessionUpdate::ToolCallUpdate(up) => {
                let Some(status) = &up.fields.status else {
                    return;
                };
                let id = up.tool_call_id.to_string();
                let title = up
                    .fields
                    .title
                    .clone()
                    .or_else(|| self.titles.lock().ok().and_then(|m| m.get(&id).cloned()))
                    .unwrap_or(id);
                let line = format!("[tool] {title}: {}", snake!(status));
                self.say(|con| con.line(&line));
            }
            SessionUpdate::Plan(p) => {
                let line = format!("[plan] {} step(s)", p.entries.len());
                self.say(|con| con.line(&line));
            }
            _ => {}
        }
    }

    async fn request_permission(&self, req: &RequestPermissionRequest) -> RequestPermissionOutcome {
        <HandlerBridge as ClientHandler>::request_permission(&self.bridge, req).await
    }

    async fn read_text_file(&self, r: ReadTextFileRequest) -> Result<ReadTextFileResponse, HandlerError> {
        <HandlerBridge as ClientHandler>::read_text_file(&self.bridge, r).await
    }

    async fn write_text_file(&self, r: WriteTextFileRequest) -> Result<WriteTextFileResponse, HandlerError> {
        <HandlerBridge as ClientHandler>::write_text_file(&self.bridge, r).await
    }

    async fn terminal(
        &self,
        request: TerminalRequest,
        id: &RequestId,
    ) -> Result<TerminalResponse, HandlerError> {
        <HandlerBridge as ClientHandler>::terminal(&self.bridge, request, id).await
    }
}

/// Runs `tether acp`.
pub async fn run(args: AcpArgs) -> ExitCode {
    let cwd = match args.cwd.clone().map(Ok).unwrap_or_else(std::env::current_dir) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("tether acp: no working directory: {e}");
            return ExitCode::from(2);
        }
    };
    let Some(command) = AgentCommand::from_argv(&args.agent) else {
        eprintln!("tether acp: give the agent command after `--`, e.g. `tether acp -- gemini --acp`");
        return ExitCode::from(2);
    };
    let lines = stdin_lines();
    let console = Arc::new(Mutex::new(Console::default()));
    let policy = if args.yes {
        Policy::allow_all()
    } else {
        Policy::default()
    };
    let workspace = match Workspace::new(&cwd) {
        Ok(w) => w.policy(policy).approver(PromptApprover {
            lines: lines.clone(),
            console: console.clone(),
        }),
        Err(e) => {
            eprintln!("tether acp: cannot use {} as the workspace: {e}", cwd.display());
            return ExitCode::from(2);
        }
    };
    let handler = Arc::new(CliHandler {
        bridge: HandlerBridge::new(Arc::new(workspace)),
        console: console.clone(),
        titles: Mutex::new(HashMap::new()),
    });
    let options = ClientOptions::default().with_prompt_timeout(None);
    let client = match AcpClient::spawn(command.current_dir(&cwd), handler, options).await {
        Ok(c) => c,
        Err(e) => {
            complain(e);
            return ExitCode::from(1);
        }
    };
    let init = match client.initialize().await {
        Ok(i) => i,
        Err(e) => {
            complain(format!("initialize failed: {e}"));
            return ExitCode::from(1);
        }
    };
    let session = match client.new_session(NewSessionRequest::new(cwd.clone())).await {
        Ok(s) => s.session_id.clone(),
        Err(e) => {
            complain(format!("session/new failed: {e}"));
            client.shutdown().await;
            return ExitCode::from(1);
        }
    };
    let agent_name = init
        .agent_info
        .as_ref()
        .map(|i| i.name.clone())
        .unwrap_or_else(|| "agent".into());
    if let Ok(mut c) = console.lock() {
        c.line(&format!(
            "tether acp: {agent_name} (protocol {}), session {session}, workspace {}",
            init.protocol_version,
            cwd.display()
        ));
    }
    let mut code = ExitCode::SUCCESS;
    loop {
        if let Ok(mut c) = console.lock() {
            c.line("> ");
        }
        let next = tokio::select! {
            line = async { lines.lock().await.recv().await } => line,
            _ = tokio::signal::ctrl_c() => {
                if let Ok(mut c) = console.lock() {
                    c.line("(no turn is running; end input with Ctrl-D to quit)");
                }
                continue;
            }
        };
        let Some(line) = next else { break };
        if line.trim().is_empty() {
            continue;
        }
        let prompt = vec![ContentBlock::Text(TextContent::new(line))];
        let turn = client.prompt(&session, prompt);
        tokio::pin!(turn);
        let result = loop {
            tokio::select! {
                r = &mut turn => break r,
                _ = tokio::signal::ctrl_c() => {
                    if let Ok(mut c) = console.lock() {
                        c.line("^C cancelling the turn…");
                    }
                    if let Err(e) = client.cancel(&session).await {
                        complain(format!("cancel failed: {e}"));
                    }
                }
            }
        };
        match result {
            Ok(outcome) => {
                if let Ok(mut c) = console.lock() {
                    c.line(&format!("[stop: {}]", outcome.stop_reason_raw));
                }
            }
            Err(e) => {
                complain(e);
                code = ExitCode::from(1);
                if client.closed_error().is_some() {
                    break;
                }
            }
        }
    }
    client.shutdown().await;
    code
}
