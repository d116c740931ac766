//! An OTLP receiver on 127.0.0.1, over HTTP or gRPC (the collector's own service definitions,
//! served by tonic), decoding the official `opentelemetry-proto` messages, and helpers to read
//! what it got.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::metric;
use prost::Message;
use serde_json::{Value, json};
use tokio::sync::watch;

/// A span as received, ids in hex.
#[derive(Debug, Clone)]
pub struct Span {
    pub trace_id: String,
    pub span_id: String,
    pub parent: String,
    pub name: String,
    /// 1 internal, 2 server, 3 client.
    pub kind: i32,
    pub attrs: BTreeMap<String, Value>,
    /// 0 unset, 1 ok, 2 error.
    pub status: i32,
    pub status_message: String,
    pub events: Vec<(String, BTreeMap<String, Value>)>,
    pub links: Vec<(String, String, BTreeMap<String, Value>)>,
    pub start: u64,
    pub end: u64,
    pub service: Option<String>,
}

impl Span {
    pub fn attr(&self, k: &str) -> Option<&Value> {
        self.attrs.get(k)
    }
    pub fn keys(&self) -> Vec<&str> {
        self.attrs.keys().map(String::as_str).collect()
    }
}

/// One histogram data point.
#[derive(Debug, Clone)]
pub struct Point {
    pub name: String,
    pub attrs: BTreeMap<String, Value>,
    pub count: u64,
    pub sum: f64,
    pub bounds: Vec<f64>,
}

#[derive(Default)]
struct Got {
    spans: Vec<Span>,
    points: Vec<Point>,
    requests: u64,
    /// The `x-api-key` header (HTTP) or metadata (gRPC) of each export request.
    keys: Vec<Option<String>>,
}

/// The receiver.
pub struct Receiver {
    pub url: String,
    got: Arc<Mutex<Got>>,
    tick: watch::Receiver<u64>,
    /// The server of a receiver started with [`Receiver::start_with`] or
    /// [`Receiver::start_grpc_with`] (its CA, what each request arrived over); stops on drop.
    pub served: Option<tether_testkit::server::Served>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn any(v: &AnyValue) -> Value {
    match &v.value {
        Some(any_value::Value::StringValue(s)) => json!(s),
        Some(any_value::Value::BoolValue(b)) => json!(b),
        Some(any_value::Value::IntValue(i)) => json!(i),
        Some(any_value::Value::DoubleValue(d)) => json!(d),
        Some(any_value::Value::ArrayValue(a)) => Value::Array(a.values.iter().map(any).collect()),
        Some(other) => json!(format!("{other:?}")),
        None => Value::Null,
    }
}

fn attrs(kv: &[KeyValue]) -> BTreeMap<String, Value> {
    kv.iter()
        .map(|k| (k.key.clone(), k.value.as_ref().map(any).unwrap_or(Value::Null)))
        .collect()
}

type Shared = (Arc<Mutex<Got>>, Arc<watch::Sender<u64>>);

fn api_key(h: &axum::http::HeaderMap) -> Option<String> {
    h.get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

async fn traces(State(shared): State<Shared>, headers: axum::http::HeaderMap, body: Bytes) -> &'static [u8] {
    if let Ok(req) = ExportTraceServiceRequest::decode(body) {
        record_traces(&shared, req, api_key(&headers));
    }
    b""
}

async fn metrics(State(shared): State<Shared>, headers: axum::http::HeaderMap, body: Bytes) -> &'static [u8] {
    if let Ok(req) = ExportMetricsServiceRequest::decode(body) {
        record_metrics(&shared, req, api_key(&headers));
    }
    b""
}

fn record_traces((got, tx): &Shared, req: ExportTraceServiceRequest, key: Option<String>) {
    {
        let mut g = got.lock().unwrap();
        g.requests += 1;
        g.keys.push(key);
        for rs in req.resource_spans {
            let service = rs.resource.as_ref().and_then(|r| {
                attrs(&r.attributes)
                    .get("service.name")
                    .and_then(|v| v.as_str().map(str::to_owned))
            });
            for ss in rs.scope_spans {
                for s in ss.spans {
                    g.spans.push(Span {
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent: hex(&s.parent_span_id),
                        name: s.name.clone(),
                        kind: s.kind,
                        attrs: attrs(&s.attributes),
                        status: s.status.as_ref().map(|x| x.code).unwrap_or(0),
                        status_message: s.status.as_ref().map(|x| x.message.clone()).unwrap_or_default(),
                        events: s
                            .events
                            .iter()
                            .map(|e| (e.name.clone(), attrs(&e.attributes)))
                            .collect(),
                        links: s
                            .links
                            .iter()
                            .map(|l| (hex(&l.trace_id), hex(&l.span_id), attrs(&l.attributes)))
                            .collect(),
                        start: s.start_time_unix_nano,
                        end: s.end_time_unix_nano,
                        service: service.clone(),
                    });
                }
            }
        }
    }
    tx.send_modify(|n| *n += 1);
}

