//! The generation loop: slots with their KV caches, prefix reuse, sampling, constraints,
//! streaming, cancellation.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::error::GgufError;
use crate::model::{Cache, Weights};
use crate::tokenizer::Tokenizer;
use crate::tools::{CALL_OPEN, Call, CallStream, Piece};

/// How the next tokens are chosen.
#[derive(Debug, Clone)]
pub struct Sampling {
    /// Temperature; `0` is greedy (the most likely token, ties to the lowest id).
    pub temperature: f32,
    /// Nucleus sampling mass (`1.0`: off).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (`0`: off).
    pub top_k: usize,
    /// The random seed; `None` draws one per call.
    pub seed: Option<u64>,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.2,
            top_p: 0.95,
            top_k: 40,
            seed: None,
        }
    }
}

/// What the model may write, given the tools and `tool_choice`.
#[derive(Debug, Clone)]
pub enum Mode {
    /// Text only.
    Text,
    /// Text, and calls once the model opens one (the grammar of calls).
    Auto(String),
    /// Calls only, from the first token (the grammar of calls).
    Calls(String),
}

/// Counters of one generation (what a follow-up turn reused is asserted from these).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TurnStats {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV entries were already cached (not computed again).
    pub reused_tokens: usize,
    /// Prompt tokens run through the model (pre-filled).
    pub prefilled_tokens: usize,
    /// Tokens generated (including forced ones such as `<tool_call>`).
    pub generated_tokens: usize,
    /// Microseconds spent pre-filling.
    pub prefill_us: u64,
    /// Microseconds from the start to the first generated token.
    pub first_token_us: u64,
    /// Microseconds spent generating after the first token.
    pub decode_us: u64,
}

/// A generation's outcome.
#[derive(Debug, Clone)]
pub struct Generated {
    /// The text (outside tool calls).
    pub text: String,
    /// The tool calls.
    pub calls: Vec<Call>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: &'static str,
    /// Counters.
    pub stats: TurnStats,
}

/// One sequence: its KV cache and the tokens whose entries it holds.
pub struct Slot {
    pub(crate) cache: Cache,
    pub(crate) tokens: Vec<u32>,
}

/// The toktrie view of our tokenizer, for llguidance.
struct Env {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tok
            .encode(&String::from_utf8_lossy(s), false)
            .unwrap_or_default()
    }
}

/// Builds llguidance's token environment: control tokens are marked special (`0xFF` + text), so
/// grammar text can never produce them.
pub fn tok_env(tok: &Arc<Tokenizer>) -> TokEnv {
    let words: Vec<Vec<u8>> = (0..tok.vocab_size() as u32)
        .map(|id| {
            let b = tok.token_bytes(id);
            if tok.is_control(id) {
                let mut v = Vec::with_capacity(b.len() + 1);
                v.push(TokTrie::SPECIAL_TOKEN_MARKER);
                v.extend_from_slice(b);
                v
            } else {
                b.to_vec()
            }
        })
        .collect();
    let mut info = TokRxInfo::new(tok.vocab_size() as u32, tok.eos);
    info.tok_bos = tok.bos;
    let trie = TokTrie::from(&info, &words);
    Arc::new(Env {
        trie,
        tok: tok.clone(),
    })
}

/// Everything a generation needs that does not change between calls.
pub struct Engine {
    pub(crate) weights: Weights,
    pub(crate) tok: Arc<Tokenizer>,
    pub(crate) env: TokEnv,
    pub(crate) factory: Mutex<Option<Arc<ParserFactory>>>,
    pub(crate) slots: Vec<Mutex<Slot>>,
    pub(crate) pool: rayon::ThreadPool,
    pub(crate) context: usize,
    pub(crate) last: Mutex<TurnStats>,
    pub(crate) totals: Mutex<TurnStats>,
}

/// Pre-fill in batches of at most this many tokens.
const BATCH: usize = 256;

fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Emits text with the tail held back while it could still become a stop string or a call
/// opening, and with incomplete UTF-8 held back until its bytes arrive.
struct TextOut {
    bytes: Vec<u8>,
    text: String,
    sent: usize,
}

