//! Cancellation and timeouts stop the work: a stopped tool's task is aborted (and the child it
//! owns killed), its outcome is recorded so a resume does not run it again unless asked, and a
//! cancel is never lost between requests.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tether::local::LocalLoop;
use tether::{
    CancellationToken, Error, EventKind, EventStore, Input, MemoryStore, Opened, Provider, ScriptedModel,
    Session, SessionConfig, Terminal, ToolResult, ToolSet, ToolSpec, ToolUse, TurnContext, TurnResult,
};
use tokio::sync::{mpsc, oneshot};

fn spec(name: &str) -> ToolSpec {
    ToolSpec::new(name, name, json!({"type": "object"}))
}

/// Signals when dropped: the tool's future was dropped (its task aborted), not left running.
struct OnDrop(Option<oneshot::Sender<()>>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// What a `sleeper` tool reports to the test.
struct Probe {
    started: mpsc::UnboundedReceiver<u32>,
    dropped: oneshot::Receiver<()>,
    finished: Arc<AtomicBool>,
}

/// A tool that starts `sleep 60` (killed when dropped), reports its pid, and sets `finished` if
/// it ever gets to the end.
fn sleeper() -> (ToolSet, Probe) {
    let (started_tx, started) = mpsc::unbounded_channel();
    let (dropped_tx, dropped) = oneshot::channel();
    let dropped_tx = Arc::new(Mutex::new(Some(dropped_tx)));
    let finished = Arc::new(AtomicBool::new(false));
    let f = finished.clone();
    let tools = ToolSet::new().tool(spec("sleeper"), move |_input: Value| {
        let started_tx = started_tx.clone();
        let guard = OnDrop(dropped_tx.lock().unwrap().take());
        let f = f.clone();
        async move {
            // Declared before the child, so dropped after it: once the test hears of the drop,
            // the child has been sent its kill.
            let _guard = guard;
            let mut child = tokio::process::Command::new("sleep")
                .arg("60")
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| e.to_string())?;
            let _ = started_tx.send(child.id().unwrap_or(0));
            let _ = child.wait().await;
            f.store(true, Ordering::SeqCst);
            Ok::<_, String>("slept".into())
        }
    });
    (
        tools,
        Probe {
            started,
            dropped,
            finished,
        },
    )
}

/// Whether process `pid` is gone or a zombie (dead, not yet reaped).
fn is_dead(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

/// Waits (generously) for a killed process to die: the kill is sent synchronously when the
/// child is dropped; the kernel takes its moment to deliver it.
async fn wait_dead(pid: u32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !is_dead(pid) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "process {pid} still runs after its tool was stopped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn results_of(events: &[tether::Event]) -> Vec<ToolResult> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ToolResult { result } => Some(result.clone()),
            _ => None,
        })
        .collect()
}

/// Issue 17: a cancelled 60 s tool kept running (its task was dropped, not aborted). Now the
/// cancel returns only after the tool's future is gone, its `sleep 60` is killed, its outcome is
/// recorded, and the local loop's history answers the call, so the next request is well formed.
#[tokio::test]
async fn a_cancelled_tool_is_stopped_killed_and_recorded() {
    let (tools, mut probe) = sleeper();
    let store = Arc::new(MemoryStore::default());
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("s1", "sleeper", "{}")])),
        Ok(ScriptedModel::text("after the cancel")),
    ]));
    let mut s = Session::builder(LocalLoop::with_model(model.clone()).session_id("c1"))
        .handler(tools)
        .store(store.clone())
        .open()
        .await
        .unwrap();
    let cancel = CancellationToken::new();
    let (r, pid) = {
        let run = s.send_cancellable("go", cancel.clone());
        tokio::pin!(run);
        let pid = tokio::select! {
            r = &mut run => panic!("the run ended before its tool started: {r:?}"),
            pid = probe.started.recv() => pid.unwrap(),
        };
        cancel.cancel();
        (run.await, pid)
    };
    assert!(matches!(r, Err(Error::Cancelled)), "{r:?}");
    // The engine waited for the aborted task: its future is already dropped.
    assert!(
        probe.dropped.try_recv().is_ok(),
        "the cancelled tool's future is still alive (its task was not aborted)"
    );
    wait_dead(pid).await;
    assert!(!probe.finished.load(Ordering::SeqCst));

    // Recorded, in the memo and the record, as stopped.
    let u = ToolUse::from_arguments("s1", "sleeper", "{}");
    let memo = store.tool_result("c1", &u.memo_key()).await.unwrap().unwrap();
    assert!(memo.is_error && memo.content.contains("stopped"), "{memo:?}");
    let recorded = results_of(&store.load("c1").await.unwrap());
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0].tool_use_id, "s1");
    assert!(recorded[0].content.contains("the request was cancelled"));

    // The next request carries an answer for the cancelled call (a chat API refuses a history
    // whose tool call has no answer).
    let r = s.send("and now?").await.unwrap();
    assert_eq!(r.text, "after the cancel");
    let msgs = &model.requests()[1].messages;
    let answer = msgs
        .iter()
        .find(|m| m.tool_call_id.as_deref() == Some("s1"))
        .expect("the cancelled call is answered in the history");
    assert!(answer.is_error);
}

