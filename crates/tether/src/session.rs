//! [`Session`]: the session engine, written once for every provider.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{Error, Result};
use crate::event::{Event, EventKind};
use crate::handler::{Handler, NoTools, ToolOutput};
use crate::provider::Resume;
use crate::provider::{Input, Opened, Provider, TurnContext};
use crate::raw;
use crate::retry::RetryPolicy;
use crate::sink::{EventObserver, EventSink, Mark, RunInput};
use crate::store::{EventStore, MemoryStore};
use crate::thread::{CHECKPOINT, Checkpoint, Claim, ThreadId, ThreadStart, ThreadStore};
use crate::types::{
    PendingToolUse, SessionInfo, SessionResult, StopReason, Terminal, ToolResult, ToolSpec, ToolUse,
    ToolUseResult, TurnResult, Usage, UserMessage, Waiting,
};

/// What the turn guard sees after each turn.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct GuardInfo {
    /// Turns taken in this request.
    pub turns: u32,
    /// Usage so far in this request.
    pub usage: Usage,
    /// The session's id.
    pub session_id: String,
}

/// The turn guard's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuardDecision {
    /// Go on.
    Continue,
    /// Stop the request now, with this reason.
    Halt(String),
}

type TurnGuard = Arc<dyn Fn(&GuardInfo) -> GuardDecision + Send + Sync>;

/// How a session runs. Every field has a default; see each one.
#[derive(Clone)]
#[non_exhaustive]
pub struct SessionConfig {
    /// Most turns per request (default 50). Turn `max_turns + 1` is never started: the request
    /// ends `Terminated` with stop reason `max_turns`, keeping the last turn's text.
    pub max_turns: u32,
    /// Tool uses of one turn run at most this many at a time (default 8); results keep input order.
    pub tool_concurrency: usize,
    /// A tool that runs longer gets an error result (default 5 minutes; `None`: no limit). Time
    /// the call spends waiting for the user (an MCP server's elicitation: the source pauses the
    /// call's [`crate::source::CallClock`]) does not count.
    pub tool_timeout: Option<Duration>,
    /// The terminal tool, when the run must end by calling it. Declared to the model; a call ends
    /// the request (`final_output` holds its input); an `EndTurn` without it is re-prompted.
    pub terminal_tool: Option<ToolSpec>,
    /// Re-prompts before giving up on the terminal tool (default 2).
    pub max_reprompts: u32,
    /// The time limit of [`SessionBuilder::run`] (default 600 s).
    pub timeout: Duration,
    /// Backoff for reconnecting a dropped stream (default 0.5 s doubling to 64 s, 8 tries).
    pub reconnect: RetryPolicy,
    /// Checked after every turn, before the turn limit.
    pub turn_guard: Option<TurnGuard>,
    /// Caller metadata, copied into [`SessionInfo::metadata`].
    pub metadata: serde_json::Map<String, Value>,
}

impl std::fmt::Debug for SessionConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionConfig")
            .field("max_turns", &self.max_turns)
            .field("tool_concurrency", &self.tool_concurrency)
            .field("tool_timeout", &self.tool_timeout)
            .field("terminal_tool", &self.terminal_tool.as_ref().map(|t| &t.name))
            .field("max_reprompts", &self.max_reprompts)
            .field("timeout", &self.timeout)
            .field("turn_guard", &self.turn_guard.is_some())
            .finish()
    }
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            max_turns: 50,
            tool_concurrency: 8,
            tool_timeout: Some(Duration::from_secs(300)),
            terminal_tool: None,
            max_reprompts: 2,
            timeout: Duration::from_secs(600),
            reconnect: RetryPolicy {
                max_retries: 8,
                base: Duration::from_millis(500),
                max_backoff: Duration::from_secs(64),
                ..RetryPolicy::default()
            },
            turn_guard: None,
            metadata: Default::default(),
        }
    }
}

/// Builder-style setters, so a caller outside this crate can set what it needs (the struct is
/// `#[non_exhaustive]`: a struct literal would break when a field is added).
///
/// ```
/// use std::time::Duration;
/// let c = tether::SessionConfig::default()
///     .with_max_turns(5)
///     .with_timeout(Duration::from_secs(30));
/// assert_eq!(c.max_turns, 5);
/// ```
impl SessionConfig {
    /// Most turns per request.
    pub fn with_max_turns(mut self, n: u32) -> Self {
        self.max_turns = n;
        self
    }

    /// How many tool uses of one turn run at a time.
    pub fn with_tool_concurrency(mut self, n: usize) -> Self {
        self.tool_concurrency = n;
        self
    }

    /// The time limit of one tool call (`None`: no limit).
    pub fn with_tool_timeout(mut self, t: Option<Duration>) -> Self {
        self.tool_timeout = t;
        self
    }

    /// The terminal tool the run must end by calling.
    pub fn with_terminal_tool(mut self, tool: ToolSpec) -> Self {
        self.terminal_tool = Some(tool);
        self
    }

    /// Re-prompts before giving up on the terminal tool.
    pub fn with_max_reprompts(mut self, n: u32) -> Self {
        self.max_reprompts = n;
        self
    }

    /// The time limit of [`SessionBuilder::run`].
    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// Backoff for reconnecting a dropped stream.
    pub fn with_reconnect(mut self, policy: RetryPolicy) -> Self {
        self.reconnect = policy;
        self
    }

    /// A guard checked after every turn.
    pub fn with_turn_guard(
        mut self,
        guard: impl Fn(&GuardInfo) -> GuardDecision + Send + Sync + 'static,
    ) -> Self {
        self.turn_guard = Some(Arc::new(guard));
        self
    }

    /// Caller metadata, copied into [`SessionInfo::metadata`].
    pub fn with_metadata(mut self, metadata: serde_json::Map<String, Value>) -> Self {
        self.metadata = metadata;
        self
    }
}

/// Builds a [`Session`]: a provider, a handler, a store, and a [`SessionConfig`].
pub struct SessionBuilder {
    provider: Box<dyn Provider>,
    handler: Arc<dyn Handler>,
    store: Arc<dyn EventStore>,
    config: SessionConfig,
    /// The thread to open, when the session is a thread's.
    thread: Option<ThreadOpen>,
    /// Subscriptions made before the session opened.
    subscribers: Vec<mpsc::Sender<std::sync::Arc<Event>>>,
    /// The observer attached to the session's sink at open (a tracer).
    observer: Option<Arc<dyn EventObserver>>,
    /// The priority the session's model deltas are paced on ([`SessionBuilder::priority`]).
    priority: Option<crate::priority::Priority>,
    /// Whether the provider's `open` reaches nothing outside the process
    /// ([`SessionBuilder::provider_opens_locally`]).
    opens_locally: bool,
}

/// What [`SessionBuilder::thread`] asked for.
struct ThreadOpen {
    store: Arc<dyn ThreadStore>,
    id: ThreadId,
    agent: String,
    title: String,
    /// The user messages that start a new thread ([`SessionBuilder::first_messages`]).
    first: Vec<UserMessage>,
}

impl SessionBuilder {
    /// The handler serving tools and client-side requests (default: [`NoTools`]).
    pub fn handler(mut self, handler: impl Handler) -> Self {
        self.handler = Arc::new(handler);
        self
    }

    /// The handler, already shared.
    pub fn handler_arc(mut self, handler: Arc<dyn Handler>) -> Self {
        self.handler = handler;
        self
    }

    /// The event store (default: a fresh [`MemoryStore`]).
    pub fn store(mut self, store: Arc<dyn EventStore>) -> Self {
        self.store = store;
        self
    }

    /// The whole configuration.
    pub fn config(mut self, config: SessionConfig) -> Self {
        self.config = config;
        self
    }

    /// Most turns per request.
    pub fn max_turns(mut self, n: u32) -> Self {
        self.config.max_turns = n.max(1);
        self
    }

    /// The terminal tool the run must end with.
    pub fn terminal_tool(mut self, spec: ToolSpec) -> Self {
        self.config.terminal_tool = Some(spec);
        self
    }

    /// The time limit of [`SessionBuilder::run`].
    pub fn timeout(mut self, d: Duration) -> Self {
        self.config.timeout = d;
        self
    }

    /// A guard checked after every turn.
    pub fn turn_guard(mut self, g: impl Fn(&GuardInfo) -> GuardDecision + Send + Sync + 'static) -> Self {
        self.config.turn_guard = Some(Arc::new(g));
        self
    }

    /// Makes the session a thread's: [`Self::open`] claims `thread` for `agent` in `store` (which
    /// is also the session's event store), then opens a new provider session for a new thread
    /// (recording the provider's session handle in the thread), or reloads the thread's record
    /// and checkpoint and asks the provider to [`resume`](Provider::resume) from them.
    ///
    /// The session's id ([`SessionInfo::session_id`]) is then the thread's record key, and its
    /// metadata names the thread (`thread`) and the agent (`agent`). Opening fails with
    /// [`Error::ThreadTaken`] when the thread belongs to another agent, and with
    /// [`Error::CannotResume`] when the provider cannot reopen the session (nothing is written
    /// then).
    pub fn thread(mut self, store: Arc<dyn ThreadStore>, thread: ThreadId, agent: impl Into<String>) -> Self {
        self.store = store.clone();
        self.thread = Some(ThreadOpen {
            store,
            id: thread,
            agent: agent.into(),
            title: String::new(),
            first: Vec::new(),
        });
        self
    }

    /// The title a new thread gets (typically its first user message, shortened); ignored
    /// without [`Self::thread`].
    pub fn title(mut self, title: impl Into<String>) -> Self {
        if let Some(t) = &mut self.thread {
            t.title = title.into();
        }
        self
    }

    /// The user messages that start the thread's first request (an AG-UI request's messages);
    /// ignored without [`Self::thread`].
    ///
    /// When opening finds the thread not yet started (just created, or claimed earlier by a run
    /// that stopped before recording anything), the engine records these messages in the same
    /// store step as the provider's session handle ([`ThreadStore::start_thread`]; with
    /// [`Self::provider_opens_locally`], in the claim's own step), instead of one step for the
    /// handle and another when the first request records them. They are then in the record,
    /// delivered to subscribers as the session opens, and sent with the session's next request,
    /// as a message a resume found unanswered is ([`Opened::unanswered`]): a
    /// [`Session::send_messages`] carrying the same ids does not record or send them twice. A
    /// thread that already started ignores them (the request records what is new, as always).
    pub fn first_messages(mut self, messages: Vec<UserMessage>) -> Self {
        if let Some(t) = &mut self.thread {
            t.first = messages;
        }
        self
    }

