//! [`AcpAgent`]: an ACP agent as a tether [`Provider`], so it runs under the same session engine,
//! store and front-ends as every other provider.
//!
//! Mapping of `session/update` kinds onto tether events (raw type `acp.session_update`, the
//! update's JSON kept as `raw`):
//!
//! | ACP | tether |
//! |---|---|
//! | `agent_message_chunk` (text) | live `TextDelta`; the turn's text is recorded as one durable assistant `Message` at its end |
//! | `agent_thought_chunk` (text) | live `ReasoningDelta` (kept in that `Message`'s `reasoning`) |
//! | `user_message_chunk` | durable user `Message` |
//! | `tool_call` | durable `ToolCallStart` (the call is also reported in `TurnResult::server_tool_uses`) |
//! | `tool_call_update` | durable `ToolCallUpdate`; on `completed`/`failed` also a durable `ToolResult` |
//! | `plan`, `usage_update`, unknown kinds, everything else | durable `Other` (raw kept) |
//!
//! The agent's permission, file, terminal and elicitation requests go to the session's
//! [`tether::Handler`] (through [`crate::bridge`]), after the connection validated them.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde_json::{Value, json};
use tether::{
    Event, EventKind, EventSink, Handler, Input, Mark, Opened, Provider, Resume, Role, SessionInfo, Terminal,
    ToolResult, ToolUse, TurnContext, TurnResult,
};

use crate::bridge::HandlerBridge;
use crate::client::{AcpClient, AgentCommand};
use crate::connection::lock;
use crate::error::{AcpError, ClientError, codes};
use crate::handler::{AcpTerminalRequest, AcpTerminalResponse, AcpUpdate, ClientHandler, SessionUpdateEvent};
use crate::options::ClientOptions;
use crate::schema::{
    CompleteElicitationNotification, ContentBlock, CreateElicitationRequest, CreateElicitationResponse,
    LoadSessionRequest, McpServer, NewSessionRequest, ReadTextFileRequest, ReadTextFileResponse, RequestId,
    RequestPermissionOutcome, RequestPermissionRequest, ResumeSessionRequest, SessionId, SessionUpdate,
    StopReason, TextContent, ToolCallContent, ToolCallStatus, WriteTextFileRequest, WriteTextFileResponse,
};

const RAW_TYPE: &str = "acp.session_update";

struct TurnState {
    sink: EventSink,
    text: String,
    reasoning: String,
    message_id: String,
    tool_uses: Vec<ToolUse>,
}

#[derive(Default)]
struct RouterState {
    handler: Option<Arc<dyn Handler>>,
    support: tether::Capabilities,
    turn: Option<TurnState>,
    /// Updates that arrived outside a turn; recorded at the start of the next one.
    backlog: Vec<SessionUpdateEvent>,
    /// A `session/load` is replaying the session's history: its updates are already in the
    /// record (it is what a resume reloads), so they are not recorded again.
    replaying: bool,
}

/// The ACP-side handler of an [`AcpAgent`]: routes updates to the running turn's sink and
/// requests to the session's handler.
#[derive(Default)]
struct Router {
    state: Mutex<RouterState>,
}

fn text_of(block: &ContentBlock) -> Option<&str> {
    match block {
        ContentBlock::Text(t) => Some(&t.text),
        _ => None,
    }
}

fn status_str(s: &ToolCallStatus) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn result_text(content: Option<&Vec<ToolCallContent>>, raw_output: Option<&Value>) -> String {
    let mut parts = Vec::new();
    for c in content.into_iter().flatten() {
        match c {
            ToolCallContent::Content(c) => {
                if let Some(t) = text_of(&c.content) {
                    parts.push(t.to_owned());
                }
            }
            ToolCallContent::Diff(d) => parts.push(format!("diff {}", d.path.display())),
            ToolCallContent::Terminal(t) => parts.push(format!("terminal {}", t.terminal_id)),
            _ => {}
        }
    }
    if parts.is_empty()
        && let Some(v) = raw_output
    {
        return v.to_string();
    }
    parts.join("\n")
}

