//! JSON-RPC 2.0 over newline-delimited UTF-8: framing, correlation per direction, inbound
//! validation and dispatch, cancellation, back-pressure.
//!
//! Two tasks per connection: a dispatcher, which reads the agent's stdout (framing in place,
//! size-limited) and parses and handles each message strictly in arrival order before reading on
//! (`session/update` is awaited, so a slow handler back-pressures the agent through the pipe
//! instead of losing updates), and a writer behind a bounded queue. Agent requests run on their own
//! tasks after validation so a slow permission question does not stall the stream; each gets
//! exactly one answer.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::process::Child;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;

use crate::error::{AcpError, ClientError, Direction, codes};
use crate::fast::{FastCache, decode_text_chunk};
use crate::handler::{
    AcpTerminalRequest, AcpUpdate, ClientHandler, RawMessage, SessionUpdateEvent, TerminateReason,
};
use crate::options::ClientOptions;
use crate::roots::confine;
use crate::schema::{
    CancelRequestNotification, ClientCapabilities, CompleteElicitationNotification, CreateElicitationRequest,
    CreateElicitationResponse, CreateTerminalRequest, ElicitationAction, ElicitationMode, ElicitationScope,
    InitializeResponse, KillTerminalRequest, Meta, ReadTextFileRequest, ReleaseTerminalRequest, RequestId,
    RequestPermissionOutcome, RequestPermissionRequest, RequestPermissionResponse, SessionId, SessionUpdate,
    TerminalOutputRequest, WaitForTerminalExitRequest, WriteTextFileRequest,
};

/// Runs in the dispatcher when a response arrives, before the caller is woken (so state such as a
/// new session's roots is in place before the agent's next message is dispatched).
pub(crate) type Hook = Box<dyn FnOnce(&Conn, &Value) + Send>;

struct PendingCall {
    tx: oneshot::Sender<Result<Value, AcpError>>,
    hook: Option<Hook>,
    method: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InboundKind {
    Permission,
    Elicitation,
    Other,
}

struct InboundEntry {
    generation: u64,
    session: Option<SessionId>,
    kind: InboundKind,
    abort: Option<AbortHandle>,
}

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

enum ReadEnd {
    Eof,
    TooLarge(usize),
    Io(std::io::Error),
}

/// Position of the first `\n`, eight bytes at a time (std has no public `memchr`, and a plain
/// byte loop was the reader's main cost in a flood).
fn find_newline(s: &[u8]) -> Option<usize> {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    const NL: u64 = LO * b'\n' as u64;
    let mut words = s.chunks_exact(8);
    let mut offset = 0;
    for w in words.by_ref() {
        let Ok(bytes) = <[u8; 8]>::try_from(w) else { break };
        let x = u64::from_le_bytes(bytes) ^ NL;
        if x.wrapping_sub(LO) & !x & HI != 0 {
            break;
        }
        offset += 8;
    }
    s.get(offset..)?
        .iter()
        .position(|&b| b == b'\n')
        .map(|i| offset + i)
}

/// The read buffer's size (it grows only for a frame longer than this, up to the frame limit).
/// Larger than a pipe's default 64 KiB so that one read can take all the pipe holds.
const READ_BUF: usize = 256 * 1024;

/// The agent's stdout, framed in place: frames are handed out as slices of one reused buffer
/// (no copy, no allocation per frame or per read). Whatever follows the last complete frame (the
/// start of the next one) is moved to the front before the next read.
struct FrameReader<R> {
    reader: R,
    buf: Vec<u8>,
    /// `buf[start..end]` is read and not yet handed out.
    start: usize,
    end: usize,
    /// `buf[start..scanned]` is known to hold no newline.
    scanned: usize,
    limit: usize,
}

enum Frame {
    /// `buf[range]`: without the newline and a trailing `\r`; blank lines are skipped. Not yet
    /// checked to be UTF-8.
    Line(std::ops::Range<usize>),
    End(ReadEnd),
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    fn new(reader: R, limit: usize) -> Self {
        FrameReader {
            reader,
            buf: vec![0; READ_BUF],
            start: 0,
            end: 0,
            scanned: 0,
            limit,
        }
    }

