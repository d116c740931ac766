//! [`FakeOpenAi`]: a scripted fake OpenAI-compatible server (real HTTP on 127.0.0.1).
//!
//! A script is a queue of [`Reply`]s, one per `POST …/chat/completions` request, in order. A
//! completion reply ([`Reply::text`], [`Reply::tool_calls`]) answers in the form the request asked
//! for: an SSE stream when its body says `"stream": true`, one JSON object otherwise. Faults are
//! produced on demand: HTTP errors with retry headers, an `error` object inside a 200 stream, a
//! connection dropped mid-stream, a stalled stream, a malformed chunk, a missing `[DONE]`, a body
//! that ends before any `finish_reason`, llama-cpp-python's repeated ids and `function_call`.
//! Every request is recorded ([`FakeOpenAi::requests`]) so tests can assert what was sent.
//!
//! ```no_run
//! # async fn f() {
//! use tether_testkit::openai::{FakeOpenAi, Reply};
//! let fake = FakeOpenAi::start().await;
//! fake.push(Reply::tool_calls(&[("call_1", "get_weather", r#"{"city":"Paris"}"#)]));
//! fake.push(Reply::text("It is sunny.").usage(12, 4));
//! // point a client at fake.url() (".../v1"), then:
//! assert_eq!(fake.requests().len(), 0);
//! # }
//! ```
//!
//! When the script runs out the server answers 500 with `x-should-retry: false` and a message
//! saying so, so a test that sends more requests than it scripted fails loudly and at once.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::server::{Negotiated, Serve, TestCa};

/// A scripted fake OpenAI-compatible server on a random 127.0.0.1 port.
///
/// Dropping it stops accepting connections.
pub struct FakeOpenAi {
    server: crate::server::Running,
    state: Arc<Shared>,
}

impl std::fmt::Debug for FakeOpenAi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeOpenAi")
            .field("url", &self.url())
            .field("remaining", &self.remaining())
            .finish()
    }
}

#[derive(Default)]
struct Shared {
    script: Mutex<VecDeque<Reply>>,
    requests: Mutex<Vec<RecordedRequest>>,
    counter: AtomicU64,
    /// Set by [`FakeOpenAi::answer_repeats_alike`]: the bodies answered by a clean completion,
    /// with the reply they got.
    answered: Mutex<Option<Vec<(Value, Reply)>>>,
}

/// One request the fake received, as tether sent it.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedRequest {
    /// The HTTP method (`POST`).
    pub method: String,
    /// The path (`/v1/chat/completions`).
    pub path: String,
    /// Every header, names lowercased, in arrival order.
    pub headers: Vec<(String, String)>,
    /// The JSON body (`Value::Null` when the body was not JSON).
    pub body: Value,
}

impl RecordedRequest {
    /// The first value of a header (name case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The request's `messages` array (empty when absent).
    pub fn messages(&self) -> &[Value] {
        self.body
            .get("messages")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// Whether the request asked for a stream.
    pub fn is_stream(&self) -> bool {
        self.body.get("stream").and_then(Value::as_bool).unwrap_or(false)
    }
}

impl FakeOpenAi {
    /// Starts the server on a random 127.0.0.1 port.
    ///
    /// # Panics
    /// When no port on 127.0.0.1 can be bound (a test environment failure); see
    /// [`FakeOpenAi::try_start`] to handle that.
    pub async fn start() -> Self {
        Self::start_with(Serve::plain()).await
    }

    /// Starts the server on a random 127.0.0.1 port, serving as `serve` says (e.g.
    /// [`Serve::tls`]: TLS with a generated CA, HTTP/2 by ALPN).
    ///
    /// # Panics
    /// When no port on 127.0.0.1 can be bound; see [`FakeOpenAi::try_start_with`].
    pub async fn start_with(serve: Serve) -> Self {
        match Self::try_start_with(serve).await {
            Ok(s) => s,
            Err(e) => panic!("FakeOpenAi could not bind 127.0.0.1:0: {e}"),
        }
    }