    /// Declares that the provider's [`Provider::open`] reaches nothing outside the process (the
    /// local loop's does not: it only prepares its history) and may be called on a session that
    /// then [`resume`](Provider::resume)s instead.
    ///
    /// Opening a thread with [`Self::first_messages`] then opens the provider *before* claiming
    /// the thread, so a new thread is claimed, given its provider session and its first messages
    /// in one store step ([`ThreadStore::claim_thread_starting`]): one store round trip before
    /// the first model request instead of two. A claim that finds the thread started resumes the
    /// provider as usual (its early open is discarded). Never set this for a provider whose open
    /// creates something remotely (a Managed Agents or AgentCore session, an ACP agent's
    /// session): a thread that already exists would leave that behind.
    pub fn provider_opens_locally(mut self) -> Self {
        self.opens_locally = true;
        self
    }

    /// Subscribes to the session's events before it opens (what opening a thread records, a
    /// resume's catch-up, included), as [`EventSink::subscribe`] does once it is open.
    pub fn subscribe(&mut self, capacity: usize) -> crate::Subscription {
        let (sub, tx) = crate::Subscription::pair(capacity);
        self.subscribers.push(tx);
        sub
    }

    /// Wraps the handler (an adapter adding its front-end tools or its approval channel to the
    /// handler an application configured).
    pub fn map_handler(mut self, f: impl FnOnce(Arc<dyn Handler>) -> Arc<dyn Handler>) -> Self {
        self.handler = f(self.handler);
        self
    }

