//! A database written by the previous `tether serve` (whose `openai` agents ran on serve's own
//! adapter: user messages recorded as `serve.user_message`, a `serve.checkpoint` and
//! `serve.interrupts` beside the engine's checkpoint) still opens. The fixture
//! `fixtures/serve-legacy.db` was written by that version's real binary against the
//! `fake_openai` example (`ui` mode) with `writes = "ask"`: thread `legacy-done` (two
//! exchanges), `legacy-tool` (a `write_file` approved and run) and `legacy-waiting` (a
//! `write_file` waiting on an approval interrupt).
//!
//! Decided behaviour: such threads stay readable over GET (every user message included) and
//! resume. A follow-up continues with the whole earlier history, no message twice; a thread left
//! waiting on an approval is asked again with a new interrupt (the old interrupt's id was kept by
//! the old adapter and is not honoured: it gets 409 `INTERRUPT_NOT_ISSUED`), and approving that
//! runs the call once.

mod common;

use common::*;
use serde_json::{Value, json};
use tether_testkit::openai::Reply;

fn contents(msgs: &Value) -> Vec<(String, String)> {
    msgs["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_owned(),
                m["content"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_database_of_the_previous_serve_opens_reads_and_resumes() {
    let env = Env::new().await;
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/serve-legacy.db");
    std::fs::copy(&fixture, env.dir.path().join("tether.db")).unwrap();
    env.fake.push(Reply::text("Third answer."));
    env.fake.push(Reply::text("Wrote it, at last."));
    // `writes` is `ask` by default, as in the fixture's configuration.
    let server = env.start(env.config(""), None).await;

    // Readable: the threads, and every message of their records.
    let (s, threads) = get(&server, "/v1/threads?agent=main").await;
    assert_eq!(s, 200, "{threads}");
    let mut ids: Vec<&str> = threads["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["threadId"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["legacy-done", "legacy-tool", "legacy-waiting"]);
    let (s, msgs) = get(&server, "/v1/threads/legacy-done/messages").await;
    assert_eq!(s, 200);
    let before = [
        ("user", "hello there"),
        ("assistant", "You said: hello there"),
        ("user", "second message"),
        ("assistant", "You said: second message"),
    ];
    let want: Vec<(String, String)> = before
        .iter()
        .map(|(r, c)| (r.to_string(), c.to_string()))
        .collect();
    assert_eq!(contents(&msgs), want);
    let (_, msgs) = get(&server, "/v1/threads/legacy-tool/messages").await;
    let roles: Vec<String> = contents(&msgs).into_iter().map(|(r, _)| r).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);

    // A follow-up continues with the earlier history, each message once.
    let m = json!([
        {"id": "u1", "role": "user", "content": "hello there"},
        {"id": "u2", "role": "user", "content": "second message"},
        {"id": "u3", "role": "user", "content": "third"}
    ]);
    let ev = run(&server, "main", &input("legacy-done", "n1", m), None).await;
    assert_eq!(last(&ev)["type"], "RUN_FINISHED", "{ev:?}");
    assert_eq!(text_of(&ev), "Third answer.");
    let sent: Vec<(String, String)> = env.fake.requests()[0]
        .messages()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_owned(),
                m["content"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    let mut want_sent = vec![("system".to_owned(), "be brief".to_owned())];
    want_sent.extend(want.iter().cloned());
    want_sent.push(("user".into(), "third".into()));
    assert_eq!(sent, want_sent);
    let (_, events) = get(&server, "/v1/threads/legacy-done/events").await;
    let seqs: Vec<u64> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "gapless record"
    );

    // The thread left waiting on an approval: the old interrupt id is not honoured...
    let (_, waiting) = get(&server, "/v1/threads/legacy-waiting/events").await;
    assert!(waiting["events"].as_array().unwrap().len() >= 2, "{waiting}");
    let m = json!([{"id": "u1", "role": "user", "content": "please write a file"}]);
    let mut body = input("legacy-waiting", "n2", m.clone());
    body["resume"] = json!([{"interruptId": "approval_7c8e0608696c6c27c064d45726ac21b4",
        "status": "resolved", "payload": {"approved": true}}]);
    let resp = post_run(&server, "main", &body, None).await;
    assert_eq!(resp.status().as_u16(), 409);
    let text = resp.text().await.unwrap();
    assert!(text.contains("INTERRUPT_NOT_ISSUED"), "{text}");
    // ...the next request asks again, and approving that runs the call once.
    let ev = run(&server, "main", &input("legacy-waiting", "n3", m.clone()), None).await;
    let fin = last(&ev);
    assert_eq!(fin["outcome"]["type"], "interrupt", "{fin}");
    let intr = &fin["outcome"]["interrupts"][0];
    assert_eq!(intr["toolCallId"], "call_write_2", "{intr}");
    assert!(
        !env.ws().join("hello.txt").exists(),
        "nothing written before approval"
    );
    let mut body = input("legacy-waiting", "n4", m);
    body["resume"] =
        json!([{"interruptId": intr["id"], "status": "resolved", "payload": {"approved": true}}]);
    let ev = run(&server, "main", &body, None).await;
    assert_eq!(last(&ev)["type"], "RUN_FINISHED", "{ev:?}");
    assert_eq!(text_of(&ev), "Wrote it, at last.");
    assert_eq!(
        std::fs::read_to_string(env.ws().join("hello.txt")).unwrap(),
        "hello from tether\n"
    );
    assert_eq!(env.fake.requests().len(), 2, "no model call but the two answers");
}
