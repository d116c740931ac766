//! The 31 AG-UI 1.0 event types.
//!
//! Every event serializes as one JSON object with a `type` discriminator, camelCase members,
//! and optional members omitted rather than `null`. `rawEvent`, `result`, `payload` and the
//! like hold "any JSON but `null`": a `Some(Value::Null)` is omitted too.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::{MessageId, RunId, SubagentRunId, ThreadId, ToolCallId};
use crate::patch::PatchOperation;
use crate::types::{
    Content, JsonObject, Message, RunAgentInput, RunFinishedOutcome, SubagentOutcome, TokenUsage, is_absent,
};

/// The protocol version this crate speaks and declares on `RUN_STARTED`.
pub const PROTOCOL_VERSION: &str = "1.0";

fn null_as_none<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    let v = Option::<Value>::deserialize(d)?;
    Ok(match v {
        Some(Value::Null) | None => None,
        some => some,
    })
}

macro_rules! event_struct {
    (attributable $(#[$m:meta])* $name:ident { $($body:tt)* }) => {
        event_struct!(@emit $(#[$m])* $name [
            /// The subagent this event belongs to (absent: the main agent).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub subagent_run_id: Option<SubagentRunId>,
        ] { $($body)* });
    };
    (boundary $(#[$m:meta])* $name:ident { $($body:tt)* }) => {
        event_struct!(@emit $(#[$m])* $name [] { $($body)* });
    };
    (@emit $(#[$m:meta])* $name:ident [$($extra:tt)*] { $($body:tt)* }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
        #[serde(rename_all = "camelCase")]
        pub struct $name {
            $($body)*
            $($extra)*
            /// Milliseconds since the epoch (an integer).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub timestamp: Option<i64>,
            /// The upstream event this one was derived from (any JSON but `null`).
            #[serde(default, deserialize_with = "null_as_none", skip_serializing_if = "is_absent")]
            pub raw_event: Option<Value>,
            /// Metadata (the key `"ag-ui"` is reserved).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub metadata: Option<JsonObject>,
        }
    };
}

/// Role of a text message (`TEXT_MESSAGE_START.role`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum TextMessageRole {
    /// `developer`.
    Developer,
    /// `system`.
    System,
    /// `assistant` (the default when absent).
    #[default]
    Assistant,
    /// `user`.
    User,
}

impl TextMessageRole {
    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            TextMessageRole::Developer => "developer",
            TextMessageRole::System => "system",
            TextMessageRole::Assistant => "assistant",
            TextMessageRole::User => "user",
        }
    }
}

/// The literal `"tool"` role of `TOOL_CALL_RESULT`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolRole {
    /// `tool`.
    #[default]
    Tool,
}

/// The literal `"reasoning"` role of `REASONING_MESSAGE_START`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReasoningRole {
    /// `reasoning`.
    #[default]
    Reasoning,
}

/// What a `REASONING_ENCRYPTED_VALUE` is attached to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum EncryptedValueSubtype {
    /// A tool call (`entityId` = `toolCallId`).
    #[serde(rename = "tool-call")]
    ToolCall,
    /// A message (`entityId` = `messageId`).
    #[default]
    #[serde(rename = "message")]
    Message,
}

impl EncryptedValueSubtype {
    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            EncryptedValueSubtype::ToolCall => "tool-call",
            EncryptedValueSubtype::Message => "message",
        }
    }
}

// ----- lifecycle -----------------------------------------------------------------------------

event_struct!(boundary
    /// `RUN_STARTED`: the first event of a run.
    RunStartedEvent {
        /// Thread id (the input's).
        pub thread_id: ThreadId,
        /// Run id (the input's).
        pub run_id: RunId,
        /// `"1.0"`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub protocol_version: Option<String>,
        /// Lineage.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub parent_run_id: Option<RunId>,
        /// Echo of the input.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub input: Option<Box<RunAgentInput>>,
    }
);

event_struct!(boundary
    /// `RUN_FINISHED`: the run ended normally.
    RunFinishedEvent {
        /// Thread id.
        pub thread_id: ThreadId,
        /// Run id.
        pub run_id: RunId,
        /// Result (any JSON but `null`).
        #[serde(default, deserialize_with = "null_as_none", skip_serializing_if = "is_absent")]
        pub result: Option<Value>,
        /// Absent means success.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub outcome: Option<RunFinishedOutcome>,
        /// Token usage per model.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub usage: Option<Vec<TokenUsage>>,
    }
);

