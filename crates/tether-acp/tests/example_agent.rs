//! Against the real example agent of `@agentclientprotocol/sdk@1.9.0` (installed by
//! `conformance/acp/setup.sh`; missing, every test here fails saying so).

mod common;

use std::sync::Arc;

use common::{PermissionAnswer, Recorder, WAIT, example_agent, text};
use tether::Capabilities;
use tether_acp::schema::{NewSessionRequest, RequestId, SessionUpdate, StopReason, ToolCallStatus};
use tether_acp::{AcpClient, AcpUpdate, AgentCommand, ClientOptions};

/// The example agent under a client; fails the test (with how to install it) when it is missing.
async fn start(recorder: Arc<Recorder>) -> AcpClient {
    let agent = example_agent();
    AcpClient::spawn(
        AgentCommand::new("node").arg(agent),
        recorder,
        ClientOptions::default().with_prompt_timeout(Some(WAIT)),
    )
    .await
    .expect("spawn node")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_turn_with_permission_ends_end_turn() {
    let rec = Recorder::new(Capabilities::none(), PermissionAnswer::Select("allow".into()));
    let client = start(rec.clone()).await;
    let init = client.initialize().await.expect("initialize");
    assert_eq!(init.protocol_version.as_u16(), 1);
    assert!(!init.agent_capabilities.load_session);

    let cwd = tempfile::tempdir().unwrap();
    let session = client
        .new_session(NewSessionRequest::new(cwd.path()))
        .await
        .expect("session/new");
    assert!(!session.session_id.0.is_empty());
    assert!(client.knows_session(&session.session_id));

    let outcome = client
        .prompt(&session.session_id, text("hello"))
        .await
        .expect("prompt");
    assert_eq!(outcome.stop_reason, Some(StopReason::EndTurn));

    // Text chunks, in order, all delivered before prompt returned.
    let texts = rec.texts();
    assert_eq!(texts.len(), 3, "{texts:?}");
    assert!(texts[0].starts_with("I'll help you with that."));
    assert!(
        texts[2].contains("successfully updated the configuration"),
        "{texts:?}"
    );

    // Tool calls: call_1 read → completed; call_2 edit → completed after permission.
    let events = rec.events.lock().unwrap().clone();
    let mut saw_call1 = false;
    let mut call2_completed = false;
    for e in &events {
        assert_eq!(e.session_id, session.session_id);
        if let AcpUpdate::Known(u) = &e.update {
            match u.as_ref() {
                SessionUpdate::ToolCall(tc) if tc.tool_call_id.0.as_ref() == "call_1" => {
                    saw_call1 = true;
                    assert_eq!(tc.title, "Reading project files");
                }
                SessionUpdate::ToolCallUpdate(up) if up.tool_call_id.0.as_ref() == "call_2" => {
                    call2_completed = up.fields.status == Some(ToolCallStatus::Completed);
                }
                _ => {}
            }
        }
    }
    assert!(saw_call1 && call2_completed, "{:?}", rec.kinds());

    // The permission request arrived with agent-side id 0 and both options.
    let perms = rec.permissions.lock().unwrap().clone();
    assert_eq!(perms.len(), 1);
    assert_eq!(perms[0].1, Some(RequestId::Number(0)));
    let ids: Vec<String> = perms[0]
        .0
        .options
        .iter()
        .map(|o| o.option_id.to_string())
        .collect();
    assert_eq!(ids, ["allow", "reject"]);
    client.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_permission_takes_the_other_branch() {
    let rec = Recorder::new(Capabilities::none(), PermissionAnswer::Select("reject".into()));
    let client = start(rec.clone()).await;
    client.initialize().await.unwrap();
    let cwd = tempfile::tempdir().unwrap();
    let s = client
        .new_session(NewSessionRequest::new(cwd.path()))
        .await
        .unwrap();
    let out = client.prompt(&s.session_id, text("hi")).await.unwrap();
    assert_eq!(out.stop_reason, Some(StopReason::EndTurn));
    let texts = rec.texts();
    assert!(
        texts.last().unwrap().contains("skip the configuration update"),
        "{texts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_turn_ends_cancelled() {
    let rec = Recorder::new(Capabilities::none(), PermissionAnswer::Hang);
    let client = start(rec.clone()).await;
    client.initialize().await.unwrap();
    let cwd = tempfile::tempdir().unwrap();
    let s = client
        .new_session(NewSessionRequest::new(cwd.path()))
        .await
        .unwrap();
    let c2 = client.clone();
    let sid = s.session_id.clone();
    let turn = tokio::spawn(async move { c2.prompt(&sid, text("hi")).await });
    // Wait until the first chunk arrived, then cancel mid-turn.
    rec.wait_until("the first chunk", |r| !r.texts().is_empty()).await;
    client.cancel(&s.session_id).await.unwrap();
    let out = tokio::time::timeout(WAIT, turn)
        .await
        .expect("prompt returns after cancel")
        .unwrap()
        .unwrap();
    assert_eq!(out.stop_reason, Some(StopReason::Cancelled));
    assert!(out.is_cancelled());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_answers_a_pending_permission_cancelled() {
    // The handler never answers the permission question; cancel must answer it at once.
    let rec = Recorder::new(Capabilities::none(), PermissionAnswer::Hang);
    let client = start(rec.clone()).await;
    client.initialize().await.unwrap();
    let cwd = tempfile::tempdir().unwrap();
    let s = client
        .new_session(NewSessionRequest::new(cwd.path()))
        .await
        .unwrap();
    let c2 = client.clone();
    let sid = s.session_id.clone();
    let turn = tokio::spawn(async move { c2.prompt(&sid, text("hi")).await });
    rec.wait_until("the permission request", |r| {
        !r.permissions.lock().unwrap().is_empty()
    })
    .await;
    assert_eq!(
        rec.permissions.lock().unwrap().len(),
        1,
        "permission request never came"
    );
    client.cancel(&s.session_id).await.unwrap();
    // The example agent returns right after a `cancelled` outcome.
    let out = tokio::time::timeout(WAIT, turn)
        .await
        .expect("prompt returns after cancel")
        .unwrap()
        .unwrap();
    assert!(
        matches!(
            out.stop_reason,
            Some(StopReason::Cancelled) | Some(StopReason::EndTurn)
        ),
        "{out:?}"
    );
    // No completion text: the edit was not applied.
    assert!(!rec.texts().iter().any(|t| t.contains("successfully updated")));
}
