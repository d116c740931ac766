//! A byte-level line splitter for Server-Sent Events.
//!
//! Why not an SSE crate: those parse the whole SSE grammar (`event:`/`id:`/`retry:` fields,
//! multi-line `data:` joining, reconnection) and allocate a `String` per event. Chat completion
//! streams use only single-line `data:` events, so this splitter hands out slices borrowed from
//! the network buffer itself: no copy at all when a read holds whole lines (the usual case, as
//! servers flush once per event), one copy into a reused buffer for a line split across reads.
//! Lines end with LF, CRLF or a lone CR, as the SSE grammar allows.

use bytes::Bytes;

/// Splits a byte stream into lines without their terminators.
///
/// Feed each network chunk with [`LineSplitter::push`], then take lines with
/// [`LineSplitter::next_line`] until it returns `None`; at the end of the body,
/// [`LineSplitter::finish`] returns an unterminated last line, if any.
#[derive(Debug, Default)]
pub struct LineSplitter {
    cur: Bytes,
    pos: usize,
    partial: Vec<u8>,
    /// `partial` holds the line returned last: clear it on the next call.
    partial_taken: bool,
    /// The last line ended with CR at the end of a chunk: a leading LF in the next belongs to it.
    skip_lf: bool,
}

impl LineSplitter {
    /// A splitter with nothing buffered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds the next chunk (the previous one must have been drained by `next_line`).
    pub fn push(&mut self, chunk: Bytes) {
        if self.pos < self.cur.len() {
            // Not drained: keep the rest rather than lose it.
            let rest = self.cur.slice(self.pos..);
            self.clear_taken();
            self.partial.extend_from_slice(&rest);
        }
        self.cur = chunk;
        self.pos = 0;
    }

    /// Lets go of the current chunk, keeping its unfinished last line (copied, as [`Self::push`]
    /// would). The chunk is a view into the HTTP client's read buffer: released before the next
    /// read, the buffer is reused in place instead of a second one being allocated beside it.
    pub fn release(&mut self) {
        self.push(Bytes::new());
    }

    fn clear_taken(&mut self) {
        if self.partial_taken {
            self.partial.clear();
            self.partial_taken = false;
        }
    }

    /// The next complete line of the current chunk (joined with any earlier partial line).
    pub fn next_line(&mut self) -> Option<&[u8]> {
        self.clear_taken();
        let mut start = self.pos;
        if self.skip_lf && start < self.cur.len() {
            self.skip_lf = false;
            if self.cur[start] == b'\n' {
                start += 1;
                self.pos = start;
            }
        }
        let buf = &self.cur[start..];
        // The blank line after every event: found without a search (a `memchr2` call costs
        // more than a whole short line's scan in its setup).
        if buf.first() == Some(&b'\n') && self.partial.is_empty() {
            self.pos = start + 1;
            return Some(&[]);
        }
        match memchr::memchr2(b'\n', b'\r', buf) {
            Some(i) => {
                let end = start + i;
                let mut next = end + 1;
                if self.cur[end] == b'\r' {
                    if next < self.cur.len() {
                        if self.cur[next] == b'\n' {
                            next += 1;
                        }
                    } else {
                        self.skip_lf = true;
                    }
                }
                self.pos = next;
                if self.partial.is_empty() {
                    Some(&self.cur[start..end])
                } else {
                    self.partial.extend_from_slice(&self.cur[start..end]);
                    self.partial_taken = true;
                    Some(&self.partial)
                }
            }
            None => {
                self.partial.extend_from_slice(buf);
                // Drained: let go of the network buffer now rather than at the next `push`, so
                // the HTTP client, the only owner left, reuses its read buffer for the next read instead of
                // allocating another while this one is still referenced (~10 KiB a connection).
                self.cur = Bytes::new();
                self.pos = 0;
                None
            }
        }
    }

    /// The unread rest of the current chunk when a line starts there (nothing partial, no LF
    /// owed to a CR), for a caller that can consume whole lines itself; see
    /// [`advance`](Self::advance).
    pub fn rest(&self) -> Option<&[u8]> {
        (self.partial.is_empty() && !self.skip_lf && self.pos < self.cur.len()).then(|| &self.cur[self.pos..])
    }

    /// Skips `n` bytes of [`rest`](Self::rest), which must end a line.
    pub fn advance(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.cur.len());
    }

    /// Bytes of a line begun but not yet terminated.
    pub fn pending_len(&self) -> usize {
        if self.partial_taken { 0 } else { self.partial.len() }
    }

    /// At the end of the body: the unterminated last line, if any.
    pub fn finish(&mut self) -> Option<&[u8]> {
        self.clear_taken();
        if self.pos < self.cur.len() {
            let rest = self.cur.slice(self.pos..);
            self.partial.extend_from_slice(&rest);
            self.pos = self.cur.len();
        }
        if self.partial.is_empty() {
            None
        } else {
            self.partial_taken = true;
            Some(&self.partial)
        }
    }
}

/// The payload of a `data:` line (one optional leading space removed), or `None` for any
/// other line (blank separators, `:` comments, `event:`/`id:`/`retry:` fields).
pub fn data_of(line: &[u8]) -> Option<&[u8]> {
    let d = line.strip_prefix(b"data:")?;
    Some(d.strip_prefix(b" ").unwrap_or(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_all(chunks: &[&[u8]]) -> Vec<String> {
        split_with(chunks, false)
    }

    /// `release`: let go of each chunk once its lines are taken, as the stream reader does.
    fn split_with(chunks: &[&[u8]], release: bool) -> Vec<String> {
        let mut s = LineSplitter::new();
        let mut out = Vec::new();
        for c in chunks {
            s.push(Bytes::copy_from_slice(c));
            while let Some(l) = s.next_line() {
                out.push(String::from_utf8_lossy(l).into_owned());
            }
            if release {
                s.release();
            }
        }
        if let Some(l) = s.finish() {
            out.push(String::from_utf8_lossy(l).into_owned());
        }
        out
    }

    #[test]
    fn splits_on_every_line_ending_across_chunks() {
        let whole: &[u8] = b"data: a\n\ndata: b\r\n\r\ndata: c\r\rdata: d";
        let expect = vec!["data: a", "", "data: b", "", "data: c", "", "data: d"];
        assert_eq!(split_all(&[whole]), expect);
        for i in 0..whole.len() {
            for j in i..whole.len() {
                let pieces = [&whole[..i], &whole[i..j], &whole[j..]];
                assert_eq!(split_all(&pieces), expect, "{i} {j}");
                assert_eq!(split_with(&pieces, true), expect, "released, {i} {j}");
            }
        }
    }

    #[test]
    fn data_payloads() {
        assert_eq!(data_of(b"data: {}"), Some(&b"{}"[..]));
        assert_eq!(data_of(b"data:{}"), Some(&b"{}"[..]));
        assert_eq!(data_of(b": keep-alive"), None);
        assert_eq!(data_of(b"event: x"), None);
    }
}
