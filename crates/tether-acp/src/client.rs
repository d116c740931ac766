//! The client API: spawn an agent, `initialize`, manage sessions, run prompt turns.

use std::ffi::OsString;
use std::ops::Deref;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, BufReader};

use crate::connection::{Conn, Hook, SessionEntry, lock};
use crate::error::AcpError;
use crate::handler::ClientHandler;
use crate::options::ClientOptions;
use crate::roots::canonical_root;
use crate::schema::{
    AgentCapabilities, AuthenticateRequest, AuthenticateResponse, CancelNotification, ClientCapabilities,
    CloseSessionRequest, CloseSessionResponse, ContentBlock, DeleteSessionRequest, DeleteSessionResponse,
    Implementation, InitializeRequest, InitializeResponse, ListSessionsRequest, ListSessionsResponse,
    LoadSessionRequest, LoadSessionResponse, LogoutRequest, LogoutResponse, NewSessionRequest,
    NewSessionResponse, PromptRequest, PromptResponse, ResumeSessionRequest, ResumeSessionResponse,
    SessionId, SetSessionConfigOptionRequest, SetSessionConfigOptionResponse, SetSessionModeRequest,
    SetSessionModeResponse, StopReason,
};
use agent_client_protocol_schema::ProtocolVersion;

/// How to start an agent process.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AgentCommand {
    /// The program.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment variables.
    pub env: Vec<(OsString, OsString)>,
    /// Working directory (default: inherited).
    pub cwd: Option<PathBuf>,
    /// Start the agent in its own process group, so a Ctrl-C at the terminal reaches the client
    /// (which turns it into `session/cancel`) and not the agent. Default `true`.
    pub own_process_group: bool,
}

impl AgentCommand {
    /// A command with no arguments.
    pub fn new(program: impl Into<OsString>) -> Self {
        AgentCommand {
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            cwd: None,
            own_process_group: true,
        }
    }
    /// From an argv (`["node", "agent.js"]`); `None` if empty.
    pub fn from_argv<S: Into<OsString> + Clone>(argv: &[S]) -> Option<Self> {
        let (first, rest) = argv.split_first()?;
        Some(AgentCommand::new(first.clone()).args(rest.iter().cloned()))
    }
    /// Appends one argument.
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }
    /// Appends arguments.
    pub fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, args: I) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }
    /// Sets an environment variable.
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }
    /// Sets the working directory.
    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cwd = Some(dir.into());
        self
    }
    /// Chooses whether the agent gets its own process group.
    pub fn own_process_group(mut self, yes: bool) -> Self {
        self.own_process_group = yes;
        self
    }
}

/// A decoded answer plus the JSON it came from (unknown fields such as a legacy `models` kept).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Received<T> {
    /// The typed answer.
    pub value: T,
    /// The answer exactly as received.
    pub raw: Value,
}

impl<T> Deref for Received<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

/// How a prompt turn ended.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct PromptOutcome {
    /// The stop reason, when it is one this client knows.
    pub stop_reason: Option<StopReason>,
    /// The `stopReason` string as sent (also for unknown reasons).
    pub stop_reason_raw: String,
    /// The decoded answer, when it decodes.
    pub response: Option<PromptResponse>,
    /// The answer as received.
    pub raw: Value,
}

impl PromptOutcome {
    /// Whether the turn ended because it was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.stop_reason == Some(StopReason::Cancelled)
    }
}

struct Inner {
    conn: Arc<Conn>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.conn.kill_now();
    }
}

/// A connection to one ACP agent. Cheap to clone; the agent is killed when the last clone drops
/// (call [`AcpClient::shutdown`] for a graceful exit).
#[derive(Clone)]
pub struct AcpClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AcpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcpClient")
            .field("closed", &self.inner.conn.closed_error().is_some())
            .finish()
    }
}

