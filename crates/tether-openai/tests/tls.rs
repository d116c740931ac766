//! The path every real OpenAI-compatible provider takes: TLS and HTTP/2 (reqwest with rustls),
//! against `FakeOpenAi` serving TLS with a CA generated at start, trusted through
//! `OpenAiBuilder::add_root_certificates_pem` with verification on. The fake records what each
//! request arrived over, so the tests see TLS and HTTP/2 rather than assume them.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use tether::{Error, EventKind, RecordingSleeper, Terminal, TransportKind};
use tether_openai::{OpenAiBuilder, OpenAiModel};
use tether_testkit::openai::{FakeOpenAi, Reply};
use tether_testkit::{Serve, TestCa};

/// Generous: a handshake and a two-turn session take milliseconds; this only turns a hang into
/// a failure on a loaded machine.
const LIMIT: Duration = Duration::from_secs(60);

fn builder(fake: &FakeOpenAi) -> OpenAiBuilder {
    OpenAiModel::builder(fake.url())
        .model("fake-model")
        .stream_idle_timeout(Duration::from_secs(30))
}

fn trusting(fake: &FakeOpenAi) -> OpenAiBuilder {
    let ca = fake.ca().expect("a TLS fake has a CA");
    builder(fake).add_root_certificates_pem(ca.pem())
}

/// Runs `prompt` with the weather tools on `model`; returns the result and how many tools ran.
async fn run(model: OpenAiModel, prompt: &str) -> (tether::Result<tether::SessionResult>, usize) {
    let sleeper = RecordingSleeper::default();
    let ran = Arc::new(AtomicUsize::new(0));
    let session = tether::Session::builder(local(model, &sleeper)).handler(tools(ran.clone()));
    let r = tokio::time::timeout(LIMIT, async move {
        let mut s = session.open().await?;
        s.send(prompt).await
    })
    .await
    .expect("the session ends in time");
    (r, ran.load(Ordering::SeqCst))
}

