//! The one error type every tether seam returns.

use std::time::Duration;

/// How a transport failed before a full response arrived.
///
/// Kept separate from HTTP status errors because the retry policy treats most of these as
/// transient, and because callers want to tell "nothing listens there" from "it hung up".
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TransportKind {
    /// The request or a read timed out.
    Timeout,
    /// The connection could not be established in time.
    ConnectTimeout,
    /// Nothing accepted the connection (e.g. no server on that port).
    Refused,
    /// The peer reset the connection.
    Reset,
    /// The connection closed before the response (or stream) was complete.
    Closed,
    /// A stream went silent for longer than its idle timeout.
    Idle,
    /// Any other transport failure (DNS, TLS, ...); not retried.
    Other,
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            TransportKind::Timeout => "timeout",
            TransportKind::ConnectTimeout => "connect timeout",
            TransportKind::Refused => "connection refused",
            TransportKind::Reset => "connection reset",
            TransportKind::Closed => "connection closed",
            TransportKind::Idle => "stream idle",
            TransportKind::Other => "other",
        };
        f.write_str(s)
    }
}

/// Which kind of problem an [`Error::Config`] is: what a caller may handle differently (a user
/// interface points at the setting for [`ConfigKind::Invalid`], a program retries a call after
/// finishing what [`ConfigKind::State`] names, reports the environment for [`ConfigKind::Setup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ConfigKind {
    /// A setting or argument has a value that cannot be used: a base URL that is not `http(s)`,
    /// a header value with characters a header cannot carry, a certificate bundle that holds no
    /// certificate, a transcript that is not a list of messages. Fix the value.
    Invalid,
    /// What was asked is not supported here: an input an ACP agent cannot take, a protocol
    /// that is not built in. Use another input, provider or build.
    Unsupported,
    /// The call is not allowed in the current state: tool uses are pending, the agent is not
    /// open yet. Do what the message says first, then call again.
    State,
    /// Setting up from the configuration failed in the environment: building the HTTP client,
    /// starting a thread, spawning an agent, fetching a model file. The source says why.
    Setup,
}

impl std::fmt::Display for ConfigKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConfigKind::Invalid => "invalid",
            ConfigKind::Unsupported => "unsupported",
            ConfigKind::State => "state",
            ConfigKind::Setup => "setup",
        })
    }
}

