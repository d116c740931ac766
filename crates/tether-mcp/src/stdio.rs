//! The stdio transport to an MCP server run as a child process: newline-delimited JSON-RPC on
//! its stdin and stdout, as rmcp's `TokioChildProcess`, with one difference that is the reason
//! this exists.
//!
//! rmcp reads every response into its `ServerResult`, an untagged union of twenty result types
//! in which `CallToolResult` is the sixteenth: serde tries the fifteen before it first, building
//! and dropping an error message for each. That costs about 40,000 instructions per tool call,
//! more than half of what a whole call costs a client on rmcp (BENCHMARKS.md, "MCP tool
//! calls"). This transport knows which requests it sent were `tools/call`, and reads their
//! responses straight into `CallToolResult`; a response that does not read as one, and every
//! other message, is read by rmcp's own codec, exactly as `TokioChildProcess` reads it.
//!
//! Everything else follows rmcp's stdio transport: lines over 16 MiB are dropped (the connection
//! stays up), input that is not JSON is ignored, JSON that is not a message gets an "Invalid
//! request" error response, non-MCP notifications are ignored, and closing ends the server's
//! stdin, then waits for it to exit (3 s), then sends SIGTERM (3 s more), then kills it. The
//! child is killed if the transport is dropped without being closed.

use std::collections::HashSet;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rmcp::RoleClient;
use rmcp::model::{
    CallToolResult, ClientNotification, ClientRequest, ErrorData, JsonRpcMessage, JsonRpcVersion2_0,
    RequestId, ServerResult,
};
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::async_rw::{JsonRpcMessageCodec, JsonRpcMessageCodecError};
use serde::Deserialize;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout};
use tokio_util::codec::Decoder;

use crate::lock;

/// The longest line read (rmcp's `DEFAULT_MAX_LINE_LENGTH`): a longer one is dropped.
const MAX_LINE: usize = 16 * 1024 * 1024;
/// How long `close` waits for the server to exit, after closing its stdin and after SIGTERM.
const EXIT_WAIT: Duration = Duration::from_secs(3);

/// The ids of `tools/call` requests sent and not yet answered.
type Calls = Arc<Mutex<HashSet<RequestId>>>;

/// An MCP server's stdio, as an rmcp transport (see the module's documentation).
pub(crate) struct ChildStdio {
    child: Option<Child>,
    stdin: Arc<tokio::sync::Mutex<Option<ChildStdin>>>,
    lines: Lines<BufReader<ChildStdout>>,
    calls: Calls,
}

impl ChildStdio {
    /// Starts `cmd` with its stdin, stdout and stderr piped; its stderr is returned to be read.
    pub(crate) fn spawn(
        mut cmd: tokio::process::Command,
    ) -> std::io::Result<(ChildStdio, Option<ChildStderr>)> {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(std::io::Error::other("the child's stdin or stdout is not a pipe"));
        };
        let stderr = child.stderr.take();
        Ok((
            ChildStdio {
                child: Some(child),
                stdin: Arc::new(tokio::sync::Mutex::new(Some(stdin))),
                lines: Lines::new(BufReader::new(stdout), MAX_LINE),
                calls: Arc::default(),
            },
            stderr,
        ))
    }
}