    /// Starts the server on a random 127.0.0.1 port, reporting a bind failure.
    pub async fn try_start() -> std::io::Result<Self> {
        Self::try_start_with(Serve::plain()).await
    }

    /// Starts the server as `serve` says, reporting a bind failure.
    pub async fn try_start_with(serve: Serve) -> std::io::Result<Self> {
        let state = Arc::new(Shared::default());
        let app = axum::Router::new().fallback(handle).with_state(state.clone());
        let server = crate::server::serve(app, &serve).await?;
        Ok(FakeOpenAi { server, state })
    }

    /// The base URL, including `/v1` (like `OPENAI_BASE_URL`): `http://127.0.0.1:<port>/v1`,
    /// `https://…` when serving TLS.
    pub fn url(&self) -> String {
        format!("{}/v1", self.server.origin())
    }

    /// The socket address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// The CA to trust when serving TLS (`None` over plain HTTP).
    pub fn ca(&self) -> Option<&TestCa> {
        self.server.ca()
    }

    /// What every request so far arrived over (TLS version, ALPN, HTTP version), in arrival order.
    pub fn negotiated(&self) -> Vec<Negotiated> {
        self.server.negotiated()
    }

    /// Appends a reply to the script.
    pub fn push(&self, reply: Reply) -> &Self {
        if let Ok(mut s) = self.state.script.lock() {
            s.push_back(reply);
        }
        self
    }

    /// Appends several replies to the script, in order.
    pub fn push_all(&self, replies: impl IntoIterator<Item = Reply>) -> &Self {
        if let Ok(mut s) = self.state.script.lock() {
            s.extend(replies);
        }
        self
    }

    /// From now on, a request whose body equals that of an earlier request answered by a clean
    /// completion (no fault, not an HTTP error) gets the same reply again, without taking one
    /// from the script: what a deterministic model does with the same input. For tests where a
    /// durable-execution engine may repeat a model step whose result it had not yet made durable
    /// (a node lost mid-step), so the script need not guess how often that happens;
    /// [`FakeOpenAi::requests`] still shows every request.
    pub fn answer_repeats_alike(&self) -> &Self {
        if let Ok(mut a) = self.state.answered.lock() {
            a.get_or_insert_with(Vec::new);
        }
        self
    }

    /// Replies not yet used.
    pub fn remaining(&self) -> usize {
        self.state.script.lock().map(|s| s.len()).unwrap_or(0)
    }

    /// Every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.state.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

async fn handle(State(state): State<Arc<Shared>>, req: Request) -> Response {
    let method = req.method().to_string();
    let path = req.uri().path().to_owned();
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let bytes = axum::body::to_bytes(req.into_body(), 64 << 20)
        .await
        .unwrap_or_default();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let n = state.counter.fetch_add(1, Ordering::Relaxed) + 1;
    let rec = RecordedRequest {
        method: method.clone(),
        path: path.clone(),
        headers,
        body,
    };
    let stream = rec.is_stream();
    let repeat_of = state.answered.lock().ok().and_then(|a| {
        a.as_ref()?
            .iter()
            .find(|(body, _)| *body == rec.body)
            .map(|(_, reply)| reply.clone())
    });
    let body_seen = rec.body.clone();
    let model = rec
        .body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("fake-model")
        .to_owned();
    if let Ok(mut r) = state.requests.lock() {
        r.push(rec);
    }
    if method != "POST" || !path.ends_with("/chat/completions") {
        return error_response(
            StatusCode::NOT_FOUND,
            &format!("FakeOpenAi serves POST /v1/chat/completions; got {method} {path}"),
            "not_found",
            &[],
        );
    }
    let next = match repeat_of {
        Some(reply) => Some(reply),
        None => {
            let next = state.script.lock().ok().and_then(|mut s| s.pop_front());
            if let (Some(reply), Ok(mut answered)) = (&next, state.answered.lock())
                && let Some(answered) = answered.as_mut()
                && reply.is_clean_completion()
            {
                answered.push((body_seen, reply.clone()));
            }
            next
        }
    };
    let Some(reply) = next else {
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!(
                "FakeOpenAi: the script is empty (request #{n}, {method} {path}); push one Reply per expected request"
            ),
            "fake_script_exhausted",
            &[("x-should-retry", "false")],
        );
    };
    reply.respond(stream, &model, n)
}

fn error_response(status: StatusCode, message: &str, kind: &str, headers: &[(&str, &str)]) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": kind}});
    let mut resp = (status, axum::Json(body)).into_response();
    for (k, v) in headers {
        if let (Ok(k), Ok(v)) = (HeaderName::try_from(*k), HeaderValue::try_from(*v)) {
            resp.headers_mut().insert(k, v);
        }
    }
    resp
}

