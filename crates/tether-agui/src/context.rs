//! [`RunContext`]: what an agent writes a run through, and its RAII handles.
//!
//! Opening a handle emits its START; dropping it emits its END. Every opener takes
//! `&mut self`, and a handle keeps the context's event sink and state borrowed until it drops,
//! so two messages, tool calls or reasoning blocks cannot be open at the same time by accident:
//!
//! ```compile_fail,E0499
//! # use tether_agui::{RunContext, Result};
//! # fn f(ctx: &mut RunContext) -> Result<()> {
//! let mut first = ctx.message()?;
//! let second = ctx.message()?; // error: `*ctx` is already borrowed by `first`
//! first.delta("hi")?;
//! # drop(second); Ok(()) }
//! ```
//!
//! ```compile_fail,E0499
//! # use tether_agui::{RunContext, Result};
//! # fn f(ctx: &mut RunContext) -> Result<()> {
//! let mut call = ctx.tool_call("search")?;
//! let mut text = ctx.message()?; // error: a tool call is open
//! call.args("{}")?;
//! # text.delta("x")?; Ok(()) }
//! ```
//!
//! ```compile_fail,E0499
//! # use tether_agui::{RunContext, Result};
//! # fn f(ctx: &mut RunContext) -> Result<()> {
//! let mut thinking = ctx.reasoning()?;
//! let call = ctx.tool_call("search")?; // error: reasoning is open
//! thinking.delta("hmm")?;
//! # drop(call); Ok(()) }
//! ```
//!
//! Provider-style interleaved parallel tool calls, which the borrow rules above forbid, have
//! their own typed API: [`RunContext::parallel_tool_calls`].

use std::collections::HashMap;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::error::{Error, Result};
use crate::event::{EncryptedValueSubtype, Event, TextMessageRole};
use crate::ids::{MessageId, RunId, ThreadId, ToolCallId};
use crate::patch;
use crate::types::{
    Content, Context, Interrupt, ResumeEntry, RunAgentInput, RunFinishedOutcome, TokenUsage, Tool,
};
use crate::verify::Verifier;

/// A typed run state: `Serialize + DeserializeOwned + Default`. `()` is stateless.
pub trait AgentState: Serialize + DeserializeOwned + Default + Send + 'static {}
impl<T: Serialize + DeserializeOwned + Default + Send + 'static> AgentState for T {}

/// How the agent ended its run.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum RunOutcome {
    /// Success. Calls ended without a result are listed as `pendingToolCallIds` automatically.
    Success,
    /// Suspended: `RUN_FINISHED{outcome: interrupt}`; the next request's `resume[]` answers.
    Interrupt(Vec<Interrupt>),
    /// Cancelled: `RUN_FINISHED{outcome: cancelled}`.
    Cancelled,
}

impl RunOutcome {
    /// An interrupt outcome.
    pub fn interrupt(interrupts: Vec<Interrupt>) -> Self {
        RunOutcome::Interrupt(interrupts)
    }
}

// ---------------------------------------------------------------------------------------------
// Cancellation

/// The cancellation signal shared by a run and its transport: tether's one token,
/// [`tether::CancellationToken`] (tokio-util's), under the name this crate's API has used. A run
/// cancelled here is cancelled for the session driving it too, with no bridge between two kinds
/// of token; new code can name it `tether::CancellationToken`.
pub type CancelToken = tether::CancellationToken;

// ---------------------------------------------------------------------------------------------
// The sink

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dead {
    Violation,
    BufferFull,
    Closed,
}

/// Where events go: the verifier, then the bounded channel to the transport.
pub(crate) struct Sink {
    verifier: Verifier,
    tx: mpsc::Sender<Box<Event>>,
    capacity: usize,
    cancel: CancelToken,
    dead: Option<Dead>,
    timestamps: bool,
    /// The assistant message the current model turn's tool calls attach to.
    turn_message: Option<MessageId>,
}

