//! `tether run`: one prompt, streamed to the terminal, with the workspace tools.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use tether::local::LocalLoop;
use tether::workspace::{Approval, ApprovalRequest, Approver, Policy, Workspace};
use tether::{Error, Event, EventKind, Provider, Session, SessionResult};

/// Options of `tether run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The prompt.
    pub prompt: String,
    /// Base URL of an OpenAI-compatible endpoint, including `/v1` (e.g. http://127.0.0.1:8080/v1).
    #[arg(long, env = "OPENAI_BASE_URL")]
    pub base_url: Option<String>,
    /// API key for the endpoint (local servers usually need none).
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Model name (openai: default `default`, which local servers such as llama-server accept;
    /// anthropic: default `--anthropic-model` / `ANTHROPIC_MODEL`, then claude-sonnet-4-5).
    #[arg(long, env = "TETHER_MODEL")]
    pub model: Option<String>,
    /// Most turns before the run stops.
    #[arg(long, default_value_t = 50)]
    pub max_turns: u32,
    /// Print events and the result as JSON lines instead of text.
    #[arg(long)]
    pub json: bool,
    /// Allow writes and commands without asking.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// The workspace directory the tools work in (default: the current directory).
    #[arg(long)]
    pub cwd: Option<PathBuf>,
    /// A system prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Time limit of the whole run, in seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// Use non-streaming requests.
    #[arg(long)]
    pub no_stream: bool,
    /// Where the loop lives (openai, anthropic, managed, agentcore) and what each needs.
    #[command(flatten)]
    pub provider: crate::providers::ProviderArgs,
}

/// Asks on the terminal; anything but y/yes/a/always (or end of input) refuses.
struct TerminalApprover;

#[async_trait]
impl Approver for TerminalApprover {
    async fn approve(&self, req: &ApprovalRequest) -> Approval {
        let summary = req.summary.clone();
        tokio::task::spawn_blocking(move || {
            let mut err = std::io::stderr();
            let _ = write!(err, "\n? allow {summary}? [y]es / [a]lways / [N]o: ");
            let _ = err.flush();
            let mut line = String::new();
            match std::io::stdin().read_line(&mut line) {
                Ok(0) | Err(_) => {
                    let _ = writeln!(err, "(no answer: refused)");
                    Approval::Deny
                }
                Ok(_) => match line.trim().to_ascii_lowercase().as_str() {
                    "y" | "yes" => Approval::Once,
                    "a" | "always" => Approval::Always,
                    _ => Approval::Deny,
                },
            }
        })
        .await
        .unwrap_or(Approval::Deny)
    }
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("tether: {msg}");
    ExitCode::from(2)
}

/// Turns an error into a message a person can act on.
fn explain(e: &Error, base_url: &str, model: &str) -> String {
    if let Some(m) = crate::providers::explain(e, base_url) {
        return m;
    }
    match e {
        Error::Transport {
            kind: tether::TransportKind::Refused,
            ..
        } => format!(
            "could not connect to {base_url}: connection refused. Is the server running? (set --base-url or OPENAI_BASE_URL)"
        ),
        Error::Transport { .. } => format!("talking to {base_url} failed: {e}"),
        Error::Http {
            status: 401 | 403,
            message,
            ..
        } => format!(
            "{base_url} rejected the credentials (HTTP {}): {message}. Set OPENAI_API_KEY or --api-key.",
            e.status().unwrap_or(401)
        ),
        Error::Http {
            status: 404, message, ..
        } => format!(
            "{base_url} answered 404: {message}. Is the model name `{model}` right (--model / TETHER_MODEL), and does the base URL end in /v1?"
        ),
        Error::Timeout(d) => format!("the run did not finish within {}s (--timeout)", d.as_secs()),
        _ => e.to_string(),
    }
}

fn short(s: &str, n: usize) -> String {
    let one: String = s.replace('\n', "⏎");
    if one.chars().count() > n {
        format!("{}…", one.chars().take(n).collect::<String>())
    } else {
        one
    }
}

