//! The session engine and the local loop, driven by a scripted model (no network).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tether::local::LocalLoop;
use tether::{
    ChatModel, ChatRequest, ChatResponse, DeltaSink, Error, EventKind, GuardDecision, Handler, MemoryStore,
    RecordingSleeper, RetryPolicy, ScriptedModel, Session, SessionInfo, StopReason, Terminal, ToolOutput,
    ToolResult, ToolSet, ToolSpec, ToolUse,
};

fn spec(name: &str) -> ToolSpec {
    ToolSpec::new(name, name, json!({"type": "object"}))
}

fn assert_record_is_exactly_once(events: &[impl std::borrow::Borrow<tether::Event>]) {
    let mut ids = std::collections::HashSet::new();
    let mut last = 0;
    for e in events.iter().map(std::borrow::Borrow::borrow) {
        assert!(ids.insert(e.id.clone()), "duplicate event id {}", e.id);
        let s = e.seq.expect("recorded events carry a sequence number");
        assert!(s > last, "sequence numbers must increase: {s} after {last}");
        last = s;
    }
}

fn tools() -> ToolSet {
    ToolSet::new()
        .tool(spec("echo"), |input: Value| async move {
            Ok::<_, String>(input["v"].as_str().unwrap_or_default().to_owned())
        })
        .tool(spec("slow"), |input: Value| async move {
            let ms = input["ms"].as_u64().unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok::<_, String>(format!("slept {ms}"))
        })
        .tool(spec("fail"), |_input: Value| async move {
            Err::<String, _>("bad input")
        })
        .tool(spec("boom"), |_input: Value| async move {
            if true {
                panic!("kaboom");
            }
            Ok::<String, String>(String::new())
        })
}

#[tokio::test]
async fn parallel_tool_calls_run_concurrently_and_results_keep_call_order() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[
            ("a", "slow", r#"{"ms":60}"#),
            ("b", "slow", r#"{"ms":1}"#),
            ("c", "echo", r#"{"v":"third"}"#),
        ])),
        Ok(ScriptedModel::text("done")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(tools())
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.terminal, Terminal::EndTurn);
    assert_eq!(r.text, "done");
    assert_eq!(r.turns, 2);
    let reqs = model.requests();
    let last = &reqs[1].messages;
    let tool_msgs: Vec<_> = last.iter().filter(|m| m.tool_call_id.is_some()).collect();
    assert_eq!(tool_msgs.len(), 3);
    assert_eq!(tool_msgs[0].tool_call_id.as_deref(), Some("a"));
    assert_eq!(tool_msgs[0].content.as_deref(), Some("slept 60"));
    assert_eq!(tool_msgs[1].tool_call_id.as_deref(), Some("b"));
    assert_eq!(tool_msgs[2].content.as_deref(), Some("third"));
    assert_record_is_exactly_once(&r.events);
    let results: Vec<_> = r
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ToolResult { result } => Some(result.tool_use_id.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 3);
}

#[tokio::test]
async fn tool_errors_and_panics_become_error_results() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[
            ("a", "fail", "{}"),
            ("b", "boom", "{}"),
            ("c", "nope", "{}"),
            ("d", "echo", "{bad json"),
        ])),
        Ok(ScriptedModel::text("ok")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(tools())
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.text, "ok");
    let msgs = &model.requests()[1].messages;
    let tool: Vec<_> = msgs.iter().filter(|m| m.tool_call_id.is_some()).collect();
    assert!(tool.iter().all(|m| m.is_error));
    assert!(tool[0].content.as_deref().unwrap().contains("bad input"));
    assert!(tool[1].content.as_deref().unwrap().contains("panicked: kaboom"));
    assert!(
        tool[2]
            .content
            .as_deref()
            .unwrap()
            .contains("no tool named `nope`")
    );
    assert!(tool[3].content.as_deref().unwrap().contains("not valid JSON"));
}

/// A call alone in its turn runs on the session's own task, not a spawned one: its panic still
/// becomes an error result, and the session goes on.
#[tokio::test]
async fn a_lone_call_that_panics_becomes_an_error_result() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("b", "boom", "{}")])),
        Ok(ScriptedModel::tool_calls(&[(
            "e",
            "echo",
            r#"{"v":"still here"}"#,
        )])),
        Ok(ScriptedModel::text("ok")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(tools())
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.text, "ok");
    let msgs = &model.requests()[2].messages;
    let tool: Vec<_> = msgs.iter().filter(|m| m.tool_call_id.is_some()).collect();
    assert!(tool[0].is_error);
    assert!(tool[0].content.as_deref().unwrap().contains("panicked: kaboom"));
    assert_eq!(
        (tool[1].is_error, tool[1].content.as_deref()),
        (false, Some("still here"))
    );
}

