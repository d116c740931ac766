//! [`AgentCore`]: the [`Provider`] for Bedrock AgentCore (Harness and Runtime modes).

use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures_util::StreamExt;
use serde_json::{Map, Value, json};
use tether::{
    Error, Event, EventKind, Input, Opened, Provider, Resume, RetryPolicy, Role, StopReason, Terminal,
    ToolResult, TransportKind, TurnContext, TurnResult, retry::parse_retry_after,
};
use tether_http::sse::SseDecoder;

use crate::converse::Fold;
use crate::eventstream::{Frame, FrameDecoder};
use crate::sigv4::{AwsCredentials, SERVICE, resolve_region, sign_request};

/// The raw type of the assistant message recorded at the end of each turn (its raw payload is
/// the Converse assistant message, which a harness resume sends back with the tool results).
pub const MESSAGE: &str = "agentcore.message";

/// The session-id header.
pub const SESSION_HEADER: &str = "X-Amzn-Bedrock-AgentCore-Runtime-Session-Id";
/// The user-id header.
pub const USER_HEADER: &str = "X-Amzn-Bedrock-AgentCore-Runtime-User-Id";
/// The turn-id header (a custom header, always passed to the container).
pub const TURN_HEADER: &str = "X-Amzn-Bedrock-AgentCore-Runtime-Custom-Turn-Id";

/// What to invoke.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Target {
    /// `InvokeHarness` on a harness ARN, at an endpoint (`None`: `DEFAULT`).
    Harness {
        /// The harness ARN.
        arn: String,
        /// The endpoint name.
        qualifier: Option<String>,
    },
    /// `InvokeAgentRuntime` on a runtime ARN, at an endpoint (`None`: `DEFAULT`).
    Runtime {
        /// The agent runtime ARN.
        arn: String,
        /// The endpoint name.
        qualifier: Option<String>,
    },
}

/// How to reach AgentCore.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AgentCoreConfig {
    /// What to invoke.
    pub target: Target,
    /// The region (see [`resolve_region`]).
    pub region: String,
    /// The credentials.
    pub credentials: AwsCredentials,
    /// The data-plane origin (default `https://bedrock-agentcore.<region>.amazonaws.com`).
    pub endpoint: Option<String>,
    /// The runtime session id (33–256 characters; default: a fresh 36-character id).
    pub session_id: Option<String>,
    /// The end-user id passed to the runtime.
    pub user_id: Option<String>,
    /// Retries of a failed or truncated turn (default 2).
    pub invoke_retries: u32,
    /// Longest silence between two chunks of a response (default 300 s, longer than the other
    /// providers' 120 s: the remote loop runs its own tools between chunks, and a retried
    /// invocation runs them again). Exceeding it fails the attempt as `Transport{kind: Idle}`,
    /// which is retried up to `invoke_retries`.
    pub idle_timeout: Duration,
    /// The most one turn's response may bring: its text, reasoning and tool-call names and
    /// inputs together (default [`tether::chat::DEFAULT_MAX_RESPONSE_BYTES`], 8 MiB), and
    /// sixteen times that of raw body (framing included). Past either the turn fails with
    /// [`Error::ResponseTooLarge`], not retried.
    pub max_response_bytes: usize,
    /// Per-invocation harness overrides (`model`, `systemPrompt`, `maxIterations`, `maxTokens`,
    /// `timeoutSeconds`, ...), sent beside `messages`.
    pub overrides: Map<String, Value>,
    /// Backoff between retries (its sleeper is injectable for tests).
    pub retry: RetryPolicy,
    /// Runtime mode: also call `StopRuntimeSession` when the provider is closed (default
    /// `false`: the microVM stays warm for a later reattach with the same session id, until its
    /// idle timeout). A turn dropped by a cancel or a timeout stops the session regardless.
    pub stop_session_on_close: bool,
    /// Extra CA certificates to trust beside the built-in roots, as PEM bundles (default none);
    /// see [`AgentCoreConfig::add_root_certificates_pem`].
    pub root_certificates: Vec<String>,
}

