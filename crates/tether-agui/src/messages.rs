//! A thread's record as AG-UI messages: the one projection from tether events to the messages a
//! client shows when it reopens a thread (`GET /v1/threads/{id}/messages`, a `MESSAGES_SNAPSHOT`).
//!
//! Durable events only: user messages ([`tether::raw::USER_MESSAGE`], and
//! [`tether::raw::LEGACY_SERVE_USER_MESSAGE`] in an older `tether serve`'s records), every provider's assistant
//! messages (with the tool calls they made), tool calls a remote loop reported on their own
//! (an ACP agent's, a Managed Agents custom tool use), and tool results. Everything else
//! (usage, retries, directives, provider bookkeeping) is not a message.

use std::collections::HashSet;

use tether::{Event, EventKind, Role, raw};

use crate::types::{AssistantMessage, Content, FunctionCall, Message, ToolCall, ToolMessage};

fn call(id: &str, name: &str, arguments: String) -> ToolCall {
    ToolCall {
        id: id.into(),
        kind: "function".into(),
        function: FunctionCall {
            name: name.to_owned(),
            arguments,
        },
        encrypted_value: None,
        metadata: None,
    }
}

/// The conversation a thread's record holds, as AG-UI messages, in record order.
pub fn thread_messages(events: &[Event]) -> Vec<Message> {
    let mut out = Vec::new();
    let mut calls: HashSet<String> = HashSet::new();
    // The earlier `tether serve` recorded each user message twice: its own copy, then the
    // engine's (the texts joined) right after. The engine's copy that follows its own is skipped.
    let mut legacy_copy = false;
    for e in events.iter().filter(|e| e.is_durable()) {
        match &e.kind {
            EventKind::Message {
                message_id,
                role: Role::User,
                text,
                ..
            } if e.raw_type == raw::USER_MESSAGE || e.raw_type == raw::LEGACY_SERVE_USER_MESSAGE => {
                let legacy = e.raw_type == raw::LEGACY_SERVE_USER_MESSAGE;
                if !legacy && std::mem::take(&mut legacy_copy) {
                    continue;
                }
                legacy_copy = legacy;
                out.push(Message::user(message_id.as_str(), text.clone()));
            }
            EventKind::Message {
                message_id,
                role: Role::Assistant,
                text,
                tool_uses,
                ..
            } => {
                let tc: Vec<ToolCall> = tool_uses
                    .iter()
                    .inspect(|u| {
                        calls.insert(u.id.clone());
                    })
                    .map(|u| {
                        call(
                            &u.id,
                            &u.name,
                            u.raw_input.clone().unwrap_or_else(|| u.input.to_string()),
                        )
                    })
                    .collect();
                if text.is_empty() && tc.is_empty() {
                    continue;
                }
                out.push(Message::Assistant(AssistantMessage {
                    id: message_id.as_str().into(),
                    content: (!text.is_empty()).then(|| text.clone()),
                    tool_calls: (!tc.is_empty()).then_some(tc),
                    ..Default::default()
                }));
            }
            EventKind::ToolCallStart {
                tool_use_id, name, ..
            } if calls.insert(tool_use_id.clone()) => {
                out.push(Message::Assistant(AssistantMessage {
                    id: format!("{tool_use_id}-call").into(),
                    tool_calls: Some(vec![call(tool_use_id, name, String::new())]),
                    ..Default::default()
                }));
            }
            EventKind::ToolCall { tool_use, .. } if calls.insert(tool_use.id.clone()) => {
                let args = tool_use
                    .raw_input
                    .clone()
                    .unwrap_or_else(|| tool_use.input.to_string());
                out.push(Message::Assistant(AssistantMessage {
                    id: format!("{}-call", tool_use.id).into(),
                    tool_calls: Some(vec![call(&tool_use.id, &tool_use.name, args)]),
                    ..Default::default()
                }));
            }
            EventKind::ToolResult { result } => {
                let mut m = ToolMessage {
                    id: format!("{}-result", result.tool_use_id).into(),
                    tool_call_id: result.tool_use_id.as_str().into(),
                    content: Content::Text(result.content.clone()),
                    ..Default::default()
                };
                if result.is_error {
                    m.error = Some(result.content.clone());
                }
                out.push(Message::Tool(m));
            }
            _ => {}
        }
    }
    out
}
