//! [`LocalLoop`]: the agent loop run in-process over any [`ChatModel`], with loop guards.
//!
//! The guards exist for models that follow instructions weakly:
//! - **duplicate call**: a call with the same tool name and arguments as an earlier call in the
//!   same request is not run again; it is answered in history with a "duplicate" tool message,
//!   recorded as that call's result (a `local.duplicate_tool_call` event of kind `ToolResult`).
//!   Arguments that are not valid JSON are keyed by their raw text, so two different malformed
//!   calls never collide. A turn whose calls were all duplicates continues by itself (the next
//!   model call sees the answers).
//! - **corrective**: after two consecutive errors from the same tool, a user message tells the
//!   model to change its input (`local.directive`, role `corrective`).
//! - **final turn**: on the last turn the request may take, a user message tells the model to
//!   finish now, naming the terminal tool when there is one (`local.directive`, role `final_turn`).
//!
//! Guards reset on every new user message: budgets are per request.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{Value, json};

use crate::chat::{ChatMessage, ChatModel, ChatRequest, ChatResponse};
use crate::error::{Error, Result};
use crate::event::{EventKind, Role};
use crate::provider::{Input, Opened, Provider, Resume, TurnContext};
use crate::raw;
use crate::retry::RetryPolicy;
use crate::sink::{DeltaSink, Mark, ModelCall};
use crate::types::{StopReason, Terminal, ToolUse, ToolUseResult, TurnResult};

mod rebuild;

/// The in-process agent loop, a [`Provider`] over a [`ChatModel`].
///
/// ```no_run
/// # async fn f() -> tether::Result<()> {
/// use tether::{Session, ScriptedModel, local::LocalLoop};
/// let model = ScriptedModel::new(vec![Ok(ScriptedModel::text("4"))]);
/// let provider = LocalLoop::new(model).system_prompt("You add numbers.");
/// let result = Session::builder(provider).run("2+2?").await?;
/// assert_eq!(result.text, "4");
/// # Ok(()) }
/// ```
pub struct LocalLoop {
    model: Arc<dyn ChatModel>,
    system_prompt: Option<String>,
    retry: RetryPolicy,
    session_id: String,
    /// The next model request: the model name, the history (`req.messages`) and the tools. Kept
    /// whole so a model call borrows it rather than copying the history each turn (a turn's
    /// cost then does not grow with the conversation's length).
    req: ChatRequest,
    /// The engine's [`TurnContext::tools_generation`] of the tools in `req`.
    tools_generation: Option<u64>,
    resumed: bool,
    /// Whether the history gained something the record lacks since the engine last asked
    /// ([`Provider::state_beyond_record`]): what `open` set up, a raw input, an event the sink
    /// had already.
    beyond_record: bool,
    seen: HashSet<String>,
    error_counts: HashMap<String, u32>,
}

impl std::fmt::Debug for LocalLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalLoop")
            .field("model", &self.model.name())
            .field("model_name", &self.req.model)
            .field("session_id", &self.session_id)
            .field("history_len", &self.req.messages.len())
            .finish()
    }
}

impl LocalLoop {
    /// A loop over `model`.
    pub fn new(model: impl ChatModel) -> Self {
        Self::with_model(Arc::new(model))
    }

    /// A loop over a shared model.
    pub fn with_model(model: Arc<dyn ChatModel>) -> Self {
        LocalLoop {
            model,
            system_prompt: None,
            retry: RetryPolicy::default(),
            session_id: format!("local_{:016x}", rand::random::<u64>()),
            req: ChatRequest {
                model: String::new(),
                messages: Vec::new(),
                tools: Vec::new(),
            },
            tools_generation: None,
            resumed: false,
            beyond_record: true,
            seen: HashSet::new(),
            error_counts: HashMap::new(),
        }
    }

    /// The model name sent with every request (empty: the model's own default).
    pub fn model_name(mut self, name: impl Into<String>) -> Self {
        self.req.model = name.into();
        self
    }

    /// The system prompt.
    pub fn system_prompt(mut self, prompt: impl Into<String>) -> Self {
        self.system_prompt = Some(prompt.into());
        self
    }

    /// The retry policy for model calls (default [`RetryPolicy::default`]).
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// The session id (default `local_` + 16 hex digits).
    pub fn session_id(mut self, id: impl Into<String>) -> Self {
        self.session_id = id.into();
        self
    }