impl fmt::Debug for Sink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sink")
            .field("capacity", &self.capacity)
            .field("dead", &self.dead)
            .finish_non_exhaustive()
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Sink {
    fn check_alive(&self) -> Result<()> {
        match self.dead {
            Some(Dead::Violation) => Err(Error::RunEnded),
            Some(Dead::BufferFull) => Err(Error::BufferFull {
                capacity: self.capacity,
            }),
            Some(Dead::Closed) => Err(Error::Cancelled),
            None if self.cancel.is_cancelled() || self.tx.is_closed() => Err(Error::Cancelled),
            None => Ok(()),
        }
    }

    /// Verifies and queues one event. A violation queues one `RUN_ERROR` instead and kills
    /// the run.
    pub(crate) fn emit(&mut self, mut event: Event) -> Result<()> {
        self.check_alive()?;
        if self.timestamps && event.timestamp().is_none() {
            event.set_timestamp(now_ms());
        }
        if let Err(v) = self.verifier.observe(&event) {
            tracing::warn!(code = v.code(), "AG-UI stream violation: {}", v.detail);
            let err = Event::run_error(v.detail.clone(), Some(v.code().to_owned()));
            if self.verifier.observe(&err).is_ok() {
                let _ = self.tx.try_send(Box::new(err));
            }
            self.dead = Some(Dead::Violation);
            return Err(Error::Verification(v));
        }
        match &event {
            Event::TextMessageStart(e)
                if e.subagent_run_id.is_none()
                    && matches!(e.role, None | Some(TextMessageRole::Assistant)) =>
            {
                self.turn_message = Some(e.message_id.clone());
            }
            Event::ToolCallResult(_) | Event::RunStarted(_) => self.turn_message = None,
            _ => {}
        }
        match self.tx.try_send(Box::new(event)) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.dead = Some(Dead::BufferFull);
                Err(Error::BufferFull {
                    capacity: self.capacity,
                })
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.dead = Some(Dead::Closed);
                self.cancel.cancel();
                Err(Error::Cancelled)
            }
        }
    }

    /// Sends a terminal event, waiting for buffer space.
    async fn emit_final(&mut self, mut event: Event) {
        if matches!(self.dead, Some(Dead::Closed | Dead::Violation)) {
            return;
        }
        if self.timestamps && event.timestamp().is_none() {
            event.set_timestamp(now_ms());
        }
        if let Err(v) = self.verifier.observe(&event) {
            tracing::warn!(code = v.code(), "AG-UI stream violation: {}", v.detail);
            event = Event::run_error(v.detail.clone(), Some(v.code().to_owned()));
            if self.verifier.observe(&event).is_err() {
                return;
            }
        }
        let _ = self.tx.send(Box::new(event)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// State

/// Typed state plus what the client last saw of it (as the compact JSON last published).
pub(crate) struct StateManager<S> {
    value: S,
    published: Option<Vec<u8>>,
}

struct CountingWriter {
    n: usize,
    limit: usize,
}

impl std::io::Write for CountingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.n += buf.len();
        if self.n > self.limit {
            return Err(std::io::Error::other("limit"));
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Whether `value` serializes to more than `limit` bytes (stops counting past the limit).
fn serialized_len_exceeds(value: &Value, limit: usize) -> bool {
    let mut w = CountingWriter { n: 0, limit };
    serde_json::to_writer(&mut w, value).is_err()
}

/// The event that brings a client holding `old` (or nothing) to `new`: a snapshot first, a
/// JSON-Patch delta when it is smaller than the snapshot, nothing when unchanged.
pub fn state_update(old: Option<&Value>, new: &Value) -> Result<Option<Event>> {
    let Some(old) = old else {
        return Ok(Some(Event::state_snapshot(new.clone())));
    };
    let ops = patch::diff(old, new);
    if ops.is_empty() {
        return Ok(None);
    }
    let patch_len = serde_json::to_vec(&ops)?.len();
    if serialized_len_exceeds(new, patch_len) {
        Ok(Some(Event::state_delta(ops)))
    } else {
        Ok(Some(Event::state_snapshot(new.clone())))
    }
}

/// [`state_update`] over serialized states (`serde_json::to_vec` output), as the run's
/// typed state is published.
///
/// Two serializations of one state usually differ in a short stretch: the smallest value
/// covering it becomes a single `replace` without building either tree. Otherwise both
/// documents are parsed and diffed as trees.
pub fn state_update_json(old: Option<&[u8]>, new: &[u8]) -> Result<Option<Event>> {
    let Some(old) = old else {
        return Ok(Some(Event::state_snapshot(serde_json::from_slice(new)?)));
    };
    if old == new {
        return Ok(None);
    }
    // A replacement up to 1/8 of the document is taken as it is; beyond that a tree diff may
    // find a much smaller patch (an append to a long list, say).
    if let Some(ops) = crate::bytediff::replace_patch(old, new, (new.len() / 8).max(256)) {
        let patch_len = serde_json::to_vec(&ops)?.len();
        if patch_len < new.len() {
            return Ok(Some(Event::state_delta(ops)));
        }
    }
    let old: Value = serde_json::from_slice(old)?;
    let new: Value = serde_json::from_slice(new)?;
    state_update(Some(&old), &new)
}

impl<S: AgentState> StateManager<S> {
    fn publish(&mut self, sink: &mut Sink) -> Result<()> {
        let new = serde_json::to_vec(&self.value)?;
        if let Some(event) = state_update_json(self.published.as_deref(), &new)? {
            sink.emit(event)?;
        }
        self.published = Some(new);
        Ok(())
    }
}

macro_rules! state_trio {
    () => {
        /// The typed state, as left by the last change.
        pub fn state(&self) -> &S {
            &self.state.value
        }

        /// The typed state, mutably. Nothing is emitted until [`Self::publish_state`].
        pub fn state_mut(&mut self) -> &mut S {
            &mut self.state.value
        }

        /// Publishes the state: `STATE_SNAPSHOT` the first time, then a JSON-Patch
        /// `STATE_DELTA` when that is smaller than a snapshot, nothing when unchanged.
        pub fn publish_state(&mut self) -> Result<()> {
            self.state.publish(self.sink)
        }
    };
}

// ---------------------------------------------------------------------------------------------
// RunContext

/// Options of one run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Capacity of the event buffer between the agent and the transport (default 16384).
    /// An agent that outruns it without awaiting [`RunContext::ready`] ends with
    /// `RUN_ERROR{code: "EVENT_BUFFER_FULL"}`.
    pub buffer: usize,
    /// Stamp every event with `timestamp` (ms since epoch).
    pub timestamps: bool,
    /// Echo the input on `RUN_STARTED.input`.
    pub echo_input: bool,
    /// The runtime each run's task is spawned on (`None`: the current one).
    ///
    /// A server can keep its connections on one runtime and the runs' work on another: a burst
    /// of new requests is then not queued behind the tasks of runs already streaming, so the
    /// first event of a new run goes out in the time it takes to read its request.
    pub runtime: Option<tokio::runtime::Handle>,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            buffer: 16 * 1024,
            timestamps: false,
            echo_input: false,
            runtime: None,
        }
    }
}

