//! Two tether nodes serve one thread (issue 18, scale-out): both run `tether serve` with
//! `backend = "restate"` in front of one real `restate-server` (from npm, `conformance/restate`),
//! each with a SQLite file of its own; their service endpoints sit behind one TCP forwarder
//! registered as the deployment, so Restate reaches whichever is alive (node A while it is).
//!
//! The record is the thread's Restate object state, so a turn started through node A that waits
//! for an approval is approved through node B, node B relays the rest of the turn from the
//! record (the turn runs on node A's service: node B gets its durable events, text as whole
//! messages, not A's live token deltas), and either node reads the same gapless record.

#![cfg(feature = "restate")]

mod common;

use common::*;
use serde_json::{Value, json};
use tether_serve::{Server, ServerOptions};
use tether_testkit::openai::{FakeOpenAi, Reply};
use tether_testkit::restate::{Forwarder, Restate, free_port};

/// Starts a node: its own SQLite file `db`, its service endpoint on `listen`, advertised to
/// Restate as `advertise` (the forwarder).
async fn node(env: &Env, restate: &Restate, listen: u16, advertise: &str, db: &str) -> Server {
    let server_lines = restate::node_lines(&restate.ingress, &restate.admin, listen, advertise);
    let config = env.config_with(&server_lines, TOUCH);
    tether_serve::start(ServerOptions::new(config, "127.0.0.1:0", env.dir.path().join(db)))
        .await
        .expect("a tether node")
}

/// A fresh Restate server and the test's environment (workspace, fake model), no node yet.
async fn setup() -> (Restate, Env) {
    let restate = Restate::start().await;
    let env = Env {
        dir: tempfile::tempdir().expect("tempdir"),
        fake: FakeOpenAi::start().await,
        restate: None,
        postgres: restate::postgres().await,
    };
    (restate, env)
}

/// Two nodes (`a.db`, `b.db`) whose service endpoints sit behind one forwarder, registered with
/// Restate as the deployment: Restate reaches node A while it is alive.
struct TwoNodes {
    env: Env,
    // Held for the test's length: dropping them stops the Restate server and the forwarder.
    _restate: Restate,
    _forwarder: Forwarder,
    a: Server,
    b: Server,
}

impl TwoNodes {
    async fn start() -> Self {
        TwoNodes::start_with(None).await
    }

    /// As [`TwoNodes::start`], Restate hearing the rest of a turn `lag` late once it wrote
    /// `marker` (see [`Forwarder::start_holding`]).
    async fn start_holding(marker: &str, lag: std::time::Duration) -> Self {
        TwoNodes::start_with(Some((marker, lag))).await
    }

    async fn start_with(hold: Option<(&str, std::time::Duration)>) -> Self {
        let (restate, env) = setup().await;
        let (pa, pb) = (free_port(), free_port());
        let targets = vec![
            format!("127.0.0.1:{pa}").parse().expect("addr"),
            format!("127.0.0.1:{pb}").parse().expect("addr"),
        ];
        let forwarder = match hold {
            None => Forwarder::start(targets).await,
            Some((marker, lag)) => Forwarder::start_holding(targets, marker.as_bytes(), lag).await,
        };
        let a = node(&env, &restate, pa, &forwarder.url(), "a.db").await;
        let b = node(&env, &restate, pb, &forwarder.url(), "b.db").await;
        TwoNodes {
            env,
            _restate: restate,
            _forwarder: forwarder,
            a,
            b,
        }
    }

    async fn shutdown(self) {
        self.a.shutdown();
        self.b.shutdown();
        self.a.wait().await;
        self.b.wait().await;
    }
}

/// The thread's events as node `server` serves them: asserted gapless, ids unique.
async fn record(server: &Server, thread: &str) -> Value {
    let (s, v) = get(server, &format!("/v1/threads/{thread}/events")).await;
    assert_eq!(s, 200, "{v}");
    assert_gapless(&v);
    v
}

async fn messages(server: &Server, thread: &str) -> Value {
    let (s, v) = get(server, &format!("/v1/threads/{thread}/messages")).await;
    assert_eq!(s, 200, "{v}");
    v
}