impl AgentCoreConfig {
    /// A configuration for `target` with credentials from the environment and the region
    /// resolved from `region` or the environment.
    pub fn from_env(target: Target, region: Option<&str>) -> tether::Result<Self> {
        Ok(Self::new(
            target,
            resolve_region(region),
            AwsCredentials::from_env()?,
        ))
    }

    /// A configuration with explicit credentials.
    pub fn new(target: Target, region: impl Into<String>, credentials: AwsCredentials) -> Self {
        AgentCoreConfig {
            target,
            region: region.into(),
            credentials,
            endpoint: None,
            session_id: None,
            user_id: None,
            invoke_retries: 2,
            idle_timeout: Duration::from_secs(300),
            max_response_bytes: tether::chat::DEFAULT_MAX_RESPONSE_BYTES,
            overrides: Map::new(),
            retry: RetryPolicy::default(),
            stop_session_on_close: false,
            root_certificates: Vec::new(),
        }
    }

    /// The same configuration also trusting the CA certificates in `pem` (one or more
    /// `-----BEGIN CERTIFICATE-----` blocks, e.g. a `.pem` or `.crt` file's text) beside the
    /// built-in Mozilla roots: for an endpoint (a VPC endpoint, a TLS-inspecting proxy) whose
    /// certificate chains to a private CA. Verification stays on. May be called more than once;
    /// a bundle that holds no certificate fails [`AgentCore::new`] with [`Error::Config`].
    pub fn add_root_certificates_pem(mut self, pem: impl Into<String>) -> Self {
        self.root_certificates.push(pem.into());
        self
    }
}

/// Checks a runtime session id: 33–256 characters of `[a-zA-Z0-9][a-zA-Z0-9-_]*`.
pub fn validate_session_id(id: &str) -> tether::Result<()> {
    let ok_chars = id
        .chars()
        .enumerate()
        .all(|(i, c)| c.is_ascii_alphanumeric() || (i > 0 && (c == '-' || c == '_')));
    if !(33..=256).contains(&id.len()) || !ok_chars {
        return Err(Error::config(
            tether::ConfigKind::Invalid,
            format!(
                "the AgentCore runtime session id must be 33-256 characters of [a-zA-Z0-9-_] starting with a \
             letter or digit (got {} characters); a UUID qualifies",
                id.len()
            ),
        ));
    }
    Ok(())
}

fn random_hex(n: usize) -> String {
    (0..n)
        .map(|_| format!("{:x}", rand::random::<u8>() & 0xf))
        .collect()
}

fn new_session_id() -> String {
    let h = random_hex(32);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Percent-encodes everything but unreserved characters.
fn enc(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// One attempt's outcome.
enum Attempt {
    Done(Box<(Fold, Vec<(String, Value)>)>),
    /// Retry (truncated stream, bad frame, transient failure).
    Retry(Error, bool),
}

/// The Bedrock AgentCore provider; see the [crate docs](crate).
pub struct AgentCore {
    config: AgentCoreConfig,
    http: reqwest::Client,
    session_id: String,
    resumed: bool,
    /// The assistant turn awaiting tool results (not persisted by the harness).
    pending_assistant: Option<Value>,
    turns: u64,
    /// A turn started and did not return (its future was dropped: cancel or timeout).
    in_flight: bool,
}

impl std::fmt::Debug for AgentCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentCore")
            .field("config", &self.config)
            .field("session_id", &self.session_id)
            .finish()
    }
}

impl AgentCore {
    /// A provider for `config`; fails on an invalid session id.
    pub fn new(config: AgentCoreConfig) -> tether::Result<Self> {
        let (session_id, resumed) = match &config.session_id {
            Some(s) => {
                validate_session_id(s)?;
                (s.clone(), true)
            }
            None => (new_session_id(), false),
        };
        let http = tether_http::add_root_certificates(reqwest::Client::builder(), &config.root_certificates)?
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(config.idle_timeout)
            .build()
            .map_err(|e| Error::config_with(tether::ConfigKind::Setup, "cannot build the HTTP client", e))?;
        Ok(AgentCore {
            config,
            http,
            session_id,
            resumed,
            pending_assistant: None,
            turns: 0,
            in_flight: false,
        })
    }

