//! Tool uses from a model are hostile: ids reused for different calls, ids shared inside one
//! turn, empty or unknown tool names. Each call gets its own answer, and none is answered with
//! another call's result.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tether::local::LocalLoop;
use tether::{
    EventKind, EventStore, Input, MemoryStore, Opened, Provider, ScriptedModel, Session, Terminal,
    ToolResult, ToolSet, ToolSpec, ToolUse, TurnContext, TurnResult,
};

fn spec(name: &str) -> ToolSpec {
    ToolSpec::new(name, name, json!({"type": "object"}))
}

fn results_of(events: &[impl std::borrow::Borrow<tether::Event>]) -> Vec<ToolResult> {
    events
        .iter()
        .map(std::borrow::Borrow::borrow)
        .filter_map(|e| match &e.kind {
            EventKind::ToolResult { result } => Some(result.clone()),
            _ => None,
        })
        .collect()
}

/// `echo` answers its `v`; `touch` creates the file it names (the side effect under test).
fn tools(dir: &std::path::Path, calls: Arc<AtomicU32>) -> ToolSet {
    let dir = dir.to_owned();
    let c = calls.clone();
    ToolSet::new()
        .tool(spec("echo"), move |input: Value| {
            c.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, String>(input["v"].as_str().unwrap_or_default().to_owned()) }
        })
        .tool(spec("touch"), move |input: Value| {
            calls.fetch_add(1, Ordering::SeqCst);
            let path = dir.join(input["name"].as_str().unwrap_or("unnamed"));
            async move {
                std::fs::write(&path, b"").map_err(|e| e.to_string())?;
                Ok::<_, String>(format!("created {}", path.display()))
            }
        })
}

/// Issue 11, defect 8: turn 1 runs `dup` = `echo safe`; turn 2 emits `dup` = `touch PWNED_DUP`.
/// The second call was never run, the model was told "safe", nothing was recorded, and the run
/// ended in success. Now the second call runs, the model gets its own result under the id it
/// used, and both results are in the record.
#[tokio::test]
async fn a_reused_tool_call_id_runs_the_new_call() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let store = Arc::new(MemoryStore::default());
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("dup", "echo", r#"{"v":"safe"}"#)])),
        Ok(ScriptedModel::tool_calls(&[(
            "dup",
            "touch",
            r#"{"name":"PWNED_DUP"}"#,
        )])),
        Ok(ScriptedModel::text("done")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()).session_id("d1"))
        .handler(tools(dir.path(), calls.clone()))
        .store(store.clone())
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.terminal, Terminal::EndTurn);
    assert!(r.pending_tool_uses.is_empty());
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the second call must run");
    assert!(dir.path().join("PWNED_DUP").exists());
    // The model is told what the second call did, under the id it used.
    let third = &model.requests()[2].messages;
    let answers: Vec<_> = third
        .iter()
        .filter(|m| m.tool_call_id.as_deref() == Some("dup"))
        .map(|m| m.content.clone().unwrap_or_default())
        .collect();
    assert_eq!(answers.len(), 2);
    assert_eq!(answers[0], "safe");
    assert!(answers[1].starts_with("created"), "{answers:?}");
    // Both results are in the record, and both uses in the result.
    let recorded = results_of(&store.load("d1").await.unwrap());
    assert_eq!(recorded.len(), 2, "{recorded:?}");
    assert!(recorded.iter().all(|r| r.tool_use_id == "dup"));
    assert_eq!(r.tool_uses.len(), 2);
    assert_eq!(r.tool_uses[1].name, "touch");
}

/// A provider replaying scripted turns and keeping every input it gets.
struct Script {
    turns: Vec<TurnResult>,
    inputs: Arc<Mutex<Vec<Input>>>,
    pending: Vec<ToolUse>,
}

impl Script {
    fn new(turns: Vec<TurnResult>) -> (Self, Arc<Mutex<Vec<Input>>>) {
        let inputs = Arc::new(Mutex::new(Vec::new()));
        (
            Script {
                turns,
                inputs: inputs.clone(),
                pending: Vec::new(),
            },
            inputs,
        )
    }
}

#[async_trait::async_trait]
impl Provider for Script {
    fn name(&self) -> &str {
        "script"
    }
    async fn open(&mut self, _cx: &TurnContext) -> tether::Result<Opened> {
        Ok({
            let mut o = Opened::new("p1").with_pending(std::mem::take(&mut self.pending));
            o.resumed = !self.pending.is_empty();
            o
        })
    }
    async fn turn(&mut self, input: Input, _cx: &TurnContext) -> tether::Result<TurnResult> {
        self.inputs.lock().unwrap().push(input);
        if self.turns.is_empty() {
            let mut tr = TurnResult::new(Terminal::EndTurn, json!("end_turn"));
            tr.text = "end".into();
            return Ok(tr);
        }
        Ok(self.turns.remove(0))
    }
}

fn asks(uses: Vec<ToolUse>) -> TurnResult {
    let mut tr = TurnResult::new(Terminal::RequiresAction, json!("tool_use"));
    tr.tool_uses = uses;
    tr
}

