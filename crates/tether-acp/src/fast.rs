//! Fast path for the one message an agent floods: a `session/update` notification whose update is a
//! text `user_message_chunk`, `agent_message_chunk` or `agent_thought_chunk`.
//!
//! # Why not the schema crate's typed decode
//!
//! The general path decodes a line three times: the JSON-RPC envelope (`params` captured raw), the
//! `session/update` params (`update` captured raw), then the update as the schema crate's
//! [`SessionUpdate`]. That last step is the expensive one: `SessionUpdate` and `ContentBlock` are
//! internally tagged enums, so serde first buffers the whole update into its private `Content`
//! tree (every key and string copied into an allocation), finds the tag, then deserializes the
//! variant again from the buffer; the `DefaultOnError` fields (`messageId`, `_meta`,
//! `annotations`) buffer once more. Profiled on a flood of ~190-byte chunks that is about 2 µs per
//! update, against ~70–140 ns to split the same line off a pipe.
//!
//! Here the whole line is read in **one** pass by small borrowed structs that mirror exactly the
//! common shape of a text chunk; only the text itself (and `_meta`, when present) is allocated.
//!
//! # Why it is exact
//!
//! The fast decoder only ever *accepts* messages whose typed decode it reproduces; for anything
//! else it returns `None` and the caller takes the general path, which then produces the same
//! result (or the same error) as before. Concretely it declines when:
//! - the line has a key this shape does not name (`id`, `result`, an unknown field at any level —
//!   `deny_unknown_fields`), a duplicate key, or a required field missing;
//! - the method is not `session/update`, the kind is not one of the three chunk kinds, or the
//!   content type is not `text`;
//! - `annotations` is present and not `null` (the general path decodes it, or drops it on error);
//! - `messageId` is neither a string nor `null`, or a `_meta` is neither an object nor `null`
//!   (where the schema would silently default, or the params decode would fail).
//!
//! Within that accepted set the result is field for field what the schema crate builds:
//! `messageId`/`_meta` string/object → `Some`, `null`/absent → `None`. Unknown fields are never
//! dropped silently: a line that has any takes the general path (and the raw line is handed to
//! the handler on both paths).

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;

use crate::handler::{AcpUpdate, SessionUpdateEvent};
use crate::schema::{ContentBlock, ContentChunk, MessageId, Meta, SessionId, SessionUpdate, TextContent};

#[derive(Deserialize)]
enum Method {
    #[serde(rename = "session/update")]
    SessionUpdate,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum ChunkKind {
    UserMessageChunk,
    AgentMessageChunk,
    AgentThoughtChunk,
}

#[derive(Deserialize)]
enum ContentType {
    #[serde(rename = "text")]
    Text,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line<'a> {
    #[serde(default, rename = "jsonrpc")]
    _jsonrpc: IgnoredAny,
    #[serde(rename = "method")]
    _method: Method,
    #[serde(borrow)]
    params: Params<'a>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Params<'a> {
    #[serde(rename = "sessionId", borrow)]
    session_id: Cow<'a, str>,
    #[serde(borrow)]
    update: Update<'a>,
    #[serde(default, rename = "_meta", borrow)]
    meta: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Update<'a> {
    #[serde(rename = "sessionUpdate")]
    kind: ChunkKind,
    content: Content<'a>,
    #[serde(default, rename = "messageId", borrow)]
    message_id: Option<Cow<'a, str>>,
    #[serde(default, rename = "_meta", borrow)]
    meta: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Content<'a> {
    #[serde(rename = "type")]
    _type: ContentType,
    text: String,
    #[serde(default, borrow)]
    annotations: Option<&'a RawValue>,
    #[serde(default, rename = "_meta", borrow)]
    meta: Option<&'a RawValue>,
}

/// The last session id seen, so a flood for one session does not allocate a [`SessionId`] per
/// update (it is an `Arc<str>`; a hit is a string compare and a reference-count increment).
#[derive(Default)]
pub(crate) struct SessionIdCache(Option<SessionId>);

impl SessionIdCache {
    fn get(&mut self, id: &str) -> SessionId {
        match &self.0 {
            Some(s) if &*s.0 == id => s.clone(),
            _ => {
                let s = SessionId::new(id);
                self.0 = Some(s.clone());
                s
            }
        }
    }
}

/// Decodes `line` if it is a text chunk `session/update` of the common shape; `None` means "take
/// the general path" (see the module docs for exactly when).
pub(crate) fn decode_text_chunk(line: &str, sessions: &mut SessionIdCache) -> Option<SessionUpdateEvent> {
    let l: Line<'_> = serde_json::from_str(line).ok()?;
    let p = l.params;
    let u = p.update;
    if u.content.annotations.is_some() {
        return None;
    }
    // The `_meta`s are captured raw (keeping the structs above small and cheap to move); a
    // non-null one must be an object, else decline.
    let meta = |raw: Option<&RawValue>| -> Result<Option<Meta>, ()> {
        raw.map(|r| serde_json::from_str::<Meta>(r.get()).map_err(|_| ()))
            .transpose()
    };
    let (params_meta, update_meta, content_meta) =
        (meta(p.meta).ok()?, meta(u.meta).ok()?, meta(u.content.meta).ok()?);
    // Built in place: the schema's builders would move the ~450-byte chunk once per call.
    let chunk = ContentChunk::new(ContentBlock::Text(TextContent::new(u.content.text)));
    let mut update = Box::new(match u.kind {
        ChunkKind::UserMessageChunk => SessionUpdate::UserMessageChunk(chunk),
        ChunkKind::AgentMessageChunk => SessionUpdate::AgentMessageChunk(chunk),
        ChunkKind::AgentThoughtChunk => SessionUpdate::AgentThoughtChunk(chunk),
    });
    if u.message_id.is_some() || update_meta.is_some() || content_meta.is_some() {
        if let SessionUpdate::UserMessageChunk(c)
        | SessionUpdate::AgentMessageChunk(c)
        | SessionUpdate::AgentThoughtChunk(c) = update.as_mut()
        {
            c.message_id = u.message_id.map(|id| MessageId::new(id.as_ref()));
            c.meta = update_meta;
            if let ContentBlock::Text(t) = &mut c.content {
                t.meta = content_meta;
            }
        }
    }
    Some(SessionUpdateEvent {
        session_id: sessions.get(&p.session_id),
        update: AcpUpdate::Known(update),
        meta: params_meta,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connection::parse_update;

    /// The general path: what `dispatch_line` does for a notification.
    fn general(line: &str) -> Option<SessionUpdateEvent> {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        if v.get("id").is_some() || v.get("method")?.as_str()? != "session/update" {
            return None;
        }
        let params = serde_json::to_string(v.get("params")?).ok()?;
        parse_update(&params).ok()
    }

    const ACCEPTED: &[&str] = &[
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"hi"}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_thought_chunk","content":{"type":"text","text":"hmm"}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"user_message_chunk","content":{"type":"text","text":"q"}}}}"#,
        // Key order does not matter; escapes are decoded.
        r#"{"params":{"update":{"content":{"text":"a\"b\\n\u00e9\n","type":"text"},"sessionUpdate":"agent_message_chunk"},"sessionId":"s\u0031"},"method":"session\/update","jsonrpc":"2.0"}"#,
        // Optional fields, present and null.
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","_meta":{"a":1},"update":{"sessionUpdate":"agent_message_chunk","messageId":"m1","_meta":{"b":[1,2.5,"x"]},"content":{"type":"text","text":"hi","annotations":null,"_meta":{"c":null}}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","_meta":null,"update":{"sessionUpdate":"agent_message_chunk","messageId":null,"_meta":null,"content":{"type":"text","text":"","_meta":null}}}}"#,
        // No `jsonrpc` at all (the general path does not check it either).
        r#"{"method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"x"}}}}"#,
    ];

