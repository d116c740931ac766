//! The parsing half of [`MessagesModel::chat`](super::MessagesModel) without the HTTP, for the
//! crate's `fuzzing` module (not part of the API). Each function is the body of `chat` after the
//! response arrived, line for line: keep them in step.

use serde_json::Value;
use tether::{ChatResponse, DeltaSink, Error};

use super::{Assembly, replay_events};
use crate::http::stream_error;
use crate::sse::SseDecoder;

/// A streamed body arriving in `reads`, as `chat` reads it with `stream(true)`.
pub(crate) async fn stream(reads: &[&[u8]], deltas: &DeltaSink) -> tether::Result<ChatResponse> {
    let mut dec = SseDecoder::new();
    let mut asm = Assembly::default();
    for chunk in reads {
        for frame in dec.push(chunk) {
            if frame.data.is_empty() {
                continue;
            }
            let data: Value = serde_json::from_str(&frame.data).map_err(|e| {
                Error::Malformed(format!(
                    "a Messages stream event is not JSON ({e}): {}",
                    frame.data
                ))
            })?;
            let kind = frame
                .event
                .clone()
                .or_else(|| data["type"].as_str().map(str::to_owned))
                .unwrap_or_default();
            asm.on_event(&kind, &data, deltas).await?;
            if asm.done {
                return Ok(asm.finish());
            }
        }
    }
    Err(Error::Transport {
        kind: tether::TransportKind::Closed,
        message: "the Messages stream ended before message_stop".into(),
        endpoint: "fuzz".into(),
    })
}

/// A whole message body, as `chat` reads it with `stream(false)`.
pub(crate) async fn whole(text: &str, deltas: &DeltaSink) -> tether::Result<ChatResponse> {
    let msg: Value = serde_json::from_str(text)
        .map_err(|e| Error::Malformed(format!("answered with a message that is not JSON ({e})")))?;
    if msg["type"] == "error" {
        return Err(stream_error(&msg));
    }
    if !msg["content"].is_array() {
        return Err(Error::Malformed(format!(
            "answered without a content array: {msg}"
        )));
    }
    let mut asm = Assembly::default();
    for (kind, data) in replay_events(&msg) {
        asm.on_event(kind, &data, deltas).await?;
    }
    let originals = msg["content"].as_array().cloned().unwrap_or_default();
    for ((_, b), original) in asm.blocks.iter_mut().zip(originals) {
        b.block = original;
        b.json_seen = false;
    }
    Ok(asm.finish())
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
                matches!(&r, Err(Error::Malformed(m)) if m.contains("content block object")),
                "{block}: {r:?}"
            );
        }
    }
}
