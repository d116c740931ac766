//! The `tether.toml` configuration: server limits and the agents it serves.
//!
//! ```toml
//! [server]
//! max_body_bytes = 1048576     # 413 past this
//! body_timeout_secs = 30       # a request body not fully read by then gets 408
//! run_timeout_secs = 600       # a run past this ends in RUN_ERROR{code: "RUN_TIMEOUT"}
//! max_concurrent_runs = 256    # 429 past this
//! shutdown_grace_secs = 30     # running turns get this long to finish on shutdown
//! first_output_hold_ms = 20    # while runs wait for their first output, a streaming run waits
//!                              # up to this per model delta (0: no priority for new runs)
//! allowed_origins = ["http://localhost:5173"]   # other web origins that may call the API (CORS)
//! backend = "sqlite"           # where turns run: "sqlite" (in process, default) or "restate"
//!                              # (durable invocations; needs the `restate` cargo feature):
//! # restate_ingress = "http://127.0.0.1:8080"   # the Restate ingress turns are sent to
//! # restate_admin = "http://127.0.0.1:9070"     # the admin API the service registers with
//! # restate_listen = "127.0.0.1:9080"           # where the service endpoint Restate calls listens
//! # restate_advertise = "http://127.0.0.1:9080" # the endpoint's URI as Restate reaches it
//! # node_url = "http://10.0.0.5:7878"           # this server as the other tether nodes reach it
//!                                               # (they follow a turn running here live)
//! # restate_postgres = "host=10.0.0.7 user=tether dbname=tether"   # keep the threads' records
//! #                          # in this PostgreSQL (every node the same) instead of Restate's state
//! # restate_postgres_password_env = "TETHER_PG_PASSWORD"   # the variable holding its password
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
//! [agents.coder.sandbox]      # how run_command and the command tools are confined (Linux)
//! mode = "auto"                # auto: confined where the kernel can, else run with a warning;
//!                              # require: refused where it cannot; off: never confined
//! network = false              # true: commands may use the network
//! writable = []                # directories writable besides the workspace root and the cwd
//!
//! [[agents.coder.frontend_tools]]   # tools the browser runs (besides RunAgentInput.tools)
//! name = "confirm"
//! description = "Ask the user a yes/no question"
//!
//! [agents.coder.terminal_tool]      # the run ends when the model calls it
//! name = "final_answer"
//!
//! [[agents.coder.mcp]]         # an MCP server (started with the server, shared by the agent's runs)
//! name = "fs"                  # prefixes its tools when asked (fs__read_file)
//! command = "npx"              # stdio: command, args, env, cwd ...
//! args = ["-y", "@modelcontextprotocol/server-filesystem", "."]
//! # url = "https://mcp.example/mcp"                    # ... or streamable HTTP: url, headers
//! # headers = { Authorization = "Bearer ${MCP_TOKEN}" } # ${VAR}: from the environment
//! prefix = "on_collision"      # never (a name clash is an error) | always | on_collision
//! allow = ["read_*"]           # only these tools (`*` wildcards); deny = [...] never these
//! approval = ["write_file"]    # "always" | "never" | a list: asked in the browser (an interrupt)
//! timeout_secs = 60            # per call (the wait for the user's answer to an elicitation not counted)
//! elicitation_timeout_secs = 900   # how long an elicitation waits for the user (then: cancel)
//! sampling = false             # true: the server may sample the agent's model
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::providers::{LocalSpec, ManagedStart, ProviderSpec};
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
#[non_exhaustive]
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
#[non_exhaustive]
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
    /// First output first (default 20 ms; 0 turns it off): while any run is still waiting for
    /// its first output, a run already streaming waits up to this many milliseconds after each
    /// model delta before it reads its model again (see `tether::priority`). Under a burst of
    /// runs every run gets its first words sooner; the price is that all of them are in memory
    /// at once (a higher peak) and a stream may lag by this much per delta while runs arrive.
    /// At most 1000.
    #[serde(default = "default_first_output_hold")]
    pub first_output_hold_ms: u64,
    /// Longest the whole body of a run request may take to arrive, in seconds (default 30; 408
    /// past it). A client that trickles its body holds a connection, never a run slot: the slot is
    /// taken once the body is read.
    #[serde(default = "default_body_timeout")]
    pub body_timeout_secs: u64,
    /// Web origins other than the server's own whose pages may call the API from a browser
    /// (`scheme://host[:port]`, e.g. `http://localhost:5173`). They get CORS answers; every other
    /// cross-origin browser request is refused (403 `ORIGIN_NOT_ALLOWED`). Default: none.
    #[serde(default)]
    pub allowed_origins: Vec<String>,
    /// Where a thread's turns run (default [`Backend::Sqlite`]).
    #[serde(default)]
    pub backend: Backend,
    /// The Restate ingress URL turns are sent to (backend `restate`; default
    /// `http://127.0.0.1:8080`).
    #[serde(default)]
    pub restate_ingress: Option<String>,
    /// The Restate admin API URL the service registers itself with (backend `restate`; default
    /// `http://127.0.0.1:9070`).
    #[serde(default)]
    pub restate_admin: Option<String>,
    /// The address the service endpoint Restate calls listens on (backend `restate`; default
    /// `127.0.0.1:9080`; port 0 picks one).
    #[serde(default)]
    pub restate_listen: Option<String>,
    /// The endpoint's URI as Restate reaches it (backend `restate`; default `http://` + the
    /// address it listens on).
    #[serde(default)]
    pub restate_advertise: Option<String>,
    /// This server's own base URL as the other tether nodes of a cluster reach it (backend
    /// `restate`): a turn that runs on this node's service is announced under it, and a node
    /// whose client waits for that turn streams its live events (token deltas included) from
    /// `GET {node_url}/v1/threads/{id}/live`, with the server's token (the nodes share one).
    /// Default: `http://` + the address the server is bound to, unless that is a wildcard
    /// (`0.0.0.0`, `::`): then turns here are not announced and other nodes relay them from the
    /// record (whole messages).
    #[serde(default)]
    pub node_url: Option<String>,
    /// Keeps the threads' records in this PostgreSQL database (a libpq connection string, such
    /// as `host=127.0.0.1 user=tether dbname=tether`, or a `postgresql://` URL; backend
    /// `restate`) instead of Restate's object state: Restate then stores each turn's steps and a
    /// few small keys, and reads of records never queue on Restate. Every node serving the same
    /// agent must name the same database. Its password, if any, comes from the variable that
    /// `restate_postgres_password_env` names, never from this file. Default: none (the records
    /// are Restate's object state).
    #[serde(default)]
    pub restate_postgres: Option<String>,
    /// The environment variable holding the password of `restate_postgres` (none when unset).
    #[serde(default)]
    pub restate_postgres_password_env: Option<String>,
}