event_struct!(boundary
    /// `RUN_ERROR`: the run failed.
    RunErrorEvent {
        /// What went wrong.
        pub message: String,
        /// Machine-readable code.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub code: Option<String>,
        /// Token usage spent before the failure.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub usage: Option<Vec<TokenUsage>>,
    }
);

event_struct!(attributable
    /// `STEP_STARTED`.
    StepStartedEvent {
        /// Step name.
        pub step_name: String,
    }
);

event_struct!(attributable
    /// `STEP_FINISHED`.
    StepFinishedEvent {
        /// Step name.
        pub step_name: String,
    }
);

// ----- text ----------------------------------------------------------------------------------

event_struct!(attributable
    /// `TEXT_MESSAGE_START`.
    TextMessageStartEvent {
        /// Message id.
        pub message_id: MessageId,
        /// Role (absent: assistant).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub role: Option<TextMessageRole>,
        /// Author name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub name: Option<String>,
    }
);

event_struct!(attributable
    /// `TEXT_MESSAGE_CONTENT`.
    TextMessageContentEvent {
        /// Message id.
        pub message_id: MessageId,
        /// Text fragment.
        pub delta: String,
    }
);

event_struct!(attributable
    /// `TEXT_MESSAGE_END`.
    TextMessageEndEvent {
        /// Message id.
        pub message_id: MessageId,
    }
);

event_struct!(attributable
    /// `TEXT_MESSAGE_CHUNK`: START/CONTENT/END in one self-closing form.
    TextMessageChunkEvent {
        /// Message id (required on the first chunk of an item).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub message_id: Option<MessageId>,
        /// Role.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub role: Option<TextMessageRole>,
        /// Text fragment.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub delta: Option<String>,
        /// Author name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub name: Option<String>,
    }
);

// ----- tools ---------------------------------------------------------------------------------

event_struct!(attributable
    /// `TOOL_CALL_START`.
    ToolCallStartEvent {
        /// Call id.
        pub tool_call_id: ToolCallId,
        /// Tool name.
        pub tool_call_name: String,
        /// The assistant message that made the call.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub parent_message_id: Option<MessageId>,
    }
);

event_struct!(attributable
    /// `TOOL_CALL_ARGS`: a fragment of the argument text.
    ToolCallArgsEvent {
        /// Call id.
        pub tool_call_id: ToolCallId,
        /// Argument text fragment.
        pub delta: String,
    }
);

event_struct!(attributable
    /// `TOOL_CALL_END`: the arguments are complete.
    ToolCallEndEvent {
        /// Call id.
        pub tool_call_id: ToolCallId,
    }
);

event_struct!(attributable
    /// `TOOL_CALL_CHUNK`.
    ToolCallChunkEvent {
        /// Call id (required on the first chunk).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tool_call_id: Option<ToolCallId>,
        /// Tool name (required on the first chunk).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tool_call_name: Option<String>,
        /// Parent assistant message.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub parent_message_id: Option<MessageId>,
        /// Argument text fragment.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub delta: Option<String>,
    }
);

event_struct!(attributable
    /// `TOOL_CALL_RESULT`: a backend tool's result, as a new `tool` message.
    ToolCallResultEvent {
        /// Id of the new tool message.
        pub message_id: MessageId,
        /// The call answered.
        pub tool_call_id: ToolCallId,
        /// Text or parts.
        pub content: Content,
        /// `"tool"`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub role: Option<ToolRole>,
    }
);

// ----- state ---------------------------------------------------------------------------------

event_struct!(attributable
    /// `STATE_SNAPSHOT`: replaces the consumer's state.
    StateSnapshotEvent {
        /// The whole state (any JSON, `null` included).
        pub snapshot: Value,
    }
);

event_struct!(attributable
    /// `STATE_DELTA`: an RFC 6902 patch against the current state.
    StateDeltaEvent {
        /// The patch.
        pub delta: Vec<PatchOperation>,
    }
);

