//! tether threads on a real Restate server (from npm, `conformance/restate`), with the real
//! service process (`tether-restate-demo`) and the testkit's OpenAI fake as the model.
//!
//! With `TETHER_RESTATE_RECORD=shared` every test runs with the threads' records in a real
//! PostgreSQL (the machine's, started per test: `tether_testkit::postgres`) instead of the
//! object state: the same scenarios, the same assertions.

mod common;

use common::*;
use serde_json::json;
use tether::EventKind;
use tether_testkit::openai::{FakeOpenAi, Reply};

struct Setup {
    restate: Restate,
    fake: FakeOpenAi,
    config: ServiceConfig,
    _dir: tempfile::TempDir,
    _pg: Option<tether_testkit::postgres::Postgres>,
}

async fn setup() -> Setup {
    let restate = Restate::start().await;
    let fake = FakeOpenAi::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pg = match std::env::var("TETHER_RESTATE_RECORD").as_deref() {
        Ok("shared") => Some(tether_testkit::postgres::Postgres::start().await),
        Ok("state") | Err(_) => None,
        Ok(other) => panic!("TETHER_RESTATE_RECORD={other}: say `state` or `shared`"),
    };
    let config = ServiceConfig {
        listen: format!("127.0.0.1:{}", free_port()),
        admin: restate.admin.clone(),
        model_url: fake.url(),
        effects: dir.path().join("effects.log"),
        live: None,
        shared: pg.as_ref().map(|p| p.connection()),
    };
    Setup {
        restate,
        fake,
        config,
        _dir: dir,
        _pg: pg,
    }
}

impl Setup {
    /// The threads of the demo's agent as a front-end reads them: through the ingress, or from
    /// the shared record's database when the records are kept there.
    async fn store(&self) -> tether_restate::RestateStore {
        let st = store(&self.restate.ingress);
        match &self.config.shared {
            Some(c) => st.with_shared(
                tether_restate::SharedRecord::connect(c)
                    .await
                    .expect("the shared record"),
            ),
            None => st,
        }
    }
}

fn turn(id: &str, text: &str) -> serde_json::Value {
    json!({"message_id": id, "text": text})
}

/// A turn with a tool call completes; the tool ran once; the record has every event once, in a
/// gapless sequence; a second turn continues the thread from that record.
#[tokio::test(flavor = "multi_thread")]
async fn a_turn_with_a_tool_call_completes_and_is_recorded_once() {
    let s = setup().await;
    let service = Service::start(&s.config);
    s.fake
        .push(Reply::tool_calls(&[(
            "call_1",
            "append_line",
            r#"{"text":"one"}"#,
        )]))
        .push(Reply::text("Appended."));
    let (status, out) = call(&s.restate.ingress, "t-1", "turn", &turn("m1", "append one")).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["text"], "Appended.", "{out}");
    assert_eq!(out["tool_uses"], json!(["call_1"]));
    assert_eq!(effects(&s.config.effects), vec!["append_line call_1 one"]);
    let added = out["events_added"].as_u64().expect("events_added");

    // The second turn's model call sees the first turn's history, rebuilt from the record.
    s.fake.push(Reply::text("Still here."));
    let (status, out2) = call(&s.restate.ingress, "t-1", "turn", &turn("m2", "and now?")).await;
    assert_eq!(status, 200, "{out2}");
    assert_eq!(out2["text"], "Still here.");
    let last = s.fake.requests().pop().expect("a request");
    let history = serde_json::to_string(last.messages()).unwrap_or_default();
    for want in ["append one", "call_1", "appended one", "and now?"] {
        assert!(history.contains(want), "history lacks {want}: {history}");
    }
    assert_eq!(
        s.fake.requests().len(),
        3,
        "one model call per step, none repeated"
    );
    let events = check_record(&s.restate.ingress, "t-1").await;
    // The turn says how long the record is after it: a relay that showed that much reads no more.
    assert_eq!(out2["length"], json!(events.len()), "{out2}");
    // The thread at a glance, in one call: the thread, its record's length, no turn running.
    let (status, glance) = call(&s.restate.ingress, "t-1", "status", &json!(null)).await;
    assert_eq!(status, 200, "{glance}");
    assert_eq!(glance["thread"]["id"], "t-1", "{glance}");
    assert_eq!(glance["length"], json!(events.len()), "{glance}");
    assert_eq!(glance["invocation"], json!(null), "{glance}");
    // The message the last turn was sent with stays; where a turn runs only while it runs.
    assert_eq!(glance["message"], "m2", "{glance}");
    assert_eq!(glance["announced"], json!(null), "{glance}");
    // A thread never used: nothing, and no error.
    let (status, glance) = call(&s.restate.ingress, "t-never", "status", &json!(null)).await;
    assert_eq!(status, 200, "{glance}");
    assert_eq!(
        glance,
        json!({"thread": null, "length": 0, "invocation": null, "message": null, "announced": null}),
        "{glance}"
    );
    service.kill();
    assert_eq!(
        events.len() as u64,
        added + out2["events_added"].as_u64().unwrap_or(0)
    );
    let results = events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::ToolResult { .. }))
        .count();
    assert_eq!(results, 1, "one tool result recorded: {events:#?}");
}

