//! `EventMapper`: tether session events to the AG-UI events of one run, as `tether serve` and
//! `ThreadAgent` both use it. The mapped stream must pass the verifier and keep every text.

use std::sync::Arc;

use serde_json::{Value, json};
use tether::{EventKind, Role, ToolResult, ToolUse, Usage};
use tether_agui::{
    AgUiEvent, AgUiResult, Agent, EventMapper, RunAgentInput, RunContext, RunOptions, RunOutcome, Verifier,
    run_agent,
};

/// Maps a fixed list of session events.
struct Feed(Vec<tether::Event>);

impl Agent for Feed {
    type State = Value;
    async fn run(&self, ctx: &mut RunContext<Value>) -> AgUiResult<RunOutcome> {
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

async fn run(events: Vec<tether::Event>, input: RunAgentInput) -> Vec<AgUiEvent> {
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

fn json_of(events: &[AgUiEvent]) -> Vec<Value> {
    events.iter().map(|e| serde_json::to_value(e).unwrap()).collect()
}

/// The client's messages after `events`, folded the way `@ag-ui/client@1.0.0`'s
/// `defaultApplyEvents` folds them (`MESSAGES_SNAPSHOT` included), starting from the input's.
fn client_messages(input: &RunAgentInput, events: &[Value]) -> Vec<Value> {
    let mut ms: Vec<Value> = input
        .messages
        .iter()
        .map(|m| serde_json::to_value(m).unwrap())
        .collect();
    let find = |ms: &mut Vec<Value>, id: &Value| ms.iter().position(|m| &m["id"] == id);
    let call_at = |ms: &Vec<Value>, id: &Value| {
        ms.iter().enumerate().find_map(|(i, m)| {
            m["toolCalls"]
                .as_array()
                .and_then(|cs| cs.iter().position(|c| &c["id"] == id))
                .map(|j| (i, j))
        })
    };
    for e in events {
        match e["type"].as_str().unwrap() {
            "TEXT_MESSAGE_START" | "REASONING_MESSAGE_START" if find(&mut ms, &e["messageId"]).is_none() => {
                let role = if e["type"] == "TEXT_MESSAGE_START" {
                    "assistant"
                } else {
                    "reasoning"
                };
                ms.push(json!({"id": e["messageId"], "role": role, "content": ""}));
            }
            "TEXT_MESSAGE_CONTENT" | "REASONING_MESSAGE_CONTENT" => {
                let i = find(&mut ms, &e["messageId"]).expect("content for a known message");
                let c = format!(
                    "{}{}",
                    ms[i]["content"].as_str().unwrap_or(""),
                    e["delta"].as_str().unwrap()
                );
                ms[i]["content"] = json!(c);
            }
            "TOOL_CALL_START" => {
                if call_at(&ms, &e["toolCallId"]).is_some() {
                    continue;
                }
                let call = json!({"id": e["toolCallId"], "type": "function",
                    "function": {"name": e["toolCallName"], "arguments": ""}});
                let parent = &e["parentMessageId"];
                match (!parent.is_null()).then(|| find(&mut ms, parent)).flatten() {
                    Some(i) if ms[i]["role"] == "assistant" => {
                        if ms[i]["toolCalls"].is_null() {
                            ms[i]["toolCalls"] = json!([]);
                        }
                        ms[i]["toolCalls"].as_array_mut().unwrap().push(call);
                    }
                    found => {
                        let id = if found.is_some() || parent.is_null() {
                            e["toolCallId"].clone()
                        } else {
                            parent.clone()
                        };
                        ms.push(json!({"id": id, "role": "assistant", "toolCalls": [call]}));
                    }
                }
            }
            "TOOL_CALL_ARGS" => {
                let (i, j) = call_at(&ms, &e["toolCallId"]).expect("args for a known call");
                let a = &mut ms[i]["toolCalls"][j]["function"]["arguments"];
                *a = json!(format!("{}{}", a.as_str().unwrap(), e["delta"].as_str().unwrap()));
            }
            "TOOL_CALL_RESULT" => {
                ms.push(json!({"id": e["messageId"], "role": "tool", "toolCallId": e["toolCallId"], "content": e["content"]}));
            }
            "MESSAGES_SNAPSHOT" => {
                let snap = e["messages"].as_array().unwrap();
                let has_reasoning = snap.iter().any(|m| m["role"] == "reasoning");
                let mut kept: Vec<Value> = ms
                    .iter()
                    .filter_map(|m| match snap.iter().find(|x| x["id"] == m["id"]) {
                        Some(x) => Some(x.clone()),
                        None if m["role"] == "reasoning" && !has_reasoning => Some(m.clone()),
                        None => None,
                    })
                    .collect();
                for x in snap {
                    if !kept.iter().any(|m| m["id"] == x["id"]) {
                        kept.push(x.clone());
                    }
                }
                ms = kept;
            }
            _ => {}
        }
    }
    ms
}

/// What a provider does, in order.
enum Step {
    Text(&'static str),
    Reasoning(&'static str),
    Start(&'static str),
    Args(&'static str, &'static str),
    End(&'static str),
    Retry,
    /// The durable message: its text and its calls (id, arguments).
    Record(&'static str, &'static [(&'static str, &'static str)]),
}

/// Plays the steps through a real `EventSink` (which shows a retried message once) and maps
/// what a subscriber receives, as `ThreadAgent` and `tether serve` do.
async fn through_the_sink(steps: &[Step], input: RunAgentInput) -> (Vec<Value>, Vec<Value>) {
    let sink = tether::EventSink::detached();
    let mut sub = sink.subscribe(4096).await;
    let live = |kind| tether::Event::new("", "local.delta", Value::Null, kind);
    for s in steps {
        match s {
            Step::Text(d) => {
                sink.emit_live(live(EventKind::TextDelta {
                    message_id: "m1".into(),
                    delta: (*d).into(),
                }))
                .await
            }
            Step::Reasoning(d) => {
                sink.emit_live(live(EventKind::ReasoningDelta {
                    message_id: "m1".into(),
                    delta: (*d).into(),
                }))
                .await
            }
            Step::Start(id) => {
                sink.emit_live(live(EventKind::ToolCallStart {
                    tool_use_id: (*id).into(),
                    name: "f".into(),
                    message_id: Some("m1".into()),
                }))
                .await
            }
            Step::Args(id, d) => {
                sink.emit_live(live(EventKind::ToolCallArgs {
                    tool_use_id: (*id).into(),
                    delta: (*d).into(),
                }))
                .await
            }
            Step::End(id) => {
                sink.emit_live(live(EventKind::ToolCallEnd {
                    tool_use_id: (*id).into(),
                }))
                .await
            }
            Step::Retry => {
                sink.record(
                    "",
                    "local.retry",
                    Value::Null,
                    EventKind::Retry {
                        attempt: 1,
                        delay_ms: 500,
                        error: "the stream ended early".into(),
                    },
                )
                .await
                .unwrap();
            }
            Step::Record(text, calls) => {
                sink.record(
                    "m1",
                    "local.model_response",
                    Value::Null,
                    EventKind::Message {
                        message_id: "m1".into(),
                        role: Role::Assistant,
                        text: (*text).into(),
                        reasoning: None,
                        tool_uses: calls
                            .iter()
                            .map(|(id, args)| ToolUse::from_arguments(*id, "f", args))
                            .collect(),
                    },
                )
                .await
                .unwrap();
            }
        }
    }
    drop(sink);
    let mut events = Vec::new();
    while let Ok(e) = sub.try_recv() {
        events.push(e);
    }
    let out = json_of(&run(events, input.clone()).await);
    let messages = client_messages(&input, &out);
    (out, messages)
}

fn texts(v: &[Value]) -> Vec<(&str, &str)> {
    v.iter()
        .filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT")
        .map(|e| (e["messageId"].as_str().unwrap(), e["delta"].as_str().unwrap()))
        .collect()
}

fn user_input() -> RunAgentInput {
    serde_json::from_value(json!({
        "threadId": "t1", "runId": "r1",
        "messages": [{"id": "u1", "role": "user", "content": "hi"}]
    }))
    .unwrap()
}

#[tokio::test]
async fn a_retry_that_repeats_the_text_goes_on_in_the_same_message() {
    use Step::*;
    let (v, messages) = through_the_sink(
        &[
            Text("partial"),
            Retry,
            Text("partial after"),
            Text(" drop complete"),
            Record("partial after drop complete", &[]),
        ],
        user_input(),
    )
    .await;
    assert_eq!(
        texts(&v),
        [("m1", "partial"), ("m1", " after"), ("m1", " drop complete")]
    );
    let starts = v.iter().filter(|e| e["type"] == "TEXT_MESSAGE_START").count();
    assert_eq!(starts, 1, "one message: {v:#?}");
    let retry = v
        .iter()
        .find(|e| e["type"] == "CUSTOM")
        .expect("the retry is shown");
    assert_eq!(
        (&retry["name"], &retry["value"]["attempt"]),
        (&json!("tether.retry"), &json!(1))
    );
    assert_eq!(
        messages,
        [
            json!({"id": "u1", "role": "user", "content": "hi"}),
            json!({"id": "m1", "role": "assistant", "content": "partial after drop complete"}),
        ]
    );
}

#[tokio::test]
async fn a_retry_that_says_something_else_is_withdrawn_with_a_snapshot() {
    use Step::*;
    let (v, messages) = through_the_sink(
        &[
            Text("partial"),
            Retry,
            Text("something "),
            Text("else"),
            Record("something else", &[]),
        ],
        user_input(),
    )
    .await;
    let snapshot = v
        .iter()
        .find(|e| e["type"] == "MESSAGES_SNAPSHOT")
        .expect("the partial message is withdrawn");
    assert_eq!(
        snapshot["messages"],
        json!([{"id": "u1", "role": "user", "content": "hi"}])
    );
    assert_eq!(
        messages,
        [
            json!({"id": "u1", "role": "user", "content": "hi"}),
            json!({"id": "m1", "role": "assistant", "content": "something else"}),
        ],
        "{v:#?}"
    );
}

#[tokio::test]
async fn a_retried_tool_call_is_shown_once_whether_its_id_is_kept_or_not() {
    use Step::*;
    // Same id, same arguments: the call goes on where it was cut.
    let (v, messages) = through_the_sink(
        &[
            Text("Let me"),
            Start("c1"),
            Args("c1", r#"{"a""#),
            Retry,
            Text("Let me"),
            Start("c1"),
            Args("c1", r#"{"a":1}"#),
            End("c1"),
            Record("Let me", &[("c1", r#"{"a":1}"#)]),
        ],
        user_input(),
    )
    .await;
    assert!(!v.iter().any(|e| e["type"] == "MESSAGES_SNAPSHOT"));
    assert_eq!(messages[1]["toolCalls"][0]["function"]["arguments"], r#"{"a":1}"#);
    assert_eq!(v.last().unwrap()["outcome"]["pendingToolCallIds"], json!(["c1"]));

    // Same id, other arguments; and a new id: the message restarts, the old call is gone.
    for (id, args) in [("c1", r#"{"b":2}"#), ("c2", r#"{"a":1}"#)] {
        let steps = [
            Text("Let me"),
            Start("c1"),
            Args("c1", r#"{"a""#),
            End("c1"),
            Retry,
            Text("Let me"),
            Start(id),
            Args(id, args),
            End(id),
            Record(
                "Let me",
                if id == "c1" {
                    &[("c1", r#"{"b":2}"#)]
                } else {
                    &[("c2", r#"{"a":1}"#)]
                },
            ),
        ];
        let (v, messages) = through_the_sink(&steps, user_input()).await;
        assert!(v.iter().any(|e| e["type"] == "MESSAGES_SNAPSHOT"), "{v:#?}");
        assert_eq!(messages.len(), 2, "{messages:#?}");
        assert_eq!(messages[1]["content"], "Let me");
        assert_eq!(
            messages[1]["toolCalls"],
            json!([{"id": id, "type": "function", "function": {"name": "f", "arguments": args}}])
        );
        assert_eq!(
            v.last().unwrap()["outcome"]["pendingToolCallIds"],
            json!([id]),
            "{v:#?}"
        );
    }
}

#[tokio::test]
async fn restarted_reasoning_is_replaced_in_place() {
    use Step::*;
    let (v, messages) = through_the_sink(
        &[
            Reasoning("think"),
            Text("A"),
            Retry,
            Reasoning("rethink"),
            Text("B"),
            Record("B", &[]),
        ],
        user_input(),
    )
    .await;
    assert_eq!(
        messages,
        [
            json!({"id": "u1", "role": "user", "content": "hi"}),
            json!({"id": "m1-reasoning", "role": "reasoning", "content": "rethink"}),
            json!({"id": "m1", "role": "assistant", "content": "B"}),
        ],
        "{v:#?}"
    );
}

#[tokio::test]
async fn text_sent_after_its_record_is_not_shown_twice() {
    // Managed Agents: the message is recorded whole, then its text is sent live.
    let msg = ev(EventKind::Message {
        message_id: "a1".into(),
        role: Role::Assistant,
        text: "one".into(),
        reasoning: None,
        tool_uses: Vec::new(),
    });
    let events = run(vec![msg, text("a1", "one")], RunAgentInput::new("t1", "r1")).await;
    let v = json_of(&events);
    assert_eq!(texts(&v), [("a1", "one")]);
}

#[tokio::test]
async fn a_message_whose_live_text_was_seen_in_part_ends_whole() {
    // A relay that began following the turn mid-message (on another node) saw only the text's
    // end; the record's message holds it all, and the client must end with all of it.
    let msg = ev(EventKind::Message {
        message_id: "a1".into(),
        role: Role::Assistant,
        text: "Hello, world".into(),
        reasoning: None,
        tool_uses: vec![ToolUse::new("c1", "look", json!({"q": 1}))],
    });
    let input = user_input();
    let events = run(vec![text("a1", ", wor"), text("a1", "ld"), msg], input.clone()).await;
    let v = json_of(&events);
    let client = client_messages(&input, &v);
    let assistant: Vec<&Value> = client.iter().filter(|m| m["role"] == "assistant").collect();
    assert_eq!(assistant.len(), 1, "{client:#?}");
    assert_eq!(assistant[0]["content"], "Hello, world", "{client:#?}");
    assert_eq!(assistant[0]["toolCalls"][0]["id"], "c1", "{client:#?}");

    // Seen whole: nothing withdrawn, nothing sent twice.
    let msg = ev(EventKind::Message {
        message_id: "a1".into(),
        role: Role::Assistant,
        text: "Hello, world".into(),
        reasoning: None,
        tool_uses: Vec::new(),
    });
    let events = run(vec![text("a1", "Hello"), text("a1", ", world"), msg], input).await;
    let v = json_of(&events);
    assert_eq!(texts(&v), [("a1", "Hello"), ("a1", ", world")]);
    assert!(!v.iter().any(|e| e["type"] == "MESSAGES_SNAPSHOT"), "{v:#?}");
}

#[tokio::test]
async fn a_message_whose_live_text_was_seen_from_its_beginning_goes_on_from_there() {
    // A relay got the record's message before the rest of its live text: the client holds the
    // beginning, and gets the rest once, in the same message (no snapshot, nothing sent twice).
    let msg = ev(EventKind::Message {
        message_id: "a1".into(),
        role: Role::Assistant,
        text: "Hello, world".into(),
        reasoning: None,
        tool_uses: Vec::new(),
    });
    let input = user_input();
    let events = run(
        vec![text("a1", "Hel"), text("a1", "lo"), msg, text("a1", ", world")],
        input,
    )
    .await;
    let v = json_of(&events);
    assert_eq!(texts(&v), [("a1", "Hel"), ("a1", "lo"), ("a1", ", world")]);
    assert!(!v.iter().any(|e| e["type"] == "MESSAGES_SNAPSHOT"), "{v:#?}");
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
                usage: Usage::new(3, 4),
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

mod retried {
    //! Property: whatever a failed attempt showed, the client ends holding what a run without the
    //! retry leaves it (the recorded message), and every stream passes the verifier.

    use proptest::prelude::*;

    use super::*;

    /// A message's live events: text, reasoning and tool calls (ids by position).
    fn events_of(parts: &[(u8, String)]) -> Vec<tether::Event> {
        let live = |kind| tether::Event::new("", "local.delta", Value::Null, kind);
        let mut out = Vec::new();
        for (i, (kind, text)) in parts.iter().enumerate() {
            match kind % 3 {
                0 if !text.is_empty() => out.push(live(EventKind::TextDelta {
                    message_id: "m1".into(),
                    delta: text.clone(),
                })),
                1 if !text.is_empty() => out.push(live(EventKind::ReasoningDelta {
                    message_id: "m1".into(),
                    delta: text.clone(),
                })),
                2 => {
                    let id = format!("c{i}");
                    out.push(live(EventKind::ToolCallStart {
                        tool_use_id: id.clone(),
                        name: "f".into(),
                        message_id: Some("m1".into()),
                    }));
                    for ch in text.chars() {
                        out.push(live(EventKind::ToolCallArgs {
                            tool_use_id: id.clone(),
                            delta: ch.to_string(),
                        }));
                    }
                    out.push(live(EventKind::ToolCallEnd { tool_use_id: id }));
                }
                _ => {}
            }
        }
        out
    }

    fn record_of(parts: &[(u8, String)]) -> tether::Event {
        let text: String = parts
            .iter()
            .filter(|p| p.0 % 3 == 0)
            .map(|p| p.1.as_str())
            .collect();
        let tool_uses = parts
            .iter()
            .enumerate()
            .filter(|(_, p)| p.0 % 3 == 2)
            .map(|(i, p)| ToolUse::from_arguments(format!("c{i}"), "f", &p.1))
            .collect();
        tether::Event::new(
            "m1",
            "local.model_response",
            Value::Null,
            EventKind::Message {
                message_id: "m1".into(),
                role: Role::Assistant,
                text,
                reasoning: None,
                tool_uses,
            },
        )
    }

    /// The sink's output for: `shown`, a retry, `again`, the record.
    async fn through(
        shown: &[tether::Event],
        again: &[tether::Event],
        record: tether::Event,
    ) -> (Vec<Value>, Vec<Value>) {
        let sink = tether::EventSink::detached();
        let mut sub = sink.subscribe(4096).await;
        for e in shown {
            sink.emit_live(e.clone()).await;
        }
        if !shown.is_empty() {
            sink.record(
                "",
                "local.retry",
                Value::Null,
                EventKind::Retry {
                    attempt: 1,
                    delay_ms: 0,
                    error: "cut".into(),
                },
            )
            .await
            .unwrap();
        }
        for e in again {
            sink.emit_live(e.clone()).await;
        }
        sink.emit(record).await.unwrap();
        drop(sink);
        let mut events = Vec::new();
        while let Ok(e) = sub.try_recv() {
            events.push(e);
        }
        let out = json_of(&run(events, user_input()).await);
        let messages = client_messages(&user_input(), &out);
        (out, messages)
    }

    fn parts() -> impl Strategy<Value = Vec<(u8, String)>> {
        proptest::collection::vec((0u8..3, "[ab{}]{0,4}"), 0..4)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn the_client_ends_with_the_record(
            first in parts(),
            other in parts(),
            mode in 0u8..3,
            grow in 0usize..8,
            cut in 1usize..64,
        ) {
            let second = match mode {
                0 => first.clone(),
                1 => other,
                _ => {
                    let mut m = first.clone();
                    if let Some(p) = m.get_mut(grow % first.len().max(1)) {
                        p.1.push('b');
                    }
                    m
                }
            };
            let shown = events_of(&first);
            let shown = &shown[..cut.min(shown.len())];
            let again = events_of(&second);
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let (_, want) = rt.block_on(through(&[], &again, record_of(&second)));
            let (out, got) = rt.block_on(through(shown, &again, record_of(&second)));
            // A restarted message's reasoning is emptied in place, not removed: @ag-ui/client
            // keeps every reasoning message when a snapshot lists none, so the last one cannot
            // be withdrawn. It keeps its place (before the text, where reasoning comes), and an
            // empty one may stay: it holds no text. Everything else is exact, in order.
            let split = |ms: &[Value]| {
                let (mut r, o): (Vec<Value>, Vec<Value>) =
                    ms.iter().cloned().partition(|m| m["role"] == "reasoning");
                r.retain(|m| m["content"] != "");
                r.sort_by_key(|m| m["id"].to_string());
                (r, o)
            };
            prop_assert_eq!(split(&got), split(&want), "events: {:#?}", out);
            let pending = |v: &[Value]| v.last().map(|e| e["outcome"]["pendingToolCallIds"].clone());
            let (plain, _) = rt.block_on(through(&[], &again, record_of(&second)));
            prop_assert_eq!(pending(&out), pending(&plain));
        }
    }
}
