//! `ThreadAgent` over tether's real local loop (scripted model) and a scripted remote loop that
//! asks permission mid-turn, on the in-memory thread store.

mod common;

use std::sync::Arc;

use common::*;
use serde_json::{Value, json};
use tether::{ChatModel, MemoryStore, ScriptedModel, Session, ToolSet, ToolSpec, local::LocalLoop};
use tether_agui::{
    Message, RunAgentInput, RunOptions, ThreadAgent, run_agent,
    types::{AssistantMessage, ToolCall},
};

/// How long a test waits for something that must happen (generous: a loaded 2-core machine).
const WAIT: std::time::Duration = std::time::Duration::from_secs(60);

fn agent(model: Arc<ScriptedModel>) -> ThreadAgent {
    agent_with(model, ToolSet::new())
}

fn agent_with(model: Arc<ScriptedModel>, tools: ToolSet) -> ThreadAgent {
    ThreadAgent::new("a", Arc::new(MemoryStore::default()), move |_input| {
        let m: Arc<dyn ChatModel> = model.clone();
        Ok(Session::builder(LocalLoop::with_model(m)).handler(tools.clone()))
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

async fn serve(agent: &Arc<ThreadAgent>, input: RunAgentInput) -> Vec<Value> {
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
    let a = Arc::new(agent_with(model, tools()));
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
    let a = Arc::new(agent_with(model, tools()).require_approval(["add"]));
    let ev = serve(&a, input()).await;
    let last = ev.last().unwrap();
    assert_eq!(last["outcome"]["type"], "interrupt");
    let interrupt = &last["outcome"]["interrupts"][0];
    assert_eq!(interrupt["reason"], "approval");
    assert_eq!(interrupt["toolCallId"], "c1");
    let interrupt_id = interrupt["id"].as_str().unwrap().to_owned();
    assert!(
        interrupt_id.starts_with("approval_") && interrupt_id.len() == 41,
        "{interrupt_id}"
    );

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
    let a = Arc::new(ThreadAgent::new(
        "a",
        Arc::new(MemoryStore::default()),
        move |_input| {
            let m: Arc<dyn ChatModel> = m.clone();
            Ok(Session::builder(LocalLoop::with_model(m)))
        },
    ));
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
async fn a_kept_session_serves_the_next_request_without_a_resume() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::text("one")),
        Ok(ScriptedModel::text("two")),
    ]));
    let a = Arc::new(agent(model.clone()).keep_alive(1));
    serve(&a, input()).await;
    assert_eq!(a.live_threads(), 1, "kept open");
    let mut next = input();
    next.run_id = "r2".into();
    next.messages.push(Message::user("u2", "again"));
    let ev = serve(&a, next).await;
    assert_eq!(ev[2]["delta"], "two");
    let reqs = model.requests();
    assert!(reqs[1].messages.len() > reqs[0].messages.len());
    // Another thread: the least recently used one is closed.
    let mut other = input();
    other.thread_id = "t2".into();
    let model2 = model.clone();
    let _ = model2;
    assert_eq!(a.live_threads(), 1);
}

/// A remote loop that asks permission in the middle of its turn (as an ACP agent or a Managed
/// Agents tool confirmation does), then says what it was told.
struct Asker {
    outcomes: Arc<std::sync::Mutex<Vec<tether::PermissionOutcome>>>,
}

