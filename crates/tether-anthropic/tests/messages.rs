//! The Messages ChatModel against the scripted fake over real HTTP.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::{Value, json};
use tether::local::LocalLoop;
use tether::{Error, EventKind, RecordingSleeper, RetryPolicy, Session, Terminal, ToolSet, ToolSpec};
use tether_anthropic::{ClientConfig, MessagesModel};
use tether_testkit::anthropic::{FakeMessages, Reply, golden};

fn weather_tool() -> ToolSpec {
    ToolSpec::new(
        "get_weather",
        "Weather for a city",
        json!({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}),
    )
}

fn model(fake: &FakeMessages) -> MessagesModel {
    MessagesModel::new(ClientConfig::new("sk-test").base_url(fake.url()), "claude-test")
        .expect("model")
        .max_tokens(1024)
        .thinking(json!({"type": "enabled", "budget_tokens": 512}))
}

fn tools(calls: Arc<AtomicU32>) -> ToolSet {
    ToolSet::new().tool(weather_tool(), move |input: Value| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            assert_eq!(input["city"], "Paris");
            Ok::<_, String>("sunny, 24C".to_owned())
        }
    })
}

#[tokio::test]
async fn thinking_and_tool_use_round_trip_the_signature_unchanged() {
    let fake = FakeMessages::start(vec![
        Reply::Sse(golden("thinking_tool_use.sse")),
        Reply::Sse(golden("final_text.sse")),
    ])
    .await;
    let calls = Arc::new(AtomicU32::new(0));
    let provider = LocalLoop::new(model(&fake)).system_prompt("You are terse.");
    let result = Session::builder(provider)
        .handler(tools(calls.clone()))
        .run("Weather in Paris?")
        .await
        .expect("run");
    assert_eq!(result.terminal, Terminal::EndTurn);
    assert_eq!(result.text, "It is sunny in Paris.");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(result.tool_uses.len(), 1);
    assert_eq!(result.tool_uses[0].input, json!({"city": "Paris"}));
    assert_eq!(result.usage.output_tokens, 89 + 12);
    assert_eq!(result.usage.cache_read_tokens, 100);

    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].header("x-api-key"), Some("sk-test"));
    assert_eq!(reqs[0].header("anthropic-version"), Some("2023-06-01"));
    let expected: Value = serde_json::from_str(&golden("second_request.json")).expect("golden json");
    assert_eq!(
        reqs[1].body, expected,
        "second request differs from the golden file"
    );
    let sig = &reqs[1].body["messages"][1]["content"][0]["signature"];
    assert_eq!(
        sig,
        "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds+xJ3zjL5Q/sig=="
    );
}

