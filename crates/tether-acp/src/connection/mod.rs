//! JSON-RPC 2.0 over newline-delimited UTF-8: framing, correlation per direction, inbound
//! validation and dispatch, cancellation, back-pressure.
//!
//! Two tasks per connection: a dispatcher, which reads the agent's stdout (framing in place,
//! size-limited) and parses and handles each message strictly in arrival order before reading on
//! (`session/update` is awaited, so a slow handler back-pressures the agent through the pipe
//! instead of losing updates), and a writer behind a bounded queue. Agent requests run on their own
//! tasks after validation so a slow permission question does not stall the stream; each gets
//! exactly one answer.
//!
//! By responsibility: [`framing`] cuts the agent's stdout into frames and writes ours;
//! [`wire`] holds the JSON-RPC message shapes; [`dispatch`] routes each inbound frame (and
//! validates and serves the agent's requests); [`correlation`] pairs answers with requests in
//! both directions (our calls and their timeouts and cancellation; the agent's requests and their
//! one answer each); [`child`] owns the agent process's exit. This module holds the connection's
//! shared state and its lifecycle (start, close).

mod child;
mod correlation;
mod dispatch;
mod framing;
mod wire;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::process::Child;
use tokio::sync::{mpsc, watch};

use crate::error::AcpError;
use crate::handler::{ClientHandler, TerminateReason};
use crate::options::ClientOptions;
use crate::schema::{ClientCapabilities, InitializeResponse, RequestId, SessionId};

pub(crate) use correlation::Hook;
use correlation::{InboundEntry, PendingCall};
use framing::{FrameReader, writer_loop};
pub(crate) use wire::parse_update;

/// What the client knows about one session.
#[derive(Debug, Clone)]
pub(crate) struct SessionEntry {
    pub(crate) roots: Vec<PathBuf>,
    pub(crate) cwd: PathBuf,
    pub(crate) cancelling: bool,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) advertised: Option<ClientCapabilities>,
    pub(crate) agent: Option<InitializeResponse>,
    pub(crate) sessions: HashMap<SessionId, SessionEntry>,
}

pub(crate) struct Conn {
    pub(crate) opts: ClientOptions,
    pub(crate) handler: Arc<dyn ClientHandler>,
    out_tx: mpsc::Sender<String>,
    pending: Mutex<HashMap<i64, PendingCall>>,
    next_id: AtomicI64,
    inbound: Mutex<HashMap<RequestId, InboundEntry>>,
    next_generation: AtomicU64,
    pub(crate) state: Mutex<State>,
    closed: watch::Sender<Option<AcpError>>,
    child: Mutex<Option<Child>>,
    /// Bumped whenever a session is forgotten, so the dispatcher can trust its last "this session
    /// is known" check for a flood without taking the state lock per update.
    sessions_removed: AtomicU64,
}

