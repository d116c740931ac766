//! The session vocabulary shared by every provider: tools, tool uses and results, usage,
//! session identity, turn terminals and results.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::event::Event;

/// A tool the model may call: name, description and a JSON Schema for its input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ToolSpec {
    /// The tool's name, as the model will call it.
    pub name: String,
    /// What the tool does, for the model.
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the tool's input (an object schema).
    #[serde(default = "empty_object_schema")]
    pub input_schema: Value,
    /// Facts about the tool for observers, never sent to a model: where it comes from. An MCP
    /// tool source sets `mcp.server` (the server's name), and where known `mcp.tool` (the
    /// tool's name on the server), `mcp.transport` (`stdio` or `http`), `mcp.protocol.version`,
    /// `mcp.session.id`, `server.address` and `server.port`; a tracer (`tether-otel`) puts them
    /// on the tool call's span.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub meta: serde_json::Map<String, Value>,
}

fn empty_object_schema() -> Value {
    serde_json::json!({"type": "object"})
}

impl ToolSpec {
    /// A tool with a name, a description and an input schema.
    ///
    /// ```
    /// let t = tether::ToolSpec::new("get_weather", "Weather for a city",
    ///     serde_json::json!({"type":"object","properties":{"city":{"type":"string"}}}));
    /// assert_eq!(t.name, "get_weather");
    /// ```
    pub fn new(name: impl Into<String>, description: impl Into<String>, input_schema: Value) -> Self {
        ToolSpec {
            name: name.into(),
            description: description.into(),
            input_schema,
            meta: Default::default(),
        }
    }

    /// The spec with one more fact in [`ToolSpec::meta`] (e.g. `mcp.server`).
    pub fn with_meta(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.meta.insert(key.into(), value.into());
        self
    }
}

/// One call of a tool, as the model or remote loop asked for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ToolUse {
    /// The provider's id for this call; results are matched to it.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The decoded input (an object; `{}` when the model sent nothing).
    #[serde(default)]
    pub input: Value,
    /// Set when the model's argument text was not a JSON object (did not parse, or parsed to an
    /// array, string, number, boolean or null): why. The engine then
    /// answers the call with an error result naming it, instead of running the tool on `{}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_error: Option<String>,
    /// The raw argument text as the model produced it, when it was a string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_input: Option<String>,
}

impl ToolUse {
    /// A tool use with a decoded input.
    pub fn new(id: impl Into<String>, name: impl Into<String>, input: Value) -> Self {
        ToolUse {
            id: id.into(),
            name: name.into(),
            input,
            input_error: None,
            raw_input: None,
        }
    }

    /// A tool use from the model's raw argument text: empty means `{}`; invalid JSON, or JSON
    /// that is not an object (`[1]`, `"x"`, `null`: every tool's input schema is an object), is
    /// kept raw with the error recorded in `input_error`, and `input` stays `{}`.
    pub fn from_arguments(id: impl Into<String>, name: impl Into<String>, arguments: &str) -> Self {
        let mut u = ToolUse::new(id, name, Value::Object(Default::default()));
        if !arguments.trim().is_empty() {
            match serde_json::from_str::<Value>(arguments) {
                Ok(v @ Value::Object(_)) => u.input = v,
                Ok(other) => {
                    let kind = match other {
                        Value::Array(_) => "an array",
                        Value::String(_) => "a string",
                        Value::Number(_) => "a number",
                        Value::Bool(_) => "a boolean",
                        _ => "null",
                    };
                    u.input_error = Some(format!("the arguments are {kind}, not an object"));
                }
                Err(e) => u.input_error = Some(format!("not valid JSON: {e}")),
            }
        }
        u.raw_input = Some(arguments.to_owned());
        u
    }
}