fn record_metrics((got, tx): &Shared, req: ExportMetricsServiceRequest, key: Option<String>) {
    {
        let mut g = got.lock().unwrap();
        g.requests += 1;
        g.keys.push(key);
        for rm in req.resource_metrics {
            for sm in rm.scope_metrics {
                for m in sm.metrics {
                    if let Some(metric::Data::Histogram(h)) = &m.data {
                        for p in &h.data_points {
                            g.points.push(Point {
                                name: m.name.clone(),
                                attrs: attrs(&p.attributes),
                                count: p.count,
                                sum: p.sum.unwrap_or(0.0),
                                bounds: p.explicit_bounds.clone(),
                            });
                        }
                    }
                }
            }
        }
    }
    tx.send_modify(|n| *n += 1);
}

/// The collector's gRPC services, recording what they receive.
#[derive(Clone)]
struct Grpc(Shared);

fn grpc_key<T>(r: &tonic::Request<T>) -> Option<String> {
    r.metadata()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

#[tonic::async_trait]
impl TraceService for Grpc {
    async fn export(
        &self,
        r: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let key = grpc_key(&r);
        record_traces(&self.0, r.into_inner(), key);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

#[tonic::async_trait]
impl MetricsService for Grpc {
    async fn export(
        &self,
        r: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        let key = grpc_key(&r);
        record_metrics(&self.0, r.into_inner(), key);
        Ok(tonic::Response::new(ExportMetricsServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    pub async fn start() -> Receiver {
        let got = Arc::new(Mutex::new(Got::default()));
        let (tx, rx) = watch::channel(0u64);
        let app = Router::new()
            .route("/v1/traces", post(traces))
            .route("/v1/metrics", post(metrics))
            .with_state((got.clone(), Arc::new(tx)));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the receiver");
        let url = format!("http://{}", l.local_addr().expect("addr"));
        tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        Receiver {
            url,
            got,
            tick: rx,
            served: None,
        }
    }

    /// The OTLP/HTTP receiver served as `how` says (over TLS with a fresh CA: `served`'s).
    pub async fn start_with(how: tether_testkit::Serve) -> Receiver {
        Self::serve(how, |state| {
            Router::new()
                .route("/v1/traces", post(traces))
                .route("/v1/metrics", post(metrics))
                .with_state(state)
        })
        .await
    }

    /// The gRPC receiver (the collector's services as an axum router) served as `how` says:
    /// over TLS, HTTP/2 is agreed by ALPN, as a collector on `https://` serves gRPC.
    pub async fn start_grpc_with(how: tether_testkit::Serve) -> Receiver {
        Self::serve(how, |state| {
            let svc = Grpc(state);
            tonic::service::Routes::new(TraceServiceServer::new(svc.clone()))
                .add_service(MetricsServiceServer::new(svc))
                .into_axum_router()
        })
        .await
    }

    /// The app `app` makes of the receiver's state, served by the testkit as `how` says.
    async fn serve(how: tether_testkit::Serve, app: impl FnOnce(Shared) -> Router) -> Receiver {
        let got = Arc::new(Mutex::new(Got::default()));
        let (tx, rx) = watch::channel(0u64);
        let served = tether_testkit::server::serve_router(app((got.clone(), Arc::new(tx))), &how)
            .await
            .expect("serve the receiver");
        Receiver {
            url: served.origin(),
            got,
            tick: rx,
            served: Some(served),
        }
    }

    /// The CA a TLS receiver's certificate chains to (and its client certificate, for mTLS).
    pub fn ca(&self) -> &tether_testkit::TestCa {
        self.served.as_ref().and_then(|s| s.ca()).expect("a TLS receiver")
    }

    /// The PEM of the CA a TLS receiver's certificate chains to.
    pub fn ca_pem(&self) -> String {
        self.ca().pem().to_owned()
    }

    /// How many requests reached the receiver's server (over TLS: past the handshake).
    pub fn requests(&self) -> usize {
        self.served.as_ref().map(|s| s.negotiated().len()).unwrap_or(0)
    }

    /// The same receiver over OTLP/gRPC: tonic serving the collector's `TraceService` and
    /// `MetricsService` on 127.0.0.1 (`url` is the gRPC server's, `http://127.0.0.1:PORT`).
    pub async fn start_grpc() -> Receiver {
        let got = Arc::new(Mutex::new(Got::default()));
        let (tx, rx) = watch::channel(0u64);
        let svc = Grpc((got.clone(), Arc::new(tx)));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the receiver");
        let url = format!("http://{}", l.local_addr().expect("addr"));
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(svc.clone()))
                .add_service(MetricsServiceServer::new(svc))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(l))
                .await;
        });
        Receiver {
            url,
            got,
            tick: rx,
            served: None,
        }
    }

    /// The `x-api-key` of each export request received (`None` where it had none).
    pub fn api_keys(&self) -> Vec<Option<String>> {
        self.got.lock().unwrap().keys.clone()
    }

    pub fn spans(&self) -> Vec<Span> {
        self.got.lock().unwrap().spans.clone()
    }

    pub fn points(&self) -> Vec<Point> {
        self.got.lock().unwrap().points.clone()
    }

    /// Waits (up to 60 s) until `pred` holds over the spans received; returns them.
    pub async fn wait_spans(&self, what: &str, pred: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let mut tick = self.tick.clone();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let spans = self.spans();
            if pred(&spans) {
                return spans;
            }
            match tokio::time::timeout_at(deadline, tick.changed()).await {
                Ok(Ok(())) => {}
                _ => panic!("timed out waiting for {what}; got {:#?}", self.spans()),
            }
        }
    }

    /// Waits (up to 60 s) until `pred` holds over the metric points received.
    pub async fn wait_points(&self, what: &str, pred: impl Fn(&[Point]) -> bool) -> Vec<Point> {
        let mut tick = self.tick.clone();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let points = self.points();
            if pred(&points) {
                return points;
            }
            match tokio::time::timeout_at(deadline, tick.changed()).await {
                Ok(Ok(())) => {}
                _ => panic!("timed out waiting for {what}; got {:#?}", self.points()),
            }
        }
    }
}