/// One run (or a sequence of runs) of an agent, as seen by the agent.
pub struct RunContext<S = ()> {
    input: Arc<RunAgentInput>,
    sink: Sink,
    state: StateManager<S>,
    run_id: RunId,
    counter: u64,
    usage: Vec<TokenUsage>,
    result: Option<Value>,
    state_error: Option<serde_json::Error>,
}

impl<S> fmt::Debug for RunContext<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunContext")
            .field("thread_id", &self.input.thread_id)
            .field("run_id", &self.run_id)
            .finish_non_exhaustive()
    }
}

/// The receiving end of a context's events (from [`RunContext::new`]).
///
/// The queue holds boxed events: a tokio channel allocates its slots 32 at a time, and 32
/// pointers (256 bytes) rather than 32 events (7 KiB) per block is what every concurrent run
/// saves, at one small allocation per event.
#[derive(Debug)]
pub struct EventReceiver {
    rx: mpsc::Receiver<Box<Event>>,
}

impl EventReceiver {
    pub(crate) fn channel(capacity: usize) -> (mpsc::Sender<Box<Event>>, Self) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (tx, EventReceiver { rx })
    }

    /// The next event; `None` once the context is dropped and every event was received.
    pub async fn recv(&mut self) -> Option<Event> {
        self.rx.recv().await.map(|b| *b)
    }

    /// The next event if one is ready now.
    pub fn try_recv(&mut self) -> Option<Event> {
        self.rx.try_recv().ok().map(|b| *b)
    }

    /// Polls for the next event.
    pub fn poll_recv(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Event>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| *b))
    }
}

impl<S: AgentState> RunContext<S> {
    /// A context for `input` and the channel its events arrive on. Nothing is emitted yet;
    /// [`crate::run_agent`] emits `RUN_STARTED` and the terminal event around the agent.
    pub fn new(input: RunAgentInput, options: &RunOptions) -> (Self, EventReceiver) {
        let (tx, rx) = EventReceiver::channel(options.buffer);
        let ctx = Self::with_sender(Arc::new(input), tx, CancelToken::new(), options);
        (ctx, rx)
    }

    pub(crate) fn with_sender(
        input: Arc<RunAgentInput>,
        tx: mpsc::Sender<Box<Event>>,
        cancel: CancelToken,
        options: &RunOptions,
    ) -> Self {
        let (value, state_error) = match &input.state {
            None => (S::default(), None),
            Some(Value::Object(m)) if m.is_empty() => (
                serde_json::from_value(Value::Object(m.clone())).unwrap_or_default(),
                None,
            ),
            Some(v) => match serde_json::from_value(v.clone()) {
                Ok(s) => (s, None),
                Err(e) => (S::default(), Some(e)),
            },
        };
        Self {
            sink: Sink {
                verifier: Verifier::for_input(&input),
                tx,
                capacity: options.buffer.max(1),
                cancel,
                dead: None,
                timestamps: options.timestamps,
                turn_message: None,
            },
            state: StateManager {
                value,
                published: None,
            },
            run_id: input.run_id.clone(),
            input,
            counter: 0,
            usage: Vec::new(),
            result: None,
            state_error,
        }
    }

    // ----- input accessors -----

    /// The request.
    pub fn input(&self) -> &RunAgentInput {
        &self.input
    }

    /// The thread id.
    pub fn thread_id(&self) -> &ThreadId {
        &self.input.thread_id
    }

    /// The current run's id (the input's, or the one given to [`Self::next_run`]).
    pub fn run_id(&self) -> &RunId {
        &self.run_id
    }

    /// The conversation so far.
    pub fn messages(&self) -> &[crate::types::Message] {
        &self.input.messages
    }

    /// The text of the last user message.
    pub fn last_user_text(&self) -> Option<String> {
        self.input.last_user_text()
    }

    /// The front-end tools.
    pub fn tools(&self) -> &[Tool] {
        &self.input.tools
    }

    /// Whether `name` is a front-end tool (the client executes it).
    pub fn is_frontend_tool(&self, name: &str) -> bool {
        self.input.tool(name).is_some()
    }

    /// The context entries.
    pub fn context(&self) -> &[Context] {
        &self.input.context
    }

