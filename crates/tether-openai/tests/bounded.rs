//! The bounded-read-buffer client (`OpenAiBuilder::read_buffer`, the crate's lean HTTP/1.1 client): the same
//! replies and the same typed errors as through reqwest, over real sockets to the fake server.

use std::time::Duration;

use serde_json::json;
use tether::{ChatMessage, ChatModel, ChatRequest, DeltaSink, Error, TransportKind};
use tether_openai::OpenAiModel;
use tether_testkit::openai::{FakeOpenAi, Reply};

fn req() -> ChatRequest {
    ChatRequest {
        model: String::new(),
        messages: vec![ChatMessage::user("hi")],
        tools: Vec::new(),
    }
}

fn model(url: &str, stream: bool) -> OpenAiModel {
    OpenAiModel::builder(url)
        .model("m")
        .api_key("sk-test")
        .header("x-extra", "1")
        .stream(stream)
        .read_buffer(8 * 1024)
        .request_timeout(Duration::from_millis(800))
        .stream_idle_timeout(Duration::from_millis(300))
        .build()
        .unwrap()
}

async fn one(reply: Reply, stream: bool) -> (tether::Result<tether::ChatResponse>, FakeOpenAi) {
    let fake = FakeOpenAi::start().await;
    fake.push(reply);
    let r = model(&fake.url(), stream)
        .chat(&req(), &DeltaSink::discard())
        .await;
    assert_eq!(fake.requests().len(), 1, "exactly one attempt");
    (r, fake)
}

fn text(r: tether::ChatResponse) -> String {
    r.message.content.unwrap_or_default()
}

fn kind(r: &tether::Result<tether::ChatResponse>) -> Option<TransportKind> {
    match r {
        Err(Error::Transport { kind, .. }) => Some(*kind),
        _ => None,
    }
}

/// A stream many times the buffer's size arrives whole, with the configured headers sent.
#[tokio::test]
async fn a_long_stream_arrives_whole_through_an_8_kib_buffer() {
    // 20,000 deltas of "ab": ~2.5 MB of SSE, in 64 KiB writes, through 8 KiB reads.
    let (r, fake) = one(Reply::long_text(20_000, "ab"), true).await;
    let t = text(r.expect("reply"));
    assert_eq!(t, "ab".repeat(20_000));
    let sent = &fake.requests()[0];
    assert_eq!(sent.header("authorization"), Some("Bearer sk-test"));
    assert_eq!(sent.header("x-extra"), Some("1"));
    assert_eq!(sent.header("accept"), Some("text/event-stream"));
    assert!(sent.is_stream());
}

#[tokio::test]
async fn a_json_reply_is_read_whole() {
    let (r, fake) = one(Reply::text("hello there"), false).await;
    assert_eq!(text(r.expect("reply")), "hello there");
    assert_eq!(fake.requests()[0].header("accept"), Some("application/json"));
}

#[tokio::test]
async fn connection_faults_are_typed_as_through_reqwest() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    let r = model(&format!("http://127.0.0.1:{port}/v1"), true)
        .chat(&req(), &DeltaSink::discard())
        .await;
    assert_eq!(kind(&r), Some(TransportKind::Refused), "{r:?}");
    assert!(r.unwrap_err().is_transient());

    let (r, _f) = one(Reply::text("abcdefghijklmnop").drop_after(2), true).await;
    assert_eq!(kind(&r), Some(TransportKind::Closed), "{r:?}");
    let (r, _f) = one(Reply::text("abcdefghijklmnop").stall_after(2), true).await;
    assert_eq!(kind(&r), Some(TransportKind::Idle), "{r:?}");
    let (r, _f) = one(Reply::text("abcdefghijklmnop").truncate_after(2), true).await;
    assert_eq!(kind(&r), Some(TransportKind::Closed), "{r:?}");
    let (r, _f) = one(Reply::text("abc").drop_after(0), false).await;
    assert_eq!(kind(&r), Some(TransportKind::Closed), "{r:?}");
}

#[tokio::test]
async fn http_errors_carry_message_and_retry_headers() {
    let (r, _f) = one(
        Reply::http(503, json!("upstream unavailable"))
            .header("retry-after", "0.25")
            .header("x-should-retry", "true"),
        true,
    )
    .await;
    match r {
        Err(Error::Http {
            status: 503,
            message,
            retry_after,
            should_retry,
            ..
        }) => {
            assert_eq!(message, "upstream unavailable");
            assert_eq!(retry_after, Some(Duration::from_millis(250)));
            assert_eq!(should_retry, Some(true));
        }
        other => panic!("{other:?}"),
    }
}

/// One model serves call after call (its pool hands back a connection that finished its body).
#[tokio::test]
async fn calls_follow_one_another() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text("one")).push(Reply::text("two"));
    let m = model(&fake.url(), true);
    assert_eq!(text(m.chat(&req(), &DeltaSink::discard()).await.unwrap()), "one");
    assert_eq!(text(m.chat(&req(), &DeltaSink::discard()).await.unwrap()), "two");
    assert_eq!(fake.requests().len(), 2);
}