    /// Continues from a transcript exported earlier (the local loop's [`crate::Session::checkpoint`]: its chat history).
    pub fn transcript(mut self, transcript: &Value) -> Result<Self> {
        let history: Vec<ChatMessage> = serde_json::from_value(transcript.clone()).map_err(|e| {
            Error::config_with(
                crate::ConfigKind::Invalid,
                "the transcript is not a list of chat messages",
                e,
            )
        })?;
        self.resumed = !history.is_empty();
        self.req.messages = history;
        Ok(self)
    }

    /// The history so far.
    pub fn history(&self) -> &[ChatMessage] {
        &self.req.messages
    }

    async fn directive(&mut self, cx: &TurnContext, role: &str, text: String) -> Result<()> {
        self.req.messages.push(ChatMessage::user(text.clone()));
        let recorded = cx
            .sink
            .record(
                "",
                raw::LOCAL_DIRECTIVE,
                json!({"type": raw::LOCAL_DIRECTIVE, "role": role, "text": text}),
                EventKind::Directive {
                    role: role.into(),
                    text,
                },
            )
            .await?;
        self.note_recorded(recorded);
        Ok(())
    }

    /// Notes whether an event holding an addition to the history was recorded (`false`: one with
    /// its id was there already, so a rebuild from the record would not see this one).
    fn note_recorded(&mut self, recorded: bool) {
        self.beyond_record |= !recorded;
    }

    async fn apply_results(&mut self, cx: &TurnContext, answered: &[ToolUseResult]) -> Result<()> {
        for ToolUseResult {
            tool_use: u,
            result: r,
            ..
        } in answered
        {
            self.req.messages.push(rebuild::tool_message(&u.id, r));
            let n = self.error_counts.entry(u.name.clone()).or_insert(0);
            if r.is_error {
                *n += 1;
            } else {
                *n = 0;
            }
        }
        let mut warned = HashSet::new();
        for ToolUseResult {
            tool_use: u,
            result: r,
            ..
        } in answered
        {
            if r.is_error
                && self.error_counts.get(&u.name).copied().unwrap_or(0) >= 2
                && warned.insert(u.name.clone())
            {
                let finish = match &cx.terminal_tool {
                    Some(t) => format!(" (or call your terminal tool `{t}` if you are done)"),
                    None => String::new(),
                };
                let text = format!(
                    "STOP — the {} tool rejected your input again: {}. Change your input before calling it again{finish}.",
                    u.name, r.content
                );
                self.directive(cx, "corrective", text).await?;
            }
        }
        Ok(())
    }

    /// The rest of a turn once the model answered: the response recorded (with its usage and
    /// any repeated calls answered), the turn's result.
    async fn answered(
        &mut self,
        cx: &TurnContext,
        message_id: String,
        resp: ChatResponse,
    ) -> Result<TurnResult> {
        // Each call decoded once: for the record, the duplicate check and the engine.
        let all_uses: Vec<ToolUse> = resp.message.tool_calls.iter().map(|c| c.to_tool_use()).collect();
        let mut uses = Vec::new();
        let mut dups = Vec::new();
        for (c, u) in resp.message.tool_calls.iter().zip(&all_uses) {
            if self.seen.insert(u.fingerprint()) {
                uses.push(u.clone());
            } else {
                dups.push(c.clone());
            }
        }
        let text = resp.message.content.clone().unwrap_or_default();
        let payload = json!({
            "type": raw::LOCAL_MODEL_RESPONSE,
            "message": resp.message,
            "finish_reason": resp.finish_reason,
            "usage": resp.usage,
            "response": resp.raw,
        });
        let kind = EventKind::Message {
            message_id: message_id.clone(),
            role: Role::Assistant,
            text: text.clone(),
            reasoning: resp.message.reasoning.clone(),
            tool_uses: all_uses,
        };
        // Into the history as it is (not a copy), before the record, as before.
        self.req.messages.push(resp.message);
        let recorded = cx
            .sink
            .record(&message_id, raw::LOCAL_MODEL_RESPONSE, payload, kind)
            .await?;
        self.note_recorded(recorded);
        if let Some(u) = &resp.usage {
            cx.sink
                .record(
                    format!("{message_id}:usage"),
                    raw::LOCAL_USAGE,
                    json!({"type": raw::LOCAL_USAGE, "usage": u}),
                    EventKind::Usage { usage: u.clone() },
                )
                .await?;
        }
        for d in &dups {
            let directive = format!(
                "You already made this exact call to `{}` with these arguments in this request. Do not repeat it; use the earlier result{}.",
                d.name,
                match &cx.terminal_tool {
                    Some(t) => format!(", or call `{t}` if you are done"),
                    None => String::new(),
                }
            );
            let answer = json!({"duplicate": true, "message": directive}).to_string();
            self.req
                .messages
                .push(ChatMessage::tool(&d.id, answer.clone(), false));
            let input = d.to_tool_use().input;
            // Recorded as the call's result (what the model was answered), so every reader of
            // the record (a front-end's projection, a resume) sees the call answered.
            let recorded = cx
                .sink
                .record(
                    format!("dup:{}", d.id),
                    raw::LOCAL_DUPLICATE_TOOL_CALL,
                    json!({"type": raw::LOCAL_DUPLICATE_TOOL_CALL, "id": d.id, "name": d.name, "input": input}),
                    EventKind::ToolResult {
                        result: crate::types::ToolResult::new(&d.id, answer, false),
                    },
                )
                .await?;
            self.note_recorded(recorded);
        }

        let finish = resp.finish_reason.clone().filter(|s| !s.is_empty());
        let stop = finish.clone().map(Value::String).unwrap_or(Value::Null);
        let terminal = if !uses.is_empty() || !dups.is_empty() {
            Terminal::RequiresAction
        } else {
            match finish.as_deref() {
                None | Some("stop") => Terminal::EndTurn,
                Some(_) => Terminal::Terminated,
            }
        };
        Ok(TurnResult {
            terminal,
            // A chat completion without a finish reason ended normally.
            stop_reason: if stop.is_null() {
                StopReason::EndTurn
            } else {
                StopReason::from_raw(stop)
            },
            text,
            tool_uses: uses,
            server_tool_uses: Vec::new(),
            usage: resp.usage,
        })
    }

