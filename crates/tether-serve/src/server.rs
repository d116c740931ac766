//! The HTTP server: routes, bearer-token auth, limits, embedded UI, graceful shutdown.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use serde_json::{Value, json};
use tether_agui::{AgUiRouterExt, EndpointOptions, StreamGuard};
use tether_sqlite::SqliteStore;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::agent::{ServeAgent, Shared, thread_messages};
use crate::config::Config;

/// Why the server did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// A non-loopback bind address without a token.
    #[error(
        "refusing to listen on {bind} without a token: anyone who can reach it could run your agents and their tools. \
         Pass --token or set TETHER_TOKEN, or bind to 127.0.0.1"
    )]
    TokenRequired {
        /// The bind address.
        bind: String,
    },
    /// The bind address is not valid or cannot be bound.
    #[error("cannot listen on {bind}: {message}")]
    Bind {
        /// The bind address.
        bind: String,
        /// Why.
        message: String,
    },
    /// The configuration is unusable.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The database could not be opened.
    #[error(transparent)]
    Store(#[from] tether_sqlite::StoreError),
    /// An agent could not be set up.
    #[error("agent `{agent}`: {message}")]
    Agent {
        /// The agent.
        agent: String,
        /// Why.
        message: String,
    },
}

/// Everything the server needs to start.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The agents and limits.
    pub config: Config,
    /// The address to listen on (`host:port`; port 0 picks one).
    pub bind: String,
    /// The SQLite database file.
    pub db: PathBuf,
    /// The bearer token every `/v1/` route requires, when set.
    pub token: Option<String>,
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _front: FrontRuntime,
}

/// The runtime the server's connections live on (accepting, reading requests, writing events),
/// apart from the runtime the runs work on (the caller's).
///
/// Why two: with 1,000 runs streaming, every worker of one runtime has a queue of run tasks, each
/// parsing a chunk of model output; a new connection's tasks (accept, read the request, write
/// `RUN_STARTED`) wait behind all of them, several times over — 100–200 ms on two cores. On a
/// runtime of their own, where tasks only move bytes, they wait for a thread the OS schedules
/// fairly. The runs' tasks are spawned on the caller's runtime ([`RunOptions::runtime`]).
///
/// [`RunOptions::runtime`]: tether_agui::RunOptions::runtime
struct FrontRuntime(Option<tokio::runtime::Runtime>);

impl std::fmt::Debug for FrontRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrontRuntime")
    }
}

impl Drop for FrontRuntime {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which is not allowed inside another runtime's task.
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl Server {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts a graceful shutdown: no new runs; running ones get the grace period to finish.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Waits until the server has stopped.
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

#[derive(Clone)]
struct AppState {
    shared: Arc<Shared>,
    agents: Arc<Vec<AgentInfo>>,
    token: Option<Arc<str>>,
    runs: Arc<Semaphore>,
    draining: Arc<AtomicBool>,
}

#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct AgentInfo {
    name: String,
    description: String,
    model: String,
    tools: Vec<String>,
}

fn is_loopback(bind: &str) -> Result<bool, ServeError> {
    let addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(bind)
        .map_err(|e| ServeError::Bind {
            bind: bind.into(),
            message: format!("{e} (use host:port, e.g. 127.0.0.1:7878)"),
        })?
        .collect();
    Ok(!addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback()))
}

