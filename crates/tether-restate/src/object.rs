//! The thread as a Restate virtual object (`TetherThread`, keyed by thread id).
//!
//! - `turn` (exclusive): runs one turn of the thread with the local loop; every model call and
//!   every tool call is a `ctx.run` step, an approval an awakeable.
//! - `approve` (shared): completes the awakeable the turn waits on, after checking that the tool
//!   use it names is one the turn waits for.
//! - `waiting` and `running` (shared): what the turn waits for, and whether a turn runs.
//! - `cancel` (shared): cancels the turn in flight (Restate cancels the invocation: the step in
//!   flight ends, a waiting approval ends as a cancel, and the turn records what it did).
//! - `thread`, `events` and `checkpoint` (shared): the thread's record, kept in the object's
//!   state (see [`crate::record`]) or in a shared database ([`crate::shared`]), readable while a
//!   turn runs or waits.

use std::collections::HashMap;
use std::sync::Arc;

use restate_sdk::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tether::local::LocalLoop;
use tether::{
    CancellationToken, ChatModel, Error, Event, Handler, MemoryStore, RetryPolicy, Session, SessionConfig,
    StopReason, Thread, ThreadId, ThreadStore, ToolResult, UserMessage, Waiting,
};

use crate::hub::ThreadHub;
use crate::index::TetherThreadsClient;
use crate::record::{self, Page, Snapshot, Written};
use crate::shared::{SharedRecord, Start};
use crate::steps::{Decision, JournaledOutput, Step, StepClient, StepHandler, StepModel};

/// The longest message text a turn accepts, in bytes.
pub const MAX_TEXT: usize = 1 << 20;
/// The longest client message id, in bytes.
pub const MAX_MESSAGE_ID: usize = 256;

/// State key: the running turn's invocation id (for `cancel`).
const STATE_TURN: &str = "turn";
/// State key: what the turn waits for ([`Waiting`] as the approver sees it).
const STATE_PENDING: &str = "pending";
/// State key: the client id of the message the thread's last turn was sent with (kept after the
/// turn: [`ThreadStatus::message`]).
const STATE_MESSAGE: &str = "turn_message";
/// State key: where the running turn's sender said it runs ([`ThreadStatus::announced`]).
const STATE_ANNOUNCED: &str = "announced";

/// The body of a `turn` call.
///
/// ```
/// let req = tether_restate::TurnRequest::new("m1", "What is in README.md?").run("run-7");
/// assert_eq!(serde_json::to_value(&req).unwrap()["message_id"], "m1");
/// ```
#[derive(Debug, Clone, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TurnRequest {
    /// The client's id of the message (recorded once: a redelivered request is not sent twice).
    pub message_id: String,
    /// The user's message.
    pub text: String,
    /// Who sent it (e.g. the AG-UI run id; empty: nobody said): reported back in
    /// [`TurnSignal::Ended`] so a relay knows the end of *its* turn when the same message is sent
    /// again by another run. At most 256 bytes, no control characters.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run: String,
    /// Where the sender says the turn runs, if it does (e.g. the URL of its own node): the turn
    /// keeps it in its state while it runs ([`ThreadStatus::announced`], read by a relay
    /// elsewhere with the thread's status, no write of its own), and hands it to the
    /// [`TetherThread::on_attempt`] hook ([`Attempt::announced`]), which need not publish where
    /// the turn runs when it starts there. At most [`MAX_ANNOUNCED`] bytes, no control
    /// characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub announced: Option<String>,
    /// The sender's clock when it sent the turn (milliseconds since the Unix epoch): the turn's
    /// time (the thread's `updated_ms`). Part of the request, so the same on every replay: the
    /// turn reads no clock of its own, one journaled step fewer. `None`: the turn reads the clock
    /// in a step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock: Option<i64>,
    /// Whether the thread may have a record to import from the legacy store (see
    /// [`TetherThread::import`]), for a thread with no record on Restate yet: `Some(false)` when
    /// the sender found none there, and then the turn does not look (with [`TurnRequest::clock`]
    /// set, its first step is its model call). `None` (or `Some(true)`): it looks, in a step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub import: Option<bool>,
}

impl TurnRequest {
    /// A turn for the user's message `text`, of client id `message_id`.
    pub fn new(message_id: impl Into<String>, text: impl Into<String>) -> Self {
        TurnRequest {
            message_id: message_id.into(),
            text: text.into(),
            run: String::new(),
            announced: None,
            clock: None,
            import: None,
        }
    }

    /// Who sends it ([`TurnRequest::run`]).
    pub fn run(mut self, run: impl Into<String>) -> Self {
        self.run = run.into();
        self
    }

    /// Where the sender says the turn runs ([`TurnRequest::announced`]).
    pub fn announced(mut self, at: Option<String>) -> Self {
        self.announced = at;
        self
    }

    /// The sender's clock ([`TurnRequest::clock`]).
    pub fn clock(mut self, unix_ms: i64) -> Self {
        self.clock = Some(unix_ms);
        self
    }

    /// The sender's clock read now ([`TurnRequest::clock`]): the clock a turn reads in a step
    /// when it is not given one.
    pub fn clock_now(self) -> Self {
        self.clock(now_ms())
    }

    /// Whether the thread may have a legacy record to import ([`TurnRequest::import`]).
    pub fn import(mut self, may: bool) -> Self {
        self.import = Some(may);
        self
    }
}

/// The longest [`TurnRequest::announced`], in bytes.
pub const MAX_ANNOUNCED: usize = 2048;

/// What a turn returns.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TurnOutcome {
    /// The thread's record key (the thread id: the record is the thread object's state).
    pub record: String,
    /// The answer.
    pub text: String,
    /// The last model turn's stop reason.
    pub stop_reason: Value,
    /// Ids of the tool uses run.
    pub tool_uses: Vec<String>,
    /// Ids of tool uses left waiting for a front-end (not run here).
    pub pending: Vec<String>,
    /// Events the turn added to the record.
    pub events_added: usize,
    /// How many events the record holds after the turn: a relay that showed that many need not
    /// read the record again.
    #[serde(default)]
    pub length: u64,
}

/// A thread at a glance, read in one call (the `status` handler, [`RestateStore::status`]):
/// what a front-end asks before it sends a turn.
///
/// Why one call: each read is an invocation through the ingress, and under load it queues
/// behind the turns' own; three reads in one put a turn's start off by less.
///
/// [`RestateStore::status`]: crate::RestateStore::status
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ThreadStatus {
    /// The thread (`None` before its first turn).
    #[serde(default)]
    pub thread: Option<Thread>,
    /// How many events the thread's record holds.
    #[serde(default)]
    pub length: u64,
    /// The running turn's invocation id (`None` when no turn runs).
    #[serde(default)]
    pub invocation: Option<String>,
    /// The client id of the message the thread's last turn (running or ended) was sent with,
    /// once that turn started: a run sending it again is a client reconnecting to that turn.
    #[serde(default)]
    pub message: Option<String>,
    /// Where the running turn's sender said it runs ([`TurnRequest::announced`]; `None` when no
    /// turn runs or its sender said nothing). A replay elsewhere is published by the
    /// [`TetherThread::on_attempt`] hook instead.
    #[serde(default)]
    pub announced: Option<String>,
}

