//! The local loop traced end to end: the testkit's fake OpenAI server, a real OTLP/HTTP receiver
//! on 127.0.0.1 decoding the official protobuf messages.

mod common;

use std::time::Duration;

use common::{CLIENT, CONTENT, ERROR, INTERNAL, Receiver, Span, named, one};
use serde_json::{Value, json};
use tether::{CancellationToken, EventKind, Session, ToolSet, ToolSpec, local::LocalLoop};
use tether_openai::OpenAiModel;
use tether_otel::{Telemetry, Tracer};
use tether_testkit::openai::{FakeOpenAi, Reply};

fn telemetry(rx: &Receiver, capture: bool) -> (Telemetry, Tracer) {
    let t = common::telemetry(rx, capture);
    let tracer = t.tracer().agent_name("helper").with_dispatch(t.dispatch());
    (t, tracer)
}

fn model(fake: &FakeOpenAi) -> OpenAiModel {
    OpenAiModel::builder(fake.url())
        .model("gpt-test")
        .build()
        .expect("model")
}

/// Exports what is batched (blocking until the export is done, off the async workers).
async fn flush(t: &Telemetry) {
    tokio::task::block_in_place(|| t.flush());
}

fn keys(s: &Span) -> Vec<&str> {
    s.keys()
}

fn assert_no_content(spans: &[Span]) {
    for s in spans {
        for k in CONTENT {
            assert!(s.attr(k).is_none(), "{k} on {} without opting in: {s:#?}", s.name);
        }
    }
}

