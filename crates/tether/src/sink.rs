//! [`EventSink`]: where providers put what happens, and where the exactly-once record is kept.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex, OnceLock};

use serde_json::Value;
use tokio::sync::{Mutex, mpsc};

use crate::error::Result;
use crate::event::{Event, EventKind};
use crate::handler::Handler;
use crate::store::EventStore;
use crate::types::SessionInfo;

/// The session's event pipeline, handed to providers through [`crate::TurnContext`].
///
/// [`EventSink::emit`] records a durable event exactly once (a repeated id is dropped), appends it
/// to the [`EventStore`], and delivers it to the handler and every subscriber.
/// [`EventSink::emit_live`] delivers without recording (token deltas). Delivery to subscribers
/// waits for room in their queues: a slow subscriber slows the session, and nothing is dropped.
///
/// Cloning is cheap; clones share the same record.
#[derive(Clone)]
pub struct EventSink {
    inner: Arc<Inner>,
}

struct Inner {
    info: StdMutex<Arc<SessionInfo>>,
    handler: Arc<dyn Handler>,
    store: Arc<dyn EventStore>,
    record: Mutex<Record>,
    subscribers: StdMutex<Vec<mpsc::Sender<Box<Event>>>>,
    observer: OnceLock<Arc<dyn EventObserver>>,
    /// W3C `traceparent` values by scope (see [`EventSink::traceparent`]).
    trace: StdMutex<HashMap<String, String>>,
    full_payloads: AtomicBool,
}

/// Sees every event of a session as it is delivered, synchronously, before the handler and the
/// subscribers, and the *marks* that exist only for it ([`EventSink::observe`]): where a tracer
/// (`tether-otel`) builds its spans.
///
/// It runs on the session's own task, in line: an observer must be quick and must not block. In
/// exchange it sees each event at the moment it happens (a subscriber's queue lags), and it can
/// set the trace context ([`EventSink::set_traceparent`]) of a model call or a tool call before
/// that call leaves the process.
pub trait EventObserver: Send + Sync + 'static {
    /// One event (durable, live, or an observer-only mark), with the sink it went through.
    fn on_event(&self, event: &Event, sink: &EventSink);
}

#[derive(Default)]
struct Record {
    seen: HashSet<String>,
    next_seq: u64,
    events: Vec<Event>,
}

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSink").field("info", &self.info()).finish()
    }
}

impl EventSink {
    /// A sink for a session, delivering to `handler` and recording in `store`.
    pub fn new(info: SessionInfo, handler: Arc<dyn Handler>, store: Arc<dyn EventStore>) -> Self {
        EventSink {
            inner: Arc::new(Inner {
                info: StdMutex::new(Arc::new(info)),
                handler,
                store,
                record: Mutex::new(Record {
                    next_seq: 1,
                    ..Default::default()
                }),
                subscribers: StdMutex::new(Vec::new()),
                observer: OnceLock::new(),
                trace: StdMutex::new(HashMap::new()),
                full_payloads: AtomicBool::new(false),
            }),
        }
    }

    /// Attaches the session's observer (a tracer); there is at most one. Returns `false`, changing
    /// nothing, when one is attached already.
    pub fn set_observer(&self, observer: Arc<dyn EventObserver>) -> bool {
        self.inner.observer.set(observer).is_ok()
    }

    /// Whether an observer is attached: marks ([`EventSink::observe`]) are only worth building
    /// when one is.
    pub fn observed(&self) -> bool {
        self.inner.observer.get().is_some()
    }

    /// Shows a *mark* to the observer only: a moment that matters to a tracer but is no part of
    /// the conversation (a request's start and end, a model call's start). Marks are neither
    /// recorded nor delivered to the handler or the subscribers, so front-ends and records are
    /// unchanged by them. Raw types of marks: `tether.run_start`, `tether.run_end`,
    /// `tether.tool_start` (the engine), `local.model_call` (the local loop),
    /// `tether.permission_request` and `tether.permission_outcome` (an approval a provider asks
    /// its handler for during a turn: ACP).
    pub fn observe(&self, event: &Event) {
        if let Some(o) = self.inner.observer.get() {
            o.on_event(event, self);
        }
    }