#[async_trait::async_trait]
impl tether::Provider for Asker {
    fn name(&self) -> &str {
        "asker"
    }
    async fn open(&mut self, _cx: &tether::TurnContext) -> tether::Result<tether::Opened> {
        Ok(tether::Opened::new("r-1"))
    }
    async fn resume(
        &mut self,
        from: tether::Resume<'_>,
        _cx: &tether::TurnContext,
    ) -> tether::Result<tether::Opened> {
        Ok(tether::Opened::resumed(from.session_id.unwrap_or_default()))
    }
    async fn turn(
        &mut self,
        input: tether::Input,
        cx: &tether::TurnContext,
    ) -> tether::Result<tether::TurnResult> {
        let tether::Input::Message(_) = input else {
            return Ok(tether::TurnResult::new(tether::Terminal::EndTurn, "stop"));
        };
        let req = tether::PermissionRequest::new("call_2", "Modify config.json")
            .with_input(json!({"path": "config.json"}))
            .with_kind("edit")
            .with_options(vec![
                tether::PermissionOption::new("allow", "Allow", tether::PermissionKind::AllowOnce),
                tether::PermissionOption::new("reject", "Skip", tether::PermissionKind::RejectOnce),
            ]);
        let outcome = cx.handler.request_permission(&req, &cx.info()).await;
        self.outcomes.lock().unwrap().push(outcome.clone());
        let text = if outcome.allows(&req) {
            "allowed"
        } else {
            "refused"
        };
        let n = self.outcomes.lock().unwrap().len();
        cx.sink
            .emit(tether::Event::new(
                format!("asker-{n}"),
                "asker.message",
                json!({"text": text}),
                tether::EventKind::Message {
                    message_id: format!("asker-m{n}"),
                    role: tether::Role::Assistant,
                    text: text.into(),
                    reasoning: None,
                    tool_uses: vec![],
                },
            ))
            .await?;
        let mut t = tether::TurnResult::new(tether::Terminal::EndTurn, "end_turn");
        t.text = text.into();
        Ok(t)
    }
}

fn asker(
    store: Arc<MemoryStore>,
    outcomes: Arc<std::sync::Mutex<Vec<tether::PermissionOutcome>>>,
) -> ThreadAgent {
    ThreadAgent::new("a", store, move |_input| {
        Ok(Session::builder(Asker {
            outcomes: outcomes.clone(),
        }))
    })
}

fn resume_with(id: &str, payload: Value) -> RunAgentInput {
    let mut i = input();
    i.run_id = "r2".into();
    i.resume = vec![
        serde_json::from_value(json!({"interruptId": id, "status": "resolved", "payload": payload})).unwrap(),
    ];
    i
}

