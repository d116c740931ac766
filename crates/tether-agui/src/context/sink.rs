//! The sink: every event passes the verifier, then the bounded channel to the transport.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dead {
    Violation,
    BufferFull,
    Closed,
}

/// Where events go: the verifier, then the bounded channel to the transport.
pub(crate) struct Sink {
    pub(super) verifier: Verifier,
    pub(super) tx: mpsc::Sender<Box<AgUiEvent>>,
    pub(super) capacity: usize,
    pub(super) cancel: tether::CancellationToken,
    pub(super) dead: Option<Dead>,
    pub(super) timestamps: bool,
    /// The assistant message the current model turn's tool calls attach to.
    pub(super) turn_message: Option<MessageId>,
}

impl fmt::Debug for Sink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sink")
            .field("capacity", &self.capacity)
            .field("dead", &self.dead)
            .finish_non_exhaustive()
    }
}

pub(super) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Sink {
    pub(super) fn check_alive(&self) -> AgUiResult<()> {
        match self.dead {
            Some(Dead::Violation) => Err(AgUiError::RunEnded),
            Some(Dead::BufferFull) => Err(AgUiError::BufferFull {
                capacity: self.capacity,
            }),
            Some(Dead::Closed) => Err(AgUiError::Cancelled),
            None if self.cancel.is_cancelled() || self.tx.is_closed() => Err(AgUiError::Cancelled),
            None => Ok(()),
        }
    }

    /// Verifies and queues one event. A violation queues one `RUN_ERROR` instead and kills
    /// the run.
    pub(crate) fn emit(&mut self, mut event: AgUiEvent) -> AgUiResult<()> {
        self.check_alive()?;
        if self.timestamps && event.timestamp().is_none() {
            event.set_timestamp(now_ms());
        }
        if let Err(v) = self.verifier.observe(&event) {
            tracing::warn!(code = v.code(), "AG-UI stream violation: {}", v.detail);
            let err = AgUiEvent::run_error(v.detail.clone(), Some(v.code().to_owned()));
            if self.verifier.observe(&err).is_ok() {
                let _ = self.tx.try_send(Box::new(err));
            }
            self.dead = Some(Dead::Violation);
            return Err(AgUiError::Verification(v));
        }
        match &event {
            AgUiEvent::TextMessageStart(e)
                if e.subagent_run_id.is_none()
                    && matches!(e.role, None | Some(TextMessageRole::Assistant)) =>
            {
                self.turn_message = Some(e.message_id.clone());
            }
            AgUiEvent::ToolCallResult(_) | AgUiEvent::RunStarted(_) => self.turn_message = None,
            _ => {}
        }
        match self.tx.try_send(Box::new(event)) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.dead = Some(Dead::BufferFull);
                Err(AgUiError::BufferFull {
                    capacity: self.capacity,
                })
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.dead = Some(Dead::Closed);
                self.cancel.cancel();
                Err(AgUiError::Cancelled)
            }
        }
    }

    /// Sends a terminal event, waiting for buffer space.
    pub(super) async fn emit_final(&mut self, mut event: AgUiEvent) {
        if matches!(self.dead, Some(Dead::Closed | Dead::Violation)) {
            return;
        }
        if self.timestamps && event.timestamp().is_none() {
            event.set_timestamp(now_ms());
        }
        if let Err(v) = self.verifier.observe(&event) {
            tracing::warn!(code = v.code(), "AG-UI stream violation: {}", v.detail);
            event = AgUiEvent::run_error(v.detail.clone(), Some(v.code().to_owned()));
            if self.verifier.observe(&event).is_err() {
                return;
            }
        }
        let _ = self.tx.send(Box::new(event)).await;
    }
}
