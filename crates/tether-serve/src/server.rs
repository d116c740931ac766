//! The HTTP server: routes, the trust boundary (Host, Origin, bearer token), limits, embedded
//! UI, graceful shutdown.
//!
//! The boundary, checked on every request before routing:
//! - **Host.** On a loopback bind, only requests whose `Host` names a loopback host are served:
//!   `localhost` (not `*.localhost`: some resolvers send those names to the network), an IPv4
//!   address in 127.0.0.0/8, `[::1]`; any port. Anything else gets 403 `HOST_NOT_ALLOWED`: a page
//!   on `http://attacker.example:PORT` whose name was re-pointed at 127.0.0.1 (DNS rebinding) is
//!   same-origin with itself in the browser, and only the `Host` it sends tells it apart. On a
//!   non-loopback bind the names it is reached by are not known, so `Host` is not checked there;
//!   the token (required on such a bind) is what keeps a rebinding page out of `/v1/`.
//! - **Origin.** A browser request from another origin (an `Origin` that is not `http(s)://` +
//!   the request's `Host`) gets 403 `ORIGIN_NOT_ALLOWED` unless `[server] allowed_origins` lists
//!   it; listed origins get CORS answers (preflight included). A request without `Origin` whose
//!   `Sec-Fetch-Site` says another site sent it (a `<script>` or `<img>` tag) is refused too,
//!   except a top-level navigation (the user following a link to the UI).
//! - **Token.** Every route but `/`, `/assets/*` and `/healthz` needs `Authorization: Bearer`
//!   when the server has a token (`tether serve` generates one unless `--no-token`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use serde_json::{Value, json};
use tether_agui::server::Admit;
use tether_agui::thread::Update;
use tether_agui::{AgUiRouterExt, EndpointOptions, RunAgentInput, StreamGuard, ThreadAgent};
use tether_sqlite::SqliteStore;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::config::Config;

/// An agent as `tether serve` runs it: every provider through [`ThreadAgent`], with the state
/// panel the web UI shows ([`panel`]).
pub(crate) type ServedAgent = ThreadAgent<Value>;

/// Why the server did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// A non-loopback bind address without a token (`--no-token`, or no token in the options).
    #[error(
        "refusing to listen on {bind} without a token: anyone who can reach it could run your agents and their tools. \
         Drop --no-token (a token is then generated and printed), pass --token or set TETHER_TOKEN, or bind to 127.0.0.1"
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
#[non_exhaustive]
pub struct ServerOptions {
    /// The agents and limits.
    pub config: Config,
    /// The address to listen on (`host:port`; port 0 picks one).
    pub bind: String,
    /// The SQLite database file.
    pub db: PathBuf,
    /// The bearer token every `/v1/` route requires. `None` (or empty): no token, which only a
    /// loopback bind allows. (`tether serve` generates one unless told `--no-token`; see
    /// [`generate_token`](crate::generate_token).)
    pub token: Option<String>,
}

impl ServerOptions {
    /// A server for `config`, listening on `bind` (`host:port`), keeping its threads in the
    /// SQLite file `db`, with no token (which only a loopback bind allows).
    pub fn new(config: Config, bind: impl Into<String>, db: impl Into<PathBuf>) -> Self {
        ServerOptions {
            config,
            bind: bind.into(),
            db: db.into(),
            token: None,
        }
    }

    /// The same options with the bearer token every `/v1/` route requires.
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    shutdown: CancellationToken,
    stopped_accepting: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _front: FrontRuntime,
    /// The backend's services running beside the server (the Restate endpoint), stopped with it.
    services: Services,
}

/// The backend's services (see [`Service`]).
struct Services(Vec<Service>);

impl std::fmt::Debug for Services {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Services({})", self.0.len())
    }
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

    /// Starts a graceful shutdown: from the moment this returns no new run is admitted (503
    /// `SHUTTING_DOWN`); running ones get the grace period to finish.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Resolves once the listener is closed after [`Server::shutdown`]: from then on a new
    /// connection is refused by the OS (the port can be bound by a replacement).
    pub async fn stopped_accepting(&self) {
        self.stopped_accepting.cancelled().await;
    }

    /// Waits until the server has stopped.
    pub async fn wait(self) {
        let _ = self.task.await;
        for s in self.services.0 {
            s.await;
        }
    }
}

#[derive(Clone)]
struct AppState {
    /// Where the `GET /v1/threads...` routes read threads (the SQLite file; on the Restate
    /// backend, Restate through its ingress).
    store: Arc<dyn tether::ThreadStore>,
    agents: Arc<Vec<AgentInfo>>,
    boundary: Arc<Boundary>,
}

