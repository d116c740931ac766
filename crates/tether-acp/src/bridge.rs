//! Serving an ACP agent's requests with a tether [`tether::Handler`] — typically the ready
//! [`tether::workspace::Workspace`] (files and terminals confined to a root, output capped with
//! truncation reported, a permission policy whose `allow_always` is remembered per session).
//!
//! [`HandlerBridge`] is a [`ClientHandler`] that converts each ACP request into the tether
//! vocabulary, calls the tether handler, and converts the answer back. The connection has already
//! validated the request (capability, params, session, path confinement) before it gets here.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{Value, json};
use tether::handler as th;
use tether::{Handler, SessionInfo};

use crate::error::{ClientError, codes};
use crate::handler::{AcpTerminalRequest, AcpTerminalResponse, ClientHandler, SessionUpdateEvent};
use crate::schema::{
    CompleteElicitationNotification, CreateElicitationRequest, CreateElicitationResponse,
    CreateTerminalResponse, ElicitationAction, ElicitationMode, ElicitationScope, KillTerminalResponse,
    PermissionOptionKind, ReadTextFileRequest, ReadTextFileResponse, ReleaseTerminalResponse, RequestId,
    RequestPermissionOutcome, RequestPermissionRequest, SelectedPermissionOutcome, SessionId,
    TerminalExitStatus, TerminalOutputResponse, WaitForTerminalExitResponse, WriteTextFileRequest,
    WriteTextFileResponse,
};

/// Maps a tether handler error onto a JSON-RPC error.
pub fn handler_error(e: th::HandlerError) -> ClientError {
    let code = match &e {
        th::HandlerError::Unsupported(_) => codes::METHOD_NOT_FOUND,
        th::HandlerError::OutsideRoot(_) | th::HandlerError::Invalid(_) => codes::INVALID_PARAMS,
        th::HandlerError::NotFound(_) => codes::RESOURCE_NOT_FOUND,
        _ => codes::INTERNAL_ERROR,
    };
    ClientError::new(code, e.to_string())
}

fn snake<T: serde::Serialize>(v: &T) -> Option<String> {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
}

/// Converts an ACP permission request into tether's.
pub fn permission_request(req: &RequestPermissionRequest) -> th::PermissionRequest {
    let options = req
        .options
        .iter()
        .filter_map(|o| {
            let kind = match o.kind {
                PermissionOptionKind::AllowOnce => th::PermissionKind::AllowOnce,
                PermissionOptionKind::AllowAlways => th::PermissionKind::AllowAlways,
                PermissionOptionKind::RejectOnce => th::PermissionKind::RejectOnce,
                PermissionOptionKind::RejectAlways => th::PermissionKind::RejectAlways,
                _ => return None,
            };
            Some(th::PermissionOption::new(
                o.option_id.to_string(),
                o.name.clone(),
                kind,
            ))
        })
        .collect();
    let f = &req.tool_call.fields;
    let mut out = th::PermissionRequest::new(
        req.tool_call.tool_call_id.to_string(),
        f.title.clone().unwrap_or_default(),
    )
    .with_input(f.raw_input.clone().unwrap_or(Value::Null))
    .with_options(options)
    .with_raw(serde_json::to_value(req).unwrap_or(Value::Null));
    out.kind = f.kind.as_ref().and_then(snake);
    out
}

/// Converts tether's permission answer back.
pub fn permission_outcome(o: th::PermissionOutcome) -> RequestPermissionOutcome {
    match o {
        th::PermissionOutcome::Selected { option_id } => {
            RequestPermissionOutcome::Selected(SelectedPermissionOutcome::new(option_id))
        }
        _ => RequestPermissionOutcome::Cancelled,
    }
}

fn exit_status(e: th::ExitStatus) -> TerminalExitStatus {
    TerminalExitStatus::new()
        .exit_code(e.exit_code.map(|c| c as u32))
        .signal(e.signal)
}

