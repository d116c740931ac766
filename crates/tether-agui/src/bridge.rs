//! The bridge: any tether [`Session`](tether::Session) served as an AG-UI [`Agent`].
//!
//! [`SessionAgent`] keeps one tether session per AG-UI thread. Each request drives that
//! session and maps its events onto the run as they arrive: text and reasoning deltas,
//! tool calls with their argument deltas (attached to the assistant message that made them),
//! local tool results, usage on `RUN_FINISHED`, errors as `RUN_ERROR`.
//!
//! - **Front-end tools** (`RunAgentInput.tools`) are declared to the model; when the model
//!   calls one, the session pauses with the call pending and the run finishes as a success
//!   with the call in `pendingToolCallIds`. The next request carrying the `tool` message
//!   submits it as the call's result and the same session continues.
//! - **Permission requests** (from a remote loop, or before running a tool named in
//!   [`SessionAgent::require_approval`]) are answered by a [`PermissionPolicy`]; with
//!   [`PermissionPolicy::Interrupt`] the run finishes with an `interrupt` outcome while the
//!   session waits, and the next request's `resume[]` entry answers it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;
use serde_json::{Value, json};
use tether::{
    Capabilities, ElicitationRequest, ElicitationResponse, EventKind, Handler, HandlerError, NoTools,
    PermissionKind, PermissionOutcome, PermissionRequest, ReadTextFile, SessionBuilder, SessionHandle,
    SessionInfo, TerminalRequest, TerminalResponse, ToolOutput, ToolResult, ToolSpec, ToolUse, WriteTextFile,
};
use tokio::sync::{mpsc, oneshot};

use crate::context::{RunContext, RunOutcome};
use crate::error::{Error, Result};
use crate::event::{EncryptedValueSubtype, Event, TextMessageRole};
use crate::ids::{InterruptId, MessageId, ThreadId, ToolCallId};
use crate::run::Agent;
use crate::types::{
    AssistantMessage, Interrupt, Message, ReasoningMessage, ResumeStatus, RunAgentInput, TokenUsage,
    ToolCall, ToolMessage,
};

/// How permission requests are answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PermissionPolicy {
    /// Ask the wrapped handler (its default refuses).
    #[default]
    Delegate,
    /// Allow (once) without asking.
    Allow,
    /// Refuse without asking.
    Deny,
    /// Finish the run with an `interrupt` outcome; the next request's `resume[]` answers.
    Interrupt,
}

/// Builds the session for a new thread from its first request.
pub type SessionFactory = dyn Fn(&RunAgentInput) -> tether::Result<SessionBuilder> + Send + Sync;

struct PermissionAsk {
    request: PermissionRequest,
    answer: oneshot::Sender<PermissionOutcome>,
}

/// The handler installed on bridged sessions: front-end tools, approvals, and delegation.
struct BridgeHandler {
    inner: Arc<dyn Handler>,
    frontend: RwLock<Vec<ToolSpec>>,
    approval: HashSet<String>,
    policy: PermissionPolicy,
    asks: mpsc::Sender<PermissionAsk>,
}

impl BridgeHandler {
    fn is_frontend(&self, name: &str) -> bool {
        self.frontend
            .read()
            .map(|f| f.iter().any(|t| t.name == name))
            .unwrap_or(false)
    }

    async fn permission(&self, req: &PermissionRequest, info: &SessionInfo) -> PermissionOutcome {
        let pick = |kind_allows: bool| {
            req.options
                .iter()
                .find(|o| o.kind.allows() == kind_allows)
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
                let (tx, rx) = oneshot::channel();
                let ask = PermissionAsk {
                    request: req.clone(),
                    answer: tx,
                };
                if self.asks.send(ask).await.is_err() {
                    return PermissionOutcome::Cancelled;
                }
                rx.await.unwrap_or(PermissionOutcome::Cancelled)
            }
        }
    }
}