/// A tool past its timeout is stopped, not left running behind its error result.
#[tokio::test]
async fn a_timed_out_tool_is_stopped() {
    let (tools, mut probe) = sleeper();
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("s1", "sleeper", "{}")])),
        Ok(ScriptedModel::text("ok")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()))
        .handler(tools)
        .config(SessionConfig::default().with_tool_timeout(Some(Duration::from_secs(3))))
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.text, "ok");
    let pid = probe.started.try_recv().expect("the tool started");
    assert!(probe.dropped.try_recv().is_ok(), "the timed-out tool still runs");
    wait_dead(pid).await;
    assert!(!probe.finished.load(Ordering::SeqCst));
    let msgs = &model.requests()[1].messages;
    let t = msgs.iter().find(|m| m.tool_call_id.is_some()).unwrap();
    assert!(t.is_error && t.content.as_deref().unwrap().contains("timed out"));
}

/// The run's own timeout stops its tools too, and records why.
#[tokio::test]
async fn a_run_past_its_timeout_stops_its_tools_and_records_them() {
    let (tools, mut probe) = sleeper();
    let store = Arc::new(MemoryStore::default());
    let model = ScriptedModel::new(vec![Ok(ScriptedModel::tool_calls(&[("s1", "sleeper", "{}")]))]);
    let e = Session::builder(LocalLoop::new(model).session_id("t1"))
        .handler(tools)
        .store(store.clone())
        // The timeout under test (long enough for the tool to start its child first).
        .timeout(Duration::from_secs(3))
        .run("go")
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    let pid = probe.started.try_recv().expect("the tool started");
    assert!(probe.dropped.try_recv().is_ok(), "the tool outlived the run");
    wait_dead(pid).await;
    let recorded = results_of(&store.load("t1").await.unwrap());
    assert_eq!(recorded.len(), 1);
    assert!(recorded[0].content.contains("the run timed out"), "{recorded:?}");
}

/// A provider that reattaches to a session waiting on one tool use, the way a remote loop
/// reports what it waits on after a restart; it records the results it gets.
struct Waiting {
    pending: Vec<ToolUse>,
    got: Arc<Mutex<Vec<ToolResult>>>,
}

#[async_trait::async_trait]
impl Provider for Waiting {
    fn name(&self) -> &str {
        "waiting"
    }
    async fn open(&mut self, _cx: &TurnContext) -> tether::Result<Opened> {
        Ok(Opened::resumed("w1").with_pending(std::mem::take(&mut self.pending)))
    }
    async fn turn(&mut self, input: Input, _cx: &TurnContext) -> tether::Result<TurnResult> {
        if let Input::ToolResults(answered) = input {
            self.got
                .lock()
                .unwrap()
                .extend(answered.into_iter().map(|a| a.result));
        }
        let mut tr = TurnResult::new(Terminal::EndTurn, json!("end_turn"));
        tr.text = "done".into();
        Ok(tr)
    }
}

