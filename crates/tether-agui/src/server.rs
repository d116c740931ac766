//! The axum router: one `POST` endpoint per agent.
//!
//! Answers: `200` with an SSE (or protobuf, by `Accept`) stream once the input is valid —
//! failures after that are in-stream `RUN_ERROR`s; `400` with a JSON error for a malformed
//! body; `405` for other methods; `406` when `Accept` allows neither encoding; `413` past the
//! body limit; `408` when the body does not arrive within [`EndpointOptions::body_timeout`];
//! `415` for a non-JSON body; whatever [`EndpointOptions::admit`] answers for a run it refuses.
//! SSE streams carry `:` comment keep-alives while idle. Dropping the response (client
//! disconnect) cancels the run and aborts its task.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, post};
use futures_util::Stream;
use tokio::time::Sleep;

use crate::context::RunOptions;
use crate::encode::{Encoding, SSE_KEEP_ALIVE};
use crate::run::{Agent, EventStream, run_agent};
use crate::types::RunAgentInput;

/// Configuration of one endpoint.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct EndpointOptions {
    /// Largest accepted request body, in bytes (413 beyond).
    pub body_limit: usize,
    /// Interval of SSE keep-alive comments while the run is idle (`None`: none).
    pub keep_alive: Option<Duration>,
    /// Options of each run.
    pub run: RunOptions,
    /// Longest the whole request body may take to arrive (`408` past it; `None`: no limit). A
    /// client trickling its body then holds its connection for this long at most.
    pub body_timeout: Option<Duration>,
    /// Decides whether a run may start, once its body is read and decoded and before anything is
    /// streamed (`None`: every valid input runs).
    pub admit: Option<Admit>,
}

impl Default for EndpointOptions {
    fn default() -> Self {
        Self {
            body_limit: 2 * 1024 * 1024,
            keep_alive: Some(Duration::from_secs(15)),
            run: RunOptions::default(),
            body_timeout: Some(Duration::from_secs(30)),
            admit: None,
        }
    }
}

/// Builder-style setters (the struct is `#[non_exhaustive]`).
///
/// ```
/// use std::time::Duration;
/// let o = tether_agui::EndpointOptions::default()
///     .with_body_limit(64 * 1024)
///     .with_keep_alive(Some(Duration::from_secs(5)));
/// assert_eq!(o.body_limit, 64 * 1024);
/// ```
impl EndpointOptions {
    /// The largest accepted request body, in bytes.
    pub fn with_body_limit(mut self, bytes: usize) -> Self {
        self.body_limit = bytes;
        self
    }

    /// The SSE keep-alive interval (`None`: none).
    pub fn with_keep_alive(mut self, every: Option<Duration>) -> Self {
        self.keep_alive = every;
        self
    }

    /// The options of each run.
    pub fn with_run(mut self, run: RunOptions) -> Self {
        self.run = run;
        self
    }

    /// The longest the request body may take to arrive (`None`: no limit).
    pub fn with_body_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.body_timeout = timeout;
        self
    }

    /// The admission check run before a run starts.
    pub fn with_admit(mut self, admit: Admit) -> Self {
        self.admit = Some(admit);
        self
    }
}

/// What [`Admit`] answers: the run may start (holding the guard, if any, for as long as it
/// streams), or this response goes out instead of the stream.
pub type Admission = std::result::Result<Option<StreamGuard>, Response>;

/// A check run on each decoded [`RunAgentInput`] before `RUN_STARTED`: the place for limits that
/// must not be taken while a client is still sending its body (a concurrency slot) and for
/// refusing input that is well-formed but not acceptable (AG-UI: reject *before* `RUN_STARTED`
/// with an HTTP status). It sees the input synchronously and returns a future for the rest.
///
/// ```
/// use tether_agui::server::Admit;
/// let admit = Admit::new(|input| {
///     let busy = input.thread_id.as_str() == "busy";
///     Box::pin(async move {
///         if busy {
///             use axum::response::IntoResponse;
///             return Err(axum::http::StatusCode::CONFLICT.into_response());
///         }
///         Ok(None)
///     })
/// });
/// # drop(admit);
/// ```
#[derive(Clone)]
pub struct Admit(Arc<AdmitFn>);

type AdmitFn =
    dyn Fn(&RunAgentInput) -> Pin<Box<dyn std::future::Future<Output = Admission> + Send>> + Send + Sync;

