//! Errors.

use crate::verify::Violation;

/// The result of serving a run: [`AgUiError`] by default.
pub type AgUiResult<T, E = AgUiError> = std::result::Result<T, E>;

/// What can go wrong while serving a run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgUiError {
    /// An event would have broken the AG-UI ordering rules; the run was ended with
    /// `RUN_ERROR{code: violation.code()}` and accepts no further events.
    #[error("AG-UI stream violation: {0}")]
    Verification(#[from] Violation),
    /// The client went away (or the run was cancelled); stop working.
    #[error("the run was cancelled or its client disconnected")]
    Cancelled,
    /// The run already ended; nothing more can be emitted on it.
    #[error("the run has already ended; start a new run before emitting more events")]
    RunEnded,
    /// The agent produced events faster than the transport drained them.
    #[error("event buffer full ({capacity} events): the client is not reading the stream")]
    BufferFull {
        /// The configured capacity.
        capacity: usize,
    },
    /// JSON (de)serialization failed (typed state, tool arguments).
    #[error("JSON error: {0}")]
    Json(#[from] serde_json::Error),
    /// The input state does not fit the agent's typed state.
    #[error("RunAgentInput.state does not match the agent's state type: {0}")]
    InvalidState(serde_json::Error),
    /// The agent failed; becomes `RUN_ERROR{message, code}`.
    #[error("{message}")]
    Agent {
        /// Machine-readable code for `RUN_ERROR.code`.
        code: Option<String>,
        /// Message for `RUN_ERROR.message`.
        message: String,
    },
}

impl AgUiError {
    /// An agent failure with a code, reported as `RUN_ERROR{code, message}`.
    pub fn agent(code: impl Into<String>, message: impl Into<String>) -> Self {
        AgUiError::Agent {
            code: Some(code.into()),
            message: message.into(),
        }
    }

    /// The `RUN_ERROR.code` this error is reported with.
    pub fn code(&self) -> String {
        match self {
            AgUiError::Verification(v) => v.code().to_owned(),
            AgUiError::Cancelled => "CANCELLED".to_owned(),
            AgUiError::RunEnded => "RUN_ENDED".to_owned(),
            AgUiError::BufferFull { .. } => "EVENT_BUFFER_FULL".to_owned(),
            AgUiError::Json(_) => "JSON_ERROR".to_owned(),
            AgUiError::InvalidState(_) => "INVALID_STATE".to_owned(),
            AgUiError::Agent { code, .. } => code.clone().unwrap_or_else(|| "AGENT_ERROR".to_owned()),
        }
    }
}
