//! [`MessagesModel`]: a [`ChatModel`] over Anthropic's Messages API, streaming.
//!
//! Mapping to the neutral chat contract:
//! - system messages become the top-level `system` blocks; consecutive user and tool messages
//!   merge into one user message, `tool_result` blocks first (all results of a parallel batch in
//!   one message);
//! - an assistant message this model produced carries its content blocks, exactly as received
//!   (thinking and redacted-thinking blocks with their signatures), in
//!   `provider_data["anthropic"]["content"]`, and is sent back from there unchanged;
//! - stop reasons map to the chat vocabulary the local loop reads (`end_turn` and `stop_sequence`
//!   → `stop`, `tool_use` → `tool_calls`, `max_tokens` → `length`; anything else is kept), the
//!   raw one stays in [`ChatResponse::raw`].
//!
//! With [`MessagesModel::stream`]`(false)` the request says `stream: false` and the whole message
//! comes back as JSON; it is replayed through the same assembly as a stream (one delta per block
//! and kind: text, reasoning, signature, tool-call start / arguments / end), so a front-end sees
//! the same delta vocabulary, and its content blocks are kept exactly as received.
//!
//! One call makes one attempt: 429, 529 and 5xx come back as [`Error::Http`] (and overload errors
//! inside a 200 stream as [`Error::Stream`]), which the shared retry policy of the loop retries.
//!
//! Bounds: the response headers must come within [`MessagesModel::request_timeout`] (600 s; for
//! `stream(false)` the whole body too), a stream may not stay silent longer than
//! [`MessagesModel::stream_idle_timeout`] (120 s; `Transport{kind: Idle}`, retried by the loop),
//! and one response may bring at most [`MessagesModel::max_response_bytes`] (8 MiB of text,
//! thinking, signatures and tool input; [`Error::ResponseTooLarge`], not retried).

use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Map, Value, json};
use tether::chat::ChatToolCall;
use tether::{ChatMessage, ChatModel, ChatRequest, ChatResponse, DeltaSink, Error, Role, ToolSpec, Usage};

use crate::http::{ClientConfig, error_from_response, stream_error, transport_error};
use crate::sse::{MAX_FRAME, SseDecoder};

/// A [`ChatModel`] over `POST /v1/messages`, streaming by default (see [`MessagesModel::stream`]).
///
/// ```no_run
/// # fn f() -> tether::Result<()> {
/// use tether_anthropic::{ClientConfig, MessagesModel};
/// let model = MessagesModel::new(ClientConfig::from_env()?, "claude-sonnet-4-5")?
///     .max_tokens(2048)
///     .thinking(serde_json::json!({"type": "enabled", "budget_tokens": 1024}))
///     .prompt_cache(true);
/// let provider = tether::local::LocalLoop::new(model);
/// # let _ = provider; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct MessagesModel {
    config: ClientConfig,
    client: reqwest::Client,
    model: String,
    max_tokens: u32,
    thinking: Option<Value>,
    cache: bool,
    betas: Vec<String>,
    extra: Map<String, Value>,
    stream: bool,
    request_timeout: Duration,
    idle_timeout: Duration,
    max_response_bytes: usize,
}

impl MessagesModel {
    /// A model named `model` (used when a request names none).
    pub fn new(config: ClientConfig, model: impl Into<String>) -> tether::Result<Self> {
        Ok(MessagesModel {
            client: config.client()?,
            config,
            model: model.into(),
            max_tokens: 4096,
            thinking: None,
            cache: false,
            betas: Vec::new(),
            extra: Map::new(),
            stream: true,
            request_timeout: Duration::from_secs(600),
            idle_timeout: Duration::from_secs(120),
            max_response_bytes: tether::chat::DEFAULT_MAX_RESPONSE_BYTES,
        })
    }

    /// How long the response headers may take, and for [`stream`](Self::stream)`(false)` the
    /// whole body (default 600 s, as Anthropic's SDKs); exceeding it is
    /// `Transport{kind: Timeout}`, which the loop's retry policy retries.
    pub fn request_timeout(mut self, d: Duration) -> Self {
        self.request_timeout = d;
        self
    }