/// Converts one update into tether events: `(event, durable)`. Also updates the turn's
/// accumulators.
fn convert(ev: &SessionUpdateEvent, turn: &mut TurnState) -> Vec<(Event, bool)> {
    let raw = match &ev.update {
        AcpUpdate::Known(u) => serde_json::to_value(u.as_ref()).unwrap_or(Value::Null),
        AcpUpdate::Unknown { raw, .. } => raw.clone(),
    };
    let mk = |kind: EventKind| Event::new("", RAW_TYPE, raw.clone(), kind);
    let AcpUpdate::Known(update) = &ev.update else {
        return vec![(mk(EventKind::Other), true)];
    };
    match update.as_ref() {
        SessionUpdate::AgentMessageChunk(c) => match text_of(&c.content) {
            Some(t) => {
                turn.text.push_str(t);
                let message_id = c
                    .message_id
                    .as_ref()
                    .map(|m| m.to_string())
                    .unwrap_or_else(|| turn.message_id.clone());
                vec![(
                    mk(EventKind::TextDelta {
                        message_id,
                        delta: t.to_owned(),
                    }),
                    false,
                )]
            }
            None => vec![(mk(EventKind::Other), true)],
        },
        SessionUpdate::AgentThoughtChunk(c) => match text_of(&c.content) {
            Some(t) => {
                turn.reasoning.push_str(t);
                let message_id = c
                    .message_id
                    .as_ref()
                    .map(|m| m.to_string())
                    .unwrap_or_else(|| turn.message_id.clone());
                vec![(
                    mk(EventKind::ReasoningDelta {
                        message_id,
                        delta: t.to_owned(),
                    }),
                    false,
                )]
            }
            None => vec![(mk(EventKind::Other), true)],
        },
        SessionUpdate::UserMessageChunk(c) => vec![(
            mk(EventKind::Message {
                message_id: c.message_id.as_ref().map(|m| m.to_string()).unwrap_or_default(),
                role: Role::User,
                text: text_of(&c.content).unwrap_or_default().to_owned(),
                reasoning: None,
                tool_uses: Vec::new(),
            }),
            true,
        )],
        SessionUpdate::ToolCall(tc) => {
            let id = tc.tool_call_id.to_string();
            let name = if tc.title.is_empty() {
                serde_json::to_value(tc.kind)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_else(|| "tool".into())
            } else {
                tc.title.clone()
            };
            turn.tool_uses.push(ToolUse::new(
                id.clone(),
                name.clone(),
                tc.raw_input.clone().unwrap_or(json!({})),
            ));
            let mut out = vec![(
                mk(EventKind::ToolCallStart {
                    tool_use_id: id.clone(),
                    name,
                    message_id: None,
                }),
                true,
            )];
            if matches!(tc.status, ToolCallStatus::Completed | ToolCallStatus::Failed) {
                let text = result_text(Some(&tc.content), tc.raw_output.as_ref());
                let r = if tc.status == ToolCallStatus::Failed {
                    ToolResult::error(id, text)
                } else {
                    ToolResult::ok(id, text)
                };
                out.push((mk(EventKind::ToolResult { result: r }), true));
            }
            out
        }
        SessionUpdate::ToolCallUpdate(up) => {
            let id = up.tool_call_id.to_string();
            let f = &up.fields;
            let mut out = vec![(
                mk(EventKind::ToolCallUpdate {
                    tool_use_id: id.clone(),
                    status: f.status.as_ref().map(status_str),
                }),
                true,
            )];
            if let Some(s @ (ToolCallStatus::Completed | ToolCallStatus::Failed)) = &f.status {
                let text = result_text(f.content.as_ref(), f.raw_output.as_ref());
                let r = if *s == ToolCallStatus::Failed {
                    ToolResult::error(id, text)
                } else {
                    ToolResult::ok(id, text)
                };
                out.push((mk(EventKind::ToolResult { result: r }), true));
            }
            out
        }
        _ => vec![(mk(EventKind::Other), true)],
    }
}