impl ToolUse {
    /// What identifies the call apart from its id: the tool's name and its arguments, canonical
    /// JSON (object keys sorted, no whitespace) when they parsed, the raw text when they did not
    /// (so two different malformed calls never compare equal).
    ///
    /// Two tool uses are *the same tool use* when their ids and fingerprints are equal: only then
    /// does the engine answer one from the other's recorded result.
    pub fn fingerprint(&self) -> String {
        let bytes = self.fingerprint_bytes();
        // Built from `&str`s and serde_json's output only, so always UTF-8.
        String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }

    /// [`fingerprint`](Self::fingerprint) as bytes: what [`memo_key`](Self::memo_key) hashes.
    fn fingerprint_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.name.len() + 64);
        out.extend_from_slice(self.name.as_bytes());
        out.push(0);
        match (&self.input_error, &self.raw_input) {
            (Some(_), Some(raw)) => {
                out.extend_from_slice(b"raw:");
                out.extend_from_slice(raw.as_bytes());
            }
            _ => {
                out.extend_from_slice(b"json:");
                canonical_json(&self.input, &mut out);
            }
        }
        out
    }

    /// The key the engine memoizes this tool use's result under: its id, `#`, and 32 hex digits
    /// of the SHA-256 of its [`fingerprint`](Self::fingerprint). An id longer than 128 bytes or
    /// holding control characters is replaced by `~` and a digest of it, so keys stay bounded.
    ///
    /// A model that reuses an id for a different call gets a different key, so the call is run
    /// rather than answered with the earlier call's result; a redelivery of the same call (a
    /// reconnect, a crash recovery) gets the same key and is answered from the memo.
    pub fn memo_key(&self) -> String {
        let id = if self.id.len() <= 128 && !self.id.chars().any(char::is_control) {
            self.id.clone()
        } else {
            format!("~{}", hex32(self.id.as_bytes()))
        };
        let mut key = String::with_capacity(id.len() + 33);
        key.push_str(&id);
        key.push('#');
        push_hex32(&mut key, &self.fingerprint_bytes());
        key
    }
}

/// The first 16 bytes of the SHA-256 of `data`, as 32 lowercase hex digits.
pub(crate) fn digest_hex(data: &[u8]) -> String {
    hex32(data)
}

/// The first 16 bytes of the SHA-256 of `data`, as 32 lowercase hex digits.
fn hex32(data: &[u8]) -> String {
    let mut out = String::with_capacity(32);
    push_hex32(&mut out, data);
    out
}

/// Appends the first 16 bytes of the SHA-256 of `data` to `out`, as 32 lowercase hex digits.
fn push_hex32(out: &mut String, data: &[u8]) {
    use sha2::Digest;
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let d = sha2::Sha256::digest(data);
    for b in d.iter().take(16) {
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0xf)] as char);
    }
}

/// Writes `v` as JSON with object keys sorted, whatever the map's own order: serde_json keeps
/// insertion order when any crate in the build enables its `preserve_order` feature. Strings,
/// numbers and literals are written by serde_json itself, so the text is what
/// `Value::to_string` writes for each of them.
pub(crate) fn canonical_json(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Object(m) => {
            let mut entries: Vec<(&String, &Value)> = m.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_json(out, k.as_str());
                out.push(b':');
                canonical_json(x, out);
            }
            out.push(b'}');
        }
        Value::Array(a) => {
            out.push(b'[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical_json(x, out);
            }
            out.push(b']');
        }
        other => write_json(out, other),
    }
}

/// Appends `v`'s compact JSON (a `Vec`'s writer cannot fail; a value that cannot be written,
/// which no `str` or scalar `Value` is, writes nothing).
fn write_json<T: Serialize + ?Sized>(out: &mut Vec<u8>, v: &T) {
    let _ = serde_json::to_writer(&mut *out, v);
}

/// The answer to one [`ToolUse`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ToolResult {
    /// The id of the tool use this answers.
    pub tool_use_id: String,
    /// The result text (or the error text when `is_error`).
    #[serde(default)]
    pub content: String,
    /// Whether the tool failed.
    #[serde(default)]
    pub is_error: bool,
}

