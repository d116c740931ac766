//! The verifier: the official client's rules, the server MUSTs it does not check, and
//! proptests for the JSON-Patch diff.

use proptest::prelude::*;
use serde_json::{Value, json};
use tether_agui::{AgUiEvent, Rule, RunAgentInput, Verifier, patch};

fn ev(v: Value) -> AgUiEvent {
    serde_json::from_value(v).expect("test event parses")
}

/// Feeds `events`; returns the rule of the first violation and its index.
fn check(verifier: &mut Verifier, events: &[Value]) -> Option<(usize, Rule)> {
    for (i, e) in events.iter().enumerate() {
        if let Err(v) = verifier.observe(&ev(e.clone())) {
            return Some((i, v.rule));
        }
    }
    None
}

fn rs(run: &str) -> Value {
    json!({"type":"RUN_STARTED","threadId":"t1","runId":run})
}
fn rf(run: &str) -> Value {
    json!({"type":"RUN_FINISHED","threadId":"t1","runId":run})
}

#[test]
fn accepts_conformant_streams() {
    let streams = vec![
        // interleaved messages and calls, unordered events anywhere, sequential runs
        vec![
            rs("r1"),
            json!({"type":"TEXT_MESSAGE_START","messageId":"m1"}),
            json!({"type":"TOOL_CALL_START","toolCallId":"c1","toolCallName":"f","parentMessageId":"m1"}),
            json!({"type":"TEXT_MESSAGE_START","messageId":"m2"}),
            json!({"type":"STATE_SNAPSHOT","snapshot":{}}),
            json!({"type":"TOOL_CALL_ARGS","toolCallId":"c1","delta":"{}"}),
            json!({"type":"TEXT_MESSAGE_END","messageId":"m1"}),
            json!({"type":"TEXT_MESSAGE_END","messageId":"m2"}),
            json!({"type":"TOOL_CALL_END","toolCallId":"c1"}),
            json!({"type":"TOOL_CALL_RESULT","messageId":"m3","toolCallId":"c1","content":"ok"}),
            json!({"type":"REASONING_START","messageId":"x"}),
            json!({"type":"REASONING_MESSAGE_START","messageId":"x","role":"reasoning"}),
            json!({"type":"REASONING_MESSAGE_END","messageId":"x"}),
            json!({"type":"REASONING_END","messageId":"x"}),
            json!({"type":"STEP_STARTED","stepName":"s"}),
            json!({"type":"STEP_FINISHED","stepName":"s"}),
            rf("r1"),
            json!({"type":"RUN_ERROR","message":"late"}),
            rs("r2"),
            rf("r2"),
        ],
        // first event may be RUN_ERROR, then a new run
        vec![json!({"type":"RUN_ERROR","message":"x"}), rs("r1"), rf("r1")],
        // chunks: continuation without id, closed by the next event and by RUN_FINISHED
        vec![
            rs("r1"),
            json!({"type":"TEXT_MESSAGE_CHUNK","messageId":"m1","delta":"a"}),
            json!({"type":"TEXT_MESSAGE_CHUNK","delta":"b"}),
            json!({"type":"TOOL_CALL_CHUNK","toolCallId":"c1","toolCallName":"f","delta":"{"}),
            json!({"type":"TOOL_CALL_CHUNK","delta":"}","toolCallName":"f"}),
            json!({"type":"CUSTOM","name":"x","value":1}),
            json!({"type":"TOOL_CALL_RESULT","messageId":"m2","toolCallId":"c1","content":"ok"}),
            json!({"type":"REASONING_MESSAGE_CHUNK","messageId":"r","delta":"t"}),
            rf("r1"),
        ],
        // subagents
        vec![
            rs("r1"),
            json!({"type":"SUBAGENT_STARTED","subagentRunId":"s1","name":"a"}),
            json!({"type":"TEXT_MESSAGE_START","messageId":"m1","subagentRunId":"s1"}),
            json!({"type":"TEXT_MESSAGE_END","messageId":"m1","subagentRunId":"s1"}),
            json!({"type":"SUBAGENT_FINISHED","subagentRunId":"s1"}),
            rf("r1"),
        ],
    ];
    for s in streams {
        let mut v = Verifier::new();
        assert_eq!(check(&mut v, &s), None, "{s:#?}");
        assert!(v.finish().is_ok());
    }
}

