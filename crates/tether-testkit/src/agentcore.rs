//! A scripted fake of Bedrock AgentCore's data plane, over real HTTP on 127.0.0.1:
//! `POST /harnesses/invoke` (AWS event-stream responses) and
//! `POST /runtimes/{arn}/invocations` (JSON or SSE responses).
//!
//! Frames are encoded here independently of the client's decoder (prelude and message CRC-32
//! computed by a local table), and can be corrupted on purpose. Each request must carry a
//! SigV4 `authorization` for service `bedrock-agentcore` and a session id of 33–256 characters,
//! else it is refused like AWS would (403 / 400 `ValidationException`). Every request is
//! recorded. Stream bodies are sent in small chunks so frames straddle reads.
//!
//! Stalled replies ([`Reply::StallFrames`], [`Reply::StallSse`]) send their bytes and then
//! nothing, keeping the connection open, until `StopRuntimeSession`
//! (`POST /runtimes/{arn}/stopruntimesession`, recorded like invocations) ends them.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::response::Response;
use axum::routing::post;
use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::server::{Negotiated, Serve, TestCa};

fn crc32(data: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0xedb8_8320 & mask);
        }
    }
    !crc
}

/// Encodes one event-stream message with string headers.
pub fn encode(headers: &[(&str, &str)], payload: &[u8]) -> Vec<u8> {
    let mut h = Vec::new();
    for (name, value) in headers {
        h.push(name.len() as u8);
        h.extend_from_slice(name.as_bytes());
        h.push(7);
        h.extend_from_slice(&(value.len() as u16).to_be_bytes());
        h.extend_from_slice(value.as_bytes());
    }
    let total = (16 + h.len() + payload.len()) as u32;
    let mut out = Vec::with_capacity(total as usize);
    out.extend_from_slice(&total.to_be_bytes());
    out.extend_from_slice(&(h.len() as u32).to_be_bytes());
    let prelude_crc = crc32(&out);
    out.extend_from_slice(&prelude_crc.to_be_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(payload);
    let crc = crc32(&out);
    out.extend_from_slice(&crc.to_be_bytes());
    out
}

/// An `event` frame of type `event_type` with a JSON payload.
pub fn event_frame(event_type: &str, payload: &Value) -> Vec<u8> {
    encode(
        &[
            (":message-type", "event"),
            (":event-type", event_type),
            (":content-type", "application/json"),
        ],
        payload.to_string().as_bytes(),
    )
}

/// An `exception` frame (a modeled exception such as `throttlingException`).
pub fn exception_frame(kind: &str, message: &str) -> Vec<u8> {
    encode(
        &[
            (":message-type", "exception"),
            (":exception-type", kind),
            (":content-type", "application/json"),
        ],
        json!({"message": message}).to_string().as_bytes(),
    )
}

/// The same frame with one payload byte flipped: its message CRC no longer matches.
pub fn corrupt(mut frame: Vec<u8>) -> Vec<u8> {
    let at = frame.len().saturating_sub(6);
    if let Some(b) = frame.get_mut(at) {
        *b ^= 0x20;
    }
    frame
}

/// Frames from a golden file `golden/agentcore/<name>`: a JSON list of
/// `{"event": "<type>", "payload": {...}}`.
pub fn golden_frames(name: &str) -> Vec<Vec<u8>> {
    let v = golden(name);
    v.as_array()
        .into_iter()
        .flatten()
        .map(|f| event_frame(f["event"].as_str().unwrap_or_default(), &f["payload"]))
        .collect()
}

/// Reads `golden/agentcore/<name>` as JSON.
pub fn golden(name: &str) -> Value {
    let text = crate::anthropic::read_golden("agentcore", name);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("golden agentcore/{name}: {e}"))
}

/// One scripted answer.
#[derive(Debug, Clone)]
pub enum Reply {
    /// 200 `application/vnd.amazon.eventstream` with these encoded frames.
    Frames(Vec<Vec<u8>>),
    /// 200 `application/json`.
    Json(Value),
    /// 200 `text/event-stream` with this body.
    Sse(String),
    /// An error status with an AWS JSON error body (`x-amzn-errortype` set from `kind`).
    Status(u16, String, String),
    /// Like [`Reply::Frames`], then silence with the connection open (until a stop).
    StallFrames(Vec<Vec<u8>>),
    /// Like [`Reply::Sse`], then silence with the connection open (until a stop).
    StallSse(String),
    /// These frames, then `repeat` again and again for as long as the client reads (a stream
    /// that never ends).
    EndlessFrames {
        /// Sent once, first.
        head: Vec<Vec<u8>>,
        /// Sent forever after.
        repeat: Vec<u8>,
    },
}

/// A recorded request.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The path.
    pub path: String,
    /// The raw query string.
    pub query: String,
    /// Headers, names lowercased.
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

struct St {
    script: VecDeque<Reply>,
    requests: Vec<Recorded>,
    /// Flipped by StopRuntimeSession: stalled bodies end.
    stopped: tokio::sync::watch::Sender<bool>,
}

type Shared = Arc<Mutex<St>>;

fn aws_error(status: u16, kind: &str, message: &str) -> Response {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("x-amzn-errortype", kind)
        .body(Body::from(json!({"message": message}).to_string()))
        .unwrap_or_default()
}

