//! The Managed Agents provider against the scripted fake over real HTTP.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use async_trait::async_trait;
use serde_json::{Value, json};
use tether::{
    Error, Handler, PermissionOutcome, PermissionRequest, RecordingSleeper, RetryPolicy, Session,
    SessionConfig, SessionInfo, SessionResult, Terminal, ToolOutput, ToolSet, ToolSpec, ToolUse,
};
use tether_anthropic::{ClientConfig, ManagedAgents, ManagedConfig};
use tether_testkit::managed::{FakeManaged, ManagedFaults, golden};

fn lookup() -> ToolSpec {
    ToolSpec::new(
        "lookup",
        "Look a key up",
        json!({"type":"object","properties":{"q":{"type":"string"}},"required":["q"]}),
    )
}

fn counting_tools(calls: Arc<AtomicU32>) -> ToolSet {
    ToolSet::new().tool(lookup(), move |input: Value| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>(format!("value of {}", input["q"].as_str().unwrap_or("?")))
        }
    })
}

/// The tool round trip: a custom tool use, then the answer.
fn tool_turns() -> Vec<Vec<Value>> {
    let v = golden("tool_round_trip.json");
    v.as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.as_array().cloned().unwrap_or_default())
        .collect()
}

fn provider(fake: &FakeManaged) -> ManagedAgents {
    let cfg = ManagedConfig::new(
        ClientConfig::new("sk-test").base_url(fake.url()),
        "agent_1",
        "env_1",
    );
    ManagedAgents::new(cfg).expect("provider")
}

fn config(sleeper: &RecordingSleeper) -> SessionConfig {
    SessionConfig::default().with_reconnect(
        RetryPolicy::default()
            .with_backoff(
                std::time::Duration::from_millis(500),
                std::time::Duration::from_secs(64),
            )
            .with_max_retries(8)
            .with_jitter(false)
            .with_sleeper(sleeper.clone()),
    )
}

/// Every event id once, sequence numbers 1..=n without gaps, and every event of the fake's log
/// present exactly once.
fn assert_exactly_once(result: &SessionResult, log: &[Value]) {
    let mut ids = HashSet::new();
    for (i, e) in result.events.iter().enumerate() {
        assert!(ids.insert(e.id.clone()), "duplicate event id {}", e.id);
        assert_eq!(e.seq, Some(i as u64 + 1), "gap or disorder at {}", e.id);
    }
    for ev in log {
        let id = ev["id"].as_str().unwrap_or_default();
        assert!(
            ids.contains(id),
            "event {id} ({}) missing from the record",
            ev["type"]
        );
    }
}

async fn run_round_trip(faults: ManagedFaults) -> (FakeManaged, SessionResult, u32, RecordingSleeper) {
    let fake = FakeManaged::start(tool_turns(), faults).await;
    let calls = Arc::new(AtomicU32::new(0));
    let sleeper = RecordingSleeper::default();
    let result = Session::builder(provider(&fake))
        .handler(counting_tools(calls.clone()))
        .config(config(&sleeper))
        .run("What is x?")
        .await
        .expect("run");
    (fake, result, calls.load(Ordering::SeqCst), sleeper)
}

fn posted_results(fake: &FakeManaged) -> Vec<Value> {
    fake.posted()
        .into_iter()
        .filter(|e| e["type"] == "user.custom_tool_result")
        .collect()
}

#[tokio::test]
async fn tool_round_trip() {
    let (fake, result, calls, sleeper) = run_round_trip(ManagedFaults::default()).await;
    assert_eq!(result.terminal, Terminal::EndTurn);
    assert_eq!(result.text, "x is 42.");
    assert_eq!(calls, 1);
    let posted = posted_results(&fake);
    assert_eq!(posted.len(), 1);
    assert_eq!(posted[0]["content"][0]["text"], "value of x");
    assert_eq!(posted[0]["is_error"], false);
    assert_eq!(fake.posted()[0]["type"], "user.message");
    assert_eq!(result.usage.input_tokens, 30);
    assert_eq!(result.usage.output_tokens, 12);
    assert!(sleeper.slept().is_empty());
    assert_eq!(fake.stream_opens(), 1);
    let log = fake.log(&result.session_id);
    assert_exactly_once(&result, &log);
}

