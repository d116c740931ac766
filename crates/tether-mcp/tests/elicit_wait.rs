//! Issue 14: a held elicitation is not bounded by the tool call's timeout. The reference server's
//! `trigger-elicitation-request` asks the user mid-call; a user who answers after both the MCP
//! call timeout and the session's tool timeout have passed still gets the call through (the wait
//! is the user's time, not the call's), while an elicitation nobody answers is bounded by its
//! own `elicitation_timeout` (answered `cancel`, and the call then ends normally).
//!
//! The slow user here is a handler that waits on purpose: the timeouts themselves are under test.

mod common;

use std::time::Duration;

use async_trait::async_trait;
use common::*;
use serde_json::json;
use tether::local::LocalLoop;
use tether::source::{SourceOptions, ToolSources, WithTools};
use tether::{
    ElicitationRequest, ElicitationResponse, EventKind, Handler, Session, SessionConfig, SessionInfo,
    SessionResult,
};
use tether_mcp::{McpServer, ServerConfig};
use tether_openai::OpenAiModel;
use tether_testkit::openai::{FakeOpenAi, Reply};

/// A user who answers after `delay` (or never, with `None`).
struct SlowUser(Option<Duration>);

#[async_trait]
impl Handler for SlowUser {
    async fn elicit(&self, _req: &ElicitationRequest, _info: &SessionInfo) -> ElicitationResponse {
        match self.0 {
            Some(d) => {
                tokio::time::sleep(d).await;
                ElicitationResponse::Accept {
                    content: Some(json!({"name": "Ada Lovelace", "check": true})),
                }
            }
            None => std::future::pending().await,
        }
    }
}

fn result_of(r: &SessionResult, id: &str) -> tether::ToolResult {
    r.events
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::ToolResult { result } if result.tool_use_id == id => Some(result.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no result for {id}"))
}

/// One session whose model calls the elicitation tool once: the MCP call timeout is 1 s and the
/// session's tool timeout 2 s.
async fn elicit_once(user: SlowUser, elicitation_timeout: Option<Duration>) -> tether::ToolResult {
    let mut cfg = ServerConfig::new("everything", everything_stdio()).call_timeout(Duration::from_secs(1));
    if let Some(t) = elicitation_timeout {
        cfg = cfg.elicitation_timeout(t);
    }
    let server = McpServer::connect(cfg).await.expect("the server starts");
    wait_for_tools(&server, &["trigger-elicitation-request"]).await;
    let sources = ToolSources::new()
        .add(server.clone(), SourceOptions::new("everything"))
        .unwrap();
    let handler = WithTools::new(user, sources).unwrap();
    let fake = FakeOpenAi::start().await;
    fake.push_all([
        Reply::tool_calls(&[("c1", "trigger-elicitation-request", "{}")]),
        Reply::text("done"),
    ]);
    let model = OpenAiModel::builder(fake.url()).model("m").build().unwrap();
    let r = tokio::time::timeout(
        LONG,
        Session::builder(LocalLoop::new(model))
            .handler(handler)
            .config(
                SessionConfig::default()
                    .with_tool_timeout(Some(Duration::from_secs(2)))
                    .with_max_turns(4),
            )
            .run("go"),
    )
    .await
    .expect("the session ends")
    .expect("the session succeeds");
    assert_eq!(r.text, "done");
    result_of(&r, "c1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_answering_after_the_call_timeout_still_gets_the_call_through() {
    // Answered after 4 s: past the MCP call timeout (1 s) and the tool timeout (2 s).
    let r = elicit_once(SlowUser(Some(Duration::from_secs(4))), None).await;
    assert!(
        !r.is_error && r.content.contains("Ada Lovelace"),
        "the late answer reached the server: {r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_elicitation_is_bounded_by_its_own_timeout() {
    let r = elicit_once(SlowUser(None), Some(Duration::from_secs(3))).await;
    assert!(
        r.content.contains("cancel"),
        "nobody answered within the elicitation timeout: the server heard a cancel: {r:?}"
    );
    assert!(
        !r.content.contains("did not answer within") && !r.content.contains("timed out after"),
        "not the call's own timeout: {r:?}"
    );
}