#[test]
fn rejects_what_the_client_rejects_and_what_it_misses() {
    let cases: Vec<(Vec<Value>, usize, Rule)> = vec![
        (
            vec![json!({"type":"TEXT_MESSAGE_START","messageId":"m"})],
            0,
            Rule::FirstEvent,
        ),
        (vec![rs("r1"), rs("r2")], 1, Rule::RunAlreadyActive),
        (
            vec![
                rs("r1"),
                json!({"type":"RUN_ERROR","message":"x"}),
                json!({"type":"CUSTOM","name":"n","value":1}),
            ],
            2,
            Rule::AfterTerminal,
        ),
        (
            vec![
                rs("r1"),
                rf("r1"),
                json!({"type":"TEXT_MESSAGE_START","messageId":"m"}),
            ],
            2,
            Rule::AfterTerminal,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"TEXT_MESSAGE_CONTENT","messageId":"m","delta":"x"}),
            ],
            1,
            Rule::NotOpen,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"TEXT_MESSAGE_START","messageId":"m"}),
                json!({"type":"TEXT_MESSAGE_START","messageId":"m"}),
            ],
            2,
            Rule::DuplicateStart,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"TOOL_CALL_START","toolCallId":"c","toolCallName":"f"}),
                rf("r1"),
            ],
            2,
            Rule::OpenAtFinish,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"REASONING_MESSAGE_CONTENT","messageId":"x","delta":"a"}),
            ],
            1,
            Rule::NotOpen,
        ),
        (
            vec![rs("r1"), json!({"type":"STEP_FINISHED","stepName":"s"})],
            1,
            Rule::NotOpen,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"STEP_STARTED","stepName":"s"}),
                json!({"type":"STEP_STARTED","stepName":"s"}),
            ],
            2,
            Rule::DuplicateStart,
        ),
        // server MUSTs the client does not check
        (
            vec![
                rs("r1"),
                json!({"type":"TOOL_CALL_START","toolCallId":"c","toolCallName":"f"}),
                json!({"type":"TOOL_CALL_RESULT","messageId":"m","toolCallId":"c","content":""}),
            ],
            2,
            Rule::ResultBeforeEnd,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"TOOL_CALL_RESULT","messageId":"m","toolCallId":"zz","content":""}),
            ],
            1,
            Rule::UnknownToolCall,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"RUN_FINISHED","threadId":"t1","runId":"other"}),
            ],
            1,
            Rule::IdMismatch,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"RUN_FINISHED","threadId":"t2","runId":"r1"}),
            ],
            1,
            Rule::IdMismatch,
        ),
        (
            vec![
                rs("r1"),
                rf("r1"),
                json!({"type":"RUN_STARTED","threadId":"t9","runId":"r2"}),
            ],
            2,
            Rule::IdMismatch,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"ACTIVITY_DELTA","messageId":"a","activityType":"x","patch":[]}),
            ],
            1,
            Rule::InvalidEvent,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"STATE_DELTA","delta":[{"op":"add","path":"no-slash","value":1}]}),
            ],
            1,
            Rule::InvalidEvent,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"RUN_FINISHED","threadId":"t1","runId":"r1","outcome":{"type":"interrupt","interrupts":[]}}),
            ],
            1,
            Rule::InvalidEvent,
        ),
        (
            vec![rs("r1"), json!({"type":"TEXT_MESSAGE_CHUNK","delta":"x"})],
            1,
            Rule::InvalidEvent,
        ),
        (
            vec![rs("r1"), json!({"type":"TOOL_CALL_CHUNK","toolCallId":"c"})],
            1,
            Rule::InvalidEvent,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"TEXT_MESSAGE_START","messageId":"m","subagentRunId":"s"}),
                json!({"type":"TEXT_MESSAGE_END","messageId":"m"}),
            ],
            2,
            Rule::OwnerMismatch,
        ),
        (
            vec![rs("r1"), json!({"type":"SUBAGENT_FINISHED","subagentRunId":"s"})],
            1,
            Rule::NotOpen,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"SUBAGENT_STARTED","subagentRunId":"s","name":"a"}),
                rf("r1"),
            ],
            2,
            Rule::OpenAtFinish,
        ),
        (
            vec![
                rs("r1"),
                json!({"type":"TOOL_CALL_START","toolCallId":"c","toolCallName":"f"}),
                json!({"type":"TOOL_CALL_END","toolCallId":"c"}),
                json!({"type":"TOOL_CALL_RESULT","messageId":"m","toolCallId":"c","content":""}),
                json!({"type":"TOOL_CALL_RESULT","messageId":"m2","toolCallId":"c","content":""}),
            ],
            4,
            Rule::DuplicateResult,
        ),
    ];
    for (stream, at, rule) in cases {
        let mut v = Verifier::new();
        assert_eq!(check(&mut v, &stream), Some((at, rule)), "{stream:#?}");
    }
}