    fn origin(&self) -> String {
        self.config
            .endpoint
            .clone()
            .unwrap_or_else(|| format!("https://bedrock-agentcore.{}.amazonaws.com", self.config.region))
            .trim_end_matches('/')
            .to_owned()
    }

    fn url(&self) -> String {
        let q = |qualifier: &Option<String>| {
            qualifier
                .as_deref()
                .map(|x| format!("qualifier={}", enc(x)))
                .unwrap_or_default()
        };
        match &self.config.target {
            Target::Harness { arn, qualifier } => {
                let mut u = format!("{}/harnesses/invoke?harnessArn={}", self.origin(), enc(arn));
                if qualifier.is_some() {
                    u.push('&');
                    u.push_str(&q(qualifier));
                }
                u
            }
            Target::Runtime { arn, qualifier } => {
                let mut u = format!("{}/runtimes/{}/invocations", self.origin(), enc(arn));
                if qualifier.is_some() {
                    u.push('?');
                    u.push_str(&q(qualifier));
                }
                u
            }
        }
    }

    /// `StopRuntimeSession` (runtime mode): ends the microVM of this session and cuts any stream
    /// in flight. `POST /runtimes/{arn}/stopruntimesession[?qualifier=]` with the session-id header
    /// and a fresh `clientToken` (idempotency). Returns whether a request was made.
    pub async fn stop_runtime_session(&self) -> tether::Result<bool> {
        let Target::Runtime { arn, qualifier } = &self.config.target else {
            return Ok(false);
        };
        let mut url = format!("{}/runtimes/{}/stopruntimesession", self.origin(), enc(arn));
        if let Some(q) = qualifier {
            url.push_str("?qualifier=");
            url.push_str(&enc(q));
        }
        let body = serde_json::to_vec(&json!({"clientToken": new_session_id()}))
            .map_err(|e| Error::config_with(tether::ConfigKind::Invalid, "cannot encode the request", e))?;
        let headers = vec![
            ("host".to_owned(), host_of(&url)?),
            ("content-type".to_owned(), "application/json".to_owned()),
            ("accept".to_owned(), "application/json".to_owned()),
            (SESSION_HEADER.to_owned(), self.session_id.clone()),
        ];
        let signed = sign_request(
            "POST",
            &url,
            &headers,
            &body,
            &self.config.credentials,
            &self.config.region,
            SERVICE,
            SystemTime::now(),
        )?;
        let mut rb = self.http.post(&url).timeout(Duration::from_secs(30)).body(body);
        for (k, v) in headers.iter().chain(signed.iter()) {
            if k != "host" {
                rb = rb.header(k.as_str(), v.as_str());
            }
        }
        let resp = rb.send().await.map_err(|e| transport(e, &url))?;
        if !resp.status().is_success() {
            return Err(http_error(resp, &url).await);
        }
        Ok(true)
    }

    fn is_harness(&self) -> bool {
        matches!(self.config.target, Target::Harness { .. })
    }

    /// The request body for an input.
    fn body(&self, input: &Input, turn_id: &str) -> tether::Result<Value> {
        if self.is_harness() {
            let messages = match input {
                Input::Message(t) => json!([{"role": "user", "content": [{"text": t}]}]),
                Input::ToolResults(answered) => {
                    let assistant = self.pending_assistant.clone().unwrap_or_else(|| {
                        let content: Vec<Value> = answered
                            .iter()
                            .map(|a| &a.tool_use)
                            .map(
                                |u| json!({"toolUse": {"toolUseId": u.id, "name": u.name, "input": u.input}}),
                            )
                            .collect();
                        json!({"role": "assistant", "content": content})
                    });
                    let content: Vec<Value> = answered.iter().map(|a| tool_result_block(&a.result)).collect();
                    json!([assistant, {"role": "user", "content": content}])
                }
                Input::Raw(v) if v["messages"].is_array() => v["messages"].clone(),
                _ => {
                    return Err(Error::config(
                        tether::ConfigKind::Unsupported,
                        "AgentCore takes a message, tool results, or a raw {\"messages\": [...]} input",
                    ));
                }
            };
            let mut body = self.config.overrides.clone();
            body.insert("messages".into(), messages);
            Ok(Value::Object(body))
        } else {
            let mut body = match input {
                Input::Message(t) => json!({"prompt": t}),
                Input::ToolResults(answered) => json!({
                    "tool_uses": answered.iter().map(|a| &a.tool_use).collect::<Vec<_>>(),
                    "tool_results": answered.iter().map(|a| &a.result).collect::<Vec<_>>(),
                }),
                Input::Raw(v) if v.is_object() => v.clone(),
                _ => {
                    return Err(Error::config(
                        tether::ConfigKind::Unsupported,
                        "AgentCore runtime takes a message, tool results or a raw object",
                    ));
                }
            };
            body["turn_id"] = json!(turn_id);
            body["session_id"] = json!(self.session_id);
            Ok(body)
        }
    }

