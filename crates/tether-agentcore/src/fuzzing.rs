//! Entry points for the fuzz targets in `fuzz/` and the corpus replay tests. **Not part of the
//! API**: hidden from the docs, free to change with the targets.
//!
//! - [`check_eventstream`]: an `application/vnd.amazon.eventstream` body (raw bytes, or frames
//!   described by the input and encoded with valid CRCs, so the fuzzer reaches past the
//!   checksums) through [`FrameDecoder`] cut every way [`tether::fuzzing::splits`] cuts it, and
//!   the events through the turn [`Fold`].
//! - [`check_runtime_body`]: a runtime container's SSE or JSON body through the provider's
//!   payload splitter and event mapping, and the fold.
//! - [`check_streamed_arguments`]: tool input streamed as `toolUse.input` fragments.

use serde_json::{Value, json};
use tether::fuzzing::splits;

use crate::converse::Fold;
use crate::eventstream::{Frame, FrameDecoder};
use crate::provider;

/// Encodes one event-stream message with string headers (the reference encoding, CRCs valid).
pub fn encode(headers: &[(&str, &str)], payload: &[u8]) -> Vec<u8> {
    let mut h = Vec::new();
    for (name, value) in headers {
        let name = &name.as_bytes()[..name.len().min(255)];
        let value = &value.as_bytes()[..value.len().min(u16::MAX as usize)];
        h.push(name.len() as u8);
        h.extend_from_slice(name);
        h.push(7);
        h.extend_from_slice(&(value.len() as u16).to_be_bytes());
        h.extend_from_slice(value);
    }
    let total = (16 + h.len() + payload.len()) as u32;
    let mut out = Vec::with_capacity(total as usize);
    out.extend_from_slice(&total.to_be_bytes());
    out.extend_from_slice(&(h.len() as u32).to_be_bytes());
    let prelude_crc = crc32fast::hash(&out);
    out.extend_from_slice(&prelude_crc.to_be_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(payload);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_be_bytes());
    out
}

/// The body an input describes. A first byte with its low bit clear: the rest, raw. Set: a list
/// of frames, each `kind, type length, type, payload length (2 bytes), payload`, where kind
/// chooses an event, an exception, an error, an event with a broken CRC, or raw bytes.
pub fn body_of(data: &[u8]) -> Vec<u8> {
    let Some((&mode, mut rest)) = data.split_first() else {
        return Vec::new();
    };
    if mode & 1 == 0 {
        return rest.to_vec();
    }
    let mut out = Vec::new();
    let take = |rest: &mut &[u8], n: usize| -> Vec<u8> {
        let n = n.min(rest.len());
        let (a, b) = rest.split_at(n);
        *rest = b;
        a.to_vec()
    };
    while let Some((&kind, r)) = rest.split_first() {
        rest = r;
        let tlen = take(&mut rest, 1).first().copied().unwrap_or(0) as usize;
        let ty = String::from_utf8_lossy(&take(&mut rest, tlen)).into_owned();
        let plen = take(&mut rest, 2);
        let plen = plen.iter().fold(0usize, |n, &b| n << 8 | b as usize);
        let payload = take(&mut rest, plen);
        let frame = match kind % 5 {
            0 => encode(
                &[
                    (":message-type", "event"),
                    (":event-type", &ty),
                    (":content-type", "application/json"),
                ],
                &payload,
            ),
            1 => encode(
                &[(":message-type", "exception"), (":exception-type", &ty)],
                &payload,
            ),
            2 => encode(
                &[
                    (":message-type", "error"),
                    (":error-code", &ty),
                    (":error-message", &String::from_utf8_lossy(&payload)),
                ],
                b"",
            ),
            3 => {
                let mut f = encode(&[(":message-type", "event"), (":event-type", &ty)], &payload);
                let at = f.len().saturating_sub(5);
                if let Some(b) = f.get_mut(at) {
                    *b ^= 0x20;
                }
                f
            }
            _ => payload,
        };
        out.extend_from_slice(&frame);
    }
    out
}

/// The frames `reads` decode to, and the error that stopped decoding, if any; and whether a
/// partial frame was left.
fn decode(reads: &[&[u8]]) -> (Vec<Frame>, Option<String>, bool) {
    let mut dec = FrameDecoder::new();
    let mut frames = Vec::new();
    for r in reads {
        match dec.push(r) {
            Ok(f) => frames.extend(f),
            Err(e) => return (frames, Some(e.to_string()), dec.has_partial()),
        }
    }
    let partial = dec.has_partial();
    (frames, None, partial)
}