fn print_event(e: &Event, json_mode: bool, at_line_start: &mut bool) {
    if json_mode {
        if let Ok(s) = serde_json::to_string(&json!({"event": e})) {
            println!("{s}");
        }
        return;
    }
    let mut out = std::io::stdout();
    match &e.kind {
        EventKind::TextDelta { delta, .. } => {
            let _ = write!(out, "{delta}");
            let _ = out.flush();
            *at_line_start = delta.ends_with('\n');
        }
        EventKind::ToolCall { tool_use, .. } => {
            if !*at_line_start {
                let _ = writeln!(out);
            }
            let _ = writeln!(
                out,
                "⚙ {} {}",
                tool_use.name,
                short(&tool_use.input.to_string(), 120)
            );
            *at_line_start = true;
        }
        EventKind::ToolResult { result } => {
            let mark = if result.is_error { "✗" } else { "✓" };
            let _ = writeln!(out, "{mark} {}", short(&result.content, 160));
            *at_line_start = true;
        }
        EventKind::Retry {
            attempt,
            delay_ms,
            error,
        } => {
            eprintln!("\n(retry {attempt} in {delay_ms} ms: {error})");
        }
        EventKind::Message { tool_uses, .. } => {
            for u in tool_uses {
                if !*at_line_start {
                    let _ = writeln!(out);
                }
                let _ = writeln!(out, "⚙ {} {}", u.name, short(&u.input.to_string(), 120));
                *at_line_start = true;
            }
        }
        _ => {}
    }
}

/// Runs `tether run`.
pub async fn run(args: RunArgs) -> ExitCode {
    let loop_options = crate::providers::LoopOptions {
        model: args.model.clone(),
        system: args.system.clone(),
        no_stream: args.no_stream,
    };
    let remote = if args.provider.uses_gguf(args.base_url.as_deref()) {
        crate::providers::build_gguf(&args.provider, &loop_options).map(Some)
    } else {
        crate::providers::build_remote(&args.provider, &loop_options)
    };
    let remote = match remote {
        Ok(r) => r,
        Err(m) => return fail(m),
    };
    let remote_label = remote.as_ref().map(|_| args.provider.label());
    let Some(base_url) = remote_label.or_else(|| args.base_url.clone().filter(|s| !s.trim().is_empty()))
    else {
        return fail(
            "no model endpoint configured: pass --base-url or set OPENAI_BASE_URL \
             (e.g. http://127.0.0.1:8080/v1 for a local llama-server)",
        );
    };
    // Local servers (llama-server) ignore the name; OpenAI needs a real one (a 404 says so).
    let model_name = args
        .model
        .clone()
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| "default".into());
    let root = match &args.cwd {
        Some(p) => p.clone(),
        None => match std::env::current_dir() {
            Ok(p) => p,
            Err(e) => return fail(format!("cannot read the current directory: {e}")),
        },
    };
    let workspace = match Workspace::new(&root) {
        Ok(w) => w,
        Err(e) => return fail(format!("workspace {}: {e}", root.display())),
    };
    let workspace = if args.yes {
        workspace.policy(Policy::allow_all())
    } else {
        workspace.approver(TerminalApprover)
    };
    if let Some(p) = remote {
        return run_with(p, workspace, &args, &base_url, &model_name).await;
    }
    let mut builder = tether_openai::OpenAiModel::builder(&base_url)
        .model(model_name.clone())
        .stream(!args.no_stream);
    if let Some(k) = args.api_key.clone().filter(|k| !k.is_empty()) {
        builder = builder.api_key(k);
    }
    let model = match builder.build() {
        Ok(m) => m,
        Err(e) => return fail(e),
    };
    let mut provider = LocalLoop::new(model).model_name(model_name.clone());
    if let Some(s) = &args.system {
        provider = provider.system_prompt(s.clone());
    }
    let provider: Box<dyn Provider> = Box::new(provider);
    run_with(provider, workspace, &args, &base_url, &model_name).await
}

