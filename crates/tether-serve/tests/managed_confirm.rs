//! Issue 12: a Managed Agents built-in tool that needs the user's confirmation
//! (`agent.tool_use` with `needs_confirmation`, then an idle `requires_action` naming it) is an
//! approval interrupt in `tether serve`: the run ends with it while the remote session waits, no
//! `user.tool_confirmation` is posted before the user answers, and the next request's `resume[]`
//! posts `allow` (approved) or `deny` (denied), after which the remote turn finishes. Against the
//! testkit's Managed Agents fake, over real HTTP on 127.0.0.1, threads in a real SQLite file.

use serde_json::{Value, json};
use tether_serve::{Config, ServerOptions};
use tether_testkit::managed::{FakeManaged, ManagedFaults};

mod common;
use common::{interrupt_of, text_of, with_resume};

fn input(thread: &str, run: &str) -> Value {
    common::prompt_input(thread, run, "list the files")
}

async fn run(addr: std::net::SocketAddr, body: &Value) -> Vec<Value> {
    common::run_at(addr, "remote", body).await
}

async fn post(addr: std::net::SocketAddr, body: &Value) -> (u16, String) {
    common::post_at(addr, "remote", body).await
}

fn resume(thread: &str, run: &str, id: &Value, approved: bool) -> Value {
    with_resume(input(thread, run), id, json!({"approved": approved}))
}

fn confirmations(fake: &FakeManaged) -> Vec<Value> {
    fake.posted()
        .into_iter()
        .filter(|e| e["type"] == "user.tool_confirmation")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_managed_tool_confirmation_is_an_interrupt_approved_or_denied() {
    // The only test in this binary: nothing else reads the environment while it is set.
    // SAFETY: no other thread of this process reads or writes the environment here.
    unsafe { std::env::set_var("TETHER_TEST_MANAGED_KEY", "sk-test") };
    let idle = |reason: &str| json!({"type": "session.status_idle", "stop_reason": {"type": reason}});
    let say = |text: &str| json!({"type": "agent.message", "content": [{"type": "text", "text": text}]});
    // Every session plays these turns: a built-in `bash` call waiting for confirmation, then
    // (once it is answered) its result and an answer.
    let turns = vec![
        vec![
            say("Let me look."),
            json!({"type": "agent.tool_use", "name": "bash", "input": {"command": "ls"},
                   "needs_confirmation": true}),
            idle("requires_action"),
        ],
        vec![
            json!({"type": "agent.tool_result", "tool_use_id": "x",
                   "content": [{"type": "text", "text": "a.txt"}]}),
            say("Done looking."),
            idle("end_turn"),
        ],
    ];
    let fake = FakeManaged::start(turns, ManagedFaults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    let text = format!(
        r#"
[agents.remote]
provider = "managed"
base_url = "{url}"
api_key_env = "TETHER_TEST_MANAGED_KEY"
agent_id = "agent_1"
environment_id = "env_1"
[agents.remote.workspace]
root = "{ws}"
"#,
        url = fake.url(),
        ws = ws.display(),
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

    // Approved.
    let first = run(addr, &input("t-yes", "r1")).await;
    let asked = interrupt_of(&first);
    assert_eq!(asked["reason"], "approval", "{asked}");
    assert!(
        asked["message"].as_str().unwrap_or_default().contains("bash"),
        "{asked}"
    );
    assert_eq!(asked["metadata"]["input"], json!({"command": "ls"}), "{asked}");
    assert!(text_of(&first).contains("Let me look."), "{first:?}");
    assert!(
        confirmations(&fake).is_empty(),
        "nothing is confirmed before the user answers"
    );
    let second = run(addr, &resume("t-yes", "r2", &asked["id"], true)).await;
    let fin = second.last().unwrap();
    assert_eq!(fin["type"], "RUN_FINISHED", "{second:?}");
    assert_ne!(fin["outcome"]["type"], "interrupt", "{fin}");
    assert!(text_of(&second).contains("Done looking."), "{second:?}");
    let c = confirmations(&fake);
    assert_eq!(c.len(), 1, "{c:?}");
    assert_eq!(c[0]["result"], "allow", "{c:?}");
    // Answered once: the same interrupt id is refused now, and nothing more is posted.
    let (status, body) = post(addr, &resume("t-yes", "r3", &asked["id"], true)).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(confirmations(&fake).len(), 1);

    // Denied.
    let first = run(addr, &input("t-no", "r1")).await;
    let asked = interrupt_of(&first);
    assert_eq!(confirmations(&fake).len(), 1, "nothing posted before the answer");
    let second = run(addr, &resume("t-no", "r2", &asked["id"], false)).await;
    let fin = second.last().unwrap();
    assert_eq!(fin["type"], "RUN_FINISHED", "{second:?}");
    let c = confirmations(&fake);
    assert_eq!(c.len(), 2, "{c:?}");
    assert_eq!(c[1]["result"], "deny", "{c:?}");
    assert!(c[1]["deny_message"].is_string(), "{c:?}");
}