/// What happens to a streamed reply after its first `n` data events.
#[derive(Debug, Clone, PartialEq)]
enum Fault {
    /// A data line whose JSON is an `error` object, then the body ends.
    Error(Value),
    /// The connection is aborted (no terminating chunk).
    Drop,
    /// Nothing more is sent; the connection stays open until the client leaves.
    Stall,
    /// A data line that is not JSON, then the rest of the stream.
    Malformed,
    /// The body ends cleanly (no `finish_reason`, no `[DONE]`).
    Truncate,
}

#[derive(Debug, Clone)]
enum Kind {
    Completion(Box<Completion>),
    Http {
        status: u16,
        body: Value,
    },
    /// Pre-encoded SSE pieces, sent as they are.
    Raw(Vec<Bytes>),
    /// `n` content deltas whose text is the server's send time (`t<micros>;`), then finish + `[DONE]`.
    Stamped {
        n: usize,
    },
    /// Content deltas of this text, forever (until the client leaves).
    Endless(String),
}

#[derive(Debug, Clone, Default)]
struct Completion {
    text: String,
    reasoning: String,
    calls: Vec<(String, String, String)>,
    finish: Option<String>,
    usage: Option<(u64, u64, u64)>,
    usage_choices_null: bool,
    text_chunk: usize,
    args_chunk: usize,
    interleave: bool,
    llama: bool,
    no_done: bool,
    fault: Option<(usize, Fault)>,
}

/// One scripted answer of [`FakeOpenAi`].
///
/// Build a completion with [`Reply::text`] or [`Reply::tool_calls`] and shape it with the
/// modifiers (chunking, usage, quirks, faults); build an HTTP error with [`Reply::http`] and its
/// shorthands; or send arbitrary SSE with [`Reply::sse`]. Stream faults (`*_after(n)`) happen
/// after the first `n` data events of the normal stream; for a non-stream request they apply to
/// the JSON body (drop: aborted before the body, stall: headers then nothing, malformed: invalid
/// JSON, error: a 200 body holding the `error` object, truncate: a cut-off JSON body).
#[derive(Debug, Clone)]
pub struct Reply {
    kind: Kind,
    headers: Vec<(String, String)>,
    split_bytes: Option<usize>,
    pace: Option<Duration>,
}

impl Reply {
    /// A completion with no fault: one that reaches the client whole.
    fn is_clean_completion(&self) -> bool {
        matches!(&self.kind, Kind::Completion(c) if c.fault.is_none())
    }

    fn new(kind: Kind) -> Self {
        Reply {
            kind,
            headers: Vec::new(),
            split_bytes: None,
            pace: None,
        }
    }

    fn completion(c: Completion) -> Self {
        Self::new(Kind::Completion(Box::new(Completion {
            text_chunk: 8,
            args_chunk: 5,
            ..c
        })))
    }

    fn with_completion(mut self, f: impl FnOnce(&mut Completion)) -> Self {
        if let Kind::Completion(c) = &mut self.kind {
            f(c);
        }
        self
    }

    /// A text answer (`finish_reason: "stop"`), streamed in deltas of 8 characters by default.
    pub fn text(text: impl Into<String>) -> Self {
        Self::completion(Completion {
            text: text.into(),
            ..Default::default()
        })
    }

