//! Wire encoders: SSE (`text/event-stream`) and protobuf
//! (`application/vnd.ag-ui.event+proto`), and `Accept` negotiation between them.

use crate::event::AgUiEvent;

/// The SSE media type.
pub const SSE_MEDIA_TYPE: &str = "text/event-stream";
/// The AG-UI protobuf media type (exact; the client compares it for equality).
pub const PROTO_MEDIA_TYPE: &str = "application/vnd.ag-ui.event+proto";

/// A wire format for a stream of events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Encoding {
    /// `data: {json}\n\n` frames.
    Sse,
    /// 4-byte big-endian length + one `ag_ui.Event` per frame.
    Protobuf,
}

impl Encoding {
    /// The response `Content-Type`.
    pub fn content_type(self) -> &'static str {
        match self {
            Encoding::Sse => SSE_MEDIA_TYPE,
            Encoding::Protobuf => PROTO_MEDIA_TYPE,
        }
    }

    /// Appends one encoded frame for `event` to `out`.
    pub fn encode_into(self, event: &AgUiEvent, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        match self {
            Encoding::Sse => encode_sse_into(event, out),
            Encoding::Protobuf => {
                crate::proto::encode_frame_into(event, out);
                Ok(())
            }
        }
    }

    /// Picks the encoding from an `Accept` header value.
    ///
    /// Absent or empty `Accept` means SSE. The protobuf type wins when it is acceptable with a
    /// quality at least that of SSE. `None` when neither is acceptable (answer 406).
    pub fn negotiate(accept: Option<&str>) -> Option<Encoding> {
        let accept = match accept.map(str::trim) {
            None | Some("") => return Some(Encoding::Sse),
            Some(a) => a,
        };
        let mut sse_q: Option<f32> = None;
        let mut proto_q: Option<f32> = None;
        let mut wildcard_q: Option<f32> = None;
        for item in accept.split(',') {
            let mut parts = item.split(';');
            let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            let mut q = 1.0f32;
            for p in parts {
                let p = p.trim();
                if let Some(v) = p.strip_prefix("q=").or_else(|| p.strip_prefix("Q=")) {
                    q = v.trim().parse().unwrap_or(0.0);
                }
            }
            let slot = match media.as_str() {
                SSE_MEDIA_TYPE => &mut sse_q,
                PROTO_MEDIA_TYPE => &mut proto_q,
                "*/*" | "text/*" | "application/*" => {
                    // `text/*` covers SSE, `application/*` covers protobuf; both fall back to SSE.
                    &mut wildcard_q
                }
                _ => continue,
            };
            *slot = Some(slot.map_or(q, |old: f32| old.max(q)));
        }
        let sse = sse_q.or(wildcard_q).unwrap_or(0.0);
        let proto = proto_q.unwrap_or(0.0);
        if proto > 0.0 && proto >= sse {
            Some(Encoding::Protobuf)
        } else if sse > 0.0 {
            Some(Encoding::Sse)
        } else {
            None
        }
    }
}