impl ToolResult {
    /// A result, failed or not.
    pub fn new(tool_use_id: impl Into<String>, content: impl Into<String>, is_error: bool) -> Self {
        ToolResult {
            tool_use_id: tool_use_id.into(),
            content: content.into(),
            is_error,
        }
    }

    /// A successful result.
    pub fn ok(tool_use_id: impl Into<String>, content: impl Into<String>) -> Self {
        ToolResult {
            tool_use_id: tool_use_id.into(),
            content: content.into(),
            is_error: false,
        }
    }

    /// A failed result.
    pub fn error(tool_use_id: impl Into<String>, content: impl Into<String>) -> Self {
        ToolResult {
            tool_use_id: tool_use_id.into(),
            content: content.into(),
            is_error: true,
        }
    }
}

/// A tool use and its answer, paired: what [`crate::Input::ToolResults`] hands a provider, so
/// a result can never be matched to the wrong call by position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ToolUseResult {
    /// The call, as the model or remote loop made it.
    pub tool_use: ToolUse,
    /// Its answer (`result.tool_use_id` is `tool_use.id`).
    pub result: ToolResult,
}

impl ToolUseResult {
    /// The answer `result` to `tool_use`.
    ///
    /// ```
    /// use tether::{ToolResult, ToolUse, ToolUseResult};
    /// let a = ToolUseResult::new(ToolUse::new("c1", "ls", serde_json::json!({})), ToolResult::ok("c1", "a.txt"));
    /// assert_eq!(a.tool_use.id, a.result.tool_use_id);
    /// ```
    pub fn new(tool_use: ToolUse, result: ToolResult) -> Self {
        ToolUseResult { tool_use, result }
    }
}

/// Token usage, summed over model calls, with each provider's usage object kept verbatim.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Usage {
    /// Input (prompt) tokens.
    #[serde(default)]
    pub input_tokens: u64,
    /// Output (completion) tokens.
    #[serde(default)]
    pub output_tokens: u64,
    /// Input tokens served from a prompt cache, where the provider reports them.
    #[serde(default)]
    pub cache_read_tokens: u64,
    /// Each provider usage object as it arrived.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub raw: Vec<Value>,
}

impl Usage {
    /// Usage of `input_tokens` in and `output_tokens` out.
    ///
    /// ```
    /// let u = tether::Usage::new(10, 5).with_cache_read_tokens(4);
    /// assert_eq!((u.total(), u.cache_read_tokens), (15, 4));
    /// ```
    pub fn new(input_tokens: u64, output_tokens: u64) -> Self {
        Usage {
            input_tokens,
            output_tokens,
            ..Default::default()
        }
    }

    /// The same usage with this many input tokens served from a prompt cache.
    pub fn with_cache_read_tokens(mut self, n: u64) -> Self {
        self.cache_read_tokens = n;
        self
    }

    /// The same usage with one more provider usage object kept verbatim.
    pub fn with_raw(mut self, raw: Value) -> Self {
        self.raw.push(raw);
        self
    }

    /// Adds another usage into this one (sums, and appends the raw objects).
    pub fn add(&mut self, other: &Usage) {
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cache_read_tokens += other.cache_read_tokens;
        self.raw.extend(other.raw.iter().cloned());
    }

    /// Total tokens, input plus output.
    pub fn total(&self) -> u64 {
        self.input_tokens + self.output_tokens
    }
}

/// Who the running session is: handed to every handler callback.
///
/// It grows by fields, never by arity: new facts about the session are added here.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SessionInfo {
    /// The session's id (the provider's when it has one).
    pub session_id: String,
    /// The provider's name (`local`, `managed`, `agentcore`, `acp`, ...).
    pub provider: String,
    /// Caller metadata given at session start.
    #[serde(default)]
    pub metadata: serde_json::Map<String, Value>,
    /// The W3C `traceparent` of the operation this callback belongs to, when the session is
    /// traced: in [`crate::Handler::call_tool`], the tool call's `execute_tool` span. A handler
    /// passes it on to what it calls (an MCP request's `params._meta.traceparent`, an HTTP
    /// `traceparent` header) so the callee's spans join the trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl SessionInfo {
    /// Info for a session id and provider name.
    pub fn new(session_id: impl Into<String>, provider: impl Into<String>) -> Self {
        SessionInfo {
            session_id: session_id.into(),
            provider: provider.into(),
            metadata: Default::default(),
            traceparent: None,
        }
    }
}