    async fn call_model(&mut self, cx: &TurnContext, message_id: &str) -> Result<ChatResponse> {
        // The tools change rarely (between requests, or an MCP server's list): copied only then,
        // and not even compared while the engine declares the list it declared last time.
        let generation = cx.tools_generation();
        if (generation.is_none() || generation != self.tools_generation) && self.req.tools != cx.tools {
            self.req.tools = cx.tools.clone();
        }
        self.tools_generation = generation;
        let req = &self.req;
        let mut retries = 0u32;
        loop {
            if cx.sink.observed() {
                // The model call's start, for a tracer (a mark: not recorded, not delivered).
                let model = if req.model.is_empty() {
                    self.model.default_model()
                } else {
                    req.model.as_str()
                };
                cx.sink.mark(Mark::ModelCall(&ModelCall {
                    message_id,
                    attempt: retries + 1,
                    model,
                    provider: self.model.name(),
                    endpoint: self.model.endpoint(),
                    request: req,
                }));
            }
            // Every attempt streams under the message's one id: the sink then shows a retried
            // message once (a repeat is held back, a different attempt restarts the message).
            let deltas = DeltaSink::new(cx.sink.clone(), message_id);
            match self.model.chat(req, &deltas).await {
                Ok(r) => return Ok(r),
                Err(e) => {
                    let Some(d) = self.retry.delay_for(&e, retries) else {
                        return Err(e);
                    };
                    retries += 1;
                    tracing::warn!(attempt = retries, delay_ms = d.as_millis() as u64, error = %e, "retrying model call");
                    // Boxed: a retry is rare, and a record's future inline (1.6 KB) sized this
                    // call's future by that much for the whole of every model stream.
                    Box::pin(cx.sink.record(
                        "",
                        raw::LOCAL_RETRY,
                        json!({"type": raw::LOCAL_RETRY, "attempt": retries, "delay_ms": d.as_millis() as u64, "error": e.to_string(), "status": e.status()}),
                        EventKind::Retry {
                            attempt: retries,
                            delay_ms: d.as_millis() as u64,
                            error: e.to_string(),
                        },
                    ))
                    .await?;
                    self.retry.sleeper.sleep(d).await;
                }
            }
        }
    }
}

/// The duplicate-call key: the tool name and its arguments (see [`ToolUse::fingerprint`]):
/// canonical JSON when they parse, the raw text when they don't.
/// The loop keys each call by its decoded use's fingerprint, which is this.
#[cfg(test)]
fn call_key(name: &str, arguments: &str) -> String {
    ToolUse::from_arguments("", name, arguments).fingerprint()
}

#[async_trait]
impl Provider for LocalLoop {
    fn name(&self) -> &str {
        "local"
    }

