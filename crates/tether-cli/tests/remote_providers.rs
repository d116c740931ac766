//! `tether run --provider managed|agentcore|anthropic` as a subprocess against the testkit fakes,
//! and the errors for missing credentials and ids.

use std::process::{Command, Output, Stdio};

use serde_json::json;
use tether_testkit::agentcore::{FakeAgentCore, Reply as AcReply, golden_frames};
use tether_testkit::anthropic::{FakeMessages, Reply as MsgReply, golden};
use tether_testkit::managed::{FakeManaged, ManagedFaults};

const CLEARED: [&str; 14] = [
    "ANTHROPIC_MODEL",
    "OPENAI_BASE_URL",
    "OPENAI_API_KEY",
    "TETHER_MODEL",
    "TETHER_PROVIDER",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "TETHER_MANAGED_AGENT_ID",
    "TETHER_MANAGED_ENVIRONMENT_ID",
    "TETHER_AGENTCORE_RUNTIME_ARN",
    "TETHER_AGENTCORE_HARNESS_ARN",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
];

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

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn managed_runs_a_tool_against_the_fake() {
    let turns = vec![
        vec![
            json!({"type": "agent.custom_tool_use", "name": "write_file", "input": {"path": "out.txt", "content": "hi"}}),
            json!({"type": "session.status_idle", "stop_reason": {"type": "requires_action"}}),
        ],
        vec![
            json!({"type": "agent.message", "content": [{"type": "text", "text": "Wrote it."}]}),
            json!({"type": "session.status_idle", "stop_reason": {"type": "end_turn"}}),
        ],
    ];
    let fake = FakeManaged::start(turns, ManagedFaults::default()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let o = tokio::task::spawn_blocking(move || {
        tether(
            &d,
            &[
                "run",
                "--provider",
                "managed",
                "--agent-id",
                "agent_1",
                "--environment-id",
                "env_1",
                "--yes",
                "write hi to out.txt",
            ],
            &[("ANTHROPIC_API_KEY", "sk-test"), ("ANTHROPIC_BASE_URL", &url)],
        )
    })
    .await
    .expect("join");
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("Wrote it."), "{out}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("out.txt")).unwrap_or_default(),
        "hi"
    );
    let posted = fake.posted();
    assert_eq!(posted[0]["type"], "user.message");
    assert_eq!(posted[1]["type"], "user.custom_tool_result");
}

