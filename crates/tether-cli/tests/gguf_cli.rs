//! `tether run` end to end on the embedded model (the default GGUF, which `scripts/test` fetches
//! into the user's cache before `cargo test`; fetched here otherwise): no endpoint, no key.

use std::process::{Command, Output, Stdio};

use serde_json::Value;

const CLEARED: [&str; 9] = [
    "OPENAI_BASE_URL",
    "TETHER_TOKEN",
    "OPENAI_API_KEY",
    "TETHER_MODEL",
    "TETHER_PROVIDER",
    "TETHER_GGUF",
    "TETHER_GGUF_TOOL_CHOICE",
    "TETHER_GGUF_SEED",
    "TETHER_GGUF_CONTEXT",
];

fn model_cached() {
    if let Err(e) = tether_gguf::fetch::default_model() {
        panic!("the embedded model is needed for this test: {e}");
    }
}

fn tether(dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tether"));
    cmd.args(args).current_dir(dir);
    for k in CLEARED {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("tether runs")
}

/// With no endpoint configured, `tether run` answers on the embedded model, streaming text, and
/// says on stderr which model runs and where it is cached.
#[test]
fn run_without_an_endpoint_uses_the_embedded_model() {
    model_cached();
    let dir = tempfile::tempdir().expect("tempdir");
    let o = tether(
        dir.path(),
        &[
            "run",
            "--json",
            "--max-turns",
            "3",
            "Say hello in one short sentence.",
        ],
        &[
            ("TETHER_GGUF_SEED", "greedy"),
            ("TETHER_GGUF_TOOL_CHOICE", "none"),
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "stdout: {out}\nstderr: {err}");
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("running the embedded model"))
        .collect();
    assert_eq!(lines.len(), 1, "{err}");
    let path = tether_gguf::fetch::default_model_path().expect("path");
    assert!(lines[0].contains(&path.display().to_string()), "{err}");
    assert!(lines[0].contains("SmolLM2-135M-Instruct"), "{err}");
    let mut deltas = 0;
    let mut result = None;
    for l in out.lines() {
        let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"));
        if v["event"]["kind"]["kind"] == "text_delta" {
            deltas += 1;
        }
        if v.get("result").is_some() {
            result = Some(v["result"].clone());
        }
    }
    let result = result.expect("a result line");
    assert!(deltas >= 2, "the answer streamed in {deltas} deltas: {out}");
    assert!(
        !result["text"].as_str().unwrap_or("").trim().is_empty(),
        "{result}"
    );
}

/// With `tool_choice` forced to a tool (a test-only option), the call runs through the workspace
/// handler and its result reaches the model: the next model call's prompt holds it, and that
/// call pre-fills only what is new.
#[test]
fn forced_tool_call_runs_and_its_result_reaches_the_model() {
    model_cached();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("zebra-marker.txt"), "stripes").expect("write");
    // Greedy SmolLM2-135M passes the tool's own name as the path (`{"path": "list_dir"}`); that
    // directory exists too, so whichever of the two it lists, the listing is real.
    std::fs::create_dir(dir.path().join("list_dir")).expect("mkdir");
    std::fs::write(dir.path().join("list_dir/zebra-marker.txt"), "stripes").expect("write");
    let o = tether(
        dir.path(),
        &["run", "--json", "--max-turns", "4", "What files are here?"],
        &[
            ("TETHER_GGUF_SEED", "greedy"),
            ("TETHER_GGUF_TOOL_CHOICE", "list_dir"),
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        matches!(o.status.code(), Some(0 | 3)),
        "stdout: {out}\nstderr: {err}"
    );
    let events: Vec<Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v.get("event").cloned())
        .collect();
    let result = events
        .iter()
        .find(|e| e["kind"]["kind"] == "tool_result")
        .unwrap_or_else(|| panic!("no tool result: {out}"));
    let content = result["kind"]["result"]["content"].as_str().unwrap_or("");
    assert!(content.contains("zebra-marker.txt"), "{result}");
    assert_ne!(result["kind"]["result"]["is_error"], true, "{result}");
    let usages: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"]["kind"] == "usage")
        .map(|e| &e["kind"]["usage"])
        .collect();
    assert!(usages.len() >= 2, "one model call after the tool result: {out}");
    let n = |u: &Value, k: &str| u[k].as_u64().unwrap_or(0);
    let (first, second) = (usages[0], usages[1]);
    // The second prompt is the first, the call, and the result: longer than the first prompt
    // and the call by at least the result's tokens, and only that tail was pre-filled.
    assert!(
        n(second, "input_tokens") > n(first, "input_tokens") + n(first, "output_tokens") + 5,
        "{first} then {second}"
    );
    assert!(
        n(second, "cache_read_tokens") >= n(first, "input_tokens"),
        "{first} then {second}"
    );
}

/// A GGUF path that does not exist is an error that says what to do, before any work.
#[test]
fn missing_gguf_says_what_to_do() {
    let dir = tempfile::tempdir().expect("tempdir");
    let o = tether(
        dir.path(),
        &["run", "--gguf", "/nonexistent/model.gguf", "hi"],
        &[],
    );
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no model file at /nonexistent/model.gguf"), "{err}");
    assert!(err.contains("--base-url"), "{err}");
}

/// `tether serve` with no config file and no endpoint serves its `default` agent on the
/// embedded model: an AG-UI run streams the model's text.
#[test]
fn serve_without_config_or_endpoint_runs_on_the_embedded_model() {
    use std::io::{BufRead, BufReader, Read, Write};
    model_cached();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tether"));
    cmd.args(["serve", "--bind", "127.0.0.1:0", "--db"])
        .arg(dir.path().join("t.db"))
        .current_dir(dir.path());
    for k in CLEARED {
        cmd.env_remove(k);
    }
    // The server's token (without one it makes its own and prints it on the terminal).
    let token = "gguf-serve-test-token";
    let mut child = cmd
        .env("TETHER_GGUF_SEED", "greedy")
        .env("TETHER_TOKEN", token)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tether serve starts");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stderr = child.stderr.take().expect("stderr");
    let mut child = Kill(child);
    // The address, from the one line that announces it (the model loads before it).
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = Vec::new();
    let addr = loop {
        let Some(Ok(l)) = lines.next() else {
            let _ = child.0.kill();
            panic!("tether serve ended before listening: {seen:?}");
        };
        if let Some(rest) = l.strip_prefix("tether serve: listening on http://") {
            break rest.split_whitespace().next().unwrap_or_default().to_owned();
        }
        seen.push(l);
    };
    assert!(seen.iter().any(|l| l.contains("embedded model")), "{seen:?}");
    let body = serde_json::json!({
        "threadId": "t1", "runId": "r1", "tools": [], "context": [], "state": {}, "forwardedProps": {},
        "messages": [{"id": "m1", "role": "user", "content": "Say hello."}]
    })
    .to_string();
    let mut s = std::net::TcpStream::connect(&addr).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(300)))
        .expect("timeout");
    write!(
        s,
        "POST /v1/agents/default/run HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\
         Authorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("TEXT_MESSAGE_CONTENT"), "{resp}");
    assert!(resp.contains("RUN_FINISHED"), "{resp}");
}
