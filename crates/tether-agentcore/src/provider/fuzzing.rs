//! How [`AgentCore`](super::AgentCore) reads a runtime container's body, without the HTTP, for
//! the crate's `fuzzing` module (not part of the API).

use serde_json::Value;

use tether_http::sse::SseDecoder;

use super::{runtime_events, runtime_json};

/// The `data:` payloads of an SSE body arriving in `reads`, as `attempt` splits them.
pub(crate) fn sse_payloads(reads: &[&[u8]]) -> Vec<String> {
    let mut sse = SseDecoder::new();
    reads.iter().flat_map(|r| sse.push(r)).map(|f| f.data).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `agentcore_runtime` fuzz target: a read ending inside a UTF-8 character
    /// turned it into two U+FFFD, and one ending between CR and LF lost the frame.
    #[test]
    fn a_frame_is_the_same_wherever_the_reads_end() {
        let body = "data: w\u{f6}rld \u{1f600}\r\n\r\ndata: {\"a\":1}\r\ndata: 2\n\n".as_bytes();
        let whole = sse_payloads(&[body]);
        assert_eq!(whole, ["w\u{f6}rld \u{1f600}", "{\"a\":1}\n2"]);
        for i in 0..=body.len() {
            for j in i..=body.len() {
                let reads = [&body[..i], &body[i..j], &body[j..]];
                assert_eq!(sse_payloads(&reads), whole, "cut at {i} and {j}");
            }
        }
    }
}
