//! Rebuilding a thread's local-loop history from the durable record, after a restart or a crash.
//!
//! After every request that ends with nothing pending, the server saves a checkpoint (the loop's
//! transcript and the last sequence number it covers). A later request starts from it and replays
//! the events recorded after it: user messages, model responses, tool results and directives,
//! exactly as the local loop put them in its history. What the replay ends on says how to
//! continue: tool uses not yet answered by a model response are handed back as pending (the
//! engine answers them from the tool-result memo or runs them), a user message with no model
//! response after it is sent again.

use std::collections::{HashMap, HashSet};

use async_trait::async_trait;
use serde_json::{Value, json};
use tether::{
    ChatMessage, ChatToolCall, Event, EventKind, EventStore, Input, Opened, Provider, ToolResult, ToolUse,
    TurnContext, TurnResult, local::LocalLoop,
};

/// The state key of the checkpoint.
pub(crate) const CHECKPOINT: &str = "serve.checkpoint";
/// The raw type of a user message the server recorded.
pub(crate) const USER_MESSAGE: &str = "serve.user_message";

/// A thread's history, rebuilt.
#[derive(Debug, Default)]
pub(crate) struct Rebuilt {
    /// The loop's history (with the system prompt when there is one).
    pub history: Vec<ChatMessage>,
    /// Tool uses of the last model response that no later response answered.
    pub pending: Vec<ToolUse>,
    /// A user message recorded with no model response after it: to send again.
    pub trailing_user: Option<String>,
    /// AG-UI ids of the user messages already taken.
    pub user_ids: HashSet<String>,
    /// Every durable event of the session.
    pub events: Vec<Event>,
}

impl Rebuilt {
    /// The highest sequence number stored.
    pub(crate) fn last_seq(&self) -> u64 {
        self.events.iter().filter_map(|e| e.seq).max().unwrap_or(0)
    }
}

/// The tool message the local loop adds for a result.
fn tool_message(r: &ToolResult) -> ChatMessage {
    let content = if r.is_error {
        json!({"error": r.content, "isError": true}).to_string()
    } else {
        r.content.clone()
    };
    ChatMessage::tool(&r.tool_use_id, content, r.is_error)
}

