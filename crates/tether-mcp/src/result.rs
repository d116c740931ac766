//! A `tools/call` result as the text the model sees: nothing silently dropped.

use rmcp::model::{CallToolResult, ContentBlock};
use serde_json::Value;
use tether::ToolOutput;

/// The most text a result becomes; the rest is cut with a note saying how much.
pub(crate) const RESULT_CAP: usize = 256 * 1024;

/// Cuts `s` to at most `max` bytes (on a character boundary), saying how much was cut.
pub(crate) fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}\n[… {} more bytes not shown]", &s[..cut], s.len() - cut)
}

fn base64_len(data: &str) -> usize {
    let d = data.trim_end_matches('=').len();
    d * 3 / 4
}

/// One content block as text. Text is kept; what the model cannot be given as text (images,
/// audio, binary resources) is described: its type, size and where it came from.
fn block_text(b: &Value) -> String {
    let s = |k: &str| b.get(k).and_then(Value::as_str);
    match s("type") {
        Some("text") => s("text").unwrap_or_default().to_owned(),
        Some(kind @ ("image" | "audio")) => format!(
            "[{kind} content: {}, {} bytes; tether gives tool results to the model as text, so the {kind} itself is not shown]",
            s("mimeType").unwrap_or("unknown type"),
            s("data").map(base64_len).unwrap_or(0)
        ),
        Some("resource") => {
            let r = b.get("resource").cloned().unwrap_or(Value::Null);
            let uri = r.get("uri").and_then(Value::as_str).unwrap_or("?");
            match (
                r.get("text").and_then(Value::as_str),
                r.get("blob").and_then(Value::as_str),
            ) {
                (Some(t), _) => format!("[resource {uri}]\n{t}"),
                (None, Some(blob)) => format!(
                    "[resource {uri}: {}, {} bytes of binary data, not shown]",
                    r.get("mimeType")
                        .and_then(Value::as_str)
                        .unwrap_or("unknown type"),
                    base64_len(blob)
                ),
                (None, None) => format!("[resource {uri}]"),
            }
        }
        Some("resource_link") => {
            let mut t = format!("[resource link: {}", s("uri").unwrap_or("?"));
            if let Some(n) = s("name") {
                t.push_str(&format!(" ({n})"));
            }
            if let Some(d) = s("description") {
                t.push_str(&format!(": {d}"));
            }
            if let Some(m) = s("mimeType") {
                t.push_str(&format!(", {m}"));
            }
            t.push(']');
            t
        }
        // A type this version does not know: kept whole, as JSON.
        _ => format!("[content] {b}"),
    }
}

/// A `tools/call` result (its JSON) as the text the model sees: the text blocks in order, other
/// blocks described, the structured content appended as JSON unless a text block already holds
/// it, and `isError` as an error result.
pub fn to_output(result: &Value) -> ToolOutput {
    let blocks: Vec<Value> = result
        .get("content")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut parts: Vec<String> = blocks.iter().map(block_text).collect();
    if let Some(sc) = result.get("structuredContent") {
        let already = blocks.iter().any(|b| {
            b.get("type").and_then(Value::as_str) == Some("text")
                && b.get("text")
                    .and_then(Value::as_str)
                    .and_then(|t| serde_json::from_str::<Value>(t).ok())
                    .is_some_and(|v| &v == sc)
        });
        if !already {
            parts.push(format!("structured content: {sc}"));
        }
    }
    let text = if parts.is_empty() {
        "(no content)".to_owned()
    } else {
        clip(&parts.join("\n"), RESULT_CAP)
    };
    if result.get("isError").and_then(Value::as_bool) == Some(true) {
        ToolOutput::Error(text)
    } else {
        ToolOutput::Ok(text)
    }
}

