//! `tether run` as a subprocess, exporting to a real OTLP receiver (HTTP or gRPC) — or to a
//! closed port.

mod bins;
mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{Receiver, one};
use serde_json::json;
use tether_testkit::openai::{FakeOpenAi, Reply};

async fn tether_run(
    fake: &FakeOpenAi,
    dir: &std::path::Path,
    env: &[(&str, String)],
) -> std::process::Output {
    let bin = tokio::task::spawn_blocking(bins::tether).await.expect("build");
    let mut cmd = tokio::process::Command::new(bin);
    bins::clean_env(&mut cmd);
    cmd.args(["run", "--base-url", &fake.url(), "--model", "m", "say hi"])
        .current_dir(dir)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    // Generous: the run must succeed; this only stops a hung process from hanging the suite.
    tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("tether run finished (nothing blocked it)")
        .expect("tether run ran")
}

/// `tether run` (answering "hi there", usage 3 in / 2 out) with `env`, exporting to `rx`: it
/// succeeds and `rx` gets its request span, with the model call's span under it, from service
/// `service`, whose context went to the model as `traceparent`.
async fn run_and_check_trace(rx: &Receiver, env: &[(&str, String)], service: &str) {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text("hi there").usage(3, 2));
    let dir = tempfile::tempdir().expect("tempdir");
    let out = tether_run(&fake, dir.path(), env).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // Exported at exit: the run's span and its model call.
    let spans = rx
        .wait_spans("the CLI run's spans", |s| {
            s.iter().any(|s| s.name == "invoke_agent") && s.iter().any(|s| s.name == "chat m")
        })
        .await;
    let run = one(&spans, "invoke_agent");
    let chat = one(&spans, "chat m");
    assert_eq!(chat.parent, run.span_id);
    assert_eq!(run.service.as_deref(), Some(service));
    assert_eq!(run.attr("gen_ai.provider.name"), Some(&json!("openai")));
    assert_eq!(chat.attr("gen_ai.usage.input_tokens"), Some(&json!(3)));
    assert_eq!(chat.attr("gen_ai.usage.output_tokens"), Some(&json!(2)));
    assert_eq!(
        fake.requests()[0].header("traceparent"),
        Some(format!("00-{}-{}-01", chat.trace_id, chat.span_id).as_str())
    );
    assert!(!stderr.contains("could not export"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tether_run_exports_its_trace_when_an_endpoint_is_set() {
    let rx = Receiver::start().await;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", rx.url.clone()),
        ("OTEL_SERVICE_NAME", "cli-test".into()),
    ];
    run_and_check_trace(&rx, &env, "cli-test").await;
}

/// `tether run` (answering "hi there") with `env`: it succeeds and says the answer; its stderr.
async fn run_ok(env: &[(&str, String)]) -> String {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text("hi there"));
    let dir = tempfile::tempdir().expect("tempdir");
    let out = tether_run(&fake, dir.path(), env).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "the run failed: {stdout}\n{stderr}");
    assert!(stdout.contains("hi there"), "{stdout}");
    stderr
}

/// [`run_ok`], warning about export exactly once, naming `named`; the run's stderr.
async fn run_with_one_export_warning(env: &[(&str, String)], named: &str) -> String {
    let stderr = run_ok(env).await;
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("could not export"))
        .collect();
    assert_eq!(warnings.len(), 1, "expected one export warning, got: {stderr}");
    assert!(warnings[0].contains(named), "{stderr}");
    stderr
}

/// [`run_ok`] with `env`, which export cannot start with: stderr says export is off.
async fn run_with_export_off(env: &[(&str, String)]) -> String {
    let stderr = run_ok(env).await;
    assert!(stderr.contains("OpenTelemetry export is off"), "{stderr}");
    stderr
}

/// `tether run` exporting with `protocol` to a closed port: it succeeds with one warning.
async fn closed_port_costs_one_warning(protocol: &str) {
    let port = bins::closed_port();
    let stderr = run_with_one_export_warning(
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://127.0.0.1:{port}")),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol.into()),
            // Export during the run as well as at exit: every attempt fails.
            ("OTEL_BSP_SCHEDULE_DELAY", "10".into()),
            ("OTEL_METRIC_EXPORT_INTERVAL", "10".into()),
        ],
        &format!("127.0.0.1:{port}"),
    )
    .await;
    let other: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.contains("could not export") && !l.trim().is_empty())
        .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.to_lowercase().contains("opentelemetry"))
        .collect();
    assert!(other.is_empty(), "more than the one warning: {stderr}");
}