    /// `forwardedProps`.
    pub fn forwarded_props(&self) -> Option<&Value> {
        self.input.forwarded_props.as_ref()
    }

    /// The answers to the previous run's interrupts.
    pub fn resume(&self) -> &[ResumeEntry] {
        &self.input.resume
    }

    /// The answer to interrupt `id`.
    pub fn resume_for(&self, id: &str) -> Option<&ResumeEntry> {
        self.input.resume.iter().find(|r| r.interrupt_id == *id)
    }

    /// Whether this request resumes interrupts.
    pub fn is_resume(&self) -> bool {
        !self.input.resume.is_empty()
    }

    // ----- cancellation -----

    /// The run's cancellation token (tripped when the client disconnects).
    pub fn cancel_token(&self) -> &CancelToken {
        &self.sink.cancel
    }

    /// Whether the run was cancelled or its client went away.
    pub fn is_cancelled(&self) -> bool {
        self.sink.cancel.is_cancelled() || self.sink.tx.is_closed()
    }

    /// Waits until the transport has room for at least one more event (backpressure for
    /// agents that produce events faster than the client reads them).
    pub async fn ready(&self) -> Result<()> {
        match self.sink.tx.reserve().await {
            Ok(_permit) => Ok(()),
            Err(_) => Err(Error::Cancelled),
        }
    }

    // ----- state -----

    /// The typed state.
    pub fn state(&self) -> &S {
        &self.state.value
    }

    /// The typed state, mutably. Nothing is emitted until [`Self::publish_state`].
    pub fn state_mut(&mut self) -> &mut S {
        &mut self.state.value
    }

    /// Replaces the state (not yet published).
    pub fn set_state(&mut self, state: S) {
        self.state.value = state;
    }

    /// Publishes the state: `STATE_SNAPSHOT` the first time, then a JSON-Patch `STATE_DELTA`
    /// when the patch is smaller than the snapshot, nothing when unchanged.
    pub fn publish_state(&mut self) -> Result<()> {
        self.state.publish(&mut self.sink)
    }

    // ----- run bookkeeping -----

    /// Adds token usage, reported on `RUN_FINISHED.usage` (or `RUN_ERROR.usage`).
    pub fn add_usage(&mut self, usage: TokenUsage) {
        self.usage.push(usage);
    }

    /// Sets `RUN_FINISHED.result`.
    pub fn set_result(&mut self, result: Value) {
        self.result = Some(result);
    }

    /// Calls of the current run ended without a result so far.
    pub fn pending_tool_calls(&self) -> Vec<ToolCallId> {
        self.sink.verifier.pending_tool_calls()
    }

    /// A fresh message id, `"{runId}-msg-N"`.
    pub fn new_message_id(&mut self) -> MessageId {
        self.counter += 1;
        MessageId::new(format!("{}-msg-{}", self.run_id, self.counter))
    }

    /// A fresh tool call id, `"{runId}-call-N"`.
    pub fn new_tool_call_id(&mut self) -> ToolCallId {
        self.counter += 1;
        ToolCallId::new(format!("{}-call-{}", self.run_id, self.counter))
    }

    /// Ends the current turn's assistant message: the next tool call attaches to a new one.
    pub fn new_turn(&mut self) {
        self.sink.turn_message = None;
    }

    /// Emits any event (verified like every other).
    pub fn emit(&mut self, event: impl Into<Event>) -> Result<()> {
        self.sink.emit(event.into())
    }

    // ----- openers -----