    /// How long a stream may go without receiving a byte (default 120 s; the API sends `ping`
    /// events while a response is slow); exceeding it is `Transport{kind: Idle}`, which the
    /// loop's retry policy retries, instead of a run hanging until its own timeout.
    pub fn stream_idle_timeout(mut self, d: Duration) -> Self {
        self.idle_timeout = d;
        self
    }

    /// The most one response may bring, in bytes of text, thinking, signatures and tool input
    /// together (default [`tether::chat::DEFAULT_MAX_RESPONSE_BYTES`], 8 MiB); past it the call
    /// stops with [`Error::ResponseTooLarge`], not retried. A non-streamed body may be at most
    /// four times this (JSON escapes) plus 64 KiB.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// `max_tokens` of every request (default 4096; the API requires one).
    pub fn max_tokens(mut self, n: u32) -> Self {
        self.max_tokens = n;
        self
    }

    /// The `thinking` setting, e.g. `{"type":"enabled","budget_tokens":1024}` or
    /// `{"type":"adaptive"}` (model-dependent: keep it in configuration).
    pub fn thinking(mut self, thinking: Value) -> Self {
        self.thinking = Some(thinking);
        self
    }

    /// Whether to place prompt-cache breakpoints: on the last system block, the last tool, and
    /// the last block of the newest message.
    pub fn prompt_cache(mut self, on: bool) -> Self {
        self.cache = on;
        self
    }

    /// Whether to stream (default `true`). Without streaming the reply is one JSON message,
    /// replayed as deltas after it is parsed.
    pub fn stream(mut self, on: bool) -> Self {
        self.stream = on;
        self
    }

    /// Adds an `anthropic-beta` feature name.
    pub fn beta(mut self, name: impl Into<String>) -> Self {
        self.betas.push(name.into());
        self
    }

    /// Sets any other top-level request field (`temperature`, `tool_choice`, `metadata`, ...).
    pub fn param(mut self, key: impl Into<String>, value: Value) -> Self {
        self.extra.insert(key.into(), value);
        self
    }

    /// The request body for `req` (public for golden tests).
    pub fn request_body(&self, req: &ChatRequest) -> tether::Result<Value> {
        let model = if req.model.is_empty() {
            &self.model
        } else {
            &req.model
        };
        if model.is_empty() {
            return Err(Error::config(
                tether::ConfigKind::Invalid,
                "no Anthropic model named: pass one to MessagesModel::new or in the request",
            ));
        }
        let (mut system, mut messages) = convert_messages(&req.messages);
        let mut tools: Vec<Value> = req.tools.iter().map(tool_json).collect();
        if self.cache {
            if let Some(Value::Object(b)) = system.last_mut() {
                b.insert("cache_control".into(), json!({"type": "ephemeral"}));
            }
            if let Some(Value::Object(t)) = tools.last_mut() {
                t.insert("cache_control".into(), json!({"type": "ephemeral"}));
            }
            if let Some(Value::Object(b)) = messages
                .last_mut()
                .and_then(|m| m.get_mut("content"))
                .and_then(Value::as_array_mut)
                .and_then(|c| c.last_mut())
            {
                b.insert("cache_control".into(), json!({"type": "ephemeral"}));
            }
        }
        let mut body = Map::new();
        body.insert("model".into(), json!(model));
        body.insert("max_tokens".into(), json!(self.max_tokens));
        if !system.is_empty() {
            body.insert("system".into(), Value::Array(system));
        }
        body.insert("messages".into(), Value::Array(messages));
        if !tools.is_empty() {
            body.insert("tools".into(), Value::Array(tools));
        }
        if let Some(t) = &self.thinking {
            body.insert("thinking".into(), t.clone());
        }
        for (k, v) in &self.extra {
            body.insert(k.clone(), v.clone());
        }
        body.insert("stream".into(), json!(self.stream));
        Ok(Value::Object(body))
    }
}

fn tool_json(t: &ToolSpec) -> Value {
    let mut v = json!({"name": t.name, "input_schema": t.input_schema});
    if !t.description.is_empty() {
        v["description"] = json!(t.description);
    }
    v
}

