//! Server-Sent Events, decoded once for every provider crate: the OpenAI-compatible stream, the
//! Anthropic Messages and Managed Agents streams, and AgentCore runtime containers.
//!
//! Two layers, one grammar (the [WHATWG event-stream] one: lines end with LF, CRLF or a lone CR,
//! a blank line ends an event, `:` starts a comment, one space after the field's colon is
//! dropped):
//!
//! - [`LineSplitter`] splits a byte stream into lines borrowed from the network buffer itself: no
//!   copy when a read holds whole lines (the usual case, as servers flush once per event), one copy
//!   into a reused buffer for a line split across reads. With [`data_of`] it is the fast path of a
//!   stream whose events are single `data:` lines (OpenAI chat completions).
//! - [`SseDecoder`] builds whole events ([`SseFrame`]: `event`, `data` lines joined with `\n`, `id`)
//!   on top of it, for streams that name their events or split data over lines.
//!
//! Why not an SSE crate: those parse the grammar the same way but allocate a `String` per line
//! or event and bring reconnection logic a provider does not want (retries are the shared
//! `RetryPolicy`'s job). Both layers give the same lines and events however the stream is cut
//! into reads (property-tested below).
//!
//! [WHATWG event-stream]: https://html.spec.whatwg.org/multipage/server-sent-events.html#parsing-an-event-stream

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

/// One decoded SSE event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SseFrame {
    /// The `event:` name, if the event named one.
    pub event: Option<String>,
    /// The `data:` lines, joined with `\n` (invalid UTF-8 replaced by U+FFFD).
    pub data: String,
    /// The `id:` field of this event, if any.
    pub id: Option<String>,
}

/// The largest event a stream reader should accept (16 MiB): a server that never ends its event
/// must not grow the buffer without bound. Readers check [`SseDecoder::pending`] against it.
pub const MAX_FRAME: usize = 16 << 20;

/// An incremental SSE event decoder over [`LineSplitter`].
///
/// An event is dispatched at the blank line that ends it when it had at least one `data:` line
/// (as the WHATWG grammar says: an event with only an `event:` name, or only comments, is
/// dropped). Unknown fields are ignored; an `id` holding NUL is ignored. An unfinished event at
/// the end of the body is not dispatched (it was cut off).
///
/// ```
/// use tether_http::sse::SseDecoder;
///
/// let mut dec = SseDecoder::new();
/// assert!(dec.push(b"event: ping\r\ndata: {}\r").is_empty());
/// let frames = dec.push(b"\n\r\n: comment\n\ndata: 1\ndata: 2\n\n");
/// assert_eq!(frames.len(), 2);
/// assert_eq!(frames[0].event.as_deref(), Some("ping"));
/// assert_eq!(frames[1].data, "1\n2");
/// ```
#[derive(Debug, Default)]
pub struct SseDecoder {
    lines: LineSplitter,
    event: Option<String>,
    data: Vec<u8>,
    has_data: bool,
    id: Option<String>,
    /// Bytes of the event being read, its lines' terminators counted as one byte each.
    held: usize,
}

impl SseDecoder {
    /// A decoder with nothing buffered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds the next read; returns every event completed by it.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<SseFrame> {
        let mut out = Vec::new();
        self.lines.push(Bytes::copy_from_slice(chunk));
        while let Some(line) = self.lines.next_line() {
            if line.is_empty() {
                self.held = 0;
                let event = self.event.take();
                let id = self.id.take();
                if std::mem::take(&mut self.has_data) {
                    out.push(SseFrame {
                        event,
                        data: String::from_utf8_lossy(&self.data).into_owned(),
                        id,
                    });
                }
                self.data.clear();
                continue;
            }
            self.held = self.held.saturating_add(line.len() + 1);
            if line[0] == b':' {
                continue;
            }
            let (field, value) = match line.iter().position(|&b| b == b':') {
                Some(i) => {
                    let v = &line[i + 1..];
                    (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
                }
                None => (line, &b""[..]),
            };
            match field {
                b"data" => {
                    if self.has_data {
                        self.data.push(b'\n');
                    }
                    self.has_data = true;
                    self.data.extend_from_slice(value);
                }
                b"event" => self.event = Some(String::from_utf8_lossy(value).into_owned()),
                b"id" if !value.contains(&0) => self.id = Some(String::from_utf8_lossy(value).into_owned()),
                _ => {}
            }
        }
        out
    }

    /// Bytes held back as an incomplete event (its lines so far and an unfinished line).
    pub fn pending(&self) -> usize {
        self.held.saturating_add(self.lines.pending_len())
    }
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

    fn decode(reads: &[&[u8]]) -> (Vec<SseFrame>, usize) {
        let mut d = SseDecoder::new();
        let mut out = Vec::new();
        for r in reads {
            out.extend(d.push(r));
        }
        (out, d.pending())
    }

    fn frame(event: Option<&str>, data: &str, id: Option<&str>) -> SseFrame {
        SseFrame {
            event: event.map(str::to_owned),
            data: data.to_owned(),
            id: id.map(str::to_owned),
        }
    }

