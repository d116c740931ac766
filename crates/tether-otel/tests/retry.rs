//! An OTLP/HTTP collector that is briefly unavailable: the span export tries again (429, 502,
//! 503 and 504, as the OTLP exporter specification lists them) and the batch arrives once; one
//! that refuses the batch outright (400) is not asked again.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::routing::post;

/// What the collector saw: each distinct export body, with how often it was sent and whether
/// it was accepted.
type Seen = Arc<Mutex<HashMap<Vec<u8>, (u64, bool)>>>;

/// A collector answering the first `fail` sendings of each span export body with `status`
/// (and `retry-after: 0`), later ones 200. Keyed by body, so the count does not depend on how
/// the spans were batched.
async fn collector(fail: u64, status: StatusCode) -> (String, Seen) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let traces = move |body: Bytes| {
        let s = s.clone();
        async move {
            let mut m = s.lock().expect("lock");
            let e = m.entry(body.to_vec()).or_insert((0, false));
            e.0 += 1;
            if e.0 <= fail {
                return (status, [("retry-after", "0")]);
            }
            e.1 = true;
            (StatusCode::OK, [("retry-after", "0")])
        }
    };
    let app = Router::new()
        .route("/v1/traces", post(traces))
        .route("/v1/metrics", post(|| async { StatusCode::OK }));
    (common::serve(app).await, seen)
}

/// (times sent, accepted) of each body the collector saw.
fn sendings(seen: &Seen) -> Vec<(u64, bool)> {
    let m = seen.lock().expect("lock");
    assert!(!m.is_empty(), "nothing was exported");
    assert!(m.keys().all(|b| !b.is_empty()), "an empty export body");
    m.values().copied().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_briefly_unavailable_gets_the_batch_on_a_later_try() {
    for status in [
        StatusCode::TOO_MANY_REQUESTS,
        StatusCode::BAD_GATEWAY,
        StatusCode::SERVICE_UNAVAILABLE,
        StatusCode::GATEWAY_TIMEOUT,
    ] {
        let (url, seen) = collector(2, status).await;
        common::one_run_exported_to(&url).await;
        for (sent, accepted) in sendings(&seen) {
            assert_eq!(
                (sent, accepted),
                (3, true),
                "{status}: two refusals, then the batch"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_batch_is_not_sent_again() {
    let (url, seen) = collector(u64::MAX, StatusCode::BAD_REQUEST).await;
    common::one_run_exported_to(&url).await;
    for (sent, accepted) in sendings(&seen) {
        assert_eq!((sent, accepted), (1, false));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_down_for_good_is_tried_four_times_in_all() {
    let (url, seen) = collector(u64::MAX, StatusCode::SERVICE_UNAVAILABLE).await;
    common::one_run_exported_to(&url).await;
    for (sent, accepted) in sendings(&seen) {
        assert_eq!((sent, accepted), (4, false), "one try and three retries");
    }
}