/// What a relay that hears nothing of a turn from its own process reads, in one call (the
/// `progress` handler, [`RestateStore::progress`]): what the turn waits for, and the record's
/// events after those the relay showed. The turn may run on another node's service.
///
/// Read in that order from one handler: a turn records its events before it waits, so a
/// `waiting` list comes with the events that lead to it.
///
/// [`RestateStore::progress`]: crate::RestateStore::progress
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Progress {
    /// The tool uses the running turn waits for approval of (empty when none).
    #[serde(default)]
    pub waiting: Vec<WaitingToolUse>,
    /// A page of the record (see [`Page`]).
    #[serde(default)]
    pub events: Vec<Event>,
}

/// A tool use as the approver sees it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WaitingToolUse {
    /// The tool use's id.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// What the handler said needs approving.
    pub summary: String,
    /// The tool use's arguments (an approver checks it approves this very call).
    #[serde(default)]
    pub input: Value,
}

/// A change of a running turn's state, sent out of band (like [`LiveEvent`]) to whoever relays
/// the turn to a client: the turn now waits for approvals, or it ended.
///
/// Sent on the same process as the turn's [`LiveEvent`]s and after them, so a receiver that
/// drains the event channel when it gets a signal has every event sent before it. A turn
/// replayed after a crash or a suspension may send a signal again (e.g. `Waiting` for tool uses
/// already answered): a receiver ignores what it knows. Serializable, so a front-end node can
/// pass it on to another (`tether serve`'s live route).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
// One signal or two a turn, moved through a channel: its size does not matter, and an unboxed
// outcome is easier to match on.
#[allow(clippy::large_enum_variant)]
pub enum TurnSignal {
    /// The turn waits for a decision on these tool uses.
    Waiting {
        /// The thread.
        thread: ThreadId,
        /// The tool uses waiting.
        tool_uses: Vec<WaitingToolUse>,
    },
    /// The turn ended: its outcome, or the terminal failure's status code and message (409: it
    /// was cancelled). Sent once Restate holds everything the turn wrote (its record, and the
    /// thread no longer running: see [`TetherThread`]'s `turn`), so a receiver may tell its
    /// client at once, without asking Restate first.
    Ended {
        /// The thread.
        thread: ThreadId,
        /// The id of the message the turn was started with.
        message_id: String,
        /// The [`TurnRequest::run`] the turn was started with.
        run: String,
        /// The outcome.
        outcome: Result<TurnOutcome, (u16, String)>,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct PendingState {
    awakeable: String,
    tool_uses: Vec<WaitingToolUse>,
}

/// The virtual object's implementation: the model and the tools a turn uses (the record is the
/// object's state).
pub struct TetherThread {
    model: Arc<dyn ChatModel>,
    handler: Arc<dyn Handler>,
    import: Option<Arc<dyn ThreadStore>>,
    agent: String,
    system_prompt: Option<String>,
    model_name: Option<String>,
    live: Option<Fanout<LiveEvent>>,
    drafts: LiveDrafts,
    signals: Option<Fanout<TurnSignal>>,
    on_attempt: Option<OnAttempt>,
    shared: Option<SharedRecord>,
}

/// Where a turn's out-of-band messages go: one channel for every thread, or one per thread.
#[derive(Clone)]
enum Fanout<T> {
    All(tokio::sync::broadcast::Sender<T>),
    PerThread(ThreadHub<T>),
}

impl<T: Clone> Fanout<T> {
    fn send(&self, thread: &ThreadId, msg: T) {
        match self {
            // No subscriber is not an error: the record holds every durable event anyway, and a
            // signal only wakes a relay.
            Fanout::All(tx) => {
                let _ = tx.send(msg);
            }
            Fanout::PerThread(hub) => hub.send(thread, msg),
        }
    }
}

/// See [`TetherThread::on_attempt`].
pub type OnAttempt =
    Arc<dyn Fn(Attempt) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>;

/// A turn starting (or replayed) in this process, as the [`TetherThread::on_attempt`] hook sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Attempt {
    /// The turn's thread.
    pub thread: ThreadId,
    /// Where the turn's sender said it runs ([`TurnRequest::announced`]).
    pub announced: Option<String>,
    /// The turn's invocation id (what [`ThreadStatus::invocation`] shows while it runs): a
    /// hook publishing where this attempt runs tags it with this, so a reader can tell it from
    /// an earlier turn's.
    pub invocation: String,
}

impl Attempt {
    /// A turn of `thread` starting, its sender having said it runs at `announced`.
    pub fn new(thread: ThreadId, announced: Option<String>) -> Self {
        Attempt {
            thread,
            announced,
            invocation: String::new(),
        }
    }

    /// The turn's invocation id ([`Attempt::invocation`]).
    pub fn invocation(mut self, id: impl Into<String>) -> Self {
        self.invocation = id.into();
        self
    }
}

/// An event of a running turn, as the service process sees it (out of band: not journaled).
///
/// Live events (`seq == None`: token deltas) are sent while the model step runs (and again, from
/// the part's start, if a replayed turn runs the step again). Durable events are sent as the engine records them; a turn replayed after a crash
/// sends them again with the same id and `seq`, so a consumer keeps what it has not seen by id.
///
/// A live delta carries its `offset`: where its text starts in the part it continues, so that a
/// relay that saw a part from another place (the record, a peer, an earlier attempt of the
/// model step) shows each character of it once: it continues from what it showed, drops what
/// it showed already, and never shows a part whose beginning it missed as if it were whole.
#[derive(Debug, Clone)]
pub struct LiveEvent {
    /// The thread.
    pub thread: ThreadId,
    /// The event.
    pub event: tether::Event,
    /// For a live delta of text, reasoning or tool-call arguments: the bytes of that part (the
    /// message's text, its reasoning, the call's arguments) this attempt of the turn streamed
    /// before it. A model step that runs again (a replayed turn) streams from 0 again. `None`
    /// for every other event.
    pub offset: Option<u64>,
}

/// The part of a message a live delta continues, as [`LiveEvent::offset`] counts it: `Some`
/// for text, reasoning and tool-call argument deltas.
pub fn live_part(kind: &tether::EventKind) -> Option<(LivePart, &str, &str)> {
    match kind {
        tether::EventKind::TextDelta { message_id, delta } => Some((LivePart::Text, message_id, delta)),
        tether::EventKind::ReasoningDelta { message_id, delta } => {
            Some((LivePart::Reasoning, message_id, delta))
        }
        tether::EventKind::ToolCallArgs { tool_use_id, delta } => {
            Some((LivePart::Arguments, tool_use_id, delta))
        }
        _ => None,
    }
}

/// Which part of a message a live delta belongs to (see [`live_part`]).
///
/// In the order a message streams them (reasoning, text, then its calls' arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LivePart {
    /// The message's reasoning (keyed by the message id).
    Reasoning,
    /// The message's text (keyed by the message id).
    Text,
    /// A tool call's arguments (keyed by the tool use id).
    Arguments,
}