    #[test]
    fn decodes_events_across_chunks_and_line_endings() {
        let mut d = SseDecoder::new();
        let mut got = d.push(b"event: ping\r\ndata: {}\r");
        assert!(got.is_empty());
        got.extend(d.push(b"\n\r\n: comment\n\nevent: a\ndata: 1\ndata: 2\nid: 7\n\nda"));
        assert_eq!(
            got,
            vec![
                frame(Some("ping"), "{}", None),
                frame(Some("a"), "1\n2", Some("7"))
            ]
        );
        assert_eq!(d.pending(), 2);
    }

    #[test]
    fn the_grammar_of_fields() {
        let body: &[u8] = b"data\n\ndata:\n\nevent: only-a-name\n\n:just a comment\n\n\
            data:  two spaces\nretry: 5\nunknown: x\n\nid: a\0b\ndata: nul id\n\nevent: cut\ndata: off";
        let (got, pending) = decode(&[body]);
        assert_eq!(
            got,
            vec![
                frame(None, "", None),
                frame(None, "", None),
                frame(None, " two spaces", None),
                frame(None, "nul id", None),
            ]
        );
        assert!(pending > 0, "the unfinished event is held");
    }

    /// Found by the `agentcore_runtime` fuzz target (in the decoder AgentCore had then): a read
    /// ending inside a UTF-8 character turned it into two U+FFFD, and one ending between CR and
    /// LF lost the event.
    #[test]
    fn an_event_is_the_same_wherever_the_reads_end() {
        let body = "data: w\u{f6}rld \u{1f600}\r\n\r\ndata: {\"a\":1}\r\ndata: 2\n\n".as_bytes();
        let (whole, _) = decode(&[body]);
        let data: Vec<&str> = whole.iter().map(|f| f.data.as_str()).collect();
        assert_eq!(data, ["w\u{f6}rld \u{1f600}", "{\"a\":1}\n2"]);
        for i in 0..=body.len() {
            for j in i..=body.len() {
                let reads = [&body[..i], &body[i..j], &body[j..]];
                assert_eq!(decode(&reads).0, whole, "cut at {i} and {j}");
            }
        }
    }

    #[test]
    fn a_never_ending_event_is_counted_as_pending() {
        let mut d = SseDecoder::new();
        d.push(b"data: ");
        for _ in 0..100 {
            assert!(d.push(&[b'x'; 1000]).is_empty());
        }
        assert!(d.pending() >= 100_000);
        d.push(b"\ndata: more\n");
        assert!(d.pending() >= 100_000, "an event of many lines is held whole");
        assert_eq!(d.push(b"\n").len(), 1);
        assert_eq!(d.pending(), 0);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        /// Streams made of the bytes that matter to the grammar (line endings, colons, spaces,
        /// field names, a multi-byte character, NUL) in any order.
        fn stream() -> impl Strategy<Value = Vec<u8>> {
            let piece = prop_oneof![
                Just(&b"\n"[..]),
                Just(&b"\r"[..]),
                Just(&b"\r\n"[..]),
                Just(&b"data:"[..]),
                Just(&b"data: "[..]),
                Just(&b"event: e"[..]),
                Just(&b"id: 1"[..]),
                Just(&b":"[..]),
                Just(&b" "[..]),
                Just(&b"x"[..]),
                Just("\u{e9}\u{1f600}".as_bytes()),
                Just(&b"\0"[..]),
                Just(&b"\xff"[..]),
            ];
            prop::collection::vec(piece, 0..60).prop_map(|v| v.concat())
        }

        /// Cut points into a stream of `len` bytes, sorted.
        fn cuts(bytes: &[u8], raw: &[usize]) -> Vec<Vec<u8>> {
            let mut at: Vec<usize> = raw.iter().map(|c| c % (bytes.len() + 1)).collect();
            at.sort_unstable();
            let mut out = Vec::new();
            let mut prev = 0;
            for c in at {
                out.push(bytes[prev..c].to_vec());
                prev = c;
            }
            out.push(bytes[prev..].to_vec());
            out
        }

        proptest! {
            #[test]
            fn any_chunking_gives_the_same_lines(s in stream(), raw in prop::collection::vec(any::<usize>(), 0..8), release in any::<bool>()) {
                let reads = cuts(&s, &raw);
                let reads: Vec<&[u8]> = reads.iter().map(Vec::as_slice).collect();
                prop_assert_eq!(split_with(&reads, release), split_all(&[&s]));
            }

            #[test]
            fn any_chunking_gives_the_same_events(s in stream(), raw in prop::collection::vec(any::<usize>(), 0..8)) {
                let reads = cuts(&s, &raw);
                let reads: Vec<&[u8]> = reads.iter().map(Vec::as_slice).collect();
                let (whole, whole_pending) = decode(&[&s]);
                let (cut, cut_pending) = decode(&reads);
                prop_assert_eq!(cut, whole);
                prop_assert_eq!(cut_pending, whole_pending);
            }

            /// The events agree with the lines: one event per blank line that follows a `data` line.
            #[test]
            fn events_are_built_from_the_lines(s in stream()) {
                let (events, _) = decode(&[&s]);
                let mut expected = 0;
                let mut has_data = false;
                for l in split_all(&[&s]) {
                    // `finish` returns an unterminated last line: not followed by a blank line.
                    if l.is_empty() {
                        expected += usize::from(std::mem::take(&mut has_data));
                    } else if l == "data" || l.starts_with("data:") {
                        has_data = true;
                    }
                }
                prop_assert_eq!(events.len(), expected);
            }
        }
    }
}