    /// The next frame (reading when the buffer holds no complete one), or why reading stopped.
    /// A frame longer than `limit` bytes ends reading with [`ReadEnd::TooLarge`] (so a partial
    /// frame never holds more than `limit` bytes).
    async fn next(&mut self) -> Frame {
        loop {
            let pending = self.buf.get(self.scanned..self.end).unwrap_or_default();
            if let Some(i) = find_newline(pending) {
                let (start, nl) = (self.start, self.scanned + i);
                self.start = nl + 1;
                self.scanned = self.start;
                if nl - start > self.limit {
                    return Frame::End(ReadEnd::TooLarge(nl - start));
                }
                if let Some(r) = self.frame(start, nl) {
                    return Frame::Line(r);
                }
                continue;
            }
            self.scanned = self.end;
            let held = self.end - self.start;
            if held > self.limit {
                return Frame::End(ReadEnd::TooLarge(held));
            }
            // Make room: move the partial frame to the front, or grow for a long frame.
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.start = 0;
                self.end = held;
                self.scanned = held;
            }
            if self.end == self.buf.len() {
                let grown = (self.buf.len() * 2).min(self.limit.saturating_add(1).max(self.buf.len() + 1));
                self.buf.resize(grown, 0);
            }
            let room = self.buf.get_mut(self.end..).unwrap_or_default();
            match self.reader.read(room).await {
                Ok(0) => {
                    let (start, end) = (self.start, self.end);
                    self.start = end;
                    self.scanned = end;
                    if let Some(r) = self.frame(start, end) {
                        return Frame::Line(r);
                    }
                    return Frame::End(ReadEnd::Eof);
                }
                Ok(n) => self.end += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Frame::End(ReadEnd::Io(e)),
            }
        }
    }

    /// `buf[start..end]` as a frame, without a trailing `\r`; `None` for a blank line.
    fn frame(&self, start: usize, mut end: usize) -> Option<std::ops::Range<usize>> {
        if end > start && self.buf.get(end - 1) == Some(&b'\r') {
            end -= 1;
        }
        self.buf
            .get(start..end)
            .is_some_and(|f| !f.iter().all(u8::is_ascii_whitespace))
            .then_some(start..end)
    }

    fn get(&self, r: std::ops::Range<usize>) -> Option<&[u8]> {
        self.buf.get(r)
    }
}

async fn writer_loop<W: AsyncWrite + Unpin>(conn: Arc<Conn>, mut rx: mpsc::Receiver<String>, writer: W) {
    let mut w = tokio::io::BufWriter::with_capacity(64 * 1024, writer);
    let mut closed = conn.closed.subscribe();
    loop {
        tokio::select! {
            biased;
            frame = rx.recv() => {
                let Some(frame) = frame else { return };
                let mut result = write_line(&mut w, &frame).await;
                while result.is_ok() {
                    match rx.try_recv() {
                        Ok(next) => result = write_line(&mut w, &next).await,
                        Err(_) => break,
                    }
                }
                if result.is_ok() {
                    result = w.flush().await;
                }
                if let Err(e) = result {
                    conn.close(AcpError::io("writing to the agent's stdin", e), true);
                    return;
                }
            }
            _ = async { let _ = closed.wait_for(Option::is_some).await; } => {
                let _ = w.flush().await;
                let _ = w.shutdown().await;
                return;
            }
        }
    }
}

async fn write_line<W: AsyncWrite + Unpin>(w: &mut W, frame: &str) -> std::io::Result<()> {
    w.write_all(frame.as_bytes()).await?;
    w.write_all(b"\n").await
}

/// Presence-aware JSON field: `null` is `Present`, a missing key is `Absent`.
#[derive(Default, Clone, Copy)]
enum Field<'a> {
    #[default]
    Absent,
    Present(&'a RawValue),
}

impl<'de: 'a, 'a> Deserialize<'de> for Field<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <&'a RawValue>::deserialize(d).map(Field::Present)
    }
}

