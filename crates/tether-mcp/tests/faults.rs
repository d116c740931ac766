//! Faults, with the fault server (`examples/fault_server.rs`, on rmcp's server side): a crash
//! mid-call, a hang past the timeout, malformed messages, a tool list that changes between turns,
//! two servers with one tool name, a denied tool, a refused approval, a server that never starts,
//! and a crash + resume that must not call a side-effecting tool twice.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::json;
use tether::local::LocalLoop;
use tether::source::{
    ApprovalRule, CallContext, Prefix, SourceOptions, ToolSource, ToolSources, ToolsError, WithTools,
};
use tether::{EventKind, Handler, ScriptedModel, Session, SessionInfo, SessionResult, ToolOutput, ToolUse};
use tether_mcp::{McpError, McpServer, ServerConfig};
use tether_testkit::openai::{FakeOpenAi, Reply};

fn cx() -> CallContext {
    CallContext::new(SessionInfo::new("s", "test"), Arc::new(tether::NoTools))
}

async fn call(s: &McpServer, name: &str, input: serde_json::Value) -> ToolOutput {
    s.call(&ToolUse::new("u", name, input), cx()).await
}

/// Waits until the server is running again under a newer connection than `after`.
async fn wait_restarted(s: &McpServer, after: u64) {
    let mut rx = s.tools_changed();
    tokio::time::timeout(LONG, async {
        while !(s.is_running() && s.generation() > after) {
            rx.changed().await.unwrap();
        }
    })
    .await
    .expect("the server is restarted");
}

