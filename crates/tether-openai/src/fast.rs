//! Fast path for the chunk a stream is made of: `{"id":…,"object":"chat.completion.chunk",…,
//! "choices":[{"index":0,"delta":{"content":"…"},"finish_reason":null}]}`.
//!
//! # Why a hand-written scanner
//!
//! A long answer is thousands of these chunks, each ~150–250 bytes of which only the few bytes of
//! `content` matter. Through serde's derive every chunk walks the visitor machinery for each of
//! ~10 keys (a field-identifier visitor per key, `IgnoredAny` per unknown value, an `Option`
//! layer per field, the `FirstChoice` sequence visitor), and profiled on the relay bench that
//! was the largest single cost of relaying a delta (~1 µs a chunk on the 2-vCPU bench machine,
//! more than reading the bytes off the socket). The shape is fixed and tiny, so a single
//! forward pass over the bytes — compare each key against a handful of literals, skip scalars,
//! borrow the strings — does the same work for a fraction of the cost. The scanner itself
//! (tokens, strings, objects, scalars) is [`tether::json_scan`], shared with tether-acp's fast
//! path; this module keeps only the chunk's shape and the template below.
//!
//! # Why it is exact
//!
//! [`chunk`] returns what the accumulator reads of the [`crate::wire::Chunk`] serde would build
//! (every field a common chunk can carry, in a small struct: [`Light`]), or `None`, and the
//! caller then runs the full serde parse, which produces the same result (or the same error) as before. It only
//! *accepts* input it can prove serde accepts with that result; when in doubt it declines:
//! - structure: one top-level object; `choices` is `null`, `[]` or exactly one object with
//!   `index` absent or the literal `0`; `delta` is `null` or an object;
//! - known keys (`id`, `model`, `choices`, `usage`, `error`; `index`, `delta`, `finish_reason`;
//!   `content`, `refusal`, `reasoning_content`, `reasoning`, `tool_calls`, `function_call`) at
//!   most once each (serde rejects a duplicate field); their values strings or `null`, except
//!   `usage`, `error`, `tool_calls` and `function_call`, which must be `null` (anything else is
//!   the full path's business);
//! - unknown keys (`object`, `created`, `system_fingerprint`, `logprobs`, `obfuscation`, `role`,
//!   …) only with scalar values: a string, `true`/`false`/`null`, or an integer in JSON's
//!   grammar; an object or array value (say `logprobs` with content) declines;
//! - a line that is not UTF-8 as a whole, keys with escapes, strings with raw control
//!   characters, numbers with a fraction or exponent, anything after the object but JSON
//!   whitespace: decline;
//! - strings without escapes are borrowed after UTF-8 validation (as serde does); a string with
//!   escapes is decoded by serde_json itself, so escape handling (`\uXXXX`, surrogate pairs,
//!   errors) is serde's by construction.
//!
//! `tests` checks this differentially: generated chunks (random key order, whitespace, extra
//! fields, escaped and non-ASCII text, non-fast shapes, byte mutations) give the same fields
//! and the same accumulated text and emits through both paths.

use std::borrow::Cow;

use tether::json_scan::{Scan, Seen, decode_token as decode, string_token};

/// What a common chunk carries: the fields [`crate::StreamAccumulator`] reads, borrowed from the
/// line unless escaped. Small on purpose: the serde [`crate::wire::Chunk`] is ~400 bytes of
/// options (tool calls, usage, error) that moving around costs more than scanning the line.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Light<'a> {
    pub id: Option<Cow<'a, str>>,
    pub model: Option<Cow<'a, str>>,
    pub content: Option<Cow<'a, str>>,
    pub refusal: Option<Cow<'a, str>>,
    pub reasoning_content: Option<Cow<'a, str>>,
    pub reasoning: Option<Cow<'a, str>>,
    pub finish_reason: Option<Cow<'a, str>>,
    /// Where the `content` string token (quotes included) is in the line, when there is one.
    pub content_span: Option<(usize, usize)>,
}

