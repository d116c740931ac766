//! The RAII handles: an open message, tool call, reasoning block or step; each emits its END
//! on drop.

use super::*;

/// One open text message. `TEXT_MESSAGE_START` has gone out; `Drop` emits `TEXT_MESSAGE_END`.
pub struct MessageHandle<'a, S> {
    pub(super) sink: &'a mut Sink,
    pub(super) state: &'a mut StateManager<S>,
    pub(super) id: MessageId,
    pub(super) ended: bool,
}

impl<S> fmt::Debug for MessageHandle<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageHandle").field("id", &self.id).finish()
    }
}

impl<S> MessageHandle<'_, S> {
    /// The message id.
    pub fn id(&self) -> &MessageId {
        &self.id
    }

    /// Appends text — `TEXT_MESSAGE_CONTENT`.
    pub fn delta(&mut self, text: impl AsRef<str>) -> AgUiResult<()> {
        self.sink
            .emit(AgUiEvent::text_message_content(self.id.clone(), text.as_ref()))
    }

    /// Emits an unrelated event (state, custom, raw, ...) without closing the message.
    pub fn emit(&mut self, event: impl Into<AgUiEvent>) -> AgUiResult<()> {
        self.sink.emit(event.into())
    }

    /// Attaches the provider's opaque value to this message — `REASONING_ENCRYPTED_VALUE`.
    pub fn encrypted_value(&mut self, value: impl Into<String>) -> AgUiResult<()> {
        self.sink.emit(AgUiEvent::reasoning_encrypted_value(
            EncryptedValueSubtype::Message,
            self.id.as_str(),
            value,
        ))
    }

    /// Emits `TEXT_MESSAGE_END` and consumes the handle.
    pub fn end(mut self) -> AgUiResult<()> {
        self.ended = true;
        self.sink.emit(AgUiEvent::text_message_end(self.id.clone()))
    }
}

impl<S: AgentState> MessageHandle<'_, S> {
    state_trio!();
}

impl<S> Drop for MessageHandle<'_, S> {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.sink.emit(AgUiEvent::text_message_end(self.id.clone()));
        }
    }
}

/// One open tool call. `TOOL_CALL_START` has gone out; `Drop` emits `TOOL_CALL_END`.
///
/// Arguments stream as text because providers stream them as text; the handle keeps what it
/// emitted so [`Self::parse_args`] can hand back the finished struct:
///
/// ```
/// # use tether_agui::{RunContext, RunOptions, RunAgentInput, AgUiResult};
/// # #[derive(serde::Deserialize)] struct Query { city: String }
/// # fn main() -> AgUiResult<()> {
/// # let (mut ctx, _rx) = RunContext::<()>::new(RunAgentInput::new("t", "r"), &RunOptions::default());
/// # ctx.emit(tether_agui::AgUiEvent::run_started("t", "r"))?;
/// let mut call = ctx.tool_call("get_weather")?;
/// call.args(r#"{"city":"#)?;
/// call.args(r#""Seoul"}"#)?;
/// let query: Query = call.parse_args()?;
/// assert_eq!(query.city, "Seoul");
/// call.result(r#"{"tempC":21}"#)?; // TOOL_CALL_END then TOOL_CALL_RESULT
/// # Ok(()) }
/// ```
pub struct ToolCallHandle<'a, S> {
    pub(super) sink: &'a mut Sink,
    pub(super) state: &'a mut StateManager<S>,
    pub(super) id: ToolCallId,
    pub(super) name: String,
    pub(super) result_message_id: MessageId,
    pub(super) args: String,
    pub(super) ended: bool,
}

impl<S> fmt::Debug for ToolCallHandle<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolCallHandle")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("args", &self.args)
            .finish()
    }
}

impl<S> ToolCallHandle<'_, S> {
    /// The id every event of this call carries.
    pub fn id(&self) -> &ToolCallId {
        &self.id
    }

    /// The tool name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The id the result message will carry.
    pub fn result_message_id(&self) -> &MessageId {
        &self.result_message_id
    }

    /// Appends a fragment of the argument JSON — `TOOL_CALL_ARGS`.
    pub fn args(&mut self, delta: impl AsRef<str>) -> AgUiResult<()> {
        let delta = delta.as_ref();
        self.sink
            .emit(AgUiEvent::tool_call_args(self.id.clone(), delta))?;
        self.args.push_str(delta);
        Ok(())
    }

    /// Serializes `value` and emits it as the call's arguments in one delta.
    pub fn args_json<T: Serialize + ?Sized>(&mut self, value: &T) -> AgUiResult<()> {
        let text = serde_json::to_string(value)?;
        self.args(text)
    }

    /// The argument JSON emitted so far, unparsed.
    pub fn raw_args(&self) -> &str {
        &self.args
    }

    /// Parses everything emitted through [`Self::args`] into `T`. Fails while the arguments
    /// are still partial.
    pub fn parse_args<T: DeserializeOwned>(&self) -> AgUiResult<T> {
        Ok(serde_json::from_str(&self.args)?)
    }

    /// Attaches the provider's opaque reasoning signature for this call —
    /// `REASONING_ENCRYPTED_VALUE` with subtype `tool-call`.
    pub fn encrypted_value(&mut self, value: impl Into<String>) -> AgUiResult<()> {
        self.sink.emit(AgUiEvent::reasoning_encrypted_value(
            EncryptedValueSubtype::ToolCall,
            self.id.as_str(),
            value,
        ))
    }

    /// Emits an unrelated event without closing the call.
    pub fn emit(&mut self, event: impl Into<AgUiEvent>) -> AgUiResult<()> {
        self.sink.emit(event.into())
    }

    /// Emits `TOOL_CALL_END` and consumes the handle, leaving the call unanswered (a front-end
    /// tool: its result arrives as a message on the next request). The call is reported in
    /// `pendingToolCallIds` automatically.
    pub fn end(mut self) -> AgUiResult<()> {
        self.ended = true;
        self.sink.emit(AgUiEvent::tool_call_end(self.id.clone()))
    }

    /// Emits `TOOL_CALL_END` then `TOOL_CALL_RESULT`, and consumes the handle. Returns the id
    /// of the tool message carrying the result.
    pub fn result(mut self, content: impl Into<Content>) -> AgUiResult<MessageId> {
        self.ended = true;
        self.sink.emit(AgUiEvent::tool_call_end(self.id.clone()))?;
        self.sink.emit(AgUiEvent::tool_call_result(
            self.result_message_id.clone(),
            self.id.clone(),
            content,
        ))?;
        Ok(self.result_message_id.clone())
    }

    /// Serializes `value` and reports it as the call's result.
    pub fn result_json<T: Serialize + ?Sized>(self, value: &T) -> AgUiResult<MessageId> {
        let text = serde_json::to_string(value)?;
        self.result(text)
    }
}