/// Arguments that parse but are not an object (`[1]`, `"x"`, `null`, `5`) never reach a tool:
/// every tool's input schema is an object, and a handler reading `input["path"]` of an array
/// would act on nothing. Each is answered with an error naming what it was.
#[tokio::test]
async fn arguments_that_are_not_an_object_never_reach_the_tool() {
    let calls: Vec<(String, &str)> = ["[1]", "\"x\"", "null", "5", "true"]
        .iter()
        .enumerate()
        .map(|(i, a)| (format!("c{i}"), *a))
        .collect();
    let script: Vec<(&str, &str, &str)> = calls.iter().map(|(id, a)| (id.as_str(), "echo", *a)).collect();
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&script)),
        Ok(ScriptedModel::text("ok")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(tools())
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.text, "ok");
    let msgs = &model.requests()[1].messages;
    let tool: Vec<_> = msgs.iter().filter(|m| m.tool_call_id.is_some()).collect();
    assert_eq!(tool.len(), 5);
    for (m, kind) in tool
        .iter()
        .zip(["an array", "a string", "null", "a number", "a boolean"])
    {
        assert!(m.is_error, "{m:?}");
        let text = m.content.as_deref().unwrap_or_default();
        assert!(text.contains(kind) && text.contains("not an object"), "{text}");
    }
}

#[tokio::test]
async fn a_hung_tool_times_out_into_an_error_result() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("a", "slow", r#"{"ms":60000}"#)])),
        Ok(ScriptedModel::text("ok")),
    ]));
    let cfg = tether::SessionConfig::default().with_tool_timeout(Some(Duration::from_millis(50)));
    let r = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(tools())
        .config(cfg)
        .run("go")
        .await
        .unwrap();
    let msgs = &model.requests()[1].messages;
    let t = msgs.iter().find(|m| m.tool_call_id.is_some()).unwrap();
    assert!(t.is_error && t.content.as_deref().unwrap().contains("timed out"));
    assert_eq!(r.text, "ok");
}

