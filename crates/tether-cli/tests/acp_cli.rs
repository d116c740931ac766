//! `tether acp` and `tether run --provider acp` driven as subprocesses (piped stdin/stdout)
//! against the ACP SDK's example agent, the third-party judge: its permission question asked on
//! the terminal and answered `y`/`n` (or `--yes`), its tool calls and text printed, Ctrl-C
//! cancelling a turn, `--json`, and `--session-id` refused with a typed error because the example
//! agent does not advertise `loadSession`.

mod acp_common;

use acp_common::{Cli, example_argv, tether};
use serde_json::Value;

#[test]
fn a_turn_with_the_permission_answered_at_the_prompt() {
    let agent = example_argv();
    let dir = tempfile::tempdir().unwrap();
    let mut cli = Cli::start(&[], dir.path(), &agent);
    cli.wait_for("tether acp: `node`, session ");
    cli.send("please fix the config");
    let out = cli.wait_for("? allow Modifying critical configuration file (edit)?");
    assert!(out.contains("I'll help you with that."), "{out}");
    assert!(out.contains("⚙ Reading project files"), "{out}");
    assert!(
        out.contains("✓ # My Project\\n\\nThis is a sample project..."),
        "{out}"
    );
    // The call that asks is shown before its question.
    let call = out.find("⚙ Modifying critical configuration file").expect(&out);
    let question = out.find("? allow Modifying").expect(&out);
    assert!(call < question, "{out}");
    cli.send("y");
    let out = cli.wait_for("[stop: end_turn]");
    assert!(out.contains("allowed once"), "{out}");
    assert!(
        out.contains(r#"✓ {"success":true,"message":"Configuration updated"}"#),
        "{out}"
    );
    assert!(out.contains("successfully updated the configuration"), "{out}");
    // A follow-up message goes to the same session, and is asked again.
    cli.send("once more");
    cli.wait_for("? allow Modifying critical configuration file (edit)?");
    cli.send("n");
    let out = cli.wait_for("[stop: end_turn]");
    assert!(out.contains("skip the configuration update"), "{out}");
    let (status, _, _) = cli.finish();
    assert!(status.success(), "{status}");
}

#[test]
fn yes_allows_without_asking_and_no_refuses() {
    let agent = example_argv();
    let dir = tempfile::tempdir().unwrap();
    let mut cli = Cli::start(&["--yes"], dir.path(), &agent);
    cli.send("go");
    let out = cli.wait_for("[stop: end_turn]");
    assert!(!out.contains("? allow"), "{out}");
    assert!(out.contains("successfully updated the configuration"), "{out}");
    // A refusal takes the agent's other branch.
    let mut cli2 = Cli::start(&[], dir.path(), &agent);
    cli2.send("go");
    cli2.wait_for("? allow");
    cli2.send("n");
    let out = cli2.wait_for("[stop: end_turn]");
    assert!(out.contains("refused"), "{out}");
    assert!(out.contains("skip the configuration update"), "{out}");
    assert!(cli.finish().0.success());
    assert!(cli2.finish().0.success());
}

#[cfg(unix)]
#[test]
fn ctrl_c_cancels_the_turn_not_the_program() {
    let agent = example_argv();
    let dir = tempfile::tempdir().unwrap();
    let mut cli = Cli::start(&[], dir.path(), &agent);
    cli.wait_for("tether acp: `node`, session ");
    cli.send("start");
    cli.wait_for("I'll help you with that.");
    cli.interrupt();
    let out = cli.wait_for("[stop: cancelled]");
    assert!(out.contains("cancelling the turn"), "{out}");
    // The agent stopped: it never got to the question of that turn.
    assert!(!out.contains("? allow"), "{out}");
    // The prompt comes back, and the session takes another turn.
    cli.wait_for("> ");
    cli.send("again");
    cli.wait_for("? allow");
    cli.send("y");
    let out = cli.wait_for("[stop: end_turn]");
    assert!(out.contains("successfully updated the configuration"), "{out}");
    let (status, _, _) = cli.finish();
    assert!(status.success(), "{status}");
}

#[test]
fn run_provider_acp_asks_on_stdin_and_prints_like_every_provider() {
    let agent = example_argv();
    let dir = tempfile::tempdir().unwrap();
    let r = tether(
        dir.path(),
        &["run", "--provider", "acp", "please fix the config"],
        &agent,
        "y\n",
        &[],
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(
        r.stderr
            .contains("? allow Modifying critical configuration file (edit)? [y]es / [a]lways / [N]o"),
        "{r:?}"
    );
    assert!(r.stdout.contains("⚙ Reading project files"), "{r:?}");
    assert!(
        r.stdout.contains("⚙ Modifying critical configuration file"),
        "{r:?}"
    );
    assert!(
        r.stdout.contains("successfully updated the configuration"),
        "{r:?}"
    );
    assert!(r.stderr.contains("— 1 turn(s)"), "{r:?}");
    assert!(r.stderr.contains("stop: end_turn"), "{r:?}");
    // `n` takes the agent's other branch.
    let r = tether(
        dir.path(),
        &["run", "--provider", "acp", "please fix the config"],
        &agent,
        "n\n",
        &[],
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("skip the configuration update"), "{r:?}");
    assert!(!r.stdout.contains("successfully updated"), "{r:?}");
}

#[test]
fn run_provider_acp_json_is_events_then_the_result() {
    let agent = example_argv();
    let dir = tempfile::tempdir().unwrap();
    let r = tether(
        dir.path(),
        &["run", "--provider", "acp", "--json", "--yes", "go"],
        &agent,
        "",
        &[],
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let lines: Vec<Value> = r
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let (last, events) = lines.split_last().expect("output");
    let result = &last["result"];
    assert_eq!(result["stop_reason"], "end_turn", "{last}");
    assert_eq!(result["terminal"], "end_turn", "{last}");
    assert!(
        result["text"].as_str().unwrap().contains("successfully updated"),
        "{last}"
    );
    let sid = result["session_id"].as_str().unwrap();
    assert!(!sid.is_empty());
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["event"]["kind"]["kind"].as_str().unwrap())
        .collect();
    for k in [
        "message",
        "text_delta",
        "tool_call_start",
        "tool_call_update",
        "tool_result",
    ] {
        assert!(kinds.contains(&k), "no {k} in {kinds:?}");
    }
    // The durable events are the session's record: numbered from 1 without a gap.
    let seqs: Vec<u64> = events.iter().filter_map(|e| e["event"]["seq"].as_u64()).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
    assert!(!r.stderr.contains("? allow"), "{r:?}");
}

#[test]
fn session_id_is_refused_with_a_typed_error_when_the_agent_cannot_load() {
    let agent = example_argv();
    let dir = tempfile::tempdir().unwrap();
    let r = tether(
        dir.path(),
        &["run", "--provider", "acp", "--session-id", "earlier-1", "go"],
        &agent,
        "",
        &[],
    );
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(
        r.stderr.contains("acp cannot resume a session")
            && r.stderr.contains("does not advertise `loadSession`"),
        "{r:?}"
    );
    assert!(r.stdout.is_empty(), "{r:?}");
    let r = tether(
        dir.path(),
        &["acp", "--session-id", "earlier-1"],
        &agent,
        "go\n",
        &[],
    );
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(
        r.stderr
            .contains("tether acp: --session-id: acp cannot resume a session"),
        "{r:?}"
    );
}