impl TextOut {
    fn new() -> Self {
        TextOut {
            bytes: Vec::new(),
            text: String::new(),
            sent: 0,
        }
    }

    /// Adds bytes; returns whether new characters were decoded.
    fn push(&mut self, b: &[u8]) {
        self.bytes.extend_from_slice(b);
        let valid = match std::str::from_utf8(&self.bytes) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_some() => {
                // Invalid bytes: replace them and go on.
                let s = String::from_utf8_lossy(&self.bytes).into_owned();
                self.text.push_str(&s);
                self.bytes.clear();
                return;
            }
            Err(e) => e.valid_up_to(),
        };
        if valid > 0 {
            if let Ok(s) = std::str::from_utf8(&self.bytes[..valid]) {
                self.text.push_str(s);
            }
            self.bytes.drain(..valid);
        }
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of one of `pats`.
fn partial_suffix(s: &str, pats: &[&str]) -> usize {
    let mut best = 0;
    for p in pats {
        for k in (1..p.len().min(s.len() + 1)).rev() {
            if k <= best {
                break;
            }
            if s.is_char_boundary(s.len() - k) && p.is_char_boundary(k) && s.ends_with(&p[..k]) {
                best = k;
                break;
            }
        }
    }
    best
}

impl Engine {
    fn factory(&self) -> Result<Arc<ParserFactory>, GgufError> {
        let mut g = self
            .factory
            .lock()
            .map_err(|_| GgufError::Grammar("poisoned".into()))?;
        if let Some(f) = g.as_ref() {
            return Ok(f.clone());
        }
        let mut f = ParserFactory::new_simple(&self.env).map_err(|e| GgufError::Grammar(e.to_string()))?;
        f.set_stderr_log_level(0);
        let f = Arc::new(f);
        *g = Some(f.clone());
        Ok(f)
    }

    fn matcher(&self, lark: &str) -> Result<Matcher, GgufError> {
        let f = self.factory()?;
        let parser = f
            .create_parser(TopLevelGrammar::from_lark(lark.to_owned()))
            .map_err(|e| GgufError::Grammar(e.to_string()))?;
        Ok(Matcher::new(Ok(parser)))
    }

    /// Checks that a grammar compiles (a bad schema fails before any token is spent).
    pub fn check_grammar(&self, lark: &str) -> Result<(), GgufError> {
        let m = self.matcher(lark)?;
        match m.get_error() {
            Some(e) => Err(GgufError::Grammar(e)),
            None => Ok(()),
        }
    }

    /// Takes the free slot whose cached tokens share the longest prefix with `prompt`, or waits
    /// for the best one.
    fn slot(&self, prompt: &[u32]) -> Result<MutexGuard<'_, Slot>, GgufError> {
        let mut best: Option<(usize, MutexGuard<'_, Slot>)> = None;
        for s in &self.slots {
            if let Ok(g) = s.try_lock() {
                let n = lcp(&g.tokens, prompt);
                if best.as_ref().is_none_or(|(b, _)| n > *b) {
                    best = Some((n, g));
                }
            }
        }
        if let Some((_, g)) = best {
            return Ok(g);
        }
        self.slots
            .first()
            .ok_or_else(|| GgufError::Inference("no slots".into()))?
            .lock()
            .map_err(|_| GgufError::Inference("a previous generation panicked".into()))
    }

    /// Runs `tokens` through the model on `slot`, in batches; returns the last position's logits.
    fn feed(&self, slot: &mut Slot, tokens: &[u32], cancel: &AtomicBool) -> Result<Vec<f32>, GgufError> {
        let mut logits = Vec::new();
        for chunk in tokens.chunks(BATCH) {
            if cancel.load(Ordering::Relaxed) {
                return Err(GgufError::Cancelled);
            }
            // The cache grows only when a batch succeeds, so it stays in step with the tokens.
            let t = self
                .pool
                .install(|| self.weights.forward(chunk, &mut slot.cache, false))
                .map_err(GgufError::candle)?;
            slot.tokens.extend_from_slice(chunk);
            logits = t.to_vec1::<f32>().map_err(GgufError::candle)?;
        }
        Ok(logits)
    }

