//! The client-side handler: what the connection calls when the agent sends a notification or a
//! request. Every method has a default that refuses (or ignores), so a handler implements only
//! what it supports and declares it in [`ClientHandler::supports`]; the client advertises exactly
//! that in `initialize`.
//!
//! The connection owns correlation, validation (id in use, capability advertised, params well
//! formed, session known, paths inside the session roots), cancellation and timeouts; a handler
//! never sends a JSON-RPC response itself.

use async_trait::async_trait;
use serde_json::Value;
use serde_json::value::RawValue;
use tether::Capabilities;

use crate::error::ClientError;
use crate::schema::{
    ClientCapabilities, CompleteElicitationNotification, CreateElicitationRequest, CreateElicitationResponse,
    CreateTerminalRequest, CreateTerminalResponse, ElicitationAction, ElicitationCapabilities,
    ElicitationFormCapabilities, ElicitationUrlCapabilities, FileSystemCapabilities, KillTerminalRequest,
    KillTerminalResponse, Meta, PermissionOptionKind, ReadTextFileRequest, ReadTextFileResponse,
    ReleaseTerminalRequest, ReleaseTerminalResponse, RequestId, RequestPermissionOutcome,
    RequestPermissionRequest, SelectedPermissionOutcome, SessionId, SessionUpdate, TerminalOutputRequest,
    TerminalOutputResponse, WaitForTerminalExitRequest, WaitForTerminalExitResponse, WriteTextFileRequest,
    WriteTextFileResponse,
};

/// The `clientCapabilities` a handler's [`Capabilities`] imply: file reads and writes, the five
/// `terminal/*` methods, and form and URL elicitation (`elicitation/create` with that `mode`, and
/// `elicitation/complete` with URL). The client advertises exactly these (unless
/// `ClientOptions::capabilities` overrides them), and the connection refuses requests for
/// anything not advertised with `-32601` before the handler is called.
pub fn client_capabilities(caps: Capabilities) -> ClientCapabilities {
    let mut out = ClientCapabilities::new()
        .fs(FileSystemCapabilities::new()
            .read_text_file(caps.read_files)
            .write_text_file(caps.write_files))
        .terminal(caps.terminals);
    if caps.elicitation_form || caps.elicitation_url {
        let mut e = ElicitationCapabilities::new();
        if caps.elicitation_form {
            e = e.form(ElicitationFormCapabilities::new());
        }
        if caps.elicitation_url {
            e = e.url(ElicitationUrlCapabilities::new());
        }
        out = out.elicitation(e);
    }
    out
}

/// A `session/update` as the handler sees it: the typed update when this client knows the kind,
/// otherwise the raw JSON (never dropped).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum AcpUpdate {
    /// A kind the schema knows, decoded.
    Known(Box<SessionUpdate>),
    /// A kind this client does not know (or a known kind that failed to decode), passed through.
    Unknown {
        /// The `sessionUpdate` discriminator (empty if missing).
        kind: String,
        /// The whole `update` object.
        raw: Value,
        /// Why it could not be decoded as a known kind, if it claimed to be one.
        error: Option<String>,
    },
}

impl AcpUpdate {
    /// The `sessionUpdate` discriminator of this update.
    pub fn kind(&self) -> String {
        match self {
            AcpUpdate::Known(u) => serde_json::to_value(u.as_ref())
                .ok()
                .and_then(|v| v.get("sessionUpdate").and_then(Value::as_str).map(str::to_owned))
                .unwrap_or_default(),
            AcpUpdate::Unknown { kind, .. } => kind.clone(),
        }
    }
}

/// One `session/update` notification.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SessionUpdateEvent {
    /// The session it belongs to (always one this client knows).
    pub session_id: SessionId,
    /// The update.
    pub update: AcpUpdate,
    /// The notification's `_meta`.
    pub meta: Option<Meta>,
}

/// The JSON-RPC message a request or notification arrived in, exactly as received (one line of
/// JSON). Keeps every field, including unknown ones; decode it only when needed.
#[derive(Debug, Clone, Copy)]
pub struct RawMessage<'a> {
    line: &'a str,
}