/// Locks a std mutex, recovering from poisoning (a panicking handler must not wedge the client).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Conn {
    /// Starts the reader, dispatcher and writer tasks.
    pub(crate) fn start<R, W>(
        reader: R,
        writer: W,
        child: Option<Child>,
        handler: Arc<dyn ClientHandler>,
        opts: ClientOptions,
    ) -> Arc<Conn>
    where
        R: AsyncRead + Send + Unpin + 'static,
        W: AsyncWrite + Send + Unpin + 'static,
    {
        let (out_tx, out_rx) = mpsc::channel(opts.queue_capacity);
        let limit = opts.max_frame_bytes;
        let conn = Arc::new(Conn {
            opts,
            handler,
            out_tx,
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicI64::new(0),
            inbound: Mutex::new(HashMap::new()),
            next_generation: AtomicU64::new(0),
            state: Mutex::new(State::default()),
            closed: watch::channel(None).0,
            child: Mutex::new(child),
            sessions_removed: AtomicU64::new(0),
        });
        tokio::spawn(writer_loop(conn.clone(), out_rx, writer));
        tokio::spawn(conn.clone().dispatch_loop(FrameReader::new(reader, limit)));
        conn
    }

    /// The error the connection closed with, if it is closed.
    pub(crate) fn closed_error(&self) -> Option<AcpError> {
        self.closed.borrow().clone()
    }

    /// Resolves when the connection is closed, with the reason.
    pub(crate) async fn wait_closed(&self) -> AcpError {
        let mut rx = self.closed.subscribe();
        match rx.wait_for(Option::is_some).await {
            Ok(v) => v.clone().unwrap_or(AcpError::Closed {
                reason: "closed".into(),
            }),
            Err(_) => AcpError::Closed {
                reason: "closed".into(),
            },
        }
    }

    /// Marks the connection closed (first call wins), fails every pending call, aborts handler
    /// work, optionally kills the agent, and calls the handler's `terminate`.
    pub(crate) fn close(&self, err: AcpError, kill: bool) {
        let first = self.closed.send_if_modified(|c| {
            if c.is_none() {
                *c = Some(err.clone());
                true
            } else {
                false
            }
        });
        if !first {
            return;
        }
        let pending: Vec<PendingCall> = lock(&self.pending).drain().map(|(_, p)| p).collect();
        for p in pending {
            let _ = p.tx.send(Err(err.clone()));
        }
        for (_, e) in lock(&self.inbound).drain() {
            if let Some(a) = e.abort {
                a.abort();
            }
        }
        if kill && let Some(child) = lock(&self.child).as_mut() {
            let _ = child.start_kill();
        }
        let handler = self.handler.clone();
        let reason = match &err {
            AcpError::Closed { .. } => TerminateReason::Shutdown,
            other => TerminateReason::Error(other.clone()),
        };
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { handler.terminate(&reason).await });
        }
    }

    /// Forgets a session (its updates are dropped from now on).
    pub(crate) fn remove_session(&self, id: &SessionId) {
        let mut state = lock(&self.state);
        state.sessions.remove(id);
        self.sessions_removed.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::{AcpUpdate, SessionUpdateEvent};
    use crate::schema::SessionUpdate;
    use async_trait::async_trait;
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;

    #[derive(Default)]
    struct Texts(Mutex<Vec<String>>);

    #[async_trait]
    impl ClientHandler for Texts {
        async fn session_update(&self, event: &SessionUpdateEvent) {
            if let AcpUpdate::Known(u) = &event.update
                && let SessionUpdate::AgentMessageChunk(c) = u.as_ref()
                && let crate::schema::ContentBlock::Text(t) = &c.content
            {
                lock(&self.0).push(t.text.clone());
            }
        }
    }

    fn chunk(session: &str, text: &str) -> String {
        format!(
            r#"{{"jsonrpc":"2.0","method":"session/update","params":{{"sessionId":"{session}","update":{{"sessionUpdate":"agent_message_chunk","content":{{"type":"text","text":"{text}"}}}}}}}}"#
        ) + "\n"
    }

    fn know(conn: &Conn, id: &str) {
        let entry = SessionEntry {
            roots: Vec::new(),
            cwd: PathBuf::new(),
            cancelling: false,
        };
        lock(&conn.state).sessions.insert(SessionId::new(id), entry);
    }

    async fn wait_for(texts: &Texts, last: &str) -> Vec<String> {
        for _ in 0..500 {
            let seen = lock(&texts.0).clone();
            if seen.last().map(String::as_str) == Some(last) {
                return seen;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("`{last}` never arrived: {:?}", lock(&texts.0));
    }

    /// The dispatcher trusts its last "session known" check during a flood only until a session
    /// is removed: after that, updates for the removed session are dropped again.
    #[tokio::test]
    async fn updates_for_a_removed_session_are_dropped_after_a_flood() {
        let (mut agent_out, client_in) = tokio::io::duplex(64 * 1024);
        let (client_out, _agent_in) = tokio::io::duplex(64 * 1024);
        let texts = Arc::new(Texts::default());
        let conn = Conn::start(
            client_in,
            client_out,
            None,
            texts.clone(),
            ClientOptions::default(),
        );
        know(&conn, "s");
        for t in ["a", "b", "c"] {
            agent_out.write_all(chunk("s", t).as_bytes()).await.unwrap();
        }
        assert_eq!(wait_for(&texts, "c").await, ["a", "b", "c"]);
        conn.remove_session(&SessionId::new("s"));
        know(&conn, "u");
        for (s, t) in [("s", "d"), ("u", "e"), ("s", "f"), ("u", "g")] {
            agent_out.write_all(chunk(s, t).as_bytes()).await.unwrap();
        }
        assert_eq!(wait_for(&texts, "g").await, ["a", "b", "c", "e", "g"]);
    }
}