    /// An observer for the session's events (a tracer such as `tether-otel`'s), attached to its
    /// sink before the provider opens, so it sees every request from the first.
    pub fn observer(mut self, observer: Arc<dyn EventObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Paces the session's model deltas on `priority`: after each delta it delivers, the session
    /// waits (at most the priority's hold) while another run is starting, so that runs still
    /// waiting for their first output go first (see [`crate::priority`]). A server gives one
    /// priority to all its sessions; the runs mark themselves with
    /// [`Priority::starting`](crate::priority::Priority::starting). Default: no pacing.
    pub fn priority(mut self, priority: crate::priority::Priority) -> Self {
        self.priority = Some(priority);
        self
    }

    /// Opens the session (creating or reattaching on the provider's side; for a thread, see
    /// [`Self::thread`]).
    pub async fn open(self) -> Result<Session> {
        let tools_version = self.handler.tools_version();
        let tools = declared_tools(self.handler.as_ref(), self.config.terminal_tool.as_ref());
        let mut info = SessionInfo::new("", self.provider.name());
        info.metadata = self.config.metadata.clone();
        let sink = EventSink::new(info.clone(), self.handler.clone(), self.store);
        for tx in self.subscribers {
            sink.attach(tx);
        }
        if let Some(o) = self.observer {
            sink.set_observer(o);
        }
        if let Some(p) = self.priority {
            sink.set_priority(p);
        }
        let mut cx = TurnContext::new(sink, self.handler).with_turn(0, self.config.max_turns);
        cx.terminal_tool = self.config.terminal_tool.as_ref().map(|t| t.name.clone());
        cx.set_tools(tools);
        let mut provider = self.provider;
        let (opened, thread) = match self.thread {
            None => {
                let opened = provider.open(&cx).await?;
                info.session_id = opened.session_id.clone();
                cx.sink.set_info(info);
                let stored = cx.sink.store().load(&opened.session_id).await?;
                cx.sink.seed(&stored).await;
                (opened, None)
            }
            Some(t) => {
                let opened = open_thread(provider.as_mut(), &cx, info, &t, self.opens_locally).await?;
                (opened, Some(t.id))
            }
        };
        // What a reattached session waits on: a call the handler says needs approval waits for
        // it; any other waits for its result (a front-end tool's, or a run on resume).
        let paused: Vec<Paused> = opened
            .pending
            .iter()
            .map(|u| Paused {
                tool_use: u.clone(),
                waiting: Some(match cx.handler.needs_approval(u) {
                    Some(summary) => Waiting::Approval { summary },
                    None => Waiting::Client,
                }),
            })
            .collect();
        Ok(Session {
            provider,
            cx,
            config: self.config,
            paused,
            approved: Arc::new(Mutex::new(std::collections::HashSet::new())),
            unanswered: opened.unanswered.clone(),
            opened,
            thread,
            unsaved: false,
            unrecorded: false,
            tools_version,
            tasks: TaskTracker::new(),
            batch: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// Opens the session, sends `prompt`, and returns the result; the whole run is bounded by the
    /// configured timeout (default 600 s), after which in-flight work is torn down, the provider
    /// asked to interrupt, and [`Error::Timeout`] returned.
    ///
    /// ```no_run
    /// # async fn f() -> tether::Result<()> {
    /// use tether::{Session, ScriptedModel, local::LocalLoop};
    /// let model = ScriptedModel::new(vec![Ok(ScriptedModel::text("hi"))]);
    /// let result = Session::builder(LocalLoop::new(model)).run("Say hi").await?;
    /// assert_eq!(result.text, "hi");
    /// # Ok(()) }
    /// ```
    pub async fn run(self, prompt: impl Into<String>) -> Result<SessionResult> {
        let timeout = self.config.timeout;
        // A timeout too large for the clock (`Duration::MAX`, a config's `u64::MAX` seconds)
        // means no deadline, never an overflow panic.
        let deadline = tokio::time::Instant::now().checked_add(timeout);
        let prompt = prompt.into();
        let opening = self.open();
        let mut session = match deadline {
            Some(at) => match tokio::time::timeout_at(at, opening).await {
                Ok(s) => s?,
                Err(_) => return Err(Error::Timeout(timeout)),
            },
            None => opening.await?,
        };
        if !session.pending_tool_uses().is_empty() {
            return Err(tools_pending());
        }
        let r = session
            .request(
                Start::Input(Input::Message(prompt)),
                CancellationToken::new(),
                deadline.map(|at| (at, timeout)),
            )
            .await;
        // Bounded: a hung endpoint cannot hold the caller after the deadline.
        let _ = tokio::time::timeout(PROVIDER_GRACE, session.provider.close()).await;
        r
    }
}

/// A fresh record key for a new thread: `s_` and 64 random bits.
fn new_record_key() -> String {
    format!("s_{:016x}", rand::random::<u64>())
}

/// Claims a thread and opens or resumes its provider session (see [`SessionBuilder::thread`]).
///
/// A thread not yet started, given first messages, is started in one store step: its provider
/// session with its first messages, which the sink then adopts ([`EventSink::adopt`]) rather than
/// writing them again. With `early` (the provider opens locally) the provider is opened before the
/// claim, and that step is the claim's own; otherwise it follows the claim and the provider's open.
async fn open_thread(
    provider: &mut dyn Provider,
    cx: &TurnContext,
    mut info: SessionInfo,
    t: &ThreadOpen,
    early: bool,
) -> Result<Opened> {
    // A new thread's record is empty: its first messages are numbered from 1.
    let first = FirstMessages::new(&t.first);
    let early = match early && !first.events.is_empty() {
        true => Some(provider.open(cx).await?),
        false => None,
    };
    let claim = match &early {
        Some(opened) => {
            let start = ThreadStart::new(provider.name(), &opened.session_id, &first.events);
            t.store
                .claim_thread_starting(&t.id, &t.agent, &new_record_key(), &t.title, &start)
                .await?
        }
        None => {
            t.store
                .claim_thread(&t.id, &t.agent, &new_record_key(), &t.title)
                .await?
        }
    };
    let (thread, created) = match claim {
        Claim::Claimed { thread, created } => (thread, created),
        Claim::Taken(other) => {
            return Err(Error::ThreadTaken {
                thread: other.id.to_string(),
                agent: other.agent,
            });
        }
    };
    info.session_id = thread.record.clone();
    info.metadata
        .insert("thread".into(), Value::String(t.id.to_string()));
    info.metadata
        .insert("agent".into(), Value::String(t.agent.clone()));
    cx.sink.set_info(info);
    let store = cx.sink.store().clone();
    // A thread this claim created has the fresh record key chosen above (64 random bits):
    // nothing is recorded under it, so there is nothing to load. Skipping the read takes one
    // store round trip off every new thread's way to its first model request (under 1,000
    // concurrent new runs, each round trip queues behind the others at the store's one writer).
    let events = if created {
        Vec::new()
    } else {
        store.load(&thread.record).await?
    };
    cx.sink.seed(&events).await;
    if created && let Some(opened) = early {
        // The claim stored the provider session and the first messages.
        return first.adopt(cx, opened).await;
    }
    if thread.provider_session.is_none() && events.is_empty() {
        let opened = match early {
            Some(opened) => opened,
            None => provider.open(cx).await?,
        };
        if first.events.is_empty() {
            t.store
                .set_provider_session(&t.id, provider.name(), &opened.session_id)
                .await?;
            return Ok(opened);
        }
        let start = ThreadStart::new(provider.name(), &opened.session_id, &first.events);
        t.store.start_thread(&t.id, &thread.record, &start).await?;
        return first.adopt(cx, opened).await;
    }
    if !thread.provider.is_empty() && thread.provider != provider.name() {
        return Err(Error::cannot_resume(
            provider.name(),
            format!(
                "thread {} was recorded by the `{}` provider; a `{}` session cannot continue it (start a new thread)",
                t.id,
                thread.provider,
                provider.name()
            ),
        ));
    }
    let checkpoint: Checkpoint = match store.state(&thread.record, CHECKPOINT).await? {
        Some(v) => serde_json::from_value(v).map_err(|e| {
            Error::store_with(format_args!("the checkpoint of thread {} is unreadable", t.id), e)
        })?,
        None => Checkpoint::default(),
    };
    let state = (!checkpoint.provider.is_null()).then_some(&checkpoint.provider);
    let from = Resume::new(thread.provider_session.as_deref(), state, checkpoint.seq, &events);
    let opened = provider.resume(from, cx).await?;
    if thread.provider_session.as_deref() != Some(opened.session_id.as_str()) {
        t.store
            .set_provider_session(&t.id, provider.name(), &opened.session_id)
            .await?;
    }
    Ok(opened)
}

/// The first messages of a thread not yet started, as the events that record them
/// ([`SessionBuilder::first_messages`]), numbered from 1.
#[derive(Default)]
struct FirstMessages {
    events: Vec<Event>,
    texts: Vec<String>,
}

impl FirstMessages {
    /// The events recording `messages` in order, as [`Session::send_messages`] records them: a
    /// message whose id came earlier in the list is left out (it would not be recorded or sent
    /// twice).
    fn new(messages: &[UserMessage]) -> Self {
        let mut out = FirstMessages::default();
        for m in messages {
            let mut e = user_message_event(m);
            if out.events.iter().any(|x| x.id == e.id) {
                continue;
            }
            e.seq = Some(out.events.len() as u64 + 1);
            out.events.push(e);
            out.texts.push(m.text.clone());
        }
        out
    }

    /// Records the first messages the thread's start step has just stored (the sink adopts
    /// them: numbered and delivered, not written again), and hands their text to the session's
    /// next request.
    async fn adopt(self, cx: &TurnContext, opened: Opened) -> Result<Opened> {
        cx.sink.adopt(self.events).await?;
        let mut texts = self.texts;
        if let Some(earlier) = opened.unanswered.clone() {
            texts.insert(0, earlier);
        }
        Ok(opened.with_unanswered(Some(texts.join("\n\n"))))
    }
}

/// The error of a request made while the session waits for tool results.
fn tools_pending() -> Error {
    Error::config(
        crate::ConfigKind::State,
        "the session waits for tool results: call submit_tool_results (or resume) first",
    )
}

/// How long a provider gets to interrupt (after a cancel or a timeout) and to close after a run's
/// timeout, so a hung endpoint cannot hold the caller.
const PROVIDER_GRACE: Duration = Duration::from_secs(10);

/// How long the engine waits, after aborting tool tasks (a tool timeout, a cancel), for them to
/// end. A task ends at its next `.await` once aborted; one blocked outside an `.await` (a
/// blocking call on an async thread) cannot be stopped and is left behind after this grace.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// A session: one provider driven by the engine, with a handler and a store.
///
/// [`Session::send`] runs one request (a prompt or a follow-up) to its end; the loop runs tool
/// uses through the handler (up to 8 at a time, results in order, errors and panics become error
/// results, each result recorded in the store's memo before the provider is resumed), applies the
/// turn limit, the turn guard and the terminal tool, and reconnects dropped streams. For a
/// long-lived session driven from elsewhere, [`Session::spawn`] returns a [`SessionHandle`].
///
/// # Tool uses from the model are checked
/// A tool use is answered from the memo only when it is *the same tool use* as the one recorded:
/// same id, same tool name, same arguments ([`ToolUse::memo_key`]). A model that reuses an id
/// for a different call gets that call run (its result memoized and recorded under its own key,
/// and handed to the provider under the id the model used, so the provider's history stays well
/// formed); the same call delivered again (a reconnect, a crash recovery) is answered from the
/// memo and not run twice. Calls of one turn that share an id but differ are all refused with an
/// error result (an approval or a result for that id could not say which call it meant); exact
/// repeats of one call in a turn run once. A call with an empty name, or naming a tool the
/// handler does not declare, gets an error result listing the available tools, without reaching
/// the handler (front-end tools, declared by the handler, still pause the request as pending).
/// Every tool use handed to the engine ends with a recorded result, or is pending (front-end).
///
/// # Cancellation and timeouts stop the work
/// A cancel ([`Session::send_cancellable`], [`SessionHandle::cancel`]), a tool's timeout
/// ([`SessionConfig::tool_timeout`]) or a run's timeout ([`SessionBuilder::run`]) aborts the tool
/// tasks it stops and waits (up to 5 s) for them to end: a tool stops at its next `.await`, and
/// what it owns is dropped (a `tokio::process::Child` spawned with `kill_on_drop` is killed). A
/// tool blocked outside an `.await` cannot be stopped and finishes on its own (a call alone in
/// its turn runs on the session's own task, so the session waits for it too; calls of a batch
/// run on tasks of their own). Each tool use the stop left without a result gets an error
/// result saying so, recorded in the memo and the record and handed to the provider (its history stays well formed), so a later resume or
/// reconnect does not run it again; [`Session::forget_tool_result`] makes it run again when the
/// same tool use is delivered next. What else a stop does depends on the provider's
/// [`Provider::interrupt`]:
/// - **local loop** ([`crate::local::LocalLoop`]): the model call in flight is dropped (its HTTP
///   stream closed, which is how a server learns to stop generating); nothing runs remotely.
/// - **Claude Managed Agents**: `user.interrupt` is posted, so the remote loop stops working (and
///   billing); custom tool uses in flight are abandoned, never re-run by a reconnect; the idle the
///   interrupt forces is not taken for the end of the next request. Built-in tools running
///   server-side stop as the service decides.
/// - **Bedrock AgentCore**: in runtime mode `StopRuntimeSession` ends the session's microVM; the
///   harness API has no stop call, so only the connection is closed and the harness may finish
///   the invocation server-side (bounded by its `timeoutSeconds`).
/// - **ACP agents**: `session/cancel` is sent and the agent's pending permission and elicitation
///   requests are answered `cancelled`; stopping is then up to the agent (it should end its
///   prompt with `cancelled`); file and terminal requests it already made are served to the end.
///
/// The provider gets 10 s to interrupt; the engine does not wait longer for it.
pub struct Session {
    provider: Box<dyn Provider>,
    cx: TurnContext,
    config: SessionConfig,
    opened: Opened,
    /// The thread the session is, when it is one.
    thread: Option<ThreadId>,
    /// A paused batch: every tool use with what it still waits for (`None`: answered, in the
    /// memo). A resume runs the batch again: answered uses come from the memo, approved ones run.
    paused: Vec<Paused>,
    /// The memo keys of the paused tool uses the application approved (each runs once).
    approved: Arc<Mutex<std::collections::HashSet<String>>>,
    /// A user message the provider never answered (from a resume): sent again with the next
    /// request.
    unanswered: Option<String>,
    /// Whether the provider may have changed since its transcript was last saved.
    unsaved: bool,
    /// Whether the engine handed the provider something the record lacks since the checkpoint
    /// was last saved (an input it did not record, results it made up), or a request failed:
    /// the next save is then not skipped (see [`Provider::state_beyond_record`]).
    unrecorded: bool,
    /// The handler's [`Handler::tools_version`] when `cx.tools` was read from it.
    tools_version: Option<u64>,
    /// The session's tool tasks: a cancel waits on it for the tasks it aborted to end.
    tasks: TaskTracker,
    /// The tool batch in flight (set when a turn hands tool uses over, cleared when they are
    /// answered), so a cancel, a timeout or a halt can answer what it stopped.
    batch: Arc<Mutex<Vec<Slot>>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("provider", &self.provider.name())
            .field("info", &self.cx.sink.info())
            .field("config", &self.config)
            .finish()
    }
}

/// One tool use of a paused batch.
#[derive(Debug, Clone)]
struct Paused {
    tool_use: ToolUse,
    /// What it still waits for; `None` once answered.
    waiting: Option<Waiting>,
}

/// One tool use of the batch in flight.
struct Slot {
    tool_use: ToolUse,
    key: String,
    state: SlotState,
}

enum SlotState {
    NotStarted,
    Running,
    /// A front-end tool: waits for a result from outside.
    Pending,
    Done(ToolResult),
}

fn slot_state(r: &Ran) -> SlotState {
    match r {
        Ok(r) => SlotState::Done(r.clone()),
        Err(_) => SlotState::Pending,
    }
}

/// Each tool use with its result, in order; a use left without one (waiting for the client or
/// the user) is not among them.
fn answered(uses: Vec<ToolUse>, results: Vec<Option<ToolResult>>) -> Vec<ToolUseResult> {
    uses.into_iter()
        .zip(results)
        .filter_map(|(u, r)| r.map(|r| ToolUseResult::new(u, r)))
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a request starts from.
enum Start {
    /// A provider input (a message is recorded as the user's first).
    Input(Input),
    /// User messages already recorded (or being sent again): the provider gets their text.
    Recorded {
        /// The messages' text, joined.
        text: String,
        /// Exactly one recorded message, as a resume would replay it (so the provider's state
        /// after it is rebuilt from the record and needs no checkpoint).
        exact: bool,
    },
    /// Tool uses a paused or reattached session waits on: run them (answers the application
    /// wrote for them count), then continue with their results.
    Pending(Vec<ToolUse>),
}

#[derive(Default)]
struct Acc {
    texts: Vec<String>,
    tool_uses: Vec<ToolUse>,
    /// The memo keys of `tool_uses`.
    keys: std::collections::HashSet<String>,
    server_tool_uses: Vec<ToolUse>,
    usage: Usage,
    turns: u32,
    final_output: Option<Value>,
    terminal_called: bool,
}

impl Acc {
    /// Takes in a turn's result; `keys` are its tool uses' memo keys, in order.
    fn absorb(&mut self, tr: &TurnResult, keys: &[String]) {
        self.texts.push(tr.text.clone());
        for (u, key) in tr.tool_uses.iter().zip(keys) {
            self.add_tool_use(u, key);
        }
        self.server_tool_uses.extend(tr.server_tool_uses.iter().cloned());
        if let Some(u) = &tr.usage {
            self.usage.add(u);
        }
    }

    /// Adds a tool use unless the same tool use (id, name, arguments: its memo key `key`) is
    /// there already.
    fn add_tool_use(&mut self, u: &ToolUse, key: &str) {
        if self.keys.insert(key.to_owned()) {
            self.tool_uses.push(u.clone());
        }
    }
}

impl Session {
    /// Starts building a session on `provider`.
    pub fn builder(provider: impl Provider) -> SessionBuilder {
        Self::builder_boxed(Box::new(provider))
    }

    /// Starts building a session on an already boxed provider.
    pub fn builder_boxed(provider: Box<dyn Provider>) -> SessionBuilder {
        SessionBuilder {
            provider,
            handler: Arc::new(NoTools),
            store: Arc::new(MemoryStore::default()),
            config: SessionConfig::default(),
            thread: None,
            subscribers: Vec::new(),
            observer: None,
            priority: None,
            opens_locally: false,
        }
    }

    /// The session's identity.
    pub fn info(&self) -> Arc<SessionInfo> {
        self.cx.sink.info()
    }

    /// The session's event pipeline (subscribe to it for live events).
    pub fn sink(&self) -> &EventSink {
        &self.cx.sink
    }

    /// What opening the session learned (reattached? pending tool uses?).
    pub fn opened(&self) -> &Opened {
        &self.opened
    }

    /// The thread the session is, when it was opened as one ([`SessionBuilder::thread`]).
    pub fn thread(&self) -> Option<&ThreadId> {
        self.thread.as_ref()
    }

    /// The provider's name.
    pub fn provider_name(&self) -> &str {
        self.provider.name()
    }

    /// Tool uses waiting for something from outside (a front-end tool's result, the user's
    /// approval), if the last request paused or a resume found them.
    pub fn pending_tool_uses(&self) -> Vec<ToolUse> {
        self.paused
            .iter()
            .filter(|p| p.waiting.is_some())
            .map(|p| p.tool_use.clone())
            .collect()
    }

    /// Whether a request is paused: a batch of tool uses waits (some perhaps already answered);
    /// [`Session::resume`] goes on with it.
    pub fn is_paused(&self) -> bool {
        !self.paused.is_empty()
    }

    /// [`Self::pending_tool_uses`], each with what it waits for.
    pub fn pending(&self) -> Vec<PendingToolUse> {
        self.paused
            .iter()
            .filter_map(|p| {
                p.waiting.clone().map(|waiting| PendingToolUse {
                    tool_use: p.tool_use.clone(),
                    waiting,
                })
            })
            .collect()
    }

    /// Whether a user message with this client id is in the session's record already (sent in
    /// an earlier request: a client that sends its whole history sends it again).
    pub fn knows_message(&self, id: &str) -> impl std::future::Future<Output = bool> + Send + 'static {
        let sink = self.cx.sink.clone();
        let key = user_event_id(id);
        async move { sink.has_seen(&key).await }
    }

    /// The provider's resumable state ([`Provider::checkpoint`]), if it keeps one.
    pub fn checkpoint(&self) -> Option<Value> {
        self.provider.checkpoint()
    }

    /// Runs one request: a prompt or follow-up message, to its end.
    ///
    /// Fails with [`Error::Config`] while tool uses are pending: submit their results first.
    pub async fn send(&mut self, text: impl Into<String>) -> Result<SessionResult> {
        self.send_cancellable(text, CancellationToken::new()).await
    }

    /// [`Session::send`], stopped early when `cancel` fires: the turn in flight is dropped, the
    /// tool tasks in flight are aborted (see the type's docs), the provider asked to interrupt,
    /// and [`Error::Cancelled`] returned.
    pub async fn send_cancellable(
        &mut self,
        text: impl Into<String>,
        cancel: CancellationToken,
    ) -> Result<SessionResult> {
        self.send_messages(vec![UserMessage::new(text)], cancel).await
    }

    /// Runs one request from user messages that carry the client's ids (an AG-UI request's new
    /// messages). Each is recorded once, as a [`raw::USER_MESSAGE`] event whose id is `user:` and
    /// the client's id: a message already in the record (a client resending its history, a
    /// redelivered request) is neither recorded nor sent again. The provider gets the new texts
    /// (after a message a resume found unanswered, see [`Opened::unanswered`]) as one message;
    /// with nothing new and nothing unanswered the request ends at once with stop reason `idle`.
    ///
    /// Fails with [`Error::Config`] while tool uses are pending: answer them, or give them up
    /// with [`Session::abandon_pending_tools`], first.
    pub async fn send_messages(
        &mut self,
        messages: Vec<UserMessage>,
        cancel: CancellationToken,
    ) -> Result<SessionResult> {
        if !self.pending_tool_uses().is_empty() {
            return Err(tools_pending());
        }
        let mut texts: Vec<String> = Vec::new();
        // A text resent from before may be several messages joined: not as the record has it.
        let mut exact = true;
        if let Some(t) = self.unanswered.take() {
            texts.push(t);
            exact = false;
        }
        for m in messages {
            let recorded = self.cx.sink.emit(user_message_event(&m)).await?;
            if recorded {
                texts.push(m.text);
            }
        }
        if texts.is_empty() {
            return Ok(self.idle_result().await);
        }
        // Several messages go to the provider as one, which the record does not hold.
        let exact = exact && texts.len() == 1;
        let text = texts.join("\n\n");
        self.request(Start::Recorded { text, exact }, cancel, None).await
    }

    /// Runs one request from any [`Input`]: a provider-specific raw input such as a Managed
    /// Agents `user.define_outcome` event, or a message. Same rules as [`Session::send`].
    pub async fn send_input(&mut self, input: Input, cancel: CancellationToken) -> Result<SessionResult> {
        if let Input::Message(text) = input {
            return self.send_messages(vec![UserMessage::new(text)], cancel).await;
        }
        if !self.pending_tool_uses().is_empty() {
            return Err(tools_pending());
        }
        self.request(Start::Input(input), cancel, None).await
    }

    /// Records an answer from outside for a pending tool use (a front-end tool's result, a
    /// denial the user gave): memoized under the use's memo key and recorded once, exactly as a
    /// result the engine produced, so a later resume (in this process or after a restart) takes
    /// it. Returns `false` (recording nothing) when no pending use has the result's id. The
    /// session stays paused until [`Session::resume`].
    pub async fn answer_tool_use(&mut self, result: ToolResult) -> Result<bool> {
        let Some(i) = self
            .paused
            .iter()
            .position(|p| p.waiting.is_some() && p.tool_use.id == result.tool_use_id)
        else {
            return Ok(false);
        };
        let key = current_key(&self.cx.sink, &self.paused[i].tool_use).await;
        let sid = self.info().session_id.clone();
        store_result(&self.cx, &sid, &key, &result).await?;
        self.paused[i].waiting = None;
        Ok(true)
    }

    /// Approves the pending tool use with this id that waits for approval: the next
    /// [`Session::resume`] runs it, once, provided it is still exactly that call (same id, tool
    /// and arguments). Returns `false` when no such use waits.
    pub async fn approve(&mut self, tool_use_id: &str) -> bool {
        let Some(p) = self
            .paused
            .iter()
            .find(|p| matches!(p.waiting, Some(Waiting::Approval { .. })) && p.tool_use.id == tool_use_id)
        else {
            return false;
        };
        let key = current_key(&self.cx.sink, &p.tool_use).await;
        lock(&self.approved).insert(key);
        true
    }

    /// Resumes a paused request with results for its pending tool uses (front-end tools), or a
    /// reattached session with results for what it waited on: each result is recorded
    /// ([`Session::answer_tool_use`]), then the session resumes ([`Session::resume`]). Results for
    /// unknown ids are ignored; uses still without a result keep the session paused.
    pub async fn submit_tool_results(
        &mut self,
        results: Vec<ToolResult>,
        cancel: CancellationToken,
    ) -> Result<SessionResult> {
        for r in results {
            self.answer_tool_use(r).await?;
        }
        self.resume(cancel).await
    }

    /// Gives up on the pending tool uses (front-end tools nobody answered, approvals nobody gave):
    /// each gets an error result saying `reason`, recorded in the store and handed to the
    /// provider's history, so the next [`Session::send`] can start a new request instead of
    /// failing.
    pub async fn abandon_pending_tools(&mut self, reason: &str) -> Result<()> {
        let batch = std::mem::take(&mut self.paused);
        if batch.is_empty() {
            return Ok(());
        }
        let sid = self.info().session_id.clone();
        let mut answered = Vec::with_capacity(batch.len());
        for p in batch {
            let key = current_key(&self.cx.sink, &p.tool_use).await;
            if p.waiting.is_some() {
                store_result(&self.cx, &sid, &key, &ToolResult::error(&p.tool_use.id, reason)).await?;
            }
            let mut r = self
                .cx
                .sink
                .store()
                .tool_result(&sid, &key)
                .await?
                .unwrap_or_else(|| ToolResult::error(&p.tool_use.id, reason));
            r.tool_use_id = p.tool_use.id.clone();
            answered.push(ToolUseResult::new(p.tool_use, r));
        }
        self.record_tool_results(&answered).await?;
        self.checkpoint_now().await
    }

    /// Forgets the recorded result of `tool_use` (matched by id, name and arguments), so the next
    /// time a provider hands the engine this same tool use (a resume, a reconnect) it is run
    /// again instead of answered from the memo.
    ///
    /// This is how a user asks for a tool that a cancel or a timeout stopped (whose recorded
    /// result says so) to run again. The memo keeps the old result; the forgetting is itself
    /// recorded (a `tether.tool_result_forgotten` event), and the next run's result is memoized
    /// and recorded under a new key. Returns whether a result was recorded to forget.
    pub async fn forget_tool_result(&mut self, tool_use: &ToolUse) -> Result<bool> {
        let key = current_key(&self.cx.sink, tool_use).await;
        let sid = self.info().session_id.clone();
        if self.cx.sink.store().tool_result(&sid, &key).await?.is_none() {
            return Ok(false);
        }
        self.cx
            .sink
            .record(
                format!("tool_forget:{key}"),
                raw::TOOL_RESULT_FORGOTTEN,
                json!({"tool_use_id": tool_use.id, "name": tool_use.name, "key": key}),
                EventKind::Other,
            )
            .await?;
        Ok(true)
    }

    /// Resumes a paused or reattached session: runs the tool uses it waits on again (answers
    /// recorded for them count, approved ones run, the rest stay pending) and continues. With
    /// nothing pending it sends a user message a resume found unanswered
    /// ([`Opened::unanswered`]), or returns at once with stop reason `idle`.
    ///
    /// Answers the application stored for a pending use by its id (an approval's denial, a
    /// front-end result) count as its result; uses already run (same id, name and arguments) are
    /// answered from the memo, cancelled and timed-out ones included (see
    /// [`Session::forget_tool_result`]).
    pub async fn resume(&mut self, cancel: CancellationToken) -> Result<SessionResult> {
        if self.paused.is_empty() {
            return match self.unanswered.take() {
                Some(text) => {
                    self.request(Start::Recorded { text, exact: false }, cancel, None)
                        .await
                }
                None => Ok(self.idle_result().await),
            };
        }
        let uses: Vec<ToolUse> = std::mem::take(&mut self.paused)
            .into_iter()
            .map(|p| p.tool_use)
            .collect();
        self.request(Start::Pending(uses), cancel, None).await
    }

    async fn idle_result(&mut self) -> SessionResult {
        SessionResult {
            terminal: Terminal::EndTurn,
            stop_reason: StopReason::Idle,
            session_id: self.info().session_id.clone(),
            text: String::new(),
            texts: Vec::new(),
            tool_uses: Vec::new(),
            server_tool_uses: Vec::new(),
            pending_tool_uses: Vec::new(),
            final_output: None,
            usage: Usage::default(),
            turns: 0,
            events: self.cx.sink.take_record().await,
        }
    }

    /// Closes the provider's side of the session.
    pub async fn close(mut self) -> Result<()> {
        self.provider.close().await
    }

    /// Runs a request until it ends, `cancel` fires ([`Error::Cancelled`]) or the deadline passes
    /// ([`Error::Timeout`] with the configured duration); a stop tears down the work in flight.
    async fn request(
        &mut self,
        start: Start,
        cancel: CancellationToken,
        deadline: Option<(tokio::time::Instant, Duration)>,
    ) -> Result<SessionResult> {
        // Handlers may change their tools between requests (AG-UI front-end tools do).
        self.refresh_tools();
        lock(&self.batch).clear();
        // Marks cost nothing without an observer (`EventSink::mark` checks), as at the end.
        let input = match &start {
            Start::Input(Input::Message(_)) => RunInput::Message,
            Start::Input(Input::ToolResults(..)) => RunInput::ToolResults,
            Start::Input(Input::Continue) => RunInput::Continue,
            Start::Input(Input::Raw(_)) => RunInput::Raw,
            Start::Recorded { .. } => RunInput::Message,
            Start::Pending(_) => RunInput::Resume,
        };
        self.cx.sink.mark(Mark::RunStart {
            provider: self.provider.name(),
            input,
        });
        let stop = async {
            match deadline {
                Some((at, d)) => tokio::select! {
                    _ = cancel.cancelled() => Error::Cancelled,
                    _ = tokio::time::sleep_until(at) => Error::Timeout(d),
                },
                None => {
                    cancel.cancelled().await;
                    Error::Cancelled
                }
            }
        };
        let outcome = tokio::select! {
            biased;
            e = stop => Err(e),
            r = self.drive(start) => Ok(r),
        };
        let was_stopped = outcome.is_err();
        let r = match outcome {
            Ok(r) => r,
            Err(stopped) => {
                let why = match &stopped {
                    Error::Timeout(_) => "the run timed out",
                    _ => "the request was cancelled",
                };
                // The drive future is gone: its tool tasks were aborted as it was dropped.
                stop_tasks(&self.tasks).await;
                let _ = tokio::time::timeout(PROVIDER_GRACE, self.provider.interrupt()).await;
                if let Err(e) = Box::pin(self.settle(why)).await {
                    tracing::warn!(error = %e, "could not record the tool uses a stop left unanswered");
                }
                Err(stopped)
            }
        };
        if r.is_err() {
            // The failed request's events are in the store; the next result must not carry them.
            let _ = self.cx.sink.take_record().await;
            // Whatever the provider holds now, the next save writes it.
            self.unrecorded = true;
        }
        // A request that failed in a provider call is not checkpointed: the provider's state may
        // hold a half-done turn (a user message it never answered), which a resume from the last
        // checkpoint and the record sees, and sends again, instead. A stop (cancel, timeout)
        // answered the tool uses it stopped: that is saved.
        let r = if r.is_ok() || was_stopped {
            match self.checkpoint_now().await {
                Ok(()) => r,
                Err(e) => Err(e),
            }
        } else {
            r
        };
        self.cx.sink.mark(Mark::RunEnd { result: &r });
        r
    }

    /// Answers the tool batch in flight after a stop (`why`): uses not yet run, running, or
    /// waiting on a front-end get an error result (memoized and recorded), and the whole batch is
    /// handed to the provider, whose history then holds an answer for every call.
    ///
    /// Its callers box it: a stop is rare, and inline its 2.6 KB future sized every request's
    /// future (`request`, `drive`) for the whole of every turn.
    async fn settle(&mut self, why: &str) -> Result<()> {
        let slots = std::mem::take(&mut *lock(&self.batch));
        if slots.is_empty() {
            return Ok(());
        }
        let sid = self.info().session_id.clone();
        let mut answered = Vec::with_capacity(slots.len());
        for Slot {
            tool_use: u,
            key,
            state,
        } in slots
        {
            let r = match state {
                SlotState::Done(r) => r,
                state => {
                    let text = match state {
                        SlotState::Running => format!(
                            "tool `{}` was stopped before it finished: {why}. It may have partly run. It is not run again on resume unless its recorded result is forgotten.",
                            shown(&u.name)
                        ),
                        _ => format!("tool `{}` was not run: {why}.", shown(&u.name)),
                    };
                    let r = ToolResult::error(&u.id, text);
                    store_result(&self.cx, &sid, &key, &r).await?;
                    // First record wins: a result that landed in the memo first is the answer.
                    match self.cx.sink.store().tool_result(&sid, &key).await? {
                        Some(mut m) => {
                            m.tool_use_id = u.id.clone();
                            m
                        }
                        None => r,
                    }
                }
            };
            answered.push(ToolUseResult::new(u, r));
        }
        self.record_tool_results(&answered).await
    }

    /// Notes the tool uses a turn handed over, before anything else happens to them; `keys` are
    /// their memo keys ([`memo_keys`]).
    fn hand_over(&self, uses: &[ToolUse], keys: &[String]) {
        *lock(&self.batch) = uses
            .iter()
            .zip(keys)
            .map(|(u, key)| Slot {
                tool_use: u.clone(),
                key: key.clone(),
                state: SlotState::NotStarted,
            })
            .collect();
    }

    /// Saves the checkpoint (state key [`CHECKPOINT`]: the provider's state and the sequence
    /// number it covers) so a crash loses at most the turn in flight: called after every turn and
    /// at the end of every request. Nothing is written when the provider was not called since
    /// the last save (a request that ends with the turn just saved), for a provider that keeps
    /// no state, nor when the record holds everything the provider got since the last save
    /// (neither the provider nor the engine noted anything beyond it, see
    /// [`Provider::state_beyond_record`]): a resume rebuilds the state from the saved checkpoint
    /// and the record after it.
    async fn checkpoint_now(&mut self) -> Result<()> {
        self.checkpoint_saver().await.await
    }

    /// [`Session::checkpoint_now`] in two steps: takes the provider's state and the sequence
    /// number it covers now, and returns the write, which owns them, so it can run beside other
    /// work (a turn's tool calls).
    async fn checkpoint_saver(&mut self) -> impl std::future::Future<Output = Result<()>> + Send + 'static {
        let state = match std::mem::take(&mut self.unsaved) {
            // Skipped when the record holds everything since the last save: a resume rebuilds
            // the same state from that checkpoint and the record after it.
            true => {
                let beyond = self.provider.state_beyond_record();
                match std::mem::take(&mut self.unrecorded) || beyond {
                    true => self.provider.checkpoint(),
                    false => None,
                }
            }
            false => None,
        };
        let sink = self.cx.sink.clone();
        let seq = match state {
            Some(_) => sink.last_seq().await,
            None => 0,
        };
        async move {
            if let Some(provider) = state {
                let sid = sink.info().session_id.clone();
                sink.store()
                    .put_state_owned(&sid, CHECKPOINT, checkpoint_value(seq, provider))
                    .await?;
            }
            Ok(())
        }
    }

    async fn drive(&mut self, start: Start) -> Result<SessionResult> {
        let mut acc = Acc::default();
        let first = match start {
            Start::Input(i) => {
                // An input given directly (`run`'s prompt, a raw input, results from outside) is
                // in no record.
                if !matches!(i, Input::Continue) {
                    self.unrecorded = true;
                }
                i
            }
            Start::Recorded { text, exact } => {
                self.unrecorded |= !exact;
                Input::Message(text)
            }
            Start::Pending(uses) => {
                let keys = memo_keys(&uses);
                self.hand_over(&uses, &keys);
                let (results, pending) = self.runner().run(&uses, &keys, true).await?;
                if !pending.is_empty() {
                    lock(&self.batch).clear();
                    self.pause(uses, &pending);
                    return Ok(self.paused_result().await);
                }
                lock(&self.batch).clear();
                Input::ToolResults(answered(uses, results))
            }
        };
        let mut input = first;
        let mut reprompts_left = self.config.max_reprompts;
        let terminal_name = self.config.terminal_tool.as_ref().map(|t| t.name.clone());
        loop {
            if acc.turns >= self.config.max_turns {
                if let Input::ToolResults(answered) = &input {
                    // Answered but never sent: the provider's history still gets the answers.
                    self.record_tool_results(answered).await?;
                }
                return Ok(self
                    .finish(acc, Terminal::Terminated, StopReason::MaxTurns, Vec::new())
                    .await);
            }
            self.cx.turn = acc.turns + 1;
            let tr = self.turn_with_reconnect(input, &mut acc).await?;
            acc.turns += 1;
            // Each use's memo key, computed once (a SHA-256 of its canonical arguments).
            let keys = memo_keys(&tr.tool_uses);
            acc.absorb(&tr, &keys);
            if tr.terminal == Terminal::RequiresAction {
                self.hand_over(&tr.tool_uses, &keys);
            }
            // A turn that hands tool uses over saves its checkpoint while they run: the save
            // holds the provider's state as of the turn's end, taken now, and the tools' results
            // are memoized and recorded on their own (a resume replays the record after the
            // checkpoint), so it need not come first; the first call then starts a store round
            // trip earlier. Any other turn saves it now.
            let saving = self.checkpoint_saver().await;
            let mut saving = if tr.terminal == Terminal::RequiresAction && !tr.tool_uses.is_empty() {
                Some(saving)
            } else {
                saving.await?;
                None
            };
            if let Some(g) = &self.config.turn_guard {
                let gi = GuardInfo {
                    turns: acc.turns,
                    usage: acc.usage.clone(),
                    session_id: self.info().session_id.clone(),
                };
                let g = g.clone();
                match std::panic::catch_unwind(AssertUnwindSafe(|| g(&gi))) {
                    Ok(GuardDecision::Continue) => {}
                    Ok(GuardDecision::Halt(reason)) => {
                        if let Some(saving) = saving.take() {
                            saving.await?;
                        }
                        // The turn's tool uses are answered (not run), so the history stays whole.
                        Box::pin(self.settle(&format!("the session was halted ({reason})"))).await?;
                        let sr = StopReason::Halted { reason };
                        return Ok(self.finish(acc, Terminal::Terminated, sr, Vec::new()).await);
                    }
                    Err(p) => return Err(Error::Guard(panic_message(p.as_ref()))),
                }
            }
            match tr.terminal {
                Terminal::RequiresAction => {
                    let uses = tr.tool_uses;
                    if uses.is_empty() {
                        input = Input::Continue;
                        continue;
                    }
                    let (ran, saved) = match saving.take() {
                        Some(saving) => {
                            futures_util::future::join(self.runner().run(&uses, &keys, false), saving).await
                        }
                        None => (self.runner().run(&uses, &keys, false).await, Ok(())),
                    };
                    if let Err(e) = saved {
                        // The calls that ran are memoized and recorded: the provider gets their
                        // results (and the others an error result), so its history stays whole.
                        Box::pin(self.settle("the checkpoint could not be saved")).await?;
                        return Err(e);
                    }
                    let (results, pending) = ran?;
                    if let Some(t) = uses.iter().find(|u| Some(&u.name) == terminal_name.as_ref()) {
                        acc.terminal_called = true;
                        acc.final_output = Some(t.input.clone());
                        let done: Vec<ToolUseResult> = results
                            .iter()
                            .zip(&uses)
                            .map(|(r, u)| {
                                let r = r
                                    .clone()
                                    .unwrap_or_else(|| ToolResult::error(&u.id, "not run: the run ended"));
                                ToolUseResult::new(u.clone(), r)
                            })
                            .collect();
                        lock(&self.batch).clear();
                        self.record_tool_results(&done).await?;
                        return Ok(self
                            .finish(acc, Terminal::EndTurn, StopReason::TerminalTool, Vec::new())
                            .await);
                    }
                    lock(&self.batch).clear();
                    if !pending.is_empty() {
                        let waiting = pending.iter().map(|p| p.tool_use.clone()).collect();
                        self.pause(uses, &pending);
                        return Ok(self
                            .finish(acc, Terminal::RequiresAction, StopReason::PendingTools, waiting)
                            .await);
                    }
                    input = Input::ToolResults(answered(uses, results));
                }
                Terminal::EndTurn => {
                    if let Some(name) = &terminal_name
                        && !acc.terminal_called
                    {
                        if reprompts_left > 0 {
                            reprompts_left -= 1;
                            let text = format!(
                                "You ended your turn without calling the `{name}` tool. You MUST call `{name}` now to finish, with your final answer as its input."
                            );
                            let recorded = self
                                .cx
                                .sink
                                .record(
                                    "",
                                    raw::REPROMPT,
                                    json!({"text": text}),
                                    EventKind::Directive {
                                        role: "reprompt".into(),
                                        text: text.clone(),
                                    },
                                )
                                .await?;
                            self.unrecorded |= !recorded;
                            input = Input::Message(text);
                            continue;
                        }
                        return Ok(self
                            .finish(acc, Terminal::EndTurn, StopReason::NoTerminalTool, Vec::new())
                            .await);
                    }
                    return Ok(self
                        .finish(acc, Terminal::EndTurn, tr.stop_reason, Vec::new())
                        .await);
                }
                Terminal::Terminated => {
                    return Ok(self
                        .finish(acc, Terminal::Terminated, tr.stop_reason, Vec::new())
                        .await);
                }
            }
        }
    }

    fn runner(&self) -> ToolRunner<'_> {
        ToolRunner {
            cx: &self.cx,
            config: &self.config,
            tasks: &self.tasks,
            batch: &self.batch,
            approved: &self.approved,
        }
    }

    /// Keeps a batch that some uses left waiting: the next resume runs it again.
    fn pause(&mut self, uses: Vec<ToolUse>, pending: &[PendingToolUse]) {
        self.paused = uses
            .into_iter()
            .map(|u| {
                let waiting = pending
                    .iter()
                    .find(|p| p.tool_use.id == u.id)
                    .map(|p| p.waiting.clone());
                Paused { tool_use: u, waiting }
            })
            .collect();
    }

    /// Hands tool results to the provider without a turn (its checkpoint then needs saving: a
    /// rebuild from the record takes results no turn followed for a batch still pending).
    async fn record_tool_results(&mut self, answered: &[ToolUseResult]) -> Result<()> {
        self.unsaved = true;
        self.unrecorded = true;
        self.provider.record_tool_results(answered).await
    }

    async fn turn_with_reconnect(&mut self, input: Input, acc: &mut Acc) -> Result<TurnResult> {
        self.unsaved = true;
        // A tool source's list may change between turns (an MCP server's `list_changed`).
        self.refresh_tools();
        let mut input = Some(input);
        let mut attempts = 0u32;
        loop {
            let inp = input.take().unwrap_or(Input::Continue);
            let mut err = match self.provider.turn(inp, &self.cx).await {
                Ok(tr) => return Ok(tr),
                Err(e) => e,
            };
            if !self.provider.can_reconnect() || !err.is_transient() {
                return Err(err);
            }
            // Back off and reconnect until it works, the error is final, or the tries run out
            // (then the last error is returned; every attempt is in the record).
            let pending = loop {
                let Some(delay) = self.config.reconnect.delay_for(&err, attempts) else {
                    return Err(err);
                };
                attempts += 1;
                let delay_ms = delay.as_millis() as u64;
                // Boxed: a reconnect is rare, and a record's future (2 KB) inline sized the
                // session's request future by that much for the whole of every turn.
                Box::pin(self.cx.sink.record(
                    "",
                    raw::RECONNECT,
                    json!({"attempt": attempts, "delay_ms": delay_ms, "error": err.to_string()}),
                    EventKind::Retry {
                        attempt: attempts,
                        delay_ms,
                        error: err.to_string(),
                    },
                ))
                .await?;
                self.config.reconnect.sleeper.sleep(delay).await;
                match self.provider.reconnect(&self.cx).await {
                    Ok(p) => break p,
                    Err(e) if e.is_transient() => err = e,
                    Err(e) => return Err(e),
                }
            };
            if pending.is_empty() {
                input = Some(Input::Continue);
            } else {
                let keys = memo_keys(&pending);
                for (u, key) in pending.iter().zip(&keys) {
                    acc.add_tool_use(u, key);
                }
                self.hand_over(&pending, &keys);
                let (results, _pending) = self.runner().run(&pending, &keys, true).await?;
                lock(&self.batch).clear();
                self.unrecorded |= results.iter().any(Option::is_none);
                let answered = pending
                    .into_iter()
                    .zip(results)
                    .map(|(u, r)| {
                        let r = r.unwrap_or_else(|| ToolResult::error(&u.id, "this tool is not run here"));
                        ToolUseResult::new(u, r)
                    })
                    .collect();
                input = Some(Input::ToolResults(answered));
            }
        }
    }
}

/// Waits (bounded) for every tool task of the session to end: after an abort, the tasks end at
/// their next `.await`.
async fn stop_tasks(tasks: &TaskTracker) {
    tasks.close();
    if tokio::time::timeout(STOP_GRACE, tasks.wait()).await.is_err() {
        tracing::warn!(
            "a tool did not stop within {STOP_GRACE:?} of its abort (blocked outside an .await); it is left to finish"
        );
    }
    tasks.reopen();
}

/// Aborts its task when dropped: a tool whose future is dropped (a cancel, a timeout, a request
/// torn down) must not keep running on its own.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What running a batch of tool uses needs of the session.
struct ToolRunner<'a> {
    cx: &'a TurnContext,
    config: &'a SessionConfig,
    tasks: &'a TaskTracker,
    batch: &'a Mutex<Vec<Slot>>,
    approved: &'a Mutex<std::collections::HashSet<String>>,
}

