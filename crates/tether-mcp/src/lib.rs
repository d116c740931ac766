//! # tether-mcp
//!
//! MCP servers as a tether tool source, on the official Rust SDK (`rmcp`, client side only).
//!
//! - [`McpServer`]: one server, over a child's stdio or streamable HTTP. It initializes, lists
//!   every page of tools (cached; refreshed on `notifications/tools/list_changed`), and serves
//!   calls as a [`tether::source::ToolSource`]: add it to any handler with
//!   [`tether::source::WithTools`] (prefixes, filters, approval).
//! - The server's own requests are served locally: elicitation through the session's
//!   [`tether::Handler::elicit`], sampling refused unless [`ServerConfig::sampling`] gives a model,
//!   roots are [`ServerConfig::roots`], progress and log notifications become session events
//!   (`mcp.progress`, `mcp.log`, live).
//! - A dropped call future (the turn was cancelled) sends `notifications/cancelled`; each call
//!   has a timeout ([`ServerConfig::call_timeout`]); a server that exits or stops answering turns
//!   its calls into tool errors and is restarted with backoff; one that never starts is
//!   [`McpError::Start`], naming the command and its stderr.
//! - [`config`]: the `mcpServers` JSON of Claude Desktop / Claude Code / Cursor, `--mcp
//!   NAME=COMMAND`, and the serde shape `tether.toml` reuses.
//!
//! This crate never depends on a front-end (CLI, server, AG-UI).
//!
//! The `mcpServers` JSON of Claude Desktop or Cursor reads as-is:
//!
//! ```
//! let entries = tether_mcp::config::parse_json(r#"{"mcpServers": {
//!     "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "."]},
//!     "docs": {"url": "https://example.com/mcp"}
//! }}"#)?;
//! let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
//! assert_eq!(names, ["docs", "files"]);
//! # Ok::<(), tether_mcp::McpError>(())
//! ```

#![deny(missing_docs)]
// Sampling, roots and logging are deprecated by the 2026-07-28 revision (SEP-2577) that rmcp
// marks; tether speaks 2025-11-25, where they are current, and serves them.
#![allow(deprecated)]

pub mod config;
mod result;
mod stdio;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CancelledNotification, CancelledNotificationParam,
    ClientCapabilities, ClientConfig, ClientNotification, ClientRequest, CreateMessageRequestParams,
    CreateMessageResult, ElicitRequestParams, ElicitResult, ErrorCode, ErrorData, Implementation,
    ListRootsResult, LoggingMessageNotificationParam, ProgressNotificationParam, ProgressToken,
    ProtocolVersion, RequestId, ServerResult,
};
use rmcp::service::RunningServiceCancellationToken;
use rmcp::service::{
    NotificationContext, Peer, PeerRequestOptions, RequestContext, RoleClient, ServiceError,
};
use rmcp::{ClientHandler, ServiceExt};
use serde_json::{Value, json};
use tether::chat::{ChatMessage, ChatModel, ChatRequest};
use tether::sink::DeltaSink;
use tether::source::{CallContext, ToolSource};
use tether::{
    ElicitationMode, ElicitationRequest, ElicitationResponse, Event, EventKind, ToolOutput, ToolSpec, ToolUse,
};
use tokio::io::AsyncBufReadExt;
use tokio::sync::watch;
use tokio::time::Instant;

pub use result::to_output;

/// How tether reaches a server.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transport {
    /// A child process speaking JSON-RPC lines on its stdin and stdout.
    Stdio {
        /// The program.
        command: String,
        /// Its arguments.
        args: Vec<String>,
        /// Variables set for it, beside the few it inherits (`PATH`, `HOME`, `USER`, `LOGNAME`,
        /// `SHELL`, `TERM`, `LANG`, `TMPDIR`): tether's own environment (API keys) is not passed.
        env: Vec<(String, String)>,
        /// Its working directory (default: tether's).
        cwd: Option<PathBuf>,
    },
    /// Streamable HTTP.
    Http {
        /// The endpoint (`http://127.0.0.1:3001/mcp`).
        url: String,
        /// Headers sent with every request (`Authorization: Bearer …`).
        headers: Vec<(String, String)>,
    },
}

impl Transport {
    /// The command line or URL, for messages.
    pub fn describe(&self) -> String {
        match self {
            Transport::Stdio { command, args, .. } => {
                let mut s = command.clone();
                for a in args {
                    s.push(' ');
                    s.push_str(a);
                }
                s
            }
            Transport::Http { url, .. } => url.clone(),
        }
    }
}

/// What answers a server's sampling requests: the session's model.
#[derive(Clone)]
#[non_exhaustive]
pub struct SamplingModel {
    /// The model.
    pub model: Arc<dyn ChatModel>,
    /// The model name sent in its requests.
    pub model_name: String,
}

impl SamplingModel {
    /// Sampling requests answered by `model`, asked for `model_name`.
    pub fn new(model: Arc<dyn ChatModel>, model_name: impl Into<String>) -> Self {
        SamplingModel {
            model,
            model_name: model_name.into(),
        }
    }
}

impl std::fmt::Debug for SamplingModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SamplingModel")
            .field("model_name", &self.model_name)
            .finish()
    }
}

/// One server's configuration.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ServerConfig {
    /// The server's name (in messages, prefixes and events).
    pub name: String,
    /// How to reach it.
    pub transport: Transport,
    /// How long one tool call may take before it is cancelled and answered with an error.
    pub call_timeout: Duration,
    /// How long starting and initializing may take.
    pub startup_timeout: Duration,
    /// The roots the server is given (`roots/list`): the workspace root.
    pub roots: Vec<PathBuf>,
    /// Who answers the server's sampling requests; `None` refuses them.
    pub sampling: Option<SamplingModel>,
    /// How long the server's elicitation may wait for the user's answer (then it is answered
    /// `cancel`). The wait does not count against [`ServerConfig::call_timeout`] nor the
    /// session's tool timeout: it is the user's time, not the call's.
    pub elicitation_timeout: Duration,
}

