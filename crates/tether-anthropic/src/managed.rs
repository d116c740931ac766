//! [`ManagedAgents`]: a [`Provider`] for Claude Managed Agents (beta `managed-agents-2026-04-01`).
//!
//! The agent loop runs on Anthropic's side; custom tools run here. One turn: post the input
//! (`user.message`, `user.custom_tool_result`s, or a raw event such as `user.define_outcome`),
//! then read `/v1/sessions/{id}/events/stream` until a boundary:
//! - `session.status_idle` with `end_turn`, `satisfied` or `max_iterations_reached` → `EndTurn`;
//! - `session.status_idle` with `requires_action` → the blocking ids (from
//!   `stop_reason.event_ids` or `stop_reason.requires_action.event_ids`) are resolved against the
//!   whole history: unanswered `agent.custom_tool_use`s are handed to the engine as
//!   `RequiresAction`; `agent.tool_use` / `agent.mcp_tool_use` waiting for confirmation go to the
//!   handler's permission request and are answered with `user.tool_confirmation`; an idle whose
//!   ids are all answered already (stale) is read past;
//! - any other idle stop reason (`retries_exhausted`, `budget_reached`, `failed`, none),
//!   `session.status_terminated`, `session.deleted`, or a `session.error` whose `retry_status` is
//!   `exhausted` or `terminal` → `Terminated`. A `retrying` error is informational.
//!
//! Events are recorded exactly once by id. The stream is opened before the first input is posted.
//! A stream that ends or breaks without a boundary is a transient error; the engine then calls
//! [`Provider::reconnect`], which reopens the stream *first*, lists the full history (paging until
//! the cursor is blank or repeats), records the events missed while disconnected, and returns the
//! custom tool uses that have no result yet (the engine runs them through its memo and the results
//! already posted are never posted again). A stream silent for longer than
//! [`ManagedConfig::stream_idle_timeout`] (default 120 s; `ping` heartbeats count) is a dropped
//! stream too (`Transport{kind: Idle}`, transient): the engine reconnects and reconciles instead
//! of waiting on a dead connection until the run's own timeout.
//!
//! **Stopping.** When the engine drops a turn (a run timeout or a cancel) it calls
//! [`Provider::interrupt`], which posts `user.interrupt` so the remote loop stops working (and
//! billing) instead of running on unseen; the custom tool uses in flight are abandoned (never
//! re-run by a later reconnect). The idle that the interrupt forces is not taken for the end of
//! the next turn: after an interrupt, boundaries are read past until the echo of the next input
//! shows it was processed. [`Provider::close`] drops the event stream; the session itself stays
//! (it can be reattached with its id) unless [`ManagedConfig::archive_on_close`] is set, in which
//! case `close` also archives it (`POST /v1/sessions/{id}/archive`, once).

use std::collections::{HashMap, HashSet, VecDeque};
use std::pin::Pin;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use reqwest::Method;
use serde_json::{Value, json};
use tether::{
    Error, Event, EventKind, Input, Opened, PermissionRequest, Provider, Resume, Role, Terminal, ToolResult,
    ToolUse, TransportKind, TurnContext, TurnResult, Usage,
};

use crate::http::{ApiClient, ClientConfig, stream_error, transport_error};
use crate::sse::{MAX_FRAME, SseDecoder, SseFrame};

/// The Managed Agents beta header value.
pub const MANAGED_AGENTS_BETA: &str = "managed-agents-2026-04-01";

/// How to reach a Managed Agents session.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ManagedConfig {
    /// Key and origin.
    pub client: ClientConfig,
    /// The agent to create a session on (with `environment_id`).
    pub agent_id: Option<String>,
    /// The environment to create a session in.
    pub environment_id: Option<String>,
    /// An existing session to reattach to (wins over `agent_id`).
    pub session_id: Option<String>,
    /// The `anthropic-beta` header (default [`MANAGED_AGENTS_BETA`]).
    pub beta: String,
    /// How long the event stream may stay silent (no event, no heartbeat) before it counts as
    /// dropped: a transient `Transport{kind: Idle}` error, after which the engine reconnects and
    /// reconciles (default 120 s). Raise it if a proxy in between swallows heartbeats.
    pub stream_idle_timeout: Duration,
    /// Page size when listing history (default 100).
    pub history_page_size: u32,
    /// A title for sessions this provider creates.
    pub title: Option<String>,
    /// Archive the session when the provider is closed (default `false`: the session is left
    /// idle server-side, to be reattached later). Archiving is final: an archived session takes
    /// no more input. Note that `Session::run` closes the provider at the end of every run.
    pub archive_on_close: bool,
}