event_struct!(boundary
    /// `MESSAGES_SNAPSHOT`: the conversation, reconciled by id.
    MessagesSnapshotEvent {
        /// Messages.
        pub messages: Vec<Message>,
    }
);

// ----- activity ------------------------------------------------------------------------------

event_struct!(attributable
    /// `ACTIVITY_SNAPSHOT`.
    ActivitySnapshotEvent {
        /// Activity message id.
        pub message_id: MessageId,
        /// Activity type.
        pub activity_type: String,
        /// Content (an object).
        pub content: JsonObject,
        /// `false` merges instead of replacing (absent: replace).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub replace: Option<bool>,
    }
);

event_struct!(attributable
    /// `ACTIVITY_DELTA`: a JSON Patch against an activity's content.
    ActivityDeltaEvent {
        /// Activity message id.
        pub message_id: MessageId,
        /// Activity type.
        pub activity_type: String,
        /// The patch.
        pub patch: Vec<PatchOperation>,
    }
);

// ----- passthrough ---------------------------------------------------------------------------

event_struct!(attributable
    /// `RAW`: an upstream event passed through.
    RawEvent {
        /// The upstream event (any JSON).
        pub event: Value,
        /// Where it came from.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub source: Option<String>,
    }
);

event_struct!(attributable
    /// `CUSTOM`: an application event.
    CustomEvent {
        /// Name.
        pub name: String,
        /// Value (any JSON).
        pub value: Value,
    }
);

// ----- reasoning -----------------------------------------------------------------------------

event_struct!(attributable
    /// `REASONING_START`: opens a reasoning span.
    ReasoningStartEvent {
        /// Span id.
        pub message_id: MessageId,
    }
);

event_struct!(attributable
    /// `REASONING_MESSAGE_START`.
    ReasoningMessageStartEvent {
        /// Reasoning message id.
        pub message_id: MessageId,
        /// `"reasoning"`.
        pub role: ReasoningRole,
    }
);

event_struct!(attributable
    /// `REASONING_MESSAGE_CONTENT`.
    ReasoningMessageContentEvent {
        /// Reasoning message id.
        pub message_id: MessageId,
        /// Text fragment.
        pub delta: String,
    }
);

event_struct!(attributable
    /// `REASONING_MESSAGE_END`.
    ReasoningMessageEndEvent {
        /// Reasoning message id.
        pub message_id: MessageId,
    }
);

event_struct!(attributable
    /// `REASONING_MESSAGE_CHUNK`.
    ReasoningMessageChunkEvent {
        /// Reasoning message id (required on the first chunk).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub message_id: Option<MessageId>,
        /// Text fragment.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub delta: Option<String>,
    }
);

event_struct!(attributable
    /// `REASONING_END`: closes a reasoning span.
    ReasoningEndEvent {
        /// Span id.
        pub message_id: MessageId,
    }
);

event_struct!(attributable
    /// `REASONING_ENCRYPTED_VALUE`: a provider's opaque reasoning signature.
    ReasoningEncryptedValueEvent {
        /// What `entity_id` names.
        pub subtype: EncryptedValueSubtype,
        /// A message id or a tool call id.
        pub entity_id: String,
        /// The opaque value.
        pub encrypted_value: String,
    }
);

// ----- subagents -----------------------------------------------------------------------------

event_struct!(boundary
    /// `SUBAGENT_STARTED`.
    SubagentStartedEvent {
        /// The subagent run's identity.
        pub subagent_run_id: SubagentRunId,
        /// Name.
        pub name: String,
        /// Description.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub description: Option<String>,
        /// Enclosing subagent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub parent_subagent_run_id: Option<SubagentRunId>,
        /// Tool call that spawned it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub parent_tool_call_id: Option<ToolCallId>,
        /// Message that spawned it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub parent_message_id: Option<MessageId>,
    }
);

event_struct!(boundary
    /// `SUBAGENT_FINISHED`.
    SubagentFinishedEvent {
        /// The subagent run.
        pub subagent_run_id: SubagentRunId,
        /// Result (any JSON but `null`).
        #[serde(default, deserialize_with = "null_as_none", skip_serializing_if = "is_absent")]
        pub result: Option<Value>,
        /// Outcome.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub outcome: Option<SubagentOutcome>,
    }
);