/// A turn started through node A runs a tool and waits for approval; the approval goes through
/// node B, which relays the rest of the turn; the record and messages read through either node
/// are the same and gapless, each tool ran once, no model call was repeated, and both nodes list
/// the thread.
#[tokio::test(flavor = "multi_thread")]
async fn a_turn_started_on_one_node_is_approved_and_read_on_the_other() {
    let nodes = TwoNodes::start().await;
    let (env, a, b) = (&nodes.env, &nodes.a, &nodes.b);

    env.fake
        .push(Reply::tool_calls(&[(
            "call_1",
            "append_line",
            r#"{"line":"first"}"#,
        )]))
        .push(Reply::tool_calls(&[(
            "call_2",
            "touch_file",
            r#"{"name":"touched.txt"}"#,
        )]))
        .push(Reply::text("Both done."));
    let thread = "t-two";
    let ev = run_at(
        a.addr(),
        "main",
        &prompt_input(thread, "r1", "append, then touch"),
    )
    .await;
    let intr = interrupt_of(&ev);
    assert_eq!(intr["toolCallId"], "call_2", "{intr}");
    assert!(!env.ws().join("touched.txt").exists(), "ran before its approval");

    // While the turn waits, both nodes read the same record.
    let (ra, rb) = (record(a, thread).await, record(b, thread).await);
    assert_eq!(ra, rb, "the waiting turn's record differs between the nodes");
    assert!(ra["events"].as_array().is_some_and(|e| e.len() >= 3), "{ra}");

    let body = with_resume(
        prompt_input(thread, "r2", "append, then touch"),
        &intr["id"],
        json!({"approved": true}),
    );
    let ev = run_at(b.addr(), "main", &body).await;
    finished_ok(&ev);
    assert_eq!(text_of(&ev), "Both done.", "{ev:?}");

    let (ra, rb) = (record(a, thread).await, record(b, thread).await);
    assert_eq!(ra, rb, "the record differs between the nodes");
    assert_eq!(messages(a, thread).await, messages(b, thread).await);
    let texts: Vec<String> = messages(b, thread).await["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter_map(|m| m["content"].as_str().map(str::to_owned))
        .collect();
    assert!(texts.iter().any(|t| t == "Both done."), "{texts:?}");

    let log = std::fs::read_to_string(env.ws().join("log.txt")).unwrap_or_default();
    assert_eq!(
        log.lines().collect::<Vec<_>>(),
        ["call_1 first"],
        "append_line ran once"
    );
    let touched = std::fs::read_to_string(env.ws().join("touched.txt")).unwrap_or_default();
    assert_eq!(
        touched.lines().collect::<Vec<_>>(),
        ["call_2"],
        "touch_file ran once"
    );
    assert_eq!(env.fake.requests().len(), 3, "no model call repeated");

    for server in [a, b] {
        let (s, v) = get(server, "/v1/threads?agent=main").await;
        assert_eq!(s, 200, "{v}");
        let ids: Vec<&str> = v["threads"]
            .as_array()
            .expect("threads")
            .iter()
            .filter_map(|t| t["threadId"].as_str())
            .collect();
        assert_eq!(ids, [thread], "{v}");
    }
    nodes.shutdown().await;
}

/// What a node's approval relies on when the Restate node behind the ingress dies while it is
/// answered: the `approve` call sent again with the same idempotency key is answered with the
/// first call's result (200), not run a second time (which would answer 409: the turn no longer
/// waits on that tool use); without a key the repeat is refused. The tool runs once.
#[tokio::test(flavor = "multi_thread")]
async fn an_approval_repeated_with_its_key_is_answered_as_the_first() {
    let (restate, env) = setup().await;
    let listen = free_port();
    let a = node(
        &env,
        &restate,
        listen,
        &format!("http://127.0.0.1:{listen}"),
        "a.db",
    )
    .await;
    env.fake
        .push(Reply::tool_calls(&[(
            "call_1",
            "touch_file",
            r#"{"name":"touched.txt"}"#,
        )]))
        .push(Reply::text("Done."));
    let thread = "t-approve-twice";
    let ev = run_at(a.addr(), "main", &prompt_input(thread, "r1", "touch")).await;
    assert_eq!(interrupt_of(&ev)["toolCallId"], "call_1", "{ev:?}");

    let approve = |key: Option<&'static str>| {
        let mut req = client()
            .post(format!("{}/TetherThread/{thread}/approve", restate.ingress))
            .json(&json!({"decision": "answer", "tool_use_id": "call_1", "approved": true}));
        if let Some(k) = key {
            req = req.header("idempotency-key", k);
        }
        async move {
            let r = req.send().await.expect("POST approve");
            (r.status().as_u16(), r.text().await.unwrap_or_default())
        }
    };
    let first = approve(Some("t-approve-twice/call_1/approved/0")).await;
    assert_eq!(first.0, 200, "{first:?}");
    let repeat = approve(Some("t-approve-twice/call_1/approved/0")).await;
    assert_eq!(repeat.0, 200, "the repeat with the key: {repeat:?}");

    // The turn goes on once and ends; then an approval without a key finds nothing to answer.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let v = messages(&a, thread).await;
        if v.to_string().contains("Done.") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the turn never ended: {v}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let unkeyed = approve(None).await;
    assert_eq!(unkeyed.0, 409, "a repeat without a key: {unkeyed:?}");
    let touched = std::fs::read_to_string(env.ws().join("touched.txt")).unwrap_or_default();
    assert_eq!(
        touched.lines().collect::<Vec<_>>(),
        ["call_1"],
        "touch_file ran once"
    );
    assert_eq!(env.fake.requests().len(), 2, "no model call repeated");
    record(&a, thread).await;
    a.shutdown();
    a.wait().await;
}