impl ManagedConfig {
    /// A configuration creating sessions on `agent_id` in `environment_id`.
    pub fn new(client: ClientConfig, agent_id: impl Into<String>, environment_id: impl Into<String>) -> Self {
        ManagedConfig {
            agent_id: Some(agent_id.into()),
            environment_id: Some(environment_id.into()),
            ..Self::reattach(client, "")
        }
    }

    /// A configuration reattaching to the existing session `session_id`.
    pub fn reattach(client: ClientConfig, session_id: impl Into<String>) -> Self {
        let sid: String = session_id.into();
        ManagedConfig {
            client,
            agent_id: None,
            environment_id: None,
            session_id: (!sid.is_empty()).then_some(sid),
            beta: MANAGED_AGENTS_BETA.into(),
            stream_idle_timeout: Duration::from_secs(120),
            history_page_size: 100,
            title: None,
            archive_on_close: false,
        }
    }
}

type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

struct LiveStream {
    body: ByteStream,
    dec: SseDecoder,
    queue: VecDeque<SseFrame>,
}

/// What the current turn has gathered (kept across a failed attempt, taken when a turn ends).
#[derive(Debug, Default)]
struct TurnAcc {
    texts: Vec<String>,
    usage: Option<Usage>,
    server_tool_uses: Vec<ToolUse>,
}

/// Input posted while the connection failed; re-posted on the next turn unless history shows it
/// arrived.
#[derive(Debug)]
struct Unposted {
    events: Vec<Value>,
    ambiguous: bool,
}

/// A [`Provider`] for Claude Managed Agents; see the [module docs](self).
///
/// ```no_run
/// # async fn f() -> tether::Result<()> {
/// use tether_anthropic::{ClientConfig, ManagedAgents, ManagedConfig};
/// let cfg = ManagedConfig::new(ClientConfig::from_env()?, "agent_123", "env_456");
/// let result = tether::Session::builder(ManagedAgents::new(cfg)?).run("Hello").await?;
/// println!("{}", result.text);
/// # Ok(()) }
/// ```
pub struct ManagedAgents {
    config: ManagedConfig,
    api: ApiClient,
    session_id: Option<String>,
    stream: Option<LiveStream>,
    /// Custom tool uses by event id, in first-seen order.
    tool_uses: HashMap<String, (ToolUse, Value)>,
    tool_order: Vec<String>,
    /// Custom tool uses with a result (seen in history or echoes, or posted by us).
    answered: HashSet<String>,
    /// Built-in / MCP tool uses that may wait for a confirmation, by event id.
    confirmable: HashMap<String, Value>,
    confirmed: HashSet<String>,
    acc: TurnAcc,
    /// A turn boundary reached while disconnected (found in history by a reconnect).
    stashed: Option<TurnResult>,
    unposted: Option<Unposted>,
    /// How many `user.message` events the session's history held at the last reconcile: a
    /// resume compares it with the user messages tether recorded, to find one a crash kept from
    /// being posted.
    remote_user_messages: usize,
    /// Set by [`Provider::interrupt`]: the idle it forces is stale for the next turn, whose
    /// boundaries count only once the echo of this input type (processed) has been seen.
    after_interrupt: bool,
    awaiting_echo: Option<String>,
    archived: bool,
}

impl std::fmt::Debug for ManagedAgents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManagedAgents")
            .field("config", &self.config)
            .field("session_id", &self.session_id)
            .field("connected", &self.stream.is_some())
            .finish()
    }
}

fn provider_err(message: impl Into<String>) -> Error {
    Error::provider("managed", message)
}

impl ManagedAgents {
    /// A provider for `config`.
    pub fn new(config: ManagedConfig) -> tether::Result<Self> {
        let api = ApiClient::new(config.client.clone(), Some(config.beta.clone()))?;
        Ok(ManagedAgents {
            session_id: config.session_id.clone(),
            config,
            api,
            stream: None,
            tool_uses: HashMap::new(),
            tool_order: Vec::new(),
            answered: HashSet::new(),
            confirmable: HashMap::new(),
            confirmed: HashSet::new(),
            acc: TurnAcc::default(),
            stashed: None,
            unposted: None,
            remote_user_messages: 0,
            after_interrupt: false,
            awaiting_echo: None,
            archived: false,
        })
    }

    /// The session id, once opened.
    pub fn session_id(&self) -> Option<&str> {
        self.session_id.as_deref()
    }

    /// An input that starts an outcome-graded run (`user.define_outcome`); `max_iterations` is
    /// omitted when `None`.
    pub fn define_outcome(description: &str, rubric: &str, max_iterations: Option<u32>) -> Input {
        let mut ev = json!({
            "type": "user.define_outcome",
            "description": description,
            "rubric": {"type": "text", "content": rubric},
        });
        if let Some(n) = max_iterations {
            ev["max_iterations"] = json!(n);
        }
        Input::Raw(ev)
    }

