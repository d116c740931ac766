//! What `fake_openai` and `fake_anthropic` share: answering a request with what an in-process
//! testkit fake answers to it, once the reply that request is to get has been queued there.

use std::future::Future;

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// Runs `forward` (queue the reply, send the request to the fake) in a task of its own and
/// relays the fake's answer. A task, not this handler's future: when `tether serve` is killed
/// mid-request (the crash test does it at random), axum drops the handler, and a reply queued
/// but not yet taken by the fake would answer the next request instead, every later reply one
/// behind. The fake takes its reply before it answers, so a finished `forward` has paired them.
pub async fn relay<F>(forward: F) -> Response
where
    F: Future<Output = reqwest::Result<reqwest::Response>> + Send + 'static,
{
    let resp = match tokio::spawn(forward).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => return (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
        Err(e) => return (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    };
    let status = resp.status();
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_owned();
    let mut out = Response::new(Body::from_stream(resp.bytes_stream()));
    *out.status_mut() = status;
    if let Ok(v) = ct.parse() {
        out.headers_mut().insert("content-type", v);
    }
    out
}
