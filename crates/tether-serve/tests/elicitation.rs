//! An MCP server's elicitation in `tether serve`: on an agent served by `ThreadAgent` (here the
//! Anthropic local loop, against the testkit fake), the pinned reference server's
//! `trigger-elicitation-request` tool asks the user for input mid-call; the run ends with an
//! elicitation interrupt carrying the server's message and schema, and the next request's
//! `resume` answers it: accepted content reaches the server (and the tool's result), a decline is
//! a decline, and an interrupt id the server never issued is refused (over real HTTP on
//! 127.0.0.1, with the real reference server as a subprocess).

use serde_json::{Value, json};
use tether_serve::{Config, ServerOptions};
use tether_testkit::anthropic::{FakeMessages, Reply, sse_body};

mod common;
use common::{everything_js, interrupt_of, result_of, text_of, with_resume};

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

/// A streamed Messages answer with one content block (`start` its opening, `delta` its content).
fn message(start: Value, delta: Value, stop: &str) -> Reply {
    Reply::Sse(sse_body(&[
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
            "model": "claude-test", "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 1, "output_tokens": 1}}}),
        json!({"type": "content_block_start", "index": 0, "content_block": start}),
        json!({"type": "content_block_delta", "index": 0, "delta": delta}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null},
            "usage": {"output_tokens": 1}}),
        json!({"type": "message_stop"}),
    ]))
}

fn elicit_call(id: &str) -> Reply {
    message(
        json!({"type": "tool_use", "id": id, "name": "trigger-elicitation-request", "input": {}}),
        json!({"type": "input_json_delta", "partial_json": "{}"}),
        "tool_use",
    )
}

fn text(t: &str) -> Reply {
    message(
        json!({"type": "text", "text": ""}),
        json!({"type": "text_delta", "text": t}),
        "end_turn",
    )
}

/// The result of tool call `id` as the model heard it (the last request's `tool_result`).
fn heard(fake: &FakeMessages, id: &str) -> String {
    let last = fake.requests().last().unwrap().body.clone();
    let block = last["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["content"].as_array())
        .flatten()
        .find(|b| b["type"] == "tool_result" && b["tool_use_id"] == id)
        .unwrap_or_else(|| panic!("no result for {id} in {last}"))
        .clone();
    block["content"].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_elicitation_is_an_interrupt_the_browser_answers() {
    // The only test in this binary: nothing else reads the environment while it is set.
    // SAFETY: no other thread of this process reads or writes the environment here.
    unsafe { std::env::set_var("TETHER_TEST_ELICIT_KEY", "sk-test") };
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeMessages::start(vec![
        elicit_call("toolu_1"),
        text("Thanks, Ada."),
        elicit_call("toolu_2"),
        text("Fine."),
    ])
    .await;
    let text = format!(
        r#"
[agents.main]
provider = "anthropic"
base_url = "{url}"
api_key_env = "TETHER_TEST_ELICIT_KEY"
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

    // 1. The tool's server asks for input: the run ends with an elicitation interrupt showing
    //    the server's message and schema; the tool has no result yet.
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
    assert!(id.starts_with("approval_") && id.len() == 41, "{id}");
    assert!(
        result_of(&ev, "toolu_1").is_none(),
        "the call waits for the answer"
    );

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
    let content = heard(&fake, "toolu_1");
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
    let content = heard(&fake, "toolu_2");
    assert!(
        content.contains("declined")
            && content.contains(r#"\"action\": \"decline\""#)
            && !content.contains("Mallory"),
        "{content}"
    );
}