    fn sid(&self) -> tether::Result<&str> {
        self.session_id
            .as_deref()
            .ok_or_else(|| provider_err("the session is not open"))
    }

    async fn open_stream(&mut self) -> tether::Result<()> {
        self.stream = None;
        let path = format!("/v1/sessions/{}/events/stream", self.sid()?);
        let resp = self.api.sse(&path).await?;
        self.stream = Some(LiveStream {
            body: Box::pin(resp.bytes_stream()),
            dec: SseDecoder::new(),
            queue: VecDeque::new(),
        });
        Ok(())
    }

    async fn post_events(&mut self, events: Vec<Value>) -> tether::Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let path = format!("/v1/sessions/{}/events", self.sid()?);
        let body = json!({ "events": events });
        match self.api.json(Method::POST, &path, Some(&body)).await {
            Ok(_) => Ok(()),
            Err(e) => {
                let ambiguous = match &e {
                    Error::Transport { kind, .. } => {
                        !matches!(kind, TransportKind::Refused | TransportKind::ConnectTimeout)
                    }
                    _ => false,
                };
                if e.is_transient() {
                    self.unposted = Some(Unposted {
                        events: body["events"].as_array().cloned().unwrap_or_default(),
                        ambiguous,
                    });
                    // Make the engine reconnect (and reconcile) before going on.
                    self.stream = None;
                }
                Err(e)
            }
        }
    }

    /// Every event of the session's history, oldest first.
    async fn list_history(&mut self) -> tether::Result<Vec<Value>> {
        let sid = self.sid()?.to_owned();
        list_history(&self.api, &sid, self.config.history_page_size).await
    }

    /// Updates the tool bookkeeping from one event (live or from history).
    fn absorb_tools(&mut self, ev: &Value) {
        let id = ev["id"].as_str().unwrap_or_default();
        match ev["type"].as_str().unwrap_or_default() {
            "agent.custom_tool_use" if !id.is_empty() && !self.tool_uses.contains_key(id) => {
                let u = ToolUse::new(id, ev["name"].as_str().unwrap_or_default(), input_of(ev));
                self.tool_uses.insert(id.to_owned(), (u, ev.clone()));
                self.tool_order.push(id.to_owned());
            }
            "user.custom_tool_result" => {
                if let Some(t) = ev["custom_tool_use_id"].as_str() {
                    self.answered.insert(t.to_owned());
                }
            }
            "agent.tool_use" | "agent.mcp_tool_use" if !id.is_empty() => {
                self.confirmable.insert(id.to_owned(), ev.clone());
            }
            "user.tool_confirmation" => {
                if let Some(t) = ev["tool_use_id"].as_str() {
                    self.confirmed.insert(t.to_owned());
                }
            }
            _ => {}
        }
    }

    /// Updates the turn's text, usage and server tool uses from one event.
    fn absorb_turn(&mut self, ev: &Value) {
        match ev["type"].as_str().unwrap_or_default() {
            "agent.message" => {
                let t = text_of(&ev["content"]);
                if !t.is_empty() {
                    self.acc.texts.push(t);
                }
            }
            "span.model_request_end" => {
                if let Some(u) = usage_of(ev) {
                    self.acc.usage.get_or_insert_with(Usage::default).add(&u);
                }
            }
            "agent.tool_use" | "agent.mcp_tool_use" => {
                let id = ev["id"].as_str().unwrap_or_default();
                self.acc.server_tool_uses.push(ToolUse::new(
                    id,
                    ev["name"].as_str().unwrap_or_default(),
                    input_of(ev),
                ));
            }
            _ => {}
        }
    }

    fn take_turn(&mut self, terminal: Terminal, stop_reason: Value, tool_uses: Vec<ToolUse>) -> TurnResult {
        let acc = std::mem::take(&mut self.acc);
        TurnResult::new(terminal, stop_reason)
            .with_text(acc.texts.join("\n"))
            .with_tool_uses(tool_uses)
            .with_server_tool_uses(acc.server_tool_uses)
            .with_usage(acc.usage)
    }

    fn pending_tool_uses(&self) -> Vec<ToolUse> {
        self.tool_order
            .iter()
            .filter(|id| !self.answered.contains(*id))
            .filter_map(|id| self.tool_uses.get(id).map(|(u, _)| u.clone()))
            .collect()
    }

    /// Lists the history and brings the bookkeeping up to date. With `record`, events not yet in
    /// the record are recorded (catch-up after a drop); otherwise their ids are only marked seen
    /// (a reattach: they belong to earlier requests). Returns the custom tool uses without result.
    async fn reconcile(&mut self, cx: &TurnContext, record: bool) -> tether::Result<Vec<ToolUse>> {
        let history = self.list_history().await?;
        let mut last_input = None;
        let mut last_boundary: Option<(usize, Value)> = None;
        let mut last_requires: Option<Vec<String>> = None;
        let mut unposted_arrived = false;
        self.remote_user_messages = 0;
        for (i, ev) in history.iter().enumerate() {
            let ty = ev["type"].as_str().unwrap_or_default();
            if ty == "user.message" {
                self.remote_user_messages += 1;
            }
            let id = ev["id"].as_str().unwrap_or_default().to_owned();
            let fresh = !id.is_empty() && !cx.sink.has_seen(&id).await;
            if record {
                if cx.sink.emit(to_event(ev)).await? {
                    live_text(cx, ev).await;
                    self.absorb_turn(ev);
                }
            } else if !id.is_empty() {
                cx.sink.mark_seen([id]).await;
            }
            self.absorb_tools(ev);
            if fresh
                && let Some(u) = &self.unposted
                && u.events.first().and_then(|e| e["type"].as_str()) == Some(ty)
            {
                unposted_arrived = true;
            }
            if ty.starts_with("user.") && ty != "user.interrupt" {
                last_input = Some(i);
            }
            match boundary_of(ev) {
                Boundary::End(_, _) => {
                    last_boundary = Some((i, ev.clone()));
                    last_requires = None;
                }
                Boundary::RequiresAction(ids) => last_requires = Some(ids),
                Boundary::None => {}
            }
        }
        if unposted_arrived && self.unposted.as_ref().is_some_and(|u| u.ambiguous) {
            self.unposted = None;
        }
        let pending = self.pending_tool_uses();
        if let Some(ids) = last_requires {
            self.confirm(cx, &ids).await?;
        }
        self.stashed = None;
        if pending.is_empty()
            && self.unposted.is_none()
            && let Some((i, ev)) = last_boundary
            && last_input.is_none_or(|li| i > li)
            && let Boundary::End(t, sr) = boundary_of(&ev)
        {
            self.stashed = Some(self.take_turn(t, sr, Vec::new()));
        }
        Ok(pending)
    }

    /// Answers the confirmation requests among `ids` through the handler.
    async fn confirm(&mut self, cx: &TurnContext, ids: &[String]) -> tether::Result<()> {
        let mut out = Vec::new();
        for id in ids {
            if self.confirmed.contains(id) {
                continue;
            }
            let Some(ev) = self.confirmable.get(id).cloned() else {
                continue;
            };
            let req = PermissionRequest::new(id.clone(), ev["name"].as_str().unwrap_or("tool"))
                .with_input(input_of(&ev))
                .with_raw(ev.clone());
            let info = cx.info();
            let outcome = cx.handler.request_permission(&req, &info).await;
            let mut c = json!({"type": "user.tool_confirmation", "tool_use_id": id});
            if outcome.allows(&req) {
                c["result"] = json!("allow");
            } else {
                c["result"] = json!("deny");
                c["deny_message"] = json!("The user denied this tool call.");
            }
            if let Some(t) = ev.get("session_thread_id").filter(|v| !v.is_null()) {
                c["session_thread_id"] = t.clone();
            }
            out.push(c);
        }
        if out.is_empty() {
            return Ok(());
        }
        let ids: Vec<String> = out
            .iter()
            .filter_map(|c| c["tool_use_id"].as_str().map(str::to_owned))
            .collect();
        self.post_events(out).await?;
        self.confirmed.extend(ids);
        Ok(())
    }

    async fn next_frame(&mut self) -> tether::Result<SseFrame> {
        let idle = self.config.stream_idle_timeout;
        loop {
            let Some(s) = self.stream.as_mut() else {
                return Err(Error::transport(
                    TransportKind::Closed,
                    "the event stream is not connected",
                    "managed event stream",
                ));
            };
            if let Some(f) = s.queue.pop_front() {
                return Ok(f);
            }
            match tokio::time::timeout(idle, s.body.next()).await {
                Err(_) => {
                    self.stream = None;
                    return Err(Error::transport(
                        TransportKind::Idle,
                        format!(
                            "no event or heartbeat on session {}'s stream for {idle:?}",
                            self.session_id.as_deref().unwrap_or("?")
                        ),
                        "managed event stream",
                    ));
                }
                Ok(None) => {
                    self.stream = None;
                    return Err(Error::transport(
                        TransportKind::Closed,
                        "the event stream ended before the turn did",
                        "managed event stream",
                    ));
                }
                Ok(Some(Err(e))) => {
                    self.stream = None;
                    return Err(transport_error(e, "managed event stream"));
                }
                Ok(Some(Ok(chunk))) => {
                    let frames = s.dec.push(&chunk);
                    s.queue.extend(frames);
                    if s.dec.pending() > MAX_FRAME {
                        self.stream = None;
                        return Err(Error::malformed(format!(
                            "an event on the managed stream exceeded {MAX_FRAME} bytes without ending"
                        )));
                    }
                }
            }
        }
    }

    /// Handles one live event; returns the turn's result at a boundary.
    async fn on_event(&mut self, ev: Value, cx: &TurnContext) -> tether::Result<Option<TurnResult>> {
        if !cx.sink.emit(to_event(&ev)).await? {
            return Ok(None); // delivered twice: already recorded and handled
        }
        live_text(cx, &ev).await;
        self.absorb_tools(&ev);
        self.absorb_turn(&ev);
        if self.awaiting_echo.is_some() {
            // The idle an earlier interrupt forced, or anything else before our input was
            // processed: not this turn's end.
            return Ok(None);
        }
        match boundary_of(&ev) {
            Boundary::None => Ok(None),
            Boundary::End(t, sr) => Ok(Some(self.take_turn(t, sr, Vec::new()))),
            Boundary::RequiresAction(ids) => {
                let known =
                    |s: &Self, id: &String| s.tool_uses.contains_key(id) || s.confirmable.contains_key(id);
                if ids.iter().any(|id| !known(self, id)) {
                    // Ids from before we connected (or a reattach): resolve against full history.
                    for h in self.list_history().await? {
                        self.absorb_tools(&h);
                    }
                }
                self.confirm(cx, &ids).await?;
                let uses: Vec<ToolUse> = ids
                    .iter()
                    .filter(|id| !self.answered.contains(*id))
                    .filter_map(|id| self.tool_uses.get(id).map(|(u, _)| u.clone()))
                    .collect();
                for id in ids.iter().filter(|id| !known(self, id)) {
                    tracing::warn!(event_id = %id, "requires_action names an event not found in history");
                }
                if uses.is_empty() {
                    Ok(None) // stale idle, or only confirmations: the session goes on
                } else {
                    Ok(Some(self.take_turn(
                        Terminal::RequiresAction,
                        ev["stop_reason"].clone(),
                        uses,
                    )))
                }
            }
        }
    }

    fn input_events(&mut self, input: Input) -> tether::Result<Vec<Value>> {
        Ok(match input {
            Input::Message(text) => vec![json!({
                "type": "user.message",
                "content": [{"type": "text", "text": text}],
            })],
            Input::ToolResults(answered) => {
                let mut evs = Vec::new();
                for a in &answered {
                    if self.answered.contains(&a.result.tool_use_id) {
                        continue; // its result is already posted (or in history)
                    }
                    evs.push(self.result_event(&a.result, Some(&a.tool_use)));
                }
                evs
            }
            Input::Continue => Vec::new(),
            Input::Raw(v) => match &v {
                Value::Object(m) if m.get("events").is_some_and(Value::is_array) => {
                    v["events"].as_array().cloned().unwrap_or_default()
                }
                Value::Object(m) if m.get("type").is_some_and(Value::is_string) => vec![v],
                _ => {
                    return Err(Error::config(
                        tether::ConfigKind::Invalid,
                        "a raw Managed Agents input must be an event object with a \"type\" or {\"events\": [...]}",
                    ));
                }
            },
            _ => {
                return Err(Error::config(
                    tether::ConfigKind::Unsupported,
                    "this input is not supported by Managed Agents",
                ));
            }
        })
    }

    fn result_event(&self, r: &ToolResult, _use: Option<&ToolUse>) -> Value {
        let mut ev = json!({
            "type": "user.custom_tool_result",
            "custom_tool_use_id": r.tool_use_id,
            "content": [{"type": "text", "text": r.content}],
            "is_error": r.is_error,
        });
        if let Some((_, raw)) = self.tool_uses.get(&r.tool_use_id)
            && let Some(t) = raw.get("session_thread_id").filter(|v| !v.is_null())
        {
            ev["session_thread_id"] = t.clone();
        }
        ev
    }
}

