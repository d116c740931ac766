//! # tether-openai
//!
//! [`OpenAiModel`]: a [`tether::ChatModel`] over an OpenAI-compatible
//! `POST {base_url}/chat/completions` (OpenAI, llama.cpp `llama-server`, llama-cpp-python, vLLM,
//! and the like), streaming (SSE) or not.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> tether::Result<()> {
//! # // A scripted OpenAI-compatible server on 127.0.0.1 stands in for llama-server here.
//! # let server = tether_testkit::openai::FakeOpenAi::start().await;
//! # server.push(tether_testkit::openai::Reply::text("Hi!"));
//! # let base_url = server.url();
//! use tether::{Session, local::LocalLoop};
//! use tether_openai::OpenAiModel;
//! // base_url: e.g. "http://127.0.0.1:8080/v1" (llama-server) or "https://api.openai.com/v1".
//! let model = OpenAiModel::builder(base_url).model("qwen").build()?;
//! let result = Session::builder(LocalLoop::new(model)).run("Say hi").await?;
//! assert_eq!(result.text, "Hi!");
//! # Ok(()) }
//! ```
//!
//! **Base URL.** Like the OpenAI SDKs' `OPENAI_BASE_URL`, the base URL includes the API version
//! path (`https://api.openai.com/v1`, `http://127.0.0.1:8080/v1`); `/chat/completions` is
//! appended. A base URL with no path at all (`http://127.0.0.1:8080`) gets `/v1` added, since
//! that is what every compatible server serves; any other path is used as given (for gateways
//! that mount the API elsewhere).
//!
//! **One attempt per call.** Retries belong to [`tether::local::LocalLoop`] and its
//! [`tether::RetryPolicy`]; this crate reports every failure as a typed [`tether::Error`] the
//! policy classifies: [`Error::Http`] (status, the server's message and code, `retry-after-ms`
//! / `retry-after`, `x-should-retry`), [`Error::Transport`] (refused, reset, closed, timeouts,
//! a stream idle for too long, a body cut before any `finish_reason`), [`Error::Stream`] (an
//! `error` object inside a 200 stream) and [`Error::Malformed`].

#![deny(missing_docs)]

mod accum;
mod fast;
// Entry points for the fuzz targets in `fuzz/`; not part of the API (its own docs say so: an
// outer doc here would make rustdoc resolve the module doc's links from the crate root).
#[doc(hidden)]
pub mod fuzzing;
mod transport;
mod wire;

use std::time::Duration;

use async_trait::async_trait;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;
use tether::{ChatModel, ChatRequest, ChatResponse, DeltaSink, Error, Result, TransportKind};
use tokio::time::Instant;
use transport::{Response, Transport, TransportError};

#[doc(hidden)]
pub use accum::{CallAcc, Emit, Fed, StreamAccumulator};
#[doc(hidden)]
pub use tether_http::sse::{LineSplitter, data_of};

/// A measuring hook for benchmarks (feature `bench-probe`, off by default): tells a benchmark when
/// `OpenAiModel` received the bytes of each piece of text, so it can time what happens inside
/// tether (parse, accumulation, event delivery) apart from the server and the network.
#[cfg(feature = "bench-probe")]
#[doc(hidden)]
pub mod probe {
    use std::sync::OnceLock;
    use std::time::Instant;

    type Hook = Box<dyn Fn(&str, Instant) + Send + Sync>;
    static HOOK: OnceLock<Hook> = OnceLock::new();

    /// Installs the hook, once per process (false if one was installed already). It is called,
    /// before the text is forwarded, with each network read's new text and the instant that
    /// read's bytes reached `OpenAiModel` (before line splitting and parsing).
    pub fn install(f: impl Fn(&str, Instant) + Send + Sync + 'static) -> bool {
        HOOK.set(Box::new(f)).is_ok()
    }

    pub(crate) fn text(t: &str, at: Instant) {
        if let Some(h) = HOOK.get() {
            h(t, at)
        }
    }
}

/// Whether the hand-written fast path parses this `data:` payload (rather than serde); for tests.
#[doc(hidden)]
pub fn fast_path_accepts(data: &[u8]) -> bool {
    fast::chunk(data.trim_ascii()).is_some()
}

