//! The path the real Anthropic API takes: TLS and HTTP/2 (reqwest with rustls), for the
//! Messages model and the Managed Agents provider, against the fakes serving TLS with a CA
//! generated at start, trusted through `ClientConfig::add_root_certificates_pem` with
//! verification on. The fakes record what each request arrived over, so the tests see TLS and
//! HTTP/2 rather than assume them.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tether::local::LocalLoop;
use tether::{
    Error, RecordingSleeper, RetryPolicy, Session, SessionConfig, SessionResult, Terminal, ToolSet, ToolSpec,
    TransportKind,
};
use tether_anthropic::{ClientConfig, ManagedAgents, ManagedConfig, MessagesModel};
use tether_testkit::anthropic::{FakeMessages, Reply, golden};
use tether_testkit::managed::{self, FakeManaged, ManagedFaults};
use tether_testkit::{Negotiated, Serve, TestCa};

/// Generous: a handshake and a two-turn session take milliseconds; this only turns a hang into
/// a failure on a loaded machine.
const LIMIT: Duration = Duration::from_secs(60);

async fn in_time<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("the session ends in time")
}

fn assert_all_tls_h2(neg: &[Negotiated]) {
    assert!(!neg.is_empty());
    for n in neg {
        assert!(n.is_tls_h2(), "not TLS + HTTP/2: {n:?}");
        assert_eq!(n.tls_version.as_deref(), Some("TLSv1_3"), "{n:?}");
    }
}

/// A transport error naming the untrusted certificate, typed as not retryable.
fn assert_untrusted(err: &Error) {
    match err {
        Error::Transport { kind, message, .. } => {
            assert_eq!(*kind, TransportKind::Other, "{err:?}");
            assert!(message.contains("UnknownIssuer"), "{message}");
            assert!(message.contains("add_root_certificates_pem"), "{message}");
            assert!(!err.is_transient(), "{err:?}");
        }
        other => panic!("expected a transport error naming the certificate, got {other:?}"),
    }
}

// ---- Messages ----

fn weather_tool() -> ToolSpec {
    ToolSpec::new(
        "get_weather",
        "Weather for a city",
        json!({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}),
    )
}

fn weather(calls: Arc<AtomicU32>) -> ToolSet {
    ToolSet::new().tool(weather_tool(), move |input: Value| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            assert_eq!(input["city"], "Paris");
            Ok::<_, String>("sunny, 24C".to_owned())
        }
    })
}

fn messages_model(config: ClientConfig) -> MessagesModel {
    MessagesModel::new(config, "claude-test")
        .expect("model")
        .max_tokens(1024)
        .thinking(json!({"type": "enabled", "budget_tokens": 512}))
}

async fn messages_fake() -> FakeMessages {
    FakeMessages::start_with(
        vec![
            Reply::Sse(golden("thinking_tool_use.sse")),
            Reply::Sse(golden("final_text.sse")),
        ],
        Serve::tls(),
    )
    .await
}

#[tokio::test]
async fn messages_a_streamed_tool_round_trip_over_tls_and_http2() {
    let fake = messages_fake().await;
    assert!(fake.url().starts_with("https://127.0.0.1:"), "{}", fake.url());
    let ca = fake.ca().expect("a TLS fake has a CA").pem();
    let config = ClientConfig::new("sk-test")
        .base_url(fake.url())
        .add_root_certificates_pem(ca);
    let calls = Arc::new(AtomicU32::new(0));
    let result = in_time(
        Session::builder(LocalLoop::new(messages_model(config)).system_prompt("You are terse."))
            .handler(weather(calls.clone()))
            .run("Weather in Paris?"),
    )
    .await
    .expect("the session succeeds over TLS");
    assert_eq!(result.terminal, Terminal::EndTurn);
    assert_eq!(result.text, "It is sunny in Paris.");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(result.tool_uses[0].input, json!({"city": "Paris"}));
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].header("x-api-key"), Some("sk-test"));
    assert_eq!(reqs[0].body["stream"], true);
    let expected: Value = serde_json::from_str(&golden("second_request.json")).expect("golden json");
    assert_eq!(reqs[1].body, expected, "the tool result went back unchanged");
    let neg = fake.negotiated();
    assert_eq!(neg.len(), 2, "{neg:?}");
    assert_all_tls_h2(&neg);
    assert!(neg.iter().all(|n| n.path == "/v1/messages"));
}

