//! A lean HTTP/1.1 client for plain-`http` endpoints: one `POST` at a time per connection, the
//! response body handed over as it is read, connections kept for reuse.
//!
//! Why hand-written (hyper's client was used here before): a relay holds one upstream connection
//! per concurrent run, and at 1,000 runs what each connection holds is the relay's memory.
//! hyper's client keeps, per connection, an 8 KiB write buffer (for a request of about 1 KiB,
//! written once), a 9 KiB block of the channel between the caller and the connection's task, and
//! the task itself — about 17 KiB beyond the read buffer, measured with heaptrack in the
//! `tether serve` bench. This client holds the socket and one read buffer of the configured
//! size, and reads in the caller's task.
//!
//! It also hands over everything one read brought in one piece: the data of several chunks of a
//! `chunked` body is moved together in the buffer, so a server that sends one chunk per SSE
//! event still costs one delta event per read, not one per chunk.
//!
//! What it does not do: TLS, HTTP/2, proxies, redirects, `Expect: 100-continue`. tether-openai's
//! model builder uses it only for plain `http` without a proxy, when a bounded read buffer is
//! asked for; reqwest serves everything else. Feature `lean-client` (off by default).

use std::io;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Idle connections kept for reuse (a kept connection holds only its socket).
const MAX_IDLE: usize = 1024;
/// How long an idle connection is kept.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// The largest response head read (the buffer grows past its size for a head only).
const MAX_HEAD: usize = 64 * 1024;
/// The longest chunk-size or trailer line accepted.
const MAX_LINE: usize = 4096;

/// A failure, with where it happened (for the error's kind, and whether a retry is safe).
#[derive(Debug)]
#[non_exhaustive]
pub struct LeanError {
    /// While connecting (the request was not sent).
    pub connecting: bool,
    /// On a reused connection before any byte of the response: the server had closed it, and
    /// never saw the request.
    stale: bool,
    /// What failed (its kind and chain of sources classify it: [`crate::classify_chain`]).
    pub error: io::Error,
}

impl LeanError {
    fn io(error: io::Error) -> Self {
        LeanError {
            connecting: false,
            stale: false,
            error,
        }
    }

    fn closed(message: String) -> Self {
        Self::io(io::Error::new(io::ErrorKind::UnexpectedEof, message))
    }

    fn invalid(message: String) -> Self {
        Self::io(io::Error::new(io::ErrorKind::InvalidData, message))
    }
}

/// The client of one endpoint (its host and port), with its idle connections.
pub struct Lean {
    /// `host:port`, to connect to.
    addr: String,
    /// The `Host` header.
    host: String,
    /// The request target's prefix is the URL's path; requests name their full URL.
    headers: HeaderMap,
    read_buffer: usize,
    connect_timeout: Duration,
    /// Idle connections, deregistered from any runtime (a model may be used from several).
    idle: Mutex<Vec<(std::net::TcpStream, Instant)>>,
}

