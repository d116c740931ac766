//! The live stream equals the record: a model call retried after it had streamed part of its
//! answer is shown once, through a real session and the local loop's own retry.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use tether::local::LocalLoop;
use tether::{
    ChatMessage, ChatModel, ChatRequest, ChatResponse, DeltaSink, Error, EventKind, RecordingSleeper,
    RetryPolicy, Session, TransportKind,
};

/// Streams `first` and drops (a transient transport failure), then answers `second` whole,
/// streamed in `pieces`.
struct Flaky {
    calls: AtomicUsize,
    first: &'static str,
    second: Vec<&'static str>,
}

#[async_trait]
impl ChatModel for Flaky {
    fn name(&self) -> &str {
        "flaky"
    }

    async fn chat(&self, _req: &ChatRequest, deltas: &DeltaSink) -> tether::Result<ChatResponse> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            deltas.text(self.first).await;
            return Err(Error::transport(
                TransportKind::Closed,
                "the stream ended early",
                "test",
            ));
        }
        for p in &self.second {
            deltas.text(p).await;
        }
        Ok(ChatResponse::new(ChatMessage::assistant(self.second.concat())).with_finish_reason("stop"))
    }
}

/// Runs one prompt; returns (the text a subscriber was shown, message ids of the deltas,
/// restarts, the record's text).
async fn run(first: &'static str, second: Vec<&'static str>) -> (String, Vec<String>, usize, String) {
    let model = Flaky {
        calls: AtomicUsize::new(0),
        first,
        second,
    };
    let retry = RetryPolicy::default().with_sleeper(RecordingSleeper::default());
    let model: Arc<dyn ChatModel> = Arc::new(model);
    let mut session = Session::builder(LocalLoop::with_model(model).retry(retry))
        .open()
        .await
        .unwrap();
    let mut sub = session.sink().subscribe(1024).await;
    let result = session.send("go").await.unwrap();
    drop(session);
    let (mut shown, mut ids, mut restarts) = (String::new(), Vec::new(), 0);
    while let Some(e) = sub.recv().await {
        match e.kind {
            EventKind::TextDelta { message_id, delta } => {
                shown.push_str(&delta);
                ids.push(message_id);
            }
            EventKind::MessageRestart { .. } => {
                restarts += 1;
                shown.clear();
            }
            _ => {}
        }
    }
    ids.dedup();
    assert!(
        result
            .events
            .iter()
            .any(|e| matches!(e.kind, EventKind::Retry { .. })),
        "the call was retried"
    );
    (shown, ids, restarts, result.text)
}

#[tokio::test]
async fn a_dropped_stream_retried_with_the_same_answer_is_shown_once() {
    let (shown, ids, restarts, record) = run("partial", vec!["part", "ial after drop", " complete"]).await;
    assert_eq!(record, "partial after drop complete");
    assert_eq!(shown, record, "not `partialpartial after drop complete`");
    assert_eq!(restarts, 0);
    assert_eq!(ids.len(), 1, "one message id across the attempts: {ids:?}");
}

#[tokio::test]
async fn a_retry_with_another_answer_restarts_the_message() {
    let (shown, ids, restarts, record) = run("partial", vec!["something ", "else"]).await;
    assert_eq!(record, "something else");
    assert_eq!(shown, record);
    assert_eq!(restarts, 1);
    assert_eq!(ids.len(), 1, "{ids:?}");
}

/// A streaming provider whose stream drops mid-message: the engine reconnects
/// (`tether.reconnect`) and the provider streams the message again, from its start, then
/// records it.
struct Reconnecting {
    first: &'static str,
    again: &'static str,
    turns: u32,
}

#[async_trait]
impl tether::Provider for Reconnecting {
    fn name(&self) -> &str {
        "reconnecting"
    }

    async fn open(&mut self, _cx: &tether::TurnContext) -> tether::Result<tether::Opened> {
        Ok(tether::Opened::new("r-1"))
    }

    fn can_reconnect(&self) -> bool {
        true
    }

    async fn turn(
        &mut self,
        _input: tether::Input,
        cx: &tether::TurnContext,
    ) -> tether::Result<tether::TurnResult> {
        self.turns += 1;
        let delta = |d: &str| {
            tether::Event::new(
                "",
                "fake.delta",
                serde_json::Value::Null,
                EventKind::TextDelta {
                    message_id: "msg-1".into(),
                    delta: d.into(),
                },
            )
        };
        if self.turns == 1 {
            cx.sink.emit_live(delta(self.first)).await;
            return Err(Error::transport(
                TransportKind::Closed,
                "stream ended early",
                "fake",
            ));
        }
        for piece in self.again.split_inclusive(' ') {
            cx.sink.emit_live(delta(piece)).await;
        }
        cx.sink
            .record(
                "msg-1",
                "fake.message",
                serde_json::Value::Null,
                EventKind::Message {
                    message_id: "msg-1".into(),
                    role: tether::Role::Assistant,
                    text: self.again.into(),
                    reasoning: None,
                    tool_uses: Vec::new(),
                },
            )
            .await?;
        let mut tr = tether::TurnResult::new(tether::Terminal::EndTurn, "end_turn");
        tr.text = self.again.into();
        Ok(tr)
    }
}

async fn reconnect(first: &'static str, again: &'static str) -> (String, usize, String) {
    let config = tether::SessionConfig::default()
        .with_reconnect(RetryPolicy::default().with_sleeper(RecordingSleeper::default()));
    let mut session = Session::builder(Reconnecting {
        first,
        again,
        turns: 0,
    })
    .config(config)
    .open()
    .await
    .unwrap();
    let mut sub = session.sink().subscribe(1024).await;
    let result = session.send("go").await.unwrap();
    drop(session);
    assert!(
        result.events.iter().any(|e| e.raw_type == "tether.reconnect"),
        "the engine reconnected"
    );
    let (mut shown, mut restarts) = (String::new(), 0);
    while let Some(e) = sub.recv().await {
        match e.kind {
            EventKind::TextDelta { delta, .. } => shown.push_str(&delta),
            EventKind::MessageRestart { .. } => {
                restarts += 1;
                shown.clear();
            }
            _ => {}
        }
    }
    (shown, restarts, result.text)
}

#[tokio::test]
async fn a_dropped_stream_then_reconnect_shows_the_message_once() {
    let (shown, restarts, record) = reconnect("The answer ", "The answer is 42.").await;
    assert_eq!((shown.as_str(), restarts), ("The answer is 42.", 0));
    assert_eq!(record, "The answer is 42.");
    let (shown, restarts, record) = reconnect("The answer is 41", "The answer is 42.").await;
    assert_eq!((shown.as_str(), restarts), ("The answer is 42.", 1));
    assert_eq!(record, "The answer is 42.");
}
