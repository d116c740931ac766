//! [`Provider`]: where the agent loop lives.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::event::Event;
use crate::handler::Handler;
use crate::sink::EventSink;
use crate::types::{SessionInfo, ToolSpec, ToolUse, ToolUseResult, TurnResult};

/// What drives a turn.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Input {
    /// The first prompt of a request, or a follow-up user message.
    Message(String),
    /// The tool uses the previous turn asked for, each with its result, in the order asked.
    ToolResults(Vec<ToolUseResult>),
    /// Go on without new input: the previous `RequiresAction` turn left nothing to run (its calls
    /// were all answered in the provider's own history), or a reconnect resumes a turn in flight.
    Continue,
    /// A provider-specific raw input (e.g. a Managed Agents `user.define_outcome` event).
    Raw(Value),
}

/// What [`Provider::open`] or [`Provider::resume`] learned.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Opened {
    /// The session's id (the provider's when it has one).
    pub session_id: String,
    /// True when an existing session was reattached rather than created.
    pub resumed: bool,
    /// Tool uses the reattached session still waits for.
    pub pending: Vec<ToolUse>,
    /// A user message the record holds that the provider never answered (a crash came between
    /// recording it and the answer): the engine sends it again, without recording it again, with
    /// the session's next request.
    pub unanswered: Option<String>,
}

impl Opened {
    /// A session `session_id` just created (not reattached), waiting on nothing.
    pub fn new(session_id: impl Into<String>) -> Self {
        Opened {
            session_id: session_id.into(),
            ..Opened::default()
        }
    }

    /// A session `session_id` reattached from its record.
    pub fn resumed(session_id: impl Into<String>) -> Self {
        Opened {
            resumed: true,
            ..Opened::new(session_id)
        }
    }

    /// The same, with the tool uses the session still waits for.
    pub fn with_pending(mut self, pending: Vec<ToolUse>) -> Self {
        self.pending = pending;
        self
    }

    /// The same, with a recorded user message the provider never answered.
    pub fn with_unanswered(mut self, text: Option<String>) -> Self {
        self.unanswered = text;
        self
    }
}

/// What [`Provider::resume`] reopens a session from: the thread's record as the store holds it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Resume<'a> {
    /// The provider's own session handle recorded in the thread (a Managed Agents session id, an
    /// AgentCore runtime session id, an ACP session id), when one was.
    pub session_id: Option<&'a str>,
    /// The provider's state at the thread's last checkpoint ([`Provider::checkpoint`]), if any.
    pub checkpoint: Option<&'a Value>,
    /// The sequence number the checkpoint covers (0 without one): events after it are newer than
    /// the checkpoint's state.
    pub since: u64,
    /// The thread's whole record, in sequence order (already seeded into the session's sink, so
    /// re-emitting one of them is a no-op).
    pub events: &'a [Event],
}

impl<'a> Resume<'a> {
    /// A resume from a session handle, a checkpoint and a record (the engine builds these; this
    /// is for tests and for engines of other kinds).
    pub fn new(
        session_id: Option<&'a str>,
        checkpoint: Option<&'a Value>,
        since: u64,
        events: &'a [Event],
    ) -> Self {
        Resume {
            session_id,
            checkpoint,
            since,
            events,
        }
    }

    /// The durable events newer than the checkpoint.
    pub fn since_checkpoint(&self) -> impl Iterator<Item = &'a Event> + 'a {
        let since = self.since;
        self.events
            .iter()
            .filter(move |e| e.seq.is_some_and(|s| s > since))
    }
}

/// What a provider sees of the session while it drives a turn.
///
/// `sink` is where it reports events (durable ones exactly once); `handler` is where requests it
/// gets *during* a turn go (ACP's file, terminal and permission requests, Managed Agents' tool
/// confirmations). Tool uses it hands back as `RequiresAction` are run by the engine, not by it.
#[derive(Clone)]
#[non_exhaustive]
pub struct TurnContext {
    /// The session's event pipeline.
    pub sink: EventSink,
    /// The session's handler.
    pub handler: Arc<dyn Handler>,
    /// The tools to declare to the model (the handler's, plus the terminal tool).
    pub tools: Vec<ToolSpec>,
    /// The terminal tool's name, when one is configured.
    pub terminal_tool: Option<String>,
    /// This turn's number within the current request (1-based).
    pub turn: u32,
    /// The most turns the request may take.
    pub max_turns: u32,
    /// Which list `tools` is: see [`TurnContext::tools_generation`].
    tools_generation: Option<u64>,
}

impl std::fmt::Debug for TurnContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnContext")
            .field("turn", &self.turn)
            .field("max_turns", &self.max_turns)
            .field("terminal_tool", &self.terminal_tool)
            .finish()
    }
}

impl TurnContext {
    /// The context of turn 1 of 1 for a session's `sink` and `handler`, declaring no tools (the
    /// engine builds these; this is for driving a provider directly, as tests do).
    pub fn new(sink: EventSink, handler: Arc<dyn Handler>) -> Self {
        TurnContext {
            sink,
            handler,
            tools: Vec::new(),
            terminal_tool: None,
            turn: 1,
            max_turns: 1,
            tools_generation: None,
        }
    }

    /// The same context declaring `tools`.
    pub fn with_tools(mut self, tools: Vec<ToolSpec>) -> Self {
        self.tools = tools;
        self.tools_generation = None;
        self
    }