    async fn attempt(&self, body: &[u8], turn_id: &str, cx: &TurnContext, n: u32) -> tether::Result<Attempt> {
        let url = self.url();
        let host = host_of(&url)?;
        let accept = if self.is_harness() {
            "application/vnd.amazon.eventstream"
        } else {
            "application/json, text/event-stream"
        };
        let mut headers = vec![
            ("host".to_owned(), host),
            ("content-type".to_owned(), "application/json".to_owned()),
            ("accept".to_owned(), accept.to_owned()),
            (SESSION_HEADER.to_owned(), self.session_id.clone()),
            (TURN_HEADER.to_owned(), turn_id.to_owned()),
        ];
        if let Some(u) = &self.config.user_id {
            headers.push((USER_HEADER.to_owned(), u.clone()));
        }
        let signed = sign_request(
            "POST",
            &url,
            &headers,
            body,
            &self.config.credentials,
            &self.config.region,
            SERVICE,
            SystemTime::now(),
        )?;
        let mut rb = self.http.post(&url).body(body.to_vec());
        for (k, v) in headers.iter().chain(signed.iter()) {
            if k != "host" {
                rb = rb.header(k.as_str(), v.as_str());
            }
        }
        // Unsigned (SigV4 signs the headers it lists): the invocation joins the session's trace.
        let rb = tether_http::with_traceparent(rb, cx.sink.traceparent(""));
        let resp = match rb.send().await {
            Ok(r) => r,
            Err(e) => {
                let err = transport(e, &url);
                let retry = err.is_transient();
                return Ok(Attempt::Retry(err, retry));
            }
        };
        if !resp.status().is_success() {
            let err = http_error(resp, &url).await;
            let retry = err.is_transient();
            return Ok(Attempt::Retry(err, retry));
        }
        let is_sse = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|c| c.starts_with("text/event-stream"));
        let is_json = !self.is_harness() && !is_sse;
        let mut stream = resp.bytes_stream();
        let mut fold = Fold::default();
        let mut frames: Vec<(String, Value)> = Vec::new();
        let mut dec = FrameDecoder::new();
        let mut sse = SseDecoder::new();
        let mut json_body = Vec::new();
        let message_id = format!("{turn_id}-a{n}");
        let limit = self.config.max_response_bytes;
        let raw_limit = limit.saturating_mul(16);
        let mut raw = 0usize;
        loop {
            let next = tokio::time::timeout(self.config.idle_timeout, stream.next()).await;
            let chunk = match next {
                Err(_) => {
                    let err = Error::transport(
                        TransportKind::Idle,
                        format!("no data for {:?}", self.config.idle_timeout),
                        url.clone(),
                    );
                    return Ok(Attempt::Retry(err, true));
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => return Ok(Attempt::Retry(transport(e, &url), true)),
                Ok(Some(Ok(c))) => c,
            };
            raw = raw.saturating_add(chunk.len());
            if raw > raw_limit {
                return Err(Error::ResponseTooLarge { limit: limit as u64 });
            }
            if is_json {
                json_body.extend_from_slice(&chunk);
                continue;
            }
            let decoded: Vec<(String, Value)> = if is_sse || !self.is_harness() {
                sse.push(&chunk)
                    .into_iter()
                    .flat_map(|f| runtime_events(&f.data))
                    .collect()
            } else {
                match dec.push(&chunk) {
                    Ok(fs) => {
                        let mut v = Vec::new();
                        for f in fs {
                            match f {
                                Frame::Event { event_type, payload } => v.push((event_type, payload)),
                                Frame::Exception { kind, message } => {
                                    // Surfaced as an error event, then a typed error; never retried.
                                    cx.sink
                                        .emit(Event::new(
                                            format!("{turn_id}:error"),
                                            "agentcore.stream_error",
                                            json!({"__stream_error__": {"type": kind, "message": message}}),
                                            EventKind::Error {
                                                code: kind.clone(),
                                                message: message.clone(),
                                            },
                                        ))
                                        .await?;
                                    return Err(Error::Stream {
                                        message,
                                        code: Some(kind),
                                    });
                                }
                            }
                        }
                        v
                    }
                    Err(e) => return Ok(Attempt::Retry(e, true)),
                }
            };
            for (ty, p) in decoded {
                if let Some(t) = fold.apply(&ty, &p) {
                    cx.sink
                        .emit_live(Event::new(
                            "",
                            "agentcore.text_delta",
                            Value::Null,
                            EventKind::TextDelta {
                                message_id: message_id.clone(),
                                delta: t,
                            },
                        ))
                        .await;
                }
                frames.push((ty, p));
            }
            if fold.kept() > limit {
                return Err(Error::ResponseTooLarge { limit: limit as u64 });
            }
        }
        if is_json {
            let v: Value = serde_json::from_slice(&json_body)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&json_body).into_owned()));
            for (ty, p) in runtime_json(&v) {
                fold.apply(&ty, &p);
                frames.push((ty, p));
            }
            if fold.kept() > limit {
                return Err(Error::ResponseTooLarge { limit: limit as u64 });
            }
        }
        if !self.is_harness() && fold.stop_reason.is_none() {
            // A container without a terminal event: the end of the body ends the turn.
            let reason = if fold.tool_uses().is_empty() {
                "end_turn"
            } else {
                "tool_use"
            };
            fold.apply("messageStop", &json!({"stopReason": reason}));
        }
        if !fold.is_complete() || dec.has_partial() {
            let err = Error::transport_with(
                TransportKind::Closed,
                StreamTruncated.to_string(),
                url,
                StreamTruncated,
            );
            return Ok(Attempt::Retry(err, true));
        }
        Ok(Attempt::Done(Box::new((fold, frames))))
    }
}