impl Light<'_> {
    /// Whether the chunk's only effect is its `content` (no reasoning, refusal or finish
    /// reason): then a later line equal to it but for the content string means just that new
    /// content (see [`Template`]).
    pub(crate) fn content_only(&self) -> bool {
        self.content_span.is_some()
            && self.refusal.is_none()
            && self.reasoning_content.is_none()
            && self.reasoning.is_none()
            && self.finish_reason.as_deref().is_none_or(str::is_empty)
    }
}

/// The chunk serde would build from `data`, reduced to what the accumulator reads, when `data`
/// has the common shape; `None` otherwise (the caller then parses it in full).
pub(crate) fn chunk(data: &[u8]) -> Option<Light<'_>> {
    // Validating the whole line once is cheaper than per string, and only stricter than serde
    // (which ignores the bytes of an unknown string): outside strings non-ASCII is an error anyway.
    let mut s = Scan::new(std::str::from_utf8(data).ok()?);
    let mut c = Light::default();
    let mut seen = Seen::default();
    s.object(|s, key| {
        match plain(key)? {
            "id" => {
                seen.once(1)?;
                c.id = s.opt_string()?;
            }
            "model" => {
                seen.once(2)?;
                c.model = s.opt_string()?;
            }
            "choices" => {
                seen.once(4)?;
                choices(s, &mut c)?;
            }
            "usage" => {
                seen.once(8)?;
                s.null()?;
            }
            "error" => {
                seen.once(16)?;
                s.null()?;
            }
            _ => s.scalar()?,
        }
        Some(())
    })?;
    s.end().map(|()| c)
}

/// A key without escapes (one with an escape declines: serde would match it after unescaping,
/// which this scanner does not try to reproduce).
#[inline]
fn plain(key: Cow<'_, str>) -> Option<&str> {
    match key {
        Cow::Borrowed(k) => Some(k),
        Cow::Owned(_) => None,
    }
}

/// `choices`: `null`, `[]` or one choice with index 0.
fn choices<'a>(s: &mut Scan<'a>, c: &mut Light<'a>) -> Option<()> {
    match s.peek()? {
        b'n' => s.null(),
        b'[' => {
            s.eat(b'[')?;
            if s.peek()? == b']' {
                return s.eat(b']');
            }
            choice(s, c)?;
            s.eat(b']')
        }
        _ => None,
    }
}

fn choice<'a>(s: &mut Scan<'a>, c: &mut Light<'a>) -> Option<()> {
    let mut seen = Seen::default();
    s.object(|s, key| {
        match plain(key)? {
            "index" => {
                seen.once(1)?;
                s.eat(b'0')?;
            }
            "delta" => {
                seen.once(2)?;
                match s.peek()? {
                    b'n' => s.null()?,
                    _ => delta(s, c)?,
                }
            }
            "finish_reason" => {
                seen.once(4)?;
                c.finish_reason = s.opt_string()?;
            }
            _ => s.scalar()?,
        }
        Some(())
    })
}

fn delta<'a>(s: &mut Scan<'a>, c: &mut Light<'a>) -> Option<()> {
    let mut seen = Seen::default();
    s.object(|s, key| {
        match plain(key)? {
            "content" => {
                seen.once(1)?;
                s.ws();
                let at = s.pos();
                c.content = s.opt_string()?;
                if c.content.is_some() {
                    c.content_span = Some((at, s.pos()));
                }
            }
            "refusal" => {
                seen.once(2)?;
                c.refusal = s.opt_string()?;
            }
            "reasoning_content" => {
                seen.once(4)?;
                c.reasoning_content = s.opt_string()?;
            }
            "reasoning" => {
                seen.once(8)?;
                c.reasoning = s.opt_string()?;
            }
            "tool_calls" => {
                seen.once(16)?;
                s.null()?;
            }
            "function_call" => {
                seen.once(32)?;
                s.null()?;
            }
            _ => s.scalar()?,
        }
        Some(())
    })
}

