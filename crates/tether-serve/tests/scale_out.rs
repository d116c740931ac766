//! Scale-out with node loss (issue 18): 3 Restate nodes (one cluster, replication 2) and 2 tether
//! nodes that are real `tether-serve` processes (this crate's binary, `backend = "restate"`), each
//! with its own configuration and SQLite file and its own service endpoint, both endpoints behind
//! one TCP `Forwarder` registered as the deployment (Restate reaches the first live one), and both
//! nodes sending to the cluster's ingress through a second `Forwarder` over the three nodes'
//! ingresses (the first live one serves).
//!
//! What is killed, when (SIGKILL, both in each test):
//! - tether node A, the one the client started the turn through and whose service ran the turn
//!   (the deployment's first target);
//! - Restate node 1: the cluster's first node, which provisioned it, and the ingress the tether
//!   nodes reached while it lived (so their calls fail over to node 2 through the forwarder).
//!
//! Two moments: while the turn waits for the approval of a tool call (the client holds the
//! interrupt A issued), and while the turn's model step is in flight on A (the fake model holds
//! its stream open; the client's stream from A breaks mid-turn). In both the client then goes to
//! node B: it approves there, or first reconnects there by sending its message again with the
//! messages it holds, and reads the rest of the turn there. The turn completes; the client's
//! streams together show every tool call, tool result and text of the record B serves, each
//! once and in order (nothing missed, nothing twice); the record is gapless; each tool's effect
//! is its own call's (lines in a file, one per invocation); every scripted model answer is used
//! once (the call in flight when A died is made again: its step never completed).
//!
//! What node loss may repeat: a step (model or tool call) whose result Restate had not yet made
//! durable when node 1 died is run again by the new leader: Restate's at-least-once for a step
//! in flight, seen here about once in 16 runs a few seconds after the kill. The fake model
//! answers a repeated question alike; a tool sees the same `$TETHER_TOOL_USE_ID` both times
//! (its idempotency key), so the checks allow a tool's line twice but never another call's.

#![cfg(feature = "restate")]

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use common::*;
use serde_json::{Value, json};
use tether_testkit::openai::{FakeOpenAi, Reply};
use tether_testkit::restate::{Forwarder, Restate, free_port};
use tokio::io::AsyncBufReadExt;

/// The two tests each run a 3-node cluster and two servers: one at a time on a 2-core machine.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const PROMPT: &str = "append, then touch";

/// A `tether-serve` process; SIGKILLed when dropped.
struct Node {
    child: tokio::process::Child,
    addr: SocketAddr,
    /// What it wrote to stderr (for a failing assertion's message).
    log: Arc<Mutex<String>>,
}

impl Node {
    /// SIGKILLs the process and reaps it.
    async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// The cluster, the model, the forwarders and the two tether nodes of one test.
struct Cluster {
    restate: Vec<Restate>,
    dir: tempfile::TempDir,
    fake: FakeOpenAi,
    _ingress: Forwarder,
    _endpoints: Forwarder,
    a: Node,
    b: Node,
    /// The records' database (`TETHER_RESTATE_RECORD=shared`), dropped after the nodes.
    _postgres: Option<tether_testkit::postgres::Postgres>,
}

fn addr_of(url: &str) -> SocketAddr {
    url.trim_start_matches("http://")
        .parse()
        .unwrap_or_else(|e| panic!("{url} is no host:port URL: {e}"))
}

impl Cluster {
    async fn start() -> Cluster {
        let restate = Restate::start_cluster(3).await;
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("ws")).expect("workspace");
        let fake = FakeOpenAi::start().await;
        // A step in flight while Restate fails over may run again (see the module docs).
        fake.answer_repeats_alike();
        let ingress = Forwarder::start(restate.iter().map(|r| addr_of(&r.ingress)).collect()).await;
        let (pa, pb) = (free_port(), free_port());
        let endpoints = Forwarder::start(vec![
            SocketAddr::from(([127, 0, 0, 1], pa)),
            SocketAddr::from(([127, 0, 0, 1], pb)),
        ])
        .await;
        let postgres = restate::postgres().await;
        let shared = restate::shared_lines(postgres.as_ref());
        let mut nodes = Vec::new();
        for (name, port) in [("a", pa), ("b", pb)] {
            let config = config_text(
                &ingress.url(),
                &restate[1].admin,
                (port, &endpoints.url()),
                &shared,
                &fake.url(),
                &dir.path().join("ws"),
            );
            nodes.push(node(dir.path(), name, &config).await);
        }
        let b = nodes.pop().expect("node b");
        let a = nodes.pop().expect("node a");
        Cluster {
            restate,
            dir,
            fake,
            _ingress: ingress,
            _endpoints: endpoints,
            a,
            b,
            _postgres: postgres,
        }
    }

