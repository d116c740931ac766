//! Shared helpers for the tether-openai integration tests.
#![allow(dead_code)]

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tether::local::LocalLoop;
use tether::{
    Event, EventKind, RecordingSleeper, RetryPolicy, SessionBuilder, SessionResult, ToolSet, ToolSpec,
};
use tether_openai::OpenAiModel;
use tether_testkit::openai::FakeOpenAi;

/// A streaming model on the fake, with a generous idle timeout: its streams must succeed, even
/// on a loaded machine.
pub fn model(fake: &FakeOpenAi) -> OpenAiModel {
    model_with_idle(fake, Duration::from_secs(30))
}

/// A streaming model on the fake with this idle timeout (short only where it is under test).
pub fn model_with_idle(fake: &FakeOpenAi, idle: Duration) -> OpenAiModel {
    OpenAiModel::builder(fake.url())
        .model("fake-model")
        .stream_idle_timeout(idle)
        .build()
        .expect("model")
}

/// A local loop over `model` whose retries sleep instantly and are recorded.
pub fn local(model: OpenAiModel, sleeper: &RecordingSleeper) -> LocalLoop {
    LocalLoop::new(model)
        .session_id("s1")
        .retry(RetryPolicy::default().with_sleeper(sleeper.clone()))
}

pub fn session(fake: &FakeOpenAi, sleeper: &RecordingSleeper) -> SessionBuilder {
    tether::Session::builder(local(model(fake), sleeper))
}

pub fn spec(name: &str) -> ToolSpec {
    ToolSpec::new(
        name,
        format!("the {name} tool"),
        json!({"type": "object", "properties": {}}),
    )
}

/// Tools `get_weather`, `get_time` and `add`, each echoing its input; `calls` counts runs.
/// `get_weather` sleeps longest so results finish out of order.
pub fn tools(calls: Arc<AtomicUsize>) -> ToolSet {
    let mut set = ToolSet::new();
    for (name, ms) in [("get_weather", 60u64), ("get_time", 20), ("add", 0)] {
        let calls = calls.clone();
        set = set.tool(spec(name), move |input: Value| {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok::<_, String>(format!("{name} result for {input}"))
            }
        });
    }
    set
}

/// The record is gapless and each id appears once: sequence numbers `first..first+n`.
pub fn check_record(r: &SessionResult, first: u64) {
    let seqs: Vec<u64> = r.events.iter().map(|e| e.seq.expect("durable")).collect();
    let want: Vec<u64> = (first..first + r.events.len() as u64).collect();
    assert_eq!(seqs, want, "sequence numbers");
    let ids: HashSet<&str> = r.events.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids.len(), r.events.len(), "event ids unique");
}

pub fn count(events: &[impl std::borrow::Borrow<Event>], f: impl Fn(&EventKind) -> bool) -> usize {
    events.iter().filter(|e| f(&e.borrow().kind)).count()
}

pub fn retries(r: &SessionResult) -> usize {
    count(&r.events, |k| matches!(k, EventKind::Retry { .. }))
}

/// The assistant messages' texts in the record.
pub fn messages(r: &SessionResult) -> Vec<String> {
    r.events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Message {
                text,
                role: tether::Role::Assistant,
                ..
            } => Some(text.clone()),
            _ => None,
        })
        .collect()
}

/// Drains a subscriber that is no longer fed (the sender side must be idle).
pub fn drain(rx: &mut tether::Subscription) -> Vec<Event> {
    let mut out = Vec::new();
    while let Ok(e) = rx.try_recv() {
        out.push(e);
    }
    out
}
