//! [`Session`]: the session engine, written once for every provider.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::event::{Event, EventKind};
use crate::handler::{Handler, NoTools, ToolOutput};
use crate::provider::{Input, Opened, Provider, TurnContext};
use crate::retry::RetryPolicy;
use crate::sink::EventSink;
use crate::store::{EventStore, MemoryStore};
use crate::types::{
    SessionInfo, SessionResult, Terminal, ToolResult, ToolSpec, ToolUse, TurnResult, Usage, stop_reason,
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
pub struct SessionConfig {
    /// Most turns per request (default 50). Turn `max_turns + 1` is never started: the request
    /// ends `Terminated` with stop reason `max_turns`, keeping the last turn's text.
    pub max_turns: u32,
    /// Tool uses of one turn run at most this many at a time (default 8); results keep input order.
    pub tool_concurrency: usize,
    /// A tool that runs longer gets an error result (default 5 minutes; `None`: no limit).
    pub tool_timeout: Option<Duration>,
    /// The terminal tool, when the run must end by calling it. Declared to the model; a call ends
    /// the request (`final_output` holds its input); an `EndTurn` without it is re-prompted.
    pub terminal_tool: Option<ToolSpec>,
    /// Re-prompts before giving up on the terminal tool (default 2).
    pub max_reprompts: u32,
    /// The time limit of [`Session::run`] (default 600 s).
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

/// Builds a [`Session`]: a provider, a handler, a store, and a [`SessionConfig`].
pub struct SessionBuilder {
    provider: Box<dyn Provider>,
    handler: Arc<dyn Handler>,
    store: Arc<dyn EventStore>,
    config: SessionConfig,
    /// The session's stored events, when the caller loaded them already.
    stored: Option<Vec<Event>>,
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

    /// The time limit of [`Session::run`].
    pub fn timeout(mut self, d: Duration) -> Self {
        self.config.timeout = d;
        self
    }

    /// A guard checked after every turn.
    pub fn turn_guard(mut self, g: impl Fn(&GuardInfo) -> GuardDecision + Send + Sync + 'static) -> Self {
        self.config.turn_guard = Some(Arc::new(g));
        self
    }

    /// The session's stored events, when the caller has just loaded them from the store (to
    /// rebuild a history, say): [`Self::open`] then takes its record's ids and sequence from
    /// them instead of loading them again. They must be the events of the session the provider
    /// opens, as [`EventStore::load`] returned them.
    pub fn stored_events(mut self, events: Vec<Event>) -> Self {
        self.stored = Some(events);
        self
    }

    /// Opens the session (creating or reattaching on the provider's side).
    pub async fn open(self) -> Result<Session> {
        let tools = declared_tools(self.handler.as_ref(), self.config.terminal_tool.as_ref());
        let mut info = SessionInfo::new("", self.provider.name());
        info.metadata = self.config.metadata.clone();
        let sink = EventSink::new(info.clone(), self.handler.clone(), self.store.clone());
        let cx = TurnContext {
            sink,
            handler: self.handler,
            tools,
            terminal_tool: self.config.terminal_tool.as_ref().map(|t| t.name.clone()),
            turn: 0,
            max_turns: self.config.max_turns,
        };
        let mut provider = self.provider;
        let opened = provider.open(&cx).await?;
        info.session_id = opened.session_id.clone();
        cx.sink.set_info(info);
        let stored = match self.stored {
            Some(events) => events,
            None => cx.sink.store().load(&opened.session_id).await?,
        };
        cx.sink.seed(&stored).await;
        Ok(Session {
            provider,
            cx,
            config: self.config,
            pending: opened.pending.clone(),
            held: Vec::new(),
            opened,
            unsaved: false,
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
        let deadline = tokio::time::Instant::now() + timeout;
        let prompt = prompt.into();
        let mut session = match tokio::time::timeout_at(deadline, self.open()).await {
            Ok(s) => s?,
            Err(_) => return Err(Error::Timeout(timeout)),
        };
        let r = tokio::time::timeout_at(deadline, session.send(prompt)).await;
        match r {
            Ok(res) => {
                let _ = session.provider.close().await;
                res
            }
            Err(_) => {
                // The deadline has passed: give the provider a short, bounded chance to stop the
                // remote loop and close, so a hung endpoint cannot hold the caller.
                let grace = Duration::from_secs(10);
                let _ = tokio::time::timeout(grace, session.provider.interrupt()).await;
                let _ = tokio::time::timeout(grace, session.provider.close()).await;
                Err(Error::Timeout(timeout))
            }
        }
    }
}

/// A session: one provider driven by the engine, with a handler and a store.
///
/// [`Session::send`] runs one request (a prompt or a follow-up) to its end; the loop runs tool
/// uses through the handler (up to 8 at a time, results in order, errors and panics become error
/// results, each result recorded in the store's memo before the provider is resumed), applies the
/// turn limit, the turn guard and the terminal tool, and reconnects dropped streams. For a
/// long-lived session driven from elsewhere, [`Session::spawn`] returns a [`SessionHandle`].
pub struct Session {
    provider: Box<dyn Provider>,
    cx: TurnContext,
    config: SessionConfig,
    opened: Opened,
    /// Tool uses a reattached session still waits for.
    pending: Vec<ToolUse>,
    /// A batch paused on front-end tools: every use with its result where one is known.
    held: Vec<(ToolUse, Option<ToolResult>)>,
    /// Whether the provider may have changed since its transcript was last saved.
    unsaved: bool,
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

#[derive(Default)]
struct Acc {
    texts: Vec<String>,
    tool_uses: Vec<ToolUse>,
    server_tool_uses: Vec<ToolUse>,
    usage: Usage,
    turns: u32,
    final_output: Option<Value>,
    terminal_called: bool,
}

impl Acc {
    fn absorb(&mut self, tr: &TurnResult) {
        self.texts.push(tr.text.clone());
        for u in &tr.tool_uses {
            if !self.tool_uses.iter().any(|x| x.id == u.id) {
                self.tool_uses.push(u.clone());
            }
        }
        self.server_tool_uses.extend(tr.server_tool_uses.iter().cloned());
        if let Some(u) = &tr.usage {
            self.usage.add(u);
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
            stored: None,
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

    /// Tool uses waiting for results from outside (front-end tools), if the last request paused.
    pub fn pending_tool_uses(&self) -> Vec<ToolUse> {
        self.held
            .iter()
            .filter(|(_, r)| r.is_none())
            .map(|(u, _)| u.clone())
            .chain(self.pending.iter().cloned())
            .collect()
    }

    /// The provider's client-held history, if it keeps one.
    pub fn transcript(&self) -> Option<Value> {
        self.provider.transcript()
    }

    /// Runs one request: a prompt or follow-up message, to its end.
    ///
    /// Fails with [`Error::Config`] while tool uses are pending: submit their results first.
    pub async fn send(&mut self, text: impl Into<String>) -> Result<SessionResult> {
        self.send_cancellable(text, CancellationToken::new()).await
    }

    /// [`Session::send`], stopped early when `cancel` fires: the turn in flight is dropped, the
    /// provider asked to interrupt, and [`Error::Cancelled`] returned.
    pub async fn send_cancellable(
        &mut self,
        text: impl Into<String>,
        cancel: CancellationToken,
    ) -> Result<SessionResult> {
        if !self.pending_tool_uses().is_empty() {
            return Err(Error::Config(
                "the session waits for tool results: call submit_tool_results (or resume) first".into(),
            ));
        }
        self.request(Input::Message(text.into()), cancel).await
    }

    /// Runs one request from any [`Input`]: a provider-specific raw input such as a Managed
    /// Agents `user.define_outcome` event, or a message. Same rules as [`Session::send`].
    pub async fn send_input(&mut self, input: Input, cancel: CancellationToken) -> Result<SessionResult> {
        if !self.pending_tool_uses().is_empty() {
            return Err(Error::Config(
                "the session waits for tool results: call submit_tool_results (or resume) first".into(),
            ));
        }
        self.request(input, cancel).await
    }

    /// Resumes a paused request with results for its pending tool uses (front-end tools), or a
    /// reattached session with results for what it waited on. Results for unknown ids are ignored;
    /// uses still without a result keep the session paused.
    pub async fn submit_tool_results(
        &mut self,
        results: Vec<ToolResult>,
        cancel: CancellationToken,
    ) -> Result<SessionResult> {
        let mut batch: Vec<(ToolUse, Option<ToolResult>)> = std::mem::take(&mut self.held);
        batch.extend(self.pending.drain(..).map(|u| (u, None)));
        for r in results {
            if let Some(slot) = batch.iter_mut().find(|(u, _)| u.id == r.tool_use_id) {
                let store = self.cx.sink.store().clone();
                let sid = self.info().session_id.clone();
                store.put_tool_result(&sid, &r).await?;
                record_result(&self.cx.sink, &r).await?;
                slot.1 = Some(r);
            }
        }
        if batch.iter().any(|(_, r)| r.is_none()) {
            self.held = batch;
            return Ok(self.paused_result(Vec::new()).await);
        }
        let (uses, results): (Vec<ToolUse>, Vec<ToolResult>) = batch
            .into_iter()
            .map(|(u, r)| (u, r.unwrap_or_else(|| ToolResult::error("", ""))))
            .unzip();
        self.request(Input::ToolResults(uses, results), cancel).await
    }

    /// Gives up on the pending tool uses (front-end tools nobody answered): each gets an error
    /// result saying `reason`, recorded in the store and handed to the provider's history, so the
    /// next [`Session::send`] can start a new request instead of failing.
    pub async fn abandon_pending_tools(&mut self, reason: &str) -> Result<()> {
        let mut batch: Vec<(ToolUse, Option<ToolResult>)> = std::mem::take(&mut self.held);
        batch.extend(self.pending.drain(..).map(|u| (u, None)));
        if batch.is_empty() {
            return Ok(());
        }
        let sid = self.info().session_id.clone();
        let mut uses = Vec::with_capacity(batch.len());
        let mut results = Vec::with_capacity(batch.len());
        for (u, r) in batch {
            let r = match r {
                Some(r) => r,
                None => {
                    let r = ToolResult::error(&u.id, reason);
                    self.cx.sink.store().put_tool_result(&sid, &r).await?;
                    record_result(&self.cx.sink, &r).await?;
                    r
                }
            };
            uses.push(u);
            results.push(r);
        }
        self.record_tool_results(&uses, &results).await?;
        self.checkpoint().await
    }

    /// Resumes a reattached session: re-runs the tool uses it waits on through the handler and
    /// continues. With nothing pending it returns at once with stop reason `idle`.
    pub async fn resume(&mut self, cancel: CancellationToken) -> Result<SessionResult> {
        if self.pending.is_empty() && self.held.is_empty() {
            let sid = self.info().session_id.clone();
            return Ok(SessionResult {
                terminal: Terminal::EndTurn,
                stop_reason: json!(stop_reason::IDLE),
                session_id: sid,
                text: String::new(),
                texts: Vec::new(),
                tool_uses: Vec::new(),
                server_tool_uses: Vec::new(),
                pending_tool_uses: Vec::new(),
                final_output: None,
                usage: Usage::default(),
                turns: 0,
                events: self.cx.sink.take_record().await,
                transcript: self.provider.transcript(),
            });
        }
        let uses: Vec<ToolUse> = std::mem::take(&mut self.pending);
        let (results, pending) = run_tools(&self.cx, &self.config, &uses).await?;
        if !pending.is_empty() {
            self.held = uses.into_iter().zip(results).collect();
            return Ok(self.paused_result(Vec::new()).await);
        }
        let results = results.into_iter().flatten().collect();
        self.request(Input::ToolResults(uses, results), cancel).await
    }

    /// Closes the provider's side of the session.
    pub async fn close(mut self) -> Result<()> {
        self.provider.close().await
    }

    async fn request(&mut self, input: Input, cancel: CancellationToken) -> Result<SessionResult> {
        // Handlers may change their tools between requests (AG-UI front-end tools do).
        self.cx.tools = declared_tools(self.cx.handler.as_ref(), self.config.terminal_tool.as_ref());
        let r = tokio::select! {
            biased;
            _ = cancel.cancelled() => None,
            r = self.drive(input) => Some(r),
        };
        let r = match r {
            Some(r) => r,
            None => {
                let _ = tokio::time::timeout(Duration::from_secs(10), self.provider.interrupt()).await;
                let _ = self.cx.sink.take_record().await;
                Err(Error::Cancelled)
            }
        };
        self.checkpoint().await?;
        r
    }

    /// Saves the provider's transcript (state key `transcript`) so a crash loses at most the turn
    /// in flight: called after every turn and at the end of every request. Nothing is written
    /// when the provider was not called since the last save (a request that ends with the turn
    /// just saved).
    fn checkpoint(&mut self) -> impl std::future::Future<Output = Result<()>> + Send + 'static {
        let transcript = match std::mem::take(&mut self.unsaved) {
            true => self.provider.transcript(),
            false => None,
        };
        let sink = self.cx.sink.clone();
        async move {
            if let Some(t) = transcript {
                let sid = sink.info().session_id.clone();
                sink.store().put_state(&sid, "transcript", &t).await?;
            }
            Ok(())
        }
    }

    async fn drive(&mut self, first: Input) -> Result<SessionResult> {
        let mut acc = Acc::default();
        if let Input::Message(text) = &first {
            // The user's side of the conversation belongs in the record too.
            self.cx
                .sink
                .record(
                    "",
                    "tether.user_message",
                    json!({"text": text}),
                    EventKind::Message {
                        message_id: String::new(),
                        role: crate::event::Role::User,
                        text: text.clone(),
                        reasoning: None,
                        tool_uses: Vec::new(),
                    },
                )
                .await?;
        }
        let mut input = first;
        let mut reprompts_left = self.config.max_reprompts;
        let terminal_name = self.config.terminal_tool.as_ref().map(|t| t.name.clone());
        loop {
            if acc.turns >= self.config.max_turns {
                return Ok(self
                    .finish(
                        acc,
                        Terminal::Terminated,
                        json!(stop_reason::MAX_TURNS),
                        Vec::new(),
                    )
                    .await);
            }
            self.cx.turn = acc.turns + 1;
            let tr = self.turn_with_reconnect(input, &mut acc).await?;
            acc.turns += 1;
            acc.absorb(&tr);
            self.checkpoint().await?;
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
                        let sr = json!({"type": stop_reason::HALTED, "reason": reason});
                        return Ok(self.finish(acc, Terminal::Terminated, sr, Vec::new()).await);
                    }
                    Err(p) => return Err(Error::Guard(panic_message(p.as_ref()))),
                }
            }
            match tr.terminal {
                Terminal::RequiresAction => {
                    let mut uses: Vec<ToolUse> = Vec::new();
                    for u in tr.tool_uses {
                        if uses.iter().any(|x| x.id == u.id) {
                            tracing::warn!(tool_use_id = %u.id, "duplicate tool-use id in one turn; keeping the first");
                        } else {
                            uses.push(u);
                        }
                    }
                    if uses.is_empty() {
                        input = Input::Continue;
                        continue;
                    }
                    let (results, pending) = run_tools(&self.cx, &self.config, &uses).await?;
                    if let Some(t) = uses.iter().find(|u| Some(&u.name) == terminal_name.as_ref()) {
                        acc.terminal_called = true;
                        acc.final_output = Some(t.input.clone());
                        let done: Vec<ToolResult> = results
                            .iter()
                            .zip(&uses)
                            .map(|(r, u)| {
                                r.clone()
                                    .unwrap_or_else(|| ToolResult::error(&u.id, "not run: the run ended"))
                            })
                            .collect();
                        self.record_tool_results(&uses, &done).await?;
                        return Ok(self
                            .finish(
                                acc,
                                Terminal::EndTurn,
                                json!(stop_reason::TERMINAL_TOOL),
                                Vec::new(),
                            )
                            .await);
                    }
                    if !pending.is_empty() {
                        self.held = uses.into_iter().zip(results).collect();
                        return Ok(self
                            .finish(
                                acc,
                                Terminal::RequiresAction,
                                json!(stop_reason::PENDING_TOOLS),
                                pending,
                            )
                            .await);
                    }
                    input = Input::ToolResults(uses, results.into_iter().flatten().collect());
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
                            self.cx
                                .sink
                                .record(
                                    "",
                                    "tether.reprompt",
                                    json!({"text": text}),
                                    EventKind::Directive {
                                        role: "reprompt".into(),
                                        text: text.clone(),
                                    },
                                )
                                .await?;
                            input = Input::Message(text);
                            continue;
                        }
                        return Ok(self
                            .finish(
                                acc,
                                Terminal::EndTurn,
                                json!(stop_reason::NO_TERMINAL_TOOL),
                                Vec::new(),
                            )
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

    /// Hands tool results to the provider (its transcript then needs saving).
    async fn record_tool_results(&mut self, uses: &[ToolUse], results: &[ToolResult]) -> Result<()> {
        self.unsaved = true;
        self.provider.record_tool_results(uses, results).await
    }

    async fn turn_with_reconnect(&mut self, input: Input, acc: &mut Acc) -> Result<TurnResult> {
        self.unsaved = true;
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
            // Back off and reconnect until it works, the error is final, or the tries run out.
            let pending = loop {
                let Some(delay) = self.config.reconnect.delay_for(&err, attempts) else {
                    return Err(err);
                };
                attempts += 1;
                let delay_ms = delay.as_millis() as u64;
                self.cx
                    .sink
                    .record(
                        "",
                        "tether.reconnect",
                        json!({"attempt": attempts, "delay_ms": delay_ms, "error": err.to_string()}),
                        EventKind::Retry {
                            attempt: attempts,
                            delay_ms,
                            error: err.to_string(),
                        },
                    )
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
                for u in &pending {
                    if !acc.tool_uses.iter().any(|x| x.id == u.id) {
                        acc.tool_uses.push(u.clone());
                    }
                }
                let (results, _pending) = run_tools(&self.cx, &self.config, &pending).await?;
                let results = results
                    .into_iter()
                    .zip(&pending)
                    .map(|(r, u)| r.unwrap_or_else(|| ToolResult::error(&u.id, "this tool is not run here")))
                    .collect();
                input = Some(Input::ToolResults(pending, results));
            }
        }
    }
}

/// Runs tool uses through the handler, up to `tool_concurrency` at a time, results in order.
/// `None` marks a use whose tool is not run here (pending); those are also returned apart.
async fn run_tools(
    cx: &TurnContext,
    config: &SessionConfig,
    uses: &[ToolUse],
) -> Result<(Vec<Option<ToolResult>>, Vec<ToolUse>)> {
    let terminal = config.terminal_tool.as_ref().map(|t| t.name.as_str());
    let sid = cx.sink.info().session_id.clone();
    type Fut<'a> =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<Option<ToolResult>>> + Send + 'a>>;
    let sid = &sid;
    let futs: Vec<Fut<'_>> = uses
        .iter()
        .map(|u| Box::pin(run_one(cx, config, u, terminal, sid)) as Fut<'_>)
        .collect();
    let outs: Vec<Result<Option<ToolResult>>> = futures_util::stream::iter(futs)
        .buffered(config.tool_concurrency.max(1))
        .collect()
        .await;
    let mut results = Vec::with_capacity(uses.len());
    let mut pending = Vec::new();
    for (o, u) in outs.into_iter().zip(uses) {
        let o = o?;
        if o.is_none() {
            pending.push(u.clone());
        }
        results.push(o);
    }
    Ok((results, pending))
}

async fn run_one(
    cx: &TurnContext,
    config: &SessionConfig,
    u: &ToolUse,
    terminal: Option<&str>,
    sid: &str,
) -> Result<Option<ToolResult>> {
    let store = cx.sink.store();
    if let Some(r) = store.tool_result(sid, &u.id).await? {
        // The memo is written before the event (`store_result`): a crash between the two leaves a
        // result the next run answers from but the record lacks. Record it now; `emit` is
        // exactly-once by id, so a result already in the record is not written again.
        record_result(&cx.sink, &r).await?;
        return Ok(Some(r));
    }
    let result = if Some(u.name.as_str()) == terminal {
        ToolResult::ok(&u.id, "Done.")
    } else if let Some(err) = &u.input_error {
        ToolResult::error(
            &u.id,
            format!(
                "the arguments for `{}` are not valid JSON ({err}); call it again with a JSON object",
                u.name
            ),
        )
    } else {
        let handler = cx.handler.clone();
        let info = (*cx.sink.info()).clone();
        let call = u.clone();
        let task = tokio::spawn(async move { handler.call_tool(&call, &info).await });
        let joined = match config.tool_timeout {
            Some(d) => match tokio::time::timeout(d, task).await {
                Ok(j) => j,
                Err(_) => {
                    let r = ToolResult::error(&u.id, format!("tool `{}` timed out after {d:?}", u.name));
                    return store_result(cx, sid, r).await.map(Some);
                }
            },
            None => task.await,
        };
        match joined {
            Ok(ToolOutput::Ok(s)) => ToolResult::ok(&u.id, s),
            Ok(ToolOutput::Error(s)) => ToolResult::error(&u.id, s),
            Ok(ToolOutput::Pending) => return Ok(None),
            Err(e) if e.is_panic() => {
                let msg = panic_message(e.into_panic().as_ref());
                ToolResult::error(&u.id, format!("tool `{}` panicked: {msg}", u.name))
            }
            Err(e) => ToolResult::error(&u.id, format!("tool `{}` failed: {e}", u.name)),
        }
    };
    store_result(cx, sid, result).await.map(Some)
}

async fn store_result(cx: &TurnContext, sid: &str, r: ToolResult) -> Result<ToolResult> {
    cx.sink.store().put_tool_result(sid, &r).await?;
    record_result(&cx.sink, &r).await?;
    Ok(r)
}

impl Session {
    async fn paused_result(&mut self, extra: Vec<ToolUse>) -> SessionResult {
        let mut pending = self.pending_tool_uses();
        pending.extend(extra);
        SessionResult {
            terminal: Terminal::RequiresAction,
            stop_reason: json!(stop_reason::PENDING_TOOLS),
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
            transcript: self.provider.transcript(),
        }
    }

    async fn finish(
        &mut self,
        acc: Acc,
        terminal: Terminal,
        stop: Value,
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
            transcript: self.provider.transcript(),
        }
    }

    /// Moves the session onto a task and returns a handle to drive it from anywhere.
    pub fn spawn(self) -> SessionHandle {
        let (cmd_tx, mut cmd_rx) = mpsc::channel::<Command>(16);
        let (res_tx, res_rx) = mpsc::channel(16);
        let sink = self.cx.sink.clone();
        let current = Arc::new(Mutex::new(CancellationToken::new()));
        let cur = current.clone();
        let mut session = self;
        let task = tokio::spawn(async move {
            while let Some(cmd) = cmd_rx.recv().await {
                let token = CancellationToken::new();
                if let Ok(mut g) = cur.lock() {
                    *g = token.clone();
                }
                let r = match cmd {
                    Command::Send(text) => session.send_cancellable(text, token).await,
                    Command::ToolResults(rs) => session.submit_tool_results(rs, token).await,
                    Command::Close => {
                        let _ = session.provider.close().await;
                        break;
                    }
                };
                if res_tx.send(r).await.is_err() {
                    break;
                }
            }
        });
        SessionHandle {
            cmd: cmd_tx,
            results: res_rx,
            sink,
            current,
            task,
        }
    }
}

/// The tools declared to the model: the handler's, then the terminal tool.
fn declared_tools(handler: &dyn Handler, terminal: Option<&ToolSpec>) -> Vec<ToolSpec> {
    let mut tools = handler.tools();
    if let Some(t) = terminal {
        tools.retain(|s| s.name != t.name);
        tools.push(t.clone());
    }
    tools
}

async fn record_result(sink: &EventSink, r: &ToolResult) -> Result<bool> {
    sink.emit(Event::new(
        format!("tool_result:{}", r.tool_use_id),
        "tether.tool_result",
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

/// Drives a [`Session`] running on its own task: follow-up messages, cancel, live events.
pub struct SessionHandle {
    cmd: mpsc::Sender<Command>,
    results: mpsc::Receiver<Result<SessionResult>>,
    sink: EventSink,
    current: Arc<Mutex<CancellationToken>>,
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
    /// Queues a message; its result arrives through [`SessionHandle::next_result`].
    pub async fn send(&self, text: impl Into<String>) -> Result<()> {
        self.cmd
            .send(Command::Send(text.into()))
            .await
            .map_err(|_| Error::Closed)
    }

    /// Queues results for pending tool uses (front-end tools).
    pub async fn submit_tool_results(&self, results: Vec<ToolResult>) -> Result<()> {
        self.cmd
            .send(Command::ToolResults(results))
            .await
            .map_err(|_| Error::Closed)
    }

    /// The result of the next finished request, in order; `None` once the session is gone.
    pub async fn next_result(&mut self) -> Option<Result<SessionResult>> {
        self.results.recv().await
    }

    /// Cancels the request in flight (its result is [`Error::Cancelled`]); the session stays up.
    pub fn cancel(&self) {
        if let Ok(g) = self.current.lock() {
            g.cancel();
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
        let _ = self.cmd.send(Command::Close).await;
        drop(self.results);
        let _ = self.task.await;
    }
}
