//! Dispatch: the one task that reads frames and handles each strictly in arrival order
//! (`session/update` awaited, so a slow handler back-pressures the agent), and the validation and
//! serving of the agent's requests (capability, params, session, path confinement) before the
//! handler sees them.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;
use tokio::io::AsyncRead;

use super::framing::{Frame, FrameReader, ReadEnd};
use super::wire::{Envelope, Field, WireError, null_raw, parse_update};
use super::{Conn, SessionEntry, lock};
use crate::error::{AcpError, ClientError, Direction, codes};
use crate::fast::{FastCache, decode_text_chunk};
use crate::handler::{AcpTerminalRequest, RawMessage, SessionUpdateEvent};
use crate::roots::confine;
use crate::schema::{
    CancelRequestNotification, CompleteElicitationNotification, CreateElicitationRequest,
    CreateElicitationResponse, CreateTerminalRequest, ElicitationAction, ElicitationMode, ElicitationScope,
    KillTerminalRequest, ReadTextFileRequest, ReleaseTerminalRequest, RequestId, RequestPermissionOutcome,
    RequestPermissionRequest, RequestPermissionResponse, SessionId, TerminalOutputRequest,
    WaitForTerminalExitRequest, WriteTextFileRequest,
};

pub(super) fn to_value<T: Serialize>(v: &T) -> Result<Value, ClientError> {
    serde_json::to_value(v).map_err(|e| ClientError::internal(format!("could not encode the answer: {e}")))
}

pub(super) fn parse_params<T: serde::de::DeserializeOwned>(params: &str) -> Result<T, ClientError> {
    serde_json::from_str(params).map_err(|e| ClientError::invalid_params(format!("invalid params: {e}")))
}

impl Conn {
    /// Reads and dispatches in one task, strictly in arrival order: nothing more is read while a
    /// message is handled, so a slow handler back-pressures the agent through the pipe (at most
    /// one read buffer is held ahead), and no frame waits in a queue or crosses threads.
    pub(super) async fn dispatch_loop<R: AsyncRead + Unpin>(self: Arc<Self>, mut frames: FrameReader<R>) {
        let mut sessions = FastCache::default();
        loop {
            match frames.next().await {
                Frame::Line(r) => match frames.get(r).map(std::str::from_utf8) {
                    Some(Ok(line)) => self.dispatch_line(line, &mut sessions).await,
                    Some(Err(_)) | None => {
                        tracing::warn!("agent sent a frame that is not UTF-8");
                        self.send_error(&RequestId::Null, codes::PARSE_ERROR, "frame is not valid UTF-8")
                            .await;
                    }
                },
                Frame::End(end) => {
                    self.end_of_input(end).await;
                    return;
                }
            }
        }
    }

    /// The agent's stdout ended (or failed, or sent an oversized frame): close the connection.
    pub(super) async fn end_of_input(&self, end: ReadEnd) {
        let (err, kill) = match end {
            ReadEnd::Eof => (
                AcpError::AgentExited {
                    exit: self.reap().await,
                },
                true,
            ),
            ReadEnd::TooLarge(size) => (
                AcpError::FrameTooLarge {
                    direction: Direction::Inbound,
                    size,
                    limit: self.opts.max_frame_bytes,
                },
                true,
            ),
            ReadEnd::Io(e) => (AcpError::io("reading the agent's stdout", e), true),
        };
        if self.closed_error().is_none() {
            tracing::warn!(error = %err, "ACP connection ended");
        }
        self.close(err, kill);
    }

