//! What opening a thread asks of the store, on a real SQLite file: a new thread's session reads
//! nothing back (its record key is fresh, so nothing can be recorded under it); a new thread
//! opened with its first messages is claimed, given its provider session and its first messages
//! in one store call when the provider opens locally (two otherwise), and nothing else is
//! written before the first model request; a thread opened again reloads its whole record and
//! continues it.
//!
//! Why it matters: `tether serve` opens a thread's session on every request, and at 1,000
//! concurrent runs every store call before the first model request waits its turn at the store's
//! one writer thread. A new run made four such calls in series (claim, read the empty record,
//! record the provider session, record the user message); it now makes one (see BENCHMARKS.md,
//! `tether-serve`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde_json::Value;
use tether::local::LocalLoop;
use tether::{
    ChatModel, ChatRequest, ChatResponse, Claim, DeltaSink, Event, EventStore, ScriptedModel, Session,
    Thread, ThreadId, ThreadStart, ThreadStore, ToolResult, UserMessage,
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

    /// Every call so far, by method.
    fn snapshot(&self) -> HashMap<&'static str, usize> {
        self.calls.lock().unwrap().clone()
    }
}

#[async_trait]
impl EventStore for Counting {
    async fn append(&self, session_id: &str, event: &Event) -> tether::Result<bool> {
        self.count("append");
        self.inner.append(session_id, event).await
    }
    async fn append_with_state(
        &self,
        session_id: &str,
        event: &Event,
        key: &str,
        value: &Value,
    ) -> tether::Result<bool> {
        self.count("append_with_state");
        self.inner.append_with_state(session_id, event, key, value).await
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
        self.count(if key == "observer" {
            "put_state observer"
        } else {
            "put_state"
        });
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
    async fn start_thread(
        &self,
        thread: &ThreadId,
        record: &str,
        start: &ThreadStart<'_>,
    ) -> tether::Result<()> {
        self.count("start_thread");
        self.inner.start_thread(thread, record, start).await
    }
    async fn claim_thread_starting(
        &self,
        thread: &ThreadId,
        agent: &str,
        new_record: &str,
        title: &str,
        start: &ThreadStart<'_>,
    ) -> tether::Result<Claim> {
        self.count("claim_thread_starting");
        self.inner
            .claim_thread_starting(thread, agent, new_record, title, start)
            .await
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

/// A model that notes the store calls made before each request it gets, then answers as the
/// scripted model does.
struct Noting {
    inner: ScriptedModel,
    store: Arc<Counting>,
    seen: Mutex<Vec<HashMap<&'static str, usize>>>,
}

#[async_trait]
impl ChatModel for Noting {
    fn name(&self) -> &str {
        "noting"
    }
    async fn chat(&self, req: &ChatRequest, deltas: &DeltaSink) -> tether::Result<ChatResponse> {
        self.seen.lock().unwrap().push(self.store.snapshot());
        self.inner.chat(req, deltas).await
    }
}

fn counting_store(dir: &tempfile::TempDir) -> Arc<Counting> {
    Arc::new(Counting {
        inner: SqliteStore::open(dir.path().join("tether.db")).unwrap(),
        calls: Mutex::new(HashMap::new()),
    })
}

/// Opens `thread` with `first` as its first messages, sends them, and returns the store calls
/// made before the first model request, the texts the model was sent, and the session's record.
async fn first_request(
    store: &Arc<Counting>,
    thread: &ThreadId,
    first: Vec<UserMessage>,
    locally: bool,
) -> (HashMap<&'static str, usize>, Vec<String>, String) {
    let model = Arc::new(Noting {
        inner: ScriptedModel::new(vec![Ok(ScriptedModel::text("answer"))]),
        store: store.clone(),
        seen: Mutex::new(Vec::new()),
    });
    let mut builder = Session::builder(LocalLoop::with_model(model.clone()));
    if locally {
        builder = builder.provider_opens_locally();
    }
    let mut session = builder
        .thread(store.clone() as Arc<dyn ThreadStore>, thread.clone(), "agent")
        .first_messages(first.clone())
        .open()
        .await
        .unwrap();
    for m in &first {
        assert!(session.knows_message(m.id.as_deref().unwrap()).await);
    }
    let first_len = first.len();
    let r = session.send_messages(first, Default::default()).await.unwrap();
    assert_eq!(r.text, "answer");
    let users = r
        .events
        .iter()
        .filter(|e| e.raw_type == tether::raw::USER_MESSAGE)
        .count();
    assert_eq!(
        users, first_len,
        "the request's record holds its messages: {:?}",
        r.events
    );
    let record = session.info().session_id.clone();
    session.close().await.unwrap();
    let sent = model
        .inner
        .requests()
        .first()
        .map(|req| {
            req.messages
                .iter()
                .filter(|m| m.role == tether::Role::User)
                .filter_map(|m| m.content.clone())
                .collect()
        })
        .unwrap_or_default();
    let before = model.seen.lock().unwrap().first().cloned().unwrap();
    (before, sent, record)
}

#[tokio::test]
async fn a_new_thread_started_with_its_messages_waits_for_one_store_call_before_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let store = counting_store(&dir);
    let thread = ThreadId::new("t-new").unwrap();
    let first = vec![
        UserMessage::with_id("u1", "hello"),
        UserMessage::with_id("u2", "there"),
    ];
    let (before, sent, record) = first_request(&store, &thread, first, true).await;
    assert_eq!(
        before,
        HashMap::from([("claim_thread_starting", 1)]),
        "one store call before the first model request"
    );
    assert_eq!(
        sent,
        vec!["hello\n\nthere".to_owned()],
        "the model got both messages, once"
    );

    // On the file: the thread with its provider session; the messages first in the record,
    // numbered 1 and 2, each once, then the answer.
    let t = store.inner.thread(&thread).await.unwrap().unwrap();
    assert_eq!(t.provider, "local");
    assert!(t.provider_session.is_some());
    let events = store.inner.load(&record).await.unwrap();
    let ids: Vec<(&str, Option<u64>)> = events.iter().map(|e| (e.id.as_str(), e.seq)).collect();
    assert_eq!(
        &ids[..2],
        &[("user:u1", Some(1)), ("user:u2", Some(2))],
        "{ids:?}"
    );
    let seqs: Vec<u64> = events.iter().filter_map(|e| e.seq).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "gapless: {ids:?}"
    );
    assert!(
        events.iter().any(|e| matches!(
            &e.kind,
            tether::EventKind::Message {
                role: tether::Role::Assistant,
                ..
            }
        )),
        "{ids:?}"
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| e.raw_type == tether::raw::USER_MESSAGE)
            .count(),
        2
    );
}