/// Waits until `path` exists (a side effect of the server's, observed).
async fn wait_file(path: &Path) {
    tokio::time::timeout(LONG, async {
        while !path.exists() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{} never appeared", path.display()));
}

fn result_of(r: &SessionResult, id: &str) -> tether::ToolResult {
    r.events
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::ToolResult { result } if result.tool_use_id == id => Some(result.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no result for {id}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_call_is_a_tool_error_and_the_server_is_restarted() {
    let s = connect("f", fault(&[])).await;
    let g = s.generation();
    match call(&s, "crash", json!({})).await {
        ToolOutput::Error(m) => {
            assert!(
                m.contains("exited or dropped the connection") && m.contains("crash"),
                "{m}"
            );
            assert!(
                m.contains("crashing on purpose"),
                "the server's stderr is shown: {m}"
            );
        }
        o => panic!("{o:?}"),
    }
    wait_restarted(&s, g).await;
    assert_eq!(call(&s, "noop", json!({})).await, ToolOutput::Ok("ok".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_timeout_is_cancelled_at_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let flag = dir.path().join("cancelled");
    let cfg = ServerConfig::new("f", fault(&[("FAULT_CANCEL_FILE", flag.to_str().unwrap())]))
        .call_timeout(Duration::from_millis(500));
    let s = McpServer::connect(cfg).await.unwrap();
    match call(&s, "slow", json!({"secs": 600})).await {
        ToolOutput::Error(m) => assert!(
            m.contains("did not answer within") && m.contains("cancelled"),
            "{m}"
        ),
        o => panic!("{o:?}"),
    }
    // The server heard `notifications/cancelled` for that request.
    wait_file(&flag).await;
    // Only that call: the server answers pings, so it is not restarted.
    assert_eq!(call(&s, "noop", json!({})).await, ToolOutput::Ok("ok".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_server_is_restarted() {
    let cfg =
        ServerConfig::new("f", fault(&[("FAULT_HANG_ALL", "1")])).call_timeout(Duration::from_millis(500));
    let s = McpServer::connect(cfg).await.unwrap();
    let g = s.generation();
    assert!(
        matches!(call(&s, "hang", json!({})).await, ToolOutput::Error(m) if m.contains("did not answer"))
    );
    // It answers no ping either: it is taken down and started again.
    wait_restarted(&s, g).await;
    assert_eq!(call(&s, "noop", json!({})).await, ToolOutput::Ok("ok".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_call_sends_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let flag = dir.path().join("cancelled");
    let s = connect("f", fault(&[("FAULT_CANCEL_FILE", flag.to_str().unwrap())])).await;
    let running = call(&s, "slow", json!({"secs": 600}));
    // The call is dropped while the server works on it (as the engine drops a cancelled tool).
    assert!(
        tokio::time::timeout(Duration::from_millis(300), running)
            .await
            .is_err()
    );
    wait_file(&flag).await;
    assert_eq!(call(&s, "noop", json!({})).await, ToolOutput::Ok("ok".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_do_not_take_the_session_down() {
    let s = connect("f", fault(&[])).await;
    let g = s.generation();
    let out = tokio::time::timeout(LONG, call(&s, "malformed", json!({})))
        .await
        .expect("the call ends");
    // rmcp may skip the line or drop the connection: either way the call is answered, never hung.
    match &out {
        ToolOutput::Ok(t) => assert_eq!(t, "after garbage"),
        ToolOutput::Error(m) => assert!(m.contains("MCP server `f`"), "{m}"),
        o => panic!("{o:?}"),
    }
    if !s.is_running() {
        wait_restarted(&s, g).await;
    }
    assert_eq!(call(&s, "noop", json!({})).await, ToolOutput::Ok("ok".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_list_that_changes_is_declared_on_the_next_turn() {
    let s = connect("f", fault(&[])).await;
    let sources = ToolSources::new()
        .add(s.clone(), SourceOptions::new("f"))
        .unwrap();
    let fake = FakeOpenAi::start().await;
    fake.push_all([
        Reply::tool_calls(&[("g1", "grow", "{}")]),
        Reply::tool_calls(&[("g2", "echo", r#"{"text":"x"}"#)]),
        Reply::text("done"),
    ]);
    let model = tether_openai::OpenAiModel::builder(fake.url())
        .model("m")
        .build()
        .unwrap();
    let r = Session::builder(LocalLoop::new(model))
        .handler(WithTools::new(tether::NoTools, sources).unwrap())
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.text, "done");
    let declared = |i: usize| -> Vec<String> {
        fake.requests()[i].body["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
            .collect()
    };
    assert!(!declared(0).contains(&"grown".to_owned()));
    assert!(declared(1).contains(&"grown".to_owned()), "{:?}", declared(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_with_one_tool_name_need_a_prefix() {
    let a = connect("a", fault(&[("FAULT_TAG", "from a: ")])).await;
    let b = connect("b", fault(&[("FAULT_TAG", "from b: ")])).await;
    let plain = ToolSources::new()
        .add(a.clone(), SourceOptions::new("a"))
        .unwrap()
        .add(b.clone(), SourceOptions::new("b"))
        .unwrap();
    match WithTools::new(tether::NoTools, plain) {
        Err(ToolsError::Collision { name, first, second }) => {
            assert_eq!(name, "noop");
            assert!(
                first.contains("`a`") && second.contains("`b`"),
                "{first} / {second}"
            );
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a collision must be a configuration error"),
    }
    let prefixed = ToolSources::new()
        .add(a, SourceOptions::new("a").prefix(Prefix::OnCollision))
        .unwrap()
        .add(b, SourceOptions::new("b").prefix(Prefix::OnCollision))
        .unwrap();
    let h = WithTools::new(tether::NoTools, prefixed).unwrap();
    let names: Vec<String> = h.tools().into_iter().map(|t| t.name).collect();
    assert!(
        names.contains(&"a__echo".into()) && names.contains(&"b__echo".into()),
        "{names:?}"
    );
    let info = SessionInfo::new("s", "t");
    let out = h
        .call_tool(&ToolUse::new("1", "b__echo", json!({"text": "x"})), &info)
        .await;
    assert_eq!(out, ToolOutput::Ok("from b: x".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_tool_is_not_offered_nor_called() {
    let dir = tempfile::tempdir().unwrap();
    let count = dir.path().join("count");
    let s = connect("f", fault(&[("FAULT_COUNT_FILE", count.to_str().unwrap())])).await;
    let sources = ToolSources::new()
        .add(s, SourceOptions::new("f").deny(["count", "cr*"]))
        .unwrap();
    let fake = FakeOpenAi::start().await;
    fake.push_all([Reply::tool_calls(&[("d1", "count", "{}")]), Reply::text("done")]);
    let model = tether_openai::OpenAiModel::builder(fake.url())
        .model("m")
        .build()
        .unwrap();
    let r = Session::builder(LocalLoop::new(model))
        .handler(WithTools::new(tether::NoTools, sources).unwrap())
        .run("go")
        .await
        .unwrap();
    let d1 = result_of(&r, "d1");
    assert!(d1.is_error, "{d1:?}");
    let offered = fake.requests()[0].body["tools"].to_string();
    assert!(!offered.contains("\"count\"") && !offered.contains("\"crash\"") && offered.contains("\"noop\""));
    assert!(!count.exists(), "a denied tool must never reach the server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_approval_never_calls_the_tool() {
    let dir = tempfile::tempdir().unwrap();
    let count = dir.path().join("count");
    let s = connect("f", fault(&[("FAULT_COUNT_FILE", count.to_str().unwrap())])).await;
    let sources = ToolSources::new()
        .add(
            s,
            SourceOptions::new("f").approval(ApprovalRule::Tools(vec!["count".into()])),
        )
        .unwrap();
    // NoTools answers every permission request with a refusal.
    let h = WithTools::new(tether::NoTools, sources).unwrap();
    let info = SessionInfo::new("s", "t");
    match h.call_tool(&ToolUse::new("1", "count", json!({})), &info).await {
        ToolOutput::Error(m) => assert!(m.contains("refused") && m.contains("not run"), "{m}"),
        o => panic!("{o:?}"),
    }
    assert!(!count.exists());
    // A tool without approval runs.
    assert_eq!(
        h.call_tool(&ToolUse::new("2", "noop", json!({})), &info).await,
        ToolOutput::Ok("ok".into())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_starts_is_a_clear_error() {
    let e = McpServer::connect(ServerConfig::new("f", fault(&[("FAULT_FAIL_START", "1")])))
        .await
        .unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, McpError::Start { .. }));
    assert!(
        m.contains("MCP server `f`") && m.contains("fault_server"),
        "names the command: {m}"
    );
    assert!(m.contains("refusing to start"), "shows its stderr: {m}");

    let e = McpServer::connect(ServerConfig::new(
        "g",
        tether_mcp::Transport::Stdio {
            command: "/nonexistent/mcp-server".into(),
            args: vec![],
            env: vec![],
            cwd: None,
        },
    ))
    .await
    .unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("/nonexistent/mcp-server") && m.contains("cannot run"),
        "{m}"
    );
}

/// A side-effecting MCP tool is called once, even when the process stops after the call and the
/// session is resumed from its SQLite record: the engine answers the redelivered call from the
/// memo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_after_a_crash_does_not_call_a_side_effecting_tool_twice() {
    let dir = tempfile::tempdir().unwrap();
    let count = dir.path().join("count");
    let db = dir.path().join("t.db");
    let run = |model: Arc<ScriptedModel>| {
        let count = count.clone();
        let db = db.clone();
        async move {
            let s = connect("f", fault(&[("FAULT_COUNT_FILE", count.to_str().unwrap())])).await;
            let sources = ToolSources::new().add(s, SourceOptions::new("f")).unwrap();
            let store = Arc::new(tether_sqlite::SqliteStore::open(&db).unwrap());
            Session::builder(LocalLoop::with_model(model).session_id("thread-1"))
                .handler(WithTools::new(tether::NoTools, sources).unwrap())
                .store(store)
                .run("go")
                .await
        }
    };
    // 1. The tool runs, then the model call after it fails: the run dies with the result recorded.
    let first = run(Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("k1", "count", "{}")])),
        Err(tether::Error::malformed("the process died here")),
    ])))
    .await;
    assert!(first.is_err());
    assert_eq!(std::fs::read_to_string(&count).unwrap().lines().count(), 1);
    // 2. A new process (a new server, a reopened store) is handed the same call again.
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("k1", "count", "{}")])),
        Ok(ScriptedModel::text("done")),
    ]));
    let second = run(model.clone()).await.unwrap();
    assert_eq!(second.text, "done");
    assert_eq!(
        std::fs::read_to_string(&count).unwrap().lines().count(),
        1,
        "the MCP tool must not run twice"
    );
    // The model was answered with the recorded result.
    let reqs = model.requests();
    let answered: Vec<String> = reqs[1]
        .messages
        .iter()
        .filter(|m| m.tool_call_id.as_deref() == Some("k1"))
        .filter_map(|m| m.content.clone())
        .collect();
    assert_eq!(answered, vec!["count 1".to_owned()]);
}