/// Every event of session `sid`'s history, oldest first, paging until the cursor is blank or repeats.
async fn list_history(api: &ApiClient, sid: &str, page_size: u32) -> tether::Result<Vec<Value>> {
    let mut out = Vec::new();
    let mut cursors = HashSet::new();
    let mut page: Option<String> = None;
    loop {
        let mut path = format!("/v1/sessions/{sid}/events?limit={}&order=asc", page_size.max(1));
        if let Some(p) = &page {
            path.push_str("&page=");
            path.push_str(&encode_query(p));
        }
        let v = api.json(Method::GET, &path, None).await?;
        if let Some(items) = v["data"].as_array() {
            out.extend(items.iter().cloned());
        }
        match v["next_page"].as_str().filter(|s| !s.trim().is_empty()) {
            Some(next) if cursors.insert(next.to_owned()) => page = Some(next.to_owned()),
            Some(next) => {
                tracing::warn!(cursor = next, "history cursor repeated; stopping");
                break;
            }
            None => break,
        }
    }
    Ok(out)
}

/// Percent-encodes a cursor for a query string.
fn encode_query(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn input_of(ev: &Value) -> Value {
    match &ev["input"] {
        Value::Null => json!({}),
        v => v.clone(),
    }
}

fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter_map(|b| b["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

fn usage_of(ev: &Value) -> Option<Usage> {
    let u = ev
        .get("model_usage")
        .filter(|v| v.is_object())
        .or_else(|| ev.get("usage").filter(|v| v.is_object()))?;
    let n = |k: &str| u[k].as_u64().unwrap_or(0);
    Some(
        Usage::new(
            n("input_tokens") + n("cache_creation_input_tokens") + n("cache_read_input_tokens"),
            n("output_tokens"),
        )
        .with_cache_read_tokens(n("cache_read_input_tokens"))
        .with_raw(u.clone()),
    )
}

enum Boundary {
    None,
    End(Terminal, Value),
    RequiresAction(Vec<String>),
}

fn ids_of(v: &Value) -> Option<Vec<String>> {
    v.as_array()
        .map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_owned)).collect())
}

