//! # tether-serve
//!
//! `tether serve`: agents defined in one TOML file ([`config`]), every session kept durably in
//! SQLite (`tether-sqlite`), an AG-UI endpoint per agent, a small JSON API, and a web UI embedded
//! in the binary.
//!
//! Routes: `POST /v1/agents/{agent}/run` (AG-UI: `RunAgentInput` in, SSE or protobuf out),
//! `GET /v1/agents`, `GET /v1/threads?agent=…`, `GET /v1/threads/{thread}/events`,
//! `GET /v1/threads/{thread}/messages`, `GET /healthz`, and the UI at `/`.
//!
//! Threads (AG-UI `threadId`) map to sessions in the database and resume across requests and
//! restarts. Every agent, whatever its provider (`openai`, `gguf`, `anthropic`, `managed`,
//! `agentcore`, `acp`; built by [`providers`]), is served by `tether_agui::ThreadAgent`, whose
//! sessions the engine resumes through the `Provider` seam (a local loop rebuilds its history
//! from its checkpoint and the events after it; pending tool uses are answered from the
//! tool-result memo). A tool that needs the user's approval ends the run with an AG-UI
//! interrupt; the next request's `resume[]` carries the answer. This crate keeps the config,
//! the routes, the trust boundary, the limits and the UI; no session logic.
//!
//! ```
//! use std::path::Path;
//! let config = tether_serve::Config::parse(
//!     r#"
//!     [agents.coder]
//!     provider = "openai"
//!     base_url = "http://127.0.0.1:8080/v1"
//!     model = "qwen3"
//!     "#,
//!     "tether.toml",
//!     Path::new("."),
//! )?;
//! assert!(config.agents.contains_key("coder"));
//! // tether_serve::start(config, options) then serves it (see [`Server`]).
//! # Ok::<(), tether_serve::ConfigError>(())
//! ```

#![deny(missing_docs)]

#[cfg(feature = "restate")]
mod backend;
pub mod config;
mod handler;
mod model;
pub mod providers;
mod server;
mod ui;

use std::path::PathBuf;
use std::process::ExitCode;

/// The jemalloc options the `tether-serve` and `tether` binaries compile in (each exports it as
/// `_rjem_malloc_conf`, the symbol tikv-jemalloc-sys's jemalloc reads at its start): freed pages
/// go back to the system 20 ms after they were freed instead of 10 s. With jemalloc's defaults a
/// burst of runs kept ~10 KiB more peak memory per run than glibc's malloc; with these, as much
/// as glibc's, still faster than it (BENCHMARKS.md, "The allocator"). `_RJEM_MALLOC_CONF` in the
/// environment overrides them (`dirty_decay_ms:10000` for the defaults' speed).
pub const JEMALLOC_CONF: &[u8; 35] = b"dirty_decay_ms:20,muzzy_decay_ms:0\0";

pub use config::{Config, ConfigError};
pub use server::{ServeError, Server, ServerOptions, start};

#[cfg(feature = "restate")]
pub use backend::{FOLLOW_HEADER, follow_credential};

/// The arguments of `tether serve`.
#[derive(Debug, Clone, clap::Args)]
// The field docs are `tether serve --help` text too: "[server]" there names the TOML section,
// not a Rust item, so rustdoc's link lint is quieted rather than the help text changed.
#[allow(rustdoc::private_intra_doc_links)]
pub struct ServeArgs {
    /// The agents' configuration file (default: ./tether.toml when it exists; otherwise one agent,
    /// `default`, on $OPENAI_BASE_URL / $OPENAI_API_KEY / $TETHER_MODEL with the workspace tools
    /// over the current directory, writes and commands only when approved in the browser).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The address to listen on. On a loopback address only requests naming a loopback host
    /// (`localhost`, 127.x.y.z, `[::1]`) are served; a non-loopback address requires a token.
    #[arg(long, default_value = "127.0.0.1:7878")]
    pub bind: String,
    /// The SQLite database holding every session.
    #[arg(long, default_value = "tether.db")]
    pub db: PathBuf,
    /// The bearer token every /v1/ route requires. Without it (and without --no-token) a random
    /// token is generated at start and printed once, in the UI's URL.
    #[arg(long, env = "TETHER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Serve /v1/ without a token (loopback binds only): any program of any user on this
    /// machine can then drive the agents and their tools. Web pages still cannot (Host and
    /// Origin checks).
    #[arg(long)]
    pub no_token: bool,
    /// Largest request body in bytes (overrides [server] max_body_bytes).
    #[arg(long)]
    pub max_body_bytes: Option<usize>,
    /// Longest run in seconds (overrides [server] run_timeout_secs).
    #[arg(long)]
    pub run_timeout: Option<u64>,
    /// Most concurrent runs (overrides [server] max_concurrent_runs).
    #[arg(long)]
    pub max_concurrent_runs: Option<usize>,
    /// Seconds running turns get to finish on shutdown (overrides [server] shutdown_grace_secs).
    #[arg(long)]
    pub shutdown_grace: Option<u64>,
    /// Where turns run (overrides [server] backend): `sqlite` (in this process, the default) or
    /// `restate` (durable invocations on a Restate cluster; see the tether-restate README).
    #[arg(long, value_enum)]
    pub backend: Option<config::Backend>,
}