/// Calls of one turn that share an id but differ are all refused (none runs: an answer or an
/// approval for that id could not say which call it meant), each with its own error result; an
/// exact repeat of a call runs once and both get its result. The old engine kept the first and
/// dropped the second, so the provider got one answer for two calls.
#[tokio::test]
async fn calls_sharing_an_id_in_one_turn_are_refused_and_exact_repeats_run_once() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let (p, inputs) = Script::new(vec![
        asks(vec![
            ToolUse::new("x", "echo", json!({"v": "harmless"})),
            ToolUse::new("x", "touch", json!({"name": "SHARED_ID"})),
            ToolUse::new("y", "echo", json!({"v": "once"})),
            ToolUse::new("y", "echo", json!({"v": "once"})),
        ]),
        TurnResult::new(Terminal::EndTurn, json!("end_turn")),
    ]);
    let r = Session::builder(p)
        .handler(tools(dir.path(), calls.clone()))
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.terminal, Terminal::EndTurn);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "only `y` runs, once");
    assert!(!dir.path().join("SHARED_ID").exists());
    let inputs = inputs.lock().unwrap().clone();
    let Input::ToolResults(answered) = &inputs[1] else {
        panic!("expected tool results, got {:?}", inputs[1]);
    };
    let uses: Vec<_> = answered.iter().map(|a| &a.tool_use).collect();
    let results: Vec<_> = answered.iter().map(|a| a.result.clone()).collect();
    assert_eq!(uses.len(), 4);
    assert_eq!(results.len(), 4, "one answer per call");
    for r in &results[..2] {
        assert_eq!(r.tool_use_id, "x");
        assert!(r.is_error && r.content.contains("share the id `x`"), "{r:?}");
    }
    assert_eq!(results[2], ToolResult::ok("y", "once"));
    assert_eq!(results[3], ToolResult::ok("y", "once"));
    // The record holds one result per distinct call (the exact repeat is the same tool use).
    assert_eq!(results_of(&r.events).len(), 3);
}

/// A call with an empty name or an unknown name becomes that call's error result, listing the
/// available tools, without reaching the handler; the other calls run, and a front-end tool the
/// handler declares still pauses the request as pending.
#[tokio::test]
async fn empty_and_unknown_tool_names_are_that_calls_error() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let reached = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = reached.clone();
    let handler = tools(dir.path(), calls.clone())
        .pending_tool(spec("confirm"))
        .on_event(|_, _| {});
    // Wraps the tool set to see every name that reaches it.
    struct Spy(ToolSet, Arc<Mutex<Vec<String>>>);
    #[async_trait::async_trait]
    impl tether::Handler for Spy {
        fn tools(&self) -> Vec<ToolSpec> {
            self.0.tools()
        }
        async fn call_tool(&self, call: &ToolUse, info: &tether::SessionInfo) -> tether::ToolOutput {
            self.1.lock().unwrap().push(call.name.clone());
            self.0.call_tool(call, info).await
        }
    }
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[
            ("e1", "", "{}"),
            ("u1", "rm_rf\u{1b}[2K", "{}"),
            ("ok", "echo", r#"{"v":"fine"}"#),
            ("c1", "confirm", "{}"),
        ])),
        Ok(ScriptedModel::text("after")),
    ]));
    let mut s = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(Spy(handler, seen))
        .open()
        .await
        .unwrap();
    let r = s.send("go").await.unwrap();
    assert_eq!(
        r.terminal,
        Terminal::RequiresAction,
        "the front-end tool pauses the run"
    );
    assert_eq!(r.pending_tool_uses.len(), 1);
    assert_eq!(r.pending_tool_uses[0].id, "c1");
    assert_eq!(
        *reached.lock().unwrap(),
        vec!["echo".to_owned(), "confirm".to_owned()],
        "calls with an empty or unknown name never reach the handler"
    );
    let results = results_of(&r.events);
    let empty = results.iter().find(|r| r.tool_use_id == "e1").unwrap();
    assert!(
        empty.is_error && empty.content.contains("no tool name"),
        "{empty:?}"
    );
    assert!(empty.content.contains("`echo`") && empty.content.contains("`confirm`"));
    let unknown = results.iter().find(|r| r.tool_use_id == "u1").unwrap();
    assert!(
        unknown.is_error && unknown.content.contains("no tool named"),
        "{unknown:?}"
    );
    assert!(
        !unknown.content.contains('\u{1b}'),
        "a model's name is shown escaped: {unknown:?}"
    );
    assert!(unknown.content.contains("`touch`"));
    let r = s
        .submit_tool_results(vec![ToolResult::ok("c1", "yes")], Default::default())
        .await
        .unwrap();
    assert_eq!(r.text, "after");
    let ids: Vec<_> = model.requests()[1]
        .messages
        .iter()
        .filter_map(|m| m.tool_call_id.clone())
        .collect();
    assert_eq!(ids, ["e1", "u1", "ok", "c1"], "every call answered, in order");
}