fn boundary_of(ev: &Value) -> Boundary {
    match ev["type"].as_str().unwrap_or_default() {
        "session.status_idle" => {
            let sr = &ev["stop_reason"];
            match sr["type"].as_str() {
                Some("end_turn" | "satisfied" | "max_iterations_reached") => {
                    Boundary::End(Terminal::EndTurn, sr.clone())
                }
                Some("requires_action") => Boundary::RequiresAction(
                    ids_of(&sr["event_ids"])
                        .or_else(|| ids_of(&sr["requires_action"]["event_ids"]))
                        .unwrap_or_default(),
                ),
                _ => Boundary::End(Terminal::Terminated, sr.clone()),
            }
        }
        "session.status_terminated" | "session.deleted" => Boundary::End(Terminal::Terminated, ev.clone()),
        "session.error" => match ev["error"]["retry_status"]["type"].as_str() {
            Some("exhausted" | "terminal") => Boundary::End(Terminal::Terminated, ev.clone()),
            _ => Boundary::None,
        },
        _ => Boundary::None,
    }
}

fn kind_of(ev: &Value) -> EventKind {
    let id = ev["id"].as_str().unwrap_or_default().to_owned();
    let ty = ev["type"].as_str().unwrap_or_default();
    match ty {
        "agent.message" => EventKind::Message {
            message_id: id,
            role: Role::Assistant,
            text: text_of(&ev["content"]),
            reasoning: None,
            tool_uses: Vec::new(),
        },
        "agent.thinking" => EventKind::ReasoningDelta {
            message_id: id,
            delta: ev["thinking"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| text_of(&ev["content"])),
        },
        "agent.custom_tool_use" | "agent.tool_use" | "agent.mcp_tool_use" => EventKind::ToolCall {
            tool_use: ToolUse::new(id, ev["name"].as_str().unwrap_or_default(), input_of(ev)),
            message_id: None,
        },
        // `user.*` events are echoes of what we posted (the engine already recorded the tool
        // results as `tether.tool_result`): kept raw, not normalized a second time.
        "span.model_request_end" => match usage_of(ev) {
            Some(usage) => EventKind::Usage { usage },
            None => EventKind::Other,
        },
        "session.error" => EventKind::Error {
            code: ev["error"]["type"].as_str().unwrap_or("unknown").to_owned(),
            message: ev["error"]["message"].as_str().unwrap_or_default().to_owned(),
        },
        t if t.starts_with("session.status_") => EventKind::Status {
            status: t.trim_start_matches("session.status_").to_owned(),
        },
        _ => EventKind::Other,
    }
}

