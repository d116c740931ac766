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
//! Here the whole line is read in **one** pass, in three tiers: the canonical form (serde's and the
//! TypeScript SDK's key order, no whitespace, no optional fields) by matching its constant parts
//! and scanning only its three strings; any other plain shape by a hand-written scanner; the rest
//! of the common shape by small borrowed serde structs. Only the text itself (and `_meta`, when
//! present) is allocated, and in a flood not even that: the previous update's box and text buffer
//! are reused once its handler is done with it ([`FastCache::recycle`]).
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
enum ChunkKind {
    #[serde(rename = "user_message_chunk")]
    User,
    #[serde(rename = "agent_message_chunk")]
    Agent,
    #[serde(rename = "agent_thought_chunk")]
    Thought,
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

/// What one decoded update leaves for the next, so a flood does not allocate per update: the last
/// session id seen (an `Arc<str>`; a hit is a string compare and a reference-count increment), and
/// the boxed update and text buffer of the previous update once its handler is done with it.
#[derive(Default)]
pub(crate) struct FastCache {
    session: Option<SessionId>,
    spare: Option<Box<SessionUpdate>>,
    /// The last session found known, with the connection's removal count at the time.
    verified: Option<(SessionId, u64)>,
}

/// A text buffer larger than this is not kept for reuse (one huge chunk must not pin its memory).
const SPARE_TEXT_MAX: usize = 16 * 1024;

impl FastCache {
    fn get(&mut self, id: &str) -> SessionId {
        match &self.session {
            Some(s) if &*s.0 == id => s.clone(),
            _ => {
                let s = SessionId::new(id);
                self.session = Some(s.clone());
                s
            }
        }
    }

    /// Whether `id` was found known while the removal count was `removed` (still true if no
    /// session was removed since).
    pub(crate) fn is_verified(&self, id: &SessionId, removed: u64) -> bool {
        self.verified
            .as_ref()
            .is_some_and(|(s, r)| *r == removed && (std::sync::Arc::ptr_eq(&s.0, &id.0) || s == id))
    }

    pub(crate) fn set_verified(&mut self, id: &SessionId, removed: u64) {
        self.verified = Some((id.clone(), removed));
    }

    /// Takes back a delivered event's allocations (only a text chunk's are reused).
    pub(crate) fn recycle(&mut self, event: SessionUpdateEvent) {
        if let AcpUpdate::Known(mut u) = event.update
            && let SessionUpdate::UserMessageChunk(c)
            | SessionUpdate::AgentMessageChunk(c)
            | SessionUpdate::AgentThoughtChunk(c) = u.as_mut()
            && let ContentBlock::Text(t) = &c.content
            && t.text.capacity() <= SPARE_TEXT_MAX
        {
            self.spare = Some(u);
        }
    }