impl<'a> Field<'a> {
    fn raw(self) -> Option<&'a RawValue> {
        match self {
            Field::Absent => None,
            Field::Present(r) => Some(r),
        }
    }
}

#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(default, borrow)]
    id: Field<'a>,
    #[serde(default, borrow)]
    method: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    params: Field<'a>,
    #[serde(default, borrow)]
    result: Field<'a>,
    #[serde(default, borrow)]
    error: Field<'a>,
}

#[derive(Deserialize)]
struct WireError {
    #[serde(default)]
    code: i64,
    #[serde(default)]
    message: String,
    #[serde(default)]
    data: Option<Value>,
}

#[derive(Deserialize, Default)]
struct SessionHint {
    #[serde(default)]
    params: Option<SessionHintParams>,
}

#[derive(Deserialize, Default)]
struct SessionHintParams {
    #[serde(default, rename = "sessionId")]
    session_id: Option<SessionId>,
}

#[derive(Deserialize)]
struct UpdateParams<'a> {
    #[serde(rename = "sessionId")]
    session_id: SessionId,
    #[serde(borrow)]
    update: &'a RawValue,
    #[serde(default, rename = "_meta")]
    meta: Option<Meta>,
}

#[derive(Serialize)]
struct OutRequest<'a, P: Serialize> {
    jsonrpc: &'static str,
    id: i64,
    method: &'a str,
    params: &'a P,
}

#[derive(Serialize)]
struct OutNotification<'a, P: Serialize> {
    jsonrpc: &'static str,
    method: &'a str,
    params: &'a P,
}

#[derive(Serialize)]
struct OutResult<'a> {
    jsonrpc: &'static str,
    id: &'a RequestId,
    result: &'a Value,
}

#[derive(Serialize)]
struct OutErrorBody<'a> {
    code: i32,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: &'a Option<Value>,
}

#[derive(Serialize)]
struct OutError<'a> {
    jsonrpc: &'static str,
    id: &'a RequestId,
    error: OutErrorBody<'a>,
}

/// Decodes a `session/update`'s params leniently: unknown kinds (and known kinds that fail to
/// decode) become [`AcpUpdate::Unknown`] with the raw JSON.
pub(crate) fn parse_update(params: &str) -> Result<SessionUpdateEvent, String> {
    let p: UpdateParams<'_> =
        serde_json::from_str(params).map_err(|e| format!("invalid session/update params: {e}"))?;
    let update = match serde_json::from_str::<SessionUpdate>(p.update.get()) {
        Ok(u) => AcpUpdate::Known(Box::new(u)),
        Err(e) => {
            let raw: Value = serde_json::from_str(p.update.get()).unwrap_or(Value::Null);
            let kind = raw
                .get("sessionUpdate")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            AcpUpdate::Unknown {
                kind,
                raw,
                error: Some(e.to_string()),
            }
        }
    };
    Ok(SessionUpdateEvent {
        session_id: p.session_id,
        update,
        meta: p.meta,
    })
}

struct CallGuard<'a> {
    conn: &'a Conn,
    id: i64,
    armed: bool,
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

fn to_value<T: Serialize>(v: &T) -> Result<Value, ClientError> {
    serde_json::to_value(v).map_err(|e| ClientError::internal(format!("could not encode the answer: {e}")))
}