/// The streaming hot path (content and argument deltas without `rawEvent`/`metadata`),
/// written directly; byte-identical to the derived serialization.
fn encode_sse_fast(event: &AgUiEvent, out: &mut Vec<u8>) -> Result<bool, serde_json::Error> {
    let (ty, id_key, id, delta, sub, ts, plain): (&[u8], &[u8], &str, &str, _, _, bool) = match event {
        AgUiEvent::TextMessageContent(e) => (
            b"TEXT_MESSAGE_CONTENT",
            b"messageId",
            &e.message_id,
            &e.delta,
            e.subagent_run_id.as_deref(),
            e.timestamp,
            e.raw_event.is_none() && e.metadata.is_none(),
        ),
        AgUiEvent::ToolCallArgs(e) => (
            b"TOOL_CALL_ARGS",
            b"toolCallId",
            &e.tool_call_id,
            &e.delta,
            e.subagent_run_id.as_deref(),
            e.timestamp,
            e.raw_event.is_none() && e.metadata.is_none(),
        ),
        AgUiEvent::ReasoningMessageContent(e) => (
            b"REASONING_MESSAGE_CONTENT",
            b"messageId",
            &e.message_id,
            &e.delta,
            e.subagent_run_id.as_deref(),
            e.timestamp,
            e.raw_event.is_none() && e.metadata.is_none(),
        ),
        _ => return Ok(false),
    };
    if !plain {
        return Ok(false);
    }
    out.reserve(48 + id.len() + delta.len());
    out.extend_from_slice(b"data: {\"type\":\"");
    out.extend_from_slice(ty);
    out.extend_from_slice(b"\",\"");
    out.extend_from_slice(id_key);
    out.extend_from_slice(b"\":");
    push_json_str(out, id);
    out.extend_from_slice(b",\"delta\":");
    push_json_str(out, delta);
    if let Some(sub) = sub {
        out.extend_from_slice(b",\"subagentRunId\":");
        push_json_str(out, sub);
    }
    if let Some(ts) = ts {
        out.extend_from_slice(b",\"timestamp\":");
        serde_json::to_writer(&mut *out, &ts)?;
    }
    out.extend_from_slice(b"}\n\n");
    Ok(true)
}

/// Appends `s` to `out` as a JSON string: the bytes `serde_json::to_writer(out, s)` writes
/// (the same escapes: `\"`, `\\`, `\b \f \n \r \t`, `\u00xx` for the other control characters,
/// everything else as it is).
///
/// Written here rather than left to serde_json, whose escaper looks at one byte at a time through
/// `io::Write`: this one skips eight plain bytes at a time (no control character, quote or
/// backslash among them) and copies each plain run with one `extend_from_slice`. It is the SSE
/// encoder's hot path: the `encode` bench measures it (BENCHMARKS.md, issue 16's table).
fn push_json_str(out: &mut Vec<u8>, s: &str) {
    let b = s.as_bytes();
    out.reserve(b.len() + 2);
    out.push(b'"');
    let mut copied = 0;
    let mut i = 0;
    while i < b.len() {
        let rest = &b[i..];
        let (word, n) = match rest.first_chunk::<8>() {
            Some(w) => (*w, 8),
            None => {
                // The last bytes, padded with plain ones.
                let mut w = [b' '; 8];
                w[..rest.len()].copy_from_slice(rest);
                (w, rest.len())
            }
        };
        let special = specials(u64::from_le_bytes(word));
        if special == 0 {
            i += n;
            continue;
        }
        // The lowest flag is exact (a false one can only sit above a true one).
        i += (special.trailing_zeros() / 8) as usize;
        let Some(&c) = b.get(i) else { break };
        out.extend_from_slice(&b[copied..i]);
        push_escape(out, c);
        i += 1;
        copied = i;
    }
    out.extend_from_slice(&b[copied..]);
    out.push(b'"');
}

/// The high bit of each byte of `w` that JSON must escape (a control character, `"` or `\`),
/// eight bytes at once; exact for the lowest such byte.
fn specials(w: u64) -> u64 {
    crate::swar::below(w, 0x20) | crate::swar::equal(w, b'"') | crate::swar::equal(w, b'\\')
}

/// Appends the escape of `c`, a byte [`specials`] flags, as serde_json writes it.
fn push_escape(out: &mut Vec<u8>, c: u8) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let short: &[u8] = match c {
        b'"' => b"\\\"",
        b'\\' => b"\\\\",
        b'\n' => b"\\n",
        b'\r' => b"\\r",
        b'\t' => b"\\t",
        0x08 => b"\\b",
        0x0c => b"\\f",
        _ => {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(c >> 4)]);
            out.push(HEX[usize::from(c & 0xf)]);
            return;
        }
    };
    out.extend_from_slice(short);
}