#[async_trait]
impl Handler for BridgeHandler {
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
        if self.approval.contains(&call.name) {
            let req = PermissionRequest {
                tool_use_id: call.id.clone(),
                title: call.name.clone(),
                input: call.input.clone(),
                kind: None,
                options: PermissionRequest::standard_options(),
                raw: Value::Null,
            };
            let outcome = self.permission(&req, info).await;
            if !outcome.allows(&req) {
                return ToolOutput::Error(format!("the user did not allow `{}` to run", call.name));
            }
        }
        self.inner.call_tool(call, info).await
    }

    async fn on_event(&self, event: &tether::Event, info: &SessionInfo) {
        self.inner.on_event(event, info).await
    }

    async fn request_permission(&self, req: &PermissionRequest, info: &SessionInfo) -> PermissionOutcome {
        self.permission(req, info).await
    }

    async fn read_text_file(
        &self,
        req: &ReadTextFile,
        info: &SessionInfo,
    ) -> std::result::Result<String, HandlerError> {
        self.inner.read_text_file(req, info).await
    }

    async fn write_text_file(
        &self,
        req: &WriteTextFile,
        info: &SessionInfo,
    ) -> std::result::Result<(), HandlerError> {
        self.inner.write_text_file(req, info).await
    }

    async fn terminal(
        &self,
        req: &TerminalRequest,
        info: &SessionInfo,
    ) -> std::result::Result<TerminalResponse, HandlerError> {
        self.inner.terminal(req, info).await
    }

    async fn elicit(&self, req: &ElicitationRequest, info: &SessionInfo) -> ElicitationResponse {
        self.inner.elicit(req, info).await
    }

    async fn elicitation_complete(&self, id: &str, info: &SessionInfo) {
        self.inner.elicitation_complete(id, info).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

struct PendingPermission {
    interrupt_id: InterruptId,
    request: PermissionRequest,
    answer: oneshot::Sender<PermissionOutcome>,
}

/// One AG-UI thread's session.
struct Thread {
    handle: SessionHandle,
    events: tether::Subscription,
    asks: mpsc::Receiver<PermissionAsk>,
    handler: Arc<BridgeHandler>,
    provider: String,
    /// A command was sent whose result has not been read.
    in_flight: bool,
    /// Front-end calls the session waits on.
    pending_calls: Vec<ToolUse>,
    permission: Option<PendingPermission>,
    interrupts: u64,
}

/// Folds a session event into the typed state; returns whether the state changed (and should
/// be published).
pub type StateReducer<S> = dyn Fn(&mut S, &tether::Event) -> bool + Send + Sync;

/// An [`Agent`] that serves tether sessions, one per AG-UI thread.
///
/// With [`SessionAgent::with_state`], session events (typically tool results) update a typed
/// state that is published as `STATE_SNAPSHOT` / `STATE_DELTA` as the run goes.
pub struct SessionAgent<S = ()> {
    factory: Box<SessionFactory>,
    reducer: Option<Box<StateReducer<S>>>,
    handler: Arc<dyn Handler>,
    approval: HashSet<String>,
    policy: PermissionPolicy,
    threads: Mutex<HashMap<ThreadId, Arc<tokio::sync::Mutex<Thread>>>>,
}

impl<S> std::fmt::Debug for SessionAgent<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionAgent")
            .field("policy", &self.policy)
            .field("approval", &self.approval)
            .finish_non_exhaustive()
    }
}

impl SessionAgent<()> {
    /// An agent whose threads get sessions from `factory` (called with the thread's first
    /// request). Set the session's handler with [`SessionAgent::handler`], not on the builder:
    /// the bridge installs its own handler around it.
    pub fn new(
        factory: impl Fn(&RunAgentInput) -> tether::Result<SessionBuilder> + Send + Sync + 'static,
    ) -> Self {
        Self {
            factory: Box::new(factory),
            reducer: None,
            handler: Arc::new(NoTools),
            approval: HashSet::new(),
            policy: PermissionPolicy::default(),
            threads: Mutex::new(HashMap::new()),
        }
    }

    /// Gives the agent a typed state (`RunAgentInput.state` on the way in) that `reducer`
    /// updates from session events; each change is published before the next event.
    pub fn with_state<T: crate::AgentState>(
        self,
        reducer: impl Fn(&mut T, &tether::Event) -> bool + Send + Sync + 'static,
    ) -> SessionAgent<T> {
        SessionAgent {
            factory: self.factory,
            reducer: Some(Box::new(reducer)),
            handler: self.handler,
            approval: self.approval,
            policy: self.policy,
            threads: self.threads,
        }
    }
}

impl<S> SessionAgent<S> {
    /// The handler serving the sessions' backend tools and client-side requests.
    pub fn handler(mut self, handler: impl Handler) -> Self {
        self.handler = Arc::new(handler);
        self
    }