async fn two_tool_run(capture: bool) -> (Vec<Span>, tether::SessionResult, FakeOpenAi, Receiver, Telemetry) {
    let rx = Receiver::start().await;
    let (t, tracer) = telemetry(&rx, capture);
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[("c1", "ok_tool", "{\"x\":1}"), ("c2", "bad_tool", "{}")]).usage(10, 5));
    fake.push(Reply::text("done").usage(20, 7));
    let result = Session::builder(LocalLoop::new(model(&fake)).system_prompt("be brief"))
        .handler(common::tools())
        .observer(tracer.observer())
        .run("use the tools")
        .await
        .expect("run");
    assert_eq!(result.text, "done");
    flush(&t).await;
    let spans = rx.wait_spans("the run's five spans", |s| s.len() >= 5).await;
    (spans, result, fake, rx, t)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_run_is_one_tree_of_genai_spans() {
    let (spans, result, fake, rx, t) = two_tool_run(false).await;
    assert_eq!(spans.len(), 5, "{spans:#?}");
    let run = one(&spans, "invoke_agent helper");
    let chats = named(&spans, "chat gpt-test");
    assert_eq!(chats.len(), 2, "{spans:#?}");
    let ok = one(&spans, "execute_tool ok_tool");
    let bad = one(&spans, "execute_tool bad_tool");

    // One trace; the request span is the root, everything else its child.
    assert!(spans.iter().all(|s| s.trace_id == run.trace_id));
    assert_eq!(run.parent, "");
    for s in chats.iter().copied().chain([ok, bad]) {
        assert_eq!(s.parent, run.span_id, "{} is not a child of the run", s.name);
    }
    assert_eq!(run.service.as_deref(), Some("tether"));

    // Kinds: the local loop is in-process; model calls go over HTTP; tools run here.
    assert_eq!(run.kind, INTERNAL);
    assert!(chats.iter().all(|c| c.kind == CLIENT));
    assert_eq!(ok.kind, INTERNAL);
    assert_eq!(bad.kind, INTERNAL);

    // Exactly the conventions' attributes, with the values of the run.
    let sid = json!(result.session_id);
    assert_eq!(
        keys(run),
        vec![
            "gen_ai.agent.name",
            "gen_ai.conversation.id",
            "gen_ai.operation.name",
            "gen_ai.provider.name",
            "gen_ai.usage.input_tokens",
            "gen_ai.usage.output_tokens",
        ]
    );
    assert_eq!(run.attr("gen_ai.operation.name"), Some(&json!("invoke_agent")));
    assert_eq!(run.attr("gen_ai.provider.name"), Some(&json!("openai")));
    assert_eq!(run.attr("gen_ai.agent.name"), Some(&json!("helper")));
    assert_eq!(run.attr("gen_ai.conversation.id"), Some(&sid));
    assert_eq!(run.status, 0);

    let mut chats: Vec<&Span> = chats;
    chats.sort_by_key(|c| c.start);
    let port = json!(i64::from(fake.addr().port()));
    for (i, (c, (fin, input, output))) in chats
        .iter()
        .zip([("tool_calls", 10, 5), ("stop", 20, 7)])
        .enumerate()
    {
        assert_eq!(
            keys(c),
            vec![
                "gen_ai.conversation.id",
                "gen_ai.operation.name",
                "gen_ai.provider.name",
                "gen_ai.request.model",
                "gen_ai.response.finish_reasons",
                "gen_ai.response.id",
                "gen_ai.response.model",
                "gen_ai.usage.input_tokens",
                "gen_ai.usage.output_tokens",
                "server.address",
                "server.port",
            ],
            "{c:#?}"
        );
        assert_eq!(c.attr("gen_ai.operation.name"), Some(&json!("chat")));
        assert_eq!(c.attr("gen_ai.provider.name"), Some(&json!("openai")));
        assert_eq!(c.attr("gen_ai.request.model"), Some(&json!("gpt-test")));
        assert_eq!(c.attr("gen_ai.response.model"), Some(&json!("gpt-test")));
        assert_eq!(
            c.attr("gen_ai.response.id"),
            Some(&json!(format!("chatcmpl-fake-{}", i + 1)))
        );
        assert_eq!(c.attr("gen_ai.response.finish_reasons"), Some(&json!([fin])));
        assert_eq!(c.attr("gen_ai.usage.input_tokens"), Some(&json!(input)));
        assert_eq!(c.attr("gen_ai.usage.output_tokens"), Some(&json!(output)));
        assert_eq!(c.attr("gen_ai.conversation.id"), Some(&sid));
        assert_eq!(c.attr("server.address"), Some(&json!("127.0.0.1")));
        assert_eq!(c.attr("server.port"), Some(&port));
        assert_eq!(c.status, 0);
    }

    for (s, id, name, desc) in [
        (ok, "c1", "ok_tool", "Always works"),
        (bad, "c2", "bad_tool", "Always fails"),
    ] {
        assert_eq!(s.attr("gen_ai.operation.name"), Some(&json!("execute_tool")));
        assert_eq!(s.attr("gen_ai.tool.name"), Some(&json!(name)));
        assert_eq!(s.attr("gen_ai.tool.call.id"), Some(&json!(id)));
        assert_eq!(s.attr("gen_ai.tool.type"), Some(&json!("function")));
        assert_eq!(s.attr("gen_ai.tool.description"), Some(&json!(desc)));
    }
    assert_eq!(
        keys(ok),
        vec![
            "gen_ai.operation.name",
            "gen_ai.tool.call.id",
            "gen_ai.tool.description",
            "gen_ai.tool.name",
            "gen_ai.tool.type",
        ]
    );
    assert_eq!(ok.status, 0);
    assert_eq!(bad.attr("error.type"), Some(&json!("tool_error")));
    assert_eq!(bad.status, ERROR);
    assert_eq!(keys(bad).len(), 6);

    // In time order: model call, its tools, the next model call, all inside the run.
    assert!(chats[0].end <= ok.start && chats[0].end <= bad.start);
    assert!(ok.end <= chats[1].start && bad.end <= chats[1].start);
    assert!(spans.iter().all(|s| s.start >= run.start && s.end <= run.end));

    // Content is opt-in.
    assert_no_content(&spans);

    // Token usage is the session's: on the run, summed over the model calls, and in the metric.
    assert_eq!(
        run.attr("gen_ai.usage.input_tokens"),
        Some(&json!(result.usage.input_tokens))
    );
    assert_eq!(
        run.attr("gen_ai.usage.output_tokens"),
        Some(&json!(result.usage.output_tokens))
    );
    let sum = |k: &str| -> u64 {
        chats
            .iter()
            .map(|c| c.attr(k).and_then(Value::as_u64).unwrap_or(0))
            .sum()
    };
    assert_eq!(sum("gen_ai.usage.input_tokens"), result.usage.input_tokens);
    assert_eq!(sum("gen_ai.usage.output_tokens"), result.usage.output_tokens);
    let points = rx
        .wait_points("the token usage metric", |p| {
            p.iter().any(|p| p.name == "gen_ai.client.token.usage")
                && p.iter().any(|p| p.name == "gen_ai.client.operation.duration")
        })
        .await;
    let tokens = |ty: &str| -> (u64, f64) {
        points
            .iter()
            .filter(|p| {
                p.name == "gen_ai.client.token.usage" && p.attrs.get("gen_ai.token.type") == Some(&json!(ty))
            })
            .fold((0, 0.0), |(c, s), p| (c + p.count, s + p.sum))
    };
    assert_eq!(tokens("input"), (2, result.usage.input_tokens as f64));
    assert_eq!(tokens("output"), (2, result.usage.output_tokens as f64));
    let tp = points
        .iter()
        .find(|p| p.name == "gen_ai.client.token.usage")
        .expect("token point");
    assert_eq!(tp.attrs.get("gen_ai.provider.name"), Some(&json!("openai")));
    assert_eq!(tp.attrs.get("gen_ai.operation.name"), Some(&json!("chat")));
    assert_eq!(tp.attrs.get("gen_ai.request.model"), Some(&json!("gpt-test")));
    assert_eq!(tp.bounds.first(), Some(&1.0));
    let durations: Vec<&str> = points
        .iter()
        .filter(|p| p.name == "gen_ai.client.operation.duration")
        .filter_map(|p| p.attrs.get("gen_ai.operation.name").and_then(Value::as_str))
        .collect();
    assert!(
        durations.contains(&"chat") && durations.contains(&"invoke_agent"),
        "{durations:?}"
    );

    // Each model request carried its chat span's context.
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    for (r, c) in reqs.iter().zip(&chats) {
        assert_eq!(
            r.header("traceparent"),
            Some(format!("00-{}-{}-01", c.trace_id, c.span_id).as_str()),
            "the model request does not carry its chat span"
        );
    }
    drop(t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_is_recorded_only_when_opted_in() {
    let (spans, _result, _fake, _rx, t) = two_tool_run(true).await;
    let mut chats = named(&spans, "chat gpt-test");
    chats.sort_by_key(|c| c.start);
    let input: Value = serde_json::from_str(
        chats[0]
            .attr("gen_ai.input.messages")
            .and_then(Value::as_str)
            .expect("input"),
    )
    .expect("json");
    assert_eq!(
        input,
        json!([
            {"role": "system", "parts": [{"type": "text", "content": "be brief"}]},
            {"role": "user", "parts": [{"type": "text", "content": "use the tools"}]}
        ])
    );
    let output: Value = serde_json::from_str(
        chats[0]
            .attr("gen_ai.output.messages")
            .and_then(Value::as_str)
            .expect("output"),
    )
    .expect("json");
    assert_eq!(output[0]["role"], "assistant");
    assert_eq!(output[0]["finish_reason"], "tool_calls");
    assert_eq!(output[0]["parts"][0]["type"], "tool_call");
    assert_eq!(output[0]["parts"][0]["arguments"], json!({"x": 1}));
    let second: Value = serde_json::from_str(
        chats[1]
            .attr("gen_ai.input.messages")
            .and_then(Value::as_str)
            .expect("input"),
    )
    .expect("json");
    assert_eq!(second.as_array().map(Vec::len), Some(5), "{second}");
    assert_eq!(second[3]["parts"][0]["type"], "tool_call_response");

    let ok = one(&spans, "execute_tool ok_tool");
    assert_eq!(ok.attr("gen_ai.tool.call.arguments"), Some(&json!("{\"x\":1}")));
    assert_eq!(ok.attr("gen_ai.tool.call.result"), Some(&json!("fine")));
    let bad = one(&spans, "execute_tool bad_tool");
    assert_eq!(bad.attr("gen_ai.tool.call.arguments"), Some(&json!("{}")));
    assert!(
        bad.attr("gen_ai.tool.call.result").is_none(),
        "a failed tool has no result"
    );
    drop(t);
}

/// Waits for the failed run's two spans and checks both end with `error.type`.
async fn assert_failed(rx: &Receiver, t: &Telemetry, error_type: &str) {
    flush(t).await;
    let spans = rx
        .wait_spans("the failed run's spans", |s| {
            s.iter().any(|s| s.name == "invoke_agent helper") && s.iter().any(|s| s.name == "chat gpt-test")
        })
        .await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    for s in &spans {
        assert_eq!(s.attr("error.type"), Some(&json!(error_type)), "{s:#?}");
        assert_eq!(s.status, ERROR, "{s:#?}");
        assert!(!s.status_message.is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_times_out_ends_its_spans_with_error_type() {
    let rx = Receiver::start().await;
    let (t, tracer) = telemetry(&rx, false);
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text("never ends").stall_after(1));
    let err = Session::builder(LocalLoop::new(model(&fake)))
        .observer(tracer.observer())
        // The timeout under test: short on purpose.
        .timeout(Duration::from_millis(500))
        .run("hi")
        .await
        .expect_err("times out");
    assert!(matches!(err, tether::Error::Timeout(_)), "{err:?}");
    assert_failed(&rx, &t, "timeout").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_run_ends_its_spans_with_error_type() {
    let rx = Receiver::start().await;
    let (t, tracer) = telemetry(&rx, false);
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text("hello there").chunk_chars(2).stall_after(2));
    let mut session = Session::builder(LocalLoop::new(model(&fake)))
        .observer(tracer.observer())
        .open()
        .await
        .expect("open");
    let mut sub = session.sink().subscribe(64).await;
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    // Cancel once the model is streaming.
    tokio::spawn(async move {
        while let Some(e) = sub.recv().await {
            if matches!(e.kind, EventKind::TextDelta { .. }) {
                c.cancel();
                break;
            }
        }
    });
    let err = session
        .send_cancellable("hi", cancel)
        .await
        .expect_err("cancelled");
    assert!(matches!(err, tether::Error::Cancelled), "{err:?}");
    assert_failed(&rx, &t, "cancelled").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_model_answers_401_ends_its_spans_with_error_type() {
    let rx = Receiver::start().await;
    let (t, tracer) = telemetry(&rx, false);
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::error(401, "Incorrect API key provided", "invalid_api_key"));
    let err = Session::builder(LocalLoop::new(model(&fake)))
        .observer(tracer.observer())
        .run("hi")
        .await
        .expect_err("401");
    assert_eq!(err.status(), Some(401), "{err:?}");
    assert_failed(&rx, &t, "401").await;
    // The chat's duration point carries the error too (and reported no usage: no token point).
    let is_chat = |p: &&common::Point| {
        p.name == "gen_ai.client.operation.duration"
            && p.attrs.get("gen_ai.operation.name") == Some(&json!("chat"))
    };
    let points = rx
        .wait_points("the failed chat's duration", |p| p.iter().any(|p| is_chat(&p)))
        .await;
    let chat = points.iter().find(is_chat).expect("the chat's duration point");
    assert_eq!(chat.attrs.get("error.type"), Some(&json!("401")), "{chat:?}");
    assert!(
        !points.iter().any(|p| p.name == "gen_ai.client.token.usage"),
        "{points:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_dropped_mid_run_ends_its_spans_with_error_type() {
    let rx = Receiver::start().await;
    let (t, tracer) = telemetry(&rx, false);
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text("hello there").chunk_chars(2).stall_after(2));
    let mut session = Session::builder(LocalLoop::new(model(&fake)))
        .observer(tracer.observer())
        .open()
        .await
        .expect("open");
    let mut sub = session.sink().subscribe(64).await;
    // Drive the request until the model streams, then drop it (and the session) mid-flight.
    common::until_streaming(session.send("hi"), &mut sub).await;
    drop(session);
    assert_failed(&rx, &t, "interrupted").await;
}

#[test]
fn off_without_configuration() {
    // No endpoint in this test's environment: nothing is set up.
    if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_none()
        && std::env::var_os("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none()
    {
        assert!(Telemetry::from_env().expect("from_env").is_none());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_model_call_is_one_span_with_a_retry_event() {
    let rx = Receiver::start().await;
    let (t, tracer) = telemetry(&rx, false);
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::server_error(503));
    fake.push(Reply::text("ok").usage(2, 1));
    let sleeper = tether::RecordingSleeper::default();
    let retry = tether::RetryPolicy::default()
        .with_jitter(false)
        .with_sleeper(sleeper.clone());
    let result = Session::builder(LocalLoop::new(model(&fake)).retry(retry))
        .observer(tracer.observer())
        .run("hi")
        .await
        .expect("run");
    assert_eq!(result.text, "ok");
    flush(&t).await;
    let spans = rx.wait_spans("the run's spans", |s| s.len() >= 2).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let chat = one(&spans, "chat gpt-test");
    assert_eq!(chat.status, 0);
    let retries: Vec<_> = chat.events.iter().filter(|(n, _)| n == "tether.retry").collect();
    assert_eq!(retries.len(), 1, "{chat:#?}");
    assert_eq!(retries[0].1.get("tether.retry.attempt"), Some(&json!(1)));
    assert_eq!(retries[0].1.get("error.type"), Some(&json!("503")));
    assert_eq!(fake.requests().len(), 2, "two attempts, one span");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_tool_call_carries_the_mcp_attributes_and_hands_its_context_to_the_handler() {
    let rx = Receiver::start().await;
    let (t, tracer) = telemetry(&rx, false);
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[("c9", "docs__search", "{\"q\":\"x\"}")]));
    fake.push(Reply::text("found"));
    // An MCP tool as a tool source marks it (the convention in the crate README).
    let spec = ToolSpec::new("docs__search", "Search the docs", json!({"type": "object"}))
        .with_meta("mcp.server", "docs")
        .with_meta("mcp.tool", "search")
        .with_meta("mcp.transport", "stdio")
        .with_meta("mcp.protocol.version", "2025-06-18");
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
    let s = seen.clone();
    let tools = ToolSet::new().tool_with_info(spec, move |_call, info| {
        // What an MCP client puts in `params._meta.traceparent`.
        *s.lock().unwrap() = info.traceparent.clone();
        async { Ok::<_, String>("a result".to_owned()) }
    });
    Session::builder(LocalLoop::new(model(&fake)))
        .handler(tools)
        .observer(tracer.observer())
        .run("search")
        .await
        .expect("run");
    flush(&t).await;
    let spans = rx.wait_spans("the run's spans", |s| s.len() >= 4).await;
    let tool = one(&spans, "execute_tool docs__search");
    // The fake model reported no usage: the run claims none (not 0).
    let run = one(&spans, "invoke_agent helper");
    assert!(run.attr("gen_ai.usage.input_tokens").is_none(), "{run:#?}");
    assert!(run.attr("gen_ai.usage.output_tokens").is_none(), "{run:#?}");
    assert_eq!(tool.attr("mcp.method.name"), Some(&json!("tools/call")));
    assert_eq!(tool.attr("mcp.server.name"), Some(&json!("docs")));
    assert_eq!(tool.attr("mcp.protocol.version"), Some(&json!("2025-06-18")));
    assert_eq!(tool.attr("network.transport"), Some(&json!("pipe")));
    assert_eq!(tool.attr("gen_ai.operation.name"), Some(&json!("execute_tool")));
    assert_eq!(
        seen.lock().unwrap().as_deref(),
        Some(format!("00-{}-{}-01", tool.trace_id, tool.span_id).as_str()),
        "the handler got the tool span's context"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untraced_session_hands_no_context_and_builds_no_marks() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[("c1", "probe", "{}")]));
    fake.push(Reply::text("done"));
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    let tools = ToolSet::new().tool_with_info(
        ToolSpec::new("probe", "", json!({"type": "object"})),
        move |_call, info| {
            s.lock().unwrap().push(info.traceparent.clone());
            async { Ok::<_, String>("ok".to_owned()) }
        },
    );
    let result = Session::builder(LocalLoop::new(model(&fake)))
        .handler(tools)
        .run("go")
        .await
        .expect("run");
    assert_eq!(*seen.lock().unwrap(), vec![None]);
    assert!(fake.requests().iter().all(|r| r.header("traceparent").is_none()));
    // Marks never reach the record.
    assert!(
        result
            .events
            .iter()
            .all(|e| !e.raw_type.starts_with("tether.run_")
                && e.raw_type != "tether.tool_start"
                && e.raw_type != "local.model_call")
    );
}
