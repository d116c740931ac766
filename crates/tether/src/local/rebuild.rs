//! The local loop's history, rebuilt from a thread's record (after a restart, a crash, or when a
//! server reopens a thread for each request).
//!
//! The engine checkpoints the loop's history with the sequence number it covers, after a turn
//! whose additions the record lacks (see `LocalLoop::state_beyond_record`: a turn the record
//! holds is not saved, since this rebuild replays it). A rebuild starts from that history (or from the system prompt alone) and replays the
//! events recorded after it, exactly as the loop put them in its history: user messages, model
//! responses, tool results, directives, duplicate calls. What the replay ends on says how to go on:
//! tool calls no later model response answers are pending (the engine answers them from the
//! tool-result memo, or runs them); user messages with no model response after them are sent
//! again.

use std::collections::{HashMap, HashSet};

use serde_json::{Value, json};

use crate::chat::{ChatMessage, ChatToolCall};
use crate::error::{Error, Result};
use crate::event::{EventKind, Role};
use crate::provider::{Resume, TurnContext};
use crate::raw;
use crate::types::{ToolResult, ToolUse};

/// A history, rebuilt.
#[derive(Debug, Default)]
pub(crate) struct Rebuilt {
    /// The loop's history (with the system prompt when there is one).
    pub history: Vec<ChatMessage>,
    /// Tool uses of the last model response that no later response answered.
    pub pending: Vec<ToolUse>,
    /// User messages recorded with no model response after them: to send again.
    pub unanswered: Option<String>,
}

/// The tool message the local loop adds for a result (see `LocalLoop::apply_results`).
pub(crate) fn tool_message(tool_call_id: &str, r: &ToolResult) -> ChatMessage {
    let content = if r.is_error {
        json!({"error": r.content, "isError": true}).to_string()
    } else {
        r.content.clone()
    };
    ChatMessage::tool(tool_call_id, content, r.is_error)
}

/// The tool calls of the history's last assistant message that no tool message after it answers.
fn trailing_calls(history: &[ChatMessage]) -> Vec<ChatToolCall> {
    let Some(i) = history.iter().rposition(|m| m.role == Role::Assistant) else {
        return Vec::new();
    };
    let answered: HashSet<&str> = history[i + 1..]
        .iter()
        .filter(|m| m.role == Role::Tool)
        .filter_map(|m| m.tool_call_id.as_deref())
        .collect();
    history[i]
        .tool_calls
        .iter()
        .filter(|c| !answered.contains(c.id.as_str()))
        .cloned()
        .collect()
}

/// Rebuilds the history of the thread `from` describes.
pub(crate) async fn rebuild(
    from: &Resume<'_>,
    system_prompt: Option<&str>,
    cx: &TurnContext,
) -> Result<Rebuilt> {
    let sid = cx.info().session_id.clone();
    let store = cx.sink.store().clone();
    let mut history: Vec<ChatMessage> = match from.checkpoint {
        Some(v) => serde_json::from_value(v.clone()).map_err(|e| {
            Error::cannot_resume(
                "local",
                format!("the checkpoint of session {sid} is not a local-loop history: {e}"),
            )
        })?,
        None => system_prompt
            .map(|p| vec![ChatMessage::system(p)])
            .unwrap_or_default(),
    };
    // The checkpoint is taken after each turn, before its tool calls run: they are the batch.
    let mut batch: Vec<ChatToolCall> = trailing_calls(&history);
    let mut results: HashMap<String, ToolResult> = HashMap::new();
    // Where the user messages with no model response after them start, and their texts.
    let mut trailing: Option<(usize, Vec<String>)> = None;

    // Pushes the answered batch's tool messages, in call order.
    async fn flush(
        store: &dyn crate::store::EventStore,
        sid: &str,
        batch: &mut Vec<ChatToolCall>,
        results: &mut HashMap<String, ToolResult>,
        history: &mut Vec<ChatMessage>,
    ) -> Result<()> {
        for c in batch.drain(..) {
            // A result is used for its own batch only (`remove`): a model that reuses a call id in
            // a later turn must never be answered with the earlier call's result. The memo is
            // keyed by `memo_key` (id + name + arguments); answers an application recorded
            // itself by id (a denial) sit under the bare id.
            let r = match results.remove(&c.id) {
                Some(r) => r,
                None => match store.tool_result(sid, &c.to_tool_use().memo_key()).await? {
                    Some(r) => r,
                    None => match store.tool_result(sid, &c.id).await? {
                        Some(r) => r,
                        None => ToolResult::error(
                            &c.id,
                            "the tool was interrupted by a restart; its result is unknown",
                        ),
                    },
                },
            };
            history.push(tool_message(&c.id, &r));
        }
        Ok(())
    }

    let store = store.as_ref();
    // The earlier `tether serve` recorded each user message twice: its own copy, then the
    // engine's (the texts joined) right after. The engine's copy that follows its own is skipped.
    let mut legacy_copy = false;
    for e in from.since_checkpoint() {
        match (e.raw_type.as_str(), &e.kind) {
            (raw::USER_MESSAGE | raw::LEGACY_SERVE_USER_MESSAGE, _) => {
                let legacy = e.raw_type == raw::LEGACY_SERVE_USER_MESSAGE;
                if !legacy && std::mem::take(&mut legacy_copy) {
                    continue;
                }
                legacy_copy = legacy;
                flush(store, &sid, &mut batch, &mut results, &mut history).await?;
                let text = e
                    .raw
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                match &mut trailing {
                    Some((_, texts)) => texts.push(text.clone()),
                    None => trailing = Some((history.len(), vec![text.clone()])),
                }
                history.push(ChatMessage::user(text));
            }
            (raw::LOCAL_MODEL_RESPONSE, _) => {
                flush(store, &sid, &mut batch, &mut results, &mut history).await?;
                let msg: ChatMessage = serde_json::from_value(
                    e.raw.get("message").cloned().unwrap_or(Value::Null),
                )
                .map_err(|err| Error::store_with(format_args!("event {} is unreadable", e.id), err))?;
                batch = msg.tool_calls.clone();
                history.push(msg);
                trailing = None;
            }
            (raw::LOCAL_DUPLICATE_TOOL_CALL, EventKind::ToolResult { result }) => {
                history.push(ChatMessage::tool(
                    &result.tool_use_id,
                    result.content.clone(),
                    false,
                ));
                batch.retain(|c| c.id != result.tool_use_id);
            }
            // Records written before the answer was recorded as the call's result.
            (raw::LOCAL_DUPLICATE_TOOL_CALL, EventKind::Directive { text, .. }) => {
                let id = e
                    .raw
                    .get("id")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                history.push(ChatMessage::tool(
                    &id,
                    json!({"duplicate": true, "message": text}).to_string(),
                    false,
                ));
                batch.retain(|c| c.id != id);
            }
            (raw::TOOL_RESULT, EventKind::ToolResult { result }) => {
                results.insert(result.tool_use_id.clone(), result.clone());
            }
            (raw::LOCAL_DIRECTIVE | raw::REPROMPT, EventKind::Directive { text, .. }) => {
                flush(store, &sid, &mut batch, &mut results, &mut history).await?;
                history.push(ChatMessage::user(text.clone()));
            }
            _ => {}
        }
    }
    let mut out = Rebuilt::default();
    if let Some((at, texts)) = trailing {
        // Sent again by the engine: the loop adds them (and any directive) to its history itself.
        history.truncate(at);
        out.unanswered = Some(texts.join("\n\n"));
    }
    out.pending = batch.iter().map(ChatToolCall::to_tool_use).collect();
    out.history = history;
    Ok(out)
}