/// How a turn ended. Exactly three: the provider's own stop reason is kept beside it, raw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Terminal {
    /// The agent finished its answer.
    EndTurn,
    /// The agent waits for tool results.
    RequiresAction,
    /// The turn ended for any other reason (length, filter, limit, error, interruption).
    Terminated,
}

/// What a provider reports at the end of one turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TurnResult {
    /// How the turn ended.
    pub terminal: Terminal,
    /// Why the turn ended (the provider's reason, typed; an unknown one kept raw).
    pub stop_reason: StopReason,
    /// The turn's assistant text.
    #[serde(default)]
    pub text: String,
    /// Tool uses to run locally (with `RequiresAction`).
    #[serde(default)]
    pub tool_uses: Vec<ToolUse>,
    /// Tool uses the remote loop ran itself (observe only).
    #[serde(default)]
    pub server_tool_uses: Vec<ToolUse>,
    /// The turn's usage, when reported.
    #[serde(default)]
    pub usage: Option<Usage>,
}

impl TurnResult {
    /// A turn that ended with `terminal` for `stop_reason` (a [`StopReason`], or a raw
    /// provider value or name, mapped by [`StopReason::from_raw`]).
    pub fn new(terminal: Terminal, stop_reason: impl Into<StopReason>) -> Self {
        TurnResult {
            terminal,
            stop_reason: stop_reason.into(),
            text: String::new(),
            tool_uses: Vec::new(),
            server_tool_uses: Vec::new(),
            usage: None,
        }
    }

    /// The same result with the turn's assistant text.
    pub fn with_text(mut self, text: impl Into<String>) -> Self {
        self.text = text.into();
        self
    }

    /// The same result with tool uses to run locally.
    pub fn with_tool_uses(mut self, tool_uses: Vec<ToolUse>) -> Self {
        self.tool_uses = tool_uses;
        self
    }

    /// The same result with tool uses the remote loop ran itself.
    pub fn with_server_tool_uses(mut self, tool_uses: Vec<ToolUse>) -> Self {
        self.server_tool_uses = tool_uses;
        self
    }

    /// The same result with the turn's usage (a [`Usage`], or an `Option` of one).
    pub fn with_usage(mut self, usage: impl Into<Option<Usage>>) -> Self {
        self.usage = usage.into();
        self
    }
}

/// Why a turn (or a request) ended: the provider's reason, or the session engine's own.
///
/// Providers spell the same reason differently (OpenAI's `stop` and `length`, Anthropic's and
/// ACP's `end_turn` and `max_tokens`, Bedrock's `tool_use`); they all parse to one variant, so
/// a caller matches on it instead of comparing strings. A reason this version does not know is
/// kept as the provider sent it, in [`StopReason::Other`].
///
/// Serialized, a known reason is its snake_case name (`"end_turn"`, `"max_turns"`), a halt is
/// `{"type": "halted", "reason": ...}` and [`StopReason::Other`] is its raw value, exactly as
/// records written before this type existed hold them: every stored stop reason still loads
/// ([`StopReason::from_raw`] is the one mapping).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum StopReason {
    /// The model finished its answer (`end_turn`, OpenAI's `stop`).
    EndTurn,
    /// The model hit its output token limit (`max_tokens`, OpenAI's `length`).
    MaxTokens,
    /// The model asked for tools (`tool_use`, OpenAI's `tool_calls`).
    ToolUse,
    /// The model produced one of the request's stop sequences.
    StopSequence,
    /// The model declined to answer.
    Refusal,
    /// A content filter or guardrail stopped the answer (`content_filter`).
    ContentFilter,
    /// The server paused a long turn, to be continued (Anthropic's `pause_turn`).
    PauseTurn,
    /// The turn was cancelled.
    Cancelled,
    /// The request used all its turns.
    MaxTurns,
    /// The model ended its turn without calling the required terminal tool, after re-prompts.
    NoTerminalTool,
    /// The terminal tool was called: the run is complete.
    TerminalTool,
    /// The turn guard halted the session, for the reason it gave.
    Halted {
        /// The guard's reason.
        reason: String,
    },
    /// Some tool uses belong to no local handler (front-end tools) and wait for results.
    PendingTools,
    /// A `RequiresAction` turn had nothing to run and the provider could not continue.
    UnresolvedRequiresAction,
    /// A reattached session had nothing pending and no prompt to deliver.
    Idle,
    /// A reason this version does not know, exactly as the provider sent it (a string, or an
    /// object such as Managed Agents' `{"type": "requires_action", "event_ids": [...]}`).
    Other(Value),
}

