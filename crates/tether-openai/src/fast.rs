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
//! borrow the strings — does the same work for a fraction of the cost.
//!
//! # Why it is exact
//!
//! [`chunk`] returns the very [`Chunk`] serde would build, or `None`, and the caller then runs
//! the full serde parse, which produces the same result (or the same error) as before. It only
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
//! fields, escaped and non-ASCII text, non-fast shapes, byte mutations) give the same `Chunk`
//! and the same accumulated text and emits through both paths.

use std::borrow::Cow;

use crate::wire::{ChoiceDelta, Chunk, Delta, FirstChoice, Frags, Str};

/// The chunk serde would build from `data`, when `data` has the common shape; `None` otherwise
/// (the caller then parses it in full).
pub(crate) fn chunk(data: &[u8]) -> Option<Chunk<'_>> {
    // Validating the whole line once is cheaper than per string, and only stricter than serde
    // (which ignores the bytes of an unknown string): outside strings non-ASCII is an error anyway.
    let text = std::str::from_utf8(data).ok()?;
    let mut s = Scan {
        s: text,
        b: data,
        i: 0,
    };
    let mut c = Chunk {
        id: None,
        model: None,
        choices: FirstChoice(None),
        usage: None,
        error: None,
    };
    let mut seen = Seen(0);
    s.object(|s, key| {
        match key {
            b"id" => {
                seen.once(1)?;
                c.id = s.opt_string()?;
            }
            b"model" => {
                seen.once(2)?;
                c.model = s.opt_string()?;
            }
            b"choices" => {
                seen.once(4)?;
                c.choices = s.choices()?;
            }
            b"usage" => {
                seen.once(8)?;
                s.null()?;
            }
            b"error" => {
                seen.once(16)?;
                s.null()?;
            }
            _ => s.unknown()?,
        }
        Some(())
    })?;
    s.ws();
    (s.i == data.len()).then_some(c)
}

/// Known keys seen in one object, as bits.
struct Seen(u8);

impl Seen {
    #[inline]
    fn once(&mut self, bit: u8) -> Option<()> {
        if self.0 & bit != 0 {
            return None;
        }
        self.0 |= bit;
        Some(())
    }
}

struct Scan<'a> {
    /// The line, valid UTF-8.
    s: &'a str,
    /// The same, as bytes.
    b: &'a [u8],
    i: usize,
}

