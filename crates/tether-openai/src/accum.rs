//! [`StreamAccumulator`]: turns a stream's `data:` payloads into one response, and tells the
//! caller which deltas to emit as it goes.
//!
//! Rules (spec §5): tool calls are keyed by their `index` (the fragment's position in the chunk
//! when absent); `id`, `type` and `name` are set once from the first non-empty value (later equal
//! values, as llama-cpp-python repeats them, are ignored; a different later value is logged and
//! dropped); argument pieces are concatenated; the legacy `function_call` is used only when no
//! `tool_calls` fragment ever arrives; `finish_reason: ""` counts as absent; `choices` null or
//! missing is tolerated; the usage chunk is read; `[DONE]` ends the stream.

use std::ops::Range;

use serde_json::{Value, json};
use tether::{ChatMessage, ChatResponse, ChatToolCall, Error, Usage};

use crate::fast;
use crate::wire::{self, Chunk, ToolCallDelta};

/// What the caller must forward to the `DeltaSink` after a [`StreamAccumulator::feed`] or
/// [`StreamAccumulator::finish`]: ranges into the accumulator's own text, so nothing is copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Emit {
    /// `text()[range]` is a new piece of text.
    Text(Range<usize>),
    /// `reasoning()[range]` is a new piece of reasoning.
    Reasoning(Range<usize>),
    /// Call `calls()[slot]` started: its id and name are known.
    Start(usize),
    /// `calls()[slot].arguments[range]` is a new argument piece of a started call.
    Args(usize, Range<usize>),
    /// Call `calls()[slot]` is complete.
    End(usize),
}

/// What a payload meant for the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fed {
    /// Keep reading.
    More,
    /// `[DONE]`: the stream is over.
    Done,
}

/// A tool call being accumulated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallAcc {
    /// The key: the fragment's `index` (or its position).
    pub index: u32,
    /// The call's id (set once).
    pub id: String,
    /// The call's type (set once; `function`).
    pub kind: String,
    /// The function name (set once).
    pub name: String,
    /// The argument text, concatenated.
    pub arguments: String,
    /// Whether `Emit::Start` was issued.
    pub started: bool,
}

/// The cap on what one response accumulates, in bytes.
#[derive(Debug, Clone, Copy)]
struct Limit(usize);

impl Default for Limit {
    fn default() -> Self {
        Limit(tether::chat::DEFAULT_MAX_RESPONSE_BYTES)
    }
}

/// Accumulates one streamed chat completion.
///
/// Everything it keeps from the model (text, reasoning, tool-call ids, names and arguments) is
/// counted against a cap ([`StreamAccumulator::with_limit`], default
/// [`tether::chat::DEFAULT_MAX_RESPONSE_BYTES`]); past it, feeding fails with
/// [`Error::ResponseTooLarge`].
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct StreamAccumulator {
    text: String,
    reasoning: String,
    calls: Vec<CallAcc>,
    legacy: Option<CallAcc>,
    saw_tool_calls: bool,
    finish_reason: Option<String>,
    usage: Option<Usage>,
    id: Option<String>,
    model: Option<String>,
    events: u64,
    emits: Vec<Emit>,
    /// The last content-only chunk the fast path read (see `fast::Template`).
    template: fast::Template,
    /// Bytes kept so far (text, reasoning, tool-call fields).
    kept: usize,
    limit: Limit,
}

/// Gives the call in `slot`, about to start, an id no started call of this response has.
///
/// Two calls of one response sharing an id (a confused or hostile server) would make their
/// results indistinguishable, in the session's record and in the next request's `tool` messages,
/// so a repeated id gets the call's index appended (`call_b` at index 1 becomes `call_b_1`).
fn make_id_unique(calls: &mut [CallAcc], slot: usize) {
    let taken = |calls: &[CallAcc], id: &str| {
        calls
            .iter()
            .enumerate()
            .any(|(i, c)| i != slot && c.started && c.id == id)
    };
    if !taken(calls, &calls[slot].id) {
        return;
    }
    let base = format!("{}_{}", calls[slot].id, calls[slot].index);
    let mut id = base.clone();
    let mut n = 1u32;
    while taken(calls, &id) {
        id = format!("{base}_{n}");
        n += 1;
    }
    tracing::warn!(index = calls[slot].index, first = %calls[slot].id, now = %id, "two tool calls of one response share an id; the later one is renamed");
    calls[slot].id = id;
}

