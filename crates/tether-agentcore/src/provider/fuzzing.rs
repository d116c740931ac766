//! How [`AgentCore`](super::AgentCore) reads a runtime container's body, without the HTTP, for
//! the crate's `fuzzing` module (not part of the API).

use serde_json::Value;

use super::{SseLines, runtime_events, runtime_json};

/// The `data:` payloads of an SSE body arriving in `reads`, as `attempt` splits them.
pub(crate) fn sse_payloads(reads: &[&[u8]]) -> Vec<String> {
    let mut sse = SseLines::default();
    reads.iter().flat_map(|r| sse.push(r)).collect()
}

/// The Converse events `attempt` makes of one SSE payload.
pub(crate) fn events_of_payload(data: &str) -> Vec<(String, Value)> {
    runtime_events(data)
}

/// The Converse events `attempt` makes of a whole JSON body.
pub(crate) fn events_of_json(body: &[u8]) -> Vec<(String, Value)> {
    let v: Value = serde_json::from_slice(body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()));
    runtime_json(&v)
}