impl Lean {
    /// A client for `endpoint` (an `http://` URL), sending `headers` with every request and
    /// reading through a buffer of `read_buffer` bytes.
    pub fn new(
        endpoint: &str,
        headers: &HeaderMap,
        read_buffer: usize,
        connect_timeout: Duration,
    ) -> Option<Lean> {
        let url = reqwest::Url::parse(endpoint).ok()?;
        if url.scheme() != "http" {
            return None;
        }
        let host = url.host_str()?.to_owned();
        let port = url.port_or_known_default()?;
        let addr = if host.contains(':') {
            format!("[{}]:{port}", host.trim_matches(['[', ']']))
        } else {
            format!("{host}:{port}")
        };
        let host_header = match url.port() {
            Some(p) => format!("{host}:{p}"),
            None => host,
        };
        Some(Lean {
            addr,
            host: host_header,
            headers: headers.clone(),
            read_buffer: read_buffer.max(1024),
            connect_timeout,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Posts `body` to `url` (of this client's endpoint), accepting `accept`; resolves once the
    /// response head has arrived.
    pub async fn post(
        self: &Arc<Self>,
        url: &str,
        accept: &str,
        body: &[u8],
    ) -> Result<LeanResponse, LeanError> {
        self.post_traced(url, accept, body, None).await
    }

    /// [`Lean::post`], with a `traceparent` header when the request belongs to a trace (a value
    /// [`crate::traceparent_header`] checked: no line break can reach the request).
    pub async fn post_traced(
        self: &Arc<Self>,
        url: &str,
        accept: &str,
        body: &[u8],
        traceparent: Option<&HeaderValue>,
    ) -> Result<LeanResponse, LeanError> {
        let mut request = self.request(url, accept, body)?;
        if let Some(tp) = traceparent {
            // Inserted after the request line and `host` (before the other headers).
            let at = request
                .windows(2)
                .position(|w| w == b"\r\n")
                .map(|i| i + 2)
                .unwrap_or(0);
            let line = [b"traceparent: ".as_slice(), tp.as_bytes(), b"\r\n"].concat();
            request.splice(at..at, line);
        }
        let mut fresh_only = false;
        loop {
            let (stream, reused) = match self.take_idle(fresh_only) {
                Some(s) => (s, true),
                None => (self.connect().await?, false),
            };
            match self.exchange(stream, &request, reused).await {
                Err(e) if e.stale => {
                    // The server closed the idle connection as we used it; it never saw the
                    // request. Once more, on a new connection.
                    fresh_only = true;
                }
                r => return r,
            }
        }
    }

    fn request(&self, url: &str, accept: &str, body: &[u8]) -> Result<Vec<u8>, LeanError> {
        let parsed =
            reqwest::Url::parse(url).map_err(|e| LeanError::invalid(format!("bad URL {url}: {e}")))?;
        let mut target = parsed.path().to_owned();
        if let Some(q) = parsed.query() {
            target.push('?');
            target.push_str(q);
        }
        let mut r = Vec::with_capacity(256 + body.len());
        r.extend_from_slice(b"POST ");
        r.extend_from_slice(target.as_bytes());
        r.extend_from_slice(b" HTTP/1.1\r\nhost: ");
        r.extend_from_slice(self.host.as_bytes());
        r.extend_from_slice(b"\r\n");
        for (name, value) in &self.headers {
            if name == reqwest::header::ACCEPT || name == reqwest::header::CONTENT_LENGTH {
                continue;
            }
            r.extend_from_slice(name.as_str().as_bytes());
            r.extend_from_slice(b": ");
            r.extend_from_slice(value.as_bytes());
            r.extend_from_slice(b"\r\n");
        }
        r.extend_from_slice(b"accept: ");
        r.extend_from_slice(accept.as_bytes());
        r.extend_from_slice(b"\r\ncontent-length: ");
        r.extend_from_slice(body.len().to_string().as_bytes());
        r.extend_from_slice(b"\r\n\r\n");
        r.extend_from_slice(body);
        Ok(r)
    }

    /// An idle connection the server has not closed, unless `fresh_only`.
    fn take_idle(&self, fresh_only: bool) -> Option<TcpStream> {
        if fresh_only {
            return None;
        }
        loop {
            let (s, since) = self.idle.lock().ok()?.pop()?;
            if since.elapsed() > IDLE_TIMEOUT {
                continue;
            }
            // Anything readable on an idle connection (its end, or bytes nobody asked for) makes
            // it unusable; a live one has nothing to read.
            let mut probe = [0u8; 1];
            match s.peek(&mut probe) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                _ => continue,
            }
            if let Ok(t) = TcpStream::from_std(s) {
                return Some(t);
            }
        }
    }

    fn put_idle(&self, stream: TcpStream) {
        let Ok(s) = stream.into_std() else { return };
        if let Ok(mut idle) = self.idle.lock() {
            let now = Instant::now();
            idle.retain(|(_, since)| now.duration_since(*since) <= IDLE_TIMEOUT);
            if idle.len() < MAX_IDLE {
                idle.push((s, now));
            }
        }
    }

    async fn connect(&self) -> Result<TcpStream, LeanError> {
        let connecting = |error: io::Error| LeanError {
            connecting: true,
            stale: false,
            error,
        };
        let stream = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.addr)).await {
            Err(_) => {
                return Err(connecting(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "connecting to {} timed out after {:?}",
                        self.addr, self.connect_timeout
                    ),
                )));
            }
            Ok(Err(e)) => {
                return Err(connecting(io::Error::new(
                    e.kind(),
                    format!("cannot connect to {}: {e}", self.addr),
                )));
            }
            Ok(Ok(s)) => s,
        };
        // No Nagle: the request is one write, and the server answers as soon as it has it.
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }

    /// Writes the request and reads the response head.
    async fn exchange(
        self: &Arc<Self>,
        mut stream: TcpStream,
        request: &[u8],
        reused: bool,
    ) -> Result<LeanResponse, LeanError> {
        let stale = |e: LeanError| LeanError { stale: reused, ..e };
        stream
            .write_all(request)
            .await
            .map_err(|e| stale(LeanError::io(e)))?;
        let mut buf = BytesMut::with_capacity(self.read_buffer);
        loop {
            // Parse what has arrived; interim (1xx) responses are skipped.
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut head = httparse::Response::new(&mut headers);
            match head.parse(&buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let code = head.code.unwrap_or(0);
                    if (100..200).contains(&code) && code != 101 {
                        let _ = buf.split_to(len);
                        continue;
                    }
                    let status = StatusCode::from_u16(code).map_err(|_| {
                        LeanError::invalid(format!("the response status {code} is not valid"))
                    })?;
                    let mut map = HeaderMap::with_capacity(head.headers.len());
                    for h in head.headers.iter() {
                        if let (Ok(n), Ok(v)) = (
                            HeaderName::from_bytes(h.name.as_bytes()),
                            HeaderValue::from_bytes(h.value),
                        ) {
                            map.append(n, v);
                        }
                    }
                    let framing = framing(status, &map)?;
                    let keep_alive = head.version == Some(1) && !has_token(&map, "connection", "close");
                    let _ = buf.split_to(len);
                    return Ok(LeanResponse {
                        status,
                        headers: map,
                        body: BodyReader {
                            stream: Some(stream),
                            buf,
                            framing,
                            keep_alive,
                            read_buffer: self.read_buffer,
                            client: self.clone(),
                        },
                    });
                }
                Ok(httparse::Status::Partial) => {}
                Err(e) => return Err(LeanError::invalid(format!("malformed response head: {e}"))),
            }
            if buf.len() >= MAX_HEAD {
                return Err(LeanError::invalid(format!(
                    "the response head is larger than {MAX_HEAD} bytes"
                )));
            }
            if buf.capacity() == buf.len() {
                buf.reserve(self.read_buffer.min(MAX_HEAD - buf.len()));
            }
            let n = stream.read_buf(&mut buf).await.map_err(|e| {
                if buf.is_empty() {
                    stale(LeanError::io(e))
                } else {
                    LeanError::io(e)
                }
            })?;
            if n == 0 {
                let e = LeanError::closed(if buf.is_empty() {
                    "the server closed the connection without answering".to_owned()
                } else {
                    "the server closed the connection inside the response head".to_owned()
                });
                return Err(if buf.is_empty() { stale(e) } else { e });
            }
        }
    }
}