/// The content blocks an assistant message is sent back with.
fn assistant_blocks(m: &ChatMessage) -> Vec<Value> {
    if let Some(blocks) = m
        .provider_data
        .as_ref()
        .and_then(|p| p.get("anthropic"))
        .and_then(|a| a.get("content"))
        .and_then(Value::as_array)
    {
        return blocks.clone();
    }
    let mut out = Vec::new();
    if let Some(t) = m.content.as_deref().filter(|t| !t.is_empty()) {
        out.push(json!({"type": "text", "text": t}));
    }
    for c in &m.tool_calls {
        let input = match serde_json::from_str::<Value>(&c.arguments) {
            Ok(v @ Value::Object(_)) => v,
            _ => json!({}),
        };
        out.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input}));
    }
    out
}

/// Splits a neutral history into Anthropic's `system` blocks and alternating messages.
fn convert_messages(history: &[ChatMessage]) -> (Vec<Value>, Vec<Value>) {
    let mut system = Vec::new();
    let mut out: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for m in history {
        let (role, blocks): (&'static str, Vec<Value>) = match m.role {
            Role::System => {
                if let Some(t) = &m.content {
                    system.push(json!({"type": "text", "text": t}));
                }
                continue;
            }
            Role::Assistant => ("assistant", assistant_blocks(m)),
            Role::Tool => {
                let mut b = json!({
                    "type": "tool_result",
                    "tool_use_id": m.tool_call_id.clone().unwrap_or_default(),
                    "content": m.content.clone().unwrap_or_default(),
                });
                if m.is_error {
                    b["is_error"] = json!(true);
                }
                ("user", vec![b])
            }
            _ => {
                let t = m.content.clone().unwrap_or_default();
                ("user", vec![json!({"type": "text", "text": t})])
            }
        };
        if blocks.is_empty() {
            continue;
        }
        match out.last_mut() {
            Some((r, existing)) if *r == role => {
                if role == "user" {
                    // tool_result blocks first, text after them.
                    for b in blocks {
                        if b["type"] == "tool_result" {
                            let at = existing.iter().take_while(|x| x["type"] == "tool_result").count();
                            existing.insert(at, b);
                        } else {
                            existing.push(b);
                        }
                    }
                } else {
                    existing.extend(blocks);
                }
            }
            _ => out.push((role, blocks)),
        }
    }
    let messages = out
        .into_iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    (system, messages)
}

/// A content block being assembled from a stream. Text, thinking and signature pieces are
/// appended to their own strings and written into the block once, at the end (appending to the
/// JSON value itself copied the whole text at every delta).
#[derive(Debug, Default)]
struct Block {
    block: Value,
    partial_json: String,
    json_seen: bool,
    text: String,
    thinking: String,
    signature: String,
}

impl Block {
    /// Writes the appended pieces into the block.
    fn settle(&mut self) {
        for (key, piece) in [
            ("text", &mut self.text),
            ("thinking", &mut self.thinking),
            ("signature", &mut self.signature),
        ] {
            if !piece.is_empty() {
                let whole = format!("{}{piece}", self.block[key].as_str().unwrap_or_default());
                self.block[key] = Value::String(whole);
                piece.clear();
            }
        }
    }
}

/// Assembles a streamed message.
#[derive(Debug)]
struct Assembly {
    message: Value,
    blocks: Vec<(u64, Block)>,
    stop_reason: Option<String>,
    stop_sequence: Value,
    usage: Map<String, Value>,
    done: bool,
    /// Bytes kept from the model so far, and the cap on them.
    kept: usize,
    limit: usize,
}

impl Assembly {
    fn new(limit: usize) -> Self {
        Assembly {
            message: Value::Null,
            blocks: Vec::new(),
            stop_reason: None,
            stop_sequence: Value::Null,
            usage: Map::new(),
            done: false,
            kept: 0,
            limit,
        }
    }

    fn block(&mut self, index: u64) -> Option<&mut Block> {
        self.blocks.iter_mut().find(|(i, _)| *i == index).map(|(_, b)| b)
    }

    /// Counts `n` more bytes kept; fails past the cap.
    fn keep(&mut self, n: usize) -> tether::Result<()> {
        self.kept = self.kept.saturating_add(n);
        if self.kept > self.limit {
            return Err(Error::ResponseTooLarge {
                limit: self.limit as u64,
            });
        }
        Ok(())
    }