    /// How permission requests are answered.
    pub fn permission_policy(mut self, policy: PermissionPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Backend tools that need the user's permission before each run (asked per the policy).
    pub fn require_approval<I, T>(mut self, tools: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        self.approval.extend(tools.into_iter().map(Into::into));
        self
    }

    /// Closes a thread's session (waiting for a request in flight to be cancelled) and forgets
    /// the thread; its next request opens a new session. `false` if the thread was unknown.
    pub async fn close_thread(&self, thread_id: &ThreadId) -> bool {
        let thread = self.threads.lock().ok().and_then(|mut m| m.remove(thread_id));
        let Some(thread) = thread else {
            return false;
        };
        let mut t = thread.lock().await;
        if let Some(p) = t.permission.take() {
            let _ = p.answer.send(PermissionOutcome::Cancelled);
        }
        t.handle.cancel();
        drop(t);
        if let Ok(t) = Arc::try_unwrap(thread) {
            t.into_inner().handle.close().await;
        }
        true
    }

    /// Number of threads with a live session.
    pub fn thread_count(&self) -> usize {
        self.threads.lock().map(|t| t.len()).unwrap_or(0)
    }

    async fn thread(&self, input: &RunAgentInput) -> Result<Arc<tokio::sync::Mutex<Thread>>> {
        if let Some(t) = self
            .threads
            .lock()
            .ok()
            .and_then(|m| m.get(&input.thread_id).cloned())
        {
            return Ok(t);
        }
        let (asks_tx, asks_rx) = mpsc::channel(4);
        let handler = Arc::new(BridgeHandler {
            inner: self.handler.clone(),
            frontend: RwLock::new(frontend_specs(input)),
            approval: self.approval.clone(),
            policy: self.policy,
            asks: asks_tx,
        });
        let builder = (self.factory)(input).map_err(tether_error)?;
        let session = builder
            .handler_arc(handler.clone())
            .open()
            .await
            .map_err(tether_error)?;
        let provider = session.info().provider.clone();
        let handle = session.spawn();
        let events = handle.subscribe(1024).await;
        let thread = Arc::new(tokio::sync::Mutex::new(Thread {
            handle,
            events,
            asks: asks_rx,
            handler,
            provider,
            in_flight: false,
            pending_calls: Vec::new(),
            permission: None,
            interrupts: 0,
        }));
        let mut map = self
            .threads
            .lock()
            .map_err(|_| Error::agent("INTERNAL", "the thread table is poisoned"))?;
        Ok(map.entry(input.thread_id.clone()).or_insert(thread).clone())
    }
}

fn tether_error(e: tether::Error) -> Error {
    let code = match &e {
        tether::Error::Cancelled => return Error::Cancelled,
        other => other.code().to_ascii_uppercase(),
    };
    Error::Agent {
        code: Some(code),
        message: e.to_string(),
    }
}

fn frontend_specs(input: &RunAgentInput) -> Vec<ToolSpec> {
    input
        .tools
        .iter()
        .map(|t| {
            ToolSpec::new(
                t.name.clone(),
                t.description.clone(),
                t.parameters.clone().unwrap_or_else(|| json!({"type": "object"})),
            )
        })
        .collect()
}

/// Tool calls the input's assistant messages made and no tool message answers.
fn unanswered_calls(input: &RunAgentInput) -> HashSet<String> {
    let mut asked = HashSet::new();
    let mut answered = HashSet::new();
    for m in &input.messages {
        match m {
            Message::Assistant(a) => {
                for c in a.tool_calls.iter().flatten() {
                    asked.insert(c.id.to_string());
                }
            }
            Message::Tool(t) => {
                answered.insert(t.tool_call_id.to_string());
            }
            _ => {}
        }
    }
    asked.retain(|id| !answered.contains(id));
    asked
}

/// Maps a tether session's events onto the AG-UI events of one run.
///
/// Text and reasoning messages are opened and closed around their deltas; a message whose text
/// arrived whole is sent whole, and once (text sent live after the message was recorded, as
/// providers whose messages arrive whole do, is not sent again). Each tool call is started,
/// streamed and ended once; a tool result is shown once, for a call this run showed or one the
/// input left unanswered; usage becomes the run's usage; a retry becomes a `tether.retry` custom
/// event and changes nothing else: the session's sink already shows a retried message once. When
/// the sink restarts a message ([`EventKind::MessageRestart`]: the retried call said something
/// else), its open parts are ended and a `MESSAGES_SNAPSHOT` withdraws what the client was shown
/// of it (the input's messages and this run's, with that message's text and tool calls left out
/// and its reasoning emptied); the message then streams again under its own id, so the client
/// ends with one message holding what the record keeps. [`SessionAgent`] maps its sessions with
/// it; an agent that drives a tether session itself (`tether serve`) uses the same.
///
/// ```
/// use tether_agui::{EventMapper, RunAgentInput};
/// let input: RunAgentInput = serde_json::from_value(serde_json::json!({
///     "threadId": "t1", "runId": "r1", "messages": []
/// })).unwrap();
/// let mapper = EventMapper::new(&input).model("gpt-4o-mini");
/// assert!(!mapper.usage_seen());
/// ```
#[derive(Debug, Default)]
pub struct EventMapper {
    /// The text message open now: the session's message id, and the id it goes out under.
    text: Option<(String, MessageId)>,
    reasoning: Option<MessageId>,
    calls_open: HashSet<String>,
    calls_started: HashSet<String>,
    texts_started: HashSet<String>,
    streamed_text: HashSet<String>,
    streamed_reasoning: HashSet<String>,
    /// Session messages whose durable record was mapped.
    recorded: HashSet<String>,
    /// The text messages each session message went out as.
    texts_of: HashMap<String, Vec<MessageId>>,
    /// The tool calls each session message made.
    calls_of: HashMap<String, Vec<String>>,
    mirror: Mirror,
    answerable: HashSet<String>,
    answered: HashSet<String>,
    usage_seen: bool,
    model: Option<String>,
}

fn reasoning_id(message_id: &str) -> MessageId {
    MessageId::new(format!("{message_id}-reasoning"))
}

/// What the client holds of this run's messages: the events sent so far, folded the way
/// `@ag-ui/client` folds them. A `MESSAGES_SNAPSHOT` replaces the client's whole list, so the one
/// that withdraws a restarted message must list everything else as the client has it.
#[derive(Debug, Default)]
struct Mirror {
    messages: Vec<Message>,
}

impl Mirror {
    fn find(&mut self, id: &str) -> Option<&mut Message> {
        self.messages.iter_mut().rev().find(|m| m.id().as_str() == id)
    }

