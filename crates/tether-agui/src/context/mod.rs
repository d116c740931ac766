//! [`RunContext`]: what an agent writes a run through, and its RAII handles.
//!
//! Opening a handle emits its START; dropping it emits its END. Every opener takes
//! `&mut self`, and a handle keeps the context's event sink and state borrowed until it drops,
//! so two messages, tool calls or reasoning blocks cannot be open at the same time by accident:
//!
//! ```compile_fail,E0499
//! # use tether_agui::{RunContext, AgUiResult};
//! # fn f(ctx: &mut RunContext) -> AgUiResult<()> {
//! let mut first = ctx.message()?;
//! let second = ctx.message()?; // error: `*ctx` is already borrowed by `first`
//! first.delta("hi")?;
//! # drop(second); Ok(()) }
//! ```
//!
//! ```compile_fail,E0499
//! # use tether_agui::{RunContext, AgUiResult};
//! # fn f(ctx: &mut RunContext) -> AgUiResult<()> {
//! let mut call = ctx.tool_call("search")?;
//! let mut text = ctx.message()?; // error: a tool call is open
//! call.args("{}")?;
//! # text.delta("x")?; Ok(()) }
//! ```
//!
//! ```compile_fail,E0499
//! # use tether_agui::{RunContext, AgUiResult};
//! # fn f(ctx: &mut RunContext) -> AgUiResult<()> {
//! let mut thinking = ctx.reasoning()?;
//! let call = ctx.tool_call("search")?; // error: reasoning is open
//! thinking.delta("hmm")?;
//! # drop(call); Ok(()) }
//! ```
//!
//! Provider-style interleaved parallel tool calls, which the borrow rules above forbid, have
//! their own typed API: [`RunContext::parallel_tool_calls`].
//!
//! By responsibility: [`RunContext`] and its options here; the cancellation token in `cancel`;
//! the verifier-and-channel sink in `sink`; the typed state and its deltas in `state`; the RAII
//! handles in `handles`; interleaved tool calls in `parallel`.

use std::collections::HashMap;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::error::{AgUiError, AgUiResult};
use crate::event::{AgUiEvent, EncryptedValueSubtype, TextMessageRole};
use crate::ids::{MessageId, RunId, ThreadId, ToolCallId};
use crate::patch;
use crate::types::{
    Content, Context, Interrupt, ResumeEntry, RunAgentInput, RunFinishedOutcome, TokenUsage, Tool,
};
use crate::verify::Verifier;

#[macro_use]
mod state;
mod cancel;
mod handles;
mod parallel;
mod sink;

#[allow(deprecated)]
pub use cancel::CancelToken;
pub use handles::{MessageHandle, ReasoningHandle, StepGuard, ToolCallHandle};
pub use parallel::{CallSlot, ParallelToolCalls};
use sink::Dead;
pub(crate) use sink::Sink;
use state::StateManager;
pub use state::{state_update, state_update_json};

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
// RunContext

/// Options of one run.
#[derive(Debug, Clone)]
#[non_exhaustive]
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

/// Builder-style setters (the struct is `#[non_exhaustive]`).
impl RunOptions {
    /// The capacity of the event buffer between the agent and the transport.
    pub fn with_buffer(mut self, events: usize) -> Self {
        self.buffer = events;
        self
    }

    /// Stamp every event with `timestamp`, or not.
    pub fn with_timestamps(mut self, on: bool) -> Self {
        self.timestamps = on;
        self
    }

    /// Echo the input on `RUN_STARTED.input`, or not.
    pub fn with_echo_input(mut self, on: bool) -> Self {
        self.echo_input = on;
        self
    }

    /// The runtime each run's task is spawned on.
    pub fn with_runtime(mut self, runtime: tokio::runtime::Handle) -> Self {
        self.runtime = Some(runtime);
        self
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
    rx: mpsc::Receiver<Box<AgUiEvent>>,
}

impl EventReceiver {
    pub(crate) fn channel(capacity: usize) -> (mpsc::Sender<Box<AgUiEvent>>, Self) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (tx, EventReceiver { rx })
    }

    /// The next event; `None` once the context is dropped and every event was received.
    pub async fn recv(&mut self) -> Option<AgUiEvent> {
        self.rx.recv().await.map(|b| *b)
    }

    /// The next event if one is ready now.
    pub fn try_recv(&mut self) -> Option<AgUiEvent> {
        self.rx.try_recv().ok().map(|b| *b)
    }

    /// Polls for the next event.
    pub fn poll_recv(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<AgUiEvent>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| *b))
    }
}

impl<S: AgentState> RunContext<S> {
    /// A context for `input` and the channel its events arrive on. Nothing is emitted yet;
    /// [`crate::run_agent`] emits `RUN_STARTED` and the terminal event around the agent.
    pub fn new(input: RunAgentInput, options: &RunOptions) -> (Self, EventReceiver) {
        let (tx, rx) = EventReceiver::channel(options.buffer);
        let ctx = Self::with_sender(Arc::new(input), tx, tether::CancellationToken::new(), options);
        (ctx, rx)
    }

