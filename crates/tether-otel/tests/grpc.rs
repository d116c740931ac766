//! OTLP/gRPC export ([`OtlpProtocol::Grpc`]) to a real gRPC collector endpoint (tonic serving the
//! collector's own service definitions): the same spans and metrics as over OTLP/HTTP, with the
//! configured headers sent as gRPC metadata.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{Receiver, Span};
use serde_json::Value;
use tether::{Session, local::LocalLoop};
use tether_otel::{ExportConfig, OtlpProtocol, Telemetry};
use tether_testkit::openai::{FakeOpenAi, Reply};

/// A span as compared: name, kind, its parent's name, attribute names, status.
type Shape = (String, i32, String, Vec<String>, i32);

fn shapes(spans: &[Span]) -> Vec<Shape> {
    let name_of = |id: &str| {
        spans
            .iter()
            .find(|s| s.span_id == id)
            .map(|s| s.name.clone())
            .unwrap_or_default()
    };
    let mut out: Vec<Shape> = spans
        .iter()
        .map(|s| {
            (
                s.name.clone(),
                s.kind,
                name_of(&s.parent),
                s.keys().into_iter().map(str::to_owned).collect(),
                s.status,
            )
        })
        .collect();
    out.sort();
    out
}

/// One request with two tool calls (one failing) and a text answer, exported with `protocol` to
/// `rx` with an `x-api-key` header; the spans and the metric points' names and attributes.
async fn export(
    rx: &Receiver,
    protocol: OtlpProtocol,
) -> (Vec<Span>, Vec<(String, BTreeMap<String, Value>)>) {
    let mut config = ExportConfig::new(&rx.url)
        .protocol(protocol)
        .batch_delay(Duration::from_millis(50))
        .metrics_interval(Duration::from_secs(3600));
    config.headers.push(("X-Api-Key".into(), "s3cret".into()));
    let t = Telemetry::new(config).expect("telemetry");
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[("c1", "ok_tool", "{\"x\":1}"), ("c2", "bad_tool", "{}")]).usage(10, 5));
    fake.push(Reply::text("done").usage(20, 7));
    let model = tether_openai::OpenAiModel::builder(fake.url())
        .model("gpt-test")
        .build()
        .expect("model");
    let tracer = t.tracer().agent_name("helper");
    let mut session = Session::builder(LocalLoop::new(model))
        .handler(common::tools())
        .observer(tracer.observer())
        .open()
        .await
        .expect("open");
    assert_eq!(session.send("use the tools").await.expect("run").text, "done");
    drop(session);
    let spans = rx.wait_spans("the request's spans", |s| s.len() >= 5).await;
    // Metrics are read at shutdown (the interval is never reached).
    tokio::task::block_in_place(|| t.shutdown());
    let points = rx
        .wait_points("the metrics", |p| {
            p.iter().any(|p| p.name == "gen_ai.client.token.usage")
                && p.iter().any(|p| p.name == "gen_ai.client.operation.duration")
        })
        .await;
    let mut points: Vec<_> = points.into_iter().map(|p| (p.name, p.attrs)).collect();
    for (_, a) in &mut points {
        a.remove("server.port");
    }
    points.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
    (spans, points)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_export_carries_what_http_export_carries() {
    let http = Receiver::start().await;
    let grpc = Receiver::start_grpc().await;
    let (h_spans, h_points) = export(&http, OtlpProtocol::HttpProtobuf).await;
    let (g_spans, g_points) = export(&grpc, OtlpProtocol::Grpc).await;

    // The tree: the request, two chats and two tools under it.
    assert_eq!(g_spans.len(), 5, "{g_spans:#?}");
    let run = common::one(&g_spans, "invoke_agent helper");
    assert_eq!(g_spans.iter().filter(|s| s.parent == run.span_id).count(), 4);
    assert!(g_spans.iter().all(|s| s.trace_id == run.trace_id));
    assert_eq!(shapes(&g_spans), shapes(&h_spans));
    assert_eq!(g_points, h_points);

    // The header went as metadata on every gRPC export, as a header on every HTTP one.
    for rx in [&http, &grpc] {
        let keys = rx.api_keys();
        assert!(!keys.is_empty());
        assert!(keys.iter().all(|k| k.as_deref() == Some("s3cret")), "{keys:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_grpc_cannot_carry_is_a_configuration_error() {
    // A name with a space; a value with a line break (a header injection through metadata).
    for (k, v, named) in [
        ("bad key", "v", "\"bad key\""),
        ("x-api-key", "s3cret\r\nx-admin: 1", "\"x-api-key\""),
    ] {
        let mut config = ExportConfig::new("http://127.0.0.1:4317").protocol(OtlpProtocol::Grpc);
        config.headers.push((k.into(), v.into()));
        let e = Telemetry::new(config).expect_err("a header gRPC cannot carry");
        assert!(
            matches!(
                e,
                tether::Error::Config {
                    kind: tether::ConfigKind::Invalid,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains(named), "{e}");
    }
}
