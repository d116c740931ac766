//! The session vocabulary shared by every provider: tools, tool uses and results, usage,
//! session identity, turn terminals and results.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::event::Event;

/// A tool the model may call: name, description and a JSON Schema for its input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
        let mut out = String::with_capacity(self.name.len() + 16);
        out.push_str(&self.name);
        out.push('\u{0}');
        match (&self.input_error, &self.raw_input) {
            (Some(_), Some(raw)) => {
                out.push_str("raw:");
                out.push_str(raw);
            }
            _ => {
                out.push_str("json:");
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
        format!("{id}#{}", hex32(self.fingerprint().as_bytes()))
    }
}

/// The first 16 bytes of the SHA-256 of `data`, as 32 lowercase hex digits.
fn hex32(data: &[u8]) -> String {
    use sha2::Digest;
    use std::fmt::Write;
    let d = sha2::Sha256::digest(data);
    let mut out = String::with_capacity(32);
    for b in d.iter().take(16) {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// Writes `v` as JSON with object keys sorted, whatever the map's own order: serde_json keeps
/// insertion order when any crate in the build enables its `preserve_order` feature.
pub(crate) fn canonical_json(v: &Value, out: &mut String) {
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
                if let Some(x) = m.get(k) {
                    canonical_json(x, out);
                }
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(x, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// The answer to one [`ToolUse`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

/// Token usage, summed over model calls, with each provider's usage object kept verbatim.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
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
pub struct TurnResult {
    /// How the turn ended.
    pub terminal: Terminal,
    /// The provider's own stop reason, raw (`"stop"`, `{"type":"requires_action",...}`, ...).
    pub stop_reason: Value,
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
    /// A turn that ended with `terminal` and a raw stop reason.
    pub fn new(terminal: Terminal, stop_reason: impl Into<Value>) -> Self {
        TurnResult {
            terminal,
            stop_reason: stop_reason.into(),
            text: String::new(),
            tool_uses: Vec::new(),
            server_tool_uses: Vec::new(),
            usage: None,
        }
    }
}

/// Stop reasons the session engine itself produces (beside the providers' raw ones).
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
pub struct SessionResult {
    /// How the last turn ended.
    pub terminal: Terminal,
    /// The last turn's raw stop reason, or one of [`stop_reason`]'s.
    pub stop_reason: Value,
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
    pub events: Vec<Event>,
    /// The provider's client-held history, when it keeps one (the local loop does).
    pub transcript: Option<Value>,
}