/// The known reasons and their serialized names, canonical name first for each.
const STOP_NAMES: &[(&str, StopReason)] = &[
    ("end_turn", StopReason::EndTurn),
    ("stop", StopReason::EndTurn),
    ("max_tokens", StopReason::MaxTokens),
    ("length", StopReason::MaxTokens),
    ("tool_use", StopReason::ToolUse),
    ("tool_calls", StopReason::ToolUse),
    ("stop_sequence", StopReason::StopSequence),
    ("refusal", StopReason::Refusal),
    ("content_filter", StopReason::ContentFilter),
    ("pause_turn", StopReason::PauseTurn),
    ("cancelled", StopReason::Cancelled),
    (stop_reason::MAX_TURNS, StopReason::MaxTurns),
    (stop_reason::NO_TERMINAL_TOOL, StopReason::NoTerminalTool),
    (stop_reason::TERMINAL_TOOL, StopReason::TerminalTool),
    (stop_reason::PENDING_TOOLS, StopReason::PendingTools),
    (
        stop_reason::UNRESOLVED_REQUIRES_ACTION,
        StopReason::UnresolvedRequiresAction,
    ),
    (stop_reason::IDLE, StopReason::Idle),
];

impl StopReason {
    /// The reason a raw value names: a known name (in any provider's spelling), an object
    /// that is only `{"type": <known name>}`, a halt (`{"type": "halted", "reason": "..."}`),
    /// or else [`StopReason::Other`] holding the value unchanged (`null` included: a provider
    /// that sent no reason).
    pub fn from_raw(raw: Value) -> Self {
        match &raw {
            Value::String(s) => Self::from_name(s).unwrap_or(StopReason::Other(raw)),
            Value::Object(o) => {
                let ty = o.get("type").and_then(Value::as_str);
                if ty == Some(stop_reason::HALTED)
                    && o.len() == 2
                    && let Some(reason) = o.get("reason").and_then(Value::as_str)
                {
                    return StopReason::Halted {
                        reason: reason.to_owned(),
                    };
                }
                match ty.and_then(Self::from_name) {
                    Some(r) if o.len() == 1 => r,
                    _ => StopReason::Other(raw),
                }
            }
            _ => StopReason::Other(raw),
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        STOP_NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, r)| r.clone())
    }

    /// The canonical name of a known reason (`"end_turn"`, `"halted"`), or the string an
    /// unknown one was, if it was a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            StopReason::Halted { .. } => Some(stop_reason::HALTED),
            StopReason::Other(v) => v.as_str(),
            known => STOP_NAMES.iter().find(|(_, r)| r == known).map(|(n, _)| *n),
        }
    }

    /// The reason as the JSON value it serializes to.
    pub fn to_value(&self) -> Value {
        match self {
            StopReason::Halted { reason } => {
                serde_json::json!({"type": stop_reason::HALTED, "reason": reason})
            }
            StopReason::Other(v) => v.clone(),
            known => Value::String(known.as_str().unwrap_or_default().to_owned()),
        }
    }
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::Halted { reason } => write!(f, "halted ({reason})"),
            StopReason::Other(Value::String(s)) => f.write_str(s),
            StopReason::Other(v) => write!(f, "{v}"),
            known => f.write_str(known.as_str().unwrap_or_default()),
        }
    }
}