impl Admit {
    /// Wraps the check.
    pub fn new(
        f: impl Fn(&RunAgentInput) -> Pin<Box<dyn std::future::Future<Output = Admission> + Send>>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        Admit(Arc::new(f))
    }
}

impl std::fmt::Debug for Admit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Admit")
    }
}

/// Something a run's response holds until its stream ends (the run finished, failed, or its
/// client went away): a concurrency permit, a metrics span. A middleware puts it in the request's
/// extensions; the endpoint takes it from there into the response body. A request refused before
/// its stream starts (400, 413, 415…) drops it at once.
///
/// ```
/// use tether_agui::StreamGuard;
/// let permit = std::sync::Arc::new(tokio::sync::Semaphore::new(1)).try_acquire_owned().unwrap();
/// let guard = StreamGuard::new(permit);
/// # drop(guard);
/// ```
#[derive(Clone)]
pub struct StreamGuard(#[allow(dead_code)] Arc<dyn std::any::Any + Send + Sync>);

impl StreamGuard {
    /// Holds `value` for the life of the stream.
    pub fn new(value: impl std::any::Any + Send + Sync) -> Self {
        StreamGuard(Arc::new(value))
    }
}

impl std::fmt::Debug for StreamGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StreamGuard")
    }
}

struct Endpoint<A> {
    agent: Arc<A>,
    options: EndpointOptions,
}

/// A JSON error response `{"code": ..., "message": ...}`.
fn json_error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let body = serde_json::json!({"code": code, "message": message.into()});
    (status, axum::Json(body)).into_response()
}

/// The method router for one agent (POST only; other methods get a JSON 405).
pub fn endpoint<A: Agent, S: Clone + Send + Sync + 'static>(
    agent: A,
    options: EndpointOptions,
) -> MethodRouter<S> {
    let ep = Arc::new(Endpoint {
        agent: Arc::new(agent),
        options,
    });
    post(move |req: Request| {
        let ep = ep.clone();
        async move { handle(ep, req).await }
    })
    .fallback(|| async {
        let mut r = json_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "METHOD_NOT_ALLOWED",
            "AG-UI endpoints accept POST only",
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        r
    })
}

/// A router serving `agent` at `path`.
pub fn router<A: Agent>(path: &str, agent: A, options: EndpointOptions) -> Router {
    Router::new().route(path, endpoint(agent, options))
}

/// Adds AG-UI endpoints to a router.
pub trait AgUiRouterExt {
    /// Serves `agent` at `path` with default options.
    fn route_agui<A: Agent>(self, path: &str, agent: A) -> Self;
    /// Serves `agent` at `path` with `options`.
    fn route_agui_with<A: Agent>(self, path: &str, agent: A, options: EndpointOptions) -> Self;
}

impl<S: Clone + Send + Sync + 'static> AgUiRouterExt for Router<S> {
    fn route_agui<A: Agent>(self, path: &str, agent: A) -> Self {
        self.route(path, endpoint(agent, EndpointOptions::default()))
    }
    fn route_agui_with<A: Agent>(self, path: &str, agent: A, options: EndpointOptions) -> Self {
        self.route(path, endpoint(agent, options))
    }
}

/// Decodes a request body into a `RunAgentInput` (unknown members ignored).
pub fn decode_input(body: &[u8]) -> Result<RunAgentInput, serde_json::Error> {
    serde_json::from_slice(body)
}

fn is_json(content_type: Option<&str>) -> bool {
    let Some(ct) = content_type else {
        return false;
    };
    let media = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    media == "application/json" || (media.starts_with("application/") && media.ends_with("+json"))
}