    const DECLINED: &[&str] = &[
        // Requests and responses.
        r#"{"jsonrpc":"2.0","id":1,"method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"hi"}}}}"#,
        r#"{"jsonrpc":"2.0","id":1,"result":{}}"#,
        // Other methods, kinds and content types.
        r#"{"jsonrpc":"2.0","method":"session/updatex","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"hi"}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"tool_call","toolCallId":"c","title":"t"}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"image","data":"x","mimeType":"image/png"}}}}"#,
        // Unknown fields at every level (the general path keeps or ignores them; raw stays available).
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"known"},"extraField":42}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","x":1,"update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"k"}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","x":1,"params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"k"}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"k","x":1}}}}"#,
        // Fields the schema decodes leniently or in full.
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"k","annotations":{"priority":1}}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","messageId":7,"content":{"type":"text","text":"k"}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","_meta":[1],"content":{"type":"text","text":"k"}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"k","_meta":"x"}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","_meta":5,"update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"k"}}}}"#,
        // Missing or duplicate fields, wrong types, bad JSON.
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk"}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"a","text":"b"}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","sessionUpdate":"agent_thought_chunk","content":{"type":"text","text":"a"}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":2,"update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"a"}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":5}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"\ud800"}}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"a"}}}"#,
        r#"{"jsonrpc":"2.0","method":"session/update","params":null}"#,
        "not json",
    ];

    #[test]
    fn accepted_lines_decode_exactly_as_the_schema_does() {
        let mut cache = SessionIdCache::default();
        for line in ACCEPTED {
            let fast = decode_text_chunk(line, &mut cache).unwrap_or_else(|| panic!("declined: {line}"));
            let slow = general(line).unwrap_or_else(|| panic!("general path failed: {line}"));
            assert!(matches!(slow.update, AcpUpdate::Known(_)), "{line}");
            assert_eq!(fast, slow, "{line}");
        }
    }

    #[test]
    fn everything_else_takes_the_general_path() {
        let mut cache = SessionIdCache::default();
        for line in DECLINED {
            assert!(decode_text_chunk(line, &mut cache).is_none(), "accepted: {line}");
        }
    }

    #[test]
    fn the_session_id_cache_follows_the_line() {
        let mut cache = SessionIdCache::default();
        let line = |s: &str| {
            format!(
                r#"{{"method":"session/update","params":{{"sessionId":"{s}","update":{{"sessionUpdate":"agent_message_chunk","content":{{"type":"text","text":"x"}}}}}}}}"#
            )
        };
        for s in ["a", "a", "b", "a"] {
            let e = decode_text_chunk(&line(s), &mut cache).map(|e| e.session_id);
            assert_eq!(e, Some(SessionId::new(s)));
        }
    }
}
