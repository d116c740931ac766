//! A forward JSON scanner for the wire crates' fast paths: the shared half of the hand-written
//! decoders in `tether-openai` (the chat-completion chunk) and `tether-acp` (the text
//! `session/update`). Behind the `json-scan` feature; not a general JSON parser.
//!
//! # Why here
//!
//! Both fast paths read one small JSON object of a known shape in a single left-to-right pass
//! (compare each key against a handful of literals, borrow the strings, decline anything
//! unexpected) because serde's derive machinery was, profiled, the largest cost of relaying a
//! delta (see each crate's `fast.rs`). They share everything but the shape itself, so that part
//! lives once, in the one crate both depend on: `tether-http` would have pulled reqwest into
//! `tether-acp`, which speaks JSON-RPC over stdio, and a crate of its own would add a publish
//! step for ~300 lines. The feature keeps it out of a normal build of this crate.
//!
//! # The contract
//!
//! Every method returns `None` when the input is not what it reads (the caller then declines
//! and takes its full serde path); on `Some` it has read exactly what serde_json would have,
//! with the same result:
//! - strings without escapes are borrowed from the input; a string with escapes is decoded by
//!   serde_json itself, so escape handling (`\uXXXX`, surrogate pairs, errors) is serde's by
//!   construction; a raw control character in a string declines (serde rejects it);
//! - whitespace is JSON's four characters; numbers are integers only (a fraction or exponent
//!   leaves the scanner before it, so the caller finds neither `,` nor `}` and declines);
//! - the input is a `&str`, so it was validated as UTF-8 once, as a whole (only stricter than
//!   serde, which ignores the bytes of a string it skips: outside strings non-ASCII is an error
//!   anyway).
//!
//! ```
//! use tether::json_scan::{Scan, once};
//! let mut s = Scan::new(r#" {"name": "a\u00e9", "n": 12, "x": null} "#);
//! let (mut name, mut n) = (None, None);
//! s.object(|s, key| match &*key {
//!     "name" => once(&mut name, s.string()),
//!     "n" => once(&mut n, s.integer()),
//!     _ => s.scalar(),
//! })
//! .unwrap();
//! assert!(s.end().is_some());
//! assert_eq!(name.as_deref(), Some("aé"));
//! ```

use std::borrow::Cow;

/// A cursor over one JSON text: each method reads one token or value at the cursor, after any
/// whitespace, and returns `None` (the position then unspecified) if it is not there.
#[derive(Debug, Clone)]
pub struct Scan<'a> {
    line: &'a str,
    i: usize,
}

impl<'a> Scan<'a> {
    /// A cursor at the start of `line`.
    #[inline]
    pub fn new(line: &'a str) -> Self {
        Scan { line, i: 0 }
    }

    /// The cursor's byte offset in the input.
    #[inline]
    pub fn pos(&self) -> usize {
        self.i
    }

    /// Skips JSON whitespace.
    #[inline]
    pub fn ws(&mut self) {
        let b = self.line.as_bytes();
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = b.get(self.i) {
            self.i += 1;
        }
    }