/// The default [`ServerConfig::elicitation_timeout`]: 15 minutes (as long as an ACP agent's
/// request may wait for the client), for a person who answers in a browser later.
pub const DEFAULT_ELICITATION_TIMEOUT: Duration = Duration::from_secs(15 * 60);

impl ServerConfig {
    /// A server named `name` reached by `transport`: 60 s per call, 30 s to start, no roots, no
    /// sampling.
    pub fn new(name: impl Into<String>, transport: Transport) -> Self {
        ServerConfig {
            name: name.into(),
            transport,
            call_timeout: Duration::from_secs(60),
            startup_timeout: Duration::from_secs(30),
            roots: Vec::new(),
            sampling: None,
            elicitation_timeout: DEFAULT_ELICITATION_TIMEOUT,
        }
    }

    /// Sets how long an elicitation may wait for the user.
    pub fn elicitation_timeout(mut self, d: Duration) -> Self {
        self.elicitation_timeout = d;
        self
    }

    /// Sets the per-call timeout.
    pub fn call_timeout(mut self, d: Duration) -> Self {
        self.call_timeout = d;
        self
    }

    /// Sets the roots.
    pub fn roots(mut self, roots: Vec<PathBuf>) -> Self {
        self.roots = roots;
        self
    }

    /// Lets the server sample the given model.
    pub fn sampling(mut self, s: SamplingModel) -> Self {
        self.sampling = Some(s);
        self
    }
}

/// Why a server could not be used.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum McpError {
    /// The server did not start or did not complete the MCP handshake.
    #[error("MCP server `{name}` (`{command}`) did not start: {message}{}", stderr_note(.stderr))]
    Start {
        /// The server's name.
        name: String,
        /// The command line or URL.
        command: String,
        /// What failed.
        message: String,
        /// The end of what it wrote on stderr.
        stderr: String,
    },
    /// A configuration entry is wrong.
    #[error("MCP configuration: {0}")]
    Config(String),
}

fn stderr_note(s: &str) -> String {
    if s.trim().is_empty() {
        String::new()
    } else {
        format!("; its stderr ends with:\n{}", s.trim_end())
    }
}

/// The last bytes a child wrote on stderr.
#[derive(Default)]
struct Tail {
    text: String,
}

const TAIL_CAP: usize = 8 * 1024;

impl Tail {
    fn push(&mut self, line: &str) {
        self.text.push_str(line);
        self.text.push('\n');
        if self.text.len() > TAIL_CAP {
            let mut cut = self.text.len() - TAIL_CAP;
            while !self.text.is_char_boundary(cut) {
                cut += 1;
            }
            self.text.drain(..cut);
        }
    }
}

/// One live connection.
struct Conn {
    peer: Peer<RoleClient>,
    stop: Mutex<Option<RunningServiceCancellationToken>>,
    generation: u64,
    /// Becomes true when a stdio child's stderr has ended (it exited): what it wrote last, often
    /// the reason it failed, is then all in the tail. `None` for HTTP servers.
    stderr_done: Option<watch::Receiver<bool>>,
}

/// Waits (bounded) for a child's stderr to end, so that a failure's message carries what the
/// child wrote before exiting; its reader task may still be draining the pipe when the
/// connection's end is seen.
async fn stderr_drained(done: Option<watch::Receiver<bool>>) {
    if let Some(mut d) = done {
        let _ = tokio::time::timeout(Duration::from_secs(2), d.wait_for(|ended| *ended)).await;
    }
}

impl Conn {
    /// Ends the connection (a stdio server's child is killed).
    fn halt(&self) {
        if let Some(t) = lock(&self.stop).take() {
            t.cancel();
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.halt();
    }
}

/// A call in flight, for routing the server's requests and notifications to its session.
struct InFlight {
    cx: CallContext,
    tool_use_id: String,
    progress: Option<ProgressToken>,
    generation: u64,
    /// The pauses of this call's `call_timeout` in force (its elicitation waits for the user).
    paused: usize,
    /// When the pause in force began.
    paused_since: Option<Instant>,
    /// The time spent paused before it.
    paused_total: Duration,
}

impl InFlight {
    /// The time the call's clock ran since `started` (pauses left out).
    fn running(&self, started: Instant, now: Instant) -> Duration {
        let paused = self.paused_total
            + self
                .paused_since
                .map(|t| now.saturating_duration_since(t))
                .unwrap_or_default();
        now.saturating_duration_since(started).saturating_sub(paused)
    }
}

/// A pause of one call's `call_timeout` (see [`Client::create_elicitation`]): the clock runs
/// again when the last pause of the call is dropped.
struct CallPause {
    inner: Weak<Inner>,
    key: u64,
}

impl CallPause {
    fn new(inner: &Arc<Inner>, key: u64) -> CallPause {
        if let Some(c) = lock(&inner.calls).get_mut(&key) {
            if c.paused == 0 {
                c.paused_since = Some(Instant::now());
            }
            c.paused += 1;
        }
        CallPause {
            inner: Arc::downgrade(inner),
            key,
        }
    }
}

impl Drop for CallPause {
    fn drop(&mut self) {
        let Some(inner) = self.inner.upgrade() else { return };
        if let Some(c) = lock(&inner.calls).get_mut(&self.key) {
            c.paused = c.paused.saturating_sub(1);
            if c.paused == 0
                && let Some(t) = c.paused_since.take()
            {
                c.paused_total += Instant::now().saturating_duration_since(t);
            }
        }
    }
}

#[derive(Default)]
struct Health {
    /// Consecutive failed starts (the backoff's exponent).
    failures: u32,
    /// Why it is down, when it is.
    down: Option<String>,
    restarting: bool,
    /// Stopped on purpose: not restarted.
    stopped: bool,
}

struct Inner {
    cfg: ServerConfig,
    conn: Mutex<Option<Arc<Conn>>>,
    tools: Mutex<Vec<ToolSpec>>,
    tools_tx: watch::Sender<u64>,
    /// Tool-list refreshes asked for by `list_changed` and not done yet.
    refreshing: watch::Sender<u32>,
    calls: Mutex<HashMap<u64, InFlight>>,
    next_call: AtomicU64,
    generation: AtomicU64,
    health: Mutex<Health>,
    stderr: Arc<Mutex<Tail>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// An MCP server used as a tool source. Cloning shares the connection.
#[derive(Clone)]
pub struct McpServer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer")
            .field("name", &self.inner.cfg.name)
            .field("transport", &self.inner.cfg.transport.describe())
            .finish()
    }
}

