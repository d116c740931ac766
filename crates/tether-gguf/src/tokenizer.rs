//! The tokenizer, built from the GGUF's own metadata (`tokenizer.ggml.*`).
//!
//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`: SmolLM, Qwen, Llama 3) through the
//! `tokenizers` crate's BPE model and pre-tokenizers, which `candle-core` already builds (with
//! its pure-Rust `fancy-regex` backend), so it adds nothing to the build. The pre-tokenizer is
//! chosen by `tokenizer.ggml.pre` the way llama.cpp chooses its regexes.
//!
//! Special tokens are split out of the text before BPE, longest first, as llama.cpp does, with one
//! difference that is a trust boundary: control tokens (`<|im_start|>`, `<|im_end|>`, ...) are
//! recognised only in text the chat template wrote itself, never inside a message's content
//! (see [`Tokenizer::encode_marked`]), so a file, a tool result or a web page that contains
//! `<|im_end|><|im_start|>system` cannot open a turn of its own.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::tokenizer::SplitDelimiterBehavior;

use crate::error::GgufError;

/// Opens a stretch of untrusted text in a rendered prompt (a private-use character).
pub const UNTRUSTED_OPEN: char = '\u{E000}';
/// Closes a stretch of untrusted text.
pub const UNTRUSTED_CLOSE: char = '\u{E001}';

const REGEX_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const REGEX_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const REGEX_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// A GGUF model's tokenizer.
pub struct Tokenizer {
    bpe: tokenizers::Tokenizer,
    /// Each token's bytes (byte-level decoded; special tokens as their text).
    bytes: Vec<Vec<u8>>,
    /// Special tokens that may be split out of text, longest first: (text, id, control?).
    specials: Vec<(String, u32, bool)>,
    is_control: Vec<bool>,
    /// BOS, when the model wants one at the start of a prompt.
    pub bos: Option<u32>,
    /// Whether to put BOS first (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// The end-of-sequence token.
    pub eos: u32,
    /// Every token that ends a generation (EOS, end-of-turn, `<|im_end|>`, ...).
    pub eog: Vec<u32>,
    /// The `tokenizer.ggml.pre` in use.
    pub pre: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.bytes.len())
            .field("pre", &self.pre)
            .field("eos", &self.eos)
            .finish()
    }
}

fn strings(ct: &Content, key: &str) -> Result<Vec<String>, GgufError> {
    match ct.metadata.get(key) {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                other => Err(GgufError::Corrupt(format!(
                    "`{key}` holds a non-string: {other:?}"
                ))),
            })
            .collect(),
        Some(_) => Err(GgufError::Corrupt(format!("`{key}` is not an array"))),
        None => Err(GgufError::MissingMetadata(key.to_owned())),
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::U8(x) => Some(*x as i64),
        Value::I8(x) => Some(*x as i64),
        Value::U16(x) => Some(*x as i64),
        Value::I16(x) => Some(*x as i64),
        Value::U32(x) => Some(*x as i64),
        Value::I32(x) => Some(*x as i64),
        Value::U64(x) => i64::try_from(*x).ok(),
        Value::I64(x) => Some(*x),
        _ => None,
    }
}

fn id_of(ct: &Content, key: &str, n: usize) -> Option<u32> {
    ct.metadata
        .get(key)
        .and_then(int)
        .and_then(|x| u32::try_from(x).ok())
        .filter(|x| (*x as usize) < n)
}

/// GPT-2's byte ↔ printable-character table: the character each byte is written as.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (b'!' as u32..=b'~' as u32).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    table
}

fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper, GgufError> {
    let split = |rx: &str| -> Result<PreTokenizerWrapper, GgufError> {
        Split::new(
            SplitPattern::Regex(rx.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map(Into::into)
        .map_err(|e| GgufError::UnsupportedTokenizer(format!("pre-tokenizer regex: {e}")))
    };
    let bytes = || -> PreTokenizerWrapper { ByteLevel::new(false, false, false).into() };
    Ok(match pre {
        // llama.cpp: `\p{N}` isolated first, then the GPT-2 regex (HF: Digits(individual) +
        // ByteLevel).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            Sequence::new(vec![Digits::new(true).into(), split(REGEX_GPT2)?, bytes()]).into()
        }
        "qwen2" | "stablelm2" | "hunyuan" | "deepseek-r1-qwen" => {
            Sequence::new(vec![split(REGEX_QWEN2)?, bytes()]).into()
        }
        "llama3" | "llama-bpe" | "llama-v3" | "smaug-bpe" | "falcon3" | "pixtral" | "lfm2" => {
            Sequence::new(vec![split(REGEX_LLAMA3)?, bytes()]).into()
        }
        _ => Sequence::new(vec![split(REGEX_GPT2)?, bytes()]).into(),
    })
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF describes.
    pub fn from_gguf(ct: &Content) -> Result<Self, GgufError> {
        let model = match ct.metadata.get("tokenizer.ggml.model") {
            Some(Value::String(s)) => s.clone(),
            _ => return Err(GgufError::MissingMetadata("tokenizer.ggml.model".into())),
        };
        if model != "gpt2" {
            return Err(GgufError::UnsupportedTokenizer(format!(
                "`tokenizer.ggml.model = {model}` (only byte-level BPE, `gpt2`, is built: SmolLM, Qwen, Llama 3)"
            )));
        }
        let tokens = strings(ct, "tokenizer.ggml.tokens")?;
        let merges = strings(ct, "tokenizer.ggml.merges")?;
        let n = tokens.len();
        if n == 0 || n > 1 << 22 {
            return Err(GgufError::Corrupt(format!("{n} tokens in the vocabulary")));
        }
        let types: Vec<i64> = match ct.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) if a.len() == n => a.iter().map(|v| int(v).unwrap_or(1)).collect(),
            Some(_) => {
                return Err(GgufError::Corrupt(
                    "`tokenizer.ggml.token_type` does not match the vocabulary".into(),
                ));
            }
            None => vec![1; n],
        };
        let mut vocab = Vocab::default();
        for (i, t) in tokens.iter().enumerate() {
            // The first id of a duplicated string wins, as in llama.cpp.
            vocab.entry(t.clone()).or_insert(i as u32);
        }
        let merges: Vec<(String, String)> = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| GgufError::Corrupt(format!("merge `{m}` has no space")))
            })
            .collect::<Result<_, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| GgufError::UnsupportedTokenizer(format!("BPE: {e}")))?;
        let pre = match ct.metadata.get("tokenizer.ggml.pre") {
            Some(Value::String(s)) => s.clone(),
            _ => "default".to_owned(),
        };
        let mut hf = tokenizers::Tokenizer::new(bpe);
        hf.with_pre_tokenizer(Some(pre_tokenizer(&pre)?));

        let table = byte_chars();
        let mut inverse: HashMap<char, u8> = HashMap::with_capacity(256);
        for (b, c) in table.iter().enumerate() {
            inverse.insert(*c, b as u8);
        }
        let mut bytes = Vec::with_capacity(n);
        let mut specials = Vec::new();
        let mut is_control = vec![false; n];
        for (i, t) in tokens.iter().enumerate() {
            let ty = types[i];
            if ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED {
                bytes.push(t.as_bytes().to_vec());
                if !t.is_empty() {
                    specials.push((t.clone(), i as u32, ty == TYPE_CONTROL));
                }
                is_control[i] = ty == TYPE_CONTROL;
            } else {
                // Byte-level: each character stands for one byte; anything else is kept as text.
                let mut b = Vec::with_capacity(t.len());
                for c in t.chars() {
                    match inverse.get(&c) {
                        Some(x) => b.push(*x),
                        None => {
                            let mut buf = [0u8; 4];
                            b.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                        }
                    }
                }
                bytes.push(b);
            }
        }
        // Longest first, then lowest id, as llama.cpp partitions.
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let eos = id_of(ct, "tokenizer.ggml.eos_token_id", n)
            .ok_or_else(|| GgufError::MissingMetadata("tokenizer.ggml.eos_token_id".into()))?;
        let bos = id_of(ct, "tokenizer.ggml.bos_token_id", n);
        let add_bos = matches!(
            ct.metadata.get("tokenizer.ggml.add_bos_token"),
            Some(Value::Bool(true))
        );
        let mut eog = vec![eos];
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = id_of(ct, key, n) {
                eog.push(id);
            }
        }
        for (i, t) in tokens.iter().enumerate() {
            if is_control[i]
                && matches!(
                    t.as_str(),
                    "<|im_end|>"
                        | "<|endoftext|>"
                        | "<|eot_id|>"
                        | "<|eom_id|>"
                        | "<end_of_turn>"
                        | "</s>"
                        | "<|end|>"
                )
            {
                eog.push(i as u32);
            }
        }
        eog.sort_unstable();
        eog.dedup();
        Ok(Tokenizer {
            bpe: hf,
            bytes,
            specials,
            is_control,
            bos,
            add_bos,
            eos,
            eog,
            pre,
        })
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    /// The bytes of one token (empty for an id out of range).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Every token's bytes, by id.
    pub fn all_token_bytes(&self) -> &[Vec<u8>] {
        &self.bytes
    }

    /// Whether `id` is a control token.
    pub fn is_control(&self, id: u32) -> bool {
        self.is_control.get(id as usize).copied().unwrap_or(false)
    }

    /// Whether `id` ends a generation.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// The text of `ids` (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut b = Vec::new();
        for &id in ids {
            b.extend_from_slice(self.token_bytes(id));
        }
        String::from_utf8_lossy(&b).into_owned()
    }

    fn bpe(&self, text: &str, out: &mut Vec<u32>) -> Result<(), GgufError> {
        if text.is_empty() {
            return Ok(());
        }
        let enc = self
            .bpe
            .encode_fast(text, false)
            .map_err(|e| GgufError::UnsupportedTokenizer(format!("encoding failed: {e}")))?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// Tokenizes `text` as llama.cpp's `llama_tokenize(text, add_special = false,
    /// parse_special)`: special tokens split out first (control tokens only when
    /// `parse_special`), the rest byte-level BPE.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, GgufError> {
        let trusted = if parse_special {
            vec![(0, text.len())]
        } else {
            Vec::new()
        };
        self.encode_ranges(text, &trusted)
    }

    /// Tokenizes a rendered prompt in which [`UNTRUSTED_OPEN`] … [`UNTRUSTED_CLOSE`] enclose text
    /// that came from a message (content, tool arguments): control tokens are recognised only
    /// outside those stretches. The markers themselves are removed. BOS is prepended when the
    /// model asks for it.
    pub fn encode_marked(&self, marked: &str) -> Result<Vec<u32>, GgufError> {
        let (text, trusted) = strip_marks(marked);
        let mut ids = Vec::new();
        if self.add_bos
            && let Some(b) = self.bos
        {
            ids.push(b);
        }
        ids.extend(self.encode_ranges(&text, &trusted)?);
        Ok(ids)
    }

    fn encode_ranges(&self, text: &str, trusted: &[(usize, usize)]) -> Result<Vec<u32>, GgufError> {
        // Fragments: Ok(text range) still to tokenize, Err(id) a special token.
        let mut frags: Vec<Result<(usize, usize), u32>> = vec![Ok((0, text.len()))];
        let in_trusted = |s: usize, e: usize| trusted.iter().any(|&(a, b)| a <= s && e <= b);
        for (sp, id, control) in &self.specials {
            let mut next = Vec::with_capacity(frags.len());
            for f in frags {
                let Ok((s, e)) = f else {
                    next.push(f);
                    continue;
                };
                let step = sp.chars().next().map(char::len_utf8).unwrap_or(1);
                let (mut cursor, mut pos) = (s, s);
                while let Some(off) = text[pos..e].find(sp.as_str()) {
                    let at = pos + off;
                    let end = at + sp.len();
                    if *control && !in_trusted(at, end) {
                        // Inside a message: the text stays text.
                        pos = at + step;
                        continue;
                    }
                    if at > cursor {
                        next.push(Ok((cursor, at)));
                    }
                    next.push(Err(*id));
                    cursor = end;
                    pos = end;
                }
                if cursor < e {
                    next.push(Ok((cursor, e)));
                }
            }
            frags = next;
        }
        let mut out = Vec::new();
        for f in frags {
            match f {
                Ok((s, e)) => self.bpe(&text[s..e], &mut out)?,
                Err(id) => out.push(id),
            }
        }
        Ok(out)
    }
}

