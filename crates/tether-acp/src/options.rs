//! Connection limits and timeouts.

use std::time::Duration;

use crate::schema::ClientCapabilities;

/// Limits, timeouts and identity for an [`crate::AcpClient`]. Build with `Default` and the
/// `with_*` methods.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClientOptions {
    /// `clientInfo.name` sent in `initialize`.
    pub client_name: String,
    /// `clientInfo.version` sent in `initialize`.
    pub client_version: String,
    /// Explicit capabilities; replaces the set derived from the handler's
    /// [`ClientHandler::supports`](crate::ClientHandler::supports) entirely.
    pub capabilities: Option<ClientCapabilities>,
    /// Maximum size of one JSON-RPC frame in either direction, in bytes (without the newline).
    /// An oversized inbound frame closes the connection with [`crate::AcpError::FrameTooLarge`].
    pub max_frame_bytes: usize,
    /// Capacity of the outbound queue (frames waiting for the writer to the agent's stdin), in
    /// messages; when full, senders wait. Inbound messages are not queued at all: one task reads
    /// the agent's stdout and handles each message before it reads on, so at most one read buffer
    /// (256 KiB, or one frame of up to `max_frame_bytes`) is held ahead of the handler and a slow
    /// handler back-pressures the agent through the pipe; nothing is dropped.
    pub queue_capacity: usize,
    /// Maximum outbound requests awaiting an answer.
    pub max_pending_requests: usize,
    /// Default timeout for a request (everything but `session/prompt` and `initialize`).
    pub request_timeout: Duration,
    /// Timeout for `initialize`.
    pub initialize_timeout: Duration,
    /// Timeout for `session/prompt` and `session/load` (a turn may take many minutes);
    /// `None` waits as long as the agent lives.
    pub prompt_timeout: Option<Duration>,
    /// Timeout for one handler call answering an agent request (permission questions wait for a
    /// human); on expiry the agent gets `-32603`.
    pub handler_timeout: Duration,
    /// How long `shutdown` waits for the agent to exit after its stdin is closed before killing it.
    pub shutdown_grace: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            client_name: "tether".into(),
            client_version: env!("CARGO_PKG_VERSION").into(),
            capabilities: None,
            max_frame_bytes: 8 * 1024 * 1024,
            queue_capacity: 1024,
            max_pending_requests: 1024,
            request_timeout: Duration::from_secs(30),
            initialize_timeout: Duration::from_secs(30),
            prompt_timeout: Some(Duration::from_secs(60 * 60)),
            handler_timeout: Duration::from_secs(15 * 60),
            shutdown_grace: Duration::from_secs(2),
        }
    }
}

impl ClientOptions {
    /// Sets the maximum frame size.
    pub fn with_max_frame_bytes(mut self, n: usize) -> Self {
        self.max_frame_bytes = n.max(64);
        self
    }
    /// Sets the outbound queue capacity (see [`ClientOptions::queue_capacity`]).
    pub fn with_queue_capacity(mut self, n: usize) -> Self {
        self.queue_capacity = n.max(1);
        self
    }
    /// Sets the maximum number of pending outbound requests.
    pub fn with_max_pending_requests(mut self, n: usize) -> Self {
        self.max_pending_requests = n.max(1);
        self
    }
    /// Sets the default request timeout.
    pub fn with_request_timeout(mut self, d: Duration) -> Self {
        self.request_timeout = d;
        self
    }
    /// Sets the `initialize` timeout.
    pub fn with_initialize_timeout(mut self, d: Duration) -> Self {
        self.initialize_timeout = d;
        self
    }
    /// Sets the `session/prompt` timeout (`None`: no limit).
    pub fn with_prompt_timeout(mut self, d: Option<Duration>) -> Self {
        self.prompt_timeout = d;
        self
    }
    /// Sets the handler timeout.
    pub fn with_handler_timeout(mut self, d: Duration) -> Self {
        self.handler_timeout = d;
        self
    }
    /// Overrides the advertised client capabilities.
    pub fn with_capabilities(mut self, caps: ClientCapabilities) -> Self {
        self.capabilities = Some(caps);
        self
    }
    /// Sets `clientInfo`.
    pub fn with_client_info(mut self, name: impl Into<String>, version: impl Into<String>) -> Self {
        self.client_name = name.into();
        self.client_version = version.into();
        self
    }
}