/// The longest SSE line accepted (16 MiB); a longer one is reported as malformed.
const MAX_LINE: usize = 16 << 20;
/// The output token limit sent when the caller sets none (see [`OpenAiBuilder::max_tokens`]).
pub const DEFAULT_MAX_TOKENS: u32 = 8192;
/// The most of an error body read for its message.
const MAX_ERROR_BODY: usize = 64 << 10;

/// Configures an [`OpenAiModel`]; see each method for its default.
#[derive(Clone)]
pub struct OpenAiBuilder {
    base_url: String,
    api_key: Option<String>,
    model: String,
    headers: Vec<(String, String)>,
    connect_timeout: Duration,
    request_timeout: Duration,
    idle_timeout: Duration,
    max_tokens: Option<u32>,
    max_tokens_field: Option<String>,
    max_response_bytes: usize,
    stream: bool,
    include_usage: bool,
    extra: serde_json::Map<String, Value>,
    read_buffer: Option<usize>,
    root_certificates: Vec<String>,
}

impl std::fmt::Debug for OpenAiBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiBuilder")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("model", &self.model)
            .field(
                "headers",
                &self
                    .headers
                    .iter()
                    .map(|(k, _)| (k, "<redacted>"))
                    .collect::<Vec<_>>(),
            )
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_tokens", &self.max_tokens)
            .field("max_tokens_field", &self.max_tokens_field)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("stream", &self.stream)
            .field("include_usage", &self.include_usage)
            .field("extra", &self.extra)
            .field("read_buffer", &self.read_buffer)
            .field("root_certificates", &self.root_certificates.len())
            .finish()
    }
}

impl OpenAiBuilder {
    /// A builder for `base_url` (see the crate docs: it should include `/v1`).
    pub fn new(base_url: impl Into<String>) -> Self {
        OpenAiBuilder {
            base_url: base_url.into(),
            api_key: None,
            model: String::new(),
            headers: Vec::new(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(600),
            idle_timeout: Duration::from_secs(120),
            max_tokens: Some(DEFAULT_MAX_TOKENS),
            max_tokens_field: None,
            max_response_bytes: tether::chat::DEFAULT_MAX_RESPONSE_BYTES,
            stream: true,
            include_usage: true,
            extra: Default::default(),
            read_buffer: None,
            root_certificates: Vec::new(),
        }
    }

    /// A builder from the environment: `OPENAI_BASE_URL` (default `https://api.openai.com/v1`),
    /// `OPENAI_API_KEY` (optional) and `OPENAI_MODEL` (optional).
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let mut b = Self::new(var("OPENAI_BASE_URL").unwrap_or_else(|| "https://api.openai.com/v1".into()));
        b.api_key = var("OPENAI_API_KEY");
        if let Some(m) = var("OPENAI_MODEL") {
            b.model = m;
        }
        b
    }

    /// The API key, sent as `Authorization: Bearer <key>` (default none: local servers need none).
    /// It is redacted from `Debug` output.
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// The default model name, used when the request names none (default empty: then every
    /// request must name one, e.g. with `LocalLoop::model_name`).
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// Reads each connection through a buffer of exactly `bytes` (at least 1 KiB) instead of one
    /// that grows while reads fill it (default: growing, up to about 400 KiB).
    ///
    /// For servers relaying many concurrent streams from a fast local model: a stream that
    /// arrives faster than it is forwarded fills every read, and the growing buffer ends up
    /// holding hundreds of KiB per connection. Applies to plain `http://` endpoints not sent
    /// through a proxy (`HTTP_PROXY` or `ALL_PROXY` set, and `NO_PROXY` not exempting the host),
    /// which a lean HTTP/1.1 client of this crate then serves: per connection it holds the socket
    /// and that one buffer, and it hands over everything a read brought as one piece (one delta
    /// event per read, even from a server that sends one HTTP chunk per SSE event). `https` and
    /// proxied endpoints keep reqwest.
    pub fn read_buffer(mut self, bytes: usize) -> Self {
        self.read_buffer = Some(bytes);
        self
    }

    /// Also trusts the CA certificates in `pem` (one or more `-----BEGIN CERTIFICATE-----`
    /// blocks, e.g. a `.pem` or `.crt` file's text) for `https` endpoints, beside the built-in
    /// Mozilla roots: for a server or a TLS-inspecting proxy whose certificate chains to a private
    /// CA. Verification stays on. May be called more than once; a bundle that holds no
    /// certificate fails [`OpenAiBuilder::build`] with [`Error::Config`].
    pub fn add_root_certificates_pem(mut self, pem: impl Into<String>) -> Self {
        self.root_certificates.push(pem.into());
        self
    }

