//! `EventMapper`: tether session events to the AG-UI events of one run, as `tether serve` and
//! `SessionAgent` both use it. The mapped stream must pass the verifier and keep every text.

use std::sync::Arc;

use serde_json::{Value, json};
use tether::{EventKind, Role, ToolResult, ToolUse, Usage};
use tether_agui::{
    Agent, Event, EventMapper, Result, RunAgentInput, RunContext, RunOptions, RunOutcome, Verifier, run_agent,
};

/// Maps a fixed list of session events.
struct Feed(Vec<tether::Event>);

impl Agent for Feed {
    type State = Value;
    async fn run(&self, ctx: &mut RunContext<Value>) -> Result<RunOutcome> {
        let mut m = EventMapper::new(ctx.input()).model("m1");
        for e in &self.0 {
            m.map(ctx, e)?;
        }
        m.close(ctx)?;
        Ok(RunOutcome::Success)
    }
}

fn ev(kind: EventKind) -> tether::Event {
    tether::Event::new("", "test", Value::Null, kind)
}

fn text(id: &str, delta: &str) -> tether::Event {
    ev(EventKind::TextDelta {
        message_id: id.into(),
        delta: delta.into(),
    })
}

async fn run(events: Vec<tether::Event>, input: RunAgentInput) -> Vec<Event> {
    // The input's calls are known to the run (a result may answer one of them).
    let mut v = Verifier::for_input(&input);
    let out = run_agent(Arc::new(Feed(events)), input, RunOptions::default())
        .collect_all()
        .await;
    for e in &out {
        v.observe(e)
            .unwrap_or_else(|err| panic!("{e:?} rejected: {err} in {out:#?}"));
    }
    v.finish().unwrap();
    out
}

fn json_of(events: &[Event]) -> Vec<Value> {
    events.iter().map(|e| serde_json::to_value(e).unwrap()).collect()
}

#[tokio::test]
async fn a_text_streamed_again_after_a_retry_is_kept_under_a_fresh_id() {
    // A retried model call streams its message again from the start, under the same id: the
    // retry closes the partial message, the new stream is a message of its own.
    let events = run(
        vec![
            text("m1", "Hel"),
            ev(EventKind::Retry {
                attempt: 1,
                delay_ms: 500,
                error: "reset".into(),
            }),
            text("m1", "Hello"),
            text("m1", " there"),
        ],
        RunAgentInput::new("t1", "r1"),
    )
    .await;
    let v = json_of(&events);
    let contents: Vec<(&str, &str)> = v
        .iter()
        .filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT")
        .map(|e| (e["messageId"].as_str().unwrap(), e["delta"].as_str().unwrap()))
        .collect();
    assert_eq!(contents[0], ("m1", "Hel"));
    let second = contents[1].0;
    assert_ne!(second, "m1", "the second stream gets its own id");
    assert_eq!(contents[1..], [(second, "Hello"), (second, " there")]);
    let retry = v
        .iter()
        .find(|e| e["type"] == "CUSTOM")
        .expect("the retry is shown");
    assert_eq!(retry["name"], "tether.retry");
    assert_eq!(retry["value"]["attempt"], 1);
}

#[tokio::test]
async fn results_are_shown_for_calls_of_this_run_or_unanswered_in_the_input_once() {
    let input: RunAgentInput = serde_json::from_value(json!({
        "threadId": "t1", "runId": "r2",
        "messages": [
            {"id": "a0", "role": "assistant", "toolCalls": [
                {"id": "old", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "done", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ]},
            {"id": "t0", "role": "tool", "toolCallId": "done", "content": "already here"}
        ]
    }))
    .unwrap();
    let result = |id: &str| {
        ev(EventKind::ToolResult {
            result: ToolResult::ok(id, format!("result of {id}")),
        })
    };
    let events = run(
        vec![
            result("old"),
            result("done"),
            result("stranger"),
            ev(EventKind::Message {
                message_id: "m1".into(),
                role: Role::Assistant,
                text: "calling".into(),
                reasoning: None,
                tool_uses: vec![ToolUse::new("c1", "f", json!({"x": 1}))],
            }),
            result("c1"),
            result("c1"),
            ev(EventKind::Usage {
                usage: Usage {
                    input_tokens: 3,
                    output_tokens: 4,
                    ..Default::default()
                },
            }),
        ],
        input,
    )
    .await;
    let v = json_of(&events);
    let results: Vec<&str> = v
        .iter()
        .filter(|e| e["type"] == "TOOL_CALL_RESULT")
        .map(|e| e["toolCallId"].as_str().unwrap())
        .collect();
    assert_eq!(results, ["old", "c1"]);
    let text: String = v
        .iter()
        .filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text, "calling", "a message that arrived whole is sent whole");
    let args: Vec<&str> = v
        .iter()
        .filter(|e| e["type"] == "TOOL_CALL_ARGS")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(args, [r#"{"x":1}"#]);
    let fin = v.last().unwrap();
    assert_eq!(fin["type"], "RUN_FINISHED");
    let usage = serde_json::to_string(fin).unwrap();
    assert!(
        usage.contains("m1") && usage.contains('7'),
        "usage with the model: {fin}"
    );
}