/// A body of `chunks` that then stays open until a stop.
fn stalled(chunks: Vec<Bytes>, st: &Shared) -> Body {
    let mut stopped = st.lock().unwrap_or_else(|p| p.into_inner()).stopped.subscribe();
    let head = futures_util::stream::iter(chunks.into_iter().map(Ok::<_, std::io::Error>));
    let tail = futures_util::stream::once(async move {
        let _ = stopped.wait_for(|s| *s).await;
    })
    .filter_map(|_| async { None::<Result<Bytes, std::io::Error>> });
    Body::from_stream(head.chain(tail))
}

fn halves(frames: Vec<Vec<u8>>) -> Vec<Bytes> {
    let mut chunks = Vec::new();
    for f in frames {
        let mid = f.len() / 2;
        chunks.push(Bytes::copy_from_slice(&f[..mid]));
        chunks.push(Bytes::copy_from_slice(&f[mid..]));
    }
    chunks
}

async fn invoke(State(st): State<Shared>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let stop = uri.path().ends_with("/stopruntimesession");
    let rec = Recorded {
        path: uri.path().to_owned(),
        query: uri.query().unwrap_or_default().to_owned(),
        headers: headers
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or_default().to_owned()))
            .collect(),
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    };
    let auth = rec.header("authorization").unwrap_or_default().to_owned();
    let sid_len = rec
        .header("x-amzn-bedrock-agentcore-runtime-session-id")
        .map(str::len)
        .unwrap_or(0);
    let reply = {
        let mut g = st.lock().unwrap_or_else(|p| p.into_inner());
        g.requests.push(rec.clone());
        if !auth.starts_with("AWS4-HMAC-SHA256 Credential=")
            || !auth.contains("/bedrock-agentcore/aws4_request")
            || !auth.contains("SignedHeaders=")
            || rec.header("x-amz-date").is_none()
        {
            return aws_error(
                403,
                "AccessDeniedException",
                "missing or malformed SigV4 signature",
            );
        }
        if !(33..=256).contains(&sid_len) {
            return aws_error(
                400,
                "ValidationException",
                "runtimeSessionId must be 33-256 characters",
            );
        }
        if stop {
            g.stopped.send_replace(true);
            let sid = rec
                .header("x-amzn-bedrock-agentcore-runtime-session-id")
                .unwrap_or_default()
                .to_owned();
            return Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .header("x-amzn-bedrock-agentcore-runtime-session-id", sid.as_str())
                .body(Body::from(
                    json!({"runtimeSessionId": sid, "statusCode": 200}).to_string(),
                ))
                .unwrap_or_default();
        }
        g.script.pop_front()
    };
    match reply {
        Some(Reply::Frames(frames)) => {
            let chunks: Vec<Result<Bytes, std::io::Error>> = halves(frames).into_iter().map(Ok).collect();
            Response::builder()
                .status(200)
                .header("content-type", "application/vnd.amazon.eventstream")
                .body(Body::from_stream(futures_util::stream::iter(chunks)))
                .unwrap_or_default()
        }
        Some(Reply::Json(v)) => Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(Body::from(v.to_string()))
            .unwrap_or_default(),
        Some(Reply::Sse(s)) => Response::builder()
            .status(200)
            .header("content-type", "text/event-stream")
            .body(Body::from(s))
            .unwrap_or_default(),
        Some(Reply::Status(status, kind, message)) => aws_error(status, &kind, &message),
        Some(Reply::StallFrames(frames)) => Response::builder()
            .status(200)
            .header("content-type", "application/vnd.amazon.eventstream")
            .body(stalled(halves(frames), &st))
            .unwrap_or_default(),
        Some(Reply::StallSse(s)) => Response::builder()
            .status(200)
            .header("content-type", "text/event-stream")
            .body(stalled(vec![Bytes::from(s)], &st))
            .unwrap_or_default(),
        Some(Reply::EndlessFrames { head, repeat }) => {
            let repeat = Bytes::from(repeat);
            let head = futures_util::stream::iter(halves(head).into_iter().map(Ok::<_, std::io::Error>));
            Response::builder()
                .status(200)
                .header("content-type", "application/vnd.amazon.eventstream")
                .body(Body::from_stream(head.chain(futures_util::stream::repeat_with(
                    move || Ok(repeat.clone()),
                ))))
                .unwrap_or_default()
        }
        None => aws_error(500, "InternalServerException", "fake: the script is exhausted"),
    }
}

/// The fake AgentCore data plane.
pub struct FakeAgentCore {
    server: crate::server::Running,
    state: Shared,
}

impl FakeAgentCore {
    /// Starts a fake answering with `script`, one reply per invocation.
    pub async fn start(script: Vec<Reply>) -> Self {
        Self::start_with(script, Serve::plain()).await
    }

    /// Starts a fake answering with `script`, serving as `serve` says (e.g. [`Serve::tls`]:
    /// TLS with a generated CA, HTTP/2 by ALPN).
    pub async fn start_with(script: Vec<Reply>, serve: Serve) -> Self {
        let state = Arc::new(Mutex::new(St {
            script: script.into(),
            requests: Vec::new(),
            stopped: tokio::sync::watch::channel(false).0,
        }));
        let app = Router::new()
            .route("/harnesses/invoke", post(invoke))
            .route("/runtimes/{arn}/invocations", post(invoke))
            .route("/runtimes/{arn}/stopruntimesession", post(invoke))
            .with_state(state.clone());
        let server = crate::anthropic::serve(app, serve).await;
        FakeAgentCore { server, state }
    }

    /// The origin to use as the endpoint (`http://127.0.0.1:<port>`, `https://…` over TLS).
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
