//! `tether serve` end to end: real sockets on 127.0.0.1, a real SQLite file, the testkit's fake
//! OpenAI server behind the agents.

use std::path::Path;

use serde_json::{Value, json};
use tether_serve::{Config, Server, ServerOptions};
use tether_testkit::openai::{FakeOpenAi, Reply};

struct Env {
    dir: tempfile::TempDir,
    fake: FakeOpenAi,
}

impl Env {
    async fn new() -> Env {
        Env {
            dir: tempfile::tempdir().unwrap(),
            fake: FakeOpenAi::start().await,
        }
    }

    fn config(&self, extra: &str) -> Config {
        let ws = self.dir.path().join("ws");
        std::fs::create_dir_all(&ws).unwrap();
        let text = format!(
            r#"
[agents.main]
base_url = "{url}"
model = "fake"
system_prompt = "be brief"
[agents.main.workspace]
root = "{ws}"
[[agents.main.commands]]
name = "append_line"
description = "Append a line to log.txt"
command = 'printf "%s %s\n" "$TETHER_TOOL_USE_ID" "$TETHER_ARG_LINE" >> log.txt'
{extra}
"#,
            url = self.fake.url(),
            ws = ws.display(),
        );
        Config::parse(&text, "test.toml", self.dir.path()).unwrap()
    }

    async fn start(&self, config: Config, token: Option<&str>) -> Server {
        tether_serve::start(ServerOptions {
            config,
            bind: "127.0.0.1:0".into(),
            db: self.dir.path().join("tether.db"),
            token: token.map(str::to_owned),
        })
        .await
        .unwrap()
    }

