//! Wire encoders: SSE (`text/event-stream`) and protobuf
//! (`application/vnd.ag-ui.event+proto`), and `Accept` negotiation between them.

use crate::event::Event;

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
    pub fn encode_into(self, event: &Event, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
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

/// Appends `data: {json}\n\n` for `event` to `out` (LF only, one line of JSON).
pub fn encode_sse_into(event: &Event, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    let start = out.len();
    out.extend_from_slice(b"data: ");
    if let Err(e) = serde_json::to_writer(&mut *out, event) {
        out.truncate(start);
        return Err(e);
    }
    out.extend_from_slice(b"\n\n");
    Ok(())
}

/// One SSE frame for `event`.
pub fn encode_sse(event: &Event) -> Result<Vec<u8>, serde_json::Error> {
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
            Encoding::negotiate(Some(
                "application/vnd.ag-ui.event+proto, text/event-stream"
            )),
            Some(Encoding::Protobuf)
        );
        assert_eq!(
            Encoding::negotiate(Some(
                "application/vnd.ag-ui.event+proto;q=0.5, text/event-stream"
            )),
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
    fn sse_frame_is_lf_only() {
        let e = Event::text_message_content("m1", "a\r\nb");
        let bytes = encode_sse(&e).unwrap();
        assert_eq!(
            std::str::from_utf8(&bytes).unwrap(),
            "data: {\"type\":\"TEXT_MESSAGE_CONTENT\",\"messageId\":\"m1\",\"delta\":\"a\\r\\nb\"}\n\n"
        );
    }
}