/// Converts an ACP terminal request into tether's.
pub fn terminal_request(req: &AcpTerminalRequest) -> th::TerminalRequest {
    match req {
        AcpTerminalRequest::Create(c) => th::TerminalRequest::Create {
            command: c.command.clone(),
            args: c.args.clone(),
            env: c.env.iter().map(|v| (v.name.clone(), v.value.clone())).collect(),
            cwd: c.cwd.clone(),
            output_byte_limit: c.output_byte_limit,
        },
        AcpTerminalRequest::Output(r) => th::TerminalRequest::Output {
            terminal_id: r.terminal_id.to_string(),
        },
        AcpTerminalRequest::WaitForExit(r) => th::TerminalRequest::WaitForExit {
            terminal_id: r.terminal_id.to_string(),
        },
        AcpTerminalRequest::Kill(r) => th::TerminalRequest::Kill {
            terminal_id: r.terminal_id.to_string(),
        },
        AcpTerminalRequest::Release(r) => th::TerminalRequest::Release {
            terminal_id: r.terminal_id.to_string(),
        },
    }
}

/// Converts tether's terminal answer back, shaped for the request it answers.
pub fn terminal_response(
    req: &AcpTerminalRequest,
    resp: th::TerminalResponse,
) -> Result<AcpTerminalResponse, ClientError> {
    let mismatch = |m: &str| ClientError::internal(format!("the handler gave a wrong answer to {m}"));
    Ok(match (req, resp) {
        (AcpTerminalRequest::Create(_), th::TerminalResponse::Created { terminal_id }) => {
            AcpTerminalResponse::Create(CreateTerminalResponse::new(terminal_id))
        }
        (
            AcpTerminalRequest::Output(_),
            th::TerminalResponse::Output {
                output,
                truncated,
                exit_status: exit,
            },
        ) => AcpTerminalResponse::Output(
            TerminalOutputResponse::new(output, truncated).exit_status(exit.map(exit_status)),
        ),
        (AcpTerminalRequest::WaitForExit(_), th::TerminalResponse::Exited(e)) => {
            AcpTerminalResponse::WaitForExit(WaitForTerminalExitResponse::new(exit_status(e)))
        }
        (AcpTerminalRequest::Kill(_), _) => AcpTerminalResponse::Kill(KillTerminalResponse::new()),
        (AcpTerminalRequest::Release(_), _) => AcpTerminalResponse::Release(ReleaseTerminalResponse::new()),
        (r, _) => return Err(mismatch(r.method())),
    })
}

/// Converts an ACP elicitation into tether's.
pub fn elicitation_request(req: &CreateElicitationRequest) -> Option<th::ElicitationRequest> {
    let raw = serde_json::to_value(req).unwrap_or(Value::Null);
    let (id, mode) = match &req.mode {
        ElicitationMode::Form(f) => (
            None,
            th::ElicitationMode::Form {
                schema: serde_json::to_value(&f.requested_schema).unwrap_or(Value::Null),
            },
        ),
        ElicitationMode::Url(u) => (
            Some(u.elicitation_id.to_string()),
            th::ElicitationMode::Url { url: u.url.clone() },
        ),
        _ => return None,
    };
    let mut out = th::ElicitationRequest::new(req.message.clone(), mode).with_raw(raw);
    out.id = id;
    Some(out)
}

/// Converts tether's elicitation answer back.
pub fn elicitation_response(r: th::ElicitationResponse) -> Result<CreateElicitationResponse, ClientError> {
    let v = match r {
        th::ElicitationResponse::Accept { content } => match content {
            Some(c) => json!({"action": "accept", "content": c}),
            None => json!({"action": "accept"}),
        },
        th::ElicitationResponse::Decline => json!({"action": "decline"}),
        _ => json!({"action": "cancel"}),
    };
    let action: ElicitationAction = serde_json::from_value(v)
        .map_err(|e| ClientError::internal(format!("elicitation content does not fit ACP: {e}")))?;
    Ok(CreateElicitationResponse::new(action))
}

/// The session scope of an elicitation, if it has one.
pub fn elicitation_session(req: &CreateElicitationRequest) -> Option<SessionId> {
    match req.scope() {
        ElicitationScope::Session(s) => Some(s.session_id.clone()),
        _ => None,
    }
}

/// Answers an ACP agent's requests with a tether [`Handler`] (a [`tether::workspace::Workspace`],
/// a front-end's handler, …). Capabilities are advertised from the handler's
/// [`Handler::capabilities`]. Session updates are ignored here (see [`crate::AcpAgent`] for the
/// provider that turns them into tether events).
pub struct HandlerBridge {
    handler: Arc<dyn Handler>,
    provider_name: String,
}

impl HandlerBridge {
    /// Wraps a tether handler.
    pub fn new(handler: Arc<dyn Handler>) -> Self {
        HandlerBridge {
            handler,
            provider_name: "acp".into(),
        }
    }

