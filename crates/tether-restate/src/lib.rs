//! # tether-restate
//!
//! Threads on [Restate](https://restate.dev): a tether thread is a Restate virtual object keyed
//! by its thread id, a turn is one exclusive invocation on it, and every model call and every
//! tool call of the turn is a journaled step (`ctx.run`), so a crash of the service never runs a
//! recorded step again. See the crate README for the design.
//!
//! - [`object::TetherThread`]: the virtual object (`turn`, `approve`, `waiting`, `running`,
//!   `cancel`).
//! - [`steps`]: the seam between tether's engine and the journal ([`steps::StepModel`],
//!   [`steps::StepHandler`]): the engine stays ordinary async Rust, and only this crate knows
//!   the 0.x SDK.
//! - [`record`], [`store::RestateStore`], [`notes`], [`index`]: the thread's record is the
//!   object's own state (written with the journal, read through shared handlers by any tether
//!   node), its front-end bookkeeping a second per-thread object, its listing an index per agent.
//! - [`shared::SharedRecord`]: or the record in a PostgreSQL database every node reaches
//!   ([`TetherThread::shared_record`], [`RestateStore::with_shared`]): Restate then stores each
//!   turn's steps and a few small keys, and reads of records never queue on Restate.
//! - [`serve`] and [`register`]: the HTTP endpoint on a listener, and its registration with the
//!   Restate admin API.
//!
//! The service over an OpenAI-compatible model, with no tools (the record is the object's state),
//! served on
//! a listener (a real deployment then calls [`register`] with the Restate admin URL, and sends
//! turns to the ingress: `POST /TetherThread/{thread}/turn`); its health check answers without
//! a Restate server:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use tether::NoTools;
//! use tether_openai::OpenAiModel;
//! use tether_restate::TetherThread;
//!
//! let model = OpenAiModel::builder("http://127.0.0.1:8000/v1").model("qwen3").build()?;
//! let thread =
//!     TetherThread::new("assistant", Arc::new(model), Arc::new(NoTools)).system_prompt("Answer briefly.");
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let addr = listener.local_addr()?;
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let server = tokio::spawn(tether_restate::serve_until(thread, listener, async {
//!     let _ = stopped.await;
//! }));
//! // Restate calls a deployment over HTTP/2.
//! let http2 = reqwest::Client::builder().http2_prior_knowledge().build()?;
//! let health = http2.get(format!("http://{addr}/health")).send().await?;
//! assert!(health.status().is_success());
//! let _ = stop.send(());
//! server.await?;
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

// The object macro generates undocumented items (its service trait and `serve`).
pub mod hub;
#[allow(missing_docs)]
pub mod index;
#[allow(missing_docs)]
pub mod notes;
#[allow(missing_docs)]
pub mod object;
pub mod record;
pub mod shared;
pub mod steps;
pub mod store;

use std::time::Duration;

use restate_sdk::prelude::Endpoint;
use tokio::net::TcpListener;

pub use hub::ThreadHub;
pub use index::TetherThreads;
pub use notes::TetherThreadNotes;
pub use object::{
    Attempt, LiveDrafts, LiveEvent, LivePart, OnAttempt, Progress, TetherThread, ThreadStatus, TurnOutcome,
    TurnRequest, TurnSignal, WaitingToolUse, live_part,
};
pub use shared::SharedRecord;
pub use steps::Decision;
pub use store::RestateStore;

/// The virtual object's service name in Restate (`/TetherThread/{thread}/turn` at the ingress).
pub const SERVICE: &str = "TetherThread";
/// The service name of a thread's notes object ([`notes::TetherThreadNotes`], keyed by thread).
pub const NOTES: &str = "TetherThreadNotes";
/// The service name of the thread index ([`index::TetherThreads`], keyed by agent).
pub const INDEX: &str = "TetherThreads";

/// Why the service could not be registered with Restate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// The admin API could not be reached before the deadline.
    #[error("the Restate admin API at {admin} could not be reached within {waited:?}: {message}")]
    Unreachable {
        /// The admin URL.
        admin: String,
        /// How long registration kept trying.
        waited: Duration,
        /// The last failure.
        message: String,
    },
    /// The deployment was registered, but the ingress did not serve the service in time (in a
    /// cluster a node's ingress learns of a new deployment after the admin API's node).
    #[error(
        "the Restate ingress at {ingress} did not serve {SERVICE} within {waited:?} after its registration: {message}"
    )]
    NotServed {
        /// The ingress URL.
        ingress: String,
        /// How long it was waited for.
        waited: Duration,
        /// The last failure.
        message: String,
    },
    /// The admin API refused the deployment.
    #[error("the Restate admin API refused the deployment {uri} ({status}): {body}")]
    Refused {
        /// The deployment URI.
        uri: String,
        /// The HTTP status.
        status: u16,
        /// The response body (at most 2 KiB).
        body: String,
    },
}