fn parse_params<T: serde::de::DeserializeOwned>(params: &str) -> Result<T, ClientError> {
    serde_json::from_str(params).map_err(|e| ClientError::invalid_params(format!("invalid params: {e}")))
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

    /// Closes stdin, waits up to the grace period for the agent to exit, then kills it.
    pub(crate) async fn shutdown(&self) {
        self.close(
            AcpError::Closed {
                reason: "the client shut the connection down".into(),
            },
            false,
        );
        let child = lock(&self.child).take();
        if let Some(mut child) = child
            && tokio::time::timeout(self.opts.shutdown_grace, child.wait())
                .await
                .is_err()
        {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Kills the agent without waiting (used on drop).
    pub(crate) fn kill_now(&self) {
        self.close(
            AcpError::Closed {
                reason: "the client was dropped".into(),
            },
            true,
        );
    }

    /// Reaps the agent after its stdout closed and describes how it exited.
    async fn reap(&self) -> Option<String> {
        let child = lock(&self.child).take();
        let mut child = child?;
        let status = match tokio::time::timeout(Duration::from_secs(2), child.wait()).await {
            Ok(Ok(s)) => s,
            _ => {
                let _ = child.start_kill();
                return Some("still running after closing stdout; killed".into());
            }
        };
        Some(describe_exit(status))
    }

    /// Reads and dispatches in one task, strictly in arrival order: nothing more is read while a
    /// message is handled, so a slow handler back-pressures the agent through the pipe (at most
    /// one read buffer is held ahead), and no frame waits in a queue or crosses threads.
    async fn dispatch_loop<R: AsyncRead + Unpin>(self: Arc<Self>, mut frames: FrameReader<R>) {
        let mut sessions = FastCache::default();
        loop {
            match frames.next().await {
                Frame::Line(r) => match frames.get(r).map(std::str::from_utf8) {
                    Some(Ok(line)) => self.dispatch_line(line, &mut sessions).await,
                    Some(Err(_)) | None => {
                        tracing::warn!("agent sent a frame that is not UTF-8");
                        self.send_error(&RequestId::Null, codes::PARSE_ERROR, "frame is not valid UTF-8")
                            .await;
                    }
                },
                Frame::End(end) => {
                    self.end_of_input(end).await;
                    return;
                }
            }
        }
    }

    /// The agent's stdout ended (or failed, or sent an oversized frame): close the connection.
    async fn end_of_input(&self, end: ReadEnd) {
        let (err, kill) = match end {
            ReadEnd::Eof => (
                AcpError::AgentExited {
                    exit: self.reap().await,
                },
                true,
            ),
            ReadEnd::TooLarge(size) => (
                AcpError::FrameTooLarge {
                    direction: Direction::Inbound,
                    size,
                    limit: self.opts.max_frame_bytes,
                },
                true,
            ),
            ReadEnd::Io(e) => (AcpError::io("reading the agent's stdout", e), true),
        };
        if self.closed_error().is_none() {
            tracing::warn!(error = %err, "ACP connection ended");
        }
        self.close(err, kill);
    }

    async fn dispatch_line(self: &Arc<Self>, line: &str, sessions: &mut FastCache) {
        // The flood case (text chunks) in one pass; everything else below. See `fast`.
        if let Some(event) = decode_text_chunk(line, sessions) {
            // Loaded before the check: a removal after it changes the count, so the next update
            // checks again.
            let removed = self.sessions_removed.load(Ordering::Acquire);
            if sessions.is_verified(&event.session_id, removed) {
                self.handler
                    .session_update_with_message(&event, &RawMessage::new(line))
                    .await;
            } else if self.deliver_update(&event, line).await {
                sessions.set_verified(&event.session_id, removed);
            }
            sessions.recycle(event);
            return;
        }
        let env: Envelope<'_> = match serde_json::from_str(line) {
            Ok(env) => env,
            Err(e) => {
                let code = if e.is_syntax() || e.is_eof() {
                    codes::PARSE_ERROR
                } else {
                    codes::INVALID_REQUEST
                };
                tracing::warn!(error = %e, "malformed frame from the agent");
                self.send_error(&RequestId::Null, code, &format!("malformed message: {e}"))
                    .await;
                return;
            }
        };
        match (env.method.is_some(), env.id) {
            (true, Field::Present(id_raw)) => {
                let method = env.method.map(|m| m.into_owned()).unwrap_or_default();
                match serde_json::from_str::<RequestId>(id_raw.get()) {
                    Ok(id) => self.on_request(id, method, line.to_owned()).await,
                    Err(_) => {
                        self.send_error(&RequestId::Null, codes::INVALID_REQUEST, "invalid request id")
                            .await
                    }
                }
            }
            (true, Field::Absent) => {
                let method = env.method.clone().unwrap_or_default();
                let params = env.params.raw();
                self.on_notification(&method, params, line).await;
            }
            (false, Field::Present(id_raw)) => {
                let outcome = match (env.result, env.error) {
                    (_, Field::Present(err)) => {
                        let e: WireError = serde_json::from_str(err.get()).unwrap_or(WireError {
                            code: codes::INTERNAL_ERROR as i64,
                            message: err.get().to_owned(),
                            data: None,
                        });
                        Err(e)
                    }
                    (Field::Present(result), Field::Absent) => {
                        Ok(serde_json::from_str::<Value>(result.get()).unwrap_or(Value::Null))
                    }
                    (Field::Absent, Field::Absent) => {
                        tracing::warn!(line = %line, "agent sent a message with an id but no method, result or error");
                        return;
                    }
                };
                self.on_response(id_raw.get(), outcome);
            }
            (false, Field::Absent) => {
                tracing::warn!(line = %line, "agent sent a message that is neither request, notification nor response");
                self.send_error(&RequestId::Null, codes::INVALID_REQUEST, "not a JSON-RPC message")
                    .await;
            }
        }
    }

    /// Hands a decoded `session/update` to the handler (awaited: a slow handler back-pressures the
    /// reader), unless its session is unknown; whether it was delivered.
    async fn deliver_update(&self, event: &SessionUpdateEvent, line: &str) -> bool {
        if !lock(&self.state).sessions.contains_key(&event.session_id) {
            tracing::warn!(session = %event.session_id, "dropping a session/update for an unknown session");
            return false;
        }
        self.handler
            .session_update_with_message(event, &RawMessage::new(line))
            .await;
        true
    }

    /// Forgets a session (its updates are dropped from now on).
    pub(crate) fn remove_session(&self, id: &SessionId) {
        let mut state = lock(&self.state);
        state.sessions.remove(id);
        self.sessions_removed.fetch_add(1, Ordering::Release);
    }

    fn on_response(&self, id_raw: &str, outcome: Result<Value, WireError>) {
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

    async fn on_notification(self: &Arc<Self>, method: &str, params: Option<&RawValue>, line: &str) {
        let params_str = params.map(RawValue::get).unwrap_or("null");
        match method {
            "session/update" => match parse_update(params_str) {
                Ok(event) => {
                    self.deliver_update(&event, line).await;
                }
                Err(e) => tracing::warn!(error = %e, "dropping a malformed session/update"),
            },
            "elicitation/complete" => {
                match serde_json::from_str::<CompleteElicitationNotification>(params_str) {
                    Ok(n) => self.handler.elicitation_complete(n).await,
                    Err(e) => tracing::warn!(error = %e, "malformed elicitation/complete"),
                }
            }
            "$/cancel_request" => match serde_json::from_str::<CancelRequestNotification>(params_str) {
                Ok(n) => self.cancel_inbound(&n.request_id).await,
                Err(e) => tracing::warn!(error = %e, "malformed $/cancel_request"),
            },
            m if m.starts_with('_') => {
                let raw = params.unwrap_or(null_raw());
                self.handler.ext_notification(m, raw).await;
            }
            other => tracing::debug!(method = other, "ignoring unknown notification"),
        }
    }

    async fn on_request(self: &Arc<Self>, id: RequestId, method: String, line: String) {
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

    async fn finish_inbound(&self, id: &RequestId, generation: u64, result: Result<Value, ClientError>) {
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
    async fn cancel_inbound(&self, id: &RequestId) {
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

    fn session(&self, id: &SessionId) -> Result<SessionEntry, ClientError> {
        lock(&self.state)
            .sessions
            .get(id)
            .cloned()
            .ok_or_else(|| ClientError::invalid_params(format!("unknown session {id}")))
    }

    async fn process_request(&self, id: &RequestId, method: &str, line: &str) -> Result<Value, ClientError> {
        let env: Envelope<'_> = serde_json::from_str(line)
            .map_err(|e| ClientError::new(codes::INVALID_REQUEST, e.to_string()))?;
        let params = env.params.raw().map(RawValue::get).unwrap_or("null");
        let message = RawMessage::new(line);
        let caps = lock(&self.state).advertised.clone().unwrap_or_default();
        let not_advertised = || ClientError::method_not_found(method);
        match method {
            "session/request_permission" => {
                let req: RequestPermissionRequest = parse_params(params)?;
                let session = self.session(&req.session_id)?;
                if session.cancelling {
                    return to_value(&RequestPermissionResponse::new(
                        RequestPermissionOutcome::Cancelled,
                    ));
                }
                let outcome = self.handler.request_permission_with_message(&req, &message).await;
                if let RequestPermissionOutcome::Selected(s) = &outcome
                    && !req.options.iter().any(|o| o.option_id == s.option_id)
                {
                    return Err(ClientError::internal(format!(
                        "the client handler chose option `{}`, which the agent did not offer",
                        s.option_id
                    )));
                }
                to_value(&RequestPermissionResponse::new(outcome))
            }
            "fs/read_text_file" => {
                if !caps.fs.read_text_file {
                    return Err(not_advertised());
                }
                let mut req: ReadTextFileRequest = parse_params(params)?;
                let session = self.session(&req.session_id)?;
                req.path = confine(&req.path, &session.roots)
                    .map_err(|e| ClientError::invalid_params(e.to_string()))?;
                to_value(&self.handler.read_text_file(req).await?)
            }
            "fs/write_text_file" => {
                if !caps.fs.write_text_file {
                    return Err(not_advertised());
                }
                let mut req: WriteTextFileRequest = parse_params(params)?;
                let session = self.session(&req.session_id)?;
                req.path = confine(&req.path, &session.roots)
                    .map_err(|e| ClientError::invalid_params(e.to_string()))?;
                to_value(&self.handler.write_text_file(req).await?)
            }
            "terminal/create"
            | "terminal/output"
            | "terminal/wait_for_exit"
            | "terminal/kill"
            | "terminal/release" => {
                if !caps.terminal {
                    return Err(not_advertised());
                }
                let request = match method {
                    "terminal/create" => {
                        let mut req: CreateTerminalRequest = parse_params(params)?;
                        let session = self.session(&req.session_id)?;
                        let cwd = req.cwd.clone().unwrap_or(session.cwd.clone());
                        req.cwd = Some(
                            confine(&cwd, &session.roots)
                                .map_err(|e| ClientError::invalid_params(e.to_string()))?,
                        );
                        AcpTerminalRequest::Create(req)
                    }
                    "terminal/output" => {
                        AcpTerminalRequest::Output(parse_params::<TerminalOutputRequest>(params)?)
                    }
                    "terminal/wait_for_exit" => {
                        AcpTerminalRequest::WaitForExit(parse_params::<WaitForTerminalExitRequest>(params)?)
                    }
                    "terminal/kill" => AcpTerminalRequest::Kill(parse_params::<KillTerminalRequest>(params)?),
                    _ => AcpTerminalRequest::Release(parse_params::<ReleaseTerminalRequest>(params)?),
                };
                self.session(request.session_id())?;
                let response = self.handler.terminal(request, id).await?;
                if response.method() != method {
                    return Err(ClientError::internal(format!(
                        "the client handler answered `{method}` with a `{}` result",
                        response.method()
                    )));
                }
                response
                    .to_value()
                    .map_err(|e| ClientError::internal(format!("could not encode the answer: {e}")))
            }
            "elicitation/create" => {
                let Some(ecaps) = caps
                    .elicitation
                    .clone()
                    .filter(|e| e.supports_form() || e.supports_url())
                else {
                    return Err(not_advertised());
                };
                let req: CreateElicitationRequest = parse_params(params)?;
                let form = match &req.mode {
                    ElicitationMode::Form(_) if ecaps.supports_form() => true,
                    ElicitationMode::Url(_) if ecaps.supports_url() => false,
                    ElicitationMode::Form(_) => {
                        return Err(ClientError::invalid_params("form elicitation was not advertised"));
                    }
                    ElicitationMode::Url(_) => {
                        return Err(ClientError::invalid_params("url elicitation was not advertised"));
                    }
                    _ => return Err(ClientError::invalid_params("unknown elicitation mode")),
                };
                match req.scope() {
                    ElicitationScope::Session(s) => {
                        if self.session(&s.session_id)?.cancelling {
                            return to_value(&CreateElicitationResponse::new(ElicitationAction::Cancel));
                        }
                    }
                    ElicitationScope::Request(r) => {
                        let known = match &r.request_id {
                            RequestId::Number(n) => lock(&self.pending).contains_key(n),
                            _ => false,
                        };
                        if !known {
                            return Err(ClientError::invalid_params(format!(
                                "elicitation names request {}, which is not pending",
                                r.request_id
                            )));
                        }
                    }
                    _ => return Err(ClientError::invalid_params("unknown elicitation scope")),
                }
                let response = if form {
                    self.handler.form_elicitation(req).await?
                } else {
                    self.handler.url_elicitation(req).await?
                };
                to_value(&response)
            }
            m if m.starts_with('_') => {
                let raw = env.params.raw().unwrap_or(null_raw());
                self.handler.ext_method(m, raw).await
            }
            _ => Err(ClientError::method_not_found(method)),
        }
    }

    async fn send_response(&self, id: &RequestId, result: Result<Value, ClientError>) {
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

    async fn send_error(&self, id: &RequestId, code: i32, message: &str) {
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
    fn notify_nowait(&self, method: &str, params: Value) {
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

fn null_raw() -> &'static RawValue {
    // `RawValue::NULL` is a valid `&'static RawValue` for JSON `null`.
    RawValue::NULL
}

fn describe_exit(status: std::process::ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exited with code {code}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("killed by signal {sig}");
        }
    }
    status.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;

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

    async fn frames(input: &'static [u8], pipe: usize, limit: usize) -> (Vec<String>, String) {
        let (mut w, r) = tokio::io::duplex(pipe);
        tokio::spawn(async move {
            let _ = w.write_all(input).await;
        });
        let mut reader = FrameReader::new(r, limit);
        let mut out = Vec::new();
        loop {
            match reader.next().await {
                Frame::Line(r) => out.push(String::from_utf8_lossy(reader.get(r).unwrap_or_default()).into()),
                Frame::End(ReadEnd::Eof) => return (out, "eof".into()),
                Frame::End(ReadEnd::TooLarge(n)) => return (out, format!("too large {n}")),
                Frame::End(ReadEnd::Io(e)) => return (out, e.to_string()),
            }
        }
    }

    /// Frames split over many short reads, blank lines, `\r\n`, a last line without a newline,
    /// and the size limit (a frame of exactly `limit` bytes passes, one more byte does not, with
    /// or without its newline read yet).
    #[tokio::test]
    async fn frames_are_cut_in_place_across_reads() {
        for pipe in [1, 3, 7, 64 * 1024] {
            let (f, end) = frames(b"ab\n\n  \r\ncd\r\n\xff\nlast", pipe, 100).await;
            assert_eq!(
                (f, end.as_str()),
                (
                    vec!["ab".into(), "cd".into(), "\u{fffd}".into(), "last".into()],
                    "eof"
                )
            );
            let (f, end) = frames(b"12345\n123456\nnever", pipe, 5).await;
            assert_eq!((f, end.as_str()), (vec!["12345".to_string()], "too large 6"));
            let (f, end) = frames(b"1\n1234567890", pipe, 5).await;
            assert_eq!(f, ["1"]);
            assert!(end.starts_with("too large "), "{end}");
        }
        // A frame longer than the read buffer grows it (up to the limit).
        let long: &'static [u8] = Box::leak([vec![b'x'; READ_BUF + 10], b"\nok\n".to_vec()].concat().into());
        let (f, end) = frames(long, 64 * 1024, READ_BUF + 10).await;
        assert_eq!(
            (f.len(), f[0].len(), f[1].as_str(), end.as_str()),
            (2, READ_BUF + 10, "ok", "eof")
        );
    }
}