impl rmcp::transport::Transport<RoleClient> for ChildStdio {
    type Error = std::io::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleClient>,
    ) -> impl std::future::Future<Output = Result<(), Self::Error>> + Send + 'static {
        match &item {
            JsonRpcMessage::Request(r) if matches!(r.request, ClientRequest::CallToolRequest(_)) => {
                lock(&self.calls).insert(r.id.clone());
            }
            // A cancelled call may never be answered: it is not waited for.
            JsonRpcMessage::Notification(n) => {
                if let ClientNotification::CancelledNotification(c) = &n.notification
                    && let Some(id) = &c.params.request_id
                {
                    lock(&self.calls).remove(id);
                }
            }
            _ => {}
        }
        let line = serde_json::to_vec(&item).map(|mut v| {
            v.push(b'\n');
            v
        });
        let stdin = self.stdin.clone();
        async move {
            let line = line.map_err(std::io::Error::other)?;
            let mut w = stdin.lock().await;
            let Some(w) = w.as_mut() else {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::NotConnected,
                    "the MCP server's stdin is closed",
                ));
            };
            w.write_all(&line).await?;
            w.flush().await
        }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleClient>> {
        loop {
            match self.lines.next().await {
                Ok(Line::Whole) => {}
                Ok(Line::TooLong) => {
                    tracing::warn!("an MCP server sent a line over {MAX_LINE} bytes; it was dropped");
                    continue;
                }
                Ok(Line::End) => return None,
                Err(e) => {
                    tracing::warn!("reading from an MCP server failed: {e}");
                    return None;
                }
            }
            let parsed = parse(self.lines.line(), &self.calls);
            self.lines.clear();
            match parsed {
                Ok(Some(m)) => return Some(m),
                Ok(None) => {}
                Err(JsonRpcMessageCodecError::Serde(e)) => match e.classify() {
                    // Not JSON: there is no id to answer, and answering could start an error
                    // storm with a server that echoes it; ignored, as rmcp does.
                    serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                        tracing::debug!("ignoring an MCP server's unparsable message: {e}");
                    }
                    serde_json::error::Category::Data | serde_json::error::Category::Io => {
                        tracing::debug!("an MCP server's message is no JSON-RPC message: {e}");
                        let error = TxJsonRpcMessage::<RoleClient>::error(
                            ErrorData::invalid_request("Invalid request", None),
                            None,
                        );
                        // On a task of its own: `receive` may be dropped at any `.await` (rmcp
                        // polls it in a `select!`), and a line written in part would garble
                        // the next.
                        tokio::spawn(rmcp::transport::Transport::send(self, error));
                    }
                },
                Err(e) => {
                    tracing::warn!("reading from an MCP server failed: {e}");
                    return None;
                }
            }
        }
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        drop(self.stdin.lock().await.take());
        let Some(child) = self.child.as_mut() else {
            return Ok(());
        };
        if tokio::time::timeout(EXIT_WAIT, child.wait()).await.is_err() {
            #[cfg(unix)]
            if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
                // SAFETY: kill(2) on the pid of a child not yet waited for (so not reused).
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
            if tokio::time::timeout(EXIT_WAIT, child.wait()).await.is_err() {
                child.kill().await?;
            }
        }
        self.child = None;
        Ok(())
    }
}

/// A response's envelope, its result left unread.
#[derive(Deserialize)]
struct Reply<'a> {
    /// Read to check it is "2.0".
    #[serde(rename = "jsonrpc")]
    _version: JsonRpcVersion2_0,
    id: RequestId,
    #[serde(borrow)]
    result: &'a serde_json::value::RawValue,
    method: Option<serde::de::IgnoredAny>,
    error: Option<serde::de::IgnoredAny>,
}

/// Reads one line: the answer to a `tools/call` straight as a `CallToolResult`, anything else
/// with rmcp's codec (`Ok(None)`: a message rmcp ignores).
fn parse(
    line: &[u8],
    calls: &Calls,
) -> Result<Option<RxJsonRpcMessage<RoleClient>>, JsonRpcMessageCodecError> {
    if let Ok(r) = serde_json::from_slice::<Reply<'_>>(line)
        && r.method.is_none()
        && r.error.is_none()
        && lock(calls).remove(&r.id)
    {
        // What does not read as a tool result is read by rmcp below, which decides what it is
        // (and so what the caller gets).
        if let Ok(result) = serde_json::from_str::<CallToolResult>(r.result.get()) {
            return Ok(Some(JsonRpcMessage::response(
                ServerResult::CallToolResult(result),
                r.id,
            )));
        }
    }
    let mut buf = bytes::BytesMut::from(line);
    let m = JsonRpcMessageCodec::<RxJsonRpcMessage<RoleClient>>::new_with_max_length(MAX_LINE)
        .decode_eof(&mut buf)?;
    // An answer (or an error) to a call ends the wait for it, however it was read.
    match &m {
        Some(JsonRpcMessage::Response(r)) => {
            lock(calls).remove(&r.id);
        }
        Some(JsonRpcMessage::Error(e)) => {
            if let Some(id) = &e.id {
                lock(calls).remove(id);
            }
        }
        _ => {}
    }
    Ok(m)
}

