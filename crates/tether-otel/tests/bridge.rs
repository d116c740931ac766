//! The `tracing` bridge: an application's own `tracing` layer, beside `Telemetry::layer()`, sees
//! the same span tree the OTLP receiver gets (names, parents), under the application's own span.

mod common;

use std::sync::{Arc, Mutex};

use common::{Receiver, named, one};
use serde_json::{Value, json};
use tether::{Session, ToolSet, ToolSpec, local::LocalLoop};
use tether_testkit::openai::{FakeOpenAi, Reply};
use tracing::Instrument;
use tracing::span;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;
use tracing_subscriber::registry::LookupSpan;

/// A span the layer saw open: its id, its name (`otel.name` when set), its parent's id.
type Opened = (u64, String, Option<u64>);

/// Every span the layer sees open.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<Opened>>>);

struct OtelName(Option<String>);

impl tracing::field::Visit for OtelName {
    fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
        if f.name() == "otel.name" {
            self.0 = Some(v.to_owned());
        }
    }
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        if f.name() == "otel.name" {
            self.0 = Some(format!("{v:?}").trim_matches('"').to_owned());
        }
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Seen {
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let mut v = OtelName(None);
        attrs.record(&mut v);
        let name = v.0.unwrap_or_else(|| attrs.metadata().name().to_owned());
        let parent = ctx.span(id).and_then(|s| s.parent()).map(|p| p.id().into_u64());
        self.0.lock().unwrap().push((id.into_u64(), name, parent));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_tracing_layer_sees_the_same_tree() {
    let rx = Receiver::start().await;
    let t = common::telemetry(&rx, false);
    let seen = Seen::default();
    // The application's subscriber: its own layer and the telemetry's.
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(seen.clone()).with(t.layer()));
    let tracer = t.tracer().agent_name("helper").with_dispatch(dispatch.clone());
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
    // The application's own span, current while the session opens and runs.
    let app = tracing::dispatcher::with_default(&dispatch, || tracing::info_span!("app_request"));
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
    let spans = rx.wait_spans("the run's four spans", |s| s.len() >= 4).await;

    let seen = seen.0.lock().unwrap().clone();
    let id_of = |name: &str| -> u64 {
        let ids: Vec<u64> = seen.iter().filter(|s| s.1 == name).map(|s| s.0).collect();
        assert_eq!(ids.len(), 1, "{name} in {seen:?}");
        ids[0]
    };
    let parent_of = |name: &str| seen.iter().find(|s| s.1 == name).and_then(|s| s.2);
    let run = id_of("invoke_agent helper");
    assert_eq!(
        parent_of("invoke_agent helper"),
        Some(id_of("app_request")),
        "{seen:?}"
    );
    let chats: Vec<_> = seen.iter().filter(|s| s.1 == "chat gpt-test").collect();
    assert_eq!(chats.len(), 2, "{seen:?}");
    assert!(chats.iter().all(|c| c.2 == Some(run)), "{seen:?}");
    assert_eq!(parent_of("execute_tool ok_tool"), Some(run), "{seen:?}");

    // The same tree over OTLP. `Telemetry::layer()` exports tether's spans only (its filter), so
    // there the request span is the root, not the unexported application span's child.
    let otlp_run = one(&spans, "invoke_agent helper");
    assert_eq!(otlp_run.parent, "");
    assert_eq!(named(&spans, "chat gpt-test").len(), 2);
    assert_eq!(one(&spans, "execute_tool ok_tool").parent, otlp_run.span_id);
}