event_struct!(boundary
    /// `SUBAGENT_ERROR`.
    SubagentErrorEvent {
        /// The subagent run.
        pub subagent_run_id: SubagentRunId,
        /// What went wrong.
        pub message: String,
        /// Machine-readable code.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub code: Option<String>,
    }
);

macro_rules! events {
    ($($variant:ident($ty:ident) = $wire:literal, proto $num:literal, arm $arm:literal;)*) => {
        /// One AG-UI event.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "type", rename_all = "SCREAMING_SNAKE_CASE")]
        #[non_exhaustive]
        pub enum AgUiEvent {
            $(
                #[doc = concat!("`", $wire, "`")]
                $variant($ty),
            )*
        }

        /// The discriminator of an [`AgUiEvent`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum EventType {
            $(
                #[doc = concat!("`", $wire, "`")]
                $variant,
            )*
        }

        impl EventType {
            /// Every event type of AG-UI 1.0.
            pub const ALL: &'static [EventType] = &[$(EventType::$variant,)*];

            /// The wire string (`"RUN_STARTED"`, ...).
            pub fn as_str(self) -> &'static str {
                match self { $(EventType::$variant => $wire,)* }
            }

            /// The `ag_ui.EventType` enum value used by the protobuf binding.
            pub fn proto_number(self) -> i32 {
                match self { $(EventType::$variant => $num,)* }
            }

            /// The field number of this type's arm in the `ag_ui.Event` envelope's `oneof`.
            pub fn proto_arm(self) -> u32 {
                match self { $(EventType::$variant => $arm,)* }
            }
        }

        impl AgUiEvent {
            /// This event's type.
            pub fn event_type(&self) -> EventType {
                match self { $(AgUiEvent::$variant(_) => EventType::$variant,)* }
            }

            /// The `timestamp`, if set.
            pub fn timestamp(&self) -> Option<i64> {
                match self { $(AgUiEvent::$variant(e) => e.timestamp,)* }
            }

            /// Sets the `timestamp` (milliseconds since the epoch).
            pub fn set_timestamp(&mut self, ms: i64) {
                match self { $(AgUiEvent::$variant(e) => e.timestamp = Some(ms),)* }
            }

            /// The `metadata`, if set.
            pub fn metadata(&self) -> Option<&JsonObject> {
                match self { $(AgUiEvent::$variant(e) => e.metadata.as_ref(),)* }
            }

            /// The `rawEvent`, if set.
            pub fn raw_event(&self) -> Option<&Value> {
                match self { $(AgUiEvent::$variant(e) => e.raw_event.as_ref(),)* }
            }
        }

        $(
            impl From<$ty> for AgUiEvent {
                fn from(e: $ty) -> Self {
                    AgUiEvent::$variant(e)
                }
            }
        )*
    };
}

