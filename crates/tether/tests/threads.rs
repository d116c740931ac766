//! Threads in the core: a thread is claimed for an agent, opened on a new provider session or
//! resumed from its record and checkpoint, and takes user messages once by their client ids.
//! The local loop's resume rebuilds its history from the record (the crash cases are staged by
//! writing the record a killed process would have left).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::{Value, json};
use tether::local::LocalLoop;
use tether::{
    CancellationToken, ChatMessage, ChatToolCall, Error, Event, EventKind, EventStore, Handler, Input,
    MemoryStore, Opened, Provider, Role, ScriptedModel, Session, SessionInfo, Terminal, ThreadId,
    ThreadStore, ToolOutput, ToolResult, ToolSpec, ToolUse, TurnContext, TurnResult, UserMessage, Waiting,
    raw,
};

fn tid(s: &str) -> ThreadId {
    ThreadId::new(s).unwrap()
}

/// A handler whose `touch` tool counts its runs and needs approval when its input says so.
#[derive(Default)]
struct Touch {
    runs: AtomicU32,
}

#[async_trait::async_trait]
impl Handler for Touch {
    fn tools(&self) -> Vec<ToolSpec> {
        vec![ToolSpec::new("touch", "touch a file", json!({"type": "object"}))]
    }
    fn needs_approval(&self, call: &ToolUse) -> Option<String> {
        (call.input["ask"] == true).then(|| format!("touch {}", call.input["file"]))
    }
    async fn call_tool(&self, call: &ToolUse, _info: &SessionInfo) -> ToolOutput {
        self.runs.fetch_add(1, Ordering::SeqCst);
        ToolOutput::Ok(format!("touched {}", call.input["file"]))
    }
}

fn session(
    store: &Arc<MemoryStore>,
    thread: &str,
    model: &Arc<ScriptedModel>,
    handler: &Arc<Touch>,
) -> tether::SessionBuilder {
    let m: Arc<dyn tether::ChatModel> = model.clone();
    Session::builder(LocalLoop::with_model(m).system_prompt("be brief"))
        .handler_arc(handler.clone())
        .thread(store.clone(), tid(thread), "agent-a")
        .title("first")
}

fn assert_gapless(events: &[Event]) {
    let mut ids = std::collections::HashSet::new();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(
            e.seq,
            Some(i as u64 + 1),
            "gapless numbering at {}: {events:#?}",
            e.id
        );
        assert!(ids.insert(e.id.clone()), "duplicate event id {}", e.id);
    }
}

#[tokio::test]
async fn a_thread_is_claimed_opened_and_resumed_by_a_new_session() {
    let store = Arc::new(MemoryStore::default());
    let handler = Arc::new(Touch::default());
    let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("one"))]));
    let mut s = session(&store, "t1", &model, &handler).open().await.unwrap();
    let r = s
        .send_messages(
            vec![UserMessage::with_id("u1", "hello")],
            CancellationToken::new(),
        )
        .await
        .unwrap();
    assert_eq!(r.text, "one");
    let thread = store.thread(&tid("t1")).await.unwrap().unwrap();
    assert_eq!(
        (thread.agent.as_str(), thread.provider.as_str()),
        ("agent-a", "local")
    );
    assert_eq!(
        s.info().session_id,
        thread.record,
        "the session's id is the thread's record key"
    );
    assert!(thread.provider_session.is_some());
    drop(s);

    // A new process: a new loop over the same store continues the conversation.
    let model2 = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("two"))]));
    let mut s = session(&store, "t1", &model2, &handler).open().await.unwrap();
    assert!(s.opened().resumed);
    assert!(s.knows_message("u1").await, "the first message is in the record");
    let r = s
        .send_messages(
            vec![
                UserMessage::with_id("u1", "hello"),
                UserMessage::with_id("u2", "again"),
            ],
            CancellationToken::new(),
        )
        .await
        .unwrap();
    assert_eq!(r.text, "two");
    let sent = &model2.requests()[0].messages;
    let roles: Vec<(Role, Option<&str>)> = sent.iter().map(|m| (m.role, m.content.as_deref())).collect();
    assert_eq!(
        roles,
        [
            (Role::System, Some("be brief")),
            (Role::User, Some("hello")),
            (Role::Assistant, Some("one")),
            (Role::User, Some("again")),
        ],
        "the rebuilt history, and the resent u1 not sent again"
    );
    let all = store.load(&thread.record).await.unwrap();
    assert_gapless(&all);
    let users: Vec<&str> = all
        .iter()
        .filter(|e| e.raw_type == raw::USER_MESSAGE)
        .map(|e| e.id.as_str())
        .collect();
    assert_eq!(
        users,
        ["user:u1", "user:u2"],
        "each user message recorded once, by its id"
    );

    // Nothing new: the request does nothing.
    let r = s
        .send_messages(
            vec![UserMessage::with_id("u2", "again")],
            CancellationToken::new(),
        )
        .await
        .unwrap();
    assert_eq!(r.stop_reason, tether::StopReason::Idle);
    assert_eq!(store.load(&thread.record).await.unwrap().len(), all.len());
}

