//! Request correlation in both directions: our calls to the agent (ids, the pending table, the
//! timeout, `$/cancel_request` when a caller gives up, the answer handed back) and the agent's
//! requests to us (the inbound table, duplicate ids, cancellation, exactly one answer each).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;

use super::dispatch::to_value;
use super::wire::{OutError, OutErrorBody, OutNotification, OutRequest, OutResult, SessionHint, WireError};
use super::{Conn, lock};
use crate::error::{AcpError, ClientError, Direction, codes};
use crate::schema::{
    CreateElicitationResponse, ElicitationAction, RequestId, RequestPermissionOutcome,
    RequestPermissionResponse, SessionId,
};

/// Runs in the dispatcher when a response arrives, before the caller is woken (so state such as a
/// new session's roots is in place before the agent's next message is dispatched).
pub(crate) type Hook = Box<dyn FnOnce(&Conn, &Value) + Send>;

pub(super) struct PendingCall {
    pub(super) tx: oneshot::Sender<Result<Value, AcpError>>,
    pub(super) hook: Option<Hook>,
    pub(super) method: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum InboundKind {
    Permission,
    Elicitation,
    Other,
}

pub(super) struct InboundEntry {
    pub(super) generation: u64,
    pub(super) session: Option<SessionId>,
    pub(super) kind: InboundKind,
    pub(super) abort: Option<AbortHandle>,
}

pub(super) struct CallGuard<'a> {
    pub(super) conn: &'a Conn,
    pub(super) id: i64,
    pub(super) armed: bool,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        if self.armed && lock(&self.conn.pending).remove(&self.id).is_some() {
            // The caller gave up (its future was dropped): tell the agent.
            self.conn
                .notify_nowait("$/cancel_request", serde_json::json!({ "requestId": self.id }));
        }
    }
}

impl Conn {
    pub(super) fn on_response(&self, id_raw: &str, outcome: Result<Value, WireError>) {
        let Ok(id) = serde_json::from_str::<i64>(id_raw) else {
            tracing::warn!(id = id_raw, "response with an id this client never issued");
            return;
        };
        let Some(p) = lock(&self.pending).remove(&id) else {
            tracing::debug!(
                id,
                "response for a request no longer pending (timed out or cancelled)"
            );
            return;
        };
        let result = match outcome {
            Ok(v) => {
                if let Some(hook) = p.hook {
                    hook(self, &v);
                }
                Ok(v)
            }
            Err(e) => Err(AcpError::Rpc {
                method: p.method,
                code: e.code,
                message: e.message,
                data: e.data.map(Box::new),
            }),
        };
        let _ = p.tx.send(result);
    }

    pub(super) async fn on_request(self: &Arc<Self>, id: RequestId, method: String, line: String) {
        let kind = match method.as_str() {
            "session/request_permission" => InboundKind::Permission,
            "elicitation/create" => InboundKind::Elicitation,
            _ => InboundKind::Other,
        };
        let session = serde_json::from_str::<SessionHint>(&line)
            .ok()
            .and_then(|h| h.params)
            .and_then(|p| p.session_id);
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let duplicate = {
            let mut inbound = lock(&self.inbound);
            let duplicate = inbound.contains_key(&id);
            if !duplicate {
                inbound.insert(
                    id.clone(),
                    InboundEntry {
                        generation,
                        session,
                        kind,
                        abort: None,
                    },
                );
            }
            duplicate
        };
        if duplicate {
            self.send_error(&id, codes::INVALID_REQUEST, "request id already in use")
                .await;
            return;
        }
        let conn = self.clone();
        let work_id = id.clone();
        let work = tokio::spawn(async move { conn.process_request(&work_id, &method, &line).await });
        let abort = work.abort_handle();
        if let Some(e) = lock(&self.inbound).get_mut(&id)
            && e.generation == generation
        {
            e.abort = Some(abort.clone());
        }
        let conn = self.clone();
        let timeout = self.opts.handler_timeout;
        tokio::spawn(async move {
            let result = match tokio::time::timeout(timeout, work).await {
                Ok(Ok(r)) => r,
                Ok(Err(join)) if join.is_cancelled() => return,
                Ok(Err(_)) => Err(ClientError::internal("the client handler panicked")),
                Err(_) => {
                    abort.abort();
                    Err(ClientError::internal(format!(
                        "the client handler timed out after {timeout:?}"
                    )))
                }
            };
            conn.finish_inbound(&id, generation, result).await;
        });
    }

