//! The testkit's fake Bedrock AgentCore data plane as a process, for `tether serve`'s provider
//! tests (`conformance/agui/serve-providers.mjs`). Its runtime answers, in order: a
//! `write_file` tool use (which the agent's workspace policy may ask the user about), a
//! confirmation once the result comes back, then an answer to each follow-up message.
//!
//! `cargo run -p tether-serve --example fake_agentcore` prints `listening on http://127.0.0.1:PORT`
//! (the data-plane origin) and serves until killed.

use serde_json::json;
use tether_testkit::agentcore::{FakeAgentCore, Reply};

#[tokio::main]
async fn main() {
    let mut script = vec![
        Reply::Json(json!({
            "text": "Writing the file.",
            "tool_uses": [{"id": "t_write", "name": "write_file",
                           "input": {"path": "agentcore.txt", "content": "hello from agentcore\n"}}],
            "stop_reason": "tool_use"
        })),
        Reply::Json(json!({"text": "Wrote agentcore.txt.", "stop_reason": "end_turn"})),
    ];
    for i in 1..=8 {
        script.push(Reply::Json(
            json!({"text": format!("Follow-up answer {i}."), "stop_reason": "end_turn"}),
        ));
    }
    let fake = FakeAgentCore::start(script).await;
    println!("listening on {}", fake.url());
    std::future::pending::<()>().await;
}
