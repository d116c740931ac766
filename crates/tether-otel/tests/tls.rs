//! OTLP export to collectors on `https://` (OTLP/HTTP and gRPC over TLS, the testkit's TLS
//! server with a fresh private CA): trusted when the CA is given
//! ([`ExportConfig::ca_certificate`]), refused otherwise; a client certificate shown to a
//! collector that asks for mutual TLS; certificates and keys that cannot be used are
//! configuration errors.

mod common;

use std::time::Duration;

use common::{Receiver, one};
use serde_json::json;
use tether_otel::{ExportConfig, OtlpProtocol, Telemetry};
use tether_testkit::Serve;

fn config(rx: &Receiver, protocol: OtlpProtocol) -> ExportConfig {
    ExportConfig::new(&rx.url)
        .protocol(protocol)
        .batch_delay(Duration::from_millis(50))
        .metrics_interval(Duration::from_secs(3600))
}

async fn receiver(protocol: OtlpProtocol) -> Receiver {
    match protocol {
        OtlpProtocol::Grpc => Receiver::start_grpc_with(Serve::tls()).await,
        _ => Receiver::start_with(Serve::tls()).await,
    }
}

async fn exports_to_a_private_ca_collector(protocol: OtlpProtocol) {
    let rx = receiver(protocol).await;
    assert!(rx.url.starts_with("https://127.0.0.1:"), "{}", rx.url);
    let t = Telemetry::new(config(&rx, protocol).ca_certificate(rx.ca_pem())).expect("telemetry");
    common::one_traced_run(&t).await;
    let spans = rx
        .wait_spans("the run's spans over TLS", |s| {
            s.iter().any(|s| s.name == "invoke_agent") && s.iter().any(|s| s.name == "chat m")
        })
        .await;
    let chat = one(&spans, "chat m");
    assert_eq!(chat.parent, one(&spans, "invoke_agent").span_id);
    assert_eq!(chat.attr("gen_ai.usage.input_tokens"), Some(&json!(3)));
    // The metrics go the same way (read at shutdown).
    tokio::task::block_in_place(|| t.shutdown());
    rx.wait_points("the run's metrics over TLS", |p| {
        p.iter().any(|p| p.name == "gen_ai.client.token.usage")
    })
    .await;
    // Every export came over TLS; gRPC's over HTTP/2 agreed by ALPN.
    let served = rx.served.as_ref().expect("a served receiver").negotiated();
    assert!(!served.is_empty());
    for n in &served {
        assert!(n.tls_version.is_some(), "{n:?}");
        if protocol == OtlpProtocol::Grpc {
            assert!(n.is_tls_h2(), "{n:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_over_https_to_a_collector_whose_ca_is_given() {
    exports_to_a_private_ca_collector(OtlpProtocol::HttpProtobuf).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_over_grpc_with_tls_to_a_collector_whose_ca_is_given() {
    exports_to_a_private_ca_collector(OtlpProtocol::Grpc).await;
}

/// Without its CA, the collector's certificate is refused: nothing reaches it (no request gets
/// past the handshake), and the run is unaffected.
async fn refuses_an_untrusted_collector(protocol: OtlpProtocol) {
    let rx = receiver(protocol).await;
    let t = Telemetry::new(config(&rx, protocol)).expect("telemetry");
    common::one_traced_run(&t).await;
    tokio::task::block_in_place(|| t.shutdown());
    assert_eq!(rx.requests(), 0, "a request got past the TLS handshake");
    assert!(rx.spans().is_empty());
    assert!(rx.points().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_collector_signed_by_an_unknown_ca_gets_nothing() {
    refuses_an_untrusted_collector(OtlpProtocol::HttpProtobuf).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_tls_collector_signed_by_an_unknown_ca_gets_nothing() {
    refuses_an_untrusted_collector(OtlpProtocol::Grpc).await;
}

/// A collector that asks for mutual TLS gets the exports of a client given its certificate and
/// key, and nothing (no request past the handshake) from one without them.
async fn mutual_tls(protocol: OtlpProtocol) {
    let rx = match protocol {
        OtlpProtocol::Grpc => Receiver::start_grpc_with(Serve::tls_client_auth()).await,
        _ => Receiver::start_with(Serve::tls_client_auth()).await,
    };
    let without = Telemetry::new(config(&rx, protocol).ca_certificate(rx.ca_pem())).expect("telemetry");
    common::one_traced_run(&without).await;
    tokio::task::block_in_place(|| without.shutdown());
    assert_eq!(
        rx.requests(),
        0,
        "a client without a certificate got past the handshake"
    );
    let ca = rx.ca();
    let with = Telemetry::new(
        config(&rx, protocol)
            .ca_certificate(ca.pem())
            .client_identity(ca.client_cert_pem(), ca.client_key_pem()),
    )
    .expect("telemetry");
    common::one_traced_run(&with).await;
    rx.wait_spans("the run's spans over mutual TLS", |s| {
        s.iter().any(|s| s.name == "chat m")
    })
    .await;
    tokio::task::block_in_place(|| with.shutdown());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_export_shows_the_client_certificate_a_collector_asks_for() {
    mutual_tls(OtlpProtocol::HttpProtobuf).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_export_shows_the_client_certificate_a_collector_asks_for() {
    mutual_tls(OtlpProtocol::Grpc).await;
}

#[test]
fn certificates_and_keys_that_cannot_be_used_are_configuration_errors() {
    let ca = tether_testkit::TestCa::generate();
    for protocol in [OtlpProtocol::HttpProtobuf, OtlpProtocol::Grpc] {
        let base = || ExportConfig::new("https://127.0.0.1:4318").protocol(protocol);
        let cases = [
            (
                base().ca_certificate("not a certificate"),
                "ExportConfig::ca_certificate",
            ),
            (base().ca_certificate(""), "ExportConfig::ca_certificate"),
            // A certificate where the key should be.
            (
                base().client_identity(ca.pem(), ca.pem()),
                "ExportConfig::client_identity",
            ),
        ];
        for (config, named) in cases {
            let e = Telemetry::new(config).expect_err("an unusable certificate or key");
            assert!(
                matches!(
                    e,
                    tether::Error::Config {
                        kind: tether::ConfigKind::Invalid,
                        ..
                    }
                ),
                "{e:?}"
            );
            assert!(e.to_string().contains(named), "{protocol:?}: {e}");
        }
        // The CA itself is fine.
        assert!(Telemetry::new(base().ca_certificate(ca.pem())).is_ok());
    }
}