    /// An answer calling tools `(id, name, arguments)` (`finish_reason: "tool_calls"`); each
    /// call's first fragment carries id, type and name, later ones 5-character argument pieces.
    pub fn tool_calls(calls: &[(&str, &str, &str)]) -> Self {
        Self::completion(Completion {
            calls: calls
                .iter()
                .map(|(i, n, a)| ((*i).to_owned(), (*n).to_owned(), (*a).to_owned()))
                .collect(),
            ..Default::default()
        })
    }

    /// Text sent before the tool calls (for a [`Reply::tool_calls`]) or instead of the text.
    pub fn with_text(self, text: impl Into<String>) -> Self {
        let text = text.into();
        self.with_completion(|c| c.text = text)
    }

    /// Reasoning text, streamed as `reasoning_content` deltas before the text.
    pub fn reasoning(self, text: impl Into<String>) -> Self {
        let text = text.into();
        self.with_completion(|c| c.reasoning = text)
    }

    /// Text and reasoning deltas of `n` characters (at least 1).
    pub fn chunk_chars(self, n: usize) -> Self {
        self.with_completion(|c| c.text_chunk = n.max(1))
    }

    /// Tool-call argument fragments of `n` characters (at least 1).
    pub fn args_chunk(self, n: usize) -> Self {
        self.with_completion(|c| c.args_chunk = n.max(1))
    }

    /// Parallel calls' fragments interleaved round-robin by index (as OpenAI does).
    pub fn interleaved(self) -> Self {
        self.with_completion(|c| c.interleave = true)
    }

    /// The finish reason (default `stop`, or `tool_calls` with calls; `""` is sent as is).
    pub fn finish_reason(self, reason: impl Into<String>) -> Self {
        let r = reason.into();
        self.with_completion(|c| c.finish = Some(r))
    }

    /// A usage report: the `choices: []` chunk before `[DONE]` in a stream, `usage` in JSON.
    pub fn usage(self, prompt_tokens: u64, completion_tokens: u64) -> Self {
        self.with_completion(|c| {
            let cached = c.usage.map(|u| u.2).unwrap_or(0);
            c.usage = Some((prompt_tokens, completion_tokens, cached))
        })
    }

    /// Cached prompt tokens in the usage report (`prompt_tokens_details.cached_tokens`).
    pub fn cached_tokens(self, n: u64) -> Self {
        self.with_completion(|c| {
            let (p, o, _) = c.usage.unwrap_or((0, 0, 0));
            c.usage = Some((p, o, n))
        })
    }

    /// The usage chunk carries `choices: null` (vLLM).
    pub fn usage_choices_null(self) -> Self {
        self.with_completion(|c| c.usage_choices_null = true)
    }

    /// llama-cpp-python's quirks: every tool-call fragment repeats id, type and name, and carries
    /// the legacy `function_call` object too (with a malformed `name:`).
    pub fn llama_cpp_python(self) -> Self {
        self.with_completion(|c| c.llama = true)
    }

    /// The stream ends after the finish chunk (and usage) without `data: [DONE]`.
    pub fn no_done(self) -> Self {
        self.with_completion(|c| c.no_done = true)
    }

    /// After `n` data events, a data line holding `{"error": {message, type, code}}`; then the body ends.
    pub fn error_after(self, n: usize, message: &str, code: &str) -> Self {
        let e = json!({"error": {"message": message, "type": code, "param": null, "code": code}});
        self.with_completion(|c| c.fault = Some((n, Fault::Error(e))))
    }

    /// After `n` data events the connection is aborted mid-body.
    pub fn drop_after(self, n: usize) -> Self {
        self.with_completion(|c| c.fault = Some((n, Fault::Drop)))
    }

    /// After `n` data events nothing more is sent, the connection kept open.
    pub fn stall_after(self, n: usize) -> Self {
        self.with_completion(|c| c.fault = Some((n, Fault::Stall)))
    }

    /// After `n` data events a data line that is not JSON (`{"choices": [` cut short).
    pub fn malformed_after(self, n: usize) -> Self {
        self.with_completion(|c| c.fault = Some((n, Fault::Malformed)))
    }

