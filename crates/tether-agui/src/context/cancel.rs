//! Cancellation: the token a run shares with its transport, and the context's view of it.

use super::*;

/// The cancellation signal shared by a run and its transport: tether's one token,
/// [`tether::CancellationToken`] (tokio-util's), under the name this crate's API has used. A run
/// cancelled here is cancelled for the session driving it too, with no bridge between two kinds
/// of token; new code can name it `tether::CancellationToken`.
#[deprecated(note = "use `tether::CancellationToken`, the same type")]
pub type CancelToken = tether::CancellationToken;

impl<S: AgentState> RunContext<S> {
    // ----- cancellation -----

    /// The run's cancellation token (tripped when the client disconnects).
    pub fn cancel_token(&self) -> &tether::CancellationToken {
        &self.sink.cancel
    }

    /// Whether the run was cancelled or its client went away.
    pub fn is_cancelled(&self) -> bool {
        self.sink.cancel.is_cancelled() || self.sink.tx.is_closed()
    }

    /// Waits until the transport took every event emitted so far and has room for at least one
    /// more (backpressure for agents that produce events faster than the client reads them).
    ///
    /// Await it once per event of the agent's own source: what one source event becomes may be
    /// several AG-UI events, and those the buffer has no room for wait in the context (up to
    /// the buffer's size again, at least 64) until this is awaited next. Cancel safe.
    pub async fn ready(&mut self) -> AgUiResult<()> {
        self.sink.ready().await
    }
}