events! {
    TextMessageStart(TextMessageStartEvent) = "TEXT_MESSAGE_START", proto 0, arm 1;
    TextMessageContent(TextMessageContentEvent) = "TEXT_MESSAGE_CONTENT", proto 1, arm 2;
    TextMessageEnd(TextMessageEndEvent) = "TEXT_MESSAGE_END", proto 2, arm 3;
    ToolCallStart(ToolCallStartEvent) = "TOOL_CALL_START", proto 3, arm 4;
    ToolCallArgs(ToolCallArgsEvent) = "TOOL_CALL_ARGS", proto 4, arm 5;
    ToolCallEnd(ToolCallEndEvent) = "TOOL_CALL_END", proto 5, arm 6;
    StateSnapshot(StateSnapshotEvent) = "STATE_SNAPSHOT", proto 6, arm 7;
    StateDelta(StateDeltaEvent) = "STATE_DELTA", proto 7, arm 8;
    MessagesSnapshot(MessagesSnapshotEvent) = "MESSAGES_SNAPSHOT", proto 8, arm 9;
    Raw(RawEvent) = "RAW", proto 9, arm 10;
    Custom(CustomEvent) = "CUSTOM", proto 10, arm 11;
    RunStarted(RunStartedEvent) = "RUN_STARTED", proto 11, arm 12;
    RunFinished(RunFinishedEvent) = "RUN_FINISHED", proto 12, arm 13;
    RunError(RunErrorEvent) = "RUN_ERROR", proto 13, arm 14;
    StepStarted(StepStartedEvent) = "STEP_STARTED", proto 14, arm 15;
    StepFinished(StepFinishedEvent) = "STEP_FINISHED", proto 15, arm 16;
    SubagentStarted(SubagentStartedEvent) = "SUBAGENT_STARTED", proto 16, arm 19;
    SubagentFinished(SubagentFinishedEvent) = "SUBAGENT_FINISHED", proto 17, arm 20;
    SubagentError(SubagentErrorEvent) = "SUBAGENT_ERROR", proto 18, arm 21;
    TextMessageChunk(TextMessageChunkEvent) = "TEXT_MESSAGE_CHUNK", proto 19, arm 17;
    ToolCallChunk(ToolCallChunkEvent) = "TOOL_CALL_CHUNK", proto 20, arm 18;
    ToolCallResult(ToolCallResultEvent) = "TOOL_CALL_RESULT", proto 21, arm 22;
    ActivitySnapshot(ActivitySnapshotEvent) = "ACTIVITY_SNAPSHOT", proto 22, arm 23;
    ActivityDelta(ActivityDeltaEvent) = "ACTIVITY_DELTA", proto 23, arm 24;
    ReasoningStart(ReasoningStartEvent) = "REASONING_START", proto 24, arm 25;
    ReasoningMessageStart(ReasoningMessageStartEvent) = "REASONING_MESSAGE_START", proto 25, arm 26;
    ReasoningMessageContent(ReasoningMessageContentEvent) = "REASONING_MESSAGE_CONTENT", proto 26, arm 27;
    ReasoningMessageEnd(ReasoningMessageEndEvent) = "REASONING_MESSAGE_END", proto 27, arm 28;
    ReasoningMessageChunk(ReasoningMessageChunkEvent) = "REASONING_MESSAGE_CHUNK", proto 28, arm 29;
    ReasoningEnd(ReasoningEndEvent) = "REASONING_END", proto 29, arm 30;
    ReasoningEncryptedValue(ReasoningEncryptedValueEvent) = "REASONING_ENCRYPTED_VALUE", proto 30, arm 31;
}

