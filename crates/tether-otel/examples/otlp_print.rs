//! A minimal OTLP/HTTP receiver that prints each trace as a tree when its root span arrives:
//! enough to see a `tether run` without a collector.
//!
//! ```sh
//! cargo run -p tether-otel --example otlp_print            # listens on 127.0.0.1:4318
//! OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 tether run "…"
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as V;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

type Traces = Arc<Mutex<HashMap<Vec<u8>, Vec<Span>>>>;

fn value(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(V::StringValue(s)) => {
            let s: String = s.chars().take(80).collect();
            format!("{s:?}")
        }
        Some(V::IntValue(i)) => i.to_string(),
        Some(V::BoolValue(b)) => b.to_string(),
        Some(V::DoubleValue(d)) => d.to_string(),
        Some(V::ArrayValue(a)) => format!(
            "[{}]",
            a.values
                .iter()
                .map(|x| value(&Some(x.clone())))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        _ => "?".into(),
    }
}

fn print(spans: &[Span], parent: &[u8], depth: usize) {
    let mut children: Vec<&Span> = spans.iter().filter(|s| s.parent_span_id == parent).collect();
    children.sort_by_key(|s| s.start_time_unix_nano);
    for s in children {
        let ms = s.end_time_unix_nano.saturating_sub(s.start_time_unix_nano) as f64 / 1e6;
        let kind = ["?", "internal", "server", "client", "producer", "consumer"]
            .get(s.kind as usize)
            .copied()
            .unwrap_or("?");
        println!("{}{} [{kind}] {ms:.1} ms", "  ".repeat(depth), s.name);
        for a in &s.attributes {
            println!("{}  {} = {}", "  ".repeat(depth), a.key, value(&a.value));
        }
        for e in &s.events {
            println!("{}  event {}", "  ".repeat(depth), e.name);
        }
        for l in &s.links {
            let hex: String = l.span_id.iter().map(|b| format!("{b:02x}")).collect();
            println!("{}  link to span {hex}", "  ".repeat(depth));
        }
        print(spans, &s.span_id, depth + 1);
    }
}

async fn traces(State(t): State<Traces>, body: Bytes) -> &'static [u8] {
    let Ok(req) = ExportTraceServiceRequest::decode(body) else {
        return b"";
    };
    let mut all = t.lock().unwrap_or_else(|p| p.into_inner());
    for rs in req.resource_spans {
        for ss in rs.scope_spans {
            for s in ss.spans {
                let root = s.parent_span_id.is_empty();
                let id = s.trace_id.clone();
                all.entry(id.clone()).or_default().push(s);
                if root && let Some(spans) = all.remove(&id) {
                    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
                    println!("trace {hex}");
                    print(&spans, &[], 1);
                }
            }
        }
    }
    b""
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:4318".into());
    let app = Router::new()
        .route("/v1/traces", post(traces))
        .route("/v1/metrics", post(|| async { "" }))
        .with_state(Traces::default());
    let l = tokio::net::TcpListener::bind(&addr).await?;
    eprintln!("OTLP/HTTP receiver on http://{addr}; traces print when their root span ends");
    axum::serve(l, app).await
}