    fn ws(&self) -> PathBuf {
        self.dir.path().join("ws")
    }

    /// SIGKILLs tether node A and Restate node 1.
    async fn kill_a_and_restate_1(&mut self) {
        self.a.kill().await;
        self.restate.remove(0).kill();
    }

    /// The lines of a file in the workspace (none when it does not exist).
    fn lines(&self, file: &str) -> Vec<String> {
        std::fs::read_to_string(self.ws().join(file))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Fails with both nodes' logs and the surviving Restate nodes' logs.
    fn logs(&self) -> String {
        let mut out = format!(
            "--- tether A:\n{}\n--- tether B:\n{}\n",
            self.a.log(),
            self.b.log()
        );
        for (i, r) in self.restate.iter().enumerate() {
            out.push_str(&format!(
                "--- restate (surviving #{i}):\n{}\n",
                tail(&r.log(), 4000)
            ));
        }
        out
    }
}

fn tail(s: &str, n: usize) -> &str {
    let start = s.len().saturating_sub(n);
    let mut i = start;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

/// One agent, `main`, on the fake model, with `append_line` (no approval) and `touch_file`
/// (approval), its turns on Restate.
fn config_text(
    ingress: &str,
    admin: &str,
    (listen, advertise): (u16, &str),
    shared: &str,
    model: &str,
    ws: &Path,
) -> String {
    format!(
        "[server]\n{}{shared}\n{}{TOUCH}{WAIT}",
        restate::node_lines(ingress, admin, listen, advertise),
        agent_main(model, ws)
    )
}

/// A command tool (no approval) that marks it started, waits until the file `go` exists, then
/// appends its tool-use id to `waited.txt`: a tool step the test can hold while it kills nodes.
const WAIT: &str = r#"
[[agents.main.commands]]
name = "wait_for_go"
description = "Wait for the go file"
command = 'printf "%s\n" "$TETHER_TOOL_USE_ID" >> started.txt; while [ ! -e go ]; do sleep 0.05; done; printf "%s\n" "$TETHER_TOOL_USE_ID" >> waited.txt'
"#;

/// Starts `tether-serve` with `config` and its own SQLite file; returns once it listens (its
/// service registered with the admin API).
async fn node(dir: &Path, name: &str, config: &str) -> Node {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, config).expect("write the config");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tether-serve"))
        .arg("--config")
        .arg(&path)
        .args(["--bind", "127.0.0.1:0", "--no-token", "--db"])
        .arg(dir.join(format!("{name}.db")))
        .env_remove("TETHER_TOKEN")
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn tether-serve");
    let stderr = child.stderr.take().expect("stderr");
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let sink = log.clone();
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            if let Ok(mut s) = sink.lock() {
                s.push_str(&l);
                s.push('\n');
            }
            let _ = tx.send(l);
        }
    });
    let mut node = Node {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        log,
    };
    loop {
        let line = tokio::time::timeout(PATIENCE * 2, rx.recv())
            .await
            .ok()
            .flatten()
            .unwrap_or_else(|| panic!("tether-serve {name} never said it was listening: {}", node.log()));
        if let Some(rest) = line.split("listening on http://").nth(1) {
            let addr = rest.split_whitespace().next().unwrap_or_default();
            node.addr = addr.parse().unwrap_or_else(|e| panic!("{line}: {e}"));
            return node;
        }
    }
}

/// A run's SSE stream read as it arrives: the events so far, and whether the body ended whole.
struct Stream {
    seen: Arc<Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<Result<(), String>>,
}