/// Where `tether serve` runs a thread's turns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Backend {
    /// In this process, over the SQLite database (the default; one machine).
    #[default]
    Sqlite,
    /// As durable invocations on Restate (the `TetherThread` virtual object of
    /// `tether-restate`): a crash never repeats a recorded model or tool call. Needs the
    /// `restate` cargo feature.
    Restate,
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
fn default_first_output_hold() -> u64 {
    20
}

/// The largest `first_output_hold_ms`: a stream never waits longer than this per delta.
pub const MAX_FIRST_OUTPUT_HOLD_MS: u64 = 1000;
fn default_body_timeout() -> u64 {
    30
}

/// The longest duration any setting may name, in seconds (a week). Durations past it are
/// refused with a config error instead of overflowing the arithmetic that uses them.
pub const MAX_DURATION_SECS: u64 = 7 * 24 * 3600;

/// The model name used when neither the agent's `model` nor `$TETHER_MODEL` names one: the same
/// as `tether run`'s (`default`, which local servers such as llama-server accept; OpenAI needs a
/// real name and says so with a 404).
pub const DEFAULT_MODEL: &str = "default";

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection {
            max_body_bytes: default_body(),
            run_timeout_secs: default_run_timeout(),
            max_concurrent_runs: default_concurrency(),
            shutdown_grace_secs: default_grace(),
            first_output_hold_ms: default_first_output_hold(),
            body_timeout_secs: default_body_timeout(),
            allowed_origins: Vec::new(),
            backend: Backend::default(),
            restate_ingress: None,
            restate_admin: None,
            restate_listen: None,
            restate_advertise: None,
            node_url: None,
            restate_postgres: None,
            restate_postgres_password_env: None,
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
#[non_exhaustive]
pub struct AgentConfig {
    /// Where the agent's loop lives: `openai` (the local loop over an OpenAI-compatible
    /// chat-completions endpoint, the default), `gguf` (a GGUF model run in-process), `anthropic` (the local loop over the Anthropic
    /// Messages API), `managed` (Claude Managed Agents), `agentcore` (Amazon Bedrock AgentCore)
    /// or `acp` (an ACP agent subprocess, `command`).
    #[serde(default = "default_provider")]
    pub provider: String,
    /// For `gguf`: the model file (relative to the config file; default: `$TETHER_GGUF`, else the
    /// default model, SmolLM2-135M-Instruct, fetched into the user's cache on first use).
    #[serde(default)]
    pub gguf: Option<PathBuf>,
    /// The endpoint's base URL: openai, with `/v1` (default: `$OPENAI_BASE_URL`); anthropic and
    /// managed, the API origin (default `https://api.anthropic.com`); agentcore, the data-plane
    /// origin (default: the region's).
    #[serde(default)]
    pub base_url: Option<String>,
    /// The environment variable holding the API key (default `OPENAI_API_KEY`; anthropic and
    /// managed: `ANTHROPIC_API_KEY`). The key itself never goes in the file.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// The model name (default: `$TETHER_MODEL`, else [`DEFAULT_MODEL`], as `tether run`;
    /// anthropic: `claude-sonnet-4-5`). Remote loops (managed, agentcore, acp) choose their own.
    #[serde(default)]
    pub model: Option<String>,
    /// managed: the Managed Agents agent id (a thread's first request starts a session of it).
    #[serde(default)]
    pub agent_id: Option<String>,
    /// managed: the environment id.
    #[serde(default)]
    pub environment_id: Option<String>,
    /// agentcore: the runtime ARN (InvokeAgentRuntime); or `harness_arn`.
    #[serde(default)]
    pub runtime_arn: Option<String>,
    /// agentcore: the harness ARN (InvokeHarness); or `runtime_arn`.
    #[serde(default)]
    pub harness_arn: Option<String>,
    /// agentcore: the endpoint name (qualifier; default DEFAULT).
    #[serde(default)]
    pub qualifier: Option<String>,
    /// agentcore: the AWS region (default: `AWS_REGION`, then `AWS_DEFAULT_REGION`, then
    /// us-east-1). Credentials are the standard AWS environment variables.
    #[serde(default)]
    pub region: Option<String>,
    /// acp: the agent command and its arguments (`["gemini", "--experimental-acp"]`), started in
    /// the agent's workspace root, whose files and terminals it is served under the workspace
    /// policy; its permission requests are approval interrupts in the browser.
    #[serde(default)]
    pub command: Vec<String>,
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
    /// How `run_command` and the command tools are confined.
    #[serde(default)]
    pub sandbox: SandboxConfig,
    /// Tools the browser runs.
    #[serde(default)]
    pub frontend_tools: Vec<ToolDecl>,
    /// The tool that ends the run.
    #[serde(default)]
    pub terminal_tool: Option<ToolDecl>,
    /// MCP servers whose tools the agent gets (`[[agents.NAME.mcp]]`).
    #[serde(default)]
    pub mcp: Vec<tether_mcp::config::Entry>,
    /// The agent's running MCP servers, started once at server start and shared by its runs.
    #[serde(skip)]
    pub(crate) mcp_running: McpRunning,
}

impl AgentConfig {
    /// The agent's provider, its options resolved (credentials read from the environment
    /// variables the configuration names). For `openai` and `gguf` this builds the model (a GGUF
    /// file is loaded here, once: agents naming the same file share it). Errors name what to set.
    pub fn provider_spec(&self, agent: &str) -> Result<ProviderSpec, String> {
        let some = |v: &Option<String>| v.clone().filter(|s| !s.trim().is_empty());
        let anthropic = || -> Result<tether_anthropic::ClientConfig, String> {
            let env = some(&self.api_key_env).unwrap_or_else(|| "ANTHROPIC_API_KEY".into());
            let key = std::env::var(&env)
                .ok()
                .filter(|k| !k.trim().is_empty())
                .ok_or_else(|| {
                    format!(
                        "agent `{agent}`: provider `{}` needs an Anthropic API key in the environment \
                         variable `{env}` (api_key_env)",
                        self.provider
                    )
                })?;
            let origin =
                some(&self.base_url).unwrap_or_else(|| tether_anthropic::http::DEFAULT_BASE_URL.into());
            Ok(tether_anthropic::ClientConfig::new(key).base_url(origin))
        };
        Ok(match self.provider.as_str() {
            "openai" | "gguf" => {
                let base_url = some(&self.base_url)
                    .or_else(|| std::env::var("OPENAI_BASE_URL").ok())
                    .filter(|s| !s.trim().is_empty())
                    .unwrap_or_else(|| "http://127.0.0.1:8080/v1".into());
                let key_env = some(&self.api_key_env).unwrap_or_else(|| "OPENAI_API_KEY".into());
                let api_key = std::env::var(&key_env).ok().filter(|s| !s.is_empty());
                // As `tether run`: the configured name, else $TETHER_MODEL, else `default`.
                let model_name = some(&self.model)
                    .or_else(|| std::env::var("TETHER_MODEL").ok())
                    .filter(|m| !m.trim().is_empty())
                    .unwrap_or_else(|| DEFAULT_MODEL.into());
                let model = crate::model::of(self, &base_url, api_key, &model_name)
                    .map_err(|e| format!("agent `{agent}`: {e}"))?;
                ProviderSpec::Local(LocalSpec::new(model, model_name, self.system_prompt.clone()))
            }
            "anthropic" => ProviderSpec::Anthropic {
                client: anthropic()?,
                model: some(&self.model).unwrap_or_else(|| crate::providers::DEFAULT_ANTHROPIC_MODEL.into()),
                system: some(&self.system_prompt),
                stream: self.stream,
            },
            "managed" => {
                let (Some(agent_id), Some(environment_id)) =
                    (some(&self.agent_id), some(&self.environment_id))
                else {
                    return Err(format!(
                        "agent `{agent}`: provider `managed` needs `agent_id` and `environment_id`"
                    ));
                };
                ProviderSpec::Managed {
                    client: anthropic()?,
                    start: ManagedStart::New {
                        agent_id,
                        environment_id,
                    },
                }
            }
            "agentcore" => {
                use tether_agentcore::{AgentCoreConfig, AwsCredentials, Target};
                let qualifier = some(&self.qualifier);
                let target = match (some(&self.harness_arn), some(&self.runtime_arn)) {
                    (Some(arn), None) => Target::Harness { arn, qualifier },
                    (None, Some(arn)) => Target::Runtime { arn, qualifier },
                    _ => {
                        return Err(format!(
                            "agent `{agent}`: provider `agentcore` needs one of `runtime_arn` and `harness_arn`"
                        ));
                    }
                };
                let creds = AwsCredentials::from_env().map_err(|e| format!("agent `{agent}`: {e}"))?;
                let region = tether_agentcore::sigv4::resolve_region(self.region.as_deref());
                let mut cfg = AgentCoreConfig::new(target, region, creds);
                cfg.endpoint = some(&self.base_url);
                ProviderSpec::AgentCore(Box::new(cfg))
            }
            "acp" => {
                let Some(w) = &self.workspace else {
                    return Err(format!("agent `{agent}`: provider `acp` needs a workspace"));
                };
                ProviderSpec::Acp {
                    command: self.command.clone(),
                    cwd: w.root.clone(),
                    session_id: None,
                    // The server's run_timeout bounds the run; the client does not cut a turn.
                    prompt_timeout: None,
                }
            }
            other => return Err(format!("agent `{agent}`: unknown provider `{other}`")),
        })
    }
}

/// The MCP servers an agent runs with, once started (shared by every clone of its config).
#[derive(Clone, Default)]
pub(crate) struct McpRunning(pub(crate) std::sync::Arc<std::sync::OnceLock<tether::source::ToolSources>>);

impl std::fmt::Debug for McpRunning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("McpRunning").field(&self.0.get()).finish()
    }
}

