//! Threads: durable conversations that outlive the process serving them.
//!
//! A thread is one conversation with one agent: its id (the client's, e.g. an AG-UI `threadId`),
//! the agent it belongs to, the provider that runs it and that provider's own session handle
//! (a Managed Agents session id, an AgentCore runtime session id, an ACP session id, the local
//! loop's id), and its exactly-once record in an [`EventStore`] under the thread's record key.
//! The engine keeps one checkpoint per thread (state key [`CHECKPOINT`]): the provider's
//! resumable state and the sequence number it covers.
//!
//! [`ThreadStore`] is the seam: an [`EventStore`] that also keeps the threads. The engine opens a
//! thread with [`crate::SessionBuilder::thread`]: it claims the thread for the agent, then either
//! opens a new provider session (recording its handle in the thread) or reloads the record and
//! checkpoint and asks the provider to [`resume`](crate::Provider::resume).
//!
//! A thread is one unit of exclusive execution: one request at a time drives it (the caller
//! serialises requests per thread; a second server on the same store is refused by the store).

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::event::Event;
use crate::store::EventStore;

/// The state key of a thread's checkpoint (a [`Checkpoint`] as JSON).
pub const CHECKPOINT: &str = "tether.checkpoint";

/// The longest thread id, in bytes.
pub const MAX_THREAD_ID: usize = 256;

/// A thread's id: 1 to [`MAX_THREAD_ID`] bytes, no control characters (it comes from a client,
/// and it ends up in URLs, logs and error messages).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ThreadId(String);

impl ThreadId {
    /// Checks and wraps a thread id; [`Error::InvalidThreadId`] says what is wrong.
    pub fn new(id: impl Into<String>) -> Result<Self> {
        let id = id.into();
        let why = if id.is_empty() {
            Some("it is empty")
        } else if id.len() > MAX_THREAD_ID {
            Some("it is longer than 256 bytes")
        } else if id.chars().any(char::is_control) {
            Some("it holds control characters")
        } else {
            None
        };
        match why {
            Some(reason) => Err(Error::InvalidThreadId {
                id: shown(&id),
                reason: reason.into(),
            }),
            None => Ok(ThreadId(id)),
        }
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for ThreadId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for ThreadId {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        ThreadId::new(s)
    }
}

impl From<ThreadId> for String {
    fn from(t: ThreadId) -> String {
        t.0
    }
}

impl AsRef<str> for ThreadId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// A client-supplied string for a message: at most 64 characters, control characters escaped.
fn shown(s: &str) -> String {
    let mut out: String = s.chars().take(64).collect::<String>().escape_debug().to_string();
    if s.chars().nth(64).is_some() {
        out.push('…');
    }
    out
}

/// A thread as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Thread {
    /// The thread's id.
    pub id: ThreadId,
    /// The agent the thread belongs to (a name the application chose).
    pub agent: String,
    /// The provider that runs it ([`crate::Provider::name`]: `local`, `managed`, `agentcore`,
    /// `acp`, ...); empty until a provider session was opened.
    pub provider: String,
    /// The key of the thread's record in the store (its events, memo and state).
    pub record: String,
    /// The provider's own session handle, once a provider session was opened.
    pub provider_session: Option<String>,
    /// A short title (the first user message, typically).
    pub title: String,
    /// Created, ms since the epoch.
    pub created_ms: i64,
    /// Last used, ms since the epoch.
    pub updated_ms: i64,
}

impl Thread {
    /// A thread of `agent` with record key `record`, created and last used at `created_ms`, with
    /// no provider session yet and no title (a store builds these).
    pub fn new(id: ThreadId, agent: impl Into<String>, record: impl Into<String>, created_ms: i64) -> Self {
        Thread {
            id,
            agent: agent.into(),
            provider: String::new(),
            record: record.into(),
            provider_session: None,
            title: String::new(),
            created_ms,
            updated_ms: created_ms,
        }
    }

    /// The same thread with its title.
    pub fn with_title(mut self, title: impl Into<String>) -> Self {
        self.title = title.into();
        self
    }

    /// The same thread run by `provider`, with the provider's own session handle if it has one.
    pub fn with_provider(mut self, provider: impl Into<String>, session: Option<String>) -> Self {
        self.provider = provider.into();
        self.provider_session = session;
        self
    }

    /// The same thread, last used at `updated_ms`.
    pub fn with_updated_ms(mut self, updated_ms: i64) -> Self {
        self.updated_ms = updated_ms;
        self
    }
}

/// What [`ThreadStore::claim_thread`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// The thread is the agent's: just created (`created`), or already its own (marked used now).
    Claimed {
        /// The stored thread.
        thread: Thread,
        /// Whether this call created it.
        created: bool,
    },
    /// The thread belongs to another agent; nothing was written.
    Taken(Thread),
}

/// A thread's checkpoint: the provider's resumable state ([`crate::Provider::checkpoint`]) and
/// the sequence number of the last event it covers. Events after `seq` are what a resume replays.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Checkpoint {
    /// The last sequence number the state covers (0: none).
    #[serde(default)]
    pub seq: u64,
    /// The provider's state (`null` when it keeps none).
    #[serde(default)]
    pub provider: Value,
}

impl Checkpoint {
    /// The provider's state `provider` as of sequence number `seq`.
    pub fn new(seq: u64, provider: Value) -> Self {
        Checkpoint { seq, provider }
    }
}