    /// Opens an assistant text message.
    pub fn message(&mut self) -> Result<MessageHandle<'_, S>> {
        let id = self.new_message_id();
        self.message_with_id(id, TextMessageRole::Assistant)
    }

    /// Opens a text message with a given id and role.
    pub fn message_with_id(
        &mut self,
        id: impl Into<MessageId>,
        role: TextMessageRole,
    ) -> Result<MessageHandle<'_, S>> {
        let id = id.into();
        self.sink.emit(Event::text_message_start(id.clone(), role))?;
        Ok(MessageHandle {
            sink: &mut self.sink,
            state: &mut self.state,
            id,
            ended: false,
        })
    }

    /// Emits a whole assistant message; returns its id.
    pub fn say(&mut self, text: impl AsRef<str>) -> Result<MessageId> {
        let mut m = self.message()?;
        m.delta(text)?;
        let id = m.id().clone();
        m.end()?;
        Ok(id)
    }

    /// Opens a reasoning block (`REASONING_START` + `REASONING_MESSAGE_START`, same id).
    pub fn reasoning(&mut self) -> Result<ReasoningHandle<'_, S>> {
        let id = self.new_message_id();
        self.reasoning_with_id(id)
    }

    /// Opens a reasoning block with a given id.
    pub fn reasoning_with_id(&mut self, id: impl Into<MessageId>) -> Result<ReasoningHandle<'_, S>> {
        let id = id.into();
        self.sink.emit(Event::reasoning_start(id.clone()))?;
        if let Err(e) = self.sink.emit(Event::reasoning_message_start(id.clone())) {
            let _ = self.sink.emit(Event::reasoning_end(id));
            return Err(e);
        }
        Ok(ReasoningHandle {
            sink: &mut self.sink,
            state: &mut self.state,
            id,
            ended: false,
        })
    }

    /// Emits a whole reasoning block; returns its id.
    pub fn think(&mut self, text: impl AsRef<str>) -> Result<MessageId> {
        let mut r = self.reasoning()?;
        r.delta(text)?;
        let id = r.id().clone();
        r.end()?;
        Ok(id)
    }

    /// The message the next tool call attaches to: the current turn's assistant message, or a
    /// fresh id (the client then creates the assistant message, and later calls of the same
    /// turn join it).
    fn turn_parent(&mut self) -> MessageId {
        if let Some(id) = &self.sink.turn_message {
            return id.clone();
        }
        let id = self.new_message_id();
        self.sink.turn_message = Some(id.clone());
        id
    }

    /// Opens a tool call attached (`parentMessageId`) to the current turn's assistant message.
    pub fn tool_call(&mut self, name: impl Into<String>) -> Result<ToolCallHandle<'_, S>> {
        let id = self.new_tool_call_id();
        let parent = self.turn_parent();
        self.tool_call_with(id, name, Some(parent))
    }

    /// Opens a tool call with a given id and parent message (`None`: no `parentMessageId`).
    pub fn tool_call_with(
        &mut self,
        id: impl Into<ToolCallId>,
        name: impl Into<String>,
        parent_message_id: Option<MessageId>,
    ) -> Result<ToolCallHandle<'_, S>> {
        let id = id.into();
        let name = name.into();
        let result_message_id = self.new_message_id();
        self.sink.emit(Event::tool_call_start(
            id.clone(),
            name.clone(),
            parent_message_id,
        ))?;
        Ok(ToolCallHandle {
            sink: &mut self.sink,
            state: &mut self.state,
            id,
            name,
            result_message_id,
            args: String::new(),
            ended: false,
        })
    }

    /// Opens a step; the guard derefs to this context and emits `STEP_FINISHED` on drop.
    pub fn step(&mut self, name: impl Into<String>) -> Result<StepGuard<'_, S>> {
        let name = name.into();
        self.sink.emit(Event::step_started(name.clone()))?;
        Ok(StepGuard {
            ctx: self,
            name,
            finished: false,
        })
    }

    /// Opens a batch of interleaved tool calls (as providers stream parallel calls), attached
    /// to the current turn's assistant message.
    pub fn parallel_tool_calls(&mut self) -> ParallelToolCalls<'_, S> {
        let parent = self.turn_parent();
        ParallelToolCalls {
            ctx: self,
            parent: Some(parent),
            calls: Vec::new(),
            by_index: HashMap::new(),
        }
    }

    /// Ends the current run with `outcome` and starts another on the same thread (sequential
    /// runs in one stream).
    pub fn next_run(&mut self, outcome: RunOutcome, run_id: impl Into<RunId>) -> Result<()> {
        let finished = self.finished_event(outcome);
        self.sink.emit(finished)?;
        self.run_id = run_id.into();
        self.counter = 0;
        self.sink.emit(Event::run_started(
            self.input.thread_id.clone(),
            self.run_id.clone(),
        ))
    }

    fn finished_event(&mut self, outcome: RunOutcome) -> Event {
        let outcome = match outcome {
            RunOutcome::Success => {
                let pending = self.sink.verifier.pending_tool_calls();
                Some(RunFinishedOutcome::Success {
                    pending_tool_call_ids: (!pending.is_empty()).then_some(pending),
                })
            }
            RunOutcome::Interrupt(interrupts) => Some(RunFinishedOutcome::Interrupt { interrupts }),
            RunOutcome::Cancelled => Some(RunFinishedOutcome::Cancelled),
        };
        let mut e = crate::event::RunFinishedEvent {
            thread_id: self.input.thread_id.clone(),
            run_id: self.run_id.clone(),
            outcome,
            ..Default::default()
        };
        if let Some(RunFinishedOutcome::Success {
            pending_tool_call_ids: None,
        }) = e.outcome
        {
            e.outcome = None;
        }
        e.result = self.result.take();
        if !self.usage.is_empty() {
            e.usage = Some(std::mem::take(&mut self.usage));
        }
        Event::RunFinished(e)
    }

    // ----- driver hooks (used by run_agent) -----

    /// Queues `RUN_STARTED` (synchronously: the queue is empty, so it never waits).
    pub(crate) fn start(&mut self, echo_input: bool) -> Result<()> {
        let mut started = crate::event::RunStartedEvent {
            thread_id: self.input.thread_id.clone(),
            run_id: self.run_id.clone(),
            protocol_version: Some(crate::event::PROTOCOL_VERSION.to_owned()),
            parent_run_id: self.input.parent_run_id.clone(),
            ..Default::default()
        };
        if echo_input {
            started.input = Some(Box::new((*self.input).clone()));
        }
        self.sink.emit(Event::RunStarted(started))?;
        if let Some(e) = self.state_error.take() {
            return Err(Error::InvalidState(e));
        }
        Ok(())
    }

    pub(crate) async fn finish(&mut self, result: Result<RunOutcome>) {
        if self.sink.dead == Some(Dead::Closed) || !self.sink.verifier.in_run() {
            return;
        }
        // Events were dropped on the floor: whatever the agent says, the run failed.
        let result = match (self.sink.dead, result) {
            (Some(Dead::BufferFull), _) => Err(Error::BufferFull {
                capacity: self.sink.capacity,
            }),
            (_, r) => r,
        };
        let event = match result {
            Ok(outcome) => self.finished_event(outcome),
            Err(Error::Cancelled) if !self.sink.tx.is_closed() => self.finished_event(RunOutcome::Cancelled),
            Err(e) => {
                let mut ev = crate::event::RunErrorEvent {
                    message: e.to_string(),
                    code: Some(e.code()),
                    ..Default::default()
                };
                if !self.usage.is_empty() {
                    ev.usage = Some(std::mem::take(&mut self.usage));
                }
                Event::RunError(ev)
            }
        };
        self.sink.emit_final(event).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Handles

/// One open text message. `TEXT_MESSAGE_START` has gone out; `Drop` emits `TEXT_MESSAGE_END`.
pub struct MessageHandle<'a, S> {
    sink: &'a mut Sink,
    state: &'a mut StateManager<S>,
    id: MessageId,
    ended: bool,
}

