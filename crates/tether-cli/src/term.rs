//! Terminal output is inert: everything a model, a tool, a file or an agent says is printed with
//! the characters that drive a terminal escaped, so it can neither move the cursor, erase or
//! rewrite lines, retitle the window, nor reorder what is shown.
//!
//! Escaped: C0 controls (U+0000–U+001F: ESC, CR, BS, BEL, ...), DEL, C1 controls
//! (U+0080–U+009F, e.g. the 8-bit CSI U+009B), the bidirectional controls that reorder text
//! (U+061C, U+200E, U+200F, U+202A–U+202E, U+2066–U+2069) and the Unicode line and paragraph
//! separators (U+2028, U+2029). Newline and tab stay as they are in streamed prose only. C0
//! controls and DEL print as `\xNN` (`\n`, `\t`, `\r` by name), the others as `\u{NNNN}`.
//! [`Inert::Exact`] also doubles backslashes, so what a person approves reads back to exactly
//! one text.

use std::borrow::Cow;
use std::fmt::Write as _;

/// How a piece of outside text is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inert {
    /// Streamed prose (model and agent text): newlines and tabs stay, everything else that
    /// drives a terminal is escaped.
    Prose,
    /// One line (tool calls and result previews, titles, errors): newlines and tabs escaped too.
    Line,
    /// What a person is asked to approve: one line, backslashes doubled, so the exact text (a
    /// command with a newline in it, say) is unambiguous.
    Exact,
}

/// Whether `c` drives a terminal (or reorders text) when printed raw.
fn is_control(c: char) -> bool {
    matches!(c,
        '\u{0}'..='\u{1f}'
        | '\u{7f}'..='\u{9f}'
        | '\u{61c}'
        | '\u{200e}'
        | '\u{200f}'
        | '\u{202a}'..='\u{202e}'
        | '\u{2066}'..='\u{2069}'
        | '\u{2028}'
        | '\u{2029}')
}

fn escapes(c: char, how: Inert) -> bool {
    match c {
        '\n' | '\t' => how != Inert::Prose,
        '\\' => how == Inert::Exact,
        c => is_control(c),
    }
}

/// `s` made safe to print as `how` says (borrowed when nothing needed escaping).
pub fn inert(s: &str, how: Inert) -> Cow<'_, str> {
    let Some(first) = s.find(|c| escapes(c, how)) else {
        return Cow::Borrowed(s);
    };
    let mut out = String::with_capacity(s.len() + 8);
    out.push_str(&s[..first]);
    for c in s[first..].chars() {
        if !escapes(c, how) {
            out.push(c);
            continue;
        }
        match c {
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x80 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
        }
    }
    Cow::Owned(out)
}