fn assistant_message(message_id: String, text: String, reasoning: String) -> Event {
    Event::new(
        "",
        "acp.message",
        json!({"text": text, "reasoning": reasoning}),
        EventKind::Message {
            message_id,
            role: Role::Assistant,
            text,
            reasoning: (!reasoning.is_empty()).then_some(reasoning),
            tool_uses: Vec::new(),
        },
    )
}

impl Router {
    fn bridge(&self) -> Result<HandlerBridge, ClientError> {
        lock(&self.state)
            .handler
            .clone()
            .map(HandlerBridge::new)
            .ok_or_else(|| ClientError::internal("no session handler attached"))
    }

    fn info(&self, session: &SessionId) -> SessionInfo {
        match &lock(&self.state).turn {
            Some(t) => (*t.sink.info()).clone(),
            None => SessionInfo::new(session.to_string(), "acp"),
        }
    }

    async fn record(&self, ev: &SessionUpdateEvent) {
        let (sink, events) = {
            let mut st = lock(&self.state);
            if st.replaying {
                return;
            }
            let Some(turn) = st.turn.as_mut() else {
                st.backlog.push(ev.clone());
                return;
            };
            (turn.sink.clone(), convert(ev, turn))
        };
        for (event, durable) in events {
            if durable {
                if let Err(e) = sink.emit(event).await {
                    tracing::warn!(error = %e, "could not record an ACP update");
                }
            } else {
                sink.emit_live(event).await;
            }
        }
    }
}

#[async_trait]
impl ClientHandler for Router {
    fn supports(&self) -> tether::Capabilities {
        lock(&self.state).support
    }

    async fn session_update(&self, event: &SessionUpdateEvent) {
        self.record(event).await;
    }

    async fn request_permission(&self, req: &RequestPermissionRequest) -> RequestPermissionOutcome {
        // The wait for an answer, shown to a tracer (observer-only marks; nothing is recorded).
        let sink = lock(&self.state)
            .turn
            .as_ref()
            .map(|t| t.sink.clone())
            .filter(EventSink::observed);
        let id = req.tool_call.tool_call_id.to_string();
        if let Some(s) = &sink {
            s.mark(Mark::PermissionRequest { tool_use_id: &id });
        }
        let out = match self.bridge() {
            Ok(b) => b.permission(req, &self.info(&req.session_id)).await,
            Err(_) => crate::handler::refuse_permission(req),
        };
        if let Some(s) = &sink {
            let outcome = match &out {
                RequestPermissionOutcome::Selected(o) => o.option_id.to_string(),
                _ => "cancelled".to_owned(),
            };
            s.mark(Mark::PermissionOutcome {
                tool_use_id: &id,
                outcome: &outcome,
            });
        }
        out
    }

    async fn read_text_file(&self, r: ReadTextFileRequest) -> Result<ReadTextFileResponse, ClientError> {
        let info = self.info(&r.session_id);
        self.bridge()?.read(r, &info).await
    }

    async fn write_text_file(&self, r: WriteTextFileRequest) -> Result<WriteTextFileResponse, ClientError> {
        let info = self.info(&r.session_id);
        self.bridge()?.write(r, &info).await
    }

    async fn terminal(
        &self,
        request: AcpTerminalRequest,
        _id: &RequestId,
    ) -> Result<AcpTerminalResponse, ClientError> {
        let info = self.info(request.session_id());
        self.bridge()?.terminal(request, &info).await
    }

    async fn form_elicitation(
        &self,
        r: CreateElicitationRequest,
    ) -> Result<CreateElicitationResponse, ClientError> {
        let info = match crate::bridge::elicitation_session(&r) {
            Some(s) => self.info(&s),
            None => SessionInfo::new("", "acp"),
        };
        self.bridge()?.elicit(r, &info).await
    }

    async fn url_elicitation(
        &self,
        r: CreateElicitationRequest,
    ) -> Result<CreateElicitationResponse, ClientError> {
        self.form_elicitation(r).await
    }

    async fn elicitation_complete(&self, n: CompleteElicitationNotification) {
        if let Ok(b) = self.bridge() {
            b.elicitation_complete(n).await;
        }
    }
}