#[tokio::test(flavor = "multi_thread")]
async fn agentcore_harness_against_the_fake() {
    let fake = FakeAgentCore::start(vec![AcReply::Frames(golden_frames("final_turn.json"))]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let o = tokio::task::spawn_blocking(move || {
        tether(
            &d,
            &[
                "run",
                "--provider",
                "agentcore",
                "--harness-arn",
                "arn:aws:bedrock-agentcore:us-east-1:123456789012:harness/h_abc-0123456789",
                "--region",
                "us-east-1",
                "what is x?",
            ],
            &[
                ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
                ("AWS_SECRET_ACCESS_KEY", "secret"),
                ("TETHER_AGENTCORE_ENDPOINT", &url),
            ],
        )
    })
    .await
    .expect("join");
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("x is 42."), "{out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn anthropic_messages_against_the_fake() {
    let fake = FakeMessages::start(vec![MsgReply::Sse(golden("final_text.sse"))]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let o = tokio::task::spawn_blocking(move || {
        tether(
            &d,
            &[
                "run",
                "--provider",
                "anthropic",
                "--anthropic-model",
                "claude-test",
                "hi",
            ],
            &[("ANTHROPIC_API_KEY", "sk-test"), ("ANTHROPIC_BASE_URL", &url)],
        )
    })
    .await
    .expect("join");
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("It is sunny in Paris."), "{out}");
    assert_eq!(fake.requests()[0].body["model"], "claude-test");
}

/// Runs `tether run --provider anthropic <extra> hi` against a fake answering `reply`; returns
/// the body of the request the fake received.
async fn anthropic_request(extra: &[&str], env: &[(&str, &str)], reply: MsgReply) -> serde_json::Value {
    let fake = FakeMessages::start(vec![reply]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let mut args: Vec<String> = ["run", "--provider", "anthropic"].map(String::from).to_vec();
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args.push("hi".into());
    let mut vars: Vec<(String, String)> = vec![
        ("ANTHROPIC_API_KEY".into(), "sk-test".into()),
        ("ANTHROPIC_BASE_URL".into(), url),
    ];
    vars.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    let o = tokio::task::spawn_blocking(move || {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let e: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        tether(&d, &a, &e)
    })
    .await
    .expect("join");
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("It is sunny in Paris."), "{out}");
    fake.requests()[0].body.clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn anthropic_takes_model_and_system_like_openai() {
    let sse = || MsgReply::Sse(golden("final_text.sse"));
    let body = anthropic_request(&["--model", "claude-flag", "--system", "Be brief."], &[], sse()).await;
    assert_eq!(body["model"], "claude-flag");
    assert_eq!(body["system"], json!([{"type": "text", "text": "Be brief."}]));
    assert_eq!(body["stream"], true);

    let body = anthropic_request(&[], &[("TETHER_MODEL", "claude-env")], sse()).await;
    assert_eq!(body["model"], "claude-env");
    assert!(body.get("system").is_none(), "{body}");

    // ANTHROPIC_MODEL is the fallback: TETHER_MODEL wins when both are set.
    let body = anthropic_request(&[], &[("ANTHROPIC_MODEL", "claude-anthropic-env")], sse()).await;
    assert_eq!(body["model"], "claude-anthropic-env");
    let both = [
        ("ANTHROPIC_MODEL", "claude-anthropic-env"),
        ("TETHER_MODEL", "claude-env"),
    ];
    let body = anthropic_request(&[], &both, sse()).await;
    assert_eq!(body["model"], "claude-env");

    let body = anthropic_request(&[], &[], sse()).await;
    assert_eq!(body["model"], "claude-sonnet-4-5");
}

#[tokio::test(flavor = "multi_thread")]
async fn anthropic_no_stream_sends_stream_false() {
    let reply = MsgReply::Json(serde_json::from_str(&golden("final_text.json")).expect("json"));
    let body = anthropic_request(&["--no-stream", "--model", "claude-x"], &[], reply).await;
    assert_eq!(body["stream"], false);
    assert_eq!(body["model"], "claude-x");
}

#[tokio::test(flavor = "multi_thread")]
async fn managed_reports_model_and_system_as_ignored() {
    let turns = vec![vec![
        json!({"type": "agent.message", "content": [{"type": "text", "text": "ok"}]}),
        json!({"type": "session.status_idle", "stop_reason": {"type": "end_turn"}}),
    ]];
    let fake = FakeManaged::start(turns, ManagedFaults::default()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let o = tokio::task::spawn_blocking(move || {
        tether(
            &d,
            &[
                "run",
                "--provider",
                "managed",
                "--agent-id",
                "agent_1",
                "--environment-id",
                "env_1",
                "--system",
                "Be brief.",
                "hi",
            ],
            &[
                ("ANTHROPIC_API_KEY", "sk-test"),
                ("ANTHROPIC_BASE_URL", &url),
                ("TETHER_MODEL", "gpt-x"),
            ],
        )
    })
    .await
    .expect("join");
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(
        err.contains("--model / TETHER_MODEL and --system ignored with --provider managed"),
        "{err}"
    );
}

#[test]
fn missing_credentials_and_ids_are_explained() {
    let dir = tempfile::tempdir().expect("tempdir");
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 5] = [
        (&["run", "--provider", "managed", "x"], &[], "ANTHROPIC_API_KEY"),
        (&["run", "--provider", "anthropic", "x"], &[], "ANTHROPIC_API_KEY"),
        (
            &["run", "--provider", "managed", "x"],
            &[("ANTHROPIC_API_KEY", "k")],
            "--agent-id and --environment-id",
        ),
        (&["run", "--provider", "agentcore", "x"], &[], "--runtime-arn"),
        (
            &["run", "--provider", "agentcore", "--runtime-arn", "arn:x", "x"],
            &[],
            "AWS_ACCESS_KEY_ID",
        ),
    ];
    for (args, env, needle) in cases {
        let o = tether(dir.path(), args, env);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