    /// Generates an answer to `prompt` (token ids of the rendered conversation).
    #[allow(clippy::too_many_arguments)] // the options of one generation, each used once
    pub fn generate(
        &self,
        prompt: &[u32],
        mode: &Mode,
        sampling: &Sampling,
        max_tokens: usize,
        stops: &[String],
        cancel: &AtomicBool,
        out: &mut dyn FnMut(Piece),
    ) -> Result<Generated, GgufError> {
        let start = Instant::now();
        if prompt.is_empty() {
            return Err(GgufError::Inference("empty prompt".into()));
        }
        if prompt.len() >= self.context {
            return Err(GgufError::ContextOverflow {
                prompt: prompt.len(),
                context: self.context,
                reserve: 1,
            });
        }
        // Compile the grammar before touching the cache: a bad schema costs nothing.
        let mut matcher = match mode {
            Mode::Text => None,
            Mode::Auto(g) | Mode::Calls(g) => {
                let m = self.matcher(g)?;
                if let Some(e) = m.get_error() {
                    return Err(GgufError::Grammar(e));
                }
                Some(m)
            }
        };
        let mut guard = self.slot(prompt)?;
        let slot = &mut *guard;
        // Reuse the longest common prefix; at least one token must run to get logits.
        let reuse = lcp(&slot.tokens, prompt).min(prompt.len() - 1);
        slot.cache.truncate(reuse);
        slot.tokens.truncate(reuse);
        let mut stats = TurnStats {
            prompt_tokens: prompt.len(),
            reused_tokens: reuse,
            prefilled_tokens: prompt.len() - reuse,
            ..Default::default()
        };
        let mut logits = self.feed(slot, &prompt[reuse..], cancel)?;
        stats.prefill_us = start.elapsed().as_micros() as u64;

        let mut rng = match sampling.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let stop_pats: Vec<&str> = stops
            .iter()
            .map(String::as_str)
            .filter(|s| !s.is_empty())
            .collect();
        let mut held: Vec<&str> = stop_pats.clone();
        let calls_allowed = !matches!(mode, Mode::Text);
        if calls_allowed {
            held.push(CALL_OPEN);
        }
        let mut text = TextOut::new();
        let mut calls = CallStream::default();
        // Constrained: in a call (from the start for `Calls`, after `<tool_call>` for `Auto`).
        let mut in_call = false;
        let mut generated = 0usize;
        let mut finish: &'static str;
        let mut first_at: Option<Instant> = None;
        // Forced tokens: the call opening under `Calls`, neither sampled nor part of the JSON.
        let mut pending: std::collections::VecDeque<u32> = Default::default();
        if let Mode::Calls(_) = mode {
            pending = self.tok.encode(CALL_OPEN, true)?.into();
            in_call = true;
        }
        let vocab = self.tok.vocab_size();
        loop {
            if cancel.load(Ordering::Relaxed) {
                return Err(GgufError::Cancelled);
            }
            if generated >= max_tokens || slot.cache.len() >= self.context {
                finish = "length";
                break;
            }
            let forced = !pending.is_empty();
            let next = if let Some(t) = pending.pop_front() {
                t
            } else {
                let mask = match (&mut matcher, in_call) {
                    (Some(m), true) => {
                        if m.is_stopped() {
                            // The grammar is complete and allows nothing more (one named call).
                            finish = "stop";
                            break;
                        }
                        Some(m.compute_mask().map_err(|e| GgufError::Grammar(e.to_string()))?)
                    }
                    _ => None,
                };
                sample(&mut logits, vocab, mask.as_ref(), sampling, &mut rng)
            };
            if first_at.is_none() {
                first_at = Some(Instant::now());
                stats.first_token_us = start.elapsed().as_micros() as u64;
            }
            generated += 1;
            if forced {
                // Neither grammar nor text: the opening of a call the mode requires.
            } else if in_call && let Some(m) = &mut matcher {
                if self.tok.is_eog(next) || m.is_stopped() {
                    // The grammar allowed the end: the calls are complete.
                    finish = "stop";
                    break;
                }
                m.consume_token(next)
                    .map_err(|e| GgufError::Grammar(e.to_string()))?;
            } else if self.tok.is_eog(next) {
                finish = "stop";
                break;
            }
            let bytes = self.tok.token_bytes(next).to_vec();
            if forced {
            } else if in_call {
                let s = String::from_utf8_lossy(&bytes).into_owned();
                for p in calls.push(&s) {
                    out(p);
                }
            } else {
                text.push(&bytes);
                // A stop string ends the message before it.
                if let Some((at, _)) = stop_pats
                    .iter()
                    .filter_map(|p| {
                        text.text[text.sent.min(text.text.len())..]
                            .find(p)
                            .map(|i| (i + text.sent, p))
                    })
                    .min_by_key(|(i, _)| *i)
                {
                    text.text.truncate(at);
                    if at > text.sent {
                        out(Piece::Text(text.text[text.sent..].to_owned()));
                        text.sent = at;
                    }
                    finish = "stop";
                    break;
                }
                if calls_allowed && let Some(i) = text.text[text.sent.min(text.text.len())..].find(CALL_OPEN)
                {
                    let at = text.sent + i;
                    if at > text.sent {
                        out(Piece::Text(text.text[text.sent..at].to_owned()));
                    }
                    let rest = text.text[at + CALL_OPEN.len()..].to_owned();
                    text.text.truncate(at);
                    text.sent = at;
                    in_call = true;
                    if let Some(m) = &mut matcher {
                        // What followed the opening in the same token goes to the grammar too.
                        let toks = self.tok.encode(&rest, false)?;
                        if !toks.is_empty() && m.consume_tokens(&toks).is_err() {
                            return Err(GgufError::Grammar(format!(
                                "the model opened a tool call with {rest:?}, which no tool call can continue"
                            )));
                        }
                    }
                    for p in calls.push(&rest) {
                        out(p);
                    }
                } else {
                    let hold = partial_suffix(&text.text[text.sent.min(text.text.len())..], &held);
                    let upto = text.text.len() - hold;
                    if upto > text.sent {
                        out(Piece::Text(text.text[text.sent..upto].to_owned()));
                        text.sent = upto;
                    }
                }
            }
            if slot.cache.len() + 1 > self.context {
                finish = "length";
                break;
            }
            logits = self.feed(slot, &[next], cancel)?;
        }
        if text.sent < text.text.len() {
            out(Piece::Text(text.text[text.sent..].to_owned()));
            text.sent = text.text.len();
        }
        let calls = calls.calls;
        if !calls.is_empty() {
            finish = "tool_calls";
        }
        stats.generated_tokens = generated;
        if let Some(f) = first_at {
            stats.decode_us = f.elapsed().as_micros() as u64;
        }
        if let Ok(mut l) = self.last.lock() {
            *l = stats;
        }
        if let Ok(mut t) = self.totals.lock() {
            t.prompt_tokens += stats.prompt_tokens;
            t.reused_tokens += stats.reused_tokens;
            t.prefilled_tokens += stats.prefilled_tokens;
            t.generated_tokens += stats.generated_tokens;
            t.prefill_us += stats.prefill_us;
            t.first_token_us += stats.first_token_us;
            t.decode_us += stats.decode_us;
        }
        Ok(Generated {
            text: text.text,
            calls,
            finish_reason: finish,
            stats,
        })
    }

