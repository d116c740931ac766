//! A server-sent-events decoder: frames split on blank lines (CRLF and CR normalized), `data:`
//! lines joined with `\n`, comments and unknown fields ignored, a trailing partial frame kept for
//! the next read.

/// One decoded SSE frame.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SseFrame {
    /// The `event:` name, if any.
    pub event: Option<String>,
    /// The `data:` lines, joined with `\n`.
    pub data: String,
    /// The `id:` field, if any.
    pub id: Option<String>,
}

/// The largest frame a stream reader accepts (16 MiB): a server that never ends its frame must
/// not grow the buffer without bound. Readers check [`SseDecoder::pending`] against it.
pub const MAX_FRAME: usize = 16 << 20;

/// Incremental SSE decoder.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
    cr: bool,
    /// How far `buf` is known to hold no blank line (so a long frame is scanned once, not once
    /// per push).
    scanned: usize,
}

impl SseDecoder {
    /// A fresh decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns every frame completed by them.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<SseFrame> {
        for &b in chunk {
            if self.cr {
                self.cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            if b == b'\r' {
                self.cr = true;
                self.buf.push(b'\n');
            } else {
                self.buf.push(b);
            }
        }
        let mut out = Vec::new();
        while let Some(pos) = find_blank_line(&self.buf[self.scanned..]).map(|p| p + self.scanned) {
            let frame: Vec<u8> = self.buf.drain(..pos + 2).collect();
            self.scanned = 0;
            if let Some(f) = parse_frame(&frame[..pos]) {
                out.push(f);
            }
        }
        // The last byte may start a blank line with the next push.
        self.scanned = self.buf.len().saturating_sub(1);
        out
    }

    /// Bytes held back as an incomplete frame.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

fn find_blank_line(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\n\n")
}

fn parse_frame(raw: &[u8]) -> Option<SseFrame> {
    let text = String::from_utf8_lossy(raw);
    let mut f = SseFrame::default();
    let mut data: Vec<&str> = Vec::new();
    for line in text.split('\n') {
        if line.is_empty() || line.starts_with(':') {
            continue;
        }
        let (field, value) = match line.split_once(':') {
            Some((k, v)) => (k, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "event" => f.event = Some(value.to_owned()),
            "data" => data.push(value),
            "id" => f.id = Some(value.to_owned()),
            _ => {}
        }
    }
    if data.is_empty() && f.event.is_none() {
        return None;
    }
    f.data = data.join("\n");
    Some(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_frames_across_chunks_and_line_endings() {
        let mut d = SseDecoder::new();
        let mut got = d.push(b"event: ping\r\ndata: {}\r");
        assert!(got.is_empty());
        got.extend(d.push(b"\n\r\n: comment\n\nevent: a\ndata: 1\ndata: 2\n\nda"));
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].event.as_deref(), Some("ping"));
        assert_eq!(got[0].data, "{}");
        assert_eq!(got[1].data, "1\n2");
        assert_eq!(d.pending(), 2);
    }

    #[test]
    fn a_frame_split_byte_by_byte_decodes_the_same() {
        let body = b"event: a\r\ndata: 1\r\n\r\nevent: b\ndata: 2\n\n";
        let mut d = SseDecoder::new();
        let mut got = Vec::new();
        for b in body.iter() {
            got.extend(d.push(std::slice::from_ref(b)));
        }
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].data, "1");
        assert_eq!(got[1].event.as_deref(), Some("b"));
        assert_eq!(d.pending(), 0);
    }
}