/// The providers `tether serve` hosts (`provider = "…"`).
pub const PROVIDERS: [&str; 6] = ["openai", "gguf", "anthropic", "managed", "agentcore", "acp"];

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
#[non_exhaustive]
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

/// `[agents.NAME.sandbox]`: how the agent's commands (`run_command`, the command tools) are
/// confined; see `tether::sandbox` for what is and is not confined.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct SandboxConfig {
    /// `auto` (default: confined where the kernel supports it, else run unconfined with a
    /// warning at start), `require` (refused where the kernel cannot confine them), `off`.
    #[serde(default)]
    pub mode: tether::sandbox::SandboxMode,
    /// Whether commands may use the network (default false).
    #[serde(default)]
    pub network: bool,
    /// Directories commands may write beneath besides the workspace root and their cwd
    /// (relative paths are from the config file's directory).
    #[serde(default)]
    pub writable: Vec<PathBuf>,
}

impl SandboxConfig {
    /// The sandbox it describes.
    pub fn sandbox(&self) -> tether::sandbox::Sandbox {
        let mut s = tether::sandbox::Sandbox::new(self.mode).allow_network(self.network);
        for w in &self.writable {
            s = s.writable(w.clone());
        }
        s
    }
}

/// `[[agents.NAME.commands]]`: a tool that runs `sh -c command`, confined by the agent's
/// [`SandboxConfig`] (writable beneath the workspace root and its `cwd`).
///
/// The command sees the call's arguments as JSON on stdin and in `$TETHER_ARGS`, each top-level
/// scalar argument as `$TETHER_ARG_<NAME>` (upper-cased), and the call's id as
/// `$TETHER_TOOL_USE_ID` (an idempotency key: tether never runs a recorded call again, but a
/// crash between the command's effect and the record can re-run it once).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
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
#[non_exhaustive]
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
            if !PROVIDERS.contains(&a.provider.as_str()) {
                return Err(invalid(format!(
                    "agent `{name}`: provider `{}` is not supported by `tether serve`; use one of {}",
                    a.provider,
                    PROVIDERS.join(", ")
                )));
            }
            if a.provider == "acp" {
                if a.command.first().is_none_or(|p| p.trim().is_empty()) {
                    return Err(invalid(format!(
                        "agent `{name}`: provider `acp` needs `command`, the agent's argv, e.g. \
                         command = [\"gemini\", \"--experimental-acp\"]"
                    )));
                }
                if a.workspace.is_none() {
                    return Err(invalid(format!(
                        "agent `{name}`: provider `acp` needs a `[agents.{name}.workspace]`: the agent runs \
                         in its root and its file and terminal requests are served under its policy"
                    )));
                }
            } else if !a.command.is_empty() {
                return Err(invalid(format!(
                    "agent `{name}`: `command` is only for provider `acp` (this agent's is `{}`)",
                    a.provider
                )));
            }
            if let Some(g) = &mut a.gguf
                && g.is_relative()
            {
                *g = base_dir.join(&*g);
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
            let mut servers = std::collections::HashSet::new();
            for m in a.mcp.iter_mut() {
                if !servers.insert(m.name.clone()) {
                    return Err(invalid(format!(
                        "agent `{name}`: two MCP servers are named `{}`",
                        m.name
                    )));
                }
                if let Some(d) = &m.cwd
                    && d.is_relative()
                {
                    m.cwd = Some(base_dir.join(d));
                }
                // Checked now (names, command or url, approval words), connected at start.
                m.transport()
                    .and_then(|_| m.source_options())
                    .map_err(|e| invalid(format!("agent `{name}`: {e}")))?;
            }
            for w in a.sandbox.writable.iter_mut() {
                if w.is_relative() {
                    *w = base_dir.join(&*w);
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
        cfg.check(origin)?;
        Ok(cfg)
    }

    /// What to tell the user at start about agents whose commands will not be confined as
    /// configured (one line each; empty when every agent's are, or cannot run any).
    pub fn sandbox_warnings(&self) -> Vec<String> {
        self.agents
            .iter()
            .filter(|(_, a)| {
                !a.commands.is_empty()
                    || a.workspace
                        .as_ref()
                        .is_some_and(|w| w.commands != AccessConfig::Deny)
            })
            .filter_map(|(name, a)| {
                a.sandbox
                    .sandbox()
                    .warning()
                    .map(|w| format!("agent `{name}`: {w}"))
            })
            .collect()
    }

    /// Checks the limits and origins (done by [`Config::parse`]; again by the server after
    /// command-line overrides, and for a `Config` built in code): every count positive, every
    /// duration within [`MAX_DURATION_SECS`], every allowed origin a plain `scheme://host[:port]`.
    /// Origins are stored lower-cased (as browsers send them).
    pub fn check(&mut self, origin: &str) -> Result<(), ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: origin.into(),
            message,
        };
        let s = &self.server;
        if s.max_concurrent_runs == 0 || s.max_body_bytes == 0 {
            return Err(invalid(
                "[server] max_body_bytes and max_concurrent_runs must be at least 1".into(),
            ));
        }
        if s.first_output_hold_ms > MAX_FIRST_OUTPUT_HOLD_MS {
            return Err(invalid(format!(
                "[server] first_output_hold_ms is {}; it must be between 0 (off) and {MAX_FIRST_OUTPUT_HOLD_MS} milliseconds",
                s.first_output_hold_ms
            )));
        }
        let durations = [
            ("[server] run_timeout_secs", s.run_timeout_secs, 1),
            ("[server] body_timeout_secs", s.body_timeout_secs, 1),
            ("[server] shutdown_grace_secs", s.shutdown_grace_secs, 0),
        ];
        for (what, v, min) in durations {
            check_duration(what, v, min).map_err(invalid)?;
        }
        for (name, a) in &self.agents {
            check_duration(
                &format!("[agents.{name}] tool_timeout_secs"),
                a.tool_timeout_secs,
                1,
            )
            .map_err(invalid)?;
            if a.max_turns == 0 {
                return Err(invalid(format!("agent `{name}`: max_turns must be at least 1")));
            }
        }
        for o in self.server.allowed_origins.iter_mut() {
            *o = parse_origin(o).map_err(|m| invalid(format!("[server] allowed_origins: {m}")))?;
        }
        Ok(())
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
                agent_id: None,
                environment_id: None,
                runtime_arn: None,
                harness_arn: None,
                qualifier: None,
                region: None,
                command: Vec::new(),
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
                sandbox: SandboxConfig::default(),
                frontend_tools: Vec::new(),
                terminal_tool: None,
                mcp: Vec::new(),
                mcp_running: McpRunning::default(),
            },
        );
        Config {
            server: ServerSection::default(),
            agents,
        }
    }
}