    /// An extra header sent with every request (e.g. `OpenAI-Organization`). Values are redacted
    /// from `Debug` output.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// How long connecting may take (default 5 s, as the OpenAI SDK); exceeding it is
    /// `TransportKind::ConnectTimeout`.
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// How long the response headers may take, and for a non-stream response the whole body
    /// (default 600 s, as the OpenAI SDK); exceeding it is `TransportKind::Timeout`. A stream's
    /// body is bounded by the idle timeout instead, so a long answer is never cut.
    pub fn request_timeout(mut self, d: Duration) -> Self {
        self.request_timeout = d;
        self
    }

    /// How long a stream may go without receiving a byte (default 120 s); exceeding it is
    /// `TransportKind::Idle`, which the retry policy retries. It applies to both HTTP clients.
    pub fn stream_idle_timeout(mut self, d: Duration) -> Self {
        self.idle_timeout = d;
        self
    }

    /// The output token limit sent with every request (default [`DEFAULT_MAX_TOKENS`], 8192),
    /// so a model that would never stop is asked to. Raise it for reasoning models (their
    /// reasoning counts against it); lower it, or [`no_max_tokens`](Self::no_max_tokens), for a
    /// server that counts it against a small context (vLLM refuses a request whose prompt plus
    /// `max_tokens` exceeds `max_model_len`). Whatever it is,
    /// [`max_response_bytes`](Self::max_response_bytes) still caps what one response may bring.
    pub fn max_tokens(mut self, n: u32) -> Self {
        self.max_tokens = Some(n);
        self
    }

    /// Sends no output token limit: the server's own default applies (for llama.cpp, until the
    /// context is full). [`max_response_bytes`](Self::max_response_bytes) still applies.
    pub fn no_max_tokens(mut self) -> Self {
        self.max_tokens = None;
        self
    }

    /// The field the limit is sent as (default: `max_completion_tokens` for `api.openai.com`,
    /// whose reasoning models refuse `max_tokens`; `max_tokens` for every other server, which is
    /// what local servers accept).
    pub fn max_tokens_field(mut self, name: impl Into<String>) -> Self {
        self.max_tokens_field = Some(name.into());
        self
    }

    /// The most one response may bring, in bytes of text, reasoning and tool-call arguments
    /// together (default [`tether::chat::DEFAULT_MAX_RESPONSE_BYTES`], 8 MiB); past it the call
    /// stops with [`Error::ResponseTooLarge`], which is not retried. A non-streamed body may be
    /// at most four times this (JSON escapes) plus 64 KiB.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// Whether to stream (default true). Deltas reach the `DeltaSink` in both modes; without a
    /// stream they arrive all at once when the response is complete.
    pub fn stream(mut self, on: bool) -> Self {
        self.stream = on;
        self
    }

    /// Whether to ask for the usage chunk of a stream (`stream_options.include_usage`, default
    /// true). Turn it off for servers that reject `stream_options`.
    pub fn include_usage(mut self, on: bool) -> Self {
        self.include_usage = on;
        self
    }

    /// An extra top-level request field (`temperature`, `seed`, `parallel_tool_calls`, ...).
    /// Fields tether sets itself (`model`, `messages`, `tools`, `stream`, `stream_options`, the
    /// token limit) cannot be overridden this way.
    pub fn extra_body(mut self, key: impl Into<String>, value: Value) -> Self {
        self.extra.insert(key.into(), value);
        self
    }