    pub(super) async fn finish_inbound(
        &self,
        id: &RequestId,
        generation: u64,
        result: Result<Value, ClientError>,
    ) {
        let owned = {
            let mut inbound = lock(&self.inbound);
            match inbound.get(id) {
                Some(e) if e.generation == generation => {
                    inbound.remove(id);
                    true
                }
                _ => false,
            }
        };
        if owned {
            self.send_response(id, result).await;
        }
    }

    /// `$/cancel_request` from the agent: abort the handler and answer `-32800`.
    pub(super) async fn cancel_inbound(&self, id: &RequestId) {
        let entry = lock(&self.inbound).remove(id);
        if let Some(e) = entry {
            if let Some(a) = e.abort {
                a.abort();
            }
            self.send_response(id, Err(ClientError::cancelled())).await;
        }
    }

    /// Answers this session's pending permission requests `cancelled` and elicitations `cancel`.
    pub(crate) async fn cancel_session_requests(&self, session: &SessionId) -> usize {
        let victims: Vec<(RequestId, InboundEntry)> = {
            let mut inbound = lock(&self.inbound);
            let ids: Vec<RequestId> = inbound
                .iter()
                .filter(|(_, e)| e.kind != InboundKind::Other && e.session.as_ref() == Some(session))
                .map(|(id, _)| id.clone())
                .collect();
            ids.into_iter()
                .filter_map(|id| inbound.remove(&id).map(|e| (id, e)))
                .collect()
        };
        let n = victims.len();
        for (id, e) in victims {
            if let Some(a) = e.abort {
                a.abort();
            }
            let answer = match e.kind {
                InboundKind::Permission => to_value(&RequestPermissionResponse::new(
                    RequestPermissionOutcome::Cancelled,
                )),
                _ => to_value(&CreateElicitationResponse::new(ElicitationAction::Cancel)),
            };
            self.send_response(&id, answer).await;
        }
        n
    }

    pub(super) async fn send_response(&self, id: &RequestId, result: Result<Value, ClientError>) {
        let frame = match &result {
            Ok(v) => serde_json::to_string(&OutResult {
                jsonrpc: "2.0",
                id,
                result: v,
            }),
            Err(e) => serde_json::to_string(&OutError {
                jsonrpc: "2.0",
                id,
                error: OutErrorBody {
                    code: e.code,
                    message: &e.message,
                    data: &e.data,
                },
            }),
        };
        let frame = match frame {
            Ok(f) if f.len() <= self.opts.max_frame_bytes => f,
            Ok(f) => {
                let msg = format!(
                    "the answer ({} bytes) exceeds the maximum frame size of {} bytes",
                    f.len(),
                    self.opts.max_frame_bytes
                );
                return Box::pin(self.send_error(id, codes::INTERNAL_ERROR, &msg)).await;
            }
            Err(e) => {
                let msg = format!("could not encode the answer: {e}");
                return Box::pin(self.send_error(id, codes::INTERNAL_ERROR, &msg)).await;
            }
        };
        let _ = self.out_tx.send(frame).await;
    }

    pub(super) async fn send_error(&self, id: &RequestId, code: i32, message: &str) {
        let frame = serde_json::to_string(&OutError {
            jsonrpc: "2.0",
            id,
            error: OutErrorBody {
                code,
                message,
                data: &None,
            },
        });
        if let Ok(f) = frame {
            let _ = self.out_tx.send(f).await;
        }
    }