    /// Sets (or with `None` clears) the W3C `traceparent` of the work in progress in `scope`:
    /// `""` for the session's current model call or request (what an outgoing provider request
    /// belongs to), a tool use's id for that tool call. Set by the observer; read where a call
    /// leaves the process (a provider's HTTP request, an MCP request's `_meta`).
    pub fn set_traceparent(&self, scope: &str, value: Option<String>) {
        let mut g = match self.inner.trace.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        match value {
            Some(v) => {
                g.insert(scope.to_owned(), v);
            }
            None => {
                g.remove(scope);
            }
        }
    }

    /// The W3C `traceparent` of the work in progress in `scope` (see
    /// [`EventSink::set_traceparent`]); `None` when the session is not traced.
    pub fn traceparent(&self, scope: &str) -> Option<String> {
        if !self.observed() {
            return None;
        }
        let g = match self.inner.trace.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        g.get(scope).cloned()
    }

    /// Asks for full payloads in marks (a model call's request messages), which are left out by
    /// default because they are large. A tracer recording content sets it.
    pub fn set_full_payloads(&self, on: bool) {
        self.inner.full_payloads.store(on, Ordering::Relaxed);
    }

    /// Whether marks should carry full payloads (see [`EventSink::set_full_payloads`]).
    pub fn full_payloads(&self) -> bool {
        self.inner.full_payloads.load(Ordering::Relaxed)
    }

    /// A sink that records in memory and delivers to nobody: for using a provider or model alone.
    pub fn detached() -> Self {
        EventSink::new(
            SessionInfo::new("detached", "none"),
            Arc::new(crate::handler::NoTools),
            Arc::new(crate::store::MemoryStore::default()),
        )
    }