/// A client of node B waits for a turn whose invocation runs on node A's service (the
/// deployment's first target): B follows the turn on A (`GET /v1/threads/{id}/live`, announced
/// by A as the turn starts there) and relays its token deltas as they come, not only the
/// recorded message; the client ends with the whole text once, and the record is gapless.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_of_one_node_gets_the_live_deltas_of_a_turn_running_on_the_other() {
    const TEXT: &str = "The quick brown fox jumps over the lazy dog.";
    let nodes = TwoNodes::start().await;
    let (env, a, b) = (&nodes.env, &nodes.a, &nodes.b);
    // Two characters a delta, one write every 60 ms: about 1.4 s of live text.
    env.fake.push(
        Reply::text(TEXT)
            .chunk_chars(2)
            .pace(std::time::Duration::from_millis(60)),
    );
    let thread = "t-live";
    let ev = run_at(b.addr(), "main", &prompt_input(thread, "r1", "say it")).await;
    finished_ok(&ev);
    let contents = ev.iter().filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT").count();
    assert!(
        contents >= 5,
        "B relayed the text whole ({contents} content events), not live: {ev:?}"
    );
    // Every character once, whenever B began following: nothing withdrawn, nothing repeated.
    assert_eq!(text_of(&ev), TEXT, "{ev:?}");
    assert!(!ev.iter().any(|e| e["type"] == "MESSAGES_SNAPSHOT"), "{ev:?}");
    let v = record(b, thread).await;
    assert_eq!(record(a, thread).await, v);
    assert_eq!(env.fake.requests().len(), 1, "no model call repeated");
    nodes.shutdown().await;
}

/// The live route of a node with a token: refused without it, refused with another thread's or
/// token's follow credential, open with the thread's credential (the token itself is never
/// sent to a peer) or with the token; it starts with `"subscribed"`.
#[tokio::test(flavor = "multi_thread")]
async fn the_live_route_takes_the_token_or_the_threads_follow_credential() {
    let (restate, env) = setup().await;
    let listen = free_port();
    let server_lines = restate::node_lines(
        &restate.ingress,
        &restate.admin,
        listen,
        &format!("http://127.0.0.1:{listen}"),
    );
    let config = env.config_with(&server_lines, "");
    let node = tether_serve::start(
        ServerOptions::new(config, "127.0.0.1:0", env.dir.path().join("a.db"))
            .with_token(Some("s3cret".into())),
    )
    .await
    .expect("a tether node");
    let url = format!("http://{}/v1/threads/t-x/live", node.addr());
    let get = |header: Option<(&'static str, String)>| {
        let mut req = client().get(&url);
        if let Some((k, v)) = header {
            req = req.header(k, v);
        }
        async move { req.send().await.expect("GET live") }
    };
    assert_eq!(get(None).await.status(), 401);
    let wrong_thread = tether_serve::follow_credential("s3cret", "t-y");
    let wrong_token = tether_serve::follow_credential("other", "t-x");
    for c in [wrong_thread, wrong_token, String::new(), "zz".into()] {
        let r = get(Some((tether_serve::FOLLOW_HEADER, c.clone()))).await;
        assert_eq!(r.status(), 401, "credential {c:?}");
    }
    for h in [
        (
            tether_serve::FOLLOW_HEADER,
            tether_serve::follow_credential("s3cret", "t-x"),
        ),
        ("authorization", "Bearer s3cret".to_owned()),
    ] {
        let mut r = get(Some(h.clone())).await;
        assert_eq!(r.status(), 200, "{h:?}");
        let first = tokio::time::timeout(PATIENCE, r.chunk())
            .await
            .expect("a first line")
            .expect("body")
            .expect("a chunk");
        assert_eq!(&first[..], b"\"subscribed\"\n", "{h:?}");
    }
    node.shutdown();
    node.wait().await;
}

