//! [`ChatModel`]: one model call for the local loop, on a neutral OpenAI-chat-shaped contract.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::Result;
use crate::event::Role;
use crate::sink::DeltaSink;
use crate::types::{ToolSpec, ToolUse, Usage};

/// The default cap on one model response (8 MiB): its text, reasoning and tool-call arguments
/// together, as the `ChatModel` implementations accumulate them. A model that never stops is cut
/// there with [`crate::Error::ResponseTooLarge`] instead of growing the process without bound.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 8 << 20;

/// A tool call inside an assistant message: id, name and the argument text as the model wrote it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ChatToolCall {
    /// The call's id.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The argument JSON text (possibly invalid: the model wrote it).
    pub arguments: String,
}

impl ChatToolCall {
    /// A call of `name` with id `id` and the argument text `arguments`.
    pub fn new(id: impl Into<String>, name: impl Into<String>, arguments: impl Into<String>) -> Self {
        ChatToolCall {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    /// The call as a [`ToolUse`], its arguments decoded (see [`ToolUse::from_arguments`]).
    pub fn to_tool_use(&self) -> ToolUse {
        ToolUse::from_arguments(&self.id, &self.name, &self.arguments)
    }
}

/// One message of a chat history, in a provider-neutral shape.
///
/// OpenAI-compatible and Anthropic models both map to and from it. `provider_data` carries
/// anything a provider must get back unchanged in a later request (e.g. Anthropic thinking blocks
/// with their signatures), so round-trips lose nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ChatMessage {
    /// Who wrote it.
    pub role: Role,
    /// The text (`None` for an assistant message with only tool calls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Tool calls made by an assistant message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ChatToolCall>,
    /// For a tool message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For a tool message: whether it reports an error.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_error: bool,
    /// Reasoning text of an assistant message, when the model exposed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Provider-specific content to send back unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_data: Option<Value>,
}

impl ChatMessage {
    fn plain(role: Role, text: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: Some(text.into()),
            tool_calls: Vec::new(),
            tool_call_id: None,
            is_error: false,
            reasoning: None,
            provider_data: None,
        }
    }

    /// A system message.
    pub fn system(text: impl Into<String>) -> Self {
        Self::plain(Role::System, text)
    }

    /// A user message.
    pub fn user(text: impl Into<String>) -> Self {
        Self::plain(Role::User, text)
    }

    /// An assistant message with text only.
    pub fn assistant(text: impl Into<String>) -> Self {
        Self::plain(Role::Assistant, text)
    }

    /// A tool result message.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>, is_error: bool) -> Self {
        ChatMessage {
            tool_call_id: Some(tool_call_id.into()),
            is_error,
            ..Self::plain(Role::Tool, content)
        }
    }

    /// An assistant message that calls tools (with `text`, if any, before the calls).
    ///
    /// ```
    /// use tether::{ChatMessage, ChatToolCall};
    /// let m = ChatMessage::assistant_calls(None, vec![ChatToolCall::new("c1", "ls", "{}")]);
    /// assert_eq!(m.tool_calls[0].name, "ls");
    /// ```
    pub fn assistant_calls(text: Option<String>, tool_calls: Vec<ChatToolCall>) -> Self {
        ChatMessage {
            content: text,
            tool_calls,
            ..Self::plain(Role::Assistant, "")
        }
    }

    /// The same message with these tool calls.
    pub fn with_tool_calls(mut self, tool_calls: Vec<ChatToolCall>) -> Self {
        self.tool_calls = tool_calls;
        self
    }

    /// The same message with its reasoning text.
    pub fn with_reasoning(mut self, reasoning: impl Into<String>) -> Self {
        self.reasoning = Some(reasoning.into());
        self
    }

    /// The same message with provider-specific content to send back unchanged.
    pub fn with_provider_data(mut self, data: Value) -> Self {
        self.provider_data = Some(data);
        self
    }
}

