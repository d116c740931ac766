//! The axum endpoint over real TCP: statuses, negotiation, keep-alives, disconnects.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tether_agui::{AgUiRouterExt, EndpointOptions, RunOutcome};

agent!(Hello, (), |ctx| {
    ctx.say("hi")?;
    Ok(RunOutcome::Success)
});

agent!(Slow, (), |ctx| {
    tokio::time::sleep(Duration::from_millis(300)).await;
    ctx.say("late")?;
    Ok(RunOutcome::Success)
});

static DROPPED: AtomicBool = AtomicBool::new(false);
struct Flag;
impl Drop for Flag {
    fn drop(&mut self) {
        DROPPED.store(true, Ordering::SeqCst);
    }
}

agent!(Forever, (), |ctx| {
    let _flag = Flag;
    ctx.say("started")?;
    ctx.cancel_token().cancelled().await;
    Ok(RunOutcome::Cancelled)
});

async fn serve() -> String {
    let options = EndpointOptions::default()
        .with_body_limit(1024)
        .with_keep_alive(Some(Duration::from_millis(50)));
    let app = axum::Router::new()
        .route_agui("/hello", Hello)
        .route_agui_with("/small", Hello, options.clone())
        .route_agui_with("/slow", Slow, options)
        .route_agui("/forever", Forever);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

fn body() -> String {
    json!({"threadId":"t1","runId":"r1","messages":[{"id":"u1","role":"user","content":"hi"}],
           "tools":[],"context":[],"state":{},"forwardedProps":{},"unknownField":1})
    .to_string()
}

async fn post(url: &str, accept: &str, content_type: &str, body: String) -> reqwest::Response {
    reqwest::Client::new()
        .post(url)
        .header("accept", accept)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn sse_stream() {
    let base = serve().await;
    let r = post(
        &format!("{base}/hello"),
        "text/event-stream",
        "application/json",
        body(),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    let frames: Vec<Value> = text
        .split("\n\n")
        .filter(|f| !f.is_empty())
        .map(|f| serde_json::from_str(f.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    let types: Vec<&str> = frames.iter().map(|f| f["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        [
            "RUN_STARTED",
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_END",
            "RUN_FINISHED"
        ]
    );
}

#[tokio::test]
async fn protobuf_stream_by_accept() {
    let base = serve().await;
    let r = post(
        &format!("{base}/hello"),
        "application/vnd.ag-ui.event+proto",
        "application/json",
        body(),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/vnd.ag-ui.event+proto");
    let bytes = r.bytes().await.unwrap();
    let mut frames = 0;
    let mut rest = &bytes[..];
    while !rest.is_empty() {
        let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        rest = &rest[4 + len..];
        frames += 1;
    }
    assert_eq!(frames, 5);
}

async fn error_of(r: reqwest::Response, status: u16, code: &str) {
    assert_eq!(r.status(), status);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json")
    );
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["code"], code, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()));
}

#[tokio::test]
async fn http_errors() {
    let base = serve().await;
    let url = format!("{base}/hello");
    error_of(
        post(
            &url,
            "text/event-stream",
            "application/json",
            "{\"threadId\":".into(),
        )
        .await,
        400,
        "INVALID_INPUT",
    )
    .await;
    error_of(
        post(
            &url,
            "text/event-stream",
            "application/json",
            "{\"threadId\":\"t\"}".into(),
        )
        .await,
        400,
        "INVALID_INPUT",
    )
    .await;
    error_of(
        post(&url, "text/event-stream", "text/plain", body()).await,
        415,
        "UNSUPPORTED_MEDIA_TYPE",
    )
    .await;
    error_of(
        post(&url, "application/json", "application/json", body()).await,
        406,
        "NOT_ACCEPTABLE",
    )
    .await;
    let big = json!({"threadId":"t","runId":"r","messages":[],"pad":"x".repeat(4096)}).to_string();
    error_of(
        post(
            &format!("{base}/small"),
            "text/event-stream",
            "application/json",
            big,
        )
        .await,
        413,
        "PAYLOAD_TOO_LARGE",
    )
    .await;
    let r = reqwest::Client::new().get(&url).send().await.unwrap();
    assert_eq!(r.headers()["allow"], "POST");
    error_of(r, 405, "METHOD_NOT_ALLOWED").await;
}

#[tokio::test]
async fn keep_alive_comments_while_idle() {
    let base = serve().await;
    let r = post(&format!("{base}/slow"), "*/*", "application/json", body()).await;
    let text = r.text().await.unwrap();
    assert!(text.contains(":\n\n"), "{text}");
    assert!(text.trim_end().ends_with('}'));
    assert!(text.contains("RUN_FINISHED"));
}

#[tokio::test]
async fn client_disconnect_cancels_the_run() {
    let base = serve().await;
    let mut r = post(
        &format!("{base}/forever"),
        "text/event-stream",
        "application/json",
        body(),
    )
    .await;
    let first = r.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("RUN_STARTED"));
    assert!(!DROPPED.load(Ordering::SeqCst));
    drop(r);
    for _ in 0..100 {
        if DROPPED.load(Ordering::SeqCst) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the agent was not cancelled after the client went away");
}