    fn info(&self, session: &SessionId) -> SessionInfo {
        SessionInfo::new(session.to_string(), self.provider_name.clone())
    }

    /// The wrapped handler.
    pub fn handler(&self) -> &Arc<dyn Handler> {
        &self.handler
    }

    /// `session/request_permission` through the tether handler.
    pub async fn permission(
        &self,
        req: &RequestPermissionRequest,
        info: &SessionInfo,
    ) -> RequestPermissionOutcome {
        permission_outcome(
            self.handler
                .request_permission(&permission_request(req), info)
                .await,
        )
    }

    /// `fs/read_text_file` through the tether handler.
    pub async fn read(
        &self,
        r: ReadTextFileRequest,
        info: &SessionInfo,
    ) -> Result<ReadTextFileResponse, ClientError> {
        let req = th::ReadTextFile::new(r.path).with_range(r.line, r.limit);
        self.handler
            .read_text_file(&req, info)
            .await
            .map(ReadTextFileResponse::new)
            .map_err(handler_error)
    }

    /// `fs/write_text_file` through the tether handler.
    pub async fn write(
        &self,
        r: WriteTextFileRequest,
        info: &SessionInfo,
    ) -> Result<WriteTextFileResponse, ClientError> {
        let req = th::WriteTextFile::new(r.path, r.content);
        self.handler
            .write_text_file(&req, info)
            .await
            .map(|_| WriteTextFileResponse::new())
            .map_err(handler_error)
    }

    /// `terminal/*` through the tether handler.
    pub async fn terminal(
        &self,
        request: AcpTerminalRequest,
        info: &SessionInfo,
    ) -> Result<AcpTerminalResponse, ClientError> {
        let resp = self
            .handler
            .terminal(&terminal_request(&request), info)
            .await
            .map_err(handler_error)?;
        terminal_response(&request, resp)
    }

    /// `elicitation/create` through the tether handler.
    pub async fn elicit(
        &self,
        r: CreateElicitationRequest,
        info: &SessionInfo,
    ) -> Result<CreateElicitationResponse, ClientError> {
        let Some(req) = elicitation_request(&r) else {
            return Err(ClientError::invalid_params("unknown elicitation mode"));
        };
        elicitation_response(self.handler.elicit(&req, info).await)
    }

    fn info_for_elicitation(&self, r: &CreateElicitationRequest) -> SessionInfo {
        match elicitation_session(r) {
            Some(s) => self.info(&s),
            None => SessionInfo::new("", self.provider_name.clone()),
        }
    }
}

#[async_trait]
impl ClientHandler for HandlerBridge {
    fn supports(&self) -> th::Capabilities {
        self.handler.capabilities()
    }

    async fn session_update(&self, _event: &SessionUpdateEvent) {}

    async fn request_permission(&self, req: &RequestPermissionRequest) -> RequestPermissionOutcome {
        let info = self.info(&req.session_id);
        self.permission(req, &info).await
    }

    async fn read_text_file(&self, r: ReadTextFileRequest) -> Result<ReadTextFileResponse, ClientError> {
        let info = self.info(&r.session_id);
        self.read(r, &info).await
    }

    async fn write_text_file(&self, r: WriteTextFileRequest) -> Result<WriteTextFileResponse, ClientError> {
        let info = self.info(&r.session_id);
        self.write(r, &info).await
    }

    async fn terminal(
        &self,
        request: AcpTerminalRequest,
        _id: &RequestId,
    ) -> Result<AcpTerminalResponse, ClientError> {
        let info = self.info(request.session_id());
        HandlerBridge::terminal(self, request, &info).await
    }

    async fn form_elicitation(
        &self,
        r: CreateElicitationRequest,
    ) -> Result<CreateElicitationResponse, ClientError> {
        let info = self.info_for_elicitation(&r);
        self.elicit(r, &info).await
    }

    async fn url_elicitation(
        &self,
        r: CreateElicitationRequest,
    ) -> Result<CreateElicitationResponse, ClientError> {
        let info = self.info_for_elicitation(&r);
        self.elicit(r, &info).await
    }

    async fn elicitation_complete(&self, n: CompleteElicitationNotification) {
        let info = SessionInfo::new("", self.provider_name.clone());
        self.handler
            .elicitation_complete(&n.elicitation_id.to_string(), &info)
            .await
    }
}