#[tokio::test]
async fn a_thread_of_another_agent_is_refused_with_a_typed_error() {
    let store = Arc::new(MemoryStore::default());
    let handler = Arc::new(Touch::default());
    let model = Arc::new(ScriptedModel::new(vec![]));
    session(&store, "t1", &model, &handler).open().await.unwrap();
    let m: Arc<dyn tether::ChatModel> = model.clone();
    let e = Session::builder(LocalLoop::with_model(m))
        .thread(store.clone(), tid("t1"), "agent-b")
        .open()
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::ThreadTaken { agent, .. } if agent == "agent-a"),
        "{e}"
    );
    assert_eq!(e.code(), "thread_taken");
}

/// A provider that cannot resume (the trait's default).
struct NoResume;

#[async_trait::async_trait]
impl Provider for NoResume {
    fn name(&self) -> &str {
        "noresume"
    }
    async fn open(&mut self, _cx: &TurnContext) -> tether::Result<Opened> {
        Ok(Opened::new("nr-1"))
    }
    async fn turn(&mut self, _input: Input, _cx: &TurnContext) -> tether::Result<TurnResult> {
        let mut t = TurnResult::new(Terminal::EndTurn, "stop");
        t.text = "ok".into();
        Ok(t)
    }
}

#[tokio::test]
async fn a_provider_that_cannot_resume_says_so_and_the_record_is_untouched() {
    let store = Arc::new(MemoryStore::default());
    let mut s = Session::builder(NoResume)
        .thread(store.clone(), tid("t"), "a")
        .open()
        .await
        .unwrap();
    s.send("hi").await.unwrap();
    let record = store.thread(&tid("t")).await.unwrap().unwrap().record;
    let before = store.load(&record).await.unwrap();
    let e = Session::builder(NoResume)
        .thread(store.clone(), tid("t"), "a")
        .open()
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::CannotResume { provider, .. } if provider == "noresume"),
        "{e}"
    );
    assert_eq!(e.code(), "cannot_resume");
    assert_eq!(
        store.load(&record).await.unwrap(),
        before,
        "nothing lost, nothing added"
    );
}

