//! Issue 12: an ACP agent's own `fs/*` and `terminal/create` requests under an `ask` workspace
//! policy are asked of the user, not refused. The testkit's scripted ACP agent (a real
//! subprocess) writes, reads and runs a command mid-turn; `tether serve` (over real HTTP on
//! 127.0.0.1, threads in a real SQLite file) ends the run with an approval interrupt while the
//! agent's request waits; the next request's `resume[]` approves (the workspace serves it) or
//! denies (the agent gets an error, nothing happens), and an interrupt id never issued is
//! refused before anything runs.

use serde_json::{Value, json};
use tether_serve::{Config, ServerOptions};

mod common;
use common::{finished_ok, interrupt_of, prompt_input as input, text_of, with_resume};
use tether_testkit::peers::fake_acp_agent as fake_agent;

async fn run(addr: std::net::SocketAddr, body: &Value) -> Vec<Value> {
    common::run_at(addr, "coder", body).await
}

async fn post(addr: std::net::SocketAddr, body: &Value) -> (u16, String) {
    common::post_at(addr, "coder", body).await
}

fn resume(thread: &str, run: &str, prompt: &str, id: &Value, approved: bool) -> Value {
    with_resume(input(thread, run, prompt), id, json!({"approved": approved}))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acp_agents_requests_under_ask_are_approval_interrupts() {
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::write(ws.join("notes.txt"), "secret notes").unwrap();
    let text = format!(
        r#"
[agents.coder]
provider = "acp"
command = [{agent:?}]
[agents.coder.workspace]
root = "{ws}"
reads = "ask"
writes = "ask"
commands = "ask"
"#,
        agent = fake_agent().display().to_string(),
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

    // A write, approved: asked first (nothing written while the question waits), then done.
    let target = ws.join("x.txt");
    let prompt = format!("write {} hello world", target.display());
    let first = run(addr, &input("t-write", "r1", &prompt)).await;
    let asked = interrupt_of(&first);
    assert_eq!(asked["reason"], "approval", "{asked}");
    let message = asked["message"].as_str().unwrap_or_default();
    assert!(message.contains("write x.txt (11 bytes)"), "{asked}");
    assert_eq!(asked["metadata"]["kind"], "edit", "{asked}");
    assert_eq!(asked["metadata"]["input"]["content"], "hello world", "{asked}");
    assert!(!target.exists(), "nothing is written before the user answers");
    // An id the server never issued is refused before anything runs; the question still waits.
    let (status, body) = post(
        addr,
        &resume("t-write", "r2", &prompt, &json!("approval_00"), true),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("INTERRUPT_NOT_ISSUED"), "{body}");
    assert!(!target.exists());
    let second = run(addr, &resume("t-write", "r3", &prompt, &asked["id"], true)).await;
    finished_ok(&second);
    assert!(text_of(&second).starts_with("ok:"), "{:?}", text_of(&second));
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "hello world");

    // A write, denied: the agent hears a refusal, nothing is written.
    let denied = ws.join("y.txt");
    let prompt = format!("write {} not wanted", denied.display());
    let first = run(addr, &input("t-deny", "r1", &prompt)).await;
    let asked = interrupt_of(&first);
    let second = run(addr, &resume("t-deny", "r2", &prompt, &asked["id"], false)).await;
    finished_ok(&second);
    let said = text_of(&second);
    assert!(
        said.starts_with("err:") && said.contains("not approved"),
        "{said}"
    );
    assert!(!denied.exists(), "a denied write never happens");

    // A read, denied: the agent never sees the content.
    let prompt = format!("read {}", ws.join("notes.txt").display());
    let first = run(addr, &input("t-read", "r1", &prompt)).await;
    let asked = interrupt_of(&first);
    assert_eq!(asked["metadata"]["kind"], "read", "{asked}");
    let second = run(addr, &resume("t-read", "r2", &prompt, &asked["id"], false)).await;
    let said = text_of(&second);
    assert!(said.starts_with("err:") && !said.contains("secret"), "{said}");
    // The same read, approved, on another thread: served.
    let first = run(addr, &input("t-read2", "r1", &prompt)).await;
    let asked = interrupt_of(&first);
    let second = run(addr, &resume("t-read2", "r2", &prompt, &asked["id"], true)).await;
    assert!(
        text_of(&second).contains("secret notes"),
        "{:?}",
        text_of(&second)
    );

    // A terminal command: asked once (at `terminal/create`), then run, waited on, read, released.
    let marker = ws.join("ran.txt");
    let prompt = "terminal - touch ran.txt";
    let first = run(addr, &input("t-term", "r1", prompt)).await;
    let asked = interrupt_of(&first);
    assert_eq!(asked["metadata"]["kind"], "execute", "{asked}");
    assert!(
        asked["message"]
            .as_str()
            .unwrap_or_default()
            .contains("run `touch ran.txt`"),
        "{asked}"
    );
    assert!(!marker.exists(), "nothing runs before the user answers");
    let second = run(addr, &resume("t-term", "r2", prompt, &asked["id"], true)).await;
    finished_ok(&second);
    let said = text_of(&second);
    assert!(
        said.contains("create ok:") && said.contains("release ok:"),
        "{said}"
    );
    assert!(marker.exists(), "the approved command ran");
    // Denied: the command never starts.
    let prompt = "terminal - touch never.txt";
    let first = run(addr, &input("t-term2", "r1", prompt)).await;
    let asked = interrupt_of(&first);
    let second = run(addr, &resume("t-term2", "r2", prompt, &asked["id"], false)).await;
    let said = text_of(&second);
    assert!(said.starts_with("create err:"), "{said}");
    assert!(!ws.join("never.txt").exists(), "a denied command never runs");
}