impl Stream {
    async fn open(addr: SocketAddr, body: &Value) -> Stream {
        let mut resp = client()
            .post(format!("http://{addr}/v1/agents/main/run"))
            .header("accept", "text/event-stream")
            .json(body)
            .send()
            .await
            .expect("the run's request");
        assert_eq!(resp.status(), 200);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let out = seen.clone();
        let task = tokio::spawn(async move {
            let mut buf = String::new();
            loop {
                match resp.chunk().await {
                    Ok(Some(c)) => {
                        buf.push_str(&String::from_utf8_lossy(&c));
                        while let Some(end) = buf.find("\n\n") {
                            let frame: String = buf.drain(..end + 2).collect();
                            if let Some(d) = frame.lines().find_map(|l| l.strip_prefix("data: "))
                                && let Ok(v) = serde_json::from_str::<Value>(d)
                                && let Ok(mut s) = out.lock()
                            {
                                s.push(v);
                            }
                        }
                    }
                    Ok(None) => return Ok(()),
                    Err(e) => return Err(e.to_string()),
                }
            }
        });
        Stream { seen, task }
    }

    fn seen(&self) -> Vec<Value> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Waits for the body's end: `Ok` when it ended cleanly, `Err` when the connection broke.
    async fn end(self) -> (Vec<Value>, Result<(), String>) {
        let r = tokio::time::timeout(PATIENCE, self.task)
            .await
            .expect("the stream ends")
            .expect("the reader task");
        let seen = self.seen.lock().map(|s| s.clone()).unwrap_or_default();
        (seen, r)
    }
}

/// What a client's AG-UI stream showed of a turn, in order: texts (deltas of one message
/// joined), tool calls and tool results, by id.
#[derive(Debug, Clone, PartialEq)]
enum Fact {
    Text(String),
    Call(String),
    Result(String),
}

fn stream_facts(events: &[Value]) -> Vec<Fact> {
    let mut out = Vec::new();
    // Index in `out` of each open text message.
    let mut texts: Vec<(String, usize)> = Vec::new();
    for e in events {
        match e["type"].as_str().unwrap_or_default() {
            "TEXT_MESSAGE_START" => {
                texts.push((e["messageId"].as_str().unwrap_or_default().to_owned(), out.len()));
                out.push(Fact::Text(String::new()));
            }
            "TEXT_MESSAGE_CONTENT" => {
                let id = e["messageId"].as_str().unwrap_or_default();
                let at = texts.iter().rev().find(|(m, _)| m == id).map(|(_, i)| *i);
                match at.and_then(|i| out.get_mut(i)) {
                    Some(Fact::Text(t)) => t.push_str(e["delta"].as_str().unwrap_or_default()),
                    _ => panic!("text content without its start: {events:?}"),
                }
            }
            "TOOL_CALL_START" => out.push(Fact::Call(
                e["toolCallId"].as_str().unwrap_or_default().to_owned(),
            )),
            "TOOL_CALL_RESULT" => out.push(Fact::Result(
                e["toolCallId"].as_str().unwrap_or_default().to_owned(),
            )),
            _ => {}
        }
    }
    out
}

/// The same facts, from the record as `GET /v1/threads/{id}/events` serves it.
fn record_facts(events: &[tether::Event]) -> Vec<Fact> {
    let mut out = Vec::new();
    for e in events {
        match &e.kind {
            tether::EventKind::Message {
                role: tether::Role::Assistant,
                text,
                tool_uses,
                ..
            } => {
                if !text.is_empty() {
                    out.push(Fact::Text(text.clone()));
                }
                out.extend(tool_uses.iter().map(|u| Fact::Call(u.id.clone())));
            }
            tether::EventKind::ToolResult { result } => out.push(Fact::Result(result.tool_use_id.clone())),
            _ => {}
        }
    }
    out
}