/// A line of JSON (`--json`) made safe to print: the controls JSON leaves raw inside strings
/// (DEL, C1, bidi, separators) become `\uNNNN` escapes, which decode to the same value (they
/// can only occur inside strings: everything else JSON writes is ASCII).
pub fn inert_json(json: &str) -> Cow<'_, str> {
    let raw = |c: char| c >= '\u{7f}' && is_control(c);
    let Some(first) = json.find(raw) else {
        return Cow::Borrowed(json);
    };
    let mut out = String::with_capacity(json.len() + 8);
    out.push_str(&json[..first]);
    for c in json[first..].chars() {
        if raw(c) {
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Reads an [`Inert::Exact`] text back.
    fn unescape(s: &str) -> String {
        let mut out = String::new();
        let mut it = s.chars().peekable();
        while let Some(c) = it.next() {
            if c != '\\' {
                out.push(c);
                continue;
            }
            match it.next() {
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some('r') => out.push('\r'),
                Some('\\') => out.push('\\'),
                Some('x') => {
                    let h: String = it.by_ref().take(2).collect();
                    out.push(char::from_u32(u32::from_str_radix(&h, 16).unwrap()).unwrap());
                }
                Some('u') => {
                    assert_eq!(it.next(), Some('{'));
                    let h: String = it.by_ref().take_while(|c| *c != '}').collect();
                    out.push(char::from_u32(u32::from_str_radix(&h, 16).unwrap()).unwrap());
                }
                other => panic!("unexpected escape {other:?} in {s:?}"),
            }
        }
        out
    }

    #[test]
    fn the_command_that_erased_itself_is_shown_whole() {
        let cmd = "run `touch pwned\r\x1b[2K\x1b[1Aecho harmless`";
        assert_eq!(
            inert(cmd, Inert::Exact),
            "run `touch pwned\\r\\x1b[2K\\x1b[1Aecho harmless`"
        );
        assert_eq!(inert("a\nb", Inert::Exact), "a\\nb");
        assert_eq!(inert("a\nb\tc", Inert::Prose), "a\nb\tc");
        assert_eq!(
            inert("a\\nb", Inert::Exact),
            "a\\\\nb",
            "a literal backslash-n is not a newline"
        );
        assert_eq!(inert("a\\nb", Inert::Line), "a\\nb");
        assert_eq!(inert("\u{9b}31m", Inert::Prose), "\\u{9b}31m");
        assert_eq!(inert("abc\u{202e}fed", Inert::Prose), "abc\\u{202e}fed");
        assert_eq!(inert("\u{2066}x\u{2069}", Inert::Line), "\\u{2066}x\\u{2069}");
        assert_eq!(
            inert("bell\x07 del\x7f nul\0", Inert::Prose),
            "bell\\x07 del\\x7f nul\\x00"
        );
        assert!(matches!(
            inert("plain text, émoji 🦀", Inert::Exact),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn json_keeps_its_value_and_loses_its_raw_controls() {
        let v = serde_json::json!({"t": "a\u{9b}b\u{202e}c\u{7f}\u{1b}"});
        let line = serde_json::to_string(&v).unwrap();
        let safe = inert_json(&line);
        assert!(!safe.chars().any(is_control), "{safe}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&safe).unwrap(), v);
    }

    proptest! {
        #[test]
        fn nothing_that_drives_a_terminal_is_left(s in "\\PC*|[\\x00-\\x1f\\x7f-\\u{9f}\\u{202a}-\\u{202e}\\u{2066}-\\u{2069}a\\\\\n]{0,40}") {
            for how in [Inert::Prose, Inert::Line, Inert::Exact] {
                let out = inert(&s, how);
                for c in out.chars() {
                    let allowed = how == Inert::Prose && (c == '\n' || c == '\t');
                    prop_assert!(!is_control(c) || allowed, "{:?} left in {:?} ({:?})", c, out, how);
                }
            }
        }

        #[test]
        fn exact_reads_back_to_the_same_text(s in "\\PC*|[\\x00-\\x1f\\x7f-\\u{9f}\\u{202a}-\\u{202e}\\u{2066}-\\u{2069}ax{}u\\\\\n]{0,40}") {
            prop_assert_eq!(unescape(&inert(&s, Inert::Exact)), s);
        }

        #[test]
        fn safe_text_is_unchanged(s in "[^\\x00-\\x1f\\x7f-\\u{9f}\\u{61c}\\u{200e}\\u{200f}\\u{202a}-\\u{202e}\\u{2066}-\\u{2069}\\u{2028}\\u{2029}\\\\]*") {
            for how in [Inert::Prose, Inert::Line, Inert::Exact] {
                prop_assert_eq!(inert(&s, how), s.as_str());
            }
        }

        #[test]
        fn json_lines_decode_to_the_same_value(s in "\\PC*|[\\x00-\\x1f\\x7f-\\u{9f}\\u{202a}-\\u{202e}\\u{2066}-\\u{2069}a\"\\\\]{0,40}") {
            let v = serde_json::json!({"s": s});
            let line = serde_json::to_string(&v).unwrap();
            let safe = inert_json(&line);
            prop_assert!(!safe.chars().any(is_control));
            prop_assert_eq!(serde_json::from_str::<serde_json::Value>(&safe).unwrap(), v);
        }
    }
}
