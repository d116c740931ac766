//! Newline-delimited framing: the agent's stdout cut into frames in place (size-limited), and
//! the writer task that sends our frames to its stdin behind a bounded queue.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::Conn;
use crate::error::AcpError;

pub(super) enum ReadEnd {
    Eof,
    TooLarge(usize),
    Io(std::io::Error),
}

/// Position of the first `\n`, eight bytes at a time (std has no public `memchr`, and a plain
/// byte loop was the reader's main cost in a flood).
pub(super) fn find_newline(s: &[u8]) -> Option<usize> {
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
pub(super) const READ_BUF: usize = 256 * 1024;

/// The agent's stdout, framed in place: frames are handed out as slices of one reused buffer
/// (no copy, no allocation per frame or per read). Whatever follows the last complete frame (the
/// start of the next one) is moved to the front before the next read.
pub(super) struct FrameReader<R> {
    reader: R,
    buf: Vec<u8>,
    /// `buf[start..end]` is read and not yet handed out.
    start: usize,
    end: usize,
    /// `buf[start..scanned]` is known to hold no newline.
    scanned: usize,
    limit: usize,
}

pub(super) enum Frame {
    /// `buf[range]`: without the newline and a trailing `\r`; blank lines are skipped. Not yet
    /// checked to be UTF-8.
    Line(std::ops::Range<usize>),
    End(ReadEnd),
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub(super) fn new(reader: R, limit: usize) -> Self {
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
    pub(super) async fn next(&mut self) -> Frame {
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
    pub(super) fn frame(&self, start: usize, mut end: usize) -> Option<std::ops::Range<usize>> {
        if end > start && self.buf.get(end - 1) == Some(&b'\r') {
            end -= 1;
        }
        self.buf
            .get(start..end)
            .is_some_and(|f| !f.iter().all(u8::is_ascii_whitespace))
            .then_some(start..end)
    }

    pub(super) fn get(&self, r: std::ops::Range<usize>) -> Option<&[u8]> {
        self.buf.get(r)
    }
}

pub(super) async fn writer_loop<W: AsyncWrite + Unpin>(
    conn: Arc<Conn>,
    mut rx: mpsc::Receiver<String>,
    writer: W,
) {
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

pub(super) async fn write_line<W: AsyncWrite + Unpin>(w: &mut W, frame: &str) -> std::io::Result<()> {
    w.write_all(frame.as_bytes()).await?;
    w.write_all(b"\n").await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

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
