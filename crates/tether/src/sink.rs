//! [`EventSink`]: where providers put what happens, and where the exactly-once record is kept.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, DefaultHasher, Hasher, RandomState};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex, OnceLock};

use futures_util::future::Either;
use serde_json::Value;
use tokio::sync::{Mutex, mpsc};

use crate::chat::ChatRequest;
use crate::error::{Error, Result};
use crate::event::{Event, EventKind};
use crate::handler::Handler;
use crate::raw;
use crate::store::EventStore;
use crate::types::{SessionInfo, SessionResult, ToolUse};

/// The session's event pipeline, handed to providers through [`crate::TurnContext`].
///
/// [`EventSink::emit`] records a durable event exactly once (a repeated id is dropped), appends it
/// to the [`EventStore`], and delivers it to the handler and every subscriber.
/// [`EventSink::emit_live`] delivers without recording (token deltas). Delivery to subscribers
/// waits for room in their queues: a slow subscriber slows the session, and nothing is dropped.
///
/// **The live stream equals the record.** A model call that is retried (a `Retry` event, after
/// a 429/503 or a dropped stream) streams its message again from the start. The sink remembers,
/// for the message streaming now, what it delivered (per part: a run of text or reasoning, a
/// signature, a tool call and its arguments; a length and a keyed hash, not the text), holds
/// back the new attempt's pieces while they repeat it, delivers only what goes beyond it, and,
/// when the new attempt differs (or ends shorter, or the record gets another message instead),
/// delivers an [`EventKind::MessageRestart`] followed by the new attempt's content so far. So
/// every consumer (the handler, every subscriber) sees each message once, ending with what the
/// record keeps, without knowing about retries.
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
    live: StdMutex<LiveGuard>,
    subscribers: StdMutex<Vec<mpsc::Sender<Arc<Event>>>>,
    observer: OnceLock<Arc<dyn EventObserver>>,
    /// Whether the observer wants the deltas a [`DeltaSink`] delivers (its `wants_deltas`).
    observer_deltas: AtomicBool,
    /// W3C `traceparent` values by scope (see [`EventSink::traceparent`]).
    trace: StdMutex<Traceparents>,
    full_payloads: AtomicBool,
    /// What the model deltas are paced on ([`EventSink::set_priority`]).
    priority: OnceLock<crate::priority::Priority>,
}

/// Sees every event of a session as it is delivered, synchronously, before the handler and the
/// subscribers, and the [`Mark`]s that exist only for it ([`EventSink::mark`]): where a tracer
/// (`tether-otel`) builds its spans.
///
/// It runs on the session's own task, in line: an observer must be quick and must not block. In
/// exchange it sees each event at the moment it happens (a subscriber's queue lags), and it can
/// set the trace context ([`EventSink::set_traceparent`]) of a model call or a tool call before
/// that call leaves the process.
pub trait EventObserver: Send + Sync + 'static {
    /// One event (durable, live, or an observer-only mark), with the sink it went through.
    fn on_event(&self, event: &Event, sink: &EventSink);

    /// One [`Mark`]: a moment of a request that matters to a tracer and is no part of the
    /// conversation. The default ignores it.
    fn on_mark(&self, mark: &Mark<'_>, sink: &EventSink) {
        let _ = (mark, sink);
    }

    /// Whether [`on_event`](Self::on_event) is called for a model's token and argument deltas
    /// (what a [`DeltaSink`] delivers: text, reasoning and tool-argument pieces, a tool call's
    /// start and end, a reasoning signature). Asked once, when the observer is attached. A
    /// tracer, which builds spans from requests, model calls and tool calls, answers `false`
    /// and so costs nothing per token.
    fn wants_deltas(&self) -> bool {
        true
    }

    /// A small named state value to store in the same store step as `event`, a durable event
    /// about to be recorded ([`EventStore::append_with_state`]): how an observer keeps state
    /// across a restart without a store write of its own (a tracer's link to the request in
    /// progress). Called before the append, under the record's lock, so it must be quick and
    /// must not use the sink; the event is then delivered to [`on_event`](Self::on_event) only
    /// if it was recorded, and with it the state. `None` (the default) stores nothing.
    fn state_with(&self, event: &Event) -> Option<(&'static str, Value)> {
        let _ = event;
        None
    }
}

/// A moment of a request shown to the session's [`EventObserver`] only ([`EventSink::mark`]):
/// a request's start and end, a model call's start, a tool's start, an approval asked during a
/// turn. Marks are neither recorded nor delivered to the handler or the subscribers, so
/// front-ends and records are unchanged by them, and they are typed and borrowed: showing one
/// builds nothing (no JSON), and the sink builds none at all when no observer is attached.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Mark<'a> {
    /// A request begins (the engine): its provider's name ([`crate::Provider::name`]) and what
    /// started it.
    RunStart {
        /// The provider's name: `local`, `managed`, `agentcore`, `acp`, ...
        provider: &'a str,
        /// What started the request.
        input: RunInput,
    },
    /// The request ended (the engine), with its result.
    RunEnd {
        /// What the request returns to its caller.
        result: &'a Result<SessionResult>,
    },
    /// The local loop calls its model (once per attempt).
    ModelCall(&'a ModelCall<'a>),
    /// The engine starts running a tool use (each one it runs). A tracer knows most of them
    /// from the model's message already; this tells it of the others (a resumed request's
    /// pending uses).
    ToolStart {
        /// The use being run.
        tool_use: &'a ToolUse,
    },
    /// An approval is asked of the handler during a turn (an ACP agent's permission request),
    /// for this tool use.
    PermissionRequest {
        /// The tool use the approval is for.
        tool_use_id: &'a str,
    },
    /// The approval's answer: the option chosen, or `cancelled`.
    PermissionOutcome {
        /// The tool use the approval was for.
        tool_use_id: &'a str,
        /// The chosen option's id, or `cancelled`.
        outcome: &'a str,
    },
}

/// What started a request ([`Mark::RunStart`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RunInput {
    /// A user message.
    Message,
    /// Results of tool uses the previous request left waiting.
    ToolResults,
    /// A continuation without new input.
    Continue,
    /// A provider-specific raw input.
    Raw,
    /// A request resumed from its record (after a restart, or an approval's answer).
    Resume,
}

impl RunInput {
    /// Its name: `message`, `tool_results`, `continue`, `raw`, `resume`.
    pub fn as_str(self) -> &'static str {
        match self {
            RunInput::Message => "message",
            RunInput::ToolResults => "tool_results",
            RunInput::Continue => "continue",
            RunInput::Raw => "raw",
            RunInput::Resume => "resume",
        }
    }
}

/// The local loop's call of its model ([`Mark::ModelCall`]).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ModelCall<'a> {
    /// The id the response is recorded under (every attempt streams under it).
    pub message_id: &'a str,
    /// The attempt, from 1 (a retry after a 429 or a dropped stream is 2, ...).
    pub attempt: u32,
    /// The model asked for (the request's, else the model's default).
    pub model: &'a str,
    /// The model's provider name ([`crate::ChatModel::name`]).
    pub provider: &'a str,
    /// The endpoint it is called at; `None` for a model in this process.
    pub endpoint: Option<&'a str>,
    /// The request: its messages and tools.
    pub request: &'a ChatRequest,
}

/// The `traceparent`s of a session's work in progress ([`EventSink::set_traceparent`]).
#[derive(Default)]
struct Traceparents {
    /// Scope `""`: the current model call or request (set and read on every model request, so
    /// kept out of the map).
    current: Option<String>,
    /// By tool use id.
    tools: HashMap<String, String>,
}

