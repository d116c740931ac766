//! [`ThreadAgent`]: any tether thread served as an AG-UI agent, live or durable.
//!
//! Each request (AG-UI `threadId` = the tether thread) claims its thread for the agent (exclusive:
//! a second request on a busy thread gets `THREAD_BUSY`; a thread of another agent
//! `THREAD_AGENT_MISMATCH`), takes what it brings (answers to the thread's interrupts, front-end
//! tool results, new user messages), runs it through the session engine and maps what happens
//! onto the run with [`EventMapper`].
//!
//! - **Durable or live.** A thread's session is opened from the store for each request (the
//!   engine resumes it from its record and checkpoint: after a restart too), or kept open in
//!   memory between requests ([`ThreadAgent::keep_alive`]: an ACP agent's process, say).
//! - **One approval protocol** ([`crate::approval`]): a tool call that needs approval waits
//!   durably and the run ends with an interrupt; a permission request a remote loop makes
//!   mid-turn, or an elicitation a tool's server makes during a call (through
//!   [`asking_handler`]), ends the run with an interrupt too, while the session is held live until
//!   the next request's `resume[]` answers it. Interrupt ids are random, recorded, bound to the thread, the
//!   run and the question, usable once; anything else is refused before anything runs.
//! - **Front-end tools** (`RunAgentInput.tools`) are declared to the model; a call to one ends the
//!   run as a success with it in `pendingToolCallIds`, and the `tool` message the next request
//!   carries is its result. A run never ends in success with a backend call nobody will answer
//!   (`RUN_ERROR` `UNANSWERED_TOOL_CALL`).
//! - **State**: an optional typed state folded from the run ([`ThreadAgent::with_state`]).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};
use tether::{
    CancellationToken, Capabilities, ElicitationRequest, ElicitationResponse, EventKind, Handler,
    HandlerError, PendingToolUse, PermissionOutcome, PermissionRequest, ReadTextFile, Role, Session,
    SessionBuilder, SessionInfo, SessionResult, StopReason, Subscription, TerminalRequest, TerminalResponse,
    ThreadId, ThreadStore, ToolOutput, ToolResult, ToolSpec, ToolUse, UserMessage, Waiting, WriteTextFile,
};
use tokio::sync::{mpsc, oneshot};

use crate::approval::{self, Outstanding, Refusal};
use crate::context::{RunContext, RunOutcome};
use crate::error::{AgUiError, AgUiResult};
use crate::mapper::EventMapper;
use crate::run::Agent;
use crate::types::{Interrupt, Message, ResumeEntry, RunAgentInput, TokenUsage};

/// Builds the session of a thread from the request that opens it: the provider, the handler
/// and the configuration (the adapter adds the thread, its front-end tools and its question
/// channel).
pub type ThreadFactory = dyn Fn(&RunAgentInput) -> tether::Result<SessionBuilder> + Send + Sync;

/// What [`ThreadAgent::on_open`] runs on each session it opens, before the session's request:
/// given the session's sink (e.g. to attach an observer that first reads the thread's stored
/// state, as `tether_otel::attach_global` does).
pub type OnOpen =
    dyn for<'a> Fn(&'a tether::EventSink) -> futures_util::future::BoxFuture<'a, ()> + Send + Sync;

/// What a state reducer sees of a run.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Update<'a> {
    /// The run started.
    Started {
        /// The agent's name.
        agent: &'a str,
        /// The thread.
        thread: &'a str,
    },
    /// An event of the session (durable or live).
    Event(&'a tether::Event),
    /// The run is ending; `waiting` when the thread waits on something (a tool result from the
    /// client, an approval).
    Finished {
        /// Whether the thread waits on the user or the client.
        waiting: bool,
    },
}

/// Folds a run's updates into the typed state; returns whether the state changed (it is then
/// published).
pub type StateReducer<S> = dyn Fn(&mut S, Update<'_>) -> bool + Send + Sync;

/// How permission requests a remote loop makes mid-turn are answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PermissionPolicy {
    /// The run ends with an approval interrupt; the session is held live until the next
    /// request's `resume[]` answers it.
    #[default]
    Interrupt,
    /// The session's own handler answers.
    Delegate,
    /// Allowed (once) without asking.
    Allow,
    /// Refused without asking.
    Deny,
}

/// A question asked mid-turn, waiting for the user, with the way back to the turn.
enum Question {
    /// A remote loop's permission request.
    Permission {
        request: PermissionRequest,
        answer: oneshot::Sender<PermissionOutcome>,
    },
    /// An elicitation (an MCP server asking the user for input during a tool call).
    Elicitation {
        request: ElicitationRequest,
        answer: oneshot::Sender<ElicitationResponse>,
    },
}

/// The capacity of a run's subscription to its session's events (see where it subscribes).
const SUBSCRIPTION: usize = 32;

/// The fewest thread entries at which [`ThreadAgent`]'s table is swept of entries that keep
/// nothing (see `ThreadAgent::slot`).
const MIN_SWEEP: usize = 64;

/// A question asked mid-turn, waiting for the user.
struct Ask {
    question: Question,
    /// The thread's record key (from the session's identity).
    record: String,
}

impl Ask {
    fn held(&self) -> approval::Held<'_> {
        match &self.question {
            Question::Permission { request, .. } => approval::Held::Permission(request),
            Question::Elicitation { request, .. } => approval::Held::Elicitation(request),
        }
    }

    /// Answers the question from a resume's answers; a question the resume did not answer is
    /// refused (a permission request) or declined (an elicitation).
    fn answer(self, answers: &approval::Answers) {
        match self.question {
            Question::Permission { request, answer } => {
                let _ = answer.send(answers.permission.clone().unwrap_or_else(|| reject(&request)));
            }
            Question::Elicitation { answer, .. } => {
                let _ = answer.send(
                    answers
                        .elicitation
                        .clone()
                        .unwrap_or(ElicitationResponse::Decline),
                );
            }
        }
    }

    /// Refuses the question (nobody will answer it).
    fn refuse(self) {
        self.answer(&approval::Answers::default());
    }

    /// The AG-UI interrupt that asks it.
    fn interrupt(&self, id: &str, known_call: impl Fn(&str) -> bool) -> Interrupt {
        match &self.question {
            Question::Permission { request, .. } => {
                permission_interrupt(id, request, known_call(&request.tool_use_id))
            }
            Question::Elicitation { request, .. } => elicitation_interrupt(id, request),
        }
    }
}

tokio::task_local! {
    static ASKING: Arc<dyn Handler>;
}

