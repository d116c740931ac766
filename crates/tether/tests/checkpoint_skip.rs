//! The local loop's checkpoint is saved only when the record lacks part of its history (what
//! `open` set up, a raw input, several messages sent as one, answers the engine made up): a turn
//! whose additions are all recorded (the model's response, tool results, directives, duplicate
//! calls) is not saved again. These tests prove that a resume from an older checkpoint and the
//! record after it rebuilds exactly the history the live loop had, after every kind of turn,
//! and after a kill in the middle of a tool call.

use std::sync::Arc;

use serde_json::json;
use tether::local::LocalLoop;
use tether::{
    CancellationToken, ChatMessage, EventStore, Handler, Input, MemoryStore, Role, ScriptedModel, Session,
    SessionInfo, ThreadId, ThreadStore, ToolOutput, ToolSpec, ToolUse, UserMessage,
};

fn tid(s: &str) -> ThreadId {
    ThreadId::new(s).unwrap()
}

/// `echo` answers its input's `v`, `fail` always fails, `hang` never returns.
struct Tools;

#[async_trait::async_trait]
impl Handler for Tools {
    fn tools(&self) -> Vec<ToolSpec> {
        ["echo", "fail", "hang"]
            .iter()
            .map(|n| ToolSpec::new(*n, *n, json!({"type": "object"})))
            .collect()
    }
    async fn call_tool(&self, call: &ToolUse, _info: &SessionInfo) -> ToolOutput {
        match call.name.as_str() {
            "echo" => ToolOutput::Ok(call.input["v"].as_str().unwrap_or_default().to_owned()),
            "fail" => ToolOutput::Error("bad input".into()),
            _ => std::future::pending().await,
        }
    }
}

/// A session on thread `t` of `store` whose model answers with `script`.
async fn open(store: &Arc<MemoryStore>, script: Vec<tether::ChatResponse>, max_turns: u32) -> Session {
    let model = ScriptedModel::new(script.into_iter().map(Ok).collect());
    Session::builder(LocalLoop::new(model).system_prompt("be brief"))
        .handler(Tools)
        .max_turns(max_turns)
        .thread(store.clone(), tid("t"), "agent")
        .open()
        .await
        .unwrap()
}

/// The live loop's history.
fn history(s: &Session) -> Vec<ChatMessage> {
    serde_json::from_value(s.checkpoint().expect("the local loop keeps its history")).unwrap()
}

/// The thread's saved checkpoint: the sequence number it covers, and its history's length.
async fn saved(store: &Arc<MemoryStore>) -> (u64, usize) {
    let record = store.thread(&tid("t")).await.unwrap().unwrap().record;
    let cp = store
        .state(&record, tether::thread::CHECKPOINT)
        .await
        .unwrap()
        .expect("a checkpoint");
    (
        cp["seq"].as_u64().unwrap(),
        cp["provider"].as_array().map_or(0, Vec::len),
    )
}

/// The number of the thread's last recorded event.
async fn last_seq(store: &Arc<MemoryStore>) -> u64 {
    let record = store.thread(&tid("t")).await.unwrap().unwrap().record;
    store
        .load(&record)
        .await
        .unwrap()
        .iter()
        .filter_map(|e| e.seq)
        .max()
        .unwrap_or(0)
}

/// Reopens the thread in a new session (as a new process would) and checks its rebuilt history
/// is the live one.
async fn assert_resumes_to(
    store: &Arc<MemoryStore>,
    live: &[ChatMessage],
    script: Vec<tether::ChatResponse>,
    max_turns: u32,
) -> Session {
    let s = open(store, script, max_turns).await;
    assert!(s.opened().resumed);
    assert_eq!(history(&s), live, "the resumed history is the live one");
    s
}