/// How a tool call's future ended without an output.
enum Stopped {
    /// It panicked, with this message.
    Panicked(String),
    /// Its task failed otherwise (cancelled by the runtime shutting down).
    Failed(String),
}

/// What running one tool use came to: its result, or what it waits for.
type Ran = std::result::Result<ToolResult, Waiting>;

/// What is done with one tool use of a batch.
#[derive(Clone)]
enum Plan {
    Run,
    /// An exact repeat (same id, name and arguments) of the use at this index: answered with its
    /// result.
    SameAs(usize),
    /// Refused with this error text.
    Refuse(String),
}

impl ToolRunner<'_> {
    /// Runs tool uses through the handler, up to `tool_concurrency` at a time, results in order.
    /// `None` marks a use whose tool is not run here (pending); those are also returned apart.
    ///
    /// `by_id`: answers stored by the application under a use's bare id (for pending uses of a
    /// reattached session or a reconnect) count as its result.
    async fn run(
        &self,
        uses: &[ToolUse],
        base_keys: &[String],
        by_id: bool,
    ) -> Result<(Vec<Option<ToolResult>>, Vec<PendingToolUse>)> {
        let info = self.cx.sink.info();
        let sid = info.session_id.as_str();
        let mut keys = Vec::with_capacity(uses.len());
        for base in base_keys {
            keys.push(current_key_from(&self.cx.sink, base).await);
        }
        let plan = plan_batch(uses, &keys);
        // A call alone in its batch runs on the session's own task: spawning it would only add
        // a task hop there and back (a wake-up of another thread when the session runs on one
        // outside the runtime's workers) to each call.
        let inline = plan.iter().filter(|p| matches!(p, Plan::Run)).count() == 1;
        {
            let mut b = lock(self.batch);
            for (slot, key) in b.iter_mut().zip(&keys) {
                slot.key = key.clone();
            }
        }
        type Fut<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Option<Ran>>> + Send + 'a>>;
        let futs: Vec<Fut<'_>> = uses
            .iter()
            .zip(&keys)
            .zip(&plan)
            .enumerate()
            .map(|(i, ((u, key), p))| {
                Box::pin(async move {
                    let r = match p {
                        Plan::SameAs(_) => return Ok(None),
                        Plan::Refuse(text) => {
                            let r = ToolResult::error(&u.id, text.clone());
                            store_result(self.cx, sid, key, &r).await?;
                            Ok(r)
                        }
                        Plan::Run => {
                            self.set_state(i, SlotState::Running);
                            self.run_one(u, key, by_id, sid, inline).await?
                        }
                    };
                    self.set_state(i, slot_state(&r));
                    Ok(Some(r))
                }) as Fut<'_>
            })
            .collect();
        let outs: Vec<Result<Option<Ran>>> = futures_util::stream::iter(futs)
            .buffered(self.config.tool_concurrency.max(1))
            .collect()
            .await;
        let mut ran: Vec<Option<Ran>> = Vec::with_capacity(uses.len());
        for o in outs {
            ran.push(o?);
        }
        for (i, p) in plan.iter().enumerate() {
            if let Plan::SameAs(j) = p {
                let r = ran[*j].clone();
                if let Some(r) = &r {
                    self.set_state(i, slot_state(r));
                }
                ran[i] = r;
            }
        }
        let mut results = Vec::with_capacity(uses.len());
        let mut pending = Vec::new();
        for (u, r) in uses.iter().zip(ran) {
            match r {
                Some(Ok(r)) => results.push(Some(r)),
                Some(Err(waiting)) => {
                    results.push(None);
                    pending.push(PendingToolUse {
                        tool_use: u.clone(),
                        waiting,
                    });
                }
                None => results.push(None),
            }
        }
        Ok((results, pending))
    }

    /// Takes the approval of the call under `key`, if the application gave one (used once).
    fn take_approval(&self, key: &str) -> bool {
        lock(self.approved).remove(key)
    }

    fn set_state(&self, i: usize, state: SlotState) {
        if let Some(s) = lock(self.batch).get_mut(i) {
            s.state = state;
        }
    }

    /// Runs one tool use: answered from the memo when it ran before, else through the handler,
    /// on a task of its own, or on this one when `inline` (it is alone in its batch).
    async fn run_one(&self, u: &ToolUse, key: &str, by_id: bool, sid: &str, inline: bool) -> Result<Ran> {
        let cx = self.cx;
        let store = cx.sink.store();
        if let Some(mut r) = store.tool_result(sid, key).await? {
            // The same tool use was run before (a redelivery). The memo is written before the
            // event (`store_result`): a crash between the two leaves a result the next run
            // answers from but the record lacks. Record it now; `emit` is exactly-once by id, so a
            // result already in the record is not written again.
            r.tool_use_id = u.id.clone();
            record_result(&cx.sink, key, &r).await?;
            return Ok(Ok(r));
        }
        // An answer the application stored for this pending use by its id. An id shaped like a
        // memo key is never looked up bare: a model naming its call after another call's key
        // would be answered with that call's result.
        if by_id
            && !looks_like_memo_key(&u.id)
            && let Some(r) = store.tool_result(sid, &u.id).await?
        {
            record_result(&cx.sink, &u.id, &r).await?;
            return Ok(Ok(r));
        }
        let result = if Some(u.name.as_str()) == self.config.terminal_tool.as_ref().map(|t| t.name.as_str()) {
            ToolResult::ok(&u.id, "Done.")
        } else if let Some(refusal) = check_call(cx, u) {
            ToolResult::error(&u.id, refusal)
        } else if let Some(summary) = cx.handler.needs_approval(u)
            && !self.take_approval(key)
        {
            return Ok(Err(Waiting::Approval { summary }));
        } else {
            let handler = cx.handler.clone();
            // The tool's start, for a tracer (a mark: not recorded, not delivered).
            cx.sink.mark(Mark::ToolStart { tool_use: u });
            // The tool call's trace context, for a handler that passes it on (MCP `_meta`): the
            // session's info as it is when that is what it holds already (untraced), else a copy.
            let info = cx.sink.info();
            let traceparent = cx.sink.traceparent(&u.id);
            let info = if info.traceparent == traceparent {
                info
            } else {
                let mut copy = (*info).clone();
                copy.traceparent = traceparent;
                Arc::new(copy)
            };
            // The call can report progress into the session (`ToolEvents::current`).
            let events = crate::source::ToolEvents::new(cx.sink.clone(), &u.id);
            // The call's clock: time the call spends waiting for the user (a source pauses it)
            // does not count against the tool timeout.
            let clock = events.clock().clone();
            let joined = match inline {
                true => {
                    // On this task: the call borrows the use instead of a copy of it. Dropped (so
                    // stopped at its next `.await`) on a timeout or with the request.
                    let call = events.scope(async { handler.call_tool(u, &info).await });
                    let call = AssertUnwindSafe(call).catch_unwind();
                    match self.config.tool_timeout {
                        Some(d) => clock.timeout(d, call).await,
                        None => Some(call.await),
                    }
                    .map(|j| j.map_err(|p| Stopped::Panicked(panic_message(p.as_ref()))))
                }
                false => {
                    let call = u.clone();
                    let call = events.scope(async move { handler.call_tool(&call, &info).await });
                    let mut task = AbortOnDrop(self.tasks.spawn(call));
                    let joined = match self.config.tool_timeout {
                        Some(d) => clock.timeout(d, &mut task.0).await,
                        None => Some((&mut task.0).await),
                    };
                    if joined.is_none() {
                        task.0.abort();
                        if tokio::time::timeout(STOP_GRACE, &mut task.0).await.is_err() {
                            tracing::warn!(tool = %u.name, "a timed-out tool did not stop within {STOP_GRACE:?}");
                        }
                    }
                    joined.map(|j| {
                        j.map_err(|e| match e.is_panic() {
                            true => Stopped::Panicked(panic_message(e.into_panic().as_ref())),
                            false => Stopped::Failed(e.to_string()),
                        })
                    })
                }
            };
            let Some(joined) = joined else {
                let d = self.config.tool_timeout.unwrap_or_default();
                let r = ToolResult::error(
                    &u.id,
                    format!(
                        "tool `{}` timed out after {d:?} and was stopped; it may have partly run",
                        shown(&u.name)
                    ),
                );
                store_result(cx, sid, key, &r).await?;
                return Ok(Ok(r));
            };
            match joined {
                Ok(ToolOutput::Ok(s)) => ToolResult::ok(&u.id, s),
                Ok(ToolOutput::Error(s)) => ToolResult::error(&u.id, s),
                Ok(ToolOutput::Pending) => return Ok(Err(Waiting::Client)),
                Err(Stopped::Panicked(msg)) => {
                    ToolResult::error(&u.id, format!("tool `{}` panicked: {msg}", shown(&u.name)))
                }
                Err(Stopped::Failed(e)) => {
                    ToolResult::error(&u.id, format!("tool `{}` failed: {e}", shown(&u.name)))
                }
            }
        };
        store_result(cx, sid, key, &result).await?;
        Ok(Ok(result))
    }
}