    /// Builds the model (and its HTTP client).
    ///
    /// Errors: [`Error::Config`] for a base URL that is not an `http(s)` URL, an invalid header,
    /// or an HTTP client that cannot be built.
    pub fn build(self) -> Result<OpenAiModel> {
        let endpoint = endpoint_of(&self.base_url)?;
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(k) = &self.api_key {
            let mut v = HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| {
                Error::config(
                    tether::ConfigKind::Invalid,
                    "the API key contains characters not allowed in a header",
                )
            })?;
            v.set_sensitive(true);
            headers.insert(AUTHORIZATION, v);
        }
        for (k, v) in &self.headers {
            let name = HeaderName::from_bytes(k.as_bytes()).map_err(|_| {
                Error::config(
                    tether::ConfigKind::Invalid,
                    format!("{k:?} is not a valid HTTP header name"),
                )
            })?;
            let mut value = HeaderValue::from_str(v).map_err(|_| {
                Error::config(
                    tether::ConfigKind::Invalid,
                    format!("the value of header {k:?} is not a valid header value"),
                )
            })?;
            value.set_sensitive(true);
            headers.insert(name, value);
        }
        // Checked even when the lean client serves (plain http): a bad bundle is a bad config.
        let client = tether_http::add_root_certificates(reqwest::Client::builder(), &self.root_certificates)?;
        let http = match Transport::bounded(&endpoint, self.read_buffer, &headers, self.connect_timeout) {
            Some(t) => t,
            None => Transport::Reqwest(
                client
                    .default_headers(headers)
                    .connect_timeout(self.connect_timeout)
                    .tcp_nodelay(true)
                    .pool_idle_timeout(Duration::from_secs(60))
                    .build()
                    .map_err(|e| {
                        Error::config_with(tether::ConfigKind::Setup, "cannot build the HTTP client", e)
                    })?,
            ),
        };
        let max_tokens_field = self.max_tokens_field.clone().unwrap_or_else(|| {
            let openai = reqwest::Url::parse(&endpoint)
                .ok()
                .and_then(|u| u.host_str().map(|h| h.eq_ignore_ascii_case("api.openai.com")))
                .unwrap_or(false);
            if openai {
                "max_completion_tokens"
            } else {
                "max_tokens"
            }
            .to_owned()
        });
        Ok(OpenAiModel {
            http,
            endpoint,
            max_tokens_field,
            cfg: self,
        })
    }
}

fn endpoint_of(base_url: &str) -> Result<String> {
    let url = reqwest::Url::parse(base_url.trim()).map_err(|e| {
        Error::config(
            tether::ConfigKind::Invalid,
            format!("the base URL {base_url:?} is not a URL ({e}); expected e.g. http://127.0.0.1:8080/v1"),
        )
    })?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(Error::config(
            tether::ConfigKind::Invalid,
            format!("the base URL {base_url:?} must be http or https"),
        ));
    }
    let mut s = url.as_str().trim_end_matches('/').to_owned();
    if matches!(url.path(), "" | "/") && url.query().is_none() {
        s.push_str("/v1");
    }
    s.push_str("/chat/completions");
    Ok(s)
}

/// A [`ChatModel`] over OpenAI-compatible chat completions. Build it with
/// [`OpenAiModel::builder`]; cloning is cheap (the HTTP connection pool is shared).
#[derive(Clone)]
pub struct OpenAiModel {
    http: Transport,
    endpoint: String,
    /// The field the token limit is sent as.
    max_tokens_field: String,
    cfg: OpenAiBuilder,
}

impl std::fmt::Debug for OpenAiModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiModel")
            .field("endpoint", &self.endpoint)
            .field("config", &self.cfg)
            .finish()
    }
}

impl OpenAiModel {
    /// A builder for `base_url` (e.g. `http://127.0.0.1:8080/v1`).
    pub fn builder(base_url: impl Into<String>) -> OpenAiBuilder {
        OpenAiBuilder::new(base_url)
    }