#[tokio::test]
async fn duplicate_calls_are_answered_in_history_and_not_dispatched() {
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let h = ToolSet::new().tool(spec("echo"), move |_input: Value| {
        let c = c.clone();
        async move {
            c.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>("x".into())
        }
    });
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("a", "echo", r#"{"v":1}"#)])),
        // Same call again (keys reordered whitespace): all duplicates, the loop continues itself.
        Ok(ScriptedModel::tool_calls(&[("b", "echo", r#"{ "v": 1 }"#)])),
        Ok(ScriptedModel::text("final")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(h)
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.terminal, Terminal::EndTurn);
    assert_eq!(r.text, "final");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the duplicate must not run");
    let third = &model.requests()[2].messages;
    let dup = third
        .iter()
        .find(|m| m.tool_call_id.as_deref() == Some("b"))
        .unwrap();
    assert!(dup.content.as_deref().unwrap().contains("\"duplicate\":true"));
    assert!(r.events.iter().any(|e| e.raw_type == "local.duplicate_tool_call"));
    assert_record_is_exactly_once(&r.events);
}

#[tokio::test]
async fn two_consecutive_errors_inject_a_corrective() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("a", "fail", r#"{"n":1}"#)])),
        Ok(ScriptedModel::tool_calls(&[("b", "fail", r#"{"n":2}"#)])),
        Ok(ScriptedModel::text("gave up")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(tools())
        .run("go")
        .await
        .unwrap();
    let directives: Vec<_> = r
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Directive { role, text } if role == "corrective" => Some(text.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(directives.len(), 1, "only after the second consecutive error");
    assert!(directives[0].starts_with("STOP — the fail tool"));
    let last = model.requests()[2].messages.last().cloned().unwrap();
    assert!(last.content.unwrap().starts_with("STOP"));
}

#[tokio::test]
async fn the_turn_limit_ends_with_a_stop_reason_and_the_last_turn_gets_a_final_directive() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("a", "echo", r#"{"v":"1"}"#)])),
        Ok(ScriptedModel::tool_calls(&[("b", "echo", r#"{"v":"2"}"#)])),
        Ok(ScriptedModel::tool_calls(&[("c", "echo", r#"{"v":"3"}"#)])),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(tools())
        .max_turns(3)
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.terminal, Terminal::Terminated);
    assert_eq!(r.stop_reason, StopReason::MaxTurns);
    assert_eq!(r.turns, 3);
    assert_eq!(model.remaining(), 0);
    let third = &model.requests()[2].messages;
    assert!(
        third
            .last()
            .unwrap()
            .content
            .as_deref()
            .unwrap()
            .starts_with("FINAL TURN")
    );
    assert!(
        r.events
            .iter()
            .any(|e| matches!(&e.kind, EventKind::Directive { role, .. } if role == "final_turn"))
    );
}

#[tokio::test]
async fn a_final_answer_on_the_last_allowed_turn_is_kept() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("a", "echo", r#"{"v":"1"}"#)])),
        Ok(ScriptedModel::text("answer")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model))
        .handler(tools())
        .max_turns(2)
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.terminal, Terminal::EndTurn);
    assert_eq!(r.text, "answer");
}

#[tokio::test]
async fn terminal_tool_ends_the_run_and_is_reprompted_when_missing() {
    let finish = ToolSpec::new("finish", "Finish", json!({"type":"object"}));
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::text("I think I'm done")),
        Ok(ScriptedModel::tool_calls(&[("f", "finish", r#"{"answer":42}"#)])),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()))
        .terminal_tool(finish.clone())
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.terminal, Terminal::EndTurn);
    assert_eq!(r.stop_reason, StopReason::TerminalTool);
    assert_eq!(r.final_output, Some(json!({"answer": 42})));
    assert!(model.requests()[0].tools.iter().any(|t| t.name == "finish"));
    let reprompt = model.requests()[1].messages.last().cloned().unwrap();
    assert!(reprompt.content.unwrap().contains("MUST call `finish`"));

    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::text("a")),
        Ok(ScriptedModel::text("b")),
        Ok(ScriptedModel::text("c")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()))
        .terminal_tool(finish)
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.terminal, Terminal::EndTurn);
    assert_eq!(r.stop_reason, StopReason::NoTerminalTool);
    assert_eq!(r.turns, 3, "the first answer plus two re-prompts");
    assert_eq!(r.text, "c");
}

#[tokio::test]
async fn the_turn_guard_halts_and_a_panicking_guard_is_a_typed_error() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("a", "echo", r#"{"v":"1"}"#)])),
        Ok(ScriptedModel::text("never")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model))
        .handler(tools())
        .turn_guard(|g| {
            if g.turns >= 1 {
                GuardDecision::Halt("budget".into())
            } else {
                GuardDecision::Continue
            }
        })
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.terminal, Terminal::Terminated);
    assert_eq!(
        r.stop_reason,
        StopReason::Halted {
            reason: "budget".into()
        }
    );
    assert_eq!(
        json!(r.stop_reason),
        json!({"type": "halted", "reason": "budget"})
    );

    let model = ScriptedModel::new(vec![Ok(ScriptedModel::text("x"))]);
    let e = Session::builder(LocalLoop::new(model))
        .turn_guard(|_| panic!("guard bug"))
        .run("go")
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Guard(ref m) if m.contains("guard bug")), "{e}");
}

#[tokio::test]
async fn length_and_filter_stops_are_terminated_with_the_raw_reason() {
    let mut resp = ScriptedModel::text("cut");
    resp.finish_reason = Some("length".into());
    let r = Session::builder(LocalLoop::new(ScriptedModel::new(vec![Ok(resp)])))
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.terminal, Terminal::Terminated);
    assert_eq!(r.stop_reason, StopReason::MaxTokens);
    assert_eq!(r.text, "cut");
}

#[tokio::test]
async fn transient_model_errors_are_retried_with_backoff_and_recorded() {
    let sleeper = RecordingSleeper::default();
    let e503 = || Error::Http {
        status: 503,
        message: "overloaded".into(),
        code: None,
        retry_after: None,
        should_retry: None,
        endpoint: "x".into(),
    };
    let e401 = Error::Http {
        status: 401,
        message: "bad key".into(),
        code: None,
        retry_after: None,
        should_retry: None,
        endpoint: "x".into(),
    };
    let model = ScriptedModel::new(vec![Err(e503()), Err(e503()), Ok(ScriptedModel::text("ok"))]);
    let lp = LocalLoop::new(model).retry(RetryPolicy::default().with_sleeper(sleeper.clone()));
    let r = Session::builder(lp).run("go").await.unwrap();
    assert_eq!(r.text, "ok");
    assert_eq!(sleeper.slept().len(), 2);
    assert_eq!(r.events.iter().filter(|e| e.raw_type == "local.retry").count(), 2);

    let model = ScriptedModel::new(vec![Err(e401), Ok(ScriptedModel::text("never"))]);
    let lp = LocalLoop::new(model).retry(RetryPolicy::default().with_sleeper(RecordingSleeper::default()));
    let e = Session::builder(lp).run("go").await.unwrap_err();
    assert_eq!(e.status(), Some(401));
}

#[tokio::test]
async fn front_end_tools_pause_the_session_until_results_arrive() {
    let h = tools().pending_tool(spec("confirm"));
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[
            ("a", "echo", r#"{"v":"1"}"#),
            ("b", "confirm", "{}"),
        ])),
        Ok(ScriptedModel::text("confirmed")),
    ]));
    let mut s = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(h)
        .open()
        .await
        .unwrap();
    let r = s.send("go").await.unwrap();
    assert_eq!(r.terminal, Terminal::RequiresAction);
    assert_eq!(r.stop_reason, StopReason::PendingTools);
    assert_eq!(r.pending_tool_uses.len(), 1);
    assert_eq!(r.pending_tool_uses[0].id, "b");
    assert!(matches!(
        s.send("again").await,
        Err(Error::Config {
            kind: tether::ConfigKind::State,
            ..
        })
    ));
    let r = s
        .submit_tool_results(vec![ToolResult::ok("b", "yes")], Default::default())
        .await
        .unwrap();
    assert_eq!(r.terminal, Terminal::EndTurn);
    assert_eq!(r.text, "confirmed");
    let msgs = &model.requests()[1].messages;
    let ids: Vec<_> = msgs.iter().filter_map(|m| m.tool_call_id.clone()).collect();
    assert_eq!(ids, vec!["a", "b"]);
}

#[tokio::test]
async fn pending_front_end_tools_can_be_abandoned_for_a_new_message() {
    let h = tools().pending_tool(spec("confirm"));
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("b", "confirm", "{}")])),
        Ok(ScriptedModel::text("moving on")),
    ]));
    let mut s = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(h)
        .open()
        .await
        .unwrap();
    let r = s.send("go").await.unwrap();
    assert_eq!(r.pending_tool_uses.len(), 1);
    s.abandon_pending_tools("the user moved on").await.unwrap();
    let r = s.send("something else").await.unwrap();
    assert_eq!(r.text, "moving on");
    let msgs = &model.requests()[1].messages;
    let t = msgs
        .iter()
        .find(|m| m.tool_call_id.as_deref() == Some("b"))
        .unwrap();
    assert!(t.is_error && t.content.as_deref().unwrap().contains("the user moved on"));
}