    /// After `n` data events the body ends cleanly: no `finish_reason`, no `[DONE]`.
    pub fn truncate_after(self, n: usize) -> Self {
        self.with_completion(|c| c.fault = Some((n, Fault::Truncate)))
    }

    /// An HTTP answer with `status` and a JSON body.
    pub fn http(status: u16, body: Value) -> Self {
        Self::new(Kind::Http { status, body })
    }

    /// An HTTP error with OpenAI's error body `{"error": {message, type, param, code}}`.
    pub fn error(status: u16, message: &str, code: &str) -> Self {
        Self::http(
            status,
            json!({"error": {"message": message, "type": code, "param": null, "code": code}}),
        )
    }

    /// A 429 rate limit (`rate_limit_exceeded`) with `retry-after: <secs>`.
    pub fn rate_limited(retry_after_secs: &str) -> Self {
        Self::error(429, "Rate limit reached for requests", "rate_limit_exceeded")
            .header("retry-after", retry_after_secs)
    }

    /// A 429 for exhausted quota (`insufficient_quota`), which no retry fixes.
    pub fn quota_exceeded() -> Self {
        Self::error(
            429,
            "You exceeded your current quota, please check your plan and billing details.",
            "insufficient_quota",
        )
    }

    /// A 5xx with a JSON error body (`server_error`).
    pub fn server_error(status: u16) -> Self {
        Self::error(
            status,
            "The server had an error while processing your request.",
            "server_error",
        )
    }

    /// A stream of raw data payloads, each sent as `data: <payload>\n\n` in its own write (no
    /// `[DONE]` is added: include it if wanted).
    pub fn sse<I, S>(payloads: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::new(Kind::Raw(
            payloads
                .into_iter()
                .map(|p| Bytes::from(format!("data: {}\n\n", p.as_ref())))
                .collect(),
        ))
    }

    /// A stream of exact byte pieces, each its own write: nothing is added.
    pub fn raw(pieces: Vec<Bytes>) -> Self {
        Self::new(Kind::Raw(pieces))
    }

    /// A pre-encoded stream of `n` content deltas (`delta` each), a finish chunk, a usage chunk
    /// and `[DONE]`, written in 64 KiB pieces: for benchmarks, so the server is not the bottleneck.
    /// Build it once and clone it: clones share the bytes.
    pub fn long_text(n: usize, delta: &str) -> Self {
        let mut out = Vec::with_capacity(n * (delta.len() + 120) + 512);
        let piece = serde_json::to_string(delta).unwrap_or_else(|_| "\"\"".into());
        out.extend_from_slice(
            b"data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
        );
        for _ in 0..n {
            out.extend_from_slice(b"data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{\"content\":");
            out.extend_from_slice(piece.as_bytes());
            out.extend_from_slice(b"},\"finish_reason\":null}]}\n\n");
        }
        out.extend_from_slice(b"data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n");
        out.extend_from_slice(b"data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"bench\",\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1,\"total_tokens\":2}}\n\ndata: [DONE]\n\n");
        let all = Bytes::from(out);
        let pieces = (0..all.len())
            .step_by(64 << 10)
            .map(|i| all.slice(i..(i + (64 << 10)).min(all.len())))
            .collect();
        Self::new(Kind::Raw(pieces))
    }

    /// `n` content deltas whose text is the server's send time, `t<micros since the epoch>;`
    /// (strictly increasing across the server, so unique: a stamp taken in the same microsecond as
    /// the previous one is moved a microsecond on),
    /// each written on its own (combine with [`Reply::pace`]), then a finish chunk and `[DONE]`:
    /// for measuring how long a delta takes from the server to a subscriber.
    pub fn stamped_text(n: usize) -> Self {
        Self::new(Kind::Stamped { n })
    }

    /// A model that never stops: content deltas of `delta`, streamed for as long as the client
    /// reads (no finish reason, no `[DONE]`), for output caps.
    pub fn endless(delta: impl Into<String>) -> Self {
        Self::new(Kind::Endless(delta.into()))
    }