/// The first and the largest delay before a restart.
const BACKOFF_FIRST: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// How long a server that timed out a call gets to answer a ping before it is restarted as hung.
const PING_GRACE: Duration = Duration::from_secs(5);

fn backoff(failures: u32) -> Duration {
    let f = failures.min(10);
    BACKOFF_FIRST.saturating_mul(1u32 << f).min(BACKOFF_MAX)
}

impl McpServer {
    /// Starts the server, completes the handshake and lists its tools. A server that does not
    /// start is [`McpError::Start`] with the command and the end of its stderr.
    pub async fn connect(cfg: ServerConfig) -> Result<McpServer, McpError> {
        install_crypto();
        let (tools_tx, _) = watch::channel(0u64);
        let inner = Arc::new(Inner {
            cfg,
            conn: Mutex::new(None),
            tools: Mutex::new(Vec::new()),
            tools_tx,
            refreshing: watch::channel(0u32).0,
            calls: Mutex::new(HashMap::new()),
            next_call: AtomicU64::new(1),
            generation: AtomicU64::new(0),
            health: Mutex::new(Health::default()),
            stderr: Arc::new(Mutex::new(Tail::default())),
        });
        start(&inner).await?;
        Ok(McpServer { inner })
    }

    /// The server's name.
    pub fn name(&self) -> &str {
        &self.inner.cfg.name
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &ServerConfig {
        &self.inner.cfg
    }

    /// A receiver that changes each time the tool list is replaced (a `list_changed` refresh)
    /// and each time the connection is (re)established.
    pub fn tools_changed(&self) -> watch::Receiver<u64> {
        self.inner.tools_tx.subscribe()
    }

    /// Lists the tools again now.
    pub async fn refresh_tools(&self) -> Result<(), String> {
        let conn = lock(&self.inner.conn)
            .clone()
            .ok_or("the server is not running")?;
        refresh(&self.inner, &conn.peer).await
    }

    /// Whether the server is connected now (false while it is being restarted).
    pub fn is_running(&self) -> bool {
        lock(&self.inner.conn).is_some()
    }

    /// How many times the connection was (re)established.
    pub fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::SeqCst)
    }

    /// The end of what the server wrote on stderr (stdio servers).
    pub fn stderr_tail(&self) -> String {
        lock(&self.inner.stderr).text.clone()
    }

    /// Stops the server (its child is killed) until the next restart; for tests and shutdown.
    pub fn stop(&self) {
        lock(&self.inner.health).stopped = true;
        let conn = lock(&self.inner.conn).take();
        if let Some(c) = conn {
            c.halt();
        }
    }
}

