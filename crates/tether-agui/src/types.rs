//! Auxiliary protocol types: messages, content parts, `RunAgentInput`, tools, interrupts,
//! resume entries, token usage and run outcomes.
//!
//! Serialization follows the 1.0 schema: camelCase names, optional fields omitted (never
//! `null`), unknown input members ignored.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ids::{InterruptId, MessageId, RunId, SubagentRunId, ThreadId, ToolCallId};

/// `skip_serializing_if` for "any JSON but `null`" fields: absent and `null` are both omitted.
pub(crate) fn is_absent(v: &Option<Value>) -> bool {
    matches!(v, None | Some(Value::Null))
}

/// Deserializes an optional value where `null` means absent.
fn null_as_none<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    let v = Option::<Value>::deserialize(d)?;
    Ok(match v {
        Some(Value::Null) | None => None,
        some => some,
    })
}

/// A JSON object (`metadata`, activity content, ...).
pub type JsonObject = Map<String, Value>;

// ---------------------------------------------------------------------------------------------
// Content parts

/// Where a binary content part's bytes live.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
#[non_exhaustive]
pub enum PartSource {
    /// Inline base64 data.
    #[serde(rename_all = "camelCase")]
    Data {
        /// Base64 bytes.
        value: String,
        /// MIME type of the bytes.
        mime_type: String,
    },
    /// A URL.
    #[serde(rename_all = "camelCase")]
    Url {
        /// The URL.
        value: String,
        /// MIME type, if known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mime_type: Option<String>,
    },
    /// An opaque provider file handle.
    #[serde(rename_all = "camelCase")]
    File {
        /// The handle.
        value: String,
        /// Which provider the handle belongs to.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        provider: Option<String>,
        /// MIME type, if known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mime_type: Option<String>,
    },
}

/// One part of a multimodal `content` array.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
#[non_exhaustive]
pub enum ContentPart {
    /// Text.
    Text {
        /// The text.
        text: String,
        /// Optional part id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// Optional metadata (any JSON but `null`).
        #[serde(default, deserialize_with = "null_as_none", skip_serializing_if = "is_absent")]
        metadata: Option<Value>,
    },
    /// An image.
    Image(MediaPart),
    /// Audio.
    Audio(MediaPart),
    /// Video.
    Video(MediaPart),
    /// A document.
    Document(MediaPart),
}

impl ContentPart {
    /// A text part.
    pub fn text(text: impl Into<String>) -> Self {
        ContentPart::Text {
            text: text.into(),
            id: None,
            metadata: None,
        }
    }
}

/// The body of an image, audio, video or document part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct MediaPart {
    /// Where the bytes are.
    pub source: PartSource,
    /// Optional part id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Optional metadata (any JSON but `null`).
    #[serde(default, deserialize_with = "null_as_none", skip_serializing_if = "is_absent")]
    pub metadata: Option<Value>,
}

/// `content` of user and tool messages and of `TOOL_CALL_RESULT`: a string or parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Multimodal parts.
    Parts(Vec<ContentPart>),
}

impl Default for Content {
    fn default() -> Self {
        Content::Text(String::new())
    }
}

impl Content {
    /// The text of this content: the string itself, or the text parts joined.
    pub fn to_text(&self) -> String {
        match self {
            Content::Text(s) => s.clone(),
            Content::Parts(parts) => {
                let mut out = String::new();
                for p in parts {
                    if let ContentPart::Text { text, .. } = p {
                        out.push_str(text);
                    }
                }
                out
            }
        }
    }
}

impl From<String> for Content {
    fn from(s: String) -> Self {
        Content::Text(s)
    }
}

impl From<&str> for Content {
    fn from(s: &str) -> Self {
        Content::Text(s.to_owned())
    }
}

// ---------------------------------------------------------------------------------------------
// Messages

/// The `function` of an assistant tool call.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct FunctionCall {
    /// Tool name.
    pub name: String,
    /// Argument JSON text.
    pub arguments: String,
}

/// A tool call recorded on an assistant message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct ToolCall {
    /// Call id.
    pub id: ToolCallId,
    /// Always `"function"`.
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    /// Name and arguments.
    pub function: FunctionCall,
    /// Provider's opaque reasoning signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encrypted_value: Option<String>,
    /// Metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<JsonObject>,
}

impl ToolCall {
    /// A function call with its argument text.
    pub fn new(id: impl Into<ToolCallId>, name: impl Into<String>, arguments: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            kind: function_type(),
            function: FunctionCall {
                name: name.into(),
                arguments: arguments.into(),
            },
            encrypted_value: None,
            metadata: None,
        }
    }
}

fn function_type() -> String {
    "function".to_owned()
}

macro_rules! message_struct {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* pub $f:ident : $t:ty),* $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
        #[serde(rename_all = "camelCase")]
        pub struct $name {
            /// Message id.
            pub id: MessageId,
            $($(#[$fm])* pub $f: $t,)*
            /// Metadata.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub metadata: Option<JsonObject>,
            /// The subagent that produced this message.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub subagent_run_id: Option<SubagentRunId>,
        }
    };
}