impl<S: AgentState> ToolCallHandle<'_, S> {
    state_trio!();
}

impl<S> Drop for ToolCallHandle<'_, S> {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.sink.emit(AgUiEvent::tool_call_end(self.id.clone()));
        }
    }
}

/// One open reasoning block: `REASONING_START` and `REASONING_MESSAGE_START` (same id) have
/// gone out; `Drop` emits `REASONING_MESSAGE_END` then `REASONING_END`.
pub struct ReasoningHandle<'a, S> {
    pub(super) sink: &'a mut Sink,
    pub(super) state: &'a mut StateManager<S>,
    pub(super) id: MessageId,
    pub(super) ended: bool,
}

impl<S> fmt::Debug for ReasoningHandle<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReasoningHandle").field("id", &self.id).finish()
    }
}

impl<S> ReasoningHandle<'_, S> {
    /// The span and message id.
    pub fn id(&self) -> &MessageId {
        &self.id
    }

    /// Appends reasoning text — `REASONING_MESSAGE_CONTENT`.
    pub fn delta(&mut self, text: impl AsRef<str>) -> AgUiResult<()> {
        self.sink.emit(AgUiEvent::reasoning_message_content(
            self.id.clone(),
            text.as_ref(),
        ))
    }

    /// Attaches the provider's opaque reasoning value — `REASONING_ENCRYPTED_VALUE`
    /// (subtype `message`).
    pub fn encrypted_value(&mut self, value: impl Into<String>) -> AgUiResult<()> {
        self.sink.emit(AgUiEvent::reasoning_encrypted_value(
            EncryptedValueSubtype::Message,
            self.id.as_str(),
            value,
        ))
    }

    /// Emits an unrelated event without closing the block.
    pub fn emit(&mut self, event: impl Into<AgUiEvent>) -> AgUiResult<()> {
        self.sink.emit(event.into())
    }

    /// Emits `REASONING_MESSAGE_END` then `REASONING_END`, and consumes the handle.
    pub fn end(mut self) -> AgUiResult<()> {
        self.ended = true;
        let a = self.sink.emit(AgUiEvent::reasoning_message_end(self.id.clone()));
        let b = self.sink.emit(AgUiEvent::reasoning_end(self.id.clone()));
        a.and(b)
    }
}

impl<S: AgentState> ReasoningHandle<'_, S> {
    state_trio!();
}

impl<S> Drop for ReasoningHandle<'_, S> {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.sink.emit(AgUiEvent::reasoning_message_end(self.id.clone()));
            let _ = self.sink.emit(AgUiEvent::reasoning_end(self.id.clone()));
        }
    }
}

/// A running step. Derefs to the [`RunContext`] (a step is a scope); `Drop` emits
/// `STEP_FINISHED`.
pub struct StepGuard<'a, S: AgentState> {
    pub(super) ctx: &'a mut RunContext<S>,
    pub(super) name: String,
    pub(super) finished: bool,
}

impl<S: AgentState> fmt::Debug for StepGuard<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StepGuard").field("name", &self.name).finish()
    }
}

impl<S: AgentState> StepGuard<'_, S> {
    /// The step name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Emits `STEP_FINISHED` and consumes the guard.
    pub fn finish(mut self) -> AgUiResult<()> {
        self.finished = true;
        self.ctx.sink.emit(AgUiEvent::step_finished(self.name.clone()))
    }
}

impl<S: AgentState> Deref for StepGuard<'_, S> {
    type Target = RunContext<S>;
    fn deref(&self) -> &RunContext<S> {
        self.ctx
    }
}

impl<S: AgentState> DerefMut for StepGuard<'_, S> {
    fn deref_mut(&mut self) -> &mut RunContext<S> {
        self.ctx
    }
}

impl<S: AgentState> Drop for StepGuard<'_, S> {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.ctx.sink.emit(AgUiEvent::step_finished(self.name.clone()));
        }
    }
}
