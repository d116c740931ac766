//! The path the real AgentCore data plane takes: TLS and HTTP/2 (reqwest with rustls), against
//! `FakeAgentCore` serving TLS with a CA generated at start, trusted through
//! `AgentCoreConfig::add_root_certificates_pem` with verification on. The fake records what each
//! request arrived over, so the tests see TLS and HTTP/2 rather than assume them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tether::{Error, RecordingSleeper, RetryPolicy, Session, Terminal, ToolSet, ToolSpec, TransportKind};
use tether_agentcore::{AgentCore, AgentCoreConfig, AwsCredentials, Target};
use tether_testkit::agentcore::{FakeAgentCore, Reply, golden, golden_frames};
use tether_testkit::{Serve, TestCa};

const ARN: &str = "arn:aws:bedrock-agentcore:us-east-1:123456789012:harness/helper_abc-0123456789";

/// Generous: a handshake and a two-turn session take milliseconds; this only turns a hang into
/// a failure on a loaded machine.
const LIMIT: Duration = Duration::from_secs(60);

fn tools(calls: Arc<AtomicU32>) -> ToolSet {
    ToolSet::new().tool(
        ToolSpec::new("lookup", "Look up", json!({"type":"object"})),
        move |input: Value| {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok::<_, String>(format!("value of {}", input["q"].as_str().unwrap_or("?")))
            }
        },
    )
}

fn config(fake: &FakeAgentCore, sleeper: &RecordingSleeper) -> AgentCoreConfig {
    let mut c = AgentCoreConfig::new(
        Target::Harness {
            arn: ARN.into(),
            qualifier: None,
        },
        "us-east-1",
        AwsCredentials::new("AKIDEXAMPLE", "secret", Some("session-token".into())),
    );
    c.endpoint = Some(fake.url());
    c.retry = RetryPolicy::default()
        .with_sleeper(sleeper.clone())
        .with_jitter(false);
    c
}

async fn fake() -> FakeAgentCore {
    FakeAgentCore::start_with(
        vec![
            Reply::Frames(golden_frames("tool_turn.json")),
            Reply::Frames(golden_frames("final_turn.json")),
        ],
        Serve::tls(),
    )
    .await
}

#[tokio::test]
async fn a_streamed_tool_round_trip_over_tls_and_http2() {
    let fake = fake().await;
    assert!(fake.url().starts_with("https://127.0.0.1:"), "{}", fake.url());
    let sleeper = RecordingSleeper::default();
    let mut cfg = config(&fake, &sleeper).add_root_certificates_pem(fake.ca().expect("CA").pem());
    cfg.overrides.insert("maxIterations".into(), json!(5));
    let calls = Arc::new(AtomicU32::new(0));
    let result = tokio::time::timeout(
        LIMIT,
        Session::builder(AgentCore::new(cfg).expect("provider"))
            .handler(tools(calls.clone()))
            .run("What is x?"),
    )
    .await
    .expect("the session ends in time")
    .expect("the session succeeds over TLS");
    assert_eq!(result.terminal, Terminal::EndTurn);
    assert_eq!(result.text, "x is 42.");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(sleeper.slept().is_empty());
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    // SigV4 signs the host header; over HTTP/2 it travels as :authority and still verifies at
    // the fake's check (which needs a well-formed signature).
    assert!(
        reqs[0]
            .header("authorization")
            .is_some_and(|a| a.starts_with("AWS4-HMAC-SHA256 "))
    );
    assert_eq!(
        reqs[1].body,
        golden("resume_request.json"),
        "the tool result went back"
    );
    let neg = fake.negotiated();
    assert_eq!(neg.len(), 2, "{neg:?}");
    for n in &neg {
        assert!(n.is_tls_h2(), "not TLS + HTTP/2: {n:?}");
        assert_eq!(n.tls_version.as_deref(), Some("TLSv1_3"), "{n:?}");
        assert_eq!(n.path, "/harnesses/invoke");
    }
}