    /// The next byte after whitespace, not consumed.
    #[inline]
    pub fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.line.as_bytes().get(self.i).copied()
    }

    /// Consumes the byte `c` after whitespace.
    #[inline]
    pub fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.i += 1)
    }

    /// Consumes exactly `lit` at the cursor (no whitespace skipped: a canonical form's constant
    /// parts are matched byte for byte).
    #[inline]
    pub fn lit(&mut self, lit: &[u8]) -> Option<()> {
        let rest = self.line.as_bytes().get(self.i..)?;
        rest.starts_with(lit).then(|| self.i += lit.len())
    }

    /// `null`, after whitespace.
    #[inline]
    pub fn null(&mut self) -> Option<()> {
        self.ws();
        self.lit(b"null")
    }

    /// Only whitespace is left (what `serde_json::from_str` requires after the value).
    #[inline]
    pub fn end(&mut self) -> Option<()> {
        self.ws();
        (self.i == self.line.len()).then_some(())
    }

    /// A string, after whitespace: borrowed when it has no escape, else decoded by serde_json.
    #[inline]
    pub fn string(&mut self) -> Option<Cow<'a, str>> {
        self.eat(b'"')?;
        let s = self.line.as_bytes();
        let start = self.i;
        let mut j = find_special(s, start);
        match *s.get(j)? {
            b'"' => {
                self.i = j + 1;
                // Both ends are at an ASCII quote, so on character boundaries.
                self.line.get(start..j).map(Cow::Borrowed)
            }
            b'\\' => {
                // Find the closing quote (an escape is `\` and one more byte; `\u` is followed
                // by hex digits), then let serde_json decode and validate it all.
                loop {
                    match *s.get(j)? {
                        b'"' => break,
                        b'\\' => j = find_special(s, j + 2),
                        _ => return None,
                    }
                }
                self.i = j + 1;
                let quoted = self.line.get(start - 1..j + 1)?;
                serde_json::from_str::<String>(quoted).ok().map(Cow::Owned)
            }
            _ => None,
        }
    }

    /// A string or `null`.
    #[inline]
    pub fn opt_string(&mut self) -> Option<Option<Cow<'a, str>>> {
        match self.peek()? {
            b'"' => self.string().map(Some),
            b'n' => self.null().map(|()| None),
            _ => None,
        }
    }

    /// An integer in JSON's grammar (`-?(0|[1-9][0-9]*)`), after whitespace. A fraction or
    /// exponent after it is left unread.
    pub fn integer(&mut self) -> Option<()> {
        self.ws();
        let b = self.line.as_bytes();
        if b.get(self.i) == Some(&b'-') {
            self.i += 1;
        }
        match *b.get(self.i)? {
            b'0' => self.i += 1,
            b'1'..=b'9' => {
                self.i += 1;
                while let Some(b'0'..=b'9') = b.get(self.i) {
                    self.i += 1;
                }
            }
            _ => return None,
        }
        Some(())
    }

    /// A scalar value, skipped: a string, `true`, `false`, `null` or an integer (for the value of
    /// a key the shape does not name; an object or array declines).
    pub fn scalar(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.string().map(drop),
            b'n' => self.lit(b"null"),
            b't' => self.lit(b"true"),
            b'f' => self.lit(b"false"),
            b'-' | b'0'..=b'9' => self.integer(),
            _ => None,
        }
    }

    /// An object: `field(self, key)` reads each member's value (and must consume it). Keys are
    /// decoded like any string (an escaped key comes as [`Cow::Owned`]: a caller that declines
    /// escaped keys checks for that).
    #[inline]
    pub fn object(&mut self, mut field: impl FnMut(&mut Self, Cow<'a, str>) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        loop {
            let key = self.string()?;
            self.eat(b':')?;
            field(self, key)?;
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
}

/// Fills `slot` with the value `v` read, once: a second value for the same key declines, as a
/// duplicate field fails serde's derive.
#[inline]
pub fn once<T>(slot: &mut Option<T>, v: Option<T>) -> Option<()> {
    if slot.is_some() {
        return None;
    }
    *slot = Some(v?);
    Some(())
}

/// Known keys seen in one object, one bit each (for keys whose value is read into something
/// other than an `Option` slot, where [`once`] does not fit).
#[derive(Debug, Default, Clone, Copy)]
pub struct Seen(u32);

impl Seen {
    /// Marks `bit` seen; `None` if it already was (a duplicate key).
    #[inline]
    pub fn once(&mut self, bit: u32) -> Option<()> {
        if self.0 & bit != 0 {
            return None;
        }
        self.0 |= bit;
        Some(())
    }
}

/// The string token `buf` starts with (quotes included): up to the first unescaped quote, with
/// no raw control character (serde's rule, and so no CR or LF). Works on bytes not yet
/// validated, for matching a token inside a larger buffer.
#[inline]
pub fn string_token(buf: &[u8]) -> Option<&[u8]> {
    if buf.first() != Some(&b'"') {
        return None;
    }
    let mut i = find_special_short(buf, 1);
    loop {
        match *buf.get(i)? {
            b'"' => return Some(&buf[..=i]),
            b'\\' => i = find_special(buf, i + 2),
            _ => return None,
        }
    }
}

/// The value of the string token `token` (exactly one, as [`string_token`] finds): borrowed
/// without escapes, else decoded by serde_json; `None` if it is not valid UTF-8 or not one token.
#[inline]
pub fn decode_token(token: &[u8]) -> Option<Cow<'_, str>> {
    let text = std::str::from_utf8(token).ok()?;
    // Most tokens have no escape: their inside, borrowed, after one short search.
    if let Some(inner) = text.strip_prefix('"').and_then(|t| t.strip_suffix('"'))
        && find_special_short(inner.as_bytes(), 0) == inner.len()
    {
        return Some(Cow::Borrowed(inner));
    }
    let mut s = Scan::new(text);
    let v = s.string()?;
    (s.i == token.len()).then_some(v)
}

/// [`find_special`] for a string that is usually short (a token's text, an id, a model name):
/// its first 16 bytes a byte at a time, then eight at a time. On the template path (one short
/// token per line) the word search alone cost more than the byte loop it replaced (callgrind:
/// +4.7 % instructions per line).
#[inline]
fn find_special_short(s: &[u8], from: usize) -> usize {
    let end = s.len().min(from.saturating_add(16));
    if let Some(head) = s.get(from..end) {
        if let Some(p) = head.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20) {
            return from + p;
        }
        if end == s.len() {
            return end;
        }
        return find_special(s, end);
    }
    find_special(s, from)
}