/// How the body of a response ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// This many bytes are left.
    Length(u64),
    /// `Transfer-Encoding: chunked`, at this point of the encoding.
    Chunked(Chunk),
    /// At the end of the connection.
    Close,
    /// The body has ended.
    Done,
}

/// Where a chunked body's decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Before a chunk-size line.
    Size,
    /// Inside a chunk's data: bytes left.
    Data(u64),
    /// After a chunk's data, before its CRLF.
    DataEnd,
    /// After the last chunk: trailer lines up to an empty one.
    Trailer,
}

fn has_token(h: &HeaderMap, name: &str, token: &str) -> bool {
    h.get_all(name).iter().any(|v| {
        v.to_str()
            .is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    })
}

fn framing(status: StatusCode, h: &HeaderMap) -> Result<Framing, LeanError> {
    if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok(Framing::Done);
    }
    if let Some(te) = h.get_all("transfer-encoding").iter().next_back() {
        let last = te.to_str().unwrap_or("").rsplit(',').next().unwrap_or("").trim();
        return Ok(if last.eq_ignore_ascii_case("chunked") {
            Framing::Chunked(Chunk::Size)
        } else {
            Framing::Close
        });
    }
    let mut lengths = h.get_all("content-length").iter();
    match lengths.next() {
        None => Ok(Framing::Close),
        Some(v) => {
            let n = v
                .to_str()
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| LeanError::invalid("the response's Content-Length is not a number".into()))?;
            if lengths.any(|o| o != v) {
                return Err(LeanError::invalid(
                    "the response has conflicting Content-Length headers".into(),
                ));
            }
            Ok(if n == 0 { Framing::Done } else { Framing::Length(n) })
        }
    }
}