/// Sets `slot` to `value` if it is empty; returns the bytes added.
fn set_once(slot: &mut String, value: &str, what: &str, index: u32) -> usize {
    if value.is_empty() {
        return 0;
    }
    if slot.is_empty() {
        slot.push_str(value);
        return value.len();
    } else if slot != value {
        tracing::warn!(index, field = what, first = %slot, later = %value, "a tool call's {what} changed mid-stream; keeping the first");
    }
    0
}

impl StreamAccumulator {
    /// An empty accumulator.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty accumulator whose response may keep at most `bytes` bytes.
    pub fn with_limit(bytes: usize) -> Self {
        StreamAccumulator {
            limit: Limit(bytes),
            ..Self::default()
        }
    }

    /// Fails once the response kept more than its cap.
    pub fn check_size(&self) -> Result<(), Error> {
        if self.kept > self.limit.0 {
            return Err(Error::ResponseTooLarge {
                limit: self.limit.0 as u64,
            });
        }
        Ok(())
    }

    /// The deltas to forward, from the last `feed` or `finish`.
    pub fn emits(&self) -> &[Emit] {
        &self.emits
    }

    /// Forgets the emits forwarded so far. Emits accumulate across [`feed`](Self::feed) calls
    /// until cleared, and contiguous pieces of the same text or call merge, so a caller that
    /// forwards once per network read sends one delta for everything that read carried.
    pub fn clear_emits(&mut self) {
        self.emits.clear();
    }

    /// The text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The reasoning so far.
    pub fn reasoning(&self) -> &str {
        &self.reasoning
    }

    /// The tool calls so far (sorted by index after `finish`).
    pub fn calls(&self) -> &[CallAcc] {
        &self.calls
    }

    /// The finish reason, once one arrived (never `""`).
    pub fn finish_reason(&self) -> Option<&str> {
        self.finish_reason.as_deref()
    }

    /// Data events fed so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Feeds one `data:` payload.
    ///
    /// Errors: [`Error::Stream`] for an `error` object, [`Error::Malformed`] for a payload that
    /// is not a chunk.
    pub fn feed(&mut self, data: &[u8]) -> Result<Fed, Error> {
        self.feed_with(data, true)
    }

    /// [`feed`](Self::feed), with the hand-written fast path for common chunks (`fast`) or
    /// serde only: both give the same result (see `fast.rs`), which the tests check.
    #[doc(hidden)]
    pub fn feed_with(&mut self, data: &[u8], fast: bool) -> Result<Fed, Error> {
        let fed = self.feed_unchecked(data, fast)?;
        self.check_size()?;
        Ok(fed)
    }