/// ring as rustls' process default, for the HTTP transport (its reqwest has no provider of its
/// own); a provider installed before is kept.
fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Starts a connection and lists the tools; on success it is the current one.
async fn start(inner: &Arc<Inner>) -> Result<(), McpError> {
    let cfg = &inner.cfg;
    let generation = inner.generation.fetch_add(1, Ordering::SeqCst) + 1;
    let client = Client {
        inner: Arc::downgrade(inner),
        generation,
    };
    let fail = |message: String, stderr: String| McpError::Start {
        name: cfg.name.clone(),
        command: cfg.transport.describe(),
        message,
        stderr,
    };
    let (service, stderr_done) = match &cfg.transport {
        Transport::Stdio {
            command,
            args,
            env,
            cwd,
        } => {
            let mut cmd = tokio::process::Command::new(command);
            cmd.args(args).env_clear();
            for k in [
                "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "LANG", "TMPDIR",
            ] {
                if let Some(v) = std::env::var_os(k) {
                    cmd.env(k, v);
                }
            }
            cmd.envs(env.iter().map(|(k, v)| (k, v)));
            if let Some(d) = cwd {
                cmd.current_dir(d);
            }
            let (transport, stderr) = stdio::ChildStdio::spawn(cmd)
                .map_err(|e| fail(format!("cannot run `{command}`: {e}"), String::new()))?;
            let (done_tx, done_rx) = watch::channel(false);
            if let Some(stderr) = stderr {
                let tail = inner.stderr.clone();
                let name = cfg.name.clone();
                tokio::spawn(async move {
                    let mut lines = tokio::io::BufReader::new(stderr).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        tracing::debug!(server = %name, "stderr: {line}");
                        lock(&tail).push(&line);
                    }
                    done_tx.send_replace(true);
                });
            }
            let transport = Observed {
                inner: transport,
                refreshing: inner.refreshing.clone(),
            };
            let served = tokio::time::timeout(cfg.startup_timeout, client.serve(transport)).await;
            (served, Some(done_rx))
        }
        Transport::Http { url, headers } => {
            let mut map = HashMap::new();
            let mut auth = None;
            for (k, v) in headers {
                if k.eq_ignore_ascii_case("authorization") {
                    auth = Some(v.strip_prefix("Bearer ").unwrap_or(v).to_owned());
                    continue;
                }
                let name = http::HeaderName::from_bytes(k.as_bytes())
                    .map_err(|e| fail(format!("header name `{k}`: {e}"), String::new()))?;
                let value = http::HeaderValue::from_str(v).map_err(|e| {
                    fail(
                        format!("header `{k}` has a value that cannot be sent: {e}"),
                        String::new(),
                    )
                })?;
                map.insert(name, value);
            }
            let mut config =
                rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(
                    url.as_str(),
                )
                .custom_headers(map);
            if let Some(a) = auth {
                config = config.auth_header(a);
            }
            let transport = Observed {
                inner: rmcp::transport::StreamableHttpClientTransport::from_config(config),
                refreshing: inner.refreshing.clone(),
            };
            let served = tokio::time::timeout(cfg.startup_timeout, client.serve(transport)).await;
            (served, None)
        }
    };
    let stderr_now = |done: Option<watch::Receiver<bool>>| async move {
        // A child that failed usually exited: wait (bounded) for its stderr to end.
        stderr_drained(done).await;
        lock(&inner.stderr).text.clone()
    };
    let service = match service {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return Err(fail(
                format!("the MCP handshake failed: {e}"),
                stderr_now(stderr_done).await,
            ));
        }
        Err(_) => {
            return Err(fail(
                format!("no MCP handshake within {:?}", cfg.startup_timeout),
                stderr_now(stderr_done).await,
            ));
        }
    };
    let peer = service.peer().clone();
    if let Err(e) = refresh(inner, &peer).await {
        let _ = service.cancel().await;
        return Err(fail(
            format!("listing its tools failed: {e}"),
            stderr_now(stderr_done).await,
        ));
    }
    let conn = Arc::new(Conn {
        peer,
        stop: Mutex::new(Some(service.cancellation_token())),
        generation,
        stderr_done: stderr_done.clone(),
    });
    *lock(&inner.conn) = Some(conn);
    {
        let mut h = lock(&inner.health);
        h.down = None;
        h.failures = 0;
    }
    // Up: whoever waits on `tools_changed` sees it running.
    inner.tools_tx.send_modify(|n| *n += 1);
    // The supervisor: when the connection ends (the child exited, the stream broke, a hang was
    // detected), the server is marked down and restarted with backoff.
    let weak = Arc::downgrade(inner);
    tokio::spawn(async move {
        let reason = service.waiting().await;
        stderr_drained(stderr_done).await;
        let Some(inner) = weak.upgrade() else { return };
        on_down(&inner, generation, format!("the connection ended ({reason:?})"));
    });
    Ok(())
}

/// A transport that counts `notifications/tools/list_changed` as they are read, in order with
/// the responses: a call whose response follows such a notification then waits for the refresh
/// (`settle`), whereas rmcp runs notification handlers as tasks that may start after it.
struct Observed<T> {
    inner: T,
    refreshing: watch::Sender<u32>,
}

impl<T: rmcp::transport::Transport<RoleClient> + 'static> rmcp::transport::Transport<RoleClient>
    for Observed<T>
{
    type Error = T::Error;

    fn send(
        &mut self,
        item: rmcp::service::TxJsonRpcMessage<RoleClient>,
    ) -> impl std::future::Future<Output = Result<(), Self::Error>> + Send + 'static {
        self.inner.send(item)
    }

    // The trait's signature (a `Send` future), spelled as it is.
    #[allow(clippy::manual_async_fn)]
    fn receive(
        &mut self,
    ) -> impl std::future::Future<Output = Option<rmcp::service::RxJsonRpcMessage<RoleClient>>> + Send {
        async move {
            let m = self.inner.receive().await;
            if let Some(rmcp::model::JsonRpcMessage::Notification(n)) = &m
                && matches!(
                    n.notification,
                    rmcp::model::ServerNotification::ToolListChangedNotification(_)
                )
            {
                self.refreshing.send_modify(|n| *n += 1);
            }
            m
        }
    }

    fn close(&mut self) -> impl std::future::Future<Output = Result<(), Self::Error>> + Send {
        self.inner.close()
    }
}

/// Marks the connection of `generation` down and schedules a restart.
fn on_down(inner: &Arc<Inner>, generation: u64, why: String) {
    {
        let mut c = lock(&inner.conn);
        match c.as_ref() {
            Some(conn) if conn.generation == generation => *c = None,
            // A newer connection is up, or this one was already taken down.
            Some(_) => return,
            None => {}
        }
    }
    let stderr = lock(&inner.stderr).text.clone();
    let why = format!("{why}{}", stderr_note(&stderr));
    tracing::warn!(server = %inner.cfg.name, "MCP server down: {why}");
    {
        let mut h = lock(&inner.health);
        h.down = Some(why);
        if h.restarting || h.stopped {
            return;
        }
        h.restarting = true;
    }
    let weak = Arc::downgrade(inner);
    tokio::spawn(async move {
        loop {
            let delay = match weak.upgrade() {
                Some(i) => backoff(lock(&i.health).failures),
                None => return,
            };
            tokio::time::sleep(delay).await;
            let Some(inner) = weak.upgrade() else { return };
            lock(&inner.stderr).text.clear();
            match start(&inner).await {
                Ok(()) => {
                    lock(&inner.health).restarting = false;
                    tracing::info!(server = %inner.cfg.name, "MCP server restarted");
                    return;
                }
                Err(e) => {
                    let mut h = lock(&inner.health);
                    h.failures = h.failures.saturating_add(1);
                    h.down = Some(e.to_string());
                }
            }
        }
    });
}

