//! The wire shapes: the outgoing request (serialized straight from tether's types, borrowing
//! them) and the incoming chunk / completion (deserialized leniently, borrowing from the line).

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeSeq, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tether::{ChatMessage, ChatRequest, Role, ToolSpec, Usage};

// ---------------------------------------------------------------------------------------------
// Request

/// Request options that come from the model's configuration.
pub(crate) struct RequestOptions<'a> {
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: Option<(&'a str, u32)>,
    pub extra: &'a serde_json::Map<String, Value>,
}

/// The request body, serialized without building an intermediate JSON tree.
pub(crate) struct WireRequest<'a> {
    pub model: &'a str,
    pub req: &'a ChatRequest,
    pub opts: RequestOptions<'a>,
}

const RESERVED: [&str; 5] = ["model", "messages", "tools", "stream", "stream_options"];

impl Serialize for WireRequest<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("model", self.model)?;
        m.serialize_entry("messages", &Messages(&self.req.messages))?;
        if !self.req.tools.is_empty() {
            // `tool_choice` is omitted: "auto" is the default with tools, and some servers
            // (llama.cpp) reject the object form.
            m.serialize_entry("tools", &Tools(&self.req.tools))?;
        }
        m.serialize_entry("stream", &self.opts.stream)?;
        if self.opts.stream && self.opts.include_usage {
            m.serialize_entry("stream_options", &IncludeUsage)?;
        }
        let max_field = self.opts.max_tokens.map(|(f, _)| f);
        if let Some((field, n)) = self.opts.max_tokens {
            m.serialize_entry(field, &n)?;
        }
        for (k, v) in self.opts.extra {
            if !RESERVED.contains(&k.as_str()) && Some(k.as_str()) != max_field {
                m.serialize_entry(k, v)?;
            }
        }
        m.end()
    }
}

struct IncludeUsage;

impl Serialize for IncludeUsage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(1))?;
        m.serialize_entry("include_usage", &true)?;
        m.end()
    }
}

struct Messages<'a>(&'a [ChatMessage]);

impl Serialize for Messages<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for msg in self.0 {
            seq.serialize_element(&Message(msg))?;
        }
        seq.end()
    }
}

struct Message<'a>(&'a ChatMessage);

impl Serialize for Message<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let msg = self.0;
        let role = match msg.role {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
            // `Role` may grow; anything else is sent as a user message.
            _ => "user",
        };
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("role", role)?;
        // Never `null`: llama-cpp-python rejects an assistant message with `content: null`
        // (HTTP 500), and `""` means the same thing to every other server.
        m.serialize_entry("content", msg.content.as_deref().unwrap_or(""))?;
        if role == "assistant" && !msg.tool_calls.is_empty() {
            m.serialize_entry("tool_calls", &Calls(msg))?;
        }
        if role == "tool" {
            m.serialize_entry("tool_call_id", msg.tool_call_id.as_deref().unwrap_or(""))?;
        }
        m.end()
    }
}

struct Calls<'a>(&'a ChatMessage);

impl Serialize for Calls<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.tool_calls.len()))?;
        for c in &self.0.tool_calls {
            seq.serialize_element(&CallOut {
                id: &c.id,
                kind: "function",
                function: FnOut {
                    name: &c.name,
                    arguments: &c.arguments,
                },
            })?;
        }
        seq.end()
    }
}

#[derive(Serialize)]
struct CallOut<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    function: FnOut<'a>,
}

#[derive(Serialize)]
struct FnOut<'a> {
    name: &'a str,
    arguments: &'a str,
}

struct Tools<'a>(&'a [ToolSpec]);

impl Serialize for Tools<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let default_schema = serde_json::json!({"type": "object"});
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for t in self.0 {
            let parameters = if t.input_schema.is_object() {
                &t.input_schema
            } else {
                &default_schema
            };
            seq.serialize_element(&ToolOut {
                kind: "function",
                function: ToolFn {
                    name: &t.name,
                    description: &t.description,
                    parameters,
                },
            })?;
        }
        seq.end()
    }
}

#[derive(Serialize)]
struct ToolOut<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    function: ToolFn<'a>,
}

#[derive(Serialize)]
struct ToolFn<'a> {
    name: &'a str,
    description: &'a str,
    parameters: &'a Value,
}

// ---------------------------------------------------------------------------------------------
// Stream chunks

/// A JSON string, borrowed from the line when it has no escapes.
#[derive(Debug, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct Str<'a>(#[serde(borrow)] pub Cow<'a, str>);

impl Str<'_> {
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