/// A client whose stream broke before it saw anything of its turn sends its message again, to
/// another node, after the turn ended there: it gets the whole turn (the message is the one the
/// thread's last turn was sent with), and the turn is not run again.
#[tokio::test(flavor = "multi_thread")]
async fn a_message_sent_again_after_its_turn_ended_gets_the_turn() {
    let nodes = TwoNodes::start().await;
    let (env, a, b) = (&nodes.env, &nodes.a, &nodes.b);
    env.fake
        .push(Reply::tool_calls(&[(
            "call_1",
            "append_line",
            r#"{"line":"once"}"#,
        )]))
        .push(Reply::text("Appended."));
    let thread = "t-again";
    let first = run_at(a.addr(), "main", &prompt_input(thread, "r1", "append")).await;
    finished_ok(&first);
    // The same message, holding nothing of its turn, through the other node.
    let again = run_at(b.addr(), "main", &prompt_input(thread, "r2", "append")).await;
    finished_ok(&again);
    let facts = |ev: &[Value]| -> Vec<String> {
        ev.iter()
            .filter_map(|e| match e["type"].as_str()? {
                "TOOL_CALL_START" => Some(format!("call {}", e["toolCallId"].as_str()?)),
                "TOOL_CALL_RESULT" => Some(format!("result {}", e["toolCallId"].as_str()?)),
                _ => None,
            })
            .collect()
    };
    assert_eq!(facts(&again), facts(&first), "{again:?}");
    assert_eq!(text_of(&again), "Appended.", "{again:?}");
    let log = std::fs::read_to_string(env.ws().join("log.txt")).unwrap_or_default();
    assert_eq!(
        log.lines().collect::<Vec<_>>(),
        ["call_1 once"],
        "the tool ran once"
    );
    assert_eq!(env.fake.requests().len(), 2, "no model call repeated");
    record(b, thread).await;
    nodes.shutdown().await;
}