    fn call(&mut self, id: &str) -> Option<&mut ToolCall> {
        self.messages.iter_mut().rev().find_map(|m| match m {
            Message::Assistant(a) => a.tool_calls.iter_mut().flatten().find(|c| c.id.as_str() == id),
            _ => None,
        })
    }

    fn apply(&mut self, ev: &Event) {
        match ev {
            Event::TextMessageStart(e) if self.find(&e.message_id).is_none() => {
                self.messages.push(Message::Assistant(AssistantMessage {
                    id: e.message_id.clone(),
                    content: Some(String::new()),
                    ..Default::default()
                }));
            }
            Event::TextMessageContent(e) => {
                if let Some(Message::Assistant(a)) = self.find(&e.message_id) {
                    a.content.get_or_insert_with(String::new).push_str(&e.delta);
                }
            }
            Event::ReasoningMessageStart(e) if self.find(&e.message_id).is_none() => {
                self.messages.push(Message::Reasoning(ReasoningMessage {
                    id: e.message_id.clone(),
                    ..Default::default()
                }));
            }
            Event::ReasoningMessageContent(e) => {
                if let Some(Message::Reasoning(r)) = self.find(&e.message_id) {
                    r.content.push_str(&e.delta);
                }
            }
            Event::ReasoningEncryptedValue(e) => match e.subtype {
                EncryptedValueSubtype::ToolCall => {
                    if let Some(c) = self.call(&e.entity_id) {
                        c.encrypted_value = Some(e.encrypted_value.clone());
                    }
                }
                EncryptedValueSubtype::Message => match self.find(&e.entity_id) {
                    Some(Message::Assistant(a)) => a.encrypted_value = Some(e.encrypted_value.clone()),
                    Some(Message::Reasoning(r)) => r.encrypted_value = Some(e.encrypted_value.clone()),
                    _ => {}
                },
            },
            Event::ToolCallStart(e) if self.call(&e.tool_call_id).is_none() => {
                let call = ToolCall::new(e.tool_call_id.clone(), e.tool_call_name.clone(), "");
                // As the client does: under the parent when it is an assistant message, else in
                // an assistant message of its own.
                let parent = e.parent_message_id.as_ref();
                if let Some(p) = parent
                    && let Some(Message::Assistant(a)) = self.find(p)
                {
                    a.tool_calls.get_or_insert_with(Vec::new).push(call);
                    return;
                }
                let id = match parent {
                    Some(p) if self.find(p).is_none() => p.clone(),
                    _ => MessageId::new(e.tool_call_id.as_str()),
                };
                self.messages.push(Message::Assistant(AssistantMessage {
                    id,
                    tool_calls: Some(vec![call]),
                    ..Default::default()
                }));
            }
            Event::ToolCallArgs(e) => {
                if let Some(c) = self.call(&e.tool_call_id) {
                    c.function.arguments.push_str(&e.delta);
                }
            }
            Event::ToolCallResult(e) => self.messages.push(Message::Tool(ToolMessage {
                id: e.message_id.clone(),
                content: e.content.clone(),
                tool_call_id: e.tool_call_id.clone(),
                ..Default::default()
            })),
            _ => {}
        }
    }
}

impl EventMapper {
    /// A mapper for the run of `input` (whose unanswered tool calls it may show results of).
    pub fn new(input: &RunAgentInput) -> Self {
        EventMapper {
            answerable: unanswered_calls(input),
            ..Default::default()
        }
    }

    /// The model named on the usage the run reports.
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// Whether a usage event was mapped (the run's usage is then reported; a caller adding the
    /// session's total as well would count it twice).
    pub fn usage_seen(&self) -> bool {
        self.usage_seen
    }

    /// Whether this run showed the tool call, or the input left it unanswered: the calls whose
    /// results and approvals belong to this run.
    pub fn knows_call(&self, tool_use_id: &str) -> bool {
        self.calls_started.contains(tool_use_id) || self.answerable.contains(tool_use_id)
    }

    /// Maps one session event (and nothing for kinds AG-UI has no event for).
    pub fn map<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>, ev: &tether::Event) -> Result<()> {
        self.on_event(ctx, ev)
    }