/// A redelivered tool use (same id, name and arguments: a reconnect, a reattach) is answered
/// from the memo and not run twice; a use with that id and other arguments is run.
#[tokio::test]
async fn the_memo_answers_only_the_same_tool_use() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let store = Arc::new(MemoryStore::default());
    let first = ToolUse::new("t", "echo", json!({"v": "one"}));
    let (p, _) = Script::new(vec![asks(vec![first.clone()])]);
    Session::builder(p)
        .handler(tools(dir.path(), calls.clone()))
        .store(store.clone())
        .run("go")
        .await
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // Reattached, waiting on the same use (keys in another order: the same arguments).
    let same = ToolUse::from_arguments("t", "echo", r#"{ "v" : "one" }"#);
    let (mut p, inputs) = Script::new(vec![]);
    p.pending = vec![same];
    let mut s = Session::builder(p)
        .handler(tools(dir.path(), calls.clone()))
        .store(store.clone())
        .open()
        .await
        .unwrap();
    s.resume(Default::default()).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1, "a redelivery is not run again");
    let Input::ToolResults(rs) = inputs.lock().unwrap()[0].clone() else {
        panic!("expected results");
    };
    let rs: Vec<ToolResult> = rs.into_iter().map(|a| a.result).collect();
    assert_eq!(rs[0], ToolResult::ok("t", "one"));

    // Reattached, waiting on a use with the same id and other arguments: it runs.
    let other = ToolUse::new("t", "echo", json!({"v": "two"}));
    let (mut p, inputs) = Script::new(vec![]);
    p.pending = vec![other];
    let mut s = Session::builder(p)
        .handler(tools(dir.path(), calls.clone()))
        .store(store.clone())
        .open()
        .await
        .unwrap();
    s.resume(Default::default()).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let Input::ToolResults(rs) = inputs.lock().unwrap()[0].clone() else {
        panic!("expected results");
    };
    let rs: Vec<ToolResult> = rs.into_iter().map(|a| a.result).collect();
    assert_eq!(rs[0], ToolResult::ok("t", "two"));
    assert_eq!(results_of(&store.load("p1").await.unwrap()).len(), 2);
}

/// An answer the application stored for a pending use under its bare id (an approval's denial,
/// as `tether serve` writes it) is taken when the session resumes, and the tool does not run.
#[tokio::test]
async fn an_answer_stored_by_id_for_a_pending_use_is_taken_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let store = Arc::new(MemoryStore::default());
    store
        .put_tool_result("p1", &ToolResult::error("w", "the user denied this action"))
        .await
        .unwrap();
    let (mut p, inputs) = Script::new(vec![]);
    p.pending = vec![ToolUse::new("w", "touch", json!({"name": "DENIED"}))];
    let mut s = Session::builder(p)
        .handler(tools(dir.path(), calls.clone()))
        .store(store.clone())
        .open()
        .await
        .unwrap();
    s.resume(Default::default()).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(!dir.path().join("DENIED").exists());
    let Input::ToolResults(rs) = inputs.lock().unwrap()[0].clone() else {
        panic!("expected results");
    };
    let rs: Vec<ToolResult> = rs.into_iter().map(|a| a.result).collect();
    assert!(rs[0].is_error && rs[0].content.contains("denied"));

    // A fresh turn reusing that id is not answered by it.
    let (p, _) = Script::new(vec![asks(vec![ToolUse::new(
        "w",
        "touch",
        json!({"name": "FRESH"}),
    )])]);
    Session::builder(p)
        .handler(tools(dir.path(), calls.clone()))
        .store(store.clone())
        .run("again")
        .await
        .unwrap();
    assert!(dir.path().join("FRESH").exists());
}

/// A model that names a call after another call's memo key is not answered with that call's
/// result when the session resumes it (bare-id answers are for ids, not keys).
#[tokio::test]
async fn an_id_shaped_like_a_memo_key_is_not_answered_by_that_key() {
    let dir = tempfile::tempdir().unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let store = Arc::new(MemoryStore::default());
    let first = ToolUse::new("a", "echo", json!({"v": "safe"}));
    let (p, _) = Script::new(vec![asks(vec![first.clone()])]);
    Session::builder(p)
        .handler(tools(dir.path(), calls.clone()))
        .store(store.clone())
        .run("go")
        .await
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let forged = ToolUse::new(first.memo_key(), "touch", json!({"name": "FORGED"}));
    let (mut p, inputs) = Script::new(vec![]);
    p.pending = vec![forged];
    let mut s = Session::builder(p)
        .handler(tools(dir.path(), calls.clone()))
        .store(store.clone())
        .open()
        .await
        .unwrap();
    s.resume(Default::default()).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the forged call runs");
    assert!(dir.path().join("FORGED").exists());
    let Input::ToolResults(rs) = inputs.lock().unwrap()[0].clone() else {
        panic!("expected results");
    };
    let rs: Vec<ToolResult> = rs.into_iter().map(|a| a.result).collect();
    assert!(rs[0].content.starts_with("created"), "{rs:?}");
}