#[tokio::test]
async fn overloaded_529_and_in_stream_errors_are_retried_by_the_shared_policy() {
    let fake = FakeMessages::start(vec![
        Reply::overloaded(),
        Reply::Status {
            status: 429,
            body: json!({"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}),
            headers: vec![("retry-after".into(), "2".into())],
        },
        Reply::Sse(golden("error_in_stream.sse")),
        Reply::Sse(golden("final_text.sse")),
    ])
    .await;
    let sleeper = RecordingSleeper::default();
    let policy = RetryPolicy::default()
        .with_sleeper(sleeper.clone())
        .with_jitter(false);
    let provider = LocalLoop::new(model(&fake)).retry(policy);
    let result = Session::builder(provider).run("hi").await.expect("run");
    assert_eq!(result.text, "It is sunny in Paris.");
    assert_eq!(fake.requests().len(), 4);
    let slept = sleeper.slept();
    assert_eq!(slept.len(), 3);
    assert_eq!(
        slept[1],
        std::time::Duration::from_secs(2),
        "retry-after honoured"
    );
    let retries = result
        .events
        .iter()
        .filter(|e| e.raw_type == "local.retry")
        .count();
    assert_eq!(retries, 3);
}

#[tokio::test]
async fn a_missing_key_is_a_401_that_is_not_retried() {
    let fake = FakeMessages::start(vec![Reply::Sse(golden("final_text.sse"))]).await;
    let m = MessagesModel::new(ClientConfig::new("").base_url(fake.url()), "claude-test").expect("model");
    let sleeper = RecordingSleeper::default();
    let provider = LocalLoop::new(m).retry(RetryPolicy::default().with_sleeper(sleeper.clone()));
    let err = Session::builder(provider).run("hi").await.expect_err("401");
    assert!(matches!(err, Error::Http { status: 401, .. }), "{err:?}");
    assert_eq!(err.code(), "auth");
    assert!(sleeper.slept().is_empty());
}

#[tokio::test]
async fn prompt_cache_breakpoints_go_on_system_tools_and_the_newest_block() {
    let fake = FakeMessages::start(vec![Reply::Sse(golden("final_text.sse"))]).await;
    let m = model(&fake).prompt_cache(true);
    let provider = LocalLoop::new(m).system_prompt("sys");
    let calls = Arc::new(AtomicU32::new(0));
    Session::builder(provider)
        .handler(tools(calls))
        .run("hi")
        .await
        .expect("run");
    let body = &fake.requests()[0].body;
    let eph = json!({"type": "ephemeral"});
    assert_eq!(body["system"][0]["cache_control"], eph);
    assert_eq!(body["tools"][0]["cache_control"], eph);
    assert_eq!(body["messages"][0]["content"][0]["cache_control"], eph);
}

/// Against the real API: `cargo test -p tether-anthropic --test messages -- --ignored` with
/// ANTHROPIC_API_KEY set (TETHER_ANTHROPIC_MODEL optional). Without the key it fails, saying so.
#[tokio::test]
#[ignore = "live: needs ANTHROPIC_API_KEY; run with --ignored"]
async fn live_messages_round_trip() {
    let cfg = ClientConfig::from_env()
        .unwrap_or_else(|e| panic!("this live test needs ANTHROPIC_API_KEY in the environment: {e}"));
    let model_name = std::env::var("TETHER_ANTHROPIC_MODEL").unwrap_or_else(|_| "claude-sonnet-4-5".into());
    let m = MessagesModel::new(cfg, model_name)
        .expect("model")
        .max_tokens(256);
    let result = Session::builder(LocalLoop::new(m))
        .run("Reply with the single word: pong")
        .await
        .expect("live run");
    assert!(result.text.to_lowercase().contains("pong"), "{}", result.text);
}

/// The live deltas of one run, merged per kind (`kind`, concatenated content; tool arguments
/// compared as JSON since a stream may space them differently).
async fn delta_summary(
    fake: &FakeMessages,
    m: MessagesModel,
) -> (Vec<(String, String)>, tether::SessionResult) {
    let provider = LocalLoop::new(m).system_prompt("You are terse.");
    let calls = Arc::new(AtomicU32::new(0));
    let mut session = Session::builder(provider)
        .handler(tools(calls))
        .open()
        .await
        .expect("open");
    let mut rx = session.sink().subscribe(1024).await;
    let result = session.send("Weather in Paris?").await.expect("run");
    let mut out: Vec<(String, String)> = Vec::new();
    while let Ok(e) = rx.try_recv() {
        let (kind, piece) = match &e.kind {
            EventKind::TextDelta { delta, .. } => ("text", delta.clone()),
            EventKind::ReasoningDelta { delta, .. } => ("reasoning", delta.clone()),
            EventKind::ReasoningSignature { value, .. } => ("signature", value.clone()),
            EventKind::ToolCallStart {
                tool_use_id, name, ..
            } => ("start", format!("{tool_use_id} {name}")),
            EventKind::ToolCallArgs { delta, .. } => ("args", delta.clone()),
            EventKind::ToolCallEnd { tool_use_id } => ("end", tool_use_id.clone()),
            _ => continue,
        };
        match out.last_mut() {
            Some((k, acc)) if k == kind && matches!(kind, "text" | "reasoning" | "args") => {
                acc.push_str(&piece)
            }
            _ => out.push((kind.to_owned(), piece)),
        }
    }
    for (k, v) in &mut out {
        if k == "args" {
            *v = serde_json::from_str::<Value>(v)
                .map(|j| j.to_string())
                .unwrap_or_default();
        }
    }
    assert!(!fake.requests().is_empty());
    (out, result)
}

#[tokio::test]
async fn non_streaming_sends_stream_false_and_emits_the_same_deltas() {
    let streamed = FakeMessages::start(vec![
        Reply::Sse(golden("thinking_tool_use.sse")),
        Reply::Sse(golden("final_text.sse")),
    ])
    .await;
    let (want, streamed_result) = delta_summary(&streamed, model(&streamed)).await;

    let whole = FakeMessages::start(vec![
        Reply::Json(serde_json::from_str(&golden("thinking_tool_use.json")).expect("json")),
        Reply::Json(serde_json::from_str(&golden("final_text.json")).expect("json")),
    ])
    .await;
    let (got, result) = delta_summary(&whole, model(&whole).stream(false)).await;
    assert!(want.len() >= 6, "{want:?}");
    assert_eq!(got, want, "the same deltas, streamed or not");
    assert_eq!(result.text, "It is sunny in Paris.");
    assert_eq!(result.text, streamed_result.text);
    let calls = |r: &tether::SessionResult| -> Vec<(String, String, Value)> {
        r.tool_uses
            .iter()
            .map(|u| (u.id.clone(), u.name.clone(), u.input.clone()))
            .collect()
    };
    assert_eq!(calls(&result), calls(&streamed_result));
    assert_eq!(result.usage.output_tokens, 89 + 12);
    assert_eq!(result.usage.cache_read_tokens, 100);

    let reqs = whole.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].header("accept"), Some("application/json"));
    let mut expected: Value = serde_json::from_str(&golden("second_request.json")).expect("golden json");
    expected["stream"] = json!(false);
    assert_eq!(reqs[1].body, expected, "the thinking block goes back unchanged");
}