    /// Log-likelihood scoring as llama.cpp's `llama-perplexity` does it: the text's tokens in
    /// chunks of `n_ctx` (a fresh cache each), scoring the second half of each chunk. Returns the
    /// perplexity over the first `chunks` chunks.
    pub fn perplexity(&self, tokens: &[u32], n_ctx: usize, chunks: usize) -> Result<f64, GgufError> {
        if n_ctx < 4 || tokens.len() < n_ctx * chunks.max(1) {
            return Err(GgufError::Inference(format!(
                "{} tokens are too few for {chunks} chunks of {n_ctx}",
                tokens.len()
            )));
        }
        let first = n_ctx / 2;
        let (mut nll, mut count) = (0f64, 0usize);
        for c in 0..chunks {
            let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
            if self.tok.add_bos
                && let Some(b) = self.tok.bos
            {
                chunk[0] = b;
            }
            let mut cache = Cache::new(&self.weights);
            let logits = self
                .pool
                .install(|| self.weights.forward(&chunk, &mut cache, true))
                .map_err(GgufError::candle)?;
            let rows: Vec<Vec<f32>> = logits.to_vec2().map_err(GgufError::candle)?;
            for j in first..n_ctx - 1 {
                nll -= crate::model::log_prob(&rows[j], chunk[j + 1] as usize);
                count += 1;
            }
        }
        Ok((nll / count as f64).exp())
    }