/// The spans of one trace that are named `name`.
pub fn named<'a>(spans: &'a [Span], name: &str) -> Vec<&'a Span> {
    spans.iter().filter(|s| s.name == name).collect()
}

/// The one span named `name`.
pub fn one<'a>(spans: &'a [Span], name: &str) -> &'a Span {
    let v = named(spans, name);
    assert_eq!(
        v.len(),
        1,
        "expected one span `{name}`, got {}: {spans:#?}",
        v.len()
    );
    v[0]
}

pub const INTERNAL: i32 = 1;
pub const CLIENT: i32 = 3;
pub const ERROR: i32 = 2;

/// The content attributes, never on a span unless opted in.
pub const CONTENT: [&str; 5] = [
    "gen_ai.input.messages",
    "gen_ai.output.messages",
    "gen_ai.system_instructions",
    "gen_ai.tool.call.arguments",
    "gen_ai.tool.call.result",
];

/// A telemetry exporting to `rx` quickly (spans batched for 50 ms; metrics at an interval no
/// test reaches, read at shutdown), with content captured when `capture`.
pub fn telemetry(rx: &Receiver, capture: bool) -> tether_otel::Telemetry {
    tether_otel::Telemetry::new(
        tether_otel::ExportConfig::new(&rx.url)
            .batch_delay(Duration::from_millis(50))
            .metrics_interval(Duration::from_secs(3600))
            .capture_content(capture),
    )
    .expect("telemetry")
}

/// One request traced by `t`, answered "hi" (usage 3 in, 2 out) by a fresh fake.
pub async fn one_traced_run(t: &tether_otel::Telemetry) {
    let fake = tether_testkit::openai::FakeOpenAi::start().await;
    fake.push(tether_testkit::openai::Reply::text("hi").usage(3, 2));
    let model = tether_openai::OpenAiModel::builder(fake.url())
        .model("m")
        .build()
        .expect("model");
    let r = tether::Session::builder(tether::local::LocalLoop::new(model))
        .observer(t.tracer().observer())
        .run("say hi")
        .await
        .expect("the run");
    assert_eq!(r.text, "hi");
}

/// A tool that works (`ok_tool`) and one that fails (`bad_tool`).
pub fn tools() -> tether::ToolSet {
    tether::ToolSet::new()
        .tool(
            tether::ToolSpec::new("ok_tool", "Always works", json!({"type": "object"})),
            |_input: Value| async { Ok::<_, String>("fine".to_owned()) },
        )
        .tool(
            tether::ToolSpec::new("bad_tool", "Always fails", json!({"type": "object"})),
            |_input: Value| async { Err::<String, _>("boom".to_owned()) },
        )
}

/// Drives `request` until the model streams text (a text delta on `sub`), then drops it
/// mid-flight; panics if it ends first.
pub async fn until_streaming<F: std::future::Future>(request: F, sub: &mut tether::Subscription) {
    tokio::pin!(request);
    loop {
        tokio::select! {
            _ = &mut request => panic!("the stalled request ended"),
            e = sub.recv() => if matches!(e.map(|e| e.kind), Some(tether::EventKind::TextDelta { .. })) { break },
        }
    }
}

/// One traced request (as [`one_traced_run`]) exported over OTLP/HTTP to `url`, then the
/// telemetry shut down: spans every 20 ms, metrics only at shutdown.
pub async fn one_run_exported_to(url: &str) {
    let t = tether_otel::Telemetry::new(
        tether_otel::ExportConfig::new(url)
            .batch_delay(std::time::Duration::from_millis(20))
            .metrics_interval(std::time::Duration::from_secs(3600)),
    )
    .expect("telemetry");
    one_traced_run(&t).await;
    tokio::task::block_in_place(|| t.shutdown());
}

/// Serves `app` on 127.0.0.1 (a port of its own); its base URL.
pub async fn serve(app: axum::Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    url
}