#[tokio::test]
async fn approvals_pause_the_call_and_run_it_once_when_given() {
    let store = Arc::new(MemoryStore::default());
    let handler = Arc::new(Touch::default());
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[(
            "c1",
            "touch",
            r#"{"file":"a","ask":true}"#,
        )])),
        Ok(ScriptedModel::text("done")),
    ]));
    let mut s = session(&store, "t", &model, &handler).open().await.unwrap();
    let r = s.send("touch a").await.unwrap();
    assert_eq!(r.terminal, Terminal::RequiresAction);
    let pending = s.pending();
    assert_eq!(pending.len(), 1);
    assert_eq!(
        pending[0].waiting,
        Waiting::Approval {
            summary: "touch \"a\"".into()
        }
    );
    assert_eq!(handler.runs.load(Ordering::SeqCst), 0, "not run before approval");
    // Resuming without an approval keeps it waiting.
    let r = s.resume(CancellationToken::new()).await.unwrap();
    assert_eq!(r.pending_tool_uses.len(), 1);
    assert!(!s.approve("nope").await);
    assert!(s.approve("c1").await);
    let r = s.resume(CancellationToken::new()).await.unwrap();
    assert_eq!(r.text, "done");
    assert_eq!(handler.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_denial_recorded_from_outside_answers_the_call_in_a_new_process() {
    let store = Arc::new(MemoryStore::default());
    let handler = Arc::new(Touch::default());
    let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::tool_calls(&[(
        "c1",
        "touch",
        r#"{"file":"a","ask":true}"#,
    )]))]));
    let mut s = session(&store, "t", &model, &handler).open().await.unwrap();
    s.send("touch a").await.unwrap();
    drop(s);
    // The next request comes to a new process: the rebuilt thread waits on the same call.
    let model2 = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text(
        "ok, not touching",
    ))]));
    let mut s = session(&store, "t", &model2, &handler).open().await.unwrap();
    assert_eq!(s.pending_tool_uses().len(), 1);
    assert!(
        s.answer_tool_use(ToolResult::error("c1", "the user denied this action"))
            .await
            .unwrap()
    );
    let r = s.resume(CancellationToken::new()).await.unwrap();
    assert_eq!(r.text, "ok, not touching");
    assert_eq!(handler.runs.load(Ordering::SeqCst), 0);
    let sent = &model2.requests()[0].messages;
    let tool = sent.iter().find(|m| m.role == Role::Tool).unwrap();
    assert!(tool.content.as_deref().unwrap().contains("denied"), "{tool:?}");
    let record = store.thread(&tid("t")).await.unwrap().unwrap().record;
    let all = store.load(&record).await.unwrap();
    assert_gapless(&all);
    assert_eq!(
        all.iter()
            .filter(|e| matches!(e.kind, EventKind::ToolResult { .. }))
            .count(),
        1,
        "one result recorded"
    );
}

/// Stages the record a killed process left: the thread, a user message, a model response asking
/// for tools, and whatever `extra` adds.
async fn staged(store: &Arc<MemoryStore>, thread: &str, calls: &[(&str, &str, &str)]) -> String {
    let record = match store
        .claim_thread(&tid(thread), "agent-a", "rec-1", "")
        .await
        .unwrap()
    {
        tether::Claim::Claimed { thread, .. } => thread.record,
        other => panic!("{other:?}"),
    };
    store
        .set_provider_session(&tid(thread), "local", "local_dead")
        .await
        .unwrap();
    let msg = ChatMessage::assistant("").with_tool_calls(
        calls
            .iter()
            .map(|(id, name, args)| ChatToolCall::new(*id, *name, *args))
            .collect(),
    );
    let events = vec![
        Event::new(
            "user:u1",
            raw::USER_MESSAGE,
            json!({"id": "u1", "text": "go"}),
            EventKind::Message {
                message_id: "u1".into(),
                role: Role::User,
                text: "go".into(),
                reasoning: None,
                tool_uses: vec![],
            },
        ),
        Event::new(
            "m1",
            raw::LOCAL_MODEL_RESPONSE,
            json!({"message": msg}),
            EventKind::Message {
                message_id: "m1".into(),
                role: Role::Assistant,
                text: String::new(),
                reasoning: None,
                tool_uses: vec![],
            },
        ),
    ];
    for (i, mut e) in events.into_iter().enumerate() {
        e.seq = Some(i as u64 + 1);
        store.append(&record, &e).await.unwrap();
    }
    record
}