    pub(crate) fn with_sender(
        input: Arc<RunAgentInput>,
        tx: mpsc::Sender<Box<AgUiEvent>>,
        cancel: tether::CancellationToken,
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
                overflow: Default::default(),
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
    pub fn publish_state(&mut self) -> AgUiResult<()> {
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
    pub fn emit(&mut self, event: impl Into<AgUiEvent>) -> AgUiResult<()> {
        self.sink.emit(event.into())
    }

    // ----- openers -----

    /// Opens an assistant text message.
    pub fn message(&mut self) -> AgUiResult<MessageHandle<'_, S>> {
        let id = self.new_message_id();
        self.message_with_id(id, TextMessageRole::Assistant)
    }

    /// Opens a text message with a given id and role.
    pub fn message_with_id(
        &mut self,
        id: impl Into<MessageId>,
        role: TextMessageRole,
    ) -> AgUiResult<MessageHandle<'_, S>> {
        let id = id.into();
        self.sink.emit(AgUiEvent::text_message_start(id.clone(), role))?;
        Ok(MessageHandle {
            sink: &mut self.sink,
            state: &mut self.state,
            id,
            ended: false,
        })
    }

    /// Emits a whole assistant message; returns its id.
    pub fn say(&mut self, text: impl AsRef<str>) -> AgUiResult<MessageId> {
        let mut m = self.message()?;
        m.delta(text)?;
        let id = m.id().clone();
        m.end()?;
        Ok(id)
    }

    /// Opens a reasoning block (`REASONING_START` + `REASONING_MESSAGE_START`, same id).
    pub fn reasoning(&mut self) -> AgUiResult<ReasoningHandle<'_, S>> {
        let id = self.new_message_id();
        self.reasoning_with_id(id)
    }

    /// Opens a reasoning block with a given id.
    pub fn reasoning_with_id(&mut self, id: impl Into<MessageId>) -> AgUiResult<ReasoningHandle<'_, S>> {
        let id = id.into();
        self.sink.emit(AgUiEvent::reasoning_start(id.clone()))?;
        if let Err(e) = self.sink.emit(AgUiEvent::reasoning_message_start(id.clone())) {
            let _ = self.sink.emit(AgUiEvent::reasoning_end(id));
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
    pub fn think(&mut self, text: impl AsRef<str>) -> AgUiResult<MessageId> {
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
    pub fn tool_call(&mut self, name: impl Into<String>) -> AgUiResult<ToolCallHandle<'_, S>> {
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
    ) -> AgUiResult<ToolCallHandle<'_, S>> {
        let id = id.into();
        let name = name.into();
        let result_message_id = self.new_message_id();
        self.sink.emit(AgUiEvent::tool_call_start(
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
    pub fn step(&mut self, name: impl Into<String>) -> AgUiResult<StepGuard<'_, S>> {
        let name = name.into();
        self.sink.emit(AgUiEvent::step_started(name.clone()))?;
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
    pub fn next_run(&mut self, outcome: RunOutcome, run_id: impl Into<RunId>) -> AgUiResult<()> {
        let finished = self.finished_event(outcome);
        self.sink.emit(finished)?;
        self.run_id = run_id.into();
        self.counter = 0;
        self.sink.emit(AgUiEvent::run_started(
            self.input.thread_id.clone(),
            self.run_id.clone(),
        ))
    }

    fn finished_event(&mut self, outcome: RunOutcome) -> AgUiEvent {
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
        AgUiEvent::RunFinished(e)
    }

    // ----- driver hooks (used by run_agent) -----

    /// Queues `RUN_STARTED` (synchronously: the queue is empty, so it never waits).
    pub(crate) fn start(&mut self, echo_input: bool) -> AgUiResult<()> {
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
        self.sink.emit(AgUiEvent::RunStarted(started))?;
        if let Some(e) = self.state_error.take() {
            return Err(AgUiError::InvalidState(e));
        }
        Ok(())
    }

    pub(crate) async fn finish(&mut self, result: AgUiResult<RunOutcome>) {
        if self.sink.dead == Some(Dead::Closed) || !self.sink.verifier.in_run() {
            return;
        }
        // Events were dropped on the floor: whatever the agent says, the run failed.
        let result = match (self.sink.dead, result) {
            (Some(Dead::BufferFull), _) => Err(AgUiError::BufferFull {
                capacity: self.sink.capacity,
            }),
            (_, r) => r,
        };
        let event = match result {
            Ok(outcome) => self.finished_event(outcome),
            Err(AgUiError::Cancelled) if !self.sink.tx.is_closed() => {
                self.finished_event(RunOutcome::Cancelled)
            }
            Err(e) => {
                let mut ev = crate::event::RunErrorEvent {
                    message: e.to_string(),
                    code: Some(e.code()),
                    ..Default::default()
                };
                if !self.usage.is_empty() {
                    ev.usage = Some(std::mem::take(&mut self.usage));
                }
                AgUiEvent::RunError(ev)
            }
        };
        self.sink.emit_final(event).await;
    }
}