/// Lists every page of tools and replaces the cache.
async fn refresh(inner: &Inner, peer: &Peer<RoleClient>) -> Result<(), String> {
    let tools = peer.list_all_tools().await.map_err(|e| e.to_string())?;
    let mut seen = std::collections::HashSet::new();
    let marks = telemetry_meta(&inner.cfg, peer);
    let specs: Vec<ToolSpec> = tools
        .iter()
        .filter_map(|t| {
            let v = serde_json::to_value(t).ok()?;
            let name = v.get("name")?.as_str()?.to_owned();
            // The names models accept (OpenAI's and Anthropic's rule); others would make every
            // request of the session fail. Left out, said in the log; a repeated name too.
            if !valid_tool_name(&name) {
                tracing::warn!(server = %inner.cfg.name, "tool {name:?} left out: a tool name must be 1 to 64 letters, digits, `_` or `-`");
                return None;
            }
            if !seen.insert(name.clone()) {
                tracing::warn!(server = %inner.cfg.name, "tool {name:?} is listed twice; the first is kept");
                return None;
            }
            let description = v
                .get("description")
                .and_then(Value::as_str)
                .or_else(|| v.get("title").and_then(Value::as_str))
                .unwrap_or_default()
                .to_owned();
            let schema = match v.get("inputSchema") {
                Some(s @ Value::Object(_)) => s.clone(),
                _ => json!({"type": "object"}),
            };
            let mut spec = ToolSpec::new(name.clone(), description, schema).with_meta("mcp.tool", name);
            for (k, v) in &marks {
                spec = spec.with_meta(*k, v.clone());
            }
            Some(spec)
        })
        .collect();
    *lock(&inner.tools) = specs;
    inner.tools_tx.send_modify(|n| *n += 1);
    Ok(())
}

/// What a tracer puts on a tool's `execute_tool` span (the MCP semantic conventions): the
/// server's name, its transport, the negotiated protocol version and, over HTTP, its address.
/// Carried in `ToolSpec::meta`, which is never sent to a model (see the `tether-otel` README).
fn telemetry_meta(cfg: &ServerConfig, peer: &Peer<RoleClient>) -> Vec<(&'static str, Value)> {
    let mut m = vec![("mcp.server", Value::from(cfg.name.clone()))];
    match &cfg.transport {
        Transport::Stdio { .. } => m.push(("mcp.transport", "stdio".into())),
        Transport::Http { url, .. } => {
            m.push(("mcp.transport", "http".into()));
            if let Ok(uri) = url.parse::<http::Uri>()
                && let Some(host) = uri.host()
            {
                let host = host.trim_start_matches('[').trim_end_matches(']');
                m.push(("server.address", host.to_owned().into()));
                let port = uri.port_u16().or(match uri.scheme_str() {
                    Some("https") => Some(443),
                    Some("http") => Some(80),
                    _ => None,
                });
                if let Some(p) = port {
                    m.push(("server.port", p.into()));
                }
            }
        }
    }
    if let Some(info) = peer.peer_info() {
        m.push(("mcp.protocol.version", info.protocol_version.to_string().into()));
    }
    m
}

/// Whether models accept `name` as a tool name.
fn valid_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Unregisters a call when dropped, and sends `notifications/cancelled` if it was still armed
/// (the call future was dropped: the turn was cancelled, or the call timed out).
struct CallGuard {
    inner: Arc<Inner>,
    key: u64,
    cancel: Option<(Peer<RoleClient>, RequestId, &'static str)>,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        lock(&self.inner.calls).remove(&self.key);
        if let Some((peer, id, reason)) = self.cancel.take()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(async move {
                let n = CancelledNotification::new(CancelledNotificationParam::new(
                    Some(id),
                    Some(reason.to_owned()),
                ));
                let _ = peer
                    .send_notification(ClientNotification::CancelledNotification(n))
                    .await;
            });
        }
    }
}

impl McpServer {
    fn down_message(&self) -> String {
        let h = lock(&self.inner.health);
        format!(
            "MCP server `{}` is not running ({}); tether is restarting it, so try again shortly",
            self.inner.cfg.name,
            h.down.as_deref().unwrap_or("not connected")
        )
    }