/// What the guard checks on every request (see the module's documentation).
struct Boundary {
    /// The bind is loopback: `Host` must name a loopback host.
    loopback_only: bool,
    /// Other origins allowed to call from a browser (lower-case).
    allowed_origins: Box<[String]>,
    /// The bearer token, when there is one.
    token: Option<Box<str>>,
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
    let mut opts = opts;
    opts.config.check("the server's configuration")?;
    let token = opts.token.clone().filter(|t| !t.trim().is_empty());
    let configured_node = match &opts.config.server.node_url {
        Some(u) => {
            let ok = (u.starts_with("http://") || u.starts_with("https://"))
                && u.parse::<axum::http::Uri>().is_ok_and(|p| p.host().is_some());
            if !ok {
                return Err(ServeError::Config(crate::config::ConfigError::Invalid {
                    path: "[server] node_url".into(),
                    message: format!(
                        "{} is not an http(s) URL of this server (e.g. \"http://10.0.0.5:7878\")",
                        printable(u)
                    ),
                }));
            }
            Some(u.trim_end_matches('/').to_owned())
        }
        None => None,
    };
    let loopback = is_loopback(&opts.bind)?;
    if token.is_none() && !loopback {
        return Err(ServeError::TokenRequired { bind: opts.bind });
    }
    let store = SqliteStore::open(&opts.db)?;
    let limits = &opts.config.server;
    let run_timeout = Duration::from_secs(limits.run_timeout_secs);
    // The agents' MCP servers, before anything that must be torn down on an error.
    for (name, cfg) in &opts.config.agents {
        crate::handler::start_mcp(cfg)
            .await
            .map_err(|message| ServeError::Agent {
                agent: name.clone(),
                message,
            })?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(front_threads())
        .thread_name("tether-serve-http")
        .enable_all()
        .build()
        .map_err(|e| ServeError::Bind {
            bind: opts.bind.clone(),
            message: format!("cannot start the HTTP runtime: {e}"),
        })?;
    let front = rt.handle().clone();
    // Owned by `front_rt` at once: a start that fails below drops the runtime without blocking
    // (a runtime dropped in async code panics).
    let front_rt = FrontRuntime(Some(rt));
    let shutdown = CancellationToken::new();
    let runs = Arc::new(Semaphore::new(limits.max_concurrent_runs));
    // One for the whole server: its runs share its cores.
    let priority = (limits.first_output_hold_ms > 0)
        .then(|| tether::priority::Priority::new(Duration::from_millis(limits.first_output_hold_ms)));
    let endpoint = EndpointOptions::default()
        .with_body_limit(limits.max_body_bytes)
        .with_body_timeout(Some(Duration::from_secs(limits.body_timeout_secs)))
        .with_run(
            tether_agui::RunOptions::default()
                .with_runtime(tokio::runtime::Handle::current())
                .with_buffer(RUN_EVENT_BUFFER),
        );
    let mut app: Router<AppState> = Router::new();
    // This server's URL as the other nodes of a cluster reach it: known once it is bound.
    let node: Arc<std::sync::OnceLock<String>> = Arc::default();
    let mut infos = Vec::new();
    let mut services: Vec<Service> = Vec::new();
    let backend = opts.config.server.backend;
    if backend == crate::config::Backend::Restate && opts.config.agents.len() > 1 {
        return Err(ServeError::Config(crate::config::ConfigError::Invalid {
            path: "[server] backend".into(),
            message: "the restate backend serves one agent per server for now".into(),
        }));
    }
    // The records' database, when the Restate backend keeps them outside Restate: one
    // connection set for the agent's service and the server's reads.
    #[cfg(not(feature = "restate"))]
    let shared = Shared;
    #[cfg(feature = "restate")]
    let shared: Shared = if backend == crate::config::Backend::Restate {
        crate::backend::shared_record(&opts.config.server)
            .await
            .map_err(|message| {
                ServeError::Config(crate::config::ConfigError::Invalid {
                    path: "[server] restate_postgres".into(),
                    message,
                })
            })?
    } else {
        None
    };
    for (name, cfg) in &opts.config.agents {
        let agent_err = |message: String| ServeError::Agent {
            agent: name.clone(),
            message,
        };
        let spec = cfg.provider_spec(name).map_err(agent_err)?;
        let path = format!("/v1/agents/{name}/run");
        if backend == crate::config::Backend::Restate {
            let (routed, info, service) = restate_route(
                app,
                &path,
                name,
                cfg,
                spec,
                &store,
                &opts.config.server,
                run_timeout,
                &endpoint,
                &runs,
                &shutdown,
                (&node, token.as_deref()),
                shared.clone(),
            )
            .await
            .map_err(agent_err)?;
            app = routed;
            infos.push(info);
            services.push(service);
            continue;
        }
        let (agent, info) =
            thread_agent(name, cfg, spec, &store, run_timeout, priority.as_ref()).map_err(agent_err)?;
        infos.push(info);
        let check: Arc<dyn ResumeCheck> = agent.clone();
        let options = endpoint
            .clone()
            .with_admit(admission(check, runs.clone(), shutdown.clone()));
        app = app.route_agui_with(&path, agent, options);
    }
    #[cfg(feature = "restate")]
    let store: Arc<dyn tether::ThreadStore> = if backend == crate::config::Backend::Restate {
        crate::backend::thread_store(
            &opts.config.server,
            opts.config.agents.keys(),
            &store,
            shared.as_ref(),
        )
        .map_err(|message| {
            ServeError::Config(crate::config::ConfigError::Invalid {
                path: "[server] restate_ingress".into(),
                message,
            })
        })?
    } else {
        Arc::new(store)
    };
    #[cfg(not(feature = "restate"))]
    let store: Arc<dyn tether::ThreadStore> = Arc::new(store);
    let state = AppState {
        store,
        agents: Arc::new(infos),
        boundary: Arc::new(Boundary {
            loopback_only: loopback,
            allowed_origins: opts.config.server.allowed_origins.clone().into_boxed_slice(),
            token: token.map(String::into_boxed_str),
        }),
    };
    let app = app
        .route("/v1/agents", get(list_agents))
        .route("/v1/threads", get(list_threads))
        .route("/v1/threads/{thread}/events", get(thread_events))
        .route("/v1/threads/{thread}/messages", get(thread_messages_route))
        .route("/healthz", get(|| async { axum::Json(json!({"ok": true})) }))
        .route("/", get(crate::ui::index))
        .route("/assets/{file}", get(crate::ui::asset))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state);

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
    // Announced to the other nodes: the configured URL, else the bound address unless it is a
    // wildcard (no peer could use it).
    let own = configured_node.or_else(|| (!addr.ip().is_unspecified()).then(|| format!("http://{addr}")));
    if let Some(u) = own {
        let _ = node.set(u);
    }
    let grace = Duration::from_secs(limits.shutdown_grace_secs);
    let sd = shutdown.clone();
    let stopped_accepting = CancellationToken::new();
    let stopped = stopped_accepting.clone();
    let task = front.spawn(async move {
        let serve = accept_loop(listener, app, sd.clone(), stopped);
        tokio::pin!(serve);
        tokio::select! {
            biased;
            _ = async {
                sd.cancelled().await;
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
        stopped_accepting,
        task,
        _front: front_rt,
        services: Services(services),
    })
}

/// Checks a resume request's interrupts at admission, before `RUN_STARTED` (each backend's
/// agent checks them against the thread's outstanding interrupts).
pub(crate) trait ResumeCheck: Send + Sync + 'static {
    /// See `ThreadAgent::check_resume`.
    fn check<'a>(
        &'a self,
        input: &'a RunAgentInput,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), tether_agui::CheckError>> + Send + 'a>>;
}

impl ResumeCheck for ServedAgent {
    fn check<'a>(
        &'a self,
        input: &'a RunAgentInput,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), tether_agui::CheckError>> + Send + 'a>>
    {
        Box::pin(self.check_resume(input))
    }
}

#[cfg(feature = "restate")]
impl ResumeCheck for crate::backend::RestateAgent {
    fn check<'a>(
        &'a self,
        input: &'a RunAgentInput,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), tether_agui::CheckError>> + Send + 'a>>
    {
        Box::pin(self.check_resume(input))
    }
}

/// A backend's service beside the server: the future stops it (and resolves once it is gone).
type Service = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + Sync>>;

type Routed = (Router<AppState>, AgentInfo, Service);

/// The Restate backend's shared record, if the records are kept there (`restate_postgres`).
#[cfg(feature = "restate")]
type Shared = Option<tether_restate::SharedRecord>;
/// Without the `restate` feature there is none.
#[cfg(not(feature = "restate"))]
#[derive(Clone)]
struct Shared;

/// The run route of an agent on the Restate backend (see `backend.rs`): its service endpoint
/// started and registered, its runs sent to Restate.
#[cfg(feature = "restate")]
#[allow(clippy::too_many_arguments)]
async fn restate_route(
    app: Router<AppState>,
    path: &str,
    name: &str,
    cfg: &crate::config::AgentConfig,
    spec: crate::providers::ProviderSpec,
    store: &SqliteStore,
    server: &crate::config::ServerSection,
    run_timeout: Duration,
    endpoint: &EndpointOptions,
    runs: &Arc<Semaphore>,
    shutdown: &CancellationToken,
    (node, token): (&Arc<std::sync::OnceLock<String>>, Option<&str>),
    shared: Shared,
) -> Result<Routed, String> {
    let info = AgentInfo {
        name: name.to_owned(),
        description: cfg.description.clone(),
        model: match &spec {
            crate::providers::ProviderSpec::Local(l) => l.model_name.clone(),
            other => other.kind().to_owned(),
        },
        tools: tether::Handler::tools(&crate::handler::ServeHandler::new(cfg)?)
            .into_iter()
            .map(|t| t.name)
            .collect(),
    };
    let (agent, service) = crate::backend::start(
        name,
        cfg,
        spec,
        (store, shared),
        server,
        run_timeout,
        (node.clone(), token.map(str::to_owned)),
    )
    .await?;
    let check: Arc<dyn ResumeCheck> = agent.clone();
    let options = endpoint
        .clone()
        .with_admit(admission(check, runs.clone(), shutdown.clone()));
    let follow = agent.clone();
    let live = move |Path(thread): Path<String>, headers: HeaderMap| {
        let agent = follow.clone();
        async move { live_route(&agent, &thread, &headers) }
    };
    Ok((
        app.route_agui_with(path, agent, options)
            .route("/v1/threads/{thread}/live", get(live)),
        info,
        Box::pin(service.stop()),
    ))
}

/// `GET /v1/threads/{id}/live` (Restate backend): the live events of the thread's turn running
/// on this node's service, for a relay on another node (see `backend::RestateAgent::live_lines`).
#[cfg(feature = "restate")]
fn live_route(agent: &crate::backend::RestateAgent, thread: &str, headers: &HeaderMap) -> Response {
    let Ok(id) = tether::ThreadId::new(thread) else {
        return json_error(
            StatusCode::NOT_FOUND,
            "THREAD_NOT_FOUND",
            format!("no thread {} (see GET /v1/threads)", printable(thread)),
        );
    };
    // The guard let a request with the follow header through without the token: its credential
    // is checked here, where the thread is known. A request with the token got here by it.
    if let Some(given) = headers.get(crate::backend::FOLLOW_HEADER)
        && !agent.may_follow(&id, given.to_str().ok())
    {
        return json_error(
            StatusCode::UNAUTHORIZED,
            "UNAUTHORIZED",
            "the follow credential is wrong (the nodes of a cluster must share one token)",
        );
    }
    let lines = agent.live_lines(id);
    let body = futures_util::stream::unfold(lines, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    (
        [(axum::http::header::CONTENT_TYPE, "application/x-ndjson")],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

/// Without the `restate` feature the backend is a configuration error a person can act on.
#[cfg(not(feature = "restate"))]
#[allow(clippy::too_many_arguments)]
async fn restate_route(
    _app: Router<AppState>,
    _path: &str,
    _name: &str,
    _cfg: &crate::config::AgentConfig,
    _spec: crate::providers::ProviderSpec,
    _store: &SqliteStore,
    _server: &crate::config::ServerSection,
    _run_timeout: Duration,
    _endpoint: &EndpointOptions,
    _runs: &Arc<Semaphore>,
    _shutdown: &CancellationToken,
    _node: (&Arc<std::sync::OnceLock<String>>, Option<&str>),
    _shared: Shared,
) -> Result<Routed, String> {
    Err(
        "[server] backend = \"restate\" needs tether serve built with the `restate` cargo feature \
         (cargo build -p tether-serve --features restate)"
            .into(),
    )
}

/// The admission of one agent's runs, once the request body is read (a client still sending
/// its body holds no run slot): not while shutting down (503), within the concurrent-run limit
/// (429; the slot lives as long as the run's stream), and a resume only for interrupts
/// outstanding on the thread (409, see `tether_agui::approval`).
fn admission(agent: Arc<dyn ResumeCheck>, runs: Arc<Semaphore>, shutdown: CancellationToken) -> Admit {
    Admit::new(move |input: &RunAgentInput| {
        if shutdown.is_cancelled() {
            return refuse(json_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "SHUTTING_DOWN",
                "the server is shutting down and takes no new runs; retry against its replacement",
            ));
        }
        let Ok(permit) = runs.clone().try_acquire_owned() else {
            let mut r = json_error(
                StatusCode::TOO_MANY_REQUESTS,
                "TOO_MANY_RUNS",
                "the server is at its concurrent-run limit (max_concurrent_runs); retry shortly",
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return refuse(r);
        };
        let guard = StreamGuard::new(permit);
        if input.resume.is_empty() {
            return Box::pin(std::future::ready(Ok(Some(guard))));
        }
        let agent = agent.clone();
        let input = input.clone();
        Box::pin(async move {
            match agent.check(&input).await {
                Ok(()) => Ok(Some(guard)),
                Err(tether_agui::CheckError::Refused(r)) => {
                    Err(json_error(r.status(), r.code(), r.to_string()))
                }
                Err(tether_agui::CheckError::Store(e)) => Err(json_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "STORE",
                    e.to_string(),
                )),
                Err(e) => Err(json_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "INTERNAL",
                    format!("{e:?}"),
                )),
            }
        })
    })
}

/// How many threads of an ACP agent keep their agent process between requests (the rest
/// reload their session with `session/load` on their next request).
const ACP_LIVE_THREADS: usize = 16;

/// An agent served by [`ThreadAgent`], whatever its provider: each request opens the thread's
/// session from the store (the provider resumes it: a local loop from its checkpoint and the
/// events after it, Managed Agents and AgentCore by their session id, an ACP agent with
/// `session/load`), the approval interrupts are the adapter's, and an ACP agent's permission
/// requests (and an MCP server's elicitations) end the run with an interrupt while the turn waits.
fn thread_agent(
    name: &str,
    cfg: &crate::config::AgentConfig,
    spec: crate::providers::ProviderSpec,
    store: &SqliteStore,
    run_timeout: Duration,
    priority: Option<&tether::priority::Priority>,
) -> Result<(Arc<ServedAgent>, AgentInfo), String> {
    use crate::handler::{ServeHandler, schema_or_empty};
    use crate::providers::ProviderSpec;
    // Checked once here, so a bad workspace is a start-up error rather than every run's.
    let handler = ServeHandler::new(cfg)?;
    let mut tools: Vec<String> = tether::Handler::tools(&handler)
        .into_iter()
        .map(|t| t.name)
        .collect();
    if let Some(t) = &cfg.terminal_tool {
        tools.push(t.name.clone());
    }
    let model = match &spec {
        ProviderSpec::Local(l) => l.model_name.clone(),
        ProviderSpec::Anthropic { model, .. } => model.clone(),
        other => other.kind().to_owned(),
    };
    let info = AgentInfo {
        name: name.to_owned(),
        description: cfg.description.clone(),
        model: model.clone(),
        tools,
    };
    let frontend: Vec<tether::ToolSpec> = cfg
        .frontend_tools
        .iter()
        .map(|t| tether::ToolSpec::new(&t.name, &t.description, schema_or_empty(t.parameters.clone())))
        .collect();
    let mut config = tether::SessionConfig::default()
        .with_max_turns(cfg.max_turns.max(1))
        // Bounded by the config check (at most a week), so the sum cannot overflow.
        .with_tool_timeout(Some(Duration::from_secs(
            cfg.tool_timeout_secs.clamp(1, crate::config::MAX_DURATION_SECS) + 5,
        )));
    config.terminal_tool = cfg
        .terminal_tool
        .as_ref()
        .map(|t| tether::ToolSpec::new(&t.name, &t.description, schema_or_empty(t.parameters.clone())));
    let keep_alive = if matches!(spec, ProviderSpec::Acp { .. }) {
        ACP_LIVE_THREADS
    } else {
        0
    };
    let agent_cfg = cfg.clone();
    let agent_name: Arc<str> = Arc::from(name);
    // The local loop's open only prepares its history: a new thread is then claimed, given its
    // provider session and its first messages in one store step (one wait at the store's
    // writer before the first model request, not two). A remote loop's open creates a session
    // on its service, so it must not run before the claim.
    let opens_locally = matches!(spec, ProviderSpec::Local(_) | ProviderSpec::Anthropic { .. });
    let factory = move |_input: &RunAgentInput| -> tether::Result<tether::SessionBuilder> {
        let provider = spec
            .build()
            .map_err(|m| tether::Error::config(tether::ConfigKind::Invalid, m))?;
        let handler = ServeHandler::new(&agent_cfg)
            .map_err(|m| tether::Error::config(tether::ConfigKind::Invalid, m))?;
        let mut builder = tether::Session::builder_boxed(provider)
            .handler(handler)
            .config(config.clone());
        if opens_locally {
            builder = builder.provider_opens_locally();
        }
        Ok(builder)
    };
    let store: Arc<dyn tether::ThreadStore> = Arc::new(store.clone());
    let mut agent = ThreadAgent::new(name, store, factory);
    if let Some(p) = priority {
        agent = agent.priority(p.clone());
    }
    let agent = agent
        .frontend_tools(frontend)
        .model(model)
        .run_timeout(run_timeout)
        .keep_alive(keep_alive)
        // Traced (GenAI spans, named after the agent) when telemetry is on: attached once the
        // session is open, after the tracer read the thread's trace state, so a resumed run
        // links to the runs before it from its first span.
        .on_open(move |sink| {
            let agent = agent_name.clone();
            Box::pin(async move {
                tether_otel::attach_global(sink, &agent).await;
            })
        })
        .with_state(panel);
    Ok((Arc::new(agent), info))
}

/// The state panel the web UI shows next to a run (`STATE_SNAPSHOT`, then `STATE_DELTA`s): the
/// agent and thread, the run's status (`running`, then `idle` or `waiting`), the model turns it
/// took and each tool call's state (`called`, `done`, `error`). Whatever else the client's
/// state holds is kept.
pub(crate) fn panel(state: &mut Value, update: Update<'_>) -> bool {
    if !state.is_object() {
        *state = json!({});
    }
    let Value::Object(s) = state else {
        return false;
    };
    match update {
        Update::Started { agent, thread } => {
            s.insert("agent".into(), json!(agent));
            s.insert("thread".into(), json!(thread));
            s.insert("status".into(), json!("running"));
            s.insert("turns".into(), json!(0));
            s.insert("tools".into(), json!({}));
            true
        }
        Update::Finished { waiting } => {
            s.insert("status".into(), json!(if waiting { "waiting" } else { "idle" }));
            true
        }
        Update::Event(ev) => {
            let tools = s.entry("tools").or_insert_with(|| json!({}));
            if !tools.is_object() {
                *tools = json!({});
            }
            match &ev.kind {
                tether::EventKind::Message {
                    role: tether::Role::Assistant,
                    tool_uses,
                    ..
                } if ev.is_durable() => {
                    if let Value::Object(t) = tools {
                        for u in tool_uses {
                            t.insert(u.id.clone(), json!({"name": u.name, "status": "called"}));
                        }
                    }
                    let turns = s.get("turns").and_then(Value::as_u64).unwrap_or(0) + 1;
                    s.insert("turns".into(), json!(turns));
                    true
                }
                tether::EventKind::ToolCall { tool_use, .. } => {
                    if let Value::Object(t) = tools
                        && !t.contains_key(&tool_use.id)
                    {
                        t.insert(
                            tool_use.id.clone(),
                            json!({"name": tool_use.name, "status": "called"}),
                        );
                        return true;
                    }
                    false
                }
                tether::EventKind::ToolResult { result } => {
                    let status = if result.is_error { "error" } else { "done" };
                    if let Value::Object(t) = tools {
                        let name = t
                            .get(&result.tool_use_id)
                            .and_then(|v| v.get("name"))
                            .cloned()
                            .unwrap_or_else(|| json!(""));
                        t.insert(
                            result.tool_use_id.clone(),
                            json!({"name": name, "status": status}),
                        );
                    }
                    true
                }
                _ => false,
            }
        }
        _ => false,
    }
}

fn refuse(
    r: Response,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = tether_agui::server::Admission> + Send>> {
    Box::pin(std::future::ready(Err(r)))
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
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: CancellationToken,
    stopped_accepting: CancellationToken,
) {
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
    stopped_accepting.cancel();
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

/// The AG-UI events a run keeps for a client that reads slower than the model writes (the
/// library's default is 16,384). A run past it waits for the client, and the model's stream
/// with it; so a stalled client holds at most about twice this many events (~0.5 MB) for up to
/// the run's timeout, not megabytes, on each of `max_concurrent_runs`.
const RUN_EVENT_BUFFER: usize = 1024;

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

/// A client-supplied string for an error message: at most 100 characters, control characters
/// escaped (it may end up on a terminal).
fn printable(s: &str) -> String {
    let mut out: String = s
        .chars()
        .take(100)
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect();
    if s.chars().nth(100).is_some() {
        out.push('…');
    }
    out
}

/// Whether a `Host` value (`name[:port]`, `[v6][:port]`) names this machine's loopback:
/// `localhost` (any case, with or without the root's trailing dot), an IPv4 address in
/// 127.0.0.0/8, `[::1]` or an IPv4-mapped 127/8 address. Any port. `*.localhost` is refused: not
/// every resolver keeps those names on the machine. No allocation.
pub(crate) fn is_loopback_host(host: &str) -> bool {
    if let Some(rest) = host.strip_prefix('[') {
        let Some((addr, tail)) = rest.split_once(']') else {
            return false;
        };
        if !(tail.is_empty() || tail.strip_prefix(':').is_some_and(is_port)) {
            return false;
        }
        return addr
            .parse::<Ipv6Addr>()
            .is_ok_and(|a| IpAddr::V6(a).to_canonical().is_loopback());
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if is_port(port) => name,
        Some(_) => return false,
        None => host,
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    name.eq_ignore_ascii_case("localhost") || name.parse::<Ipv4Addr>().is_ok_and(|a| a.is_loopback())
}

fn is_port(p: &str) -> bool {
    !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
}

/// Whether `origin` is the origin of a page served by this server under `host` (the request's
/// `Host`): `http://` or `https://` (behind a TLS proxy) followed by exactly that host.
fn same_origin(origin: &str, host: &str) -> bool {
    let strip = |scheme: &str| {
        origin
            .get(..scheme.len())
            .filter(|p| p.eq_ignore_ascii_case(scheme))
            .and_then(|_| origin.get(scheme.len()..))
    };
    match strip("https://").or_else(|| strip("http://")) {
        Some(rest) => !rest.is_empty() && rest.eq_ignore_ascii_case(host),
        None => false,
    }
}

/// The request's single `Host`, when it has exactly one and it is text.
fn request_host(req: &Request) -> Option<&str> {
    let mut all = req.headers().get_all(header::HOST).iter();
    let first = all.next()?;
    if all.next().is_some() {
        return None;
    }
    let host = first.to_str().ok()?;
    // An absolute-form target (`GET http://name/ HTTP/1.1`) names the host too: both must agree.
    match req.uri().authority() {
        Some(a) if !a.as_str().eq_ignore_ascii_case(host) => None,
        _ => Some(host),
    }
}

/// Paths served without a token: the UI (which then asks for the token) and the health check.
/// A peer node following a turn: `GET /v1/threads/{id}/live` with the follow credential, which
/// the route checks against the thread (the token itself is not sent to peers).
fn follows_with_credential(req: &Request) -> bool {
    #[cfg(feature = "restate")]
    {
        let path = req.uri().path();
        req.method() == Method::GET
            && req.headers().contains_key(crate::backend::FOLLOW_HEADER)
            && path.starts_with("/v1/threads/")
            && path.ends_with("/live")
            && path.matches('/').count() == 4
    }
    #[cfg(not(feature = "restate"))]
    {
        let _ = req;
        false
    }
}

fn is_public(path: &str) -> bool {
    path == "/" || path == "/healthz" || path.starts_with("/assets/")
}

/// Whether a browser request without `Origin` came from another site in a way that must be
/// refused: a subresource (`<script>`, `<img>`, a no-cors fetch) another site's page made. A
/// top-level navigation (the user following a link) is allowed: the page that linked cannot read
/// the answer.
fn cross_site_without_origin(h: &HeaderMap) -> bool {
    let Some(site) = h.get("sec-fetch-site") else {
        return false;
    };
    match site.as_bytes() {
        b"same-origin" | b"none" => false,
        _ => {
            let navigate = h
                .get("sec-fetch-mode")
                .is_some_and(|v| v.as_bytes() == b"navigate");
            let document = h
                .get("sec-fetch-dest")
                .is_some_and(|v| v.as_bytes() == b"document");
            !(navigate && document)
        }
    }
}

fn forbidden(code: &str, message: String) -> Response {
    let mut r = json_error(StatusCode::FORBIDDEN, code, message);
    r.headers_mut()
        .insert(header::VARY, HeaderValue::from_static("Origin"));
    r
}

/// The trust boundary, on every request: Host, Origin (and CORS for the allowed ones), token.
async fn guard(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let b = &st.boundary;
    let host = request_host(&req);
    if b.loopback_only && !host.is_some_and(is_loopback_host) {
        return forbidden(
            "HOST_NOT_ALLOWED",
            format!(
                "this server listens on a loopback address and serves only requests for localhost, 127.0.0.1                  or [::1]; this one was for `{}`. (A web page reaching it under another name is refused: DNS                  rebinding.)",
                printable(host.unwrap_or("(no or several Host headers)"))
            ),
        );
    }
    let headers = req.headers();
    let mut cors: Option<HeaderValue> = None;
    match headers.get(header::ORIGIN) {
        Some(o) => {
            let text = o.to_str().unwrap_or("");
            if !host.is_some_and(|h| same_origin(text, h)) {
                if !b.allowed_origins.iter().any(|a| a.eq_ignore_ascii_case(text)) {
                    return forbidden(
                        "ORIGIN_NOT_ALLOWED",
                        format!(
                            "requests from pages of {} are refused; list the origin in [server] allowed_origins to                              allow it",
                            printable(text)
                        ),
                    );
                }
                cors = Some(o.clone());
            }
        }
        None if cross_site_without_origin(headers) => {
            return forbidden(
                "ORIGIN_NOT_ALLOWED",
                "a request another site's page made (Sec-Fetch-Site) is refused".into(),
            );
        }
        None => {}
    }
    if let Some(origin) = &cors
        && req.method() == Method::OPTIONS
        && headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
    {
        return preflight(origin.clone(), headers);
    }
    if let Some(token) = &b.token
        && !is_public(req.uri().path())
        && !follows_with_credential(&req)
    {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if !given.is_some_and(|g| same(g.as_bytes(), token.as_bytes())) {
            let mut r = json_error(
                StatusCode::UNAUTHORIZED,
                "UNAUTHORIZED",
                if given.is_some() {
                    "the bearer token is wrong"
                } else {
                    "this server requires a bearer token: send Authorization: Bearer <token> (tether serve \
                     prints a URL carrying it when it starts)"
                },
            );
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            if let Some(o) = cors {
                allow_origin(&mut r, o);
            }
            return r;
        }
    }
    let mut resp = next.run(req).await;
    if let Some(o) = cors {
        allow_origin(&mut resp, o);
    }
    resp
}

/// The CORS headers of an answer to an allowed origin.
fn allow_origin(r: &mut Response, origin: HeaderValue) {
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("Retry-After, WWW-Authenticate"),
    );
    h.append(header::VARY, HeaderValue::from_static("Origin"));
}

/// The answer to an allowed origin's preflight: GET and POST, with a bearer token and a JSON
/// body. (Chrome's Private Network Access asks too when a public page calls a local server: an
/// origin the user listed may.)
fn preflight(origin: HeaderValue, req: &HeaderMap) -> Response {
    let mut r = StatusCode::NO_CONTENT.into_response();
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST"),
    );
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static("Authorization, Content-Type, Accept"),
    );
    h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    h.insert(
        header::VARY,
        HeaderValue::from_static("Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
    );
    if req
        .get("access-control-request-private-network")
        .is_some_and(|v| v.as_bytes() == b"true")
    {
        h.insert(
            "access-control-allow-private-network",
            HeaderValue::from_static("true"),
        );
    }
    r
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

fn thread_json(t: &tether::Thread) -> Value {
    json!({
        "threadId": t.id,
        "agent": t.agent,
        "title": t.title,
        "createdMs": t.created_ms,
        "updatedMs": t.updated_ms,
    })
}

async fn list_threads(State(st): State<AppState>, Query(q): Query<ThreadsQuery>) -> Response {
    match tether::ThreadStore::threads(&*st.store, q.agent.as_deref()).await {
        Ok(ts) => {
            axum::Json(json!({"threads": ts.iter().map(thread_json).collect::<Vec<_>>()})).into_response()
        }
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, "STORE", e.to_string()),
    }
}

async fn load_thread(st: &AppState, thread: &str) -> Result<(tether::Thread, Vec<tether::Event>), Response> {
    let Ok(id) = tether::ThreadId::new(thread) else {
        return Err(json_error(
            StatusCode::NOT_FOUND,
            "THREAD_NOT_FOUND",
            format!("no thread {} (see GET /v1/threads)", printable(thread)),
        ));
    };
    let rec = match tether::ThreadStore::thread(&*st.store, &id).await {
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
    match tether::EventStore::load(&*st.store, &rec.record).await {
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
            "sessionId": rec.record,
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
            "messages": tether_agui::thread_messages(&events),
        }))
        .into_response(),
        Err(r) => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every concurrent run holds its future in its task: keep it small (the adapter and the
    /// engine box their futures where they are awaited).
    #[tokio::test]
    async fn a_runs_future_stays_small() {
        let store = SqliteStore::open_in_memory().unwrap();
        let cfg: Config =
            toml::from_str("[agents.a]\nmodel = \"m\"\nbase_url = \"http://127.0.0.1:1/v1\"\n").unwrap();
        let (_, acfg) = cfg.agents.iter().next().unwrap();
        let spec = acfg.provider_spec("a").unwrap();
        let (agent, _) = thread_agent("a", acfg, spec, &store, Duration::from_secs(5), None).unwrap();
        let input: RunAgentInput =
            serde_json::from_value(json!({"threadId": "t", "runId": "r", "messages": []})).unwrap();
        let (mut ctx, _rx) = tether_agui::RunContext::<Value>::new(input, &Default::default());
        let f = tether_agui::Agent::run(agent.as_ref(), &mut ctx);
        let size = std::mem::size_of_val(&f);
        assert!(size <= 6 * 1024, "the run future is {size} bytes");
    }

    #[test]
    fn loopback_hosts() {
        for h in [
            "localhost",
            "LOCALHOST:7878",
            "localhost.:1",
            "127.0.0.1",
            "127.0.0.1:7878",
            "127.1.2.3:80",
            "[::1]",
            "[::1]:7878",
            "[::ffff:127.0.0.1]:7878",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "",
            "attacker.example",
            "attacker.example:7878",
            "localhost.attacker.example",
            "a.localhost",
            "127.0.0.1.nip.io",
            "127.0.0.1:",
            "127.0.0.1:x",
            "127.0.0.1:123456",
            "128.0.0.1",
            "0.0.0.0:7878",
            "10.0.0.1",
            "[::2]:1",
            "[::1",
            "[::1]x",
            "::1",
            "localhost:7878:1",
            "localhost@evil",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn origins() {
        assert!(same_origin("http://127.0.0.1:7878", "127.0.0.1:7878"));
        assert!(same_origin("HTTPS://LOCALHOST:1", "localhost:1"));
        assert!(!same_origin("http://127.0.0.1:7879", "127.0.0.1:7878"));
        assert!(!same_origin("http://localhost:7878", "127.0.0.1:7878"));
        assert!(!same_origin("null", "127.0.0.1:7878"));
        assert!(!same_origin("http://", ""));
        assert!(!same_origin("ftp://127.0.0.1:7878", "127.0.0.1:7878"));
    }

    #[test]
    fn printable_escapes_and_truncates() {
        assert_eq!(printable("a\u{1b}[2Kb"), "a\\u{1b}[2Kb");
        assert_eq!(printable(&"x".repeat(200)).chars().count(), 101);
    }

    proptest::proptest! {
        /// Whatever a client puts in `Host`, the check never panics, and anything it accepts
        /// is a loopback name or address.
        #[test]
        fn any_host_is_checked_without_panicking(h in "\\PC{0,60}") {
            if is_loopback_host(&h) {
                let lower = h.to_ascii_lowercase();
                proptest::prop_assert!(
                    lower.starts_with("localhost") || lower.starts_with("127.") || lower.starts_with('[')
                );
            }
            let _ = same_origin(&h, "localhost");
        }
    }
}