const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;

/// The index of the first `"`, `\` or control character at or after `from` (or a length past
/// the end), eight bytes at a time: the text of a delta is most of a line's bytes.
#[inline]
fn find_special(s: &[u8], from: usize) -> usize {
    let mut i = from;
    while let Some(w) = s.get(i..i + 8) {
        let Ok(bytes) = <[u8; 8]>::try_from(w) else { break };
        let x = u64::from_le_bytes(bytes);
        let zero = |v: u64| v.wrapping_sub(LO) & !v & HI;
        let quote = zero(x ^ (LO * b'"' as u64));
        let backslash = zero(x ^ (LO * b'\\' as u64));
        let control = x.wrapping_sub(LO * 0x20) & !x & HI;
        if quote | backslash | control != 0 {
            break;
        }
        i += 8;
    }
    while let Some(&b) = s.get(i) {
        if b == b'"' || b == b'\\' || b < 0x20 {
            return i;
        }
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What serde_json reads of a JSON string literal.
    fn serde_string(text: &str) -> Option<String> {
        serde_json::from_str::<String>(text).ok()
    }

    #[test]
    fn strings_read_as_serde_does_or_decline() {
        for text in [
            r#""""#,
            r#""plain ascii text longer than eight bytes""#,
            r#""w\u00f6rld \ud83d\ude00 \"q\" \\ \/ \n""#,
            "\"na\u{ef}ve \u{1f600}\"",
            r#""\ud800""#,
            r#""\x""#,
            "\"raw\ncontrol\"",
            "\"tab\tinside a long string\"",
            r#""unterminated"#,
            r#""ends in a backslash\"#,
        ] {
            let mut s = Scan::new(text);
            let got = s.string().filter(|_| s.end().is_some());
            assert_eq!(got.as_deref(), serde_string(text).as_deref(), "{text}");
            assert_eq!(
                decode_token(text.as_bytes()).as_deref(),
                serde_string(text).as_deref(),
                "{text}"
            );
        }
    }

    proptest::proptest! {
        /// Whatever its length (the short search's 16 bytes and past them), a token
        /// `string_token` finds decodes as serde_json reads it, or is declined where serde fails.
        #[test]
        fn tokens_of_any_length_decode_as_serde_does(
            body in "[a-z\"\\\\/nu0-9\u{e9}\t]{0,40}",
            tail in "[a-z\"]{0,3}",
        ) {
            let text = format!("\"{body}\"{tail}");
            if let Some(token) = string_token(text.as_bytes()) {
                let quoted = std::str::from_utf8(token).expect("a prefix ending at an ASCII quote");
                proptest::prop_assert_eq!(
                    decode_token(token).as_deref(),
                    serde_string(quoted).as_deref(),
                    "{}", quoted
                );
            }
        }
    }

    #[test]
    fn string_tokens_end_at_the_first_unescaped_quote() {
        assert_eq!(string_token(br#""ab\"c"rest"#), Some(&br#""ab\"c""#[..]));
        assert_eq!(
            string_token(br#""a long run of text\\"x"#),
            Some(&br#""a long run of text\\""#[..])
        );
        assert_eq!(string_token(b"\"a\nb\""), None);
        assert_eq!(string_token(br#"x"a""#), None);
        assert_eq!(string_token(br#""open"#), None);
    }

    #[test]
    fn scalars_integers_and_objects() {
        for (text, ok) in [
            ("0", true),
            ("-12", true),
            ("true", true),
            ("null", true),
            (r#""s""#, true),
            ("01", false),
            ("1.5", false),
            ("1e3", false),
            ("-", false),
            ("{}", false),
            ("[]", false),
            ("nul", false),
        ] {
            let mut s = Scan::new(text);
            assert_eq!(s.scalar().and_then(|()| s.end()).is_some(), ok, "{text}");
        }
        let mut s = Scan::new(r#"{ "a" : 1 , "b\u0062" : "x" }"#);
        let mut keys = Vec::new();
        s.object(|s, k| {
            keys.push((k.to_string(), matches!(k, Cow::Owned(_))));
            s.scalar()
        })
        .unwrap();
        assert_eq!(keys, [("a".to_owned(), false), ("bb".to_owned(), true)]);
        for bad in [r#"{"a":1,}"#, r#"{"a" 1}"#, r#"{"a":1"#, r#"{a:1}"#] {
            assert!(Scan::new(bad).object(|s, _| s.scalar()).is_none(), "{bad}");
        }
        let (mut a, mut seen) = (None, Seen::default());
        assert!(once(&mut a, Some(1)).is_some() && once(&mut a, Some(2)).is_none());
        assert!(seen.once(4).is_some() && seen.once(4).is_none() && seen.once(8).is_some());
    }
}