/// A turn waiting for approval is approved by a second request (the shared `approve` handler
/// completing the turn's awakeable); an approval naming another tool use is refused, and the
/// tool does not run before the approval.
#[tokio::test(flavor = "multi_thread")]
async fn an_approval_from_a_second_request_resumes_the_turn() {
    let s = setup().await;
    let _service = Service::start(&s.config);
    s.fake
        .push(Reply::tool_calls(&[(
            "call_g",
            "guarded_append",
            r#"{"text":"two"}"#,
        )]))
        .push(Reply::text("Done after approval."));
    let ingress = s.restate.ingress.clone();
    let mut req = turn("m1", "append two, carefully");
    req["announced"] = json!("http://127.0.0.1:9/a-node");
    let inv = send_turn(&ingress, "t-approve", &req).await;

    let waiting = until("the turn to wait for approval", async || {
        let (status, v) = call(&ingress, "t-approve", "waiting", &json!(null)).await;
        (status == 200 && v.as_array().is_some_and(|a| !a.is_empty())).then_some(v)
    })
    .await;
    assert_eq!(waiting[0]["id"], "call_g", "{waiting}");
    // A first turn waiting for approval has its thread listed already, as the thread object
    // holds it (provider session included: the index got it after the engine opened it).
    use tether::ThreadStore;
    let listed = |threads: Vec<tether::Thread>| {
        threads
            .into_iter()
            .filter(|t| t.id.as_str() == "t-approve")
            .collect::<Vec<_>>()
    };
    let thread_id = tether::ThreadId::new("t-approve").expect("an id");
    let held = s
        .store()
        .await
        .thread(&thread_id)
        .await
        .expect("the thread")
        .expect("a thread");
    assert!(held.provider_session.is_some(), "{held:?}");
    let index = until("the index to list the waiting thread", async || {
        Some(listed(s.store().await.threads(None).await.ok()?)).filter(|l| !l.is_empty())
    })
    .await;
    assert_eq!(
        index,
        vec![held],
        "the index lists the thread as its object holds it"
    );
    // A turn waiting for approval runs: `status` names its invocation, and its record so far.
    let (status, glance) = call(&ingress, "t-approve", "status", &json!(null)).await;
    assert_eq!(status, 200, "{glance}");
    assert_eq!(glance["invocation"], json!(inv), "{glance}");
    assert!(glance["length"].as_u64().is_some_and(|n| n > 0), "{glance}");
    // With its message, and where its sender said it runs (a relay elsewhere follows that).
    assert_eq!(glance["message"], "m1", "{glance}");
    assert_eq!(glance["announced"], "http://127.0.0.1:9/a-node", "{glance}");
    // What a relay elsewhere reads in one call: what the turn waits for, and the record after
    // what it showed (the same events as the `events` handler's).
    let (status, progress) = call(&ingress, "t-approve", "progress", &json!({"after": 0})).await;
    assert_eq!(status, 200, "{progress}");
    assert_eq!(progress["waiting"], waiting, "{progress}");
    let (_, events) = call(&ingress, "t-approve", "events", &json!({"after": 0})).await;
    assert_eq!(progress["events"], events, "{progress}");
    assert_eq!(
        progress["events"].as_array().map(Vec::len),
        glance["length"].as_u64().map(|n| n as usize)
    );
    let (_, later) = call(
        &ingress,
        "t-approve",
        "progress",
        &json!({"after": glance["length"], "limit": 5}),
    )
    .await;
    assert_eq!(
        later["events"],
        json!([]),
        "nothing after the last event: {later}"
    );
    assert_eq!(later["waiting"], waiting, "{later}");
    // Hostile pages: refused whole with a terminal 400 naming the field (never a partial or a
    // guessed page, never a retried invocation).
    for bad in [
        json!({"after": "x"}),
        json!({"after": -1}),
        json!({"limit": 1e30}),
        json!("after"),
    ] {
        let (status, v) = call(&ingress, "t-approve", "progress", &bad).await;
        assert_eq!(status, 400, "{bad} answered {status}: {v}");
        assert!(
            v["message"]
                .as_str()
                .is_some_and(|m| m.contains("Cannot decode input")),
            "{bad}: {v}"
        );
        assert!(v.get("events").is_none(), "{bad} answered a page: {v}");
    }
    let (_, huge) = call(
        &ingress,
        "t-approve",
        "progress",
        &json!({"after": 0, "limit": u32::MAX}),
    )
    .await;
    assert_eq!(
        huge["events"], events,
        "a huge limit is capped, not refused: {huge}"
    );
    assert!(
        effects(&s.config.effects).is_empty(),
        "the tool ran before its approval"
    );

    let (status, v) = call(
        &ingress,
        "t-approve",
        "approve",
        &json!({"decision": "answer", "tool_use_id": "call_other", "approved": true}),
    )
    .await;
    assert_eq!(status, 409, "an approval for a tool use nobody waits on: {v}");
    assert!(effects(&s.config.effects).is_empty());

    let (status, v) = call(
        &ingress,
        "t-approve",
        "approve",
        &json!({"decision": "answer", "tool_use_id": "call_g", "approved": true}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let (status, out) = attach(&ingress, &inv).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["text"], "Done after approval.");
    assert_eq!(effects(&s.config.effects), vec!["guarded_append call_g two"]);
    let (_, glance) = call(&ingress, "t-approve", "status", &json!(null)).await;
    assert_eq!(glance["invocation"], json!(null), "the turn ended: {glance}");
    // After the turn the index still matches the thread (one entry, its latest form).
    let held = s
        .store()
        .await
        .thread(&thread_id)
        .await
        .expect("the thread")
        .expect("a thread");
    until("the index to hold the thread as the turn left it", async || {
        (listed(s.store().await.threads(None).await.ok()?) == vec![held.clone()]).then_some(())
    })
    .await;
}

/// SIGKILL the service between a tool's effect and the end of the turn, at a different point
/// each time (after the first, second or third of three tool calls, while the next model call
/// is in flight): after a restart every turn finishes, every tool effect happened exactly once
/// (counted by invocation: each run appends a line), and every record is gapless and without
/// duplicates. `TETHER_RESTATE_CRASHES` sets the number of crashes (default 20).
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_between_steps_never_repeats_a_tool_effect() {
    let crashes: usize = std::env::var("TETHER_RESTATE_CRASHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let s = setup().await;
    let ingress = s.restate.ingress.clone();
    let mut config = s.config.clone();
    for i in 0..crashes {
        // A model of its own per crash, so a reply the killed call took is not left for the next.
        let fake = FakeOpenAi::start().await;
        config.model_url = fake.url();
        let service = Service::start(&config);
        let thread = format!("crash-{i}");
        // Kill while model call `k` (2..=4) is in flight: k - 1 tool effects happened before.
        let k = 2 + (i % 3);
        let mut script = vec![
            Reply::tool_calls(&[(
                &format!("c{i}a") as &str,
                "append_line",
                &format!(r#"{{"text":"{i}a"}}"#) as &str,
            )]),
            Reply::tool_calls(&[(
                &format!("c{i}b") as &str,
                "append_line",
                &format!(r#"{{"text":"{i}b"}}"#) as &str,
            )]),
            Reply::tool_calls(&[(
                &format!("c{i}c") as &str,
                "append_line",
                &format!(r#"{{"text":"{i}c"}}"#) as &str,
            )]),
            Reply::text(format!("done {i}")),
        ];
        // The call the kill interrupts never ends on its own; after the restart the step runs
        // again and gets the real reply.
        let real = std::mem::replace(&mut script[k - 1], Reply::text("never").stall_after(1));
        script.insert(k, real);
        fake.push_all(script);

        let inv = send_turn(&ingress, &thread, &turn("m1", "append three lines")).await;
        until("the model call to interrupt", async || {
            (fake.requests().len() >= k).then_some(())
        })
        .await;
        let before = effects(&config.effects);
        service.kill();
        assert_eq!(
            before.iter().filter(|l| l.contains(&format!(" c{i}"))).count(),
            k - 1,
            "crash {i}: the tool effects before the kill"
        );

        let service = Service::start(&config);
        let (status, out) = attach(&ingress, &inv).await;
        assert_eq!(status, 200, "crash {i}: {out}\n{}", s.restate.log());
        assert_eq!(out["text"], format!("done {i}"), "crash {i}");
        let lines = effects(&config.effects);
        for step in ["a", "b", "c"] {
            let n = lines
                .iter()
                .filter(|l| l.ends_with(&format!(" {i}{step}")))
                .count();
            assert_eq!(n, 1, "crash {i}: tool {step} ran {n} times: {lines:#?}");
        }
        assert_eq!(
            fake.requests().len(),
            5,
            "crash {i}: the interrupted model call alone ran again"
        );
        service.kill();
    }
    // The records are read through the service's shared handlers.
    let _reader = Service::start(&config);
    for i in 0..crashes {
        let events = check_record(&ingress, &format!("crash-{i}")).await;
        let results = events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::ToolResult { .. }))
            .count();
        assert_eq!(results, 3, "crash {i}: {events:#?}");
    }
    assert_eq!(effects(&config.effects).len(), 3 * crashes);
}

/// SIGKILL the service after a tool's effect, while the turn waits for the approval of a second
/// tool: after a restart the turn still waits, the approval resumes it, and each tool ran once.
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_while_waiting_for_approval_keeps_the_turn_and_its_effects() {
    let s = setup().await;
    let service = Service::start(&s.config);
    s.fake
        .push(Reply::tool_calls(&[(
            "call_a",
            "append_line",
            r#"{"text":"first"}"#,
        )]))
        .push(Reply::tool_calls(&[(
            "call_g",
            "guarded_append",
            r#"{"text":"second"}"#,
        )]))
        .push(Reply::text("Both done."));
    let ingress = s.restate.ingress.clone();
    let inv = send_turn(&ingress, "t-crash-approve", &turn("m1", "append two lines")).await;
    let waiting = async || {
        let (status, v) = call(&ingress, "t-crash-approve", "waiting", &json!(null)).await;
        (status == 200 && v.as_array().is_some_and(|a| !a.is_empty())).then_some(v)
    };
    until("the turn to wait for approval", waiting).await;
    assert_eq!(effects(&s.config.effects), vec!["append_line call_a first"]);
    service.kill();

    let _service = Service::start(&s.config);
    let (status, v) = call(
        &ingress,
        "t-crash-approve",
        "approve",
        &json!({"decision": "answer", "tool_use_id": "call_g", "approved": true}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let (status, out) = attach(&ingress, &inv).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["text"], "Both done.");
    assert_eq!(
        effects(&s.config.effects),
        vec!["append_line call_a first", "guarded_append call_g second"]
    );
    assert_eq!(s.fake.requests().len(), 3, "no model call ran twice");
    check_record(&ingress, "t-crash-approve").await;
}

/// A denial is an error result for the model, and the tool never runs; a cancel of a turn that
/// waits for approval ends it (409) with the waiting tool use answered by an error in the record,
/// so the next turn starts cleanly.
#[tokio::test(flavor = "multi_thread")]
async fn a_denial_and_a_cancel_never_run_the_tool() {
    let s = setup().await;
    let service = Service::start(&s.config);
    let ingress = s.restate.ingress.clone();
    let waiting = async |thread: &str| {
        until("the turn to wait for approval", async || {
            let (status, v) = call(&ingress, thread, "waiting", &json!(null)).await;
            (status == 200 && v.as_array().is_some_and(|a| !a.is_empty())).then_some(v)
        })
        .await
    };

    s.fake
        .push(Reply::tool_calls(&[(
            "call_d",
            "guarded_append",
            r#"{"text":"denied"}"#,
        )]))
        .push(Reply::text("Understood, not appending."));
    let inv = send_turn(&ingress, "t-deny", &turn("m1", "append")).await;
    waiting("t-deny").await;
    let (status, v) = call(
        &ingress,
        "t-deny",
        "approve",
        &json!({"decision": "answer", "tool_use_id": "call_d", "approved": false}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let (status, out) = attach(&ingress, &inv).await;
    assert_eq!(status, 200, "{out}");
    let last = s.fake.requests().pop().expect("a request");
    let history = serde_json::to_string(last.messages()).unwrap_or_default();
    assert!(history.contains("denied this tool call"), "{history}");

    s.fake
        .push(Reply::tool_calls(&[(
            "call_c",
            "guarded_append",
            r#"{"text":"cancelled"}"#,
        )]))
        .push(Reply::text("Fresh start."));
    let inv = send_turn(&ingress, "t-cancel", &turn("m1", "append")).await;
    waiting("t-cancel").await;
    let (status, v) = call(&ingress, "t-cancel", "cancel", &json!(null)).await;
    assert_eq!((status, v.clone()), (200, json!(true)), "{v}");
    let (status, out) = attach(&ingress, &inv).await;
    assert_eq!(status, 409, "{out}");
    let (status, out) = call(&ingress, "t-cancel", "turn", &turn("m2", "start again")).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["text"], "Fresh start.");
    assert!(
        effects(&s.config.effects).is_empty(),
        "a denied or cancelled tool ran"
    );
    let events = check_record(&ingress, "t-cancel").await;
    service.kill();
    let cancelled = events.iter().any(|e| match &e.kind {
        EventKind::ToolResult { result } => result.is_error && result.tool_use_id == "call_c",
        _ => false,
    });
    assert!(
        cancelled,
        "the cancelled tool use has an error result: {events:#?}"
    );
}

/// Hostile input is refused before the engine runs: a thread id with a control character, an
/// empty or oversized message id, an oversized text, an unknown decision (each a 4xx, nothing
/// sent to the model, nothing recorded).
#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_are_refused_before_any_step() {
    let s = setup().await;
    let service = Service::start(&s.config);
    let ingress = s.restate.ingress.clone();
    let cases = [
        ("bad%0Aid", turn("m1", "hi")),
        ("t-bad", turn("", "hi")),
        ("t-bad", turn(&"x".repeat(257), "hi")),
        ("t-bad", turn("m\u{1b}1", "hi")),
        ("t-bad", turn("m1", &"x".repeat((1 << 20) + 1))),
    ];
    for (thread, body) in cases {
        let (status, v) = call(&ingress, thread, "turn", &body).await;
        assert_eq!(status, 400, "{thread}: {v}");
    }
    let (status, v) = call(&ingress, "t-bad", "approve", &json!({"decision": "yes please"})).await;
    assert!((400..500).contains(&status), "{status} {v}");
    assert!(s.fake.requests().is_empty());
    use tether::ThreadStore;
    assert!(s.store().await.threads(None).await.expect("threads").is_empty());
    service.kill();
}

/// Token deltas leave the model step out of band while the turn runs (the journal keeps only
/// the complete response): a subscriber to the service's live route sees the answer arrive in
/// pieces that add up to the recorded message, before it.
#[tokio::test(flavor = "multi_thread")]
async fn token_deltas_stream_out_of_band_while_the_turn_runs() {
    use futures_util::StreamExt;
    let mut s = setup().await;
    let live = format!("127.0.0.1:{}", free_port());
    s.config.live = Some(live.clone());
    let service = Service::start(&s.config);
    let answer = "Hello out of band, in pieces.";
    s.fake
        .push(Reply::tool_calls(&[("call_1", "append_line", r#"{"text":"x"}"#)]))
        .push(Reply::text(answer).chunk_chars(4));
    let stream = reqwest::get(format!("http://{live}/live/t-live"))
        .await
        .expect("the live route");
    assert_eq!(stream.status(), 200);
    let mut body = stream.bytes_stream();
    let (status, out) = call(&s.restate.ingress, "t-live", "turn", &turn("m1", "say hello")).await;
    assert_eq!(status, 200, "{out}");

    let mut buf = String::new();
    let mut deltas = String::new();
    let mut pieces = 0;
    let message = tokio::time::timeout(PATIENCE, async {
        while let Some(chunk) = body.next().await {
            buf.push_str(&String::from_utf8_lossy(&chunk.expect("a chunk")));
            while let Some(end) = buf.find("\n\n") {
                let frame: String = buf.drain(..end + 2).collect();
                let data = frame.trim().strip_prefix("data: ").expect("an SSE data line");
                let event: tether::Event = serde_json::from_str(data).expect("an event");
                match event.kind {
                    EventKind::TextDelta { delta, .. } => {
                        assert!(event.seq.is_none(), "a delta is live only");
                        deltas.push_str(&delta);
                        pieces += 1;
                    }
                    EventKind::Message { text, .. } if text == answer => return text,
                    _ => {}
                }
            }
        }
        panic!("the live stream ended before the answer's message");
    })
    .await
    .expect("the answer's message on the live stream");
    assert_eq!(deltas, message, "the deltas add up to the recorded message");
    assert!(pieces > 1, "the answer came in pieces: {pieces}");
    check_record(&s.restate.ingress, "t-live").await;
    service.kill();
}

/// A redelivered request (the same message id again, as a client retrying after a lost response
/// sends it) is recorded once and not sent to the model again.
#[tokio::test(flavor = "multi_thread")]
async fn a_redelivered_message_is_neither_recorded_nor_sent_twice() {
    let s = setup().await;
    let service = Service::start(&s.config);
    s.fake.push(Reply::text("Once."));
    let (status, out) = call(&s.restate.ingress, "t-redo", "turn", &turn("m1", "hello")).await;
    assert_eq!(status, 200, "{out}");
    let (status, again) = call(&s.restate.ingress, "t-redo", "turn", &turn("m1", "hello")).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["stop_reason"], "idle", "{again}");
    assert_eq!(again["events_added"], 0, "{again}");
    assert_eq!(s.fake.requests().len(), 1, "the model was asked once");
    let events = check_record(&s.restate.ingress, "t-redo").await;
    service.kill();
    let users = events.iter().filter(|e| e.id == "user:m1").count();
    assert_eq!(users, 1, "{events:#?}");
}

/// A thread's notes written together (`put_all`, `RestateStore::put_notes`) are all there
/// after one call, or none is when one is refused (a key with a control character, more than
/// `MAX_NOTES`, the checkpoint); a `null` removes its note.
#[tokio::test(flavor = "multi_thread")]
async fn notes_written_together_are_written_whole_or_not_at_all() {
    use serde_json::Value;
    use tether::EventStore;
    let s = setup().await;
    let service = Service::start(&s.config);
    let ingress = s.restate.ingress.clone();
    let st = s.store().await;
    st.put_notes("t-notes", &[("a", json!("one")), ("b", json!({"n": 2}))])
        .await
        .expect("two notes");
    assert_eq!(st.state("t-notes", "a").await.expect("a"), Some(json!("one")));
    assert_eq!(st.state("t-notes", "b").await.expect("b"), Some(json!({"n": 2})));

    let notes = |body: Value| {
        let ingress = ingress.clone();
        async move {
            let r = reqwest::Client::new()
                .post(format!("{ingress}/TetherThreadNotes/t-notes/put_all"))
                .json(&body)
                .send()
                .await
                .expect("ingress call");
            r.status().as_u16()
        }
    };
    let bad_key = json!([{"key": "a", "value": "changed"}, {"key": "b\u{7}", "value": 1}]);
    assert_eq!(notes(bad_key).await, 400);
    let many: Vec<Value> = (0..=tether_restate::notes::MAX_NOTES)
        .map(|i| json!({"key": format!("k{i}"), "value": i}))
        .collect();
    assert_eq!(notes(Value::Array(many)).await, 400);
    assert_eq!(
        st.state("t-notes", "a").await.expect("a"),
        Some(json!("one")),
        "a refused call wrote nothing"
    );
    assert_eq!(st.state("t-notes", "k0").await.expect("k0"), None);
    assert!(
        st.put_notes("t-notes", &[(tether::thread::CHECKPOINT, json!({}))])
            .await
            .is_err()
    );

    st.put_notes("t-notes", &[("a", Value::Null)])
        .await
        .expect("a removal");
    assert_eq!(st.state("t-notes", "a").await.expect("a"), None);
    assert_eq!(st.state("t-notes", "b").await.expect("b"), Some(json!({"n": 2})));
    service.kill();
}

/// The handlers that read a few state keys load state lazily (Restate would otherwise send the
/// thread's whole record, or the agent's whole index, with every call), while the turn, which
/// reads the whole record, the index's `list`, and `status` (read once before each turn, where
/// a lazy read's exchange delayed every turn's start) get it eagerly: as registered with
/// Restate.
#[tokio::test(flavor = "multi_thread")]
async fn small_readers_load_state_lazily() {
    let s = setup().await;
    let _service = Service::start(&s.config);
    let client = reqwest::Client::new();
    let lazy_of = async |service: &str| -> Option<std::collections::BTreeMap<String, bool>> {
        let r = client
            .get(format!("{}/services/{service}", s.restate.admin))
            .send()
            .await
            .ok()?;
        if !r.status().is_success() {
            return None;
        }
        let v: serde_json::Value = r.json().await.ok()?;
        let handlers = v["handlers"].as_array()?;
        Some(
            handlers
                .iter()
                .map(|h| {
                    let name = h["name"].as_str().unwrap_or_default().to_owned();
                    (name, h["enable_lazy_state"].as_bool().unwrap_or(false))
                })
                .collect(),
        )
    };
    let thread = until("the service to be registered", async || {
        lazy_of("TetherThread").await
    })
    .await;
    for (handler, lazy) in &thread {
        assert_eq!(
            *lazy,
            handler != "turn" && handler != "status",
            "TetherThread/{handler}: {thread:?}"
        );
    }
    assert!(
        thread.contains_key("status") && thread.contains_key("progress"),
        "{thread:?}"
    );
    let index = lazy_of("TetherThreads").await.expect("the index is registered");
    assert_eq!(index.get("add"), Some(&true), "{index:?}");
    assert_eq!(index.get("list"), Some(&false), "{index:?}");
}

/// Pages of a record from any point, longer and shorter than what a read asks for before it
/// knows the record's length (8 events), are the record's events, in order, each once.
#[tokio::test(flavor = "multi_thread")]
async fn pages_of_a_record_are_its_events_in_order() {
    let s = setup().await;
    let _service = Service::start(&s.config);
    for i in 0..7 {
        s.fake.push(Reply::text(format!("answer {i}")));
        let (status, out) = call(
            &s.restate.ingress,
            "t-pages",
            "turn",
            &turn(&format!("m{i}"), "again"),
        )
        .await;
        assert_eq!(status, 200, "{out}");
    }
    let events = check_record(&s.restate.ingress, "t-pages").await;
    assert_eq!(events.len(), 14, "two events a turn");
    for (after, limit) in [
        (0u64, 0u32),
        (1, 3),
        (1, 100),
        (2, 9),
        (3, 8),
        (5, 0),
        (13, 5),
        (14, 1),
        (20, 0),
    ] {
        let (status, page) = call(
            &s.restate.ingress,
            "t-pages",
            "events",
            &json!({"after": after, "limit": limit}),
        )
        .await;
        assert_eq!(status, 200, "{page}");
        let want: Vec<_> = events
            .iter()
            .skip(after as usize)
            .take(if limit == 0 { usize::MAX } else { limit as usize })
            .map(|e| e.id.clone())
            .collect();
        let got: Vec<_> = page
            .as_array()
            .expect("a page")
            .iter()
            .map(|e| e["id"].as_str().unwrap_or_default().to_owned())
            .collect();
        assert_eq!(got, want, "after {after}, limit {limit}");
    }
}

/// A turn sent with its sender's clock stamps the thread with it (no clock of its own, on the
/// first turn and on later ones), and one told there is nothing to import looks for nothing; a
/// clock outside 1970..9999 is refused before any step.
#[tokio::test(flavor = "multi_thread")]
async fn a_turn_takes_its_senders_clock() {
    let s = setup().await;
    let _service = Service::start(&s.config);
    s.fake.push(Reply::text("one")).push(Reply::text("two"));
    let first = 1_700_000_000_123i64;
    let mut req = turn("m1", "hi");
    req["clock"] = json!(first);
    req["import"] = json!(false);
    let (status, out) = call(&s.restate.ingress, "t-clock", "turn", &req).await;
    assert_eq!(status, 200, "{out}");
    let (_, glance) = call(&s.restate.ingress, "t-clock", "status", &json!(null)).await;
    assert_eq!(glance["thread"]["created_ms"], json!(first), "{glance}");
    assert_eq!(glance["thread"]["updated_ms"], json!(first), "{glance}");
    let mut req = turn("m2", "again");
    req["clock"] = json!(first + 5_000);
    let (status, out) = call(&s.restate.ingress, "t-clock", "turn", &req).await;
    assert_eq!(status, 200, "{out}");
    let (_, glance) = call(&s.restate.ingress, "t-clock", "status", &json!(null)).await;
    assert_eq!(glance["thread"]["created_ms"], json!(first), "{glance}");
    assert_eq!(glance["thread"]["updated_ms"], json!(first + 5_000), "{glance}");
    for bad in [json!(-1), json!(253_402_300_800_000i64)] {
        let mut req = turn("m3", "bad clock");
        req["clock"] = bad.clone();
        let (status, out) = call(&s.restate.ingress, "t-clock", "turn", &req).await;
        assert_eq!(status, 400, "{bad}: {out}");
    }
    assert_eq!(s.fake.requests().len(), 2, "no model call for a refused turn");
}

/// A turn killed while it waits (Restate's admin kill: the turn never writes its end, its
/// checkpoint included) leaves a thread the next turn goes on with: the next model call holds
/// the first turn's message and its tool's result, rebuilt from the record's events.
#[tokio::test(flavor = "multi_thread")]
async fn the_turn_after_a_killed_turn_goes_on_from_the_record() {
    let s = setup().await;
    let _service = Service::start(&s.config);
    s.fake
        .push(Reply::tool_calls(&[(
            "call_a",
            "append_line",
            r#"{"text":"first"}"#,
        )]))
        .push(Reply::tool_calls(&[(
            "call_g",
            "guarded_append",
            r#"{"text":"second"}"#,
        )]));
    let ingress = s.restate.ingress.clone();
    let inv = send_turn(&ingress, "t-killed", &turn("m1", "append two lines")).await;
    until("the turn to wait for approval", async || {
        let (status, v) = call(&ingress, "t-killed", "waiting", &json!(null)).await;
        (status == 200 && v.as_array().is_some_and(|a| !a.is_empty())).then_some(())
    })
    .await;
    let client = reqwest::Client::new();
    let killed = client
        .patch(format!("{}/invocations/{inv}/kill", s.restate.admin))
        .send()
        .await
        .expect("the admin API");
    assert!(killed.status().is_success(), "kill: {}", killed.status());
    let (status, _) = attach(&ingress, &inv).await;
    assert!(status >= 400, "a killed turn has no result: {status}");
    // The thread still names the killed turn as running (it never cleared it), while Restate
    // says the invocation is over: what a front-end asks before it calls the thread busy.
    let (_, glance) = call(&ingress, "t-killed", "status", &json!(null)).await;
    assert_eq!(glance["invocation"], json!(inv), "{glance}");
    let output = client
        .get(format!("{ingress}/restate/invocation/{inv}/output"))
        .send()
        .await
        .expect("output");
    assert_eq!(output.status().as_u16(), 409, "a killed invocation's output");
    // The first model call answers the killed turn's call left waiting (as not answered), the
    // second the new message.
    s.fake.push(Reply::text("Noted.")).push(Reply::text("Picked up."));
    let (status, out) = call(&ingress, "t-killed", "turn", &turn("m2", "go on")).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["text"], "Picked up.", "{out}");
    let last = s.fake.requests().pop().expect("a request");
    let history = serde_json::to_string(last.messages()).unwrap_or_default();
    for want in ["append two lines", "call_a", "appended", "go on"] {
        assert!(history.contains(want), "history lacks {want}: {history}");
    }
    assert_eq!(
        effects(&s.config.effects),
        vec!["append_line call_a first"],
        "the guarded call never ran"
    );
    check_record(&ingress, "t-killed").await;
}
