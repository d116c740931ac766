//! An MCP server's elicitation on an `openai` agent of `tether serve` (issue 14): the agent is
//! served by `ThreadAgent` like every other kind, so the pinned reference server's
//! `trigger-elicitation-request` tool asking the user for input mid-call ends the run with an
//! elicitation interrupt (before, serve's own `openai` adapter declined it without asking). The
//! next request's `resume` answers it: accepted content reaches the server and the tool's result
//! the model hears; a decline is a decline; a forged or used-up id is refused with 409. Real HTTP
//! on 127.0.0.1, the testkit's fake OpenAI server, the real reference server as a subprocess.

use std::path::PathBuf;

use serde_json::{Value, json};
use tether_serve::{Config, ServerOptions};
use tether_testkit::openai::{FakeOpenAi, Reply};

fn everything_js() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../conformance/mcp/node_modules/@modelcontextprotocol/server-everything/dist/index.js");
    assert!(
        p.exists(),
        "the MCP reference server is not installed at {}: run `(cd conformance/mcp && npm ci)` (scripts/test does)",
        p.display()
    );
    p
}

fn input(thread: &str, run: &str) -> Value {
    json!({"threadId": thread, "runId": run,
        "messages": [{"id": format!("{thread}-u1"), "role": "user", "content": "ask me"}],
        "tools": [], "context": [], "state": {}, "forwardedProps": {}})
}

async fn post(addr: std::net::SocketAddr, body: &Value) -> (u16, String) {
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/agents/main/run"))
        .header("accept", "text/event-stream")
        .json(body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

async fn run(addr: std::net::SocketAddr, body: &Value) -> Vec<Value> {
    let (status, text) = post(addr, body).await;
    assert_eq!(status, 200, "{text}");
    text.split("\n\n")
        .filter_map(|f| f.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn text_of(events: &[Value]) -> String {
    events
        .iter()
        .filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT")
        .map(|e| e["delta"].as_str().unwrap())
        .collect()
}

/// The result of tool call `id` as the model heard it (the last request's `tool` message).
fn heard(fake: &FakeOpenAi, id: &str) -> String {
    let reqs = fake.requests();
    let last = reqs.last().unwrap();
    let m = last
        .messages()
        .iter()
        .find(|m| m["role"] == "tool" && m["tool_call_id"] == id)
        .unwrap_or_else(|| panic!("no result for {id} in {:?}", last.messages()))
        .clone();
    m["content"].as_str().unwrap_or_default().to_owned()
}

fn interrupt_of(events: &[Value]) -> Value {
    let fin = events.last().unwrap();
    assert_eq!(fin["type"], "RUN_FINISHED", "{fin}");
    assert_eq!(fin["outcome"]["type"], "interrupt", "{fin}");
    let list = fin["outcome"]["interrupts"].as_array().unwrap();
    assert_eq!(list.len(), 1, "{fin}");
    list[0].clone()
}

fn resume(thread: &str, run: &str, id: &Value, payload: Value) -> Value {
    let mut body = input(thread, run);
    body["resume"] = json!([{"interruptId": id, "status": "resolved", "payload": payload}]);
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_elicitation_on_an_openai_agent_is_an_interrupt_the_browser_answers() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[(
        "call_1",
        "trigger-elicitation-request",
        "{}",
    )]));
    fake.push(Reply::text("Thanks, Ada."));
    fake.push(Reply::tool_calls(&[(
        "call_2",
        "trigger-elicitation-request",
        "{}",
    )]));
    fake.push(Reply::text("Fine."));
    let text = format!(
        r#"
[agents.main]
base_url = "{url}"
model = "fake"
[[agents.main.mcp]]
name = "everything"
command = "node"
args = ["{js}", "stdio"]
"#,
        url = fake.url(),
        js = everything_js().display()
    );
    let config = Config::parse(&text, "test.toml", dir.path()).unwrap();
    let server = tether_serve::start(ServerOptions {
        config,
        bind: "127.0.0.1:0".into(),
        db: dir.path().join("tether.db"),
        token: None,
    })
    .await
    .unwrap();
    let addr = server.addr();

    // 1. The server asks for input: an elicitation interrupt with its message and schema; the
    //    call has no result yet (the old adapter declined here and the run went on).
    let ev = run(addr, &input("t", "r1")).await;
    let intr = interrupt_of(&ev);
    assert_eq!(intr["reason"], "elicitation", "{intr}");
    assert!(intr["message"].as_str().is_some_and(|m| !m.is_empty()), "{intr}");
    assert_eq!(intr["metadata"]["mode"], "form", "{intr}");
    assert!(
        intr["metadata"]["requestedSchema"]["properties"]["name"].is_object(),
        "{intr}"
    );
    let id = intr["id"].as_str().unwrap().to_owned();
    assert!(
        !ev.iter()
            .any(|e| e["type"] == "TOOL_CALL_RESULT" && e["toolCallId"] == "call_1"),
        "the call waits for the answer"
    );
    assert_eq!(fake.requests().len(), 1, "nothing ran past the question");

    // 2. A forged id is refused before anything runs; the question still waits.
    let accept = json!({"action": "accept", "content": {"name": "Ada Lovelace", "check": true}});
    let forged = format!("approval_{}", "0".repeat(32));
    let (status, body) = post(addr, &resume("t", "r2", &json!(forged), accept.clone())).await;
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("INTERRUPT_NOT_ISSUED"), "{body}");

    // 3. Accepted: the content reaches the server, whose result the model hears.
    let ev = run(addr, &resume("t", "r3", &json!(id), accept.clone())).await;
    assert_eq!(ev.last().unwrap()["type"], "RUN_FINISHED", "{ev:?}");
    assert_eq!(text_of(&ev), "Thanks, Ada.");
    let content = heard(&fake, "call_1");
    assert!(content.contains("Ada Lovelace"), "{content}");
    assert_eq!(fake.requests().len(), 2);

    // 4. The same id again: used up.
    let (status, body) = post(addr, &resume("t", "r4", &json!(id), accept)).await;
    assert_eq!(status, 409, "{body}");

    // 5. Declined on another thread: the server hears a decline, and nothing of the content.
    let ev = run(addr, &input("t2", "r5")).await;
    let intr = interrupt_of(&ev);
    assert_eq!(intr["reason"], "elicitation", "{intr}");
    let ev = run(
        addr,
        &resume(
            "t2",
            "r6",
            &intr["id"],
            json!({"action": "decline", "content": {"name": "Mallory"}}),
        ),
    )
    .await;
    assert_eq!(text_of(&ev), "Fine.");
    let content = heard(&fake, "call_2");
    assert!(
        content.contains("declined") && content.contains("decline") && !content.contains("Mallory"),
        "{content}"
    );
}