#[tokio::test]
async fn requires_action_in_the_nested_shape() {
    let (fake, result, calls, _) = run_round_trip(ManagedFaults {
        nested_requires_action: true,
        ..ManagedFaults::default()
    })
    .await;
    assert_eq!(result.terminal, Terminal::EndTurn);
    assert_eq!(calls, 1);
    assert_eq!(posted_results(&fake).len(), 1);
    let idle = fake
        .log(&result.session_id)
        .into_iter()
        .find(|e| e["stop_reason"]["type"] == "requires_action")
        .expect("idle");
    assert!(idle["stop_reason"]["requires_action"]["event_ids"].is_array());
    assert!(idle["stop_reason"].get("event_ids").is_none());
}

#[tokio::test]
async fn a_stream_dropped_after_the_tool_use_reconnects_and_runs_it_once() {
    let (fake, result, calls, sleeper) = run_round_trip(ManagedFaults {
        drop_after: Some("agent.custom_tool_use".into()),
        page_size: Some(2),
        ..ManagedFaults::default()
    })
    .await;
    assert_eq!(result.terminal, Terminal::EndTurn);
    assert_eq!(result.text, "x is 42.");
    assert_eq!(calls, 1, "the tool ran once");
    assert_eq!(posted_results(&fake).len(), 1, "its result was sent once");
    assert_eq!(fake.stream_opens(), 2);
    assert_eq!(sleeper.slept(), vec![std::time::Duration::from_millis(500)]);
    let history_pages = fake
        .requests()
        .iter()
        .filter(|(m, p)| m == "GET" && p.ends_with("/events"))
        .count();
    assert!(history_pages >= 3, "history was paged: {history_pages}");
    let log = fake.log(&result.session_id);
    assert_exactly_once(&result, &log);
    assert!(result.events.iter().any(|e| e.raw_type == "tether.reconnect"));
}

#[tokio::test]
async fn events_delivered_twice_are_recorded_once() {
    let (fake, result, calls, _) = run_round_trip(ManagedFaults {
        duplicate: true,
        ..ManagedFaults::default()
    })
    .await;
    assert_eq!(calls, 1);
    assert_eq!(posted_results(&fake).len(), 1);
    assert_eq!(result.text, "x is 42.");
    let log = fake.log(&result.session_id);
    assert_exactly_once(&result, &log);
    let from_fake = result.events.iter().filter(|e| e.id.starts_with("sevt_")).count();
    assert_eq!(from_fake, log.len());
}

#[tokio::test]
async fn a_repeated_history_cursor_ends_paging() {
    let (fake, result, calls, _) = run_round_trip(ManagedFaults {
        drop_after: Some("agent.custom_tool_use".into()),
        page_size: Some(3),
        repeat_cursor: true,
        ..ManagedFaults::default()
    })
    .await;
    assert_eq!(result.terminal, Terminal::EndTurn);
    assert_eq!(calls, 1);
    assert_eq!(posted_results(&fake).len(), 1);
}