    /// Ends whatever is open: the reasoning and text messages, and tool calls not yet ended.
    pub fn close<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>) -> Result<()> {
        self.close_all(ctx)
    }

    /// Emits an event and folds it into what the client holds.
    fn send<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>, ev: Event) -> Result<()> {
        self.mirror.apply(&ev);
        ctx.emit(ev)
    }

    fn close_text<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>) -> Result<()> {
        if let Some((_, id)) = self.text.take() {
            self.send(ctx, Event::text_message_end(id))?;
        }
        Ok(())
    }

    fn close_reasoning<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>) -> Result<()> {
        if let Some(id) = self.reasoning.take() {
            self.send(ctx, Event::reasoning_message_end(id.clone()))?;
            self.send(ctx, Event::reasoning_end(id))?;
        }
        Ok(())
    }

    fn close_all<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>) -> Result<()> {
        self.close_reasoning(ctx)?;
        self.close_text(ctx)?;
        let mut open: Vec<String> = self.calls_open.drain().collect();
        open.sort();
        for id in open {
            self.send(ctx, Event::tool_call_end(id))?;
        }
        Ok(())
    }

    fn text_delta<S: crate::AgentState>(
        &mut self,
        ctx: &mut RunContext<S>,
        message_id: &str,
        delta: &str,
    ) -> Result<()> {
        if delta.is_empty() {
            return Ok(());
        }
        self.close_reasoning(ctx)?;
        let id = match &self.text {
            Some((source, id)) if source == message_id => id.clone(),
            _ => {
                self.close_text(ctx)?;
                let id = if self.texts_started.insert(message_id.to_owned()) {
                    MessageId::new(message_id)
                } else {
                    MessageId::new(format!("{message_id}-{}", self.texts_started.len()))
                };
                self.send(
                    ctx,
                    Event::text_message_start(id.clone(), TextMessageRole::Assistant),
                )?;
                self.streamed_text.insert(message_id.to_owned());
                self.texts_of
                    .entry(message_id.to_owned())
                    .or_default()
                    .push(id.clone());
                self.text = Some((message_id.to_owned(), id.clone()));
                id
            }
        };
        self.send(ctx, Event::text_message_content(id, delta))
    }

    fn reasoning_delta<S: crate::AgentState>(
        &mut self,
        ctx: &mut RunContext<S>,
        message_id: &str,
        delta: &str,
    ) -> Result<()> {
        if delta.is_empty() {
            return Ok(());
        }
        let rid = reasoning_id(message_id);
        if self.reasoning.as_ref() != Some(&rid) {
            self.close_reasoning(ctx)?;
            self.close_text(ctx)?;
            self.send(ctx, Event::reasoning_start(rid.clone()))?;
            self.send(ctx, Event::reasoning_message_start(rid.clone()))?;
            self.reasoning = Some(rid.clone());
        }
        self.streamed_reasoning.insert(message_id.to_owned());
        self.send(ctx, Event::reasoning_message_content(rid, delta))
    }

    fn call_start<S: crate::AgentState>(
        &mut self,
        ctx: &mut RunContext<S>,
        id: &str,
        name: &str,
        message_id: Option<&str>,
    ) -> Result<bool> {
        if !self.calls_started.insert(id.to_owned()) {
            return Ok(false);
        }
        self.close_reasoning(ctx)?;
        let owner = message_id.or_else(|| self.text.as_ref().map(|(source, _)| source.as_str()));
        if let Some(owner) = owner {
            self.calls_of
                .entry(owner.to_owned())
                .or_default()
                .push(id.to_owned());
        }
        let parent = message_id
            .map(MessageId::new)
            .or_else(|| self.text.as_ref().map(|(_, id)| id.clone()));
        self.close_text(ctx)?;
        self.send(ctx, Event::tool_call_start(id, name, parent))?;
        self.calls_open.insert(id.to_owned());
        Ok(true)
    }

    fn whole_call<S: crate::AgentState>(
        &mut self,
        ctx: &mut RunContext<S>,
        call: &ToolUse,
        message_id: Option<&str>,
    ) -> Result<()> {
        if self.call_start(ctx, &call.id, &call.name, message_id)? {
            let args = call.raw_input.clone().unwrap_or_else(|| call.input.to_string());
            if !args.is_empty() {
                self.send(ctx, Event::tool_call_args(call.id.as_str(), args))?;
            }
        }
        if self.calls_open.remove(&call.id) {
            self.send(ctx, Event::tool_call_end(call.id.as_str()))?;
        }
        Ok(())
    }

    /// The sink restarted `message_id`: end its open parts, withdraw what the client holds of it
    /// with a snapshot, and forget it, so it streams again under its own id.
    fn restart<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>, message_id: &str) -> Result<()> {
        let rid = reasoning_id(message_id);
        let texts = self.texts_of.remove(message_id).unwrap_or_default();
        let calls = self.calls_of.remove(message_id).unwrap_or_default();
        let reasoned = self.streamed_reasoning.remove(message_id);
        if texts.is_empty() && calls.is_empty() && !reasoned {
            return Ok(()); // nothing of it was shown in this run
        }
        if self.reasoning.as_ref() == Some(&rid) {
            self.close_reasoning(ctx)?;
        }
        if self.text.as_ref().is_some_and(|(source, _)| source == message_id) {
            self.close_text(ctx)?;
        }
        let mut open: Vec<&String> = calls.iter().filter(|c| self.calls_open.contains(*c)).collect();
        open.sort();
        for id in open {
            self.calls_open.remove(id);
            self.send(ctx, Event::tool_call_end(id.as_str()))?;
        }
        // What the client holds, less the message: its text messages and calls left out (the
        // client drops what a snapshot does not list), its reasoning emptied (a snapshot that
        // lists no reasoning message keeps every reasoning message the client has).
        self.mirror.messages.retain(|m| !texts.contains(m.id()));
        for m in &mut self.mirror.messages {
            match m {
                Message::Assistant(a) => {
                    if let Some(tc) = &mut a.tool_calls {
                        tc.retain(|c| !calls.iter().any(|x| x == c.id.as_str()));
                    }
                }
                Message::Reasoning(r) if r.id == rid => {
                    r.content.clear();
                    r.encrypted_value = None;
                }
                _ => {}
            }
        }
        // A message that held only the withdrawn calls goes too.
        self.mirror.messages.retain(|m| match m {
            Message::Assistant(a) => {
                a.content.is_some() || a.tool_calls.as_ref().is_some_and(|c| !c.is_empty())
            }
            _ => true,
        });
        let mut snapshot: Vec<Message> = ctx
            .input()
            .messages
            .iter()
            .filter(|m| !matches!(m, Message::Activity(_)))
            .filter(|m| !self.mirror.messages.iter().any(|x| x.id() == m.id()))
            .cloned()
            .collect();
        snapshot.extend(self.mirror.messages.iter().cloned());
        ctx.emit(Event::messages_snapshot(snapshot))?;
        self.texts_started.remove(message_id);
        self.streamed_text.remove(message_id);
        for c in &calls {
            self.calls_started.remove(c);
        }
        Ok(())
    }

    fn on_event<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>, ev: &tether::Event) -> Result<()> {
        match &ev.kind {
            // Live text of a message already recorded (and so already sent whole) is not sent again.
            EventKind::TextDelta { message_id, .. } | EventKind::ReasoningDelta { message_id, .. }
                if self.recorded.contains(message_id) => {}
            EventKind::TextDelta { message_id, delta } => {
                self.text_delta(ctx, message_id, delta)?;
            }
            EventKind::ReasoningDelta { message_id, delta } => {
                self.reasoning_delta(ctx, message_id, delta)?;
            }
            EventKind::ReasoningSignature { message_id, value } => {
                self.send(
                    ctx,
                    Event::reasoning_encrypted_value(
                        EncryptedValueSubtype::Message,
                        reasoning_id(message_id).into_string(),
                        value.clone(),
                    ),
                )?;
            }
            EventKind::ToolCallStart {
                tool_use_id,
                name,
                message_id,
            } => {
                self.call_start(ctx, tool_use_id, name, message_id.as_deref())?;
            }
            EventKind::ToolCallArgs { tool_use_id, delta }
                if self.calls_open.contains(tool_use_id) && !delta.is_empty() =>
            {
                self.send(ctx, Event::tool_call_args(tool_use_id.as_str(), delta.as_str()))?;
            }
            EventKind::ToolCallEnd { tool_use_id } if self.calls_open.remove(tool_use_id) => {
                self.send(ctx, Event::tool_call_end(tool_use_id.as_str()))?;
            }
            EventKind::ToolCall { tool_use, message_id } => {
                self.whole_call(ctx, tool_use, message_id.as_deref())?;
            }
            EventKind::ToolResult { result } => {
                let id = &result.tool_use_id;
                if self.calls_open.remove(id) {
                    self.send(ctx, Event::tool_call_end(id.as_str()))?;
                }
                let known = self.calls_started.contains(id) || self.answerable.contains(id);
                if known && self.answered.insert(id.clone()) {
                    self.close_reasoning(ctx)?;
                    self.close_text(ctx)?;
                    self.send(
                        ctx,
                        Event::tool_call_result(format!("{id}-result"), id.as_str(), result.content.clone()),
                    )?;
                }
            }
            EventKind::Message {
                message_id,
                role: tether::Role::Assistant,
                text,
                reasoning,
                tool_uses,
            } => {
                if let Some(r) = reasoning
                    && !self.streamed_reasoning.contains(message_id)
                {
                    self.reasoning_delta(ctx, message_id, r)?;
                }
                self.close_reasoning(ctx)?;
                if !self.streamed_text.contains(message_id) {
                    self.text_delta(ctx, message_id, text)?;
                }
                for u in tool_uses {
                    self.whole_call(ctx, u, Some(message_id))?;
                }
                self.close_text(ctx)?;
                self.recorded.insert(message_id.clone());
            }
            EventKind::MessageRestart { message_id } => self.restart(ctx, message_id)?,
            EventKind::Usage { usage } => {
                self.usage_seen = true;
                ctx.add_usage(TokenUsage {
                    model: self.model.clone(),
                    input_tokens: Some(usage.input_tokens),
                    output_tokens: Some(usage.output_tokens),
                    total_tokens: Some(usage.total()),
                    cached_input_tokens: (usage.cache_read_tokens > 0).then_some(usage.cache_read_tokens),
                    ..Default::default()
                });
            }
            EventKind::Retry {
                attempt,
                delay_ms,
                error,
            } => {
                // Shown for what it is; what the call streams again the sink shows once.
                ctx.emit(Event::custom(
                    "tether.retry",
                    json!({"attempt": attempt, "delayMs": delay_ms, "error": error}),
                ))?;
            }
            _ => {}
        }
        Ok(())
    }
}

