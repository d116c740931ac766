//! Streams that stall and models that never stop, against the scripted fakes over real HTTP: a
//! stalled stream fails the attempt after the idle timeout with a transient error (so the retry
//! or reconnect policy applies) instead of hanging until the run's own timeout, and a response
//! is capped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tether::local::LocalLoop;
use tether::{
    ChatMessage, ChatModel, ChatRequest, DeltaSink, Error, RecordingSleeper, RetryPolicy, Session,
    SessionConfig, Terminal, ToolSet, ToolSpec, TransportKind,
};
use tether_anthropic::{ClientConfig, ManagedAgents, ManagedConfig, MessagesModel};
use tether_testkit::anthropic::{FakeMessages, Reply, golden, sse_body};
use tether_testkit::managed::{FakeManaged, ManagedFaults};

fn model(fake: &FakeMessages) -> MessagesModel {
    MessagesModel::new(ClientConfig::new("sk-test").base_url(fake.url()), "claude-test").expect("model")
}

/// The first events of a text message, without its end.
fn head() -> String {
    sse_body(&[
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "usage": {"input_tokens": 3}}}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "partial"}}),
    ])
}

/// A stream that stalls mid-response used to hang until the run's timeout: now the attempt
/// fails after the idle timeout as `Transport{Idle}`, and the loop's retry policy takes it.
#[tokio::test]
async fn a_stalled_messages_stream_fails_the_attempt_and_is_retried() {
    let fake = FakeMessages::start(vec![
        Reply::SseStall(head()),
        Reply::Sse(golden("final_text.sse")),
    ])
    .await;
    let sleeper = RecordingSleeper::default();
    // The idle timeout is what is under test; the run's own timeout is generous.
    let m = model(&fake).stream_idle_timeout(Duration::from_secs(1));
    let lp = LocalLoop::new(m).retry(RetryPolicy::default().with_sleeper(sleeper.clone()));
    let r = Session::builder(lp)
        .timeout(Duration::from_secs(60))
        .run("hi")
        .await
        .expect("the retry succeeds");
    assert_eq!(r.text, "It is sunny in Paris.");
    assert_eq!(fake.requests().len(), 2);
    assert_eq!(sleeper.slept().len(), 1);
    let retry = r
        .events
        .iter()
        .find(|e| e.raw_type == "local.retry")
        .expect("the retry is recorded");
    assert!(
        retry.raw["error"]
            .as_str()
            .unwrap_or_default()
            .contains("stream idle")
    );

    // One call alone: the typed error.
    let fake = FakeMessages::start(vec![Reply::SseStall(head())]).await;
    let e = model(&fake)
        .stream_idle_timeout(Duration::from_millis(300))
        .chat(
            &ChatRequest::new(String::new(), vec![ChatMessage::user("hi")], Vec::new()),
            &DeltaSink::discard(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Transport {
                kind: TransportKind::Idle,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.is_transient());
}

/// A model that never stops is cut at the response cap, once (not retried).
#[tokio::test]
async fn a_messages_model_that_never_stops_is_cut_at_the_cap() {
    let repeat = sse_body(&[
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x".repeat(1000)}}),
    ]);
    let fake = FakeMessages::start(vec![Reply::SseEndless { head: head(), repeat }]).await;
    let sleeper = RecordingSleeper::default();
    let m = model(&fake).max_response_bytes(256 << 10);
    let lp = LocalLoop::new(m).retry(RetryPolicy::default().with_sleeper(sleeper.clone()));
    let e = Session::builder(lp)
        .timeout(Duration::from_secs(60))
        .run("hi")
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::ResponseTooLarge { limit } if limit == 256 << 10),
        "{e:?}"
    );
    assert_eq!(fake.requests().len(), 1);
    assert!(sleeper.slept().is_empty());
}

/// The same bound for endless thinking and tool input.
#[tokio::test]
async fn thinking_and_tool_input_count_against_the_cap() {
    for delta in [
        json!({"type": "thinking_delta", "thinking": "t".repeat(1000)}),
        json!({"type": "input_json_delta", "partial_json": "1".repeat(1000)}),
    ] {
        let block = if delta["type"] == "thinking_delta" {
            json!({"type": "thinking", "thinking": "", "signature": ""})
        } else {
            json!({"type": "tool_use", "id": "toolu_1", "name": "t", "input": {}})
        };
        let head = sse_body(&[
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": []}}),
            json!({"type": "content_block_start", "index": 0, "content_block": block}),
        ]);
        let repeat = sse_body(&[json!({"type": "content_block_delta", "index": 0, "delta": delta})]);
        let fake = FakeMessages::start(vec![Reply::SseEndless { head, repeat }]).await;
        let e = model(&fake)
            .max_response_bytes(64 << 10)
            .chat(
                &ChatRequest::new(String::new(), vec![ChatMessage::user("hi")], Vec::new()),
                &DeltaSink::discard(),
            )
            .await
            .unwrap_err();
        assert!(matches!(e, Error::ResponseTooLarge { .. }), "{e:?}");
    }
}

fn lookup_tools(calls: Arc<AtomicU32>) -> ToolSet {
    ToolSet::new().tool(
        ToolSpec::new("lookup", "Look a key up", json!({"type": "object"})),
        move |input: Value| {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok::<_, String>(format!("value of {}", input["q"].as_str().unwrap_or("?")))
            }
        },
    )
}

/// A Managed Agents stream that goes silent (open, but no event and no heartbeat) while the
/// session goes on: after the idle timeout it counts as dropped (transient), the engine
/// reconnects, and the turn's end is found in history. It used to end the session with a
/// non-transient error after 30 minutes.
#[tokio::test]
async fn a_silent_managed_stream_is_reconnected_and_reconciled() {
    let turns = vec![
        vec![
            json!({"type": "agent.custom_tool_use", "name": "lookup", "input": {"q": "x"}}),
            json!({"type": "session.status_idle", "stop_reason": {"type": "requires_action"}}),
        ],
        vec![
            json!({"type": "agent.message", "content": [{"type": "text", "text": "x is 42."}]}),
            json!({"type": "session.status_idle", "stop_reason": {"type": "end_turn"}}),
        ],
    ];
    let fake = FakeManaged::start(
        turns,
        ManagedFaults {
            stall_after: Some("session.status_running".into()),
            ..ManagedFaults::default()
        },
    )
    .await;
    let mut cfg = ManagedConfig::new(
        ClientConfig::new("sk-test").base_url(fake.url()),
        "agent_1",
        "env_1",
    );
    // The idle timeout is what is under test.
    cfg.stream_idle_timeout = Duration::from_secs(1);
    let sleeper = RecordingSleeper::default();
    let calls = Arc::new(AtomicU32::new(0));
    let r = Session::builder(ManagedAgents::new(cfg).expect("provider"))
        .handler(lookup_tools(calls.clone()))
        .config(SessionConfig::default().with_reconnect(RetryPolicy::default().with_sleeper(sleeper.clone())))
        .timeout(Duration::from_secs(60))
        .run("What is x?")
        .await
        .expect("reconnected");
    assert_eq!(r.terminal, Terminal::EndTurn);
    assert_eq!(r.text, "x is 42.");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(fake.stream_opens(), 2);
    let reconnect = r
        .events
        .iter()
        .find(|e| e.raw_type == "tether.reconnect")
        .expect("the reconnect is recorded");
    assert!(
        reconnect.raw["error"]
            .as_str()
            .unwrap_or_default()
            .contains("stream idle")
    );
}
