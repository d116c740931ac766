//! The testkit's fake Claude Managed Agents as a process, for `tether serve`'s provider tests
//! (`conformance/agui/serve-providers.mjs`). Every session plays the same turns: a
//! `write_file` custom tool use (which the agent's workspace policy may ask the user about),
//! then a confirmation once its result is posted, then an answer to each follow-up message.
//!
//! With the argument `crash`, every session plays an `append_line` command-tool use, then a
//! confirmation (for the crash check).
//!
//! `cargo run -p tether-serve --example fake_managed` prints `listening on http://127.0.0.1:PORT`
//! (the API origin) and serves until killed.

use serde_json::json;
use tether_testkit::managed::{FakeManaged, ManagedFaults};

#[tokio::main]
async fn main() {
    let idle = |reason: &str| json!({"type": "session.status_idle", "stop_reason": {"type": reason}});
    let say = |text: &str| json!({"type": "agent.message", "content": [{"type": "text", "text": text}]});
    if std::env::args().nth(1).as_deref() == Some("crash") {
        // The crash check (`conformance/serve/crash.mjs` with CRASH_PROVIDER=managed): each
        // session calls the `append_line` command tool once, then confirms.
        let turns = vec![
            vec![
                json!({"type": "agent.custom_tool_use", "name": "append_line",
                       "input": {"line": "a line from the managed crash check"}}),
                idle("requires_action"),
            ],
            vec![say("Appended the line."), idle("end_turn")],
        ];
        let fake = FakeManaged::start(turns, ManagedFaults::default()).await;
        println!("listening on {}", fake.url());
        return std::future::pending::<()>().await;
    }
    let mut turns = vec![
        vec![
            say("Writing the file."),
            json!({"type": "agent.custom_tool_use", "name": "write_file",
                   "input": {"path": "managed.txt", "content": "hello from managed agents\n"}}),
            idle("requires_action"),
        ],
        vec![say("Wrote managed.txt."), idle("end_turn")],
    ];
    for i in 1..=8 {
        turns.push(vec![say(&format!("Follow-up answer {i}.")), idle("end_turn")]);
    }
    let fake = FakeManaged::start(turns, ManagedFaults::default()).await;
    println!("listening on {}", fake.url());
    std::future::pending::<()>().await;
}