    /// A number the engine gives each list of tools it reads from the handler, unique in the
    /// process: two turns with the same `Some` number declare the same list, so a provider that
    /// keeps the list it last sent may skip comparing it. `None` (a context built by hand): not
    /// known; compare.
    pub fn tools_generation(&self) -> Option<u64> {
        self.tools_generation
    }

    /// `tools` as the engine read them, under a fresh [`Self::tools_generation`].
    pub(crate) fn set_tools(&mut self, tools: Vec<ToolSpec>) {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        self.tools = tools;
        self.tools_generation = Some(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    }

    /// The same context as turn `turn` of at most `max_turns`.
    pub fn with_turn(mut self, turn: u32, max_turns: u32) -> Self {
        self.turn = turn;
        self.max_turns = max_turns;
        self
    }

    /// The session's identity.
    pub fn info(&self) -> Arc<SessionInfo> {
        self.sink.info()
    }

    /// Whether this is the last turn the request may take.
    pub fn is_final_turn(&self) -> bool {
        self.turn >= self.max_turns
    }
}

/// Where the agent loop lives: the local loop, Claude Managed Agents, Bedrock AgentCore, or an
/// ACP agent. The session engine drives every provider the same way:
///
/// 1. [`open`](Provider::open) once (create, or reattach to an existing remote session), or, for a
///    thread that already has a record, [`resume`](Provider::resume) from it;
/// 2. [`turn`](Provider::turn) with the first [`Input`], then with tool results, until a turn ends
///    in `EndTurn` or `Terminated`;
/// 3. on a transient error from `turn`, [`reconnect`](Provider::reconnect) (after backoff) and
///    re-run whatever tool uses it reports unanswered, then continue;
/// 4. [`close`](Provider::close) at the end.
///
/// # Cancel safety
/// The engine may drop a `turn` future (cancellation, timeout). It then calls
/// [`interrupt`](Provider::interrupt), so the provider can stop the remote loop, and may call
/// `turn` again later: a provider must stay usable after a dropped turn.
#[async_trait]
pub trait Provider: Send + 'static {
    /// The provider's name (`local`, `managed`, `agentcore`, `acp`).
    fn name(&self) -> &str;

    /// Opens or reattaches the session.
    async fn open(&mut self, cx: &TurnContext) -> Result<Opened>;

    /// Drives one turn from `input` to its terminal, reporting its events through `cx.sink`.
    async fn turn(&mut self, input: Input, cx: &TurnContext) -> Result<TurnResult>;

    /// Whether a transient error from [`turn`](Provider::turn) means a dropped stream that
    /// [`reconnect`](Provider::reconnect) can re-establish. Request/response providers retry inside
    /// their turn and say no (the default).
    fn can_reconnect(&self) -> bool {
        false
    }

    /// Re-establishes a dropped connection and returns the tool uses still unanswered (to re-run:
    /// at-least-once). The default has nothing to reconnect.
    async fn reconnect(&mut self, cx: &TurnContext) -> Result<Vec<ToolUse>> {
        let _ = cx;
        Ok(Vec::new())
    }

    /// Records tool results without starting a turn: used when the terminal tool ended the run,
    /// so the provider's history stays well formed. The default does nothing.
    async fn record_tool_results(&mut self, answered: &[ToolUseResult]) -> Result<()> {
        let _ = answered;
        Ok(())
    }

    /// Asks the remote loop to stop the turn in flight (after a cancel or a timeout).
    async fn interrupt(&mut self) -> Result<()> {
        Ok(())
    }

    /// The provider's resumable state, saved by the engine as the thread's checkpoint after a
    /// turn (with the sequence number it covers; see [`Provider::state_beyond_record`] for the
    /// turns it skips) and handed back to [`Provider::resume`]: the
    /// local loop's history; a remote session's bookkeeping that its service does not keep.
    /// `None` (the default): nothing beyond the session handle and the record.
    fn checkpoint(&self) -> Option<Value> {
        None
    }

    /// Whether the provider's state gained, since the engine last asked, something its
    /// [`resume`](Provider::resume) could not rebuild from the thread's last saved checkpoint
    /// and the events recorded after it; asking clears the note.
    ///
    /// The engine asks after every turn and skips the checkpoint's save when the answer is no
    /// and every input it handed the provider since the last save is in the record too (a user
    /// message it recorded, a reprompt, tool results it recorded). A save is O(state) (the local
    /// loop's whole history), a record append is O(event): a provider whose resume replays the
    /// record after its checkpoint need not have its state saved after a turn the record
    /// already holds. Say yes for what the record lacks: the state [`open`](Provider::open) set
    /// up (a system prompt, an imported transcript), a raw input, an event the sink did not
    /// record because one with its id was there already.
    ///
    /// The default, `true`, has the state saved after every turn.
    fn state_beyond_record(&mut self) -> bool {
        true
    }

    /// Reopens the session of a thread from its record, after a restart, a crash or an eviction:
    /// the local loop rebuilds its history; a remote loop reattaches to its session by the handle
    /// the thread recorded and catches up. Tool uses the session still waits on go in
    /// [`Opened::pending`] (the engine answers them from the memo, or runs them).
    ///
    /// The default refuses with [`Error::CannotResume`]: a provider that cannot reopen a session
    /// says so with a typed error, and nothing is lost from the record.
    async fn resume(&mut self, from: Resume<'_>, cx: &TurnContext) -> Result<Opened> {
        let _ = (from, cx);
        Err(Error::cannot_resume(
            self.name(),
            "this provider cannot reopen a session from its record",
        ))
    }

    /// Tears the session down on the provider's side where that applies.
    async fn close(&mut self) -> Result<()> {
        Ok(())
    }
}