/// What reading a line came to.
enum Line {
    /// A whole line (with its `\n`) is in the buffer.
    Whole,
    /// A line longer than the limit was dropped.
    TooLong,
    /// The stream ended.
    End,
}

/// Newline-delimited lines of at most `max` bytes, read without ever buffering more.
///
/// Cancel safe: a line read in part stays in the buffer (a `fill_buf` dropped consumes nothing,
/// and each copy is consumed with no `.await` between), so the next `next` goes on with it.
struct Lines<R> {
    read: R,
    buf: Vec<u8>,
    max: usize,
    /// Dropping the rest of a line found too long.
    skipping: bool,
}

impl<R: AsyncBufRead + Unpin> Lines<R> {
    fn new(read: R, max: usize) -> Self {
        Lines {
            read,
            buf: Vec::new(),
            max,
            skipping: false,
        }
    }

    async fn next(&mut self) -> std::io::Result<Line> {
        loop {
            let chunk = self.read.fill_buf().await?;
            if chunk.is_empty() {
                return Ok(Line::End);
            }
            let newline = chunk.iter().position(|&b| b == b'\n');
            let n = newline.map_or(chunk.len(), |i| i + 1);
            let outcome = if self.skipping {
                if newline.is_some() {
                    self.skipping = false;
                }
                None
            } else if self.buf.len() + n > self.max {
                self.buf.clear();
                self.skipping = newline.is_none();
                Some(Line::TooLong)
            } else {
                self.buf.extend_from_slice(&chunk[..n]);
                newline.map(|_| Line::Whole)
            };
            self.read.consume(n);
            if let Some(o) = outcome {
                return Ok(o);
            }
        }
    }

    /// The line read, without its line ending (`\n` or `\r\n`).
    fn line(&self) -> &[u8] {
        let l = self.buf.strip_suffix(b"\n").unwrap_or(&self.buf);
        l.strip_suffix(b"\r").unwrap_or(l)
    }