/// The `host` header value for `url` (with the port when one is given).
fn host_of(url: &str) -> tether::Result<String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| {
        Error::config(
            tether::ConfigKind::Invalid,
            format!("bad AgentCore URL {url}: {e}"),
        )
    })?;
    Ok(match parsed.port() {
        Some(p) => format!("{}:{p}", parsed.host_str().unwrap_or_default()),
        None => parsed.host_str().unwrap_or_default().to_owned(),
    })
}

fn tool_result_block(r: &ToolResult) -> Value {
    json!({"toolResult": {
        "toolUseId": r.tool_use_id,
        "content": [{"text": r.content}],
        "status": if r.is_error { "error" } else { "success" },
    }})
}

/// Events of our container protocol (or Converse envelopes) in one SSE data payload.
fn runtime_events(data: &str) -> Vec<(String, Value)> {
    match serde_json::from_str::<Value>(data) {
        Ok(v) => runtime_json(&v),
        Err(_) => vec![text_event(data)],
    }
}

fn text_event(t: &str) -> (String, Value) {
    (
        "contentBlockDelta".into(),
        json!({"contentBlockIndex": 0, "delta": {"text": t}}),
    )
}

/// Maps a runtime container's JSON onto Converse events: Converse envelopes pass through;
/// `{"type":"text"|"tool_use"|"stop"|"usage"}` events and whole replies
/// (`{"text"|"result"|"output", "tool_uses", "stop_reason"}`) are translated.
fn runtime_json(v: &Value) -> Vec<(String, Value)> {
    const CONVERSE: [&str; 6] = [
        "messageStart",
        "contentBlockStart",
        "contentBlockDelta",
        "contentBlockStop",
        "messageStop",
        "metadata",
    ];
    let Some(obj) = v.as_object() else {
        return match v.as_str() {
            Some(s) => vec![text_event(s)],
            None => Vec::new(),
        };
    };
    if obj.len() == 1
        && let Some((k, p)) = obj.iter().next()
        && CONVERSE.contains(&k.as_str())
    {
        return vec![(k.clone(), p.clone())];
    }
    let mut out = Vec::new();
    let tool = |u: &Value, i: usize| {
        let id = u["id"]
            .as_str()
            .or(u["toolUseId"].as_str())
            .unwrap_or_default()
            .to_owned();
        let input = match &u["input"] {
            Value::String(s) => s.clone(),
            Value::Null => "{}".into(),
            other => other.to_string(),
        };
        vec![
            (
                "contentBlockStart".to_owned(),
                json!({"contentBlockIndex": i + 1, "start": {"toolUse": {"toolUseId": id, "name": u["name"]}}}),
            ),
            (
                "contentBlockDelta".to_owned(),
                json!({"contentBlockIndex": i + 1, "delta": {"toolUse": {"input": input}}}),
            ),
            ("contentBlockStop".to_owned(), json!({"contentBlockIndex": i + 1})),
        ]
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text" | "text_delta") => out.push(text_event(v["text"].as_str().unwrap_or_default())),
        Some("tool_use") => out.extend(tool(v, 0)),
        Some("stop") => out.push((
            "messageStop".into(),
            json!({"stopReason": v["stop_reason"].as_str().unwrap_or("end_turn")}),
        )),
        Some("usage") => out.push(("metadata".into(), json!({"usage": v["usage"]}))),
        _ => {
            if let Some(t) = ["text", "result", "output", "response"]
                .iter()
                .find_map(|k| v[*k].as_str())
            {
                out.push(text_event(t));
            }
            if let Some(uses) = v["tool_uses"].as_array() {
                for (i, u) in uses.iter().enumerate() {
                    out.extend(tool(u, i));
                }
            }
            if let Some(r) = v["stop_reason"].as_str() {
                out.push(("messageStop".into(), json!({"stopReason": r})));
            }
        }
    }
    out
}