#[tokio::test]
async fn recorded_tool_results_are_not_run_again() {
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let h = ToolSet::new().tool(spec("side_effect"), move |_input: Value| {
        let c = c.clone();
        async move {
            c.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>("did it".into())
        }
    });
    let store = Arc::new(MemoryStore::default());
    use tether::EventStore;
    // The memo answers the same tool use: same id, name and arguments.
    let a = ToolUse::from_arguments("a", "side_effect", r#"{"n":1}"#);
    store
        .put_tool_result("s1", &ToolResult::ok(a.memo_key(), "recorded earlier"))
        .await
        .unwrap();
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[
            ("a", "side_effect", r#"{"n":1}"#),
            ("b", "side_effect", r#"{"n":2}"#),
        ])),
        Ok(ScriptedModel::text("ok")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()).session_id("s1"))
        .handler(h)
        .store(store.clone())
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.text, "ok");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "only the unrecorded use runs");
    let msgs = &model.requests()[1].messages;
    assert_eq!(
        msgs.iter()
            .find(|m| m.tool_call_id.as_deref() == Some("a"))
            .unwrap()
            .content
            .as_deref(),
        Some("recorded earlier")
    );
    let b = ToolUse::from_arguments("b", "side_effect", r#"{"n":2}"#);
    assert_eq!(
        store
            .tool_result("s1", &b.memo_key())
            .await
            .unwrap()
            .unwrap()
            .content,
        "did it"
    );
    // A memo answer still lands in the record, once: a crash between the memo and the event
    // must not leave a thread whose record has no result for a call the model saw answered.
    let results: Vec<&str> = r
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            tether::EventKind::ToolResult { result } => Some(result.tool_use_id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(results, ["a", "b"]);
}

#[tokio::test]
async fn a_session_reopened_on_the_same_store_continues_numbering_and_its_transcript() {
    let store = Arc::new(MemoryStore::default());
    let model = ScriptedModel::new(vec![Ok(ScriptedModel::text("first"))]);
    let mut s1 = Session::builder(LocalLoop::new(model).session_id("s2"))
        .store(store.clone())
        .open()
        .await
        .unwrap();
    let r1 = s1.send("one").await.unwrap();
    let transcript = s1.checkpoint().unwrap();
    drop(s1);
    let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("second"))]));
    let lp = LocalLoop::with_model(model.clone())
        .session_id("s2")
        .transcript(&transcript)
        .unwrap();
    let r2 = Session::builder(lp)
        .store(store.clone())
        .run("two")
        .await
        .unwrap();
    assert_eq!(r2.text, "second");
    let first_seq = r2.events[0].seq.unwrap();
    assert_eq!(first_seq, r1.events.last().unwrap().seq.unwrap() + 1);
    let sent = &model.requests()[0].messages;
    assert_eq!(sent.len(), 3, "user one, assistant first, user two");
    use tether::EventStore;
    let all = store.load("s2").await.unwrap();
    assert_record_is_exactly_once(&all);
}

