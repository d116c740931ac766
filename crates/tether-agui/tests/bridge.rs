//! The bridge over tether's real local loop (scripted model).

mod common;

use std::sync::Arc;

use common::*;
use serde_json::{Value, json};
use tether::{ChatModel, ScriptedModel, Session, ToolSet, ToolSpec, local::LocalLoop};
use tether_agui::{
    Message, PermissionPolicy, RunAgentInput, RunOptions, SessionAgent, run_agent,
    types::{AssistantMessage, ToolCall},
};

/// How long a test waits for something that must happen (generous: a loaded 2-core machine).
const WAIT: std::time::Duration = std::time::Duration::from_secs(60);

fn agent(model: Arc<ScriptedModel>) -> SessionAgent {
    SessionAgent::new(move |_input| {
        let m: Arc<dyn ChatModel> = model.clone();
        Ok(Session::builder(LocalLoop::with_model(m)))
    })
}

fn tools() -> ToolSet {
    ToolSet::new().tool(
        ToolSpec::new("add", "Add a and b", json!({"type": "object"})),
        |input: Value| async move {
            let a = input["a"].as_i64().ok_or("a must be a number")?;
            let b = input["b"].as_i64().ok_or("b must be a number")?;
            Ok::<_, &str>((a + b).to_string())
        },
    )
}

async fn serve(agent: &Arc<SessionAgent>, input: RunAgentInput) -> Vec<Value> {
    let events = run_agent(agent.clone(), input, RunOptions::default())
        .collect_all()
        .await;
    to_json(&events)
}

fn kinds(v: &[Value]) -> Vec<String> {
    v.iter()
        .map(|e| e["type"].as_str().unwrap_or("?").to_owned())
        .collect()
}

#[tokio::test]
async fn plain_text() {
    let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("Hello!"))]));
    let a = Arc::new(agent(model));
    let ev = serve(&a, input()).await;
    assert_eq!(
        kinds(&ev),
        [
            "RUN_STARTED",
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_END",
            "RUN_FINISHED"
        ]
    );
    assert_eq!(ev[2]["delta"], "Hello!");
    assert_eq!(ev[4].get("outcome"), None);
}

#[tokio::test]
async fn backend_tool_call_then_answer() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("c1", "add", r#"{"a":1,"b":2}"#)])),
        Ok(ScriptedModel::text("It is 3.")),
    ]));
    let a = Arc::new(agent(model).handler(tools()));
    let ev = serve(&a, input()).await;
    assert_eq!(
        kinds(&ev),
        [
            "RUN_STARTED",
            "TOOL_CALL_START",
            "TOOL_CALL_ARGS",
            "TOOL_CALL_END",
            "TOOL_CALL_RESULT",
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_END",
            "RUN_FINISHED"
        ]
    );
    assert_eq!(ev[1]["toolCallId"], "c1");
    assert!(ev[1]["parentMessageId"].is_string());
    assert_eq!(ev[4]["content"], "3");
    assert_eq!(ev[6]["delta"], "It is 3.");
}

