//! `tether run --provider acp` and `tether acp` against the testkit's scripted `fake-acp-agent`,
//! for what no real agent does on demand: a permission request answered `n`/`y`/`a` on stdin;
//! writes outside `--cwd` (directly or through a symlink) refused without a question; a terminal
//! command confined by the sandbox and stripped of secrets; Ctrl-C while a question waits;
//! `--json` across turns; `session/load` with `--session-id`; an agent that dies mid-turn; a
//! timeout; and the command-line mistakes.

mod acp_common;

use acp_common::{Cli, fake_argv, tether};
use serde_json::Value;

#[test]
fn a_permission_request_is_answered_on_stdin() {
    let agent = fake_argv();
    let dir = tempfile::tempdir().unwrap();
    for (answer, option) in [("n", "reject"), ("y", "allow"), ("a", "always"), ("", "reject")] {
        let r = tether(
            dir.path(),
            &["run", "--provider", "acp", "permission"],
            &agent,
            &format!("{answer}\n"),
            &[],
        );
        assert_eq!(r.code, Some(0), "{r:?}");
        assert!(r.stderr.contains("? allow Edit config (edit)?"), "{r:?}");
        assert!(
            r.stdout.contains(&format!(r#""optionId":"{option}""#)),
            "answer {answer:?} should select {option}: {r:?}"
        );
    }
    // No answer at all (end of input) refuses too.
    let r = tether(
        dir.path(),
        &["run", "--provider", "acp", "permission"],
        &agent,
        "",
        &[],
    );
    assert!(r.stdout.contains(r#""optionId":"reject""#), "{r:?}");
    // And interactively, the line typed after the question answers it.
    let mut cli = Cli::start(&[], dir.path(), &agent);
    cli.send("permission");
    cli.wait_for("? allow Edit config (edit)?");
    cli.send("y");
    let out = cli.wait_for("[stop: end_turn]");
    assert!(out.contains("allowed once"), "{out}");
    assert!(out.contains(r#""optionId":"allow""#), "{out}");
    assert!(cli.finish().0.success());
}

#[test]
fn a_line_typed_before_the_question_does_not_answer_it() {
    let agent = fake_argv();
    let dir = tempfile::tempdir().unwrap();
    let mut cli = Cli::start(&[], dir.path(), &agent);
    cli.wait_for("tether acp: ");
    // `y` is typed ahead (in the same write as the prompt), before any question: it is the
    // next prompt, not an answer. The question is answered by what is typed after it.
    cli.send("permission\ny");
    cli.wait_for("? allow Edit config (edit)?");
    cli.send("n");
    let out = cli.wait_for("[stop: end_turn]");
    assert!(out.contains("refused"), "{out}");
    assert!(out.contains(r#""optionId":"reject""#), "{out}");
    // The early `y` then ran as a prompt of its own.
    let out = cli.wait_for("[stop: end_turn]");
    assert!(out.contains(r#"unknown command "y""#), "{out}");
    assert!(cli.finish().0.success());
}

#[test]
fn writes_outside_the_cwd_are_refused_without_a_question() {
    let agent = fake_argv();
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().join("pwned.txt");
    let r = tether(
        dir.path(),
        &[
            "run",
            "--provider",
            "acp",
            &format!("write {} owned", target.display()),
        ],
        &agent,
        "y\ny\n",
        &[],
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("err:"), "{r:?}");
    assert!(
        !r.stderr.contains("? allow"),
        "asked about a write outside: {r:?}"
    );
    assert!(!target.exists());
    // Through a symlink inside the directory that points out of it: refused as well, even with
    // --yes.
    std::os::unix::fs::symlink(outside.path(), dir.path().join("link")).unwrap();
    let via = dir.path().join("link").join("via.txt");
    let r = tether(
        dir.path(),
        &[
            "run",
            "--provider",
            "acp",
            "--yes",
            &format!("write {} owned", via.display()),
        ],
        &agent,
        "",
        &[],
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("err:"), "{r:?}");
    assert!(!outside.path().join("via.txt").exists());
    // Inside, a write is asked: `n` refuses it, `y` does it.
    let inside = dir.path().join("notes.txt");
    let prompt = format!("write {} hello there", inside.display());
    let r = tether(
        dir.path(),
        &["run", "--provider", "acp", &prompt],
        &agent,
        "n\n",
        &[],
    );
    assert!(r.stderr.contains("? allow"), "{r:?}");
    assert!(
        r.stdout.contains("err:") && r.stdout.contains("not approved"),
        "{r:?}"
    );
    assert!(!inside.exists());
    let r = tether(
        dir.path(),
        &["run", "--provider", "acp", &prompt],
        &agent,
        "y\n",
        &[],
    );
    assert!(r.stdout.contains("ok:"), "{r:?}");
    assert_eq!(std::fs::read_to_string(&inside).unwrap(), "hello there");
}

#[test]
fn a_terminal_command_is_confined_by_the_sandbox() {
    let agent = fake_argv();
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let pwned = outside.path().join("pwned");
    let prompt = format!("terminal - touch made.txt {}", pwned.display());
    let r = tether(
        dir.path(),
        &[
            "run",
            "--provider",
            "acp",
            "--yes",
            "--sandbox",
            "require",
            &prompt,
        ],
        &agent,
        "",
        &[],
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(!r.stderr.contains("warning"), "{r:?}");
    assert!(dir.path().join("made.txt").exists(), "{r:?}");
    assert!(!pwned.exists(), "the sandbox let a command write outside: {r:?}");
    assert!(r.stdout.contains("Permission denied"), "{r:?}");
    // Secrets in tether's environment do not reach the agent's commands.
    let r = tether(
        dir.path(),
        &[
            "run",
            "--provider",
            "acp",
            "--yes",
            "--sandbox",
            "require",
            "terminal - printenv MY_SERVICE_TOKEN",
        ],
        &agent,
        "",
        &[("MY_SERVICE_TOKEN", "tok-very-secret")],
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains(r#""exitCode":1"#), "{r:?}");
    assert!(!r.stdout.contains("tok-very-secret"), "{r:?}");
    // Without --yes the command is asked first; refused, it never runs.
    let _ = std::fs::remove_file(dir.path().join("made.txt"));
    let r = tether(
        dir.path(),
        &["run", "--provider", "acp", "--sandbox", "require", &prompt],
        &agent,
        "n\n",
        &[],
    );
    assert!(r.stderr.contains("? allow run `touch made.txt"), "{r:?}");
    assert!(r.stdout.contains("create err:"), "{r:?}");
    assert!(!dir.path().join("made.txt").exists());
    // In `tether acp` the sandbox flags work the same.
    let mut cli = Cli::start(&["--yes", "--sandbox", "require"], dir.path(), &agent);
    cli.send(&prompt);
    let out = cli.wait_for("[stop: end_turn]");
    assert!(out.contains("Permission denied"), "{out}");
    assert!(!pwned.exists());
    assert!(dir.path().join("made.txt").exists());
    assert!(cli.finish().0.success());
}

#[cfg(unix)]
#[test]
fn ctrl_c_while_a_question_waits_withdraws_it_and_cancels_the_turn() {
    let agent = fake_argv();
    let dir = tempfile::tempdir().unwrap();
    let mut cli = Cli::start(&[], dir.path(), &agent);
    cli.wait_for("tether acp: ");
    cli.send("wait_cancel");
    cli.wait_for("? allow Edit config (edit)?");
    cli.interrupt();
    let out = cli.wait_for("[stop: cancelled]");
    assert!(out.contains("cancelling the turn"), "{out}");
    assert!(!out.contains("allowed"), "{out}");
    cli.wait_for("> ");
    // The session takes the next turn; an answer typed now is a prompt, not an approval.
    cli.send("echo again");
    let out = cli.wait_for("[stop: end_turn]");
    assert!(out.contains("again"), "{out}");
    assert!(!out.contains(r#""optionId":"allow""#), "{out}");
    let (status, _, _) = cli.finish();
    assert!(status.success(), "{status}");
}

#[cfg(unix)]
#[test]
fn ctrl_c_stops_a_turn_that_never_ends_and_json_says_so() {
    let agent = fake_argv();
    let dir = tempfile::tempdir().unwrap();
    let mut cli = Cli::start(&["--json"], dir.path(), &agent);
    cli.send("hang");
    // The request has started once its user message is recorded.
    cli.wait_for(r#""type":"tether.user_message""#);
    cli.interrupt();
    let out = cli.wait_for(r#"{"error":"#);
    let last: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "cancelled", "{out}");
    cli.send("echo after");
    let out = cli.wait_for(r#"{"result":"#);
    let last: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(last["result"]["stop_reason"], "end_turn", "{out}");
    assert!(
        last["result"]["text"].as_str().unwrap().contains("after"),
        "{out}"
    );
    let (status, stdout, stderr) = cli.finish();
    assert!(status.success(), "{status}");
    // With --json stdout is JSON lines only; the prompt and notices went to stderr.
    for l in stdout.lines() {
        serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
    }
    assert!(stderr.contains("cancelling the turn"), "{stderr}");
}

#[test]
fn json_lines_carry_every_turn_of_one_record() {
    let agent = fake_argv();
    let dir = tempfile::tempdir().unwrap();
    let mut cli = Cli::start(&["--json"], dir.path(), &agent);
    cli.send("tool");
    cli.wait_for(r#"{"result":"#);
    cli.send("echo two");
    cli.wait_for(r#"{"result":"#);
    let (status, stdout, _) = cli.finish();
    assert!(status.success(), "{status}");
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let results: Vec<&Value> = lines.iter().filter_map(|l| l.get("result")).collect();
    assert_eq!(results.len(), 2, "{stdout}");
    assert_eq!(results[0]["session_id"], results[1]["session_id"]);
    assert_eq!(results[1]["text"], "two");
    let events: Vec<&Value> = lines.iter().filter_map(|l| l.get("event")).collect();
    assert!(
        events
            .iter()
            .any(|e| e["kind"]["kind"] == "tool_call_start" && e["kind"]["name"] == "List files"),
        "{stdout}"
    );
    assert!(
        events
            .iter()
            .any(|e| e["kind"]["kind"] == "tool_result" && e["kind"]["result"]["content"] == "a.txt"),
        "{stdout}"
    );
    // One record across both turns: durable events numbered from 1, without a gap.
    let seqs: Vec<u64> = events.iter().filter_map(|e| e["seq"].as_u64()).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>(), "{stdout}");
    let users = events
        .iter()
        .filter(|e| e["type"] == "tether.user_message")
        .count();
    assert_eq!(users, 2, "{stdout}");
}

#[test]
fn session_id_reloads_a_session_the_agent_can_load() {
    let agent = fake_argv();
    let dir = tempfile::tempdir().unwrap();
    let r = tether(
        dir.path(),
        &[
            "run",
            "--provider",
            "acp",
            "--json",
            "--session-id",
            "old-7",
            "echo hi",
        ],
        &agent,
        "",
        &[],
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let last: Value = serde_json::from_str(r.stdout.lines().last().unwrap()).unwrap();
    assert_eq!(last["result"]["session_id"], "old-7", "{r:?}");
    assert_eq!(last["result"]["text"], "hi", "{r:?}");
    // What the agent replayed of the session is in the record.
    assert!(r.stdout.contains("earlier answer"), "{r:?}");
    let mut cli = Cli::start(&["--session-id", "old-7"], dir.path(), &agent);
    let out = cli.wait_for("tether acp: ");
    assert!(out.contains("session old-7 (reloaded)"), "{out}");
    cli.send("echo more");
    let out = cli.wait_for("[stop: end_turn]");
    assert!(out.contains("more"), "{out}");
    assert!(cli.finish().0.success());
}

#[test]
fn an_agent_that_dies_mid_turn_is_an_error_not_a_hang() {
    let agent = fake_argv();
    let dir = tempfile::tempdir().unwrap();
    let r = tether(
        dir.path(),
        &["run", "--provider", "acp", "crash"],
        &agent,
        "",
        &[],
    );
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(r.stderr.contains("exited or closed its connection"), "{r:?}");
    // Interactive: the program ends with status 1 instead of prompting an agent that is gone.
    let r = tether(dir.path(), &["acp"], &agent, "crash\necho never\n", &[]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.stderr.contains("tether acp: "), "{r:?}");
    assert!(!r.stdout.contains("never"), "{r:?}");
}

#[test]
fn the_run_timeout_stops_a_turn_that_never_ends() {
    let agent = fake_argv();
    let dir = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let r = tether(
        dir.path(),
        &["run", "--provider", "acp", "--timeout", "2", "hang"],
        &agent,
        "",
        &[],
    );
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(r.stderr.contains("did not finish within 2s"), "{r:?}");
    // Not held by the agent: well before the test's own deadline.
    assert!(started.elapsed() < acp_common::WAIT / 2, "{r:?}");
}

#[test]
fn command_line_mistakes_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = vec!["/nonexistent/acp-agent".to_string()];
    let r = tether(dir.path(), &["run", "--provider", "acp", "x"], &missing, "", &[]);
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(r.stderr.contains("could not start the ACP agent"), "{r:?}");
    let r = tether(dir.path(), &["acp"], &missing, "", &[]);
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(r.stderr.contains("could not start the ACP agent"), "{r:?}");
    // No agent command.
    let r = tether(dir.path(), &["run", "--provider", "acp", "x"], &[], "", &[]);
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(r.stderr.contains("needs the agent command after `--`"), "{r:?}");
    // An agent command for another provider.
    let r = tether(
        dir.path(),
        &["run", "--base-url", "http://127.0.0.1:9/v1", "x"],
        &fake_argv(),
        "",
        &[],
    );
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(r.stderr.contains("only for --provider acp"), "{r:?}");
}