impl From<Value> for StopReason {
    fn from(raw: Value) -> Self {
        StopReason::from_raw(raw)
    }
}

impl From<&str> for StopReason {
    fn from(name: &str) -> Self {
        StopReason::from_raw(Value::String(name.to_owned()))
    }
}

impl From<String> for StopReason {
    fn from(name: String) -> Self {
        StopReason::from_raw(Value::String(name))
    }
}

impl Serialize for StopReason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(s)
    }
}

impl<'de> Deserialize<'de> for StopReason {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Value::deserialize(d).map(StopReason::from_raw)
    }
}

/// The serialized names of the stop reasons the session engine itself produces (the
/// [`StopReason`] variants of the same names).
pub mod stop_reason {
    /// The request used all its turns.
    pub const MAX_TURNS: &str = "max_turns";
    /// The model ended its turn without calling the required terminal tool, after re-prompts.
    pub const NO_TERMINAL_TOOL: &str = "no_terminal_tool";
    /// The terminal tool was called: the run is complete.
    pub const TERMINAL_TOOL: &str = "terminal_tool";
    /// The turn guard halted the session.
    pub const HALTED: &str = "halted";
    /// Some tool uses belong to no local handler (front-end tools) and wait for results.
    pub const PENDING_TOOLS: &str = "pending_tools";
    /// A `RequiresAction` turn had nothing to run and the provider could not continue.
    pub const UNRESOLVED_REQUIRES_ACTION: &str = "unresolved_requires_action";
    /// A reattached session had nothing pending and no prompt to deliver.
    pub const IDLE: &str = "idle";
}

/// The outcome of one request (a prompt or a follow-up message) on a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SessionResult {
    /// How the last turn ended.
    pub terminal: Terminal,
    /// Why the request ended: the last turn's reason, or the engine's own
    /// ([`StopReason::MaxTurns`], [`StopReason::Halted`], ...).
    pub stop_reason: StopReason,
    /// The session's id.
    pub session_id: String,
    /// The final turn's text: the answer.
    pub text: String,
    /// Every turn's text in order, for callers that want all of it.
    pub texts: Vec<String>,
    /// Tool uses run in this request, each once (the same id, name and arguments twice count
    /// once; a reused id with other arguments is another tool use).
    pub tool_uses: Vec<ToolUse>,
    /// Tool uses the remote loop ran itself.
    pub server_tool_uses: Vec<ToolUse>,
    /// Tool uses waiting for results from outside (front-end tools).
    pub pending_tool_uses: Vec<ToolUse>,
    /// The input of the terminal tool, when it was called.
    pub final_output: Option<Value>,
    /// Usage summed over the request.
    pub usage: Usage,
    /// Turns taken in this request.
    pub turns: u32,
    /// The exactly-once record of this request's events (deduplicated by event id).
    ///
    /// Each event is shared with the session's record and store, not copied: a request's result
    /// costs no copy of its events, and dropping it frees none that the store still holds.
    pub events: Vec<Arc<Event>>,
}

/// Why a tool use waits instead of running.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "waiting", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Waiting {
    /// For the client to run it and send its result (a front-end tool:
    /// [`crate::ToolOutput::Pending`]).
    Client,
    /// For the user to approve it ([`crate::Handler::needs_approval`]).
    Approval {
        /// What to ask, in one line.
        summary: String,
    },
}

/// A tool use the session waits on, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PendingToolUse {
    /// The tool use.
    pub tool_use: ToolUse,
    /// What it waits for.
    #[serde(flatten)]
    pub waiting: Waiting,
}