    async fn on_event(&mut self, kind: &str, data: &Value, deltas: &DeltaSink) -> tether::Result<()> {
        self.keep(match kind {
            "content_block_delta" => {
                let d = &data["delta"];
                ["text", "thinking", "signature", "partial_json"]
                    .iter()
                    .filter_map(|k| d[*k].as_str())
                    .map(str::len)
                    .sum::<usize>()
                    + if d["citation"].is_null() {
                        0
                    } else {
                        d["citation"].to_string().len()
                    }
            }
            "content_block_start" => data["content_block"].to_string().len(),
            _ => 0,
        })?;
        match kind {
            "message_start" => {
                self.message = data["message"].clone();
                if let Some(u) = data["message"]["usage"].as_object() {
                    self.usage.extend(u.clone());
                }
            }
            "content_block_start" => {
                let index = data["index"].as_u64().unwrap_or(self.blocks.len() as u64);
                let block = data["content_block"].clone();
                if !block.is_object() {
                    // Deltas write into the block as an object; anything else would panic there.
                    return Err(Error::malformed(format!(
                        "content_block_start for block {index} carries no content block object: {block}"
                    )));
                }
                if block["type"] == "tool_use" {
                    let id = block["id"].as_str().unwrap_or_default();
                    let name = block["name"].as_str().unwrap_or_default();
                    deltas.tool_call_start(id, name).await;
                }
                if let Some(t) = block["text"].as_str() {
                    deltas.text(t).await;
                }
                self.blocks.push((
                    index,
                    Block {
                        block,
                        ..Block::default()
                    },
                ));
            }
            "content_block_delta" => {
                let index = data["index"].as_u64().unwrap_or(0);
                let delta = &data["delta"];
                let Some(b) = self.block(index) else {
                    return Err(Error::malformed(format!(
                        "content_block_delta for block {index}, which never started"
                    )));
                };
                match delta["type"].as_str().unwrap_or_default() {
                    "text_delta" => {
                        let t = delta["text"].as_str().unwrap_or_default();
                        b.text.push_str(t);
                        deltas.text(t).await;
                    }
                    "thinking_delta" => {
                        let t = delta["thinking"].as_str().unwrap_or_default();
                        b.thinking.push_str(t);
                        deltas.reasoning(t).await;
                    }
                    "signature_delta" => {
                        let s = delta["signature"].as_str().unwrap_or_default();
                        b.signature.push_str(s);
                        deltas.reasoning_signature(s).await;
                    }
                    "input_json_delta" => {
                        let p = delta["partial_json"].as_str().unwrap_or_default();
                        b.partial_json.push_str(p);
                        b.json_seen = true;
                        let id = b.block["id"].as_str().unwrap_or_default().to_owned();
                        deltas.tool_call_args(&id, p).await;
                    }
                    "citations_delta" => {
                        if let Some(arr) = b.block.get_mut("citations").and_then(Value::as_array_mut) {
                            arr.push(delta["citation"].clone());
                        } else {
                            b.block["citations"] = json!([delta["citation"].clone()]);
                        }
                    }
                    _ => {}
                }
            }
            "content_block_stop" => {
                let index = data["index"].as_u64().unwrap_or(0);
                if let Some(b) = self.block(index)
                    && b.block["type"] == "tool_use"
                {
                    if b.json_seen {
                        // Parsed at block stop; empty means {}. Invalid JSON keeps `{}` in the
                        // block (the API needs an object) while the raw text travels with the
                        // tool call, so the engine answers it with an error naming the problem.
                        let input = match serde_json::from_str::<Value>(&b.partial_json) {
                            Ok(v @ Value::Object(_)) => v,
                            _ => json!({}),
                        };
                        b.block["input"] = input;
                    }
                    let id = b.block["id"].as_str().unwrap_or_default().to_owned();
                    deltas.tool_call_end(&id).await;
                }
            }
            "message_delta" => {
                if let Some(r) = data["delta"]["stop_reason"].as_str() {
                    self.stop_reason = Some(r.to_owned());
                }
                if !data["delta"]["stop_sequence"].is_null() {
                    self.stop_sequence = data["delta"]["stop_sequence"].clone();
                }
                if let Some(u) = data["usage"].as_object() {
                    // Counts in message_delta are cumulative: overwrite.
                    for (k, v) in u {
                        if !v.is_null() {
                            self.usage.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
            "message_stop" => self.done = true,
            "error" => return Err(stream_error(data)),
            _ => {} // ping and anything new
        }
        Ok(())
    }

    fn finish(mut self) -> ChatResponse {
        self.blocks.sort_by_key(|(i, _)| *i);
        for (_, b) in &mut self.blocks {
            b.settle();
        }
        let mut text = String::new();
        let mut reasoning = String::new();
        let mut calls = Vec::new();
        let mut content = Vec::new();
        for (_, b) in self.blocks {
            match b.block["type"].as_str().unwrap_or_default() {
                "text" => text.push_str(b.block["text"].as_str().unwrap_or_default()),
                "thinking" => reasoning.push_str(b.block["thinking"].as_str().unwrap_or_default()),
                "tool_use" => {
                    let arguments = if b.json_seen {
                        b.partial_json.clone()
                    } else {
                        b.block["input"].to_string()
                    };
                    calls.push(ChatToolCall::new(
                        b.block["id"].as_str().unwrap_or_default(),
                        b.block["name"].as_str().unwrap_or_default(),
                        arguments,
                    ));
                }
                _ => {}
            }
            content.push(b.block);
        }
        let raw_stop = self.stop_reason.clone();
        let finish = raw_stop.as_deref().map(|r| match r {
            "end_turn" | "stop_sequence" => "stop".to_owned(),
            "tool_use" => "tool_calls".to_owned(),
            "max_tokens" => "length".to_owned(),
            other => other.to_owned(),
        });
        let u = &self.usage;
        let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
        let usage = (!u.is_empty()).then(|| {
            Usage::new(
                n("input_tokens") + n("cache_creation_input_tokens") + n("cache_read_input_tokens"),
                n("output_tokens"),
            )
            .with_cache_read_tokens(n("cache_read_input_tokens"))
            .with_raw(Value::Object(u.clone()))
        });
        let mut raw = self.message;
        if raw.is_object() {
            raw["content"] = Value::Array(content.clone());
            raw["stop_reason"] = json!(raw_stop);
            raw["stop_sequence"] = self.stop_sequence;
            raw["usage"] = Value::Object(self.usage);
        }
        let mut message =
            ChatMessage::assistant_calls((!text.is_empty() || calls.is_empty()).then_some(text), calls)
                .with_provider_data(json!({"anthropic": {"content": content}}));
        message.reasoning = (!reasoning.is_empty()).then_some(reasoning);
        let mut response = ChatResponse::new(message).with_usage(usage).with_raw(raw);
        response.finish_reason = finish;
        response
    }
}

/// The stream events equivalent to a whole (non-streamed) message: one delta per block and kind.
fn replay_events(msg: &Value) -> Vec<(&'static str, Value)> {
    let mut start = msg.clone();
    start["content"] = json!([]);
    let mut out = vec![(
        "message_start",
        json!({"type": "message_start", "message": start}),
    )];
    let blocks = msg["content"].as_array().map(Vec::as_slice).unwrap_or_default();
    for (i, b) in blocks.iter().enumerate() {
        let delta = |d: Value| ("content_block_delta", json!({"index": i, "delta": d}));
        match b["type"].as_str().unwrap_or_default() {
            "text" => {
                out.push((
                    "content_block_start",
                    json!({"index": i, "content_block": {"type": "text", "text": ""}}),
                ));
                out.push(delta(json!({"type": "text_delta", "text": b["text"]})));
            }
            "thinking" => {
                out.push((
                    "content_block_start",
                    json!({"index": i, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
                ));
                out.push(delta(
                    json!({"type": "thinking_delta", "thinking": b["thinking"]}),
                ));
                if b["signature"].is_string() {
                    out.push(delta(
                        json!({"type": "signature_delta", "signature": b["signature"]}),
                    ));
                }
            }
            "tool_use" => {
                let mut head = b.clone();
                head["input"] = json!({});
                out.push(("content_block_start", json!({"index": i, "content_block": head})));
                let input = match &b["input"] {
                    Value::Null => String::new(),
                    v => v.to_string(),
                };
                out.push(delta(json!({"type": "input_json_delta", "partial_json": input})));
            }
            // redacted_thinking, server tool blocks, anything new: whole, as received.
            _ => out.push(("content_block_start", json!({"index": i, "content_block": b}))),
        }
        out.push(("content_block_stop", json!({"index": i})));
    }
    out.push((
        "message_delta",
        json!({
            "delta": {"stop_reason": msg["stop_reason"], "stop_sequence": msg["stop_sequence"]},
            "usage": msg["usage"],
        }),
    ));
    out.push(("message_stop", json!({"type": "message_stop"})));
    out
}

#[async_trait]
impl ChatModel for MessagesModel {
    fn name(&self) -> &str {
        "anthropic"
    }

    fn default_model(&self) -> &str {
        &self.model
    }

    fn endpoint(&self) -> Option<&str> {
        Some(&self.config.base_url)
    }

    async fn chat(&self, req: &ChatRequest, deltas: &DeltaSink) -> tether::Result<ChatResponse> {
        let body = self.request_body(req)?;
        let endpoint = self.config.url("/v1/messages");
        let mut rb = self
            .client
            .post(&endpoint)
            .header("x-api-key", self.config.api_key.expose())
            .header("anthropic-version", &self.config.anthropic_version)
            .header(
                "accept",
                if self.stream {
                    "text/event-stream"
                } else {
                    "application/json"
                },
            )
            .json(&body);
        if !self.betas.is_empty() {
            rb = rb.header("anthropic-beta", self.betas.join(","));
        }
        let rb = tether_http::with_traceparent(rb, deltas.traceparent());
        let deadline = tokio::time::Instant::now().checked_add(self.request_timeout);
        let sent = match deadline {
            Some(at) => tokio::time::timeout_at(at, rb.send()).await,
            None => Ok(rb.send().await),
        };
        let resp = match sent {
            Err(_) => {
                return Err(Error::transport(
                    tether::TransportKind::Timeout,
                    format!("no response within {:?} (request timeout)", self.request_timeout),
                    endpoint,
                ));
            }
            Ok(r) => r.map_err(|e| transport_error(e, &endpoint))?,
        };
        if !resp.status().is_success() {
            return Err(error_from_response(resp, &endpoint).await);
        }
        if !self.stream {
            let cap = self.max_response_bytes.saturating_mul(4).saturating_add(64 << 10);
            let read = tether_http::read_body(resp, cap, self.idle_timeout, &endpoint);
            let body = match deadline {
                Some(at) => tokio::time::timeout_at(at, read).await.map_err(|_| {
                    Error::transport(
                        tether::TransportKind::Timeout,
                        format!(
                            "the response body did not arrive within {:?}",
                            self.request_timeout
                        ),
                        endpoint.clone(),
                    )
                })??,
                None => read.await?,
            };
            if body.truncated {
                return Err(Error::ResponseTooLarge {
                    limit: self.max_response_bytes as u64,
                });
            }
            return assemble_whole(&body.bytes, self.max_response_bytes, &endpoint, deltas).await;
        }
        let mut resp = resp;
        let idle = self.idle_timeout;
        let mut reader = StreamReader::new(self.max_response_bytes);
        loop {
            let chunk = match tokio::time::timeout(idle, resp.chunk()).await {
                Err(_) => {
                    return Err(Error::transport(
                        tether::TransportKind::Idle,
                        format!(
                            "the Messages stream sent nothing for {idle:?} (not even a ping); raise stream_idle_timeout for slow models"
                        ),
                        endpoint,
                    ));
                }
                Ok(Err(e)) => return Err(transport_error(e, &endpoint)),
                Ok(Ok(None)) => break,
                Ok(Ok(Some(c))) => c,
            };
            if let Some(done) = reader.push(&chunk, deltas).await? {
                return Ok(done);
            }
        }
        Err(Error::transport(
            tether::TransportKind::Closed,
            "the Messages stream ended before message_stop",
            endpoint,
        ))
    }
}

/// A whole (non-streamed) Messages body turned into the response: its blocks replayed as the
/// stream would have sent them (so deltas reach `deltas` the same way), then put back exactly as
/// received. One function for `chat` and the crate's fuzz hooks.
pub(crate) async fn assemble_whole(
    body: &[u8],
    max_response_bytes: usize,
    endpoint: &str,
    deltas: &DeltaSink,
) -> tether::Result<ChatResponse> {
    let msg: Value = serde_json::from_slice(body).map_err(|e| Error::Malformed {
        message: format!("{endpoint} answered with a message that is not JSON ({e})"),
        source: Some(e.into()),
    })?;
    if msg["type"] == "error" {
        return Err(stream_error(&msg));
    }
    if !msg["content"].is_array() {
        return Err(Error::malformed(format!(
            "{endpoint} answered without a content array: {}",
            snippet(&msg.to_string())
        )));
    }
    let mut asm = Assembly::new(max_response_bytes);
    for (kind, data) in replay_events(&msg) {
        asm.on_event(kind, &data, deltas).await?;
    }
    // The blocks go back exactly as received, not as rebuilt from the replay.
    let originals = msg["content"].as_array().cloned().unwrap_or_default();
    for ((_, b), original) in asm.blocks.iter_mut().zip(originals) {
        *b = Block {
            block: original,
            ..Block::default()
        };
    }
    Ok(asm.finish())
}

/// The streamed body's reader: SSE frames decoded from the reads as they come, each event
/// folded into the response. One reader for `chat` and the crate's fuzz hooks.
pub(crate) struct StreamReader {
    dec: SseDecoder,
    asm: Assembly,
}

impl StreamReader {
    pub(crate) fn new(max_response_bytes: usize) -> Self {
        StreamReader {
            dec: SseDecoder::new(),
            asm: Assembly::new(max_response_bytes),
        }
    }

    /// Takes one read; the response once `message_stop` arrived.
    pub(crate) async fn push(
        &mut self,
        chunk: &[u8],
        deltas: &DeltaSink,
    ) -> tether::Result<Option<ChatResponse>> {
        for frame in self.dec.push(chunk) {
            if frame.data.is_empty() {
                continue;
            }
            let data: Value = serde_json::from_str(&frame.data).map_err(|e| Error::Malformed {
                message: format!(
                    "a Messages stream event is not JSON ({e}): {}",
                    snippet(&frame.data)
                ),
                source: Some(e.into()),
            })?;
            let kind = frame
                .event
                .clone()
                .or_else(|| data["type"].as_str().map(str::to_owned))
                .unwrap_or_default();
            self.asm.on_event(&kind, &data, deltas).await?;
            if self.asm.done {
                let asm = std::mem::replace(&mut self.asm, Assembly::new(0));
                return Ok(Some(asm.finish()));
            }
        }
        if self.dec.pending() > MAX_FRAME {
            return Err(Error::malformed(format!(
                "a Messages stream event exceeded {MAX_FRAME} bytes without ending"
            )));
        }
        Ok(None)
    }
}

/// At most 200 characters of a payload, for error messages.
fn snippet(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// Hooks for the crate's `fuzzing` module (the `chat` body without the HTTP); not part of the API.
pub(crate) mod fuzzing;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_results_merge_first_into_one_user_message() {
        let mut a = ChatMessage::assistant("");
        a.content = None;
        a.tool_calls = vec![
            ChatToolCall::new("t1", "x", "{}"),
            ChatToolCall::new("t2", "x", "bad"),
        ];
        let h = vec![
            ChatMessage::system("sys"),
            ChatMessage::user("hi"),
            a,
            ChatMessage::tool("t1", "one", false),
            ChatMessage::user("note"),
            ChatMessage::tool("t2", "two", true),
        ];
        let (system, msgs) = convert_messages(&h);
        assert_eq!(system, vec![json!({"type":"text","text":"sys"})]);
        assert_eq!(msgs.len(), 3);
        let c = msgs[2]["content"].as_array().cloned().unwrap_or_default();
        assert_eq!(c.len(), 3);
        assert_eq!(c[0]["tool_use_id"], "t1");
        assert_eq!(c[1]["tool_use_id"], "t2");
        assert_eq!(c[1]["is_error"], true);
        assert_eq!(c[2]["text"], "note");
        assert_eq!(msgs[1]["content"][1]["input"], json!({}));
    }
}