#[tokio::test]
async fn redacted_thinking_is_sent_back_unchanged_streamed_or_not() {
    let sse = golden("redacted_thinking_tool_use.sse");
    let redacted = json!({"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpPkNRj2YfWXGmKDxH4mPnZ5sQ7vB5URj2ZtIuEMQ0T5hFF2WwhKhRGhL0bXbHJjm3H1xRvh5EYDzZpPqR1="});
    let as_json = json!({
        "id": "msg_03", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [redacted.clone(), {"type": "tool_use", "id": "toolu_02B", "name": "get_weather", "input": {"city": "Paris"}}],
        "stop_reason": "tool_use", "stop_sequence": null, "usage": {"input_tokens": 120, "output_tokens": 40}
    });
    for streaming in [true, false] {
        let first = if streaming {
            Reply::Sse(sse.clone())
        } else {
            Reply::Json(as_json.clone())
        };
        let last = if streaming {
            Reply::Sse(golden("final_text.sse"))
        } else {
            Reply::Json(serde_json::from_str(&golden("final_text.json")).expect("json"))
        };
        let fake = FakeMessages::start(vec![first, last]).await;
        let calls = Arc::new(AtomicU32::new(0));
        let result = Session::builder(LocalLoop::new(model(&fake).stream(streaming)))
            .handler(tools(calls.clone()))
            .run("Weather in Paris?")
            .await
            .expect("run");
        assert_eq!(result.text, "It is sunny in Paris.");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let second = &fake.requests()[1].body;
        assert_eq!(second["stream"], json!(streaming));
        let assistant = &second["messages"][1];
        assert_eq!(assistant["role"], "assistant");
        assert_eq!(
            assistant["content"],
            json!([redacted, {"type": "tool_use", "id": "toolu_02B", "name": "get_weather", "input": {"city": "Paris"}}]),
            "streaming={streaming}"
        );
        assert_eq!(second["messages"][2]["content"][0]["tool_use_id"], "toolu_02B");
    }
}