/// A permission request mid-turn ends the run with an approval interrupt while the turn waits
/// (the session held live); the next request's resume answers it and the turn goes on.
#[tokio::test]
async fn a_mid_turn_permission_request_is_an_interrupt_and_its_resume_answers_it() {
    let store = Arc::new(MemoryStore::default());
    let outcomes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let a = Arc::new(asker(store, outcomes.clone()));
    let ev = serve(&a, input()).await;
    let last = ev.last().unwrap();
    assert_eq!(last["outcome"]["type"], "interrupt", "{ev:?}");
    let i = &last["outcome"]["interrupts"][0];
    assert_eq!(i["reason"], "approval");
    assert_eq!(i["metadata"]["options"][0]["id"], "allow");
    let id = i["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("approval_") && id.len() == 41, "{id}");
    assert_eq!(a.live_threads(), 1, "the turn waits, held live");
    assert!(outcomes.lock().unwrap().is_empty());

    // Forged and predictable ids are refused, at admission and in the run; the question still waits.
    for forged in ["t1-permission-1", "approval_00000000000000000000000000000000"] {
        let bad = resume_with(forged, json!({"approved": true}));
        assert!(matches!(
            a.check_resume(&bad).await,
            Err(tether_agui::CheckError::Refused(_))
        ));
        let ev = serve(&a, bad).await;
        assert_eq!(ev.last().unwrap()["code"], "INTERRUPT_NOT_ISSUED", "{ev:?}");
    }
    assert!(outcomes.lock().unwrap().is_empty(), "nothing was answered");

    let ok = resume_with(&id, json!({"approved": true}));
    a.check_resume(&ok).await.unwrap();
    let ev = serve(&a, ok.clone()).await;
    assert_eq!(ev.last().unwrap()["type"], "RUN_FINISHED", "{ev:?}");
    assert!(ev.iter().any(|e| e["delta"] == "allowed"), "{ev:?}");
    assert_eq!(
        *outcomes.lock().unwrap(),
        [tether::PermissionOutcome::Selected {
            option_id: "allow".into()
        }]
    );
    // Used once: the same answer again is refused.
    let ev = serve(&a, ok).await;
    assert_eq!(ev.last().unwrap()["code"], "INTERRUPT_NOT_ISSUED");
}

/// Anything but `approved: true` refuses.
#[tokio::test]
async fn a_mid_turn_permission_denied_picks_the_refusing_option() {
    let outcomes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let a = Arc::new(asker(Arc::new(MemoryStore::default()), outcomes.clone()));
    let ev = serve(&a, input()).await;
    let id = ev.last().unwrap()["outcome"]["interrupts"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let ev = serve(
        &a,
        resume_with(&id, json!({"approved": "yes", "optionId": "allow"})),
    )
    .await;
    assert!(ev.iter().any(|e| e["delta"] == "refused"), "{ev:?}");
    assert_eq!(
        *outcomes.lock().unwrap(),
        [tether::PermissionOutcome::Selected {
            option_id: "reject".into()
        }]
    );
}

/// After a restart the held turn is gone: its question is recorded as lost, an answer to it is
/// not refused (it was issued) but approves nothing, and the thread goes on.
#[tokio::test]
async fn a_question_held_by_a_process_that_ended_is_recorded_as_lost() {
    use tether::{EventStore, ThreadStore};
    let store = Arc::new(MemoryStore::default());
    let outcomes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let a = Arc::new(asker(store.clone(), outcomes.clone()));
    let ev = serve(&a, input()).await;
    let id = ev.last().unwrap()["outcome"]["interrupts"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    drop(a); // the process that held the turn is gone

    let b = Arc::new(asker(store.clone(), outcomes.clone()));
    let answer = resume_with(&id, json!({"approved": true}));
    b.check_resume(&answer).await.expect("it was issued");
    let ev = serve(&b, answer).await;
    assert_eq!(ev.last().unwrap()["type"], "RUN_FINISHED", "{ev:?}");
    let record = store
        .thread(&tether::ThreadId::new("t1").unwrap())
        .await
        .unwrap()
        .unwrap()
        .record;
    let all = store.load(&record).await.unwrap();
    let lost: Vec<_> = all
        .iter()
        .filter(|e| e.raw_type == tether::raw::QUESTION_LOST)
        .collect();
    assert_eq!(lost.len(), 1, "{all:#?}");
    assert_eq!(lost[0].raw["tool_use_id"], "call_2");
    assert!(
        !outcomes
            .lock()
            .unwrap()
            .iter()
            .any(|o| matches!(o, tether::PermissionOutcome::Selected { option_id } if option_id == "allow")),
        "the lost question approved nothing"
    );
    // Answered once: not again.
    let ev = serve(&b, resume_with(&id, json!({"approved": true}))).await;
    assert_eq!(ev.last().unwrap()["code"], "INTERRUPT_NOT_ISSUED");
}

/// A remote loop whose turn asks the user for input (as a tool's MCP server does through the
/// session's handler), then says what it was told.
struct Elicitor {
    answers: Arc<std::sync::Mutex<Vec<tether::ElicitationResponse>>>,
}

#[async_trait::async_trait]
impl tether::Provider for Elicitor {
    fn name(&self) -> &str {
        "elicitor"
    }
    async fn open(&mut self, _cx: &tether::TurnContext) -> tether::Result<tether::Opened> {
        Ok(tether::Opened::new("e-1"))
    }
    async fn resume(
        &mut self,
        from: tether::Resume<'_>,
        _cx: &tether::TurnContext,
    ) -> tether::Result<tether::Opened> {
        Ok(tether::Opened::resumed(from.session_id.unwrap_or_default()))
    }
    async fn turn(
        &mut self,
        input: tether::Input,
        cx: &tether::TurnContext,
    ) -> tether::Result<tether::TurnResult> {
        let tether::Input::Message(_) = input else {
            return Ok(tether::TurnResult::new(tether::Terminal::EndTurn, "stop"));
        };
        let req = tether::ElicitationRequest::new(
            "Your name?",
            tether::ElicitationMode::Form {
                schema: json!({"type": "object", "properties": {"name": {"type": "string"}}}),
            },
        )
        .with_id("el-1");
        let answer = cx.handler.elicit(&req, &cx.info()).await;
        self.answers.lock().unwrap().push(answer);
        Ok(tether::TurnResult::new(tether::Terminal::EndTurn, "end_turn"))
    }
}

/// An elicitation held by a process that ended is recorded as lost (like a permission request),
/// its answer accepts nothing, and the thread goes on.
#[tokio::test]
async fn an_elicitation_held_by_a_process_that_ended_is_recorded_as_lost() {
    use tether::{EventStore, ThreadStore};
    let store = Arc::new(MemoryStore::default());
    let answers = Arc::new(std::sync::Mutex::new(Vec::new()));
    let make = |store: Arc<MemoryStore>| {
        let answers = answers.clone();
        Arc::new(ThreadAgent::new("a", store, move |_input| {
            Ok(Session::builder(Elicitor {
                answers: answers.clone(),
            }))
        }))
    };
    let a = make(store.clone());
    let ev = serve(&a, input()).await;
    let intr = ev.last().unwrap()["outcome"]["interrupts"][0].clone();
    assert_eq!(intr["reason"], "elicitation", "{ev:?}");
    assert_eq!(intr["message"], "Your name?");
    assert_eq!(intr["metadata"]["elicitationId"], "el-1");
    let id = intr["id"].as_str().unwrap().to_owned();
    drop(a); // the process that held the turn is gone

    let b = make(store.clone());
    let answer = resume_with(&id, json!({"action": "accept", "content": {"name": "Ada"}}));
    b.check_resume(&answer).await.expect("it was issued");
    let ev = serve(&b, answer.clone()).await;
    assert_eq!(ev.last().unwrap()["type"], "RUN_FINISHED", "{ev:?}");
    let record = store
        .thread(&tether::ThreadId::new("t1").unwrap())
        .await
        .unwrap()
        .unwrap()
        .record;
    let all = store.load(&record).await.unwrap();
    let lost: Vec<_> = all
        .iter()
        .filter(|e| e.raw_type == tether::raw::QUESTION_LOST)
        .collect();
    assert_eq!(lost.len(), 1, "{all:#?}");
    assert_eq!(lost[0].raw["kind"], "elicitation");
    assert!(
        !answers
            .lock()
            .unwrap()
            .iter()
            .any(|a| matches!(a, tether::ElicitationResponse::Accept { .. })),
        "the lost question accepted nothing"
    );
    // Answered once: not again.
    let ev = serve(&b, answer).await;
    assert_eq!(ev.last().unwrap()["code"], "INTERRUPT_NOT_ISSUED", "{ev:?}");
}

/// A client slower than the run: the run waits for it (backpressure), however many AG-UI events
/// one of the session's events becomes, and ends as it would for a fast client.
#[tokio::test]
async fn a_slow_client_slows_the_run_and_loses_nothing() {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[
            ("c1", "add", r#"{"a":1,"b":2}"#),
            ("c2", "add", r#"{"a":3,"b":4}"#),
            ("c3", "add", r#"{"a":5,"b":6}"#),
        ])),
        Ok(ScriptedModel::text("3, 7 and 11.")),
    ]));
    let a = Arc::new(agent_with(model, tools()));
    let mut stream = run_agent(a, input(), RunOptions::default().with_buffer(2));
    let mut events = Vec::new();
    loop {
        // The client reads an event only now and then: the run's buffer of two is always full.
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        match std::future::poll_fn(|cx| stream.poll_next_event(cx)).await {
            Some(e) => events.push(e),
            None => break,
        }
    }
    let ev = to_json(&events);
    assert_eq!(
        kinds(&ev),
        [
            "RUN_STARTED",
            "TOOL_CALL_START",
            "TOOL_CALL_ARGS",
            "TOOL_CALL_END",
            "TOOL_CALL_START",
            "TOOL_CALL_ARGS",
            "TOOL_CALL_END",
            "TOOL_CALL_START",
            "TOOL_CALL_ARGS",
            "TOOL_CALL_END",
            "TOOL_CALL_RESULT",
            "TOOL_CALL_RESULT",
            "TOOL_CALL_RESULT",
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_END",
            "RUN_FINISHED"
        ],
        "{ev:#?}"
    );
}

/// A model that streams its pieces one delta each, after `gate` lets it (when it has one).
struct Pieces {
    pieces: &'static [&'static str],
    gate: Option<Arc<tokio::sync::Semaphore>>,
}