    async fn call_inner(&self, call: &ToolUse, cx: CallContext) -> ToolOutput {
        let inner = &self.inner;
        let name = &inner.cfg.name;
        let Some(conn) = lock(&inner.conn).clone() else {
            return ToolOutput::Error(self.down_message());
        };
        let arguments = match &call.input {
            Value::Object(m) => m.clone(),
            Value::Null => Default::default(),
            other => {
                return ToolOutput::Error(format!(
                    "the arguments of `{}` must be a JSON object, not {other}",
                    call.name
                ));
            }
        };
        let key = inner.next_call.fetch_add(1, Ordering::Relaxed);
        let mut params = CallToolRequestParams::new(call.name.clone()).with_arguments(arguments);
        // A traced session hands the call's `execute_tool` span: the server's spans join the
        // trace (the MCP conventions' `params._meta.traceparent`).
        if let Some(tp) = &cx.info.traceparent {
            let mut meta = rmcp::model::RequestMetaObject::new();
            meta.set_traceparent(tp.clone());
            params.meta = Some(meta);
        }
        let started = Instant::now();
        lock(&inner.calls).insert(
            key,
            InFlight {
                cx,
                tool_use_id: call.id.clone(),
                progress: None,
                generation: conn.generation,
                paused: 0,
                paused_since: None,
                paused_total: Duration::ZERO,
            },
        );
        let mut guard = CallGuard {
            inner: inner.clone(),
            key,
            cancel: None,
        };
        let req = ClientRequest::CallToolRequest(CallToolRequest::new(params));
        let handle = match conn
            .peer
            .send_request_with_option(req, PeerRequestOptions::no_options())
            .await
        {
            Ok(h) => h,
            Err(e) => {
                return ToolOutput::Error(format!(
                    "MCP server `{name}`: the call could not be sent ({e}); it was not run"
                ));
            }
        };
        if let Some(c) = lock(&inner.calls).get_mut(&key) {
            c.progress = Some(handle.progress_token.clone());
        }
        guard.cancel = Some((conn.peer.clone(), handle.id.clone(), "the call was cancelled"));
        let timeout = inner.cfg.call_timeout;
        // The wait for the user (an elicitation of this call) does not count: see `elicit`.
        let outcome = paused_timeout(inner, key, started, timeout, handle.await_response()).await;
        if outcome.is_some() {
            settle(inner).await;
        }
        match outcome {
            None => {
                guard.cancel = guard
                    .cancel
                    .take()
                    .map(|(p, id, _)| (p, id, "the call timed out"));
                drop(guard);
                // A server that does not answer a ping either is hung: restart it.
                let weak = Arc::downgrade(inner);
                let (peer, generation) = (conn.peer.clone(), conn.generation);
                tokio::spawn(async move {
                    let alive = tokio::time::timeout(
                        PING_GRACE,
                        peer.send_request(ClientRequest::PingRequest(Default::default())),
                    )
                    .await
                    .map(|r| r.is_ok())
                    .unwrap_or(false);
                    if !alive && let Some(inner) = weak.upgrade() {
                        let conn = lock(&inner.conn).clone();
                        if let Some(c) = conn.filter(|c| c.generation == generation) {
                            c.halt();
                        }
                        on_down(
                            &inner,
                            generation,
                            "it stopped answering (a call timed out and a ping went unanswered)".into(),
                        );
                    }
                });
                ToolOutput::Error(format!(
                    "MCP server `{name}`: tool `{}` did not answer within {timeout:?}; the call was cancelled (it may have partly run)",
                    call.name
                ))
            }
            Some(Ok(ServerResult::CallToolResult(r))) => {
                guard.cancel = None;
                match result::result_output(r) {
                    Ok(out) => out,
                    Err(e) => {
                        ToolOutput::Error(format!("MCP server `{name}`: the result could not be read: {e}"))
                    }
                }
            }
            Some(Ok(other)) => {
                guard.cancel = None;
                let v = serde_json::to_value(&other).unwrap_or(Value::Null);
                ToolOutput::Error(format!(
                    "MCP server `{name}` answered the call of `{}` with something other than a tool result, which tether does not serve: {}",
                    call.name,
                    result::clip(&v.to_string(), 2000)
                ))
            }
            Some(Err(ServiceError::McpError(e))) => {
                guard.cancel = None;
                ToolOutput::Error(format!(
                    "MCP server `{name}` refused the call of `{}`: {} (error {})",
                    call.name, e.message, e.code.0
                ))
            }
            Some(Err(ServiceError::TransportClosed)) | Some(Err(ServiceError::TransportSend(_))) => {
                guard.cancel = None;
                // Read before the restart clears it: what the child wrote as it exited.
                stderr_drained(conn.stderr_done.clone()).await;
                let stderr = lock(&inner.stderr).text.clone();
                on_down(
                    inner,
                    conn.generation,
                    "the connection closed during a call".into(),
                );
                ToolOutput::Error(format!(
                    "MCP server `{name}` exited or dropped the connection during the call of `{}` (it may have partly run); tether restarts it{}",
                    call.name,
                    stderr_note(&stderr)
                ))
            }
            Some(Err(e)) => {
                guard.cancel = None;
                ToolOutput::Error(format!(
                    "MCP server `{name}`: the call of `{}` failed: {e}",
                    call.name
                ))
            }
        }
    }
}

/// Waits (bounded) for tool-list refreshes the server asked for during a call: a tool the call
/// added is then declared on the next turn.
async fn settle(inner: &Inner) {
    // The common case, nothing refreshing: no receiver, no timer.
    if *inner.refreshing.borrow() == 0 {
        return;
    }
    let mut rx = inner.refreshing.subscribe();
    let _ = tokio::time::timeout(SETTLE_GRACE, rx.wait_for(|n| *n == 0)).await;
}

/// How long a call's result waits for a tool-list refresh the server asked for during it.
const SETTLE_GRACE: Duration = Duration::from_secs(10);

/// Runs `fut` until it ends (`Some`) or call `key`'s clock, started at `started`, has run for
/// `limit` (`None`; `fut` is dropped). The clock stops while the call is paused ([`CallPause`]).
///
/// One timer, read only when it fires: a wait of `limit` less the running time so far never
/// ends early (the clock runs no faster than time), and when it ends with time left (a pause
/// happened) it waits again for what is left.
async fn paused_timeout<F: std::future::Future>(
    inner: &Inner,
    key: u64,
    started: Instant,
    limit: Duration,
    fut: F,
) -> Option<F::Output> {
    let sleep = tokio::time::sleep_until(started + limit);
    tokio::pin!(fut, sleep);
    loop {
        tokio::select! {
            biased;
            out = &mut fut => return Some(out),
            _ = &mut sleep => {
                let now = Instant::now();
                let ran = lock(&inner.calls)
                    .get(&key)
                    .map(|c| c.running(started, now))
                    .unwrap_or_else(|| now.saturating_duration_since(started));
                let left = limit.saturating_sub(ran);
                if left.is_zero() {
                    return None;
                }
                sleep.as_mut().reset(now + left);
            }
        }
    }
}