/// A request's result shares its events with the session's store instead of copying them (a
/// copy per event per request, and its drop, was the largest cost of a short request), and the
/// provider's resumable state is read from the session on demand, not built into every result.
#[tokio::test]
async fn a_result_shares_its_events_with_the_store() {
    let store = Arc::new(MemoryStore::default());
    let model = ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("c1", "echo", r#"{"v": "x"}"#)])),
        Ok(ScriptedModel::text("done")),
    ]);
    let mut session = Session::builder(LocalLoop::new(model).session_id("s9"))
        .handler(tools())
        .store(store.clone())
        .open()
        .await
        .unwrap();
    let r = session.send("go").await.unwrap();
    assert_eq!(r.text, "done");
    assert!(r.events.len() >= 3, "{:?}", r.events);
    for e in &r.events {
        assert!(
            Arc::strong_count(e) >= 2,
            "event {} is a copy: the store does not hold it",
            e.id
        );
    }
    let transcript: Vec<tether::ChatMessage> = serde_json::from_value(session.checkpoint().unwrap()).unwrap();
    assert_eq!(
        transcript.len(),
        4,
        "prompt, call, result, answer: {transcript:?}"
    );
}

/// A store that counts checkpoint saves.
#[derive(Default)]
struct CountingStore {
    inner: MemoryStore,
    saves: AtomicU32,
}

#[async_trait::async_trait]
impl tether::EventStore for CountingStore {
    async fn append(&self, s: &str, e: &tether::Event) -> tether::Result<bool> {
        self.inner.append(s, e).await
    }
    async fn load(&self, s: &str) -> tether::Result<Vec<tether::Event>> {
        self.inner.load(s).await
    }
    async fn tool_result(&self, s: &str, id: &str) -> tether::Result<Option<tether::ToolResult>> {
        self.inner.tool_result(s, id).await
    }
    async fn put_tool_result(&self, s: &str, r: &tether::ToolResult) -> tether::Result<()> {
        self.inner.put_tool_result(s, r).await
    }
    async fn put_state(&self, s: &str, k: &str, v: &Value) -> tether::Result<()> {
        self.saves.fetch_add(1, Ordering::SeqCst);
        self.inner.put_state(s, k, v).await
    }
    async fn state(&self, s: &str, k: &str) -> tether::Result<Option<Value>> {
        self.inner.state(s, k).await
    }
    async fn sessions(&self) -> tether::Result<Vec<String>> {
        self.inner.sessions().await
    }
}

/// The checkpoint is saved after a turn only when the record lacks something of the provider's
/// state (here `run`'s prompt, which is not recorded, and the system prompt `open` set up); a
/// turn the record holds (tool results, a model response) is not saved again, and a request
/// that ends with the turn just saved does not save twice.
#[tokio::test]
async fn the_checkpoint_is_saved_only_when_the_record_lacks_the_turn() {
    use tether::EventStore;
    let store = Arc::new(CountingStore::default());
    let model = ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("c1", "echo", r#"{"v": "x"}"#)])),
        Ok(ScriptedModel::tool_calls(&[("c2", "echo", r#"{"v": "y"}"#)])),
        Ok(ScriptedModel::text("done")),
    ]);
    let mut session = Session::builder(LocalLoop::new(model).session_id("s4"))
        .handler(tools())
        .store(store.clone())
        .open()
        .await
        .unwrap();
    let r = session.send("go").await.unwrap();
    assert_eq!(r.turns, 3);
    assert_eq!(
        store.saves.load(Ordering::SeqCst),
        1,
        "saved after the first turn (the prompt is in no record), not after the two the record holds"
    );
    let saved = store
        .state("s4", tether::thread::CHECKPOINT)
        .await
        .unwrap()
        .unwrap();
    let history: Vec<tether::ChatMessage> = serde_json::from_value(saved["provider"].clone()).unwrap();
    let last: Vec<tether::ChatMessage> = serde_json::from_value(session.checkpoint().unwrap()).unwrap();
    assert_eq!(history.len(), 2, "the prompt and the first model response");
    assert_eq!(
        history[..],
        last[..2],
        "the saved history is the live one's beginning"
    );
    let covered = saved["seq"].as_u64().unwrap();
    let after: Vec<&str> = r
        .events
        .iter()
        .filter(|e| e.seq.is_some_and(|s| s > covered))
        .map(|e| e.raw_type.as_str())
        .collect();
    assert!(
        after.contains(&tether::raw::TOOL_RESULT) && after.contains(&tether::raw::LOCAL_MODEL_RESPONSE),
        "what the save left out is in the record after it: {after:?}"
    );
}

/// A model that streams forever, for cancellation and timeouts.
struct Hang;

#[async_trait::async_trait]
impl ChatModel for Hang {
    fn name(&self) -> &str {
        "hang"
    }
    async fn chat(&self, _req: &ChatRequest, deltas: &DeltaSink) -> tether::Result<ChatResponse> {
        loop {
            deltas.text("x").await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

#[tokio::test]
async fn a_run_past_its_timeout_is_torn_down() {
    let e = Session::builder(LocalLoop::new(Hang))
        .timeout(Duration::from_millis(100))
        .run("go")
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Timeout(_)));
}

#[tokio::test]
async fn a_long_lived_session_takes_follow_ups_cancels_and_streams_events() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::text("one")),
        Ok(ScriptedModel::text("two")),
    ]));
    let s = Session::builder(LocalLoop::with_model(model))
        .open()
        .await
        .unwrap();
    let mut h = s.spawn();
    let mut sub = h.subscribe(64).await;
    h.send("a").await.unwrap();
    assert_eq!(h.next_result().await.unwrap().unwrap().text, "one");
    h.send("b").await.unwrap();
    assert_eq!(h.next_result().await.unwrap().unwrap().text, "two");
    let mut texts = String::new();
    while let Ok(e) = sub.try_recv() {
        if let EventKind::TextDelta { delta, .. } = e.kind {
            texts.push_str(&delta);
        }
    }
    assert_eq!(texts, "onetwo");
    h.close().await;

    let s = Session::builder(LocalLoop::new(Hang)).open().await.unwrap();
    let mut h = s.spawn();
    let mut sub = h.subscribe(4).await;
    h.send("go").await.unwrap();
    // Wait until it streams, then cancel mid-stream.
    let _ = sub.recv().await;
    h.cancel();
    let r = loop {
        tokio::select! {
            r = h.next_result() => break r,
            _ = sub.recv() => {}
        }
    };
    assert!(matches!(r, Some(Err(Error::Cancelled))));
    h.close().await;
}