async fn run_with(
    provider: Box<dyn Provider>,
    workspace: Workspace,
    args: &RunArgs,
    base_url: &str,
    model_name: &str,
) -> ExitCode {
    let timeout = Duration::from_secs(args.timeout.max(1));
    let session = Session::builder_boxed(provider)
        .handler_arc(Arc::new(workspace))
        .max_turns(args.max_turns)
        .timeout(timeout)
        .open();
    let mut session = match tokio::time::timeout(timeout, session).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return fail(explain(&e, base_url, model_name)),
        Err(_) => return fail(explain(&Error::Timeout(timeout), base_url, model_name)),
    };
    let mut events = session.sink().subscribe(1024).await;
    let json_mode = args.json;
    let printer = tokio::spawn(async move {
        let mut at_line_start = true;
        // Streamed tool calls are shown once, when their arguments are complete.
        let mut streaming: std::collections::HashMap<String, (String, String)> = Default::default();
        let mut shown = std::collections::HashSet::new();
        while let Some(e) = events.recv().await {
            if json_mode {
                print_event(&e, true, &mut at_line_start);
                continue;
            }
            match &e.kind {
                EventKind::ToolCallStart {
                    tool_use_id, name, ..
                } => {
                    streaming.insert(tool_use_id.clone(), (name.clone(), String::new()));
                }
                EventKind::ToolCallArgs { tool_use_id, delta } => {
                    if let Some((_, a)) = streaming.get_mut(tool_use_id) {
                        a.push_str(delta);
                    }
                }
                EventKind::ToolCallEnd { tool_use_id } => {
                    if let Some((name, args)) = streaming.remove(tool_use_id) {
                        shown.insert(tool_use_id.clone());
                        let input = tether::ToolUse::from_arguments(tool_use_id, &name, &args);
                        let mut call = e.clone();
                        call.kind = EventKind::ToolCall {
                            tool_use: input,
                            message_id: None,
                        };
                        print_event(&call, false, &mut at_line_start);
                    }
                }
                EventKind::Message { tool_uses, .. } => {
                    let fresh: Vec<_> = tool_uses
                        .iter()
                        .filter(|u| !shown.contains(&u.id))
                        .cloned()
                        .collect();
                    let mut e2 = e.clone();
                    if let EventKind::Message { tool_uses, .. } = &mut e2.kind {
                        *tool_uses = fresh;
                    }
                    print_event(&e2, false, &mut at_line_start);
                }
                _ => print_event(&e, false, &mut at_line_start),
            }
        }
        at_line_start
    });
    // Cancelling (rather than dropping) at the deadline lets the provider interrupt the remote
    // loop (Managed Agents `user.interrupt`, AgentCore `StopRuntimeSession`).
    let cancel = tether::CancellationToken::new();
    let deadline = {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(timeout).await;
            cancel.cancel();
        })
    };
    let result = match session.send_cancellable(args.prompt.clone(), cancel).await {
        Err(Error::Cancelled) => Err(Error::Timeout(timeout)),
        r => r,
    };
    deadline.abort();
    let _ = session.close().await;
    let at_line_start = printer.await.unwrap_or(true);
    match result {
        Ok(r) => report(&r, json_mode, at_line_start),
        Err(e) => {
            if !at_line_start {
                println!();
            }
            fail(explain(&e, base_url, model_name))
        }
    }
}

fn report(r: &SessionResult, json_mode: bool, at_line_start: bool) -> ExitCode {
    if json_mode {
        let mut v = serde_json::to_value(r).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            o.remove("events");
            o.remove("transcript");
        }
        println!("{}", json!({"result": v}));
    } else {
        if !at_line_start {
            println!();
        }
        eprintln!(
            "— {} turn(s), {} input + {} output tokens, stop: {}",
            r.turns,
            r.usage.input_tokens,
            r.usage.output_tokens,
            r.stop_reason
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| r.stop_reason.to_string())
        );
    }
    match r.terminal {
        tether::Terminal::EndTurn => ExitCode::SUCCESS,
        _ => {
            if !json_mode {
                eprintln!("tether: the run ended early ({})", r.stop_reason);
            }
            ExitCode::from(3)
        }
    }
}