    async fn open(&mut self, _cx: &TurnContext) -> Result<Opened> {
        // The system prompt and an imported transcript are in no record.
        self.beyond_record = true;
        if self.req.messages.is_empty()
            && let Some(p) = &self.system_prompt
        {
            self.req.messages.push(ChatMessage::system(p.clone()));
        }
        Ok(Opened {
            session_id: self.session_id.clone(),
            resumed: self.resumed,
            ..Opened::default()
        })
    }

    /// Rebuilds the history from the thread's checkpoint and the events recorded after it (see
    /// the `rebuild` module): tool calls left unanswered are pending, user messages left
    /// unanswered are sent again. Messages of this loop are numbered under its own fresh session
    /// id, so their ids never collide with those already recorded.
    async fn resume(&mut self, from: Resume<'_>, cx: &TurnContext) -> Result<Opened> {
        let rb = rebuild::rebuild(&from, self.system_prompt.as_deref(), cx).await?;
        self.req.messages = rb.history;
        self.resumed = true;
        // Rebuilt from the checkpoint and the record: the same resume rebuilds it again.
        self.beyond_record = false;
        if self.req.messages.is_empty()
            && let Some(p) = &self.system_prompt
        {
            self.req.messages.push(ChatMessage::system(p.clone()));
        }
        Ok(Opened {
            session_id: from
                .session_id
                .map(str::to_owned)
                .unwrap_or_else(|| self.session_id.clone()),
            resumed: true,
            pending: rb.pending,
            unanswered: rb.unanswered,
        })
    }

    async fn turn(&mut self, input: Input, cx: &TurnContext) -> Result<TurnResult> {
        match input {
            Input::Message(text) => {
                self.req.messages.push(ChatMessage::user(text));
                self.seen.clear();
                self.error_counts.clear();
            }
            // The awaits around the model call are boxed: inline, each sized the turn's future
            // for the whole of the model's stream (the turn's future is 2.5 KB with them, ~500
            // bytes without), and each runs while the stream's own future is gone.
            Input::ToolResults(answered) => Box::pin(self.apply_results(cx, &answered)).await?,
            Input::Continue => {}
            Input::Raw(v) => {
                let m: ChatMessage = serde_json::from_value(v).map_err(|e| {
                    Error::config_with(
                        crate::ConfigKind::Invalid,
                        "a raw input to the local loop must be a chat message",
                        e,
                    )
                })?;
                if m.role == Role::User {
                    self.seen.clear();
                    self.error_counts.clear();
                }
                self.req.messages.push(m);
                self.beyond_record = true;
            }
        }
        if cx.is_final_turn() {
            let text = match &cx.terminal_tool {
                Some(t) => format!(
                    "FINAL TURN: you are about to reach the maximum number of turns. Call `{t}` now with your final answer, and no other tool."
                ),
                None => "FINAL TURN: you are about to reach the maximum number of turns. Give your final answer now, without calling any tool.".to_owned(),
            };
            Box::pin(self.directive(cx, "final_turn", text)).await?;
        }
        // Derived from the history's length, so ids stay unique when a session is reattached
        // from its transcript (a restarted counter would collide with recorded ids).
        let message_id = format!("{}-m{}", self.session_id, self.req.messages.len());
        let resp = self.call_model(cx, &message_id).await?;

        Box::pin(self.answered(cx, message_id, resp)).await
    }

    async fn record_tool_results(&mut self, answered: &[ToolUseResult]) -> Result<()> {
        for a in answered {
            self.req
                .messages
                .push(rebuild::tool_message(&a.tool_use.id, &a.result));
        }
        Ok(())
    }

    fn checkpoint(&self) -> Option<Value> {
        serde_json::to_value(&self.req.messages).ok()
    }

    /// The history a resume rebuilds is the checkpoint's and the record's after it (see the
    /// `rebuild` module): a turn's model response, tool results, directives and duplicate calls
    /// are all recorded, so only what the record lacks needs a save.
    fn state_beyond_record(&mut self) -> bool {
        std::mem::take(&mut self.beyond_record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_arguments_never_collide() {
        assert_ne!(call_key("t", "{bad"), call_key("t", "{worse"));
        assert_eq!(
            call_key("t", r#"{"a":1,"b":2}"#),
            call_key("t", r#"{ "b":2, "a":1 }"#)
        );
        assert_eq!(call_key("t", ""), call_key("t", "{}"));
        assert_eq!(
            call_key("t", r#"{"x":{"b":[1,{"d":1,"c":2}],"a":null}}"#),
            call_key("t", r#"{"x":{"a":null,"b":[1,{"c":2,"d":1}]}}"#)
        );
        assert_ne!(call_key("t", "{}"), call_key("u", "{}"));
    }
}