fn transport(e: reqwest::Error, endpoint: &str) -> Error {
    tether_http::transport_error(e, endpoint)
}

/// The source of the [`Error::Transport`] for an event stream that ended before its final
/// `messageStop` with a stop reason: what the retry loop tells a truncated turn by.
#[derive(Debug)]
struct StreamTruncated;

impl std::fmt::Display for StreamTruncated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the event stream ended without messageStop.stopReason")
    }
}

impl std::error::Error for StreamTruncated {}

/// Whether `err` is a stream that ended before its final `messageStop`.
fn is_truncated(err: &Error) -> bool {
    std::error::Error::source(err).is_some_and(|s| s.is::<StreamTruncated>())
}

async fn http_error(resp: reqwest::Response, endpoint: &str) -> Error {
    let status = resp.status().as_u16();
    let h = resp.headers().clone();
    let get = |k: &str| h.get(k).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let retry_after = parse_retry_after(None, get("retry-after").as_deref());
    let header_code = get("x-amzn-errortype").map(|c| c.split(':').next().unwrap_or_default().to_owned());
    // At most 64 KiB of it, each read within 30 s: the server chooses the body.
    let text = tether_http::error_text(resp, Duration::from_secs(30)).await;
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let message = v["message"]
        .as_str()
        .or(v["Message"].as_str())
        .map(str::to_owned)
        .unwrap_or_else(|| text.chars().take(500).collect());
    let code = header_code.or_else(|| v["__type"].as_str().map(str::to_owned));
    let mut message = message;
    if status == 401 || status == 403 {
        message = format!("{message} (check the AWS credentials and the role's access to this resource)");
    }
    Error::Http {
        status,
        message,
        code,
        retry_after,
        should_retry: None,
        endpoint: endpoint.to_owned(),
    }
}