    /// The URL requests are posted to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn transport(&self, kind: TransportKind, message: impl Into<String>) -> Error {
        Error::transport(kind, message, self.endpoint.clone())
    }

    fn transport_error(&self, e: TransportError) -> Error {
        e.into_error(&self.endpoint)
    }

    async fn http_error(&self, resp: Response, deadline: Instant) -> Error {
        let status = resp.status();
        let tether_http::RetryHeaders {
            retry_after,
            should_retry,
            ..
        } = tether_http::retry_headers(resp.headers());
        let body = read_capped(resp, deadline, MAX_ERROR_BODY).await;
        let (message, code) = match serde_json::from_slice::<Value>(&body) {
            Ok(v) => {
                let err = v.get("error").unwrap_or(&v);
                let (m, c) = wire::error_parts(err);
                let m = m.or_else(|| {
                    ["message", "detail"]
                        .iter()
                        .find_map(|k| v.get(*k).and_then(Value::as_str).map(str::to_owned))
                });
                (m, c)
            }
            Err(_) => {
                let t = String::from_utf8_lossy(&body).trim().to_owned();
                ((!t.is_empty()).then(|| accum::snippet(t.as_bytes())), None)
            }
        };
        let message = message.unwrap_or_else(|| {
            status
                .canonical_reason()
                .unwrap_or("no error message in the response")
                .to_owned()
        });
        Error::Http {
            status: status.as_u16(),
            message,
            code,
            retry_after,
            should_retry,
            endpoint: self.endpoint.clone(),
        }
    }

    async fn read_stream(&self, mut resp: Response, deltas: &DeltaSink) -> Result<ChatResponse> {
        let idle = self.cfg.idle_timeout;
        let mut lines = LineSplitter::new();
        let mut acc = StreamAccumulator::with_limit(self.cfg.max_response_bytes);
        let sleep = tokio::time::sleep(idle);
        tokio::pin!(sleep);
        let mut done = false;
        'read: loop {
            let item = tokio::select! {
                biased;
                item = resp.chunk() => item,
                _ = &mut sleep => {
                    return Err(self.transport(
                        TransportKind::Idle,
                        format!("the stream sent nothing for {idle:?} (after {} events); raise stream_idle_timeout for slow models", acc.events()),
                    ));
                }
            };
            match item {
                Ok(None) => break,
                Err(e) => return Err(self.transport_error(e)),
                Ok(Some(bytes)) => {
                    #[cfg(feature = "bench-probe")]
                    let arrived = std::time::Instant::now();
                    sleep.as_mut().reset(after(idle));
                    lines.push(bytes);
                    if feed_read(&mut lines, &mut acc)? == Fed::Done {
                        done = true;
                        break 'read;
                    }
                    lines.release();
                    #[cfg(feature = "bench-probe")]
                    for e in acc.emits() {
                        if let Emit::Text(r) = e {
                            probe::text(&acc.text()[r.clone()], arrived);
                        }
                    }
                    // One delta per network read: contiguous pieces merge, so a busy stream
                    // costs one event per read rather than one per chunk, with no added delay.
                    forward(&acc, deltas).await;
                    acc.clear_emits();
                    if lines.pending_len() > MAX_LINE {
                        return Err(Error::malformed(format!(
                            "an SSE line exceeded {MAX_LINE} bytes without ending"
                        )));
                    }
                }
            }
        }
        if !done {
            if let Some(line) = lines.finish()
                && let Some(data) = data_of(line)
            {
                done = acc.feed(data)? == Fed::Done;
            }
            if !done {
                if acc.finish_reason().is_none() {
                    return Err(self.transport(
                        TransportKind::Closed,
                        format!(
                            "the stream ended before any finish_reason (truncated after {} events)",
                            acc.events()
                        ),
                    ));
                }
                tracing::warn!(endpoint = %self.endpoint, "the stream ended without data: [DONE]; accepting it after its finish_reason");
            }
        }
        acc.finish()?;
        forward(&acc, deltas).await;
        Ok(acc.into_response())
    }

    async fn read_json(
        &self,
        mut resp: Response,
        deadline: Instant,
        deltas: &DeltaSink,
    ) -> Result<ChatResponse> {
        let limit = self.cfg.max_response_bytes;
        let body_cap = limit.saturating_mul(4).saturating_add(64 << 10);
        let mut bytes = Vec::new();
        loop {
            match tokio::time::timeout_at(deadline, resp.chunk()).await {
                Err(_) => {
                    return Err(self.transport(
                        TransportKind::Timeout,
                        format!(
                            "the response body did not arrive within {:?}",
                            self.cfg.request_timeout
                        ),
                    ));
                }
                Ok(Err(e)) => return Err(self.transport_error(e)),
                Ok(Ok(None)) => break,
                Ok(Ok(Some(c))) => {
                    if bytes.len() + c.len() > body_cap {
                        return Err(Error::ResponseTooLarge { limit: limit as u64 });
                    }
                    bytes.extend_from_slice(&c);
                }
            }
        }
        let raw: Value = serde_json::from_slice(&bytes).map_err(|e| Error::Malformed {
            message: format!("the response is not JSON ({e}): {}", accum::snippet(&bytes)),
            source: Some(e.into()),
        })?;
        if let Some(err) = raw.get("error").filter(|e| !e.is_null()) {
            let (message, code) = wire::error_parts(err);
            return Err(Error::Stream {
                message: message.unwrap_or_else(|| err.to_string()),
                code,
            });
        }
        let completion: wire::Completion = serde_json::from_value(raw.clone())
            .map_err(|e| Error::malformed_with("the response is not a chat.completion", e))?;
        let choice = completion
            .choices
            .into_iter()
            .find(|c| c.index == 0)
            .ok_or_else(|| Error::malformed("the response has no choice with index 0"))?;
        let m = choice.message.unwrap_or_default();
        let mut text = wire::content_text(&m.content);
        if let Some(r) = &m.refusal {
            text.push_str(r);
        }
        let reasoning = m.reasoning_content.or(m.reasoning).filter(|r| !r.is_empty());
        let base = raw
            .get("id")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()));
        let mut calls = Vec::new();
        for (i, c) in m.tool_calls.iter().enumerate() {
            let f = c.function.as_ref();
            // A call without a name is kept: the engine answers it with an error result.
            let name = f.and_then(|f| f.name.clone()).unwrap_or_default();
            let id =
                c.id.clone()
                    .filter(|s| !s.is_empty())
                    .unwrap_or_else(|| format!("call_{base}_{i}"));
            calls.push(tether::ChatToolCall::new(
                id,
                name,
                f.map(|f| f.arguments_text()).unwrap_or_default(),
            ));
        }
        if calls.is_empty()
            && let Some(f) = &m.function_call
            && let Some(name) = f.name.clone().filter(|n| !n.is_empty())
        {
            calls.push(tether::ChatToolCall::new(
                format!("call_{base}_0"),
                name,
                f.arguments_text(),
            ));
        }
        let kept = text.len()
            + reasoning.as_ref().map_or(0, String::len)
            + calls
                .iter()
                .map(|c| c.id.len() + c.name.len() + c.arguments.len())
                .sum::<usize>();
        if kept > limit {
            return Err(Error::ResponseTooLarge { limit: limit as u64 });
        }
        if let Some(r) = &reasoning {
            deltas.reasoning(r).await;
        }
        deltas.text(&text).await;
        for c in &calls {
            deltas.tool_call_start(&c.id, &c.name).await;
            deltas.tool_call_args(&c.id, &c.arguments).await;
            deltas.tool_call_end(&c.id).await;
        }
        let mut message = tether::ChatMessage::assistant(text);
        if message.content.as_deref() == Some("") && !calls.is_empty() {
            message.content = None;
        }
        message.reasoning = reasoning;
        message.tool_calls = calls;
        let mut response = ChatResponse::new(message)
            .with_usage(completion.usage.and_then(wire::usage_of))
            .with_raw(raw);
        response.finish_reason = choice.finish_reason.filter(|f| !f.is_empty());
        Ok(response)
    }
}