impl LivePart {
    /// A live delta of this part of `id` (a message id, or a tool use id for arguments).
    pub fn delta(self, id: String, delta: String) -> tether::Event {
        let kind = match self {
            LivePart::Text => tether::EventKind::TextDelta {
                message_id: id,
                delta,
            },
            LivePart::Reasoning => tether::EventKind::ReasoningDelta {
                message_id: id,
                delta,
            },
            LivePart::Arguments => tether::EventKind::ToolCallArgs {
                tool_use_id: id,
                delta,
            },
        };
        tether::Event::new("", "restate.live_draft", Value::Null, kind)
    }
}

type Parts = HashMap<(LivePart, String), String>;

/// What each thread's turn running in this process streamed so far of the parts in progress (a
/// message's text and reasoning, a call's arguments; dropped once the record holds them whole):
/// the offsets of [`LiveEvent`], and what a relay that begins following a turn mid-message is
/// shown first ([`LiveDrafts::of`], from offset 0), so that it shows that message live too.
#[derive(Clone, Default)]
pub struct LiveDrafts {
    inner: Arc<std::sync::Mutex<HashMap<ThreadId, Parts>>>,
}

impl LiveDrafts {
    /// No drafts.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ThreadId, Parts>> {
        // Every operation on the map is a single insert, append or remove: a poisoned lock
        // leaves it consistent.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The parts of `thread`'s turn streaming now, each with what was streamed of it:
    /// (part, message or tool use id, text from offset 0), reasoning before text.
    pub fn of(&self, thread: &ThreadId) -> Vec<(LivePart, String, String)> {
        let mut out: Vec<(LivePart, String, String)> = self
            .lock()
            .get(thread)
            .map(|parts| {
                parts
                    .iter()
                    .map(|((p, id), text)| (*p, id.clone(), text.clone()))
                    .collect()
            })
            .unwrap_or_default();
        out.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        out
    }

    /// How many threads have drafts (for tests).
    pub fn threads(&self) -> usize {
        self.lock().len()
    }

    /// A new attempt of `thread`'s turn streams every part from its start.
    fn forget_thread(&self, thread: &ThreadId) {
        self.lock().remove(thread);
    }

    /// The offset of `event` if it is a delta, adding it to its part's draft; forgets the parts
    /// the record now holds whole.
    fn offset(&self, thread: &ThreadId, event: &tether::Event) -> Option<u64> {
        let mut all = self.lock();
        if let Some((part, id, delta)) = live_part(&event.kind) {
            let draft = all
                .entry(thread.clone())
                .or_default()
                .entry((part, id.to_owned()))
                .or_default();
            let offset = draft.len() as u64;
            draft.push_str(delta);
            return Some(offset);
        }
        let parts = all.get_mut(thread)?;
        match &event.kind {
            // A call starting (again) streams its arguments from their start.
            tether::EventKind::ToolCallStart { tool_use_id, .. } => {
                parts.remove(&(LivePart::Arguments, tool_use_id.clone()));
            }
            tether::EventKind::ToolCall { tool_use, .. } if event.is_durable() => {
                parts.remove(&(LivePart::Arguments, tool_use.id.clone()));
            }
            tether::EventKind::Message {
                message_id,
                tool_uses,
                ..
            } if event.is_durable() => {
                parts.remove(&(LivePart::Text, message_id.clone()));
                parts.remove(&(LivePart::Reasoning, message_id.clone()));
                for u in tool_uses {
                    parts.remove(&(LivePart::Arguments, u.id.clone()));
                }
            }
            _ => {}
        }
        if parts.is_empty() {
            all.remove(thread);
        }
        None
    }
}

/// Forwards a turn's events to the live channel, each delta with its offset.
struct LiveObserver {
    thread: ThreadId,
    tx: Fanout<LiveEvent>,
    drafts: LiveDrafts,
}

impl Drop for LiveObserver {
    fn drop(&mut self) {
        self.drafts.forget_thread(&self.thread);
    }
}

impl tether::EventObserver for LiveObserver {
    fn on_event(&self, event: &tether::Event, _sink: &tether::EventSink) {
        let offset = self.drafts.offset(&self.thread, event);
        self.tx.send(
            &self.thread,
            LiveEvent {
                thread: self.thread.clone(),
                event: event.clone(),
                offset,
            },
        );
    }
}

impl TetherThread {
    /// Threads of `agent` over `model` with `handler`'s tools.
    pub fn new(agent: impl Into<String>, model: Arc<dyn ChatModel>, handler: Arc<dyn Handler>) -> Self {
        TetherThread {
            model,
            handler,
            import: None,
            agent: agent.into(),
            system_prompt: None,
            model_name: None,
            live: None,
            drafts: LiveDrafts::new(),
            signals: None,
            on_attempt: None,
            shared: None,
        }
    }

    /// Keeps the threads' records in `record`, a database every tether node reaches, instead of
    /// the object state (see [`crate::shared`]): Restate then stores each turn's steps and a few
    /// small keys, not its events, and front-ends read records from the database. Every node
    /// serving the same threads must be given the same database; a thread's record does not move
    /// between the two homes.
    pub fn shared_record(mut self, record: SharedRecord) -> Self {
        self.shared = Some(record);
        self
    }

    /// Runs `f` in this process each time a turn of a thread starts running here, before the
    /// engine starts: a new turn, and every replay of one (after a suspension, a crash or a
    /// failover, on whichever process Restate sends it to). Its future is awaited, so what it
    /// publishes (e.g. where this process serves the turn's live events) is there before the
    /// turn's first event. Not journaled: keep it idempotent and quick, and let it fail quietly.
    pub fn on_attempt(mut self, f: OnAttempt) -> Self {
        self.on_attempt = Some(f);
        self
    }

    /// Imports a thread that has no record on Restate yet from `store` (read only), in its first
    /// turn: the events, memo and checkpoint a node recorded before its threads moved to Restate
    /// (e.g. its SQLite file). From then on the object state is the record.
    pub fn import(mut self, store: Arc<dyn ThreadStore>) -> Self {
        self.import = Some(store);
        self
    }

    /// Sends every turn's state changes to `tx` (see [`TurnSignal`]).
    pub fn signals(mut self, tx: tokio::sync::broadcast::Sender<TurnSignal>) -> Self {
        self.signals = Some(Fanout::All(tx));
        self
    }

    /// Sends every turn's state changes to its thread's subscribers of `hub` (see
    /// [`TurnSignal`]): for many concurrent relays, each of one thread.
    pub fn signal_hub(mut self, hub: ThreadHub<TurnSignal>) -> Self {
        self.signals = Some(Fanout::PerThread(hub));
        self
    }

    fn signal(&self, s: TurnSignal) {
        if let Some(tx) = &self.signals {
            let thread = match &s {
                TurnSignal::Waiting { thread, .. } | TurnSignal::Ended { thread, .. } => thread.clone(),
            };
            tx.send(&thread, s);
        }
    }

    /// Sends every turn's events to `tx` as they happen (token deltas included): the out-of-band
    /// stream a front-end relays (see [`LiveEvent`]).
    pub fn live(mut self, tx: tokio::sync::broadcast::Sender<LiveEvent>) -> Self {
        self.live = Some(Fanout::All(tx));
        self
    }