    /// A box to build the next update in, and a cleared text buffer holding `text`.
    fn boxed_text(&mut self, text: Cow<'_, str>) -> (Option<Box<SessionUpdate>>, String) {
        let Some(mut u) = self.spare.take() else {
            return (None, text.into_owned());
        };
        let mut buf = match u.as_mut() {
            SessionUpdate::UserMessageChunk(c)
            | SessionUpdate::AgentMessageChunk(c)
            | SessionUpdate::AgentThoughtChunk(c) => match &mut c.content {
                ContentBlock::Text(t) => std::mem::take(&mut t.text),
                _ => String::new(),
            },
            _ => String::new(),
        };
        match text {
            Cow::Borrowed(t) => {
                buf.clear();
                buf.push_str(t);
            }
            Cow::Owned(t) => buf = t,
        }
        (Some(u), buf)
    }
}

/// Decodes `line` if it is a text chunk `session/update` of the common shape; `None` means "take
/// the general path" (see the module docs for exactly when).
pub(crate) fn decode_text_chunk(line: &str, sessions: &mut FastCache) -> Option<SessionUpdateEvent> {
    if let Some(c) = scan::canonical(line).or_else(|| scan::scan(line)) {
        let message_id = c.message_id.as_deref();
        return Some(build(
            sessions, &c.session, c.kind, c.text, message_id, None, None, None,
        ));
    }
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
    Some(build(
        sessions,
        &p.session_id,
        u.kind,
        Cow::Owned(u.content.text),
        u.message_id.as_deref(),
        params_meta,
        update_meta,
        content_meta,
    ))
}

#[allow(clippy::too_many_arguments)]
fn build(
    sessions: &mut FastCache,
    session_id: &str,
    kind: ChunkKind,
    text: Cow<'_, str>,
    message_id: Option<&str>,
    params_meta: Option<Meta>,
    update_meta: Option<Meta>,
    content_meta: Option<Meta>,
) -> SessionUpdateEvent {
    // Built in place: the schema's builders would move the ~450-byte chunk once per call.
    let (spare, text) = sessions.boxed_text(text);
    let chunk = ContentChunk::new(ContentBlock::Text(TextContent::new(text)));
    let value = match kind {
        ChunkKind::User => SessionUpdate::UserMessageChunk(chunk),
        ChunkKind::Agent => SessionUpdate::AgentMessageChunk(chunk),
        ChunkKind::Thought => SessionUpdate::AgentThoughtChunk(chunk),
    };
    let mut update = match spare {
        Some(mut b) => {
            *b = value;
            b
        }
        None => Box::new(value),
    };
    if (message_id.is_some() || update_meta.is_some() || content_meta.is_some())
        && let SessionUpdate::UserMessageChunk(c)
        | SessionUpdate::AgentMessageChunk(c)
        | SessionUpdate::AgentThoughtChunk(c) = update.as_mut()
    {
        c.message_id = message_id.map(MessageId::new);
        c.meta = update_meta;
        if let ContentBlock::Text(t) = &mut c.content {
            t.meta = content_meta;
        }
    }
    SessionUpdateEvent {
        session_id: sessions.get(session_id),
        update: AcpUpdate::Known(update),
        meta: params_meta,
    }
}

/// The first tier: a hand-written scanner for the plain case, about three times cheaper than even
/// the borrowed serde structs above (serde_json's per-key and per-string machinery — visitor
/// calls, unit-variant enum matching, scratch handling — dominates for a line of a dozen short
/// strings). It accepts any key order and whitespace, escaped strings (decoded by serde_json) and
/// `null` optional fields; it declines (to the serde structs) anything else: numbers, booleans,
/// a non-null `_meta` or `annotations`, unknown or duplicate keys, control characters in strings,
/// trailing bytes. Declining is always safe, so it only has to be right about what it accepts.
/// The tokens, strings and objects are read by [`tether::json_scan`] (shared with tether-openai's
/// chunk fast path); this module keeps only the shape of the update.
mod scan {
    use std::borrow::Cow;

    use tether::json_scan::{Scan, once};

    use super::ChunkKind;

    pub(super) struct Chunk<'a> {
        pub(super) session: Cow<'a, str>,
        pub(super) kind: ChunkKind,
        pub(super) text: Cow<'a, str>,
        pub(super) message_id: Option<Cow<'a, str>>,
    }

    fn chunk_kind(k: &str) -> Option<ChunkKind> {
        match k {
            "user_message_chunk" => Some(ChunkKind::User),
            "agent_message_chunk" => Some(ChunkKind::Agent),
            "agent_thought_chunk" => Some(ChunkKind::Thought),
            _ => None,
        }
    }