#[async_trait]
impl Provider for AgentCore {
    fn name(&self) -> &str {
        "agentcore"
    }

    async fn open(&mut self, _cx: &TurnContext) -> tether::Result<Opened> {
        let mut opened = Opened::new(self.session_id.clone());
        opened.resumed = self.resumed;
        Ok(opened)
    }

    /// Resumes the thread's runtime session by the id it recorded. AgentCore keeps the
    /// conversation on its side; what the thread must know is whether its last turn asked for
    /// tools: the record's last assistant message, when it made local tool calls, leaves them
    /// pending (the engine answers them from the memo, or runs them) and is what a harness resume
    /// sends back with their results.
    async fn resume(&mut self, from: Resume<'_>, _cx: &TurnContext) -> tether::Result<Opened> {
        let Some(sid) = from.session_id.filter(|s| !s.is_empty()) else {
            return Err(Error::cannot_resume(
                "agentcore",
                "no AgentCore runtime session was recorded for this thread",
            ));
        };
        validate_session_id(sid)?;
        self.session_id = sid.to_owned();
        self.resumed = true;
        let last = from.events.iter().rev().find(|e| e.raw_type == MESSAGE);
        let pending = match last.map(|e| &e.kind) {
            Some(EventKind::Message { tool_uses, .. }) if !tool_uses.is_empty() => {
                self.pending_assistant = last.map(|e| e.raw.clone());
                tool_uses.clone()
            }
            _ => Vec::new(),
        };
        Ok(Opened::resumed(self.session_id.clone()).with_pending(pending))
    }

    async fn turn(&mut self, input: Input, cx: &TurnContext) -> tether::Result<TurnResult> {
        // Cleared only when the turn returns: a dropped future leaves it set for `interrupt`.
        self.in_flight = true;
        let r = self.drive_turn(input, cx).await;
        self.in_flight = false;
        r
    }

    async fn record_tool_results(&mut self, _answered: &[tether::ToolUseResult]) -> tether::Result<()> {
        self.pending_assistant = None;
        Ok(())
    }

    /// After a dropped turn (cancel, timeout): in runtime mode, `StopRuntimeSession`, so the
    /// container stops working (and billing). The harness API has no stop call: dropping the
    /// turn closed its connection, and the uncommitted tool-use turn is not persisted there.
    async fn interrupt(&mut self) -> tether::Result<()> {
        if !std::mem::take(&mut self.in_flight) {
            return Ok(());
        }
        self.pending_assistant = None;
        self.stop_runtime_session().await.map(|_| ())
    }

    /// Runtime mode with [`AgentCoreConfig::stop_session_on_close`]: `StopRuntimeSession`.
    /// Otherwise nothing: the remote session stays reattachable by its id.
    async fn close(&mut self) -> tether::Result<()> {
        if self.config.stop_session_on_close {
            self.stop_runtime_session().await?;
        }
        Ok(())
    }
}