#[test]
fn input_bound_rules() {
    let input: RunAgentInput = serde_json::from_value(json!({
        "threadId":"t1","runId":"r1",
        "tools":[{"name":"confirm","description":"d"}],
        "messages":[{"id":"a","role":"assistant","toolCalls":[{"id":"old","type":"function","function":{"name":"f","arguments":"{}"}}]}]
    }))
    .unwrap();
    // wrong run id for the first run
    let mut v = Verifier::for_input(&input);
    assert_eq!(check(&mut v, &[rs("r9")]), Some((0, Rule::IdMismatch)));
    // a result for an unanswered call of the input is fine
    let mut v = Verifier::for_input(&input);
    assert_eq!(
        check(
            &mut v,
            &[
                rs("r1"),
                json!({"type":"TOOL_CALL_RESULT","messageId":"m","toolCallId":"old","content":"x"}),
                rf("r1")
            ]
        ),
        None
    );
    // never a result for a front-end tool
    let mut v = Verifier::for_input(&input);
    assert_eq!(
        check(
            &mut v,
            &[
                rs("r1"),
                json!({"type":"TOOL_CALL_START","toolCallId":"c","toolCallName":"confirm"}),
                json!({"type":"TOOL_CALL_END","toolCallId":"c"}),
                json!({"type":"TOOL_CALL_RESULT","messageId":"m","toolCallId":"c","content":"x"}),
            ]
        ),
        Some((3, Rule::FrontendToolResult))
    );
    // pending calls are tracked
    let mut v = Verifier::for_input(&input);
    check(
        &mut v,
        &[
            rs("r1"),
            json!({"type":"TOOL_CALL_START","toolCallId":"c","toolCallName":"confirm"}),
            json!({"type":"TOOL_CALL_END","toolCallId":"c"}),
        ],
    );
    assert_eq!(v.pending_tool_calls(), vec![tether_agui::ToolCallId::new("c")]);
}

#[test]
fn truncation_is_detected() {
    let mut v = Verifier::new();
    assert_eq!(v.finish().unwrap_err().rule, Rule::Truncated);
    check(&mut v, &[rs("r1")]);
    let err = v.finish().unwrap_err();
    assert_eq!(err.rule, Rule::Truncated);
    assert_eq!(err.code(), "AGUI_TRUNCATED");
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-1000i64..1000).prop_map(|n| json!(n)),
        "[a-z~/\"\\\\é\n]{0,4}".prop_map(Value::String),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-c~/0-9\"é]{0,3}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #[test]
    fn diff_then_apply_reproduces_the_target(a in json_value(), b in json_value()) {
        let ops = patch::diff(&a, &b);
        let mut doc = a.clone();
        patch::apply(&mut doc, &ops).unwrap();
        prop_assert_eq!(&doc, &b);
        for op in &ops {
            prop_assert!(patch::is_valid_pointer(op.path()));
        }
        if a == b {
            prop_assert!(ops.is_empty());
        }
    }

    #[test]
    fn a_state_update_always_brings_the_client_to_the_new_state(a in json_value(), b in json_value()) {
        match tether_agui::state_update(Some(&a), &b).unwrap() {
            None => prop_assert_eq!(&a, &b),
            Some(AgUiEvent::StateSnapshot(s)) => {
                prop_assert_eq!(&s.snapshot, &b);
                let ops = patch::diff(&a, &b);
                prop_assert!(serde_json::to_vec(&ops).unwrap().len() >= serde_json::to_vec(&b).unwrap().len());
            }
            Some(AgUiEvent::StateDelta(d)) => {
                let mut doc = a.clone();
                patch::apply(&mut doc, &d.delta).unwrap();
                prop_assert_eq!(&doc, &b);
                prop_assert!(serde_json::to_vec(&d.delta).unwrap().len() < serde_json::to_vec(&b).unwrap().len());
            }
            Some(other) => prop_assert!(false, "unexpected {:?}", other),
        }
    }
}

/// Replaces the `n`-th leaf (in document order, modulo the leaf count) of `v` with `leaf`.
fn replace_leaf(v: &mut Value, n: &mut usize, leaf: &Value) -> bool {
    match v {
        Value::Array(a) => a.iter_mut().any(|x| replace_leaf(x, n, leaf)),
        Value::Object(m) => m.values_mut().any(|x| replace_leaf(x, n, leaf)),
        other => {
            if *n == 0 {
                *other = leaf.clone();
                true
            } else {
                *n -= 1;
                false
            }
        }
    }
}

fn check_json_update(a: &Value, b: &Value) -> Result<(), TestCaseError> {
    let (x, y) = (serde_json::to_vec(a).unwrap(), serde_json::to_vec(b).unwrap());
    match tether_agui::state_update_json(Some(&x), &y).unwrap() {
        None => prop_assert_eq!(a, b),
        Some(AgUiEvent::StateSnapshot(s)) => prop_assert_eq!(&s.snapshot, b),
        Some(AgUiEvent::StateDelta(d)) => {
            let mut doc = a.clone();
            patch::apply(&mut doc, &d.delta).unwrap();
            prop_assert_eq!(&doc, b);
            prop_assert!(serde_json::to_vec(&d.delta).unwrap().len() < y.len());
        }
        Some(other) => prop_assert!(false, "unexpected {:?}", other),
    }
    Ok(())
}

proptest! {
    #[test]
    fn serialized_state_updates_are_exact(a in json_value(), b in json_value()) {
        check_json_update(&a, &b)?;
    }

    #[test]
    fn one_changed_leaf_is_exact(a in json_value(), n in 0usize..64, leaf in json_value()) {
        let mut b = a.clone();
        let mut k = n;
        replace_leaf(&mut b, &mut k, &leaf);
        check_json_update(&a, &b)?;
    }
}