/// The last content-only chunk of a stream, kept so that the next lines equal to it but for the
/// content string — every chunk of a plain answer from llama.cpp or vLLM, whose `id`, `created`,
/// `model` and `system_fingerprint` never change within a stream — cost two byte comparisons and
/// a scan of the content string.
///
/// Why it is exact: the scanner is a deterministic left-to-right pass. A line `P S' Q` where `P`
/// and `Q` are byte for byte the template's bytes before and after its content token and `S'` is
/// one string token is scanned exactly as the template was, but for the content's value. The
/// template's other effects (`id`, `model`: set once, already applied when the template was fed;
/// no reasoning, refusal or finish reason, see [`Light::content_only`]) are no-ops the second
/// time, so the new line's whole effect is its content.
#[derive(Debug, Default)]
pub(crate) struct Template {
    line: Vec<u8>,
    start: usize,
    end: usize,
}

impl Template {
    /// Remembers `data` (just fed, fast path) as the template.
    pub(crate) fn set(&mut self, data: &[u8], (start, end): (usize, usize)) {
        self.line.clear();
        self.line.extend_from_slice(data);
        self.start = start;
        self.end = end;
    }

    /// At the start of `buf`: a whole SSE event `data: <template with another content>\n`
    /// (and its blank line `\n`, when there): its content and length. The line would come out
    /// of the line splitter exactly so — the template's bytes and a string token hold no CR or
    /// LF — and `feed` would take it, untrimmed (the template starts with `{` and ends with `}`),
    /// through [`Template::content_of`].
    pub(crate) fn event_at<'a>(&self, buf: &'a [u8]) -> Option<(Cow<'a, str>, usize)> {
        if self.line.is_empty() {
            return None;
        }
        let data = buf
            .strip_prefix(b"data: ")?
            .strip_prefix(&self.line[..self.start])?;
        let token = string_token(data)?;
        let rest = data[token.len()..].strip_prefix(&self.line[self.end..])?;
        let rest = rest.strip_prefix(b"\n")?;
        let blank = rest.first() == Some(&b'\n');
        let len = buf.len() - rest.len() + blank as usize;
        Some((decode(token)?, len))
    }

    /// The content of `data` if it is the template with another content string.
    pub(crate) fn content_of<'a>(&self, data: &'a [u8]) -> Option<Cow<'a, str>> {
        if self.line.is_empty() {
            return None;
        }
        let (prefix, suffix) = (&self.line[..self.start], &self.line[self.end..]);
        if data.len() < prefix.len() + suffix.len() + 2
            || !data.starts_with(prefix)
            || !data.ends_with(suffix)
        {
            return None;
        }
        let token = &data[prefix.len()..data.len() - suffix.len()];
        (string_token(token)?.len() == token.len()).then_some(())?;
        decode(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Chunk;

    /// What serde reads, as a `Light` (for chunks without tool calls, usage or error).
    fn full(data: &[u8]) -> Option<Light<'_>> {
        let c: Chunk<'_> = serde_json::from_slice(data).ok()?;
        let mut l = Light {
            id: c.id.map(|s| s.0),
            model: c.model.map(|s| s.0),
            ..Default::default()
        };
        if let Some(ch) = c.choices.0 {
            l.finish_reason = ch.finish_reason.map(|s| s.0);
            if let Some(d) = ch.delta {
                l.content = d.content.map(|s| s.0);
                l.refusal = d.refusal.map(|s| s.0);
                l.reasoning_content = d.reasoning_content.map(|s| s.0);
                l.reasoning = d.reasoning.map(|s| s.0);
            }
        }
        Some(l)
    }

    fn without_span(mut l: Light<'_>) -> Light<'_> {
        l.content_span = None;
        l
    }

    #[test]
    fn accepts_the_common_shapes() {
        for line in [
            &br#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1764000000,"model":"m","system_fingerprint":"fp","choices":[{"index":0,"delta":{"content":"hi"},"logprobs":null,"finish_reason":null}],"usage":null}"#[..],
            br#"{"choices":[{"finish_reason":null,"index":0,"delta":{"content":" w\u00f6rld\n"}}],"created":1,"id":"x","model":"llama","object":"chat.completion.chunk"}"#,
            br#"{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null}}],"obfuscation":"a1B2"}"#,
            br#" { "choices" : [ { "delta" : { "reasoning_content" : "hm" , "content" : null } } ] } "#,
            br#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            br#"{"choices":[]}"#,
            br#"{}"#,
        ] {
            let f = chunk(line).unwrap_or_else(|| panic!("declined {}", String::from_utf8_lossy(line)));
            assert_eq!(Some(without_span(f)), full(line), "{}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn declines_what_it_does_not_know() {
        for line in [
            &br#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}"#[..],
            br#"{"choices":[],"usage":{"prompt_tokens":1}}"#,
            br#"{"error":{"message":"x"}}"#,
            br#"{"choices":[{"index":1,"delta":{"content":"x"}}]}"#,
            br#"{"choices":[{"index":0,"delta":{"content":"x"}},{"index":1,"delta":{}}]}"#,
            br#"{"choices":[{"index":0,"logprobs":{"content":[]},"delta":{"content":"x"}}]}"#,
            br#"{"choices":[{"index":0,"delta":{"content":"x","content":"y"}}]}"#,
            br#"{"choices":[{"index":0,"delta":{"cont\u0065nt":"x"}}]}"#,
            br#"{"created":1.5}"#,
            br#"{"choices":[{"index":0,"delta":{"content":"x"}}]} x"#,
            br#"{"choices":[{"index":0,"delta":{"content":"x"}}],}"#,
            b"{\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\x01\"}}]}",
            b"{\"choices\":[{\"index\":0,\"delta\":{\"content\":\"\xff\"}}]}",
            br#"{"choices":[{"index":0,"delta":{"content":"\ud800"}}]}"#,
            br#"{"choices": ["#,
        ] {
            assert!(chunk(line).is_none(), "{}", String::from_utf8_lossy(line));
        }
    }

    #[test]
    fn escaped_strings_are_decoded_by_serde() {
        let line = br#"{"choices":[{"delta":{"content":"a\"b\\c\ud83d\ude00\/"}}]}"#;
        let c = chunk(line).unwrap();
        assert_eq!(c.content.as_deref(), Some("a\"b\\c\u{1f600}/"));
        assert_eq!(Some(without_span(c)), full(line));
    }

    #[test]
    fn template_matches_only_the_same_line_with_another_content() {
        let line = br#"{"id":"x","choices":[{"index":0,"delta":{"content":"ab"},"finish_reason":null}]}"#;
        let l = chunk(line).unwrap();
        assert!(l.content_only());
        let mut t = Template::default();
        t.set(line, l.content_span.unwrap());
        let with = |c: &str| {
            format!(
                r#"{{"id":"x","choices":[{{"index":0,"delta":{{"content":{c}}},"finish_reason":null}}]}}"#
            )
        };
        assert_eq!(
            t.content_of(with(r#""zz\n""#).as_bytes()).as_deref(),
            Some("zz\n")
        );
        assert_eq!(t.content_of(with(r#""""#).as_bytes()).as_deref(), Some(""));
        for bad in [r#""a" "#, r#""a","b""#, r#""a"#, "null", r#" "a""#, r#""\x""#] {
            assert_eq!(t.content_of(with(bad).as_bytes()), None, "{bad}");
        }
        assert_eq!(
            t.content_of(
                br#"{"id":"y","choices":[{"index":0,"delta":{"content":"ab"},"finish_reason":null}]}"#
            ),
            None
        );
    }
}