/// The engine memoizes a result before it records its event: a kill in between leaves a result
/// only the memo holds. The resumed thread must answer the call from it, not run it again.
#[tokio::test]
async fn a_result_only_the_memo_holds_answers_its_call_after_a_crash() {
    let store = Arc::new(MemoryStore::default());
    let record = staged(&store, "t", &[("c1", "touch", r#"{"file":"x"}"#)]).await;
    let use_ = ChatToolCall::new("c1", "touch", r#"{"file":"x"}"#).to_tool_use();
    store
        .put_tool_result(&record, &ToolResult::ok(use_.memo_key(), "from the memo"))
        .await
        .unwrap();
    let handler = Arc::new(Touch::default());
    let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("done"))]));
    let mut s = session(&store, "t", &model, &handler).open().await.unwrap();
    assert_eq!(s.pending_tool_uses().len(), 1);
    let r = s.resume(CancellationToken::new()).await.unwrap();
    assert_eq!(r.text, "done");
    assert_eq!(handler.runs.load(Ordering::SeqCst), 0, "answered from the memo");
    let sent = &model.requests()[0].messages;
    let tool = sent.iter().find(|m| m.role == Role::Tool).unwrap();
    assert_eq!(tool.tool_call_id.as_deref(), Some("c1"));
    assert_eq!(tool.content.as_deref(), Some("from the memo"));
    assert_gapless(&store.load(&record).await.unwrap());
}

/// A call that never ran (the kill came first) runs once on resume.
#[tokio::test]
async fn a_call_the_crash_left_unrun_runs_once_on_resume() {
    let store = Arc::new(MemoryStore::default());
    let record = staged(&store, "t", &[("c1", "touch", r#"{"file":"x"}"#)]).await;
    let handler = Arc::new(Touch::default());
    let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("done"))]));
    let mut s = session(&store, "t", &model, &handler).open().await.unwrap();
    s.resume(CancellationToken::new()).await.unwrap();
    assert_eq!(handler.runs.load(Ordering::SeqCst), 1);
    // Reopened again: nothing is pending, nothing runs again.
    let model = Arc::new(ScriptedModel::new(vec![]));
    let mut s = session(&store, "t", &model, &handler).open().await.unwrap();
    assert!(s.pending_tool_uses().is_empty());
    let r = s.resume(CancellationToken::new()).await.unwrap();
    assert_eq!(r.stop_reason, tether::StopReason::Idle);
    assert_eq!(handler.runs.load(Ordering::SeqCst), 1);
    assert_gapless(&store.load(&record).await.unwrap());
}

/// A model that reuses a call id in a later turn, for another call, must not get the first
/// call's result: the second call is run (its own memo key), and the rebuilt history pairs each
/// call with its own result.
#[tokio::test]
async fn a_reused_call_id_is_not_answered_with_the_earlier_result() {
    let store = Arc::new(MemoryStore::default());
    let handler = Arc::new(Touch::default());
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[(
            "dup",
            "touch",
            r#"{"file":"safe"}"#,
        )])),
        Ok(ScriptedModel::tool_calls(&[(
            "dup",
            "touch",
            r#"{"file":"PWNED"}"#,
        )])),
    ]));
    // The second model response's call is left unrun (max_turns 2 stops the request there).
    let m: Arc<dyn tether::ChatModel> = model.clone();
    let mut s = Session::builder(LocalLoop::with_model(m))
        .handler_arc(handler.clone())
        .thread(store.clone(), tid("t"), "agent-a")
        .max_turns(2)
        .open()
        .await
        .unwrap();
    s.send("go").await.unwrap();
    assert_eq!(
        handler.runs.load(Ordering::SeqCst),
        2,
        "another call under the same id runs"
    );
    drop(s);
    let model2 = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("ok"))]));
    let mut s = session(&store, "t", &model2, &handler).open().await.unwrap();
    s.send("next").await.unwrap();
    let answers: Vec<String> = model2.requests()[0]
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.content.clone().unwrap_or_default())
        .collect();
    assert_eq!(
        answers,
        ["touched \"safe\"", "touched \"PWNED\""],
        "each call its own result"
    );
}

