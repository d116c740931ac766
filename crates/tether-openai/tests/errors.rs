//! One `OpenAiModel::chat` call per fault, asserting the exact typed error (no retries here:
//! the model makes exactly one attempt). Every fault goes through both HTTP clients: reqwest, and
//! the lean client `OpenAiBuilder::read_buffer` selects, which must type failures the same way.

use std::time::Duration;

use serde_json::json;
use tether::{ChatMessage, ChatModel, ChatRequest, DeltaSink, Error, TransportKind};
use tether_openai::OpenAiModel;
use tether_testkit::openai::{FakeOpenAi, Reply};
use tokio::io::AsyncReadExt;

/// Both clients: reqwest (`false`) and the lean bounded-buffer client (`true`).
const CLIENTS: [bool; 2] = [false, true];

fn req() -> ChatRequest {
    ChatRequest::new(String::new(), vec![ChatMessage::user("hi")], Vec::new())
}

/// Generous timeouts: a fault must show as itself, not as a timeout on a loaded machine.
fn model(url: &str, stream: bool, lean: bool) -> OpenAiModel {
    model_timeouts(
        url,
        stream,
        lean,
        Duration::from_secs(60),
        Duration::from_secs(60),
    )
}

/// Tight timeouts, for the faults that are timeouts (no response, a stalled stream).
fn tight(url: &str, stream: bool, lean: bool) -> OpenAiModel {
    model_timeouts(
        url,
        stream,
        lean,
        Duration::from_millis(400),
        Duration::from_millis(300),
    )
}

fn model_timeouts(url: &str, stream: bool, lean: bool, request: Duration, idle: Duration) -> OpenAiModel {
    let mut b = OpenAiModel::builder(url)
        .model("m")
        .stream(stream)
        .request_timeout(request)
        .stream_idle_timeout(idle);
    if lean {
        b = b.read_buffer(8 * 1024);
    }
    b.build().unwrap()
}

async fn one(reply: Reply, stream: bool, lean: bool) -> tether::Result<tether::ChatResponse> {
    one_on(reply, stream, lean, model).await
}

/// [`one`] with tight timeouts.
async fn one_tight(reply: Reply, stream: bool, lean: bool) -> tether::Result<tether::ChatResponse> {
    one_on(reply, stream, lean, tight).await
}

async fn one_on(
    reply: Reply,
    stream: bool,
    lean: bool,
    make: fn(&str, bool, bool) -> OpenAiModel,
) -> tether::Result<tether::ChatResponse> {
    let fake = FakeOpenAi::start().await;
    fake.push(reply);
    let r = make(&fake.url(), stream, lean)
        .chat(&req(), &DeltaSink::discard())
        .await;
    assert_eq!(fake.requests().len(), 1, "exactly one attempt (lean: {lean})");
    r
}

fn kind(r: &tether::Result<tether::ChatResponse>) -> Option<TransportKind> {
    match r {
        Err(Error::Transport { kind, .. }) => Some(*kind),
        _ => None,
    }
}

#[tokio::test]
async fn refused_connect_is_refused() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    for lean in CLIENTS {
        let r = model(&format!("http://127.0.0.1:{port}/v1"), true, lean)
            .chat(&req(), &DeltaSink::discard())
            .await;
        assert_eq!(kind(&r), Some(TransportKind::Refused), "{r:?}");
        assert!(r.unwrap_err().is_transient());
    }
}

/// A raw server: accepts, reads the request head, then does `then` with the socket.
async fn raw_server(then: fn(tokio::net::TcpStream)) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let mut buf = vec![0u8; 65536];
            let _ = s.read(&mut buf).await;
            then(s);
        }
    });
    format!("http://{addr}/v1")
}

#[tokio::test]
async fn no_response_is_a_timeout() {
    let url = raw_server(|s| {
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(s);
        });
    })
    .await;
    for lean in CLIENTS {
        let r = tight(&url, true, lean).chat(&req(), &DeltaSink::discard()).await;
        assert_eq!(kind(&r), Some(TransportKind::Timeout), "{r:?}");
    }
}

#[tokio::test]
async fn closed_before_the_response_is_closed() {
    let url = raw_server(drop).await;
    for lean in CLIENTS {
        let r = model(&url, true, lean).chat(&req(), &DeltaSink::discard()).await;
        assert_eq!(kind(&r), Some(TransportKind::Closed), "{r:?}");
    }
}