    /// An extra response header (e.g. `retry-after-ms`, `x-should-retry`).
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Re-splits the encoded stream into writes of `n` bytes (at least 1), so events and lines
    /// straddle network chunks.
    pub fn split_bytes(mut self, n: usize) -> Self {
        self.split_bytes = Some(n.max(1));
        self
    }

    /// Waits `d` before each write.
    pub fn pace(mut self, d: Duration) -> Self {
        self.pace = Some(d);
        self
    }

    fn respond(self, stream: bool, model: &str, n: u64) -> Response {
        let id = format!("chatcmpl-fake-{n}");
        let (status, content_type, pieces, end) = match &self.kind {
            Kind::Http { status, body } => {
                let st = StatusCode::from_u16(*status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                (
                    st,
                    "application/json",
                    vec![Piece::Bytes(Bytes::from(body.to_string()))],
                    End::Close,
                )
            }
            Kind::Raw(p) => (
                StatusCode::OK,
                "text/event-stream",
                p.iter().cloned().map(Piece::Bytes).collect(),
                End::Close,
            ),
            Kind::Stamped { n } => {
                let mut v = vec![Piece::Bytes(sse(&chunk(
                    &id,
                    model,
                    json!({"role": "assistant", "content": ""}),
                    None,
                )))];
                v.extend((0..*n).map(|_| Piece::Stamp));
                v.push(Piece::Bytes(sse(&chunk(&id, model, json!({}), Some("stop")))));
                v.push(Piece::Bytes(Bytes::from_static(b"data: [DONE]\n\n")));
                (StatusCode::OK, "text/event-stream", v, End::Close)
            }
            Kind::Endless(delta) => (
                StatusCode::OK,
                "text/event-stream",
                vec![Piece::Bytes(sse(&chunk(
                    &id,
                    model,
                    json!({"role": "assistant", "content": ""}),
                    None,
                )))],
                End::Repeat(sse(&chunk(&id, model, json!({"content": delta}), None))),
            ),
            Kind::Completion(c) if stream => {
                let (p, end) = c.stream_pieces(&id, model);
                (StatusCode::OK, "text/event-stream", p, end)
            }
            Kind::Completion(c) => {
                let (p, end) = c.json_pieces(&id, model);
                (StatusCode::OK, "application/json", p, end)
            }
        };
        let pieces = match self.split_bytes {
            Some(k) => resplit(pieces, k),
            None => pieces,
        };
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static(content_type));
        headers.insert(
            "x-request-id",
            HeaderValue::from_str(&id).unwrap_or(HeaderValue::from_static("x")),
        );
        for (k, v) in &self.headers {
            if let (Ok(k), Ok(v)) = (
                HeaderName::try_from(k.as_str()),
                HeaderValue::try_from(v.as_str()),
            ) {
                headers.insert(k, v);
            }
        }
        let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
        let pace = self.pace;
        let stamp_model = model.to_owned();
        tokio::spawn(async move {
            for p in pieces {
                if let Some(d) = pace {
                    tokio::time::sleep(d).await;
                }
                let b = match p {
                    Piece::Bytes(b) => b,
                    Piece::Stamp => stamp(&id, &stamp_model),
                };
                if tx.send(Ok(b)).await.is_err() {
                    return;
                }
            }
            match end {
                End::Close => {}
                End::Abort => {
                    let _ = tx
                        .send(Err(std::io::Error::new(
                            std::io::ErrorKind::ConnectionAborted,
                            "FakeOpenAi: connection dropped on purpose",
                        )))
                        .await;
                }
                End::Stall => tx.closed().await,
                End::Repeat(b) => while tx.send(Ok(b.clone())).await.is_ok() {},
            }
        });
        let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        }));
        let mut resp = Response::new(body);
        *resp.status_mut() = status;
        *resp.headers_mut() = headers;
        resp
    }
}

enum Piece {
    Bytes(Bytes),
    Stamp,
}

enum End {
    Close,
    Abort,
    Stall,
    /// These bytes again and again, until the client leaves.
    Repeat(Bytes),
}

