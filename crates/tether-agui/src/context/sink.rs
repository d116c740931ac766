//! The sink: every event passes the verifier, then the bounded channel to the transport.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dead {
    Violation,
    BufferFull,
    Closed,
}

/// The fewest events the overflow holds, however small the buffer: what one source event of
/// an agent typically becomes (a model message with a dozen tool calls and a state delta).
const MIN_OVERFLOW: usize = 64;

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
    /// Events emitted while the channel was full, in order, sent before anything else by
    /// [`RunContext::ready`] and at the run's end. An agent awaits `ready` once per event of its
    /// own source, and one such event can become several AG-UI events (a model message with
    /// its tool calls; a state delta after it): those past the channel's room wait here instead
    /// of ending the run. Bounded by `capacity` (at least `MIN_OVERFLOW`): an agent that never
    /// awaits `ready` still ends with `EVENT_BUFFER_FULL`.
    pub(super) overflow: std::collections::VecDeque<Box<AgUiEvent>>,
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
                // After what waits in the overflow; it is sent at the run's end.
                match self.overflow.is_empty() {
                    true => {
                        let _ = self.tx.try_send(Box::new(err));
                    }
                    false => self.overflow.push_back(Box::new(err)),
                }
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
        // Behind events already waiting, to keep the order.
        if !self.overflow.is_empty() {
            return self.spill(Box::new(event));
        }
        match self.tx.try_send(Box::new(event)) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(event)) => self.spill(event),
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.dead = Some(Dead::Closed);
                self.cancel.cancel();
                Err(AgUiError::Cancelled)
            }
        }
    }

    /// Keeps an event the full channel had no room for, or ends the run when the overflow is
    /// full too.
    fn spill(&mut self, event: Box<AgUiEvent>) -> AgUiResult<()> {
        if self.overflow.len() >= self.capacity.max(MIN_OVERFLOW) {
            self.dead = Some(Dead::BufferFull);
            return Err(AgUiError::BufferFull {
                capacity: self.capacity,
            });
        }
        self.overflow.push_back(event);
        Ok(())
    }

    /// Sends the overflow's events, waiting for room for each; then waits for room for one
    /// more. Cancel safe: an event leaves the overflow only with a slot reserved for it.
    pub(super) async fn ready(&mut self) -> AgUiResult<()> {
        loop {
            let permit = self.tx.reserve().await.map_err(|_| AgUiError::Cancelled)?;
            match self.overflow.pop_front() {
                Some(event) => permit.send(event),
                None => return Ok(()),
            }
        }
    }

    /// Sends a terminal event, waiting for buffer space.
    pub(super) async fn emit_final(&mut self, mut event: AgUiEvent) {
        // What waits in the overflow goes first (a violation's RUN_ERROR may be among it).
        while let Some(e) = self.overflow.pop_front() {
            if self.tx.send(e).await.is_err() {
                return;
            }
        }
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