/// An external ACP agent (Gemini CLI `--acp`, Claude Code via `claude-agent-acp`, Codex via
/// `codex-acp`, …) as a tether [`Provider`].
///
/// `open` spawns the agent, sends `initialize` (advertising what the session's handler serves,
/// from [`Handler::capabilities`]) and `session/new` (or `session/load` when
/// [`AcpAgent::load_session`] was given); each `turn` is one `session/prompt`; `interrupt` sends
/// `session/cancel`; `close` shuts the agent down.
pub struct AcpAgent {
    command: AgentCommand,
    options: ClientOptions,
    cwd: PathBuf,
    additional_directories: Vec<PathBuf>,
    mcp_servers: Vec<McpServer>,
    load: Option<String>,
    client: Option<AcpClient>,
    session: Option<SessionId>,
    router: Arc<Router>,
    turns: u64,
    /// Numbers this process's messages apart from those of the processes that ran the session
    /// before (a resumed thread's record already holds their ids).
    nonce: String,
}

impl std::fmt::Debug for AcpAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcpAgent")
            .field("command", &self.command)
            .field("cwd", &self.cwd)
            .field("session", &self.session)
            .finish()
    }
}

fn to_tether(e: AcpError, program: &str) -> tether::Error {
    match e {
        AcpError::Timeout { after, .. } => tether::Error::Timeout(after),
        AcpError::Rpc { code, message, .. } if code == codes::AUTH_REQUIRED as i64 => {
            tether::Error::Auth(message)
        }
        AcpError::Spawn { .. } => tether::Error::config_with(tether::ConfigKind::Setup, "", e),
        AcpError::InvalidDirectory { .. } => tether::Error::config_with(tether::ConfigKind::Invalid, "", e),
        AcpError::AgentExited { .. } | AcpError::Io { .. } | AcpError::Closed { .. } => {
            tether::Error::transport(
                tether::TransportKind::Closed,
                e.to_string(),
                format!("acp:{program}"),
            )
        }
        AcpError::FrameTooLarge { .. } | AcpError::Decode { .. } => tether::Error::malformed_with("", e),
        // `session/load` refused locally: the agent was never asked, its sessions are untouched.
        AcpError::Unsupported {
            capability: "loadSession",
            ..
        } => tether::Error::CannotResume {
            provider: "acp".into(),
            reason: format!(
                "the agent `{program}` does not advertise `loadSession`, so it cannot reload an earlier \
                 session; start a new one instead"
            ),
        },
        other => tether::Error::Provider {
            provider: "acp".into(),
            message: other.to_string(),
        },
    }
}

impl AcpAgent {
    /// An agent started with `command`, whose sessions work in `cwd` (an existing directory).
    pub fn new(command: AgentCommand, cwd: impl Into<PathBuf>) -> Self {
        AcpAgent {
            command,
            options: ClientOptions::default(),
            cwd: cwd.into(),
            additional_directories: Vec::new(),
            mcp_servers: Vec::new(),
            load: None,
            client: None,
            session: None,
            router: Arc::new(Router::default()),
            turns: 0,
            nonce: format!("{:08x}", rand::random::<u32>()),
        }
    }

    /// Connection options (timeouts, limits).
    pub fn options(mut self, options: ClientOptions) -> Self {
        self.options = options;
        self
    }

    /// More directories the agent may use (`additionalDirectories`).
    pub fn additional_directories(mut self, dirs: Vec<PathBuf>) -> Self {
        self.additional_directories = dirs;
        self
    }

    /// MCP servers passed to the agent.
    pub fn mcp_servers(mut self, servers: Vec<McpServer>) -> Self {
        self.mcp_servers = servers;
        self
    }

    /// Reattach to an existing agent session with `session/load` instead of creating one. An
    /// agent that does not advertise `loadSession` makes `open` fail with
    /// [`tether::Error::CannotResume`], before anything is sent to it.
    pub fn load_session(mut self, session_id: impl Into<String>) -> Self {
        self.load = Some(session_id.into());
        self
    }