    /// The session's identity as of now.
    pub fn info(&self) -> Arc<SessionInfo> {
        match self.inner.info.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Replaces the session's identity (after a provider opened or reattached the session).
    pub fn set_info(&self, info: SessionInfo) {
        match self.inner.info.lock() {
            Ok(mut g) => *g = Arc::new(info),
            Err(p) => *p.into_inner() = Arc::new(info),
        }
    }

    /// The handler events are delivered to.
    pub fn handler(&self) -> &Arc<dyn Handler> {
        &self.inner.handler
    }

    /// The store the record is appended to.
    pub fn store(&self) -> &Arc<dyn EventStore> {
        &self.inner.store
    }

    /// Seeds the record with events already stored for this session (after a restart): their ids
    /// count as seen and numbering continues after the highest sequence number.
    pub async fn seed(&self, events: &[Event]) {
        let mut rec = self.inner.record.lock().await;
        for e in events {
            rec.seen.insert(e.id.clone());
            if let Some(s) = e.seq {
                rec.next_seq = rec.next_seq.max(s + 1);
            }
        }
    }

    /// Marks event ids as seen without recording them (a reconnect learned them from history).
    pub async fn mark_seen<I: IntoIterator<Item = String>>(&self, ids: I) {
        let mut rec = self.inner.record.lock().await;
        rec.seen.extend(ids);
    }

    /// Whether an event id is already in the record.
    pub async fn has_seen(&self, id: &str) -> bool {
        self.inner.record.lock().await.seen.contains(id)
    }

    /// Records a durable event exactly once and delivers it.
    ///
    /// An empty id is replaced by one tether assigns (`<session>:<seq>`). Returns `false`, doing
    /// nothing, when the id is already recorded: that is how redelivered events are deduplicated.
    pub async fn emit(&self, mut event: Event) -> Result<bool> {
        {
            let mut rec = self.inner.record.lock().await;
            let seq = rec.next_seq;
            if event.id.is_empty() {
                event.id = format!("{}:{seq}", self.info().session_id);
            }
            if rec.seen.contains(&event.id) {
                return Ok(false);
            }
            event.seq = Some(seq);
            // Appending under the record lock keeps the store in sequence order; the id and the
            // number are taken only once the store has the event, so a failed append leaves no
            // gap and the event can be emitted again.
            let session_id = self.info().session_id.clone();
            if !self.inner.store.append(&session_id, &event).await? {
                rec.seen.insert(event.id.clone());
                return Ok(false);
            }
            rec.seen.insert(event.id.clone());
            rec.next_seq += 1;
            rec.events.push(event.clone());
        }
        self.deliver(event).await;
        Ok(true)
    }

    /// Delivers a live-only event (not recorded): token and argument deltas.
    pub async fn emit_live(&self, event: Event) {
        self.deliver(event).await;
    }

    /// Shorthand: records a durable event built from a raw type, raw payload and kind.
    pub async fn record(
        &self,
        id: impl Into<String>,
        raw_type: &str,
        raw: Value,
        kind: EventKind,
    ) -> Result<bool> {
        self.emit(Event::new(id, raw_type, raw, kind)).await
    }

    async fn deliver(&self, event: Event) {
        if let Some(o) = self.inner.observer.get() {
            o.on_event(&event, self);
        }
        let info = self.info();
        self.inner.handler.on_event(&event, &info).await;
        // Fast path: a subscriber with room takes the event without waiting and without an async
        // lock; only a full queue makes the session wait (outside the lock) for that subscriber.
        let mut waiting: Vec<(mpsc::Sender<Box<Event>>, Box<Event>)> = Vec::new();
        {
            let Ok(mut subs) = self.inner.subscribers.lock() else {
                return;
            };
            subs.retain(|s| !s.is_closed());
            let n = subs.len();
            let mut event = Some(Box::new(event));
            for (i, s) in subs.iter().enumerate() {
                // The last subscriber gets the event itself; the others get clones.
                let ev = if i + 1 == n { event.take() } else { event.clone() };
                let Some(ev) = ev else { break };
                match s.try_send(ev) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(ev)) => waiting.push((s.clone(), ev)),
                    Err(mpsc::error::TrySendError::Closed(_)) => {}
                }
            }
        }
        for (s, ev) in waiting {
            let _ = s.send(ev).await;
        }
    }

    /// Subscribes to every event delivered from now on (durable and live), in order.
    ///
    /// `capacity` bounds the queue; when it is full the session waits for the subscriber.
    /// Dropping the receiver unsubscribes.
    pub async fn subscribe(&self, capacity: usize) -> Subscription {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        if let Ok(mut subs) = self.inner.subscribers.lock() {
            subs.push(tx);
        }
        Subscription { rx }
    }

    /// Takes the record accumulated since the last call (one request's events).
    pub async fn take_record(&self) -> Vec<Event> {
        std::mem::take(&mut self.inner.record.lock().await.events)
    }
}

/// A live feed of a session's events, in order (from [`EventSink::subscribe`]). Dropping it
/// unsubscribes.
///
/// The queue holds boxed events: a tokio channel allocates its slots 32 at a time, and 32
/// pointers (256 bytes) rather than 32 events (about 8 KiB) per block is what every concurrent
/// session saves, at one small allocation per delivered event.
#[derive(Debug)]
pub struct Subscription {
    rx: mpsc::Receiver<Box<Event>>,
}

impl Subscription {
    /// The next event; `None` once the session is gone and every event was received.
    ///
    /// Cancel safe: an event is never lost when this future is dropped before it completes.
    pub async fn recv(&mut self) -> Option<Event> {
        self.rx.recv().await.map(|b| *b)
    }

    /// The next event if one is queued now.
    pub fn try_recv(&mut self) -> std::result::Result<Event, mpsc::error::TryRecvError> {
        self.rx.try_recv().map(|b| *b)
    }