message_struct!(
    /// A `developer` or `system` message.
    InstructionMessage {
        /// Text.
        pub content: String,
        /// Optional author name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub name: Option<String>,
        /// Provider's opaque value.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub encrypted_value: Option<String>,
    }
);

message_struct!(
    /// An `assistant` message.
    AssistantMessage {
        /// Text, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub content: Option<String>,
        /// Tool calls the assistant made.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub tool_calls: Option<Vec<ToolCall>>,
        /// Optional author name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub name: Option<String>,
        /// Provider's opaque value.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub encrypted_value: Option<String>,
    }
);

message_struct!(
    /// A `user` message.
    UserMessage {
        /// Text or parts.
        pub content: Content,
        /// Optional author name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub name: Option<String>,
        /// Provider's opaque value.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub encrypted_value: Option<String>,
    }
);

message_struct!(
    /// A `tool` message: the result of one tool call.
    ToolMessage {
        /// Text or parts.
        pub content: Content,
        /// The call this answers.
        pub tool_call_id: ToolCallId,
        /// Error text, when the tool failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub error: Option<String>,
        /// Provider's opaque value.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub encrypted_value: Option<String>,
    }
);

message_struct!(
    /// An `activity` message (client-side only; servers ignore them on input).
    ActivityMessage {
        /// Activity type.
        pub activity_type: String,
        /// Activity content (an object).
        pub content: JsonObject,
    }
);

message_struct!(
    /// A `reasoning` message.
    ReasoningMessage {
        /// Reasoning text.
        pub content: String,
        /// Provider's opaque value.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub encrypted_value: Option<String>,
    }
);

/// A conversation message, discriminated on `role`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "lowercase")]
#[non_exhaustive]
pub enum Message {
    /// `developer`.
    Developer(InstructionMessage),
    /// `system`.
    System(InstructionMessage),
    /// `assistant`.
    Assistant(AssistantMessage),
    /// `user`.
    User(UserMessage),
    /// `tool`.
    Tool(ToolMessage),
    /// `activity`.
    Activity(ActivityMessage),
    /// `reasoning`.
    Reasoning(ReasoningMessage),
}

impl Message {
    /// The message id.
    pub fn id(&self) -> &MessageId {
        match self {
            Message::Developer(m) | Message::System(m) => &m.id,
            Message::Assistant(m) => &m.id,
            Message::User(m) => &m.id,
            Message::Tool(m) => &m.id,
            Message::Activity(m) => &m.id,
            Message::Reasoning(m) => &m.id,
        }
    }

    /// The role as its wire string.
    pub fn role(&self) -> &'static str {
        match self {
            Message::Developer(_) => "developer",
            Message::System(_) => "system",
            Message::Assistant(_) => "assistant",
            Message::User(_) => "user",
            Message::Tool(_) => "tool",
            Message::Activity(_) => "activity",
            Message::Reasoning(_) => "reasoning",
        }
    }

    /// A user message with text content.
    pub fn user(id: impl Into<MessageId>, text: impl Into<String>) -> Self {
        Message::User(UserMessage {
            id: id.into(),
            content: Content::Text(text.into()),
            ..Default::default()
        })
    }

    /// An assistant message with text content.
    pub fn assistant(id: impl Into<MessageId>, text: impl Into<String>) -> Self {
        Message::Assistant(AssistantMessage {
            id: id.into(),
            content: Some(text.into()),
            ..Default::default()
        })
    }

    /// A system message.
    pub fn system(id: impl Into<MessageId>, text: impl Into<String>) -> Self {
        Message::System(InstructionMessage {
            id: id.into(),
            content: text.into(),
            ..Default::default()
        })
    }

    /// A tool message answering `tool_call_id`.
    pub fn tool(
        id: impl Into<MessageId>,
        tool_call_id: impl Into<ToolCallId>,
        content: impl Into<Content>,
    ) -> Self {
        Message::Tool(ToolMessage {
            id: id.into(),
            tool_call_id: tool_call_id.into(),
            content: content.into(),
            ..Default::default()
        })
    }
}

// ---------------------------------------------------------------------------------------------
// RunAgentInput

/// A front-end tool the client offers (`RunAgentInput.tools`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Tool {
    /// Tool name.
    pub name: String,
    /// What the tool does.
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments.
    #[serde(default, deserialize_with = "null_as_none", skip_serializing_if = "is_absent")]
    pub parameters: Option<Value>,
    /// Metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<JsonObject>,
}

/// A piece of context the client wants in the model's context.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Context {
    /// What it is.
    pub description: String,
    /// The value.
    pub value: String,
}

/// How a consumer answered an interrupt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum ResumeStatus {
    /// Answered; `payload` carries the answer.
    Resolved,
    /// Declined.
    Cancelled,
}

/// One answer in `RunAgentInput.resume`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct ResumeEntry {
    /// The interrupt answered.
    pub interrupt_id: InterruptId,
    /// Resolved or cancelled.
    pub status: ResumeStatus,
    /// The answer.
    #[serde(default, deserialize_with = "null_as_none", skip_serializing_if = "is_absent")]
    pub payload: Option<Value>,
    /// Metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<JsonObject>,
}