    /// The underlying client, once open.
    pub fn client(&self) -> Option<&AcpClient> {
        self.client.as_ref()
    }

    fn program(&self) -> String {
        self.command.program.to_string_lossy().into_owned()
    }

    fn err(&self, e: AcpError) -> tether::Error {
        to_tether(e, &self.program())
    }

    /// Spawns and initializes the agent (once), routing its requests to the session's handler.
    async fn connect(&mut self, cx: &TurnContext) -> tether::Result<AcpClient> {
        {
            let mut st = lock(&self.router.state);
            st.handler = Some(cx.handler.clone());
            st.support = cx.handler.capabilities();
        }
        if self.client.is_none() {
            let client = AcpClient::spawn(self.command.clone(), self.router.clone(), self.options.clone())
                .await
                .map_err(|e| self.err(e))?;
            client.initialize().await.map_err(|e| self.err(e))?;
            self.client = Some(client);
        }
        self.client.clone().ok_or(tether::Error::Closed)
    }

    fn prompt_of(input: Input) -> Result<Option<Vec<ContentBlock>>, tether::Error> {
        match input {
            Input::Message(text) => Ok(Some(vec![ContentBlock::Text(TextContent::new(text))])),
            Input::Continue => Ok(None),
            Input::Raw(Value::String(s)) => Ok(Some(vec![ContentBlock::Text(TextContent::new(s))])),
            Input::Raw(v) => serde_json::from_value::<Vec<ContentBlock>>(v)
                .map(Some)
                .map_err(|e| {
                    tether::Error::config_with(
                        tether::ConfigKind::Invalid,
                        "a raw ACP input must be an array of content blocks",
                        e,
                    )
                }),
            Input::ToolResults(..) => Err(tether::Error::config(
                tether::ConfigKind::Unsupported,
                "an ACP agent runs its own tools; there are no tool results to send it",
            )),
            _ => Err(tether::Error::config(
                tether::ConfigKind::Unsupported,
                "unsupported input for an ACP agent",
            )),
        }
    }
}

#[async_trait]
impl Provider for AcpAgent {
    fn name(&self) -> &str {
        "acp"
    }

    async fn open(&mut self, cx: &TurnContext) -> tether::Result<Opened> {
        let client = self.connect(cx).await?;
        let (id, resumed) = match &self.load {
            Some(id) => {
                let req = LoadSessionRequest::new(id.clone(), self.cwd.clone())
                    .additional_directories(self.additional_directories.clone())
                    .mcp_servers(self.mcp_servers.clone());
                client.load_session(req).await.map_err(|e| self.err(e))?;
                (SessionId::new(id.as_str()), true)
            }
            None => {
                let req = NewSessionRequest::new(self.cwd.clone())
                    .additional_directories(self.additional_directories.clone())
                    .mcp_servers(self.mcp_servers.clone());
                let s = client.new_session(req).await.map_err(|e| self.err(e))?;
                (s.session_id.clone(), false)
            }
        };
        self.session = Some(id.clone());
        let mut opened = Opened::new(id.to_string());
        opened.resumed = resumed;
        Ok(opened)
    }