/// The turn fold over `events`, with its invariants checked.
fn fold(events: &[(String, Value)]) -> Fold {
    let mut f = Fold::default();
    let mut text = String::new();
    for (ty, p) in events {
        if let Some(t) = f.apply(ty, p) {
            text.push_str(&t);
        }
    }
    assert_eq!(text, f.text, "the live text is not the folded text");
    let mut ids: Vec<&str> = f.tools.iter().map(|t| t.id.as_str()).collect();
    ids.sort_unstable();
    let n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), n, "two tool uses with one id");
    let msg = f.assistant_message();
    for block in msg["content"].as_array().into_iter().flatten() {
        if let Some(u) = block.get("toolUse") {
            assert!(
                u["input"].is_object(),
                "a resumed toolUse input is not an object: {u}"
            );
        }
    }
    let _ = f.terminal();
    f
}

/// An event-stream body: never a panic; the same frames (or the same error) however it is cut
/// into reads; the events fold with the live text equal to the folded text, tool use ids unique,
/// and every input sent back an object.
pub fn check_eventstream(data: &[u8]) {
    let body = body_of(data);
    let all = splits(&body);
    let (frames, error, partial) = decode(&all[0]);
    for reads in &all[1..] {
        let (f, e, p) = decode(reads);
        match (&error, &e) {
            (None, None) => {
                assert_eq!(f, frames, "cut into {} reads", reads.len());
                assert_eq!(p, partial, "partial frame, cut into {} reads", reads.len());
            }
            (Some(a), Some(b)) => assert_eq!(a, b, "a different error, cut into {} reads", reads.len()),
            _ => panic!("cut into {} reads: error {e:?}, whole: {error:?}", reads.len()),
        }
    }
    let events: Vec<(String, Value)> = frames
        .iter()
        .filter_map(|f| match f {
            Frame::Event { event_type, payload } => Some((event_type.clone(), payload.clone())),
            _ => None,
        })
        .collect();
    for f in &frames {
        let _ = f.envelope();
    }
    fold(&events);
}

/// A runtime container's body: as SSE, the same payloads however it is cut into reads; as SSE
/// and as JSON, events that fold with their invariants. Never a panic.
pub fn check_runtime_body(body: &[u8]) {
    let all = splits(body);
    let reference = provider::fuzzing::sse_payloads(&all[0]);
    for reads in &all[1..] {
        assert_eq!(
            provider::fuzzing::sse_payloads(reads),
            reference,
            "cut into {} reads, the SSE body split into other payloads",
            reads.len()
        );
    }
    let events: Vec<(String, Value)> = reference
        .iter()
        .flat_map(|d| provider::fuzzing::events_of_payload(d))
        .collect();
    fold(&events);
    fold(&provider::fuzzing::events_of_json(body));
}

/// Tool input streamed as `toolUse.input` fragments of one content block (as `splits` cuts the
/// text, on character boundaries): the tool use is what [`tether::ToolUse::from_arguments`]
/// makes of the whole text.
pub fn check_streamed_arguments(args: &str) {
    let expected = tether::fuzzing::expected_tool_use("tu_1", "probe", args);
    for pieces in splits(args.as_bytes()) {
        let mut events = vec![
            ("messageStart".to_owned(), json!({"role": "assistant"})),
            (
                "contentBlockStart".to_owned(),
                json!({"contentBlockIndex": 1, "start": {"toolUse": {"toolUseId": "tu_1", "name": "probe"}}}),
            ),
        ];
        let (mut at, mut end) = (0, 0);
        for p in pieces {
            end += p.len();
            if args.is_char_boundary(end) {
                events.push((
                    "contentBlockDelta".to_owned(),
                    json!({"contentBlockIndex": 1, "delta": {"toolUse": {"input": &args[at..end]}}}),
                ));
                at = end;
            }
        }
        events.push(("contentBlockStop".to_owned(), json!({"contentBlockIndex": 1})));
        events.push(("messageStop".to_owned(), json!({"stopReason": "tool_use"})));
        let f = fold(&events);
        assert_eq!(f.tool_uses(), vec![expected.clone()]);
    }
}
