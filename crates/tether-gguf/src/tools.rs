//! Tool calls: the grammar that constrains them and the parser that streams them.
//!
//! The model writes a call as `<tool_call>\n{"name": "…", "arguments": {…}}\n</tool_call>` (the
//! format of [`crate::template::tool_prompt`], Qwen's and Hermes'). Inside a call, decoding is
//! constrained by an llguidance grammar: one JSON object whose `name` is one offered tool's
//! and whose `arguments` match that tool's input schema, then `</tool_call>`, then the end of the
//! message (or, with parallel calls allowed, another call or the end). So a call the embedded model emits always parses and matches
//! its schema. Text outside calls is free (`auto`) or absent (`required`, a named tool).

use serde_json::{Value, json};
use tether::ToolSpec;

/// Which tool calls a model call may or must make (OpenAI's `tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ToolChoice {
    /// Text, tool calls or both, as the model decides.
    #[default]
    Auto,
    /// No tool calls (the tools are not shown to the model).
    None,
    /// A tool call (one, or more with `GgufBuilder::parallel_tool_calls`), and no text before it.
    Required,
    /// A call of this tool.
    Named(String),
}

impl ToolChoice {
    /// Parses `auto`, `none`, `required`, or any other word as a tool name.
    pub fn parse(s: &str) -> Self {
        match s.trim() {
            "" | "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" | "any" => ToolChoice::Required,
            name => ToolChoice::Named(name.to_owned()),
        }
    }
}

/// The text that opens a call.
pub const CALL_OPEN: &str = "<tool_call>";
/// The text that closes a call.
pub const CALL_CLOSE: &str = "</tool_call>";

fn call_schema(tools: &[&ToolSpec]) -> Value {
    let alts: Vec<Value> = tools
        .iter()
        .map(|t| {
            let args = match &t.input_schema {
                Value::Object(m) if !m.is_empty() => t.input_schema.clone(),
                _ => json!({"type": "object"}),
            };
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": args},
                "required": ["name", "arguments"],
                "additionalProperties": false
            })
        })
        .collect();
    let mut schema = if alts.len() == 1 {
        alts.into_iter().next().unwrap_or(Value::Null)
    } else {
        json!({"anyOf": alts})
    };
    if let Value::Object(m) = &mut schema {
        m.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// The Lark grammar for what follows `<tool_call>`: one call of `tools` (of the named tool,
/// when `only` names one), closed; with `parallel`, more calls may follow, each opened by a new
/// `<tool_call>`. Without `parallel` the grammar is complete after one call, so the turn ends
/// there: a small model made to call a tool otherwise repeats calls until its token budget runs
/// out. (llama.cpp's server grammar does the same: one call unless `parallel_tool_calls`.)
pub fn call_grammar(tools: &[ToolSpec], only: Option<&str>, parallel: bool) -> Result<String, String> {
    let chosen: Vec<&ToolSpec> = tools
        .iter()
        .filter(|t| only.is_none_or(|n| t.name == n))
        .collect();
    if chosen.is_empty() {
        return Err(match only {
            Some(n) => format!("tool_choice names `{n}`, which is not among the offered tools"),
            None => "no tools to call".into(),
        });
    }
    let schema = serde_json::to_string(&call_schema(&chosen)).map_err(|e| e.to_string())?;
    let more = if only.is_some() || !parallel {
        String::new()
    } else {
        format!(" (\"\\n{CALL_OPEN}\\n\" call_json \"\\n{CALL_CLOSE}\")*")
    };
    Ok(format!(
        "start: WS? call_json \"\\n{CALL_CLOSE}\"{more}\n\
         call_json: %json {schema}\n\
         WS: /[ \\t\\n]+/\n"
    ))
}

/// A piece of the assistant message, in the order it was generated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Assistant text.
    Text(String),
    /// A tool call began.
    CallStart {
        /// Its id.
        id: String,
        /// The tool.
        name: String,
    },
    /// More of a call's argument text.
    CallArgs {
        /// The call.
        id: String,
        /// The text.
        delta: String,
    },
    /// A call's arguments are complete.
    CallEnd {
        /// The call.
        id: String,
    },
}

/// A finished call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// Its id.
    pub id: String,
    /// The tool.
    pub name: String,
    /// The argument JSON text.
    pub arguments: String,
}

/// Follows the text of one or more calls as it is generated (everything after `<tool_call>`),
/// streaming each call's name as soon as it is complete and its arguments as they grow.
#[derive(Debug, Default)]
pub struct CallStream {
    buf: String,
    /// Start of the current call's segment in `buf`.
    seg: usize,
    id: Option<String>,
    name: Option<String>,
    args_at: Option<usize>,
    sent: usize,
    /// Calls completed.
    pub calls: Vec<Call>,
}