/// A collector that accepts connections and never answers (nor reads): `tether run` with
/// `protocol` and a 300 ms export timeout still answers and exits, with one warning naming the
/// collector. The shutdown's own bound (5 s) keeps a hung final export from holding the exit.
async fn hung_collector_costs_one_warning(protocol: &str) {
    let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = hung.local_addr().expect("addr");
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = hung.accept().await {
            conns.push(c);
        }
    });
    run_with_one_export_warning(
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{addr}")),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol.into()),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "300".into()),
            ("OTEL_BSP_SCHEDULE_DELAY", "10".into()),
        ],
        &addr.to_string(),
    )
    .await;
    held.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_costs_one_warning() {
    hung_collector_costs_one_warning("http/protobuf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_collector_that_never_answers_costs_one_warning() {
    hung_collector_costs_one_warning("grpc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_collector_port_costs_one_warning_and_nothing_else() {
    closed_port_costs_one_warning("http/protobuf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_grpc_collector_port_costs_one_warning_and_nothing_else() {
    closed_port_costs_one_warning("grpc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tether_run_exports_over_grpc_when_the_protocol_says_so() {
    let rx = Receiver::start_grpc().await;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", rx.url.clone()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".into()),
        ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=s3cret".into()),
    ];
    run_and_check_trace(&rx, &env, "tether").await;
    // The metrics went the same way, at exit; every export carried the header as metadata.
    rx.wait_points("the CLI run's metrics over gRPC", |p| {
        p.iter().any(|p| p.name == "gen_ai.client.token.usage")
    })
    .await;
    let keys = rx.api_keys();
    assert!(!keys.is_empty());
    assert!(keys.iter().all(|k| k.as_deref() == Some("s3cret")), "{keys:?}");
}

/// OTLP/HTTP from the environment as the exporter specification says: the traces endpoint used
/// as it is (no `/v1/traces` added), the traces' own header list winning over the general one,
/// its values percent-decoded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tether_run_takes_the_traces_endpoint_and_headers_from_the_environment() {
    let rx = Receiver::start().await;
    let env = [
        (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            format!("{}/v1/traces", rx.url),
        ),
        ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=general".into()),
        (
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
            " x-api-key = s3%20cret%2C1 , other=x".into(),
        ),
        ("OTEL_METRICS_EXPORTER", "none".into()),
    ];
    run_and_check_trace(&rx, &env, "tether").await;
    let keys = rx.api_keys();
    assert!(!keys.is_empty());
    assert!(keys.iter().all(|k| k.as_deref() == Some("s3 cret,1")), "{keys:?}");
}

/// A header list that is not `key=value` is named (not its value: it may be a secret), and the
/// run goes on without export.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_header_list_is_named_and_the_run_goes_on() {
    let stderr = run_with_export_off(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318".into()),
        ("OTEL_EXPORTER_OTLP_HEADERS", "authorization-Bearer-s3cret".into()),
    ])
    .await;
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_HEADERS: entry 1 is not key=value"),
        "{stderr}"
    );
    assert!(!stderr.contains("s3cret"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_not_built_in_is_named_and_the_run_goes_on() {
    let stderr = run_with_export_off(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318".into()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json".into()),
    ])
    .await;
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_PROTOCOL=http/json is not supported") && stderr.contains("grpc"),
        "{stderr}"
    );
}

/// Each signal takes its own endpoint and CA from the environment: traces to a plain gRPC
/// collector, metrics to one on `https://` whose private CA `OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE`
/// names (the TLS of one signal is not the other's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_signal_takes_its_endpoint_and_ca_from_the_environment() {
    let traces = Receiver::start_grpc().await;
    let metrics = Receiver::start_grpc_with(tether_testkit::Serve::tls()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = dir.path().join("collector-ca.pem");
    std::fs::write(&ca, metrics.ca_pem()).expect("write the CA");
    let env = [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".to_owned()),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", traces.url.clone()),
        ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", metrics.url.clone()),
        ("OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE", ca.display().to_string()),
    ];
    run_and_check_trace(&traces, &env, "tether").await;
    metrics
        .wait_points("the CLI run's metrics over gRPC with TLS", |p| {
            p.iter().any(|p| p.name == "gen_ai.client.token.usage")
        })
        .await;
    assert!(traces.points().is_empty(), "metrics went to the traces endpoint");
    assert!(metrics.spans().is_empty(), "spans went to the metrics endpoint");
}

/// A certificate file that does not exist is named in a warning, export is off, and the run
/// goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_certificate_file_is_named_and_the_run_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("no-such-ca.pem");
    let stderr = run_with_export_off(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://127.0.0.1:4318".into()),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", missing.display().to_string()),
    ])
    .await;
    assert!(
        stderr.contains(&format!("OTEL_EXPORTER_OTLP_CERTIFICATE={}", missing.display())),
        "{stderr}"
    );
}

/// Metrics to their own endpoint, which is down: the one warning names that endpoint (not the
/// traces one), and the traces still arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_metrics_endpoint_is_the_one_named() {
    let rx = Receiver::start().await;
    let port = bins::closed_port();
    let metrics = format!("http://127.0.0.1:{port}/v1/metrics");
    let stderr = run_with_one_export_warning(
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", rx.url.clone()),
            ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", metrics.clone()),
        ],
        &metrics,
    )
    .await;
    assert!(stderr.contains("could not export metrics"), "{stderr}");
    rx.wait_spans("the run's spans", |s| s.iter().any(|s| s.name == "invoke_agent"))
        .await;
}