/// Feeds the complete lines of the chunk just pushed into `lines` to `acc`, up to `[DONE]`.
///
/// Runs of events that are the last content-only chunk with another content are taken whole
/// (`StreamAccumulator::feed_templated`: one comparison against the template per event instead
/// of a line search, the `data:` strip and a payload trim); everything else goes line by line.
#[doc(hidden)]
pub fn feed_read(lines: &mut LineSplitter, acc: &mut StreamAccumulator) -> Result<Fed> {
    loop {
        if let Some(rest) = lines.rest() {
            let n = acc.feed_templated(rest);
            lines.advance(n);
            acc.check_size()?;
        }
        let Some(line) = lines.next_line() else {
            return Ok(Fed::More);
        };
        if let Some(data) = data_of(line)
            && acc.feed(data)? == Fed::Done
        {
            return Ok(Fed::Done);
        }
    }
}

/// Forwards the accumulator's pending emits to the sink.
async fn forward(acc: &StreamAccumulator, deltas: &DeltaSink) {
    for e in acc.emits() {
        match e {
            Emit::Text(r) => deltas.text(&acc.text()[r.clone()]).await,
            Emit::Reasoning(r) => deltas.reasoning(&acc.reasoning()[r.clone()]).await,
            Emit::Start(s) => {
                let c = &acc.calls()[*s];
                deltas.tool_call_start(&c.id, &c.name).await
            }
            Emit::Args(s, r) => {
                let c = &acc.calls()[*s];
                deltas.tool_call_args(&c.id, &c.arguments[r.clone()]).await
            }
            Emit::End(s) => deltas.tool_call_end(&acc.calls()[*s].id).await,
        }
    }
}

/// `d` from now, or a far future when that overflows the clock (a `Duration::MAX` setting).
fn after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