impl<S: crate::AgentState> SessionAgent<S> {
    fn on_event(&self, mapper: &mut EventMapper, ctx: &mut RunContext<S>, ev: &tether::Event) -> Result<()> {
        mapper.map(ctx, ev)?;
        if let Some(reduce) = &self.reducer
            && reduce(ctx.state_mut(), ev)
        {
            ctx.publish_state()?;
        }
        Ok(())
    }
}

impl<S: crate::AgentState + Sync> Agent for SessionAgent<S> {
    type State = S;

    async fn run(&self, ctx: &mut RunContext<S>) -> Result<RunOutcome> {
        let thread = self.thread(ctx.input()).await?;
        // A run of this thread that was just cancelled may still be winding down.
        let Ok(mut t) = tokio::time::timeout(std::time::Duration::from_secs(10), thread.lock()).await else {
            return Err(Error::agent(
                "THREAD_BUSY",
                format!(
                    "thread {} is already running; wait for its run to finish",
                    ctx.thread_id()
                ),
            ));
        };
        let t = &mut *t;
        if let Ok(mut f) = t.handler.frontend.write() {
            *f = frontend_specs(ctx.input());
        }
        let mut mapper = EventMapper::new(ctx.input());

        // 1. What this request asks of the session.
        if let Some(p) = t.permission.take() {
            let outcome = match ctx.resume_for(&p.interrupt_id) {
                Some(entry) if entry.status == ResumeStatus::Resolved => {
                    resolve_permission(&p.request, entry.payload.as_ref())
                }
                _ => p
                    .request
                    .reject_option()
                    .map(|o| PermissionOutcome::Selected {
                        option_id: o.id.clone(),
                    })
                    .unwrap_or(PermissionOutcome::Cancelled),
            };
            let _ = p.answer.send(outcome);
        } else {
            if t.in_flight {
                // A previous run was abandoned mid-request: settle it first.
                t.handle.cancel();
                let _ = t.handle.next_result().await;
                while t.events.try_recv().is_ok() {}
                t.in_flight = false;
            }
            if !t.pending_calls.is_empty() {
                let results = tool_results_from(ctx.input(), &t.pending_calls);
                if results.is_empty() {
                    return Err(Error::agent(
                        "TOOL_RESULTS_MISSING",
                        format!(
                            "the session waits for results of front-end tool calls {}; send them as tool messages",
                            t.pending_calls
                                .iter()
                                .map(|u| u.id.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    ));
                }
                t.pending_calls.clear();
                t.handle
                    .submit_tool_results(results)
                    .await
                    .map_err(tether_error)?;
            } else {
                let Some(text) = ctx.last_user_text() else {
                    return Err(Error::agent(
                        "NO_USER_MESSAGE",
                        "the request carries no user message to send",
                    ));
                };
                t.handle.send(text).await.map_err(tether_error)?;
            }
            t.in_flight = true;
        }

        // 2. Stream the session's events until its result (or a permission interrupt).
        let cancel = ctx.cancel_token().clone();
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => {
                    // Interrupt the provider and settle the request, so the thread is ready
                    // for its next run.
                    t.handle.cancel();
                    let settle = std::time::Duration::from_secs(2);
                    if tokio::time::timeout(settle, t.handle.next_result()).await.is_ok() {
                        t.in_flight = false;
                        while t.events.try_recv().is_ok() {}
                    }
                    return Err(Error::Cancelled);
                }
                ev = t.events.recv() => {
                    let Some(ev) = ev else {
                        return Err(Error::agent("SESSION_CLOSED", "the session's event stream closed"));
                    };
                    self.on_event(&mut mapper, ctx, &ev)?;
                    ctx.ready().await?;
                }
                ask = t.asks.recv() => {
                    let Some(ask) = ask else { continue };
                    while let Ok(ev) = t.events.try_recv() {
                        self.on_event(&mut mapper, ctx, &ev)?;
                    }
                    mapper.close_all(ctx)?;
                    t.interrupts += 1;
                    let interrupt_id = InterruptId::new(format!(
                        "{}-permission-{}",
                        ctx.thread_id(),
                        t.interrupts
                    ));
                    let interrupt = permission_interrupt(&interrupt_id, &ask.request, &mapper);
                    t.permission = Some(PendingPermission {
                        interrupt_id,
                        request: ask.request,
                        answer: ask.answer,
                    });
                    return Ok(RunOutcome::interrupt(vec![interrupt]));
                }
                res = t.handle.next_result() => {
                    t.in_flight = false;
                    while let Ok(ev) = t.events.try_recv() {
                        self.on_event(&mut mapper, ctx, &ev)?;
                    }
                    mapper.close_all(ctx)?;
                    let Some(res) = res else {
                        return Err(Error::agent("SESSION_CLOSED", "the session ended"));
                    };
                    let res = res.map_err(tether_error)?;
                    if !mapper.usage_seen() && (res.usage.input_tokens > 0 || res.usage.output_tokens > 0) {
                        ctx.add_usage(TokenUsage {
                            provider: Some(t.provider.clone()),
                            input_tokens: Some(res.usage.input_tokens),
                            output_tokens: Some(res.usage.output_tokens),
                            total_tokens: Some(res.usage.total()),
                            cached_input_tokens: (res.usage.cache_read_tokens > 0)
                                .then_some(res.usage.cache_read_tokens),
                            ..Default::default()
                        });
                    }
                    t.pending_calls = res.pending_tool_uses.clone();
                    if let Some(out) = res.final_output {
                        ctx.set_result(out);
                    }
                    return Ok(RunOutcome::Success);
                }
            }
        }
    }
}

