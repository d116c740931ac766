//! `tether acp [--cwd DIR] [--yes] [--session-id ID] [--json] -- <agent command…>`: an interactive
//! terminal client for an ACP agent (Gemini CLI `--experimental-acp`, Claude Code via
//! `claude-agent-acp`, Codex via `codex-acp`, …).
//!
//! The agent runs as the provider of one long-lived [`tether::Session`] (spawned, driven through
//! its [`SessionHandle`]), exactly as `tether run --provider acp` runs it for one prompt: its
//! file and terminal requests are served by the [`Workspace`] over `--cwd` under its policy and
//! sandbox, and everything it says is recorded and printed by the same [`Printer`].
//!
//! This module owns the terminal: a prompt line on stdin starts a turn; lines typed while a turn
//! runs are sent after it; a permission question (or a write or command the policy asks about)
//! is asked here and answered by the next line read after it was shown — never by one typed
//! ahead;
//! Ctrl-C cancels the turn in flight (the engine stops it and the agent gets `session/cancel`),
//! not the program; end of input (Ctrl-D) quits once the running turn is over.

use std::collections::VecDeque;
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use serde_json::json;
use tether::sandbox::Sandbox;
use tether::workspace::{Approval, ApprovalRequest, ApproveAll, Approver, Policy, Workspace};
use tether::{Error, Session, SessionHandle, SessionResult, Subscription};
use tether_acp::AgentCommand;
use tokio::sync::{mpsc, oneshot};

use crate::print::{Printer, result_line, short};
use crate::term::{Inert, inert, inert_json};

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
    /// Reload an earlier session of the agent (`session/load`) instead of starting a new one;
    /// the agent must advertise `loadSession`.
    #[arg(long)]
    pub session_id: Option<String>,
    /// Print events and results as JSON lines on stdout (the prompt, questions and notices go to
    /// stderr).
    #[arg(long)]
    pub json: bool,
    /// How commands run by the agent are confined (Linux: Landlock + seccomp): `auto` confines
    /// where the kernel can and warns once where it cannot, `require` refuses commands where it
    /// cannot, `off` never confines. Confined commands write only inside the workspace and
    /// their own $TMPDIR.
    #[arg(long, value_name = "MODE", default_value = "auto")]
    pub sandbox: tether::sandbox::SandboxMode,
    /// Let confined commands use the network (default: no network).
    #[arg(long)]
    pub allow_network: bool,
    /// A directory confined commands may also write beneath (repeatable), e.g. a build cache.
    #[arg(long, value_name = "DIR")]
    pub writable: Vec<PathBuf>,
    /// The agent command and its arguments, after `--` (e.g. `-- gemini --experimental-acp`).
    #[arg(last = true, required = true, num_args = 1..)]
    pub agent: Vec<String>,
}

/// A line typed on stdin, with when tether read it.
struct Line {
    text: String,
    read_at: Instant,
}

/// Reads stdin lines on a thread (stdin is blocking) into a channel; closed at end of input.
///
/// Every line completed by one read is stamped with the time that read returned, taken before
/// any of them is handed on: a line typed ahead of the one that starts a turn is never younger
/// than a question that turn asks.
fn stdin_lines() -> mpsc::UnboundedReceiver<Line> {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buf = vec![0u8; 64 * 1024];
        let mut partial: Vec<u8> = Vec::new();
        loop {
            let n = match stdin.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let read_at = Instant::now();
            partial.extend_from_slice(&buf[..n]);
            while let Some(end) = partial.iter().position(|b| *b == b'\n') {
                let raw: Vec<u8> = partial.drain(..=end).collect();
                let text = String::from_utf8_lossy(&raw)
                    .trim_end_matches(['\n', '\r'])
                    .to_owned();
                if tx.send(Line { text, read_at }).is_err() {
                    return;
                }
            }
        }
        // A last line without a newline still counts.
        if !partial.is_empty() {
            let text = String::from_utf8_lossy(&partial)
                .trim_end_matches('\r')
                .to_owned();
            let _ = tx.send(Line {
                text,
                read_at: Instant::now(),
            });
        }
    });
    rx
}

/// A question for the person at the terminal, and where its answer goes.
struct Question {
    summary: String,
    answer: oneshot::Sender<Approval>,
    /// When it was shown (set by [`Screen::ask`]).
    asked_at: Instant,
}

/// The workspace's approver: hands each question to the terminal loop, which asks it when what
/// the agent said before it has been printed. Refused if the loop is gone.
struct PromptApprover {
    questions: mpsc::UnboundedSender<Question>,
}

#[async_trait]
impl Approver for PromptApprover {
    async fn approve(&self, req: &ApprovalRequest) -> Approval {
        let (answer, rx) = oneshot::channel();
        let q = Question {
            summary: req.summary.clone(),
            answer,
            asked_at: Instant::now(),
        };
        if self.questions.send(q).is_err() {
            return Approval::Deny;
        }
        rx.await.unwrap_or(Approval::Deny)
    }
}

/// SIGINT, received for as long as the program runs (installed once, before anything can be
/// interrupted, so no Ctrl-C falls between two waits).
struct Interrupts {
    #[cfg(unix)]
    signal: tokio::signal::unix::Signal,
}