struct Info;

#[async_trait::async_trait]
impl Handler for Info {
    fn tools(&self) -> Vec<ToolSpec> {
        vec![spec("whoami")]
    }
    async fn call_tool(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        ToolOutput::Ok(format!("{} {} {}", call.id, info.session_id, info.provider))
    }
}

#[tokio::test]
async fn handlers_see_the_session_info() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("t1", "whoami", "{}")])),
        Ok(ScriptedModel::text("ok")),
    ]));
    Session::builder(LocalLoop::with_model(model.clone()).session_id("sid"))
        .handler(Info)
        .run("go")
        .await
        .unwrap();
    let m = &model.requests()[1].messages;
    assert_eq!(
        m.iter()
            .find(|m| m.tool_call_id.is_some())
            .unwrap()
            .content
            .as_deref(),
        Some("t1 sid local")
    );
}

/// A streaming-style provider whose stream drops once after a tool use, then redelivers history.
struct Flaky {
    turns: u32,
    reconnects: u32,
    results_seen: Vec<ToolResult>,
}

#[async_trait::async_trait]
impl tether::Provider for Flaky {
    fn name(&self) -> &str {
        "flaky"
    }
    async fn open(&mut self, _cx: &tether::TurnContext) -> tether::Result<tether::Opened> {
        Ok(tether::Opened::new("flaky-1"))
    }
    fn can_reconnect(&self) -> bool {
        true
    }
    async fn turn(
        &mut self,
        input: tether::Input,
        cx: &tether::TurnContext,
    ) -> tether::Result<tether::TurnResult> {
        self.turns += 1;
        let ev = |id: &str, kind| tether::Event::new(id, "fake.event", json!({"id": id}), kind);
        match input {
            tether::Input::Message(_) => {
                cx.sink
                    .emit(ev(
                        "e1",
                        EventKind::Status {
                            status: "running".into(),
                        },
                    ))
                    .await?;
                let u = ToolUse::new("tu1", "echo", json!({"v": "once"}));
                cx.sink
                    .emit(ev(
                        "e2",
                        EventKind::ToolCall {
                            tool_use: u,
                            message_id: None,
                        },
                    ))
                    .await?;
                // The stream drops before the turn's boundary.
                Err(Error::transport(
                    tether::TransportKind::Closed,
                    "stream ended early",
                    "fake",
                ))
            }
            tether::Input::ToolResults(answered) => {
                self.results_seen.extend(answered.into_iter().map(|a| a.result));
                // Redelivered events are recorded once.
                cx.sink.emit(ev("e2", EventKind::Other)).await?;
                cx.sink
                    .emit(ev(
                        "e3",
                        EventKind::Status {
                            status: "idle".into(),
                        },
                    ))
                    .await?;
                let mut tr = tether::TurnResult::new(Terminal::EndTurn, json!("end_turn"));
                tr.text = "finished".into();
                Ok(tr)
            }
            other => panic!("unexpected input {other:?}"),
        }
    }
    async fn reconnect(&mut self, cx: &tether::TurnContext) -> tether::Result<Vec<ToolUse>> {
        self.reconnects += 1;
        if self.reconnects == 1 {
            // The first reconnect attempt fails transiently too.
            return Err(Error::transport(
                tether::TransportKind::Refused,
                "not yet",
                "fake",
            ));
        }
        cx.sink.mark_seen(["e1".to_owned()]).await;
        Ok(vec![ToolUse::new("tu1", "echo", json!({"v": "once"}))])
    }
}

