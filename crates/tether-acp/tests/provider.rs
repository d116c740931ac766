//! `AcpAgent` as a tether `Provider`, with tether's `Workspace` serving files, terminals and
//! permissions.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use common::fake_agent;
use tether::workspace::{Approval, ApprovalRequest, Approver, Policy, Workspace};
use tether::{EventKind, Role, Session, Terminal};
use tether_acp::{AcpAgent, AgentCommand};

struct Counting {
    answer: Approval,
    asked: Arc<AtomicUsize>,
}

#[async_trait]
impl Approver for Counting {
    async fn approve(&self, _req: &ApprovalRequest) -> Approval {
        self.asked.fetch_add(1, Ordering::SeqCst);
        self.answer
    }
}

fn texts_of(events: &[impl std::borrow::Borrow<tether::Event>]) -> Vec<String> {
    events
        .iter()
        .map(std::borrow::Borrow::borrow)
        .filter_map(|e| match &e.kind {
            EventKind::Message {
                role: Role::Assistant,
                text,
                ..
            } => Some(text.clone()),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_become_tether_events() {
    let root = tempfile::tempdir().unwrap();
    let ws = Workspace::new(root.path()).unwrap();
    let agent = AcpAgent::new(AgentCommand::new(fake_agent()), root.path());
    let mut session = Session::builder(agent).handler(ws).open().await.unwrap();
    let info = session.info();
    assert!(info.session_id.starts_with("fake-"), "{info:?}");
    let result = session.send("tool").await.unwrap();
    assert_eq!(result.terminal, Terminal::EndTurn);
    // "welcome" was sent right after session/new; depending on timing it lands in its own
    // message or at the start of this turn's text. It is never lost.
    assert!(
        result.text == "done" || result.text == "welcomedone",
        "{}",
        result.text
    );
    assert_eq!(result.stop_reason, tether::StopReason::EndTurn);
    let ev = &result.events;
    assert_eq!(texts_of(ev).concat(), "welcomedone");
    assert!(ev.iter().any(|e| matches!(&e.kind, EventKind::ToolCallStart { tool_use_id, name, .. } if tool_use_id == "t1" && name == "List files")));
    assert!(
        ev.iter().any(
            |e| matches!(&e.kind, EventKind::ToolCallUpdate { status: Some(s), .. } if s == "in_progress")
        )
    );
    assert!(ev.iter().any(|e| matches!(&e.kind, EventKind::ToolResult { result } if result.tool_use_id == "t1" && result.content == "a.txt" && !result.is_error)));
    // Plan and usage are kept, raw.
    assert!(
        ev.iter()
            .any(|e| e.raw_type == "acp.session_update" && e.raw["sessionUpdate"] == "plan")
    );
    assert!(
        ev.iter()
            .any(|e| e.raw["sessionUpdate"] == "usage_update" && e.raw["used"] == 1200)
    );
    // Reasoning is kept with the message.
    assert!(
        ev.iter()
            .any(|e| matches!(&e.kind, EventKind::Message { reasoning: Some(r), .. } if r == "thinking"))
    );
    // Durable events are numbered without gaps.
    let seqs: Vec<u64> = ev.iter().filter_map(|e| e.seq).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    assert_eq!(result.server_tool_uses.len(), 1);
    session.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permission_policy_remembers_allow_always_for_the_session() {
    let root = tempfile::tempdir().unwrap();
    let asked = Arc::new(AtomicUsize::new(0));
    let ws = Workspace::new(root.path()).unwrap().approver(Counting {
        answer: Approval::Always,
        asked: asked.clone(),
    });
    let agent = AcpAgent::new(AgentCommand::new(fake_agent()), root.path());
    let mut session = Session::builder(agent).handler(ws).open().await.unwrap();
    let r1 = session.send("permission").await.unwrap();
    assert!(r1.text.contains("\"optionId\":\"always\""), "{}", r1.text);
    let r2 = session.send("permission").await.unwrap();
    assert!(r2.text.contains("\"optionId\":\"allow\""), "{}", r2.text);
    assert_eq!(asked.load(Ordering::SeqCst), 1, "allow_always must be remembered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_permission_selects_reject() {
    let root = tempfile::tempdir().unwrap();
    let ws = Workspace::new(root.path()).unwrap().policy(Policy::read_only());
    let agent = AcpAgent::new(AgentCommand::new(fake_agent()), root.path());
    let mut session = Session::builder(agent).handler(ws).open().await.unwrap();
    let r = session.send("permission").await.unwrap();
    assert!(r.text.contains("\"optionId\":\"reject\""), "{}", r.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspace_serves_files_and_terminals() {
    let root = tempfile::tempdir().unwrap();
    let canon = std::fs::canonicalize(root.path()).unwrap();
    let ws = Workspace::new(root.path()).unwrap().policy(Policy::allow_all());
    let agent = AcpAgent::new(AgentCommand::new(fake_agent()), root.path());
    let mut session = Session::builder(agent).handler(ws).open().await.unwrap();

    let r = session
        .send(format!("write {} hello world", canon.join("notes.txt").display()))
        .await
        .unwrap();
    assert_eq!(r.text.trim_start_matches("welcome"), "ok:{}");
    assert_eq!(
        std::fs::read_to_string(canon.join("notes.txt")).unwrap(),
        "hello world"
    );
    let r = session
        .send(format!("read {}", canon.join("notes.txt").display()))
        .await
        .unwrap();
    assert_eq!(r.text, "ok:{\"content\":\"hello world\"}");

    // Output over the agent's 4096-byte limit is truncated from the start, and reported.
    let r = session.send("terminal - seq 1 5000").await.unwrap();
    assert!(r.text.contains("create ok:{\"terminalId\""), "{}", r.text);
    assert!(r.text.contains("wait ok:{\"exitCode\":0}"), "{}", r.text);
    assert!(r.text.contains("\"truncated\":true"), "{}", r.text);
    assert!(r.text.contains("4999\\n5000\\n"), "{}", r.text);
    assert!(!r.text.contains("\"1\\n2\\n3\\n"), "{}", r.text);
    assert!(r.text.contains("release ok:{}"), "{}", r.text);

    // Commands refused by policy: nothing runs.
    let root2 = tempfile::tempdir().unwrap();
    let ws = Workspace::new(root2.path()).unwrap().policy(Policy::read_only());
    let agent = AcpAgent::new(AgentCommand::new(fake_agent()), root2.path());
    let mut session = Session::builder(agent).handler(ws).open().await.unwrap();
    let r = session.send("terminal - touch made-it").await.unwrap();
    assert!(r.text.contains("create err:-32603"), "{}", r.text);
    assert!(!root2.path().join("made-it").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_crash_is_a_session_error() {
    let root = tempfile::tempdir().unwrap();
    let agent = AcpAgent::new(AgentCommand::new(fake_agent()), root.path());
    let mut session = Session::builder(agent).open().await.unwrap();
    let err = session.send("crash").await.unwrap_err();
    assert!(err.to_string().contains("exited with code 3"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loading_a_session_from_an_agent_without_load_session_is_a_typed_error() {
    // The judge: the ACP SDK's example agent advertises `loadSession: false`.
    let root = tempfile::tempdir().unwrap();
    let agent = AcpAgent::new(
        AgentCommand::new("node").arg(common::example_agent()),
        root.path(),
    )
    .load_session("earlier-1");
    let err = Session::builder(agent)
        .handler(Workspace::new(root.path()).unwrap())
        .open()
        .await
        .unwrap_err();
    match &err {
        tether::Error::CannotResume { provider, reason } => {
            assert_eq!(provider, "acp");
            assert!(reason.contains("loadSession"), "{reason}");
        }
        other => panic!("expected CannotResume, got {other:?}"),
    }
    assert_eq!(err.code(), "cannot_resume");
}