/// Plans a batch: calls that share an id but differ are all refused (an answer or an approval
/// for that id could not say which call it meant); exact repeats answer with the first's result.
fn plan_batch(uses: &[ToolUse], keys: &[String]) -> Vec<Plan> {
    let mut plan = vec![Plan::Run; uses.len()];
    for i in 0..uses.len() {
        let same_id: Vec<usize> = (0..uses.len()).filter(|&j| uses[j].id == uses[i].id).collect();
        if same_id.len() < 2 {
            continue;
        }
        if same_id.iter().any(|&j| keys[j] != keys[i]) {
            plan[i] = Plan::Refuse(format!(
                "refused: {} tool calls in this turn share the id `{}`, which must be unique; none of them was run. Call the tools again, each call with its own id.",
                same_id.len(),
                shown(&uses[i].id)
            ));
        } else if same_id[0] != i {
            plan[i] = Plan::SameAs(same_id[0]);
        }
    }
    plan
}

/// Why a call cannot be run, if it cannot: an empty or unknown tool name (declared tools only:
/// front-end tools are declared by the handler too), or arguments that are not JSON.
fn check_call(cx: &TurnContext, u: &ToolUse) -> Option<String> {
    let available = || {
        if cx.tools.is_empty() {
            "none".to_owned()
        } else {
            cx.tools
                .iter()
                .map(|t| format!("`{}`", t.name))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    if u.name.trim().is_empty() {
        return Some(format!(
            "this tool call has no tool name, so nothing was run; call one of the available tools: {}",
            available()
        ));
    }
    if !cx.tools.iter().any(|t| t.name == u.name) {
        return Some(format!(
            "no tool named `{}` is available, so nothing was run; the available tools are: {}",
            shown(&u.name),
            available()
        ));
    }
    u.input_error.as_ref().map(|err| {
        format!(
            "the arguments for `{}` are not usable ({err}); call it again with a JSON object",
            u.name
        )
    })
}

/// The memo key ([`ToolUse::memo_key`]) of each use, in order: computed once per use and
/// carried along (the accumulator, the batch in flight and the runner all need it).
fn memo_keys(uses: &[ToolUse]) -> Vec<String> {
    uses.iter().map(ToolUse::memo_key).collect()
}

/// The memo key `u` is answered under now: [`ToolUse::memo_key`], moved on by one generation
/// each time its result was forgotten ([`Session::forget_tool_result`]).
async fn current_key(sink: &EventSink, u: &ToolUse) -> String {
    current_key_from(sink, &u.memo_key()).await
}

/// [`current_key`] from the use's [`ToolUse::memo_key`], `base`.
async fn current_key_from(sink: &EventSink, base: &str) -> String {
    let mut key = base.to_owned();
    let mut generation = 0u32;
    while sink.has_seen(&format!("tool_forget:{key}")).await {
        generation += 1;
        key = format!("{base}~{generation}");
    }
    key
}

/// Whether `s` has the shape of a memo key ([`ToolUse::memo_key`], with an optional `~n`
/// generation): `#` and 32 hex digits at its end.
fn looks_like_memo_key(s: &str) -> bool {
    let base = match s.rsplit_once('~') {
        Some((b, n)) if !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()) => b,
        _ => s,
    };
    base.rsplit_once('#')
        .is_some_and(|(_, h)| h.len() == 32 && h.bytes().all(|c| c.is_ascii_hexdigit()))
}

/// A name or id from a model, for a message: control characters escaped, at most 64 characters.
fn shown(s: &str) -> String {
    let mut out: String = s.chars().take(64).collect::<String>().escape_debug().to_string();
    if s.chars().nth(64).is_some() {
        out.push('…');
    }
    out
}

/// Memoizes a tool use's result under its key, then records it (the record's result carries the
/// id the provider knows).
async fn store_result(cx: &TurnContext, sid: &str, key: &str, r: &ToolResult) -> Result<()> {
    let memo = ToolResult {
        tool_use_id: key.to_owned(),
        ..r.clone()
    };
    cx.sink.store().put_tool_result_owned(sid, memo).await?;
    record_result(&cx.sink, key, r).await?;
    Ok(())
}

impl Session {
    async fn paused_result(&mut self) -> SessionResult {
        let pending = self.pending_tool_uses();
        SessionResult {
            terminal: Terminal::RequiresAction,
            stop_reason: StopReason::PendingTools,
            session_id: self.info().session_id.clone(),
            text: String::new(),
            texts: Vec::new(),
            tool_uses: Vec::new(),
            server_tool_uses: Vec::new(),
            pending_tool_uses: pending,
            final_output: None,
            usage: Usage::default(),
            turns: 0,
            events: self.cx.sink.take_record().await,
        }
    }

    async fn finish(
        &mut self,
        acc: Acc,
        terminal: Terminal,
        stop: StopReason,
        pending: Vec<ToolUse>,
    ) -> SessionResult {
        SessionResult {
            terminal,
            stop_reason: stop,
            session_id: self.info().session_id.clone(),
            text: acc.texts.last().cloned().unwrap_or_default(),
            texts: acc.texts,
            tool_uses: acc.tool_uses,
            server_tool_uses: acc.server_tool_uses,
            pending_tool_uses: pending,
            final_output: acc.final_output,
            usage: acc.usage,
            turns: acc.turns,
            events: self.cx.sink.take_record().await,
        }
    }

    /// Moves the session onto a task and returns a handle to drive it from anywhere.
    pub fn spawn(self) -> SessionHandle {
        let (cmd_tx, mut cmd_rx) = mpsc::channel::<(Command, u64)>(16);
        let (res_tx, res_rx) = mpsc::channel(16);
        let sink = self.cx.sink.clone();
        let gate = Arc::new(Mutex::new(Gate::default()));
        let g = gate.clone();
        let mut session = self;
        let task = tokio::spawn(async move {
            while let Some((cmd, generation)) = cmd_rx.recv().await {
                let token = CancellationToken::new();
                let cancelled = {
                    let mut gate = lock(&g);
                    gate.current = Some(token.clone());
                    generation < gate.generation
                };
                let r = match cmd {
                    Command::Close => {
                        let _ = session.provider.close().await;
                        break;
                    }
                    // Cancelled while queued: never started.
                    _ if cancelled => Err(Error::Cancelled),
                    Command::Send(text) => session.send_cancellable(text, token).await,
                    Command::ToolResults(rs) => session.submit_tool_results(rs, token).await,
                };
                lock(&g).current = None;
                if res_tx.send(r).await.is_err() {
                    break;
                }
            }
        });
        SessionHandle {
            cmd: cmd_tx,
            results: res_rx,
            sink,
            gate,
            task,
        }
    }
}

/// A [`Checkpoint`] as stored, built around the provider's state without copying it (encoding a
/// `Checkpoint` would copy the whole state, a transcript that grows with the thread, once more
/// on every turn).
fn checkpoint_value(seq: u64, provider: Value) -> Value {
    let mut m = serde_json::Map::new();
    m.insert("seq".into(), Value::from(seq));
    m.insert("provider".into(), provider);
    Value::Object(m)
}

/// The declared tools: the handler's, then the terminal tool.
impl Session {
    /// Reads the handler's tools again, unless its [`Handler::tools_version`] says they are
    /// the ones the context holds (the version is read first: a list that changes in between
    /// is kept under the older version and read again next time).
    fn refresh_tools(&mut self) {
        let v = self.cx.handler.tools_version();
        if v.is_some() && v == self.tools_version {
            return;
        }
        let tools = declared_tools(self.cx.handler.as_ref(), self.config.terminal_tool.as_ref());
        self.cx.set_tools(tools);
        self.tools_version = v;
    }
}

fn declared_tools(handler: &dyn Handler, terminal: Option<&ToolSpec>) -> Vec<ToolSpec> {
    let mut tools = handler.tools();
    if let Some(t) = terminal {
        tools.retain(|s| s.name != t.name);
        tools.push(t.clone());
    }
    tools
}

/// The event recording a user message: id `user:` and the client's id (a fresh `msg_` id for a
/// message without one), see [`user_event_id`].
fn user_message_event(m: &UserMessage) -> Event {
    let id = match &m.id {
        Some(id) => id.clone(),
        None => format!("msg_{:016x}", rand::random::<u64>()),
    };
    Event::new(
        user_event_id(&id),
        raw::USER_MESSAGE,
        json!({"id": id, "text": m.text}),
        EventKind::Message {
            message_id: id,
            role: crate::event::Role::User,
            text: m.text.clone(),
            reasoning: None,
            tool_uses: Vec::new(),
        },
    )
}

/// The event id of a user message with the client's id `id`: `user:` and the id, or a digest of
/// it when it is longer than 128 bytes or holds control characters (ids come from clients).
fn user_event_id(id: &str) -> String {
    if id.len() <= 128 && !id.chars().any(char::is_control) {
        format!("user:{id}")
    } else {
        format!("user:~{}", crate::types::digest_hex(id.as_bytes()))
    }
}

/// Records a tool result, once: its event id is `tool_result:` and the use's memo key.
async fn record_result(sink: &EventSink, key: &str, r: &ToolResult) -> Result<bool> {
    let mut id = String::with_capacity("tool_result:".len() + key.len());
    id.push_str("tool_result:");
    id.push_str(key);
    sink.emit(Event::new(
        id,
        raw::TOOL_RESULT,
        serde_json::to_value(r).unwrap_or(Value::Null),
        EventKind::ToolResult { result: r.clone() },
    ))
    .await
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-text payload".into()
    }
}