    /// Reloads the thread's ACP session in a new agent process: `session/load` when the agent
    /// advertises `loadSession` (its replay of the history is not recorded again: the record has
    /// it), else `session/resume` when it advertises `sessionCapabilities.resume`; otherwise
    /// [`tether::Error::CannotResume`] ("this agent cannot resume a session"), the agent process
    /// is shut down and nothing is written.
    async fn resume(&mut self, from: Resume<'_>, cx: &TurnContext) -> tether::Result<Opened> {
        let Some(id) = from.session_id.filter(|s| !s.is_empty()).map(str::to_owned) else {
            return Err(tether::Error::cannot_resume(
                "acp",
                "no ACP session was recorded for this thread (the agent never opened one)",
            ));
        };
        let client = self.connect(cx).await?;
        let caps = client.agent_capabilities().unwrap_or_default();
        if caps.load_session {
            let req = LoadSessionRequest::new(id.clone(), self.cwd.clone())
                .additional_directories(self.additional_directories.clone())
                .mcp_servers(self.mcp_servers.clone());
            lock(&self.router.state).replaying = true;
            let r = client.load_session(req).await;
            lock(&self.router.state).replaying = false;
            r.map_err(|e| self.err(e))?;
        } else if caps.session_capabilities.resume.is_some() {
            let req = ResumeSessionRequest::new(id.clone(), self.cwd.clone())
                .additional_directories(self.additional_directories.clone())
                .mcp_servers(self.mcp_servers.clone());
            client.resume_session(req).await.map_err(|e| self.err(e))?;
        } else {
            self.close().await?;
            return Err(tether::Error::cannot_resume(
                "acp",
                format!(
                    "this agent cannot resume a session: `{}` advertises neither loadSession nor \
                     sessionCapabilities.resume, so session {id} ended with the process that ran it. \
                     The thread's record is kept; start a new thread to go on",
                    self.program()
                ),
            ));
        }
        self.session = Some(SessionId::new(id.as_str()));
        Ok(Opened::resumed(id))
    }

    async fn turn(&mut self, input: Input, cx: &TurnContext) -> tether::Result<TurnResult> {
        let (Some(client), Some(session)) = (self.client.clone(), self.session.clone()) else {
            return Err(tether::Error::config(
                tether::ConfigKind::State,
                "the ACP agent is not open",
            ));
        };
        let Some(prompt) = Self::prompt_of(input)? else {
            return Ok(TurnResult::new(Terminal::EndTurn, "continue"));
        };
        self.turns += 1;
        let backlog = {
            let mut st = lock(&self.router.state);
            st.handler = Some(cx.handler.clone());
            st.turn = Some(TurnState {
                sink: cx.sink.clone(),
                text: String::new(),
                reasoning: String::new(),
                message_id: format!("{session}:{}:turn-{}", self.nonce, self.turns),
                tool_uses: Vec::new(),
            });
            std::mem::take(&mut st.backlog)
        };
        if !backlog.is_empty() {
            for ev in &backlog {
                self.router.record(ev).await;
            }
            // What the agent said between turns is its own message, not part of this turn's text.
            let said = {
                let mut st = lock(&self.router.state);
                st.turn
                    .as_mut()
                    .map(|t| (std::mem::take(&mut t.text), std::mem::take(&mut t.reasoning)))
            };
            if let Some((text, reasoning)) = said
                && (!text.is_empty() || !reasoning.is_empty())
            {
                let id = format!("{session}:{}:between-{}", self.nonce, self.turns);
                cx.sink.emit(assistant_message(id, text, reasoning)).await?;
            }
        }
        let result = client.prompt(&session, prompt).await;
        let turn = lock(&self.router.state).turn.take();
        let outcome = result.map_err(|e| self.err(e))?;
        let (text, reasoning, message_id, tool_uses) = match turn {
            Some(t) => (t.text, t.reasoning, t.message_id, t.tool_uses),
            None => Default::default(),
        };
        if !text.is_empty() || !reasoning.is_empty() {
            cx.sink
                .emit(assistant_message(message_id, text.clone(), reasoning))
                .await?;
        }
        let terminal = match outcome.stop_reason {
            Some(StopReason::Cancelled) => Terminal::Terminated,
            _ => Terminal::EndTurn,
        };
        let mut tr = TurnResult::new(terminal, Value::String(outcome.stop_reason_raw.clone()));
        tr.text = text;
        tr.server_tool_uses = tool_uses;
        Ok(tr)
    }

    async fn interrupt(&mut self) -> tether::Result<()> {
        lock(&self.router.state).turn = None;
        if let (Some(client), Some(session)) = (&self.client, &self.session) {
            client.cancel(session).await.map_err(|e| to_tether(e, ""))?;
        }
        Ok(())
    }

    async fn close(&mut self) -> tether::Result<()> {
        if let Some(client) = self.client.take() {
            client.shutdown().await;
        }
        Ok(())
    }
}