/// Rebuilds session `sid` of `store`.
pub(crate) async fn rebuild(
    store: &dyn EventStore,
    sid: &str,
    system_prompt: Option<&str>,
) -> tether::Result<Rebuilt> {
    let events = store.load(sid).await?;
    let checkpoint = store.state(sid, CHECKPOINT).await?;
    let (mut history, from_seq) = match &checkpoint {
        Some(cp) => {
            let h: Vec<ChatMessage> = serde_json::from_value(
                cp.get("transcript").cloned().unwrap_or(Value::Null),
            )
            .map_err(|e| tether::Error::Store(format!("the checkpoint of {sid} is unreadable: {e}")))?;
            (h, cp.get("seq").and_then(Value::as_u64).unwrap_or(0))
        }
        None => (
            system_prompt
                .map(|p| vec![ChatMessage::system(p)])
                .unwrap_or_default(),
            0,
        ),
    };
    let mut out = Rebuilt::default();
    for e in &events {
        if e.raw_type == USER_MESSAGE
            && let Some(id) = e.raw.get("id").and_then(Value::as_str)
        {
            out.user_ids.insert(id.to_owned());
        }
    }
    let mut batch: Vec<ChatToolCall> = Vec::new();
    let mut results: HashMap<String, ToolResult> = HashMap::new();
    let mut trailing_user = None;
    // Pushes the answered batch's tool messages, in call order.
    async fn flush(
        store: &dyn EventStore,
        sid: &str,
        batch: &mut Vec<ChatToolCall>,
        results: &mut HashMap<String, ToolResult>,
        history: &mut Vec<ChatMessage>,
    ) -> tether::Result<()> {
        for c in batch.drain(..) {
            // A result is used for its own batch only (`remove`): a model that reuses a call id in
            // a later turn must never be answered with the earlier call's result. The memo is
            // keyed by `memo_key` (id + name + arguments); answers the server recorded itself
            // (denials, front-end results) sit under the bare id.
            let mut r = match results.remove(&c.id) {
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
            // The memo stores the result under its key; the history answers the model's id.
            r.tool_use_id = c.id.clone();
            history.push(tool_message(&r));
        }
        Ok(())
    }
    for e in events.iter().filter(|e| e.seq.is_some_and(|s| s > from_seq)) {
        match (e.raw_type.as_str(), &e.kind) {
            (USER_MESSAGE, _) => {
                flush(store, sid, &mut batch, &mut results, &mut history).await?;
                let text = e
                    .raw
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                history.push(ChatMessage::user(text.clone()));
                trailing_user = Some(text);
            }
            ("local.model_response", _) => {
                flush(store, sid, &mut batch, &mut results, &mut history).await?;
                let msg: ChatMessage = serde_json::from_value(
                    e.raw.get("message").cloned().unwrap_or(Value::Null),
                )
                .map_err(|err| tether::Error::Store(format!("event {} is unreadable: {err}", e.id)))?;
                batch = msg.tool_calls.clone();
                history.push(msg);
                trailing_user = None;
            }
            ("local.duplicate_tool_call", EventKind::Directive { text, .. }) => {
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
            (_, EventKind::ToolResult { result }) => {
                results.insert(result.tool_use_id.clone(), result.clone());
            }
            ("local.directive" | "tether.reprompt", EventKind::Directive { text, .. }) => {
                flush(store, sid, &mut batch, &mut results, &mut history).await?;
                history.push(ChatMessage::user(text.clone()));
            }
            _ => {}
        }
    }
    if let Some(text) = trailing_user {
        // Sent again by the caller: the loop adds it to the history itself.
        if matches!(history.last(), Some(m) if m.role == tether::Role::User) {
            history.pop();
        }
        out.trailing_user = Some(text);
    }
    out.pending = batch.iter().map(ChatToolCall::to_tool_use).collect();
    out.history = history;
    out.events = events;
    Ok(out)
}

/// The local loop, reattached: it reports the store's session id and the tool uses the rebuilt
/// history waits on, and numbers its messages under a fresh prefix so their ids never collide
/// with those already recorded.
pub(crate) struct Reattached {
    pub inner: LocalLoop,
    pub session_id: String,
    pub pending: Vec<ToolUse>,
}

#[async_trait]
impl Provider for Reattached {
    fn name(&self) -> &str {
        Provider::name(&self.inner)
    }

    async fn open(&mut self, cx: &TurnContext) -> tether::Result<Opened> {
        let mut o = self.inner.open(cx).await?;
        o.session_id = self.session_id.clone();
        o.pending = std::mem::take(&mut self.pending);
        o.resumed = true;
        Ok(o)
    }

    async fn turn(&mut self, input: Input, cx: &TurnContext) -> tether::Result<TurnResult> {
        self.inner.turn(input, cx).await
    }

    async fn record_tool_results(&mut self, uses: &[ToolUse], results: &[ToolResult]) -> tether::Result<()> {
        self.inner.record_tool_results(uses, results).await
    }

    async fn interrupt(&mut self) -> tether::Result<()> {
        self.inner.interrupt().await
    }

    fn transcript(&self) -> Option<Value> {
        Provider::transcript(&self.inner)
    }

    async fn close(&mut self) -> tether::Result<()> {
        self.inner.close().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether::{MemoryStore, Role};

    fn response(id: &str, calls: &[(&str, &str, &str)]) -> Event {
        let msg = ChatMessage {
            tool_calls: calls
                .iter()
                .map(|(id, name, args)| ChatToolCall {
                    id: (*id).into(),
                    name: (*name).into(),
                    arguments: (*args).into(),
                })
                .collect(),
            ..ChatMessage::assistant("")
        };
        Event::new(
            id,
            "local.model_response",
            json!({"type": "local.model_response", "message": msg}),
            EventKind::Message {
                message_id: id.into(),
                role: Role::Assistant,
                text: String::new(),
                reasoning: None,
                tool_uses: Vec::new(),
            },
        )
    }

    fn result(r: &ToolResult) -> Event {
        Event::new(
            format!("tool_result:{}", r.tool_use_id),
            "tether.tool_result",
            serde_json::to_value(r).unwrap(),
            EventKind::ToolResult { result: r.clone() },
        )
    }

    fn user(text: &str) -> Event {
        Event::new(
            format!("user:{text}"),
            USER_MESSAGE,
            json!({"id": text, "text": text}),
            EventKind::Message {
                message_id: text.into(),
                role: Role::User,
                text: text.into(),
                reasoning: None,
                tool_uses: Vec::new(),
            },
        )
    }

    async fn store_with(events: Vec<Event>) -> MemoryStore {
        let store = MemoryStore::default();
        for (i, mut e) in events.into_iter().enumerate() {
            e.seq = Some(i as u64 + 1);
            store.append("s", &e).await.unwrap();
        }
        store
    }

    /// The engine memoizes a result under its memo key before it records the event: a crash in
    /// between leaves a result only the memo holds. The rebuilt history must answer the call with
    /// it, under the model's own id.
    #[tokio::test]
    async fn a_result_only_the_memo_holds_answers_its_call() {
        let store = store_with(vec![
            response("m1", &[("c1", "echo", r#"{"x":1}"#)]),
            user("next"),
        ])
        .await;
        let use_ = ChatToolCall {
            id: "c1".into(),
            name: "echo".into(),
            arguments: r#"{"x":1}"#.into(),
        }
        .to_tool_use();
        let memo = ToolResult::ok(use_.memo_key(), "from the memo");
        store.put_tool_result("s", &memo).await.unwrap();
        let rb = rebuild(&store, "s", None).await.unwrap();
        let last = rb.history.iter().rfind(|m| m.role == Role::Tool).unwrap();
        assert_eq!(last.tool_call_id.as_deref(), Some("c1"));
        assert_eq!(last.content.as_deref(), Some("from the memo"));
    }

    /// A model that reuses a call id in a later turn, for another call, must not get the first
    /// call's result: the second call is unanswered (the restart note), not "safe".
    #[tokio::test]
    async fn a_reused_call_id_is_not_answered_with_the_earlier_result() {
        let first = ToolResult::ok("dup", "safe");
        let store = store_with(vec![
            response("m1", &[("dup", "run_command", r#"{"command":"echo safe"}"#)]),
            result(&first),
            response("m2", &[("dup", "run_command", r#"{"command":"touch PWNED"}"#)]),
            user("next"),
        ])
        .await;
        let rb = rebuild(&store, "s", None).await.unwrap();
        let answers: Vec<_> = rb
            .history
            .iter()
            .filter(|m| m.role == Role::Tool)
            .map(|m| m.content.clone().unwrap_or_default())
            .collect();
        assert_eq!(answers.len(), 2, "{answers:?}");
        assert_eq!(answers[0], "safe");
        assert!(answers[1].contains("interrupted by a restart"), "{answers:?}");
    }
}