    /// Sends every turn's events to its thread's subscribers of `hub` as they happen: as
    /// [`TetherThread::live`], but a relay reads its own thread's events only (one channel for
    /// all threads costs N² receives for N concurrent relays, and makes them lag).
    pub fn live_hub(mut self, hub: ThreadHub<LiveEvent>) -> Self {
        self.live = Some(Fanout::PerThread(hub));
        self
    }

    /// Keeps what the turns running here streamed so far of the parts in progress in `drafts`
    /// (see [`LiveDrafts`]), where a relay that begins following a turn mid-message reads it.
    pub fn live_drafts(mut self, drafts: LiveDrafts) -> Self {
        self.drafts = drafts;
        self
    }

    /// The system prompt of the local loop.
    pub fn system_prompt(mut self, prompt: impl Into<String>) -> Self {
        self.system_prompt = Some(prompt.into());
        self
    }

    /// The model name the local loop asks for.
    pub fn model_name(mut self, name: impl Into<String>) -> Self {
        self.model_name = Some(name.into());
        self
    }
}

/// Milliseconds since the epoch (read in a journaled step: a replay sees the same time).
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A failure of the record's bookkeeping: terminal (it would fail the same way again).
fn record_error(e: Error) -> TerminalError {
    TerminalError::new(format!("the thread's record: {e}"))
}

/// How a turn fails: for good (journaled, said to its relays), or for now (Restate runs the
/// invocation again from its journal: the shared record's database did not answer).
enum Failure {
    Terminal(TerminalError),
    Retry(Error),
}

impl From<TerminalError> for Failure {
    fn from(e: TerminalError) -> Self {
        Failure::Terminal(e)
    }
}

/// The record's events and checkpoint (journaled reads of the object state; with a shared
/// record, its events up to where the turn starts and the checkpoint it starts from, read from
/// the database: see [`SharedRecord::turn_start`]).
async fn read_record(
    ctx: &ObjectContext<'_>,
    shared: Option<(&SharedRecord, &Start)>,
) -> Result<(Vec<Event>, Option<Value>), Failure> {
    if let Some((shared, start)) = shared {
        let events = shared
            .events_upto(ctx.key(), start.length)
            .await
            .map_err(Failure::Retry)?;
        return Ok((events, start.checkpoint.clone()));
    }
    let checkpoint = ctx
        .get::<Json<Value>>(record::CHECKPOINT_KEY)
        .await?
        .map(Json::into_inner);
    let count = ctx
        .get::<Json<u64>>(record::EVENTS)
        .await?
        .map_or(0, Json::into_inner);
    let mut events = Vec::with_capacity(usize::try_from(count.min(4096)).unwrap_or(0));
    for seq in 1..=count {
        match ctx.get::<Json<Event>>(&record::event_key(seq)).await? {
            Some(Json(e)) => events.push(e),
            None => {
                return Err(
                    TerminalError::new(format!("the thread's record lacks event {seq} of {count}")).into(),
                );
            }
        }
    }
    Ok((events, checkpoint))
}

/// The running turn's marks as the shared record shows them (see [`ThreadStatus`]).
struct Marks {
    invocation: Option<String>,
    message: String,
    announced: Option<String>,
    /// Where the turn started in the shared record (what a replay of it starts from).
    start: Start,
    /// Whether the shared record shows them as they are.
    written: bool,
}

/// Writes what the engine added to its in-memory record since `written` into the object state
/// (events first, then their count: a reader never sees a count ahead of the events). With a
/// shared record, the events, the thread, the checkpoint and `marks` go to its database instead,
/// committed before this returns (so before the step that follows).
async fn write(
    ctx: &ObjectContext<'_>,
    shared: Option<&SharedRecord>,
    mem: &MemoryStore,
    written: &mut Written,
    marks: &mut Marks,
) -> Result<(), Failure> {
    let a = written.additions(mem).await.map_err(record_error)?;
    if let Some(shared) = shared {
        if !a.events.is_empty() || a.checkpoint.is_some() || a.thread.is_some() || !marks.written {
            let w = crate::shared::Write::new(
                a.thread.clone().unwrap_or_else(|| written.thread.clone()),
                written.events + a.events.len() as u64,
            )
            .events(a.events.clone())
            .checkpoint(a.checkpoint.clone())
            .marks(
                marks.invocation.clone(),
                Some(marks.message.clone()),
                marks.announced.clone(),
            )
            .started(&marks.start);
            shared.write(w).await.map_err(Failure::Retry)?;
            marks.written = true;
        }
        // Nothing of it on Restate: no journal entry (see `crate::shared`).
        written.apply(&a);
        return Ok(());
    }
    for e in &a.events {
        if let Some(seq) = e.seq {
            ctx.set(&record::event_key(seq), Json(e.clone()));
        }
    }
    if !a.events.is_empty() {
        ctx.set(record::EVENTS, Json(written.events + a.events.len() as u64));
    }
    if let Some(c) = &a.checkpoint {
        ctx.set(record::CHECKPOINT_KEY, Json(c.clone()));
    }
    if let Some(t) = &a.thread {
        ctx.set(record::THREAD, Json(t.clone()));
    }
    written.apply(&a);
    Ok(())
}

/// Sends `thread` to its agent's index (a one-way call, journaled with the turn) unless the
/// index got it as it is (`indexed`): one call for a turn whose thread changes only as it opens,
/// where a call at the start and another after the engine set the provider session each queued
/// on the agent's one index object. A shared record lists the threads itself: no call.
fn index(ctx: &ObjectContext<'_>, shared: bool, thread: &Thread, indexed: &mut Option<Thread>) {
    if shared || indexed.as_ref() == Some(thread) {
        return;
    }
    ctx.object_client::<TetherThreadsClient>(thread.agent.clone())
        .add(Json(thread.clone()))
        .send();
    *indexed = Some(thread.clone());
}

/// A failure inside a step: a transient one is retried by Restate (the step runs again), any
/// other is journaled as the step's terminal failure.
fn step_error(e: Error) -> HandlerError {
    if e.is_transient() {
        HandlerError::from(e)
    } else {
        TerminalError::new(e.to_string()).into()
    }
}

/// A terminal failure of a journaled operation, as the engine sees it.
fn engine_error(e: TerminalError) -> Error {
    if e.code() == 409 {
        Error::Cancelled
    } else {
        Error::Provider {
            provider: "restate".into(),
            message: e.message().to_owned(),
        }
    }
}

fn check_request(req: &TurnRequest) -> Result<(), TerminalError> {
    let bad = |m: &str| Err(TerminalError::new_with_code(400, m));
    if req.message_id.is_empty() || req.message_id.len() > MAX_MESSAGE_ID {
        return bad("message_id must be 1 to 256 bytes");
    }
    if req.message_id.chars().any(char::is_control) {
        return bad("message_id must not hold control characters");
    }
    if req.run.len() > MAX_MESSAGE_ID || req.run.chars().any(char::is_control) {
        return bad("run must be at most 256 bytes without control characters");
    }
    if req.text.len() > MAX_TEXT {
        return bad("text is longer than 1 MiB");
    }
    if let Some(a) = &req.announced
        && (a.len() > MAX_ANNOUNCED || a.chars().any(char::is_control))
    {
        return bad("announced must be at most 2048 bytes without control characters");
    }
    // The clock stamps the thread: a time before 1970 or after 9999 is a broken sender.
    if req
        .clock
        .is_some_and(|ms| !(0..=253_402_300_799_999).contains(&ms))
    {
        return bad("clock must be milliseconds since the Unix epoch, from 1970 to 9999");
    }
    Ok(())
}

