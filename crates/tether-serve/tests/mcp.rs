//! MCP servers in `tether serve` (`[[agents.NAME.mcp]]`): the pinned reference server's tools are
//! offered to the agent, and a tool marked for approval becomes an AG-UI approval interrupt the
//! browser answers (over the real HTTP API on 127.0.0.1).

use serde_json::{Value, json};
use tether_serve::{Config, ServerOptions};
use tether_testkit::openai::{FakeOpenAi, Reply};

mod common;
use common::{everything_js, input, result_of, text_of};

async fn run(addr: std::net::SocketAddr, body: &Value) -> Vec<Value> {
    common::run_at(addr, "main", body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_tool_marked_for_approval_is_an_interrupt_in_the_browser() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeOpenAi::start().await;
    let text = format!(
        r#"
[agents.main]
base_url = "{url}"
model = "fake"
[[agents.main.mcp]]
name = "everything"
command = "node"
args = ["{js}", "stdio"]
approval = ["get-sum"]
deny = ["get-env"]
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

    // The agent lists the server's tools (not the denied one).
    let agents: Value = reqwest::get(format!("http://{addr}/v1/agents"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let tools = agents.to_string();
    assert!(
        tools.contains("get-sum") && tools.contains("echo") && !tools.contains("get-env"),
        "{tools}"
    );

    fake.push_all([
        Reply::tool_calls(&[("e1", "echo", r#"{"message":"no approval needed"}"#)]),
        Reply::tool_calls(&[("s1", "get-sum", r#"{"a":1,"b":2}"#)]),
        Reply::text("Sum done."),
        Reply::tool_calls(&[("s2", "get-sum", r#"{"a":5,"b":5}"#)]),
        Reply::text("Okay."),
    ]);
    // 1. echo runs at once; get-sum waits for the user: the run ends with an interrupt.
    let m = json!([{"id": "u1", "role": "user", "content": "add"}]);
    let ev = run(addr, &input("t", "r1", m.clone())).await;
    let echo = result_of(&ev, "e1").expect("echo ran");
    assert_eq!(echo["content"], "Echo: no approval needed");
    let fin = ev.last().unwrap();
    assert_eq!(fin["outcome"]["type"], "interrupt", "{fin}");
    let intr = fin["outcome"]["interrupts"][0].clone();
    assert_eq!(intr["toolCallId"], "s1");
    assert!(
        intr["message"]
            .as_str()
            .unwrap()
            .contains("MCP server `everything`"),
        "{intr}"
    );
    assert!(result_of(&ev, "s1").is_none(), "not run before approval");

    // 2. Approved: it runs, and the model hears its result.
    let mut m2 = m.as_array().unwrap().clone();
    m2.push(json!({"id": "a1", "role": "assistant", "toolCalls": [{"id": "s1", "type": "function", "function": {"name": "get-sum", "arguments": "{}"}}]}));
    let mut body = input("t", "r2", json!(m2));
    body["resume"] =
        json!([{"interruptId": intr["id"], "status": "resolved", "payload": {"approved": true}}]);
    let ev = run(addr, &body).await;
    assert_eq!(text_of(&ev), "Sum done.");
    let r = result_of(&ev, "s1").expect("s1 ran");
    assert!(r["content"].as_str().unwrap().contains("is 3"), "{r}");

    // 3. Refused: it never reaches the server, and the model hears why.
    m2.push(json!({"id": "u2", "role": "user", "content": "again"}));
    let ev = run(addr, &input("t", "r3", json!(m2.clone()))).await;
    let intr = ev.last().unwrap()["outcome"]["interrupts"][0].clone();
    assert_eq!(intr["toolCallId"], "s2");
    let mut body = input("t", "r4", json!(m2));
    body["resume"] = json!([{"interruptId": intr["id"], "status": "cancelled"}]);
    let ev = run(addr, &body).await;
    assert_eq!(text_of(&ev), "Okay.");
    let sent = fake.requests().last().unwrap().messages().to_vec();
    let tool = sent.iter().rev().find(|m| m["role"] == "tool").unwrap();
    let content = tool["content"].as_str().unwrap();
    assert!(
        content.contains("denied") && !content.contains("is 10"),
        "{content}"
    );
}

/// A server that cannot start stops `tether serve` at start, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_cannot_start_fails_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let text = r#"
[agents.main]
base_url = "http://127.0.0.1:9/v1"
[[agents.main.mcp]]
name = "nothing"
command = "/nonexistent/mcp"
"#;
    let config = Config::parse(text, "test.toml", dir.path()).unwrap();
    let Err(e) = tether_serve::start(ServerOptions::new(
        config,
        "127.0.0.1:0",
        dir.path().join("tether.db"),
    ))
    .await
    else {
        panic!("the server must not start")
    };
    let m = e.to_string();
    assert!(
        m.contains("MCP server `nothing`") && m.contains("/nonexistent/mcp"),
        "{m}"
    );
}

/// Config mistakes in `[[agents.NAME.mcp]]` are named when the file is read.
#[test]
fn mcp_config_mistakes_are_named() {
    let dir = tempfile::tempdir().unwrap();
    for (text, needle) in [
        (
            "[agents.main]\n[[agents.main.mcp]]\nname = \"x\"\ncommand = \"a\"\naproval = \"always\"\n",
            "aproval",
        ),
        ("[agents.main]\n[[agents.main.mcp]]\nname = \"x\"\n", "command"),
        (
            "[agents.main]\n[[agents.main.mcp]]\nname = \"x\"\ncommand = \"a\"\napproval = \"maybe\"\n",
            "maybe",
        ),
        (
            "[agents.main]\n[[agents.main.mcp]]\nname = \"x\"\ncommand = \"a\"\n[[agents.main.mcp]]\nname = \"x\"\ncommand = \"b\"\n",
            "two MCP servers",
        ),
    ] {
        let e = Config::parse(text, "t.toml", dir.path()).unwrap_err().to_string();
        assert!(e.contains(needle), "{needle}: {e}");
    }
}