/// A cancelled tool is recorded as such: resuming the session that waits on it answers it from
/// the record instead of running it again, until the user forgets that result.
#[tokio::test]
async fn a_cancelled_tool_is_not_run_again_on_resume_unless_forgotten() {
    let calls = Arc::new(AtomicU32::new(0));
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let c = calls.clone();
    let tools = ToolSet::new().tool(spec("effect"), move |_input: Value| {
        let n = c.fetch_add(1, Ordering::SeqCst) + 1;
        let started_tx = started_tx.clone();
        async move {
            let _ = started_tx.send(n);
            if n == 1 {
                // The first run hangs until it is stopped.
                std::future::pending::<()>().await;
            }
            Ok::<_, String>(format!("run {n}"))
        }
    });
    let store = Arc::new(MemoryStore::default());
    let u = ToolUse::new("e1", "effect", json!({"x": 1}));
    let open = |got: Arc<Mutex<Vec<ToolResult>>>| {
        Session::builder(Waiting {
            pending: vec![u.clone()],
            got,
        })
        .handler(tools.clone())
        .store(store.clone())
        .open()
    };

    // 1. Resumed, the tool runs, and the request is cancelled while it does.
    let mut s = open(Default::default()).await.unwrap();
    let cancel = CancellationToken::new();
    let run = s.resume(cancel.clone());
    tokio::pin!(run);
    tokio::select! {
        r = &mut run => panic!("ended early: {r:?}"),
        _ = started.recv() => {}
    }
    cancel.cancel();
    assert!(matches!(run.await, Err(Error::Cancelled)));
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // 2. A restart resumes the same waiting tool use: answered from the record, not run.
    let got = Arc::new(Mutex::new(Vec::new()));
    let mut s = open(got.clone()).await.unwrap();
    let r = s.resume(CancellationToken::new()).await.unwrap();
    assert_eq!(r.text, "done");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "a cancelled tool must not run again on resume"
    );
    let answered = got.lock().unwrap().clone();
    assert_eq!(answered.len(), 1);
    assert!(answered[0].is_error && answered[0].content.contains("stopped"));
    assert_eq!(answered[0].tool_use_id, "e1");

    // 3. The user asks for it to run again: forget its result, then resume.
    assert!(s.forget_tool_result(&u).await.unwrap());
    let got = Arc::new(Mutex::new(Vec::new()));
    let mut s = open(got.clone()).await.unwrap();
    let r = s.resume(CancellationToken::new()).await.unwrap();
    assert_eq!(r.text, "done");
    assert_eq!(calls.load(Ordering::SeqCst), 2, "forgotten: it runs again");
    assert_eq!(got.lock().unwrap()[0].content, "run 2");
    // And that run's result is the one answered from now on.
    let got = Arc::new(Mutex::new(Vec::new()));
    let mut s = open(got.clone()).await.unwrap();
    s.resume(CancellationToken::new()).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(got.lock().unwrap()[0].content, "run 2");
    let events = store.load("w1").await.unwrap();
    assert_eq!(
        events
            .iter()
            .filter(|e| e.raw_type == "tether.tool_result_forgotten")
            .count(),
        1
    );
}

/// A model that answers at once: what a request that should have been cancelled would do.
fn quick(n: usize) -> Arc<ScriptedModel> {
    Arc::new(ScriptedModel::new(
        (0..n)
            .map(|i| Ok(ScriptedModel::text(&format!("answer {i}"))))
            .collect(),
    ))
}

/// A cancel that lands after a request was queued but before the session's task picked it up
/// was lost (it cancelled the previous request's token): the request ran to its end. Now it is
/// cancelled, and a request queued after the cancel runs normally. On the current-thread test
/// runtime the session's task cannot run between `send` and `cancel`, so this is the race, every
/// time.
#[tokio::test]
async fn a_cancel_between_requests_is_never_lost() {
    let model = quick(2);
    let s = Session::builder(LocalLoop::with_model(model.clone()))
        .open()
        .await
        .unwrap();
    let mut h = s.spawn();
    h.send("first").await.unwrap();
    h.cancel();
    h.send("second").await.unwrap();
    let r1 = h.next_result().await.unwrap();
    assert!(matches!(r1, Err(Error::Cancelled)), "{r1:?}");
    let r2 = h.next_result().await.unwrap().unwrap();
    assert_eq!(
        r2.text, "answer 0",
        "the cancelled request never reached the model"
    );
    assert_eq!(model.requests().len(), 1);

    // A cancel with nothing in flight or queued does not reach later requests.
    h.cancel();
    h.send("third").await.unwrap();
    assert_eq!(h.next_result().await.unwrap().unwrap().text, "answer 1");
    h.close().await;
}

/// Hangs on the message `first` (until dropped); answers anything else at once.
struct HangFirst;

#[async_trait::async_trait]
impl tether::ChatModel for HangFirst {
    fn name(&self) -> &str {
        "hang-first"
    }
    async fn chat(
        &self,
        req: &tether::ChatRequest,
        _deltas: &tether::DeltaSink,
    ) -> tether::Result<tether::ChatResponse> {
        if req.messages.last().and_then(|m| m.content.as_deref()) == Some("first") {
            std::future::pending::<()>().await;
        }
        Ok(ScriptedModel::text("answered"))
    }
}

/// The same race from a multi-threaded runtime, where the session's task may pick the request
/// up before or after the cancel: a request still queued or running when the cancel lands ends
/// cancelled, and one queued after it does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_always_reaches_what_was_queued_before_it() {
    for _ in 0..50 {
        let s = Session::builder(LocalLoop::new(HangFirst)).open().await.unwrap();
        let mut h = s.spawn();
        h.send("first").await.unwrap();
        h.cancel();
        h.send("second").await.unwrap();
        let wait = Duration::from_secs(20);
        let r1 = tokio::time::timeout(wait, h.next_result()).await;
        assert!(
            matches!(r1, Ok(Some(Err(Error::Cancelled)))),
            "the cancel was lost: {r1:?}"
        );
        let r2 = tokio::time::timeout(wait, h.next_result()).await;
        assert!(matches!(&r2, Ok(Some(Ok(r))) if r.text == "answered"), "{r2:?}");
        h.close().await;
    }
}