fn resplit(pieces: Vec<Piece>, k: usize) -> Vec<Piece> {
    let mut all = Vec::new();
    let mut out = Vec::new();
    for p in pieces {
        match p {
            Piece::Bytes(b) => all.extend_from_slice(&b),
            Piece::Stamp => {
                flush(&mut all, &mut out, k);
                out.push(Piece::Stamp);
            }
        }
    }
    flush(&mut all, &mut out, k);
    out
}

fn flush(all: &mut Vec<u8>, out: &mut Vec<Piece>, k: usize) {
    let b = Bytes::from(std::mem::take(all));
    let mut i = 0;
    while i < b.len() {
        let j = (i + k).min(b.len());
        out.push(Piece::Bytes(b.slice(i..j)));
        i = j;
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The last stamp handed out, so stamps are unique across the server (see [`Reply::stamped_text`]).
static LAST_STAMP: AtomicU64 = AtomicU64::new(0);

fn stamp(id: &str, model: &str) -> Bytes {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0);
    let prev = LAST_STAMP
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
            Some(now.max(last + 1))
        })
        .unwrap_or(now);
    let us = now.max(prev + 1);
    Bytes::from(format!(
        "data: {{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"{model}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{us};\"}},\"finish_reason\":null}}]}}\n\n"
    ))
}

fn chunk(id: &str, model: &str, delta: Value, finish: Option<&str>) -> Value {
    json!({
        "id": id, "object": "chat.completion.chunk", "created": 1_764_000_000, "model": model,
        "system_fingerprint": "fp_fake",
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        "usage": null,
    })
}

fn pieces_of(s: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    chars.chunks(n.max(1)).map(|c| c.iter().collect()).collect()
}

impl Completion {
    fn finish(&self) -> String {
        self.finish.clone().unwrap_or_else(|| {
            if self.calls.is_empty() {
                "stop".into()
            } else {
                "tool_calls".into()
            }
        })
    }