#[tokio::test]
async fn messages_an_untrusted_certificate_is_refused_with_a_typed_error() {
    let fake = messages_fake().await;
    let other = TestCa::generate();
    for config in [
        ClientConfig::new("sk-test").base_url(fake.url()),
        ClientConfig::new("sk-test")
            .base_url(fake.url())
            .add_root_certificates_pem(other.pem()),
    ] {
        let sleeper = RecordingSleeper::default();
        let provider = LocalLoop::new(messages_model(config))
            .retry(RetryPolicy::default().with_sleeper(sleeper.clone()));
        let err = in_time(Session::builder(provider).run("hi"))
            .await
            .expect_err("refused");
        assert_untrusted(&err);
        assert!(sleeper.slept().is_empty(), "not retried");
    }
    assert!(fake.negotiated().is_empty(), "no request got through");
    assert!(fake.requests().is_empty());
}

#[tokio::test]
async fn a_bundle_without_a_certificate_is_a_config_error() {
    let config = ClientConfig::new("sk-test").add_root_certificates_pem("no certificate here");
    match MessagesModel::new(config.clone(), "claude-test") {
        Err(Error::Config { message: m, .. }) => assert!(m.contains("root certificate bundle #1"), "{m}"),
        other => panic!("{other:?}"),
    }
    match ManagedAgents::new(ManagedConfig::new(config, "agent_1", "env_1")) {
        Err(Error::Config { message: m, .. }) => assert!(m.contains("root certificate bundle #1"), "{m}"),
        other => panic!("{other:?}"),
    }
}

// ---- Managed Agents ----

fn lookup(calls: Arc<AtomicU32>) -> ToolSet {
    ToolSet::new().tool(
        ToolSpec::new(
            "lookup",
            "Look a key up",
            json!({"type":"object","properties":{"q":{"type":"string"}},"required":["q"]}),
        ),
        move |input: Value| {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok::<_, String>(format!("value of {}", input["q"].as_str().unwrap_or("?")))
            }
        },
    )
}

fn tool_turns() -> Vec<Vec<Value>> {
    managed::golden("tool_round_trip.json")
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.as_array().cloned().unwrap_or_default())
        .collect()
}

fn session_config(sleeper: &RecordingSleeper) -> SessionConfig {
    SessionConfig::default().with_reconnect(
        RetryPolicy::default()
            .with_jitter(false)
            .with_sleeper(sleeper.clone()),
    )
}

fn managed_config(fake: &FakeManaged, ca: Option<&str>) -> ManagedConfig {
    let mut client = ClientConfig::new("sk-test").base_url(fake.url());
    if let Some(pem) = ca {
        client = client.add_root_certificates_pem(pem);
    }
    ManagedConfig::new(client, "agent_1", "env_1")
}

async fn managed_round_trip(faults: ManagedFaults) -> (FakeManaged, SessionResult, u32, RecordingSleeper) {
    let fake = FakeManaged::start_with(tool_turns(), faults, Serve::tls()).await;
    let ca = fake.ca().expect("a TLS fake has a CA").pem().to_owned();
    let calls = Arc::new(AtomicU32::new(0));
    let sleeper = RecordingSleeper::default();
    let provider = ManagedAgents::new(managed_config(&fake, Some(&ca))).expect("provider");
    let result = in_time(
        Session::builder(provider)
            .handler(lookup(calls.clone()))
            .config(session_config(&sleeper))
            .run("What is x?"),
    )
    .await
    .expect("the session succeeds over TLS");
    (fake, result, calls.load(Ordering::SeqCst), sleeper)
}