    /// Tier zero: a text chunk in the canonical form (the key order of the schema's structs, as
    /// serde and the TypeScript SDK write it, no whitespace, no optional fields) is matched
    /// against its constant parts with a few `memcmp`s, and only its three strings are scanned.
    /// Everything it accepts is a plain line [`scan`] accepts and decodes the same way; anything
    /// else (another order, whitespace, `messageId`, `_meta`, …) declines to [`scan`].
    pub(super) fn canonical(line: &str) -> Option<Chunk<'_>> {
        const HEAD: &str = r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"#;
        const UPDATE: &str = r#","update":{"sessionUpdate":"#;
        const CONTENT: &str = r#","content":{"type":"text","text":"#;
        const TAIL: &str = "}}}}";
        let mut sc = Scan::new(line);
        sc.lit(HEAD.as_bytes())?;
        let session = sc.string()?;
        sc.lit(UPDATE.as_bytes())?;
        let kind = chunk_kind(&sc.string()?)?;
        sc.lit(CONTENT.as_bytes())?;
        let text = sc.string()?;
        sc.lit(TAIL.as_bytes())?;
        (sc.pos() == line.len()).then_some(Chunk {
            session,
            kind,
            text,
            message_id: None,
        })
    }

    pub(super) fn scan(line: &str) -> Option<Chunk<'_>> {
        let mut sc = Scan::new(line);
        let (mut jsonrpc, mut method, mut params) = (None, None, None);
        sc.object(|sc, k| match &*k {
            "jsonrpc" => once(&mut jsonrpc, sc.string()),
            "method" => once(&mut method, sc.string().filter(|m| m == "session/update")),
            "params" => once(&mut params, scan_params(sc)),
            _ => None,
        })?;
        // Only whitespace may follow (as `serde_json::from_str` requires).
        sc.end()?;
        method?;
        params
    }

    fn scan_params<'a>(sc: &mut Scan<'a>) -> Option<Chunk<'a>> {
        let (mut session, mut update, mut meta) = (None, None, None);
        sc.object(|sc, k| match &*k {
            "sessionId" => once(&mut session, sc.string()),
            "update" => once(&mut update, scan_update(sc)),
            "_meta" => once(&mut meta, sc.null()),
            _ => None,
        })?;
        let (kind, text, message_id) = update?;
        Some(Chunk {
            session: session?,
            kind,
            text,
            message_id,
        })
    }

    type Update<'a> = (ChunkKind, Cow<'a, str>, Option<Cow<'a, str>>);

    fn scan_update<'a>(sc: &mut Scan<'a>) -> Option<Update<'a>> {
        let (mut kind, mut text, mut message_id, mut meta) = (None, None, None, None);
        sc.object(|sc, k| match &*k {
            "sessionUpdate" => once(&mut kind, sc.string().and_then(|k| chunk_kind(&k))),
            "content" => once(&mut text, scan_content(sc)),
            "messageId" => once(&mut message_id, sc.opt_string()),
            "_meta" => once(&mut meta, sc.null()),
            _ => None,
        })?;
        Some((kind?, text?, message_id.flatten()))
    }

    fn scan_content<'a>(sc: &mut Scan<'a>) -> Option<Cow<'a, str>> {
        let (mut kind, mut text, mut annotations, mut meta) = (None, None, None, None);
        sc.object(|sc, k| match &*k {
            "type" => once(&mut kind, sc.string().filter(|t| t == "text")),
            "text" => once(&mut text, sc.string()),
            "annotations" => once(&mut annotations, sc.null()),
            "_meta" => once(&mut meta, sc.null()),
            _ => None,
        })?;
        kind?;
        text
    }
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
        let mut cache = FastCache::default();
        for line in ACCEPTED {
            let fast = decode_text_chunk(line, &mut cache).unwrap_or_else(|| panic!("declined: {line}"));
            let slow = general(line).unwrap_or_else(|| panic!("general path failed: {line}"));
            assert!(matches!(slow.update, AcpUpdate::Known(_)), "{line}");
            assert_eq!(fast, slow, "{line}");
        }
    }

    #[test]
    fn recycled_allocations_leave_nothing_behind() {
        // Each update built in the previous one's box and text buffer (every order of the
        // accepted lines, so each kind, `messageId` and `_meta` follows each other) decodes
        // exactly as a fresh one.
        let mut cache = FastCache::default();
        for first in ACCEPTED {
            for line in ACCEPTED {
                let prev =
                    decode_text_chunk(first, &mut cache).unwrap_or_else(|| panic!("declined: {first}"));
                cache.recycle(prev);
                let fast = decode_text_chunk(line, &mut cache).unwrap_or_else(|| panic!("declined: {line}"));
                assert_eq!(Some(fast.clone()), general(line), "{first} then {line}");
                cache.recycle(fast);
            }
        }
    }

    #[test]
    fn everything_else_takes_the_general_path() {
        let mut cache = FastCache::default();
        for line in DECLINED {
            assert!(decode_text_chunk(line, &mut cache).is_none(), "accepted: {line}");
        }
    }

    #[test]
    fn the_scanner_takes_the_plain_lines_and_agrees_with_the_structs() {
        // Lines without a non-null `_meta` are the scanner's; they must also decode the same
        // through the serde structs (checked against the schema above).
        let plain: Vec<&str> = ACCEPTED
            .iter()
            .copied()
            .filter(|l| !l.contains("\"_meta\":{"))
            .collect();
        assert!(plain.len() >= 5);
        for line in plain {
            assert!(scan::scan(line).is_some(), "the scanner declined: {line}");
        }
        let spaced = " { \"jsonrpc\" : \"2.0\" , \"method\" : \"session/update\" , \"params\" : { \"sessionId\" : \"s1\" , \"update\" : { \"sessionUpdate\" : \"agent_message_chunk\" , \"content\" : { \"type\" : \"text\" , \"text\" : \"x y\" } } } } \t";
        let mut cache = FastCache::default();
        assert!(scan::scan(spaced).is_some());
        assert_eq!(decode_text_chunk(spaced, &mut cache), general(spaced));
        for line in DECLINED {
            assert!(scan::scan(line).is_none(), "the scanner accepted: {line}");
        }
    }

    /// Tier zero takes the canonical lines, and whatever it accepts (also among every one-byte
    /// deletion or insertion) the scanner accepts with the same result.
    #[test]
    fn the_canonical_tier_is_a_subset_of_the_scanner() {
        let same = |line: &str| -> bool {
            let Some(c) = scan::canonical(line) else {
                return false;
            };
            let s = scan::scan(line).unwrap_or_else(|| panic!("the scanner declined: {line}"));
            assert_eq!(
                (&c.session, c.kind as u8, &c.text, &c.message_id),
                (&s.session, s.kind as u8, &s.text, &s.message_id),
                "{line}"
            );
            true
        };
        for line in &ACCEPTED[..3] {
            assert!(same(line), "declined: {line}");
        }
        for line in ACCEPTED[3..].iter().chain(DECLINED) {
            assert!(scan::canonical(line).is_none(), "accepted: {line}");
        }
        let mut accepted = 0;
        for base in ACCEPTED {
            for v in one_byte_mutations(base, b"\"\\ }x,") {
                if let Ok(line) = std::str::from_utf8(&v)
                    && same(line)
                {
                    accepted += 1;
                }
            }
        }
        assert!(accepted > 50, "{accepted}");
    }

    /// Every one-byte deletion or insertion in a few lines: whatever the fast path accepts, it
    /// decodes exactly as the general path does.
    #[test]
    fn mutated_lines_are_decoded_as_the_schema_does_or_declined() {
        let mut cache = FastCache::default();
        let mut accepted = 0;
        let mut checked = 0;
        for base in ACCEPTED {
            let inserts = [b' ', b'"', b'\\', b',', b'{', b'}', b':', b'x', b'\n', 0x01];
            for v in one_byte_mutations(base, &inserts) {
                let Ok(line) = std::str::from_utf8(&v) else {
                    continue;
                };
                checked += 1;
                if let Some(fast) = decode_text_chunk(line, &mut cache) {
                    accepted += 1;
                    assert_eq!(Some(fast), general(line), "{line}");
                }
            }
        }
        assert!(checked > 10_000 && accepted > 100, "{checked} {accepted}");
    }

    /// `line` with each byte deleted, and with each of `inserts` put before each byte and at the
    /// end.
    fn one_byte_mutations(line: &str, inserts: &[u8]) -> Vec<Vec<u8>> {
        let bytes = line.as_bytes();
        let mut out = Vec::new();
        for i in 0..=bytes.len() {
            if i < bytes.len() {
                out.push([&bytes[..i], &bytes[i + 1..]].concat());
            }
            for &b in inserts {
                out.push([&bytes[..i], &[b], &bytes[i..]].concat());
            }
        }
        out
    }

    #[test]
    fn the_session_id_cache_follows_the_line() {
        let mut cache = FastCache::default();
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
