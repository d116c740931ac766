//! [`Event`]: what happened in a session, raw-preserving, with a normalized view.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::types::{ToolResult, ToolUse, Usage};

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Role {
    /// The system prompt.
    System,
    /// The user.
    User,
    /// The model or remote agent.
    Assistant,
    /// A tool result.
    Tool,
}

/// One thing that happened in a session.
///
/// An event keeps what the provider said (`raw`, under a namespaced `raw_type` such as
/// `local.model_response`, `agent.custom_tool_use` or `acp.session_update`) and a normalized
/// [`EventKind`] the rest of tether reads. Durable events carry a sequence number and enter the
/// session's exactly-once record; live events (`seq == None`, typically token deltas whose content
/// a later durable event also holds) are only delivered to subscribers and the handler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Event {
    /// A stable id: the provider's when it has one, else one tether assigns.
    pub id: String,
    /// Position in the session's record (1-based, gapless); `None` for live-only events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// The namespaced raw type.
    #[serde(rename = "type")]
    pub raw_type: String,
    /// The provider's raw payload (`null` for events that exist only as deltas).
    #[serde(default)]
    pub raw: Value,
    /// The normalized view.
    pub kind: EventKind,
}

impl Event {
    /// An event with an id, a raw type, a raw payload and a normalized kind.
    pub fn new(id: impl Into<String>, raw_type: impl Into<String>, raw: Value, kind: EventKind) -> Self {
        Event {
            id: id.into(),
            seq: None,
            raw_type: raw_type.into(),
            raw,
            kind,
        }
    }

    /// Whether the event is in the durable record.
    pub fn is_durable(&self) -> bool {
        self.seq.is_some()
    }

    /// The same event at position `seq` of the session's record (as a store loads it).
    pub fn with_seq(mut self, seq: u64) -> Self {
        self.seq = Some(seq);
        self
    }
}

/// The normalized view of an [`Event`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum EventKind {
    /// A piece of assistant text.
    TextDelta {
        /// The message the text belongs to.
        message_id: String,
        /// The text.
        delta: String,
    },
    /// A piece of reasoning ("thinking") text.
    ReasoningDelta {
        /// The message the reasoning belongs to.
        message_id: String,
        /// The text.
        delta: String,
    },
    /// The provider's opaque signature or encrypted value for a reasoning block.
    ReasoningSignature {
        /// The message the reasoning belongs to.
        message_id: String,
        /// The opaque value.
        value: String,
    },
    /// A tool call began streaming.
    ToolCallStart {
        /// The call's id.
        tool_use_id: String,
        /// The tool's name.
        name: String,
        /// The assistant message that made the call.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message_id: Option<String>,
    },
    /// A piece of a streaming tool call's argument JSON.
    ToolCallArgs {
        /// The call's id.
        tool_use_id: String,
        /// The fragment.
        delta: String,
    },
    /// A streaming tool call's arguments are complete.
    ToolCallEnd {
        /// The call's id.
        tool_use_id: String,
    },
    /// A complete tool call (as remote loops report them, or at the end of a model response).
    ToolCall {
        /// The call.
        tool_use: ToolUse,
        /// The assistant message that made it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message_id: Option<String>,
    },
    /// A tool's progress or status update from a remote loop (e.g. ACP `tool_call_update`).
    ToolCallUpdate {
        /// The call's id.
        tool_use_id: String,
        /// The status, when given (`in_progress`, `completed`, `failed`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        status: Option<String>,
    },
    /// A tool's result.
    ToolResult {
        /// The result.
        result: ToolResult,
    },
    /// A complete message.
    Message {
        /// The message's id.
        message_id: String,
        /// Who wrote it.
        role: Role,
        /// Its text.
        text: String,
        /// Its reasoning text, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reasoning: Option<String>,
        /// Tool calls it made.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_uses: Vec<ToolUse>,
    },
    /// Token usage of one model call.
    Usage {
        /// The usage.
        usage: Usage,
    },
    /// A status change of the session or provider (`running`, `idle`, `retrying`, ...).
    Status {
        /// The status.
        status: String,
    },
    /// A request was retried after a transient failure.
    Retry {
        /// The attempt that failed (1-based).
        attempt: u32,
        /// How long tether waits before the next attempt.
        delay_ms: u64,
        /// What failed.
        error: String,
    },
    /// The loop injected a directive (duplicate call, corrective, final turn, re-prompt).
    Directive {
        /// Why (`duplicate`, `corrective`, `final_turn`, `reprompt`).
        role: String,
        /// The text given to the model.
        text: String,
    },
    /// An error the provider reported.
    Error {
        /// A short code.
        code: String,
        /// What went wrong.
        message: String,
    },
    /// The live content already delivered for a message is void: a retried or reconnected call
    /// streamed something other than what the failed attempt had shown (or less of it).
    ///
    /// Live-only, never recorded. A consumer that shows live content discards what it shows for
    /// `message_id` (its text, reasoning and tool calls); the message's content so far follows
    /// again as live events, from its start, and the stream goes on from there. Emitted by the
    /// session's [`crate::EventSink`], never by providers.
    MessageRestart {
        /// The message whose live content starts over.
        message_id: String,
    },
    /// Anything else: see `raw`.
    Other,
}

impl EventKind {
    /// A short name for the kind, for logs and output.
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::TextDelta { .. } => "text_delta",
            EventKind::ReasoningDelta { .. } => "reasoning_delta",
            EventKind::ReasoningSignature { .. } => "reasoning_signature",
            EventKind::ToolCallStart { .. } => "tool_call_start",
            EventKind::ToolCallArgs { .. } => "tool_call_args",
            EventKind::ToolCallEnd { .. } => "tool_call_end",
            EventKind::ToolCall { .. } => "tool_call",
            EventKind::ToolCallUpdate { .. } => "tool_call_update",
            EventKind::ToolResult { .. } => "tool_result",
            EventKind::Message { .. } => "message",
            EventKind::Usage { .. } => "usage",
            EventKind::Status { .. } => "status",
            EventKind::Retry { .. } => "retry",
            EventKind::Directive { .. } => "directive",
            EventKind::Error { .. } => "error",
            EventKind::MessageRestart { .. } => "message_restart",
            EventKind::Other => "other",
        }
    }
}