#[tokio::test]
async fn an_untrusted_certificate_is_refused_with_a_typed_error() {
    let fake = fake().await;
    let other = TestCa::generate();
    for extra in [None, Some(other.pem())] {
        let sleeper = RecordingSleeper::default();
        let mut cfg = config(&fake, &sleeper);
        if let Some(pem) = extra {
            cfg = cfg.add_root_certificates_pem(pem);
        }
        let err = tokio::time::timeout(
            LIMIT,
            Session::builder(AgentCore::new(cfg).expect("provider")).run("hi"),
        )
        .await
        .expect("the session ends in time")
        .expect_err("refused");
        match &err {
            Error::Transport { kind, message, .. } => {
                assert_eq!(*kind, TransportKind::Other, "{err:?}");
                assert!(message.contains("UnknownIssuer"), "{message}");
                assert!(message.contains("add_root_certificates_pem"), "{message}");
            }
            other => panic!("expected a transport error naming the certificate, got {other:?}"),
        }
        assert!(!err.is_transient());
        assert!(sleeper.slept().is_empty(), "not retried");
    }
    assert!(fake.negotiated().is_empty(), "no request got through");
}

#[test]
fn a_bundle_without_a_certificate_is_a_config_error() {
    let cfg = AgentCoreConfig::new(
        Target::Harness {
            arn: ARN.into(),
            qualifier: None,
        },
        "us-east-1",
        AwsCredentials::new("AKIDEXAMPLE", "secret", None),
    )
    .add_root_certificates_pem("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n");
    match AgentCore::new(cfg) {
        Err(Error::Config { message: m, .. }) => assert!(m.contains("root certificate bundle #1"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_truncated_event_stream_over_http2_is_retried_with_the_same_turn_id() {
    // A body that ends before messageStop ends its HTTP/2 stream cleanly (END_STREAM); the
    // provider must still see the turn as cut and retry it.
    let mut cut = golden_frames("final_turn.json");
    cut.truncate(3);
    let fake = FakeAgentCore::start_with(
        vec![
            Reply::Frames(cut),
            Reply::Frames(golden_frames("final_turn.json")),
        ],
        Serve::tls(),
    )
    .await;
    let sleeper = RecordingSleeper::default();
    let cfg = config(&fake, &sleeper).add_root_certificates_pem(fake.ca().expect("CA").pem());
    let result = tokio::time::timeout(
        LIMIT,
        Session::builder(AgentCore::new(cfg).expect("provider")).run("hi"),
    )
    .await
    .expect("the session ends in time")
    .expect("the retry succeeds");
    assert_eq!(result.terminal, Terminal::EndTurn);
    assert_eq!(result.text, "x is 42.");
    assert_eq!(sleeper.slept().len(), 1, "retried once");
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    let turn = |i: usize| {
        reqs[i]
            .header("x-amzn-bedrock-agentcore-runtime-custom-turn-id")
            .map(str::to_owned)
    };
    assert!(turn(0).is_some());
    assert_eq!(turn(0), turn(1), "a retried turn carries the same turn id");
    assert!(fake.negotiated().iter().all(|n| n.is_tls_h2()));
}

#[tokio::test]
async fn a_run_timeout_over_http2_stops_the_runtime_session() {
    // The stalled invocation's HTTP/2 stream is abandoned (reset) when the run times out; the
    // StopRuntimeSession call that follows must still get through over TLS.
    let fake = FakeAgentCore::start_with(
        vec![Reply::StallSse(
            "data: {\"type\":\"text\",\"text\":\"thinking\"}\n\n".into(),
        )],
        Serve::tls(),
    )
    .await;
    let sleeper = RecordingSleeper::default();
    let mut cfg = config(&fake, &sleeper).add_root_certificates_pem(fake.ca().expect("CA").pem());
    cfg.target = Target::Runtime {
        arn: "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/agent-abc".into(),
        qualifier: Some("DEFAULT".into()),
    };
    let err = tokio::time::timeout(
        LIMIT,
        Session::builder(AgentCore::new(cfg).expect("provider"))
            // Tight on purpose: the run timeout is what is under test (the reply never ends).
            .timeout(Duration::from_millis(400))
            .run("hi"),
    )
    .await
    .expect("the session ends in time")
    .expect_err("the stalled run times out");
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2, "{reqs:?}");
    assert!(reqs[1].path.ends_with("/stopruntimesession"), "{}", reqs[1].path);
    let neg = fake.negotiated();
    assert_eq!(neg.len(), 2, "{neg:?}");
    assert!(neg.iter().all(|n| n.is_tls_h2()), "{neg:?}");
}
