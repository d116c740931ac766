//! The parsing half of [`MessagesModel::chat`](super::MessagesModel) without the HTTP, for the
//! crate's `fuzzing` module (not part of the API): the same reader and assembler `chat` uses.

use tether::{ChatResponse, DeltaSink, Error};

use super::{StreamReader, assemble_whole};

/// Fuzz inputs are bounded by libFuzzer; the cap here is the default.
const MAX: usize = tether::chat::DEFAULT_MAX_RESPONSE_BYTES;

/// A streamed body arriving in `reads`, as `chat` reads it with `stream(true)`.
pub(crate) async fn stream(reads: &[&[u8]], deltas: &DeltaSink) -> tether::Result<ChatResponse> {
    let mut reader = StreamReader::new(MAX);
    for chunk in reads {
        if let Some(done) = reader.push(chunk, deltas).await? {
            return Ok(done);
        }
    }
    Err(Error::transport(
        tether::TransportKind::Closed,
        "the Messages stream ended before message_stop",
        "fuzz",
    ))
}

/// A whole message body, as `chat` reads it with `stream(false)`.
pub(crate) async fn whole(text: &str, deltas: &DeltaSink) -> tether::Result<ChatResponse> {
    assemble_whole(text.as_bytes(), MAX, "fuzz", deltas).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `anthropic_messages` fuzz target: a `content_block` that is not an object
    /// (here a string) made the next text delta panic inside serde_json's `IndexMut` ("cannot
    /// access key \"text\" in JSON string"), taking the session's task down. It is now a typed
    /// `Malformed` error, which names the block.
    #[tokio::test]
    async fn a_content_block_that_is_not_an_object_is_malformed_not_a_panic() {
        for block in ["\"x\"", "5", "[1]", "null", "true"] {
            let body = format!(
                "event: content_block_start\ndata: {{\"type\":\"content_block_start\",\"index\":0,\"content_block\":{block}}}\n\n\
                 event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"a\"}}}}\n\n\
                 event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"citations_delta\",\"citation\":{{}}}}}}\n\n"
            );
            let r = stream(&[body.as_bytes()], &DeltaSink::discard()).await;
            assert!(
                matches!(&r, Err(Error::Malformed { message: m, .. }) if m.contains("content block object")),
                "{block}: {r:?}"
            );
        }
    }
}