/// A response whose head has arrived; its body is read with [`LeanResponse::chunk`].
#[non_exhaustive]
pub struct LeanResponse {
    /// The response's status.
    pub status: StatusCode,
    /// The response's headers.
    pub headers: HeaderMap,
    body: BodyReader,
}

impl LeanResponse {
    /// The next piece of the body (everything one read brought); `None` at its end. Cancel safe:
    /// dropping the future before it completes loses no data.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, LeanError> {
        self.body.next().await
    }

    /// The whole body (for tests; the model reads bodies piece by piece, under its caps).
    #[cfg(test)]
    pub(crate) async fn bytes(mut self) -> Result<Bytes, LeanError> {
        let mut out = BytesMut::new();
        while let Some(c) = self.body.next().await? {
            out.extend_from_slice(&c);
        }
        Ok(out.freeze())
    }
}

/// The most bytes left after a read's pieces that move to a buffer of their own rather than keep
/// the read's whole buffer (a chunk's size line is a few bytes).
const LEFTOVER: usize = 256;

struct BodyReader {
    /// `None` once the body has ended (the connection is back in the pool, or closed).
    stream: Option<TcpStream>,
    /// Bytes read and not yet handed over.
    buf: BytesMut,
    framing: Framing,
    keep_alive: bool,
    read_buffer: usize,
    client: Arc<Lean>,
}

impl BodyReader {
    async fn next(&mut self) -> Result<Option<Bytes>, LeanError> {
        loop {
            if let Some(piece) = self.take()? {
                self.let_go();
                return Ok(Some(piece));
            }
            if self.framing == Framing::Done {
                self.finish();
                return Ok(None);
            }
            let Some(stream) = self.stream.as_mut() else {
                return Ok(None);
            };
            // Nothing held while the stream waits for bytes (see `let_go`), and a buffer is taken
            // only once the socket is readable. A server relaying 1,000 streams that wait (a
            // slow model, or streams held back while new runs start: `tether::priority`) holds
            // no read buffer for them, where it held `read_buffer` bytes each.
            stream.readable().await.map_err(LeanError::io)?;
            let want = self.read_buffer.saturating_sub(self.buf.len()).max(1024);
            if self.buf.capacity() - self.buf.len() < want {
                self.buf.reserve(want);
            }
            let n = match stream.try_read_buf(&mut self.buf) {
                Ok(n) => n,
                // Readiness can be spurious: wait again.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(LeanError::io(e)),
            };
            if n == 0 {
                self.stream = None;
                return match self.framing {
                    Framing::Close => {
                        self.framing = Framing::Done;
                        Ok(None)
                    }
                    Framing::Length(left) => Err(LeanError::closed(format!(
                        "the connection closed {left} bytes before the end of the body"
                    ))),
                    _ => Err(LeanError::closed(
                        "the connection closed inside the chunked body".to_owned(),
                    )),
                };
            }
        }
    }

    /// Hands the read's allocation over to the pieces taken from it (freed once the caller drops
    /// them): what is left (nothing, or the start of a chunk's framing) moves to a buffer of its
    /// own, so that a stream between two reads holds no read buffer.
    fn let_go(&mut self) {
        if self.buf.is_empty() {
            self.buf = BytesMut::new();
        } else if self.buf.len() <= LEFTOVER {
            self.buf = BytesMut::from(&self.buf[..]);
        }
    }

    /// The body's data among the bytes read so far, if any; advances the framing.
    fn take(&mut self) -> Result<Option<Bytes>, LeanError> {
        match self.framing {
            Framing::Done => Ok(None),
            Framing::Close => Ok((!self.buf.is_empty()).then(|| self.buf.split().freeze())),
            Framing::Length(left) => {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                let n = (self.buf.len() as u64).min(left);
                let piece = self.buf.split_to(n as usize).freeze();
                self.framing = match left - n {
                    0 => Framing::Done,
                    rest => Framing::Length(rest),
                };
                Ok(Some(piece))
            }
            Framing::Chunked(state) => {
                let (data, state) = dechunk(&mut self.buf, state)?;
                self.framing = match state {
                    Some(s) => Framing::Chunked(s),
                    None => Framing::Done,
                };
                Ok((data > 0).then(|| self.buf.split_to(data).freeze()))
            }
        }
    }

