//! A tracer from `Telemetry::tracer()` makes no `tracing` span, yet its request span is the child
//! of the application's own `tracing` span that is current when the request starts (exported by
//! the telemetry's layer installed as the global subscriber).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{Receiver, one};
use serde_json::{Value, json};
use tether::{Session, ToolSet, ToolSpec, local::LocalLoop};
use tether_testkit::openai::{FakeOpenAi, Reply};
use tracing::Instrument;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

/// Counts the spans of target `tether_otel` that reach the subscriber.
#[derive(Clone, Default)]
struct Count(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> Layer<S> for Count {
    fn on_new_span(&self, attrs: &tracing::span::Attributes<'_>, _: &tracing::span::Id, _: Context<'_, S>) {
        if attrs.metadata().target() == tether_otel::TARGET && attrs.metadata().name() == "gen_ai" {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_started_in_an_application_span_is_its_child() {
    let rx = Receiver::start().await;
    let t = common::telemetry(&rx, false);
    let count = Count::default();
    tracing_subscriber::registry()
        .with(t.layer())
        .with(count.clone())
        .try_init()
        .expect("the test's global subscriber");
    let tracer = t.tracer().agent_name("helper");
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[("c1", "ok_tool", "{}")]));
    fake.push(Reply::text("done"));
    let model = tether_openai::OpenAiModel::builder(fake.url())
        .model("gpt-test")
        .build()
        .expect("model");
    let tools = ToolSet::new().tool(
        ToolSpec::new("ok_tool", "Always works", json!({"type": "object"})),
        |_input: Value| async { Ok::<_, String>("fine".to_owned()) },
    );
    // The application's operation, traced through the telemetry's layer (its target is the one
    // the layer exports).
    let app = tracing::info_span!(target: "tether_otel", "app_request", otel.name = "app_request");
    let result = Session::builder(LocalLoop::new(model))
        .handler(tools)
        .observer(tracer.observer())
        .run("go")
        .instrument(app.clone())
        .await
        .expect("run");
    drop(app);
    assert_eq!(result.text, "done");
    tokio::task::block_in_place(|| t.flush());
    let spans = rx
        .wait_spans("the app's span and the run's four", |s| s.len() >= 5)
        .await;

    let app = one(&spans, "app_request");
    let run = one(&spans, "invoke_agent helper");
    assert_eq!(run.parent, app.span_id, "{spans:#?}");
    assert_eq!(run.trace_id, app.trace_id);
    assert_eq!(one(&spans, "execute_tool ok_tool").parent, run.span_id);
    let chats: Vec<_> = spans.iter().filter(|s| s.name == "chat gpt-test").collect();
    assert_eq!(chats.len(), 2, "{spans:#?}");
    assert!(chats.iter().all(|c| c.parent == run.span_id));
    // Built on the SDK directly: no `tracing` span of tether's reached the subscriber.
    assert_eq!(count.0.load(Ordering::SeqCst), 0);
}