/// A user message recorded before the kill, with no model response after it, is sent again
/// once the thread resumes, and not recorded twice.
#[tokio::test]
async fn an_unanswered_user_message_is_sent_again_after_a_crash() {
    let store = Arc::new(MemoryStore::default());
    let handler = Arc::new(Touch::default());
    let dead = Arc::new(ScriptedModel::new(vec![Err(Error::config(
        tether::ConfigKind::Setup,
        "the model died",
    ))]));
    let mut s = session(&store, "t", &dead, &handler).open().await.unwrap();
    assert!(
        s.send_messages(
            vec![UserMessage::with_id("u1", "are you there?")],
            CancellationToken::new()
        )
        .await
        .is_err()
    );
    drop(s);
    let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("yes"))]));
    let mut s = session(&store, "t", &model, &handler).open().await.unwrap();
    assert_eq!(s.opened().unanswered.as_deref(), Some("are you there?"));
    // The client sends its history again: the message is known, and goes out once.
    let r = s
        .send_messages(
            vec![UserMessage::with_id("u1", "are you there?")],
            CancellationToken::new(),
        )
        .await
        .unwrap();
    assert_eq!(r.text, "yes");
    let sent = &model.requests()[0].messages;
    let users: Vec<_> = sent
        .iter()
        .filter(|m| m.role == Role::User)
        .map(|m| m.content.clone())
        .collect();
    assert_eq!(users, [Some("are you there?".to_owned())]);
    let record = store.thread(&tid("t")).await.unwrap().unwrap().record;
    let all = store.load(&record).await.unwrap();
    assert_gapless(&all);
    assert_eq!(all.iter().filter(|e| e.raw_type == raw::USER_MESSAGE).count(), 1);
}

/// The checkpoint is taken after each turn, before its tools run: a kill then leaves a
/// checkpoint whose history ends on the calls. The resumed thread waits on them.
#[tokio::test]
async fn a_checkpoint_that_ends_on_tool_calls_resumes_with_them_pending() {
    let store = Arc::new(MemoryStore::default());
    /// A handler whose tool never returns: the "process" dies while it runs.
    struct Hangs;
    #[async_trait::async_trait]
    impl Handler for Hangs {
        fn tools(&self) -> Vec<ToolSpec> {
            vec![ToolSpec::new("touch", "touch", json!({"type": "object"}))]
        }
        async fn call_tool(&self, _c: &ToolUse, _i: &SessionInfo) -> ToolOutput {
            std::future::pending().await
        }
    }
    let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::tool_calls(&[(
        "c1",
        "touch",
        r#"{"file":"y"}"#,
    )]))]));
    let m: Arc<dyn tether::ChatModel> = model.clone();
    let mut s = Session::builder(LocalLoop::with_model(m))
        .handler(Hangs)
        .thread(store.clone(), tid("t"), "agent-a")
        .open()
        .await
        .unwrap();
    let sent = tokio::time::timeout(std::time::Duration::from_millis(300), s.send("go")).await;
    assert!(sent.is_err(), "the tool hangs");
    std::mem::forget(s); // a kill: nothing more is written
    let record = store.thread(&tid("t")).await.unwrap().unwrap().record;
    let cp: Value = store
        .state(&record, tether::thread::CHECKPOINT)
        .await
        .unwrap()
        .unwrap();
    assert!(cp["seq"].as_u64().unwrap() > 0);
    let handler = Arc::new(Touch::default());
    let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("done"))]));
    let mut s = session(&store, "t", &model, &handler).open().await.unwrap();
    assert_eq!(s.pending_tool_uses()[0].id, "c1");
    let r = s.resume(CancellationToken::new()).await.unwrap();
    assert_eq!(r.text, "done");
    assert_eq!(handler.runs.load(Ordering::SeqCst), 1);
    assert_gapless(&store.load(&record).await.unwrap());
}