/// Starts the server; it runs until [`Server::shutdown`] (or the process ends).
pub async fn start(opts: ServerOptions) -> Result<Server, ServeError> {
    let token = opts.token.clone().filter(|t| !t.is_empty());
    if token.is_none() && !is_loopback(&opts.bind)? {
        return Err(ServeError::TokenRequired { bind: opts.bind });
    }
    let store = SqliteStore::open(&opts.db)?;
    let limits = &opts.config.server;
    let shared = Arc::new(Shared::new(store, Duration::from_secs(limits.run_timeout_secs)));
    let front = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(front_threads())
        .thread_name("tether-serve-http")
        .enable_all()
        .build()
        .map_err(|e| ServeError::Bind {
            bind: opts.bind.clone(),
            message: format!("cannot start the HTTP runtime: {e}"),
        })?;
    let endpoint = EndpointOptions {
        body_limit: limits.max_body_bytes,
        run: tether_agui::RunOptions {
            runtime: Some(tokio::runtime::Handle::current()),
            ..Default::default()
        },
        ..EndpointOptions::default()
    };
    let mut runs_router: Router<AppState> = Router::new();
    let mut infos = Vec::new();
    for (name, cfg) in &opts.config.agents {
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
        let model =
            crate::model::of(cfg, &base_url, api_key, &model_name).map_err(|message| ServeError::Agent {
                agent: name.clone(),
                message,
            })?;
        let handler =
            crate::handler::ServeHandler::new(cfg, Vec::new(), Default::default()).map_err(|message| {
                ServeError::Agent {
                    agent: name.clone(),
                    message,
                }
            })?;
        let mut tools: Vec<String> = tether::Handler::tools(&handler)
            .into_iter()
            .map(|t| t.name)
            .collect();
        if let Some(t) = &cfg.terminal_tool {
            tools.push(t.name.clone());
        }
        infos.push(AgentInfo {
            name: name.clone(),
            description: cfg.description.clone(),
            model: model_name.clone(),
            tools,
        });
        let agent = ServeAgent {
            name: name.clone(),
            cfg: cfg.clone(),
            model,
            model_name,
            shared: shared.clone(),
        };
        runs_router = runs_router.route_agui_with(&format!("/v1/agents/{name}/run"), agent, endpoint.clone());
    }
    let state = AppState {
        shared,
        agents: Arc::new(infos),
        token: token.map(Arc::from),
        runs: Arc::new(Semaphore::new(limits.max_concurrent_runs)),
        draining: Arc::new(AtomicBool::new(false)),
    };
    let runs_router = runs_router.layer(middleware::from_fn_with_state(state.clone(), run_limits));
    let v1 = Router::new()
        .route("/v1/agents", get(list_agents))
        .route("/v1/threads", get(list_threads))
        .route("/v1/threads/{thread}/events", get(thread_events))
        .route("/v1/threads/{thread}/messages", get(thread_messages_route))
        .merge(runs_router)
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), auth));
    let app = Router::new()
        .route("/healthz", get(|| async { axum::Json(json!({"ok": true})) }))
        .route("/", get(crate::ui::index))
        .route("/assets/{file}", get(crate::ui::asset))
        .merge(v1)
        .with_state(state.clone());

    let bind = opts.bind.clone();
    let listener = front
        .spawn(async move { listen(&bind).await })
        .await
        .map_err(std::io::Error::other)
        .and_then(|r| r)
        .map_err(|e| ServeError::Bind {
            bind: opts.bind.clone(),
            message: e.to_string(),
        })?;
    let addr = listener.local_addr().map_err(|e| ServeError::Bind {
        bind: opts.bind.clone(),
        message: e.to_string(),
    })?;
    let shutdown = CancellationToken::new();
    let grace = Duration::from_secs(limits.shutdown_grace_secs);
    let sd = shutdown.clone();
    let draining = state.draining.clone();
    let task = front.spawn(async move {
        let serve = accept_loop(listener, app, sd.clone());
        tokio::pin!(serve);
        tokio::select! {
            // Drain first, so that `draining` is set before the last connection closes.
            biased;
            _ = async {
                sd.cancelled().await;
                draining.store(true, Ordering::SeqCst);
                tracing::info!("shutting down: no new runs; running turns get {grace:?} to finish");
                tokio::time::sleep(grace).await
            } => {
                tracing::warn!("runs still going after {grace:?}: stopping; their progress is checkpointed in the database");
            }
            () = &mut serve => {}
        }
    });
    Ok(Server {
        addr,
        shutdown,
        task,
        _front: FrontRuntime(Some(front)),
    })
}

