//! A hostile OTLP/HTTP collector: one that answers an export with an endless body, and one that
//! answers with bytes that are not an OTLP response. The export reads a bounded part of the
//! answer (1 MiB), the run is unaffected, and shutdown returns.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::post;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_answer_is_read_only_in_part() {
    // Every export is answered 200 with a body that never ends (64 KiB chunks), counted as it
    // is produced: what the server could push is bounded by what the exporter reads (1 MiB)
    // plus the sockets' buffers.
    let produced = Arc::new(AtomicU64::new(0));
    let exports = Arc::new(AtomicU64::new(0));
    let (p, e) = (produced.clone(), exports.clone());
    let endless = move || {
        let p = p.clone();
        e.fetch_add(1, Ordering::Relaxed);
        async move {
            let chunk = bytes::Bytes::from(vec![b'x'; 64 << 10]);
            let body = futures_util::stream::repeat_with(move || {
                p.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                Ok::<_, std::io::Error>(chunk.clone())
            });
            (
                [("content-type", "application/x-protobuf")],
                Body::from_stream(body),
            )
        }
    };
    let app = Router::new()
        .route("/v1/traces", post(endless.clone()))
        .route("/v1/metrics", post(endless));
    let url = common::serve(app).await;
    common::one_run_exported_to(&url).await;
    let exports = exports.load(Ordering::Relaxed);
    assert!(exports >= 1, "nothing was exported");
    // Unbounded, each export would read until its timeout (10 s at loopback speed: gigabytes).
    let produced = produced.load(Ordering::Relaxed);
    assert!(
        produced < exports * (16 << 20),
        "{produced} bytes produced for {exports} exports"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_is_not_otlp_changes_nothing() {
    let exports = Arc::new(AtomicU64::new(0));
    let e = exports.clone();
    let garbage = move || {
        e.fetch_add(1, Ordering::Relaxed);
        async { ([("content-type", "application/x-protobuf")], vec![0xffu8; 4096]) }
    };
    let app = Router::new()
        .route("/v1/traces", post(garbage.clone()))
        .route("/v1/metrics", post(garbage));
    let url = common::serve(app).await;
    common::one_run_exported_to(&url).await;
    assert!(exports.load(Ordering::Relaxed) >= 1, "nothing was exported");
}