impl<'a> Scan<'a> {
    #[inline]
    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    /// The next byte after whitespace (not consumed).
    #[inline]
    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.b.get(self.i).copied()
    }

    #[inline]
    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.i += 1)
    }

    #[inline]
    fn lit(&mut self, word: &[u8]) -> Option<()> {
        self.ws();
        self.b
            .get(self.i..)?
            .starts_with(word)
            .then(|| self.i += word.len())
    }

    #[inline]
    fn null(&mut self) -> Option<()> {
        self.lit(b"null")
    }

    /// An object: `f(self, key)` reads each value. The key is returned raw; one with an escape
    /// declines (serde would match it after unescaping).
    #[inline]
    fn object(&mut self, mut f: impl FnMut(&mut Self, &'a [u8]) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        loop {
            self.eat(b'"')?;
            let start = self.i;
            loop {
                match *self.b.get(self.i)? {
                    b'"' => break,
                    b'\\' | 0..=0x1f => return None,
                    _ => self.i += 1,
                }
            }
            let key = &self.b[start..self.i];
            self.i += 1;
            self.eat(b':')?;
            f(self, key)?;
            match self.peek()? {
                b',' => self.i += 1,
                b'}' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A string token: borrowed when it has no escape, else decoded by serde_json.
    #[inline]
    fn string(&mut self) -> Option<Cow<'a, str>> {
        self.eat(b'"')?;
        let start = self.i;
        let mut escaped = false;
        loop {
            match *self.b.get(self.i)? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    self.i += 2;
                }
                0..=0x1f => return None,
                _ => self.i += 1,
            }
        }
        let end = self.i;
        self.i += 1;
        if escaped {
            serde_json::from_str::<String>(self.s.get(start - 1..self.i)?)
                .ok()
                .map(Cow::Owned)
        } else {
            // Both ends are at a quote, so on character boundaries.
            self.s.get(start..end).map(Cow::Borrowed)
        }
    }

    /// A string or `null`.
    #[inline]
    fn opt_string(&mut self) -> Option<Option<Str<'a>>> {
        match self.peek()? {
            b'"' => Some(Some(Str(self.string()?))),
            b'n' => self.null().map(|_| None),
            _ => None,
        }
    }

    /// The value of a key the chunk types do not name: a scalar only.
    fn unknown(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.string().map(drop),
            b'n' => self.null(),
            b't' => self.lit(b"true"),
            b'f' => self.lit(b"false"),
            b'-' | b'0'..=b'9' => self.integer(),
            _ => None,
        }
    }

    /// An integer in JSON's grammar (`-?(0|[1-9][0-9]*)`); a fraction or exponent after it
    /// declines, since the caller then finds neither `,` nor `}`.
    fn integer(&mut self) -> Option<()> {
        if self.b.get(self.i) == Some(&b'-') {
            self.i += 1;
        }
        match *self.b.get(self.i)? {
            b'0' => self.i += 1,
            b'1'..=b'9' => {
                self.i += 1;
                while let Some(b'0'..=b'9') = self.b.get(self.i) {
                    self.i += 1;
                }
            }
            _ => return None,
        }
        Some(())
    }

    /// `choices`: `null`, `[]` or one choice with index 0.
    fn choices(&mut self) -> Option<FirstChoice<'a>> {
        match self.peek()? {
            b'n' => {
                self.null()?;
                Some(FirstChoice(None))
            }
            b'[' => {
                self.i += 1;
                if self.peek()? == b']' {
                    self.i += 1;
                    return Some(FirstChoice(None));
                }
                let c = self.choice()?;
                self.eat(b']')?;
                Some(FirstChoice(Some(c)))
            }
            _ => None,
        }
    }

    fn choice(&mut self) -> Option<ChoiceDelta<'a>> {
        let mut c = ChoiceDelta {
            index: 0,
            delta: None,
            finish_reason: None,
        };
        let mut seen = Seen(0);
        self.object(|s, key| {
            match key {
                b"index" => {
                    seen.once(1)?;
                    s.eat(b'0')?;
                }
                b"delta" => {
                    seen.once(2)?;
                    c.delta = match s.peek()? {
                        b'n' => s.null().map(|_| None)?,
                        _ => Some(s.delta()?),
                    };
                }
                b"finish_reason" => {
                    seen.once(4)?;
                    c.finish_reason = s.opt_string()?;
                }
                _ => s.unknown()?,
            }
            Some(())
        })?;
        Some(c)
    }

    fn delta(&mut self) -> Option<Delta<'a>> {
        let mut d = Delta {
            content: None,
            refusal: None,
            reasoning_content: None,
            reasoning: None,
            tool_calls: Frags::default(),
            function_call: None,
        };
        let mut seen = Seen(0);
        self.object(|s, key| {
            match key {
                b"content" => {
                    seen.once(1)?;
                    d.content = s.opt_string()?;
                }
                b"refusal" => {
                    seen.once(2)?;
                    d.refusal = s.opt_string()?;
                }
                b"reasoning_content" => {
                    seen.once(4)?;
                    d.reasoning_content = s.opt_string()?;
                }
                b"reasoning" => {
                    seen.once(8)?;
                    d.reasoning = s.opt_string()?;
                }
                b"tool_calls" => {
                    seen.once(16)?;
                    s.null()?;
                }
                b"function_call" => {
                    seen.once(32)?;
                    s.null()?;
                }
                _ => s.unknown()?,
            }
            Some(())
        })?;
        Some(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(data: &[u8]) -> Option<Chunk<'_>> {
        serde_json::from_slice(data).ok()
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
            assert_eq!(Some(f), full(line), "{}", String::from_utf8_lossy(line));
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
        assert_eq!(Some(&c), full(line).as_ref());
        let d = c.choices.0.unwrap().delta.unwrap();
        assert_eq!(d.content.unwrap().as_str(), "a\"b\\c\u{1f600}/");
    }
}
