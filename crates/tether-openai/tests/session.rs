//! The real `Session` + `LocalLoop` + `OpenAiModel` over real HTTP against `FakeOpenAi`:
//! the agent loop, every fault ending in a retry or the right typed error, the loop guards,
//! the terminal tool, cancellation and the run timeout.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use tether::{Error, EventKind, RecordingSleeper, Session, StopReason, Terminal, ToolSet, ToolSpec};
use tether_testkit::openai::{FakeOpenAi, Reply};
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn three_turns_with_parallel_tool_calls_results_in_call_order() {
    let fake = FakeOpenAi::start().await;
    fake.push(
        Reply::tool_calls(&[
            ("call_w", "get_weather", r#"{"city":"Paris"}"#),
            ("call_t", "get_time", r#"{"tz":"UTC"}"#),
            ("call_a", "add", r#"{"a":1,"b":2}"#),
        ])
        .interleaved()
        .args_chunk(3)
        .usage(100, 30)
        .cached_tokens(64),
    );
    fake.push(Reply::tool_calls(&[("call_w2", "get_weather", r#"{"city":"Berlin"}"#)]).usage(200, 10));
    fake.push(
        Reply::text("Paris is sunny, Berlin is grey.")
            .chunk_chars(3)
            .usage(300, 8),
    );

    let sleeper = RecordingSleeper::default();
    let ran = Arc::new(AtomicUsize::new(0));
    let mut session = session(&fake, &sleeper)
        .handler(tools(ran.clone()))
        .open()
        .await
        .unwrap();
    let mut rx = session.sink().subscribe(4096).await;
    let r = session.send("Weather in Paris and Berlin?").await.unwrap();

    assert_eq!(r.text, "Paris is sunny, Berlin is grey.");
    assert_eq!(r.terminal, Terminal::EndTurn);
    assert_eq!(r.turns, 3);
    assert_eq!(ran.load(Ordering::SeqCst), 4);
    assert_eq!(r.usage.input_tokens, 600);
    assert_eq!(r.usage.output_tokens, 48);
    assert_eq!(r.usage.cache_read_tokens, 64);
    assert_eq!(r.usage.raw.len(), 3);
    assert!(sleeper.slept().is_empty());
    check_record(&r, 1);
    assert_eq!(retries(&r), 0);

    let reqs = fake.requests();
    assert_eq!(reqs.len(), 3);
    for q in &reqs {
        assert_eq!(q.method, "POST");
        assert_eq!(q.path, "/v1/chat/completions");
        assert_eq!(q.body["model"], "fake-model");
        assert_eq!(q.body["stream"], true);
        assert_eq!(q.body["stream_options"], json!({"include_usage": true}));
        assert!(q.body.get("tool_choice").is_none());
        assert_eq!(q.header("accept"), Some("text/event-stream"));
        let tools: Vec<&str> = q.body["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                assert_eq!(t["type"], "function");
                assert!(t["function"]["parameters"].is_object());
                t["function"]["name"].as_str().unwrap()
            })
            .collect();
        assert_eq!(tools, ["get_weather", "get_time", "add"]);
    }
    // Turn 2's history: the assistant's calls (content "" not null), then one tool message per
    // call in call order, although get_weather finished last.
    let m = reqs[1].messages();
    assert_eq!(m.len(), 5, "{m:#?}");
    assert_eq!(
        m[0],
        json!({"role": "user", "content": "Weather in Paris and Berlin?"})
    );
    assert_eq!(m[1]["role"], "assistant");
    assert_eq!(m[1]["content"], "");
    let ids: Vec<&str> = m[1]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["call_w", "call_t", "call_a"]);
    assert_eq!(m[1]["tool_calls"][2]["function"]["arguments"], r#"{"a":1,"b":2}"#);
    assert_eq!(m[1]["tool_calls"][0]["type"], "function");
    let tool_ids: Vec<&str> = m[2..]
        .iter()
        .map(|t| t["tool_call_id"].as_str().unwrap())
        .collect();
    assert_eq!(tool_ids, ["call_w", "call_t", "call_a"]);
    for t in &m[2..] {
        assert_eq!(t["role"], "tool");
        assert_eq!(t.as_object().unwrap().len(), 3, "{t}");
    }
    assert!(
        m[2]["content"]
            .as_str()
            .unwrap()
            .starts_with("get_weather result for")
    );
    assert_eq!(reqs[2].messages().len(), 7);

    // Live deltas: every call started once, its fragments concatenate to its arguments, ended once.
    let live = drain(&mut rx);
    let mut args = std::collections::HashMap::<String, String>::new();
    let (mut starts, mut ends) = (Vec::new(), Vec::new());
    let mut text = String::new();
    for e in &live {
        match &e.kind {
            EventKind::ToolCallStart { tool_use_id, .. } => starts.push(tool_use_id.clone()),
            EventKind::ToolCallArgs { tool_use_id, delta } => {
                assert!(starts.contains(tool_use_id), "args before start");
                args.entry(tool_use_id.clone()).or_default().push_str(delta)
            }
            EventKind::ToolCallEnd { tool_use_id } => ends.push(tool_use_id.clone()),
            EventKind::TextDelta { delta, .. } => text.push_str(delta),
            _ => {}
        }
    }
    assert_eq!(starts, ["call_w", "call_t", "call_a", "call_w2"]);
    assert_eq!(ends, ["call_w", "call_t", "call_a", "call_w2"]);
    assert_eq!(args["call_t"], r#"{"tz":"UTC"}"#);
    assert_eq!(args["call_w2"], r#"{"city":"Berlin"}"#);
    assert_eq!(text, r.text);
    assert_eq!(fake.remaining(), 0);
}

/// Runs one prompt with `replies` scripted; returns the result and the recorded delays.
async fn run(
    replies: Vec<Reply>,
) -> (
    tether::Result<tether::SessionResult>,
    RecordingSleeper,
    FakeOpenAi,
) {
    let fake = FakeOpenAi::start().await;
    fake.push_all(replies);
    let sleeper = RecordingSleeper::default();
    let mut s = session(&fake, &sleeper).open().await.unwrap();
    let r = s.send("hi").await;
    (r, sleeper, fake)
}

/// A fault followed by a good answer: retried once, the answer recorded once, nothing lost.
async fn retried_once(fault: Reply) -> (tether::SessionResult, RecordingSleeper) {
    let (r, sleeper, fake) = run(vec![fault, Reply::text("recovered").usage(5, 1)]).await;
    let r = r.unwrap();
    assert_eq!(r.text, "recovered");
    assert_eq!(retries(&r), 1);
    assert_eq!(messages(&r), ["recovered"], "one model response recorded");
    assert_eq!(sleeper.slept().len(), 1);
    assert_eq!(fake.requests().len(), 2);
    assert_eq!(
        fake.requests()[0].body,
        fake.requests()[1].body,
        "the retry resends the same request"
    );
    check_record(&r, 1);
    (r, sleeper)
}

fn retry_error(r: &tether::SessionResult) -> String {
    r.events
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::Retry { error, .. } => Some(error.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn in_stream_server_error_is_retried() {
    let (r, _) = retried_once(Reply::text("partial answer").error_after(
        2,
        "The server is overloaded",
        "server_error",
    ))
    .await;
    assert!(retry_error(&r).contains("overloaded"), "{}", retry_error(&r));
}

#[tokio::test]
async fn in_stream_invalid_request_error_is_typed_and_not_retried() {
    let (r, sleeper, fake) = run(vec![Reply::text("x").error_after(
        1,
        "context too long",
        "invalid_request_error",
    )])
    .await;
    match r {
        Err(Error::Stream { message, code }) => {
            assert_eq!(message, "context too long");
            assert_eq!(code.as_deref(), Some("invalid_request_error"));
        }
        other => panic!("{other:?}"),
    }
    assert!(sleeper.slept().is_empty());
    assert_eq!(fake.requests().len(), 1);
}

#[tokio::test]
async fn rate_limit_429_honours_retry_after() {
    let (_, sleeper) = retried_once(Reply::rate_limited("2")).await;
    assert_eq!(sleeper.slept(), [Duration::from_secs(2)]);
    let (_, sleeper) = retried_once(
        Reply::error(429, "slow down", "rate_limit_exceeded")
            .header("retry-after-ms", "1500")
            .header("retry-after", "9"),
    )
    .await;
    assert_eq!(sleeper.slept(), [Duration::from_millis(1500)]);
    // An HTTP date is read against now: 3 s from now (to the second) is a wait of 2 to 3 s,
    // not the backoff (under a second for a first retry).
    let at = std::time::SystemTime::now() + Duration::from_secs(3);
    let (_, sleeper) = retried_once(Reply::rate_limited(&httpdate::fmt_http_date(at))).await;
    let slept = sleeper.slept();
    assert!(
        slept.len() == 1 && slept[0] >= Duration::from_millis(1500) && slept[0] <= Duration::from_secs(3),
        "{slept:?}"
    );
}

#[tokio::test]
async fn quota_429_is_not_retried() {
    let (r, sleeper, fake) = run(vec![Reply::quota_exceeded(), Reply::text("never")]).await;
    match r {
        Err(e @ Error::Http { .. }) => {
            assert_eq!(e.status(), Some(429));
            assert!(!e.is_transient());
            let Error::Http { code, message, .. } = &e else {
                unreachable!()
            };
            assert_eq!(code.as_deref(), Some("insufficient_quota"));
            assert!(message.contains("quota"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(sleeper.slept().is_empty());
    assert_eq!(fake.requests().len(), 1);
    assert_eq!(fake.remaining(), 1);
}

#[tokio::test]
async fn server_errors_500_and_503_are_retried_with_backoff() {
    let (r, sleeper, _) = run(vec![
        Reply::server_error(500),
        Reply::server_error(503),
        Reply::text("ok"),
    ])
    .await;
    let r = r.unwrap();
    assert_eq!(r.text, "ok");
    assert_eq!(retries(&r), 2);
    check_record(&r, 1);
    let slept = sleeper.slept();
    assert_eq!(slept.len(), 2);
    assert!(
        slept[0] <= Duration::from_millis(500) && slept[0] >= Duration::from_millis(375),
        "{slept:?}"
    );
    assert!(
        slept[1] <= Duration::from_millis(1000) && slept[1] >= Duration::from_millis(750),
        "{slept:?}"
    );
}

#[tokio::test]
async fn server_error_with_should_retry_false_is_final() {
    let (r, sleeper, _) = run(vec![Reply::server_error(500).header("x-should-retry", "false")]).await;
    assert!(
        matches!(
            r,
            Err(Error::Http {
                status: 500,
                should_retry: Some(false),
                ..
            })
        ),
        "{r:?}"
    );
    assert!(sleeper.slept().is_empty());
}

#[tokio::test]
async fn connection_dropped_mid_stream_is_retried() {
    let (r, _) = retried_once(Reply::text("a long answer that is cut").drop_after(3)).await;
    assert!(
        retry_error(&r).contains("connection closed"),
        "{}",
        retry_error(&r)
    );
}

#[tokio::test]
async fn stalled_stream_hits_the_idle_timeout_and_is_retried() {
    let fake = FakeOpenAi::start().await;
    fake.push_all([
        Reply::text("stalls after a while").stall_after(2),
        Reply::text("recovered"),
    ]);
    let sleeper = RecordingSleeper::default();
    // The idle timeout is under test; the retried stream is written at once, well within it.
    let model = model_with_idle(&fake, Duration::from_secs(1));
    let r = tether::Session::builder(local(model, &sleeper))
        .run("hi")
        .await
        .unwrap();
    assert_eq!(r.text, "recovered");
    assert_eq!(retries(&r), 1);
    assert_eq!(messages(&r), ["recovered"], "one model response recorded");
    assert!(retry_error(&r).contains("stream idle"), "{}", retry_error(&r));
}

#[tokio::test]
async fn malformed_chunk_is_a_typed_error() {
    let (r, sleeper, _) = run(vec![Reply::text("hello").malformed_after(2)]).await;
    match r {
        Err(Error::Malformed { message: m, .. }) => assert!(m.contains("stream event #3"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(sleeper.slept().is_empty());
}

#[tokio::test]
async fn missing_done_after_finish_reason_is_accepted() {
    let (r, sleeper, _) = run(vec![Reply::text("fine without DONE").usage(1, 1).no_done()]).await;
    let r = r.unwrap();
    assert_eq!(r.text, "fine without DONE");
    assert_eq!(r.usage.input_tokens, 1);
    assert!(sleeper.slept().is_empty());
    check_record(&r, 1);
}

#[tokio::test]
async fn body_ending_before_any_finish_reason_is_retried_as_transport() {
    let (r, _) = retried_once(Reply::text("truncated answer").truncate_after(2)).await;
    let e = retry_error(&r);
    assert!(
        e.contains("connection closed") && e.contains("before any finish_reason"),
        "{e}"
    );
}

#[tokio::test]
async fn quirky_servers_llama_cpp_python_vllm_and_byte_splits() {
    let fake = FakeOpenAi::start().await;
    fake.push(
        Reply::tool_calls(&[(
            "call__0_get_weather_cmpl-1",
            "get_weather",
            r#"{ "city": "Paris" }"#,
        )])
        .llama_cpp_python()
        .usage(10, 5)
        .usage_choices_null()
        .split_bytes(7),
    );
    fake.push(
        Reply::text("It is sunny.")
            .reasoning("The tool said so.")
            .finish_reason("")
            .split_bytes(3),
    );
    let sleeper = RecordingSleeper::default();
    let ran = Arc::new(AtomicUsize::new(0));
    let r = session(&fake, &sleeper)
        .handler(tools(ran.clone()))
        .open()
        .await
        .unwrap()
        .send("weather?")
        .await
        .unwrap();
    assert_eq!(r.text, "It is sunny.");
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(r.tool_uses[0].name, "get_weather");
    assert_eq!(r.tool_uses[0].input, json!({"city": "Paris"}));
    assert_eq!(r.usage.input_tokens, 10);
    let reasoning: Vec<Option<String>> = r
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Message {
                reasoning,
                role: tether::Role::Assistant,
                ..
            } => Some(reasoning.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(reasoning, [None, Some("The tool said so.".to_owned())]);
    check_record(&r, 1);
}

#[tokio::test]
async fn duplicate_call_is_not_dispatched() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[("c1", "get_weather", r#"{"city":"Paris"}"#)]));
    fake.push(Reply::tool_calls(&[(
        "c2",
        "get_weather",
        r#"{ "city" : "Paris" }"#,
    )]));
    fake.push(Reply::text("done"));
    let sleeper = RecordingSleeper::default();
    let ran = Arc::new(AtomicUsize::new(0));
    let r = session(&fake, &sleeper)
        .handler(tools(ran.clone()))
        .open()
        .await
        .unwrap()
        .send("go")
        .await
        .unwrap();
    assert_eq!(r.text, "done");
    assert_eq!(ran.load(Ordering::SeqCst), 1, "the duplicate was not run");
    assert!(r.events.iter().any(|e| e.id == "dup:c2"));
    let m = fake.requests()[2].messages().to_vec();
    let last = m.last().unwrap();
    assert_eq!(last["role"], "tool");
    assert_eq!(last["tool_call_id"], "c2");
    let body: Value = serde_json::from_str(last["content"].as_str().unwrap()).unwrap();
    assert_eq!(body["duplicate"], true);
    check_record(&r, 1);
}

#[tokio::test]
async fn corrective_directive_after_two_errors() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[("c1", "strict", r#"{"n":1}"#)]));
    fake.push(Reply::tool_calls(&[("c2", "strict", r#"{"n":2}"#)]));
    fake.push(Reply::text("giving up"));
    let handler = ToolSet::new().tool(spec("strict"), |_input: Value| async {
        Err::<String, _>("n must be negative")
    });
    let sleeper = RecordingSleeper::default();
    let r = session(&fake, &sleeper)
        .handler(handler)
        .open()
        .await
        .unwrap()
        .send("go")
        .await
        .unwrap();
    let correctives: Vec<&Value> = r
        .events
        .iter()
        .filter(|e| e.raw["role"] == "corrective")
        .map(|e| &e.raw)
        .collect();
    assert_eq!(correctives.len(), 1);
    let m = fake.requests()[2].messages().to_vec();
    let last = m.last().unwrap();
    assert_eq!(last["role"], "user");
    assert!(last["content"].as_str().unwrap().starts_with("STOP"), "{last}");
    // Only one error before turn 2: no corrective yet.
    assert!(fake.requests()[1].messages().last().unwrap()["role"] == "tool");
    check_record(&r, 1);
}

#[tokio::test]
async fn final_turn_directive_and_turn_limit() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[("c1", "add", r#"{"a":1}"#)]));
    fake.push(Reply::tool_calls(&[("c2", "add", r#"{"a":2}"#)]));
    let sleeper = RecordingSleeper::default();
    let r = session(&fake, &sleeper)
        .handler(tools(Arc::new(AtomicUsize::new(0))))
        .max_turns(2)
        .open()
        .await
        .unwrap()
        .send("go")
        .await
        .unwrap();
    assert_eq!(r.terminal, Terminal::Terminated);
    assert_eq!(r.stop_reason, StopReason::MaxTurns);
    assert_eq!(r.turns, 2);
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    let first_last = reqs[0].messages().last().unwrap().clone();
    assert_eq!(first_last["content"], "go");
    let last = reqs[1].messages().last().unwrap().clone();
    assert_eq!(last["role"], "user");
    assert!(
        last["content"].as_str().unwrap().starts_with("FINAL TURN"),
        "{last}"
    );
    assert_eq!(
        count(
            &r.events,
            |k| matches!(k, EventKind::Directive { role, .. } if role == "final_turn")
        ),
        1
    );
    check_record(&r, 1);
}

fn final_answer() -> ToolSpec {
    ToolSpec::new(
        "final_answer",
        "Give the final answer",
        json!({"type": "object", "properties": {"answer": {"type": "string"}}}),
    )
}

#[tokio::test]
async fn terminal_tool_reprompts_then_no_terminal_tool() {
    let fake = FakeOpenAi::start().await;
    fake.push_all([Reply::text("one"), Reply::text("two"), Reply::text("three")]);
    let sleeper = RecordingSleeper::default();
    let r = session(&fake, &sleeper)
        .terminal_tool(final_answer())
        .open()
        .await
        .unwrap()
        .send("go")
        .await
        .unwrap();
    assert_eq!(r.stop_reason, StopReason::NoTerminalTool);
    assert_eq!(r.turns, 3);
    assert_eq!(
        count(
            &r.events,
            |k| matches!(k, EventKind::Directive { role, .. } if role == "reprompt")
        ),
        2
    );
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 3);
    assert!(
        reqs[0].body["tools"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["function"]["name"] == "final_answer")
    );
    assert!(
        reqs[1].messages().last().unwrap()["content"]
            .as_str()
            .unwrap()
            .contains("final_answer")
    );
    check_record(&r, 1);
}

#[tokio::test]
async fn terminal_tool_call_ends_the_run_with_its_input() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text("thinking"));
    fake.push(Reply::tool_calls(&[("f1", "final_answer", r#"{"answer":"42"}"#)]));
    let sleeper = RecordingSleeper::default();
    let r = session(&fake, &sleeper)
        .terminal_tool(final_answer())
        .open()
        .await
        .unwrap()
        .send("go")
        .await
        .unwrap();
    assert_eq!(r.stop_reason, StopReason::TerminalTool);
    assert_eq!(r.final_output, Some(json!({"answer": "42"})));
    assert_eq!(fake.requests().len(), 2);
    check_record(&r, 1);
}

#[tokio::test]
async fn cancellation_mid_stream() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text("this stream stalls after a few deltas").stall_after(3));
    fake.push(Reply::text("after cancel"));
    let sleeper = RecordingSleeper::default();
    let model = tether_openai::OpenAiModel::builder(fake.url())
        .model("m")
        .stream_idle_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let mut s = Session::builder(local(model, &sleeper)).open().await.unwrap();
    let mut rx = s.sink().subscribe(64).await;
    let token = CancellationToken::new();
    let t = token.clone();
    let watcher = tokio::spawn(async move {
        let mut seen = String::new();
        while let Some(e) = rx.recv().await {
            if let EventKind::TextDelta { delta, .. } = e.kind {
                seen.push_str(&delta);
                t.cancel();
                break;
            }
        }
        seen
    });
    let r = s.send_cancellable("hi", token).await;
    assert!(matches!(r, Err(Error::Cancelled)), "{r:?}");
    assert!(!watcher.await.unwrap().is_empty());
    assert!(sleeper.slept().is_empty());
    // The session is still usable.
    let r = s.send("again").await.unwrap();
    assert_eq!(r.text, "after cancel");
    assert_eq!(fake.requests().len(), 2);
}

#[tokio::test]
async fn run_timeout_tears_down_a_stalled_stream() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text("stalls").stall_after(1));
    let sleeper = RecordingSleeper::default();
    let model = tether_openai::OpenAiModel::builder(fake.url())
        .model("m")
        .stream_idle_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let r = Session::builder(local(model, &sleeper))
        .timeout(Duration::from_millis(300))
        .run("hi")
        .await;
    assert!(matches!(r, Err(Error::Timeout(_))), "{r:?}");
    assert!(sleeper.slept().is_empty());
}

#[tokio::test]
async fn non_stream_mode_gives_the_same_shape() {
    let fake = FakeOpenAi::start().await;
    fake.push(
        Reply::tool_calls(&[("c1", "add", r#"{"a":1}"#), ("c2", "get_time", "")]).with_text("Let me see."),
    );
    fake.push(Reply::text("Three.").usage(9, 2));
    let sleeper = RecordingSleeper::default();
    let model = tether_openai::OpenAiModel::builder(fake.url())
        .model("m")
        .stream(false)
        .max_tokens(256)
        .max_tokens_field("max_completion_tokens")
        .api_key("sk-test")
        .header("x-extra", "1")
        .extra_body("temperature", json!(0.2))
        .build()
        .unwrap();
    let mut s = Session::builder(local(model, &sleeper))
        .handler(tools(Arc::new(AtomicUsize::new(0))))
        .open()
        .await
        .unwrap();
    let mut rx = s.sink().subscribe(256).await;
    let r = s.send("go").await.unwrap();
    assert_eq!(r.text, "Three.");
    assert_eq!(r.texts[0], "Let me see.");
    assert_eq!(r.usage.output_tokens, 2);
    let kinds: Vec<&str> = drain(&mut rx)
        .iter()
        .filter(|e| e.seq.is_none())
        .map(|e| e.kind.name())
        .collect();
    assert_eq!(
        kinds,
        [
            "text_delta",
            "tool_call_start",
            "tool_call_args",
            "tool_call_end",
            "tool_call_start",
            "tool_call_end",
            "text_delta"
        ]
    );
    let q = &fake.requests()[0];
    assert_eq!(q.body["stream"], false);
    assert!(q.body.get("stream_options").is_none());
    assert_eq!(q.body["max_completion_tokens"], 256);
    assert!(q.body.get("max_tokens").is_none());
    assert_eq!(q.body["temperature"], 0.2);
    assert_eq!(q.header("authorization"), Some("Bearer sk-test"));
    assert_eq!(q.header("x-extra"), Some("1"));
    let m = fake.requests()[1].messages().to_vec();
    assert_eq!(m[1]["content"], "Let me see.");
    assert_eq!(m[3]["tool_call_id"], "c2");
    check_record(&r, 1);
}

#[tokio::test]
async fn script_exhaustion_fails_loudly() {
    let (r, sleeper, _) = run(vec![]).await;
    match r {
        Err(Error::Http {
            status: 500, message, ..
        }) => assert!(message.contains("script is empty"), "{message}"),
        other => panic!("{other:?}"),
    }
    assert!(sleeper.slept().is_empty());
}