impl PendingToolUse {
    /// A tool use waiting for `waiting`.
    pub fn new(tool_use: ToolUse, waiting: Waiting) -> Self {
        PendingToolUse { tool_use, waiting }
    }
}

/// A user message sent to a session: its text and, when the client has one, its id (an AG-UI
/// message id), which makes recording it exactly-once across redeliveries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct UserMessage {
    /// The client's id for the message, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The text.
    pub text: String,
}

impl UserMessage {
    /// A message without a client id.
    pub fn new(text: impl Into<String>) -> Self {
        UserMessage {
            id: None,
            text: text.into(),
        }
    }

    /// A message with the client's id.
    pub fn with_id(id: impl Into<String>, text: impl Into<String>) -> Self {
        UserMessage {
            id: Some(id.into()),
            text: text.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// The canonical JSON as first written (through `Value::to_string` for keys and scalars).
    fn canonical_json_first(v: &Value, out: &mut String) {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String(k.clone()).to_string());
                    out.push(':');
                    canonical_json_first(&m[k.as_str()], out);
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    canonical_json_first(x, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<u64>().prop_map(|n| json!(n)),
            any::<f64>().prop_map(|f| json!(f)),
            "\\PC{0,8}|[\\x00-\\x1f\"\\\\\u{2028}\u{e9}]{0,4}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::vec(("\\PC{0,6}|[\\x00-\\x1f\"a-c]{0,3}", inner), 0..6)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// The canonical JSON is byte for byte what it was when the first keys were recorded.
        #[test]
        fn canonical_json_is_what_it_was(v in json_value()) {
            let mut first = String::new();
            canonical_json_first(&v, &mut first);
            let mut now = Vec::new();
            canonical_json(&v, &mut now);
            prop_assert_eq!(String::from_utf8(now).unwrap(), first);
        }
    }

    /// Memo keys already recorded must keep answering: these values were computed by the code
    /// that wrote the first records (canonical JSON, SHA-256, 32 hex digits), and resume looks
    /// results up by them.
    #[test]
    fn memo_keys_keep_their_recorded_values() {
        let long = "x".repeat(200);
        let cases = [
            ToolUse::new("c1", "noop", json!({"i": 7})),
            ToolUse::new(
                "c2",
                "read",
                json!({"b": [1, 2.5, -3e40, null, true], "a": {"z": "\u{e9}\"\\\n\u{1}", "y": {}}}),
            ),
            ToolUse::new("id\u{7}", "t", json!({"k\u{2028}": "v"})),
            ToolUse::new(long.as_str(), "t", json!({})),
            ToolUse::from_arguments("c3", "t", "{not json"),
            ToolUse::from_arguments("c4", "t", "[1]"),
            ToolUse::from_arguments("c5", "t", ""),
        ];
        let got: Vec<String> = cases.iter().map(ToolUse::memo_key).collect();
        assert_eq!(
            got,
            [
                "c1#5eecdc9c743957eae513743dd6c11e27",
                "c2#37595be05dbe4bb9ed951fbf164c0a89",
                "~9cd232bf30295df5066434a0e30d1871#0d0df995465f0ada6cbb914a6c13a52e",
                "~aa20c23e3201834050679e1d88941b9a#78dbe32b348aa804904a7492be74cac2",
                "c3#0c12dba157e43ca8f9c30bb77dd769e0",
                "c4#0634e4e386c6fcab09e87ed9173d3044",
                "c5#78dbe32b348aa804904a7492be74cac2",
            ]
        );
    }

    /// Results serialized by the code before `StopReason` existed (when the field was a raw
    /// `serde_json::Value`) still load, and each stop reason parses to the variant it meant.
    #[test]
    fn a_result_written_before_stop_reason_was_typed_still_loads() {
        let cases = [
            (json!("stop"), StopReason::EndTurn),
            (json!("end_turn"), StopReason::EndTurn),
            (json!("length"), StopReason::MaxTokens),
            (json!("max_tokens"), StopReason::MaxTokens),
            (json!("tool_calls"), StopReason::ToolUse),
            (json!("tool_use"), StopReason::ToolUse),
            (json!("cancelled"), StopReason::Cancelled),
            (json!("max_turns"), StopReason::MaxTurns),
            (json!("terminal_tool"), StopReason::TerminalTool),
            (json!("no_terminal_tool"), StopReason::NoTerminalTool),
            (json!("pending_tools"), StopReason::PendingTools),
            (
                json!("unresolved_requires_action"),
                StopReason::UnresolvedRequiresAction,
            ),
            (json!("idle"), StopReason::Idle),
            (
                json!({"type": "halted", "reason": "budget"}),
                StopReason::Halted {
                    reason: "budget".into(),
                },
            ),
            (json!({"type": "end_turn"}), StopReason::EndTurn),
            (
                json!({"type": "requires_action", "event_ids": ["e1"]}),
                StopReason::Other(json!({"type": "requires_action", "event_ids": ["e1"]})),
            ),
            (json!("weird_reason"), StopReason::Other(json!("weird_reason"))),
        ];
        for (raw, want) in cases {
            let old = json!({
                "terminal": "terminated", "stop_reason": raw, "session_id": "s1", "text": "t",
                "texts": ["t"], "tool_uses": [], "server_tool_uses": [], "pending_tool_uses": [],
                "final_output": null, "usage": {}, "turns": 1, "events": [], "checkpoint": null
            });
            let r: SessionResult = serde_json::from_value(old).expect("an old session result loads");
            assert_eq!(r.stop_reason, want, "{raw}");
            let t: TurnResult = serde_json::from_value(json!({"terminal": "end_turn", "stop_reason": raw}))
                .expect("an old turn result loads");
            assert_eq!(t.stop_reason, want, "{raw}");
        }
    }

    /// The engine's own reasons serialize exactly as the old code wrote them, so records
    /// (`tether.run_end`) and wire output do not change.
    #[test]
    fn engine_reasons_serialize_as_before() {
        for (r, old) in [
            (StopReason::MaxTurns, json!(stop_reason::MAX_TURNS)),
            (StopReason::TerminalTool, json!(stop_reason::TERMINAL_TOOL)),
            (StopReason::NoTerminalTool, json!(stop_reason::NO_TERMINAL_TOOL)),
            (StopReason::PendingTools, json!(stop_reason::PENDING_TOOLS)),
            (
                StopReason::UnresolvedRequiresAction,
                json!(stop_reason::UNRESOLVED_REQUIRES_ACTION),
            ),
            (StopReason::Idle, json!(stop_reason::IDLE)),
            (
                StopReason::Halted {
                    reason: "budget".into(),
                },
                json!({"type": stop_reason::HALTED, "reason": "budget"}),
            ),
        ] {
            assert_eq!(serde_json::to_value(&r).unwrap(), old);
        }
    }

    fn any_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            prop_oneof![
                Just("stop".to_owned()),
                Just("halted".to_owned()),
                Just("end_turn".to_owned()),
                Just("type".to_owned()),
                Just("reason".to_owned()),
                ".{0,12}"
            ]
            .prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(
                    prop_oneof![Just("type".to_owned()), Just("reason".to_owned()), "[a-z]{1,6}"],
                    inner,
                    0..4
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Any stored value loads, an unknown one is kept unchanged, and a loaded reason
        /// survives another save and load.
        #[test]
        fn any_stored_stop_reason_loads_and_round_trips(raw in any_json()) {
            let r: StopReason = serde_json::from_value(raw.clone()).unwrap();
            if let StopReason::Other(v) = &r {
                prop_assert_eq!(v, &raw);
            }
            let again: StopReason = serde_json::from_value(serde_json::to_value(&r).unwrap()).unwrap();
            prop_assert_eq!(again, r);
        }
    }
}