#[tokio::test]
async fn a_401_on_reconnect_ends_the_session_without_retrying() {
    let fake = FakeManaged::start(
        tool_turns(),
        ManagedFaults {
            drop_after: Some("agent.custom_tool_use".into()),
            stream_statuses: vec![200, 401],
            ..ManagedFaults::default()
        },
    )
    .await;
    let sleeper = RecordingSleeper::default();
    let calls = Arc::new(AtomicU32::new(0));
    let err = Session::builder(provider(&fake))
        .handler(counting_tools(calls.clone()))
        .config(config(&sleeper))
        .run("What is x?")
        .await
        .expect_err("401");
    assert!(matches!(err, Error::Http { status: 401, .. }), "{err:?}");
    assert_eq!(fake.stream_opens(), 2, "no retry after the 401");
    assert_eq!(
        sleeper.slept().len(),
        1,
        "one backoff before the reconnect, none after the 401"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_401_at_open_is_not_retried() {
    let fake = FakeManaged::start(tool_turns(), ManagedFaults::default()).await;
    let cfg = ManagedConfig::new(
        ClientConfig::new("bad-key").base_url(fake.url()),
        "agent_1",
        "env_1",
    );
    let err = Session::builder(ManagedAgents::new(cfg).expect("provider"))
        .run("hi")
        .await
        .expect_err("401");
    assert_eq!(err.code(), "auth");
    assert!(
        fake.requests().is_empty(),
        "nothing was created and nothing retried"
    );
}

/// A handler that allows built-in tool confirmations and records them.
struct Confirming {
    asked: Arc<AtomicU32>,
}

#[async_trait]
impl Handler for Confirming {
    fn tools(&self) -> Vec<ToolSpec> {
        vec![lookup()]
    }
    async fn call_tool(&self, _call: &ToolUse, _info: &SessionInfo) -> ToolOutput {
        ToolOutput::Ok("v".into())
    }
    async fn request_permission(&self, req: &PermissionRequest, _info: &SessionInfo) -> PermissionOutcome {
        self.asked.fetch_add(1, Ordering::SeqCst);
        assert_eq!(req.title, "bash");
        PermissionOutcome::Selected {
            option_id: "allow_once".into(),
        }
    }
}

#[tokio::test]
async fn tool_confirmations_go_to_the_handler() {
    let turns = vec![
        vec![
            json!({"type": "agent.tool_use", "name": "bash", "input": {"command": "ls"}, "needs_confirmation": true}),
            json!({"type": "session.status_idle", "stop_reason": {"type": "requires_action"}}),
        ],
        vec![
            json!({"type": "agent.tool_result", "tool_use_id": "x", "content": [{"type": "text", "text": "a.txt"}]}),
            json!({"type": "agent.message", "content": [{"type": "text", "text": "one file"}]}),
            json!({"type": "session.status_idle", "stop_reason": {"type": "end_turn"}}),
        ],
    ];
    let fake = FakeManaged::start(turns, ManagedFaults::default()).await;
    let asked = Arc::new(AtomicU32::new(0));
    let result = Session::builder(provider(&fake))
        .handler(Confirming { asked: asked.clone() })
        .run("list files")
        .await
        .expect("run");
    assert_eq!(result.text, "one file");
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    let conf: Vec<Value> = fake
        .posted()
        .into_iter()
        .filter(|e| e["type"] == "user.tool_confirmation")
        .collect();
    assert_eq!(conf.len(), 1);
    assert_eq!(conf[0]["result"], "allow");
    assert_eq!(result.server_tool_uses.len(), 1);
}

#[tokio::test]
async fn terminal_stop_reasons_end_the_turn_terminated() {
    for reason in ["retries_exhausted", "budget_reached"] {
        let turns = vec![vec![
            json!({"type": "session.error", "error": {"type": "model_overloaded_error", "message": "busy", "retry_status": {"type": "retrying"}}}),
            json!({"type": "session.status_idle", "stop_reason": {"type": reason}}),
        ]];
        let fake = FakeManaged::start(turns, ManagedFaults::default()).await;
        let result = Session::builder(provider(&fake)).run("hi").await.expect("run");
        assert_eq!(result.terminal, Terminal::Terminated, "{reason}");
        assert_eq!(result.stop_reason.to_value()["type"], reason);
    }
}

#[tokio::test]
async fn outcomes_are_posted_as_define_outcome() {
    let turns = vec![vec![
        json!({"type": "span.outcome_evaluation_end", "result": "satisfied"}),
        json!({"type": "agent.message", "content": [{"type": "text", "text": "done"}]}),
        json!({"type": "session.status_idle", "stop_reason": {"type": "satisfied"}}),
    ]];
    let fake = FakeManaged::start(turns, ManagedFaults::default()).await;
    let mut p = provider(&fake);
    // Drive the provider directly: the engine's `send` takes text, outcomes are raw inputs.
    let sink = tether::EventSink::new(
        SessionInfo::new("", "managed"),
        Arc::new(tether::NoTools),
        Arc::new(tether::MemoryStore::default()),
    );
    let cx = tether::TurnContext::new(sink, Arc::new(tether::NoTools)).with_turn(1, 10);
    use tether::Provider;
    p.open(&cx).await.expect("open");
    let tr = p
        .turn(
            ManagedAgents::define_outcome("write a haiku", "- 3 lines", Some(2)),
            &cx,
        )
        .await
        .expect("turn");
    assert_eq!(tr.terminal, Terminal::EndTurn);
    assert_eq!(tr.text, "done");
    let posted = fake.posted();
    assert_eq!(posted[0]["type"], "user.define_outcome");
    assert_eq!(
        posted[0]["rubric"],
        json!({"type": "text", "content": "- 3 lines"})
    );
    assert_eq!(posted[0]["max_iterations"], 2);
}

#[tokio::test]
async fn reattach_reports_unanswered_tool_uses_and_resumes() {
    let turns = vec![vec![
        json!({"type": "agent.message", "content": [{"type": "text", "text": "resumed"}]}),
        json!({"type": "session.status_idle", "stop_reason": {"type": "end_turn"}}),
    ]];
    let fake = FakeManaged::start(turns, ManagedFaults::default()).await;
    let history = vec![
        json!({"id": "sevt_old1", "type": "user.message", "content": [{"type": "text", "text": "q"}]}),
        json!({"id": "sevt_old2", "type": "agent.custom_tool_use", "name": "lookup", "input": {"q": "y"}}),
        json!({"id": "sevt_old3", "type": "session.status_idle", "stop_reason": {"type": "requires_action", "event_ids": ["sevt_old2"]}}),
    ];
    let sid = fake.seed_session(history, &["sevt_old2"]);
    let cfg = ManagedConfig::reattach(ClientConfig::new("sk-test").base_url(fake.url()), sid.clone());
    let calls = Arc::new(AtomicU32::new(0));
    let mut session = Session::builder(ManagedAgents::new(cfg).expect("provider"))
        .handler(counting_tools(calls.clone()))
        .open()
        .await
        .expect("open");
    assert!(session.opened().resumed);
    assert_eq!(session.opened().pending.len(), 1);
    let result = session
        .resume(tokio_util::sync::CancellationToken::new())
        .await
        .expect("resume");
    assert_eq!(result.text, "resumed");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(posted_results(&fake).len(), 1);
    assert!(result.events.iter().all(|e| !e.id.starts_with("sevt_old")));
}

/// Against the real service: `cargo test -p tether-anthropic --test managed -- --ignored` with
/// ANTHROPIC_API_KEY, TETHER_MANAGED_AGENT_ID and TETHER_MANAGED_ENVIRONMENT_ID set. Without
/// them it fails, saying which is missing.
#[tokio::test]
#[ignore = "live: needs ANTHROPIC_API_KEY, TETHER_MANAGED_AGENT_ID, TETHER_MANAGED_ENVIRONMENT_ID; run with --ignored"]
async fn live_managed_round_trip() {
    let need = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| panic!("this live test needs {name} in the environment"))
    };
    let cfg = ClientConfig::from_env()
        .unwrap_or_else(|e| panic!("this live test needs ANTHROPIC_API_KEY in the environment: {e}"));
    let (agent, env) = (
        need("TETHER_MANAGED_AGENT_ID"),
        need("TETHER_MANAGED_ENVIRONMENT_ID"),
    );
    let p = ManagedAgents::new(ManagedConfig::new(cfg, agent, env)).expect("provider");
    let result = Session::builder(p)
        .run("Reply with the single word: pong")
        .await
        .expect("live run");
    assert_eq!(result.terminal, Terminal::EndTurn);
}