fn check_duration(what: &str, v: u64, min: u64) -> Result<(), String> {
    if v < min || v > MAX_DURATION_SECS {
        return Err(format!(
            "{what} = {v}: must be between {min} and {MAX_DURATION_SECS} seconds (a week)"
        ));
    }
    Ok(())
}

/// A web origin as browsers send it in `Origin`: `http` or `https`, a host, an optional port, no
/// path, query, user or fragment; lower-cased. `null` and `*` are refused: every sandboxed page
/// and file sends `null`, and `*` would let every site in.
fn parse_origin(o: &str) -> Result<String, String> {
    let lower = o.trim().to_ascii_lowercase();
    let bad = |why: &str| {
        Err(format!(
            "`{o}` is not an origin ({why}); write scheme://host[:port], e.g. http://localhost:5173"
        ))
    };
    if lower == "null" || lower == "*" {
        return bad("`null` and `*` would let any page in");
    }
    let Some(rest) = lower
        .strip_prefix("http://")
        .or_else(|| lower.strip_prefix("https://"))
    else {
        return bad("it must start with http:// or https://");
    };
    if rest.is_empty() {
        return bad("no host");
    }
    if rest.contains(['/', '?', '#', '@', ' ', '\\']) {
        return bad("no path, query, fragment or user part, and no trailing slash");
    }
    let host = match rest.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((addr, port)) if addr.parse::<std::net::Ipv6Addr>().is_ok() => {
                if !(port.is_empty() || valid_port(port.strip_prefix(':'))) {
                    return bad("bad port");
                }
                return Ok(lower);
            }
            _ => return bad("bad IPv6 address"),
        },
        None => match rest.rsplit_once(':') {
            Some((h, p)) => {
                if !valid_port(Some(p)) {
                    return bad("bad port");
                }
                h
            }
            None => rest,
        },
    };
    if host.is_empty()
        || !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
    {
        return bad("bad host");
    }
    Ok(lower)
}