/// A typed `tools/call` result as the text the model sees, exactly as [`to_output`] reads its
/// JSON. A result of text blocks alone (the common case) is joined as it is, without a detour
/// through a `Value` and copies of its text; any other goes through [`to_output`].
pub(crate) fn result_output(r: CallToolResult) -> Result<ToolOutput, serde_json::Error> {
    if r.structured_content.is_some() || !r.content.iter().all(|b| matches!(b, ContentBlock::Text(_))) {
        return serde_json::to_value(&r).map(|v| to_output(&v));
    }
    let is_error = r.is_error == Some(true);
    let mut text: Option<String> = None;
    for b in r.content {
        if let ContentBlock::Text(t) = b {
            match &mut text {
                None => text = Some(t.text),
                Some(s) => {
                    s.push('\n');
                    s.push_str(&t.text);
                }
            }
        }
    }
    let text = match text {
        None => "(no content)".to_owned(),
        Some(t) if t.len() > RESULT_CAP => clip(&t, RESULT_CAP),
        Some(t) => t,
    };
    Ok(if is_error {
        ToolOutput::Error(text)
    } else {
        ToolOutput::Ok(text)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The typed path and the JSON path give the same output, on results of text alone (the
    /// typed path's own) and on the others (which it hands to the JSON path).
    #[test]
    fn typed_results_read_as_their_json() {
        let big = "y".repeat(RESULT_CAP + 5);
        for v in [
            json!({"content": [{"type": "text", "text": "ok"}]}),
            json!({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            json!({"content": [{"type": "text", "text": "bad"}], "isError": true}),
            json!({"content": [{"type": "text", "text": "fine"}], "isError": false}),
            json!({"content": []}),
            json!({"content": [], "isError": true}),
            json!({"content": [{"type": "text", "text": big}]}),
            json!({"content": [{"type": "text", "text": "{\"a\":1}"}], "structuredContent": {"a": 1}}),
            json!({"content": [], "structuredContent": {"a": 1}}),
            json!({"content": [{"type": "text", "text": "t"}, {"type": "image", "data": "AAAA", "mimeType": "image/png"}]}),
        ] {
            let typed: CallToolResult = serde_json::from_value(v.clone()).unwrap();
            // What the client hands over: the typed result, as read from the wire.
            let reread = serde_json::to_value(&typed).unwrap();
            assert_eq!(
                result_output(typed).unwrap(),
                to_output(&reread),
                "the two paths differ on {v}"
            );
        }
    }

    #[test]
    fn text_structured_images_and_errors() {
        let out = to_output(&json!({"content": [{"type": "text", "text": "hi"}]}));
        assert_eq!(out, ToolOutput::Ok("hi".into()));
        let out = to_output(&json!({
            "content": [{"type": "text", "text": "{\"a\": 1}"}],
            "structuredContent": {"a": 1}
        }));
        assert_eq!(
            out,
            ToolOutput::Ok("{\"a\": 1}".into()),
            "the same JSON is not repeated"
        );
        let out = to_output(&json!({"content": [], "structuredContent": {"a": 1}}));
        assert_eq!(out, ToolOutput::Ok("structured content: {\"a\":1}".into()));
        let out =
            to_output(&json!({"content": [{"type": "image", "data": "AAAA", "mimeType": "image/png"}]}));
        match out {
            ToolOutput::Ok(t) => assert!(t.contains("image/png") && t.contains("3 bytes"), "{t}"),
            o => panic!("{o:?}"),
        }
        let out = to_output(&json!({"content": [{"type": "text", "text": "bad"}], "isError": true}));
        assert_eq!(out, ToolOutput::Error("bad".into()));
        let out = to_output(&json!({"content": [{"type": "hologram", "x": 1}]}));
        match out {
            ToolOutput::Ok(t) => assert!(t.contains("hologram"), "unknown blocks are kept: {t}"),
            o => panic!("{o:?}"),
        }
        assert_eq!(to_output(&json!({})), ToolOutput::Ok("(no content)".into()));
    }

    #[test]
    fn huge_results_are_cut_with_a_note() {
        let big = "x".repeat(RESULT_CAP + 10);
        match to_output(&json!({"content": [{"type": "text", "text": big}]})) {
            ToolOutput::Ok(t) => assert!(t.len() < RESULT_CAP + 100 && t.contains("10 more bytes")),
            o => panic!("{o:?}"),
        }
    }
}