    fn usage_json(&self) -> Option<Value> {
        self.usage.map(|(p, c, cached)| {
            json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                   "prompt_tokens_details": {"cached_tokens": cached},
                   "completion_tokens_details": {"reasoning_tokens": 0}})
        })
    }

    /// The data events of the normal stream (finish chunk included, usage and `[DONE]` not).
    fn events(&self, id: &str, model: &str) -> Vec<Value> {
        let mut ev = vec![chunk(
            id,
            model,
            json!({"role": "assistant", "content": ""}),
            None,
        )];
        for p in pieces_of(&self.reasoning, self.text_chunk) {
            ev.push(chunk(id, model, json!({"reasoning_content": p}), None));
        }
        for p in pieces_of(&self.text, self.text_chunk) {
            ev.push(chunk(id, model, json!({"content": p}), None));
        }
        // Per call: its fragments (first carries id/type/name).
        let per_call: Vec<Vec<Value>> = self
            .calls
            .iter()
            .enumerate()
            .map(|(i, (cid, name, args))| {
                let mut frags = Vec::new();
                let mut args_pieces = pieces_of(args, self.args_chunk);
                if args_pieces.is_empty() {
                    args_pieces.push(String::new());
                }
                if self.llama {
                    for a in args_pieces {
                        frags.push(json!({
                            "tool_calls": [{"index": i, "id": cid, "type": "function",
                                            "function": {"name": name, "arguments": a}}],
                            "function_call": {"name": format!("{name}:"), "arguments": a},
                        }));
                    }
                } else {
                    frags.push(json!({"tool_calls": [{"index": i, "id": cid, "type": "function",
                                                      "function": {"name": name, "arguments": ""}}]}));
                    for a in args_pieces.into_iter().filter(|a| !a.is_empty()) {
                        frags.push(json!({"tool_calls": [{"index": i, "function": {"arguments": a}}]}));
                    }
                }
                frags
            })
            .collect();
        if self.interleave {
            let mut iters: Vec<_> = per_call.into_iter().map(|v| v.into_iter()).collect();
            loop {
                let mut any = false;
                for it in iters.iter_mut() {
                    if let Some(d) = it.next() {
                        ev.push(chunk(id, model, d, None));
                        any = true;
                    }
                }
                if !any {
                    break;
                }
            }
        } else {
            for d in per_call.into_iter().flatten() {
                ev.push(chunk(id, model, d, None));
            }
        }
        ev.push(chunk(id, model, json!({}), Some(&self.finish())));
        ev
    }

    fn stream_pieces(&self, id: &str, model: &str) -> (Vec<Piece>, End) {
        let events = self.events(id, model);
        let mut out: Vec<Piece> = Vec::new();
        let (cut, fault) = match &self.fault {
            Some((n, f)) => (Some(*n), Some(f)),
            None => (None, None),
        };
        for (i, e) in events.iter().enumerate() {
            if cut == Some(i) {
                match fault {
                    Some(Fault::Error(err)) => {
                        out.push(Piece::Bytes(sse(err)));
                        return (out, End::Close);
                    }
                    Some(Fault::Drop) => return (out, End::Abort),
                    Some(Fault::Stall) => return (out, End::Stall),
                    Some(Fault::Truncate) => return (out, End::Close),
                    Some(Fault::Malformed) => {
                        out.push(Piece::Bytes(Bytes::from_static(b"data: {\"choices\": [\n\n")))
                    }
                    None => {}
                }
            }
            out.push(Piece::Bytes(sse(e)));
        }
        match fault {
            // A fault placed past the last event still happens, at the end.
            Some(Fault::Drop) if cut.is_some_and(|c| c >= events.len()) => return (out, End::Abort),
            Some(Fault::Stall) if cut.is_some_and(|c| c >= events.len()) => return (out, End::Stall),
            _ => {}
        }
        if let Some(u) = self.usage_json() {
            let choices = if self.usage_choices_null {
                Value::Null
            } else {
                json!([])
            };
            out.push(Piece::Bytes(sse(&json!({
                "id": id, "object": "chat.completion.chunk", "created": 1_764_000_000, "model": model,
                "choices": choices, "usage": u,
            }))));
        }
        if !self.no_done {
            out.push(Piece::Bytes(Bytes::from_static(b"data: [DONE]\n\n")));
        }
        (out, End::Close)
    }

    fn json_pieces(&self, id: &str, model: &str) -> (Vec<Piece>, End) {
        let mut message = json!({"role": "assistant",
            "content": if self.text.is_empty() && !self.calls.is_empty() { Value::Null } else { json!(self.text) },
            "refusal": null});
        if !self.reasoning.is_empty() {
            message["reasoning_content"] = json!(self.reasoning);
        }
        if !self.calls.is_empty() {
            message["tool_calls"] = self
                .calls
                .iter()
                .map(
                    |(i, n, a)| json!({"id": i, "type": "function", "function": {"name": n, "arguments": a}}),
                )
                .collect();
            if self.llama
                && let Some((_, n, a)) = self.calls.first()
            {
                message["function_call"] = json!({"name": format!("{n}:"), "arguments": a});
            }
        }
        let mut body = json!({
            "id": id, "object": "chat.completion", "created": 1_764_000_000, "model": model,
            "system_fingerprint": "fp_fake",
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish(), "logprobs": null}],
        });
        if let Some(u) = self.usage_json() {
            body["usage"] = u;
        }
        let text = body.to_string();
        match &self.fault {
            Some((_, Fault::Error(e))) => (vec![Piece::Bytes(Bytes::from(e.to_string()))], End::Close),
            Some((_, Fault::Drop)) => (Vec::new(), End::Abort),
            Some((_, Fault::Stall)) => (Vec::new(), End::Stall),
            Some((_, Fault::Malformed)) => (
                vec![Piece::Bytes(Bytes::from_static(b"{\"choices\": ["))],
                End::Close,
            ),
            Some((_, Fault::Truncate)) => {
                let half = text.len() / 2;
                (
                    vec![Piece::Bytes(Bytes::copy_from_slice(&text.as_bytes()[..half]))],
                    End::Close,
                )
            }
            None => (vec![Piece::Bytes(Bytes::from(text))], End::Close),
        }
    }
}
