//! A scripted fake of Anthropic's Messages API (`POST /v1/messages`, streaming), over real HTTP
//! on 127.0.0.1.
//!
//! Each request takes the next [`Reply`] of the script: an SSE body (usually built with
//! [`sse_body`] or read from a golden file with [`golden`]), a JSON message (for
//! `stream: false`), or an error status with Anthropic's error envelope. Every request is recorded (headers and JSON body) for assertions. A request
//! without `x-api-key` gets 401, one without `anthropic-version` 400, as the real API does.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::post;
use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::server::{Negotiated, Serve, TestCa};

/// One scripted answer.
#[derive(Debug, Clone)]
pub enum Reply {
    /// 200 with this SSE body.
    Sse(String),
    /// 200 with this JSON body (a non-streamed message).
    Json(Value),
    /// 200 with this SSE body, then nothing more: the connection stays open (a stalled stream).
    SseStall(String),
    /// 200 with `head`, then `repeat` again and again for as long as the client reads (a model
    /// that never stops).
    SseEndless {
        /// Sent once, first.
        head: String,
        /// Sent forever after.
        repeat: String,
    },
    /// An error status with a JSON body and extra headers (e.g. `retry-after`).
    Status {
        /// The HTTP status.
        status: u16,
        /// The body.
        body: Value,
        /// Extra response headers.
        headers: Vec<(String, String)>,
    },
}

impl Reply {
    /// An error status with Anthropic's envelope `{"type":"error","error":{"type","message"}}`.
    pub fn error(status: u16, kind: &str, message: &str) -> Reply {
        Reply::Status {
            status,
            body: json!({"type": "error", "error": {"type": kind, "message": message}}),
            headers: Vec::new(),
        }
    }

    /// 529 `overloaded_error`.
    pub fn overloaded() -> Reply {
        Reply::error(529, "overloaded_error", "Overloaded")
    }
}

/// A recorded request.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Request headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// The JSON body.
    pub body: Value,
}

impl Recorded {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct St {
    script: VecDeque<Reply>,
    requests: Vec<Recorded>,
}

/// The fake Messages server.
pub struct FakeMessages {
    server: crate::server::Running,
    state: Arc<Mutex<St>>,
}

/// Builds an SSE body from events: `event: <type>` then `data: <json>` for each.
pub fn sse_body(events: &[Value]) -> String {
    events
        .iter()
        .map(|e| {
            format!(
                "event: {}\ndata: {}\n\n",
                e["type"].as_str().unwrap_or("message"),
                e
            )
        })
        .collect()
}

/// Reads `golden/anthropic/<name>` from this crate.
pub fn golden(name: &str) -> String {
    crate::anthropic::read_golden("anthropic", name)
}

pub(crate) fn read_golden(dir: &str, name: &str) -> String {
    let path = format!("{}/golden/{dir}/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("golden file {path}: {e}"))
}

async fn messages(State(st): State<Arc<Mutex<St>>>, headers: HeaderMap, body: Bytes) -> Response {
    let recorded = Recorded {
        headers: headers
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or_default().to_owned()))
            .collect(),
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    };
    let reply = {
        let mut g = st.lock().unwrap_or_else(|p| p.into_inner());
        g.requests.push(recorded.clone());
        if recorded.header("x-api-key").is_none_or(str::is_empty) {
            Some(Reply::error(401, "authentication_error", "invalid x-api-key"))
        } else if recorded.header("anthropic-version").is_none() {
            Some(Reply::error(
                400,
                "invalid_request_error",
                "anthropic-version header is required",
            ))
        } else {
            g.script.pop_front()
        }
    };
    match reply {
        Some(Reply::Sse(body)) => Response::builder()
            .status(200)
            .header("content-type", "text/event-stream")
            .body(Body::from(body))
            .unwrap_or_default(),
        Some(Reply::SseStall(body)) => Response::builder()
            .status(200)
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(
                futures_util::stream::once(async move { Ok::<_, std::io::Error>(Bytes::from(body)) })
                    .chain(futures_util::stream::pending()),
            ))
            .unwrap_or_default(),
        Some(Reply::SseEndless { head, repeat }) => {
            let repeat = Bytes::from(repeat);
            Response::builder()
                .status(200)
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(
                    futures_util::stream::once(async move { Ok::<_, std::io::Error>(Bytes::from(head)) })
                        .chain(futures_util::stream::repeat_with(move || Ok(repeat.clone()))),
                ))
                .unwrap_or_default()
        }
        Some(Reply::Json(v)) => Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(Body::from(v.to_string()))
            .unwrap_or_default(),
        Some(Reply::Status { status, body, headers }) => {
            let mut b = Response::builder()
                .status(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
                .header("content-type", "application/json");
            for (k, v) in headers {
                b = b.header(k, v);
            }
            b.body(Body::from(body.to_string())).unwrap_or_default()
        }
        None => Response::builder()
            .status(500)
            .body(Body::from(
                json!({"type":"error","error":{"type":"api_error","message":"fake: the script is exhausted"}})
                    .to_string(),
            ))
            .unwrap_or_default(),
    }
}

impl FakeMessages {
    /// Starts a fake answering with `script`, one reply per request.
    pub async fn start(script: Vec<Reply>) -> Self {
        Self::start_with(script, Serve::plain()).await
    }

    /// Starts a fake answering with `script`, serving as `serve` says (e.g. [`Serve::tls`]:
    /// TLS with a generated CA, HTTP/2 by ALPN).
    pub async fn start_with(script: Vec<Reply>, serve: Serve) -> Self {
        let state = Arc::new(Mutex::new(St {
            script: script.into(),
            requests: Vec::new(),
        }));
        let app = Router::new()
            .route("/v1/messages", post(messages))
            .with_state(state.clone());
        let server = crate::anthropic::serve(app, serve).await;
        FakeMessages { server, state }
    }

    /// The origin to use as the base URL (`http://127.0.0.1:<port>`, `https://…` over TLS).
    pub fn url(&self) -> String {
        self.server.origin()
    }

    /// The CA to trust when serving TLS (`None` over plain HTTP).
    pub fn ca(&self) -> Option<&TestCa> {
        self.server.ca()
    }

    /// What every request so far arrived over (TLS version, ALPN, HTTP version), in arrival order.
    pub fn negotiated(&self) -> Vec<Negotiated> {
        self.server.negotiated()
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.state.lock().map(|g| g.requests.clone()).unwrap_or_default()
    }
}

/// Serves `app` on an ephemeral port of 127.0.0.1 as `serve` says.
///
/// # Panics
/// When no port on 127.0.0.1 can be bound (a test environment failure).
pub(crate) async fn serve(app: Router, serve: Serve) -> crate::server::Running {
    match crate::server::serve(app, &serve).await {
        Ok(s) => s,
        Err(e) => panic!("tether-testkit: cannot serve on 127.0.0.1:0: {e}"),
    }
}