fn new_id() -> String {
    format!("call_{:016x}", rand::random::<u64>())
}

/// Reads a JSON string starting at `s[0] == '"'`: its value and the byte length it took.
fn json_string(s: &str) -> Option<(String, usize)> {
    let b = s.as_bytes();
    if b.first() != Some(&b'"') {
        return None;
    }
    let mut i = 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => {
                let v: String = serde_json::from_str(&s[..=i]).ok()?;
                return Some((v, i + 1));
            }
            _ => i += 1,
        }
    }
    None
}

fn skip_ws(s: &str, mut i: usize) -> usize {
    while s.as_bytes().get(i).is_some_and(|c| c.is_ascii_whitespace()) {
        i += 1;
    }
    i
}

/// Where `"key": ` ends in `s` from `i` (after whitespace), if it is complete.
fn key_at(s: &str, i: usize, key: &str) -> Option<usize> {
    let i = skip_ws(s, i);
    let (k, n) = json_string(&s[i..])?;
    if k != key {
        return None;
    }
    let j = skip_ws(s, i + n);
    if s.as_bytes().get(j) != Some(&b':') {
        return None;
    }
    let j = skip_ws(s, j + 1);
    (j < s.len()).then_some(j)
}

/// How many bytes of `s` belong to the JSON value it starts with, and whether it is complete.
fn value_extent(s: &str) -> (usize, bool) {
    let b = s.as_bytes();
    if !matches!(b.first(), Some(b'{' | b'[')) {
        // A scalar (schemas ask for objects; kept simple): up to a delimiter.
        let end = b
            .iter()
            .position(|c| matches!(c, b',' | b'}' | b']') || c.is_ascii_whitespace())
            .unwrap_or(b.len());
        return (end, end < b.len());
    }
    let (mut depth, mut in_str, mut esc) = (0usize, false, false);
    for (i, &c) in b.iter().enumerate() {
        if in_str {
            if esc {
                esc = false;
            } else if c == b'\\' {
                esc = true;
            } else if c == b'"' {
                in_str = false;
            }
            continue;
        }
        match c {
            b'"' => in_str = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return (i + 1, true);
                }
            }
            _ => {}
        }
    }
    (b.len(), false)
}