/// The POST body of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct RunAgentInput {
    /// Thread id.
    pub thread_id: ThreadId,
    /// Run id.
    pub run_id: RunId,
    /// Conversation so far.
    pub messages: Vec<Message>,
    /// Consumer's protocol version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol_version: Option<String>,
    /// Lineage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_run_id: Option<RunId>,
    /// Current state; absent or `null` means none.
    #[serde(default, deserialize_with = "null_as_none", skip_serializing_if = "is_absent")]
    pub state: Option<Value>,
    /// Front-end tools.
    #[serde(default)]
    pub tools: Vec<Tool>,
    /// Context entries.
    #[serde(default)]
    pub context: Vec<Context>,
    /// Opaque pass-through.
    #[serde(default, deserialize_with = "null_as_none", skip_serializing_if = "is_absent")]
    pub forwarded_props: Option<Value>,
    /// Answers to the previous run's interrupts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resume: Vec<ResumeEntry>,
}

impl RunAgentInput {
    /// An input with no messages.
    pub fn new(thread_id: impl Into<ThreadId>, run_id: impl Into<RunId>) -> Self {
        Self {
            thread_id: thread_id.into(),
            run_id: run_id.into(),
            ..Default::default()
        }
    }

    /// Appends a message.
    pub fn with_message(mut self, message: Message) -> Self {
        self.messages.push(message);
        self
    }

    /// The text of the last user message, if any.
    pub fn last_user_text(&self) -> Option<String> {
        self.messages.iter().rev().find_map(|m| match m {
            Message::User(u) => Some(u.content.to_text()),
            _ => None,
        })
    }

    /// The front-end tool named `name`.
    pub fn tool(&self, name: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.name == name)
    }
}

// ---------------------------------------------------------------------------------------------
// Outcomes

/// A request for the consumer's input that ends a run (`outcome.type == "interrupt"`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct Interrupt {
    /// Unique within the run.
    pub id: InterruptId,
    /// Why (e.g. `"approval"`).
    pub reason: String,
    /// Human-readable text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The tool call this interrupt is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<ToolCallId>,
    /// JSON Schema of the expected resume payload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_schema: Option<JsonObject>,
    /// Expiry (ISO-8601).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// Metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<JsonObject>,
    /// The subagent that raised it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subagent_run_id: Option<SubagentRunId>,
}

impl Interrupt {
    /// An interrupt with an id and a reason.
    pub fn new(id: impl Into<InterruptId>, reason: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            reason: reason.into(),
            ..Default::default()
        }
    }

    /// Sets the human-readable message.
    pub fn with_message(mut self, message: impl Into<String>) -> Self {
        self.message = Some(message.into());
        self
    }

    /// Ties the interrupt to a tool call.
    pub fn with_tool_call(mut self, id: impl Into<ToolCallId>) -> Self {
        self.tool_call_id = Some(id.into());
        self
    }

    /// Sets the JSON Schema of the expected payload.
    pub fn with_response_schema(mut self, schema: JsonObject) -> Self {
        self.response_schema = Some(schema);
        self
    }
}

/// How a run finished (`RUN_FINISHED.outcome`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
#[non_exhaustive]
pub enum RunFinishedOutcome {
    /// Success; front-end calls still unanswered are listed.
    #[serde(rename_all = "camelCase")]
    Success {
        /// Calls the client must answer on the next run.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pending_tool_call_ids: Option<Vec<ToolCallId>>,
    },
    /// Suspended on interrupts the next run's `resume[]` must answer.
    Interrupt {
        /// At least one.
        interrupts: Vec<Interrupt>,
    },
    /// Cancelled.
    Cancelled,
}

/// How a subagent finished.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
#[non_exhaustive]
pub enum SubagentOutcome {
    /// Done.
    Success,
    /// Suspended on interrupts.
    #[serde(rename_all = "camelCase")]
    Suspended {
        /// The interrupts it waits on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        interrupt_ids: Option<Vec<InterruptId>>,
    },
}

/// Token usage of one model (`RUN_FINISHED.usage[]`). Absent is not zero.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct TokenUsage {
    /// Provider name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Model name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Input tokens (including cached).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    /// Output tokens (including reasoning).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    /// Total.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_tokens: Option<u64>,
    /// Reasoning part of the output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
    /// Cached part of the input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input_tokens: Option<u64>,
    /// Input tokens written to a cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_input_tokens: Option<u64>,
}

impl TokenUsage {
    /// `input` tokens in and `output` tokens out, the total their sum; the rest absent.
    ///
    /// ```
    /// let u = tether_agui::TokenUsage::new(10, 5).with_model("m");
    /// assert_eq!(u.total_tokens, Some(15));
    /// ```
    pub fn new(input: u64, output: u64) -> Self {
        TokenUsage {
            input_tokens: Some(input),
            output_tokens: Some(output),
            total_tokens: Some(input.saturating_add(output)),
            ..Default::default()
        }
    }

    /// The same usage, of model `model`.
    pub fn with_model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// The same usage, of provider `provider`.
    pub fn with_provider(mut self, provider: impl Into<String>) -> Self {
        self.provider = Some(provider.into());
        self
    }
}
