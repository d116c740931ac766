//! Typed errors: what the connection reports to callers ([`AcpError`]) and what a handler answers
//! an agent with ([`ClientError`]).

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

/// JSON-RPC and ACP error codes used on the wire.
pub mod codes {
    /// Invalid JSON was received.
    pub const PARSE_ERROR: i32 = -32700;
    /// The JSON sent is not a valid request object (also: request id already in use).
    pub const INVALID_REQUEST: i32 = -32600;
    /// The method does not exist or its capability was not advertised.
    pub const METHOD_NOT_FOUND: i32 = -32601;
    /// Invalid method parameters (also: unknown session, path outside the session roots).
    pub const INVALID_PARAMS: i32 = -32602;
    /// Internal error (also: the handler failed or timed out).
    pub const INTERNAL_ERROR: i32 = -32603;
    /// The request was cancelled (`$/cancel_request`, or the connection is shutting down).
    pub const REQUEST_CANCELLED: i32 = -32800;
    /// Authentication required.
    pub const AUTH_REQUIRED: i32 = -32000;
    /// A resource (file, terminal) was not found.
    pub const RESOURCE_NOT_FOUND: i32 = -32002;
}

/// Which way a frame was travelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Direction {
    /// From the agent to us.
    Inbound,
    /// From us to the agent.
    Outbound,
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Direction::Inbound => f.write_str("inbound (agent → client)"),
            Direction::Outbound => f.write_str("outbound (client → agent)"),
        }
    }
}

/// Everything that can go wrong talking to an ACP agent.
///
/// Cloneable so a connection failure can be reported to every pending caller.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum AcpError {
    /// The agent process could not be started.
    #[error("could not start the ACP agent `{program}`: {source} (is it installed and on PATH?)")]
    Spawn {
        /// The program that was launched.
        program: String,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// Reading from or writing to the agent failed.
    #[error("I/O error talking to the ACP agent ({context}): {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The agent closed its stdout or exited; pending calls cannot complete.
    #[error("the ACP agent closed the connection{}", exit_suffix(.exit))]
    AgentExited {
        /// The exit status if the process was reaped (`None` if still running or unknown).
        exit: Option<String>,
    },
    /// The connection was closed by us (`AcpClient::shutdown`) or already failed.
    #[error("the ACP connection is closed: {reason}")]
    Closed {
        /// Why the connection closed.
        reason: String,
    },
    /// A frame exceeded the configured maximum; an inbound oversized frame closes the connection.
    #[error(
        "{direction} ACP frame of at least {size} bytes exceeds the limit of {limit} bytes (raise ClientOptions::max_frame_bytes if this agent legitimately sends larger messages)"
    )]
    FrameTooLarge {
        /// Which way the frame was going.
        direction: Direction,
        /// Bytes seen (a lower bound for inbound frames).
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// A call did not get its answer in time; `$/cancel_request` was sent for it.
    #[error("`{method}` timed out after {after:?} (the per-call timeout is configurable in ClientOptions)")]
    Timeout {
        /// The method called.
        method: String,
        /// The timeout that elapsed.
        after: Duration,
    },
    /// The agent answered with a JSON-RPC error.
    #[error("the agent answered `{method}` with error {code}: {message}")]
    Rpc {
        /// The method called.
        method: String,
        /// The JSON-RPC error code (any integer; see [`codes`]).
        code: i64,
        /// The error message.
        message: String,
        /// Optional error data.
        data: Option<Box<Value>>,
    },
    /// The agent's answer could not be decoded.
    #[error("could not decode the agent's answer to `{method}`: {message}")]
    Decode {
        /// The method called.
        method: String,
        /// The decode error.
        message: String,
    },
    /// The agent speaks a protocol version this client does not.
    #[error("the agent speaks ACP protocol version {agent}, this client only speaks version {ours}")]
    UnsupportedVersion {
        /// The agent's version.
        agent: u16,
        /// Ours.
        ours: u16,
    },
    /// The agent did not advertise the capability a call needs; nothing was sent.
    #[error("the agent does not support `{method}` (capability `{capability}` not advertised)")]
    Unsupported {
        /// The method refused locally.
        method: String,
        /// The missing capability.
        capability: &'static str,
    },
    /// Too many outbound requests are waiting for answers.
    #[error("too many pending requests ({limit}); raise ClientOptions::max_pending_requests")]
    TooManyPending {
        /// The configured limit.
        limit: usize,
    },
    /// A call was made before `initialize` succeeded.
    #[error("`{method}` needs a successful `initialize` first")]
    NotInitialized {
        /// The method attempted.
        method: String,
    },
    /// A session directory is invalid (missing, not absolute, not a directory).
    #[error("invalid session directory {path}: {reason}")]
    InvalidDirectory {
        /// The directory.
        path: String,
        /// Why.
        reason: String,
    },
    /// Parameters could not be encoded.
    #[error("could not encode parameters for `{method}`: {message}")]
    Encode {
        /// The method.
        method: String,
        /// The encode error.
        message: String,
    },
}

fn exit_suffix(exit: &Option<String>) -> String {
    match exit {
        Some(s) => format!(" ({s})"),
        None => String::new(),
    }
}

impl AcpError {
    pub(crate) fn io(context: &'static str, e: std::io::Error) -> Self {
        AcpError::Io {
            context,
            source: Arc::new(e),
        }
    }

    /// The JSON-RPC error code if the agent answered with an error.
    pub fn rpc_code(&self) -> Option<i64> {
        match self {
            AcpError::Rpc { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// An error a client handler answers an agent request with (becomes a JSON-RPC error response).
///
/// Named apart from [`tether::HandlerError`] (what a tether `Handler` answers with, mapped onto
/// this by [`crate::bridge::handler_error`]) so that code using both crates never has two
/// `HandlerError`s in scope.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message} (code {code})")]
#[non_exhaustive]
pub struct ClientError {
    /// JSON-RPC error code; see [`codes`].
    pub code: i32,
    /// Human-readable message sent to the agent.
    pub message: String,
    /// Optional structured data.
    pub data: Option<Value>,
}

impl ClientError {
    /// An error with an explicit code.
    pub fn new(code: i32, message: impl Into<String>) -> Self {
        ClientError {
            code,
            message: message.into(),
            data: None,
        }
    }
    /// `-32601`: the method is not implemented by this handler.
    pub fn method_not_found(method: &str) -> Self {
        Self::new(codes::METHOD_NOT_FOUND, format!("method not supported: {method}"))
    }
    /// `-32602`: invalid parameters.
    pub fn invalid_params(message: impl Into<String>) -> Self {
        Self::new(codes::INVALID_PARAMS, message)
    }
    /// `-32603`: the operation failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(codes::INTERNAL_ERROR, message)
    }
    /// `-32002`: a file or terminal does not exist.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(codes::RESOURCE_NOT_FOUND, message)
    }
    /// The user or policy refused the operation (`-32603` with a clear message; ACP has no
    /// dedicated code).
    pub fn refused(message: impl Into<String>) -> Self {
        Self::new(codes::INTERNAL_ERROR, message)
    }
    /// `-32800`: the request was cancelled.
    pub fn cancelled() -> Self {
        Self::new(codes::REQUEST_CANCELLED, "request cancelled")
    }
    /// Attaches structured data.
    pub fn with_data(mut self, data: Value) -> Self {
        self.data = Some(data);
        self
    }
}