/// How many events the thread's record holds.
async fn length_of(ctx: &SharedObjectContext<'_>) -> Result<u64, HandlerError> {
    Ok(ctx
        .get::<Json<u64>>(record::EVENTS)
        .await?
        .map_or(0, Json::into_inner))
}

/// The tool uses the running turn waits for approval of (empty when none).
async fn waiting_of(ctx: &SharedObjectContext<'_>) -> Result<Vec<WaitingToolUse>, HandlerError> {
    let pending = ctx.get::<Json<PendingState>>(STATE_PENDING).await?;
    Ok(pending.map(|p| p.into_inner().tool_uses).unwrap_or_default())
}

/// How many events after a page's start a read asks for together with the record's length,
/// before it knows how many there are (see [`page_of`]).
const PAGE_GUESS: u64 = 8;

/// The events of the thread's record that `page` covers, in sequence order.
///
/// The readers run with lazy state: Restate would otherwise send the whole record with each
/// read, however little of it the read wants (a 1 MiB record made a status read ~1.8x slower).
/// Each lazy read is an exchange with Restate, so the reads are asked for together: the length
/// and the first [`PAGE_GUESS`] events after the page's start in one exchange (a front-end
/// following a turn mostly asks for a few new events), the rest of the page, if any, in one more.
async fn page_of(ctx: &SharedObjectContext<'_>, page: Page) -> Result<Vec<Event>, HandlerError> {
    let guess = page.range(page.after.saturating_add(PAGE_GUESS));
    let guess_keys: Vec<String> = guess.clone().map(record::event_key).collect();
    let (count, mut found) = futures_util::future::try_join(length_of(ctx), async {
        Ok(futures_util::future::try_join_all(guess_keys.iter().map(|k| ctx.get::<Json<Event>>(k))).await?)
    })
    .await?;
    let range = page.range(count);
    let rest_keys: Vec<String> = range
        .clone()
        .filter(|seq| !guess.contains(seq))
        .map(record::event_key)
        .collect();
    found.extend(
        futures_util::future::try_join_all(rest_keys.iter().map(|k| ctx.get::<Json<Event>>(k))).await?,
    );
    range
        .zip(found)
        .map(|(seq, e)| {
            e.map(Json::into_inner).ok_or_else(|| {
                TerminalError::new(format!("the thread's record lacks event {seq} of {count}")).into()
            })
        })
        .collect()
}

#[restate_sdk::object]
impl TetherThread {
    /// Runs one turn of the thread (the object's key is the thread id).
    #[handler]
    async fn turn(
        &self,
        ctx: ObjectContext<'_>,
        req: Json<TurnRequest>,
    ) -> Result<Json<TurnOutcome>, HandlerError> {
        let req = req.into_inner();
        let message_id = req.message_id.clone();
        let run = req.run.clone();
        let out = match self.run_turn(&ctx, req).await {
            Ok(o) => Ok(o),
            Err(Failure::Terminal(e)) => Err(e),
            // Not an end: Restate runs the invocation again from its journal.
            Err(Failure::Retry(e)) => return Err(HandlerError::from(e)),
        };
        let stored = match &self.shared {
            // The record and the marks are in the database, committed by the turn's last write
            // (a failed turn's marks are cleared here, as far as the database answers: a relay
            // that finds them asks Restate whether that invocation is over).
            Some(shared) => {
                if out.is_err() {
                    let _ = shared.turn_over(ctx.key(), ctx.invocation_id()).await;
                }
                Ok(())
            }
            None => {
                // Also after a failure: a thread whose turn failed is not left looking busy.
                ctx.clear(STATE_PENDING);
                ctx.clear(STATE_TURN);
                ctx.clear(STATE_ANNOUNCED);
                // The end is said once Restate holds every write above: Restate acknowledges a
                // step's result only once it stored it, after every entry before it. A relay
                // told the turn ended answers its client at once (which may then read the
                // record, or send its next message, through any node) without a read of its own
                // to confirm it: one step instead of one more invocation per turn (a third more
                // deltas/s under the serve bench's load). (Should it fail, the turn was cancelled
                // meanwhile: nothing is said, and relays learn of the end from Restate, as from a
                // turn on another node.)
                ctx.run(|| async { Ok::<_, HandlerError>(()) }).name("end").await
            }
        };
        if stored.is_ok()
            && let Ok(thread) = ThreadId::new(ctx.key())
        {
            self.signal(TurnSignal::Ended {
                thread,
                message_id,
                run,
                outcome: match &out {
                    Ok(o) => Ok(o.clone()),
                    Err(e) => Err((e.code(), e.message().to_owned())),
                },
            });
        }
        Ok(Json(out?))
    }

    /// Answers a tool use the running turn waits on (`{"decision":"answer","tool_use_id":…,
    /// "approved":true}`), or cancels the waiting turn (`{"decision":"cancel"}`). Refused (409)
    /// when no turn waits for that tool use.
    #[handler(lazy_state)]
    async fn approve(
        &self,
        ctx: SharedObjectContext<'_>,
        decision: Json<Decision>,
    ) -> Result<(), HandlerError> {
        let decision = decision.into_inner();
        let Some(Json(pending)) = ctx.get::<Json<PendingState>>(STATE_PENDING).await? else {
            return Err(
                TerminalError::new_with_code(409, "no turn of this thread waits for an approval").into(),
            );
        };
        if let Decision::Answer { tool_use_id, .. } = &decision
            && !pending.tool_uses.iter().any(|u| &u.id == tool_use_id)
        {
            return Err(TerminalError::new_with_code(
                409,
                "the turn does not wait for an approval of that tool use",
            )
            .into());
        }
        ctx.resolve_awakeable(&pending.awakeable, Json(decision));
        Ok(())
    }

    /// What the running turn waits for: the tool uses waiting for approval (empty when none).
    #[handler(lazy_state)]
    async fn waiting(&self, ctx: SharedObjectContext<'_>) -> Result<Json<Vec<WaitingToolUse>>, HandlerError> {
        Ok(Json(waiting_of(&ctx).await?))
    }

    /// Whether a turn of the thread is running (started, and not ended; a turn waiting for an
    /// approval runs): a front-end refuses a new message on a busy thread rather than queue it
    /// behind a turn that may never end by itself.
    #[handler(lazy_state)]
    async fn running(&self, ctx: SharedObjectContext<'_>) -> Result<bool, HandlerError> {
        Ok(self.running_turn(&ctx).await?.is_some())
    }