    /// Pre-fill `prompt` on a fresh cache, then `n` greedy decode steps (EOG or not).
    pub fn bench(
        &self,
        prompt: &[u32],
        n: usize,
    ) -> Result<(std::time::Duration, std::time::Duration), GgufError> {
        let mut cache = Cache::new(&self.weights);
        let t0 = Instant::now();
        let mut logits = Vec::new();
        for chunk in prompt.chunks(BATCH) {
            logits = self
                .pool
                .install(|| self.weights.forward(chunk, &mut cache, false))
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(GgufError::candle)?;
        }
        let prefill = t0.elapsed();
        let t1 = Instant::now();
        for _ in 0..n {
            let t = argmax(&logits);
            logits = self
                .pool
                .install(|| self.weights.forward(&[t], &mut cache, false))
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(GgufError::candle)?;
        }
        Ok((prefill, t1.elapsed()))
    }

    /// Greedy continuation of `prompt` for `n` tokens (no template, no stop but EOG): the
    /// reference test against llama.cpp's `llama-simple`.
    pub fn greedy(&self, prompt: &[u32], n: usize) -> Result<Vec<u32>, GgufError> {
        let mut cache = Cache::new(&self.weights);
        let mut logits = self
            .pool
            .install(|| self.weights.forward(prompt, &mut cache, false))
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(GgufError::candle)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let t = argmax(&logits[..self.tok.vocab_size().min(logits.len())]);
            if self.tok.is_eog(t) {
                break;
            }
            out.push(t);
            logits = self
                .pool
                .install(|| self.weights.forward(&[t], &mut cache, false))
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(GgufError::candle)?;
        }
        Ok(out)
    }
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Picks the next token from `logits` (restricted to `mask` when given).
fn sample(
    logits: &mut [f32],
    vocab: usize,
    mask: Option<&toktrie::SimpleVob>,
    p: &Sampling,
    rng: &mut StdRng,
) -> u32 {
    let n = logits.len().min(vocab);
    let logits = &mut logits[..n];
    if let Some(m) = mask {
        for (i, l) in logits.iter_mut().enumerate() {
            if !m.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    if p.temperature <= 0.0 {
        return argmax(logits);
    }
    let mut idx: Vec<usize> = (0..n).filter(|&i| logits[i].is_finite()).collect();
    if idx.is_empty() {
        return argmax(logits);
    }
    idx.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if p.top_k > 0 && idx.len() > p.top_k {
        idx.truncate(p.top_k);
    }
    let max = logits[idx[0]];
    let mut probs: Vec<f32> = idx
        .iter()
        .map(|&i| ((logits[i] - max) / p.temperature).exp())
        .collect();
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= sum);
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (k, x) in probs.iter().enumerate() {
            acc += x;
            if acc >= p.top_p {
                keep = k + 1;
                break;
            }
        }
        probs.truncate(keep);
        idx.truncate(keep);
        let s: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= s);
    }
    let r: f32 = rng.random();
    let mut acc = 0.0;
    for (k, x) in probs.iter().enumerate() {
        acc += x;
        if r < acc {
            return idx[k] as u32;
        }
    }
    idx[probs.len() - 1] as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_suffixes() {
        assert_eq!(partial_suffix("hello <tool", &["<tool_call>"]), 5);
        assert_eq!(partial_suffix("hello", &["<tool_call>"]), 0);
        assert_eq!(partial_suffix("a STO", &["STOP", "<x>"]), 3);
    }

    #[test]
    fn greedy_ties_go_to_the_lowest_id() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }
}