/// The AG-UI messages a client holds after the streams `seen` (folded as `@ag-ui/client` does),
/// after its own message.
fn held_messages(thread: &str, seen: &[Value]) -> Vec<Value> {
    let mut msgs = vec![json!({"id": format!("{thread}-u1"), "role": "user", "content": PROMPT})];
    fn find<'a>(msgs: &'a mut [Value], id: &Value) -> Option<&'a mut Value> {
        msgs.iter_mut().rev().find(|m| &m["id"] == id)
    }
    for e in seen {
        match e["type"].as_str().unwrap_or_default() {
            "TEXT_MESSAGE_START" => {
                msgs.push(json!({"id": e["messageId"], "role": "assistant", "content": ""}));
            }
            "TEXT_MESSAGE_CONTENT" => {
                if let Some(m) = find(&mut msgs, &e["messageId"]) {
                    let text = format!(
                        "{}{}",
                        m["content"].as_str().unwrap_or_default(),
                        e["delta"].as_str().unwrap_or_default()
                    );
                    m["content"] = json!(text);
                }
            }
            "TOOL_CALL_START" => {
                let call = json!({"id": e["toolCallId"], "type": "function", "function": {"name": e["toolCallName"], "arguments": ""}});
                let parent = &e["parentMessageId"];
                match find(&mut msgs, parent).filter(|m| m["role"] == "assistant") {
                    Some(m) => {
                        if !m["toolCalls"].is_array() {
                            m["toolCalls"] = json!([]);
                        }
                        if let Some(a) = m["toolCalls"].as_array_mut() {
                            a.push(call);
                        }
                    }
                    None => {
                        let id = if parent.is_string() {
                            parent.clone()
                        } else {
                            e["toolCallId"].clone()
                        };
                        msgs.push(json!({"id": id, "role": "assistant", "toolCalls": [call]}));
                    }
                }
            }
            "TOOL_CALL_ARGS" => {
                for m in msgs.iter_mut().rev() {
                    if let Some(c) = m["toolCalls"]
                        .as_array_mut()
                        .and_then(|a| a.iter_mut().find(|c| c["id"] == e["toolCallId"]))
                    {
                        let args = format!(
                            "{}{}",
                            c["function"]["arguments"].as_str().unwrap_or_default(),
                            e["delta"].as_str().unwrap_or_default()
                        );
                        c["function"]["arguments"] = json!(args);
                        break;
                    }
                }
            }
            "TOOL_CALL_RESULT" => msgs.push(json!({
                "id": e["messageId"],
                "role": "tool",
                "toolCallId": e["toolCallId"],
                "content": e["content"],
            })),
            _ => {}
        }
    }
    msgs
}

/// POSTs a run to node `node` and returns its SSE events, failing with every log when it does
/// not finish (RUN_FINISHED) within three times [`PATIENCE`].
async fn run_on(c: &Cluster, node: &Node, what: &str, body: &Value) -> Vec<Value> {
    let (status, text) = tokio::time::timeout(PATIENCE * 3, post_at(node.addr, "main", body))
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {:?}\n{}", PATIENCE * 3, c.logs()));
    assert_eq!(status, 200, "{what}: {text}");
    let events = sse_events(&text);
    if events.last().is_none_or(|e| e["type"] != "RUN_FINISHED") {
        panic!("{what} failed: {events:?}\n{}", c.logs());
    }
    events
}

/// The thread's record as node `addr` serves it: asserted gapless, its event ids unique.
async fn record(addr: SocketAddr, thread: &str) -> Vec<tether::Event> {
    let r = client()
        .get(format!("http://{addr}/v1/threads/{thread}/events"))
        .send()
        .await
        .expect("GET events");
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.expect("events JSON");
    assert_gapless(&v);
    let events: Vec<tether::Event> =
        serde_json::from_value(v["events"].clone()).unwrap_or_else(|e| panic!("events: {e}: {v}"));
    events
}

/// Waits until `f` holds (checked every 20 ms); false when it did not within [`PATIENCE`].
async fn until(mut f: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !f() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    true
}