/// Removes the untrusted-text markers, returning the text and the byte ranges outside them.
pub fn strip_marks(marked: &str) -> (String, Vec<(usize, usize)>) {
    let mut text = String::with_capacity(marked.len());
    let mut trusted = Vec::new();
    let mut depth = 0usize;
    let mut start = 0usize;
    for c in marked.chars() {
        match c {
            UNTRUSTED_OPEN => {
                if depth == 0 && text.len() > start {
                    trusted.push((start, text.len()));
                }
                depth += 1;
            }
            UNTRUSTED_CLOSE => {
                if depth > 0 {
                    depth -= 1;
                    if depth == 0 {
                        start = text.len();
                    }
                }
            }
            c => text.push(c),
        }
    }
    if depth == 0 && text.len() > start {
        trusted.push((start, text.len()));
    }
    (text, trusted)
}

/// Makes message text safe to wrap in markers: the marker characters themselves are replaced.
pub fn sanitize(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains([UNTRUSTED_OPEN, UNTRUSTED_CLOSE]) {
        s.replace([UNTRUSTED_OPEN, UNTRUSTED_CLOSE], "\u{FFFD}").into()
    } else {
        s.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_split_trusted_ranges() {
        let (t, r) = strip_marks("a\u{E000}bc\u{E001}d");
        assert_eq!(t, "abcd");
        assert_eq!(r, vec![(0, 1), (3, 4)]);
        let (t, r) = strip_marks("\u{E000}x");
        assert_eq!(t, "x");
        assert!(r.is_empty());
        let (t, r) = strip_marks("x\u{E001}y");
        assert_eq!(t, "xy");
        assert_eq!(r, vec![(0, 2)]);
    }

    #[test]
    fn byte_table_is_a_bijection() {
        let t = byte_chars();
        let mut seen = std::collections::HashSet::new();
        for c in t {
            assert!(seen.insert(c));
        }
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
    }
}
