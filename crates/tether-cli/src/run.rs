//! `tether run`: one prompt, streamed to the terminal, with the workspace tools.

use std::io::{BufRead, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tether::local::LocalLoop;
use tether::sandbox::Sandbox;
use tether::workspace::{Approval, ApprovalRequest, Approver, Policy, Workspace};
use tether::{Error, Provider, Session, SessionResult};

use crate::print::{Printer, result_line, short};
use crate::term::{Inert, inert};

/// Options of `tether run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The prompt; `-` reads it from standard input (UTF-8, at most 1 MiB), and approvals are
    /// then asked on the terminal (`/dev/tty`), or refused where there is none (`--yes` allows).
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
    /// An MCP server over stdio whose tools the agent gets, as NAME=COMMAND (repeatable), e.g.
    /// `--mcp fs='npx -y @modelcontextprotocol/server-filesystem .'`.
    #[arg(long = "mcp", value_name = "NAME=COMMAND")]
    pub mcp: Vec<String>,
    /// A JSON file of MCP servers in the `mcpServers` format of Claude Desktop, Claude Code and
    /// Cursor (stdio `command`/`args`/`env` or HTTP `url`/`headers`, plus tether's `prefix`,
    /// `allow`, `deny`, `approval`, `timeout_secs`, `sampling`).
    #[arg(long = "mcp-config", value_name = "FILE")]
    pub mcp_config: Option<PathBuf>,
    /// Where the loop lives (openai, anthropic, managed, agentcore, acp) and what each needs.
    #[command(flatten)]
    pub provider: crate::providers::ProviderArgs,
}

/// Where the answers to approval questions are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answers {
    /// Standard input (the prompt came on the command line).
    Stdin,
    /// The controlling terminal, `/dev/tty` (standard input carried the prompt).
    Tty,
}

/// Asks on the terminal; anything but y/yes/a/always (or end of input, or no terminal) refuses.
/// The question shows the exact request, escaped ([`Inert::Exact`]): a command cannot hide or
/// rewrite itself on the screen.
struct TerminalApprover {
    answers: Answers,
}

#[async_trait]
impl Approver for TerminalApprover {
    async fn approve(&self, req: &ApprovalRequest) -> Approval {
        let question = format!(
            "\n? allow {}? [y]es / [a]lways / [N]o: ",
            inert(&req.summary, Inert::Exact)
        );
        let answers = self.answers;
        tokio::task::spawn_blocking(move || match answers {
            Answers::Stdin => ask(&mut std::io::stderr(), &mut std::io::stdin().lock(), &question),
            Answers::Tty => match std::fs::OpenOptions::new().read(true).write(true).open("/dev/tty") {
                Ok(tty) => {
                    let mut out = &tty;
                    ask(&mut out, &mut std::io::BufReader::new(&tty), &question)
                }
                Err(_) => {
                    let mut err = std::io::stderr();
                    let _ = writeln!(
                        err,
                        "{question}(no terminal to ask: the prompt came from standard input; refused, --yes allows)"
                    );
                    Approval::Deny
                }
            },
        })
        .await
        .unwrap_or(Approval::Deny)
    }
}

/// Writes the question, reads one answer line.
fn ask(out: &mut impl Write, input: &mut impl BufRead, question: &str) -> Approval {
    let _ = write!(out, "{question}");
    let _ = out.flush();
    let mut line = String::new();
    match input.read_line(&mut line) {
        Ok(0) | Err(_) => {
            let _ = writeln!(out, "(no answer: refused)");
            Approval::Deny
        }
        Ok(_) => match line.trim().to_ascii_lowercase().as_str() {
            "y" | "yes" => Approval::Once,
            "a" | "always" => Approval::Always,
            _ => Approval::Deny,
        },
    }
}

/// The most a prompt read from standard input may hold.
const MAX_STDIN_PROMPT: u64 = 1 << 20;

