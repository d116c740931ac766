//! Output caps and hostile tool calls, through both HTTP clients against the fake server: a
//! model that never stops is cut at the response cap (one attempt, a typed error that is not
//! retried), the token limit is asked for by default, and a tool call without a name is that
//! call's error instead of the whole response's.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use common::*;
use tether::{ChatMessage, ChatModel, ChatRequest, DeltaSink, Error, RecordingSleeper, Session};
use tether_openai::OpenAiModel;
use tether_testkit::openai::{FakeOpenAi, Reply};

/// Both clients: reqwest (`false`) and the lean bounded-buffer client (`true`).
const CLIENTS: [bool; 2] = [false, true];

fn builder(fake: &FakeOpenAi, lean: bool) -> tether_openai::OpenAiBuilder {
    let b = OpenAiModel::builder(fake.url()).model("m");
    if lean { b.read_buffer(8 * 1024) } else { b }
}

fn req() -> ChatRequest {
    ChatRequest::new(String::new(), vec![ChatMessage::user("hi")], Vec::new())
}

/// A model that never stops (a stream of 333 MB for one run, before) is cut once the response
/// holds more than the cap; the error is typed and not retried.
#[tokio::test]
async fn a_model_that_never_stops_is_cut_at_the_response_cap() {
    for lean in CLIENTS {
        let fake = FakeOpenAi::start().await;
        fake.push(Reply::endless("x".repeat(100)));
        let model = builder(&fake, lean).max_response_bytes(64 << 10).build().unwrap();
        let sleeper = RecordingSleeper::default();
        let r = Session::builder(local(model, &sleeper)).run("go").await;
        assert!(
            matches!(r, Err(Error::ResponseTooLarge { limit: 65536 })),
            "lean {lean}: {r:?}"
        );
        assert_eq!(fake.requests().len(), 1, "not retried (lean {lean})");
        assert!(sleeper.slept().is_empty());
        let msg = r.unwrap_err().to_string();
        assert!(
            msg.contains("65536 bytes") && msg.contains("max_response_bytes"),
            "{msg}"
        );
    }
}

/// The default cap holds too (8 MiB), without configuration.
#[tokio::test]
async fn the_default_response_cap_applies() {
    for lean in CLIENTS {
        let fake = FakeOpenAi::start().await;
        fake.push(Reply::endless("y".repeat(16 << 10)));
        let r = builder(&fake, lean)
            .build()
            .unwrap()
            .chat(&req(), &DeltaSink::discard())
            .await;
        assert!(
            matches!(r, Err(Error::ResponseTooLarge { limit }) if limit == tether::chat::DEFAULT_MAX_RESPONSE_BYTES as u64),
            "lean {lean}: {r:?}"
        );
    }
}

/// Endless tool-call arguments count too, and a non-streamed body past the cap is refused.
#[tokio::test]
async fn arguments_and_whole_bodies_count_against_the_cap() {
    for lean in CLIENTS {
        let fake = FakeOpenAi::start().await;
        fake.push(Reply::tool_calls(&[("c1", "add", &"1".repeat(200_000))]));
        let r = builder(&fake, lean)
            .max_response_bytes(64 << 10)
            .build()
            .unwrap()
            .chat(&req(), &DeltaSink::discard())
            .await;
        assert!(
            matches!(r, Err(Error::ResponseTooLarge { .. })),
            "lean {lean}: {r:?}"
        );

        let fake = FakeOpenAi::start().await;
        fake.push(Reply::text("z".repeat(200_000)));
        let r = builder(&fake, lean)
            .stream(false)
            .max_response_bytes(64 << 10)
            .build()
            .unwrap()
            .chat(&req(), &DeltaSink::discard())
            .await;
        assert!(
            matches!(r, Err(Error::ResponseTooLarge { .. })),
            "lean {lean}: {r:?}"
        );
        // Within the cap, the same body is fine.
        let fake = FakeOpenAi::start().await;
        fake.push(Reply::text("z".repeat(1000)));
        let r = builder(&fake, lean)
            .stream(false)
            .max_response_bytes(64 << 10)
            .build()
            .unwrap()
            .chat(&req(), &DeltaSink::discard())
            .await
            .unwrap();
        assert_eq!(r.message.content.unwrap().len(), 1000);
    }
}

/// The output token limit is asked for by default, in the field the server expects; a caller
/// can set another or none.
#[tokio::test]
async fn a_token_limit_is_sent_by_default_and_can_be_unset() {
    let fake = FakeOpenAi::start().await;
    fake.push_all([Reply::text("a"), Reply::text("b"), Reply::text("c")]);
    let call = |m: OpenAiModel| async move { m.chat(&req(), &DeltaSink::discard()).await.unwrap() };
    call(builder(&fake, false).build().unwrap()).await;
    call(builder(&fake, false).max_tokens(100).build().unwrap()).await;
    call(builder(&fake, false).no_max_tokens().build().unwrap()).await;
    let q = fake.requests();
    assert_eq!(q[0].body["max_tokens"], tether_openai::DEFAULT_MAX_TOKENS);
    assert_eq!(q[1].body["max_tokens"], 100);
    assert!(q[2].body.get("max_tokens").is_none());
    assert!(q[2].body.get("max_completion_tokens").is_none());
}

/// A tool call that never gets a function name used to fail the whole response (and with it
/// the run); now it is that call's error result, and the other call runs.
#[tokio::test]
async fn a_tool_call_without_a_name_is_that_calls_error() {
    for stream in [true, false] {
        let fake = FakeOpenAi::start().await;
        fake.push_all([
            Reply::tool_calls(&[("c1", "", r#"{"a":1}"#), ("c2", "add", r#"{"a":2}"#)]),
            Reply::text("done"),
        ]);
        let model = OpenAiModel::builder(fake.url())
            .model("m")
            .stream(stream)
            .build()
            .unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let sleeper = RecordingSleeper::default();
        let r = Session::builder(local(model, &sleeper))
            .handler(tools(calls.clone()))
            .run("go")
            .await
            .unwrap();
        assert_eq!(r.text, "done", "stream {stream}");
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        let m = fake.requests()[1].messages().to_vec();
        let c1 = m.iter().find(|m| m["tool_call_id"] == "c1").expect("c1 answered");
        assert!(
            c1["content"]
                .as_str()
                .unwrap_or_default()
                .contains("no tool name"),
            "{c1}"
        );
        let c2 = m.iter().find(|m| m["tool_call_id"] == "c2").expect("c2 answered");
        assert!(
            c2["content"]
                .as_str()
                .unwrap_or_default()
                .starts_with("add result")
        );
    }
}
