//! [`EventMapper`]: the one mapping of tether session events onto AG-UI events, used by
//! [`crate::ThreadAgent`] (and by any agent that drives a tether session itself).

use std::collections::{HashMap, HashSet};

use serde_json::json;
use tether::{EventKind, ToolUse};

use crate::context::RunContext;
use crate::error::AgUiResult;
use crate::event::{AgUiEvent, EncryptedValueSubtype, TextMessageRole};
use crate::ids::MessageId;
use crate::types::{
    AssistantMessage, Message, ReasoningMessage, RunAgentInput, TokenUsage, ToolCall, ToolMessage,
};

/// Tool calls the input's assistant messages made and no tool message answers.
fn unanswered_calls(input: &RunAgentInput) -> HashSet<String> {
    let mut asked = HashSet::new();
    let mut answered = HashSet::new();
    for m in &input.messages {
        match m {
            Message::Assistant(a) => {
                for c in a.tool_calls.iter().flatten() {
                    asked.insert(c.id.to_string());
                }
            }
            Message::Tool(t) => {
                answered.insert(t.tool_call_id.to_string());
            }
            _ => {}
        }
    }
    asked.retain(|id| !answered.contains(id));
    asked
}

/// Maps a tether session's events onto the AG-UI events of one run.
///
/// Text and reasoning messages are opened and closed around their deltas; a message whose text
/// arrived whole is sent whole, and once (text sent live after the message was recorded, as
/// providers whose messages arrive whole do, is not sent again). Each tool call is started,
/// streamed and ended once; a tool result is shown once, for a call this run showed or one the
/// input left unanswered; usage becomes the run's usage; a retry becomes a `tether.retry` custom
/// event and changes nothing else: the session's sink already shows a retried message once. When
/// the sink restarts a message ([`EventKind::MessageRestart`]: the retried call said something
/// else), its open parts are ended and a `MESSAGES_SNAPSHOT` withdraws what the client was shown
/// of it (the input's messages and this run's, with that message's text and tool calls left out
/// and its reasoning emptied); the message then streams again under its own id, so the client
/// ends with one message holding what the record keeps. [`crate::ThreadAgent`] maps its threads
/// with it; an agent that drives a tether session itself can use the same.
///
/// ```
/// use tether_agui::{EventMapper, RunAgentInput};
/// let input: RunAgentInput = serde_json::from_value(serde_json::json!({
///     "threadId": "t1", "runId": "r1", "messages": []
/// })).unwrap();
/// let mapper = EventMapper::new(&input).model("gpt-4o-mini");
/// assert!(!mapper.usage_seen());
/// ```
#[derive(Debug, Default)]
pub struct EventMapper {
    /// The text message open now: the session's message id, and the id it goes out under.
    text: Option<(String, MessageId)>,
    reasoning: Option<MessageId>,
    calls_open: HashSet<String>,
    calls_started: HashSet<String>,
    texts_started: HashSet<String>,
    streamed_text: HashSet<String>,
    streamed_reasoning: HashSet<String>,
    /// Session messages whose durable record was mapped.
    recorded: HashSet<String>,
    /// The text messages each session message went out as.
    texts_of: HashMap<String, Vec<MessageId>>,
    /// The tool calls each session message made.
    calls_of: HashMap<String, Vec<String>>,
    mirror: Mirror,
    answerable: HashSet<String>,
    answered: HashSet<String>,
    usage_seen: bool,
    model: Option<String>,
}

fn reasoning_id(message_id: &str) -> MessageId {
    MessageId::new(format!("{message_id}-reasoning"))
}

/// What the client holds of this run's messages: the events sent so far, folded the way
/// `@ag-ui/client` folds them. A `MESSAGES_SNAPSHOT` replaces the client's whole list, so the one
/// that withdraws a restarted message must list everything else as the client has it.
#[derive(Debug, Default)]
struct Mirror {
    messages: Vec<Message>,
}

impl Mirror {
    fn find(&mut self, id: &str) -> Option<&mut Message> {
        self.messages.iter_mut().rev().find(|m| m.id().as_str() == id)
    }

    fn call(&mut self, id: &str) -> Option<&mut ToolCall> {
        self.messages.iter_mut().rev().find_map(|m| match m {
            Message::Assistant(a) => a.tool_calls.iter_mut().flatten().find(|c| c.id.as_str() == id),
            _ => None,
        })
    }