impl std::fmt::Display for EventType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl AgUiEvent {
    /// The `subagentRunId` attribution of an attributable event (`None` for the main agent,
    /// for `RUN_*`, `MESSAGES_SNAPSHOT` and the `SUBAGENT_*` events, whose id is their identity).
    pub fn attribution(&self) -> Option<&SubagentRunId> {
        match self {
            AgUiEvent::TextMessageStart(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::TextMessageContent(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::TextMessageEnd(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::TextMessageChunk(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ToolCallStart(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ToolCallArgs(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ToolCallEnd(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ToolCallChunk(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ToolCallResult(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::StateSnapshot(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::StateDelta(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ActivitySnapshot(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ActivityDelta(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::Raw(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::Custom(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::StepStarted(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::StepFinished(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ReasoningStart(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ReasoningMessageStart(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ReasoningMessageContent(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ReasoningMessageEnd(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ReasoningMessageChunk(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ReasoningEnd(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::ReasoningEncryptedValue(e) => e.subagent_run_id.as_ref(),
            AgUiEvent::RunStarted(_)
            | AgUiEvent::RunFinished(_)
            | AgUiEvent::RunError(_)
            | AgUiEvent::MessagesSnapshot(_)
            | AgUiEvent::SubagentStarted(_)
            | AgUiEvent::SubagentFinished(_)
            | AgUiEvent::SubagentError(_) => None,
        }
    }

    /// `RUN_STARTED` declaring protocol 1.0.
    pub fn run_started(thread_id: impl Into<ThreadId>, run_id: impl Into<RunId>) -> Self {
        AgUiEvent::RunStarted(RunStartedEvent {
            thread_id: thread_id.into(),
            run_id: run_id.into(),
            protocol_version: Some(PROTOCOL_VERSION.to_owned()),
            ..Default::default()
        })
    }

    /// `RUN_FINISHED` with an outcome.
    pub fn run_finished(
        thread_id: impl Into<ThreadId>,
        run_id: impl Into<RunId>,
        outcome: Option<RunFinishedOutcome>,
    ) -> Self {
        AgUiEvent::RunFinished(RunFinishedEvent {
            thread_id: thread_id.into(),
            run_id: run_id.into(),
            outcome,
            ..Default::default()
        })
    }

    /// `RUN_ERROR`.
    pub fn run_error(message: impl Into<String>, code: Option<String>) -> Self {
        AgUiEvent::RunError(RunErrorEvent {
            message: message.into(),
            code,
            ..Default::default()
        })
    }

    /// `STEP_STARTED`.
    pub fn step_started(name: impl Into<String>) -> Self {
        AgUiEvent::StepStarted(StepStartedEvent {
            step_name: name.into(),
            ..Default::default()
        })
    }

    /// `STEP_FINISHED`.
    pub fn step_finished(name: impl Into<String>) -> Self {
        AgUiEvent::StepFinished(StepFinishedEvent {
            step_name: name.into(),
            ..Default::default()
        })
    }

    /// `TEXT_MESSAGE_START`; the role is omitted when it is the default (assistant).
    pub fn text_message_start(id: impl Into<MessageId>, role: TextMessageRole) -> Self {
        AgUiEvent::TextMessageStart(TextMessageStartEvent {
            message_id: id.into(),
            role: (role != TextMessageRole::Assistant).then_some(role),
            ..Default::default()
        })
    }

    /// `TEXT_MESSAGE_CONTENT`.
    pub fn text_message_content(id: impl Into<MessageId>, delta: impl Into<String>) -> Self {
        AgUiEvent::TextMessageContent(TextMessageContentEvent {
            message_id: id.into(),
            delta: delta.into(),
            ..Default::default()
        })
    }

    /// `TEXT_MESSAGE_END`.
    pub fn text_message_end(id: impl Into<MessageId>) -> Self {
        AgUiEvent::TextMessageEnd(TextMessageEndEvent {
            message_id: id.into(),
            ..Default::default()
        })
    }

    /// `TOOL_CALL_START`.
    pub fn tool_call_start(
        id: impl Into<ToolCallId>,
        name: impl Into<String>,
        parent_message_id: Option<MessageId>,
    ) -> Self {
        AgUiEvent::ToolCallStart(ToolCallStartEvent {
            tool_call_id: id.into(),
            tool_call_name: name.into(),
            parent_message_id,
            ..Default::default()
        })
    }

    /// `TOOL_CALL_ARGS`.
    pub fn tool_call_args(id: impl Into<ToolCallId>, delta: impl Into<String>) -> Self {
        AgUiEvent::ToolCallArgs(ToolCallArgsEvent {
            tool_call_id: id.into(),
            delta: delta.into(),
            ..Default::default()
        })
    }

    /// `TOOL_CALL_END`.
    pub fn tool_call_end(id: impl Into<ToolCallId>) -> Self {
        AgUiEvent::ToolCallEnd(ToolCallEndEvent {
            tool_call_id: id.into(),
            ..Default::default()
        })
    }

    /// `TOOL_CALL_RESULT` with `role: "tool"`.
    pub fn tool_call_result(
        message_id: impl Into<MessageId>,
        tool_call_id: impl Into<ToolCallId>,
        content: impl Into<Content>,
    ) -> Self {
        AgUiEvent::ToolCallResult(ToolCallResultEvent {
            message_id: message_id.into(),
            tool_call_id: tool_call_id.into(),
            content: content.into(),
            role: Some(ToolRole::Tool),
            ..Default::default()
        })
    }

    /// `STATE_SNAPSHOT`.
    pub fn state_snapshot(snapshot: Value) -> Self {
        AgUiEvent::StateSnapshot(StateSnapshotEvent {
            snapshot,
            ..Default::default()
        })
    }

    /// `STATE_DELTA`.
    pub fn state_delta(delta: Vec<PatchOperation>) -> Self {
        AgUiEvent::StateDelta(StateDeltaEvent {
            delta,
            ..Default::default()
        })
    }

    /// `MESSAGES_SNAPSHOT`.
    pub fn messages_snapshot(messages: Vec<Message>) -> Self {
        AgUiEvent::MessagesSnapshot(MessagesSnapshotEvent {
            messages,
            ..Default::default()
        })
    }

    /// `ACTIVITY_SNAPSHOT` (replacing).
    pub fn activity_snapshot(
        message_id: impl Into<MessageId>,
        activity_type: impl Into<String>,
        content: JsonObject,
    ) -> Self {
        AgUiEvent::ActivitySnapshot(ActivitySnapshotEvent {
            message_id: message_id.into(),
            activity_type: activity_type.into(),
            content,
            ..Default::default()
        })
    }

    /// `ACTIVITY_DELTA`.
    pub fn activity_delta(
        message_id: impl Into<MessageId>,
        activity_type: impl Into<String>,
        patch: Vec<PatchOperation>,
    ) -> Self {
        AgUiEvent::ActivityDelta(ActivityDeltaEvent {
            message_id: message_id.into(),
            activity_type: activity_type.into(),
            patch,
            ..Default::default()
        })
    }

    /// `RAW`.
    pub fn raw(event: Value, source: Option<String>) -> Self {
        AgUiEvent::Raw(RawEvent {
            event,
            source,
            ..Default::default()
        })
    }

    /// `CUSTOM`.
    pub fn custom(name: impl Into<String>, value: Value) -> Self {
        AgUiEvent::Custom(CustomEvent {
            name: name.into(),
            value,
            ..Default::default()
        })
    }

    /// `REASONING_START`.
    pub fn reasoning_start(id: impl Into<MessageId>) -> Self {
        AgUiEvent::ReasoningStart(ReasoningStartEvent {
            message_id: id.into(),
            ..Default::default()
        })
    }

    /// `REASONING_MESSAGE_START`.
    pub fn reasoning_message_start(id: impl Into<MessageId>) -> Self {
        AgUiEvent::ReasoningMessageStart(ReasoningMessageStartEvent {
            message_id: id.into(),
            role: ReasoningRole::Reasoning,
            ..Default::default()
        })
    }

    /// `REASONING_MESSAGE_CONTENT`.
    pub fn reasoning_message_content(id: impl Into<MessageId>, delta: impl Into<String>) -> Self {
        AgUiEvent::ReasoningMessageContent(ReasoningMessageContentEvent {
            message_id: id.into(),
            delta: delta.into(),
            ..Default::default()
        })
    }

    /// `REASONING_MESSAGE_END`.
    pub fn reasoning_message_end(id: impl Into<MessageId>) -> Self {
        AgUiEvent::ReasoningMessageEnd(ReasoningMessageEndEvent {
            message_id: id.into(),
            ..Default::default()
        })
    }

    /// `REASONING_END`.
    pub fn reasoning_end(id: impl Into<MessageId>) -> Self {
        AgUiEvent::ReasoningEnd(ReasoningEndEvent {
            message_id: id.into(),
            ..Default::default()
        })
    }

    /// `REASONING_ENCRYPTED_VALUE`.
    pub fn reasoning_encrypted_value(
        subtype: EncryptedValueSubtype,
        entity_id: impl Into<String>,
        value: impl Into<String>,
    ) -> Self {
        AgUiEvent::ReasoningEncryptedValue(ReasoningEncryptedValueEvent {
            subtype,
            entity_id: entity_id.into(),
            encrypted_value: value.into(),
            ..Default::default()
        })
    }

    /// `SUBAGENT_STARTED`.
    pub fn subagent_started(id: impl Into<SubagentRunId>, name: impl Into<String>) -> Self {
        AgUiEvent::SubagentStarted(SubagentStartedEvent {
            subagent_run_id: id.into(),
            name: name.into(),
            ..Default::default()
        })
    }

    /// `SUBAGENT_FINISHED` with a success outcome.
    pub fn subagent_finished(id: impl Into<SubagentRunId>) -> Self {
        AgUiEvent::SubagentFinished(SubagentFinishedEvent {
            subagent_run_id: id.into(),
            outcome: Some(SubagentOutcome::Success),
            ..Default::default()
        })
    }

    /// `SUBAGENT_ERROR`.
    pub fn subagent_error(id: impl Into<SubagentRunId>, message: impl Into<String>) -> Self {
        AgUiEvent::SubagentError(SubagentErrorEvent {
            subagent_run_id: id.into(),
            message: message.into(),
            ..Default::default()
        })
    }
}