/// Everything that can go wrong in a tether session, as a type a caller can match on.
///
/// Every variant's message says what happened and, where it can, what to do about it.
/// [`Error::is_transient`] is the single classification the shared [`crate::RetryPolicy`] uses.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server answered with a non-success HTTP status.
    #[error("HTTP {status} from {endpoint}: {message}")]
    Http {
        /// The HTTP status code.
        status: u16,
        /// The server's message (from its JSON error body when it sent one).
        message: String,
        /// The server's error code or type (`insufficient_quota`, `overloaded_error`, ...).
        code: Option<String>,
        /// The delay the server asked for (`retry-after-ms` / `retry-after`).
        retry_after: Option<Duration>,
        /// The server's `x-should-retry` verdict, which wins over the status classification.
        should_retry: Option<bool>,
        /// What was called (a URL or an operation name), for the message.
        endpoint: String,
    },
    /// The connection failed before a complete response arrived.
    #[error("{kind} talking to {endpoint}: {message}")]
    Transport {
        /// How it failed.
        kind: TransportKind,
        /// Details from the transport.
        message: String,
        /// What was called.
        endpoint: String,
        /// The transport's own error behind it (a `reqwest::Error`, an `std::io::Error`, a
        /// provider's marker type), for [`std::error::Error::source`] and downcasting.
        #[source]
        source: Option<BoxError>,
    },
    /// The server reported an error inside a successful (200) stream.
    #[error("the stream reported an error{}: {message}", code.as_deref().map(|c| format!(" ({c})")).unwrap_or_default())]
    Stream {
        /// The error's message.
        message: String,
        /// The error's code or type, if any.
        code: Option<String>,
    },
    /// The response could not be understood.
    #[error("malformed response: {message}")]
    Malformed {
        /// What could not be understood, including the source's text when there is one.
        message: String,
        /// The parse error behind it (a `serde_json::Error`, say), for
        /// [`std::error::Error::source`] and downcasting.
        #[source]
        source: Option<BoxError>,
    },
    /// A model's response outgrew the cap on one response (its text, reasoning and tool-call
    /// arguments together, [`crate::chat::DEFAULT_MAX_RESPONSE_BYTES`] unless configured): the
    /// call was stopped there. Not transient: the same request would do it again.
    #[error(
        "the model's response exceeded {limit} bytes of text, reasoning and tool-call arguments, so the call was stopped; if a response that large is expected raise the model's max_response_bytes, otherwise lower its max_tokens"
    )]
    ResponseTooLarge {
        /// The cap, in bytes.
        limit: u64,
    },
    /// The run did not finish within its time limit.
    #[error("the run did not finish within {0:?}; in-flight work was torn down")]
    Timeout(Duration),
    /// The run was cancelled by the caller.
    #[error("the run was cancelled")]
    Cancelled,
    /// The configuration or a call is not usable as given: a bad value, something unsupported,
    /// a call out of order, or a setup step that failed. Not transient; [`ConfigKind`] says which
    /// (match on it rather than on the message).
    #[error("configuration: {message}")]
    Config {
        /// Which kind of problem it is.
        kind: ConfigKind,
        /// What is wrong and what to do about it.
        message: String,
        /// The error behind it (a URL or certificate parse error, an `std::io::Error` from a
        /// spawn, ...), for [`std::error::Error::source`] and downcasting.
        #[source]
        source: Option<BoxError>,
    },
    /// Authentication failed or credentials are missing.
    #[error("authentication: {0}")]
    Auth(String),
    /// The turn guard panicked (a guard that halts ends the session with a stop reason instead).
    #[error("the turn guard failed: {0}")]
    Guard(String),
    /// A provider-specific failure that fits no other variant.
    #[error("{provider}: {message}")]
    Provider {
        /// The provider's name.
        provider: String,
        /// What went wrong.
        message: String,
    },
    /// The event store failed.
    #[error("event store: {message}")]
    Store {
        /// What failed, including the source's text when there is one.
        message: String,
        /// The store's own error behind it (`tether_sqlite::StoreError`, which in turn keeps
        /// rusqlite's), for [`std::error::Error::source`] and downcasting.
        #[source]
        source: Option<BoxError>,
    },
    /// The provider cannot reopen an existing session (an ACP agent that does not advertise
    /// `loadSession`, say): nothing was sent to it, and nothing recorded was changed.
    #[error("{provider} cannot resume a session: {reason}")]
    CannotResume {
        /// The provider's name.
        provider: String,
        /// Why, and what to do instead.
        reason: String,
    },
    /// The session is closed and takes no more input.
    #[error("the session is closed")]
    Closed,
    /// An I/O error outside any protocol.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The thread belongs to another agent: a thread is one agent's conversation.
    #[error("thread {thread} belongs to agent `{agent}`; start a new thread for this agent")]
    ThreadTaken {
        /// The thread's id.
        thread: String,
        /// The agent it belongs to.
        agent: String,
    },
    /// A thread id a client sent is not usable.
    #[error("thread id `{id}` is not valid: {reason} (use 1 to 256 bytes without control characters)")]
    InvalidThreadId {
        /// The id, shortened and escaped.
        id: String,
        /// What is wrong.
        reason: String,
    },
}

