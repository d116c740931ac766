//! `tether run` against the fake OpenAI server whose stream is cut mid-answer (it ends before any
//! `finish_reason`: the client sees a dropped stream, and what came before the cut surely reached
//! it): what the real binary prints is what the record holds (issue 11, defect 7: it printed the
//! partial text and then the whole answer again).

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::Value;
use tether_testkit::openai::{FakeOpenAi, Reply};

async fn tether(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_tether"))
            .args(&args)
            .current_dir(dir.path())
            .env_remove("OPENAI_BASE_URL")
            .env_remove("OPENAI_API_KEY")
            .env_remove("TETHER_MODEL")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the tether binary starts");
        drop(child.stdin.take().map(|mut i| i.flush()));
        child.wait_with_output().expect("tether exits")
    })
    .await
    .unwrap()
}

fn run_args(url: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["run", "--base-url", url, "--model", "m"]
        .map(String::from)
        .into();
    a.extend(extra.iter().map(|s| s.to_string()));
    a.push("tell me".into());
    a
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

const ANSWER: &str = "partial answer, then the rest of it.";

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_dropped_and_retried_prints_the_answer_once() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text(ANSWER).truncate_after(2));
    fake.push(Reply::text(ANSWER));
    let o = tether(run_args(&fake.url(), &[])).await;
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(err.contains("(retry 1 in"), "the stream was retried: {err}");
    assert_eq!(out, format!("{ANSWER}\n"), "the answer once, nothing before it");
    assert_eq!(fake.requests().len(), 2);

    // The same run in --json: the failed attempt did show its first text before the retry, so
    // the run above shows a repeat held back, not a cut before anything was printed.
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text(ANSWER).truncate_after(2));
    fake.push(Reply::text(ANSWER));
    let o = tether(run_args(&fake.url(), &["--json"])).await;
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    let kinds: Vec<String> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["event"]["kind"]["kind"].as_str().map(str::to_owned))
        .collect();
    let first_text = kinds.iter().position(|k| k == "text_delta");
    let retry = kinds.iter().position(|k| k == "retry");
    assert!(
        matches!((first_text, retry), (Some(t), Some(r)) if t < r),
        "text before the retry: {kinds:?}"
    );
    let shown: String = out
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["event"]["kind"]["delta"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(shown, ANSWER, "--json deltas hold the answer once");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retry_that_says_something_else_is_marked_and_printed_whole() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text("partial words that will vanish").truncate_after(2));
    fake.push(Reply::text("after drop complete"));
    let o = tether(run_args(&fake.url(), &[])).await;
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(
        out.starts_with("partial"),
        "the failed attempt's text was shown: {out:?}"
    );
    assert!(
        out.ends_with("\n[retried: the answer starts over]\nafter drop complete\n"),
        "not `partialafter drop complete`: {out:?}"
    );
}
