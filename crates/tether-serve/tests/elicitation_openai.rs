//! An MCP server's elicitation on an `openai` agent of `tether serve` (issue 14): the agent is
//! served by `ThreadAgent` like every other kind, so the pinned reference server's
//! `trigger-elicitation-request` tool asking the user for input mid-call ends the run with an
//! elicitation interrupt (before, serve's own `openai` adapter declined it without asking). The
//! next request's `resume` answers it: accepted content reaches the server and the tool's result
//! the model hears; a decline is a decline; a forged or used-up id is refused with 409. Real HTTP
//! on 127.0.0.1, the testkit's fake OpenAI server, the real reference server as a subprocess.

use serde_json::{Value, json};
use tether_serve::{Config, ServerOptions};
use tether_testkit::openai::{FakeOpenAi, Reply};

mod common;
use common::{everything_js, interrupt_of, text_of, with_resume};

fn input(thread: &str, run: &str) -> Value {
    common::prompt_input(thread, run, "ask me")
}

async fn run(addr: std::net::SocketAddr, body: &Value) -> Vec<Value> {
    common::run_at(addr, "main", body).await
}

async fn post(addr: std::net::SocketAddr, body: &Value) -> (u16, String) {
    common::post_at(addr, "main", body).await
}

fn resume(thread: &str, run: &str, id: &Value, payload: Value) -> Value {
    with_resume(input(thread, run), id, payload)
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
    let server = tether_serve::start(ServerOptions::new(
        config,
        "127.0.0.1:0",
        dir.path().join("tether.db"),
    ))
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