/// How long a connection may take to send a request head before it is closed (slow clients
/// hold a connection's buffers; hyper's default once a timer is set).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Accepts connections until `shutdown`, serving each as HTTP/1.1 with `app` on a task of the
/// current (front) runtime; then asks every open connection to close once its response is done,
/// and returns when all have.
///
/// Why not `axum::serve`: it serves through hyper-util's `auto` builder, which first reads 24
/// bytes to tell HTTP/2 from HTTP/1 and hands them back through a rewinding reader. hyper's read
/// buffer then takes the request in two reads and grows to 16 KiB, which every connection keeps
/// for its life: a quarter of the 64 KiB a run may use. Served by hyper's HTTP/1 builder the
/// request is one read into one 8 KiB buffer. (The server speaks HTTP/1.1 only, as before.)
async fn accept_loop(listener: tokio::net::TcpListener, app: Router, shutdown: CancellationToken) {
    // Each connection holds a receiver; `closed()` resolves once every one has been dropped.
    let (open_tx, open_rx) = tokio::sync::watch::channel(());
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = shutdown.cancelled() => break,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                use std::io::ErrorKind as K;
                // A connection reset before it was accepted concerns only that connection; any
                // other failure (out of descriptors or memory) would repeat at once: back off
                // instead of spinning.
                if matches!(
                    e.kind(),
                    K::ConnectionAborted | K::ConnectionReset | K::Interrupted
                ) {
                    tracing::debug!("accept: {e}");
                } else {
                    tracing::warn!("accept: {e}; pausing new connections for 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        // No Nagle: an event is one small write; held back until the previous one is
        // acknowledged it could wait out the peer's delayed ACK (40 ms on Linux).
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY: {e}");
        }
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let mut stop = open_rx.clone();
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), service);
            tokio::pin!(conn);
            let mut stopping = false;
            loop {
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            tracing::debug!("connection: {e}");
                        }
                        break;
                    }
                    _ = stop.changed(), if !stopping => {
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(stop);
        });
    }
    drop(listener);
    drop(open_rx);
    // Wake every connection (each closes once its response is done), then wait for them.
    let _ = open_tx.send(());
    open_tx.closed().await;
}

/// Threads serving connections: twice the cores, between 2 and 16.
///
/// More threads than cores, on purpose. The OS shares the cores among runnable threads, so the
/// ratio of front threads to run threads is how the server weighs a new run's first event
/// against the streaming of the runs already going; an idle front thread parks and costs
/// nothing. Their work is mostly syscalls (read a request, write events). Measured on 2 cores
/// with the `tether serve` bench (1,000 runs at once, open connections, p99 to the first event):
/// one thread 43–116 ms, two 41–76, four 27–57 (nine of ten runs under 50), eight 19–64; the
/// memory per run went from 36–46 KiB with one to 45–56 with four (each thread's allocator arena).
fn front_threads() -> usize {
    let cores = std::thread::available_parallelism().map(usize::from).unwrap_or(2);
    (cores * 2).clamp(2, 16)
}

/// The accept backlog asked of the kernel (Linux caps it at `net.core.somaxconn`, 4096 by default).
const BACKLOG: u32 = 4096;

/// Binds `bind` with a backlog for many simultaneous connects. `TcpListener::bind` (mio) asks for
/// 128: when 1,000 clients connect at once, the kernel drops the SYNs past the first 128 queued
/// and the clients retransmit them a second later (the 1.1–1.2 s p99 to the first event).
async fn listen(bind: &str) -> std::io::Result<tokio::net::TcpListener> {
    let mut last = None;
    for addr in tokio::net::lookup_host(bind).await? {
        let socket = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        };
        let bound = socket.and_then(|s| {
            #[cfg(unix)]
            s.set_reuseaddr(true)?;
            s.bind(addr)?;
            s.listen(BACKLOG)
        });
        match bound {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the address resolves to nothing",
        )
    }))
}