/// The handler of the [`ThreadAgent`] session whose tool call (or remote loop's file or terminal
/// request) is being served on this task, if any.
///
/// A tool source whose server asks the user something during a call (an MCP elicitation) asks
/// through it ([`tether::source::CallContext::handler`]): the run ends with an elicitation
/// interrupt and the call waits for the next request's answer. A handler serving an ACP agent's
/// `fs/*` or `terminal/create` under a policy that asks asks through its `request_permission`:
/// the run ends with an approval interrupt and the request waits. Outside a `ThreadAgent`'s
/// call or request it is `None`.
pub fn asking_handler() -> Option<Arc<dyn Handler>> {
    ASKING.try_with(Arc::clone).ok()
}

/// The handler a thread's session runs with: the factory's handler, plus the request's
/// front-end tools, the tools named in [`ThreadAgent::require_approval`], and the question
/// channel for mid-turn permission requests.
struct RunHandler {
    inner: Arc<dyn Handler>,
    frontend: RwLock<Vec<ToolSpec>>,
    /// Bumped after each change of `frontend`: part of this handler's tools version.
    frontend_changes: std::sync::atomic::AtomicU64,
    /// This handler's [`Handler::tools_version`] made of the inner handler's and the changes'.
    version: tether::ToolsVersion,
    approval: Arc<HashSet<String>>,
    policy: PermissionPolicy,
    /// Boxed: a tokio channel allocates its slots 32 at a time, and an `Ask` is a few hundred
    /// bytes (its request), so an unboxed channel cost every run ~9 KiB for questions that are
    /// rare; boxed, a block is 32 pointers.
    asks: mpsc::Sender<Box<Ask>>,
    /// This handler, for the tool calls it runs ([`asking_handler`]).
    me: std::sync::Weak<RunHandler>,
}