/// Resolves the configuration the arguments name.
pub fn load_config(args: &ServeArgs) -> Result<Config, ConfigError> {
    let mut cfg = match &args.config {
        Some(p) => Config::load(p)?,
        None if std::path::Path::new("tether.toml").exists() => {
            Config::load(std::path::Path::new("tether.toml"))?
        }
        None => {
            let cwd = std::env::current_dir().map_err(|source| ConfigError::Read {
                path: ".".into(),
                source,
            })?;
            Config::default_for(&cwd)
        }
    };
    if let Some(n) = args.max_body_bytes {
        cfg.server.max_body_bytes = n.max(1);
    }
    if let Some(n) = args.run_timeout {
        cfg.server.run_timeout_secs = n.max(1);
    }
    if let Some(n) = args.max_concurrent_runs {
        cfg.server.max_concurrent_runs = n.max(1);
    }
    if let Some(n) = args.shutdown_grace {
        cfg.server.shutdown_grace_secs = n;
    }
    if let Some(b) = args.backend {
        cfg.server.backend = b;
    }
    // Again after the overrides: a command-line duration is bounded like a configured one.
    let origin = args
        .config
        .as_ref()
        .map(|p| format!("{} (with the command-line options)", p.display()))
        .unwrap_or_else(|| "the command-line options".into());
    cfg.check(&origin)?;
    Ok(cfg)
}

/// A fresh bearer token: 192 bits from the operating system's random source, as 48 hex digits.
pub fn generate_token() -> std::io::Result<String> {
    use rand::TryRngCore;
    let mut b = [0u8; 24];
    rand::rngs::OsRng
        .try_fill_bytes(&mut b)
        .map_err(|e| std::io::Error::other(format!("the OS random source failed: {e}")))?;
    Ok(hex(&b))
}

pub(crate) fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

/// The token `tether serve` runs with: `--token`/`TETHER_TOKEN` when given (and not empty), none
/// with `--no-token`, otherwise a generated one (the `bool` says so: its URL is printed).
fn resolve_token(args: &ServeArgs) -> Result<(Option<String>, bool), String> {
    let given = args.token.clone().filter(|t| !t.trim().is_empty());
    match (given, args.no_token) {
        (Some(_), true) => {
            Err("--no-token and a token (--token or TETHER_TOKEN) were both given: drop one".into())
        }
        (Some(t), false) => Ok((Some(t), false)),
        (None, true) => Ok((None, false)),
        (None, false) => generate_token()
            .map(|t| (Some(t), true))
            .map_err(|e| format!("cannot generate a token: {e}")),
    }
}

/// Runs `tether serve` until SIGINT or SIGTERM; then stops taking runs and lets running turns
/// finish (up to the grace period). Exit code 0 after a clean stop, 2 when it could not start.
pub async fn serve(args: ServeArgs) -> ExitCode {
    let config = match load_config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tether serve: {e}");
            return ExitCode::from(2);
        }
    };
    for w in config.sandbox_warnings() {
        eprintln!("tether serve: warning: {w}");
    }
    let (token, generated) = match resolve_token(&args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("tether serve: {e}");
            return ExitCode::from(2);
        }
    };
    let opts = ServerOptions::new(config, args.bind.clone(), args.db.clone()).with_token(token.clone());
    let server = match start(opts).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tether serve: {e}");
            return ExitCode::from(2);
        }
    };
    eprintln!(
        "tether serve: listening on http://{} (database {})",
        server.addr(),
        args.db.display()
    );
    // The only place the generated token is shown. In the URL's fragment: a browser never sends
    // a fragment to a server, so it stays out of access logs and Referer headers; the UI takes it
    // from there, keeps it in the tab's sessionStorage and removes it from the address bar.
    // On 0.0.0.0 / [::] the browser on this machine reaches it on loopback.
    let mut shown = server.addr();
    if shown.ip().is_unspecified() {
        shown.set_ip(match shown.ip() {
            std::net::IpAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::IpAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let ui = format!("http://{shown}/");
    match (&token, generated) {
        (Some(t), true) => eprintln!("tether serve: open {ui}#token={t}"),
        (Some(_), false) => eprintln!("tether serve: open {ui} (token from --token / TETHER_TOKEN)"),
        (None, _) => {
            eprintln!("tether serve: open {ui} (--no-token: any program on this machine can use this server)")
        }
    }
    let stop = async {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = term.recv() => {}
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    };
    stop.await;
    eprintln!("tether serve: shutting down");
    server.shutdown();
    server.wait().await;
    ExitCode::SUCCESS
}
