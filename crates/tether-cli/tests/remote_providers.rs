//! `tether run --provider managed|agentcore|anthropic` as a subprocess against the testkit fakes,
//! and the errors for missing credentials and ids.

use std::process::{Command, Output, Stdio};

use serde_json::json;
use tether_testkit::agentcore::{FakeAgentCore, Reply as AcReply, golden_frames};
use tether_testkit::anthropic::{FakeMessages, Reply as MsgReply, golden};
use tether_testkit::managed::{FakeManaged, ManagedFaults};

const CLEARED: [&str; 13] = [
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