#[async_trait::async_trait]
impl ChatModel for Pieces {
    fn name(&self) -> &str {
        "pieces"
    }

    async fn chat(
        &self,
        _req: &tether::ChatRequest,
        deltas: &tether::DeltaSink,
    ) -> tether::Result<tether::ChatResponse> {
        if let Some(g) = &self.gate {
            let _ = g.acquire().await;
        }
        for p in self.pieces {
            deltas.text(p).await;
        }
        Ok(ScriptedModel::text(&self.pieces.concat()))
    }
}

fn paced(model: Pieces, priority: &tether::priority::Priority) -> Arc<ThreadAgent> {
    let model: Arc<dyn ChatModel> = Arc::new(model);
    Arc::new(
        ThreadAgent::new("a", Arc::new(MemoryStore::default()), move |_input| {
            Ok(Session::builder(LocalLoop::with_model(model.clone())))
        })
        .priority(priority.clone()),
    )
}

/// The text of the `TEXT_MESSAGE_CONTENT` events among `ev`.
fn contents(ev: &[Value]) -> Vec<String> {
    ev.iter()
        .filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT")
        .map(|e| e["delta"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// A run counts as starting until its first output; while another run is starting, a streaming
/// run's next deltas wait, and they go on, all of them, once that run has its first output.
#[tokio::test]
async fn with_a_priority_a_stream_waits_for_the_runs_still_starting() {
    let priority = tether::priority::Priority::new(std::time::Duration::from_secs(3600));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let agent = paced(
        Pieces {
            pieces: &["a", "b", "c"],
            gate: Some(gate.clone()),
        },
        &priority,
    );
    // Another run, still starting (what a server's next request would be).
    let other = priority.starting();
    let mut events = run_agent(agent, input(), RunOptions::default());
    // Admitted, no output yet: the run counts as starting too.
    tokio::time::timeout(WAIT, async {
        while priority.waiting() < 2 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the run counted as starting");
    gate.add_permits(1);
    let mut seen = Vec::new();
    while contents(&seen).is_empty() {
        let e = tokio::time::timeout(WAIT, futures_util::StreamExt::next(&mut events))
            .await
            .expect("the first delta")
            .expect("the stream went on");
        seen.extend(to_json(&[e]));
    }
    assert_eq!(contents(&seen), ["a"]);
    assert_eq!(priority.waiting(), 1, "its first output ended the run's start");
    // The other run has no output yet: the stream holds its next delta.
    let held = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        futures_util::StreamExt::next(&mut events),
    )
    .await;
    assert!(
        held.is_err(),
        "a delta went out while another run was starting: {held:?}"
    );
    drop(other);
    let rest = tokio::time::timeout(WAIT, events.collect_all())
        .await
        .expect("the run finished once no run was starting");
    seen.extend(to_json(&rest));
    assert_eq!(contents(&seen).concat(), "abc", "nothing lost");
    assert_eq!(kinds(&seen).last().map(String::as_str), Some("RUN_FINISHED"));
    assert_eq!(priority.waiting(), 0);
}

/// However long other runs keep starting, a stream waits at most the hold per delta.
#[tokio::test(start_paused = true)]
async fn a_stream_waits_at_most_the_hold_per_delta() {
    let hold = std::time::Duration::from_secs(1);
    let priority = tether::priority::Priority::new(hold);
    let agent = paced(
        Pieces {
            pieces: &["a", "b", "c"],
            gate: None,
        },
        &priority,
    );
    let _forever = priority.starting();
    let t0 = tokio::time::Instant::now();
    let ev = serve(&agent, input()).await;
    let took = t0.elapsed();
    assert_eq!(contents(&ev).concat(), "abc");
    assert_eq!(kinds(&ev).last().map(String::as_str), Some("RUN_FINISHED"));
    // Each delta after the first waited the whole hold (the clock is the test's: it moves only
    // when every task waits), and none waited longer.
    assert!(took >= 2 * hold, "the deltas were not held: {took:?}");
    assert!(took <= 3 * hold, "a delta waited past the hold: {took:?}");
    assert_eq!(priority.waiting(), 1, "only the run that never started is left");
}