#[tokio::test]
async fn a_resume_after_skipped_checkpoints_rebuilds_the_same_history() {
    let store = Arc::new(MemoryStore::default());
    let go = CancellationToken::new;

    // Request 1: two calls in a turn, a duplicate call, two failures in a row (a corrective
    // directive), then an answer. Saved once: after the first turn (the system prompt `open`
    // set up is in no record).
    let mut s = open(
        &store,
        vec![
            ScriptedModel::tool_calls(&[("c1", "echo", r#"{"v":"a"}"#), ("c2", "echo", r#"{"v":"b"}"#)]),
            ScriptedModel::tool_calls(&[("c3", "echo", r#"{"v":"a"}"#)]),
            ScriptedModel::tool_calls(&[("c4", "fail", "{}")]),
            ScriptedModel::tool_calls(&[("c5", "fail", r#"{"x":1}"#)]),
            ScriptedModel::text("one"),
        ],
        8,
    )
    .await;
    let r = s
        .send_messages(vec![UserMessage::with_id("u1", "first")], go())
        .await
        .unwrap();
    assert_eq!((r.text.as_str(), r.turns), ("one", 5));
    let live = history(&s);
    let roles: Vec<Role> = live.iter().map(|m| m.role).collect();
    assert!(
        live.iter()
            .any(|m| m.content.as_deref().is_some_and(|c| c.contains("duplicate"))),
        "a duplicate call was answered in history: {live:#?}"
    );
    assert!(
        live.iter()
            .any(|m| m.role == Role::User && m.content.as_deref().is_some_and(|c| c.starts_with("STOP"))),
        "a corrective directive: {roles:?}"
    );
    let (seq1, len1) = saved(&store).await;
    assert_eq!(
        len1, 3,
        "saved after the first turn only: system, user, assistant"
    );
    assert!(seq1 < last_seq(&store).await, "later turns were not saved");
    drop(s);

    // Request 2, on the resumed thread: one message (recorded), a call, and the final turn's
    // directive. Nothing of it is saved: the record holds all of it.
    let mut s = assert_resumes_to(
        &store,
        &live,
        vec![
            ScriptedModel::tool_calls(&[("c6", "echo", r#"{"v":"c"}"#)]),
            ScriptedModel::text("two"),
        ],
        2,
    )
    .await;
    let r = s
        .send_messages(vec![UserMessage::with_id("u2", "second")], go())
        .await
        .unwrap();
    assert_eq!(r.text, "two");
    let live = history(&s);
    assert!(
        live.iter()
            .any(|m| m.content.as_deref().is_some_and(|c| c.starts_with("FINAL TURN"))),
        "the final turn's directive: {live:#?}"
    );
    assert_eq!(saved(&store).await, (seq1, len1), "request 2 saved nothing");
    drop(s);

    // Request 3: two messages at once go to the model as one, which the record holds as two:
    // that turn is saved.
    let mut s = assert_resumes_to(
        &store,
        &live,
        vec![
            ScriptedModel::tool_calls(&[("c7", "echo", r#"{"v":"d"}"#)]),
            ScriptedModel::text("three"),
        ],
        8,
    )
    .await;
    let r = s
        .send_messages(
            vec![
                UserMessage::with_id("u3", "third"),
                UserMessage::with_id("u4", "fourth"),
            ],
            go(),
        )
        .await
        .unwrap();
    assert_eq!(r.text, "three");
    let live = history(&s);
    assert!(
        live.iter()
            .any(|m| m.content.as_deref() == Some("third\n\nfourth")),
        "one message: {live:#?}"
    );
    let (seq3, _) = saved(&store).await;
    assert!(seq3 > seq1, "the joined message was saved");
    drop(s);

    // Request 4: a raw input (in no record) is saved too.
    let mut s = assert_resumes_to(&store, &live, vec![ScriptedModel::text("four")], 8).await;
    let r = s
        .send_input(Input::Raw(json!({"role": "user", "content": "a raw note"})), go())
        .await
        .unwrap();
    assert_eq!(r.text, "four");
    let live = history(&s);
    assert!(saved(&store).await.0 > seq3, "the raw input was saved");
    drop(s);

    // Request 5: killed while a call runs, after a turn that was not saved. The resumed thread
    // has the same history and waits on the call.
    let mut s = assert_resumes_to(
        &store,
        &live,
        vec![
            ScriptedModel::tool_calls(&[("c8", "echo", r#"{"v":"e"}"#)]),
            ScriptedModel::tool_calls(&[("c9", "hang", "{}")]),
        ],
        8,
    )
    .await;
    let before = saved(&store).await;
    let sent = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        s.send_messages(vec![UserMessage::with_id("u5", "fifth")], go()),
    )
    .await;
    assert!(sent.is_err(), "the tool hangs");
    assert_eq!(saved(&store).await, before, "request 5 saved nothing");
    let live = history(&s);
    assert_eq!(
        live.last()
            .map(|m| m.tool_calls.iter().map(|c| c.id.as_str()).collect::<Vec<_>>()),
        Some(vec!["c9"])
    );
    std::mem::forget(s); // a kill: nothing more is written
    let mut s = assert_resumes_to(&store, &live, vec![ScriptedModel::text("six")], 8).await;
    assert_eq!(
        s.pending_tool_uses()
            .iter()
            .map(|u| u.id.as_str())
            .collect::<Vec<_>>(),
        ["c9"],
        "the resumed thread waits on the call the kill interrupted"
    );
    s.abandon_pending_tools("the process was killed").await.unwrap();
    let r = s
        .send_messages(vec![UserMessage::with_id("u6", "sixth")], go())
        .await
        .unwrap();
    assert_eq!(r.text, "six");
    let live = history(&s);
    drop(s);
    assert_resumes_to(&store, &live, vec![], 8).await;
}