    fn feed_unchecked(&mut self, data: &[u8], fast: bool) -> Result<Fed, Error> {
        let data = data.trim_ascii();
        if data.starts_with(b"[DONE]") {
            return Ok(Fed::Done);
        }
        self.events += 1;
        if fast {
            if let Some(content) = self.template.content_of(data) {
                self.push_texts(None, Some(&content), None);
                return Ok(Fed::More);
            }
            if let Some(c) = fast::chunk(data) {
                self.note_ids(c.id.as_deref(), c.model.as_deref());
                self.push_texts(
                    c.reasoning_content.as_deref().or(c.reasoning.as_deref()),
                    c.content.as_deref(),
                    c.refusal.as_deref(),
                );
                self.note_finish(c.finish_reason.as_deref());
                if let Some(span) = c.content_span.filter(|_| c.content_only()) {
                    self.template.set(data, span);
                }
                return Ok(Fed::More);
            }
        }
        let chunk = serde_json::from_slice::<Chunk<'_>>(data).map_err(|e| Error::Malformed {
            message: format!(
                "stream event #{} is not a chat.completion.chunk ({e}): {}",
                self.events,
                snippet(data)
            ),
            source: Some(e.into()),
        })?;
        if let Some(err) = &chunk.error
            && !err.is_null()
        {
            let (message, code) = wire::error_parts(err);
            return Err(Error::Stream {
                message: message.unwrap_or_else(|| err.to_string()),
                code,
            });
        }
        self.note_ids(
            chunk.id.as_ref().map(|s| s.as_str()),
            chunk.model.as_ref().map(|s| s.as_str()),
        );
        if let Some(u) = chunk.usage
            && let Some(u) = wire::usage_of(u)
        {
            self.usage = Some(u);
        }
        let Some(choice) = chunk.choices.0 else {
            return Ok(Fed::More);
        };
        if let Some(delta) = &choice.delta {
            self.push_texts(
                delta
                    .reasoning_content
                    .as_ref()
                    .or(delta.reasoning.as_ref())
                    .map(|s| s.as_str()),
                delta.content.as_ref().map(|s| s.as_str()),
                delta.refusal.as_ref().map(|s| s.as_str()),
            );
            if !delta.tool_calls.is_empty() {
                self.saw_tool_calls = true;
                for (pos, frag) in delta.tool_calls.iter().enumerate() {
                    self.tool_fragment(pos as u32, frag);
                }
            } else if let Some(fc) = &delta.function_call
                && !self.saw_tool_calls
            {
                // Legacy form: kept aside, used (and emitted) at the end only if no
                // `tool_calls` fragment ever arrives.
                let l = self.legacy.get_or_insert_with(CallAcc::default);
                if let Some(n) = &fc.name {
                    self.kept += set_once(&mut l.name, n.as_str(), "name", 0);
                }
                if let Some(a) = &fc.arguments {
                    l.arguments.push_str(a.as_str());
                    self.kept += a.as_str().len();
                }
            }
        }
        self.note_finish(choice.finish_reason.as_ref().map(|s| s.as_str()));
        Ok(Fed::More)
    }

    /// Feeds the whole events at the start of `buf` that are the last content-only chunk with
    /// another content (see `fast::Template`), as [`feed`](Self::feed) would one line at a time;
    /// returns the bytes consumed (0 when the first event is anything else).
    #[doc(hidden)]
    pub fn feed_templated(&mut self, buf: &[u8]) -> usize {
        let mut used = 0;
        while self.kept <= self.limit.0
            && let Some((content, len)) = self.template.event_at(&buf[used..])
        {
            self.events += 1;
            self.push_texts(None, Some(&content), None);
            used += len;
        }
        used
    }

    // The effects of a chunk, shared by the fast path and the serde path (in this order).

    fn note_ids(&mut self, id: Option<&str>, model: Option<&str>) {
        if self.id.is_none()
            && let Some(id) = id
        {
            self.id = Some(id.to_owned());
        }
        if self.model.is_none()
            && let Some(m) = model
        {
            self.model = Some(m.to_owned());
        }
    }

    fn push_texts(&mut self, reasoning: Option<&str>, content: Option<&str>, refusal: Option<&str>) {
        if let Some(r) = reasoning {
            push_piece(&mut self.reasoning, r, &mut self.emits, Emit::Reasoning);
            self.kept += r.len();
        }
        for t in [content, refusal].into_iter().flatten() {
            push_piece(&mut self.text, t, &mut self.emits, Emit::Text);
            self.kept += t.len();
        }
    }

    fn note_finish(&mut self, finish_reason: Option<&str>) {
        if let Some(f) = finish_reason
            && !f.is_empty()
        {
            self.finish_reason = Some(f.to_owned());
        }
    }

    fn tool_fragment(&mut self, pos: u32, frag: &ToolCallDelta<'_>) {
        let index = frag.index.unwrap_or(pos);
        let slot = match self.calls.iter().position(|c| c.index == index) {
            Some(s) => s,
            None => {
                self.calls.push(CallAcc {
                    index,
                    ..Default::default()
                });
                self.calls.len() - 1
            }
        };
        let call = &mut self.calls[slot];
        // Every call slot costs its bookkeeping too: endless new indexes are bounded as well.
        let mut kept = 16;
        if let Some(id) = &frag.id {
            kept += set_once(&mut call.id, id.as_str(), "id", index);
        }
        if let Some(k) = &frag.kind {
            kept += set_once(&mut call.kind, k.as_str(), "type", index);
        }
        let mut piece = "";
        if let Some(f) = &frag.function {
            if let Some(n) = &f.name {
                kept += set_once(&mut call.name, n.as_str(), "name", index);
            }
            if let Some(a) = &f.arguments {
                piece = a.as_str();
            }
        }
        let before = call.arguments.len();
        call.arguments.push_str(piece);
        kept += piece.len();
        if call.started {
            if !piece.is_empty() {
                push_emit(&mut self.emits, Emit::Args(slot, before..call.arguments.len()));
            }
        } else if !call.id.is_empty() && !call.name.is_empty() {
            call.started = true;
            make_id_unique(&mut self.calls, slot);
            let call = &self.calls[slot];
            self.emits.push(Emit::Start(slot));
            if !call.arguments.is_empty() {
                self.emits.push(Emit::Args(slot, 0..call.arguments.len()));
            }
        }
        self.kept += kept;
    }

    /// Ends the stream: adopts a legacy `function_call` if it was the only form, gives an id to
    /// calls the server sent without one, and queues `Start`/`Args` for calls not yet started
    /// and `End` for every call. Calls keep their slots (emits still queued name them by slot);
    /// [`into_response`](Self::into_response) orders them by index.
    ///
    /// A call that never got a function name is kept with an empty one: the session engine
    /// answers that call with an error result instead of failing the whole response.
    pub fn finish(&mut self) -> Result<(), Error> {
        if !self.saw_tool_calls
            && let Some(l) = self.legacy.take()
            && !l.name.is_empty()
        {
            self.calls.push(l);
        }
        let base = self
            .id
            .clone()
            .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()));
        // In index order, but by slot: calls are not moved while emits name them by slot.
        let mut order: Vec<usize> = (0..self.calls.len()).collect();
        order.sort_by_key(|&slot| self.calls[slot].index);
        for &slot in &order {
            let c = &mut self.calls[slot];
            if c.name.is_empty() {
                tracing::warn!(
                    index = c.index,
                    id = %c.id,
                    "a tool call never received a function name; it is answered with an error"
                );
            }
            if c.id.is_empty() {
                // Unique across turns: the session records tool results by call id.
                c.id = format!("call_{base}_{}", c.index);
            }
            if !c.started {
                c.started = true;
                make_id_unique(&mut self.calls, slot);
                self.emits.push(Emit::Start(slot));
                let len = self.calls[slot].arguments.len();
                if len > 0 {
                    self.emits.push(Emit::Args(slot, 0..len));
                }
            }
        }
        for &slot in &order {
            self.emits.push(Emit::End(slot));
        }
        Ok(())
    }

    /// The response, after [`StreamAccumulator::finish`].
    pub fn into_response(mut self) -> ChatResponse {
        // Sorted only now: until the last emit was forwarded, emits named calls by their slot.
        self.calls.sort_by_key(|c| c.index);
        let mut message = ChatMessage::assistant(self.text);
        if message.content.as_deref() == Some("") && !self.calls.is_empty() {
            message.content = None;
        }
        if !self.reasoning.is_empty() {
            message.reasoning = Some(self.reasoning);
        }
        message.tool_calls = self
            .calls
            .into_iter()
            .map(|c| ChatToolCall::new(c.id, c.name, c.arguments))
            .collect();
        let mut msg = json!({"role": "assistant", "content": message.content});
        if let Some(r) = &message.reasoning {
            msg["reasoning_content"] = json!(r);
        }
        if !message.tool_calls.is_empty() {
            msg["tool_calls"] = message
                .tool_calls
                .iter()
                .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                .collect();
        }
        let raw = json!({
            "id": self.id,
            "object": "chat.completion",
            "model": self.model,
            "choices": [{"index": 0, "message": msg, "finish_reason": self.finish_reason}],
            "usage": self.usage.as_ref().and_then(|u| u.raw.first().cloned()).unwrap_or(Value::Null),
        });
        let mut response = ChatResponse::new(message).with_usage(self.usage).with_raw(raw);
        response.finish_reason = self.finish_reason;
        response
    }
}