#[tokio::test]
async fn a_dropped_stream_reconnects_reruns_the_unanswered_tool_and_records_once() {
    let sleeper = RecordingSleeper::default();
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let h = ToolSet::new().tool(spec("echo"), move |i: Value| {
        let c = c.clone();
        async move {
            c.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>(i["v"].as_str().unwrap_or_default().to_owned())
        }
    });
    let cfg = tether::SessionConfig::default().with_reconnect(
        RetryPolicy::default()
            .with_sleeper(sleeper.clone())
            .with_jitter(false),
    );
    let r = Session::builder(Flaky {
        turns: 0,
        reconnects: 0,
        results_seen: vec![],
    })
    .handler(h)
    .config(cfg)
    .run("go")
    .await
    .unwrap();
    assert_eq!(r.text, "finished");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        sleeper.slept(),
        vec![Duration::from_millis(500), Duration::from_millis(1000)]
    );
    assert_record_is_exactly_once(&r.events);
    let ids: Vec<_> = r
        .events
        .iter()
        .filter(|e| e.raw_type == "fake.event")
        .map(|e| e.id.clone())
        .collect();
    assert_eq!(ids, vec!["e1", "e2", "e3"]);
    assert_eq!(
        r.events
            .iter()
            .filter(|e| e.raw_type == "tether.reconnect")
            .count(),
        2
    );
    let seqs: Vec<u64> = r.events.iter().map(|e| e.seq.unwrap()).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>(), "no gaps");
}

#[tokio::test]
async fn an_auth_failure_is_not_reconnected() {
    struct Denied;
    #[async_trait::async_trait]
    impl tether::Provider for Denied {
        fn name(&self) -> &str {
            "denied"
        }
        async fn open(&mut self, _cx: &tether::TurnContext) -> tether::Result<tether::Opened> {
            Ok(Default::default())
        }
        fn can_reconnect(&self) -> bool {
            true
        }
        async fn turn(
            &mut self,
            _i: tether::Input,
            _cx: &tether::TurnContext,
        ) -> tether::Result<tether::TurnResult> {
            Err(Error::Http {
                status: 401,
                message: "invalid x-api-key".into(),
                code: None,
                retry_after: None,
                should_retry: None,
                endpoint: "fake".into(),
            })
        }
        async fn reconnect(&mut self, _cx: &tether::TurnContext) -> tether::Result<Vec<ToolUse>> {
            panic!("must not reconnect on 401")
        }
    }
    let e = Session::builder(Denied).run("go").await.unwrap_err();
    assert_eq!(e.status(), Some(401));
}

/// The terminal tool beside other tools in one turn: the other tools run (their effects are
/// what the model asked for), every call is answered in the transcript and the record, and the
/// run ends with the terminal tool's input.
#[tokio::test]
async fn the_terminal_tool_beside_other_tools_runs_them_and_ends_the_run() {
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let h = ToolSet::new().tool(spec("write"), move |i: Value| {
        let c = c.clone();
        async move {
            c.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>(format!("wrote {}", i["v"]))
        }
    });
    let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::tool_calls(&[
        ("w1", "write", r#"{"v":1}"#),
        ("f", "finish", r#"{"answer":42}"#),
        ("w2", "write", r#"{"v":2}"#),
    ]))]));
    let mut session = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(h)
        .terminal_tool(ToolSpec::new("finish", "Finish", json!({"type":"object"})))
        .open()
        .await
        .unwrap();
    let r = session.send("go").await.unwrap();
    assert_eq!(r.terminal, Terminal::EndTurn);
    assert_eq!(r.stop_reason, StopReason::TerminalTool);
    assert_eq!(r.final_output, Some(json!({"answer": 42})));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(r.turns, 1);
    let transcript: Vec<tether::ChatMessage> = serde_json::from_value(session.checkpoint().unwrap()).unwrap();
    let answered: Vec<_> = transcript.iter().filter_map(|m| m.tool_call_id.clone()).collect();
    assert_eq!(answered, ["w1", "f", "w2"], "every call answered, in order");
    // Recorded as they finish (the tools run concurrently), each once.
    let mut recorded: Vec<_> = r
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ToolResult { result } => Some(result.tool_use_id.clone()),
            _ => None,
        })
        .collect();
    recorded.sort();
    assert_eq!(recorded, ["f", "w1", "w2"]);
    assert_record_is_exactly_once(&r.events);
}