/// A turn that never reaches a boundary: the agent says something, then nothing more.
fn stalled_then_answer() -> Vec<Vec<Value>> {
    vec![
        vec![json!({"type": "agent.message", "content": [{"type": "text", "text": "working on it"}]})],
        vec![
            json!({"type": "agent.message", "content": [{"type": "text", "text": "second answer"}]}),
            json!({"type": "session.status_idle", "stop_reason": {"type": "end_turn"}}),
        ],
    ]
}

#[tokio::test]
async fn a_run_timeout_posts_user_interrupt_and_does_not_archive_by_default() {
    let fake = FakeManaged::start(stalled_then_answer(), ManagedFaults::default()).await;
    let err = Session::builder(provider(&fake))
        .timeout(std::time::Duration::from_millis(400))
        .run("go")
        .await
        .expect_err("the stalled run times out");
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    let types: Vec<Value> = fake.posted().into_iter().map(|e| e["type"].clone()).collect();
    assert_eq!(types, vec![json!("user.message"), json!("user.interrupt")]);
    assert!(fake.archived_sessions().is_empty(), "archiving is opt-in");
}

#[tokio::test]
async fn a_cancel_interrupts_and_the_next_request_ends_at_its_own_idle() {
    let fake = FakeManaged::start(stalled_then_answer(), ManagedFaults::default()).await;
    let session = Session::builder(provider(&fake)).open().await.expect("open");
    let mut handle = session.spawn();
    let mut live = handle.subscribe(64).await;
    handle.send("first").await.expect("send");
    // Wait until the stalled turn is under way, then cancel it.
    while let Some(e) = live.recv().await {
        if e.raw_type == "agent.message" {
            break;
        }
    }
    handle.cancel();
    let first = handle.next_result().await.expect("a result");
    assert!(matches!(first, Err(Error::Cancelled)), "{first:?}");
    assert!(
        fake.posted().iter().any(|e| e["type"] == "user.interrupt"),
        "{:?}",
        fake.posted()
    );
    // The idle the interrupt forced is already on the stream: it must not end this request.
    handle.send("second").await.expect("send");
    let second = handle.next_result().await.expect("a result").expect("second run");
    assert_eq!(second.terminal, Terminal::EndTurn);
    assert_eq!(second.text, "second answer");
    handle.close().await;
}

