//! A tracer from `Telemetry::tracer()` builds its spans on the OpenTelemetry SDK directly: with
//! no `tracing` dispatcher installed at all it exports the same span tree (names, kinds,
//! parents, attributes, status, events, links) as the `tracing` bridge does.

mod common;

use std::collections::BTreeMap;

use common::{Receiver, Span};
use serde_json::{Value, json};
use tether::{Session, local::LocalLoop};
use tether_otel::Tracer;
use tether_testkit::openai::{FakeOpenAi, Reply};

/// One span as compared: ids replaced by the names of the spans they point to, and the values
/// that differ between two runs (session id, ports, response ids) by placeholders.
type Shape = (
    String,
    i32,
    String,
    BTreeMap<String, Value>,
    i32,
    String,
    Vec<String>,
    Vec<(String, BTreeMap<String, Value>)>,
);

fn shapes(spans: &[Span]) -> Vec<Shape> {
    let name_of = |id: &str| -> String {
        spans
            .iter()
            .find(|s| s.span_id == id)
            .map(|s| s.name.clone())
            .unwrap_or_else(|| if id.is_empty() { String::new() } else { "?".into() })
    };
    let mut out: Vec<Shape> = spans
        .iter()
        .map(|s| {
            let mut attrs = s.attrs.clone();
            for k in ["gen_ai.conversation.id", "gen_ai.response.id", "server.port"] {
                if let Some(v) = attrs.get_mut(k) {
                    *v = json!("*");
                }
            }
            let mut events: Vec<String> = s.events.iter().map(|(n, _)| n.clone()).collect();
            events.sort();
            let links = s
                .links
                .iter()
                .map(|(_, id, a)| (name_of(id), a.clone()))
                .collect();
            (
                s.name.clone(),
                s.kind,
                name_of(&s.parent),
                attrs,
                s.status,
                s.status_message.clone(),
                events,
                links,
            )
        })
        .collect();
    out.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
    out
}

/// Two requests of one session (tools, a failed tool, usage, content), then a third dropped
/// mid-stream; the spans the receiver got. (Links to a previous request, made when a session is
/// reopened, are in `serve.rs`: `tether serve` traces with a tracer from `Telemetry::tracer()`.)
async fn session_spans(direct: bool) -> Vec<Span> {
    let rx = Receiver::start().await;
    let t = common::telemetry(&rx, true);
    let tracer: Tracer = if direct {
        t.tracer().agent_name("helper")
    } else {
        t.tracer().agent_name("helper").with_dispatch(t.dispatch())
    };
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[("c1", "ok_tool", "{\"x\":1}"), ("c2", "bad_tool", "{}")]).usage(10, 5));
    fake.push(Reply::text("done").usage(20, 7));
    fake.push(Reply::text("again").usage(3, 2));
    fake.push(Reply::text("hello there").chunk_chars(2).stall_after(2));
    let model = tether_openai::OpenAiModel::builder(fake.url())
        .model("gpt-test")
        .build()
        .expect("model");
    let mut session = Session::builder(LocalLoop::new(model))
        .handler(common::tools())
        .observer(tracer.observer())
        .open()
        .await
        .expect("open");
    assert_eq!(session.send("use the tools").await.expect("run 1").text, "done");
    assert_eq!(session.send("once more").await.expect("run 2").text, "again");
    let mut sub = session.sink().subscribe(64).await;
    common::until_streaming(session.send("stall"), &mut sub).await;
    drop(session);
    tokio::task::block_in_place(|| t.flush());
    let spans = rx.wait_spans("three requests' spans", |s| s.len() >= 9).await;
    tokio::task::block_in_place(|| t.shutdown());
    spans
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_tracer_exports_the_bridged_tree_without_any_dispatcher() {
    // Nothing in this test binary installs a `tracing` dispatcher: bridged spans made under the
    // global one would go nowhere.
    assert!(!tracing::dispatcher::has_been_set());
    let direct = session_spans(true).await;
    assert!(!tracing::dispatcher::has_been_set());
    let bridged = session_spans(false).await;

    // The tree itself: three requests, the first with two chats and two tools under it.
    assert_eq!(direct.len(), 9, "{direct:#?}");
    let mut runs: Vec<&Span> = direct
        .iter()
        .filter(|s| s.name == "invoke_agent helper")
        .collect();
    runs.sort_by_key(|s| s.start);
    assert_eq!(runs.len(), 3);
    assert!(runs.iter().all(|r| r.parent.is_empty()));
    let under = |r: &Span| direct.iter().filter(|s| s.parent == r.span_id).count();
    assert_eq!(under(runs[0]), 4);
    assert_eq!(under(runs[1]), 1);
    assert_eq!(under(runs[2]), 1);
    assert_eq!(runs[2].attr("error.type"), Some(&json!("interrupted")));

    // And the same as the bridge's, span for span.
    let (d, b) = (shapes(&direct), shapes(&bridged));
    assert_eq!(d.len(), b.len());
    for (d, b) in d.iter().zip(&b) {
        assert_eq!(d, b);
    }
}