    pub(super) async fn dispatch_line(self: &Arc<Self>, line: &str, sessions: &mut FastCache) {
        // The flood case (text chunks) in one pass; everything else below. See `fast`.
        if let Some(event) = decode_text_chunk(line, sessions) {
            // Loaded before the check: a removal after it changes the count, so the next update
            // checks again.
            let removed = self.sessions_removed.load(Ordering::Acquire);
            if sessions.is_verified(&event.session_id, removed) {
                self.handler
                    .session_update_with_message(&event, &RawMessage::new(line))
                    .await;
            } else if self.deliver_update(&event, line).await {
                sessions.set_verified(&event.session_id, removed);
            }
            sessions.recycle(event);
            return;
        }
        let env: Envelope<'_> = match serde_json::from_str(line) {
            Ok(env) => env,
            Err(e) => {
                let code = if e.is_syntax() || e.is_eof() {
                    codes::PARSE_ERROR
                } else {
                    codes::INVALID_REQUEST
                };
                tracing::warn!(error = %e, "malformed frame from the agent");
                self.send_error(&RequestId::Null, code, &format!("malformed message: {e}"))
                    .await;
                return;
            }
        };
        match (env.method.is_some(), env.id) {
            (true, Field::Present(id_raw)) => {
                let method = env.method.map(|m| m.into_owned()).unwrap_or_default();
                match serde_json::from_str::<RequestId>(id_raw.get()) {
                    Ok(id) => self.on_request(id, method, line.to_owned()).await,
                    Err(_) => {
                        self.send_error(&RequestId::Null, codes::INVALID_REQUEST, "invalid request id")
                            .await
                    }
                }
            }
            (true, Field::Absent) => {
                let method = env.method.clone().unwrap_or_default();
                let params = env.params.raw();
                self.on_notification(&method, params, line).await;
            }
            (false, Field::Present(id_raw)) => {
                let outcome = match (env.result, env.error) {
                    (_, Field::Present(err)) => {
                        let e: WireError = serde_json::from_str(err.get()).unwrap_or(WireError {
                            code: codes::INTERNAL_ERROR as i64,
                            message: err.get().to_owned(),
                            data: None,
                        });
                        Err(e)
                    }
                    (Field::Present(result), Field::Absent) => {
                        Ok(serde_json::from_str::<Value>(result.get()).unwrap_or(Value::Null))
                    }
                    (Field::Absent, Field::Absent) => {
                        tracing::warn!(line = %line, "agent sent a message with an id but no method, result or error");
                        return;
                    }
                };
                self.on_response(id_raw.get(), outcome);
            }
            (false, Field::Absent) => {
                tracing::warn!(line = %line, "agent sent a message that is neither request, notification nor response");
                self.send_error(&RequestId::Null, codes::INVALID_REQUEST, "not a JSON-RPC message")
                    .await;
            }
        }
    }

    /// Hands a decoded `session/update` to the handler (awaited: a slow handler back-pressures the
    /// reader), unless its session is unknown; whether it was delivered.
    pub(super) async fn deliver_update(&self, event: &SessionUpdateEvent, line: &str) -> bool {
        if !lock(&self.state).sessions.contains_key(&event.session_id) {
            tracing::warn!(session = %event.session_id, "dropping a session/update for an unknown session");
            return false;
        }
        self.handler
            .session_update_with_message(event, &RawMessage::new(line))
            .await;
        true
    }

    pub(super) async fn on_notification(
        self: &Arc<Self>,
        method: &str,
        params: Option<&RawValue>,
        line: &str,
    ) {
        let params_str = params.map(RawValue::get).unwrap_or("null");
        match method {
            "session/update" => match parse_update(params_str) {
                Ok(event) => {
                    self.deliver_update(&event, line).await;
                }
                Err(e) => tracing::warn!(error = %e, "dropping a malformed session/update"),
            },
            "elicitation/complete" => {
                match serde_json::from_str::<CompleteElicitationNotification>(params_str) {
                    Ok(n) => self.handler.elicitation_complete(n).await,
                    Err(e) => tracing::warn!(error = %e, "malformed elicitation/complete"),
                }
            }
            "$/cancel_request" => match serde_json::from_str::<CancelRequestNotification>(params_str) {
                Ok(n) => self.cancel_inbound(&n.request_id).await,
                Err(e) => tracing::warn!(error = %e, "malformed $/cancel_request"),
            },
            m if m.starts_with('_') => {
                let raw = params.unwrap_or(null_raw());
                self.handler.ext_notification(m, raw).await;
            }
            other => tracing::debug!(method = other, "ignoring unknown notification"),
        }
    }

    pub(super) fn session(&self, id: &SessionId) -> Result<SessionEntry, ClientError> {
        lock(&self.state)
            .sessions
            .get(id)
            .cloned()
            .ok_or_else(|| ClientError::invalid_params(format!("unknown session {id}")))
    }

    pub(super) async fn process_request(
        &self,
        id: &RequestId,
        method: &str,
        line: &str,
    ) -> Result<Value, ClientError> {
        let env: Envelope<'_> = serde_json::from_str(line)
            .map_err(|e| ClientError::new(codes::INVALID_REQUEST, e.to_string()))?;
        let params = env.params.raw().map(RawValue::get).unwrap_or("null");
        let message = RawMessage::new(line);
        let caps = lock(&self.state).advertised.clone().unwrap_or_default();
        let not_advertised = || ClientError::method_not_found(method);
        match method {
            "session/request_permission" => {
                let req: RequestPermissionRequest = parse_params(params)?;
                let session = self.session(&req.session_id)?;
                if session.cancelling {
                    return to_value(&RequestPermissionResponse::new(
                        RequestPermissionOutcome::Cancelled,
                    ));
                }
                let outcome = self.handler.request_permission_with_message(&req, &message).await;
                if let RequestPermissionOutcome::Selected(s) = &outcome
                    && !req.options.iter().any(|o| o.option_id == s.option_id)
                {
                    return Err(ClientError::internal(format!(
                        "the client handler chose option `{}`, which the agent did not offer",
                        s.option_id
                    )));
                }
                to_value(&RequestPermissionResponse::new(outcome))
            }
            "fs/read_text_file" => {
                if !caps.fs.read_text_file {
                    return Err(not_advertised());
                }
                let mut req: ReadTextFileRequest = parse_params(params)?;
                let session = self.session(&req.session_id)?;
                req.path = confine(&req.path, &session.roots)
                    .map_err(|e| ClientError::invalid_params(e.to_string()))?;
                to_value(&self.handler.read_text_file(req).await?)
            }
            "fs/write_text_file" => {
                if !caps.fs.write_text_file {
                    return Err(not_advertised());
                }
                let mut req: WriteTextFileRequest = parse_params(params)?;
                let session = self.session(&req.session_id)?;
                req.path = confine(&req.path, &session.roots)
                    .map_err(|e| ClientError::invalid_params(e.to_string()))?;
                to_value(&self.handler.write_text_file(req).await?)
            }
            "terminal/create"
            | "terminal/output"
            | "terminal/wait_for_exit"
            | "terminal/kill"
            | "terminal/release" => {
                if !caps.terminal {
                    return Err(not_advertised());
                }
                let request = match method {
                    "terminal/create" => {
                        let mut req: CreateTerminalRequest = parse_params(params)?;
                        let session = self.session(&req.session_id)?;
                        let cwd = req.cwd.clone().unwrap_or(session.cwd.clone());
                        req.cwd = Some(
                            confine(&cwd, &session.roots)
                                .map_err(|e| ClientError::invalid_params(e.to_string()))?,
                        );
                        AcpTerminalRequest::Create(req)
                    }
                    "terminal/output" => {
                        AcpTerminalRequest::Output(parse_params::<TerminalOutputRequest>(params)?)
                    }
                    "terminal/wait_for_exit" => {
                        AcpTerminalRequest::WaitForExit(parse_params::<WaitForTerminalExitRequest>(params)?)
                    }
                    "terminal/kill" => AcpTerminalRequest::Kill(parse_params::<KillTerminalRequest>(params)?),
                    _ => AcpTerminalRequest::Release(parse_params::<ReleaseTerminalRequest>(params)?),
                };
                self.session(request.session_id())?;
                let response = self.handler.terminal(request, id).await?;
                if response.method() != method {
                    return Err(ClientError::internal(format!(
                        "the client handler answered `{method}` with a `{}` result",
                        response.method()
                    )));
                }
                response
                    .to_value()
                    .map_err(|e| ClientError::internal(format!("could not encode the answer: {e}")))
            }
            "elicitation/create" => {
                let Some(ecaps) = caps
                    .elicitation
                    .clone()
                    .filter(|e| e.supports_form() || e.supports_url())
                else {
                    return Err(not_advertised());
                };
                let req: CreateElicitationRequest = parse_params(params)?;
                let form = match &req.mode {
                    ElicitationMode::Form(_) if ecaps.supports_form() => true,
                    ElicitationMode::Url(_) if ecaps.supports_url() => false,
                    ElicitationMode::Form(_) => {
                        return Err(ClientError::invalid_params("form elicitation was not advertised"));
                    }
                    ElicitationMode::Url(_) => {
                        return Err(ClientError::invalid_params("url elicitation was not advertised"));
                    }
                    _ => return Err(ClientError::invalid_params("unknown elicitation mode")),
                };
                match req.scope() {
                    ElicitationScope::Session(s) => {
                        if self.session(&s.session_id)?.cancelling {
                            return to_value(&CreateElicitationResponse::new(ElicitationAction::Cancel));
                        }
                    }
                    ElicitationScope::Request(r) => {
                        let known = match &r.request_id {
                            RequestId::Number(n) => lock(&self.pending).contains_key(n),
                            _ => false,
                        };
                        if !known {
                            return Err(ClientError::invalid_params(format!(
                                "elicitation names request {}, which is not pending",
                                r.request_id
                            )));
                        }
                    }
                    _ => return Err(ClientError::invalid_params("unknown elicitation scope")),
                }
                let response = if form {
                    self.handler.form_elicitation(req).await?
                } else {
                    self.handler.url_elicitation(req).await?
                };
                to_value(&response)
            }
            m if m.starts_with('_') => {
                let raw = env.params.raw().unwrap_or(null_raw());
                self.handler.ext_method(m, raw).await
            }
            _ => Err(ClientError::method_not_found(method)),
        }
    }
}