impl CallStream {
    /// Appends generated text, returning the pieces it completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            let seg = &self.buf[self.seg..];
            let id = self.id.get_or_insert_with(new_id).clone();
            let Some(open) = seg.find('{') else { break };
            if self.name.is_none() {
                // `{"name": "…"` complete?
                if let Some(v) = key_at(seg, open + 1, "name")
                    && let Some((name, n)) = json_string(&seg[v..])
                {
                    out.push(Piece::CallStart {
                        id: id.clone(),
                        name: name.clone(),
                    });
                    self.name = Some(name);
                    let after = skip_ws(seg, v + n);
                    if seg.as_bytes().get(after) == Some(&b',') {
                        self.args_at = key_at(seg, after + 1, "arguments").map(|a| self.seg + a);
                    }
                }
            } else if self.args_at.is_none() {
                let v =
                    key_at(seg, open + 1, "name").and_then(|v| json_string(&seg[v..]).map(|(_, n)| v + n));
                if let Some(end) = v {
                    let after = skip_ws(seg, end);
                    if seg.as_bytes().get(after) == Some(&b',') {
                        self.args_at = key_at(seg, after + 1, "arguments").map(|a| self.seg + a);
                    }
                }
            }
            // The call closes at the `</tool_call>` after its JSON object (one inside a string of
            // the arguments is text, not the end).
            let (len, complete) = value_extent(&seg[open..]);
            let close = if complete {
                seg[open + len..].find(CALL_CLOSE).map(|c| open + len + c)
            } else {
                None
            };
            if let Some(close) = close {
                let body = seg[..close].trim();
                let (name, args) = match serde_json::from_str::<Value>(body) {
                    Ok(Value::Object(m)) => (
                        m.get("name").and_then(Value::as_str).map(str::to_owned),
                        m.get("arguments").cloned(),
                    ),
                    _ => (None, None),
                };
                let name = name.or_else(|| self.name.clone()).unwrap_or_default();
                let raw_args = self
                    .args_at
                    .and_then(|a| {
                        let rest = self.buf.get(a..)?;
                        let (n, done) = value_extent(rest);
                        let inner = &rest[..n];
                        (done && serde_json::from_str::<Value>(inner).is_ok()).then(|| inner.to_owned())
                    })
                    .or_else(|| args.map(|a| a.to_string()))
                    .unwrap_or_else(|| "{}".to_owned());
                if self.name.is_none() {
                    out.push(Piece::CallStart {
                        id: id.clone(),
                        name: name.clone(),
                    });
                }
                if raw_args.len() > self.sent && raw_args.is_char_boundary(self.sent) {
                    out.push(Piece::CallArgs {
                        id: id.clone(),
                        delta: raw_args[self.sent..].to_owned(),
                    });
                }
                out.push(Piece::CallEnd { id: id.clone() });
                self.calls.push(Call {
                    id,
                    name,
                    arguments: raw_args,
                });
                self.seg += close + CALL_CLOSE.len();
                self.id = None;
                self.name = None;
                self.args_at = None;
                self.sent = 0;
                continue;
            }
            // Stream the arguments value so far (and nothing after its end).
            if let Some(a) = self.args_at {
                let rest = &self.buf[a..];
                let avail = &rest[..value_extent(rest).0];
                if avail.len() > self.sent && avail.is_char_boundary(self.sent) {
                    out.push(Piece::CallArgs {
                        id,
                        delta: avail[self.sent..].to_owned(),
                    });
                    self.sent = avail.len();
                }
            }
            break;
        }
        out
    }

    /// Whether a call is open (started and not closed).
    pub fn in_call(&self) -> bool {
        !self.buf[self.seg..].trim().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(chunks: &[&str]) -> (Vec<Piece>, Vec<Call>) {
        let mut s = CallStream::default();
        let mut out = Vec::new();
        for c in chunks {
            out.extend(s.push(c));
        }
        (out, s.calls)
    }

    #[test]
    fn streams_name_then_arguments() {
        let text = "\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a}b.txt\"}}\n</tool_call>";
        let chunks: Vec<String> = text.chars().map(|c| c.to_string()).collect();
        let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
        let (pieces, calls) = feed(&refs);
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "read_file");
        assert_eq!(calls[0].arguments, "{\"path\": \"a}b.txt\"}");
        let args: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::CallArgs { delta, .. } => Some(delta.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(args, calls[0].arguments);
        assert!(matches!(&pieces[0], Piece::CallStart { name, .. } if name == "read_file"));
        assert!(matches!(pieces.last(), Some(Piece::CallEnd { .. })));
    }

    #[test]
    fn two_calls_and_other_key_order() {
        let (pieces, calls) = feed(&[
            "\n{\"arguments\": {}, \"name\": \"list_dir\"}\n</tool_call>\n<tool_call>\n",
            "{\"name\": \"run_command\", \"arguments\": {\"command\": \"ls\"}}\n</tool_call>",
        ]);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "list_dir");
        assert_eq!(calls[0].arguments, "{}");
        assert_eq!(calls[1].arguments, "{\"command\": \"ls\"}");
        assert_eq!(
            pieces
                .iter()
                .filter(|p| matches!(p, Piece::CallEnd { .. }))
                .count(),
            2
        );
    }

    /// A string argument holding the closing tag (a model at temperature 0.9 wrote one) is
    /// part of the arguments, streamed or not.
    #[test]
    fn closing_tag_inside_a_string_is_text() {
        let text = "\n{\"name\": \"write_file\", \"arguments\": {\"path\": \"a\", \"content\": \"x\\n</tool_call>\\n<tool_call>\\n{\\\"y\\\"}\"}}\n</tool_call>";
        let want = "{\"path\": \"a\", \"content\": \"x\\n</tool_call>\\n<tool_call>\\n{\\\"y\\\"}\"}";
        let args = |pieces: &[Piece]| -> String {
            pieces
                .iter()
                .filter_map(|p| match p {
                    Piece::CallArgs { delta, .. } => Some(delta.as_str()),
                    _ => None,
                })
                .collect()
        };
        let (pieces, calls) = feed(&[text]);
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert_eq!(calls[0].arguments, want);
        assert_eq!(args(&pieces), want);
        let chunks: Vec<String> = text.chars().map(|c| c.to_string()).collect();
        let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
        let (pieces, calls) = feed(&refs);
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert_eq!(calls[0].arguments, want);
        assert_eq!(args(&pieces), want);
    }

    #[test]
    fn grammar_names_the_tool() {
        let t = vec![ToolSpec::new("a", "x", json!({"type": "object"}))];
        assert!(call_grammar(&t, Some("b"), true).is_err());
        let g = call_grammar(&t, Some("a"), true).unwrap();
        assert!(g.contains("\"const\":\"a\""), "{g}");
        // A named tool is called once; any tool may be called again only with `parallel`.
        assert!(!g.contains(CALL_OPEN), "{g}");
        assert!(call_grammar(&t, None, true).unwrap().contains(CALL_OPEN));
        assert!(!call_grammar(&t, None, false).unwrap().contains(CALL_OPEN));
    }
}
