//! `tether run` driven as a subprocess against the testkit's fake OpenAI server.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use tether_testkit::openai::{FakeOpenAi, Reply};

fn tether(dir: &std::path::Path, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(args)
        .current_dir(dir)
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY")
        .env_remove("TETHER_MODEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the tether binary starts");
    if let Some(mut i) = child.stdin.take() {
        let _ = i.write_all(stdin.as_bytes());
    }
    child.wait_with_output().expect("tether exits")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tool_call_writes_a_file_with_yes() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[(
        "c1",
        "write_file",
        r#"{"path":"out.txt","content":"hello"}"#,
    )]));
    fake.push(Reply::text("Wrote it.").usage(12, 3));
    let dir = tempfile::tempdir().unwrap();
    let url = fake.url();
    let o = tokio::task::spawn_blocking({
        let d = dir.path().to_path_buf();
        move || {
            tether(
                &d,
                &[
                    "run",
                    "--base-url",
                    &url,
                    "--model",
                    "m",
                    "--yes",
                    "write hello to out.txt",
                ],
                "",
            )
        }
    })
    .await
    .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("out.txt")).unwrap(),
        "hello"
    );
    assert!(out.contains("⚙ write_file"), "{out}");
    assert!(out.contains("✓ wrote out.txt (5 bytes)"), "{out}");
    assert!(out.contains("Wrote it."), "{out}");
    assert!(err.contains("12 input + 3 output tokens"), "{err}");
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    let tools: Vec<String> = reqs[0].body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        tools,
        [
            "read_file",
            "list_dir",
            "search_files",
            "write_file",
            "edit_file",
            "run_command"
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_approval_touches_nothing_and_an_accepted_one_does() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[(
        "c1",
        "run_command",
        r#"{"command":"touch made"}"#,
    )]));
    fake.push(Reply::text("ok"));
    let dir = tempfile::tempdir().unwrap();
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let o =
        tokio::task::spawn_blocking(move || tether(&d, &["run", "--base-url", &url, "make a file"], "n\n"))
            .await
            .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(err.contains("? allow run `touch made`?"), "{err}");
    assert!(out.contains("✗ refused: run `touch made`: not approved"), "{out}");
    assert!(!dir.path().join("made").exists());
    let sent = &fake.requests()[1].body["messages"];
    let tool_msg = sent
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .unwrap();
    assert!(tool_msg["content"].as_str().unwrap().contains("not approved"));

    fake.push(Reply::tool_calls(&[(
        "c2",
        "run_command",
        r#"{"command":"touch made"}"#,
    )]));
    fake.push(Reply::text("ok"));
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let o =
        tokio::task::spawn_blocking(move || tether(&d, &["run", "--base-url", &url, "make a file"], "y\n"))
            .await
            .unwrap();
    assert!(o.status.success());
    assert!(dir.path().join("made").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_escape_attempt_is_refused() {
    let fake = FakeOpenAi::start().await;
    let outer = tempfile::tempdir().unwrap();
    std::fs::write(outer.path().join("secret.txt"), "top secret").unwrap();
    let ws = outer.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    fake.push(Reply::tool_calls(&[
        ("c1", "read_file", r#"{"path":"../secret.txt"}"#),
        ("c2", "write_file", r#"{"path":"../pwned.txt","content":"x"}"#),
    ]));
    fake.push(Reply::text("could not"));
    let url = fake.url();
    let o = tokio::task::spawn_blocking(move || {
        tether(&ws, &["run", "--base-url", &url, "--yes", "read it"], "")
    })
    .await
    .unwrap();
    let (out, _) = text(&o);
    assert!(o.status.success());
    assert_eq!(out.matches("is outside the workspace").count(), 2, "{out}");
    assert!(!out.contains("top secret"));
    assert!(!outer.path().join("pwned.txt").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_say_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    // No endpoint runs the embedded model (tests/gguf_cli.rs); a GGUF that is not there says
    // what to do instead.
    let o =
        tokio::task::spawn_blocking(move || tether(&d, &["run", "--gguf", "/nonexistent/m.gguf", "hi"], ""))
            .await
            .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o).1;
    assert!(
        err.contains("no model file at /nonexistent/m.gguf") && err.contains("--base-url"),
        "{err}"
    );

    // Nothing listens on this port: bind, note the port, close.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/v1");
    let d = dir.path().to_path_buf();
    let o = tokio::task::spawn_blocking(move || tether(&d, &["run", "--base-url", &url, "hi"], ""))
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).1.contains("connection refused. Is the server running?"),
        "{}",
        text(&o).1
    );

    let fake = FakeOpenAi::start().await;
    fake.push(Reply::error(401, "Incorrect API key provided", "invalid_api_key"));
    fake.push(Reply::error(
        404,
        "The model `nope` does not exist",
        "model_not_found",
    ));
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let o = tokio::task::spawn_blocking(move || tether(&d, &["run", "--base-url", &url, "hi"], ""))
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o).1;
    assert!(
        err.contains("rejected the credentials (HTTP 401): Incorrect API key provided"),
        "{err}"
    );
    assert!(err.contains("OPENAI_API_KEY"));
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let o = tokio::task::spawn_blocking(move || {
        tether(&d, &["run", "--base-url", &url, "--model", "nope", "hi"], "")
    })
    .await
    .unwrap();
    let err = text(&o).1;
    assert!(err.contains("404") && err.contains("`nope`"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn json_mode_prints_events_and_the_result() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text("hi there"));
    let dir = tempfile::tempdir().unwrap();
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let o = tokio::task::spawn_blocking(move || tether(&d, &["run", "--json", "--base-url", &url, "hi"], ""))
        .await
        .unwrap();
    assert!(o.status.success());
    let (out, _) = text(&o);
    let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let last = lines.last().unwrap();
    assert_eq!(last["result"]["text"], "hi there");
    assert_eq!(last["result"]["terminal"], "end_turn");
    assert!(lines.iter().any(|l| l["event"]["type"] == "local.model_response"));
}

/// The binary's compiled-in jemalloc options take effect (the same as `tether-serve`'s).
#[test]
fn the_allocator_options_are_read() {
    let out = Command::new(env!("CARGO_BIN_EXE_tether"))
        .arg("--help")
        .env("_RJEM_MALLOC_CONF", "stats_print:true")
        .output()
        .expect("tether --help");
    let err = String::from_utf8_lossy(&out.stderr);
    let has = |opt: &str| err.lines().any(|l| l.trim_start().starts_with(opt));
    assert!(has("opt.dirty_decay_ms: 20 "), "{err}");
    assert!(has("opt.muzzy_decay_ms: 0 "), "{err}");
}