    fn clear(&mut self) {
        self.buf.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn calls(ids: &[i64]) -> Calls {
        Arc::new(Mutex::new(ids.iter().map(|&i| RequestId::Number(i)).collect()))
    }

    fn read(line: &str, c: &Calls) -> Option<RxJsonRpcMessage<RoleClient>> {
        parse(line.as_bytes(), c).expect("parses")
    }

    #[test]
    fn a_tool_calls_answer_reads_as_rmcp_reads_it() {
        let lines = [
            r#"{"jsonrpc":"2.0","id":3,"result":{"content":[{"type":"text","text":"ok"}]}}"#,
            r#"{"jsonrpc":"2.0","id":3,"result":{"content":[],"structuredContent":{"a":[1,2.5,null]},"isError":true,"_meta":{"k":"v"}}}"#,
            r#"{"jsonrpc":"2.0","id":3,"result":{"content":[{"type":"image","data":"aGk=","mimeType":"image/png"}],"extra":1}}"#,
        ];
        for l in lines {
            let c = calls(&[3]);
            let fast = read(l, &c);
            assert!(lock(&c).is_empty(), "the answer ends the wait");
            let slow = read(l, &calls(&[]));
            // The same message (compared as written: rmcp's message types are not `PartialEq`).
            assert_eq!(
                serde_json::to_value(&fast).unwrap(),
                serde_json::to_value(&slow).unwrap(),
                "{l}"
            );
            assert!(matches!(
                fast,
                Some(JsonRpcMessage::Response(ref r)) if matches!(r.result, ServerResult::CallToolResult(_))
            ));
        }
    }

    #[test]
    fn what_is_no_tool_result_is_read_by_rmcp() {
        // Not a call we made, an error, a result that is no tool result, a request.
        let c = calls(&[1, 2]);
        let other = read(r#"{"jsonrpc":"2.0","id":7,"result":{"content":[]}}"#, &c);
        assert!(matches!(other, Some(JsonRpcMessage::Response(_))));
        assert_eq!(lock(&c).len(), 2);
        let err = read(
            r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32602,"message":"bad"}}"#,
            &c,
        );
        assert!(matches!(err, Some(JsonRpcMessage::Error(_))));
        let empty = read(r#"{"jsonrpc":"2.0","id":2,"result":{}}"#, &c);
        assert!(matches!(
            empty,
            Some(JsonRpcMessage::Response(ref r)) if matches!(r.result, ServerResult::EmptyResult(_))
        ));
        assert!(lock(&c).is_empty(), "answers of any kind end the waits");
        let req = read(r#"{"jsonrpc":"2.0","id":9,"method":"roots/list"}"#, &c);
        assert!(matches!(req, Some(JsonRpcMessage::Request(_))));
        // A notification of a method MCP does not define is rmcp's custom one; JSON that is no
        // message is an error.
        let custom = read(r#"{"jsonrpc":"2.0","method":"window/logMessage"}"#, &c);
        assert!(matches!(custom, Some(JsonRpcMessage::Notification(_))));
        assert!(matches!(
            parse(b"[1,2]", &c),
            Err(JsonRpcMessageCodecError::Serde(e)) if e.classify() == serde_json::error::Category::Data
        ));
        assert!(matches!(
            parse(b"{not json", &c),
            Err(JsonRpcMessageCodecError::Serde(e)) if e.classify() == serde_json::error::Category::Syntax
        ));
        // Nesting past serde_json's depth limit is refused on either path, not a stack overflow.
        let c = calls(&[5]);
        let deep = format!(
            r#"{{"jsonrpc":"2.0","id":5,"result":{{"structuredContent":{}1{},"content":[]}}}}"#,
            "[".repeat(10_000),
            "]".repeat(10_000)
        );
        assert!(parse(deep.as_bytes(), &c).is_err());
        // A wrong version is no fast answer.
        let c = calls(&[4]);
        assert!(parse(br#"{"jsonrpc":"1.0","id":4,"result":{"content":[]}}"#, &c).is_err());
    }

    #[tokio::test]
    async fn lines_are_bounded_and_survive_a_cancelled_read() {
        let (mut w, r) = tokio::io::duplex(64);
        let mut lines = Lines::new(BufReader::new(r), 16);
        w.write_all(b"{\"a\":1}\r\n").await.unwrap();
        assert!(matches!(lines.next().await.unwrap(), Line::Whole));
        assert_eq!(lines.line(), b"{\"a\":1}");
        lines.clear();
        // Too long: dropped up to its end, and the next line is read whole.
        w.write_all(b"0123456789abcdefghij\nok\n").await.unwrap();
        assert!(matches!(lines.next().await.unwrap(), Line::TooLong));
        assert!(matches!(lines.next().await.unwrap(), Line::Whole));
        assert_eq!(lines.line(), b"ok");
        lines.clear();
        // Half a line, a read dropped while waiting for the rest, then the rest.
        w.write_all(b"par").await.unwrap();
        let t = tokio::time::timeout(Duration::from_millis(20), lines.next()).await;
        assert!(t.is_err());
        w.write_all(b"t\n").await.unwrap();
        assert!(matches!(lines.next().await.unwrap(), Line::Whole));
        assert_eq!(lines.line(), b"part");
        lines.clear();
        drop(w);
        assert!(matches!(lines.next().await.unwrap(), Line::End));
    }
}