#[tokio::test]
async fn frontend_tool_pends_then_resumes_the_same_session() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("c1", "confirm", r#"{"q":"ok?"}"#)])),
        Ok(ScriptedModel::text("Confirmed.")),
    ]));
    let a = Arc::new(agent(model.clone()));
    let mut first = input();
    first.tools =
        vec![serde_json::from_value(json!({"name":"confirm","description":"Ask the user"})).unwrap()];
    let ev = serve(&a, first.clone()).await;
    assert_eq!(
        ev.last().unwrap(),
        &json!({"type":"RUN_FINISHED","threadId":"t1","runId":"r1",
                "outcome":{"type":"success","pendingToolCallIds":["c1"]}})
    );
    assert!(!kinds(&ev).contains(&"TOOL_CALL_RESULT".to_owned()));
    // The model saw the front-end tool.
    assert!(model.requests()[0].tools.iter().any(|t| t.name == "confirm"));

    let mut second = first;
    second.run_id = "r2".into();
    let parent = ev[1]["parentMessageId"].as_str().unwrap().to_owned();
    second.messages.push(Message::Assistant(AssistantMessage {
        id: parent.into(),
        tool_calls: Some(vec![ToolCall::new("c1", "confirm", r#"{"q":"ok?"}"#)]),
        ..Default::default()
    }));
    second.messages.push(Message::tool("tm1", "c1", "yes"));
    let ev = serve(&a, second).await;
    assert_eq!(
        kinds(&ev),
        [
            "RUN_STARTED",
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_END",
            "RUN_FINISHED"
        ]
    );
    assert_eq!(ev[2]["delta"], "Confirmed.");
    assert_eq!(a.thread_count(), 1);
    // The model got the tool message as the result of c1.
    let last = model.requests().pop().unwrap();
    let tool_msg = last
        .messages
        .iter()
        .find(|m| m.tool_call_id.as_deref() == Some("c1"));
    assert_eq!(tool_msg.and_then(|m| m.content.clone()).as_deref(), Some("yes"));
}

#[tokio::test]
async fn permission_interrupt_and_resume() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("c1", "add", r#"{"a":2,"b":2}"#)])),
        Ok(ScriptedModel::text("Done: 4.")),
    ]));
    let a = Arc::new(
        agent(model)
            .handler(tools())
            .require_approval(["add"])
            .permission_policy(PermissionPolicy::Interrupt),
    );
    let ev = serve(&a, input()).await;
    let last = ev.last().unwrap();
    assert_eq!(last["outcome"]["type"], "interrupt");
    let interrupt = &last["outcome"]["interrupts"][0];
    assert_eq!(interrupt["reason"], "permission");
    assert_eq!(interrupt["toolCallId"], "c1");
    let interrupt_id = interrupt["id"].as_str().unwrap().to_owned();

    let mut resumed = input();
    resumed.run_id = "r2".into();
    let parent = ev[1]["parentMessageId"].as_str().unwrap().to_owned();
    resumed.messages.push(Message::Assistant(AssistantMessage {
        id: parent.into(),
        tool_calls: Some(vec![ToolCall::new("c1", "add", r#"{"a":2,"b":2}"#)]),
        ..Default::default()
    }));
    resumed.resume = vec![
        serde_json::from_value(
            json!({"interruptId": interrupt_id, "status": "resolved", "payload": {"approved": true}}),
        )
        .unwrap(),
    ];
    let ev = serve(&a, resumed).await;
    assert_eq!(
        kinds(&ev),
        [
            "RUN_STARTED",
            "TOOL_CALL_RESULT",
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_END",
            "RUN_FINISHED"
        ]
    );
    assert_eq!(ev[1]["content"], "4");
}

#[tokio::test]
async fn provider_error_is_run_error() {
    let model = Arc::new(ScriptedModel::new(vec![Err(tether::Error::provider(
        "scripted",
        "the model is overloaded",
    ))]));
    let a = Arc::new(agent(model));
    let ev = serve(&a, input()).await;
    assert_eq!(kinds(&ev), ["RUN_STARTED", "RUN_ERROR"]);
    assert_eq!(ev[1]["code"], "PROVIDER");
    assert!(ev[1]["message"].as_str().unwrap().contains("overloaded"));
}

#[tokio::test]
async fn two_runs_in_one_thread_keep_the_session() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::text("first")),
        Ok(ScriptedModel::text("second")),
    ]));
    let a = Arc::new(agent(model.clone()));
    let ev1 = serve(&a, input()).await;
    let mut next = input();
    next.run_id = "r2".into();
    next.messages
        .push(Message::assistant(ev1[1]["messageId"].as_str().unwrap(), "first"));
    next.messages.push(Message::user("u2", "again"));
    let ev2 = serve(&a, next).await;
    assert_eq!(ev2[2]["delta"], "second");
    assert_ne!(ev1[1]["messageId"], ev2[1]["messageId"]);
    // One session: the second model call saw the first exchange.
    let reqs = model.requests();
    assert_eq!(reqs.len(), 2);
    assert!(reqs[1].messages.len() > reqs[0].messages.len());
}

/// A model whose first call hangs (until its request is cancelled) and whose later calls answer.
/// `entered` is notified when the first call has started.
#[derive(Default)]
struct HangsOnce {
    calls: std::sync::atomic::AtomicUsize,
    entered: tokio::sync::Notify,
}

#[async_trait::async_trait]
impl ChatModel for HangsOnce {
    fn name(&self) -> &str {
        "hangs-once"
    }
    async fn chat(
        &self,
        _req: &tether::ChatRequest,
        _deltas: &tether::DeltaSink,
    ) -> tether::Result<tether::ChatResponse> {
        if self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            self.entered.notify_one();
            std::future::pending::<()>().await;
        }
        Ok(ScriptedModel::text("back"))
    }
}

#[tokio::test]
async fn a_disconnected_run_is_cancelled_and_the_thread_serves_the_next_request() {
    let model = Arc::new(HangsOnce::default());
    let m = model.clone();
    let a = Arc::new(SessionAgent::new(move |_input| {
        let m: Arc<dyn ChatModel> = m.clone();
        Ok(Session::builder(LocalLoop::with_model(m)))
    }));
    let mut stream = run_agent(a.clone(), input(), RunOptions::default());
    let first = futures_util::StreamExt::next(&mut stream).await.unwrap();
    assert_eq!(first.event_type().as_str(), "RUN_STARTED");
    // The model call is under way (and hangs): the client goes away mid-request.
    tokio::time::timeout(WAIT, model.entered.notified())
        .await
        .expect("the model call started");
    drop(stream);

    let mut next = input();
    next.run_id = "r2".into();
    next.messages.push(Message::user("u2", "still there?"));
    let ev = tokio::time::timeout(WAIT, serve(&a, next))
        .await
        .expect("the second request must not hang");
    assert_eq!(kinds(&ev).last().unwrap(), "RUN_FINISHED");
    assert_eq!(ev[2]["delta"], "back");
}

#[tokio::test]
async fn a_closed_thread_starts_a_new_session() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::text("one")),
        Ok(ScriptedModel::text("two")),
    ]));
    let a = Arc::new(agent(model.clone()));
    serve(&a, input()).await;
    assert_eq!(a.thread_count(), 1);
    assert!(a.close_thread(&"t1".into()).await);
    assert_eq!(a.thread_count(), 0);
    assert!(!a.close_thread(&"t1".into()).await);
    let ev = serve(&a, input()).await;
    assert_eq!(ev[2]["delta"], "two");
    // A new session: the second model call starts from a fresh history.
    let reqs = model.requests();
    assert_eq!(reqs[1].messages.len(), reqs[0].messages.len());
}