fn script(fake: &FakeOpenAi) {
    fake.push(Reply::tool_calls(&[("call_1", "get_weather", r#"{"city":"Paris"}"#)]).usage(10, 5));
    fake.push(Reply::text("Paris is sunny today.").chunk_chars(4).usage(20, 6));
}

#[tokio::test]
async fn a_streamed_session_with_a_tool_call_runs_over_tls_and_http2() {
    let fake = FakeOpenAi::start_with(Serve::tls()).await;
    assert!(fake.url().starts_with("https://127.0.0.1:"), "{}", fake.url());
    script(&fake);
    let model = trusting(&fake).build().expect("model");
    let sleeper = RecordingSleeper::default();
    let ran = Arc::new(AtomicUsize::new(0));
    let mut session = tether::Session::builder(local(model, &sleeper))
        .handler(tools(ran.clone()))
        .open()
        .await
        .expect("open");
    let mut live = session.sink().subscribe(4096).await;
    let r = tokio::time::timeout(LIMIT, session.send("Weather in Paris?"))
        .await
        .expect("the session ends in time")
        .expect("the session succeeds over TLS");
    assert_eq!(r.text, "Paris is sunny today.");
    assert_eq!(r.terminal, Terminal::EndTurn);
    assert_eq!(r.turns, 2);
    assert_eq!(ran.load(Ordering::SeqCst), 1, "the tool ran once");
    assert_eq!(r.tool_uses[0].name, "get_weather");
    assert_eq!(retries(&r), 0);
    check_record(&r, 1);
    // Streamed: the answer arrived in several deltas (4 characters each), not at once.
    let live = drain(&mut live);
    let deltas: Vec<&str> = live
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::TextDelta { delta, .. } => Some(delta.as_str()),
            _ => None,
        })
        .collect();
    assert!(deltas.len() >= 2, "{deltas:?}");
    assert_eq!(deltas.concat(), r.text);

    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    assert!(reqs.iter().all(|q| q.is_stream()));
    assert_eq!(
        reqs[1].messages()[2]["tool_call_id"],
        "call_1",
        "the result went back"
    );
    let neg = fake.negotiated();
    assert_eq!(neg.len(), 2, "{neg:?}");
    for n in &neg {
        assert!(n.is_tls_h2(), "not TLS + HTTP/2: {n:?}");
        assert_eq!(n.tls_version.as_deref(), Some("TLSv1_3"), "{n:?}");
        assert_eq!(n.path, "/v1/chat/completions");
    }
}

#[tokio::test]
async fn https_with_a_read_buffer_falls_back_to_reqwest() {
    // The lean client speaks plain HTTP/1.1 only; an https endpoint must keep reqwest, which the
    // server sees as TLS + HTTP/2 (the lean client could do neither).
    let fake = FakeOpenAi::start_with(Serve::tls()).await;
    script(&fake);
    let model = trusting(&fake).read_buffer(8 << 10).build().expect("model");
    let (r, ran) = run(model, "Weather in Paris?").await;
    let r = r.expect("the session succeeds over TLS");
    assert_eq!(r.text, "Paris is sunny today.");
    assert_eq!(ran, 1);
    let neg = fake.negotiated();
    assert_eq!(neg.len(), 2, "{neg:?}");
    assert!(neg.iter().all(|n| n.is_tls_h2()), "{neg:?}");
}

#[tokio::test]
async fn a_server_offering_only_http1_gets_http1_over_tls() {
    let fake = FakeOpenAi::start_with(Serve::tls_http1_only()).await;
    script(&fake);
    let (r, ran) = run(trusting(&fake).build().expect("model"), "Weather in Paris?").await;
    assert_eq!(r.expect("the session succeeds").text, "Paris is sunny today.");
    assert_eq!(ran, 1);
    for n in fake.negotiated() {
        assert!(n.tls_version.is_some(), "{n:?}");
        assert_eq!(n.alpn.as_deref(), Some("http/1.1"), "{n:?}");
        assert_eq!(n.http_version, "HTTP/1.1", "{n:?}");
    }
}

/// The error a model that does not trust the fake's CA gets, with no retry (certificate errors
/// do not heal) and nothing reaching the server.
async fn refused(model: OpenAiModel, fake: &FakeOpenAi) {
    let (r, ran) = run(model, "hi").await;
    match r {
        Err(e @ Error::Transport { .. }) => {
            let Error::Transport { kind, message, .. } = &e else {
                unreachable!()
            };
            assert_eq!(*kind, TransportKind::Other, "{e:?}");
            assert!(message.contains("certificate"), "{message}");
            assert!(message.contains("UnknownIssuer"), "{message}");
            assert!(!e.is_transient(), "a certificate error is not retried: {e:?}");
        }
        other => panic!("expected a transport error naming the certificate, got {other:?}"),
    }
    assert_eq!(ran, 0);
    assert!(fake.negotiated().is_empty(), "no request got through");
    assert_eq!(fake.remaining(), 2, "nothing was answered");
}

#[tokio::test]
async fn an_untrusted_certificate_is_refused_with_a_typed_error() {
    let fake = FakeOpenAi::start_with(Serve::tls()).await;
    script(&fake);
    // Only the built-in roots.
    refused(builder(&fake).build().expect("model"), &fake).await;
    // Another private CA: trusting one CA does not trust another.
    let other = TestCa::generate();
    refused(
        builder(&fake)
            .add_root_certificates_pem(other.pem())
            .build()
            .expect("model"),
        &fake,
    )
    .await;
}

#[tokio::test]
async fn a_bundle_without_a_certificate_is_a_config_error() {
    for bad in ["not a certificate", "-----BEGIN CERTIFICATE-----\nAAAA\n"] {
        // Over https and over plain http with the lean client alike.
        for url in ["https://127.0.0.1:9/v1", "http://127.0.0.1:9/v1"] {
            let r = OpenAiModel::builder(url)
                .read_buffer(8 << 10)
                .add_root_certificates_pem(bad)
                .build();
            match r {
                Err(Error::Config { message: m, .. }) => {
                    assert!(m.contains("root certificate bundle #1"), "{m}")
                }
                other => panic!("{bad:?} at {url}: {other:?}"),
            }
        }
    }
}

#[tokio::test]
async fn a_stream_reset_mid_answer_over_http2_is_retried() {
    // Over HTTP/2 a body that fails mid-way is a stream reset (RST_STREAM), not a cut connection.
    let fake = FakeOpenAi::start_with(Serve::tls()).await;
    fake.push(Reply::text("a long answer that is cut").drop_after(3));
    fake.push(Reply::text("recovered").usage(5, 1));
    let sleeper = RecordingSleeper::default();
    let model = trusting(&fake).build().expect("model");
    let r = tokio::time::timeout(LIMIT, async {
        tether::Session::builder(local(model, &sleeper))
            .open()
            .await?
            .send("hi")
            .await
    })
    .await
    .expect("in time")
    .expect("the retry succeeds");
    assert_eq!(r.text, "recovered");
    assert_eq!(retries(&r), 1);
    assert_eq!(messages(&r), ["recovered"], "one model response recorded");
    let error = r
        .events
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::Retry { error, .. } => Some(error.clone()),
            _ => None,
        })
        .unwrap_or_default();
    // reqwest reports the reset as a failed body read, which is retried like a cut connection;
    // the message names the HTTP/2 stream error.
    assert!(error.contains("connection closed"), "{error}");
    assert!(error.contains("stream error received"), "{error}");
    let neg = fake.negotiated();
    assert_eq!(neg.len(), 2);
    assert!(neg.iter().all(|n| n.is_tls_h2()), "{neg:?}");
}

#[tokio::test]
async fn a_stalled_stream_over_http2_hits_the_idle_timeout_and_is_retried() {
    let fake = FakeOpenAi::start_with(Serve::tls()).await;
    fake.push(Reply::text("stalls after a while").stall_after(2));
    fake.push(Reply::text("recovered"));
    let sleeper = RecordingSleeper::default();
    // Tight on purpose: the idle timeout is what is under test.
    let model = trusting(&fake)
        .stream_idle_timeout(Duration::from_millis(300))
        .build()
        .expect("model");
    let r = tokio::time::timeout(LIMIT, async {
        tether::Session::builder(local(model, &sleeper))
            .open()
            .await?
            .send("hi")
            .await
    })
    .await
    .expect("in time")
    .expect("the retry succeeds");
    assert_eq!(r.text, "recovered");
    assert_eq!(retries(&r), 1);
    assert!(fake.negotiated().iter().all(|n| n.is_tls_h2()));
}