enum Command {
    Send(String),
    ToolResults(Vec<ToolResult>),
    Close,
}

/// What a [`SessionHandle::cancel`] applies to: every command queued under an older generation.
#[derive(Default)]
struct Gate {
    /// Bumped by each cancel.
    generation: u64,
    /// The token of the command running now.
    current: Option<CancellationToken>,
}

/// Drives a [`Session`] running on its own task: follow-up messages, cancel, live events.
pub struct SessionHandle {
    cmd: mpsc::Sender<(Command, u64)>,
    results: mpsc::Receiver<Result<SessionResult>>,
    sink: EventSink,
    gate: Arc<Mutex<Gate>>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for SessionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionHandle")
            .field("info", &self.sink.info())
            .finish()
    }
}

impl SessionHandle {
    fn queue(&self) -> u64 {
        lock(&self.gate).generation
    }

    /// Queues a message; its result arrives through [`SessionHandle::next_result`].
    pub async fn send(&self, text: impl Into<String>) -> Result<()> {
        let generation = self.queue();
        self.cmd
            .send((Command::Send(text.into()), generation))
            .await
            .map_err(|_| Error::Closed)
    }

    /// Queues results for pending tool uses (front-end tools).
    pub async fn submit_tool_results(&self, results: Vec<ToolResult>) -> Result<()> {
        let generation = self.queue();
        self.cmd
            .send((Command::ToolResults(results), generation))
            .await
            .map_err(|_| Error::Closed)
    }