fn push_piece(buf: &mut String, piece: &str, emits: &mut Vec<Emit>, f: fn(Range<usize>) -> Emit) {
    if !piece.is_empty() {
        let start = buf.len();
        buf.push_str(piece);
        push_emit(emits, f(start..buf.len()));
    }
}

/// Queues an emit, merging it into the previous one when both are contiguous pieces of the same
/// buffer (text after text, reasoning after reasoning, arguments of the same call).
fn push_emit(emits: &mut Vec<Emit>, e: Emit) {
    match (emits.last_mut(), &e) {
        (Some(Emit::Text(prev)), Emit::Text(r)) | (Some(Emit::Reasoning(prev)), Emit::Reasoning(r))
            if prev.end == r.start =>
        {
            prev.end = r.end;
        }
        (Some(Emit::Args(ps, prev)), Emit::Args(s, r)) if ps == s && prev.end == r.start => {
            prev.end = r.end;
        }
        _ => emits.push(e),
    }
}

/// At most 200 bytes of a payload, for error messages.
pub(crate) fn snippet(data: &[u8]) -> String {
    let s = String::from_utf8_lossy(&data[..data.len().min(200)]).into_owned();
    if data.len() > 200 { format!("{s}…") } else { s }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `openai_sse` fuzz target: when the last read brought earlier chunks and the
    /// end together, emits queued before `finish` named calls by slot, and `finish` sorted the
    /// calls by index under them: the forwarded `End` named a call whose `Start` was another's.
    /// Every emit, forwarded after `finish`, must name the call it was queued for.
    #[test]
    fn emits_queued_before_finish_name_the_same_calls_after_it() {
        let mut a = StreamAccumulator::new();
        for l in [
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":5,"id":"call_a","function":{"name":"read_file","arguments":""}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_b","function":{"name":"list_dir","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
        ] {
            a.feed(l.as_bytes()).unwrap();
        }
        a.finish().unwrap();
        let log = describe(&a);
        let started: Vec<&str> = log.iter().filter_map(|l| l.strip_prefix("start:")).collect();
        for end in log.iter().filter_map(|l| l.strip_prefix("end:")) {
            assert!(
                started.iter().any(|s| s.starts_with(&format!("{end}:"))),
                "end:{end} without its start in {log:?}"
            );
        }
        let ids: Vec<String> = a
            .into_response()
            .message
            .tool_calls
            .into_iter()
            .map(|c| c.id)
            .collect();
        assert_eq!(ids.len(), 3);
        assert_eq!(&ids[1..], ["call_b", "call_a"], "{ids:?}");
    }

    #[test]
    fn a_repeated_call_id_is_renamed_so_every_call_of_a_response_is_distinct() {
        let (a, ids) = feed_all(&[
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_b","function":{"name":"read_file","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_b","function":{"name":"list_dir","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":2,"id":"call_b_1","function":{"name":"list_dir","arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
        ]);
        let r = a.into_response();
        let got: Vec<_> = r.message.tool_calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(got, ["call_b", "call_b_1", "call_b_1_2"]);
        assert!(ids.iter().any(|d| d == "start:call_b_1:list_dir"), "{ids:?}");
    }

    fn feed_all(lines: &[&str]) -> (StreamAccumulator, Vec<String>) {
        let mut a = StreamAccumulator::new();
        let mut log = Vec::new();
        for l in lines {
            a.feed(l.as_bytes()).unwrap();
            log.extend(describe(&a));
            a.clear_emits();
        }
        a.finish().unwrap();
        log.extend(describe(&a));
        (a, log)
    }

    fn describe(a: &StreamAccumulator) -> Vec<String> {
        a.emits()
            .iter()
            .map(|e| match e {
                Emit::Text(r) => format!("text:{}", &a.text()[r.clone()]),
                Emit::Reasoning(r) => format!("reasoning:{}", &a.reasoning()[r.clone()]),
                Emit::Start(s) => format!("start:{}:{}", a.calls()[*s].id, a.calls()[*s].name),
                Emit::Args(s, r) => format!(
                    "args:{}:{}",
                    a.calls()[*s].id,
                    &a.calls()[*s].arguments[r.clone()]
                ),
                Emit::End(s) => format!("end:{}", a.calls()[*s].id),
            })
            .collect()
    }

    #[test]
    fn llama_cpp_python_repeats_are_set_once_and_function_call_ignored() {
        let f = |a: &str| {
            format!(
                r#"{{"choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0,"id":"call__0","type":"function","function":{{"name":"get_weather","arguments":"{a}"}}}}],"function_call":{{"name":"get_weather:","arguments":"{a}"}}}}}}]}}"#
            )
        };
        let lines = [
            f("{\\\"city\\\""),
            f(":\\\"Paris\\\"}"),
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#.into(),
        ];
        let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
        let (a, log) = feed_all(&refs);
        let r = a.into_response();
        assert_eq!(r.message.tool_calls.len(), 1);
        assert_eq!(r.message.tool_calls[0].name, "get_weather");
        assert_eq!(r.message.tool_calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(
            log,
            vec![
                "start:call__0:get_weather",
                "args:call__0:{\"city\"",
                "args:call__0::\"Paris\"}",
                "end:call__0"
            ]
        );
    }

    #[test]
    fn legacy_function_call_alone_is_used() {
        let (a, log) = feed_all(&[
            r#"{"id":"cmpl-1","choices":[{"index":0,"delta":{"function_call":{"name":"f","arguments":"{}"}}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"function_call"}]}"#,
        ]);
        let r = a.into_response();
        assert_eq!(r.message.tool_calls[0].name, "f");
        assert_eq!(r.message.tool_calls[0].id, "call_cmpl-1_0");
        assert_eq!(log.len(), 3);
    }

    #[test]
    fn empty_finish_reason_is_absent_and_usage_read() {
        let (a, _) = feed_all(&[
            r#"{"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":""}]}"#,
            r#"{"choices":null,"usage":{"prompt_tokens":3,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1}}}"#,
        ]);
        assert_eq!(a.finish_reason(), None);
        let r = a.into_response();
        let u = r.usage.unwrap();
        assert_eq!((u.input_tokens, u.output_tokens, u.cache_read_tokens), (3, 2, 1));
        assert_eq!(u.raw.len(), 1);
    }

    #[test]
    fn errors_and_malformed() {
        let mut a = StreamAccumulator::new();
        let e = a
            .feed(br#"{"error":{"message":"overloaded","type":"server_error","code":null}}"#)
            .unwrap_err();
        assert!(
            matches!(e, Error::Stream { ref code, .. } if code.as_deref() == Some("server_error")),
            "{e}"
        );
        let e = a.feed(b"{\"choices\": [").unwrap_err();
        assert!(
            matches!(e, Error::Malformed { ref message, .. } if message.contains("#2")),
            "{e}"
        );
    }
}