    /// At the end of the body: the connection goes back to the pool when it can carry another
    /// request (keep-alive, nothing read beyond the body).
    fn finish(&mut self) {
        if let Some(s) = self.stream.take()
            && self.keep_alive
            && self.buf.is_empty()
        {
            self.client.put_idle(s);
        }
    }
}

impl Drop for BodyReader {
    fn drop(&mut self) {
        // A caller that stops at the last event it needs (an SSE stream's `[DONE]`) leaves the
        // end of the body unread, usually already in the buffer: take it, and keep the
        // connection when that ends the body.
        while let Ok(Some(_)) = self.take() {}
        if self.framing == Framing::Done {
            self.finish();
        }
    }
}

/// Decodes the chunked encoding in `buf` in place: the data of every complete or partial chunk
/// is moved to the front, the framing removed. Returns how many bytes at the front are data, and
/// the decoder's state (`None` once the body has ended). Undecoded bytes (a partial size line)
/// stay after the data.
///
/// A framing error found after some data in this call is not returned yet: the data before it
/// is, and the bad bytes stay at the front of what is left, so the next call returns the error
/// with no data. The outcome of a body thus does not depend on how its bytes were cut into reads
/// (a caller that stops at an SSE stream's `[DONE]` stops before the bad framing either way).
fn dechunk(buf: &mut BytesMut, mut state: Chunk) -> Result<(usize, Option<Chunk>), LeanError> {
    let mut write = 0usize;
    let mut read = 0usize;
    let len = buf.len();
    let ended = loop {
        match state {
            Chunk::Data(left) => {
                let take = (left.min((len - read) as u64)) as usize;
                if take == 0 {
                    break false;
                }
                if write != read {
                    buf.copy_within(read..read + take, write);
                }
                write += take;
                read += take;
                state = match left - take as u64 {
                    0 => Chunk::DataEnd,
                    rest => Chunk::Data(rest),
                };
            }
            Chunk::DataEnd => match &buf[read..] {
                [] | [b'\r'] => break false,
                [b'\r', b'\n', ..] => {
                    read += 2;
                    state = Chunk::Size;
                }
                // Lenient: a bare LF.
                [b'\n', ..] => {
                    read += 1;
                    state = Chunk::Size;
                }
                _ if write > 0 => break false,
                _ => {
                    return Err(LeanError::invalid(
                        "a chunk's data is not followed by CRLF".into(),
                    ));
                }
            },
            Chunk::Size | Chunk::Trailer => {
                let Some(nl) = memchr::memchr(b'\n', &buf[read..]) else {
                    if len - read > MAX_LINE {
                        if write > 0 {
                            break false;
                        }
                        return Err(LeanError::invalid(format!(
                            "a chunk line is longer than {MAX_LINE} bytes"
                        )));
                    }
                    break false;
                };
                let line = &buf[read..read + nl];
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                if state == Chunk::Trailer {
                    read += nl + 1;
                    if line.is_empty() {
                        break true;
                    }
                    continue;
                }
                let size = match chunk_size(line) {
                    Ok(size) => size,
                    Err(_) if write > 0 => break false,
                    Err(e) => return Err(e),
                };
                read += nl + 1;
                state = if size == 0 {
                    Chunk::Trailer
                } else {
                    Chunk::Data(size)
                };
            }
        }
    };
    // Drop the framing between the data and what is left undecoded.
    if write != read {
        buf.copy_within(read..len, write);
        buf.truncate(write + (len - read));
    }
    Ok((write, (!ended).then_some(state)))
}

