//! MCP servers through the real `tether run` binary on the fake model, with the pinned reference
//! server (`conformance/mcp`): a Claude-style `--mcp-config` file end to end, `--mcp
//! NAME=COMMAND`, and an approval refused at the terminal prompt.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{Value, json};
use tether_testkit::openai::{FakeOpenAi, Reply};
use tether_testkit::peers::mcp_everything_server as everything_js;

fn tether(dir: &std::path::Path, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(args)
        .current_dir(dir)
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY")
        .env_remove("TETHER_MODEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the tether binary starts")
}

/// Waits for the child (at most a minute: generous, the server is node on a shared machine).
fn finish(mut child: Child) -> (Option<i32>, String, String) {
    let mut out = child.stdout.take().unwrap();
    let err = child.stderr.take();
    let o = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let e = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut err) = err {
            let _ = err.read_to_string(&mut s);
        }
        s
    });
    let (tx, rx) = mpsc::channel();
    let pid = child.id();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(s) => s.ok().and_then(|s| s.code()),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("tether did not exit within 60 s");
        }
    };
    (status, o.join().unwrap(), e.join().unwrap())
}

fn tool_messages(fake: &FakeOpenAi) -> Vec<Value> {
    let reqs = fake.requests();
    reqs.last()
        .map(|r| {
            r.messages()
                .iter()
                .filter(|m| m["role"] == "tool")
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_config_file_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("mcp.json");
    std::fs::write(
        &cfg,
        json!({"mcpServers": {"everything": {
            "command": "node",
            "args": [everything_js(), "stdio"],
            "prefix": "always"
        }}})
        .to_string(),
    )
    .unwrap();
    let fake = FakeOpenAi::start().await;
    fake.push_all([
        Reply::tool_calls(&[("c1", "everything__echo", r#"{"message":"from the cli"}"#)]),
        Reply::text("all done"),
    ]);
    let url = fake.url();
    let child = tether(
        dir.path(),
        &[
            "run",
            "--base-url",
            &url,
            "--mcp-config",
            cfg.to_str().unwrap(),
            "go",
        ],
    );
    let (code, out, err) = tokio::task::spawn_blocking(move || finish(child)).await.unwrap();
    assert_eq!(code, Some(0), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("all done"), "{out}");
    let declared = fake.requests()[0].body["tools"].to_string();
    assert!(
        declared.contains("everything__echo") && declared.contains("read_file"),
        "{declared}"
    );
    let tools = tool_messages(&fake);
    assert_eq!(tools.len(), 1);
    assert_eq!(tools[0]["content"], "Echo: from the cli");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_does_not_start_is_named_with_its_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeOpenAi::start().await;
    let url = fake.url();
    let child = tether(
        dir.path(),
        &[
            "run",
            "--base-url",
            &url,
            "--mcp",
            "broken=node -e 'console.error(\"no config\"); process.exit(4)'",
            "go",
        ],
    );
    let (code, out, err) = tokio::task::spawn_blocking(move || finish(child)).await.unwrap();
    assert_eq!(code, Some(2), "stdout: {out}\nstderr: {err}");
    assert!(
        err.contains("MCP server `broken`") && err.contains("node -e"),
        "{err}"
    );
    assert!(err.contains("no config"), "the server's stderr is shown: {err}");
    assert!(fake.requests().is_empty(), "nothing was asked of the model");
}

/// The approval question is asked on the terminal; `n` refuses, and the tool is never called
/// (the model is told so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_refused_at_the_prompt_is_not_called() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("mcp.json");
    std::fs::write(
        &cfg,
        json!({"mcpServers": {"everything": {
            "command": "node",
            "args": [everything_js(), "stdio"],
            "approval": ["get-sum"]
        }}})
        .to_string(),
    )
    .unwrap();
    let fake = FakeOpenAi::start().await;
    fake.push_all([
        Reply::tool_calls(&[("s1", "get-sum", r#"{"a":1,"b":2}"#)]),
        Reply::text("ok then"),
    ]);
    let url = fake.url();
    let mut child = tether(
        dir.path(),
        &[
            "run",
            "--base-url",
            &url,
            "--mcp-config",
            cfg.to_str().unwrap(),
            "go",
        ],
    );
    // Wait for the question, then answer it.
    let stderr = child.stderr.take().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stderr);
        let mut all = String::new();
        let mut buf = Vec::new();
        // The prompt has no newline: read byte-wise up to `: `.
        while r.read_until(b' ', &mut buf).map(|n| n > 0).unwrap_or(false) {
            all.push_str(&String::from_utf8_lossy(&buf));
            buf.clear();
            if all.contains("[N]o: ") {
                let _ = tx.send(all.clone());
            }
        }
        let _ = tx.send(all);
    });
    let asked = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the question is asked");
    assert!(
        asked.contains("allow get-sum") && asked.contains("everything"),
        "{asked}"
    );
    stdin.write_all(b"n\n").unwrap();
    drop(stdin);
    let (code, out, err) = tokio::task::spawn_blocking(move || finish(child)).await.unwrap();
    assert_eq!(code, Some(0), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("ok then"), "{out}");
    let tools = tool_messages(&fake);
    assert_eq!(tools.len(), 1);
    let content = tools[0]["content"].as_str().unwrap();
    assert!(
        content.contains("refused") && content.contains("not run"),
        "{content}"
    );
    assert!(!content.contains("is 3"), "the tool must not have run: {content}");
}

/// A server's elicitation is asked at the terminal, field by field; the answer reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_elicitation_is_answered_at_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeOpenAi::start().await;
    fake.push_all([
        Reply::tool_calls(&[("el1", "trigger-elicitation-request", "{}")]),
        Reply::text("thanks"),
    ]);
    let url = fake.url();
    let js = everything_js();
    let mcp = format!("everything=node '{}' stdio", js.display());
    let mut child = tether(dir.path(), &["run", "--base-url", &url, "--mcp", &mcp, "go"]);
    // y to answer, the required name, then Enter for every other field (defaults, or left out).
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"y\nAda Lovelace\n").unwrap();
    stdin.write_all(&b"\n".repeat(20)).unwrap();
    drop(stdin);
    let (code, out, err) = tokio::task::spawn_blocking(move || finish(child)).await.unwrap();
    assert_eq!(code, Some(0), "stdout: {out}\nstderr: {err}");
    assert!(err.contains("the tool asks: Please provide inputs"), "{err}");
    let tools = tool_messages(&fake);
    assert_eq!(tools.len(), 1);
    let content = tools[0]["content"].as_str().unwrap();
    assert!(
        content.contains("Name: Ada Lovelace") && content.contains("\"action\": \"accept\""),
        "{content}"
    );
}