impl<S> fmt::Debug for MessageHandle<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageHandle").field("id", &self.id).finish()
    }
}

impl<S> MessageHandle<'_, S> {
    /// The message id.
    pub fn id(&self) -> &MessageId {
        &self.id
    }

    /// Appends text — `TEXT_MESSAGE_CONTENT`.
    pub fn delta(&mut self, text: impl AsRef<str>) -> Result<()> {
        self.sink
            .emit(Event::text_message_content(self.id.clone(), text.as_ref()))
    }

    /// Emits an unrelated event (state, custom, raw, ...) without closing the message.
    pub fn emit(&mut self, event: impl Into<Event>) -> Result<()> {
        self.sink.emit(event.into())
    }

    /// Attaches the provider's opaque value to this message — `REASONING_ENCRYPTED_VALUE`.
    pub fn encrypted_value(&mut self, value: impl Into<String>) -> Result<()> {
        self.sink.emit(Event::reasoning_encrypted_value(
            EncryptedValueSubtype::Message,
            self.id.as_str(),
            value,
        ))
    }

    /// Emits `TEXT_MESSAGE_END` and consumes the handle.
    pub fn end(mut self) -> Result<()> {
        self.ended = true;
        self.sink.emit(Event::text_message_end(self.id.clone()))
    }
}

impl<S: AgentState> MessageHandle<'_, S> {
    state_trio!();
}

impl<S> Drop for MessageHandle<'_, S> {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.sink.emit(Event::text_message_end(self.id.clone()));
        }
    }
}

/// One open tool call. `TOOL_CALL_START` has gone out; `Drop` emits `TOOL_CALL_END`.
///
/// Arguments stream as text because providers stream them as text; the handle keeps what it
/// emitted so [`Self::parse_args`] can hand back the finished struct:
///
/// ```
/// # use tether_agui::{RunContext, RunOptions, RunAgentInput, Result};
/// # #[derive(serde::Deserialize)] struct Query { city: String }
/// # fn main() -> Result<()> {
/// # let (mut ctx, _rx) = RunContext::<()>::new(RunAgentInput::new("t", "r"), &RunOptions::default());
/// # ctx.emit(tether_agui::Event::run_started("t", "r"))?;
/// let mut call = ctx.tool_call("get_weather")?;
/// call.args(r#"{"city":"#)?;
/// call.args(r#""Seoul"}"#)?;
/// let query: Query = call.parse_args()?;
/// assert_eq!(query.city, "Seoul");
/// call.result(r#"{"tempC":21}"#)?; // TOOL_CALL_END then TOOL_CALL_RESULT
/// # Ok(()) }
/// ```
pub struct ToolCallHandle<'a, S> {
    sink: &'a mut Sink,
    state: &'a mut StateManager<S>,
    id: ToolCallId,
    name: String,
    result_message_id: MessageId,
    args: String,
    ended: bool,
}

impl<S> fmt::Debug for ToolCallHandle<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolCallHandle")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("args", &self.args)
            .finish()
    }
}