/// Serves `thread` (with the notes object and the thread index beside it) on `listener` (HTTP/2,
/// as Restate calls deployments) until the listener fails.
///
/// Every connection gets `TCP_NODELAY`: a step is a small frame each way between the service
/// and Restate, and with Nagle's algorithm against delayed acknowledgments a step waited tens of
/// milliseconds for nothing (the SDK's own `HttpServer` leaves the option off).
pub async fn serve(thread: TetherThread, listener: TcpListener) {
    serve_until(thread, listener, std::future::pending()).await
}

/// As [`serve`], until `stop` resolves: then every connection is closed and every invocation in
/// flight on this process abandoned (Restate retries it, on this deployment's successor), and
/// `thread` (with the store it holds) is dropped before this returns.
pub async fn serve_until(
    thread: TetherThread,
    listener: TcpListener,
    stop: impl std::future::Future<Output = ()>,
) {
    let endpoint = restate_sdk::hyper::HyperEndpoint::new(
        Endpoint::builder()
            .bind(thread)
            .bind(TetherThreadNotes)
            .bind(TetherThreads)
            .build(),
    );
    let mut conns = tokio::task::JoinSet::new();
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = &mut stop => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let (stream, remote) = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("accepting a connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::warn!("TCP_NODELAY on a connection from {remote}: {e}");
        }
        let conn = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .serve_connection(hyper_util::rt::TokioIo::new(stream), endpoint.clone());
        conns.spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection from {remote} ended: {e}");
            }
        });
    }
    drop(listener);
    conns.shutdown().await;
}

/// Registers the deployment at `uri` (this service's endpoint) with the Restate admin API at
/// `admin` (`POST /deployments`, forced so a restarted service on the same URI re-registers),
/// retrying while the admin API is not up yet, for up to `wait`.
pub async fn register(admin: &str, uri: &str, wait: Duration) -> Result<(), RegisterError> {
    let client = reqwest::Client::new();
    let url = format!("{}/deployments", admin.trim_end_matches('/'));
    let started = std::time::Instant::now();
    loop {
        let sent = client
            .post(&url)
            .json(&serde_json::json!({"uri": uri, "force": true}))
            .timeout(Duration::from_secs(30))
            .send()
            .await;
        let message = match sent {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => {
                let status = r.status().as_u16();
                let body: String = r.text().await.unwrap_or_default().chars().take(2048).collect();
                // Restate answers 5xx while it starts; anything else is a refusal.
                if status < 500 {
                    return Err(RegisterError::Refused {
                        uri: uri.to_owned(),
                        status,
                        body,
                    });
                }
                format!("{status}: {body}")
            }
            Err(e) => e.to_string(),
        };
        if started.elapsed() >= wait {
            return Err(RegisterError::Unreachable {
                admin: admin.to_owned(),
                waited: wait,
                message,
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the ingress at `ingress` serves the `TetherThread` service (a shared handler's
/// call answers), for up to `wait`: the admin API's answer to a registration does not mean every
/// node's ingress knows the deployment yet (in a cluster it learns of it a moment later, and
/// until then answers 404 "service not found"), so a server that registered waits for its own
/// ingress before it takes runs.
pub async fn wait_until_served(ingress: &str, wait: Duration) -> Result<(), RegisterError> {
    let client = reqwest::Client::new();
    // `length` of a thread no one uses: a read that writes nothing.
    let url = format!("{}/{SERVICE}/~probe/length", ingress.trim_end_matches('/'));
    let started = std::time::Instant::now();
    loop {
        let message = match client.post(&url).timeout(Duration::from_secs(30)).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => {
                let status = r.status().as_u16();
                let body: String = r.text().await.unwrap_or_default().chars().take(2048).collect();
                format!("{status}: {body}")
            }
            Err(e) => e.to_string(),
        };
        if started.elapsed() >= wait {
            return Err(RegisterError::NotServed {
                ingress: ingress.to_owned(),
                waited: wait,
                message,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