    /// The result of the next finished request, in order; `None` once the session is gone.
    pub async fn next_result(&mut self) -> Option<Result<SessionResult>> {
        self.results.recv().await
    }

    /// Cancels the request in flight and every request queued before this call (a
    /// [`SessionHandle::send`] or [`SessionHandle::submit_tool_results`] that began before it):
    /// each of their results is [`Error::Cancelled`]; queued ones never start (tool results
    /// queued so are dropped: the session stays paused). A cancel is never lost between requests,
    /// and never reaches a request queued after it. The session stays up. What stops, per
    /// provider, is in [`Session`]'s docs.
    pub fn cancel(&self) {
        let mut gate = lock(&self.gate);
        gate.generation += 1;
        if let Some(t) = &gate.current {
            t.cancel();
        }
    }

    /// Subscribes to live events (see [`EventSink::subscribe`]).
    pub async fn subscribe(&self, capacity: usize) -> crate::Subscription {
        self.sink.subscribe(capacity).await
    }

    /// The session's identity.
    pub fn info(&self) -> Arc<SessionInfo> {
        self.sink.info()
    }

    /// Closes the session and waits for its task to end.
    pub async fn close(self) {
        let _ = self.cmd.send((Command::Close, 0)).await;
        drop(self.results);
        let _ = self.task.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checkpoint built in place is exactly what encoding a [`Checkpoint`] gives, and reads
    /// back as one: stores and resumes see the same format as before.
    #[test]
    fn a_checkpoint_built_in_place_encodes_as_a_checkpoint() {
        let provider =
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "c1"}]}]);
        let built = checkpoint_value(7, provider.clone());
        let encoded = serde_json::to_value(Checkpoint {
            seq: 7,
            provider: provider.clone(),
        })
        .unwrap();
        assert_eq!(built, encoded);
        let back: Checkpoint = serde_json::from_value(built).unwrap();
        assert_eq!((back.seq, back.provider), (7, provider));
    }
}