    fn apply(&mut self, ev: &AgUiEvent) {
        match ev {
            AgUiEvent::TextMessageStart(e) if self.find(&e.message_id).is_none() => {
                self.messages.push(Message::Assistant(AssistantMessage {
                    id: e.message_id.clone(),
                    content: Some(String::new()),
                    ..Default::default()
                }));
            }
            AgUiEvent::TextMessageContent(e) => {
                if let Some(Message::Assistant(a)) = self.find(&e.message_id) {
                    a.content.get_or_insert_with(String::new).push_str(&e.delta);
                }
            }
            AgUiEvent::ReasoningMessageStart(e) if self.find(&e.message_id).is_none() => {
                self.messages.push(Message::Reasoning(ReasoningMessage {
                    id: e.message_id.clone(),
                    ..Default::default()
                }));
            }
            AgUiEvent::ReasoningMessageContent(e) => {
                if let Some(Message::Reasoning(r)) = self.find(&e.message_id) {
                    r.content.push_str(&e.delta);
                }
            }
            AgUiEvent::ReasoningEncryptedValue(e) => match e.subtype {
                EncryptedValueSubtype::ToolCall => {
                    if let Some(c) = self.call(&e.entity_id) {
                        c.encrypted_value = Some(e.encrypted_value.clone());
                    }
                }
                EncryptedValueSubtype::Message => match self.find(&e.entity_id) {
                    Some(Message::Assistant(a)) => a.encrypted_value = Some(e.encrypted_value.clone()),
                    Some(Message::Reasoning(r)) => r.encrypted_value = Some(e.encrypted_value.clone()),
                    _ => {}
                },
            },
            AgUiEvent::ToolCallStart(e) if self.call(&e.tool_call_id).is_none() => {
                let call = ToolCall::new(e.tool_call_id.clone(), e.tool_call_name.clone(), "");
                // As the client does: under the parent when it is an assistant message, else in
                // an assistant message of its own.
                let parent = e.parent_message_id.as_ref();
                if let Some(p) = parent
                    && let Some(Message::Assistant(a)) = self.find(p)
                {
                    a.tool_calls.get_or_insert_with(Vec::new).push(call);
                    return;
                }
                let id = match parent {
                    Some(p) if self.find(p).is_none() => p.clone(),
                    _ => MessageId::new(e.tool_call_id.as_str()),
                };
                self.messages.push(Message::Assistant(AssistantMessage {
                    id,
                    tool_calls: Some(vec![call]),
                    ..Default::default()
                }));
            }
            AgUiEvent::ToolCallArgs(e) => {
                if let Some(c) = self.call(&e.tool_call_id) {
                    c.function.arguments.push_str(&e.delta);
                }
            }
            AgUiEvent::ToolCallResult(e) => self.messages.push(Message::Tool(ToolMessage {
                id: e.message_id.clone(),
                content: e.content.clone(),
                tool_call_id: e.tool_call_id.clone(),
                ..Default::default()
            })),
            _ => {}
        }
    }
}

impl EventMapper {
    /// A mapper for the run of `input` (whose unanswered tool calls it may show results of).
    pub fn new(input: &RunAgentInput) -> Self {
        EventMapper {
            answerable: unanswered_calls(input),
            ..Default::default()
        }
    }

    /// The model named on the usage the run reports.
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// Whether a usage event was mapped (the run's usage is then reported; a caller adding the
    /// session's total as well would count it twice).
    pub fn usage_seen(&self) -> bool {
        self.usage_seen
    }

    /// Whether this run showed the tool call, or the input left it unanswered: the calls whose
    /// results and approvals belong to this run.
    pub fn knows_call(&self, tool_use_id: &str) -> bool {
        self.calls_started.contains(tool_use_id) || self.answerable.contains(tool_use_id)
    }

    /// Maps one session event (and nothing for kinds AG-UI has no event for).
    pub fn map<S: crate::AgentState>(
        &mut self,
        ctx: &mut RunContext<S>,
        ev: &tether::Event,
    ) -> AgUiResult<()> {
        self.on_event(ctx, ev)
    }