impl<S> ToolCallHandle<'_, S> {
    /// The id every event of this call carries.
    pub fn id(&self) -> &ToolCallId {
        &self.id
    }

    /// The tool name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The id the result message will carry.
    pub fn result_message_id(&self) -> &MessageId {
        &self.result_message_id
    }

    /// Appends a fragment of the argument JSON — `TOOL_CALL_ARGS`.
    pub fn args(&mut self, delta: impl AsRef<str>) -> Result<()> {
        let delta = delta.as_ref();
        self.sink.emit(Event::tool_call_args(self.id.clone(), delta))?;
        self.args.push_str(delta);
        Ok(())
    }

    /// Serializes `value` and emits it as the call's arguments in one delta.
    pub fn args_json<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        let text = serde_json::to_string(value)?;
        self.args(text)
    }

    /// The argument JSON emitted so far, unparsed.
    pub fn raw_args(&self) -> &str {
        &self.args
    }

    /// Parses everything emitted through [`Self::args`] into `T`. Fails while the arguments
    /// are still partial.
    pub fn parse_args<T: DeserializeOwned>(&self) -> Result<T> {
        Ok(serde_json::from_str(&self.args)?)
    }

    /// Attaches the provider's opaque reasoning signature for this call —
    /// `REASONING_ENCRYPTED_VALUE` with subtype `tool-call`.
    pub fn encrypted_value(&mut self, value: impl Into<String>) -> Result<()> {
        self.sink.emit(Event::reasoning_encrypted_value(
            EncryptedValueSubtype::ToolCall,
            self.id.as_str(),
            value,
        ))
    }

    /// Emits an unrelated event without closing the call.
    pub fn emit(&mut self, event: impl Into<Event>) -> Result<()> {
        self.sink.emit(event.into())
    }

    /// Emits `TOOL_CALL_END` and consumes the handle, leaving the call unanswered (a front-end
    /// tool: its result arrives as a message on the next request). The call is reported in
    /// `pendingToolCallIds` automatically.
    pub fn end(mut self) -> Result<()> {
        self.ended = true;
        self.sink.emit(Event::tool_call_end(self.id.clone()))
    }

    /// Emits `TOOL_CALL_END` then `TOOL_CALL_RESULT`, and consumes the handle. Returns the id
    /// of the tool message carrying the result.
    pub fn result(mut self, content: impl Into<Content>) -> Result<MessageId> {
        self.ended = true;
        self.sink.emit(Event::tool_call_end(self.id.clone()))?;
        self.sink.emit(Event::tool_call_result(
            self.result_message_id.clone(),
            self.id.clone(),
            content,
        ))?;
        Ok(self.result_message_id.clone())
    }

    /// Serializes `value` and reports it as the call's result.
    pub fn result_json<T: Serialize + ?Sized>(self, value: &T) -> Result<MessageId> {
        let text = serde_json::to_string(value)?;
        self.result(text)
    }
}

impl<S: AgentState> ToolCallHandle<'_, S> {
    state_trio!();
}

impl<S> Drop for ToolCallHandle<'_, S> {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.sink.emit(Event::tool_call_end(self.id.clone()));
        }
    }
}

/// One open reasoning block: `REASONING_START` and `REASONING_MESSAGE_START` (same id) have
/// gone out; `Drop` emits `REASONING_MESSAGE_END` then `REASONING_END`.
pub struct ReasoningHandle<'a, S> {
    sink: &'a mut Sink,
    state: &'a mut StateManager<S>,
    id: MessageId,
    ended: bool,
}

impl<S> fmt::Debug for ReasoningHandle<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReasoningHandle").field("id", &self.id).finish()
    }
}

impl<S> ReasoningHandle<'_, S> {
    /// The span and message id.
    pub fn id(&self) -> &MessageId {
        &self.id
    }

    /// Appends reasoning text — `REASONING_MESSAGE_CONTENT`.
    pub fn delta(&mut self, text: impl AsRef<str>) -> Result<()> {
        self.sink
            .emit(Event::reasoning_message_content(self.id.clone(), text.as_ref()))
    }

    /// Attaches the provider's opaque reasoning value — `REASONING_ENCRYPTED_VALUE`
    /// (subtype `message`).
    pub fn encrypted_value(&mut self, value: impl Into<String>) -> Result<()> {
        self.sink.emit(Event::reasoning_encrypted_value(
            EncryptedValueSubtype::Message,
            self.id.as_str(),
            value,
        ))
    }

    /// Emits an unrelated event without closing the block.
    pub fn emit(&mut self, event: impl Into<Event>) -> Result<()> {
        self.sink.emit(event.into())
    }

    /// Emits `REASONING_MESSAGE_END` then `REASONING_END`, and consumes the handle.
    pub fn end(mut self) -> Result<()> {
        self.ended = true;
        let a = self.sink.emit(Event::reasoning_message_end(self.id.clone()));
        let b = self.sink.emit(Event::reasoning_end(self.id.clone()));
        a.and(b)
    }
}

impl<S: AgentState> ReasoningHandle<'_, S> {
    state_trio!();
}

impl<S> Drop for ReasoningHandle<'_, S> {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.sink.emit(Event::reasoning_message_end(self.id.clone()));
            let _ = self.sink.emit(Event::reasoning_end(self.id.clone()));
        }
    }
}

/// A running step. Derefs to the [`RunContext`] (a step is a scope); `Drop` emits
/// `STEP_FINISHED`.
pub struct StepGuard<'a, S: AgentState> {
    ctx: &'a mut RunContext<S>,
    name: String,
    finished: bool,
}

impl<S: AgentState> fmt::Debug for StepGuard<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StepGuard").field("name", &self.name).finish()
    }
}

impl<S: AgentState> StepGuard<'_, S> {
    /// The step name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Emits `STEP_FINISHED` and consumes the guard.
    pub fn finish(mut self) -> Result<()> {
        self.finished = true;
        self.ctx.sink.emit(Event::step_finished(self.name.clone()))
    }
}