    /// The thread, its record's length and its running turn's invocation, read at once (see
    /// [`ThreadStatus`]).
    ///
    /// With eager state, unlike the other readers: it is read once before every turn, and a
    /// lazy read's exchange with Restate put every turn's start off (under 1,000 concurrent
    /// runs on one node, first text p99 median 1.36 s lazy against 1.10 s eager, five runs
    /// each). What it costs instead is the whole record sent with each read (a read of a 1 MiB
    /// thread ~1.8x a small one's), which the turn that follows pays anyway: it reads it all.
    #[handler]
    async fn status(&self, ctx: SharedObjectContext<'_>) -> Result<Json<ThreadStatus>, HandlerError> {
        if let Some(s) = &self.shared {
            return Ok(Json(s.status(&key_of(&ctx)?).await?));
        }
        let (thread, length, invocation, message, announced) = futures_util::future::try_join5(
            ctx.get::<Json<Thread>>(record::THREAD),
            ctx.get::<Json<u64>>(record::EVENTS),
            ctx.get::<String>(STATE_TURN),
            ctx.get::<String>(STATE_MESSAGE),
            ctx.get::<String>(STATE_ANNOUNCED),
        )
        .await?;
        Ok(Json(ThreadStatus {
            thread: thread.map(Json::into_inner),
            length: length.map_or(0, Json::into_inner),
            invocation,
            message,
            announced,
        }))
    }

    /// The thread (`null` before its first turn).
    #[handler(lazy_state)]
    async fn thread(&self, ctx: SharedObjectContext<'_>) -> Result<Json<Option<Thread>>, HandlerError> {
        if let Some(s) = &self.shared {
            return Ok(Json(s.thread(&key_of(&ctx)?).await?));
        }
        Ok(Json(
            ctx.get::<Json<Thread>>(record::THREAD)
                .await?
                .map(Json::into_inner),
        ))
    }

    /// A page of the thread's record: the events after `after`, at most `limit` (at most
    /// [`record::MAX_PAGE`]), in sequence order. A running turn's events are there as soon as
    /// the turn asks for its next step.
    #[handler(lazy_state)]
    async fn events(
        &self,
        ctx: SharedObjectContext<'_>,
        page: Json<Page>,
    ) -> Result<Json<Vec<Event>>, HandlerError> {
        Ok(Json(self.page(&ctx, page.into_inner()).await?))
    }

    /// What the running turn waits for and a page of the record, read at once (see
    /// [`Progress`]).
    #[handler(lazy_state)]
    async fn progress(
        &self,
        ctx: SharedObjectContext<'_>,
        page: Json<Page>,
    ) -> Result<Json<Progress>, HandlerError> {
        let (waiting, events) =
            futures_util::future::try_join(waiting_of(&ctx), self.page(&ctx, page.into_inner())).await?;
        Ok(Json(Progress { waiting, events }))
    }

    /// How many events the thread's record holds.
    #[handler(lazy_state)]
    async fn length(&self, ctx: SharedObjectContext<'_>) -> Result<Json<u64>, HandlerError> {
        if let Some(s) = &self.shared {
            return Ok(Json(s.status(&key_of(&ctx)?).await?.length));
        }
        Ok(Json(length_of(&ctx).await?))
    }

    /// The invocation id of the running turn (`null` when none): a front-end on any node waits
    /// for its end with Restate's attach.
    #[handler(lazy_state)]
    async fn invocation(&self, ctx: SharedObjectContext<'_>) -> Result<Json<Option<String>>, HandlerError> {
        Ok(Json(self.running_turn(&ctx).await?))
    }

    /// The thread's checkpoint (`null` when none).
    #[handler(lazy_state)]
    async fn checkpoint(&self, ctx: SharedObjectContext<'_>) -> Result<Json<Value>, HandlerError> {
        if let Some(s) = &self.shared {
            return Ok(Json(s.checkpoint(ctx.key()).await?.unwrap_or(Value::Null)));
        }
        Ok(Json(
            ctx.get::<Json<Value>>(record::CHECKPOINT_KEY)
                .await?
                .map_or(Value::Null, Json::into_inner),
        ))
    }