    /// Ends whatever is open: the reasoning and text messages, and tool calls not yet ended.
    pub fn close<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>) -> AgUiResult<()> {
        self.close_all(ctx)
    }

    /// Emits an event and folds it into what the client holds.
    fn send<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>, ev: AgUiEvent) -> AgUiResult<()> {
        self.mirror.apply(&ev);
        ctx.emit(ev)
    }

    fn close_text<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>) -> AgUiResult<()> {
        if let Some((_, id)) = self.text.take() {
            self.send(ctx, AgUiEvent::text_message_end(id))?;
        }
        Ok(())
    }

    fn close_reasoning<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>) -> AgUiResult<()> {
        if let Some(id) = self.reasoning.take() {
            self.send(ctx, AgUiEvent::reasoning_message_end(id.clone()))?;
            self.send(ctx, AgUiEvent::reasoning_end(id))?;
        }
        Ok(())
    }

    fn close_all<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>) -> AgUiResult<()> {
        self.close_reasoning(ctx)?;
        self.close_text(ctx)?;
        let mut open: Vec<String> = self.calls_open.drain().collect();
        open.sort();
        for id in open {
            self.send(ctx, AgUiEvent::tool_call_end(id))?;
        }
        Ok(())
    }

    fn text_delta<S: crate::AgentState>(
        &mut self,
        ctx: &mut RunContext<S>,
        message_id: &str,
        delta: &str,
    ) -> AgUiResult<()> {
        if delta.is_empty() {
            return Ok(());
        }
        self.close_reasoning(ctx)?;
        let id = match &self.text {
            Some((source, id)) if source == message_id => id.clone(),
            _ => {
                self.close_text(ctx)?;
                let id = if self.texts_started.insert(message_id.to_owned()) {
                    MessageId::new(message_id)
                } else {
                    MessageId::new(format!("{message_id}-{}", self.texts_started.len()))
                };
                self.send(
                    ctx,
                    AgUiEvent::text_message_start(id.clone(), TextMessageRole::Assistant),
                )?;
                self.streamed_text.insert(message_id.to_owned());
                self.texts_of
                    .entry(message_id.to_owned())
                    .or_default()
                    .push(id.clone());
                self.text = Some((message_id.to_owned(), id.clone()));
                id
            }
        };
        self.send(ctx, AgUiEvent::text_message_content(id, delta))
    }

    fn reasoning_delta<S: crate::AgentState>(
        &mut self,
        ctx: &mut RunContext<S>,
        message_id: &str,
        delta: &str,
    ) -> AgUiResult<()> {
        if delta.is_empty() {
            return Ok(());
        }
        let rid = reasoning_id(message_id);
        if self.reasoning.as_ref() != Some(&rid) {
            self.close_reasoning(ctx)?;
            self.close_text(ctx)?;
            self.send(ctx, AgUiEvent::reasoning_start(rid.clone()))?;
            self.send(ctx, AgUiEvent::reasoning_message_start(rid.clone()))?;
            self.reasoning = Some(rid.clone());
        }
        self.streamed_reasoning.insert(message_id.to_owned());
        self.send(ctx, AgUiEvent::reasoning_message_content(rid, delta))
    }

    fn call_start<S: crate::AgentState>(
        &mut self,
        ctx: &mut RunContext<S>,
        id: &str,
        name: &str,
        message_id: Option<&str>,
    ) -> AgUiResult<bool> {
        if !self.calls_started.insert(id.to_owned()) {
            return Ok(false);
        }
        self.close_reasoning(ctx)?;
        let owner = message_id.or_else(|| self.text.as_ref().map(|(source, _)| source.as_str()));
        if let Some(owner) = owner {
            self.calls_of
                .entry(owner.to_owned())
                .or_default()
                .push(id.to_owned());
        }
        let parent = message_id
            .map(MessageId::new)
            .or_else(|| self.text.as_ref().map(|(_, id)| id.clone()));
        self.close_text(ctx)?;
        self.send(ctx, AgUiEvent::tool_call_start(id, name, parent))?;
        self.calls_open.insert(id.to_owned());
        Ok(true)
    }

    fn whole_call<S: crate::AgentState>(
        &mut self,
        ctx: &mut RunContext<S>,
        call: &ToolUse,
        message_id: Option<&str>,
    ) -> AgUiResult<()> {
        if self.call_start(ctx, &call.id, &call.name, message_id)? {
            let args = call.raw_input.clone().unwrap_or_else(|| call.input.to_string());
            if !args.is_empty() {
                self.send(ctx, AgUiEvent::tool_call_args(call.id.as_str(), args))?;
            }
        } else if self.calls_open.contains(&call.id) {
            // Started and still open: the arguments go on from what the client holds (a relay
            // that got the call's record before the rest of its live arguments).
            let args = call.raw_input.clone().unwrap_or_else(|| call.input.to_string());
            let shown = self
                .mirror
                .call(&call.id)
                .map(|c| c.function.arguments.len())
                .unwrap_or(0);
            if let Some(rest) = args.get(shown..)
                && !rest.is_empty()
                && self
                    .mirror
                    .call(&call.id)
                    .is_some_and(|c| args.starts_with(c.function.arguments.as_str()))
            {
                let rest = rest.to_owned();
                self.send(ctx, AgUiEvent::tool_call_args(call.id.as_str(), rest))?;
            }
        }
        if self.calls_open.remove(&call.id) {
            self.send(ctx, AgUiEvent::tool_call_end(call.id.as_str()))?;
        }
        Ok(())
    }

    /// `message_id`'s text as the client holds it (the text messages it went out as, in order).
    fn shown_text(&self, message_id: &str) -> String {
        let Some(ids) = self.texts_of.get(message_id) else {
            return String::new();
        };
        let mut out = String::new();
        for id in ids {
            if let Some(Message::Assistant(a)) = self.mirror.messages.iter().find(|m| m.id() == id)
                && let Some(c) = &a.content
            {
                out.push_str(c);
            }
        }
        out
    }

    /// The sink restarted `message_id`: end its open parts, withdraw what the client holds of it
    /// with a snapshot, and forget it, so it streams again under its own id.
    fn restart<S: crate::AgentState>(&mut self, ctx: &mut RunContext<S>, message_id: &str) -> AgUiResult<()> {
        let rid = reasoning_id(message_id);
        let texts = self.texts_of.remove(message_id).unwrap_or_default();
        let calls = self.calls_of.remove(message_id).unwrap_or_default();
        let reasoned = self.streamed_reasoning.remove(message_id);
        if texts.is_empty() && calls.is_empty() && !reasoned {
            return Ok(()); // nothing of it was shown in this run
        }
        if self.reasoning.as_ref() == Some(&rid) {
            self.close_reasoning(ctx)?;
        }
        if self.text.as_ref().is_some_and(|(source, _)| source == message_id) {
            self.close_text(ctx)?;
        }
        let mut open: Vec<&String> = calls.iter().filter(|c| self.calls_open.contains(*c)).collect();
        open.sort();
        for id in open {
            self.calls_open.remove(id);
            self.send(ctx, AgUiEvent::tool_call_end(id.as_str()))?;
        }
        // What the client holds, less the message: its text messages and calls left out (the
        // client drops what a snapshot does not list), its reasoning emptied (a snapshot that
        // lists no reasoning message keeps every reasoning message the client has).
        self.mirror.messages.retain(|m| !texts.contains(m.id()));
        for m in &mut self.mirror.messages {
            match m {
                Message::Assistant(a) => {
                    if let Some(tc) = &mut a.tool_calls {
                        tc.retain(|c| !calls.iter().any(|x| x == c.id.as_str()));
                    }
                }
                Message::Reasoning(r) if r.id == rid => {
                    r.content.clear();
                    r.encrypted_value = None;
                }
                _ => {}
            }
        }
        // A message that held only the withdrawn calls goes too.
        self.mirror.messages.retain(|m| match m {
            Message::Assistant(a) => {
                a.content.is_some() || a.tool_calls.as_ref().is_some_and(|c| !c.is_empty())
            }
            _ => true,
        });
        let mut snapshot: Vec<Message> = ctx
            .input()
            .messages
            .iter()
            .filter(|m| !matches!(m, Message::Activity(_)))
            .filter(|m| !self.mirror.messages.iter().any(|x| x.id() == m.id()))
            .cloned()
            .collect();
        snapshot.extend(self.mirror.messages.iter().cloned());
        ctx.emit(AgUiEvent::messages_snapshot(snapshot))?;
        self.texts_started.remove(message_id);
        self.streamed_text.remove(message_id);
        for c in &calls {
            self.calls_started.remove(c);
        }
        Ok(())
    }

    fn on_event<S: crate::AgentState>(
        &mut self,
        ctx: &mut RunContext<S>,
        ev: &tether::Event,
    ) -> AgUiResult<()> {
        match &ev.kind {
            // Live text of a message already recorded (and so already sent whole) is not sent again.
            EventKind::TextDelta { message_id, .. } | EventKind::ReasoningDelta { message_id, .. }
                if self.recorded.contains(message_id) => {}
            EventKind::TextDelta { message_id, delta } => {
                self.text_delta(ctx, message_id, delta)?;
            }
            EventKind::ReasoningDelta { message_id, delta } => {
                self.reasoning_delta(ctx, message_id, delta)?;
            }
            EventKind::ReasoningSignature { message_id, value } => {
                self.send(
                    ctx,
                    AgUiEvent::reasoning_encrypted_value(
                        EncryptedValueSubtype::Message,
                        reasoning_id(message_id).into_string(),
                        value.clone(),
                    ),
                )?;
            }
            EventKind::ToolCallStart {
                tool_use_id,
                name,
                message_id,
            } => {
                self.call_start(ctx, tool_use_id, name, message_id.as_deref())?;
            }
            EventKind::ToolCallArgs { tool_use_id, delta }
                if self.calls_open.contains(tool_use_id) && !delta.is_empty() =>
            {
                self.send(
                    ctx,
                    AgUiEvent::tool_call_args(tool_use_id.as_str(), delta.as_str()),
                )?;
            }
            EventKind::ToolCallEnd { tool_use_id } if self.calls_open.remove(tool_use_id) => {
                self.send(ctx, AgUiEvent::tool_call_end(tool_use_id.as_str()))?;
            }
            EventKind::ToolCall { tool_use, message_id } => {
                self.whole_call(ctx, tool_use, message_id.as_deref())?;
            }
            EventKind::ToolResult { result } => {
                let id = &result.tool_use_id;
                if self.calls_open.remove(id) {
                    self.send(ctx, AgUiEvent::tool_call_end(id.as_str()))?;
                }
                let known = self.calls_started.contains(id) || self.answerable.contains(id);
                if known && self.answered.insert(id.clone()) {
                    self.close_reasoning(ctx)?;
                    self.close_text(ctx)?;
                    self.send(
                        ctx,
                        AgUiEvent::tool_call_result(
                            format!("{id}-result"),
                            id.as_str(),
                            result.content.clone(),
                        ),
                    )?;
                }
            }
            EventKind::Message {
                message_id,
                role: tether::Role::Assistant,
                text,
                reasoning,
                tool_uses,
            } => {
                // The rest of a message whose live text the client got the beginning of (the
                // record's message reached a relay before the rest of the live text did): sent on
                // from where the client is, so every character arrives once.
                let mut rest = None;
                if self.streamed_text.contains(message_id) {
                    let shown = self.shown_text(message_id);
                    if shown.len() < text.len() {
                        match text.strip_prefix(shown.as_str()) {
                            Some(r) => rest = Some(r),
                            // What the client holds is not the beginning of the message (a
                            // relay that began following the turn mid-message): withdraw it and
                            // send the message whole.
                            None => self.restart(ctx, message_id)?,
                        }
                    }
                }
                if let Some(r) = reasoning
                    && !self.streamed_reasoning.contains(message_id)
                {
                    self.reasoning_delta(ctx, message_id, r)?;
                }
                self.close_reasoning(ctx)?;
                if let Some(r) = rest {
                    self.text_delta(ctx, message_id, r)?;
                } else if !self.streamed_text.contains(message_id) {
                    self.text_delta(ctx, message_id, text)?;
                }
                for u in tool_uses {
                    self.whole_call(ctx, u, Some(message_id))?;
                }
                self.close_text(ctx)?;
                self.recorded.insert(message_id.clone());
            }
            EventKind::MessageRestart { message_id } => self.restart(ctx, message_id)?,
            EventKind::Usage { usage } => {
                self.usage_seen = true;
                ctx.add_usage(TokenUsage {
                    model: self.model.clone(),
                    input_tokens: Some(usage.input_tokens),
                    output_tokens: Some(usage.output_tokens),
                    total_tokens: Some(usage.total()),
                    cached_input_tokens: (usage.cache_read_tokens > 0).then_some(usage.cache_read_tokens),
                    ..Default::default()
                });
            }
            EventKind::Retry {
                attempt,
                delay_ms,
                error,
            } => {
                // Shown for what it is; what the call streams again the sink shows once.
                ctx.emit(AgUiEvent::custom(
                    "tether.retry",
                    json!({"attempt": attempt, "delayMs": delay_ms, "error": error}),
                ))?;
            }
            _ => {}
        }
        Ok(())
    }
}
