//! Against the MCP reference server (`@modelcontextprotocol/server-everything`, pinned in
//! `conformance/mcp`), over stdio and over streamable HTTP on 127.0.0.1, through full local-loop
//! sessions on the testkit's fake OpenAI model.

mod common;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use common::*;
use serde_json::{Value, json};
use tether::local::LocalLoop;
use tether::source::{CallContext, SourceOptions, ToolSource, ToolSources, WithTools};
use tether::{
    CancellationToken, ElicitationMode, ElicitationRequest, ElicitationResponse, Error, EventKind, Handler,
    ScriptedModel, Session, SessionInfo, SessionResult, ToolOutput, ToolUse,
};
use tether_mcp::{McpServer, SamplingModel, ServerConfig, Transport};
use tether_openai::OpenAiModel;
use tether_testkit::openai::{FakeOpenAi, Reply};

/// A handler that answers elicitations with a name, and remembers what it was asked.
#[derive(Default, Clone)]
struct Person {
    asked: Arc<Mutex<Vec<ElicitationRequest>>>,
}

#[async_trait]
impl Handler for Person {
    async fn elicit(&self, req: &ElicitationRequest, _info: &SessionInfo) -> ElicitationResponse {
        self.asked.lock().unwrap().push(req.clone());
        ElicitationResponse::Accept {
            content: Some(json!({"name": "Ada Lovelace", "check": true})),
        }
    }
}

const TOOLS: &[&str] = &[
    "echo",
    "get-sum",
    "get-structured-content",
    "get-tiny-image",
    "trigger-elicitation-request",
    "trigger-sampling-request",
    "trigger-long-running-operation",
];

