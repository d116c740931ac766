//! The bounded-read-buffer client (`OpenAiBuilder::read_buffer`, the crate's lean HTTP/1.1
//! client) over real sockets to the fake server: long streams, headers, JSON replies, reuse.
//! Its failures are typed in `tests/errors.rs`, which runs every fault through both clients.

use std::time::Duration;

use tether::{ChatMessage, ChatModel, ChatRequest, DeltaSink};
use tether_openai::OpenAiModel;
use tether_testkit::openai::{FakeOpenAi, Reply};

fn req() -> ChatRequest {
    ChatRequest::new(String::new(), vec![ChatMessage::user("hi")], Vec::new())
}

fn model(url: &str, stream: bool) -> OpenAiModel {
    OpenAiModel::builder(url)
        .model("m")
        .api_key("sk-test")
        .header("x-extra", "1")
        .stream(stream)
        .read_buffer(8 * 1024)
        // Generous: nothing here is a timeout test, and a 2.5 MB stream must arrive whole on a
        // loaded machine.
        .request_timeout(Duration::from_secs(60))
        .stream_idle_timeout(Duration::from_secs(60))
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