async fn handle<A: Agent>(ep: Arc<Endpoint<A>>, mut req: Request) -> Response {
    let guard = req.extensions_mut().remove::<StreamGuard>();
    let headers = req.headers();
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    if !is_json(content_type) {
        return json_error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UNSUPPORTED_MEDIA_TYPE",
            format!(
                "the body must be a JSON RunAgentInput (Content-Type: application/json), got {}",
                content_type.unwrap_or("no Content-Type")
            ),
        );
    }
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let Some(encoding) = Encoding::negotiate(accept) else {
        return json_error(
            StatusCode::NOT_ACCEPTABLE,
            "NOT_ACCEPTABLE",
            format!(
                "Accept must allow text/event-stream or application/vnd.ag-ui.event+proto, got {}",
                accept.unwrap_or("")
            ),
        );
    };
    let limit = ep.options.body_limit;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_large(limit);
    }
    let read = axum::body::to_bytes(req.into_body(), limit);
    let read = match ep.options.body_timeout {
        Some(d) => match tokio::time::timeout(d, read).await {
            Ok(r) => r,
            Err(_) => {
                return json_error(
                    StatusCode::REQUEST_TIMEOUT,
                    "BODY_TIMEOUT",
                    format!(
                        "the request body did not arrive within {}s; send it at once",
                        d.as_secs_f64()
                    ),
                );
            }
        },
        None => read.await,
    };
    let body = match read {
        Ok(b) => b,
        Err(e) => {
            let is_limit = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
                || e.to_string().contains("length limit");
            if is_limit {
                return too_large(limit);
            }
            return json_error(
                StatusCode::BAD_REQUEST,
                "BODY_READ_FAILED",
                format!("could not read the request body: {e}"),
            );
        }
    };
    let input = match decode_input(&body) {
        Ok(i) => i,
        Err(e) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                "INVALID_INPUT",
                format!("the body is not a valid RunAgentInput: {e}"),
            );
        }
    };
    let admitted = match &ep.options.admit {
        Some(admit) => match (admit.0)(&input).await {
            Ok(g) => g,
            Err(refusal) => return refusal,
        },
        None => None,
    };
    let events = run_agent(ep.agent.clone(), input, ep.options.run.clone());
    // Bounded so that `now + interval` can never overflow the clock (a day is no keep-alive).
    let keep_alive = match encoding {
        Encoding::Sse => ep.options.keep_alive.map(|d| d.min(Duration::from_secs(86_400))),
        _ => None,
    };
    let stream = BodyStream {
        events,
        encoding,
        keep_alive: keep_alive.map(|d| (d, Box::pin(tokio::time::sleep(d)))),
        _guard: guard,
        _admitted: admitted,
    };
    let mut resp = Response::new(Body::from_stream(stream));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(encoding.content_type()),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

fn too_large(limit: usize) -> Response {
    json_error(
        StatusCode::PAYLOAD_TOO_LARGE,
        "PAYLOAD_TOO_LARGE",
        format!("the request body exceeds the {limit}-byte limit"),
    )
}

/// Events ready at once that are written as one body chunk, at most.
const MAX_BATCH: usize = 256;

/// The response body: encoded events, every event ready at once in one chunk, with keep-alives
/// while idle. Events are encoded as they are taken off the queue (no vector of them is held),
/// into the chunk's own buffer, which the body takes over: between chunks nothing is held.
struct BodyStream {
    events: EventStream,
    encoding: Encoding,
    keep_alive: Option<(Duration, Pin<Box<Sleep>>)>,
    /// Held until the stream is dropped.
    _guard: Option<StreamGuard>,
    /// What the admission check handed over, held likewise.
    _admitted: Option<StreamGuard>,
}

impl BodyStream {
    fn encode(&self, e: &crate::event::AgUiEvent, buf: &mut Vec<u8>) {
        if let Err(err) = self.encoding.encode_into(e, buf) {
            tracing::error!("could not encode {}: {err}", e.event_type());
        }
    }
}

impl Stream for BodyStream {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        match this.events.poll_next_event(cx) {
            Poll::Ready(Some(first)) => {
                // A new buffer per chunk, handed to the body without a copy: a stream that waits
                // between chunks holds no buffer.
                let mut buf = Vec::with_capacity(256);
                this.encode(&first, &mut buf);
                for _ in 1..MAX_BATCH {
                    let Some(e) = this.events.try_next_event() else {
                        break;
                    };
                    this.encode(&e, &mut buf);
                }
                if let Some((d, sleep)) = &mut this.keep_alive {
                    sleep.as_mut().reset(tokio::time::Instant::now() + *d);
                }
                Poll::Ready(Some(Ok(Bytes::from(buf))))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                if let Some((d, sleep)) = &mut this.keep_alive
                    && sleep.as_mut().poll(cx).is_ready()
                {
                    sleep.as_mut().reset(tokio::time::Instant::now() + *d);
                    return Poll::Ready(Some(Ok(Bytes::from_static(SSE_KEEP_ALIVE))));
                }
                Poll::Pending
            }
        }
    }
}

use std::future::Future as _;