#[tokio::test]
async fn a_remote_provider_opens_after_the_claim_and_starts_the_thread_in_one_more_call() {
    let dir = tempfile::tempdir().unwrap();
    let store = counting_store(&dir);
    let thread = ThreadId::new("t-remote").unwrap();
    let (before, sent, record) =
        first_request(&store, &thread, vec![UserMessage::with_id("u1", "hello")], false).await;
    assert_eq!(
        before,
        HashMap::from([("claim_thread", 1), ("start_thread", 1)]),
        "the claim, then the provider session with the first message"
    );
    assert_eq!(sent, vec!["hello".to_owned()]);
    let events = store.inner.load(&record).await.unwrap();
    assert_eq!(events[0].id, "user:u1");
    assert_eq!(events[0].seq, Some(1));
}

#[tokio::test]
async fn a_started_thread_ignores_first_messages_and_records_only_what_is_new() {
    let dir = tempfile::tempdir().unwrap();
    let store = counting_store(&dir);
    let thread = ThreadId::new("t-again").unwrap();
    let (_, _, record) =
        first_request(&store, &thread, vec![UserMessage::with_id("u1", "hello")], true).await;
    store.reset();
    // The client resends its history with one new message.
    let history = vec![
        UserMessage::with_id("u1", "hello"),
        UserMessage::with_id("u2", "more"),
    ];
    let model = Arc::new(Noting {
        inner: ScriptedModel::new(vec![Ok(ScriptedModel::text("second"))]),
        store: store.clone(),
        seen: Mutex::new(Vec::new()),
    });
    let mut session = Session::builder(LocalLoop::with_model(model.clone()))
        .provider_opens_locally()
        .thread(store.clone() as Arc<dyn ThreadStore>, thread.clone(), "agent")
        .first_messages(history.clone())
        .open()
        .await
        .unwrap();
    assert!(session.opened().resumed);
    assert!(session.knows_message("u1").await);
    assert!(
        !session.knows_message("u2").await,
        "nothing of the start was written"
    );
    let r = session.send_messages(history, Default::default()).await.unwrap();
    assert_eq!(r.text, "second");
    session.close().await.unwrap();
    let before = model.seen.lock().unwrap()[0].clone();
    assert_eq!(before.get("claim_thread_starting"), Some(&1));
    assert_eq!(before.get("start_thread"), None);
    let events = store.inner.load(&record).await.unwrap();
    let users: Vec<&str> = events
        .iter()
        .filter(|e| e.raw_type == tether::raw::USER_MESSAGE)
        .map(|e| e.id.as_str())
        .collect();
    assert_eq!(users, ["user:u1", "user:u2"], "each message once");
}