impl RunHandler {
    /// Asks the user a question through the run: `None` when no run takes it (the agent's runs
    /// are gone), else the answer (`None` inside when the question was dropped unanswered).
    async fn ask<T>(&self, record: &str, question: impl FnOnce(oneshot::Sender<T>) -> Question) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        let ask = Ask {
            question: question(tx),
            record: record.to_owned(),
        };
        self.asks.send(Box::new(ask)).await.ok()?;
        rx.await.ok()
    }

    /// Runs `work` (the inner handler serving a tool call or a remote loop's file or terminal
    /// request) with this handler as the [`asking_handler`], so what it serves can ask the user.
    async fn asking<T>(&self, work: impl Future<Output = T>) -> T {
        match self.me.upgrade() {
            Some(me) => ASKING.scope(me as Arc<dyn Handler>, work).await,
            None => work.await,
        }
    }

    fn is_frontend(&self, name: &str) -> bool {
        self.frontend
            .read()
            .map(|f| f.iter().any(|t| t.name == name))
            .unwrap_or(false)
    }

    fn set_frontend(&self, specs: Vec<ToolSpec>) {
        if let Ok(mut f) = self.frontend.write() {
            *f = specs;
        }
        // After the new list is readable (see `Handler::tools_version`).
        self.frontend_changes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[async_trait]
impl Handler for RunHandler {
    fn tools_version(&self) -> Option<u64> {
        let changes = self.frontend_changes.load(std::sync::atomic::Ordering::SeqCst);
        self.version.of(&[self.inner.tools_version()?, changes])
    }

    fn tools(&self) -> Vec<ToolSpec> {
        let mut tools = self.inner.tools();
        if let Ok(f) = self.frontend.read() {
            for t in f.iter() {
                if !tools.iter().any(|x| x.name == t.name) {
                    tools.push(t.clone());
                }
            }
        }
        tools
    }

    async fn call_tool(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        if self.is_frontend(&call.name) {
            return ToolOutput::Pending;
        }
        self.asking(self.inner.call_tool(call, info)).await
    }

    fn needs_approval(&self, call: &ToolUse) -> Option<String> {
        if self.is_frontend(&call.name) {
            return None;
        }
        if self.approval.contains(&call.name) {
            return Some(format!("{} {}", call.name, call.input));
        }
        self.inner.needs_approval(call)
    }

    async fn on_event(&self, event: &tether::Event, info: &SessionInfo) {
        self.inner.on_event(event, info).await
    }

    async fn request_permission(&self, req: &PermissionRequest, info: &SessionInfo) -> PermissionOutcome {
        let pick = |allow: bool| {
            req.options
                .iter()
                .find(|o| o.kind.allows() == allow)
                .map(|o| PermissionOutcome::Selected {
                    option_id: o.id.clone(),
                })
                .unwrap_or(PermissionOutcome::Cancelled)
        };
        match self.policy {
            PermissionPolicy::Delegate => self.inner.request_permission(req, info).await,
            PermissionPolicy::Allow => pick(true),
            PermissionPolicy::Deny => pick(false),
            PermissionPolicy::Interrupt => {
                // Fail closed: no answer (the question was dropped) is a cancellation.
                self.ask(&info.session_id, |answer| Question::Permission {
                    request: req.clone(),
                    answer,
                })
                .await
                .unwrap_or(PermissionOutcome::Cancelled)
            }
        }
    }

    async fn read_text_file(
        &self,
        req: &ReadTextFile,
        info: &SessionInfo,
    ) -> std::result::Result<String, HandlerError> {
        self.asking(self.inner.read_text_file(req, info)).await
    }

    async fn write_text_file(
        &self,
        req: &WriteTextFile,
        info: &SessionInfo,
    ) -> std::result::Result<(), HandlerError> {
        self.asking(self.inner.write_text_file(req, info)).await
    }

    async fn terminal(
        &self,
        req: &TerminalRequest,
        info: &SessionInfo,
    ) -> std::result::Result<TerminalResponse, HandlerError> {
        self.asking(self.inner.terminal(req, info)).await
    }

    async fn elicit(&self, req: &ElicitationRequest, info: &SessionInfo) -> ElicitationResponse {
        match self.policy {
            PermissionPolicy::Delegate => self.inner.elicit(req, info).await,
            PermissionPolicy::Allow | PermissionPolicy::Deny => ElicitationResponse::Decline,
            PermissionPolicy::Interrupt => {
                // Fail closed: no answer (the question was dropped) is a decline.
                self.ask(&info.session_id, |answer| Question::Elicitation {
                    request: req.clone(),
                    answer,
                })
                .await
                .unwrap_or(ElicitationResponse::Decline)
            }
        }
    }

    async fn elicitation_complete(&self, id: &str, info: &SessionInfo) {
        self.inner.elicitation_complete(id, info).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// What failed in a thread's work (before it becomes a `RUN_ERROR`).
enum WorkError {
    Tether(tether::Error),
    Refused(Refusal),
    Internal(String),
}

impl From<tether::Error> for WorkError {
    fn from(e: tether::Error) -> Self {
        WorkError::Tether(e)
    }
}

impl From<WorkError> for AgUiError {
    fn from(e: WorkError) -> Self {
        match e {
            WorkError::Tether(e) => tether_error(e),
            WorkError::Refused(r) => AgUiError::agent(r.code(), r.to_string()),
            WorkError::Internal(m) => AgUiError::agent("INTERNAL", m),
        }
    }
}

/// The `RUN_ERROR` for an engine error: its code upper-cased (`CANNOT_RESUME`, ...); a thread of
/// another agent is `THREAD_AGENT_MISMATCH`.
fn tether_error(e: tether::Error) -> AgUiError {
    match &e {
        tether::Error::Cancelled => AgUiError::Cancelled,
        tether::Error::ThreadTaken { .. } => AgUiError::agent("THREAD_AGENT_MISMATCH", e.to_string()),
        other => AgUiError::agent(other.code().to_ascii_uppercase(), e.to_string()),
    }
}

/// What one request of a thread did.
#[derive(Default)]
struct Done {
    /// The last request's result (idle ones do not replace an earlier one).
    last: Option<SessionResult>,
    /// What the thread waits on now.
    pending: Vec<PendingToolUse>,
    /// The interrupts outstanding for the tool calls waiting for approval, by tool use id.
    interrupts: Vec<(String, PendingToolUse)>,
}

impl Done {
    fn after(mut self, earlier: Done) -> Done {
        let idle = |r: &SessionResult| r.stop_reason == StopReason::Idle;
        if self.last.as_ref().is_none_or(idle) {
            self.last = earlier.last;
        }
        self
    }
}

/// What a run's work leaves: its session (to keep) and how its turn ended. Boxed: held inline it
/// sized the run's relay future (the `select!` output, the locals after it) by ~1.1 KB for the
/// whole of every run.
type WorkOut = Box<(Option<Session>, std::result::Result<Done, WorkError>)>;
type Work = Pin<Box<dyn Future<Output = WorkOut> + Send>>;

/// What a request brings, owned (the work outlives the borrow of the run's input).
struct Plan {
    thread: String,
    run_id: String,
    resume: Vec<ResumeEntry>,
    users: Vec<UserMessage>,
    results: Vec<ToolResult>,
}

impl Plan {
    fn new(input: &RunAgentInput) -> Plan {
        let mut users = Vec::new();
        let mut results = Vec::new();
        for m in &input.messages {
            match m {
                Message::User(u) => users.push(UserMessage::with_id(u.id.as_str(), u.content.to_text())),
                Message::Tool(t) => {
                    let content = t.content.to_text();
                    results.push(match &t.error {
                        Some(err) if content.is_empty() => ToolResult::error(t.tool_call_id.as_str(), err),
                        Some(_) => ToolResult::error(t.tool_call_id.as_str(), content),
                        None => ToolResult::ok(t.tool_call_id.as_str(), content),
                    });
                }
                _ => {}
            }
        }
        Plan {
            thread: input.thread_id.to_string(),
            run_id: input.run_id.to_string(),
            resume: input.resume.clone(),
            users,
            results,
        }
    }
}

/// The thread's request, once its session is open: the answers first (checked against the
/// thread's outstanding interrupts before anything runs), then the pending tool uses, then the
/// new user messages; at the end the interrupts for the calls waiting for approval are issued.
async fn steps(
    session: &mut Session,
    store: &dyn ThreadStore,
    plan: &Plan,
    handler: &RunHandler,
    cancel: CancellationToken,
    opened_now: bool,
) -> std::result::Result<Done, WorkError> {
    let record = session.info().session_id.clone();
    let waiting = session.pending();
    let asks: Vec<ToolUse> = waiting
        .iter()
        .filter(|p| matches!(p.waiting, Waiting::Approval { .. }))
        .map(|p| p.tool_use.clone())
        .collect();
    // A session just resumed from the store may have lost a question its previous process
    // held: the outstanding record says so.
    let resumed = opened_now && session.opened().resumed;
    let mut outstanding = if plan.resume.is_empty() && asks.is_empty() && !resumed {
        Outstanding::new()
    } else {
        approval::load(store, &record).await?
    };
    let answers = approval::decide(
        &outstanding,
        &plan.thread,
        &plan.resume,
        Some(approval::WaitingOn {
            calls: &asks,
            held: None,
        }),
    )
    .map_err(WorkError::Refused)?;
    // No question is held live here (a held one is answered before this runs): a permission
    // interrupt still outstanding was lost with the process that held it.
    let lost: Vec<approval::Issued> = outstanding
        .values()
        .filter(|rec| rec.kind.is_live())
        .cloned()
        .collect();
    if !answers.used.is_empty() || !lost.is_empty() {
        // Used up before anything runs: an answer counts once, whatever happens next.
        for id in &answers.used {
            outstanding.remove(id);
        }
        outstanding.retain(|_, rec| !rec.kind.is_live());
        approval::save(store, &record, &outstanding).await?;
    }
    // The awaits of the rare paths below (a resume, a lost question, a denial) are boxed: inline,
    // each would size this future for every run (2.8 KB against ~1 KB), held to the run's end.
    let sink = session.sink().clone();
    for rec in &lost {
        Box::pin(record_lost(&sink, rec)).await?;
    }
    for id in &answers.approved {
        Box::pin(session.approve(id)).await;
    }
    for id in &answers.denied {
        let summary = waiting
            .iter()
            .find(|p| &p.tool_use.id == id)
            .map(|p| match &p.waiting {
                Waiting::Approval { summary } => summary.clone(),
                _ => p.tool_use.name.clone(),
            })
            .unwrap_or_default();
        Box::pin(session.answer_tool_use(ToolResult::error(
            id,
            format!("the user denied this action ({summary})"),
        )))
        .await?;
    }
    for r in &plan.results {
        // Only a front-end tool's call takes its result from the client: a backend call's
        // result is the server's to produce.
        if waiting.iter().any(|p| {
            p.tool_use.id == r.tool_use_id
                && p.waiting == Waiting::Client
                && handler.is_frontend(&p.tool_use.name)
        }) {
            Box::pin(session.answer_tool_use(r.clone())).await?;
        }
    }
    let mut new_users = Vec::new();
    for m in &plan.users {
        let known = match &m.id {
            Some(id) => session.knows_message(id).await,
            None => false,
        };
        if !known {
            new_users.push(m.clone());
        }
    }
    let mut done = Done::default();
    if !new_users.is_empty() {
        // The user moved on: what the thread still waits on is answered as such (approved
        // calls still run).
        for p in session.pending() {
            if !answers.approved.contains(&p.tool_use.id) {
                Box::pin(session.answer_tool_use(ToolResult::error(
                    &p.tool_use.id,
                    "not answered: the user sent a new message instead",
                )))
                .await?;
            }
        }
    }
    if session.is_paused() {
        done.last = Some(Box::pin(session.resume(cancel.clone())).await?);
    }
    if session.pending().is_empty() {
        let r = Box::pin(session.send_messages(new_users, cancel)).await?;
        done = Done {
            last: Some(r),
            ..Default::default()
        }
        .after(done);
    }
    done.pending = session.pending();
    let asks: Vec<&PendingToolUse> = done
        .pending
        .iter()
        .filter(|p| matches!(p.waiting, Waiting::Approval { .. }))
        .collect();
    let calls: Vec<&ToolUse> = asks.iter().map(|p| &p.tool_use).collect();
    let issued = approval::reissue(&outstanding, &plan.thread, &plan.run_id, &calls, None)
        .map_err(|e| WorkError::Internal(e.to_string()))?;
    if issued != outstanding {
        approval::save(store, &record, &issued).await?;
    }
    for p in asks {
        if let Some((id, _)) = issued.iter().find(|(_, rec)| rec.tool_use_id == p.tool_use.id) {
            done.interrupts.push((id.clone(), p.clone()));
        }
    }
    Ok(done)
}

/// Records that a question a provider asked mid-turn can no longer be answered (the process
/// holding the turn that asked it is gone).
async fn record_lost(sink: &tether::EventSink, lost: &approval::Issued) -> tether::Result<()> {
    sink.record(
        "",
        tether::raw::QUESTION_LOST,
        json!({
            "kind": lost.kind,
            "tool_use_id": lost.tool_use_id,
            "title": lost.tool_name,
            "run_id": lost.run_id,
            "reason": "the process holding the turn that asked it ended before it was answered",
        }),
        EventKind::Other,
    )
    .await
    .map(|_| ())
}

/// A thread's session kept between requests.
struct Held {
    session: Session,
    handler: Arc<RunHandler>,
    asks: mpsc::Receiver<Box<Ask>>,
    events: Subscription,
    used: u64,
}

/// A thread whose turn waits on the user's answer to a mid-turn question.
struct Asking {
    work: tokio::task::JoinHandle<WorkOut>,
    ask: Ask,
    handler: Arc<RunHandler>,
    asks: mpsc::Receiver<Box<Ask>>,
    events: Subscription,
    used: u64,
}

/// What a thread holds in memory between requests.
#[derive(Default)]
enum Live {
    #[default]
    Empty,
    Idle(Box<Held>),
    Asking(Box<Asking>),
}

/// An [`Agent`] serving tether threads: any provider, live or durable (see the module docs).
pub struct ThreadAgent<S = ()> {
    name: String,
    store: Arc<dyn ThreadStore>,
    factory: Box<ThreadFactory>,
    reducer: Option<Box<StateReducer<S>>>,
    approval: Arc<HashSet<String>>,
    frontend: Arc<Vec<ToolSpec>>,
    policy: PermissionPolicy,
    model: Option<String>,
    run_timeout: Option<Duration>,
    keep_alive: usize,
    max_held: usize,
    on_open: Option<Arc<OnOpen>>,
    /// Runs go first until their first output ([`ThreadAgent::priority`]).
    priority: Option<tether::priority::Priority>,
    clock: AtomicU64,
    threads: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Live>>>>,
    /// The table's size at which [`Self::slot`] next sweeps out entries that keep nothing.
    sweep_at: AtomicUsize,
}

impl<S> std::fmt::Debug for ThreadAgent<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadAgent")
            .field("name", &self.name)
            .field("policy", &self.policy)
            .field("keep_alive", &self.keep_alive)
            .finish_non_exhaustive()
    }
}

impl ThreadAgent<()> {
    /// An agent named `name` whose threads live in `store` and whose sessions `factory` builds
    /// (called when a request opens a thread's session).
    pub fn new(
        name: impl Into<String>,
        store: Arc<dyn ThreadStore>,
        factory: impl Fn(&RunAgentInput) -> tether::Result<SessionBuilder> + Send + Sync + 'static,
    ) -> Self {
        ThreadAgent {
            name: name.into(),
            store,
            factory: Box::new(factory),
            reducer: None,
            approval: Arc::new(HashSet::new()),
            frontend: Arc::new(Vec::new()),
            policy: PermissionPolicy::default(),
            model: None,
            run_timeout: None,
            keep_alive: 0,
            max_held: 64,
            on_open: None,
            priority: None,
            clock: AtomicU64::new(0),
            threads: Mutex::new(HashMap::new()),
            sweep_at: AtomicUsize::new(MIN_SWEEP),
        }
    }

    /// Gives the agent a typed state (`RunAgentInput.state` on the way in) that `reducer` folds
    /// the run's updates into; each change is published before the next event.
    pub fn with_state<T: crate::AgentState>(
        self,
        reducer: impl Fn(&mut T, Update<'_>) -> bool + Send + Sync + 'static,
    ) -> ThreadAgent<T> {
        ThreadAgent {
            name: self.name,
            store: self.store,
            factory: self.factory,
            reducer: Some(Box::new(reducer)),
            approval: self.approval,
            frontend: self.frontend,
            policy: self.policy,
            model: self.model,
            run_timeout: self.run_timeout,
            keep_alive: self.keep_alive,
            max_held: self.max_held,
            on_open: self.on_open,
            priority: self.priority,
            clock: self.clock,
            threads: self.threads,
            sweep_at: self.sweep_at,
        }
    }
}

impl<S> ThreadAgent<S> {
    /// How mid-turn permission requests are answered (default: an approval interrupt).
    pub fn permission_policy(mut self, policy: PermissionPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Backend tools whose every call needs the user's approval (an interrupt), besides those
    /// the session's handler says need it.
    pub fn require_approval<I, T>(mut self, tools: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        let mut set = (*self.approval).clone();
        set.extend(tools.into_iter().map(Into::into));
        self.approval = Arc::new(set);
        self
    }

    /// Tools the client runs for every thread of this agent (besides each request's
    /// `RunAgentInput.tools`): a call ends the run with it pending until the client's result.
    pub fn frontend_tools(mut self, tools: Vec<ToolSpec>) -> Self {
        self.frontend = Arc::new(tools);
        self
    }

    /// The model named on the usage the runs report.
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// The longest a run may take: past it the session's request is cancelled (the engine
    /// answers what it stopped) and the run ends in `RUN_ERROR` `RUN_TIMEOUT`.
    pub fn run_timeout(mut self, limit: Duration) -> Self {
        self.run_timeout = Some(limit);
        self
    }

    /// Runs `f` on each session this agent opens, once it is open and before its request (its
    /// events from then on pass whatever `f` attached). A server uses it to attach its tracer
    /// after the tracer has read the thread's stored trace state, so a resumed run links to the
    /// spans before it from its first span.
    pub fn on_open(
        mut self,
        f: impl for<'a> Fn(&'a tether::EventSink) -> futures_util::future::BoxFuture<'a, ()>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.on_open = Some(Arc::new(f));
        self
    }

    /// Gives this agent's runs priority until their first output (see [`tether::priority`]):
    /// each run counts as starting from its admission until the first output it maps (text,
    /// reasoning, a tool call, a message, an error) or its end, and the sessions it opens pace
    /// their model deltas on `priority`. Give every agent of a server the same priority: a burst
    /// of new runs then gets its first words before the streams already going get more.
    pub fn priority(mut self, priority: tether::priority::Priority) -> Self {
        self.priority = Some(priority);
        self
    }

    /// How many threads keep their session open in memory between requests (default 0: each
    /// request resumes its thread from the store). The least recently used beyond it are closed.
    pub fn keep_alive(mut self, sessions: usize) -> Self {
        self.keep_alive = sessions;
        self
    }

    /// How many threads may hold a turn waiting on a mid-turn question at once (default 64);
    /// past it the oldest question is refused (cancelled) and recorded as lost.
    pub fn max_held_questions(mut self, n: usize) -> Self {
        self.max_held = n.max(1);
        self
    }

    /// The agent's name (the one its threads belong to).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of threads with a session open in memory (idle or holding a question).
    pub fn live_threads(&self) -> usize {
        self.threads
            .lock()
            .map(|m| {
                m.values()
                    .filter(|v| v.try_lock().map(|l| !matches!(*l, Live::Empty)).unwrap_or(true))
                    .count()
            })
            .unwrap_or(0)
    }

    /// Checks a request's `resume[]` against the thread's outstanding interrupts before the run
    /// starts (for an endpoint's admission: refuse with [`Refusal::status`] before
    /// `RUN_STARTED`). The run checks again with the thread's lock held.
    pub async fn check_resume(&self, input: &RunAgentInput) -> std::result::Result<(), CheckError> {
        approval::check_resume(self.store.as_ref(), &self.name, input).await
    }

    fn slot(&self, thread: &str) -> AgUiResult<Arc<tokio::sync::Mutex<Live>>> {
        let mut g = self
            .threads
            .lock()
            .map_err(|_| AgUiError::agent("INTERNAL", "the thread table is poisoned"))?;
        if let Some(v) = g.get(thread) {
            return Ok(v.clone());
        }
        // Entries nobody holds and that keep nothing go, swept when the table has doubled since
        // the last sweep: sweeping at every run's start touched every thread's entry, O(threads)
        // per run under the table's lock, while a burst of runs started.
        if g.len() >= self.sweep_at.load(Ordering::Relaxed) {
            g.retain(|_, v| {
                Arc::strong_count(v) > 1 || v.try_lock().map(|l| !matches!(*l, Live::Empty)).unwrap_or(true)
            });
            self.sweep_at
                .store(g.len().saturating_mul(2).max(MIN_SWEEP), Ordering::Relaxed);
        }
        Ok(g.entry(thread.to_owned()).or_default().clone())
    }

    /// Closes the least recently used idle sessions beyond [`Self::keep_alive`], and refuses the
    /// oldest held questions beyond [`Self::max_held_questions`].
    fn evict(&self) {
        let Ok(g) = self.threads.lock() else { return };
        let mut idle: Vec<(u64, Arc<tokio::sync::Mutex<Live>>)> = Vec::new();
        let mut asking: Vec<(u64, Arc<tokio::sync::Mutex<Live>>)> = Vec::new();
        for v in g.values() {
            if let Ok(l) = v.try_lock() {
                match &*l {
                    Live::Idle(h) => idle.push((h.used, v.clone())),
                    Live::Asking(a) => asking.push((a.used, v.clone())),
                    Live::Empty => {}
                }
            }
        }
        drop(g);
        idle.sort_by_key(|(u, _)| std::cmp::Reverse(*u));
        for (_, v) in idle.into_iter().skip(self.keep_alive) {
            if let Ok(mut l) = v.try_lock()
                && let Live::Idle(h) = std::mem::take(&mut *l)
            {
                tokio::spawn(async move {
                    let _ = h.session.close().await;
                });
            }
        }
        asking.sort_by_key(|(u, _)| std::cmp::Reverse(*u));
        for (_, v) in asking.into_iter().skip(self.max_held) {
            if let Ok(mut l) = v.try_lock()
                && let Live::Asking(a) = std::mem::take(&mut *l)
            {
                let Asking { work, ask, .. } = *a;
                ask.refuse();
                // The turn goes on with the refusal; its session is closed when it ends.
                tokio::spawn(async move {
                    if let Ok((Some(s), _)) = work.await.map(|o| *o) {
                        let _ = s.close().await;
                    }
                });
            }
        }
    }
}

/// Why [`ThreadAgent::check_resume`] refused a request.
#[derive(Debug)]
#[non_exhaustive]
pub enum CheckError {
    /// The resume names interrupts not outstanding on the thread.
    Refused(Refusal),
    /// The store failed.
    Store(tether::Error),
}

/// The refusing answer to a permission request (cancelled when it offers none).
fn reject(req: &PermissionRequest) -> PermissionOutcome {
    req.reject_option()
        .map(|o| PermissionOutcome::Selected {
            option_id: o.id.clone(),
        })
        .unwrap_or(PermissionOutcome::Cancelled)
}

impl<S> ThreadAgent<S> {
    /// The front-end tools of a request: the agent's own, then the request's (`RunAgentInput.tools`).
    fn frontend_specs(&self, input: &RunAgentInput) -> Vec<ToolSpec> {
        let mut out = self.frontend.as_ref().clone();
        for t in &input.tools {
            if out.iter().any(|x| x.name == t.name) {
                continue;
            }
            let schema = match &t.parameters {
                Some(v @ Value::Object(_)) => v.clone(),
                _ => json!({"type": "object", "properties": {}}),
            };
            out.push(ToolSpec::new(t.name.clone(), t.description.clone(), schema));
        }
        out
    }
}

/// The AG-UI interrupt of a tool call waiting for approval.
fn tool_interrupt(id: &str, p: &PendingToolUse) -> Interrupt {
    let summary = match &p.waiting {
        Waiting::Approval { summary } => summary.as_str(),
        _ => p.tool_use.name.as_str(),
    };
    approval::tool_interrupt(id, &p.tool_use.id, summary)
}

/// The AG-UI interrupt of a permission request held live.
fn permission_interrupt(id: &str, req: &PermissionRequest, known_call: bool) -> Interrupt {
    let options: Vec<Value> = req
        .options
        .iter()
        .map(|o| json!({"id": o.id, "name": o.name, "kind": o.kind}))
        .collect();
    let ids: Vec<&str> = req.options.iter().map(|o| o.id.as_str()).collect();
    let mut i = Interrupt::new(id, "approval").with_message(format!("Allow {}?", req.title));
    if known_call {
        i = i.with_tool_call(req.tool_use_id.as_str());
    }
    if let Value::Object(s) = json!({
        "type": "object",
        "properties": {"approved": {"type": "boolean"}, "optionId": {"type": "string", "enum": ids}},
        "required": ["approved"]
    }) {
        i = i.with_response_schema(s);
    }
    let mut meta = serde_json::Map::new();
    meta.insert("options".into(), Value::Array(options));
    meta.insert("input".into(), req.input.clone());
    if let Some(k) = &req.kind {
        meta.insert("kind".into(), json!(k));
    }
    i.metadata = Some(meta);
    i
}

/// The AG-UI interrupt of an elicitation held live: reason `elicitation`, the server's message,
/// and in `metadata` the mode with the requested schema (a form) or the URL to visit; the
/// response schema asks for `{"action": "accept" | "decline" | "cancel", "content": {...}}`.
fn elicitation_interrupt(id: &str, req: &ElicitationRequest) -> Interrupt {
    let mut meta = serde_json::Map::new();
    let content = match &req.mode {
        tether::ElicitationMode::Form { schema } => {
            meta.insert("mode".into(), json!("form"));
            meta.insert("requestedSchema".into(), schema.clone());
            schema.clone()
        }
        tether::ElicitationMode::Url { url } => {
            meta.insert("mode".into(), json!("url"));
            meta.insert("url".into(), json!(url));
            json!({"type": "object"})
        }
        _ => json!({"type": "object"}),
    };
    if let Some(eid) = &req.id {
        meta.insert("elicitationId".into(), json!(eid));
    }
    let mut i = Interrupt::new(id, "elicitation").with_message(req.message.clone());
    if let Value::Object(s) = json!({
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": ["accept", "decline", "cancel"]},
            "content": content
        },
        "required": ["action"]
    }) {
        i = i.with_response_schema(s);
    }
    i.metadata = Some(meta);
    i
}

/// The error for a backend tool call the run leaves unanswered (the engine never should; if it
/// does, the client must not see a success it would wait on forever).
fn unanswered(id: &str, name: &str) -> AgUiError {
    AgUiError::agent(
        "UNANSWERED_TOOL_CALL",
        format!(
            "the run left the call `{}` of tool `{}` without a result, and no one but the server can answer \
             it; nothing more was run. Send another message on this thread to continue",
            approval::printable(id),
            approval::printable(name)
        ),
    )
}

/// Whether an event is output a client shows: what ends a run's wait for its first output
/// ([`ThreadAgent::priority`]).
fn is_output(kind: &EventKind) -> bool {
    match kind {
        EventKind::TextDelta { .. }
        | EventKind::ReasoningDelta { .. }
        | EventKind::ToolCallStart { .. }
        | EventKind::ToolCall { .. }
        | EventKind::Error { .. } => true,
        EventKind::Message { role, .. } => *role == Role::Assistant,
        _ => false,
    }
}

/// Maps a run's events and folds them into the typed state.
struct Mapping<'a, S> {
    mapper: EventMapper,
    names: HashMap<String, String>,
    reducer: Option<&'a StateReducer<S>>,
    /// The run counts as starting until its first output is mapped ([`ThreadAgent::priority`]).
    starting: Option<tether::priority::Starting>,
}