#[derive(Default)]
struct Record {
    seen: HashSet<String>,
    next_seq: u64,
    /// Whether events stored before this sink (by an earlier open) were seeded into the record,
    /// or ids learned from a history ([`EventSink::mark_seen`]).
    earlier: bool,
    /// The number of the first event recorded or adopted through this sink.
    first_own: Option<u64>,
    /// Shared with the store ([`EventStore::append_shared`]) and the delivery: one copy of each
    /// event until [`EventSink::take_record`] hands the record out.
    events: Vec<Arc<Event>>,
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
                live: StdMutex::new(LiveGuard::default()),
                subscribers: StdMutex::new(Vec::new()),
                observer: OnceLock::new(),
                observer_deltas: AtomicBool::new(false),
                trace: StdMutex::new(Traceparents::default()),
                full_payloads: AtomicBool::new(false),
                priority: OnceLock::new(),
            }),
        }
    }

    /// Attaches the session's observer (a tracer); there is at most one. Returns `false`, changing
    /// nothing, when one is attached already.
    pub fn set_observer(&self, observer: Arc<dyn EventObserver>) -> bool {
        let deltas = observer.wants_deltas();
        let set = self.inner.observer.set(observer).is_ok();
        if set {
            self.inner.observer_deltas.store(deltas, Ordering::Relaxed);
        }
        set
    }

    /// Whether an observer is attached: marks ([`EventSink::mark`]) are only worth building
    /// when one is.
    pub fn observed(&self) -> bool {
        self.inner.observer.get().is_some()
    }

    /// Shows a [`Mark`] to the observer only (see there); nothing when none is attached.
    pub fn mark(&self, mark: Mark<'_>) {
        if let Some(o) = self.inner.observer.get() {
            o.on_mark(&mark, self);
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
        match (scope, value) {
            ("", v) => g.current = v,
            (_, Some(v)) => {
                g.tools.insert(scope.to_owned(), v);
            }
            (_, None) => {
                g.tools.remove(scope);
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
        match scope {
            "" => g.current.clone(),
            _ => g.tools.get(scope).cloned(),
        }
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
        rec.earlier |= !events.is_empty();
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
        let before = rec.seen.len();
        rec.seen.extend(ids);
        rec.earlier |= rec.seen.len() != before;
    }

    /// The sequence number of the last event recorded (0 when none is).
    pub async fn last_seq(&self) -> u64 {
        self.inner.record.lock().await.next_seq.saturating_sub(1)
    }

    /// Whether the session's record began with this sink: nothing stored before it was seeded
    /// ([`EventSink::seed`]) or learned ([`EventSink::mark_seen`]), and the first event it
    /// recorded or adopted ([`EventSink::adopt`]: a new thread's first messages) is number 1.
    /// An observer keeping per-session state in the store (a tracer's link to the previous
    /// request) knows then that there is none to read. `false` while nothing is recorded.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let sink = tether::EventSink::detached();
    /// assert!(!sink.began_here().await);
    /// sink.record("e1", "demo", serde_json::json!({}), tether::EventKind::Other).await.unwrap();
    /// assert!(sink.began_here().await);
    /// # }
    /// ```
    pub async fn began_here(&self) -> bool {
        let rec = self.inner.record.lock().await;
        !rec.earlier && rec.first_own == Some(1)
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
        let event = {
            let mut rec = self.inner.record.lock().await;
            let seq = rec.next_seq;
            let info = self.info();
            if event.id.is_empty() {
                event.id = format!("{}:{seq}", info.session_id);
            }
            if rec.seen.contains(&event.id) {
                return Ok(false);
            }
            event.seq = Some(seq);
            // Appending under the record lock keeps the store in sequence order; the id and the
            // number are taken only once the store has the event, so a failed append leaves no
            // gap and the event can be emitted again.
            let session_id = info.session_id.as_str();
            let state = self.inner.observer.get().and_then(|o| o.state_with(&event));
            let event = Arc::new(event);
            let appended = match &state {
                Some((key, value)) => {
                    self.inner
                        .store
                        .append_with_state(session_id, &event, key, value)
                        .await?
                }
                None => self.inner.store.append_shared(session_id, &event).await?,
            };
            if !appended {
                rec.seen.insert(event.id.clone());
                return Ok(false);
            }
            rec.seen.insert(event.id.clone());
            rec.first_own.get_or_insert(seq);
            rec.next_seq += 1;
            rec.events.push(event.clone());
            event
        };
        self.deliver(Delivered::Shared(event)).await;
        Ok(true)
    }

    /// Adopts events the store already holds under this session's record, written by a step of
    /// the store's own: a new thread's start ([`crate::ThreadStore::start_thread`],
    /// [`crate::ThreadStore::claim_thread_starting`]) stores its first user messages with its
    /// provider session in one step, and the session adopts them here instead of emitting them
    /// (which would write them a second time).
    ///
    /// Adopted events are recorded as [`EventSink::emit`] records them, but nothing is written:
    /// they keep the sequence numbers they are stored under (numbering continues after them),
    /// their ids count as seen (a redelivery is dropped), [`EventSink::take_record`] returns them,
    /// and they are delivered in order to the observer, the handler and every subscriber.
    ///
    /// Each event must carry its stored number, continuing the record: the first
    /// [`EventSink::last_seq`] + 1, each next one more, every id new to the record. Otherwise
    /// nothing is adopted and the result is [`crate::Error::Store`] naming the event that does
    /// not fit: the store and the sink would disagree on what the record holds.
    pub async fn adopt(&self, events: Vec<Event>) -> Result<()> {
        let events = {
            let mut rec = self.inner.record.lock().await;
            let mut ids = HashSet::with_capacity(events.len());
            for (i, e) in events.iter().enumerate() {
                let want = rec.next_seq + i as u64;
                if e.seq != Some(want)
                    || e.id.is_empty()
                    || rec.seen.contains(&e.id)
                    || !ids.insert(e.id.as_str())
                {
                    return Err(Error::store(format!(
                        "session {}: stored event {:?} (number {}) does not continue the record (next: number {want}, an id not yet recorded), so none was adopted; reopen the session to load its record",
                        self.info().session_id,
                        e.id,
                        e.seq.map_or_else(|| "none".to_owned(), |s| s.to_string()),
                    )));
                }
            }
            let events: Vec<Arc<Event>> = events.into_iter().map(Arc::new).collect();
            if !events.is_empty() {
                let first = rec.next_seq;
                rec.first_own.get_or_insert(first);
            }
            for e in &events {
                rec.seen.insert(e.id.clone());
                rec.events.push(e.clone());
            }
            rec.next_seq += events.len() as u64;
            events
        };
        for e in events {
            self.deliver(Delivered::Shared(e)).await;
        }
        Ok(())
    }

    /// Delivers a live-only event (not recorded): token and argument deltas.
    pub async fn emit_live(&self, event: Event) {
        self.deliver(Delivered::Owned(event)).await;
    }

    /// A model's delta (from a [`DeltaSink`]): delivered like [`emit_live`](Self::emit_live),
    /// but shown to the observer only when it wants deltas ([`EventObserver::wants_deltas`]).
    async fn emit_delta(&self, event: Event) {
        if self.inner.observer_deltas.load(Ordering::Relaxed) {
            self.deliver(Delivered::Owned(event)).await;
        } else {
            self.deliver_unobserved(Delivered::Owned(event)).await;
        }
        // Boxed, and only when a run is starting: the wait (a timer) stays out of every model
        // call's future, which otherwise carries it for each delta.
        if let Some(p) = self.inner.priority.get()
            && p.waiting() > 0
        {
            Box::pin(p.pace()).await;
        }
    }

    /// Paces this session's model deltas on `priority` (see [`crate::priority`]): after each
    /// delta a [`DeltaSink`] delivers, the session waits while another run is starting (at most
    /// the priority's hold). Set once; returns `false` when a priority was already set.
    pub fn set_priority(&self, priority: crate::priority::Priority) -> bool {
        self.inner.priority.set(priority).is_ok()
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

    // `deliver` and `deliver_unobserved` are plain functions doing their synchronous part at
    // once and returning the rest: as `async fn`s each level kept its own 248-byte `event` in
    // the future beside the next level's, and every `emit`, `record` and delta carried the
    // nesting (about 500 bytes per level, in each session's turn and model-call futures). Every
    // caller awaits the returned future at once, so the observer and the retry guard see the
    // events in the same order as before.
    fn deliver(&self, event: Delivered) -> impl Future<Output = ()> + Send + '_ {
        if let Some(o) = self.inner.observer.get() {
            o.on_event(&event, self);
        }
        self.deliver_unobserved(event)
    }

    /// Delivers to the handler and the subscribers (through the retry guard), not the observer.
    fn deliver_unobserved(&self, event: Delivered) -> impl Future<Output = ()> + Send + '_ {
        let rewritten = match self.inner.live.lock() {
            Ok(mut g) => g.on_event(&event),
            Err(p) => p.into_inner().on_event(&event),
        };
        match rewritten {
            None => Either::Left(self.deliver_one(event)),
            // A stream replayed after a retry (rare): boxed, so the common path's future stays
            // the size of one delivery.
            Some(events) => Either::Right(Box::pin(self.deliver_all(events))),
        }
    }

    async fn deliver_all(&self, events: Vec<Event>) {
        for e in events {
            self.deliver_one(Delivered::Owned(e)).await;
        }
    }

    async fn deliver_one(&self, event: Delivered) {
        let info = self.info();
        self.inner.handler.on_event(&event, &info).await;
        // Fast path: a subscriber with room takes the event without waiting and without an async
        // lock; only a full queue makes the session wait (outside the lock) for that subscriber.
        let mut waiting: Vec<(mpsc::Sender<Arc<Event>>, Arc<Event>)> = Vec::new();
        {
            let Ok(mut subs) = self.inner.subscribers.lock() else {
                return;
            };
            subs.retain(|s| !s.is_closed());
            if subs.is_empty() {
                return;
            }
            // Every subscriber shares one event: a durable one with the record (no copy of its
            // payload while the store writes it), a live one in the allocation it gets here.
            let event = event.into_shared();
            for s in subs.iter() {
                match s.try_send(Arc::clone(&event)) {
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
        let (sub, tx) = Subscription::pair(capacity);
        self.attach(tx);
        sub
    }

    /// Delivers to a subscription made before the sink existed ([`Subscription::pair`]).
    pub(crate) fn attach(&self, tx: mpsc::Sender<Arc<Event>>) {
        if let Ok(mut subs) = self.inner.subscribers.lock() {
            subs.push(tx);
        }
    }

    /// Takes the record accumulated since the last call (one request's events), shared with
    /// the store rather than copied.
    pub async fn take_record(&self) -> Vec<Arc<Event>> {
        std::mem::take(&mut self.inner.record.lock().await.events)
    }
}

/// An event on its way to the observer, the handler and the subscribers: a live event owned, a
/// durable one shared with the record.
// Moved, as the `Event` was before: boxing the live variant would cost an allocation per delta.
#[allow(clippy::large_enum_variant)]
enum Delivered {
    Owned(Event),
    Shared(Arc<Event>),
}

impl std::ops::Deref for Delivered {
    type Target = Event;

    fn deref(&self) -> &Event {
        match self {
            Delivered::Owned(e) => e,
            Delivered::Shared(e) => e,
        }
    }
}

impl Delivered {
    fn into_shared(self) -> Arc<Event> {
        match self {
            Delivered::Owned(e) => Arc::new(e),
            Delivered::Shared(e) => e,
        }
    }
}

/// The event itself when nothing else holds it, else a copy.
fn unshare(e: Arc<Event>) -> Event {
    Arc::try_unwrap(e).unwrap_or_else(|e| Event::clone(&e))
}

/// One part of a message's live content: a run of text, a run of reasoning, a reasoning
/// signature, or one tool call (whose content is its argument text).
#[derive(Debug, Clone, PartialEq, Eq)]
enum PartKind {
    Text,
    Reasoning,
    Signature,
    Call { id: String, name: String },
}

/// A part as delivered: its length and a keyed hash of its bytes (the text itself is not kept).
struct Shown {
    kind: PartKind,
    len: usize,
    hash: DefaultHasher,
    ended: bool,
}

/// A part of the attempt after a retry, held back until it is known to repeat what was shown.
struct Draft {
    kind: PartKind,
    text: String,
    ended: bool,
    /// Its first `Shown::len` bytes were checked equal to what was shown.
    checked: bool,
}

struct LiveMessage {
    /// The message id (empty for tool calls that name no message).
    id: String,
    shown: Vec<Shown>,
    /// After a retry: the new attempt so far.
    replay: Option<Vec<Draft>>,
    /// More parts than [`MAX_PARTS`] were shown: they are no longer tracked, and a retry
    /// restarts the message at its first piece.
    lost: bool,
}

/// The most parts tracked per message: a model that alternates text and reasoning at every
/// character cannot make the sink hold a hasher per character.
const MAX_PARTS: usize = 256;

/// What a live event adds to its message.
enum Piece<'a> {
    Append(PartKind, &'a str),
    Signature(&'a str),
    Start(&'a str, &'a str),
    Args(&'a str, &'a str),
    End(&'a str),
}

/// Keeps what consumers see of a message equal to what the record keeps, across retries (see
/// [`EventSink`]). Only the message being streamed is tracked; a durable assistant message ends
/// the tracking of everything before it.
#[derive(Default)]
struct LiveGuard {
    keys: RandomState,
    messages: Vec<LiveMessage>,
    /// The last message the record got: live text for it afterwards (providers whose messages
    /// arrive whole send it after the durable event) is already confirmed.
    last_recorded: Option<String>,
}

fn live_event(kind: EventKind) -> Event {
    Event::new("", raw::REPLAY, Value::Null, kind)
}

impl LiveGuard {
    /// `None`: deliver the event as it is; `Some(events)`: deliver these instead (maybe none).
    fn on_event(&mut self, ev: &Event) -> Option<Vec<Event>> {
        if ev.is_durable() {
            return match &ev.kind {
                EventKind::Retry { .. } => {
                    self.retry();
                    None
                }
                EventKind::Message {
                    message_id,
                    role: crate::event::Role::Assistant,
                    ..
                } => self.recorded(message_id, ev),
                _ => None,
            };
        }
        let (message, piece) = match &ev.kind {
            EventKind::TextDelta { message_id, delta } => {
                (Some(message_id.as_str()), Piece::Append(PartKind::Text, delta))
            }
            EventKind::ReasoningDelta { message_id, delta } => (
                Some(message_id.as_str()),
                Piece::Append(PartKind::Reasoning, delta),
            ),
            EventKind::ReasoningSignature { message_id, value } => {
                (Some(message_id.as_str()), Piece::Signature(value))
            }
            EventKind::ToolCallStart {
                tool_use_id,
                name,
                message_id,
            } => (
                Some(message_id.as_deref().unwrap_or("")),
                Piece::Start(tool_use_id, name),
            ),
            EventKind::ToolCallArgs { tool_use_id, delta } => (None, Piece::Args(tool_use_id, delta)),
            EventKind::ToolCallEnd { tool_use_id } => (None, Piece::End(tool_use_id)),
            _ => return None,
        };
        let idx = match message {
            Some(id) => {
                if self.last_recorded.as_deref() == Some(id) {
                    return None;
                }
                match self.messages.iter().position(|m| m.id == id) {
                    Some(i) => i,
                    None => {
                        self.messages.push(LiveMessage {
                            id: id.to_owned(),
                            shown: Vec::new(),
                            replay: None,
                            lost: false,
                        });
                        self.messages.len() - 1
                    }
                }
            }
            // Arguments and ends belong to the message whose call they continue.
            None => {
                let call = match &piece {
                    Piece::Args(id, _) | Piece::End(id) => *id,
                    _ => return None,
                };
                self.messages.iter().position(|m| m.has_call(call))?
            }
        };
        let keys = &self.keys;
        let m = &mut self.messages[idx];
        if m.replay.is_some() {
            m.replayed(keys, piece, ev)
        } else {
            m.passed(keys, piece)
        }
    }

    /// A retry: only the message streaming when the attempt failed can be streamed again.
    fn retry(&mut self) {
        let n = self.messages.len();
        if n > 1 {
            self.messages.drain(..n - 1);
        }
        match self.messages.last_mut() {
            Some(m) if !m.shown.is_empty() || m.lost => m.replay = Some(Vec::new()),
            _ => self.messages.clear(),
        }
    }

    /// The record got message `id`: what was shown of it must be what it holds, and a failed
    /// attempt's content the record never got is withdrawn.
    fn recorded(&mut self, id: &str, ev: &Event) -> Option<Vec<Event>> {
        self.last_recorded = Some(id.to_owned());
        let mut out = Vec::new();
        for m in self.messages.drain(..) {
            let Some(drafts) = m.replay else { continue };
            let caught_up = !m.lost
                && drafts.len() == m.shown.len()
                && m.shown.iter().zip(&drafts).all(|(p, d)| complete(p, d));
            if m.id == id && !caught_up {
                out.extend(restart(&m.id, &drafts));
            } else if m.id != id {
                out.push(Event::new(
                    "",
                    raw::RESTART,
                    Value::Null,
                    EventKind::MessageRestart { message_id: m.id },
                ));
            }
        }
        if out.is_empty() {
            return None;
        }
        out.push(ev.clone());
        Some(out)
    }
}

/// Whether a draft repeats a shown part whole.
fn complete(p: &Shown, d: &Draft) -> bool {
    p.kind == d.kind && d.checked && d.text.len() == p.len && (p.ended || !d.ended)
}

/// A message's content streamed again from its start, after a `MessageRestart`.
fn restart(message_id: &str, drafts: &[Draft]) -> Vec<Event> {
    let mut out = vec![Event::new(
        "",
        raw::RESTART,
        Value::Null,
        EventKind::MessageRestart {
            message_id: message_id.to_owned(),
        },
    )];
    for d in drafts {
        match &d.kind {
            PartKind::Text if !d.text.is_empty() => out.push(live_event(EventKind::TextDelta {
                message_id: message_id.to_owned(),
                delta: d.text.clone(),
            })),
            PartKind::Reasoning if !d.text.is_empty() => out.push(live_event(EventKind::ReasoningDelta {
                message_id: message_id.to_owned(),
                delta: d.text.clone(),
            })),
            PartKind::Signature => out.push(live_event(EventKind::ReasoningSignature {
                message_id: message_id.to_owned(),
                value: d.text.clone(),
            })),
            PartKind::Call { id, name } => {
                out.push(live_event(EventKind::ToolCallStart {
                    tool_use_id: id.clone(),
                    name: name.clone(),
                    message_id: (!message_id.is_empty()).then(|| message_id.to_owned()),
                }));
                if !d.text.is_empty() {
                    out.push(live_event(EventKind::ToolCallArgs {
                        tool_use_id: id.clone(),
                        delta: d.text.clone(),
                    }));
                }
                if d.ended {
                    out.push(live_event(EventKind::ToolCallEnd {
                        tool_use_id: id.clone(),
                    }));
                }
            }
            _ => {}
        }
    }
    out
}

fn draft_of(drafts: &[Draft], id: &str) -> Option<usize> {
    drafts
        .iter()
        .position(|d| matches!(&d.kind, PartKind::Call { id: c, .. } if c == id))
}

fn hash_of(keys: &RandomState, s: &str) -> DefaultHasher {
    let mut h = keys.build_hasher();
    h.write(s.as_bytes());
    h
}

impl LiveMessage {
    fn has_call(&self, id: &str) -> bool {
        let is = |k: &PartKind| matches!(k, PartKind::Call { id: c, .. } if c == id);
        match &self.replay {
            Some(d) => d.iter().any(|d| is(&d.kind)),
            None => self.shown.iter().any(|p| is(&p.kind)),
        }
    }

    /// No retry in progress: the piece is delivered as it is and counted as shown.
    fn passed(&mut self, keys: &RandomState, piece: Piece<'_>) -> Option<Vec<Event>> {
        if self.lost {
            return None;
        }
        let out = self.track(keys, piece);
        if self.shown.len() > MAX_PARTS {
            self.shown = Vec::new();
            self.lost = true;
        }
        out
    }

    fn track(&mut self, keys: &RandomState, piece: Piece<'_>) -> Option<Vec<Event>> {
        match piece {
            Piece::Append(kind, s) => match self.shown.last_mut() {
                Some(p) if p.kind == kind => {
                    p.hash.write(s.as_bytes());
                    p.len += s.len();
                }
                _ => self.shown.push(Shown {
                    kind,
                    len: s.len(),
                    hash: hash_of(keys, s),
                    ended: false,
                }),
            },
            Piece::Signature(v) => self.shown.push(Shown {
                kind: PartKind::Signature,
                len: v.len(),
                hash: hash_of(keys, v),
                ended: true,
            }),
            Piece::Start(id, name) => {
                if self.has_call(id) {
                    return Some(Vec::new());
                }
                self.shown.push(Shown {
                    kind: PartKind::Call {
                        id: id.to_owned(),
                        name: name.to_owned(),
                    },
                    len: 0,
                    hash: keys.build_hasher(),
                    ended: false,
                });
            }
            Piece::Args(id, s) => {
                if let Some(p) = self.call_mut(id) {
                    p.hash.write(s.as_bytes());
                    p.len += s.len();
                }
            }
            Piece::End(id) => {
                if let Some(p) = self.call_mut(id) {
                    if p.ended {
                        return Some(Vec::new());
                    }
                    p.ended = true;
                }
            }
        }
        None
    }

    /// Everything shown repeated exactly: the attempt goes on as a plain stream.
    fn end_replay_if_repeated(&mut self) {
        if let Some(drafts) = &self.replay
            && drafts.len() == self.shown.len()
            && self
                .shown
                .iter()
                .zip(drafts)
                .all(|(p, d)| complete(p, d) && p.ended == d.ended)
        {
            self.replay = None;
        }
    }

    fn call_mut(&mut self, id: &str) -> Option<&mut Shown> {
        self.shown
            .iter_mut()
            .find(|p| matches!(&p.kind, PartKind::Call { id: c, .. } if c == id))
    }

    /// After a retry: the piece joins the new attempt, which is compared with what was shown.
    fn replayed(&mut self, keys: &RandomState, piece: Piece<'_>, ev: &Event) -> Option<Vec<Event>> {
        let drafts = self.replay.get_or_insert_with(Vec::new);
        let draft = |kind, text: &str, ended| Draft {
            kind,
            text: text.to_owned(),
            ended,
            checked: false,
        };
        let i = match piece {
            Piece::Append(kind, s) => match drafts.last_mut() {
                Some(d) if d.kind == kind => {
                    d.text.push_str(s);
                    drafts.len() - 1
                }
                _ => {
                    drafts.push(draft(kind, s, false));
                    drafts.len() - 1
                }
            },
            Piece::Signature(v) => {
                drafts.push(draft(PartKind::Signature, v, true));
                drafts.len() - 1
            }
            Piece::Start(id, name) => {
                if draft_of(drafts, id).is_some() {
                    return Some(Vec::new());
                }
                let kind = PartKind::Call {
                    id: id.to_owned(),
                    name: name.to_owned(),
                };
                drafts.push(draft(kind, "", false));
                drafts.len() - 1
            }
            Piece::Args(id, s) => {
                let i = draft_of(drafts, id)?;
                drafts[i].text.push_str(s);
                i
            }
            Piece::End(id) => {
                let i = draft_of(drafts, id)?;
                drafts[i].ended = true;
                i
            }
        };
        self.check(keys, i, ev)
    }

    /// Compares draft `i` with what was shown: hold it back, deliver what goes beyond, or
    /// restart the message.
    fn check(&mut self, keys: &RandomState, i: usize, ev: &Event) -> Option<Vec<Event>> {
        let drafts = self.replay.as_mut()?;
        let diverged = |m: &mut LiveMessage| {
            let drafts = m.replay.take().unwrap_or_default();
            let out = restart(&m.id, &drafts);
            m.lost = drafts.len() > MAX_PARTS;
            m.shown = if m.lost {
                Vec::new()
            } else {
                drafts
                    .into_iter()
                    .map(|d| Shown {
                        len: d.text.len(),
                        hash: hash_of(keys, &d.text),
                        kind: d.kind,
                        ended: d.ended,
                    })
                    .collect()
            };
            Some(out)
        };
        if self.lost || drafts.len() > MAX_PARTS {
            // What was shown is not known part by part: the message starts over.
            return diverged(self);
        }
        if i >= self.shown.len() {
            // A part the failed attempt never reached: shown once all it did show was repeated.
            let repeated =
                i == self.shown.len() && self.shown.iter().zip(drafts.iter()).all(|(p, d)| complete(p, d));
            if !repeated {
                return diverged(self);
            }
            // It is delivered and joins what was shown; the replay ends once every part is
            // repeated exactly (a call the consumer saw end must end here too, or get no more
            // arguments: more would be a restart).
            let d = &mut drafts[i];
            d.checked = true;
            self.shown.push(Shown {
                len: d.text.len(),
                hash: hash_of(keys, &d.text),
                kind: d.kind.clone(),
                ended: d.ended,
            });
            self.end_replay_if_repeated();
            return None;
        }
        let p = &self.shown[i];
        let d = &mut drafts[i];
        if p.kind != d.kind {
            return diverged(self);
        }
        if d.text.len() < p.len {
            return if d.ended { diverged(self) } else { Some(Vec::new()) };
        }
        if !d.checked {
            let same =
                d.text.is_char_boundary(p.len) && hash_of(keys, &d.text[..p.len]).finish() == p.hash.finish();
            if !same {
                return diverged(self);
            }
            d.checked = true;
        }
        let mut out = Vec::new();
        if d.text.len() > p.len {
            // Beyond what was shown: a text or reasoning part only if it was the last one shown
            // (after everything before it), a tool call while it is still open.
            let last = i + 1 == self.shown.len();
            let before_repeated = self.shown[..i]
                .iter()
                .zip(drafts.iter())
                .all(|(p, d)| complete(p, d));
            let may = match &p.kind {
                PartKind::Call { .. } => !p.ended,
                PartKind::Text | PartKind::Reasoning => last && before_repeated,
                PartKind::Signature => false,
            };
            if !may {
                return diverged(self);
            }
            let d = &drafts[i];
            let delta = d.text[p.len..].to_owned();
            let kind = match &ev.kind {
                EventKind::TextDelta { message_id, .. } => EventKind::TextDelta {
                    message_id: message_id.clone(),
                    delta: delta.clone(),
                },
                EventKind::ReasoningDelta { message_id, .. } => EventKind::ReasoningDelta {
                    message_id: message_id.clone(),
                    delta: delta.clone(),
                },
                EventKind::ToolCallArgs { tool_use_id, .. } => EventKind::ToolCallArgs {
                    tool_use_id: tool_use_id.clone(),
                    delta: delta.clone(),
                },
                _ => return diverged(self),
            };
            let len = d.text.len();
            let p = &mut self.shown[i];
            p.hash.write(delta.as_bytes());
            p.len = len;
            let mut e = ev.clone();
            e.kind = kind;
            out.push(e);
        } else if d.ended && !p.ended {
            // The call the failed attempt left open is now complete.
            self.shown[i].ended = true;
            out.push(ev.clone());
        }
        self.end_replay_if_repeated();
        Some(out)
    }
}

/// A live feed of a session's events, in order (from [`EventSink::subscribe`]). Dropping it
/// unsubscribes.
///
/// The queue holds shared events: a tokio channel allocates its slots 32 at a time, and 32
/// pointers (256 bytes) rather than 32 events (about 8 KiB) per block is what every concurrent
/// session saves. A durable event is the record's own (not a copy of its payload), so a
/// consumer that only reads events takes the `*_shared` forms; [`Subscription::recv`] and its
/// siblings give an owned event, copied when the record still holds it.
#[derive(Debug)]
pub struct Subscription {
    rx: mpsc::Receiver<Arc<Event>>,
}

impl Subscription {
    /// A subscription and the sender a sink delivers to.
    pub(crate) fn pair(capacity: usize) -> (Subscription, mpsc::Sender<Arc<Event>>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (Subscription { rx }, tx)
    }

    /// The next event; `None` once the session is gone and every event was received.
    ///
    /// Cancel safe: an event is never lost when this future is dropped before it completes.
    pub async fn recv(&mut self) -> Option<Event> {
        self.recv_shared().await.map(unshare)
    }

    /// The next event if one is queued now.
    pub fn try_recv(&mut self) -> std::result::Result<Event, mpsc::error::TryRecvError> {
        self.try_recv_shared().map(unshare)
    }

    /// Polls for the next event.
    pub fn poll_recv(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Event>> {
        self.poll_recv_shared(cx).map(|o| o.map(unshare))
    }

    /// The next event as delivered, shared with the record and the other subscribers; `None`
    /// once the session is gone and every event was received. Cancel safe, as [`Subscription::recv`].
    ///
    /// ```
    /// # async fn f(sub: &mut tether::Subscription) {
    /// while let Some(ev) = sub.recv_shared().await {
    ///     println!("{}", ev.raw_type);
    /// }
    /// # }
    /// ```
    pub async fn recv_shared(&mut self) -> Option<Arc<Event>> {
        self.rx.recv().await
    }

    /// The next event as delivered, if one is queued now.
    pub fn try_recv_shared(&mut self) -> std::result::Result<Arc<Event>, mpsc::error::TryRecvError> {
        self.rx.try_recv()
    }

    /// Polls for the next event as delivered.
    pub fn poll_recv_shared(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Arc<Event>>> {
        self.rx.poll_recv(cx)
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
            s.emit_delta(Event {
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
                raw::LOCAL_TEXT_DELTA,
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
                raw::LOCAL_REASONING_DELTA,
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
            raw::LOCAL_REASONING_SIGNATURE,
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
            raw::LOCAL_TOOL_CALL_START,
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
                raw::LOCAL_TOOL_CALL_ARGS,
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
            raw::LOCAL_TOOL_CALL_END,
            EventKind::ToolCallEnd {
                tool_use_id: tool_use_id.to_owned(),
            },
        )
        .await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;
    use serde_json::json;

    use super::*;
    use crate::event::Role;
    use crate::types::ToolUse;

    /// What a consumer holds for each message, folded from the live stream the way a front-end
    /// folds it (a restart discards the message's content).
    #[derive(Debug, Default, Clone, PartialEq)]
    struct Held {
        text: String,
        reasoning: String,
        calls: Vec<(String, String, String, bool)>,
    }

    #[derive(Debug, Default)]
    struct Consumer {
        held: HashMap<String, Held>,
        restarts: usize,
        text_bytes: usize,
    }

    impl Consumer {
        fn fold(&mut self, e: &Event) {
            match &e.kind {
                EventKind::TextDelta { message_id, delta } if !e.is_durable() => {
                    self.text_bytes += delta.len();
                    self.held
                        .entry(message_id.clone())
                        .or_default()
                        .text
                        .push_str(delta);
                }
                EventKind::ReasoningDelta { message_id, delta } => {
                    self.held
                        .entry(message_id.clone())
                        .or_default()
                        .reasoning
                        .push_str(delta);
                }
                EventKind::ToolCallStart {
                    tool_use_id,
                    name,
                    message_id,
                } => {
                    let h = self
                        .held
                        .entry(message_id.clone().unwrap_or_default())
                        .or_default();
                    assert!(
                        !h.calls.iter().any(|c| &c.0 == tool_use_id),
                        "call {tool_use_id} started twice"
                    );
                    h.calls
                        .push((tool_use_id.clone(), name.clone(), String::new(), false));
                }
                EventKind::ToolCallArgs { tool_use_id, delta } => {
                    let c = self.call(tool_use_id);
                    assert!(!c.3, "arguments after the end of {tool_use_id}");
                    c.2.push_str(delta);
                }
                EventKind::ToolCallEnd { tool_use_id } => {
                    let c = self.call(tool_use_id);
                    assert!(!c.3, "{tool_use_id} ended twice");
                    c.3 = true;
                }
                EventKind::MessageRestart { message_id } => {
                    self.restarts += 1;
                    self.held.remove(message_id);
                }
                _ => {}
            }
        }

        fn call(&mut self, id: &str) -> &mut (String, String, String, bool) {
            self.held
                .values_mut()
                .flat_map(|h| h.calls.iter_mut())
                .find(|c| c.0 == id)
                .unwrap_or_else(|| panic!("no call {id}"))
        }
    }

    enum Step {
        Text(&'static str),
        Reasoning(&'static str),
        Start(&'static str),
        Args(&'static str, &'static str),
        End(&'static str),
        Retry,
    }

    async fn play(steps: &[Step], record: (&str, &[(&str, &str)])) -> (Consumer, Vec<Event>) {
        let sink = EventSink::detached();
        let mut sub = sink.subscribe(4096).await;
        let live = |kind| Event::new("", "test", Value::Null, kind);
        for s in steps {
            match s {
                Step::Text(d) => {
                    sink.emit_live(live(EventKind::TextDelta {
                        message_id: "m1".into(),
                        delta: (*d).into(),
                    }))
                    .await
                }
                Step::Reasoning(d) => {
                    sink.emit_live(live(EventKind::ReasoningDelta {
                        message_id: "m1".into(),
                        delta: (*d).into(),
                    }))
                    .await
                }
                Step::Start(id) => {
                    sink.emit_live(live(EventKind::ToolCallStart {
                        tool_use_id: (*id).into(),
                        name: "f".into(),
                        message_id: Some("m1".into()),
                    }))
                    .await
                }
                Step::Args(id, d) => {
                    sink.emit_live(live(EventKind::ToolCallArgs {
                        tool_use_id: (*id).into(),
                        delta: (*d).into(),
                    }))
                    .await
                }
                Step::End(id) => {
                    sink.emit_live(live(EventKind::ToolCallEnd {
                        tool_use_id: (*id).into(),
                    }))
                    .await
                }
                Step::Retry => {
                    sink.record(
                        "",
                        raw::LOCAL_RETRY,
                        Value::Null,
                        EventKind::Retry {
                            attempt: 1,
                            delay_ms: 0,
                            error: "dropped".into(),
                        },
                    )
                    .await
                    .unwrap();
                }
            }
        }
        let (text, calls) = record;
        sink.record(
            "m1",
            raw::LOCAL_MODEL_RESPONSE,
            Value::Null,
            EventKind::Message {
                message_id: "m1".into(),
                role: Role::Assistant,
                text: text.into(),
                reasoning: None,
                tool_uses: calls
                    .iter()
                    .map(|(id, args)| ToolUse::from_arguments(*id, "f", args))
                    .collect(),
            },
        )
        .await
        .unwrap();
        drop(sink);
        let mut events = Vec::new();
        while let Ok(e) = sub.try_recv() {
            events.push(e);
        }
        let mut c = Consumer::default();
        for e in &events {
            c.fold(e);
        }
        (c, events)
    }

    fn held_calls(c: &Consumer) -> Vec<(String, String, bool)> {
        c.held
            .get("m1")
            .map(|h| h.calls.iter().map(|c| (c.0.clone(), c.2.clone(), c.3)).collect())
            .unwrap_or_default()
    }

    fn text_of(c: &Consumer) -> String {
        c.held.get("m1").map(|h| h.text.clone()).unwrap_or_default()
    }

    #[tokio::test]
    async fn a_retry_that_repeats_the_text_shows_it_once() {
        use Step::*;
        let (c, events) = play(
            &[Text("Hel"), Retry, Text("He"), Text("llo"), Text(" there")],
            ("Hello there", &[]),
        )
        .await;
        assert_eq!(text_of(&c), "Hello there");
        assert_eq!(c.restarts, 0);
        assert_eq!(
            c.text_bytes,
            "Hello there".len(),
            "nothing delivered twice: {events:#?}"
        );
        let deltas: Vec<&str> = events
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::TextDelta { delta, .. } => Some(delta.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(deltas, ["Hel", "lo", " there"]);
        // The retry itself is still delivered, in its place.
        assert!(matches!(events[1].kind, EventKind::Retry { .. }));
    }

    #[tokio::test]
    async fn a_retry_that_says_something_else_restarts_the_message() {
        use Step::*;
        let (c, events) = play(
            &[Text("partial"), Retry, Text("after drop "), Text("complete")],
            ("after drop complete", &[]),
        )
        .await;
        assert_eq!(text_of(&c), "after drop complete");
        assert_eq!(c.restarts, 1, "{events:#?}");
        // The restart comes as soon as the new attempt is known to differ (at the length of what
        // was shown), with the attempt so far, then the stream goes on.
        let kinds: Vec<&str> = events.iter().map(|e| e.kind.name()).collect();
        assert_eq!(
            kinds,
            [
                "text_delta",
                "retry",
                "message_restart",
                "text_delta",
                "text_delta",
                "message"
            ]
        );
    }

    #[tokio::test]
    async fn an_attempt_that_ends_shorter_restarts_the_message_before_the_record() {
        use Step::*;
        let (c, events) = play(&[Text("Hello there"), Retry, Text("Hello")], ("Hello", &[])).await;
        assert_eq!(text_of(&c), "Hello");
        assert_eq!(c.restarts, 1);
        assert!(matches!(events.last().unwrap().kind, EventKind::Message { .. }));
    }

    #[tokio::test]
    async fn a_repeated_tool_call_goes_on_where_it_was_cut() {
        use Step::*;
        let (c, _) = play(
            &[
                Text("Let me"),
                Start("c1"),
                Args("c1", r#"{"a""#),
                Retry,
                Text("Let me"),
                Start("c1"),
                Args("c1", r#"{"a":1}"#),
                End("c1"),
            ],
            ("Let me", &[("c1", r#"{"a":1}"#)]),
        )
        .await;
        assert_eq!(c.restarts, 0);
        assert_eq!(text_of(&c), "Let me");
        assert_eq!(held_calls(&c), [("c1".to_owned(), r#"{"a":1}"#.to_owned(), true)]);
    }

    #[tokio::test]
    async fn a_tool_call_under_a_new_id_restarts_the_message() {
        use Step::*;
        let (c, _) = play(
            &[
                Start("call_a"),
                Args("call_a", r#"{"x""#),
                Retry,
                Start("call_b"),
                Args("call_b", r#"{"x":2}"#),
                End("call_b"),
            ],
            ("", &[("call_b", r#"{"x":2}"#)]),
        )
        .await;
        assert_eq!(c.restarts, 1);
        assert_eq!(
            held_calls(&c),
            [("call_b".to_owned(), r#"{"x":2}"#.to_owned(), true)]
        );
    }

    #[tokio::test]
    async fn reasoning_is_held_back_like_text() {
        use Step::*;
        let (c, _) = play(
            &[
                Reasoning("think"),
                Text("A"),
                Retry,
                Reasoning("thi"),
                Reasoning("nk"),
                Text("AB"),
            ],
            ("AB", &[]),
        )
        .await;
        assert_eq!(c.restarts, 0);
        assert_eq!(c.held["m1"].reasoning, "think");
        assert_eq!(text_of(&c), "AB");
        // Reasoning that changes after the text began is a restart.
        let (c, _) = play(
            &[
                Reasoning("think"),
                Text("A"),
                Retry,
                Reasoning("thinking"),
                Text("A"),
            ],
            ("A", &[]),
        )
        .await;
        assert_eq!(c.restarts, 1);
        assert_eq!(c.held["m1"].reasoning, "thinking");
        assert_eq!(text_of(&c), "A");
    }

    #[tokio::test]
    async fn a_retry_before_anything_was_shown_changes_nothing() {
        use Step::*;
        let (c, events) = play(&[Retry, Text("Hi")], ("Hi", &[])).await;
        assert_eq!((text_of(&c).as_str(), c.restarts), ("Hi", 0));
        assert_eq!(events.len(), 3);
    }

    /// Counts what an observer is shown, by raw type.
    struct Seen {
        deltas: bool,
        seen: StdMutex<Vec<String>>,
    }

    impl EventObserver for Seen {
        fn on_event(&self, event: &Event, _sink: &EventSink) {
            self.seen.lock().unwrap().push(event.raw_type.clone());
        }
        fn on_mark(&self, mark: &Mark<'_>, _sink: &EventSink) {
            if let Mark::RunEnd { result: Err(e) } = mark {
                self.seen.lock().unwrap().push(format!("run_end:{}", e.code()));
            }
        }
        fn wants_deltas(&self) -> bool {
            self.deltas
        }
    }

    #[tokio::test]
    async fn an_observer_that_wants_no_deltas_is_not_called_for_them_and_subscribers_still_are() {
        for wants in [false, true] {
            let sink = EventSink::detached();
            let seen = Arc::new(Seen {
                deltas: wants,
                seen: StdMutex::new(Vec::new()),
            });
            assert!(sink.set_observer(seen.clone()));
            let mut sub = sink.subscribe(64).await;
            let d = DeltaSink::new(sink.clone(), "m");
            d.text("Hel").await;
            d.tool_call_start("t1", "f").await;
            d.tool_call_args("t1", "{}").await;
            d.tool_call_end("t1").await;
            sink.record(
                "u1",
                "tether.user_message",
                json!({}),
                EventKind::Message {
                    message_id: "u1".into(),
                    role: Role::User,
                    text: "hi".into(),
                    reasoning: None,
                    tool_uses: Vec::new(),
                },
            )
            .await
            .unwrap();
            let end: Result<SessionResult> = Err(Error::Cancelled);
            sink.mark(Mark::RunEnd { result: &end });
            let seen = seen.seen.lock().unwrap().clone();
            let deltas = [
                raw::LOCAL_TEXT_DELTA,
                raw::LOCAL_TOOL_CALL_START,
                raw::LOCAL_TOOL_CALL_ARGS,
                raw::LOCAL_TOOL_CALL_END,
            ];
            let mut expected: Vec<&str> = if wants { deltas.to_vec() } else { Vec::new() };
            expected.extend(["tether.user_message", "run_end:cancelled"]);
            assert_eq!(seen, expected, "wants_deltas = {wants}");
            // The subscribers get every delivered event either way (marks are not delivered).
            let mut got = Vec::new();
            while let Ok(e) = sub.try_recv() {
                got.push(e.raw_type);
            }
            let mut all: Vec<&str> = deltas.to_vec();
            all.push("tether.user_message");
            assert_eq!(got, all);
        }
    }

    #[tokio::test]
    async fn text_sent_after_its_record_is_not_withdrawn_by_a_reconnect() {
        // Providers whose messages arrive whole (Managed Agents) record the message, then send
        // its text live; a reconnect later must not take it back.
        let sink = EventSink::detached();
        let mut sub = sink.subscribe(64).await;
        let msg = |id: &str, text: &str| EventKind::Message {
            message_id: id.into(),
            role: Role::Assistant,
            text: text.into(),
            reasoning: None,
            tool_uses: Vec::new(),
        };
        sink.record("a", "agent.message", json!({}), msg("a", "one"))
            .await
            .unwrap();
        sink.emit_live(Event::new(
            "",
            "managed.text_delta",
            Value::Null,
            EventKind::TextDelta {
                message_id: "a".into(),
                delta: "one".into(),
            },
        ))
        .await;
        sink.record(
            "",
            raw::RECONNECT,
            json!({}),
            EventKind::Retry {
                attempt: 1,
                delay_ms: 0,
                error: "x".into(),
            },
        )
        .await
        .unwrap();
        sink.record("b", "agent.message", json!({}), msg("b", "two"))
            .await
            .unwrap();
        drop(sink);
        let mut kinds = Vec::new();
        while let Ok(e) = sub.try_recv() {
            kinds.push(e.kind.name());
        }
        assert_eq!(kinds, ["message", "text_delta", "retry", "message"]);
    }

    #[tokio::test]
    async fn a_message_of_countless_parts_is_not_tracked_part_by_part() {
        // Reasoning and text alternating at every character: a part each.
        let mut steps = Vec::new();
        for _ in 0..400 {
            steps.push(Step::Reasoning("r"));
            steps.push(Step::Text("t"));
        }
        let sink = EventSink::detached();
        let mut sub = sink.subscribe(8192).await;
        let live = |kind| Event::new("", "test", Value::Null, kind);
        for (i, s) in steps.iter().enumerate() {
            let kind = match s {
                Step::Reasoning(d) => EventKind::ReasoningDelta {
                    message_id: "m1".into(),
                    delta: (*d).into(),
                },
                Step::Text(d) => EventKind::TextDelta {
                    message_id: "m1".into(),
                    delta: (*d).into(),
                },
                _ => unreachable!(),
            };
            sink.emit_live(live(kind)).await;
            let g = sink.inner.live.lock().unwrap();
            assert!(g.messages[0].shown.len() <= MAX_PARTS, "at step {i}");
        }
        sink.record(
            "",
            raw::LOCAL_RETRY,
            Value::Null,
            EventKind::Retry {
                attempt: 1,
                delay_ms: 0,
                error: "x".into(),
            },
        )
        .await
        .unwrap();
        // The retry says "rt" only: the message starts over at its first piece.
        for (kind, d) in [(true, "r"), (false, "t")] {
            let kind = if kind {
                EventKind::ReasoningDelta {
                    message_id: "m1".into(),
                    delta: d.into(),
                }
            } else {
                EventKind::TextDelta {
                    message_id: "m1".into(),
                    delta: d.into(),
                }
            };
            sink.emit_live(live(kind)).await;
        }
        sink.record(
            "m1",
            raw::LOCAL_MODEL_RESPONSE,
            Value::Null,
            EventKind::Message {
                message_id: "m1".into(),
                role: Role::Assistant,
                text: "t".into(),
                reasoning: Some("r".into()),
                tool_uses: Vec::new(),
            },
        )
        .await
        .unwrap();
        drop(sink);
        let mut c = Consumer::default();
        while let Ok(e) = sub.try_recv() {
            c.fold(&e);
        }
        assert_eq!(c.restarts, 1);
        assert_eq!(
            (c.held["m1"].reasoning.as_str(), text_of(&c).as_str()),
            ("r", "t")
        );
    }

    fn stored(id: &str, seq: u64) -> Event {
        let mut e = Event::new(id, raw::USER_MESSAGE, json!({"text": id}), EventKind::Other);
        e.seq = Some(seq);
        e
    }

    #[tokio::test]
    async fn adopted_events_are_recorded_and_delivered_but_not_written() {
        let store = Arc::new(crate::store::MemoryStore::default());
        let sink = EventSink::new(
            SessionInfo::new("s1", "test"),
            Arc::new(crate::handler::NoTools),
            store.clone(),
        );
        let mut sub = sink.subscribe(8).await;
        sink.adopt(vec![stored("a", 1), stored("b", 2)]).await.unwrap();
        assert!(
            store.load("s1").await.unwrap().is_empty(),
            "adopting writes nothing"
        );
        assert_eq!(sink.last_seq().await, 2);
        assert!(sink.has_seen("a").await && sink.has_seen("b").await);
        let got: Vec<(String, Option<u64>)> = std::iter::from_fn(|| sub.try_recv().ok())
            .map(|e| (e.id, e.seq))
            .collect();
        assert_eq!(got, [("a".to_owned(), Some(1)), ("b".to_owned(), Some(2))]);
        // A redelivery of an adopted event is dropped; the next event continues the numbering.
        assert!(!sink.emit(stored("a", 0)).await.unwrap());
        assert!(sink.emit(stored("c", 0)).await.unwrap());
        let written = store.load("s1").await.unwrap();
        assert_eq!(written.len(), 1);
        assert_eq!((written[0].id.as_str(), written[0].seq), ("c", Some(3)));
        let record: Vec<String> = sink
            .take_record()
            .await
            .into_iter()
            .map(|e| e.id.clone())
            .collect();
        assert_eq!(record, ["a", "b", "c"]);
    }

    #[tokio::test]
    async fn subscribers_share_a_durable_event_with_the_record_and_with_each_other() {
        let store = Arc::new(crate::store::MemoryStore::default());
        let sink = EventSink::new(
            SessionInfo::new("s1", "test"),
            Arc::new(crate::handler::NoTools),
            store,
        );
        let mut a = sink.subscribe(8).await;
        let mut b = sink.subscribe(8).await;
        assert!(sink.emit(stored("a", 0)).await.unwrap());
        let (Ok(got_a), Ok(got_b)) = (a.try_recv_shared(), b.try_recv_shared()) else {
            panic!("both subscribers get the event");
        };
        let record = sink.take_record().await;
        assert!(
            Arc::ptr_eq(&got_a, &record[0]) && Arc::ptr_eq(&got_b, &record[0]),
            "one event, not a copy per subscriber"
        );
        assert_eq!(got_a.seq, Some(1));
        // A live event: one allocation shared by both; the owned form still reads it.
        DeltaSink::new(sink.clone(), "m1").text("hi").await;
        let (Ok(live_a), Ok(live_b)) = (a.try_recv_shared(), b.try_recv()) else {
            panic!("both subscribers get the delta");
        };
        for kind in [&live_a.kind, &live_b.kind] {
            assert!(
                matches!(kind, EventKind::TextDelta { message_id, delta } if message_id == "m1" && delta == "hi")
            );
        }
    }

    #[test]
    fn traceparents_are_kept_per_scope_and_only_for_an_observed_session() {
        struct Quiet;
        impl EventObserver for Quiet {
            fn on_event(&self, _: &Event, _: &EventSink) {}
        }
        let sink = EventSink::detached();
        sink.set_traceparent("", Some("req".into()));
        assert_eq!(
            sink.traceparent(""),
            None,
            "not traced: nothing leaves the process"
        );
        assert!(sink.set_observer(Arc::new(Quiet)));
        assert_eq!(sink.traceparent(""), Some("req".into()));
        sink.set_traceparent("t1", Some("tool".into()));
        sink.set_traceparent("", Some("chat".into()));
        assert_eq!(
            (
                sink.traceparent(""),
                sink.traceparent("t1"),
                sink.traceparent("t2")
            ),
            (Some("chat".into()), Some("tool".into()), None)
        );
        sink.set_traceparent("t1", None);
        assert_eq!(
            (sink.traceparent(""), sink.traceparent("t1")),
            (Some("chat".into()), None)
        );
        sink.set_traceparent("", None);
        assert_eq!(sink.traceparent(""), None);
    }

    #[tokio::test]
    async fn a_record_begins_here_only_when_nothing_came_before_it() {
        // A new thread: its first messages adopted from the open's own store step.
        let sink = EventSink::detached();
        assert!(!sink.began_here().await, "nothing recorded yet: not known");
        sink.adopt(vec![stored("a", 1)]).await.unwrap();
        assert!(sink.began_here().await);
        sink.emit(stored("b", 0)).await.unwrap();
        assert!(sink.began_here().await, "later events change nothing");
        // A new session recording its first event itself.
        let sink = EventSink::detached();
        sink.emit(stored("a", 0)).await.unwrap();
        assert!(sink.began_here().await);
        // Reopened after a restart: its stored events seeded, then more recorded.
        let sink = EventSink::detached();
        sink.seed(&[stored("a", 1), stored("b", 2)]).await;
        sink.emit(stored("c", 0)).await.unwrap();
        assert!(!sink.began_here().await);
        // Reopened with the first messages adopted after seeded ones (a resumed thread's run).
        let sink = EventSink::detached();
        sink.seed(&[stored("a", 1)]).await;
        sink.adopt(vec![stored("b", 2)]).await.unwrap();
        assert!(!sink.began_here().await);
        // Ids learned from a history (a reconnect): events exist that this sink did not record.
        let sink = EventSink::detached();
        sink.mark_seen(["x".to_owned()]).await;
        sink.emit(stored("a", 0)).await.unwrap();
        assert!(!sink.began_here().await);
        // Seeding nothing is no history.
        let sink = EventSink::detached();
        sink.seed(&[]).await;
        sink.emit(stored("a", 0)).await.unwrap();
        assert!(sink.began_here().await);
    }

    #[tokio::test]
    async fn events_that_do_not_continue_the_record_are_not_adopted() {
        let sink = EventSink::detached();
        let mut sub = sink.subscribe(8).await;
        sink.adopt(vec![stored("a", 1)]).await.unwrap();
        let bad = [
            vec![stored("b", 3)],                                      // a gap
            vec![stored("b", 1)],                                      // a number taken
            vec![stored("a", 2)],                                      // an id recorded
            vec![stored("b", 2), stored("b", 3)],                      // an id twice
            vec![stored("b", 2), stored("c", 2)],                      // a number twice
            vec![Event::new("b", "t", Value::Null, EventKind::Other)], // no number
        ];
        for events in bad {
            let err = sink.adopt(events.clone()).await.unwrap_err();
            assert!(matches!(err, crate::Error::Store { .. }), "{events:?}: {err}");
        }
        assert_eq!(sink.last_seq().await, 1, "nothing of a refused batch is adopted");
        assert!(!sink.has_seen("b").await);
        assert_eq!(std::iter::from_fn(|| sub.try_recv().ok()).count(), 1);
    }

    /// Splits `s` into pieces at the char boundaries `cuts` pick.
    fn pieces(s: &str, cuts: &[usize]) -> Vec<String> {
        let bounds: Vec<usize> = (0..=s.len()).filter(|i| s.is_char_boundary(*i)).collect();
        let mut at: Vec<usize> = cuts.iter().map(|c| bounds[c % bounds.len()]).collect();
        at.push(0);
        at.push(s.len());
        at.sort_unstable();
        at.dedup();
        at.windows(2).map(|w| s[w[0]..w[1]].to_owned()).collect()
    }

    async fn replay(shown: &[String], again: &[String], record: &str) -> Consumer {
        let sink = EventSink::detached();
        let mut sub = sink.subscribe(4096).await;
        let delta = |d: &String| {
            Event::new(
                "",
                "test",
                Value::Null,
                EventKind::TextDelta {
                    message_id: "m1".into(),
                    delta: d.clone(),
                },
            )
        };
        for d in shown {
            sink.emit_live(delta(d)).await;
        }
        sink.record(
            "",
            raw::LOCAL_RETRY,
            Value::Null,
            EventKind::Retry {
                attempt: 1,
                delay_ms: 0,
                error: "x".into(),
            },
        )
        .await
        .unwrap();
        for d in again {
            sink.emit_live(delta(d)).await;
        }
        sink.record(
            "m1",
            raw::LOCAL_MODEL_RESPONSE,
            Value::Null,
            EventKind::Message {
                message_id: "m1".into(),
                role: Role::Assistant,
                text: record.into(),
                reasoning: None,
                tool_uses: Vec::new(),
            },
        )
        .await
        .unwrap();
        drop(sink);
        let mut c = Consumer::default();
        while let Ok(e) = sub.try_recv() {
            c.fold(&e);
        }
        c
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    /// A message's live events: text, reasoning and tool calls (ids by position), each cut into
    /// pieces by `cuts`.
    fn message_events(parts: &[(u8, String)], cuts: &[usize]) -> Vec<Event> {
        let live = |kind| Event::new("", "test", Value::Null, kind);
        let mut out = Vec::new();
        for (i, (kind, text)) in parts.iter().enumerate() {
            let pieces = pieces(text, cuts);
            match kind % 3 {
                0 => out.extend(pieces.into_iter().map(|d| {
                    live(EventKind::TextDelta {
                        message_id: "m1".into(),
                        delta: d,
                    })
                })),
                1 => out.extend(pieces.into_iter().map(|d| {
                    live(EventKind::ReasoningDelta {
                        message_id: "m1".into(),
                        delta: d,
                    })
                })),
                _ => {
                    let id = format!("c{i}");
                    out.push(live(EventKind::ToolCallStart {
                        tool_use_id: id.clone(),
                        name: "f".into(),
                        message_id: Some("m1".into()),
                    }));
                    out.extend(pieces.into_iter().map(|d| {
                        live(EventKind::ToolCallArgs {
                            tool_use_id: id.clone(),
                            delta: d,
                        })
                    }));
                    out.push(live(EventKind::ToolCallEnd { tool_use_id: id }));
                }
            }
        }
        out
    }

    fn parts() -> impl Strategy<Value = Vec<(u8, String)>> {
        proptest::collection::vec((0u8..3, "[ab\u{e9}]{0,5}"), 0..5)
    }

    proptest! {
        /// Whatever the failed attempt showed and however both attempts are cut into pieces,
        /// the consumer ends with the record's text; a repeat adds no byte twice and no restart.
        /// Text, reasoning and tool calls alike: whatever part of one message the failed
        /// attempt showed, and whatever the next attempt streams, the consumer ends holding
        /// exactly the next attempt's message (started and ended once per call).
        #[test]
        fn every_part_ends_as_the_last_attempt_streamed_it(
            first in parts(),
            other in parts(),
            mode in 0u8..3,
            grow in 0usize..8,
            cut in 0usize..64,
            cuts in proptest::collection::vec(0usize..64, 0..4),
            second_cut in proptest::option::of(0usize..64),
        ) {
            // The next attempt: the same message, another one, or the same with one part grown
            // (what a model that goes on differently looks like).
            let same = mode == 0;
            let second = match mode {
                0 => first.clone(),
                1 => other,
                _ => {
                    let mut m = first.clone();
                    if let Some(p) = m.get_mut(grow % first.len().max(1)) {
                        p.1.push('b');
                    }
                    m
                }
            };
            let shown = message_events(&first, &cuts);
            let shown = &shown[..cut % (shown.len() + 1)];
            let again = message_events(&second, &[]);
            let expected = {
                let mut c = Consumer::default();
                for e in &again {
                    c.fold(e);
                }
                c.held.get("m1").cloned().unwrap_or_default()
            };
            let c = block_on(async {
                let sink = EventSink::detached();
                let mut sub = sink.subscribe(4096).await;
                for e in shown {
                    sink.emit_live(e.clone()).await;
                }
                let retry = EventKind::Retry {
                    attempt: 1,
                    delay_ms: 0,
                    error: "x".into(),
                };
                sink.record("", raw::LOCAL_RETRY, Value::Null, retry.clone()).await.unwrap();
                // Maybe the next attempt is cut too, and a third one streams it whole.
                if let Some(k) = second_cut {
                    for e in &again[..k % (again.len() + 1)] {
                        sink.emit_live(e.clone()).await;
                    }
                    sink.record("", raw::LOCAL_RETRY, Value::Null, retry).await.unwrap();
                }
                for e in &again {
                    sink.emit_live(e.clone()).await;
                }
                sink.record("m1", raw::LOCAL_MODEL_RESPONSE, Value::Null, EventKind::Message {
                    message_id: "m1".into(),
                    role: Role::Assistant,
                    text: expected.text.clone(),
                    reasoning: None,
                    tool_uses: Vec::new(),
                }).await.unwrap();
                drop(sink);
                let mut c = Consumer::default();
                while let Ok(e) = sub.try_recv() {
                    c.fold(&e);
                }
                c
            });
            prop_assert_eq!(c.held.get("m1").cloned().unwrap_or_default(), expected);
            if same {
                prop_assert_eq!(c.restarts, 0, "a repeat never restarts");
            }
        }

        #[test]
        fn the_consumer_ends_with_the_record(
            answer in "\\PC{0,24}",
            other in "\\PC{0,24}",
            cut in 0usize..64,
            shown_cuts in proptest::collection::vec(0usize..64, 0..6),
            again_cuts in proptest::collection::vec(0usize..64, 0..6),
            same in any::<bool>(),
        ) {
            let bounds: Vec<usize> = (0..=answer.len()).filter(|i| answer.is_char_boundary(*i)).collect();
            let shown_text = &answer[..bounds[cut % bounds.len()]];
            let record = if same { answer.clone() } else { other.clone() };
            let shown = pieces(shown_text, &shown_cuts);
            let again = pieces(&record, &again_cuts);
            let c = block_on(replay(&shown, &again, &record));
            prop_assert_eq!(text_of(&c), record.clone());
            if record.starts_with(shown_text) {
                prop_assert_eq!(c.restarts, 0);
                prop_assert_eq!(c.text_bytes, record.len());
            } else {
                prop_assert_eq!(c.restarts, 1);
            }
        }
    }
}