/// A new thread's whole first run (one model turn): what each way of opening it asks of the
/// store, before the model and in all.
#[tokio::test]
async fn a_new_threads_first_run_makes_three_store_calls_where_it_made_five() {
    let expected = [
        // Without first messages (as before): claim, provider session, user message, answer,
        // checkpoint.
        (
            false,
            false,
            vec![("claim_thread", 1), ("set_provider_session", 1)],
            vec![
                ("claim_thread", 1),
                ("set_provider_session", 1),
                ("append", 2),
                ("put_state", 1),
            ],
        ),
        // A provider that opens remotely: claim, then provider session with the user message.
        (
            true,
            false,
            vec![("claim_thread", 1), ("start_thread", 1)],
            vec![
                ("claim_thread", 1),
                ("start_thread", 1),
                ("append", 1),
                ("put_state", 1),
            ],
        ),
        // The local loop: one call before the model.
        (
            true,
            true,
            vec![("claim_thread_starting", 1)],
            vec![("claim_thread_starting", 1), ("append", 1), ("put_state", 1)],
        ),
    ];
    for (first, locally, at_open, total) in expected {
        let dir = tempfile::tempdir().unwrap();
        let store = counting_store(&dir);
        let thread = ThreadId::new("t").unwrap();
        let model = ScriptedModel::new(vec![Ok(ScriptedModel::text("answer"))]);
        let mut b = Session::builder(LocalLoop::new(model));
        if locally {
            b = b.provider_opens_locally();
        }
        let msgs = vec![UserMessage::with_id("u1", "go")];
        let mut b = b.thread(store.clone() as Arc<dyn ThreadStore>, thread.clone(), "agent");
        if first {
            b = b.first_messages(msgs.clone());
        }
        let mut s = b.open().await.unwrap();
        assert_eq!(
            store.snapshot(),
            HashMap::from_iter(at_open),
            "first={first} locally={locally}"
        );
        s.send_messages(msgs, Default::default()).await.unwrap();
        s.close().await.unwrap();
        assert_eq!(
            store.snapshot(),
            HashMap::from_iter(total),
            "first={first} locally={locally}"
        );
    }
}

/// An observer that keeps a state value with each model response the session records.
struct KeepsState;

impl tether::EventObserver for KeepsState {
    fn on_event(&self, _event: &Event, _sink: &tether::EventSink) {}

    fn state_with(&self, event: &Event) -> Option<(&'static str, Value)> {
        (event.raw_type == tether::raw::LOCAL_MODEL_RESPONSE)
            .then(|| ("observer", serde_json::json!({"seq": event.seq})))
    }
}

/// An observer's state rides on the model response's append (one store call), never a
/// `put_state` of its own, and is there after a reopen of the file.
#[tokio::test]
async fn an_observers_state_is_written_in_the_store_call_of_the_event_it_comes_with() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calls.db");
    let store = Arc::new(Counting {
        inner: SqliteStore::open(&path).unwrap(),
        calls: Mutex::new(HashMap::new()),
    });
    let model = ScriptedModel::new(vec![Ok(ScriptedModel::text("hi"))]);
    let mut session = Session::builder(LocalLoop::new(model))
        .store(store.clone() as Arc<dyn EventStore>)
        .observer(Arc::new(KeepsState))
        .open()
        .await
        .unwrap();
    let sid = session.info().session_id.clone();
    let r = session.send("hello").await.unwrap();
    assert_eq!(r.text, "hi");
    drop(session);
    assert_eq!(store.calls("append_with_state"), 1, "{:?}", store.snapshot());
    assert_eq!(store.calls("put_state observer"), 0, "{:?}", store.snapshot());
    drop(store);
    let reopened = SqliteStore::open(&path).unwrap();
    let events = reopened.load(&sid).await.unwrap();
    let response = events
        .iter()
        .find(|e| e.raw_type == tether::raw::LOCAL_MODEL_RESPONSE)
        .expect("the response is recorded");
    assert_eq!(
        reopened.state(&sid, "observer").await.unwrap(),
        Some(serde_json::json!({"seq": response.seq}))
    );
}