impl AgentCore {
    async fn drive_turn(&mut self, input: Input, cx: &TurnContext) -> tether::Result<TurnResult> {
        if matches!(input, Input::Continue) {
            return Err(Error::config(
                tether::ConfigKind::State,
                "AgentCore cannot continue without input: there is no turn in flight to resume",
            ));
        }
        self.turns += 1;
        let turn_id = format!("turn-{}-{}", self.turns, random_hex(12));
        let body = serde_json::to_vec(&self.body(&input, &turn_id)?)
            .map_err(|e| Error::config_with(tether::ConfigKind::Invalid, "cannot encode the request", e))?;
        let mut retries = 0u32;
        let (fold, frames) = loop {
            let (err, retryable) = match self.attempt(&body, &turn_id, cx, retries + 1).await? {
                Attempt::Done(done) => break *done,
                Attempt::Retry(e, r) => (e, r),
            };
            let truncated = is_truncated(&err);
            if !retryable || retries >= self.config.invoke_retries {
                if truncated {
                    tracing::warn!(
                        turn_id,
                        attempts = retries + 1,
                        "AgentCore stream truncated on every attempt"
                    );
                    let sr = json!({"type": "early_termination", "attempts": retries + 1, "error": err.to_string()});
                    cx.sink
                        .emit(Event::new(
                            format!("{turn_id}:early_termination"),
                            "agentcore.early_termination",
                            sr.clone(),
                            EventKind::Error {
                                code: "early_termination".into(),
                                message: err.to_string(),
                            },
                        ))
                        .await?;
                    return Ok(TurnResult::new(Terminal::Terminated, sr));
                }
                return Err(err);
            }
            let delay = self.config.retry.delay_for(&err, retries).unwrap_or_else(|| {
                let exp = self.config.retry.base.saturating_mul(1u32 << retries.min(16));
                exp.min(self.config.retry.max_backoff)
            });
            retries += 1;
            cx.sink
                .emit(Event::new(
                    format!("{turn_id}:retry{retries}"),
                    "agentcore.retry",
                    json!({"turn_id": turn_id, "attempt": retries, "delay_ms": delay.as_millis() as u64, "error": err.to_string()}),
                    EventKind::Retry {
                        attempt: retries,
                        delay_ms: delay.as_millis() as u64,
                        error: err.to_string(),
                    },
                ))
                .await?;
            self.config.retry.sleeper.sleep(delay).await;
        };
        // Only the successful attempt's frames enter the record.
        for (i, (ty, p)) in frames.iter().enumerate() {
            let kind = match (ty.as_str(), &fold.usage) {
                ("metadata", Some(u)) => EventKind::Usage { usage: u.clone() },
                _ => EventKind::Other,
            };
            cx.sink
                .emit(Event::new(
                    format!("{turn_id}:{i}"),
                    format!("agentcore.{ty}"),
                    json!({ ty: p }),
                    kind,
                ))
                .await?;
        }
        let message_id = format!("{turn_id}:message");
        let uses = fold.tool_uses();
        cx.sink
            .emit(Event::new(
                message_id.clone(),
                MESSAGE,
                fold.assistant_message(),
                EventKind::Message {
                    message_id,
                    role: Role::Assistant,
                    text: fold.text.clone(),
                    reasoning: (!fold.reasoning.is_empty()).then(|| fold.reasoning.clone()),
                    tool_uses: uses.clone(),
                },
            ))
            .await?;
        let terminal = fold.terminal();
        self.pending_assistant = (terminal == Terminal::RequiresAction).then(|| fold.assistant_message());
        let tool_uses = if terminal == Terminal::RequiresAction {
            uses
        } else {
            Vec::new()
        };
        Ok(
            TurnResult::new(terminal, StopReason::from_raw(json!(fold.stop_reason)))
                .with_text(fold.text.clone())
                .with_tool_uses(tool_uses)
                .with_server_tool_uses(fold.server_tool_uses())
                .with_usage(fold.usage.clone()),
        )
    }
}

/// Hooks for the crate's `fuzzing` module (a runtime body without the HTTP); not part of the API.
pub(crate) mod fuzzing;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids_are_checked() {
        assert!(validate_session_id(&new_session_id()).is_ok());
        assert!(validate_session_id("short").is_err());
        assert!(validate_session_id(&"a".repeat(257)).is_err());
        assert!(validate_session_id(&format!("-{}", "a".repeat(40))).is_err());
        assert!(validate_session_id(&"a".repeat(33)).is_ok());
    }

    #[test]
    fn runtime_replies_map_to_converse_events() {
        let evs = runtime_json(
            &json!({"text": "hi", "tool_uses": [{"id": "t1", "name": "x", "input": {"a": 1}}], "stop_reason": "tool_use"}),
        );
        let mut f = Fold::default();
        for (t, p) in &evs {
            f.apply(t, p);
        }
        assert_eq!(f.text, "hi");
        assert_eq!(f.terminal(), Terminal::RequiresAction);
        assert_eq!(f.tool_uses()[0].input, json!({"a": 1}));
    }
}