/// The size on a chunk-size line (hex digits, an optional `;extension`).
fn chunk_size(line: &[u8]) -> Result<u64, LeanError> {
    let digits = line.split(|&b| b == b';').next().unwrap_or(b"");
    let digits = digits.trim_ascii();
    if digits.is_empty() || digits.len() > 15 {
        return Err(LeanError::invalid(format!(
            "bad chunk size line {:?}",
            String::from_utf8_lossy(line)
        )));
    }
    let mut n = 0u64;
    for &b in digits {
        let d = (b as char).to_digit(16).ok_or_else(|| {
            LeanError::invalid(format!("bad chunk size line {:?}", String::from_utf8_lossy(line)))
        })?;
        n = n * 16 + d as u64;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chunked(pieces: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in pieces {
            out.extend_from_slice(format!("{:x}\r\n", p.len()).as_bytes());
            out.extend_from_slice(p);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\n\r\n");
        out
    }

    /// Feeds `wire` split at `cuts` through the decoder; the data, and whether it ended.
    fn decode(wire: &[u8], cuts: &[usize]) -> Result<(Vec<u8>, bool), LeanError> {
        let mut buf = BytesMut::new();
        let mut state = Some(Chunk::Size);
        let mut out = Vec::new();
        let mut at = 0;
        let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
        bounds.sort_unstable();
        bounds.push(wire.len());
        for b in bounds {
            buf.extend_from_slice(&wire[at..b.max(at)]);
            at = b.max(at);
            // As `BodyReader` does: decode until a call yields nothing more.
            while let Some(s) = state {
                let (n, next) = dechunk(&mut buf, s)?;
                out.extend_from_slice(&buf.split_to(n));
                state = next;
                if n == 0 {
                    break;
                }
            }
        }
        Ok((out, state.is_none()))
    }

    #[test]
    fn several_chunks_of_one_read_come_out_as_one_piece() {
        let wire = chunked(&[b"data: a\n\n", b"data: b\n\n", b"data: c\n\n"]);
        let mut buf = BytesMut::from(&wire[..]);
        let (n, state) = dechunk(&mut buf, Chunk::Size).unwrap();
        assert_eq!(&buf[..n], b"data: a\n\ndata: b\n\ndata: c\n\n");
        assert_eq!(state, None);
    }

    #[test]
    fn extensions_trailers_and_bare_lf_are_accepted() {
        let wire = b"5;name=x\r\nhello\n0\r\nx-trailer: 1\r\n\r\n";
        assert_eq!(decode(wire, &[]).unwrap(), (b"hello".to_vec(), true));
    }

    #[test]
    fn bad_framing_is_an_error_not_data() {
        assert!(decode(b"zz\r\nhello\r\n0\r\n\r\n", &[]).is_err());
        assert!(decode(b"5\r\nhelloXX0\r\n\r\n", &[]).is_err());
        assert!(decode(b"fffffffffffffffff\r\n", &[]).is_err());
        let long = vec![b'1'; MAX_LINE + 10];
        assert!(decode(&long, &[]).is_err());
    }

    /// The data framed before a framing error comes out first, the error on the next call: what
    /// a body yields before its error does not depend on how its bytes were cut into reads.
    #[test]
    fn data_before_bad_framing_comes_out_before_the_error() {
        for wire in [
            &b"5\r\nhelloXX0\r\n\r\n"[..],
            b"5\r\nhello\r\nzz\r\n",
            b"5\r\nhello\r\nfffffffffffffffff\r\n",
        ] {
            let mut buf = BytesMut::from(wire);
            let (n, state) = dechunk(&mut buf, Chunk::Size).unwrap();
            assert_eq!(&buf[..n], b"hello", "{wire:?}");
            let _ = buf.split_to(n);
            let state = state.expect("not ended");
            assert!(dechunk(&mut buf, state).is_err(), "{wire:?}");
        }
    }

    proptest! {
        /// However a body with bad framing is cut into reads, the data it yields before the error
        /// is the same: every byte of the chunks before the bad framing, nothing after.
        #[test]
        fn data_before_an_error_does_not_depend_on_the_cuts(
            pieces in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..40), 1..5),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let mut wire = chunked(&pieces.iter().map(Vec::as_slice).collect::<Vec<_>>());
            // Break the framing after the last piece's data: its CRLF becomes "XX".
            let end = wire.len() - b"\r\n0\r\n\r\n".len();
            wire[end] = b'X';
            wire[end + 1] = b'X';
            let expected: Vec<u8> = pieces.concat();
            let mut buf = BytesMut::new();
            let mut state = Chunk::Size;
            let mut out = Vec::new();
            let mut at = 0;
            let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
            bounds.sort_unstable();
            bounds.push(wire.len());
            let mut failed = false;
            'reads: for b in bounds {
                buf.extend_from_slice(&wire[at..b.max(at)]);
                at = b.max(at);
                loop {
                    match dechunk(&mut buf, state) {
                        Ok((n, next)) => {
                            out.extend_from_slice(&buf.split_to(n));
                            state = next.expect("the body never ends");
                            if n == 0 {
                                break;
                            }
                        }
                        Err(_) => {
                            failed = true;
                            break 'reads;
                        }
                    }
                }
            }
            prop_assert!(failed, "bad framing was accepted");
            prop_assert_eq!(out, expected);
        }
    }

    #[test]
    fn a_partial_size_line_waits_for_more() {
        let mut buf = BytesMut::from(&b"5\r\nhello\r\n1"[..]);
        let (n, state) = dechunk(&mut buf, Chunk::Size).unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(&buf[n..], b"1");
        assert_eq!(state, Some(Chunk::Size));
    }

    #[test]
    fn framing_follows_the_headers() {
        let h = |pairs: &[(&str, &str)]| {
            let mut m = HeaderMap::new();
            for (k, v) in pairs {
                m.append(
                    HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                );
            }
            m
        };
        let ok = StatusCode::OK;
        assert_eq!(
            framing(ok, &h(&[("transfer-encoding", "chunked")])).unwrap(),
            Framing::Chunked(Chunk::Size)
        );
        assert_eq!(
            framing(ok, &h(&[("content-length", "12")])).unwrap(),
            Framing::Length(12)
        );
        assert_eq!(
            framing(ok, &h(&[("content-length", "0")])).unwrap(),
            Framing::Done
        );
        assert_eq!(framing(ok, &h(&[])).unwrap(), Framing::Close);
        assert_eq!(
            framing(StatusCode::NO_CONTENT, &h(&[("content-length", "5")])).unwrap(),
            Framing::Done
        );
        assert!(framing(ok, &h(&[("content-length", "x")])).is_err());
        assert!(framing(ok, &h(&[("content-length", "1"), ("content-length", "2")])).is_err());
    }

    /// A scripted server: for each connection, the replies to write to its successive requests
    /// (`None`: read the request and close without answering). Counts the requests read.
    async fn scripted(conns: Vec<Vec<Option<Vec<u8>>>>) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/chat/completions", l.local_addr().unwrap());
        let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = seen.clone();
        tokio::spawn(async move {
            for replies in conns {
                let (mut s, _) = l.accept().await.unwrap();
                for reply in replies {
                    // Read one request: its head, then Content-Length bytes.
                    let mut got = Vec::new();
                    let mut b = [0u8; 4096];
                    loop {
                        let n = s.read(&mut b).await.unwrap();
                        assert!(n > 0, "the client closed before its request");
                        got.extend_from_slice(&b[..n]);
                        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
                            let len: usize = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length: "))
                                .and_then(|v| v.trim().parse().ok())
                                .unwrap_or(0);
                            if got.len() >= end + 4 + len {
                                break;
                            }
                        }
                    }
                    counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    match reply {
                        Some(r) => s.write_all(&r).await.unwrap(),
                        None => break,
                    }
                }
                drop(s);
            }
        });
        (url, seen)
    }

    fn json_reply(body: &str) -> Vec<u8> {
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }

    fn client(url: &str) -> Arc<Lean> {
        Arc::new(Lean::new(url, &HeaderMap::new(), 8192, Duration::from_secs(2)).unwrap())
    }

    /// Between two reads a stream keeps none of the read buffer: the piece handed over owns the
    /// read's allocation, and what is left of the framing has a small buffer of its own.
    #[tokio::test]
    async fn a_stream_between_reads_holds_no_read_buffer() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/chat/completions", l.local_addr().unwrap());
        let (go_on, wait) = tokio::sync::oneshot::channel::<()>();
        let first = "data: one\n\n";
        let second = "data: two\n\n";
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut b = [0u8; 4096];
            let _ = s.read(&mut b).await.unwrap();
            // The first chunk, then the start of the next one's size line.
            let head = format!(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{first}\r\n{:x}",
                first.len(),
                second.len()
            );
            s.write_all(head.as_bytes()).await.unwrap();
            let _ = wait.await;
            s.write_all(format!("\r\n{second}\r\n0\r\n\r\n").as_bytes())
                .await
                .unwrap();
        });
        let c = client(&url);
        let mut r = c.post(&url, "text/event-stream", b"{}").await.unwrap();
        let piece = r.chunk().await.unwrap().unwrap();
        assert_eq!(piece, first.as_bytes());
        let kept = r.body.buf.capacity();
        assert!(
            kept <= LEFTOVER,
            "the stream kept {kept} bytes of buffer between reads"
        );
        go_on.send(()).unwrap();
        let mut rest = Vec::new();
        while let Some(p) = r.chunk().await.unwrap() {
            rest.extend_from_slice(&p);
        }
        assert_eq!(rest, second.as_bytes(), "the framing left over was kept");
    }

    #[tokio::test]
    async fn one_read_of_many_chunks_is_one_piece() {
        let mut reply =
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                .to_vec();
        let events: Vec<String> = (0..40).map(|i| format!("data: {{\"n\":{i}}}\n\n")).collect();
        let refs: Vec<&[u8]> = events.iter().map(|e| e.as_bytes()).collect();
        reply.extend_from_slice(&chunked(&refs));
        let (url, _) = scripted(vec![vec![Some(reply)]]).await;
        let c = client(&url);
        let mut r = c.post(&url, "text/event-stream", b"{}").await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        let mut pieces = Vec::new();
        while let Some(p) = r.chunk().await.unwrap() {
            pieces.push(p);
        }
        assert_eq!(pieces.len(), 1, "40 chunks of one write arrive as one piece");
        assert_eq!(pieces[0], events.concat().as_bytes());
        // The body ended cleanly, so the connection is kept.
        assert_eq!(c.idle.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_kept_connection_the_server_closed_is_replaced() {
        let (url, seen) = scripted(vec![
            vec![Some(json_reply("{\"a\":1}"))],
            vec![Some(json_reply("{\"b\":2}"))],
        ])
        .await;
        let c = client(&url);
        let r = c.post(&url, "application/json", b"{}").await.unwrap();
        assert_eq!(&r.bytes().await.unwrap()[..], b"{\"a\":1}");
        assert_eq!(c.idle.lock().unwrap().len(), 1);
        // The server has closed the first connection by now; the client notices before using it.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let r = c.post(&url, "application/json", b"{}").await.unwrap();
        assert_eq!(&r.bytes().await.unwrap()[..], b"{\"b\":2}");
        assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_request_dropped_on_a_kept_connection_is_sent_again_once() {
        // Connection 1 answers one request, then reads the next and closes without a reply (a
        // server timing out its idle connection just as the request came); connection 2 answers.
        let (url, seen) = scripted(vec![
            vec![Some(json_reply("{\"a\":1}")), None],
            vec![Some(json_reply("{\"b\":2}"))],
        ])
        .await;
        let c = client(&url);
        let r = c.post(&url, "application/json", b"{}").await.unwrap();
        assert_eq!(&r.bytes().await.unwrap()[..], b"{\"a\":1}");
        let r = c.post(&url, "application/json", b"{}").await.unwrap();
        assert_eq!(&r.bytes().await.unwrap()[..], b"{\"b\":2}");
        assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 3);

        // On a new connection the same drop is an error (no second attempt).
        let (url, seen) = scripted(vec![vec![None]]).await;
        let e = client(&url)
            .post(&url, "application/json", b"{}")
            .await
            .err()
            .unwrap();
        assert_eq!(e.error.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    proptest! {
        /// Any body, in any chunks, cut into reads anywhere, decodes to itself.
        #[test]
        fn dechunk_round_trips(pieces in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..40), 0..12),
                               cuts in proptest::collection::vec(any::<usize>(), 0..8)) {
            let refs: Vec<&[u8]> = pieces.iter().map(Vec::as_slice).collect();
            let wire = chunked(&refs);
            let (data, ended) = decode(&wire, &cuts).unwrap();
            prop_assert_eq!(data, pieces.concat());
            prop_assert!(ended);
        }
    }
}