fn tool_results_from(input: &RunAgentInput, pending: &[ToolUse]) -> Vec<ToolResult> {
    let mut out = Vec::new();
    for m in &input.messages {
        if let Message::Tool(tm) = m
            && pending.iter().any(|u| u.id == tm.tool_call_id.as_str())
        {
            let text = tm.content.to_text();
            out.push(match &tm.error {
                Some(err) if text.is_empty() => ToolResult::error(tm.tool_call_id.as_str(), err),
                Some(err) => ToolResult::error(tm.tool_call_id.as_str(), format!("{err}: {text}")),
                None => ToolResult::ok(tm.tool_call_id.as_str(), text),
            });
        }
    }
    out
}

fn permission_interrupt(id: &InterruptId, req: &PermissionRequest, mapper: &EventMapper) -> Interrupt {
    let options: Vec<Value> = req
        .options
        .iter()
        .map(|o| json!({"id": o.id, "name": o.name, "kind": o.kind}))
        .collect();
    let ids: Vec<&str> = req.options.iter().map(|o| o.id.as_str()).collect();
    let schema = json!({
        "type": "object",
        "properties": {
            "approved": {"type": "boolean"},
            "optionId": {"type": "string", "enum": ids}
        }
    });
    let mut i = Interrupt::new(id.clone(), "permission").with_message(format!("Allow {}?", req.title));
    if mapper.knows_call(&req.tool_use_id) {
        i = i.with_tool_call(ToolCallId::new(req.tool_use_id.clone()));
    }
    if let Value::Object(s) = schema {
        i = i.with_response_schema(s);
    }
    let mut meta = serde_json::Map::new();
    meta.insert("options".into(), Value::Array(options));
    meta.insert("input".into(), req.input.clone());
    i.metadata = Some(meta);
    i
}

/// A resolved resume payload: `{"optionId": "..."}` or `{"approved": bool}` (or a bare bool).
fn resolve_permission(req: &PermissionRequest, payload: Option<&Value>) -> PermissionOutcome {
    let select = |o: Option<&tether::PermissionOption>| {
        o.map(|o| PermissionOutcome::Selected {
            option_id: o.id.clone(),
        })
        .unwrap_or(PermissionOutcome::Cancelled)
    };
    if let Some(option) = payload.and_then(|p| p.get("optionId")).and_then(Value::as_str)
        && req.options.iter().any(|o| o.id == option)
    {
        return PermissionOutcome::Selected {
            option_id: option.to_owned(),
        };
    }
    let approved = match payload {
        Some(Value::Bool(b)) => *b,
        Some(p) => p.get("approved").and_then(Value::as_bool).unwrap_or(true),
        None => true,
    };
    if approved {
        select(
            req.option_of(PermissionKind::AllowOnce)
                .or_else(|| req.options.iter().find(|o| o.kind.allows())),
        )
    } else {
        select(req.reject_option())
    }
}
