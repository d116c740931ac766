//! AWS event-stream decoding (`application/vnd.amazon.eventstream`) on top of
//! `aws-smithy-eventstream`, with the prelude checked before its lengths are trusted.
//!
//! A frame whose prelude or message CRC does not match, or whose lengths exceed the reference
//! implementation's bounds (message 16 MiB, headers 128 KiB), is an error: the attempt fails
//! rather than silently losing a delta.

use aws_smithy_eventstream::frame::{DecodedFrame, MessageFrameDecoder};
use aws_smithy_types::event_stream::{HeaderValue, Message};
use bytes::BytesMut;
use serde_json::{Value, json};
use tether::Error;

/// Largest message accepted.
pub const MAX_MESSAGE_LEN: u32 = 16 * 1024 * 1024;
/// Largest header section accepted.
pub const MAX_HEADERS_LEN: u32 = 128 * 1024;

/// One decoded frame.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Frame {
    /// `:message-type: event` — a stream member and its JSON payload.
    Event {
        /// `:event-type` (e.g. `contentBlockDelta`); empty when absent.
        event_type: String,
        /// The JSON payload (`{}` when empty).
        payload: Value,
    },
    /// `:message-type: exception` or `error` — a modeled exception or a stream error.
    Exception {
        /// `:exception-type` or `:error-code`.
        kind: String,
        /// The message from the payload or `:error-message`.
        message: String,
    },
}

impl Frame {
    /// The frame as a Converse-style envelope `{event_type: payload}` (exceptions as
    /// `{"__stream_error__": {"type", "message"}}`).
    pub fn envelope(&self) -> Value {
        match self {
            Frame::Event { event_type, payload } if !event_type.is_empty() => json!({ event_type: payload }),
            Frame::Event { payload, .. } => payload.clone(),
            Frame::Exception { kind, message } => {
                json!({"__stream_error__": {"type": kind, "message": message}})
            }
        }
    }
}

/// Incremental frame decoder.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: BytesMut,
    inner: MessageFrameDecoder,
    mid_frame: bool,
}

fn string_header(m: &Message, name: &str) -> Option<String> {
    m.headers()
        .iter()
        .find(|h| h.name().as_str() == name)
        .and_then(|h| match h.value() {
            HeaderValue::String(s) => Some(s.as_str().to_owned()),
            _ => None,
        })
}

fn malformed(what: impl std::fmt::Display) -> Error {
    Error::malformed(format!("event-stream frame rejected: {what}"))
}

impl FrameDecoder {
    /// A fresh decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether a partial frame is buffered (a stream ending now is truncated mid-frame).
    pub fn has_partial(&self) -> bool {
        self.mid_frame || !self.buf.is_empty()
    }

    /// Feeds bytes; returns the frames they complete.
    pub fn push(&mut self, chunk: &[u8]) -> tether::Result<Vec<Frame>> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        loop {
            if !self.mid_frame {
                if self.buf.len() < 12 {
                    break;
                }
                check_prelude(&self.buf[..12])?;
            }
            match self.inner.decode_frame(&mut self.buf).map_err(malformed)? {
                DecodedFrame::Incomplete => {
                    self.mid_frame = true;
                    break;
                }
                DecodedFrame::Complete(m) => {
                    self.mid_frame = false;
                    out.push(to_frame(&m)?);
                }
            }
        }
        Ok(out)
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn check_prelude(p: &[u8]) -> tether::Result<()> {
    let total = be32(&p[0..4]);
    let headers = be32(&p[4..8]);
    let crc = be32(&p[8..12]);
    if crc32fast::hash(&p[0..8]) != crc {
        return Err(malformed("prelude CRC mismatch"));
    }
    if total > MAX_MESSAGE_LEN || headers > MAX_HEADERS_LEN || total < headers.saturating_add(16) {
        return Err(malformed(format!(
            "implausible lengths (total {total}, headers {headers})"
        )));
    }
    Ok(())
}

fn to_frame(m: &Message) -> tether::Result<Frame> {
    let payload_text = String::from_utf8_lossy(m.payload()).into_owned();
    match string_header(m, ":message-type").as_deref() {
        Some("exception") => {
            let kind = string_header(m, ":exception-type").unwrap_or_else(|| "exception".into());
            let message = serde_json::from_str::<Value>(&payload_text)
                .ok()
                .and_then(|v| {
                    v.get("message")
                        .or_else(|| v.get("Message"))
                        .and_then(Value::as_str)
                        .map(str::to_owned)
                })
                .unwrap_or(payload_text);
            Ok(Frame::Exception { kind, message })
        }
        Some("error") => Ok(Frame::Exception {
            kind: string_header(m, ":error-code").unwrap_or_else(|| "error".into()),
            message: string_header(m, ":error-message").unwrap_or(payload_text),
        }),
        _ => {
            let payload = if payload_text.trim().is_empty() {
                json!({})
            } else {
                serde_json::from_str(&payload_text)
                    .map_err(|e| malformed(format!("payload is not JSON ({e})")))?
            };
            Ok(Frame::Event {
                event_type: string_header(m, ":event-type").unwrap_or_default(),
                payload,
            })
        }
    }
}