impl<'a> RawMessage<'a> {
    pub(crate) fn new(line: &'a str) -> Self {
        RawMessage { line }
    }
    /// The message's JSON text.
    pub fn json(&self) -> &'a str {
        self.line
    }
    /// The decoded message (`jsonrpc`, `id`, `method`, `params`, and any unknown fields).
    pub fn value(&self) -> Value {
        serde_json::from_str(self.line).unwrap_or(Value::Null)
    }
    /// The request id, for requests.
    pub fn id(&self) -> Option<RequestId> {
        self.value()
            .get("id")
            .and_then(|v| serde_json::from_value(v.clone()).ok())
    }
}

/// One of the five `terminal/*` requests, in ACP's schema types.
///
/// Named apart from [`tether::TerminalRequest`] (the provider-neutral form a tether `Handler`
/// serves, which [`crate::bridge`] converts to and from) so the two never share a name.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum AcpTerminalRequest {
    /// `terminal/create` (its `cwd` is filled with the session cwd when omitted, and resolved).
    Create(CreateTerminalRequest),
    /// `terminal/output`.
    Output(TerminalOutputRequest),
    /// `terminal/wait_for_exit`.
    WaitForExit(WaitForTerminalExitRequest),
    /// `terminal/kill`.
    Kill(KillTerminalRequest),
    /// `terminal/release`.
    Release(ReleaseTerminalRequest),
}

impl AcpTerminalRequest {
    /// The JSON-RPC method name.
    pub fn method(&self) -> &'static str {
        match self {
            AcpTerminalRequest::Create(_) => "terminal/create",
            AcpTerminalRequest::Output(_) => "terminal/output",
            AcpTerminalRequest::WaitForExit(_) => "terminal/wait_for_exit",
            AcpTerminalRequest::Kill(_) => "terminal/kill",
            AcpTerminalRequest::Release(_) => "terminal/release",
        }
    }
    /// The session the request belongs to.
    pub fn session_id(&self) -> &SessionId {
        match self {
            AcpTerminalRequest::Create(r) => &r.session_id,
            AcpTerminalRequest::Output(r) => &r.session_id,
            AcpTerminalRequest::WaitForExit(r) => &r.session_id,
            AcpTerminalRequest::Kill(r) => &r.session_id,
            AcpTerminalRequest::Release(r) => &r.session_id,
        }
    }
}

/// The answer to an [`AcpTerminalRequest`] (must match the request's method).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum AcpTerminalResponse {
    /// For `terminal/create`.
    Create(CreateTerminalResponse),
    /// For `terminal/output`.
    Output(TerminalOutputResponse),
    /// For `terminal/wait_for_exit`.
    WaitForExit(WaitForTerminalExitResponse),
    /// For `terminal/kill`.
    Kill(KillTerminalResponse),
    /// For `terminal/release`.
    Release(ReleaseTerminalResponse),
}

impl AcpTerminalResponse {
    pub(crate) fn method(&self) -> &'static str {
        match self {
            AcpTerminalResponse::Create(_) => "terminal/create",
            AcpTerminalResponse::Output(_) => "terminal/output",
            AcpTerminalResponse::WaitForExit(_) => "terminal/wait_for_exit",
            AcpTerminalResponse::Kill(_) => "terminal/kill",
            AcpTerminalResponse::Release(_) => "terminal/release",
        }
    }
    pub(crate) fn to_value(&self) -> Result<Value, serde_json::Error> {
        match self {
            AcpTerminalResponse::Create(r) => serde_json::to_value(r),
            AcpTerminalResponse::Output(r) => serde_json::to_value(r),
            AcpTerminalResponse::WaitForExit(r) => serde_json::to_value(r),
            AcpTerminalResponse::Kill(r) => serde_json::to_value(r),
            AcpTerminalResponse::Release(r) => serde_json::to_value(r),
        }
    }
}

/// Why the connection ended (passed to [`ClientHandler::terminate`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum TerminateReason {
    /// `AcpClient::shutdown` was called or the client was dropped.
    Shutdown,
    /// The connection failed or the agent exited.
    Error(crate::AcpError),
}

/// The default permission answer: the first `reject_once`/`reject_always` option if one is
/// offered, else `cancelled`. Never allows.
pub fn refuse_permission(request: &RequestPermissionRequest) -> RequestPermissionOutcome {
    request
        .options
        .iter()
        .find(|o| {
            matches!(
                o.kind,
                PermissionOptionKind::RejectOnce | PermissionOptionKind::RejectAlways
            )
        })
        .map(|o| RequestPermissionOutcome::Selected(SelectedPermissionOutcome::new(o.option_id.clone())))
        .unwrap_or(RequestPermissionOutcome::Cancelled)
}