impl Interrupts {
    fn install() -> std::io::Result<Self> {
        Ok(Interrupts {
            #[cfg(unix)]
            signal: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?,
        })
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        {
            if self.signal.recv().await.is_none() {
                std::future::pending::<()>().await;
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// The terminal: the printer, the notices and the questions being asked.
struct Screen {
    printer: Printer,
    json: bool,
    /// Questions shown and not yet answered, oldest first.
    asked: VecDeque<Question>,
}

impl Screen {
    /// A notice of ours (stdout in text mode, stderr with `--json`).
    fn say(&mut self, s: &str) {
        if self.json {
            eprintln!("{}", inert(s, Inert::Line));
        } else {
            self.printer.line(s);
        }
    }

    fn prompt(&mut self) {
        self.say("> ");
    }

    fn ask(&mut self, mut q: Question) {
        // Stamped before it can be seen: any line read after this may be its answer.
        q.asked_at = Instant::now();
        self.say(&format!(
            "? allow {}? [y]es / [a]lways / [N]o",
            inert(&q.summary, Inert::Exact)
        ));
        self.asked.push_back(q);
    }

    /// Answers the oldest open question with `line`; `false` when none is open, or the line was
    /// read before the question was shown (typed ahead, it cannot be meant as its answer).
    fn answer(&mut self, line: &Line) -> bool {
        if self.asked.front().is_none_or(|q| line.read_at < q.asked_at) {
            return false;
        }
        let Some(q) = self.asked.pop_front() else {
            return false;
        };
        let decision = match line.text.trim().to_ascii_lowercase().as_str() {
            "y" | "yes" => Approval::Once,
            "a" | "always" => Approval::Always,
            _ => Approval::Deny,
        };
        let delivered = q.answer.send(decision).is_ok();
        self.say(match (delivered, decision) {
            (false, _) => "  (the question was withdrawn: nothing was allowed)",
            (_, Approval::Once) => "  allowed once",
            (_, Approval::Always) => "  allowed for this session",
            _ => "  refused",
        });
        true
    }

    /// Refuses every open question (end of input, end of the turn).
    fn refuse_all(&mut self) {
        for q in self.asked.drain(..) {
            let _ = q.answer.send(Approval::Deny);
        }
    }

    /// Prints every event already queued: all a request emitted is queued before its result.
    fn drain(&mut self, events: &mut Subscription) {
        while let Ok(e) = events.try_recv() {
            self.printer.event(&e);
        }
    }

    /// With `--json`, a request that failed ends with one `{"error": …}` line on stdout (as one
    /// that finished ends with its `{"result": …}` line).
    fn error(&mut self, e: &Error) {
        if self.json {
            let line = json!({"error": {"code": e.code(), "message": e.to_string()}}).to_string();
            println!("{}", inert_json(&line));
        }
    }

    fn result(&mut self, r: &SessionResult) {
        if self.json {
            println!("{}", result_line(r));
            return;
        }
        let stop = r.stop_reason.to_string();
        self.say(&format!("[stop: {}]", short(&stop, 200)));
    }
}

/// An error (which may quote the agent) on standard error, inert.
fn complain(screen: &mut Screen, msg: impl std::fmt::Display) {
    screen.printer.end_line();
    eprintln!("tether acp: {}", inert(&msg.to_string(), Inert::Prose));
}

/// Whether the agent is gone after this error (the session cannot take another turn).
fn fatal(e: &Error) -> bool {
    matches!(e, Error::Transport { .. } | Error::Closed)
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
    if AgentCommand::from_argv(&args.agent).is_none() {
        eprintln!(
            "tether acp: give the agent command after `--`, e.g. `tether acp -- gemini --experimental-acp`"
        );
        return ExitCode::from(2);
    }
    let program = args.agent.first().cloned().unwrap_or_default();
    let mut interrupts = match Interrupts::install() {
        Ok(i) => i,
        Err(e) => {
            eprintln!("tether acp: cannot catch Ctrl-C: {e}");
            return ExitCode::from(2);
        }
    };
    let workspace = match Workspace::new(&cwd) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("tether acp: cannot use {} as the workspace: {e}", cwd.display());
            return ExitCode::from(2);
        }
    };
    let mut sandbox = Sandbox::new(args.sandbox).allow_network(args.allow_network);
    for w in &args.writable {
        sandbox = sandbox.writable(w.clone());
    }
    if let Some(w) = sandbox.warning() {
        eprintln!("tether acp: warning: {w}");
    }
    let (questions_tx, mut questions) = mpsc::unbounded_channel();
    let workspace = workspace.sandbox(sandbox);
    let workspace = if args.yes {
        workspace.policy(Policy::allow_all()).approver(ApproveAll)
    } else {
        workspace.approver(PromptApprover {
            questions: questions_tx,
        })
    };
    // A turn lasts as long as the agent works on it; Ctrl-C is how it is stopped.
    let agent = match (tether_serve::providers::ProviderSpec::Acp {
        command: args.agent.clone(),
        cwd: cwd.clone(),
        session_id: args.session_id.clone(),
        prompt_timeout: None,
    })
    .build()
    {
        Ok(p) => p,
        Err(e) => {
            eprintln!("tether acp: {e}");
            return ExitCode::from(2);
        }
    };
    let mut screen = Screen {
        printer: Printer::new(args.json),
        json: args.json,
        asked: VecDeque::new(),
    };
    let opening = tether_otel::observe_global(Session::builder_boxed(agent))
        .handler_arc(Arc::new(workspace))
        .open();
    let session = tokio::select! {
        s = opening => s,
        _ = interrupts.recv() => {
            complain(&mut screen, "interrupted while starting the agent");
            return ExitCode::from(130);
        }
    };
    let session = match session {
        Ok(s) => s,
        Err(e) => {
            let code = match e {
                Error::CannotResume { .. } | Error::Config { .. } => 2,
                _ => 1,
            };
            let msg = match &e {
                Error::CannotResume { .. } => format!("--session-id: {e}"),
                Error::Config { message, .. } => message.clone(),
                _ => format!("could not start a session with `{program}`: {e}"),
            };
            complain(&mut screen, msg);
            return ExitCode::from(code);
        }
    };
    let mut events = session.sink().subscribe(1024).await;
    let how = if session.opened().resumed {
        "reloaded"
    } else {
        "new"
    };
    screen.say(&format!(
        "tether acp: `{program}`, session {} ({how}), workspace {}",
        session.info().session_id,
        cwd.display()
    ));
    let handle = session.spawn();
    let code = drive(handle, &mut events, &mut questions, &mut interrupts, &mut screen).await;
    screen.printer.end_line();
    code
}

/// The terminal loop: prompts, events, questions, Ctrl-C and results, until end of input.
async fn drive(
    mut handle: SessionHandle,
    events: &mut Subscription,
    questions: &mut mpsc::UnboundedReceiver<Question>,
    interrupts: &mut Interrupts,
    screen: &mut Screen,
) -> ExitCode {
    let mut lines = stdin_lines();
    let mut code = ExitCode::SUCCESS;
    let mut busy = false;
    let mut eof = false;
    // Lines typed while a turn runs: the next prompts.
    let mut waiting: VecDeque<String> = VecDeque::new();
    screen.prompt();
    loop {
        tokio::select! {
            biased;
            _ = interrupts.recv() => {
                if busy {
                    screen.say("^C cancelling the turn…");
                    handle.cancel();
                } else {
                    screen.say("(no turn is running; end input with Ctrl-D to quit)");
                }
            }
            Some(e) = events.recv() => screen.printer.event(&e),
            Some(q) = questions.recv() => {
                screen.drain(events);
                if busy && !eof {
                    screen.ask(q);
                } else {
                    // Outside a turn, or nobody left to answer: refused.
                    let _ = q.answer.send(Approval::Deny);
                }
            }
            // The agent stopped waiting for the oldest question (its turn was cancelled).
            _ = withdrawn(screen.asked.front_mut()) => {
                screen.asked.pop_front();
                screen.say("  (the question was withdrawn)");
            }
            r = handle.next_result(), if busy => {
                busy = false;
                screen.drain(events);
                screen.refuse_all();
                match r {
                    Some(Ok(r)) => screen.result(&r),
                    Some(Err(Error::Cancelled)) => {
                        screen.error(&Error::Cancelled);
                        screen.say("[stop: cancelled]");
                    }
                    Some(Err(e)) => {
                        let gone = fatal(&e);
                        screen.error(&e);
                        complain(screen, e);
                        code = ExitCode::from(1);
                        if gone {
                            break;
                        }
                    }
                    None => {
                        complain(screen, "the session ended");
                        code = ExitCode::from(1);
                        break;
                    }
                }
                match waiting.pop_front() {
                    Some(p) => {
                        screen.printer.next_request();
                        if handle.send(p).await.is_err() {
                            complain(screen, "the session ended");
                            code = ExitCode::from(1);
                            break;
                        }
                        busy = true;
                    }
                    None if eof => break,
                    None => screen.prompt(),
                }
            }
            line = lines.recv(), if !eof => match line {
                None => {
                    eof = true;
                    screen.refuse_all();
                    if !busy {
                        break;
                    }
                }
                Some(line) => {
                    if screen.answer(&line) {
                        continue;
                    }
                    let line = line.text;
                    if line.trim().is_empty() {
                        if !busy {
                            screen.prompt();
                        }
                        continue;
                    }
                    if busy {
                        waiting.push_back(line);
                        continue;
                    }
                    screen.printer.next_request();
                    if handle.send(line).await.is_err() {
                        complain(screen, "the session ended");
                        code = ExitCode::from(1);
                        break;
                    }
                    busy = true;
                }
            },
        }
    }
    screen.refuse_all();
    handle.close().await;
    screen.drain(events);
    code
}

/// Resolves when the question's asker stops waiting; never without a question.
async fn withdrawn(q: Option<&mut Question>) {
    match q {
        Some(q) => q.answer.closed().await,
        None => std::future::pending().await,
    }
}