/// What a new thread starts with, written in one store step ([`ThreadStore::start_thread`],
/// [`ThreadStore::claim_thread_starting`]): the provider that runs it with that provider's
/// session handle, and the first events of its record (its first user messages, numbered from
/// 1).
///
/// Why one step: every store call before a new thread's first model request waits its turn at a
/// durable store's one writer; under many concurrent new runs those waits are most of the time
/// to the first token (see BENCHMARKS.md, `tether-serve`). Writing the session handle with the
/// first events also keeps a thread's record from ever holding events without the provider
/// session they belong to.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ThreadStart<'a> {
    /// The provider that runs the thread ([`crate::Provider::name`]).
    pub provider: &'a str,
    /// The provider's own session handle.
    pub session: &'a str,
    /// The first events of the thread's record, in sequence order, numbered (`seq` set).
    pub events: &'a [Event],
}

impl<'a> ThreadStart<'a> {
    /// A thread run by `provider` in its session `session`, whose record starts with `events`.
    pub fn new(provider: &'a str, session: &'a str, events: &'a [Event]) -> Self {
        ThreadStart {
            provider,
            session,
            events,
        }
    }
}

/// The store seam for threads: an [`EventStore`] (the records) that also keeps the threads.
///
/// Implemented by [`crate::MemoryStore`] and `tether-sqlite`'s `SqliteStore`.
#[async_trait]
pub trait ThreadStore: EventStore {
    /// Claims `thread` for `agent` in one step: a new thread is created with record key
    /// `new_record` and `title`; an existing one of the same agent is marked used now (and gets
    /// `title` if it had none); one of another agent is returned as [`Claim::Taken`], unchanged.
    async fn claim_thread(
        &self,
        thread: &ThreadId,
        agent: &str,
        new_record: &str,
        title: &str,
    ) -> Result<Claim>;

    /// Records the provider session a thread runs on (after the provider opened it).
    async fn set_provider_session(&self, thread: &ThreadId, provider: &str, session: &str) -> Result<()>;

    /// Records what a new thread starts with ([`ThreadStart`]: its provider session and the
    /// first events of its record, under `record`) as one step, so a durable store writes it in
    /// one transaction: either all of it is stored or none.
    ///
    /// Every event must be new to the record (a thread just claimed and created has an empty
    /// one): an event already stored fails with [`Error::Store`], since its sequence number may
    /// then be another's.
    ///
    /// The default calls [`Self::set_provider_session`], then [`EventStore::append`] for each
    /// event (several steps: a crash between them leaves the provider session without the
    /// events, which a later open handles as a thread not yet started). A store with
    /// transactions overrides it.
    async fn start_thread(&self, thread: &ThreadId, record: &str, start: &ThreadStart<'_>) -> Result<()> {
        self.set_provider_session(thread, start.provider, start.session)
            .await?;
        for e in start.events {
            if !self.append(record, e).await? {
                return Err(already_stored(thread, e));
            }
        }
        Ok(())
    }

    /// [`Self::claim_thread`], and when this claim creates the thread, [`Self::start_thread`]
    /// with `start` under the new record, as one step: a new thread is stored already started
    /// (the returned thread carries the provider and its session), or not at all. A claim that
    /// finds the thread writes nothing of `start`.
    ///
    /// The default calls the two methods in turn; a store with transactions overrides it.
    async fn claim_thread_starting(
        &self,
        thread: &ThreadId,
        agent: &str,
        new_record: &str,
        title: &str,
        start: &ThreadStart<'_>,
    ) -> Result<Claim> {
        match self.claim_thread(thread, agent, new_record, title).await? {
            Claim::Claimed {
                thread: t,
                created: true,
            } => {
                self.start_thread(thread, &t.record, start).await?;
                Ok(Claim::Claimed {
                    thread: t.with_provider(start.provider, Some(start.session.to_owned())),
                    created: true,
                })
            }
            other => Ok(other),
        }
    }

    /// The thread with this id, if any.
    async fn thread(&self, thread: &ThreadId) -> Result<Option<Thread>>;

    /// The threads of an agent (every agent's with `None`), most recently used first.
    async fn threads(&self, agent: Option<&str>) -> Result<Vec<Thread>>;
}

/// The error for a first event a thread's record already holds ([`ThreadStore::start_thread`]).
pub fn already_stored(thread: &ThreadId, event: &Event) -> Error {
    Error::store(format!(
        "thread {thread} cannot start: its record already holds event {}; is another process writing this thread?",
        shown(&event.id)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_ids_are_checked() {
        assert!(ThreadId::new("t-1").is_ok());
        assert!(ThreadId::new("x".repeat(256)).is_ok());
        for bad in [String::new(), "x".repeat(257), "a\nb".into(), "\u{1b}[2J".into()] {
            let e = ThreadId::new(bad.clone()).unwrap_err();
            assert_eq!(e.code(), "invalid_thread_id", "{bad:?}");
            assert!(!e.to_string().contains('\u{1b}'), "{e}");
        }
        let t: std::result::Result<ThreadId, _> = serde_json::from_value(serde_json::json!("a\u{0}b"));
        assert!(t.is_err());
    }

    proptest::proptest! {
        /// Any string is accepted exactly when it is a valid thread id, and never panics.
        #[test]
        fn any_string_is_checked(s in "\\PC{0,300}|[\\x00-\\x1f]{1,3}") {
            let ok = ThreadId::new(s.clone()).is_ok();
            let valid = !s.is_empty() && s.len() <= MAX_THREAD_ID && !s.chars().any(char::is_control);
            proptest::prop_assert_eq!(ok, valid);
        }
    }
}