/// One `chat.completion.chunk` (only what tether reads; unknown fields are ignored).
#[derive(Debug, PartialEq, Deserialize)]
pub struct Chunk<'a> {
    /// The completion id (the same in every chunk).
    #[serde(default, borrow)]
    pub id: Option<Str<'a>>,
    /// The model that answered.
    #[serde(default, borrow)]
    pub model: Option<Str<'a>>,
    /// The first choice (index 0); `null`, missing or `[]` is `None`.
    #[serde(default, borrow)]
    pub choices: FirstChoice<'a>,
    /// The usage report (the chunk before `[DONE]` with `include_usage`).
    #[serde(default)]
    pub usage: Option<Value>,
    /// An error reported inside the stream.
    #[serde(default)]
    pub error: Option<Value>,
}

/// The choice with index 0 of a chunk, the others skipped.
#[derive(Debug, Default, PartialEq)]
pub struct FirstChoice<'a>(pub Option<ChoiceDelta<'a>>);

impl<'de: 'a, 'a> Deserialize<'de> for FirstChoice<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = FirstChoice<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of choices or null")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(FirstChoice(None))
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(FirstChoice(None))
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                d.deserialize_any(self)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut first = None;
                while let Some(c) = seq.next_element::<ChoiceDelta<'a>>()? {
                    if first.is_none() && c.index == 0 {
                        first = Some(c);
                    }
                }
                Ok(FirstChoice(first))
            }
        }
        d.deserialize_option(V(std::marker::PhantomData))
    }
}

/// One choice of a chunk.
#[derive(Debug, PartialEq, Deserialize)]
pub struct ChoiceDelta<'a> {
    /// The choice's index (0 when absent).
    #[serde(default)]
    pub index: u32,
    /// The delta.
    #[serde(default, borrow)]
    pub delta: Option<Delta<'a>>,
    /// Set on the choice's last content chunk; `""` counts as absent.
    #[serde(default, borrow)]
    pub finish_reason: Option<Str<'a>>,
}

/// A choice's delta.
#[derive(Debug, Default, PartialEq, Deserialize)]
pub struct Delta<'a> {
    /// A piece of text.
    #[serde(default, borrow)]
    pub content: Option<Str<'a>>,
    /// A piece of a refusal (shown as text).
    #[serde(default, borrow)]
    pub refusal: Option<Str<'a>>,
    /// A piece of reasoning (llama.cpp, DeepSeek, vLLM).
    #[serde(default, borrow)]
    pub reasoning_content: Option<Str<'a>>,
    /// A piece of reasoning (OpenRouter and newer vLLM spell it so).
    #[serde(default, borrow)]
    pub reasoning: Option<Str<'a>>,
    /// Tool-call fragments.
    #[serde(default, borrow)]
    pub tool_calls: Frags<'a>,
    /// The legacy single function call.
    #[serde(default, borrow)]
    pub function_call: Option<FnDelta<'a>>,
}

/// Tool-call fragments of one delta; the first is kept inline so the usual single fragment
/// costs no allocation.
#[derive(Debug, Default, PartialEq)]
pub struct Frags<'a> {
    /// The first fragment.
    pub first: Option<ToolCallDelta<'a>>,
    /// Any further fragments.
    pub rest: Vec<ToolCallDelta<'a>>,
}

impl<'a> Frags<'a> {
    /// Whether there is no fragment.
    pub fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    /// The fragments in order.
    pub fn iter(&self) -> impl Iterator<Item = &ToolCallDelta<'a>> {
        self.first.iter().chain(self.rest.iter())
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Frags<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Frags<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of tool-call fragments or null")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Frags::default())
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Frags::default())
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                d.deserialize_any(self)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut f = Frags::default();
                while let Some(c) = seq.next_element::<ToolCallDelta<'a>>()? {
                    if f.first.is_none() {
                        f.first = Some(c);
                    } else {
                        f.rest.push(c);
                    }
                }
                Ok(f)
            }
        }
        d.deserialize_option(V(std::marker::PhantomData))
    }
}

/// One tool-call fragment.
#[derive(Debug, PartialEq, Deserialize)]
pub struct ToolCallDelta<'a> {
    /// The call's index (falls back to the fragment's position when absent).
    #[serde(default)]
    pub index: Option<u32>,
    /// The call's id (first fragment at OpenAI; every fragment at llama-cpp-python).
    #[serde(default, borrow)]
    pub id: Option<Str<'a>>,
    /// `function`.
    #[serde(default, borrow, rename = "type")]
    pub kind: Option<Str<'a>>,
    /// Name and argument piece.
    #[serde(default, borrow)]
    pub function: Option<FnDelta<'a>>,
}

/// A function name and/or argument piece.
#[derive(Debug, PartialEq, Deserialize)]
pub struct FnDelta<'a> {
    /// The function's name.
    #[serde(default, borrow)]
    pub name: Option<Str<'a>>,
    /// A piece of the argument JSON text.
    #[serde(default, borrow)]
    pub arguments: Option<Str<'a>>,
}

// ---------------------------------------------------------------------------------------------
// Non-stream completion