/// The checks both tests end with: the turn completed with the scripted text, the client's
/// streams together show the record B serves (each fact once, in order), the record is
/// gapless, each tool's result is recorded once, and the model was asked `steps` different
/// questions (every scripted answer used once).
///
/// Repeats are allowed where Restate's failover allows them: a step whose result had not been
/// made durable when Restate node 1 died is run again by the surviving leader (at-least-once
/// for a step in flight; the fake answers a repeated question alike, as a deterministic model
/// would). So a tool invoked in that window may have run twice: its effect is checked to be
/// that call's (the same tool-use id, `$TETHER_TOOL_USE_ID`, the key a tool that must act once
/// deduplicates by), never a second call's. A crash of the tether service alone repeats nothing
/// (the Restate crash tests count that).
async fn assert_complete(c: &Cluster, thread: &str, streams: &[&[Value]], steps: usize) {
    let events = record(c.b.addr, thread).await;
    let shown: Vec<Fact> = streams.iter().flat_map(|s| stream_facts(s)).collect();
    assert_eq!(
        shown,
        record_facts(&events),
        "the client's streams differ from the record (missed or shown twice)"
    );
    assert_eq!(
        shown,
        [
            Fact::Call("call_1".into()),
            Fact::Result("call_1".into()),
            Fact::Call("call_2".into()),
            Fact::Result("call_2".into()),
            Fact::Text("Both done.".into()),
        ]
    );
    let appended = c.lines("log.txt");
    assert!(
        !appended.is_empty() && appended.len() <= 2 && appended.iter().all(|l| l == "call_1 first"),
        "append_line ran for call_1 only: {appended:?}"
    );
    let touched = c.lines("touched.txt");
    assert!(
        !touched.is_empty() && touched.len() <= 2 && touched.iter().all(|l| l == "call_2"),
        "touch_file ran for call_2 only: {touched:?}"
    );
    let requests = c.fake.requests();
    let mut distinct = Vec::new();
    for q in requests.iter().map(|r| &r.body) {
        if !distinct.contains(&q) {
            distinct.push(q);
        }
    }
    assert_eq!(distinct.len(), steps, "different model questions");
    assert_eq!(c.fake.remaining(), 0, "every scripted answer used");
    // The listing is the agent's index object, which each turn updates with one-way calls:
    // Restate runs them after journaling them, not before the turn answers, so one queued on a
    // partition that is failing over may land after the turn's end. Read until it lists the
    // thread (seen once empty right after the turn; the logs tell what the nodes did).
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let r = client()
            .get(format!("http://{}/v1/threads?agent=main", c.b.addr))
            .send()
            .await
            .expect("GET threads");
        let s = r.status().as_u16();
        let v = r.json::<Value>().await.unwrap_or(Value::Null);
        assert_eq!(s, 200, "{v}");
        if v["threads"][0]["threadId"] == thread {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "B does not list the thread within {PATIENCE:?}: {v}\n{}",
                c.logs()
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Tether node A and Restate node 1 are SIGKILLed while the turn, started through A, waits for
/// the approval of `touch_file`; the client approves through B and reads the rest there.
#[tokio::test(flavor = "multi_thread")]
async fn a_waiting_turn_survives_losing_its_tether_node_and_a_restate_node() {
    let _one = SERIAL.lock().await;
    let mut c = Cluster::start().await;
    c.fake
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
    let thread = "t-scale-wait";
    let first = run_on(
        &c,
        &c.a,
        "the first run, through A",
        &prompt_input(thread, "r1", PROMPT),
    )
    .await;
    let intr = interrupt_of(&first);
    assert_eq!(intr["toolCallId"], "call_2", "{intr}");
    assert!(c.lines("touched.txt").is_empty(), "ran before its approval");

    c.kill_a_and_restate_1().await;

    let body = with_resume(
        input(thread, "r2", json!(held_messages(thread, &first))),
        &intr["id"],
        json!({"approved": true}),
    );
    let second = run_on(&c, &c.b, "the approval through B", &body).await;
    finished_ok(&second);
    assert_complete(&c, thread, &[&first, &second], 3).await;
}

/// Tether node A and Restate node 1 are SIGKILLed while the turn's second model call is in
/// flight on A (the fake model holds it open); the client's stream from A breaks; the client
/// reconnects to B by sending its message again with what it holds, gets the approval's
/// interrupt from B, approves through B, and reads the rest there. The model call in flight
/// when A died is made again (its step never completed): three questions, four calls.
#[tokio::test(flavor = "multi_thread")]
async fn a_turn_mid_model_step_survives_losing_its_tether_node_and_a_restate_node() {
    let _one = SERIAL.lock().await;
    let mut c = Cluster::start().await;
    c.fake
        .push(Reply::tool_calls(&[(
            "call_1",
            "append_line",
            r#"{"line":"first"}"#,
        )]))
        .push(Reply::text("never sent").stall_after(0))
        .push(Reply::tool_calls(&[(
            "call_2",
            "touch_file",
            r#"{"name":"touched.txt"}"#,
        )]))
        .push(Reply::text("Both done."));
    let thread = "t-scale-step";
    let stream = Stream::open(c.a.addr, &prompt_input(thread, "r1", PROMPT)).await;
    let fake = &c.fake;
    if !until(|| fake.requests().len() >= 2).await {
        panic!(
            "the second model call was not made within {PATIENCE:?} ({} calls); the client saw {:?}\n{}",
            fake.requests().len(),
            stream.seen(),
            c.logs()
        );
    }
    // The client holds the first tool call and its result (so the reconnect must not show them
    // again); the turn's next model call hangs on A.
    let held = || {
        stream
            .seen()
            .iter()
            .any(|e| e["type"] == "TOOL_CALL_RESULT" && e["toolCallId"] == "call_1")
    };
    if !until(held).await {
        panic!(
            "the client never saw call_1's result: {:?}\n{}",
            stream.seen(),
            c.logs()
        );
    }
    c.kill_a_and_restate_1().await;

    let (first, ended) = stream.end().await;
    assert!(
        !first.iter().any(|e| e["type"] == "RUN_FINISHED"),
        "the run on A finished: {first:?}"
    );
    assert!(
        ended.is_err() || first.last().is_some_and(|e| e["type"] == "RUN_ERROR"),
        "{ended:?}"
    );

    // Reconnect: the same message again, with the messages the client holds.
    let body = input(thread, "r2", json!(held_messages(thread, &first)));
    let second = run_on(&c, &c.b, "the reconnect through B", &body).await;
    let intr = interrupt_of(&second);
    assert_eq!(intr["toolCallId"], "call_2", "{intr}");
    assert!(c.lines("touched.txt").is_empty(), "ran before its approval");

    let mut seen = first.clone();
    seen.extend(second.iter().cloned());
    let body = with_resume(
        input(thread, "r3", json!(held_messages(thread, &seen))),
        &intr["id"],
        json!({"approved": true}),
    );
    let third = run_on(&c, &c.b, "the approval through B", &body).await;
    finished_ok(&third);
    assert_complete(&c, thread, &[&first, &second, &third], 3).await;
}

/// Tether node A and Restate node 1 are SIGKILLed while the turn's tool step runs on A (the tool
/// waits for a file); the tool's process dies with A (it never made its effect), the client's
/// stream from A breaks, and the client reconnects to B by sending its message again. The step
/// runs again on B's service (it never completed); the turn completes there, and the client's
/// streams together show the record once. The tool's effect is the call's own (once, or twice
/// if the failover repeated B's step too: see the module docs).
#[tokio::test(flavor = "multi_thread")]
async fn a_turn_mid_tool_step_survives_losing_its_tether_node_and_a_restate_node() {
    let _one = SERIAL.lock().await;
    let mut c = Cluster::start().await;
    c.fake
        .push(Reply::tool_calls(&[("call_1", "wait_for_go", "{}")]))
        .push(Reply::text("Waited."));
    let thread = "t-scale-tool";
    let stream = Stream::open(c.a.addr, &prompt_input(thread, "r1", PROMPT)).await;
    if !until(|| !c.lines("started.txt").is_empty()).await {
        panic!(
            "the tool never started; the client saw {:?}\n{}",
            stream.seen(),
            c.logs()
        );
    }
    c.kill_a_and_restate_1().await;
    let (first, ended) = stream.end().await;
    assert!(
        !first.iter().any(|e| e["type"] == "RUN_FINISHED"),
        "the run on A finished: {first:?}"
    );
    assert!(
        ended.is_err() || first.last().is_some_and(|e| e["type"] == "RUN_ERROR"),
        "{ended:?}"
    );
    std::fs::write(c.ws().join("go"), b"").expect("write go");

    let body = input(thread, "r2", json!(held_messages(thread, &first)));
    let second = run_on(&c, &c.b, "the reconnect through B", &body).await;
    finished_ok(&second);

    let events = record(c.b.addr, thread).await;
    let shown: Vec<Fact> = [&first, &second].iter().flat_map(|s| stream_facts(s)).collect();
    assert_eq!(
        shown,
        record_facts(&events),
        "the client's streams differ from the record (missed or shown twice): {first:?}\n{second:?}\n{}",
        c.logs()
    );
    assert_eq!(
        shown,
        [
            Fact::Call("call_1".into()),
            Fact::Result("call_1".into()),
            Fact::Text("Waited.".into()),
        ]
    );
    let waited = c.lines("waited.txt");
    assert!(
        !waited.is_empty() && waited.len() <= 2 && waited.iter().all(|l| l == "call_1"),
        "the tool's effect is call_1's own: {waited:?}"
    );
    assert!(
        c.lines("started.txt").len() >= 2,
        "the step ran again on B: {:?}",
        c.lines("started.txt")
    );
    assert_eq!(c.fake.remaining(), 0, "every scripted answer used");
}
