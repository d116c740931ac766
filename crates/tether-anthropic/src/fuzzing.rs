//! Entry points for the fuzz targets in `fuzz/` and the corpus replay tests. **Not part of the
//! API**: hidden from the docs, free to change with the targets.
//!
//! - [`check_messages_stream`]: a Messages SSE body through the SSE decoder and the stream
//!   assembly of [`MessagesModel`](crate::MessagesModel), cut into reads every way
//!   [`tether::fuzzing::splits`] cuts it; the same bytes as a whole (non-streamed) message.
//! - [`check_managed_stream`]: a Managed Agents event stream through the decoder and the event
//!   mapping of [`ManagedAgents`](crate::ManagedAgents).
//! - [`check_streamed_arguments`]: tool input streamed as `input_json_delta` fragments.

use serde_json::{Value, json};
use tether::fuzzing::{Live, Recorder, block_on, splits};
use tether::{ChatResponse, Event};

use crate::sse::{SseDecoder, SseFrame};
use crate::{managed, messages};

/// Every frame the decoder completes from `reads`.
fn frames(reads: &[&[u8]]) -> Vec<SseFrame> {
    let mut dec = SseDecoder::new();
    let mut out = Vec::new();
    for r in reads {
        out.extend(dec.push(r));
    }
    out
}

/// The SSE decoder: the same frames however the body is cut.
pub fn check_sse(body: &[u8]) {
    let all = splits(body);
    let reference = frames(&all[0]);
    for reads in &all[1..] {
        assert_eq!(frames(reads), reference, "cut into {} reads", reads.len());
    }
}

/// What a client sees of one call: the live deltas, then the response (as JSON) or the error.
#[derive(Debug, PartialEq)]
struct Outcome {
    live: Live,
    result: Result<Value, String>,
}

fn outcome(live: Live, r: tether::Result<ChatResponse>) -> Outcome {
    Outcome {
        live,
        result: r
            .map(|r| serde_json::to_value(&r).unwrap_or(Value::Null))
            .map_err(|e| e.to_string()),
    }
}

fn stream(reads: &[&[u8]]) -> Outcome {
    let (deltas, rec) = Recorder::delta_sink();
    let r = block_on(messages::fuzzing::stream(reads, &deltas));
    outcome(rec.live(), r)
}

/// A Messages stream: never a panic; the same deltas and the same response (or error) however
/// the body is cut into reads. The same bytes as a whole message: a response or a typed error.
pub fn check_messages_stream(body: &[u8]) {
    check_sse(body);
    let all = splits(body);
    let reference = stream(&all[0]);
    for reads in &all[1..] {
        assert_eq!(stream(reads), reference, "cut into {} reads", reads.len());
    }
    let (deltas, _) = Recorder::delta_sink();
    let _ = block_on(messages::fuzzing::whole(&String::from_utf8_lossy(body), &deltas));
}

/// What the provider makes of each frame, up to the first error (which ends the turn).
fn managed_events(reads: &[&[u8]]) -> Vec<Result<(Event, String), String>> {
    let mut out = Vec::new();
    for f in frames(reads) {
        match managed::fuzzing::frame(&f) {
            None => {}
            Some(Ok(e)) => out.push(Ok(e)),
            Some(Err(e)) => {
                out.push(Err(e.to_string()));
                break;
            }
        }
    }
    out
}

/// A Managed Agents event stream: never a panic; the same events, boundaries and error however
/// it is cut; every event survives the JSON round trip the store puts it through.
pub fn check_managed_stream(body: &[u8]) {
    let all = splits(body);
    let reference = managed_events(&all[0]);
    for reads in &all[1..] {
        assert_eq!(managed_events(reads), reference, "cut into {} reads", reads.len());
    }
    for (event, _) in reference.iter().flatten() {
        let text = serde_json::to_string(event).expect("an event serializes");
        let back: Event = serde_json::from_str(&text).expect("a serialized event decodes");
        assert_eq!(&back, event, "the JSON round trip changed the event");
    }
}

/// Tool input streamed as `input_json_delta` fragments (as `splits` cuts the text, on character
/// boundaries): the call's arguments are the text whole, shown live whole, and the tool use is
/// what [`tether::ToolUse::from_arguments`] makes of it.
pub fn check_streamed_arguments(args: &str) {
    let expected = tether::fuzzing::expected_tool_use("toolu_1", "probe", args);
    for pieces in splits(args.as_bytes()) {
        let mut frags: Vec<&str> = Vec::new();
        let (mut at, mut end) = (0, 0);
        for p in pieces {
            end += p.len();
            if args.is_char_boundary(end) {
                frags.push(&args[at..end]);
                at = end;
            }
        }
        let ev = |name: &str, v: Value| format!("event: {name}\ndata: {v}\n\n");
        let mut body = ev(
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "usage": {"input_tokens": 1}}}),
        );
        body.push_str(&ev(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "probe", "input": {}}}),
        ));
        for f in frags {
            body.push_str(&ev(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": f}}),
            ));
        }
        body.push_str(&ev(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ));
        body.push_str(&ev(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 1}}),
        ));
        body.push_str(&ev("message_stop", json!({"type": "message_stop"})));
        let (deltas, rec) = Recorder::delta_sink();
        let resp = block_on(messages::fuzzing::stream(&[body.as_bytes()], &deltas))
            .unwrap_or_else(|e| panic!("a well-formed tool_use stream failed: {e}"));
        let calls = &resp.message.tool_calls;
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].arguments, args, "the arguments came out changed");
        assert_eq!(calls[0].to_tool_use(), expected);
        let live = rec.live();
        assert_eq!(live.calls.len(), 1);
        assert_eq!(live.calls[0].2, args, "the live arguments");
        assert_eq!(live.calls[0].3, 1, "the call ended once");
    }
}