    /// Polls for the next event.
    pub fn poll_recv(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Event>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| *b))
    }

    /// Closes the feed: the session stops delivering to it; queued events can still be received.
    pub fn close(&mut self) {
        self.rx.close();
    }
}

/// Where a [`crate::ChatModel`] streams its deltas while a call runs.
///
/// It turns each piece into a live [`Event`] of the local loop (`local.text_delta`, ...) tagged
/// with the assistant message's id. [`DeltaSink::discard`] gives one that goes nowhere, for using
/// a model on its own.
#[derive(Debug, Clone)]
pub struct DeltaSink {
    sink: Option<EventSink>,
    message_id: String,
}

impl DeltaSink {
    /// Deltas for message `message_id`, delivered through `sink`.
    pub fn new(sink: EventSink, message_id: impl Into<String>) -> Self {
        DeltaSink {
            sink: Some(sink),
            message_id: message_id.into(),
        }
    }

    /// A sink that drops every delta.
    pub fn discard() -> Self {
        DeltaSink {
            sink: None,
            message_id: String::new(),
        }
    }

    /// The id of the assistant message being streamed.
    pub fn message_id(&self) -> &str {
        &self.message_id
    }

    /// The W3C `traceparent` of this model call when the session is traced: a model sends it
    /// as the `traceparent` header of its request (see [`EventSink::traceparent`]).
    pub fn traceparent(&self) -> Option<String> {
        self.sink.as_ref().and_then(|s| s.traceparent(""))
    }

    async fn live(&self, raw_type: &'static str, kind: EventKind) {
        if let Some(s) = &self.sink {
            s.emit_live(Event {
                id: String::new(),
                seq: None,
                raw_type: raw_type.to_owned(),
                raw: Value::Null,
                kind,
            })
            .await;
        }
    }

    /// A piece of assistant text.
    pub async fn text(&self, delta: &str) {
        if self.sink.is_some() && !delta.is_empty() {
            self.live(
                "local.text_delta",
                EventKind::TextDelta {
                    message_id: self.message_id.clone(),
                    delta: delta.to_owned(),
                },
            )
            .await;
        }
    }

    /// A piece of reasoning text.
    pub async fn reasoning(&self, delta: &str) {
        if self.sink.is_some() && !delta.is_empty() {
            self.live(
                "local.reasoning_delta",
                EventKind::ReasoningDelta {
                    message_id: self.message_id.clone(),
                    delta: delta.to_owned(),
                },
            )
            .await;
        }
    }

    /// The opaque signature of a reasoning block.
    pub async fn reasoning_signature(&self, value: &str) {
        self.live(
            "local.reasoning_signature",
            EventKind::ReasoningSignature {
                message_id: self.message_id.clone(),
                value: value.to_owned(),
            },
        )
        .await;
    }

    /// A tool call began.
    pub async fn tool_call_start(&self, tool_use_id: &str, name: &str) {
        self.live(
            "local.tool_call_start",
            EventKind::ToolCallStart {
                tool_use_id: tool_use_id.to_owned(),
                name: name.to_owned(),
                message_id: Some(self.message_id.clone()),
            },
        )
        .await;
    }

    /// A piece of a tool call's arguments.
    pub async fn tool_call_args(&self, tool_use_id: &str, delta: &str) {
        if self.sink.is_some() && !delta.is_empty() {
            self.live(
                "local.tool_call_args",
                EventKind::ToolCallArgs {
                    tool_use_id: tool_use_id.to_owned(),
                    delta: delta.to_owned(),
                },
            )
            .await;
        }
    }

    /// A tool call's arguments are complete.
    pub async fn tool_call_end(&self, tool_use_id: &str) {
        self.live(
            "local.tool_call_end",
            EventKind::ToolCallEnd {
                tool_use_id: tool_use_id.to_owned(),
            },
        )
        .await;
    }
}