/// Reads the prompt of `tether run -`: bounded, UTF-8, not empty.
fn read_prompt(input: impl Read) -> Result<String, String> {
    let mut buf = Vec::new();
    input
        .take(MAX_STDIN_PROMPT + 1)
        .read_to_end(&mut buf)
        .map_err(|e| format!("cannot read the prompt from standard input: {e}"))?;
    if buf.len() as u64 > MAX_STDIN_PROMPT {
        return Err(format!(
            "the prompt on standard input is larger than {} MiB; shorten it",
            MAX_STDIN_PROMPT >> 20
        ));
    }
    let text = String::from_utf8(buf).map_err(|e| {
        format!(
            "the prompt on standard input is not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })?;
    if text.trim().is_empty() {
        return Err(
            "the prompt on standard input is empty: pipe it in, e.g. `echo \"What is here?\" | tether run -`"
                .into(),
        );
    }
    Ok(text)
}

fn fail(msg: impl std::fmt::Display) -> ExitCode {
    // Messages carry what servers and models said: printed inert.
    eprintln!("tether: {}", inert(&msg.to_string(), Inert::Prose));
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

/// Runs `tether run`.
pub async fn run(args: RunArgs) -> ExitCode {
    let loop_options = crate::providers::LoopOptions {
        model: args.model.clone(),
        system: args.system.clone(),
        no_stream: args.no_stream,
        cwd: args.cwd.clone(),
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
    let mut sandbox = Sandbox::new(args.sandbox).allow_network(args.allow_network);
    for w in &args.writable {
        sandbox = sandbox.writable(w.clone());
    }
    if let Some(w) = sandbox.warning() {
        eprintln!("tether: warning: {w}");
    }
    let workspace = workspace.sandbox(sandbox);
    // `tether run -`: the prompt is standard input, so approvals cannot be.
    let (prompt, answers) = if args.prompt == "-" {
        match tokio::task::spawn_blocking(|| read_prompt(std::io::stdin().lock())).await {
            Ok(Ok(p)) => (p, Answers::Tty),
            Ok(Err(m)) => return fail(m),
            Err(e) => return fail(format!("cannot read the prompt from standard input: {e}")),
        }
    } else {
        (args.prompt.clone(), Answers::Stdin)
    };
    let workspace = if args.yes {
        // MCP tools marked for approval are asked too: --yes answers them.
        workspace
            .policy(Policy::allow_all())
            .approver(tether::workspace::ApproveAll)
    } else {
        workspace.approver(TerminalApprover { answers })
    };
    let sampling = match &remote {
        Some(_) => None,
        None => sampling_model(&args, &base_url, &model_name),
    };
    let (handler, _servers) = match with_mcp(workspace, &args, &root, sampling).await {
        Ok(h) => h,
        Err(m) => return fail(m),
    };
    if let Some(p) = remote {
        return run_with(p, handler, &args, &prompt, &base_url, &model_name).await;
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
    run_with(provider, handler, &args, &prompt, &base_url, &model_name).await
}

/// The model that answers MCP servers' sampling requests (those allowed to sample): the run's
/// own endpoint and model.
fn sampling_model(args: &RunArgs, base_url: &str, model_name: &str) -> Option<tether_mcp::SamplingModel> {
    let mut b = tether_openai::OpenAiModel::builder(base_url).model(model_name.to_owned());
    if let Some(k) = args.api_key.clone().filter(|k| !k.is_empty()) {
        b = b.api_key(k);
    }
    let model = b.build().ok()?;
    Some(tether_mcp::SamplingModel::new(Arc::new(model), model_name))
}

/// The workspace with the MCP servers of `--mcp` and `--mcp-config` added (started now; one that
/// does not start, or a tool name two of them share without a prefix, is an error).
async fn with_mcp(
    workspace: Workspace,
    args: &RunArgs,
    root: &std::path::Path,
    sampling: Option<tether_mcp::SamplingModel>,
) -> Result<(Arc<dyn tether::Handler>, Vec<tether_mcp::McpServer>), String> {
    let mut entries = Vec::new();
    if let Some(f) = &args.mcp_config {
        entries.extend(tether_mcp::config::read_file(f).map_err(|e| e.to_string())?);
    }
    for m in &args.mcp {
        entries.push(tether_mcp::config::parse_flag(m).map_err(|e| e.to_string())?);
    }
    if entries.is_empty() {
        return Ok((Arc::new(workspace), Vec::new()));
    }
    let (sources, servers) = tether_mcp::config::connect_all(&entries, &[root.to_path_buf()], sampling)
        .await
        .map_err(|e| e.to_string())?;
    let handler =
        tether::source::WithTools::new(crate::elicit::TerminalPrompts(Arc::new(workspace)), sources)
            .map_err(|e| format!("MCP servers: {e}"))?;
    Ok((Arc::new(handler), servers))
}

async fn run_with(
    provider: Box<dyn Provider>,
    handler: Arc<dyn tether::Handler>,
    args: &RunArgs,
    prompt: &str,
    base_url: &str,
    model_name: &str,
) -> ExitCode {
    let timeout = Duration::from_secs(args.timeout.max(1));
    let session = tether_otel::observe_global(Session::builder_boxed(provider))
        .handler_arc(handler)
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
        let mut printer = Printer::new(json_mode);
        while let Some(e) = events.recv().await {
            printer.event(&e);
        }
        printer.at_line_start()
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
    let result = match session.send_cancellable(prompt.to_owned(), cancel).await {
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
        println!("{}", result_line(r));
    } else {
        if !at_line_start {
            println!();
        }
        eprintln!(
            "— {} turn(s), {} input + {} output tokens, stop: {}",
            r.turns,
            r.usage.input_tokens,
            r.usage.output_tokens,
            short(&r.stop_reason.to_string(), 200)
        );
    }
    match r.terminal {
        tether::Terminal::EndTurn => ExitCode::SUCCESS,
        _ => {
            if !json_mode {
                eprintln!(
                    "tether: the run ended early ({})",
                    short(&r.stop_reason.to_string(), 200)
                );
            }
            ExitCode::from(3)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_from_stdin_is_bounded_utf8_and_not_empty() {
        assert_eq!(read_prompt(&b"What is here?\n"[..]).unwrap(), "What is here?\n");
        assert!(read_prompt(&b" \n\t"[..]).unwrap_err().contains("empty"));
        assert!(read_prompt(&b"caf\xe9"[..]).unwrap_err().contains("not UTF-8"));
        let big = vec![b'a'; MAX_STDIN_PROMPT as usize + 1];
        assert!(read_prompt(&big[..]).unwrap_err().contains("larger than 1 MiB"));
        let max = vec![b'a'; MAX_STDIN_PROMPT as usize];
        assert_eq!(read_prompt(&max[..]).unwrap().len(), max.len());
    }

    #[test]
    fn an_answer_is_read_from_the_given_input() {
        let mut out = Vec::new();
        assert_eq!(ask(&mut out, &mut &b"y\n"[..], "? q "), Approval::Once);
        assert_eq!(ask(&mut out, &mut &b"always\n"[..], "? q "), Approval::Always);
        assert_eq!(ask(&mut out, &mut &b"yes please\n"[..], "? q "), Approval::Deny);
        assert_eq!(ask(&mut out, &mut &b""[..], "? q "), Approval::Deny);
        assert!(
            String::from_utf8(out)
                .unwrap()
                .ends_with("(no answer: refused)\n")
        );
    }
}