/// One model call's input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ChatRequest {
    /// The model name (empty: the model's configured default).
    pub model: String,
    /// The whole history.
    pub messages: Vec<ChatMessage>,
    /// The tools the model may call.
    pub tools: Vec<ToolSpec>,
}

impl ChatRequest {
    /// A call of `model` (empty: the model's default) on `messages`, with `tools` declared.
    pub fn new(model: impl Into<String>, messages: Vec<ChatMessage>, tools: Vec<ToolSpec>) -> Self {
        ChatRequest {
            model: model.into(),
            messages,
            tools,
        }
    }
}

/// One model call's output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ChatResponse {
    /// The assistant message.
    pub message: ChatMessage,
    /// The finish reason in OpenAI's words (`stop`, `tool_calls`, `length`, `content_filter`), which
    /// the local loop reads: `stop` (or none) ends the turn, tool calls ask for action, anything
    /// else ends the run `Terminated` with that reason. Models of other APIs map their own reasons
    /// (Anthropic: `end_turn` → `stop`, `max_tokens` → `length`) and keep the original in `raw`.
    pub finish_reason: Option<String>,
    /// Usage, when reported.
    pub usage: Option<Usage>,
    /// The response as the server described it (assembled for streams), for the record.
    pub raw: Value,
}

impl ChatResponse {
    /// A response carrying `message`, with no finish reason, usage or raw form yet.
    ///
    /// ```
    /// use tether::{ChatMessage, ChatResponse, Usage};
    /// let r = ChatResponse::new(ChatMessage::assistant("hi"))
    ///     .with_finish_reason("stop")
    ///     .with_usage(Usage::new(3, 1));
    /// assert_eq!(r.finish_reason.as_deref(), Some("stop"));
    /// ```
    pub fn new(message: ChatMessage) -> Self {
        ChatResponse {
            message,
            finish_reason: None,
            usage: None,
            raw: Value::Null,
        }
    }

    /// The same response with a finish reason (OpenAI's words; see [`ChatResponse::finish_reason`]).
    pub fn with_finish_reason(mut self, reason: impl Into<String>) -> Self {
        self.finish_reason = Some(reason.into());
        self
    }

    /// The same response with its usage (a [`Usage`], or an `Option` of one).
    pub fn with_usage(mut self, usage: impl Into<Option<Usage>>) -> Self {
        self.usage = usage.into();
        self
    }

    /// The same response with its raw form, for the record.
    pub fn with_raw(mut self, raw: Value) -> Self {
        self.raw = raw;
        self
    }
}

/// One model call, streaming its deltas into a [`DeltaSink`] as it goes.
///
/// Implementations: `tether-openai` (OpenAI-compatible HTTP), `tether-anthropic` (Messages), and
/// `ScriptedModel` for tests (feature `test-util`). The loop, its guards and its retries live above this trait, in
/// [`crate::local::LocalLoop`]; an implementation makes exactly one attempt per call and reports
/// failures as typed [`crate::Error`]s the shared retry policy can classify.
#[async_trait]
pub trait ChatModel: Send + Sync + 'static {
    /// A short name for logs (`openai`, `anthropic`, ...). Tracing reports it as the model's
    /// provider (`gen_ai.provider.name`), so an implementation for a provider the OpenTelemetry
    /// GenAI conventions name uses their spelling (`openai`, `anthropic`, `aws.bedrock`, ...).
    fn name(&self) -> &str;
    /// The model requested when [`ChatRequest::model`] is empty (the configured default), for
    /// tracing; empty when unknown.
    fn default_model(&self) -> &str {
        ""
    }
    /// The URL requests go to, for tracing (`server.address`, `server.port`); `None` for a model
    /// that makes no request (in-process, scripted).
    fn endpoint(&self) -> Option<&str> {
        None
    }
    /// Makes one call.
    async fn chat(&self, req: &ChatRequest, deltas: &DeltaSink) -> Result<ChatResponse>;
}
