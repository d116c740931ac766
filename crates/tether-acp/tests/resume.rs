//! An ACP agent's thread resumed after its process is gone (a restart of the server that ran it):
//! reloaded with `session/load` when the agent advertises `loadSession`, its replay not recorded
//! again; refused with a typed error, nothing lost, when it does not (the SDK's example agent).

mod common;

use std::sync::Arc;

use common::{example_agent, fake_agent};
use tether::workspace::Workspace;
use tether::{Error, EventStore, MemoryStore, Session, ThreadId, ThreadStore};
use tether_acp::{AcpAgent, AgentCommand};

fn assert_gapless(events: &[tether::Event]) {
    let mut ids = std::collections::HashSet::new();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.seq, Some(i as u64 + 1), "gapless at {}", e.id);
        assert!(ids.insert(e.id.clone()), "duplicate event id {}", e.id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_reloads_its_session_in_a_new_agent_process() {
    let root = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryStore::default());
    let thread = ThreadId::new("acp-1").unwrap();
    let open = || {
        Session::builder(AcpAgent::new(AgentCommand::new(fake_agent()), root.path()))
            .handler(Workspace::new(root.path()).unwrap())
            .thread(store.clone(), thread.clone(), "coder")
    };
    let mut s = open().open().await.unwrap();
    let r = s.send("echo first").await.unwrap();
    assert!(r.text.ends_with("first"), "{}", r.text);
    s.close().await.unwrap();
    let t = store.thread(&thread).await.unwrap().unwrap();
    let sid = t.provider_session.clone().unwrap();
    assert_eq!(t.provider, "acp");
    let before = store.load(&t.record).await.unwrap();

    // A new agent process: the session is reloaded (the fake replays two messages), not recorded
    // again, and the thread goes on under the same session id.
    let mut s = open().open().await.unwrap();
    assert!(s.opened().resumed);
    assert_eq!(s.opened().session_id, sid);
    let after_load = store.load(&t.record).await.unwrap();
    assert_eq!(after_load, before, "the replay is the record's, not new events");
    let r = s.send("echo second").await.unwrap();
    assert!(r.text.ends_with("second"), "{}", r.text);
    s.close().await.unwrap();
    let all = store.load(&t.record).await.unwrap();
    assert_gapless(&all);
    assert!(all.len() > before.len());
    let mut ids = std::collections::HashSet::new();
    for e in &all {
        if let tether::EventKind::Message { message_id, .. } = &e.kind {
            assert!(
                ids.insert(message_id.clone()),
                "message id {message_id} used twice in one thread"
            );
        }
    }
    let text = serde_json::to_string(&all).unwrap();
    assert!(
        !text.contains("earlier question") && !text.contains("earlier answer"),
        "the replayed history was not recorded: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_without_load_session_cannot_resume_and_nothing_is_lost() {
    let root = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryStore::default());
    let thread = ThreadId::new("acp-2").unwrap();
    let agent = || AcpAgent::new(AgentCommand::new("node").arg(example_agent()), root.path());
    // The example agent answers with a permission request mid-turn: the default handler refuses.
    let mut s = Session::builder(agent())
        .handler(Workspace::new(root.path()).unwrap())
        .thread(store.clone(), thread.clone(), "coder")
        .open()
        .await
        .unwrap();
    s.send("hello").await.unwrap();
    s.close().await.unwrap();
    let record = store.thread(&thread).await.unwrap().unwrap().record;
    let before = store.load(&record).await.unwrap();
    assert!(!before.is_empty());

    let e = Session::builder(agent())
        .handler(Workspace::new(root.path()).unwrap())
        .thread(store.clone(), thread.clone(), "coder")
        .open()
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::CannotResume { provider, .. } if provider == "acp"),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("cannot resume a session") && msg.contains("loadSession"),
        "{msg}"
    );
    assert_eq!(
        store.load(&record).await.unwrap(),
        before,
        "nothing lost, nothing added"
    );
    assert_gapless(&before);
}