impl<S: AgentState> Deref for StepGuard<'_, S> {
    type Target = RunContext<S>;
    fn deref(&self) -> &RunContext<S> {
        self.ctx
    }
}

impl<S: AgentState> DerefMut for StepGuard<'_, S> {
    fn deref_mut(&mut self) -> &mut RunContext<S> {
        self.ctx
    }
}

impl<S: AgentState> Drop for StepGuard<'_, S> {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.ctx.sink.emit(Event::step_finished(self.name.clone()));
        }
    }
}

/// A key naming one call of a [`ParallelToolCalls`] batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CallSlot(usize);

#[derive(Debug)]
struct ParallelCall {
    id: ToolCallId,
    args: String,
    result_message_id: MessageId,
    open: bool,
}

/// Interleaved tool calls, the way providers stream parallel calls (START a, START b, ARGS a,
/// ARGS b, END a, END b). Every event is still verified; `Drop` ends whatever is still open.
pub struct ParallelToolCalls<'a, S: AgentState> {
    ctx: &'a mut RunContext<S>,
    parent: Option<MessageId>,
    calls: Vec<ParallelCall>,
    by_index: HashMap<u64, CallSlot>,
}

impl<S: AgentState> fmt::Debug for ParallelToolCalls<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParallelToolCalls")
            .field("calls", &self.calls)
            .finish()
    }
}

impl<S: AgentState> ParallelToolCalls<'_, S> {
    /// Opens a call with a fresh id — `TOOL_CALL_START`.
    pub fn start(&mut self, name: impl Into<String>) -> Result<CallSlot> {
        let id = self.ctx.new_tool_call_id();
        self.start_with_id(id, name)
    }

    /// Opens a call with a given id.
    pub fn start_with_id(&mut self, id: impl Into<ToolCallId>, name: impl Into<String>) -> Result<CallSlot> {
        let id = id.into();
        let result_message_id = self.ctx.new_message_id();
        self.ctx
            .sink
            .emit(Event::tool_call_start(id.clone(), name, self.parent.clone()))?;
        self.calls.push(ParallelCall {
            id,
            args: String::new(),
            result_message_id,
            open: true,
        });
        Ok(CallSlot(self.calls.len() - 1))
    }

    /// The slot a provider's stream index maps to, opening the call on first sight (providers
    /// name parallel calls by index and send the id and name only in the first delta).
    pub fn slot_for_index(
        &mut self,
        index: u64,
        id: impl FnOnce() -> ToolCallId,
        name: impl FnOnce() -> String,
    ) -> Result<CallSlot> {
        if let Some(s) = self.by_index.get(&index) {
            return Ok(*s);
        }
        let slot = self.start_with_id(id(), name())?;
        self.by_index.insert(index, slot);
        Ok(slot)
    }

    fn call(&mut self, slot: CallSlot) -> &mut ParallelCall {
        &mut self.calls[slot.0]
    }

    /// The call's id.
    pub fn id(&self, slot: CallSlot) -> &ToolCallId {
        &self.calls[slot.0].id
    }

    /// The argument text emitted so far for this call.
    pub fn raw_args(&self, slot: CallSlot) -> &str {
        &self.calls[slot.0].args
    }

    /// Parses the call's arguments.
    pub fn parse_args<T: DeserializeOwned>(&self, slot: CallSlot) -> Result<T> {
        Ok(serde_json::from_str(&self.calls[slot.0].args)?)
    }

    /// Appends argument text to one call — `TOOL_CALL_ARGS`.
    pub fn args(&mut self, slot: CallSlot, delta: impl AsRef<str>) -> Result<()> {
        let id = self.call(slot).id.clone();
        self.ctx.sink.emit(Event::tool_call_args(id, delta.as_ref()))?;
        self.call(slot).args.push_str(delta.as_ref());
        Ok(())
    }

    /// Ends one call — `TOOL_CALL_END` (no-op if already ended).
    pub fn end(&mut self, slot: CallSlot) -> Result<()> {
        if !self.call(slot).open {
            return Ok(());
        }
        self.call(slot).open = false;
        let id = self.call(slot).id.clone();
        self.ctx.sink.emit(Event::tool_call_end(id))
    }

    /// Ends every open call, in the order they were opened.
    pub fn end_all(&mut self) -> Result<()> {
        for i in 0..self.calls.len() {
            self.end(CallSlot(i))?;
        }
        Ok(())
    }

    /// Reports one call's result (ending it first if needed) — `TOOL_CALL_RESULT`.
    pub fn result(&mut self, slot: CallSlot, content: impl Into<Content>) -> Result<MessageId> {
        self.end(slot)?;
        let call = self.call(slot);
        let (mid, id) = (call.result_message_id.clone(), call.id.clone());
        self.ctx
            .sink
            .emit(Event::tool_call_result(mid.clone(), id, content))?;
        Ok(mid)
    }
}

impl<S: AgentState> Drop for ParallelToolCalls<'_, S> {
    fn drop(&mut self) {
        let _ = self.end_all();
    }
}