fn json_error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        axum::Json(json!({"code": code, "message": message.into()})),
    )
        .into_response()
}

/// Constant-time comparison of two byte strings.
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(token) = &st.token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let ok = given.is_some_and(|g| same(g.as_bytes(), token.as_bytes()));
        if !ok {
            let mut r = json_error(
                StatusCode::UNAUTHORIZED,
                "UNAUTHORIZED",
                if given.is_some() {
                    "the bearer token is wrong"
                } else {
                    "this server requires a bearer token: send Authorization: Bearer <token>"
                },
            );
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return r;
        }
    }
    next.run(req).await
}

/// The concurrent-run limit and the drain on shutdown; the permit lives as long as the stream.
async fn run_limits(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    if st.draining.load(Ordering::SeqCst) {
        return json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "SHUTTING_DOWN",
            "the server is shutting down and takes no new runs; retry against its replacement",
        );
    }
    let Ok(permit) = st.runs.clone().try_acquire_owned() else {
        let mut r = json_error(
            StatusCode::TOO_MANY_REQUESTS,
            "TOO_MANY_RUNS",
            "the server is at its concurrent-run limit (max_concurrent_runs); retry shortly",
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return r;
    };
    // The endpoint holds the permit in the response body, for as long as the run streams.
    req.extensions_mut().insert(StreamGuard::new(permit));
    next.run(req).await
}

async fn not_found(req: Request) -> Response {
    json_error(
        StatusCode::NOT_FOUND,
        "NOT_FOUND",
        format!(
            "no route for {} {} (see GET /v1/agents)",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn list_agents(State(st): State<AppState>) -> Response {
    axum::Json(json!({"agents": *st.agents})).into_response()
}

#[derive(Deserialize)]
struct ThreadsQuery {
    agent: Option<String>,
}

fn thread_json(t: &tether_sqlite::ThreadRecord) -> Value {
    json!({
        "threadId": t.thread_id,
        "agent": t.agent,
        "title": t.title,
        "createdMs": t.created_ms,
        "updatedMs": t.updated_ms,
    })
}

async fn list_threads(State(st): State<AppState>, Query(q): Query<ThreadsQuery>) -> Response {
    match st.shared.store.threads(q.agent.as_deref()).await {
        Ok(ts) => {
            axum::Json(json!({"threads": ts.iter().map(thread_json).collect::<Vec<_>>()})).into_response()
        }
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, "STORE", e.to_string()),
    }
}

async fn load_thread(
    st: &AppState,
    thread: &str,
) -> Result<(tether_sqlite::ThreadRecord, Vec<tether::Event>), Response> {
    let rec = match st.shared.store.thread(thread).await {
        Ok(Some(r)) => r,
        Ok(None) => {
            return Err(json_error(
                StatusCode::NOT_FOUND,
                "THREAD_NOT_FOUND",
                format!("no thread {thread} (see GET /v1/threads)"),
            ));
        }
        Err(e) => {
            return Err(json_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "STORE",
                e.to_string(),
            ));
        }
    };
    match st.shared.store_dyn.load(&rec.session_id).await {
        Ok(ev) => Ok((rec, ev)),
        Err(e) => Err(json_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "STORE",
            e.to_string(),
        )),
    }
}

async fn thread_events(State(st): State<AppState>, Path(thread): Path<String>) -> Response {
    match load_thread(&st, &thread).await {
        Ok((rec, events)) => axum::Json(json!({
            "thread": thread_json(&rec),
            "sessionId": rec.session_id,
            "events": events,
        }))
        .into_response(),
        Err(r) => r,
    }
}

async fn thread_messages_route(State(st): State<AppState>, Path(thread): Path<String>) -> Response {
    match load_thread(&st, &thread).await {
        Ok((rec, events)) => axum::Json(json!({
            "thread": thread_json(&rec),
            "messages": thread_messages(&events),
        }))
        .into_response(),
        Err(r) => r,
    }
}