#[tokio::test]
async fn close_archives_the_session_when_asked() {
    let fake = FakeManaged::start(tool_turns(), ManagedFaults::default()).await;
    let mut cfg = ManagedConfig::new(
        ClientConfig::new("sk-test").base_url(fake.url()),
        "agent_1",
        "env_1",
    );
    cfg.archive_on_close = true;
    let calls = Arc::new(AtomicU32::new(0));
    let result = Session::builder(ManagedAgents::new(cfg).expect("provider"))
        .handler(counting_tools(calls))
        .run("What is x?")
        .await
        .expect("run");
    assert_eq!(result.terminal, Terminal::EndTurn);
    assert_eq!(fake.archived_sessions(), vec![result.session_id.clone()]);
    let archives = fake
        .requests()
        .into_iter()
        .filter(|(_, p)| p.ends_with("/archive"))
        .count();
    assert_eq!(archives, 1);
}

/// A Managed Agents thread whose process died while a custom tool ran: a new process resumes
/// the thread by its recorded session id, records what it missed, runs the tool once, and the
/// thread goes on with a follow-up. Every event once, no gap.
#[tokio::test]
async fn a_thread_resumes_after_its_process_died_mid_tool() {
    use tether::{EventStore, MemoryStore, ThreadId, ThreadStore};
    let turns = vec![
        vec![
            json!({"type": "agent.custom_tool_use", "name": "lookup", "input": {"q": "x"}}),
            json!({"type": "session.status_idle", "stop_reason": {"type": "requires_action"}}),
        ],
        vec![
            json!({"type": "agent.message", "content": [{"type": "text", "text": "x is 42"}]}),
            json!({"type": "session.status_idle", "stop_reason": {"type": "end_turn"}}),
        ],
        vec![
            json!({"type": "agent.message", "content": [{"type": "text", "text": "still 42"}]}),
            json!({"type": "session.status_idle", "stop_reason": {"type": "end_turn"}}),
        ],
    ];
    let fake = FakeManaged::start(turns, ManagedFaults::default()).await;
    let store = Arc::new(MemoryStore::default());
    let thread = ThreadId::new("m-1").unwrap();

    /// The first process's tool never returns: the process "dies" while it runs.
    struct Hangs;
    #[async_trait]
    impl Handler for Hangs {
        fn tools(&self) -> Vec<ToolSpec> {
            vec![lookup()]
        }
        async fn call_tool(&self, _call: &ToolUse, _info: &SessionInfo) -> ToolOutput {
            std::future::pending().await
        }
    }
    let mut s = Session::builder(provider(&fake))
        .handler(Hangs)
        .thread(store.clone(), thread.clone(), "remote")
        .open()
        .await
        .expect("open");
    let sent = tokio::time::timeout(std::time::Duration::from_millis(500), s.send("What is x?")).await;
    assert!(sent.is_err(), "the tool hangs");
    std::mem::forget(s); // killed: nothing more is written, nothing is closed

    let t = store.thread(&thread).await.unwrap().unwrap();
    assert_eq!(t.provider, "managed");
    let sid = t.provider_session.clone().expect("the session id is recorded");
    let calls = Arc::new(AtomicU32::new(0));
    let mut s = Session::builder(provider(&fake))
        .handler(counting_tools(calls.clone()))
        .thread(store.clone(), thread.clone(), "remote")
        .open()
        .await
        .expect("resume");
    assert!(s.opened().resumed);
    assert_eq!(s.opened().session_id, sid, "reattached, not a new session");
    assert_eq!(s.pending_tool_uses().len(), 1);
    let r = s
        .resume(tokio_util::sync::CancellationToken::new())
        .await
        .expect("resume");
    assert_eq!(r.text, "x is 42");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the tool ran once");
    assert_eq!(posted_results(&fake).len(), 1, "its result was posted once");
    let r = s.send("And now?").await.expect("follow-up");
    assert_eq!(r.text, "still 42");
    let all = store.load(&t.record).await.unwrap();
    let mut ids = HashSet::new();
    for (i, e) in all.iter().enumerate() {
        assert!(ids.insert(e.id.clone()), "duplicate event id {}", e.id);
        assert_eq!(e.seq, Some(i as u64 + 1), "gap or disorder at {}", e.id);
    }
    for ev in fake.log(&sid) {
        let id = ev["id"].as_str().unwrap_or_default();
        assert!(
            ids.contains(id),
            "event {id} ({}) missing from the record",
            ev["type"]
        );
    }
}