#[tokio::test]
async fn reset_before_the_response_is_reset() {
    let url = raw_server(|s| {
        let _ = s.set_zero_linger();
        drop(s);
    })
    .await;
    for lean in CLIENTS {
        let r = model(&url, true, lean).chat(&req(), &DeltaSink::discard()).await;
        // A reset that races the request write may surface as a closed connection.
        assert!(
            matches!(kind(&r), Some(TransportKind::Reset | TransportKind::Closed)),
            "{r:?}"
        );
    }
}

#[tokio::test]
async fn stream_faults_are_typed() {
    for lean in CLIENTS {
        let r = one(Reply::text("abcdefghijklmnop").drop_after(2), true, lean).await;
        assert_eq!(kind(&r), Some(TransportKind::Closed), "{r:?}");
        let r = one_tight(Reply::text("abcdefghijklmnop").stall_after(2), true, lean).await;
        assert_eq!(kind(&r), Some(TransportKind::Idle), "{r:?}");
        let r = one(Reply::text("abcdefghijklmnop").truncate_after(2), true, lean).await;
        assert_eq!(kind(&r), Some(TransportKind::Closed), "{r:?}");
        assert!(format!("{}", r.unwrap_err()).contains("before any finish_reason"));
        let r = one(
            Reply::text("abc").error_after(1, "boom", "server_error"),
            true,
            lean,
        )
        .await;
        assert!(
            matches!(&r, Err(Error::Stream { message, code }) if message == "boom" && code.as_deref() == Some("server_error")),
            "{r:?}"
        );
        let r = one(Reply::text("abc").malformed_after(1), true, lean).await;
        assert!(
            matches!(&r, Err(Error::Malformed { message: m, .. }) if m.contains("stream event #2")),
            "{r:?}"
        );
    }
}

#[tokio::test]
async fn non_stream_faults_are_typed() {
    for lean in CLIENTS {
        let r = one_tight(Reply::text("abc").stall_after(0), false, lean).await;
        assert_eq!(kind(&r), Some(TransportKind::Timeout), "{r:?}");
        let r = one(Reply::text("abc").drop_after(0), false, lean).await;
        assert_eq!(kind(&r), Some(TransportKind::Closed), "{r:?}");
        let r = one(Reply::text("abc").malformed_after(0), false, lean).await;
        assert!(matches!(&r, Err(Error::Malformed { .. })), "{r:?}");
        let r = one(
            Reply::text("abc").error_after(0, "nope", "server_error"),
            false,
            lean,
        )
        .await;
        assert!(matches!(&r, Err(Error::Stream { .. })), "{r:?}");
    }
}

#[tokio::test]
async fn http_errors_carry_message_code_and_retry_headers() {
    for lean in CLIENTS {
        // llama.cpp: integer code; the type is the useful code.
        let r = one(
            Reply::http(
                400,
                json!({"error": {"code": 400, "message": "Expected 'messages' to be an array", "type": "invalid_request_error"}}),
            ),
            true,
            lean,
        )
        .await;
        match r {
            Err(Error::Http {
                status: 400,
                message,
                code,
                ..
            }) => {
                assert_eq!(message, "Expected 'messages' to be an array");
                assert_eq!(code.as_deref(), Some("invalid_request_error"));
            }
            other => panic!("{other:?}"),
        }
        let r = one(
            Reply::http(503, json!("upstream unavailable"))
                .header("retry-after", "0.25")
                .header("x-should-retry", "true"),
            true,
            lean,
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
}

#[tokio::test]
async fn a_server_ignoring_stream_true_is_read_as_json() {
    for lean in CLIENTS {
        let body = json!({"id": "x", "object": "chat.completion", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
            "finish_reason": "stop"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1}});
        let r = one(Reply::http(200, body), true, lean).await.unwrap();
        assert_eq!(r.message.content.as_deref(), Some("hello"));
        assert_eq!(r.usage.unwrap().input_tokens, 2);
    }
}

#[tokio::test]
async fn a_missing_model_name_is_a_config_error() {
    let m = OpenAiModel::builder("http://127.0.0.1:9/v1").build().unwrap();
    let r = m.chat(&req(), &DeltaSink::discard()).await;
    assert!(
        matches!(
            r,
            Err(Error::Config {
                kind: tether::ConfigKind::Invalid,
                ..
            })
        ),
        "{r:?}"
    );
}