    /// Cancels the running turn, if any: the step in flight is abandoned, and the turn records
    /// error results for what it did not run. Returns whether a turn was running.
    #[handler(lazy_state)]
    async fn cancel(&self, ctx: SharedObjectContext<'_>) -> Result<bool, HandlerError> {
        match self.running_turn(&ctx).await? {
            Some(id) => {
                ctx.invocation_handle(id).cancel();
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

/// The object's key as a thread id (every key a turn ran under is one).
fn key_of(ctx: &SharedObjectContext<'_>) -> Result<ThreadId, HandlerError> {
    ThreadId::new(ctx.key()).map_err(|e| TerminalError::new_with_code(400, e.to_string()).into())
}

impl TetherThread {
    /// The running turn's invocation id, from the object state or the shared record's marks.
    async fn running_turn(&self, ctx: &SharedObjectContext<'_>) -> Result<Option<String>, HandlerError> {
        match &self.shared {
            Some(s) => Ok(s.status(&key_of(ctx)?).await?.invocation),
            None => Ok(ctx.get::<String>(STATE_TURN).await?),
        }
    }

    /// A page of the record, from the object state or the shared record.
    async fn page(&self, ctx: &SharedObjectContext<'_>, page: Page) -> Result<Vec<Event>, HandlerError> {
        match &self.shared {
            Some(s) => Ok(s.events_after(ctx.key(), page.after, page.limit()).await?),
            None => page_of(ctx, page).await,
        }
    }

    /// The body of `turn`: every failure is terminal (journaled), so the [`TurnSignal::Ended`]
    /// sent for it is final, but a shared record's database not answering, which Restate retries
    /// (the invocation runs again from its journal).
    async fn run_turn(&self, ctx: &ObjectContext<'_>, req: TurnRequest) -> Result<TurnOutcome, Failure> {
        let thread =
            ThreadId::new(ctx.key()).map_err(|e| TerminalError::new_with_code(400, e.to_string()))?;
        check_request(&req)?;
        if let Some(f) = &self.on_attempt {
            f(Attempt::new(thread.clone(), req.announced.clone()).invocation(ctx.invocation_id())).await;
        }
        // With a shared record the marks are its thread row's, written with the turn's first
        // write (see `Marks`), not three more entries of the journal.
        if self.shared.is_none() {
            ctx.set(STATE_TURN, ctx.invocation_id().to_owned());
            // Both from the request: the same on every replay. Shown by `status` from the turn's
            // first step on (a handler's writes reach Restate with its next step).
            ctx.set(STATE_MESSAGE, req.message_id.clone());
            match &req.announced {
                Some(at) => ctx.set(STATE_ANNOUNCED, at.clone()),
                None => ctx.clear(STATE_ANNOUNCED),
            }
        }

        let shared = self.shared.as_ref();
        let (snapshot, mut written, start) = self.load(ctx, &thread, &req).await?;
        let mut marks = Marks {
            invocation: Some(ctx.invocation_id().to_owned()),
            message: req.message_id.clone(),
            announced: req.announced.clone(),
            start,
            written: false,
        };
        // The thread as the agent's index (`TetherThreads`) last got it: sent before the turn's
        // first step (a first turn that waits for approval is listed already), with its provider
        // session once the engine opened it, and again only when it changed.
        let mut indexed: Option<Thread> = None;
        let mem = record::seed(&snapshot).await.map_err(record_error)?;
        let (steps, mut rx) = StepClient::channel();
        let engine = self.run_engine(&snapshot, &mem, &thread, req, steps);
        tokio::pin!(engine);
        let outcome = loop {
            tokio::select! {
                out = &mut engine => break out,
                Some(step) = rx.recv() => {
                    // The engine waits for this step: what it recorded so far is written first,
                    // so the record is readable before the step runs (or the turn suspends).
                    write(ctx, shared, &mem, &mut written, &mut marks).await?;
                    index(ctx, shared.is_some(), &written.thread, &mut indexed);
                    self.serve_step(ctx, step).await;
                }
            }
        };
        // Also after a failure: what the turn did is recorded (and, in a shared record, that it
        // no longer runs).
        marks.invocation = None;
        marks.announced = None;
        marks.written = false;
        write(ctx, shared, &mem, &mut written, &mut marks).await?;
        index(ctx, shared.is_some(), &written.thread, &mut indexed);
        let added = written.events.saturating_sub(snapshot.events.len() as u64);
        match outcome {
            Ok(mut o) => {
                o.events_added = added as usize;
                o.length = written.events;
                Ok(o)
            }
            Err(Error::Cancelled) => Err(TerminalError::new_with_code(409, "the turn was cancelled").into()),
            Err(e) => Err(TerminalError::new_with_code(500, e.to_string()).into()),
        }
    }

    /// Reads the thread's record from the object state (journaled reads: a replay starts from the
    /// same record) or, with a shared record, from where [`SharedRecord::turn_start`] says the
    /// turn starts; or imports it from the legacy store when there is none, and claims the thread
    /// for this agent, stamped with the turn's clock. Returns the record, what of it is written
    /// already, and the turn's start in the shared record (a default one without).
    async fn load(
        &self,
        ctx: &ObjectContext<'_>,
        thread: &ThreadId,
        req: &TurnRequest,
    ) -> Result<(Snapshot, Written, Start), Failure> {
        // With a shared record the thread is the database's alone: where this turn starts in it
        // (the same on every replay), read without a journal entry.
        let (found, start) = match &self.shared {
            Some(shared) => {
                let start = shared
                    .turn_start(thread, ctx.invocation_id())
                    .await
                    .map_err(Failure::Retry)?;
                (start.thread.clone(), start)
            }
            None => (
                ctx.get::<Json<Thread>>(record::THREAD)
                    .await?
                    .map(Json::into_inner),
                Start::default(),
            ),
        };
        let (now, stored, events, checkpoint, in_state) = match found {
            Some(t) => {
                let now = match req.clock {
                    Some(at) => at,
                    None => ctx
                        .run(|| async { Ok::<_, HandlerError>(Json(now_ms())) })
                        .name("clock")
                        .await?
                        .into_inner(),
                };
                let (events, checkpoint) =
                    read_record(ctx, self.shared.as_ref().map(|s| (s, &start))).await?;
                let n = events.len() as u64;
                (now, Some(t), events, checkpoint.clone(), (n, checkpoint))
            }
            None => {
                // Told the time and that there is nothing to import: no step.
                let read = match (req.clock, req.import) {
                    (Some(at), Some(false)) => (at, None),
                    _ => self.clock_and_import(ctx, thread).await?,
                };
                match read {
                    (now, Some(s)) => {
                        // The record key on Restate is the thread id.
                        let mut t = s.thread;
                        t.record = thread.as_str().to_owned();
                        (now, Some(t), s.events, s.checkpoint, (0, None))
                    }
                    (now, None) => (now, None, Vec::new(), None, (0, None)),
                }
            }
        };
        let title: String = req.text.chars().take(80).collect();
        let t = match stored {
            Some(t) if t.agent != self.agent => {
                return Err(TerminalError::new(
                    Error::ThreadTaken {
                        thread: t.id.to_string(),
                        agent: t.agent,
                    }
                    .to_string(),
                )
                .into());
            }
            Some(mut t) => {
                if t.title.is_empty() {
                    t.title = title;
                }
                t.with_updated_ms(now)
            }
            // The record key is the thread id: the record is this object's state.
            None => Thread::new(thread.clone(), self.agent.clone(), thread.as_str(), now).with_title(title),
        };
        // A shared record gets the thread with the turn's first write.
        if self.shared.is_none() {
            ctx.set(record::THREAD, Json(t.clone()));
        }
        let written = Written {
            thread: t.clone(),
            events: in_state.0,
            checkpoint: in_state.1,
        };
        Ok((
            Snapshot {
                thread: t,
                events,
                checkpoint,
            },
            written,
            start,
        ))
    }

    /// The turn's clock and, for a thread with no record on Restate, its record in the legacy
    /// store (if there is one and it holds the thread), read in one journaled step: the import
    /// happens once, and the turn waits for Restate to store one step's result instead of two.
    async fn clock_and_import(
        &self,
        ctx: &ObjectContext<'_>,
        thread: &ThreadId,
    ) -> Result<(i64, Option<Snapshot>), TerminalError> {
        let store = self.import.clone();
        let id = thread.clone();
        let Json(read) = ctx
            .run(|| async move {
                let snapshot = match store {
                    Some(store) => record::import(store.as_ref(), &id).await.map_err(step_error)?,
                    None => None,
                };
                Ok::<_, HandlerError>(Json((now_ms(), snapshot)))
            })
            .name("clock and import")
            .await?;
        Ok(read)
    }

    /// Serves one step the engine asked for, inside the invocation's journal.
    async fn serve_step(&self, ctx: &ObjectContext<'_>, step: Step) {
        match step {
            Step::Model {
                request,
                deltas,
                reply,
            } => {
                let model = self.model.clone();
                let r = ctx
                    .run(|| async move { model.chat(&request, &deltas).await.map(Json).map_err(step_error) })
                    .name("model")
                    .await;
                let _ = reply.send(r.map(Json::into_inner).map_err(engine_error));
            }
            Step::Tool { call, info, reply } => {
                let handler = self.handler.clone();
                let name = format!("tool {}", call.name.chars().take(64).collect::<String>());
                let r =
                    ctx.run(|| async move {
                        Ok(Json(JournaledOutput::from(handler.call_tool(&call, &info).await)))
                    })
                    .name(name)
                    .await;
                let out = match r {
                    Ok(Json(o)) => o.into(),
                    Err(e) => tether::ToolOutput::Error(format!("the tool step failed: {}", e.message())),
                };
                let _ = reply.send(out);
            }
            Step::Approval { pending, reply } => {
                let tool_uses = pending
                    .iter()
                    .filter_map(|p| match &p.waiting {
                        Waiting::Approval { summary } => Some(WaitingToolUse {
                            id: p.tool_use.id.clone(),
                            name: p.tool_use.name.clone(),
                            summary: summary.clone(),
                            input: p.tool_use.input.clone(),
                        }),
                        _ => None,
                    })
                    .collect::<Vec<_>>();
                let (awakeable, decision) = ctx.awakeable::<Json<Decision>>();
                ctx.set(
                    STATE_PENDING,
                    Json(PendingState {
                        awakeable,
                        tool_uses: tool_uses.clone(),
                    }),
                );
                if let Ok(thread) = ThreadId::new(ctx.key()) {
                    self.signal(TurnSignal::Waiting { thread, tool_uses });
                }
                let d = decision.await;
                ctx.clear(STATE_PENDING);
                let _ = reply.send(d.map(Json::into_inner).map_err(engine_error));
            }
        }
    }

    /// Runs the turn's engine against `mem`, the in-memory copy of the snapshot; returns the
    /// outcome (what the turn recorded is in `mem`, also after a failure).
    async fn run_engine(
        &self,
        snapshot: &Snapshot,
        mem: &Arc<MemoryStore>,
        thread: &ThreadId,
        req: TurnRequest,
        steps: StepClient,
    ) -> tether::Result<TurnOutcome> {
        let model: Arc<dyn ChatModel> = Arc::new(StepModel::new(self.model.clone(), steps.clone()));
        // One attempt per model step: a transient failure is retried by Restate inside the step.
        let mut provider = LocalLoop::with_model(model)
            .session_id(snapshot.thread.record.clone())
            .retry(RetryPolicy::none());
        if let Some(p) = &self.system_prompt {
            provider = provider.system_prompt(p.clone());
        }
        if let Some(m) = &self.model_name {
            provider = provider.model_name(m.clone());
        }
        // One tool step at a time: the journal's order must be the engine's on every replay.
        let config = SessionConfig::default().with_tool_concurrency(1);
        let handler: Arc<dyn Handler> = Arc::new(StepHandler::new(self.handler.clone(), steps.clone()));
        let mut builder = Session::builder(provider)
            .handler_arc(handler)
            .config(config)
            .thread(mem.clone(), thread.clone(), self.agent.clone())
            .title(req.text.chars().take(80).collect::<String>());
        if let Some(tx) = &self.live {
            self.drafts.forget_thread(thread);
            builder = builder.observer(Arc::new(LiveObserver {
                thread: thread.clone(),
                tx: tx.clone(),
                drafts: self.drafts.clone(),
            }));
        }
        let mut session = builder.open().await?;
        let mut o = drive(&mut session, &steps, req).await?;
        o.record = snapshot.thread.record.clone();
        Ok(o)
    }
}

/// Goes on with what the record left unfinished, sends the message, then answers approvals as
/// they come until the turn ends.
///
/// A thread whose last turn failed after a tool ran (the model failing on the tool's result)
/// opens paused on that batch: it is resumed first (the recorded result is taken from the memo,
/// the tool is not run again), as the default backend does, and the message (known to the
/// record when a client sends it again) is sent after. A new message answers what the record
/// still waits on as not answered.
async fn drive(session: &mut Session, steps: &StepClient, req: TurnRequest) -> tether::Result<TurnOutcome> {
    if !session.knows_message(&req.message_id).await {
        for p in session.pending() {
            session
                .answer_tool_use(ToolResult::error(
                    &p.tool_use.id,
                    "not answered: the user sent a new message instead",
                ))
                .await?;
        }
    }
    let mut earlier = None;
    if session.is_paused() {
        earlier = Some(session.resume(CancellationToken::new()).await?);
    }
    let mut result = match earlier {
        Some(r) if !session.pending().is_empty() => r,
        earlier => {
            let r = session
                .send_messages(
                    vec![UserMessage::with_id(req.message_id, req.text)],
                    CancellationToken::new(),
                )
                .await?;
            match earlier {
                // The message was known: the resumed request is this turn's answer.
                Some(e) if r.stop_reason == StopReason::Idle => e,
                _ => r,
            }
        }
    };
    let mut answered: Vec<String> = Vec::new();
    loop {
        let waiting: Vec<_> = session
            .pending()
            .into_iter()
            .filter(|p| matches!(p.waiting, Waiting::Approval { .. }) && !answered.contains(&p.tool_use.id))
            .collect();
        if waiting.is_empty() {
            if answered.is_empty() {
                break;
            }
            answered.clear();
            result = session.resume(CancellationToken::new()).await?;
            continue;
        }
        match steps.approval(waiting).await {
            Ok(Decision::Answer {
                tool_use_id,
                approved,
            }) => {
                if approved {
                    session.approve(&tool_use_id).await;
                } else {
                    session
                        .answer_tool_use(ToolResult::error(&tool_use_id, "the user denied this tool call"))
                        .await?;
                }
                answered.push(tool_use_id);
            }
            Ok(Decision::Cancel) | Err(Error::Cancelled) => {
                session
                    .abandon_pending_tools("cancelled: the turn was cancelled while it waited for approval")
                    .await?;
                return Err(Error::Cancelled);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(TurnOutcome {
        record: String::new(),
        text: result.text,
        stop_reason: result.stop_reason.to_value(),
        tool_uses: result.tool_uses.into_iter().map(|u| u.id).collect(),
        pending: result.pending_tool_uses.into_iter().map(|u| u.id).collect(),
        events_added: 0,
        length: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_parse_strictly() {
        let d: Decision = serde_json::from_value(
            serde_json::json!({"decision": "answer", "tool_use_id": "c", "approved": true}),
        )
        .expect("an answer");
        assert_eq!(
            d,
            Decision::Answer {
                tool_use_id: "c".into(),
                approved: true
            }
        );
        for bad in [
            serde_json::json!({"decision": "answer", "tool_use_id": "c", "approved": "yes"}),
            serde_json::json!({"decision": "answer", "tool_use_id": "c"}),
            serde_json::json!({"decision": "approve_all"}),
            serde_json::json!({"tool_use_id": "c", "approved": true}),
        ] {
            assert!(serde_json::from_value::<Decision>(bad.clone()).is_err(), "{bad}");
        }
    }

    /// Where the sender says the turn runs is bounded like every other field a caller of the
    /// ingress sets: at most `MAX_ANNOUNCED` bytes, no control characters.
    #[test]
    fn an_announcement_is_bounded() {
        let with = |a: Option<String>| check_request(&TurnRequest::new("m1", "hi").announced(a));
        assert!(with(None).is_ok());
        assert!(with(Some("http://10.0.0.1:8787".into())).is_ok());
        assert!(with(Some("x".repeat(MAX_ANNOUNCED))).is_ok());
        let long = with(Some("x".repeat(MAX_ANNOUNCED + 1))).expect_err("too long");
        assert_eq!(long.code(), 400);
        assert!(with(Some("http://a\n:1".into())).is_err());
        assert!(with(Some("http://a\u{1b}[31m".into())).is_err());
    }

    proptest::proptest! {
        /// A turn request is accepted exactly when its message id is 1 to 256 bytes without
        /// control characters and its text at most 1 MiB; nothing panics.
        #[test]
        fn turn_requests_are_checked(id in "\\PC{0,300}|[\\x00-\\x1f]{1,3}", len in 0usize..4) {
            let text = "x".repeat([0, 10, MAX_TEXT, MAX_TEXT + 1][len]);
            let ok = check_request(&TurnRequest::new(id.clone(), text.clone())).is_ok();
            let valid = !id.is_empty() && id.len() <= MAX_MESSAGE_ID && !id.chars().any(char::is_control)
                && text.len() <= MAX_TEXT;
            proptest::prop_assert_eq!(ok, valid);
        }

        /// A sender's clock is accepted exactly when it is a time from 1970 to 9999.
        #[test]
        fn a_clock_is_checked(ms in proptest::prop_oneof![proptest::num::i64::ANY, 0i64..=253_402_300_799_999]) {
            let ok = check_request(&TurnRequest::new("m", "t").clock(ms)).is_ok();
            proptest::prop_assert_eq!(ok, (0..=253_402_300_799_999).contains(&ms));
        }
    }
}