#[async_trait]
impl ToolSource for McpServer {
    fn tools(&self) -> Vec<ToolSpec> {
        lock(&self.inner.tools).clone()
    }

    /// The tool-list counter ([`McpServer::tools_changed`]), bumped after every refresh of the
    /// list: a [`tether::source::ToolSources`] keeps its routes while it stays the same.
    fn tools_version(&self) -> Option<u64> {
        Some(*self.inner.tools_tx.borrow())
    }

    async fn call(&self, call: &ToolUse, cx: CallContext) -> ToolOutput {
        self.call_inner(call, cx).await
    }
}

/// The client side of one connection: serves the server's requests and notifications.
struct Client {
    inner: Weak<Inner>,
    generation: u64,
}

impl Client {
    /// The context of the newest call in flight on this connection (the server's requests carry
    /// no call id over stdio; the newest call is the one waiting on them in the common case).
    /// Also the call's key, to pause its clock ([`CallPause`]).
    fn newest_call(&self) -> Option<(CallContext, String, u64)> {
        let inner = self.inner.upgrade()?;
        let calls = lock(&inner.calls);
        calls
            .iter()
            .filter(|(_, c)| c.generation == self.generation)
            .max_by_key(|(k, _)| **k)
            .map(|(k, c)| (c.cx.clone(), c.tool_use_id.clone(), *k))
    }

    fn elicitation_timeout(&self) -> Duration {
        self.inner
            .upgrade()
            .map(|i| i.cfg.elicitation_timeout)
            .unwrap_or(DEFAULT_ELICITATION_TIMEOUT)
    }

    fn server_name(&self) -> String {
        self.inner
            .upgrade()
            .map(|i| i.cfg.name.clone())
            .unwrap_or_default()
    }
}

fn client_info() -> ClientConfig {
    let caps: ClientCapabilities = serde_json::from_value(json!({
        "roots": {"listChanged": false},
        "sampling": {},
        "elicitation": {"form": {}, "url": {}}
    }))
    .unwrap_or_default();
    let mut info = ClientConfig::new(caps, Implementation::new("tether", env!("CARGO_PKG_VERSION")));
    // The last version with the initialize handshake and unscoped list_changed notifications.
    info.protocol_version = ProtocolVersion::V_2025_11_25;
    info
}

fn mcp_err(code: ErrorCode, message: String) -> ErrorData {
    ErrorData::new(code, message, None)
}

impl ClientHandler for Client {
    fn get_info(&self) -> ClientConfig {
        client_info()
    }