    /// Sends a request and waits for its answer (or the timeout, or the connection closing).
    pub(crate) async fn call<P: Serialize>(
        &self,
        method: &str,
        params: &P,
        timeout: Option<Duration>,
        hook: Option<Hook>,
    ) -> Result<Value, AcpError> {
        if let Some(e) = self.closed_error() {
            return Err(e);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = serde_json::to_string(&OutRequest {
            jsonrpc: "2.0",
            id,
            method,
            params,
        })
        .map_err(|e| AcpError::Encode {
            method: method.into(),
            message: e.to_string(),
        })?;
        if frame.len() > self.opts.max_frame_bytes {
            return Err(AcpError::FrameTooLarge {
                direction: Direction::Outbound,
                size: frame.len(),
                limit: self.opts.max_frame_bytes,
            });
        }
        let (tx, rx) = oneshot::channel();
        {
            let mut pending = lock(&self.pending);
            if pending.len() >= self.opts.max_pending_requests {
                return Err(AcpError::TooManyPending {
                    limit: self.opts.max_pending_requests,
                });
            }
            pending.insert(
                id,
                PendingCall {
                    tx,
                    hook,
                    method: method.to_owned(),
                },
            );
        }
        if let Some(e) = self.closed_error() {
            lock(&self.pending).remove(&id);
            return Err(e);
        }
        let mut guard = CallGuard {
            conn: self,
            id,
            armed: true,
        };
        if self.out_tx.send(frame).await.is_err() {
            guard.armed = false;
            lock(&self.pending).remove(&id);
            return Err(self.closed_error().unwrap_or(AcpError::Closed {
                reason: "the writer stopped".into(),
            }));
        }
        let received = match timeout {
            Some(t) => match tokio::time::timeout(t, rx).await {
                Ok(r) => r,
                Err(_) => {
                    guard.armed = false;
                    if lock(&self.pending).remove(&id).is_some() {
                        self.notify_nowait("$/cancel_request", serde_json::json!({ "requestId": id }));
                    }
                    return Err(AcpError::Timeout {
                        method: method.into(),
                        after: t,
                    });
                }
            },
            None => rx.await,
        };
        guard.armed = false;
        match received {
            Ok(r) => r,
            Err(_) => Err(self.closed_error().unwrap_or(AcpError::Closed {
                reason: "the connection dropped the call".into(),
            })),
        }
    }

    /// Sends a notification (waits for room in the outbound queue).
    pub(crate) async fn notify<P: Serialize>(&self, method: &str, params: &P) -> Result<(), AcpError> {
        if let Some(e) = self.closed_error() {
            return Err(e);
        }
        let frame = serde_json::to_string(&OutNotification {
            jsonrpc: "2.0",
            method,
            params,
        })
        .map_err(|e| AcpError::Encode {
            method: method.into(),
            message: e.to_string(),
        })?;
        if frame.len() > self.opts.max_frame_bytes {
            return Err(AcpError::FrameTooLarge {
                direction: Direction::Outbound,
                size: frame.len(),
                limit: self.opts.max_frame_bytes,
            });
        }
        self.out_tx.send(frame).await.map_err(|_| {
            self.closed_error().unwrap_or(AcpError::Closed {
                reason: "the writer stopped".into(),
            })
        })
    }

    /// Best-effort notification from synchronous code (drop guards, timeouts).
    pub(super) fn notify_nowait(&self, method: &str, params: Value) {
        let Ok(frame) = serde_json::to_string(&OutNotification {
            jsonrpc: "2.0",
            method,
            params: &params,
        }) else {
            return;
        };
        if let Err(mpsc::error::TrySendError::Full(frame)) = self.out_tx.try_send(frame)
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let tx = self.out_tx.clone();
            rt.spawn(async move {
                let _ = tx.send(frame).await;
            });
        }
    }

    /// Whether an outbound request with this id is waiting for its answer.
    pub(crate) fn is_pending(&self, id: i64) -> bool {
        lock(&self.pending).contains_key(&id)
    }
}