/// A Managed Agents thread whose process died after recording a user message and before posting
/// it (the conformance crash test's SIGKILL found it): the resumed session finds the message
/// unanswered, because the session's history has fewer `user.message`s than the record, and the
/// client's request carrying the same message (recorded already, so not recorded again) posts it
/// then. Before, the request did nothing and the thread never went on.
#[tokio::test]
async fn a_message_recorded_but_never_posted_is_posted_after_a_resume() {
    use tether::{
        EventStore, Input, MemoryStore, Opened, Provider, ThreadId, ThreadStore, TurnContext, TurnResult,
        UserMessage,
    };
    let turns = vec![vec![
        json!({"type": "agent.message", "content": [{"type": "text", "text": "x is 42"}]}),
        json!({"type": "session.status_idle", "stop_reason": {"type": "end_turn"}}),
    ]];
    let fake = FakeManaged::start(turns, ManagedFaults::default()).await;
    let store = Arc::new(MemoryStore::default());
    let thread = ThreadId::new("m-unposted").unwrap();

    /// The first process: opens the real session, then "dies" before its first turn posts anything.
    struct DiesBeforePosting(ManagedAgents);
    #[async_trait]
    impl Provider for DiesBeforePosting {
        fn name(&self) -> &str {
            self.0.name()
        }
        async fn open(&mut self, cx: &TurnContext) -> tether::Result<Opened> {
            self.0.open(cx).await
        }
        async fn turn(&mut self, _input: Input, _cx: &TurnContext) -> tether::Result<TurnResult> {
            std::future::pending().await
        }
    }
    let mut s = Session::builder(DiesBeforePosting(provider(&fake)))
        .thread(store.clone(), thread.clone(), "remote")
        .open()
        .await
        .expect("open");
    let msg = || vec![UserMessage::with_id("c1", "What is x?")];
    let sent = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        s.send_messages(msg(), tokio_util::sync::CancellationToken::new()),
    )
    .await;
    assert!(sent.is_err(), "the first process dies mid-request");
    std::mem::forget(s);
    assert!(
        fake.posted().iter().all(|e| e["type"] != "user.message"),
        "nothing was posted"
    );

    let mut s = Session::builder(provider(&fake))
        .thread(store.clone(), thread.clone(), "remote")
        .open()
        .await
        .expect("resume");
    assert!(s.opened().resumed);
    assert_eq!(s.opened().unanswered.as_deref(), Some("What is x?"));
    let r = s
        .send_messages(msg(), tokio_util::sync::CancellationToken::new())
        .await
        .expect("the same request again");
    assert_eq!(r.text, "x is 42");
    let posted: Vec<Value> = fake
        .posted()
        .into_iter()
        .filter(|e| e["type"] == "user.message")
        .collect();
    assert_eq!(posted.len(), 1, "posted once: {posted:?}");
    assert_eq!(posted[0]["content"][0]["text"], "What is x?");
    let t = store.thread(&thread).await.unwrap().unwrap();
    let all = store.load(&t.record).await.unwrap();
    let users = all
        .iter()
        .filter(|e| e.raw_type == tether::raw::USER_MESSAGE)
        .count();
    assert_eq!(users, 1, "the message is recorded once");
}