/// Live text for front-ends that stream: an `agent.message` arrives whole, so its text is
/// delivered once as a delta right after the durable event.
async fn live_text(cx: &TurnContext, ev: &Value) {
    if ev["type"] == "agent.message" {
        let text = text_of(&ev["content"]);
        if !text.is_empty() {
            cx.sink
                .emit_live(Event::new(
                    "",
                    "managed.text_delta",
                    Value::Null,
                    EventKind::TextDelta {
                        message_id: ev["id"].as_str().unwrap_or_default().to_owned(),
                        delta: text,
                    },
                ))
                .await;
        }
    }
}

/// The user messages tether recorded that the session never received: a crash between
/// recording a message and posting it leaves the record with more `tether.user_message`s than
/// the session's history has `user.message`s. The last ones (in record order) are the unposted;
/// the engine sends them again, as one message, with the next request. A session that received
/// more messages than tether recorded (posted by another client) has none unposted.
fn unposted_messages(record: &[Event], remote: usize) -> Option<String> {
    let local: Vec<&str> = record
        .iter()
        .filter(|e| e.raw_type == tether::raw::USER_MESSAGE)
        .filter_map(|e| match &e.kind {
            EventKind::Message { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    let missing = local.len().checked_sub(remote).filter(|n| *n > 0)?;
    Some(local[local.len() - missing..].join("\n\n"))
}

fn to_event(ev: &Value) -> Event {
    Event::new(
        ev["id"].as_str().unwrap_or_default(),
        ev["type"].as_str().unwrap_or("managed.unknown"),
        ev.clone(),
        kind_of(ev),
    )
}

#[async_trait]
impl Provider for ManagedAgents {
    fn name(&self) -> &str {
        "managed"
    }

    async fn open(&mut self, cx: &TurnContext) -> tether::Result<Opened> {
        if let Some(sid) = self.session_id.clone() {
            self.open_stream().await?;
            let pending = self.reconcile(cx, false).await?;
            // A reattach reports what it waits on; nothing stashed counts as this request's turn.
            self.stashed = None;
            self.acc = TurnAcc::default();
            return Ok(Opened::resumed(sid).with_pending(pending));
        }
        let (Some(agent), Some(env)) = (&self.config.agent_id, &self.config.environment_id) else {
            return Err(Error::config(
                tether::ConfigKind::Invalid,
                "Managed Agents needs an agent id and an environment id (--agent-id, --environment-id) \
                 to create a session, or a session id (--session-id) to reattach",
            ));
        };
        let mut body = json!({"agent": agent, "environment_id": env});
        if let Some(t) = &self.config.title {
            body["title"] = json!(t);
        }
        let created = self.api.json(Method::POST, "/v1/sessions", Some(&body)).await?;
        let sid = created["id"]
            .as_str()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| Error::malformed(format!("POST /v1/sessions answered without an id: {created}")))?
            .to_owned();
        self.session_id = Some(sid.clone());
        // Stream first: nothing the session emits after our first post is missed.
        self.open_stream().await?;
        Ok(Opened::new(sid))
    }

    /// Reattaches to the thread's session by the id it recorded and catches up: the stream is
    /// opened first, then the whole history is listed (paging by cursor) and the events the
    /// record lacks (what the session did while no process was attached) are recorded. Custom
    /// tool uses without a result are pending (the engine answers them from the memo, or runs
    /// them); confirmations the session waits on go to the handler now.
    async fn resume(&mut self, from: Resume<'_>, cx: &TurnContext) -> tether::Result<Opened> {
        let Some(sid) = from.session_id.filter(|s| !s.is_empty()).map(str::to_owned) else {
            return Err(Error::cannot_resume(
                "managed",
                "no Managed Agents session was recorded for this thread",
            ));
        };
        self.session_id = Some(sid.clone());
        self.open_stream().await?;
        let pending = self.reconcile(cx, true).await?;
        // What the history held belongs to earlier requests; nothing counts as this one's turn.
        self.stashed = None;
        self.acc = TurnAcc::default();
        let unanswered = unposted_messages(from.events, self.remote_user_messages);
        Ok(Opened::resumed(sid)
            .with_pending(pending)
            .with_unanswered(unanswered))
    }

    async fn turn(&mut self, input: Input, cx: &TurnContext) -> tether::Result<TurnResult> {
        // The turn's requests join the session's trace (its request span) when it is traced.
        self.api.set_traceparent(cx.sink.traceparent(""));
        if matches!(input, Input::Continue) {
            if self.stream.is_none() {
                // A reconnect failed earlier: reconnect and reconcile now.
                self.open_stream().await?;
                let pending = self.reconcile(cx, true).await?;
                if !pending.is_empty() {
                    let sr = json!({"type": "requires_action", "source": "reconnect"});
                    return Ok(self.take_turn(Terminal::RequiresAction, sr, pending));
                }
            }
            if let Some(tr) = self.stashed.take() {
                return Ok(tr);
            }
        } else {
            self.stashed = None;
            if self.stream.is_none() {
                self.open_stream().await?;
            }
        }
        if let Some(u) = self.unposted.take() {
            self.post_events(u.events).await?;
        }
        let events = self.input_events(input)?;
        let answered: Vec<String> = events
            .iter()
            .filter(|e| e["type"] == "user.custom_tool_result")
            .filter_map(|e| e["custom_tool_use_id"].as_str().map(str::to_owned))
            .collect();
        let first_type = events.first().and_then(|e| e["type"].as_str()).map(str::to_owned);
        self.post_events(events).await?;
        self.answered.extend(answered);
        if self.after_interrupt && first_type.is_some() {
            self.after_interrupt = false;
            self.awaiting_echo = first_type;
        }
        loop {
            let frame = self.next_frame().await?;
            if frame.data.trim().is_empty() || frame.event.as_deref() == Some("ping") {
                continue;
            }
            let data: Value = match serde_json::from_str(&frame.data) {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(error = %e, "dropping an undecodable stream frame");
                    continue;
                }
            };
            if frame.event.as_deref() == Some("error") || data["type"] == "error" {
                self.stream = None;
                return Err(stream_error(&data));
            }
            if data["type"] == "ping" {
                continue;
            }
            if let Some(ty) = &self.awaiting_echo
                && data["type"].as_str() == Some(ty.as_str())
                && !data["processed_at"].is_null()
            {
                self.awaiting_echo = None;
            }
            if let Some(tr) = self.on_event(data, cx).await? {
                return Ok(tr);
            }
        }
    }

    fn can_reconnect(&self) -> bool {
        true
    }

    async fn reconnect(&mut self, cx: &TurnContext) -> tether::Result<Vec<ToolUse>> {
        self.api.set_traceparent(cx.sink.traceparent(""));
        self.open_stream().await?;
        self.reconcile(cx, true).await
    }

    async fn interrupt(&mut self) -> tether::Result<()> {
        if self.session_id.is_none() {
            return Ok(());
        }
        // Whatever the dropped turn left half-read belongs to the interrupted work.
        // Input the interrupted request failed to post is dropped with it.
        self.acc = TurnAcc::default();
        self.stashed = None;
        self.awaiting_echo = None;
        self.unposted = None;
        let path = format!("/v1/sessions/{}/events", self.sid()?);
        let body = json!({"events": [{"type": "user.interrupt"}]});
        // Posted directly (not remembered for a re-post): a late interrupt would stop the next
        // request instead of this one.
        self.api.json(Method::POST, &path, Some(&body)).await?;
        self.after_interrupt = true;
        // The interrupted custom tool uses are abandoned: a reconnect must not re-run them.
        let pending: Vec<String> = self.pending_tool_uses().into_iter().map(|u| u.id).collect();
        self.answered.extend(pending);
        Ok(())
    }

    async fn close(&mut self) -> tether::Result<()> {
        self.stream = None;
        if self.config.archive_on_close
            && !self.archived
            && let Some(sid) = self.session_id.clone()
        {
            self.api
                .json(
                    Method::POST,
                    &format!("/v1/sessions/{sid}/archive"),
                    Some(&json!({})),
                )
                .await?;
            self.archived = true;
        }
        Ok(())
    }
}

/// Hooks for the crate's `fuzzing` module (the event stream without the HTTP); not part of the API.
pub(crate) mod fuzzing;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requires_action_ids_are_read_in_both_shapes() {
        for sr in [
            json!({"type": "requires_action", "event_ids": ["a", "b"]}),
            json!({"type": "requires_action", "requires_action": {"event_ids": ["a", "b"]}}),
        ] {
            let ev = json!({"type": "session.status_idle", "stop_reason": sr});
            match boundary_of(&ev) {
                Boundary::RequiresAction(ids) => assert_eq!(ids, vec!["a", "b"]),
                _ => panic!("not requires_action"),
            }
        }
    }

    #[test]
    fn only_final_errors_end_a_turn() {
        let retrying = json!({"type": "session.error", "error": {"type": "model_overloaded_error", "retry_status": {"type": "retrying"}}});
        assert!(matches!(boundary_of(&retrying), Boundary::None));
        let exhausted = json!({"type": "session.error", "error": {"retry_status": {"type": "exhausted"}}});
        assert!(matches!(
            boundary_of(&exhausted),
            Boundary::End(Terminal::Terminated, _)
        ));
        let budget = json!({"type": "session.status_idle", "stop_reason": {"type": "budget_reached"}});
        assert!(matches!(
            boundary_of(&budget),
            Boundary::End(Terminal::Terminated, _)
        ));
    }
}