/// The client side of ACP. See the module docs; the surface mirrors ExMCP's
/// `ExMCP.ACP.Client.Handler` (init, session updates with and without the message, permission
/// with and without the message, file read/write, one terminal callback for the five methods,
/// form and URL elicitation, elicitation completion, terminate) plus extension methods.
#[async_trait]
pub trait ClientHandler: Send + Sync + 'static {
    /// Which optional methods this handler implements (advertised in `initialize`).
    /// ([`tether::Capabilities`]: the one description of the client-side requests a handler
    /// serves, shared with tether's own [`tether::Handler`].)
    fn supports(&self) -> Capabilities {
        Capabilities::none()
    }

    /// Called once when the connection starts, before `initialize` is sent.
    async fn init(&self) {}

    /// A `session/update` for a known session. Called in arrival order, one at a time; while it
    /// runs no further message is dispatched (this is the back-pressure: updates are never
    /// dropped).
    async fn session_update(&self, _event: &SessionUpdateEvent) {}

    /// Like [`ClientHandler::session_update`] with the message as received (unknown fields kept).
    /// The connection calls this one; the default forwards to `session_update`.
    async fn session_update_with_message(&self, event: &SessionUpdateEvent, _message: &RawMessage<'_>) {
        self.session_update(event).await
    }

    /// `session/request_permission`. Must return `cancelled` or one of the offered option ids
    /// (anything else is answered with `-32603`). Default: [`refuse_permission`].
    async fn request_permission(&self, request: &RequestPermissionRequest) -> RequestPermissionOutcome {
        refuse_permission(request)
    }

    /// Like [`ClientHandler::request_permission`] with the message (including the request id).
    /// The connection calls this one; the default forwards.
    async fn request_permission_with_message(
        &self,
        request: &RequestPermissionRequest,
        _message: &RawMessage<'_>,
    ) -> RequestPermissionOutcome {
        self.request_permission(request).await
    }

    /// `fs/read_text_file`; `path` is already resolved (symlinks followed) and inside the
    /// session roots.
    async fn read_text_file(
        &self,
        _request: ReadTextFileRequest,
    ) -> Result<ReadTextFileResponse, ClientError> {
        Err(ClientError::method_not_found("fs/read_text_file"))
    }

    /// `fs/write_text_file`; `path` is already resolved and inside the session roots (the file may
    /// not exist yet: it must be created).
    async fn write_text_file(
        &self,
        _request: WriteTextFileRequest,
    ) -> Result<WriteTextFileResponse, ClientError> {
        Err(ClientError::method_not_found("fs/write_text_file"))
    }

    /// All five `terminal/*` methods. The answer variant must match the request.
    async fn terminal(
        &self,
        request: AcpTerminalRequest,
        _id: &RequestId,
    ) -> Result<AcpTerminalResponse, ClientError> {
        Err(ClientError::method_not_found(request.method()))
    }

    /// `elicitation/create` with `mode: "form"`. Default: decline.
    async fn form_elicitation(
        &self,
        _request: CreateElicitationRequest,
    ) -> Result<CreateElicitationResponse, ClientError> {
        Ok(CreateElicitationResponse::new(ElicitationAction::Decline))
    }

    /// `elicitation/create` with `mode: "url"`. Default: decline.
    async fn url_elicitation(
        &self,
        _request: CreateElicitationRequest,
    ) -> Result<CreateElicitationResponse, ClientError> {
        Ok(CreateElicitationResponse::new(ElicitationAction::Decline))
    }

    /// `elicitation/complete` (unknown ids should be ignored).
    async fn elicitation_complete(&self, _notification: CompleteElicitationNotification) {}

    /// A custom `_…` request. Default: `-32601`.
    async fn ext_method(&self, method: &str, _params: &RawValue) -> Result<Value, ClientError> {
        Err(ClientError::method_not_found(method))
    }

    /// A custom `_…` notification. Default: ignored.
    async fn ext_notification(&self, _method: &str, _params: &RawValue) {}

    /// Called once when the connection ends.
    async fn terminate(&self, _reason: &TerminateReason) {}
}

/// A handler that supports nothing optional and refuses every permission request.
#[derive(Debug, Clone, Copy, Default)]
pub struct RefusingHandler;

#[async_trait]
impl ClientHandler for RefusingHandler {}