/// Appends `data: {json}\n\n` for `event` to `out` (LF only, one line of JSON).
pub fn encode_sse_into(event: &AgUiEvent, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    let start = out.len();
    match encode_sse_fast(event, out) {
        Ok(true) => return Ok(()),
        Ok(false) => {}
        Err(e) => {
            out.truncate(start);
            return Err(e);
        }
    }
    out.extend_from_slice(b"data: ");
    if let Err(e) = serde_json::to_writer(&mut *out, event) {
        out.truncate(start);
        return Err(e);
    }
    out.extend_from_slice(b"\n\n");
    Ok(())
}

/// One SSE frame for `event`.
pub fn encode_sse(event: &AgUiEvent) -> Result<Vec<u8>, serde_json::Error> {
    let mut out = Vec::with_capacity(128);
    encode_sse_into(event, &mut out)?;
    Ok(out)
}

/// An SSE comment line, used as a keep-alive (`:\n\n`; ignored by the client).
pub const SSE_KEEP_ALIVE: &[u8] = b":\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation() {
        assert_eq!(Encoding::negotiate(None), Some(Encoding::Sse));
        assert_eq!(
            Encoding::negotiate(Some("text/event-stream")),
            Some(Encoding::Sse)
        );
        assert_eq!(Encoding::negotiate(Some("*/*")), Some(Encoding::Sse));
        assert_eq!(
            Encoding::negotiate(Some("application/vnd.ag-ui.event+proto, text/event-stream")),
            Some(Encoding::Protobuf)
        );
        assert_eq!(
            Encoding::negotiate(Some("application/vnd.ag-ui.event+proto;q=0.5, text/event-stream")),
            Some(Encoding::Sse)
        );
        assert_eq!(
            Encoding::negotiate(Some("application/vnd.ag-ui.event+proto")),
            Some(Encoding::Protobuf)
        );
        assert_eq!(Encoding::negotiate(Some("application/json")), None);
        assert_eq!(Encoding::negotiate(Some("text/event-stream;q=0")), None);
    }

    #[test]
    fn the_fast_path_matches_the_derived_serialization() {
        let mut events = vec![
            AgUiEvent::text_message_content("m1", "a \"quoted\" é\u{1}\n"),
            AgUiEvent::tool_call_args("c1", "{\"a\":"),
            AgUiEvent::reasoning_message_content("r1", ""),
        ];
        let mut with_extras = events.clone();
        for e in &mut with_extras {
            e.set_timestamp(-42);
            if let AgUiEvent::TextMessageContent(t) = e {
                t.subagent_run_id = Some("s1".into());
            }
        }
        events.extend(with_extras);
        for e in &events {
            let mut fast = Vec::new();
            assert!(encode_sse_fast(e, &mut fast).unwrap());
            let slow = format!("data: {}\n\n", serde_json::to_string(e).unwrap());
            assert_eq!(String::from_utf8(fast).unwrap(), slow);
        }
    }

    proptest::proptest! {
        /// The hand-written escaper writes what serde_json writes, for any string: plain runs
        /// longer and shorter than a word, every control character, quotes, backslashes and
        /// multi-byte characters at any offset.
        #[test]
        fn json_strings_are_escaped_as_serde_json_does(
            s in proptest::prop_oneof![
                proptest::prelude::any::<String>(),
                "[\\x00-\\x1f\"\\\\a-z \\x7fé€😀]{0,40}",
            ]
        ) {
            let mut ours = b"prefix".to_vec();
            push_json_str(&mut ours, &s);
            let mut theirs = b"prefix".to_vec();
            serde_json::to_writer(&mut theirs, &s).unwrap();
            proptest::prop_assert_eq!(String::from_utf8_lossy(&ours), String::from_utf8_lossy(&theirs));
        }
    }

    #[test]
    fn sse_frame_is_lf_only() {
        let e = AgUiEvent::text_message_content("m1", "a\r\nb");
        let bytes = encode_sse(&e).unwrap();
        assert_eq!(
            std::str::from_utf8(&bytes).unwrap(),
            "data: {\"type\":\"TEXT_MESSAGE_CONTENT\",\"messageId\":\"m1\",\"delta\":\"a\\r\\nb\"}\n\n"
        );
    }
}