/// A `chat.completion` (non-stream), read from its JSON tree.
#[derive(Debug, Deserialize)]
pub(crate) struct Completion {
    #[serde(default, deserialize_with = "null_as_default")]
    pub choices: Vec<Choice>,
    #[serde(default)]
    pub usage: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Choice {
    #[serde(default)]
    pub index: u32,
    #[serde(default)]
    pub message: Option<FullMessage>,
    #[serde(default)]
    pub finish_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct FullMessage {
    #[serde(default)]
    pub content: Option<Value>,
    #[serde(default)]
    pub refusal: Option<String>,
    #[serde(default)]
    pub reasoning_content: Option<String>,
    #[serde(default)]
    pub reasoning: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub tool_calls: Vec<FullCall>,
    #[serde(default)]
    pub function_call: Option<FullFn>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct FullCall {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub function: Option<FullFn>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct FullFn {
    #[serde(default)]
    pub name: Option<String>,
    /// A JSON string per the spec; some servers send the object itself.
    #[serde(default)]
    pub arguments: Option<Value>,
}

impl FullFn {
    pub(crate) fn arguments_text(&self) -> String {
        match &self.arguments {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
        }
    }
}

/// The text of a message `content`: a string, or an array of parts whose text parts are joined.
pub(crate) fn content_text(v: &Option<Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

// ---------------------------------------------------------------------------------------------
// Usage and errors

/// Reads an OpenAI usage object: prompt and completion tokens, cached prompt tokens
/// (`prompt_tokens_details.cached_tokens`, or DeepSeek's `prompt_cache_hit_tokens`), raw kept.
pub(crate) fn usage_of(v: Value) -> Option<Usage> {
    if !v.is_object() {
        return None;
    }
    let n = |v: Option<&Value>| v.and_then(Value::as_u64).unwrap_or(0);
    let cached = v
        .get("prompt_tokens_details")
        .and_then(|d| d.get("cached_tokens"))
        .or_else(|| v.get("prompt_cache_hit_tokens"));
    Some(
        Usage::new(n(v.get("prompt_tokens")), n(v.get("completion_tokens")))
            .with_cache_read_tokens(n(cached))
            .with_raw(v),
    )
}

/// The message and code of an OpenAI error object (`{"message","type","param","code"}`, or a
/// bare string). The code is `code` when it is a string, else `type`, else a numeric `code`
/// (llama.cpp sends the HTTP status there).
pub(crate) fn error_parts(err: &Value) -> (Option<String>, Option<String>) {
    match err {
        Value::String(s) => (Some(s.clone()), None),
        Value::Object(o) => {
            let message = o.get("message").and_then(Value::as_str).map(str::to_owned);
            let code = match o.get("code") {
                Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
                _ => None,
            }
            .or_else(|| o.get("type").and_then(Value::as_str).map(str::to_owned))
            .or_else(|| match o.get("code") {
                Some(Value::Number(n)) => Some(n.to_string()),
                _ => None,
            });
            (message, code)
        }
        _ => (None, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_borrow_when_unescaped() {
        let line = br#"{"choices":[{"index":0,"delta":{"content":"plain"}}]}"#;
        let c: Chunk<'_> = serde_json::from_slice(line).unwrap();
        let d = c.choices.0.unwrap().delta.unwrap();
        assert!(matches!(d.content.unwrap().0, Cow::Borrowed("plain")));
        let line = br#"{"choices":[{"index":0,"delta":{"content":"a\nb"}}]}"#;
        let c: Chunk<'_> = serde_json::from_slice(line).unwrap();
        assert_eq!(
            c.choices.0.unwrap().delta.unwrap().content.unwrap().as_str(),
            "a\nb"
        );
    }

    #[test]
    fn choices_null_missing_or_other_index() {
        for line in [
            &br#"{"choices":null,"usage":{"prompt_tokens":1}}"#[..],
            br#"{"usage":null}"#,
            br#"{"choices":[]}"#,
            br#"{"choices":[{"index":1,"delta":{"content":"x"}}]}"#,
        ] {
            let c: Chunk<'_> = serde_json::from_slice(line).unwrap();
            assert!(c.choices.0.is_none());
        }
    }

    #[test]
    fn error_codes_may_be_strings_or_numbers() {
        let e = serde_json::json!({"code": 400, "message": "bad", "type": "invalid_request_error"});
        assert_eq!(
            error_parts(&e),
            (Some("bad".into()), Some("invalid_request_error".into()))
        );
        let e = serde_json::json!({"code": 500, "message": "x"});
        assert_eq!(error_parts(&e).1.as_deref(), Some("500"));
        let e = serde_json::json!({"code": "insufficient_quota", "type": "insufficient_quota"});
        assert_eq!(error_parts(&e).1.as_deref(), Some("insufficient_quota"));
    }
}