    async fn list_roots(&self, _context: RequestContext<RoleClient>) -> Result<ListRootsResult, ErrorData> {
        let roots: Vec<Value> = self
            .inner
            .upgrade()
            .map(|i| i.cfg.roots.clone())
            .unwrap_or_default()
            .iter()
            .map(|p| {
                json!({
                    "uri": file_uri(p),
                    "name": p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| p.display().to_string()),
                })
            })
            .collect();
        serde_json::from_value(json!({ "roots": roots }))
            .map_err(|e| mcp_err(ErrorCode::INTERNAL_ERROR, e.to_string()))
    }

    async fn create_elicitation(
        &self,
        request: ElicitRequestParams,
        _context: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, ErrorData> {
        let raw = serde_json::to_value(&request).unwrap_or(Value::Null);
        let message = raw
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let mode = match (raw.get("url").and_then(Value::as_str), raw.get("requestedSchema")) {
            (Some(url), _) => ElicitationMode::Url { url: url.to_owned() },
            (None, Some(schema)) => ElicitationMode::Form {
                schema: schema.clone(),
            },
            (None, None) => ElicitationMode::Form {
                schema: json!({"type": "object"}),
            },
        };
        let answer = match self.newest_call() {
            Some((cx, _, key)) => {
                let mut req = ElicitationRequest::new(message, mode)
                    .with_raw(json!({"server": self.server_name(), "params": raw}));
                req.id = raw
                    .get("elicitationId")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                // The user's time is not the call's: both the call's `call_timeout` and the
                // session's tool timeout stop while the question waits, which is bounded by its
                // own `elicitation_timeout` instead (then cancelled: nobody answered).
                let _call_paused = self.inner.upgrade().map(|i| CallPause::new(&i, key));
                let _tool_paused = cx.events.as_ref().map(|e| e.clock().pause());
                let limit = self.elicitation_timeout();
                match tokio::time::timeout(limit, cx.handler.elicit(&req, &cx.info)).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        tracing::warn!(
                            server = %self.server_name(),
                            "an elicitation went unanswered for {limit:?}; answered as cancelled"
                        );
                        ElicitationResponse::Cancel
                    }
                }
            }
            // Nobody to ask: no call of this server is running.
            None => ElicitationResponse::Decline,
        };
        let v = match answer {
            ElicitationResponse::Accept { content } => match content {
                Some(c) => json!({"action": "accept", "content": c}),
                None => json!({"action": "accept"}),
            },
            ElicitationResponse::Decline => json!({"action": "decline"}),
            _ => json!({"action": "cancel"}),
        };
        serde_json::from_value(v).map_err(|e| {
            mcp_err(
                ErrorCode::INVALID_REQUEST,
                format!("the answer does not fit the request: {e}"),
            )
        })
    }

    async fn create_message(
        &self,
        params: CreateMessageRequestParams,
        _context: RequestContext<RoleClient>,
    ) -> Result<CreateMessageResult, ErrorData> {
        let Some(inner) = self.inner.upgrade() else {
            return Err(mcp_err(ErrorCode::INTERNAL_ERROR, "the client is gone".into()));
        };
        let Some(s) = inner.cfg.sampling.clone() else {
            return Err(mcp_err(
                ErrorCode::INVALID_REQUEST,
                format!(
                    "sampling refused: tether does not let MCP server `{}` use the session's model unless its configuration allows it (sampling = true)",
                    inner.cfg.name
                ),
            ));
        };
        let raw = serde_json::to_value(&params).unwrap_or(Value::Null);
        let req = sampling_request(&raw, &s.model_name);
        let resp = s
            .model
            .chat(&req, &DeltaSink::discard())
            .await
            .map_err(|e| mcp_err(ErrorCode::INTERNAL_ERROR, format!("the model failed: {e}")))?;
        let text = resp.message.content.unwrap_or_default();
        let stop = match resp.finish_reason.as_deref() {
            Some("length") => "maxTokens",
            _ => "endTurn",
        };
        serde_json::from_value(json!({
            "role": "assistant",
            "content": {"type": "text", "text": text},
            "model": s.model_name,
            "stopReason": stop,
        }))
        .map_err(|e| mcp_err(ErrorCode::INTERNAL_ERROR, e.to_string()))
    }

    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        let Some(inner) = self.inner.upgrade() else { return };
        let target = {
            let calls = lock(&inner.calls);
            calls
                .values()
                .find(|c| c.progress.as_ref() == Some(&params.progress_token))
                .map(|c| (c.cx.events.clone(), c.tool_use_id.clone()))
        };
        let raw =
            json!({"server": inner.cfg.name, "params": serde_json::to_value(&params).unwrap_or(Value::Null)});
        match target {
            Some((Some(events), id)) => {
                events
                    .live(Event::new(
                        format!("mcp.progress:{id}:{}", params.progress),
                        "mcp.progress",
                        raw,
                        EventKind::ToolCallUpdate {
                            tool_use_id: id,
                            status: Some("in_progress".into()),
                        },
                    ))
                    .await
            }
            _ => tracing::debug!(server = %inner.cfg.name, "progress for no call in a session: {raw}"),
        }
    }

    async fn on_logging_message(
        &self,
        params: LoggingMessageNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        let name = self.server_name();
        let raw = json!({"server": name, "params": serde_json::to_value(&params).unwrap_or(Value::Null)});
        tracing::info!(server = %name, "log: {raw}");
        if let Some((cx, id, _)) = self.newest_call()
            && let Some(events) = cx.events
        {
            events
                .live(Event::new(
                    format!("mcp.log:{id}"),
                    "mcp.log",
                    raw,
                    EventKind::Other,
                ))
                .await;
        }
    }

    async fn on_tool_list_changed(&self, context: NotificationContext<RoleClient>) {
        let Some(inner) = self.inner.upgrade() else { return };
        // Counted when read (`Observed`); uncounted once the list is replaced. A call that ends
        // meanwhile waits for it (`settle`), so the next turn declares the new list.
        let done = |inner: &Inner| inner.refreshing.send_modify(|n| *n = n.saturating_sub(1));
        if inner.generation.load(Ordering::SeqCst) != self.generation {
            // An old connection's news.
            done(&inner);
            return;
        }
        // The connection's own peer: during start-up it is not yet `inner.conn`.
        let peer = context.peer;
        // Not awaited here: the listing's answer arrives on the loop that runs this handler.
        tokio::spawn(async move {
            if let Err(e) = refresh(&inner, &peer).await {
                tracing::warn!(server = %inner.cfg.name, "refreshing the tool list failed: {e}");
            }
            done(&inner);
        });
    }
}

fn file_uri(p: &std::path::Path) -> String {
    let mut s = String::from("file://");
    for b in p.to_string_lossy().bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

/// A chat request from a `sampling/createMessage` request's JSON: its system prompt and
/// messages, text kept, other content described.
fn sampling_request(raw: &Value, model: &str) -> ChatRequest {
    let mut messages = Vec::new();
    if let Some(sys) = raw.get("systemPrompt").and_then(Value::as_str) {
        messages.push(ChatMessage::system(sys));
    }
    for m in raw
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let blocks: Vec<Value> = match m.get("content") {
            Some(Value::Array(a)) => a.clone(),
            Some(v) => vec![v.clone()],
            None => Vec::new(),
        };
        let text = blocks
            .iter()
            .map(|b| match b.get("type").and_then(Value::as_str) {
                Some("text") => b
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                Some(t) => format!("[{t} content, not passed to the model]"),
                None => String::new(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        match m.get("role").and_then(Value::as_str) {
            Some("assistant") => messages.push(ChatMessage::assistant(text)),
            _ => messages.push(ChatMessage::user(text)),
        }
    }
    ChatRequest::new(model, messages, Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        assert_eq!(backoff(0), BACKOFF_FIRST);
        assert!(backoff(3) > backoff(2));
        assert_eq!(backoff(50), BACKOFF_MAX);
    }

    #[test]
    fn tool_names_models_refuse_are_left_out() {
        assert!(valid_tool_name("get-sum_2"));
        assert!(!valid_tool_name(""));
        assert!(!valid_tool_name("a.b"));
        assert!(!valid_tool_name("a b"));
        assert!(!valid_tool_name(&"x".repeat(65)));
    }

    #[test]
    fn file_uris_are_escaped() {
        assert_eq!(file_uri(std::path::Path::new("/a b/c")), "file:///a%20b/c");
    }

    #[test]
    fn the_client_advertises_what_it_serves() {
        let v = serde_json::to_value(client_info()).unwrap();
        assert_eq!(v["protocolVersion"], "2025-11-25");
        assert!(v["capabilities"]["roots"].is_object());
        assert!(v["capabilities"]["elicitation"].is_object());
        assert!(v["capabilities"]["sampling"].is_object());
    }
}