async fn read_capped(mut resp: Response, deadline: Instant, cap: usize) -> Vec<u8> {
    let mut out = Vec::new();
    while out.len() < cap {
        match tokio::time::timeout_at(deadline, resp.chunk()).await {
            Ok(Ok(Some(c))) => out.extend_from_slice(&c[..c.len().min(cap - out.len())]),
            _ => break,
        }
    }
    out
}

#[async_trait]
impl ChatModel for OpenAiModel {
    fn name(&self) -> &str {
        "openai"
    }

    fn default_model(&self) -> &str {
        &self.cfg.model
    }

    fn endpoint(&self) -> Option<&str> {
        Some(&self.endpoint)
    }

    async fn chat(&self, req: &ChatRequest, deltas: &DeltaSink) -> Result<ChatResponse> {
        let model = if req.model.is_empty() {
            self.cfg.model.as_str()
        } else {
            req.model.as_str()
        };
        if model.is_empty() {
            return Err(Error::config(
                tether::ConfigKind::Invalid,
                "no model name: set OpenAiBuilder::model or name one in the request (LocalLoop::model_name)",
            ));
        }
        let stream = self.cfg.stream;
        let body = serde_json::to_vec(&wire::WireRequest {
            model,
            req,
            opts: wire::RequestOptions {
                stream,
                include_usage: self.cfg.include_usage,
                max_tokens: self.cfg.max_tokens.map(|n| (self.max_tokens_field.as_str(), n)),
                extra: &self.cfg.extra,
            },
        })
        .map_err(|e| Error::provider("openai", format!("cannot encode the request: {e}")))?;
        let deadline = after(self.cfg.request_timeout);
        let accept = if stream {
            "text/event-stream"
        } else {
            "application/json"
        };
        let traceparent = tether_http::traceparent_header(deltas.traceparent());
        let send = self.http.post(&self.endpoint, accept, body, traceparent);
        let resp = match tokio::time::timeout_at(deadline, send).await {
            Err(_) => {
                return Err(self.transport(
                    TransportKind::Timeout,
                    format!(
                        "no response within {:?} (request timeout)",
                        self.cfg.request_timeout
                    ),
                ));
            }
            Ok(Err(e)) => return Err(self.transport_error(e)),
            Ok(Ok(r)) => r,
        };
        if !resp.status().is_success() {
            return Err(self.http_error(resp, deadline).await);
        }
        let is_sse = resp
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
        if is_sse {
            self.read_stream(resp, deltas).await
        } else {
            // Also when a server ignored `stream: true` and answered with one JSON object.
            self.read_json(resp, deadline, deltas).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        let e = |u: &str| endpoint_of(u).unwrap();
        assert_eq!(
            e("http://127.0.0.1:8080/v1"),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(
            e("http://127.0.0.1:8080/v1/"),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(
            e("http://127.0.0.1:8080"),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(
            e("https://gw.example/openai"),
            "https://gw.example/openai/chat/completions"
        );
        assert!(matches!(
            endpoint_of("ftp://x"),
            Err(Error::Config {
                kind: tether::ConfigKind::Invalid,
                ..
            })
        ));
        assert!(matches!(
            endpoint_of("not a url"),
            Err(Error::Config {
                kind: tether::ConfigKind::Invalid,
                ..
            })
        ));
    }

    #[test]
    fn the_token_limit_field_follows_the_server() {
        let field = |u: &str| OpenAiModel::builder(u).build().unwrap().max_tokens_field;
        assert_eq!(field("https://api.openai.com/v1"), "max_completion_tokens");
        assert_eq!(field("http://127.0.0.1:8080/v1"), "max_tokens");
        let m = OpenAiModel::builder("https://api.openai.com/v1")
            .max_tokens_field("max_tokens")
            .build()
            .unwrap();
        assert_eq!(m.max_tokens_field, "max_tokens");
    }

    #[test]
    fn a_huge_timeout_does_not_overflow_the_clock() {
        let _ = after(Duration::MAX);
    }

    #[test]
    fn debug_redacts_the_key() {
        let b = OpenAiModel::builder("http://x/v1")
            .api_key("sk-secret")
            .header("x-k", "hidden");
        let s = format!("{b:?}");
        assert!(!s.contains("sk-secret") && !s.contains("hidden"), "{s}");
        let m = b.build().unwrap();
        assert!(!format!("{m:?}").contains("sk-secret"));
    }
}