/// A boxed error kept as the [`std::error::Error::source`] of an [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Shorthand for results whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A transport failure of `kind` talking to `endpoint`, described by `message`.
    pub fn transport(kind: TransportKind, message: impl Into<String>, endpoint: impl Into<String>) -> Self {
        Error::Transport {
            kind,
            message: message.into(),
            endpoint: endpoint.into(),
            source: None,
        }
    }

    /// A transport failure that keeps the error behind it as its [`std::error::Error::source`].
    pub fn transport_with(
        kind: TransportKind,
        message: impl Into<String>,
        endpoint: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Error::Transport {
            kind,
            message: message.into(),
            endpoint: endpoint.into(),
            source: Some(source.into()),
        }
    }

    /// Whether retrying the same request may succeed.
    ///
    /// Transient: HTTP 408, 409, 429 (but not quota exhaustion such as `insufficient_quota`),
    /// every 5xx including Anthropic's 529, and transport failures other than [`TransportKind::Other`].
    /// An `x-should-retry` header wins over the status. In-stream errors are transient when their
    /// code names an overload or server error.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Http {
                status,
                code,
                should_retry,
                ..
            } => {
                if let Some(v) = should_retry {
                    return *v;
                }
                match *status {
                    408 | 409 => true,
                    429 => !code.as_deref().is_some_and(is_quota_code),
                    s => s >= 500,
                }
            }
            Error::Transport { kind, .. } => !matches!(kind, TransportKind::Other),
            Error::Stream { code, .. } => code.as_deref().is_some_and(|c| {
                matches!(
                    c,
                    "overloaded_error"
                        | "server_error"
                        | "api_error"
                        | "rate_limit_error"
                        | "rate_limit_exceeded"
                        | "internal_error"
                )
            }),
            _ => false,
        }
    }

    /// The HTTP status, when the error came from one.
    pub fn status(&self) -> Option<u16> {
        match self {
            Error::Http { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The delay the server asked for before a retry, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::Http { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// A short machine-readable code for this error (used in AG-UI RUN_ERROR and CLI output).
    pub fn code(&self) -> &'static str {
        match self {
            Error::Http { status: 401, .. } | Error::Http { status: 403, .. } | Error::Auth(_) => "auth",
            Error::Http { status: 404, .. } => "not_found",
            Error::Http { status: 429, .. } => "rate_limited",
            Error::Http { .. } => "http",
            Error::Transport { .. } => "transport",
            Error::Stream { .. } => "stream_error",
            Error::Malformed { .. } => "malformed_response",
            Error::ResponseTooLarge { .. } => "response_too_large",
            Error::Timeout(_) => "timeout",
            Error::Cancelled => "cancelled",
            Error::Config { .. } => "config",
            Error::Guard(_) => "guard",
            Error::Provider { .. } => "provider",
            Error::Store { .. } => "store",
            Error::CannotResume { .. } => "cannot_resume",
            Error::Closed => "closed",
            Error::Io(_) => "io",
            Error::ThreadTaken { .. } => "thread_taken",
            Error::InvalidThreadId { .. } => "invalid_thread_id",
        }
    }

    /// Builds an [`Error::Malformed`] with no source error.
    pub fn malformed(message: impl Into<String>) -> Self {
        Error::Malformed {
            message: message.into(),
            source: None,
        }
    }

    /// Builds an [`Error::Malformed`] that keeps `source`; the message is `context: source`.
    pub fn malformed_with(context: impl std::fmt::Display, source: impl Into<BoxError>) -> Self {
        let source = source.into();
        Error::Malformed {
            message: with_context(context, &*source),
            source: Some(source),
        }
    }

    /// Builds an [`Error::Store`] with no source error.
    pub fn store(message: impl Into<String>) -> Self {
        Error::Store {
            message: message.into(),
            source: None,
        }
    }

    /// Builds an [`Error::Store`] that keeps `source`; the message is `context: source`, or
    /// the source's own text when `context` is empty.
    pub fn store_with(context: impl std::fmt::Display, source: impl Into<BoxError>) -> Self {
        let source = source.into();
        Error::Store {
            message: with_context(context, &*source),
            source: Some(source),
        }
    }

    /// Builds an [`Error::Config`] of `kind` with no source error.
    pub fn config(kind: ConfigKind, message: impl Into<String>) -> Self {
        Error::Config {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Builds an [`Error::Config`] of `kind` that keeps `source`; the message is
    /// `context: source`, or the source's own text when `context` is empty.
    pub fn config_with(
        kind: ConfigKind,
        context: impl std::fmt::Display,
        source: impl Into<BoxError>,
    ) -> Self {
        let source = source.into();
        Error::Config {
            kind,
            message: with_context(context, &*source),
            source: Some(source),
        }
    }

    /// The kind of an [`Error::Config`]; `None` for every other variant.
    pub fn config_kind(&self) -> Option<ConfigKind> {
        match self {
            Error::Config { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// Builds a [`Error::CannotResume`].
    pub fn cannot_resume(provider: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::CannotResume {
            provider: provider.into(),
            reason: reason.into(),
        }
    }

    /// Builds a [`Error::Provider`].
    pub fn provider(provider: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Provider {
            provider: provider.into(),
            message: message.into(),
        }
    }
}

/// `context: source`, or the source's text alone when the context is empty.
fn with_context(context: impl std::fmt::Display, source: &(dyn std::error::Error + Send + Sync)) -> String {
    let context = context.to_string();
    if context.is_empty() {
        source.to_string()
    } else {
        format!("{context}: {source}")
    }
}

/// Whether an error code or type names quota exhaustion, which no retry will fix.
fn is_quota_code(code: &str) -> bool {
    matches!(
        code,
        "insufficient_quota" | "quota_exceeded" | "billing_hard_limit_reached"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn http(status: u16, code: Option<&str>) -> Error {
        Error::Http {
            status,
            message: "m".into(),
            code: code.map(str::to_owned),
            retry_after: None,
            should_retry: None,
            endpoint: "x".into(),
        }
    }

    #[test]
    fn classification_follows_the_sdk_rules() {
        for s in [408, 409, 429, 500, 502, 503, 504, 529] {
            assert!(http(s, None).is_transient(), "{s} should be transient");
        }
        for s in [400, 401, 403, 404, 422] {
            assert!(!http(s, None).is_transient(), "{s} should not be transient");
        }
        assert!(!http(429, Some("insufficient_quota")).is_transient());
        let mut e = http(500, None);
        if let Error::Http { should_retry, .. } = &mut e {
            *should_retry = Some(false);
        }
        assert!(!e.is_transient());
        for k in [
            TransportKind::Timeout,
            TransportKind::ConnectTimeout,
            TransportKind::Refused,
            TransportKind::Reset,
            TransportKind::Closed,
        ] {
            let e = Error::transport(k, String::new(), String::new());
            assert!(e.is_transient());
        }
        assert!(!Error::Cancelled.is_transient());
        assert!(!Error::ResponseTooLarge { limit: 1 }.is_transient());
    }

    #[test]
    fn store_and_malformed_keep_their_source() {
        use std::error::Error as _;
        let json = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        let want = json.to_string();
        let e = Error::malformed_with("event #2", json);
        assert_eq!(e.to_string(), format!("malformed response: event #2: {want}"));
        let src = e.source().expect("a source");
        assert!(src.downcast_ref::<serde_json::Error>().is_some());

        let io = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "read-only");
        let e = Error::store_with("", io);
        assert_eq!(e.to_string(), "event store: read-only");
        let src = e.source().expect("a source");
        assert_eq!(
            src.downcast_ref::<std::io::Error>().map(|e| e.kind()),
            Some(std::io::ErrorKind::PermissionDenied)
        );
        assert!(Error::store("x").source().is_none());

        let bad = "x".parse::<u16>().unwrap_err();
        let e = Error::config_with(ConfigKind::Invalid, "the port `x`", bad);
        assert_eq!(
            e.to_string(),
            "configuration: the port `x`: invalid digit found in string"
        );
        assert_eq!(e.config_kind(), Some(ConfigKind::Invalid));
        assert!(matches!(
            e,
            Error::Config {
                kind: ConfigKind::Invalid,
                ..
            }
        ));
        assert!(
            e.source()
                .and_then(|s| s.downcast_ref::<std::num::ParseIntError>())
                .is_some()
        );
        let e = Error::config(ConfigKind::State, "tool uses are pending");
        assert_eq!(e.to_string(), "configuration: tool uses are pending");
        assert!(e.source().is_none() && !e.is_transient());
        assert_eq!((e.code(), e.config_kind()), ("config", Some(ConfigKind::State)));
        assert_eq!(Error::Closed.config_kind(), None);

        let e: Error = std::io::Error::other("disk full").into();
        assert!(matches!(&e, Error::Io(io) if io.kind() == std::io::ErrorKind::Other));
        assert_eq!(e.to_string(), "I/O: disk full");
        assert!(e.source().is_some());
    }
}
