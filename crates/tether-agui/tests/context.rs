//! RunContext, handles and the run driver, end to end through `run_agent`.

mod common;

use common::*;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tether_agui::{AgUiError, AgUiEvent, Interrupt, RunOutcome, TokenUsage};

#[derive(Deserialize)]
struct Query {
    city: String,
}

agent!(Weather, (), |ctx| {
    ctx.say("Let me check.")?;
    let mut call = ctx.tool_call("get_weather")?;
    call.args(r#"{"city":"#)?;
    call.args(r#""Seoul"}"#)?;
    let q: Query = call.parse_args()?;
    assert_eq!(q.city, "Seoul");
    call.result(r#"{"tempC":21}"#)?;
    ctx.add_usage({
        let mut v = TokenUsage::default();
        v.input_tokens = Some(10);
        v.output_tokens = Some(5);
        v
    });
    Ok(RunOutcome::Success)
});

#[tokio::test]
async fn tool_call_attaches_to_the_assistant_message_and_results_after_end() {
    let events = run(Weather, input()).await;
    assert_eq!(
        to_json(&events),
        vec![
            json!({"type":"RUN_STARTED","threadId":"t1","runId":"r1","protocolVersion":"1.0"}),
            json!({"type":"TEXT_MESSAGE_START","messageId":"r1-msg-1"}),
            json!({"type":"TEXT_MESSAGE_CONTENT","messageId":"r1-msg-1","delta":"Let me check."}),
            json!({"type":"TEXT_MESSAGE_END","messageId":"r1-msg-1"}),
            json!({"type":"TOOL_CALL_START","toolCallId":"r1-call-2","toolCallName":"get_weather","parentMessageId":"r1-msg-1"}),
            json!({"type":"TOOL_CALL_ARGS","toolCallId":"r1-call-2","delta":"{\"city\":"}),
            json!({"type":"TOOL_CALL_ARGS","toolCallId":"r1-call-2","delta":"\"Seoul\"}"}),
            json!({"type":"TOOL_CALL_END","toolCallId":"r1-call-2"}),
            json!({"type":"TOOL_CALL_RESULT","messageId":"r1-msg-3","toolCallId":"r1-call-2","content":"{\"tempC\":21}","role":"tool"}),
            json!({"type":"RUN_FINISHED","threadId":"t1","runId":"r1","usage":[{"inputTokens":10,"outputTokens":5}]}),
        ]
    );
}

agent!(DropsHandles, (), |ctx| {
    {
        let mut m = ctx.message()?;
        m.delta("partial")?;
        // dropped without end()
    }
    {
        let mut r = ctx.reasoning()?;
        r.delta("thinking")?;
    }
    {
        let mut step = ctx.step("plan")?;
        let _call = step.tool_call("lookup")?;
        // `?` out of here would still close both
    }
    Err(AgUiError::agent("BOOM", "the model failed"))
});

#[tokio::test]
async fn drop_closes_everything_and_errors_become_run_error() {
    let events = run(DropsHandles, input()).await;
    assert_eq!(
        types(&events),
        [
            "RUN_STARTED",
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_END",
            "REASONING_START",
            "REASONING_MESSAGE_START",
            "REASONING_MESSAGE_CONTENT",
            "REASONING_MESSAGE_END",
            "REASONING_END",
            "STEP_STARTED",
            "TOOL_CALL_START",
            "TOOL_CALL_END",
            "STEP_FINISHED",
            "RUN_ERROR",
        ]
    );
    assert_eq!(
        to_json(&events).last().unwrap(),
        &json!({"type":"RUN_ERROR","message":"the model failed","code":"BOOM"})
    );
}

agent!(FrontendCall, (), |ctx| {
    let call = ctx.tool_call("confirm")?;
    call.end()?;
    Ok(RunOutcome::Success)
});

#[tokio::test]
async fn calls_ended_without_result_are_pending() {
    let events = run(FrontendCall, input()).await;
    let last = to_json(&events).pop().unwrap();
    assert_eq!(
        last,
        json!({"type":"RUN_FINISHED","threadId":"t1","runId":"r1",
               "outcome":{"type":"success","pendingToolCallIds":["r1-call-1"]}})
    );
    // With no preceding text, the call still names a parent message (the client creates it).
    assert_eq!(
        to_json(&events)[1],
        json!({"type":"TOOL_CALL_START","toolCallId":"r1-call-1","toolCallName":"confirm","parentMessageId":"r1-msg-2"})
    );
}

agent!(Violates, (), |ctx| {
    ctx.say("ok")?;
    let err = ctx
        .emit(AgUiEvent::text_message_content("ghost", "boo"))
        .unwrap_err();
    assert!(matches!(err, AgUiError::Verification(_)));
    // Everything after the violation is refused.
    assert!(ctx.say("more").is_err());
    Ok(RunOutcome::Success)
});

#[tokio::test]
async fn a_violation_becomes_exactly_one_run_error() {
    let events = run(Violates, input()).await;
    assert_eq!(
        types(&events),
        [
            "RUN_STARTED",
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_END",
            "RUN_ERROR"
        ]
    );
    let last = to_json(&events).pop().unwrap();
    assert_eq!(last["code"], "AGUI_NOT_OPEN");
    assert!(last["message"].as_str().unwrap().contains("ghost"));
}

agent!(ResultBeforeEnd, (), |ctx| {
    ctx.emit(AgUiEvent::tool_call_start("c1", "x", None))?;
    ctx.emit(AgUiEvent::tool_call_result("m9", "c1", "early"))?;
    Ok(RunOutcome::Success)
});

#[tokio::test]
async fn result_before_end_is_caught() {
    let events = run(ResultBeforeEnd, input()).await;
    let last = to_json(&events).pop().unwrap();
    assert_eq!(last["type"], "RUN_ERROR");
    assert_eq!(last["code"], "AGUI_RESULT_BEFORE_END");
}

agent!(LeavesOpen, (), |ctx| {
    ctx.emit(AgUiEvent::text_message_start(
        "m1",
        tether_agui::event::TextMessageRole::Assistant,
    ))?;
    Ok(RunOutcome::Success)
});

#[tokio::test]
async fn open_items_at_finish_turn_into_run_error() {
    let events = run(LeavesOpen, input()).await;
    let last = to_json(&events).pop().unwrap();
    assert_eq!(last["type"], "RUN_ERROR");
    assert_eq!(last["code"], "AGUI_OPEN_AT_FINISH");
}

#[derive(Default, Serialize, Deserialize)]
struct Board {
    tasks: Vec<String>,
    title: String,
}

agent!(Stateful, Board, |ctx| {
    let mut call = ctx.tool_call("add_task")?;
    call.args_json(&json!({"title": "ship it"}))?;
    call.state_mut().tasks.push("ship it".to_owned());
    call.state_mut().tasks.push("write the release notes".to_owned());
    call.state_mut()
        .tasks
        .push("tag the release candidate".to_owned());
    call.publish_state()?; // snapshot, with the call open
    call.result_json(&json!({"ok": true}))?;
    assert_eq!(ctx.state().tasks[0], "ship it");
    ctx.state_mut().title = "v1".into();
    ctx.publish_state()?; // delta
    ctx.publish_state()?; // unchanged: nothing
    Ok(RunOutcome::Success)
});

#[tokio::test]
async fn state_snapshot_then_delta_then_nothing() {
    let events = run(Stateful, input()).await;
    let json = to_json(&events);
    let state: Vec<&Value> = json
        .iter()
        .filter(|e| e["type"].as_str().unwrap().starts_with("STATE_"))
        .collect();
    assert_eq!(state.len(), 2);
    assert_eq!(
        state[0],
        &json!({"type":"STATE_SNAPSHOT","snapshot":{"tasks":["ship it","write the release notes","tag the release candidate"],"title":""}})
    );
    assert_eq!(
        state[1],
        &json!({"type":"STATE_DELTA","delta":[{"op":"replace","path":"/title","value":"v1"}]})
    );
    // The snapshot went out between START and END of the call.
    let t = types(&events);
    let snap = t.iter().position(|t| *t == "STATE_SNAPSHOT").unwrap();
    assert_eq!(t[snap - 2], "TOOL_CALL_START");
    assert_eq!(t[snap + 1], "TOOL_CALL_END");
}

#[test]
fn a_delta_is_used_only_when_smaller_than_the_snapshot() {
    let old = json!({"a": 1});
    let new = json!({"b": 2});
    // patch: remove /a + add /b is bigger than {"b":2}
    let e = tether_agui::state_update(Some(&old), &new).unwrap().unwrap();
    assert_eq!(e.event_type().as_str(), "STATE_SNAPSHOT");
    assert!(tether_agui::state_update(Some(&new), &new).unwrap().is_none());
}

agent!(Interrupts, (), |ctx| {
    if let Some(answer) = ctx.resume_for("i1") {
        let approved = answer.payload.as_ref().and_then(|p| p["approved"].as_bool());
        ctx.say(format!("approved: {approved:?}"))?;
        return Ok(RunOutcome::Success);
    }
    Ok(RunOutcome::interrupt(vec![
        Interrupt::new("i1", "approval").with_message("delete the file?"),
    ]))
});

#[tokio::test]
async fn interrupt_and_resume() {
    let events = run(Interrupts, input()).await;
    assert_eq!(
        to_json(&events).pop().unwrap(),
        json!({"type":"RUN_FINISHED","threadId":"t1","runId":"r1",
               "outcome":{"type":"interrupt","interrupts":[{"id":"i1","reason":"approval","message":"delete the file?"}]}})
    );
    let mut resumed = input();
    resumed.run_id = "r2".into();
    resumed.resume = vec![
        serde_json::from_value(json!({"interruptId":"i1","status":"resolved","payload":{"approved":true}}))
            .unwrap(),
    ];
    let events = run(Interrupts, resumed).await;
    assert_eq!(to_json(&events)[2]["delta"], "approved: Some(true)");
}

agent!(DuplicateInterrupts, (), |_ctx| {
    Ok(RunOutcome::interrupt(vec![
        Interrupt::new("i1", "a"),
        Interrupt::new("i1", "b"),
    ]))
});

#[tokio::test]
async fn duplicate_interrupt_ids_are_refused() {
    let events = run(DuplicateInterrupts, input()).await;
    let last = to_json(&events).pop().unwrap();
    assert_eq!(last["type"], "RUN_ERROR");
    assert_eq!(last["code"], "AGUI_INVALID_EVENT");
}

agent!(TwoRuns, (), |ctx| {
    ctx.say("first")?;
    ctx.next_run(RunOutcome::Success, "r1-b")?;
    ctx.say("second")?;
    Ok(RunOutcome::Success)
});

#[tokio::test]
async fn sequential_runs_in_one_stream() {
    let events = run(TwoRuns, input()).await;
    assert_eq!(
        types(&events),
        [
            "RUN_STARTED",
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_END",
            "RUN_FINISHED",
            "RUN_STARTED",
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_END",
            "RUN_FINISHED",
        ]
    );
    let json = to_json(&events);
    assert_eq!(json[5]["runId"], "r1-b");
    assert_eq!(json[9]["runId"], "r1-b");
    assert_eq!(json[6]["messageId"], "r1-b-msg-1");
}

agent!(Parallel, (), |ctx| {
    let mut calls = ctx.parallel_tool_calls();
    let a = calls.start("search")?;
    let b = calls.start("fetch")?;
    calls.args(a, r#"{"q":"#)?;
    calls.args(b, r#"{"url":"x"}"#)?;
    calls.args(a, r#""rust"}"#)?;
    calls.end_all()?;
    let q: Value = calls.parse_args(a)?;
    assert_eq!(q["q"], "rust");
    calls.result(a, "found")?;
    calls.result(b, "fetched")?;
    Ok(RunOutcome::Success)
});

#[tokio::test]
async fn interleaved_parallel_calls_share_one_parent() {
    let events = run(Parallel, input()).await;
    assert_eq!(
        types(&events),
        [
            "RUN_STARTED",
            "TOOL_CALL_START",
            "TOOL_CALL_START",
            "TOOL_CALL_ARGS",
            "TOOL_CALL_ARGS",
            "TOOL_CALL_ARGS",
            "TOOL_CALL_END",
            "TOOL_CALL_END",
            "TOOL_CALL_RESULT",
            "TOOL_CALL_RESULT",
            "RUN_FINISHED",
        ]
    );
    let json = to_json(&events);
    assert_eq!(json[1]["parentMessageId"], json[2]["parentMessageId"]);
    assert_eq!(json[10].get("outcome"), None);
}

agent!(Panics, (), |ctx| {
    let _m = ctx.message()?;
    panic!("kaboom");
});

#[tokio::test]
async fn a_panicking_agent_still_ends_the_stream() {
    let events = run(Panics, input()).await;
    assert_eq!(
        types(&events),
        [
            "RUN_STARTED",
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_END",
            "RUN_ERROR"
        ]
    );
    let last = to_json(&events).pop().unwrap();
    assert_eq!(last["code"], "AGENT_PANIC");
    assert!(last["message"].as_str().unwrap().contains("kaboom"));
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Strict {
    count: u32,
}

agent!(StrictState, Strict, |ctx| {
    ctx.state_mut().count += 1;
    ctx.publish_state()?;
    Ok(RunOutcome::Success)
});

#[tokio::test]
async fn input_state_is_typed_and_a_mismatch_is_run_error() {
    let mut i = input();
    i.state = Some(json!({"count": 41}));
    let events = run(StrictState, i).await;
    assert_eq!(to_json(&events)[1]["snapshot"], json!({"count": 42}));

    let mut i = input();
    i.state = Some(json!({"count": "many"}));
    let events = run(StrictState, i).await;
    assert_eq!(types(&events), ["RUN_STARTED", "RUN_ERROR"]);
    assert_eq!(to_json(&events)[1]["code"], "INVALID_STATE");

    // `{}` falls back to the default.
    let mut i = input();
    i.state = Some(json!({}));
    let events = run(StrictState, i).await;
    assert_eq!(to_json(&events)[1]["snapshot"], json!({"count": 1}));
}

/// Notified when `Flood` has made all its attempts to write.
static FLOOD_DONE: tokio::sync::Notify = tokio::sync::Notify::const_new();

agent!(Flood, (), |ctx| {
    for i in 0..100 {
        // Ignores the error on purpose: the run must still end in RUN_ERROR.
        let _ = ctx.say(format!("line {i}"));
    }
    FLOOD_DONE.notify_one();
    Ok(RunOutcome::Success)
});

#[tokio::test]
async fn an_agent_that_outruns_the_buffer_ends_in_run_error() {
    let options = tether_agui::RunOptions::default().with_buffer(8);
    let mut stream = tether_agui::run_agent(std::sync::Arc::new(Flood), input(), options);
    // The agent runs ahead of the (not yet reading) transport, to the end of its writes.
    tokio::time::timeout(std::time::Duration::from_secs(60), FLOOD_DONE.notified())
        .await
        .expect("the agent made its 100 writes");
    let mut events = Vec::new();
    while let Some(e) = futures_util::StreamExt::next(&mut stream).await {
        events.push(e);
    }
    let last = to_json(&events).pop().unwrap();
    assert_eq!(last["type"], "RUN_ERROR");
    assert_eq!(last["code"], "EVENT_BUFFER_FULL");
    assert!(!types(&events).contains(&"RUN_FINISHED"));
}