impl<S: crate::AgentState> Mapping<'_, S> {
    async fn map(&mut self, ctx: &mut RunContext<S>, ev: &tether::Event) -> AgUiResult<()> {
        ctx.ready().await?;
        self.map_now(ctx, ev)
    }

    /// Maps one event (the client's buffer has room, or the run is ending), noting the names of
    /// the tool calls it shows: the run's end tells front-end calls from unanswered ones by them.
    fn map_now(&mut self, ctx: &mut RunContext<S>, ev: &tether::Event) -> AgUiResult<()> {
        self.mapper.map(ctx, ev)?;
        if self.starting.is_some() && is_output(&ev.kind) {
            self.starting = None;
        }
        match &ev.kind {
            EventKind::ToolCallStart {
                tool_use_id, name, ..
            } => {
                self.names.insert(tool_use_id.clone(), name.clone());
            }
            EventKind::ToolCall { tool_use, .. } => {
                self.names.insert(tool_use.id.clone(), tool_use.name.clone());
            }
            EventKind::Message { tool_uses, .. } => {
                for u in tool_uses {
                    self.names.insert(u.id.clone(), u.name.clone());
                }
            }
            _ => {}
        }
        self.update(ctx, Update::Event(ev))
    }

    fn update(&mut self, ctx: &mut RunContext<S>, u: Update<'_>) -> AgUiResult<()> {
        if let Some(r) = self.reducer
            && r(ctx.state_mut(), u)
        {
            ctx.publish_state()?;
        }
        Ok(())
    }

    /// Maps the events the session delivered and the run has not shown yet, each when the
    /// client has room for it.
    async fn drain(&mut self, ctx: &mut RunContext<S>, events: &mut Subscription) -> AgUiResult<()> {
        while let Ok(ev) = events.try_recv_shared() {
            self.map(ctx, &ev).await?;
        }
        Ok(())
    }
}