/// Every event of the fake's log recorded exactly once, sequence numbers without gaps.
fn assert_exactly_once(result: &SessionResult, log: &[Value]) {
    let mut ids = HashSet::new();
    for (i, e) in result.events.iter().enumerate() {
        assert!(ids.insert(e.id.clone()), "duplicate event id {}", e.id);
        assert_eq!(e.seq, Some(i as u64 + 1), "gap or disorder at {}", e.id);
    }
    for ev in log {
        let id = ev["id"].as_str().unwrap_or_default();
        assert!(ids.contains(id), "event {id} missing from the record");
    }
}

#[tokio::test]
async fn managed_a_tool_round_trip_over_tls_and_http2() {
    // Over HTTP/2 the live event stream and the posts of input and tool results share one
    // connection, as streams of it.
    let (fake, result, calls, sleeper) = managed_round_trip(ManagedFaults::default()).await;
    assert_eq!(result.terminal, Terminal::EndTurn);
    assert_eq!(result.text, "x is 42.");
    assert_eq!(calls, 1);
    let posted: Vec<Value> = fake
        .posted()
        .into_iter()
        .filter(|e| e["type"] == "user.custom_tool_result")
        .collect();
    assert_eq!(posted.len(), 1);
    assert_eq!(posted[0]["content"][0]["text"], "value of x");
    assert!(sleeper.slept().is_empty());
    assert_eq!(fake.stream_opens(), 1);
    assert_exactly_once(&result, &fake.log(&result.session_id));
    let neg = fake.negotiated();
    assert_all_tls_h2(&neg);
    let paths: Vec<(&str, &str)> = neg.iter().map(|n| (n.method.as_str(), n.path.as_str())).collect();
    assert!(paths.contains(&("POST", "/v1/sessions")), "{paths:?}");
    assert!(
        paths
            .iter()
            .any(|(m, p)| *m == "GET" && p.ends_with("/events/stream")),
        "{paths:?}"
    );
    assert!(
        paths
            .iter()
            .filter(|(m, p)| *m == "POST" && p.ends_with("/events"))
            .count()
            >= 2,
        "the message and the tool result were posted: {paths:?}"
    );
}

#[tokio::test]
async fn managed_a_stream_ended_after_the_tool_use_reconnects_over_http2_and_runs_it_once() {
    let (fake, result, calls, sleeper) = managed_round_trip(ManagedFaults {
        drop_after: Some("agent.custom_tool_use".into()),
        page_size: Some(2),
        ..ManagedFaults::default()
    })
    .await;
    assert_eq!(result.terminal, Terminal::EndTurn);
    assert_eq!(result.text, "x is 42.");
    assert_eq!(calls, 1, "the tool ran once");
    assert_eq!(fake.stream_opens(), 2);
    assert_eq!(sleeper.slept().len(), 1);
    assert!(result.events.iter().any(|e| e.raw_type == "tether.reconnect"));
    assert_exactly_once(&result, &fake.log(&result.session_id));
    assert_all_tls_h2(&fake.negotiated());
}

#[tokio::test]
async fn managed_an_untrusted_certificate_is_refused_with_a_typed_error() {
    let fake = FakeManaged::start_with(tool_turns(), ManagedFaults::default(), Serve::tls()).await;
    let other = TestCa::generate();
    for ca in [None, Some(other.pem())] {
        let sleeper = RecordingSleeper::default();
        let provider = ManagedAgents::new(managed_config(&fake, ca)).expect("provider");
        let err = in_time(
            Session::builder(provider)
                .config(session_config(&sleeper))
                .run("What is x?"),
        )
        .await
        .expect_err("refused");
        assert_untrusted(&err);
        assert!(sleeper.slept().is_empty(), "not retried");
    }
    assert!(fake.negotiated().is_empty(), "no request got through");
    assert!(fake.requests().is_empty());
}
