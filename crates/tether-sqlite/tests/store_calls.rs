//! What opening a thread asks of the store, on a real SQLite file: a new thread's session reads
//! nothing back (its record key is fresh, so nothing can be recorded under it), and a thread
//! opened again reloads its whole record and continues it.
//!
//! Why it matters: `tether serve` opens a thread's session on every request, and at 1,000
//! concurrent runs every store call before the first model request waits its turn at the store's
//! one writer thread; the read of a new thread's (empty) record was one of four such calls
//! before each run's first model request (see BENCHMARKS.md, `tether-serve`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde_json::Value;
use tether::local::LocalLoop;
use tether::{
    Claim, Event, EventStore, ScriptedModel, Session, Thread, ThreadId, ThreadStore, ToolResult, UserMessage,
};
use tether_sqlite::SqliteStore;

/// A [`SqliteStore`] that counts the calls made to it, by method.
struct Counting {
    inner: SqliteStore,
    calls: Mutex<HashMap<&'static str, usize>>,
}

impl Counting {
    fn count(&self, name: &'static str) {
        *self.calls.lock().unwrap().entry(name).or_default() += 1;
    }

    fn calls(&self, name: &str) -> usize {
        self.calls.lock().unwrap().get(name).copied().unwrap_or(0)
    }

    fn reset(&self) {
        self.calls.lock().unwrap().clear();
    }
}

#[async_trait]
impl EventStore for Counting {
    async fn append(&self, session_id: &str, event: &Event) -> tether::Result<bool> {
        self.count("append");
        self.inner.append(session_id, event).await
    }
    async fn load(&self, session_id: &str) -> tether::Result<Vec<Event>> {
        self.count("load");
        self.inner.load(session_id).await
    }
    async fn tool_result(&self, session_id: &str, tool_use_id: &str) -> tether::Result<Option<ToolResult>> {
        self.count("tool_result");
        self.inner.tool_result(session_id, tool_use_id).await
    }
    async fn put_tool_result(&self, session_id: &str, result: &ToolResult) -> tether::Result<()> {
        self.count("put_tool_result");
        self.inner.put_tool_result(session_id, result).await
    }
    async fn put_state(&self, session_id: &str, key: &str, value: &Value) -> tether::Result<()> {
        self.count("put_state");
        self.inner.put_state(session_id, key, value).await
    }
    async fn state(&self, session_id: &str, key: &str) -> tether::Result<Option<Value>> {
        self.count("state");
        self.inner.state(session_id, key).await
    }
    async fn sessions(&self) -> tether::Result<Vec<String>> {
        self.count("sessions");
        self.inner.sessions().await
    }
}

#[async_trait]
impl ThreadStore for Counting {
    async fn claim_thread(
        &self,
        thread: &ThreadId,
        agent: &str,
        new_record: &str,
        title: &str,
    ) -> tether::Result<Claim> {
        self.count("claim_thread");
        self.inner.claim_thread(thread, agent, new_record, title).await
    }
    async fn set_provider_session(
        &self,
        thread: &ThreadId,
        provider: &str,
        session: &str,
    ) -> tether::Result<()> {
        self.count("set_provider_session");
        self.inner.set_provider_session(thread, provider, session).await
    }
    async fn thread(&self, thread: &ThreadId) -> tether::Result<Option<Thread>> {
        self.count("thread");
        self.inner.thread(thread).await
    }
    async fn threads(&self, agent: Option<&str>) -> tether::Result<Vec<Thread>> {
        self.count("threads");
        self.inner.threads(agent).await
    }
}

fn thread_session(store: &Arc<Counting>, thread: &ThreadId, reply: &str) -> tether::SessionBuilder {
    let model = ScriptedModel::new(vec![Ok(ScriptedModel::text(reply))]);
    Session::builder(LocalLoop::new(model)).thread(
        store.clone() as Arc<dyn ThreadStore>,
        thread.clone(),
        "agent",
    )
}

#[tokio::test]
async fn a_new_thread_reads_nothing_back_and_a_reopened_one_reloads_its_record() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Counting {
        inner: SqliteStore::open(dir.path().join("tether.db")).unwrap(),
        calls: Mutex::new(HashMap::new()),
    });
    let thread = ThreadId::new("t-1").unwrap();

    // A new thread: claimed (created), its provider session recorded, nothing read back.
    let mut session = thread_session(&store, &thread, "first answer")
        .open()
        .await
        .unwrap();
    assert_eq!(store.calls("claim_thread"), 1);
    assert_eq!(
        store.calls("load"),
        0,
        "a new thread's record is empty: nothing to load"
    );
    assert_eq!(store.calls("state"), 0, "a new thread has no checkpoint to read");
    assert!(!session.opened().resumed);
    let record = session.info().session_id.clone();
    let r = session
        .send_messages(vec![UserMessage::with_id("u1", "hello")], Default::default())
        .await
        .unwrap();
    assert_eq!(r.text, "first answer");
    session.close().await.unwrap();
    let recorded = store.inner.load(&record).await.unwrap();
    assert!(
        recorded.iter().any(|e| e.raw_type == tether::raw::USER_MESSAGE),
        "the user message is recorded: {recorded:?}"
    );

    // The same thread again: its record is loaded and the session resumes it, so a message it
    // already has is known (not sent twice) and the next one continues the thread.
    store.reset();
    let mut session = thread_session(&store, &thread, "second answer")
        .open()
        .await
        .unwrap();
    assert_eq!(store.calls("claim_thread"), 1);
    assert_eq!(store.calls("load"), 1, "an existing thread's record is loaded");
    assert!(session.opened().resumed);
    assert_eq!(session.info().session_id, record, "the thread keeps its record");
    assert!(session.knows_message("u1").await);
    let r = session
        .send_messages(vec![UserMessage::with_id("u2", "again")], Default::default())
        .await
        .unwrap();
    assert_eq!(r.text, "second answer");
    session.close().await.unwrap();
    let after = store.inner.load(&record).await.unwrap();
    let users = after
        .iter()
        .filter(|e| e.raw_type == tether::raw::USER_MESSAGE)
        .count();
    assert_eq!(users, 2, "each user message recorded once: {after:?}");
}