impl<S: crate::AgentState + Sync> Agent for ThreadAgent<S> {
    type State = S;

    async fn run(&self, ctx: &mut RunContext<S>) -> AgUiResult<RunOutcome> {
        Box::pin(self.run_inner(ctx)).await
    }
}

impl<S: crate::AgentState + Sync> ThreadAgent<S> {
    async fn run_inner(&self, ctx: &mut RunContext<S>) -> AgUiResult<RunOutcome> {
        let thread = ThreadId::new(ctx.input().thread_id.as_str()).map_err(tether_error)?;
        let slot = self.slot(thread.as_str())?;
        let Ok(mut live) = slot.try_lock_owned() else {
            return Err(AgUiError::agent(
                "THREAD_BUSY",
                format!(
                    "another run is in progress on thread {}; wait for it to finish",
                    approval::printable(thread.as_str())
                ),
            ));
        };
        let mut plan = Plan::new(ctx.input());
        let cancel = CancellationToken::new();
        let store = self.store.clone();
        let mut mapping = Mapping {
            mapper: match &self.model {
                Some(m) => EventMapper::new(ctx.input()).model(m.clone()),
                None => EventMapper::new(ctx.input()),
            },
            names: HashMap::new(),
            reducer: self.reducer.as_deref(),
            starting: self.priority.as_ref().map(tether::priority::Priority::starting),
        };
        mapping.update(
            ctx,
            Update::Started {
                agent: &self.name,
                thread: thread.as_str(),
            },
        )?;

        // 1. What the thread is doing: a turn held on a question, a session kept open, or
        //    nothing in memory (the session is opened from the store).
        let (mut work, handler, mut asks, mut events): (Work, Arc<RunHandler>, _, _) =
            match std::mem::take(&mut *live) {
                Live::Asking(a) => {
                    let Asking {
                        work: held,
                        ask,
                        handler,
                        asks,
                        events,
                        ..
                    } = *a;
                    let mut outstanding = approval::load(store.as_ref(), &ask.record)
                        .await
                        .map_err(tether_error)?;
                    let answers = match approval::decide(
                        &outstanding,
                        &plan.thread,
                        &plan.resume,
                        Some(approval::WaitingOn {
                            calls: &[],
                            held: Some(ask.held()),
                        }),
                    ) {
                        Ok(a) => a,
                        Err(refusal) => {
                            // Nothing changed: the question still waits.
                            *live = Live::Asking(Box::new(Asking {
                                work: held,
                                ask,
                                handler,
                                asks,
                                events,
                                used: self.clock.fetch_add(1, Ordering::Relaxed),
                            }));
                            return Err(WorkError::Refused(refusal).into());
                        }
                    };
                    for id in &answers.used {
                        outstanding.remove(id);
                    }
                    // The held question is answered now, whatever this request says: a request
                    // that does not answer it moved on, which refuses it.
                    let question = ask.held();
                    outstanding.retain(|_, rec| !(rec.kind.is_live() && question.matches(rec)));
                    approval::save(store.as_ref(), &ask.record, &outstanding)
                        .await
                        .map_err(tether_error)?;
                    // Answered by the user in this request: its resume entries are used up.
                    plan.resume.clear();
                    ask.answer(&answers);
                    handler.set_frontend(self.frontend_specs(ctx.input()));
                    let plan = Arc::new(plan);
                    let cancel = cancel.clone();
                    let store = store.clone();
                    let h = handler.clone();
                    let work: Work = Box::pin(async move {
                        let (session, first) = match held.await {
                            Ok(out) => *out,
                            Err(e) => (
                                None,
                                Err(WorkError::Internal(format!("the held turn failed: {e}"))),
                            ),
                        };
                        let Some(mut session) = session else {
                            return Box::new((None, first));
                        };
                        let first = match first {
                            Ok(d) => d,
                            Err(e) => return Box::new((Some(session), Err(e))),
                        };
                        let next = steps(&mut session, store.as_ref(), &plan, &h, cancel, false).await;
                        Box::new((Some(session), next.map(|d| d.after(first))))
                    });
                    (work, handler, asks, events)
                }
                Live::Idle(h) => {
                    let Held {
                        mut session,
                        handler,
                        asks,
                        mut events,
                        ..
                    } = *h;
                    while events.try_recv_shared().is_ok() {}
                    handler.set_frontend(self.frontend_specs(ctx.input()));
                    let plan = Arc::new(plan);
                    let cancel = cancel.clone();
                    let store = store.clone();
                    let h = handler.clone();
                    let work: Work = Box::pin(async move {
                        let r = steps(&mut session, store.as_ref(), &plan, &h, cancel, false).await;
                        Box::new((Some(session), r))
                    });
                    (work, handler, asks, events)
                }
                Live::Empty => {
                    let (tx, rx) = mpsc::channel(4);
                    let builder = (self.factory)(ctx.input()).map_err(tether_error)?;
                    let handler_slot: Arc<Mutex<Option<Arc<RunHandler>>>> = Arc::new(Mutex::new(None));
                    let approval = self.approval.clone();
                    let policy = self.policy;
                    let fe = self.frontend_specs(ctx.input());
                    let hs = handler_slot.clone();
                    let mut builder = builder
                        .map_handler(move |inner| {
                            let h = Arc::new_cyclic(|me| RunHandler {
                                inner,
                                frontend: RwLock::new(fe),
                                frontend_changes: std::sync::atomic::AtomicU64::new(0),
                                version: tether::ToolsVersion::new(),
                                approval,
                                policy,
                                asks: tx,
                                me: me.clone(),
                            });
                            if let Ok(mut s) = hs.lock() {
                                *s = Some(h.clone());
                            }
                            h
                        })
                        .thread(store.clone(), thread.clone(), self.name.clone())
                        .title(
                            ctx.last_user_text()
                                .unwrap_or_default()
                                .chars()
                                .take(80)
                                .collect::<String>(),
                        );
                    // A thread not yet started is started with the request's user messages in
                    // one store step (with its provider session): the request then records
                    // nothing more before its first model request. A request answering
                    // interrupts is checked first, before anything is recorded.
                    if plan.resume.is_empty() {
                        builder = builder.first_messages(plan.users.clone());
                    }
                    if let Some(p) = &self.priority {
                        builder = builder.priority(p.clone());
                    }
                    // The relay below takes every queued event before it polls the turn again,
                    // so the queue holds what one poll of the turn produced; when it is full the
                    // session waits for the relay (the sink drops nothing). 32 is one block of
                    // the channel's slots: the capacity bounds a run's memory, not what the
                    // client gets.
                    let events = builder.subscribe(SUBSCRIPTION);
                    let handler = handler_slot
                        .lock()
                        .ok()
                        .and_then(|mut s| s.take())
                        .ok_or_else(|| {
                            AgUiError::agent("INTERNAL", "the thread's handler was not installed")
                        })?;
                    let plan = Arc::new(plan);
                    let cancel = cancel.clone();
                    let store = store.clone();
                    let h = handler.clone();
                    let on_open = self.on_open.clone();
                    // Boxed, as the open's future (3.5 KB) is: what the work captures stays for
                    // its whole life, and the builder (~600 bytes) is spent once the session is open.
                    let builder = Box::new(builder);
                    let work: Work = Box::pin(async move {
                        let mut session = match Box::pin((*builder).open()).await {
                            Ok(s) => s,
                            Err(e) => return Box::new((None, Err(WorkError::Tether(e)))),
                        };
                        if let Some(f) = on_open {
                            f(session.sink()).await;
                        }
                        let r = steps(&mut session, store.as_ref(), &plan, &h, cancel, true).await;
                        Box::new((Some(session), r))
                    });
                    (work, handler, rx, events)
                }
            };

        // 2. Relay the session's events until the work ends, a mid-turn question ends the run,
        //    the client goes away or the run times out.
        let client_gone = ctx.cancel_token().clone();
        let deadline = self
            .run_timeout
            .and_then(|d| tokio::time::Instant::now().checked_add(d));
        let timeout = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(timeout);
        let mut stopping = false;
        let mut timed_out = false;
        let mut events_open = true;
        let out = loop {
            tokio::select! {
                biased;
                _ = client_gone.cancelled(), if !stopping => {
                    stopping = true;
                    cancel.cancel();
                }
                _ = &mut timeout, if !stopping => {
                    stopping = true;
                    timed_out = true;
                    cancel.cancel();
                }
                ev = events.recv_shared(), if events_open => match ev {
                    Some(ev) => mapping.map(ctx, &ev).await?,
                    None => events_open = false,
                },
                ask = asks.recv(), if !stopping => {
                    let Some(ask) = ask else { continue };
                    let ask = *ask;
                    mapping.drain(ctx, &mut events).await?;
                    mapping.mapper.close(ctx)?;
                    let mut outstanding = approval::load(store.as_ref(), &ask.record)
                        .await
                        .map_err(tether_error)?;
                    let issued = approval::reissue(&Outstanding::new(), thread.as_str(), ctx.run_id().as_str(), &[], Some(ask.held()))
                        .map_err(|e| AgUiError::agent("INTERNAL", e.to_string()))?;
                    let Some((id, _)) = issued.iter().next().map(|(k, v)| (k.clone(), v.clone())) else {
                        return Err(AgUiError::agent("INTERNAL", "no interrupt was issued"));
                    };
                    outstanding.extend(issued);
                    approval::save(store.as_ref(), &ask.record, &outstanding)
                        .await
                        .map_err(tether_error)?;
                    let interrupt = ask.interrupt(&id, |call| mapping.mapper.knows_call(call));
                    mapping.update(ctx, Update::Finished { waiting: true })?;
                    // The turn goes on (waiting for the answer) on its own task; the next request
                    // on this thread answers the question and takes the turn over.
                    let task = tokio::spawn(work);
                    *live = Live::Asking(Box::new(Asking {
                        work: task,
                        ask,
                        handler,
                        asks,
                        events,
                        used: self.clock.fetch_add(1, Ordering::Relaxed),
                    }));
                    drop(live);
                    self.evict();
                    return Ok(RunOutcome::Interrupt(vec![interrupt]));
                }
                out = &mut work => break out,
            }
        };
        // 3. Keep the session (or close it), then end the run.
        mapping.drain(ctx, &mut events).await?;
        let (session, result) = *out;
        if let Some(session) = session {
            if self.keep_alive > 0 {
                *live = Live::Idle(Box::new(Held {
                    session,
                    handler: handler.clone(),
                    asks,
                    events,
                    used: self.clock.fetch_add(1, Ordering::Relaxed),
                }));
            } else {
                tokio::spawn(async move {
                    let _ = session.close().await;
                });
            }
        }
        drop(live);
        if self.keep_alive > 0 {
            self.evict();
        }
        if timed_out {
            let limit = self.run_timeout.unwrap_or_default();
            return Err(AgUiError::agent(
                "RUN_TIMEOUT",
                format!(
                    "the run did not finish within {}s (the server's run time limit); what it did is saved, \
                     send another message on this thread to continue",
                    limit.as_secs()
                ),
            ));
        }
        let done = result?;
        mapping.mapper.close(ctx)?;
        mapping.update(
            ctx,
            Update::Finished {
                waiting: !done.pending.is_empty(),
            },
        )?;
        if let Some(r) = &done.last {
            // The session's usage events were mapped as they came; its total only when none was.
            if !mapping.mapper.usage_seen() && r.usage.total() > 0 {
                ctx.add_usage(TokenUsage {
                    model: self.model.clone(),
                    input_tokens: Some(r.usage.input_tokens),
                    output_tokens: Some(r.usage.output_tokens),
                    total_tokens: Some(r.usage.total()),
                    cached_input_tokens: (r.usage.cache_read_tokens > 0).then_some(r.usage.cache_read_tokens),
                    ..Default::default()
                });
            }
            if let Some(out) = &r.final_output {
                ctx.set_result(out.clone());
            } else if !matches!(
                r.stop_reason,
                StopReason::EndTurn | StopReason::PendingTools | StopReason::Idle
            ) {
                ctx.set_result(json!({"stopReason": r.stop_reason}));
            }
        }
        // What is left waiting: calls for approval become interrupts (recorded); front-end calls
        // are the client's to answer. Anything else would be a backend call nobody will answer:
        // never a success.
        let asked: HashSet<&str> = done
            .interrupts
            .iter()
            .map(|(_, p)| p.tool_use.id.as_str())
            .collect();
        for p in &done.pending {
            if p.waiting == Waiting::Client && !handler.is_frontend(&p.tool_use.name) {
                return Err(unanswered(&p.tool_use.id, &p.tool_use.name));
            }
        }
        for id in ctx.pending_tool_calls() {
            let name = mapping.names.get(id.as_str()).map(String::as_str).unwrap_or("");
            if !asked.contains(id.as_str()) && !handler.is_frontend(name) {
                return Err(unanswered(id.as_str(), name));
            }
        }
        if !done.interrupts.is_empty() {
            return Ok(RunOutcome::Interrupt(
                done.interrupts
                    .iter()
                    .map(|(id, p)| tool_interrupt(id, p))
                    .collect(),
            ));
        }
        Ok(RunOutcome::Success)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent() -> ThreadAgent {
        ThreadAgent::new("a", Arc::new(tether::MemoryStore::default()), |_| {
            Err(tether::Error::config(tether::ConfigKind::Unsupported, "not used"))
        })
    }

    #[test]
    fn the_thread_table_is_swept_in_bursts_and_stays_bounded() {
        let a = agent();
        let held = a.slot("held").unwrap();
        for i in 0..1_000 {
            drop(a.slot(&format!("t{i}")).unwrap());
            let n = a.threads.lock().unwrap().len();
            assert!(
                n <= 2 * MIN_SWEEP,
                "{n} entries after {i} threads that keep nothing"
            );
        }
        // An entry someone holds survives every sweep, and is found again.
        assert!(Arc::ptr_eq(&held, &a.slot("held").unwrap()));
    }
}