fn result_of(r: &SessionResult, id: &str) -> tether::ToolResult {
    r.events
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::ToolResult { result } if result.tool_use_id == id => Some(result.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no result for {id}"))
}

/// The whole round: tools listed, called by the model through the session, each result as the
/// model sees it.
async fn full_round(t: Transport) {
    let server = connect("everything", t).await;
    wait_for_tools(&server, TOOLS).await;
    let person = Person::default();
    let sources = ToolSources::new()
        .add(server.clone(), SourceOptions::new("everything"))
        .unwrap();
    let handler = WithTools::new(person.clone(), sources).unwrap();
    let names: Vec<String> = handler.tools().into_iter().map(|t| t.name).collect();
    for t in TOOLS {
        assert!(
            names.iter().any(|n| n == t),
            "{t} not declared to the model: {names:?}"
        );
    }

    let fake = FakeOpenAi::start().await;
    fake.push_all([
        Reply::tool_calls(&[
            ("c1", "echo", r#"{"message":"hi there"}"#),
            ("c2", "get-sum", r#"{"a":2,"b":3}"#),
        ]),
        Reply::tool_calls(&[
            ("c3", "get-structured-content", r#"{"location":"Chicago"}"#),
            ("c4", "get-tiny-image", "{}"),
        ]),
        Reply::tool_calls(&[("c5", "trigger-elicitation-request", "{}")]),
        Reply::tool_calls(&[(
            "c6",
            "trigger-sampling-request",
            r#"{"prompt":"hello","maxTokens":10}"#,
        )]),
        Reply::text("done"),
    ]);
    let model = OpenAiModel::builder(fake.url()).model("m").build().unwrap();
    let r = tokio::time::timeout(
        LONG,
        Session::builder(LocalLoop::new(model))
            .handler(handler)
            .max_turns(10)
            .run("go"),
    )
    .await
    .expect("the session ends")
    .expect("the session succeeds");
    assert_eq!(r.text, "done");

    let c1 = result_of(&r, "c1");
    assert_eq!((c1.content.as_str(), c1.is_error), ("Echo: hi there", false));
    assert!(
        result_of(&r, "c2").content.contains("is 5"),
        "{:?}",
        result_of(&r, "c2")
    );
    // Structured content: the text block already holds it as JSON, so it is not repeated.
    let c3 = result_of(&r, "c3").content;
    assert!(c3.contains("Light rain") && c3.contains("36"), "{c3}");
    // The image is described, with the text around it kept in order.
    let c4 = result_of(&r, "c4").content;
    assert!(
        c4.contains("Here's the image")
            && c4.contains("[image content: image/png")
            && c4.contains("The image above is the MCP logo."),
        "{c4}"
    );
    // The server's elicitation reached the handler, and the handler's answer reached the server.
    let c5 = result_of(&r, "c5");
    assert!(c5.content.contains("Ada Lovelace") && !c5.is_error, "{c5:?}");
    let asked = person.asked.lock().unwrap().clone();
    assert_eq!(asked.len(), 1);
    assert!(
        asked[0].message.contains("Please provide inputs"),
        "{:?}",
        asked[0]
    );
    assert!(
        matches!(&asked[0].mode, ElicitationMode::Form { schema } if schema["properties"]["name"].is_object())
    );
    // Sampling is refused by default, and the refusal is the tool's error, with the reason.
    let c6 = result_of(&r, "c6");
    assert!(c6.is_error && c6.content.contains("sampling refused"), "{c6:?}");

    // The model saw exactly these results (what went back over the wire).
    let reqs = fake.requests();
    let last = reqs.last().unwrap().messages();
    let tool_msgs: Vec<&Value> = last.iter().filter(|m| m["role"] == "tool").collect();
    assert_eq!(tool_msgs.len(), 6);
    assert_eq!(tool_msgs[0]["content"], "Echo: hi there");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_full_round_through_a_session() {
    full_round(everything_stdio()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamable_http_full_round_through_a_session() {
    let http = everything_http().await;
    full_round(Transport::Http {
        url: http.url.clone(),
        headers: vec![("X-Test".into(), "1".into())],
    })
    .await;
    drop(http);
}

/// With sampling allowed, the server's request is answered by the model given (the session's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_is_answered_by_the_model_when_allowed() {
    let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("sampled words"))]));
    let cfg = ServerConfig::new("everything", everything_stdio())
        .sampling(SamplingModel::new(model.clone(), "the-model"));
    let server = McpServer::connect(cfg).await.unwrap();
    wait_for_tools(&server, &["trigger-sampling-request"]).await;
    let cx = CallContext::new(SessionInfo::new("s", "test"), Arc::new(tether::NoTools));
    let out = server
        .call(
            &ToolUse::new(
                "u1",
                "trigger-sampling-request",
                json!({"prompt": "hello", "maxTokens": 10}),
            ),
            cx,
        )
        .await;
    match out {
        ToolOutput::Ok(t) => assert!(t.contains("sampled words") && t.contains("the-model"), "{t}"),
        o => panic!("{o:?}"),
    }
    let reqs = model.requests();
    assert_eq!(reqs.len(), 1);
    let texts: Vec<String> = reqs[0]
        .messages
        .iter()
        .filter_map(|m| m.content.clone())
        .collect();
    assert!(
        texts.iter().any(|t| t == "You are a helpful test server."),
        "{texts:?}"
    );
    assert!(texts.iter().any(|t| t.contains("hello")), "{texts:?}");
}

/// Roots are the configured workspace root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roots_are_the_workspace_root() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ServerConfig::new("everything", everything_stdio()).roots(vec![dir.path().to_path_buf()]);
    let server = McpServer::connect(cfg).await.unwrap();
    wait_for_tools(&server, &["get-roots-list"]).await;
    let cx = CallContext::new(SessionInfo::new("s", "test"), Arc::new(tether::NoTools));
    match server
        .call(&ToolUse::new("u1", "get-roots-list", json!({})), cx)
        .await
    {
        ToolOutput::Ok(t) => assert!(t.contains(&format!("file://{}", dir.path().display())), "{t}"),
        o => panic!("{o:?}"),
    }
}

/// A long-running tool reports progress into the session, and cancelling the turn stops the
/// call at once (the engine drops the call; the source sends `notifications/cancelled`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_running_tool_is_cancelled_with_the_turn() {
    let server = connect("everything", everything_stdio()).await;
    wait_for_tools(&server, &["trigger-long-running-operation"]).await;
    let sources = ToolSources::new()
        .add(server.clone(), SourceOptions::new("everything"))
        .unwrap();
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[(
        "long1",
        "trigger-long-running-operation",
        r#"{"duration":120,"steps":240}"#,
    )]));
    let model = OpenAiModel::builder(fake.url()).model("m").build().unwrap();
    let mut s = Session::builder(LocalLoop::new(model))
        .handler(WithTools::new(tether::NoTools, sources).unwrap())
        .open()
        .await
        .unwrap();
    let mut events = s.sink().subscribe(256).await;
    let cancel = CancellationToken::new();
    let run = s.send_cancellable("go", cancel.clone());
    tokio::pin!(run);
    // Progress from the server arrives as a session event about the call.
    tokio::time::timeout(LONG, async {
        loop {
            tokio::select! {
                r = &mut run => panic!("the run ended before progress: {r:?}"),
                e = events.recv() => {
                    let e = e.expect("events");
                    if e.raw_type == "mcp.progress" {
                        assert!(matches!(&e.kind, EventKind::ToolCallUpdate { tool_use_id, .. } if tool_use_id == "long1"));
                        assert_eq!(e.raw["server"], "everything");
                        return;
                    }
                }
            }
        }
    })
    .await
    .expect("a progress event");
    cancel.cancel();
    let r = tokio::time::timeout(LONG, run)
        .await
        .expect("the cancel ends the run");
    assert!(matches!(r, Err(Error::Cancelled)), "{r:?}");
    // The server is still usable after the cancelled call.
    let cx = CallContext::new(SessionInfo::new("s", "test"), Arc::new(tether::NoTools));
    let out = server
        .call(&ToolUse::new("e2", "echo", json!({"message": "still here"})), cx)
        .await;
    assert_eq!(out, ToolOutput::Ok("Echo: still here".into()));
}
