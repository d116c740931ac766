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
//! restarts: each request rebuilds the session from its checkpoint and the events recorded after
//! it, answers pending tool uses from the tool-result memo, and re-sends a user message that a
//! crash left unanswered. A tool that needs the user's approval ends the run with an AG-UI
//! interrupt; the next request's `resume[]` carries the answer.

#![warn(missing_docs)]

mod agent;
pub mod config;
mod handler;
mod model;
mod rebuild;
mod server;
mod ui;

use std::path::PathBuf;
use std::process::ExitCode;

pub use config::{Config, ConfigError};
pub use server::{ServeError, Server, ServerOptions, start};

/// The arguments of `tether serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// The agents' configuration file (default: ./tether.toml when it exists; otherwise one agent,
    /// `default`, on $OPENAI_BASE_URL / $OPENAI_API_KEY / $TETHER_MODEL with the workspace tools
    /// over the current directory, writes and commands only when approved in the browser).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The address to listen on. A non-loopback address requires a token.
    #[arg(long, default_value = "127.0.0.1:7878")]
    pub bind: String,
    /// The SQLite database holding every session.
    #[arg(long, default_value = "tether.db")]
    pub db: PathBuf,
    /// The bearer token every /v1/ route requires.
    #[arg(long, env = "TETHER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
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
    Ok(cfg)
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
    let opts = ServerOptions {
        config,
        bind: args.bind.clone(),
        db: args.db.clone(),
        token: args.token.clone(),
    };
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