/// A provider whose stream always drops and whose reconnects always fail, until `healed`.
struct Broken {
    healed: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl tether::Provider for Broken {
    fn name(&self) -> &str {
        "broken"
    }
    async fn open(&mut self, _cx: &tether::TurnContext) -> tether::Result<tether::Opened> {
        Ok(tether::Opened::new("b1"))
    }
    fn can_reconnect(&self) -> bool {
        true
    }
    async fn turn(
        &mut self,
        _i: tether::Input,
        _cx: &tether::TurnContext,
    ) -> tether::Result<tether::TurnResult> {
        if self.healed.load(Ordering::SeqCst) {
            let mut tr = tether::TurnResult::new(Terminal::EndTurn, json!("end_turn"));
            tr.text = "healed".into();
            return Ok(tr);
        }
        Err(Error::transport(
            tether::TransportKind::Closed,
            "stream ended early",
            "fake",
        ))
    }
    async fn reconnect(&mut self, _cx: &tether::TurnContext) -> tether::Result<Vec<ToolUse>> {
        Err(Error::transport(
            tether::TransportKind::Refused,
            "still down",
            "fake",
        ))
    }
}

/// Reconnect attempts running out: the last error surfaces (typed, as the provider said it),
/// every attempt is in the stored record, and the next request's result does not carry the
/// failed request's events (they used to leak into it).
#[tokio::test]
async fn reconnect_attempts_running_out_surface_the_last_error_with_the_attempts_recorded() {
    use tether::EventStore;
    let sleeper = RecordingSleeper::default();
    let store = Arc::new(MemoryStore::default());
    let healed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cfg = tether::SessionConfig::default().with_reconnect(
        RetryPolicy::default()
            .with_sleeper(sleeper.clone())
            .with_max_retries(3)
            .with_jitter(false),
    );
    let mut s = Session::builder(Broken {
        healed: healed.clone(),
    })
    .store(store.clone())
    .config(cfg)
    .open()
    .await
    .unwrap();
    let e = s.send("go").await.unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Transport {
                kind: tether::TransportKind::Refused,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(sleeper.slept().len(), 3);
    let stored = store.load("b1").await.unwrap();
    let attempts: Vec<u32> = stored
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Retry { attempt, .. } if e.raw_type == "tether.reconnect" => Some(*attempt),
            _ => None,
        })
        .collect();
    assert_eq!(attempts, [1, 2, 3]);
    healed.store(true, Ordering::SeqCst);
    let r = s.send("again").await.unwrap();
    assert_eq!(r.text, "healed");
    assert!(
        r.events.iter().all(|e| e.raw_type != "tether.reconnect"),
        "the failed request's events leaked into this result"
    );
    assert_record_is_exactly_once(&store.load("b1").await.unwrap());
}

/// A request that ends before the tool uses of its last turn are sent back (a halt, the turn
/// limit) still answers every call in the provider's history: otherwise the next request's
/// history holds a tool call without an answer, which chat APIs refuse.
#[tokio::test]
async fn a_request_ending_with_unsent_tool_calls_still_answers_them_in_the_history() {
    // The turn guard halts after a turn that asked for a tool: the tool is not run.
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let h = ToolSet::new().tool(spec("echo"), move |_i: Value| {
        let c = c.clone();
        async move {
            c.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>("x".into())
        }
    });
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("a", "echo", r#"{"v":"1"}"#)])),
        Ok(ScriptedModel::text("next")),
    ]));
    let halted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hb = halted.clone();
    let mut s = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(h.clone())
        .turn_guard(move |_| {
            if hb.swap(true, Ordering::SeqCst) {
                GuardDecision::Continue
            } else {
                GuardDecision::Halt("budget".into())
            }
        })
        .open()
        .await
        .unwrap();
    let r = s.send("go").await.unwrap();
    assert_eq!(
        r.stop_reason,
        StopReason::Halted {
            reason: "budget".into()
        }
    );
    assert_eq!(
        json!(r.stop_reason),
        json!({"type": "halted", "reason": "budget"})
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    s.send("go on").await.unwrap();
    let msgs = &model.requests()[1].messages;
    let a = msgs
        .iter()
        .find(|m| m.tool_call_id.as_deref() == Some("a"))
        .expect("the halted call is answered");
    assert!(a.is_error && a.content.as_deref().unwrap().contains("halted"));

    // The turn limit ends the request after the tools ran: their results are kept.
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("b", "echo", r#"{"v":"2"}"#)])),
        Ok(ScriptedModel::text("next")),
    ]));
    let mut s = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(h)
        .max_turns(1)
        .open()
        .await
        .unwrap();
    let r = s.send("go").await.unwrap();
    assert_eq!(r.stop_reason, StopReason::MaxTurns);
    s.send("go on").await.unwrap();
    let msgs = &model.requests()[1].messages;
    let b = msgs
        .iter()
        .find(|m| m.tool_call_id.as_deref() == Some("b"))
        .expect("the answered call is in the history");
    assert_eq!(b.content.as_deref(), Some("x"));
}