/// A thread opened with its first messages records them as it opens (on a store using the
/// trait's default start methods), and sends them with the first request, once: with the
/// provider opened before the claim or after it.
#[tokio::test]
async fn a_new_thread_opened_with_its_first_messages_records_them_once_and_sends_them() {
    for locally in [true, false] {
        let store = Arc::new(MemoryStore::default());
        let handler = Arc::new(Touch::default());
        let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("hi"))]));
        let first = vec![
            UserMessage::with_id("u1", "one"),
            UserMessage::with_id("u1", "one again"),
            UserMessage::with_id("u2", "two"),
        ];
        let mut b = session(&store, "t", &model, &handler).first_messages(first.clone());
        if locally {
            b = b.provider_opens_locally();
        }
        let mut sub = b.subscribe(16);
        let mut s = b.open().await.unwrap();
        let record = s.info().session_id.clone();
        // Recorded and delivered as the session opened, before any request.
        let stored = store.load(&record).await.unwrap();
        let ids: Vec<&str> = stored.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["user:u1", "user:u2"], "locally={locally}");
        assert_gapless(&stored);
        assert_eq!(sub.recv().await.unwrap().id, "user:u1");
        assert_eq!(sub.recv().await.unwrap().id, "user:u2");
        let t = store.thread(&tid("t")).await.unwrap().unwrap();
        assert_eq!(t.provider, "local", "the provider session is recorded with them");
        assert!(t.provider_session.is_some());
        assert_eq!(s.opened().unanswered.as_deref(), Some("one\n\ntwo"));

        let r = s.send_messages(first, CancellationToken::new()).await.unwrap();
        assert_eq!(r.text, "hi");
        let users: Vec<_> = model.requests()[0]
            .messages
            .iter()
            .filter(|m| m.role == Role::User)
            .map(|m| m.content.clone())
            .collect();
        assert_eq!(
            users,
            [Some("one\n\ntwo".to_owned())],
            "sent once, locally={locally}"
        );
        let all = store.load(&record).await.unwrap();
        assert_gapless(&all);
        assert_eq!(all.iter().filter(|e| e.raw_type == raw::USER_MESSAGE).count(), 2);
        assert_eq!(
            r.events
                .iter()
                .filter(|e| e.raw_type == raw::USER_MESSAGE)
                .count(),
            2,
            "the first request's record holds the messages it sent"
        );
    }
}

/// A thread of another agent is refused before anything of the start is written, even with the
/// provider opened before the claim.
#[tokio::test]
async fn first_messages_for_a_thread_of_another_agent_write_nothing() {
    let store = Arc::new(MemoryStore::default());
    let handler = Arc::new(Touch::default());
    let model = Arc::new(ScriptedModel::new(vec![]));
    let s = session(&store, "t1", &model, &handler).open().await.unwrap();
    let record = s.info().session_id.clone();
    let before = store.thread(&tid("t1")).await.unwrap().unwrap();
    let m: Arc<dyn tether::ChatModel> = model.clone();
    let e = Session::builder(LocalLoop::with_model(m))
        .provider_opens_locally()
        .thread(store.clone(), tid("t1"), "agent-b")
        .first_messages(vec![UserMessage::with_id("u1", "mine now")])
        .open()
        .await
        .unwrap_err();
    assert!(matches!(&e, Error::ThreadTaken { .. }), "{e}");
    assert!(store.load(&record).await.unwrap().is_empty());
    assert_eq!(store.thread(&tid("t1")).await.unwrap().unwrap(), before);
}

/// First messages recorded as the thread opened, whose model call then failed, are what a
/// later open finds unanswered: sent again once, recorded once.
#[tokio::test]
async fn first_messages_a_failed_request_left_unanswered_are_sent_again() {
    let store = Arc::new(MemoryStore::default());
    let handler = Arc::new(Touch::default());
    let dead = Arc::new(ScriptedModel::new(vec![Err(Error::store("the model died"))]));
    let first = vec![UserMessage::with_id("u1", "are you there?")];
    let mut s = session(&store, "t", &dead, &handler)
        .provider_opens_locally()
        .first_messages(first.clone())
        .open()
        .await
        .unwrap();
    assert!(
        s.send_messages(first.clone(), CancellationToken::new())
            .await
            .is_err()
    );
    drop(s);
    let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("yes"))]));
    let mut s = session(&store, "t", &model, &handler)
        .provider_opens_locally()
        .first_messages(first.clone())
        .open()
        .await
        .unwrap();
    assert!(s.opened().resumed);
    assert_eq!(s.opened().unanswered.as_deref(), Some("are you there?"));
    let r = s.send_messages(first, CancellationToken::new()).await.unwrap();
    assert_eq!(r.text, "yes");
    let record = s.info().session_id.clone();
    let all = store.load(&record).await.unwrap();
    assert_gapless(&all);
    assert_eq!(all.iter().filter(|e| e.raw_type == raw::USER_MESSAGE).count(), 1);
}