fn decode<T: DeserializeOwned>(method: &str, raw: Value) -> Result<Received<T>, AcpError> {
    let value = T::deserialize(&raw).map_err(|e| AcpError::Decode {
        method: method.into(),
        message: e.to_string(),
    })?;
    Ok(Received { value, raw })
}

fn roots_of(cwd: &std::path::Path, extra: &[PathBuf]) -> Result<(PathBuf, Vec<PathBuf>), AcpError> {
    let canon = |p: &std::path::Path| {
        canonical_root(p).map_err(|reason| AcpError::InvalidDirectory {
            path: p.display().to_string(),
            reason,
        })
    };
    let cwd = canon(cwd)?;
    let mut roots = vec![cwd.clone()];
    for d in extra {
        roots.push(canon(d)?);
    }
    Ok((cwd, roots))
}

impl AcpClient {
    /// Starts the agent process and the connection (does not send `initialize`).
    pub async fn spawn(
        command: AgentCommand,
        handler: Arc<dyn ClientHandler>,
        options: ClientOptions,
    ) -> Result<AcpClient, AcpError> {
        let program = command.program.to_string_lossy().into_owned();
        let mut cmd = tokio::process::Command::new(&command.program);
        cmd.args(&command.args)
            .envs(command.env.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        if let Some(dir) = &command.cwd {
            cmd.current_dir(dir);
        }
        #[cfg(unix)]
        if command.own_process_group {
            cmd.process_group(0);
        }
        let mut child = cmd.spawn().map_err(|e| AcpError::Spawn {
            program: program.clone(),
            source: Arc::new(e),
        })?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(AcpError::Closed {
                reason: "the agent's stdio could not be captured".into(),
            });
        };
        if let Some(stderr) = child.stderr.take() {
            let name = std::path::Path::new(&program)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or(program.clone());
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::info!(target: "tether_acp::agent_stderr", agent = %name, "{line}");
                }
            });
        }
        handler.init().await;
        let conn = Conn::start(stdout, stdin, Some(child), handler, options);
        Ok(AcpClient {
            inner: Arc::new(Inner { conn }),
        })
    }

    /// Runs the connection over any byte streams (in-process agents, tests, benchmarks).
    pub async fn connect<R, W>(
        reader: R,
        writer: W,
        handler: Arc<dyn ClientHandler>,
        options: ClientOptions,
    ) -> AcpClient
    where
        R: AsyncRead + Send + Unpin + 'static,
        W: AsyncWrite + Send + Unpin + 'static,
    {
        handler.init().await;
        let conn = Conn::start(reader, writer, None, handler, options);
        AcpClient {
            inner: Arc::new(Inner { conn }),
        }
    }

    fn conn(&self) -> &Conn {
        &self.inner.conn
    }

    /// Sends any request and decodes the answer; `timeout: None` uses the default request timeout.
    pub async fn request<P: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        params: &P,
        timeout: Option<Duration>,
    ) -> Result<Received<R>, AcpError> {
        let t = timeout.unwrap_or(self.conn().opts.request_timeout);
        let raw = self.conn().call(method, params, Some(t), None).await?;
        decode(method, raw)
    }

    async fn request_hooked<P: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        params: &P,
        timeout: Option<Duration>,
        hook: Option<Hook>,
    ) -> Result<Received<R>, AcpError> {
        let raw = self.conn().call(method, params, timeout, hook).await?;
        decode(method, raw)
    }

    /// The capabilities advertised (or to be advertised) in `initialize`.
    pub fn client_capabilities(&self) -> ClientCapabilities {
        let conn = self.conn();
        conn.opts
            .capabilities
            .clone()
            .unwrap_or_else(|| crate::handler::client_capabilities(conn.handler.supports()))
    }

    /// `initialize`: advertises the capabilities, checks the agent speaks protocol version 1
    /// (otherwise the connection is closed and [`AcpError::UnsupportedVersion`] returned).
    pub async fn initialize(&self) -> Result<Received<InitializeResponse>, AcpError> {
        let caps = self.client_capabilities();
        lock(&self.conn().state).advertised = Some(caps.clone());
        let opts = &self.conn().opts;
        let req = InitializeRequest::new(ProtocolVersion::V1)
            .client_capabilities(caps)
            .client_info(Implementation::new(
                opts.client_name.clone(),
                opts.client_version.clone(),
            ));
        let resp: Received<InitializeResponse> = self
            .request_hooked("initialize", &req, Some(opts.initialize_timeout), None)
            .await?;
        if resp.protocol_version != ProtocolVersion::V1 {
            let err = AcpError::UnsupportedVersion {
                agent: resp.protocol_version.as_u16(),
                ours: ProtocolVersion::V1.as_u16(),
            };
            self.conn().close(err.clone(), true);
            return Err(err);
        }
        lock(&self.conn().state).agent = Some(resp.value.clone());
        Ok(resp)
    }

    /// The agent's capabilities (after `initialize`).
    pub fn agent_capabilities(&self) -> Option<AgentCapabilities> {
        lock(&self.conn().state)
            .agent
            .as_ref()
            .map(|a| a.agent_capabilities.clone())
    }

    fn agent_caps_for(&self, method: &str) -> Result<AgentCapabilities, AcpError> {
        self.agent_capabilities().ok_or_else(|| AcpError::NotInitialized {
            method: method.into(),
        })
    }

    /// `authenticate` with one of the agent's `authMethods`.
    pub async fn authenticate(
        &self,
        method_id: impl Into<String>,
    ) -> Result<Received<AuthenticateResponse>, AcpError> {
        let req = AuthenticateRequest::new(method_id.into());
        self.request("authenticate", &req, None).await
    }

    /// `logout` (needs `agentCapabilities.auth.logout`; refused locally otherwise).
    pub async fn logout(&self) -> Result<Received<LogoutResponse>, AcpError> {
        let caps = self.agent_caps_for("logout")?;
        if caps.auth.logout.is_none() {
            return Err(AcpError::Unsupported {
                method: "logout".into(),
                capability: "auth.logout",
            });
        }
        self.request("logout", &LogoutRequest::new(), None).await
    }

    /// `session/new`. The session's roots (its `cwd` and `additionalDirectories`, canonicalized)
    /// confine every file and terminal request the agent makes for it.
    pub async fn new_session(
        &self,
        request: NewSessionRequest,
    ) -> Result<Received<NewSessionResponse>, AcpError> {
        let (cwd, roots) = roots_of(&request.cwd, &request.additional_directories)?;
        let hook: Hook = Box::new(move |conn: &Conn, v: &Value| {
            if let Some(id) = v.get("sessionId").and_then(Value::as_str) {
                lock(&conn.state).sessions.insert(
                    SessionId::new(id),
                    SessionEntry {
                        roots,
                        cwd,
                        cancelling: false,
                    },
                );
            }
        });
        let t = Some(self.conn().opts.request_timeout);
        self.request_hooked("session/new", &request, t, Some(hook)).await
    }

    fn register(&self, id: &SessionId, cwd: PathBuf, roots: Vec<PathBuf>) {
        lock(&self.conn().state).sessions.insert(
            id.clone(),
            SessionEntry {
                roots,
                cwd,
                cancelling: false,
            },
        );
    }

    fn unregister(&self, id: &SessionId) {
        self.conn().remove_session(id);
    }

    /// `session/load` (needs `loadSession`): the agent replays the history as `session/update`s,
    /// all handled before this returns.
    pub async fn load_session(
        &self,
        request: LoadSessionRequest,
    ) -> Result<Received<LoadSessionResponse>, AcpError> {
        if !self.agent_caps_for("session/load")?.load_session {
            return Err(AcpError::Unsupported {
                method: "session/load".into(),
                capability: "loadSession",
            });
        }
        let (cwd, roots) = roots_of(&request.cwd, &request.additional_directories)?;
        let id = request.session_id.clone();
        self.register(&id, cwd, roots);
        let t = self.conn().opts.prompt_timeout;
        let r = self.request_hooked("session/load", &request, t, None).await;
        if r.is_err() {
            self.unregister(&id);
        }
        r
    }

    /// `session/resume` (needs `sessionCapabilities.resume`; no replay).
    pub async fn resume_session(
        &self,
        request: ResumeSessionRequest,
    ) -> Result<Received<ResumeSessionResponse>, AcpError> {
        if self
            .agent_caps_for("session/resume")?
            .session_capabilities
            .resume
            .is_none()
        {
            return Err(AcpError::Unsupported {
                method: "session/resume".into(),
                capability: "sessionCapabilities.resume",
            });
        }
        let (cwd, roots) = roots_of(&request.cwd, &request.additional_directories)?;
        let id = request.session_id.clone();
        self.register(&id, cwd, roots);
        let r = self.request("session/resume", &request, None).await;
        if r.is_err() {
            self.unregister(&id);
        }
        r
    }

    /// `session/list` (needs `sessionCapabilities.list`).
    pub async fn list_sessions(
        &self,
        request: ListSessionsRequest,
    ) -> Result<Received<ListSessionsResponse>, AcpError> {
        if self
            .agent_caps_for("session/list")?
            .session_capabilities
            .list
            .is_none()
        {
            return Err(AcpError::Unsupported {
                method: "session/list".into(),
                capability: "sessionCapabilities.list",
            });
        }
        self.request("session/list", &request, None).await
    }

    /// `session/close` (needs `sessionCapabilities.close`); the session is forgotten afterwards.
    pub async fn close_session(
        &self,
        session_id: &SessionId,
    ) -> Result<Received<CloseSessionResponse>, AcpError> {
        if self
            .agent_caps_for("session/close")?
            .session_capabilities
            .close
            .is_none()
        {
            return Err(AcpError::Unsupported {
                method: "session/close".into(),
                capability: "sessionCapabilities.close",
            });
        }
        self.conn().cancel_session_requests(session_id).await;
        let r = self
            .request(
                "session/close",
                &CloseSessionRequest::new(session_id.clone()),
                None,
            )
            .await;
        if r.is_ok() {
            self.unregister(session_id);
        }
        r
    }

    /// `session/delete` (needs `sessionCapabilities.delete`).
    pub async fn delete_session(
        &self,
        session_id: &SessionId,
    ) -> Result<Received<DeleteSessionResponse>, AcpError> {
        if self
            .agent_caps_for("session/delete")?
            .session_capabilities
            .delete
            .is_none()
        {
            return Err(AcpError::Unsupported {
                method: "session/delete".into(),
                capability: "sessionCapabilities.delete",
            });
        }
        let r = self
            .request(
                "session/delete",
                &DeleteSessionRequest::new(session_id.clone()),
                None,
            )
            .await;
        if r.is_ok() {
            self.unregister(session_id);
        }
        r
    }

    /// `session/set_mode`.
    pub async fn set_mode(
        &self,
        session_id: &SessionId,
        mode_id: impl Into<String>,
    ) -> Result<Received<SetSessionModeResponse>, AcpError> {
        let req = SetSessionModeRequest::new(session_id.clone(), mode_id.into());
        self.request("session/set_mode", &req, None).await
    }

    /// `session/set_config_option`.
    pub async fn set_config_option(
        &self,
        request: SetSessionConfigOptionRequest,
    ) -> Result<Received<SetSessionConfigOptionResponse>, AcpError> {
        self.request("session/set_config_option", &request, None).await
    }

    /// `session/prompt`: updates stream to the handler while it runs (all of them handled before
    /// this returns); the stop reason is returned. Uses `ClientOptions::prompt_timeout`.
    pub async fn prompt(
        &self,
        session_id: &SessionId,
        prompt: Vec<ContentBlock>,
    ) -> Result<PromptOutcome, AcpError> {
        let t = self.conn().opts.prompt_timeout;
        self.prompt_with_timeout(session_id, prompt, t).await
    }

    /// `session/prompt` with an explicit timeout (`None`: none).
    pub async fn prompt_with_timeout(
        &self,
        session_id: &SessionId,
        prompt: Vec<ContentBlock>,
        timeout: Option<Duration>,
    ) -> Result<PromptOutcome, AcpError> {
        let caps = self.agent_caps_for("session/prompt")?;
        for block in &prompt {
            let (ok, cap) = match block {
                ContentBlock::Image(_) => (caps.prompt_capabilities.image, "promptCapabilities.image"),
                ContentBlock::Audio(_) => (caps.prompt_capabilities.audio, "promptCapabilities.audio"),
                ContentBlock::Resource(_) => (
                    caps.prompt_capabilities.embedded_context,
                    "promptCapabilities.embeddedContext",
                ),
                _ => (true, ""),
            };
            if !ok {
                return Err(AcpError::Unsupported {
                    method: "session/prompt".into(),
                    capability: cap,
                });
            }
        }
        self.set_cancelling(session_id, false);
        let req = PromptRequest::new(session_id.clone(), prompt);
        let result = self.conn().call("session/prompt", &req, timeout, None).await;
        self.set_cancelling(session_id, false);
        let raw = result?;
        let stop_reason_raw = raw
            .get("stopReason")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let response = PromptResponse::deserialize(&raw).ok();
        Ok(PromptOutcome {
            stop_reason: response.as_ref().map(|r| r.stop_reason),
            stop_reason_raw,
            response,
            raw,
        })
    }

    fn set_cancelling(&self, session_id: &SessionId, on: bool) {
        if let Some(s) = lock(&self.conn().state).sessions.get_mut(session_id) {
            s.cancelling = on;
        }
    }

    /// `session/cancel`: first answers this session's pending permission requests `cancelled` (and
    /// elicitations `cancel`), and keeps answering new ones so until the running prompt returns;
    /// then notifies the agent. The running `prompt` call returns the agent's stop reason
    /// (normally `cancelled`).
    pub async fn cancel(&self, session_id: &SessionId) -> Result<(), AcpError> {
        self.set_cancelling(session_id, true);
        self.conn().cancel_session_requests(session_id).await;
        self.conn()
            .notify("session/cancel", &CancelNotification::new(session_id.clone()))
            .await
    }

    /// A custom request (`method` should start with `_`).
    pub async fn ext_request(
        &self,
        method: &str,
        params: Value,
        timeout: Option<Duration>,
    ) -> Result<Value, AcpError> {
        let t = timeout.unwrap_or(self.conn().opts.request_timeout);
        self.conn().call(method, &params, Some(t), None).await
    }

    /// A custom notification (`method` should start with `_`).
    pub async fn ext_notification(&self, method: &str, params: Value) -> Result<(), AcpError> {
        self.conn().notify(method, &params).await
    }

    /// Whether the session is one this client created, loaded or resumed.
    pub fn knows_session(&self, session_id: &SessionId) -> bool {
        lock(&self.conn().state).sessions.contains_key(session_id)
    }

    /// Whether the outbound request with this id is still waiting for its answer.
    pub fn is_pending(&self, id: i64) -> bool {
        self.conn().is_pending(id)
    }

    /// The error the connection closed with, if it has closed.
    pub fn closed_error(&self) -> Option<AcpError> {
        self.conn().closed_error()
    }

    /// Resolves when the connection closes, with the reason.
    pub async fn closed(&self) -> AcpError {
        self.conn().wait_closed().await
    }

    /// Closes the agent's stdin, waits briefly for it to exit, then kills it.
    pub async fn shutdown(&self) {
        self.conn().shutdown().await
    }
}

use serde::Deserialize as _;