    fn ws(&self) -> std::path::PathBuf {
        self.dir.path().join("ws")
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

fn input(thread: &str, run: &str, messages: Value) -> Value {
    json!({"threadId": thread, "runId": run, "messages": messages, "tools": [], "context": [], "state": {}, "forwardedProps": {}})
}

/// POSTs a run and returns its decoded SSE events.
async fn run(server: &Server, agent: &str, body: &Value, token: Option<&str>) -> Vec<Value> {
    let mut req = client()
        .post(format!("http://{}/v1/agents/{agent}/run", server.addr()))
        .header("accept", "text/event-stream")
        .json(body);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    sse_events(&resp.text().await.unwrap())
}

/// The `data:` payloads of an SSE body.
fn sse_events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|frame| frame.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

fn text_of(events: &[Value]) -> String {
    events
        .iter()
        .filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT")
        .map(|e| e["delta"].as_str().unwrap())
        .collect()
}

fn last(events: &[Value]) -> &Value {
    events.last().unwrap()
}

async fn get(server: &Server, path: &str) -> (u16, Value) {
    let r = client()
        .get(format!("http://{}{path}", server.addr()))
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_thread_streams_text_and_resumes_across_requests_and_restarts() {
    let env = Env::new().await;
    env.fake.push(Reply::text("Hello there.").chunk_chars(3));
    env.fake.push(Reply::text("Second answer."));
    env.fake.push(Reply::text("Third answer."));
    let server = env.start(env.config(""), None).await;

    assert_eq!(get(&server, "/healthz").await, (200, json!({"ok": true})));
    let (s, agents) = get(&server, "/v1/agents").await;
    assert_eq!(s, 200);
    assert_eq!(agents["agents"][0]["name"], "main");

    let m1 = json!([{"id": "u1", "role": "user", "content": "hi"}]);
    let ev = run(&server, "main", &input("t1", "r1", m1.clone()), None).await;
    assert_eq!(types(&ev)[0], "RUN_STARTED");
    assert_eq!(last(&ev)["type"], "RUN_FINISHED");
    assert_eq!(text_of(&ev), "Hello there.");
    assert!(types(&ev).contains(&"STATE_SNAPSHOT"));

    // A follow-up: the client sends the whole conversation again; only the new message counts.
    let mut m2 = m1.as_array().unwrap().clone();
    m2.push(json!({"id": "a1", "role": "assistant", "content": "Hello there."}));
    m2.push(json!({"id": "u2", "role": "user", "content": "more"}));
    let ev = run(&server, "main", &input("t1", "r2", json!(m2)), None).await;
    assert_eq!(text_of(&ev), "Second answer.");
    let sent = env.fake.requests()[1].messages().to_vec();
    let roles: Vec<&str> = sent.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user"]);

    // Restart on the same database: the thread continues with its history.
    server.shutdown();
    server.wait().await;
    let server = env.start(env.config(""), None).await;
    let (_, threads) = get(&server, "/v1/threads?agent=main").await;
    assert_eq!(threads["threads"][0]["threadId"], "t1");
    assert_eq!(threads["threads"][0]["title"], "hi");
    m2.push(json!({"id": "u3", "role": "user", "content": "again"}));
    let ev = run(&server, "main", &input("t1", "r3", json!(m2)), None).await;
    assert_eq!(text_of(&ev), "Third answer.");
    let roles: Vec<String> = env.fake.requests()[2]
        .messages()
        .iter()
        .map(|m| m["role"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "user", "assistant", "user"]
    );

    let (s, events) = get(&server, "/v1/threads/t1/events").await;
    assert_eq!(s, 200);
    let seqs: Vec<u64> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "gapless record"
    );
    let (_, msgs) = get(&server, "/v1/threads/t1/messages").await;
    let texts: Vec<&str> = msgs["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["content"].as_str())
        .collect();
    assert_eq!(
        texts,
        [
            "hi",
            "Hello there.",
            "more",
            "Second answer.",
            "again",
            "Third answer."
        ]
    );
    assert_eq!(get(&server, "/v1/threads/nope/events").await.0, 404);
}

#[tokio::test]
async fn a_write_needs_approval_through_an_interrupt() {
    let env = Env::new().await;
    env.fake.push(Reply::tool_calls(&[(
        "call_w",
        "write_file",
        r#"{"path":"hello.txt","content":"hello"}"#,
    )]));
    env.fake.push(Reply::text("Wrote it."));
    env.fake.push(Reply::tool_calls(&[(
        "call_w2",
        "write_file",
        r#"{"path":"nope.txt","content":"x"}"#,
    )]));
    env.fake.push(Reply::text("Understood."));
    let server = env.start(env.config(""), None).await;

    let m = json!([{"id": "u1", "role": "user", "content": "write hello"}]);
    let ev = run(&server, "main", &input("t", "r1", m.clone()), None).await;
    let fin = last(&ev);
    assert_eq!(fin["type"], "RUN_FINISHED");
    assert_eq!(fin["outcome"]["type"], "interrupt", "{fin}");
    let intr = &fin["outcome"]["interrupts"][0];
    assert_eq!(intr["toolCallId"], "call_w");
    assert!(
        !env.ws().join("hello.txt").exists(),
        "nothing is written before approval"
    );

    // The client answers the interrupt; the assistant message with the call is in its history.
    let mut m2 = m.as_array().unwrap().clone();
    m2.push(json!({"id": "a1", "role": "assistant", "toolCalls": [{"id": "call_w", "type": "function", "function": {"name": "write_file", "arguments": "{}"}}]}));
    let mut body = input("t", "r2", json!(m2));
    body["resume"] =
        json!([{"interruptId": intr["id"], "status": "resolved", "payload": {"approved": true}}]);
    let ev = run(&server, "main", &body, None).await;
    assert_eq!(last(&ev)["type"], "RUN_FINISHED", "{ev:?}");
    assert!(
        ev.iter()
            .any(|e| e["type"] == "TOOL_CALL_RESULT" && e["toolCallId"] == "call_w")
    );
    assert_eq!(text_of(&ev), "Wrote it.");
    assert_eq!(
        std::fs::read_to_string(env.ws().join("hello.txt")).unwrap(),
        "hello"
    );

    // A denial: the tool does not run and the model hears why.
    m2.push(json!({"id": "u2", "role": "user", "content": "write another"}));
    let ev = run(&server, "main", &input("t", "r3", json!(m2.clone())), None).await;
    let intr = last(&ev)["outcome"]["interrupts"][0].clone();
    let mut body = input("t", "r4", json!(m2));
    body["resume"] = json!([{"interruptId": intr["id"], "status": "cancelled"}]);
    let ev = run(&server, "main", &body, None).await;
    assert_eq!(text_of(&ev), "Understood.");
    assert!(!env.ws().join("nope.txt").exists());
    let sent = env.fake.requests()[3].messages().to_vec();
    let tool = sent.iter().rev().find(|m| m["role"] == "tool").unwrap();
    assert!(tool["content"].as_str().unwrap().contains("denied"), "{tool}");
}

#[tokio::test]
async fn front_end_tools_end_the_run_pending_and_take_results_next_time() {
    let env = Env::new().await;
    env.fake
        .push(Reply::tool_calls(&[("call_c", "confirm", r#"{"q":"ok?"}"#)]));
    env.fake.push(Reply::text("Confirmed."));
    let server = env.start(env.config(""), None).await;
    let tools = json!([{"name": "confirm", "description": "ask", "parameters": {"type": "object"}}]);
    let mut body = input("t", "r1", json!([{"id": "u1", "role": "user", "content": "go"}]));
    body["tools"] = tools.clone();
    let ev = run(&server, "main", &body, None).await;
    let fin = last(&ev);
    assert_eq!(fin["outcome"]["pendingToolCallIds"], json!(["call_c"]), "{fin}");
    assert!(!ev.iter().any(|e| e["type"] == "TOOL_CALL_RESULT"));

    let mut body = input(
        "t",
        "r2",
        json!([
            {"id": "u1", "role": "user", "content": "go"},
            {"id": "a1", "role": "assistant", "toolCalls": [{"id": "call_c", "type": "function", "function": {"name": "confirm", "arguments": "{}"}}]},
            {"id": "tm1", "role": "tool", "toolCallId": "call_c", "content": "yes"}
        ]),
    );
    body["tools"] = tools;
    let ev = run(&server, "main", &body, None).await;
    assert_eq!(text_of(&ev), "Confirmed.");
    let sent = env.fake.requests()[1].messages().to_vec();
    assert_eq!(sent.last().unwrap()["content"], "yes");
}

/// A tool ran and its result was recorded, then the model call after it failed (as a crash
/// would leave it): the next request answers the call from the memo without running it again.
#[tokio::test]
async fn a_recorded_tool_result_is_not_run_again_on_resume() {
    let env = Env::new().await;
    env.fake.push(Reply::tool_calls(&[(
        "call_a",
        "append_line",
        r#"{"line":"one"}"#,
    )]));
    env.fake.push(Reply::error(400, "boom", "invalid_request_error"));
    env.fake.push(Reply::text("Appended."));
    let server = env.start(env.config(""), None).await;
    let body = input(
        "t",
        "r1",
        json!([{"id": "u1", "role": "user", "content": "append one"}]),
    );
    let ev = run(&server, "main", &body, None).await;
    assert_eq!(last(&ev)["type"], "RUN_ERROR", "{ev:?}");
    let log = env.ws().join("log.txt");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "call_a one\n");

    let mut body = input(
        "t",
        "r2",
        json!([{"id": "u1", "role": "user", "content": "append one"}]),
    );
    body["runId"] = json!("r2");
    let ev = run(&server, "main", &body, None).await;
    assert_eq!(text_of(&ev), "Appended.", "{ev:?}");
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "call_a one\n",
        "ran exactly once"
    );
    let sent = env.fake.requests()[2].messages().to_vec();
    let roles: Vec<&str> = sent.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool"]);
}

#[tokio::test]
async fn refusals_token_body_size_run_time_and_concurrency() {
    // No token on a non-loopback bind: refused before anything listens.
    let env = Env::new().await;
    let err = tether_serve::start(ServerOptions {
        config: env.config(""),
        bind: "0.0.0.0:0".into(),
        db: env.dir.path().join("x.db"),
        token: None,
    })
    .await
    .unwrap_err();
    assert!(err.to_string().contains("without a token"), "{err}");

    let mut cfg = env.config("");
    cfg.server.max_body_bytes = 2048;
    cfg.server.run_timeout_secs = 1;
    cfg.server.max_concurrent_runs = 1;
    let server = env.start(cfg, Some("s3cret")).await;
    let url = format!("http://{}/v1/agents/main/run", server.addr());
    let body = input("t", "r1", json!([{"id": "u1", "role": "user", "content": "hi"}]));

    let r = client()
        .get(format!("http://{}/v1/agents", server.addr()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client()
        .post(&url)
        .bearer_auth("wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["code"], "UNAUTHORIZED");
    assert_eq!(get(&server, "/healthz").await.0, 200, "health needs no token");

    let big = input(
        "t",
        "r1",
        json!([{"id": "u1", "role": "user", "content": "x".repeat(4096)}]),
    );
    let r = client()
        .post(&url)
        .bearer_auth("s3cret")
        .header("accept", "text/event-stream")
        .json(&big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);

    // A model that stalls: the run hits its limit and ends in RUN_ERROR with a clear code; while
    // it runs, a second run is over the concurrency limit.
    env.fake.push(Reply::text("never finished").stall_after(1));
    let first = client()
        .post(&url)
        .bearer_auth("s3cret")
        .header("accept", "text/event-stream")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    let second = client()
        .post(&url)
        .bearer_auth("s3cret")
        .header("accept", "text/event-stream")
        .json(&input(
            "t2",
            "r1",
            json!([{"id": "u1", "role": "user", "content": "hi"}]),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(second.status(), 429);
    let text = first.text().await.unwrap();
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|f| f.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let fin = last(&events);
    assert_eq!(fin["type"], "RUN_ERROR");
    assert_eq!(fin["code"], "RUN_TIMEOUT", "{fin}");

    // The ended run gave its place back (the refusals above took none: the first run got in).
    env.fake.push(Reply::text("room again"));
    let third = run(
        &server,
        "main",
        &input("t3", "r1", json!([{"id": "u1", "role": "user", "content": "hi"}])),
        Some("s3cret"),
    )
    .await;
    assert_eq!(text_of(&third), "room again");
}

#[test]
fn the_binary_refuses_a_public_bind_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tether-serve"))
        .args(["--bind", "0.0.0.0:0", "--db"])
        .arg(dir.path().join("t.db"))
        .env_remove("TETHER_TOKEN")
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("without a token"), "{err}");
    assert!(
        !Path::new(&dir.path().join("t.db")).exists(),
        "nothing was created"
    );
}

/// A graceful shutdown closes the listener at once, lets the turn in progress stream to its end,
/// and returns when its connection has closed.
#[tokio::test]
async fn shutdown_lets_a_running_turn_finish_and_takes_no_new_connections() {
    let env = Env::new().await;
    env.fake.push(
        Reply::text("slow and steady")
            .chunk_chars(1)
            .pace(std::time::Duration::from_millis(20)),
    );
    let server = env.start(env.config(""), None).await;
    let addr = server.addr();
    let body = input(
        "t-sd",
        "r1",
        json!([{"id": "u1", "role": "user", "content": "hi"}]),
    );
    let running = tokio::spawn(async move {
        let resp = client()
            .post(format!("http://{addr}/v1/agents/main/run"))
            .header("accept", "text/event-stream")
            .json(&body)
            .send()
            .await
            .unwrap();
        resp.text().await.unwrap()
    });
    // Shut down while the model streams.
    for _ in 0..500 {
        if !env.fake.requests().is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(env.fake.requests().len(), 1, "the run reached the model");
    server.shutdown();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let late = client().get(format!("http://{addr}/healthz")).send().await;
    assert!(
        late.is_err(),
        "a new connection after shutdown was accepted: {late:?}"
    );
    let events = sse_events(&running.await.unwrap());
    assert_eq!(text_of(&events), "slow and steady");
    assert_eq!(last(&events)["type"], "RUN_FINISHED");
    tokio::time::timeout(std::time::Duration::from_secs(10), server.wait())
        .await
        .expect("the server stops once its last connection has closed");
}