/// A run's end means Restate holds what it showed: a client that got RUN_FINISHED reads at
/// once, on either node, the turn's last message, and a client that got an approval's interrupt
/// approves at once on either node. A relay hears of a turn's end and of its wait from the turn
/// itself (in its process, or from the peer running it) before Restate has the turn's last
/// writes; here Restate hears the rest of each turn 300 ms late once the model's answer names a
/// `held` file, so a relay that took the turn's word alone would end its run early and this
/// test would see it: each turn is approved at once through the other node and read at once
/// through the first.
#[tokio::test(flavor = "multi_thread")]
async fn what_a_finished_run_showed_is_read_at_once_on_either_node() {
    let nodes = TwoNodes::start_holding("held", std::time::Duration::from_millis(300)).await;
    let (env, a, b) = (&nodes.env, &nodes.a, &nodes.b);
    let thread = "t-read-your-writes";
    for i in 0..2 {
        let (first, other) = if i % 2 == 0 { (a, b) } else { (b, a) };
        let call = format!("call_{i}");
        env.fake
            .push(Reply::tool_calls(&[(
                call.as_str(),
                "touch_file",
                &format!(r#"{{"name":"held{i}.txt"}}"#),
            )]))
            .push(Reply::text(format!("held answer {i}")));
        let ev = run_at(
            first.addr(),
            "main",
            &input(
                thread,
                &format!("r{i}a"),
                user(&format!("u{i}"), &format!("touch {i}")),
            ),
        )
        .await;
        let intr = interrupt_of(&ev);
        assert_eq!(intr["toolCallId"], call.as_str(), "{intr}");
        // Approved at once through the other node: it finds the turn waiting.
        let body = with_resume(
            input(
                thread,
                &format!("r{i}b"),
                user(&format!("u{i}"), &format!("touch {i}")),
            ),
            &intr["id"],
            json!({"approved": true}),
        );
        let ev = run_at(other.addr(), "main", &body).await;
        finished_ok(&ev);
        assert_eq!(text_of(&ev), format!("held answer {i}"), "{ev:?}");
        // Read at once through the first node: the turn's last message is there.
        let m = messages(first, thread).await;
        let last = m["messages"]
            .as_array()
            .and_then(|a| a.last())
            .cloned()
            .unwrap_or_default();
        assert_eq!(last["content"], format!("held answer {i}"), "turn {i}: {m}");
    }
    let touched: Vec<bool> = (0..2)
        .map(|i| env.ws().join(format!("held{i}.txt")).exists())
        .collect();
    assert_eq!(touched, [true, true], "each approved tool ran");
    record(a, thread).await;
    nodes.shutdown().await;
}

/// A turn killed through Restate's admin API never clears its mark on the thread: the thread's
/// next message is served (Restate says the invocation is over), not refused as busy forever;
/// and so is the next message after a turn killed while it waited for approval.
#[tokio::test(flavor = "multi_thread")]
async fn a_thread_whose_turn_was_killed_takes_the_next_message() {
    let nodes = TwoNodes::start().await;
    let (env, a, restate) = (&nodes.env, &nodes.a, &nodes._restate);
    let running = async |thread: &str| -> Option<String> {
        let r = reqwest::Client::new()
            .post(format!("{}/TetherThread/{thread}/invocation", restate.ingress))
            .send()
            .await
            .ok()?;
        let v: Value = r.json().await.ok()?;
        v.as_str().map(str::to_owned)
    };
    let kill = async |inv: &str| {
        let r = reqwest::Client::new()
            .patch(format!("{}/invocations/{inv}/kill", restate.admin))
            .send()
            .await
            .expect("the admin API");
        assert!(r.status().is_success(), "kill: {}", r.status());
    };

    // Killed mid-stream.
    let thread = "t-killed";
    env.fake.push(
        Reply::text("x".repeat(400))
            .chunk_chars(1)
            .pace(std::time::Duration::from_millis(25)),
    );
    let addr = a.addr();
    let first = tokio::spawn(async move {
        run_at(addr, "main", &input("t-killed", "r1", user("u1", "a long one"))).await
    });
    let started = std::time::Instant::now();
    let inv = loop {
        if let Some(inv) = running(thread).await {
            break inv;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "the turn never ran"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    kill(&inv).await;
    let ev = first.await.expect("the first run");
    assert_eq!(
        last(&ev)["outcome"]["type"],
        "cancelled",
        "the killed turn's run: {ev:?}"
    );
    env.fake.push(Reply::text("fresh answer"));
    let ev = run_at(a.addr(), "main", &input(thread, "r2", user("u2", "again"))).await;
    finished_ok(&ev);
    assert_eq!(text_of(&ev), "fresh answer", "{ev:?}");

    // Killed while it waited for approval.
    let thread = "t-killed-waiting";
    env.fake.push(Reply::tool_calls(&[(
        "call_w",
        "touch_file",
        r#"{"name":"never.txt"}"#,
    )]));
    let ev = run_at(a.addr(), "main", &input(thread, "r1", user("u1", "touch"))).await;
    interrupt_of(&ev);
    let inv = running(thread).await.expect("the waiting turn");
    kill(&inv).await;
    // Two model calls: the killed turn's waiting call answered as not answered, then the
    // new message.
    env.fake
        .push(Reply::text("Noted. "))
        .push(Reply::text("answered anew"));
    let ev = run_at(a.addr(), "main", &input(thread, "r2", user("u2", "never mind"))).await;
    finished_ok(&ev);
    assert!(text_of(&ev).ends_with("answered anew"), "{ev:?}");
    assert!(
        !env.ws().join("never.txt").exists(),
        "the killed turn's call never ran"
    );
    record(a, thread).await;
    nodes.shutdown().await;
}