fn valid_port(p: Option<&str>) -> bool {
    p.is_some_and(|p| !p.is_empty() && p.len() <= 5 && p.parse::<u16>().is_ok_and(|n| n > 0))
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
[agents.coder.sandbox]
mode = "require"
network = true
writable = ["cache"]
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
        assert_eq!(a.sandbox.mode, tether::sandbox::SandboxMode::Require);
        assert!(a.sandbox.network);
        assert_eq!(a.sandbox.writable, [Path::new("/base/cache")]);
        let d = Config::parse("[agents.a]", "t.toml", Path::new("/base")).unwrap();
        assert_eq!(d.agents["a"].sandbox.mode, tether::sandbox::SandboxMode::Auto);
        assert!(
            !d.agents["a"].sandbox.network,
            "no network unless the config allows it"
        );
    }

    /// The README's quick start for `tether serve` shows one file serving an OpenAI-compatible
    /// agent, an Anthropic agent and Gemini CLI side by side: it must be a valid config.
    #[test]
    fn the_readme_multi_provider_config_is_valid() {
        let readme = include_str!("../../../README.md");
        let start = readme
            .find("One `tether.toml` serves agents of every kind")
            .expect("the README shows a multi-provider tether.toml");
        let rest = &readme[start..];
        let body = rest
            .split("```toml\n")
            .nth(1)
            .and_then(|b| b.split("```").next())
            .expect("a toml block");
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config::parse(body, "README.md", dir.path()).expect("the README's config parses");
        let kinds: Vec<&str> = cfg.agents.values().map(|a| a.provider.as_str()).collect();
        assert_eq!(kinds, ["anthropic", "acp", "openai"]);
        assert_eq!(cfg.agents["gemini"].command, ["gemini", "--experimental-acp"]);
    }

    #[test]
    fn provider_options_are_checked() {
        let base = Path::new(".");
        let e = Config::parse(
            "[agents.a]\nprovider = \"acp\"\n[agents.a.workspace]\nroot = \".\"",
            "t.toml",
            base,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("needs `command`"), "{e}");
        let e = Config::parse(
            "[agents.a]\nprovider = \"acp\"\ncommand = [\"x\"]",
            "t.toml",
            base,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("needs a `[agents.a.workspace]`"), "{e}");
        let e = Config::parse("[agents.a]\ncommand = [\"x\"]", "t.toml", base)
            .unwrap_err()
            .to_string();
        assert!(e.contains("only for provider `acp`"), "{e}");
        // A key named by the config but not set is a start-up error naming the variable.
        let c = Config::parse(
            "[agents.a]\nprovider = \"anthropic\"\napi_key_env = \"TETHER_TEST_UNSET_KEY_VAR\"",
            "t.toml",
            base,
        )
        .unwrap();
        let e = c.agents["a"].provider_spec("a").unwrap_err();
        assert!(e.contains("TETHER_TEST_UNSET_KEY_VAR"), "{e}");
        let c = Config::parse("[agents.a]\nprovider = \"managed\"", "t.toml", base).unwrap();
        let e = c.agents["a"].provider_spec("a").unwrap_err();
        assert!(e.contains("agent_id"), "{e}");
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
        let e = Config::parse("[agents.a.sandbox]\nmode = \"strict\"", "t.toml", base)
            .unwrap_err()
            .to_string();
        assert!(e.contains("strict") && e.contains("auto"), "{e}");
    }

    #[test]
    fn the_first_output_hold_is_bounded_and_can_be_off() {
        let base = Path::new(".");
        let c = Config::parse("[agents.a]\n", "t.toml", base).unwrap();
        assert_eq!(c.server.first_output_hold_ms, 20);
        let c = Config::parse("[server]\nfirst_output_hold_ms = 0\n[agents.a]\n", "t.toml", base).unwrap();
        assert_eq!(c.server.first_output_hold_ms, 0);
        let e = Config::parse(
            "[server]\nfirst_output_hold_ms = 1001\n[agents.a]\n",
            "t.toml",
            base,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("first_output_hold_ms") && e.contains("1000"), "{e}");
    }

    /// Issue 17: every duration from the config is bounded with a clear error; none overflows
    /// (a huge `tool_timeout_secs` made `tool_timeout_secs + 5` overflow).
    #[test]
    fn durations_are_bounded_with_a_clear_error() {
        let base = Path::new(".");
        for (field, table) in [
            ("run_timeout_secs", "[server]"),
            ("body_timeout_secs", "[server]"),
            ("shutdown_grace_secs", "[server]"),
            ("tool_timeout_secs", "[agents.a]"),
        ] {
            let text = if table == "[server]" {
                format!("[server]\n{field} = {}\n[agents.a]\n", u64::MAX >> 1)
            } else {
                format!("[agents.a]\n{field} = {}\n", u64::MAX >> 1)
            };
            let e = Config::parse(&text, "t.toml", base).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains("between"), "{e}");
        }
        let e = Config::parse("[server]\nrun_timeout_secs = 0\n[agents.a]\n", "t.toml", base)
            .unwrap_err()
            .to_string();
        assert!(e.contains("run_timeout_secs = 0"), "{e}");
        let ok = Config::parse(
            "[server]\nshutdown_grace_secs = 0\n[agents.a]\ntool_timeout_secs = 604800\n",
            "t.toml",
            base,
        )
        .unwrap();
        assert_eq!(ok.agents["a"].tool_timeout_secs, MAX_DURATION_SECS);
        // A config built in code is checked too.
        let mut c = Config::default_for(Path::new("/tmp"));
        c.agents.get_mut("default").unwrap().tool_timeout_secs = u64::MAX;
        assert!(c.check("code").is_err());
    }

    #[test]
    fn allowed_origins_are_plain_origins() {
        let base = Path::new(".");
        let c = Config::parse(
            "[server]\nallowed_origins = [\"HTTP://LocalHost:5173\", \"https://app.example\", \"http://[::1]:8080\"]\n[agents.a]\n",
            "t.toml",
            base,
        )
        .unwrap();
        assert_eq!(
            c.server.allowed_origins,
            [
                "http://localhost:5173",
                "https://app.example",
                "http://[::1]:8080"
            ]
        );
        for bad in [
            "null",
            "*",
            "localhost:5173",
            "http://localhost:5173/",
            "http://a/b",
            "http://user@host",
            "http://host:0",
            "http://host:99999",
            "ftp://host",
            "http://",
            "http://[zz]:1",
        ] {
            let text = format!("[server]\nallowed_origins = [\"{bad}\"]\n[agents.a]\n");
            let e = Config::parse(&text, "t.toml", base).unwrap_err().to_string();
            assert!(e.contains("allowed_origins"), "{bad}: {e}");
        }
    }

    proptest::proptest! {
        /// Whatever numbers a config holds, parsing never panics, and what it accepts is within
        /// the bounds (so every `Duration` and sum built from it is safe).
        #[test]
        fn any_durations_parse_or_are_refused_without_panicking(
            run in proptest::num::u64::ANY,
            body in proptest::num::u64::ANY,
            grace in proptest::num::u64::ANY,
            tool in proptest::num::u64::ANY,
        ) {
            // TOML integers are i64: larger values are a parse error, also fine.
            let text = format!(
                "[server]\nrun_timeout_secs = {run}\nbody_timeout_secs = {body}\nshutdown_grace_secs = {grace}\n[agents.a]\ntool_timeout_secs = {tool}\n"
            );
            if let Ok(c) = Config::parse(&text, "t.toml", Path::new(".")) {
                proptest::prop_assert!(c.server.run_timeout_secs <= MAX_DURATION_SECS);
                proptest::prop_assert!(c.server.body_timeout_secs <= MAX_DURATION_SECS);
                proptest::prop_assert!(c.server.shutdown_grace_secs <= MAX_DURATION_SECS);
                proptest::prop_assert!(c.agents["a"].tool_timeout_secs <= MAX_DURATION_SECS);
            }
        }

        /// Any string as an allowed origin: accepted only as a plain origin, never a panic.
        #[test]
        fn any_origin_string_is_checked_without_panicking(o in "\\PC{0,40}") {
            if let Ok(n) = parse_origin(&o) {
                proptest::prop_assert!(n.starts_with("http://") || n.starts_with("https://"));
                proptest::prop_assert!(!n[7..].contains('/'));
            }
        }
    }
}
