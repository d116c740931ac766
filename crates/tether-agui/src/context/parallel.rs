//! Interleaved (parallel) tool calls, as providers stream them.

use super::*;

/// A key naming one call of a [`ParallelToolCalls`] batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CallSlot(usize);

#[derive(Debug)]
pub(super) struct ParallelCall {
    pub(super) id: ToolCallId,
    pub(super) args: String,
    pub(super) result_message_id: MessageId,
    pub(super) open: bool,
}

/// Interleaved tool calls, the way providers stream parallel calls (START a, START b, ARGS a,
/// ARGS b, END a, END b). Every event is still verified; `Drop` ends whatever is still open.
pub struct ParallelToolCalls<'a, S: AgentState> {
    pub(super) ctx: &'a mut RunContext<S>,
    pub(super) parent: Option<MessageId>,
    pub(super) calls: Vec<ParallelCall>,
    pub(super) by_index: HashMap<u64, CallSlot>,
}

impl<S: AgentState> fmt::Debug for ParallelToolCalls<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParallelToolCalls")
            .field("calls", &self.calls)
            .finish()
    }
}

impl<S: AgentState> ParallelToolCalls<'_, S> {
    /// Opens a call with a fresh id — `TOOL_CALL_START`.
    pub fn start(&mut self, name: impl Into<String>) -> AgUiResult<CallSlot> {
        let id = self.ctx.new_tool_call_id();
        self.start_with_id(id, name)
    }

    /// Opens a call with a given id.
    pub fn start_with_id(
        &mut self,
        id: impl Into<ToolCallId>,
        name: impl Into<String>,
    ) -> AgUiResult<CallSlot> {
        let id = id.into();
        let result_message_id = self.ctx.new_message_id();
        self.ctx
            .sink
            .emit(AgUiEvent::tool_call_start(id.clone(), name, self.parent.clone()))?;
        self.calls.push(ParallelCall {
            id,
            args: String::new(),
            result_message_id,
            open: true,
        });
        Ok(CallSlot(self.calls.len() - 1))
    }

    /// The slot a provider's stream index maps to, opening the call on first sight (providers
    /// name parallel calls by index and send the id and name only in the first delta).
    pub fn slot_for_index(
        &mut self,
        index: u64,
        id: impl FnOnce() -> ToolCallId,
        name: impl FnOnce() -> String,
    ) -> AgUiResult<CallSlot> {
        if let Some(s) = self.by_index.get(&index) {
            return Ok(*s);
        }
        let slot = self.start_with_id(id(), name())?;
        self.by_index.insert(index, slot);
        Ok(slot)
    }

    pub(super) fn call(&mut self, slot: CallSlot) -> &mut ParallelCall {
        &mut self.calls[slot.0]
    }

    /// The call's id.
    pub fn id(&self, slot: CallSlot) -> &ToolCallId {
        &self.calls[slot.0].id
    }

    /// The argument text emitted so far for this call.
    pub fn raw_args(&self, slot: CallSlot) -> &str {
        &self.calls[slot.0].args
    }

    /// Parses the call's arguments.
    pub fn parse_args<T: DeserializeOwned>(&self, slot: CallSlot) -> AgUiResult<T> {
        Ok(serde_json::from_str(&self.calls[slot.0].args)?)
    }

    /// Appends argument text to one call — `TOOL_CALL_ARGS`.
    pub fn args(&mut self, slot: CallSlot, delta: impl AsRef<str>) -> AgUiResult<()> {
        let id = self.call(slot).id.clone();
        self.ctx
            .sink
            .emit(AgUiEvent::tool_call_args(id, delta.as_ref()))?;
        self.call(slot).args.push_str(delta.as_ref());
        Ok(())
    }

    /// Ends one call — `TOOL_CALL_END` (no-op if already ended).
    pub fn end(&mut self, slot: CallSlot) -> AgUiResult<()> {
        if !self.call(slot).open {
            return Ok(());
        }
        self.call(slot).open = false;
        let id = self.call(slot).id.clone();
        self.ctx.sink.emit(AgUiEvent::tool_call_end(id))
    }

    /// Ends every open call, in the order they were opened.
    pub fn end_all(&mut self) -> AgUiResult<()> {
        for i in 0..self.calls.len() {
            self.end(CallSlot(i))?;
        }
        Ok(())
    }

    /// Reports one call's result (ending it first if needed) — `TOOL_CALL_RESULT`.
    pub fn result(&mut self, slot: CallSlot, content: impl Into<Content>) -> AgUiResult<MessageId> {
        self.end(slot)?;
        let call = self.call(slot);
        let (mid, id) = (call.result_message_id.clone(), call.id.clone());
        self.ctx
            .sink
            .emit(AgUiEvent::tool_call_result(mid.clone(), id, content))?;
        Ok(mid)
    }
}

impl<S: AgentState> Drop for ParallelToolCalls<'_, S> {
    fn drop(&mut self) {
        let _ = self.end_all();
    }
}
