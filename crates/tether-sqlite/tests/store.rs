//! The SQLite store against real files: exactly-once append, the memo, state, threads, reopen
//! after a restart, migrations, refusals, and the session engine on top of it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::json;
use tether::{
    Claim, Event, EventKind, EventStore, MemoryStore, ScriptedModel, Session, Thread, ThreadId, ThreadStore,
    ToolResult, ToolSet, ToolSpec, local::LocalLoop,
};
use tether_sqlite::{SCHEMA_VERSION, SqliteStore, StoreError};

fn ev(id: &str, seq: u64) -> Event {
    let mut e = Event::new(
        id,
        "test.event",
        json!({"n": seq}),
        EventKind::Status { status: id.into() },
    );
    e.seq = Some(seq);
    e
}

#[tokio::test]
async fn append_is_exactly_once_and_survives_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        let s = SqliteStore::open(&path).unwrap();
        assert!(s.append("s1", &ev("a", 1)).await.unwrap());
        assert!(
            !s.append("s1", &ev("a", 1)).await.unwrap(),
            "a repeated id is refused"
        );
        assert!(s.append("s1", &ev("b", 2)).await.unwrap());
        assert!(
            s.append("s2", &ev("a", 1)).await.unwrap(),
            "ids are unique per session"
        );
    }
    let s = SqliteStore::open(&path).unwrap();
    assert!(
        !s.append("s1", &ev("b", 2)).await.unwrap(),
        "still refused after a restart"
    );
    let loaded = s.load("s1").await.unwrap();
    assert_eq!(loaded, vec![ev("a", 1), ev("b", 2)]);
    assert_eq!(s.sessions().await.unwrap(), vec!["s1", "s2"]);
    assert!(s.load("nope").await.unwrap().is_empty());
}

#[tokio::test]
async fn load_is_in_sequence_order_whatever_the_append_order() {
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open(dir.path().join("t.db")).unwrap();
    for (id, seq) in [("c", 3), ("a", 1), ("b", 2)] {
        s.append("s", &ev(id, seq)).await.unwrap();
    }
    let ids: Vec<String> = s.load("s").await.unwrap().into_iter().map(|e| e.id).collect();
    assert_eq!(ids, ["a", "b", "c"]);
}

#[tokio::test]
async fn concurrent_appends_of_the_same_ids_store_each_once() {
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open(dir.path().join("t.db")).unwrap();
    let wins = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (s, wins) = (s.clone(), wins.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..20u64 {
                if s.append("s", &ev(&format!("e{i}"), i + 1)).await.unwrap() {
                    wins.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(wins.load(Ordering::SeqCst), 20);
    assert_eq!(s.load("s").await.unwrap().len(), 20);
}

#[tokio::test]
async fn the_memo_keeps_the_first_result_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        let s = SqliteStore::open(&path).unwrap();
        assert_eq!(s.tool_result("s", "call_1").await.unwrap(), None);
        s.put_tool_result("s", &ToolResult::ok("call_1", "first"))
            .await
            .unwrap();
        s.put_tool_result("s", &ToolResult::error("call_1", "second"))
            .await
            .unwrap();
        s.put_tool_result("s", &ToolResult::error("call_2", "boom"))
            .await
            .unwrap();
    }
    let s = SqliteStore::open(&path).unwrap();
    assert_eq!(
        s.tool_result("s", "call_1").await.unwrap(),
        Some(ToolResult::ok("call_1", "first"))
    );
    assert_eq!(
        s.tool_result("s", "call_2").await.unwrap(),
        Some(ToolResult::error("call_2", "boom"))
    );
    assert_eq!(s.tool_result("other", "call_1").await.unwrap(), None);
}

#[tokio::test]
async fn state_overwrites_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        let s = SqliteStore::open(&path).unwrap();
        s.put_state("s", "transcript", &json!([1])).await.unwrap();
        s.put_state("s", "transcript", &json!([1, 2])).await.unwrap();
        s.put_state("s", "other", &json!({"a": null})).await.unwrap();
    }
    let s = SqliteStore::open(&path).unwrap();
    assert_eq!(s.state("s", "transcript").await.unwrap(), Some(json!([1, 2])));
    assert_eq!(s.state("s", "other").await.unwrap(), Some(json!({"a": null})));
    assert_eq!(s.state("s", "missing").await.unwrap(), None);
    assert_eq!(
        s.sessions().await.unwrap(),
        vec!["s"],
        "state alone makes a session"
    );
}

/// An event and the state an observer hands over with it are stored in one step: both survive a
/// reopen; a repeated event stores neither (the state rides on the event's write, never alone).
#[tokio::test]
async fn state_carried_by_an_append_is_written_with_it_and_only_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        let s = SqliteStore::open(&path).unwrap();
        assert!(
            s.append_with_state("s", &ev("a", 1), "obs", &json!({"open": true}))
                .await
                .unwrap()
        );
        assert!(
            !s.append_with_state("s", &ev("a", 1), "obs", &json!({"open": false}))
                .await
                .unwrap(),
            "the event is stored already"
        );
    }
    let s = SqliteStore::open(&path).unwrap();
    assert_eq!(s.load("s").await.unwrap().len(), 1);
    assert_eq!(
        s.state("s", "obs").await.unwrap(),
        Some(json!({"open": true})),
        "a repeated event does not write the state it carries"
    );
    // A sequence number taken by another event fails the step: the state is not written either.
    assert!(
        s.append_with_state("s", &ev("b", 1), "obs", &json!({"open": false}))
            .await
            .is_err()
    );
    assert_eq!(s.state("s", "obs").await.unwrap(), Some(json!({"open": true})));
}

/// A carried state and a state written alone are one value: whichever was stored last is read,
/// across a reopen, while the carried one writes no row of the state table (it rides on the
/// event's row) and one stored alone removes nothing of the record.
#[tokio::test]
async fn the_last_stored_value_of_a_key_is_read_whether_carried_or_put() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let state_rows = || {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.query_row("SELECT count(*) FROM state", [], |r| r.get::<_, i64>(0))
            .unwrap()
    };
    {
        let s = SqliteStore::open(&path).unwrap();
        s.append_with_state("s", &ev("a", 1), "obs", &json!(1))
            .await
            .unwrap();
        assert_eq!(s.state("s", "obs").await.unwrap(), Some(json!(1)));
        s.append_with_state("s", &ev("b", 2), "obs", &json!(2))
            .await
            .unwrap();
        s.append("s", &ev("c", 3)).await.unwrap();
        assert_eq!(
            s.state("s", "obs").await.unwrap(),
            Some(json!(2)),
            "the latest carrier"
        );
        assert_eq!(s.state("s", "other").await.unwrap(), None);
        assert_eq!(s.state("t", "obs").await.unwrap(), None, "another session's");
    }
    assert_eq!(state_rows(), 0, "carried values write no state row");
    {
        let s = SqliteStore::open(&path).unwrap();
        assert_eq!(s.state("s", "obs").await.unwrap(), Some(json!(2)));
        s.put_state("s", "obs", &json!(3)).await.unwrap();
        assert_eq!(
            s.state("s", "obs").await.unwrap(),
            Some(json!(3)),
            "put after carried"
        );
        s.append_with_state("s", &ev("d", 4), "obs", &json!(4))
            .await
            .unwrap();
        assert_eq!(
            s.state("s", "obs").await.unwrap(),
            Some(json!(4)),
            "carried after put"
        );
        s.put_state("s", "keep", &json!("k")).await.unwrap();
        s.append_with_state("s", &ev("e", 5), "obs", &json!(5))
            .await
            .unwrap();
        assert_eq!(
            s.state("s", "keep").await.unwrap(),
            Some(json!("k")),
            "other keys stay"
        );
    }
    let s = SqliteStore::open(&path).unwrap();
    assert_eq!(s.state("s", "obs").await.unwrap(), Some(json!(5)));
    assert_eq!(s.load("s").await.unwrap().len(), 5, "the record is whole");
    assert!(s.sessions().await.unwrap().contains(&"s".to_owned()));
}

/// A v4 file (before state could ride on an event) migrates with its state and record kept, and
/// then carries state on events.
#[tokio::test]
async fn a_v4_file_keeps_its_state_and_then_carries_state_on_events() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v4.db");
    {
        let v4 = SqliteStore::open_at_version(&path, 4).unwrap();
        v4.append("s", &ev("a", 1)).await.unwrap();
        v4.put_state("s", "obs", &json!("old")).await.unwrap();
    }
    let s = SqliteStore::open(&path).unwrap();
    assert_eq!(s.schema_version().unwrap(), SCHEMA_VERSION);
    assert_eq!(s.state("s", "obs").await.unwrap(), Some(json!("old")));
    s.append_with_state("s", &ev("b", 2), "obs", &json!("new"))
        .await
        .unwrap();
    assert_eq!(s.state("s", "obs").await.unwrap(), Some(json!("new")));
    assert_eq!(s.load("s").await.unwrap().len(), 2);
}

fn tid(s: &str) -> ThreadId {
    ThreadId::new(s).unwrap()
}

async fn claimed(s: &SqliteStore, thread: &str, agent: &str, record: &str, title: &str) -> (Thread, bool) {
    match s.claim_thread(&tid(thread), agent, record, title).await.unwrap() {
        Claim::Claimed { thread, created } => (thread, created),
        other => panic!("expected a claim of {thread}: {other:?}"),
    }
}

#[tokio::test]
async fn threads_keep_their_agent_provider_and_session_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        let s = SqliteStore::open(&path).unwrap();
        let (t, created) = claimed(&s, "t1", "default", "s_1", "hello").await;
        assert!(created);
        assert_eq!(
            (
                t.agent.as_str(),
                t.record.as_str(),
                t.title.as_str(),
                t.provider.as_str()
            ),
            ("default", "s_1", "hello", "")
        );
        assert_eq!(t.provider_session, None);
        s.set_provider_session(&tid("t1"), "acp", "sess-9").await.unwrap();
        claimed(&s, "t2", "coder", "s_2", "").await;
        assert!(
            s.set_provider_session(&tid("nope"), "acp", "x").await.is_err(),
            "no thread, nothing recorded"
        );
    }
    let s = SqliteStore::open(&path).unwrap();
    let t1 = s.thread(&tid("t1")).await.unwrap().unwrap();
    assert_eq!(
        (t1.provider.as_str(), t1.provider_session.as_deref()),
        ("acp", Some("sess-9"))
    );
    assert_eq!(s.thread(&tid("nope")).await.unwrap(), None);
    let coder: Vec<String> = s
        .threads(Some("coder"))
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.id.to_string())
        .collect();
    assert_eq!(coder, ["t2"]);
    assert_eq!(s.threads(None).await.unwrap().len(), 2);
}

#[tokio::test]
async fn a_claim_creates_keeps_or_refuses_a_thread_in_one_call() {
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open(dir.path().join("c.db")).unwrap();
    let (new, created) = claimed(&s, "t1", "main", "s_1", "first words").await;
    assert!(created);
    assert_eq!((new.record.as_str(), new.title.as_str()), ("s_1", "first words"));
    // The agent's own thread keeps its record and title whatever the call proposes.
    let (again, created) = claimed(&s, "t1", "main", "s_other", "later words").await;
    assert!(!created);
    assert_eq!(
        (again.record.as_str(), again.title.as_str()),
        ("s_1", "first words")
    );
    assert_eq!(again.created_ms, new.created_ms);
    assert!(again.updated_ms >= new.updated_ms);
    // Another agent's thread is refused and left as it was.
    match s.claim_thread(&tid("t1"), "coder", "s_2", "x").await.unwrap() {
        Claim::Taken(t) => assert_eq!((t.agent.as_str(), t.record.as_str()), ("main", "s_1")),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.thread(&tid("t1")).await.unwrap().unwrap().agent, "main");
    // A thread claimed without a title takes the first one offered.
    claimed(&s, "t2", "main", "s_3", "").await;
    let (t2, _) = claimed(&s, "t2", "main", "s_x", "now titled").await;
    assert_eq!((t2.record.as_str(), t2.title.as_str()), ("s_3", "now titled"));
}

#[tokio::test]
async fn an_older_schema_is_migrated_in_place_keeping_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    {
        let v1 = SqliteStore::open_at_version(&path, 1).unwrap();
        assert_eq!(v1.schema_version().unwrap(), 1);
        v1.append("s", &ev("a", 1)).await.unwrap();
        v1.put_tool_result("s", &ToolResult::ok("c", "r")).await.unwrap();
        assert!(v1.threads(None).await.is_err(), "v1 has no threads table");
    }
    let s = SqliteStore::open(&path).unwrap();
    assert_eq!(s.schema_version().unwrap(), SCHEMA_VERSION);
    assert_eq!(s.load("s").await.unwrap(), vec![ev("a", 1)]);
    assert_eq!(
        s.tool_result("s", "c").await.unwrap(),
        Some(ToolResult::ok("c", "r"))
    );
    claimed(&s, "t", "a", "s", "").await;
}

#[tokio::test]
async fn a_newer_schema_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new.db");
    drop(SqliteStore::open(&path).unwrap());
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch("PRAGMA user_version = 99").unwrap();
    }
    let err = SqliteStore::open(&path).unwrap_err();
    assert!(
        matches!(err, StoreError::NewerSchema { found: 99, .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("schema version 99") && msg.contains("upgrade tether"),
        "{msg}"
    );
}

#[tokio::test]
async fn foreign_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("other.db");
    {
        let c = rusqlite::Connection::open(&other).unwrap();
        c.execute_batch("CREATE TABLE accounts (id INTEGER)").unwrap();
    }
    let err = SqliteStore::open(&other).unwrap_err();
    assert!(matches!(err, StoreError::Foreign { .. }), "{err:?}");

    let text = dir.path().join("notes.txt");
    std::fs::write(
        &text,
        "this is not a database, just some text that is long enough ".repeat(20),
    )
    .unwrap();
    let err = SqliteStore::open(&text).unwrap_err();
    assert!(matches!(err, StoreError::Foreign { .. }), "{err:?}");
}

/// The engine on the SQLite store: a tool use redelivered after a restart returns the recorded
/// result instead of running the tool again, and the record continues without a gap.
#[tokio::test]
async fn a_redelivered_tool_use_after_a_restart_is_not_run_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let runs = Arc::new(AtomicUsize::new(0));
    let tools = {
        let runs = runs.clone();
        ToolSet::new().tool(
            ToolSpec::new("bump", "count", json!({"type": "object"})),
            move |_| {
                let runs = runs.clone();
                async move { Ok::<_, String>(format!("run {}", runs.fetch_add(1, Ordering::SeqCst) + 1)) }
            },
        )
    };
    {
        let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&path).unwrap());
        let model = ScriptedModel::new(vec![
            Ok(ScriptedModel::tool_calls(&[("call_1", "bump", "{}")])),
            Ok(ScriptedModel::text("done")),
        ]);
        let r = Session::builder(LocalLoop::new(model).session_id("sess"))
            .handler(tools.clone())
            .store(store)
            .run("go")
            .await
            .unwrap();
        assert_eq!(r.text, "done");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // "Restart": a new store on the same file, a new loop on the same session, and the model
    // redelivers the same call (same tool-use id, name and arguments: the same tool use; the
    // loop's duplicate guard is per request, and this is a new one).
    let store = SqliteStore::open(&path).unwrap();
    let transcript = store
        .state("sess", tether::thread::CHECKPOINT)
        .await
        .unwrap()
        .unwrap()["provider"]
        .clone();
    let model = ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("call_1", "bump", "{}")])),
        Ok(ScriptedModel::text("done again")),
    ]);
    let provider = LocalLoop::new(model)
        .session_id("sess")
        .transcript(&transcript)
        .unwrap();
    let shared: Arc<dyn EventStore> = Arc::new(store.clone());
    let r = Session::builder(provider)
        .handler(tools)
        .store(shared)
        .run("again")
        .await
        .unwrap();
    assert_eq!(r.text, "done again");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the memo answered the redelivered call"
    );
    // Every result the record holds for the call is the first run's (read from the record, not
    // by memo key, whose shape is the engine's business).
    let events = store.load("sess").await.unwrap();
    let results: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ToolResult { result } if result.tool_use_id == "call_1" => {
                Some(result.content.as_str())
            }
            _ => None,
        })
        .collect();
    assert!(
        !results.is_empty() && results.iter().all(|c| *c == "run 1"),
        "{results:?}"
    );
    let seqs: Vec<u64> = events.iter().filter_map(|e| e.seq).collect();
    let want: Vec<u64> = (1..=seqs.len() as u64).collect();
    assert_eq!(seqs, want, "the record is gapless across the restart");
}

mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Append(u8, u8),
        Memo(u8, u8, bool),
        State(u8, u8, i64),
        Claim(u8, u8),
        SetSession(u8, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..3, 0u8..6).prop_map(|(s, e)| Op::Append(s, e)),
            (0u8..3, 0u8..4, any::<bool>()).prop_map(|(s, t, e)| Op::Memo(s, t, e)),
            (0u8..3, 0u8..2, any::<i64>()).prop_map(|(s, k, v)| Op::State(s, k, v)),
            (0u8..3, 0u8..2).prop_map(|(t, a)| Op::Claim(t, a)),
            (0u8..3, 0u8..3).prop_map(|(t, s)| Op::SetSession(t, s)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// Any sequence of operations, with a restart in the middle, leaves the SQLite store in
        /// the same observable state as the in-memory reference.
        #[test]
        fn behaves_like_the_memory_store(ops in proptest::collection::vec(op(), 1..40), cut in 0usize..40) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let dir = tempfile::tempdir().unwrap();
                let path = dir.path().join("p.db");
                let mem = MemoryStore::default();
                let mut sql = SqliteStore::open(&path).unwrap();
                let mut seq = 0u64;
                for (i, o) in ops.iter().enumerate() {
                    if i == cut {
                        drop(sql);
                        sql = SqliteStore::open(&path).unwrap();
                    }
                    match o {
                        Op::Append(s, e) => {
                            seq += 1;
                            let event = ev(&format!("e{e}"), seq);
                            let sid = format!("s{s}");
                            assert_eq!(mem.append(&sid, &event).await.unwrap(), sql.append(&sid, &event).await.unwrap());
                        }
                        Op::Memo(s, t, err) => {
                            let r = if *err { ToolResult::error(format!("t{t}"), format!("x{seq}")) } else { ToolResult::ok(format!("t{t}"), format!("x{seq}")) };
                            let sid = format!("s{s}");
                            mem.put_tool_result(&sid, &r).await.unwrap();
                            sql.put_tool_result(&sid, &r).await.unwrap();
                        }
                        Op::State(s, k, v) => {
                            let sid = format!("s{s}");
                            mem.put_state(&sid, &format!("k{k}"), &json!(v)).await.unwrap();
                            sql.put_state(&sid, &format!("k{k}"), &json!(v)).await.unwrap();
                        }
                        Op::Claim(t, a) => {
                            let (t, a, rec) = (tid(&format!("t{t}")), format!("a{a}"), format!("r{i}"));
                            let m = mem.claim_thread(&t, &a, &rec, "title").await.unwrap();
                            let q = sql.claim_thread(&t, &a, &rec, "title").await.unwrap();
                            let shape = |c: &Claim| match c {
                                Claim::Claimed { thread, created } => (true, *created, thread.agent.clone(), thread.record.clone()),
                                Claim::Taken(thread) => (false, false, thread.agent.clone(), thread.record.clone()),
                                _ => unreachable!(),
                            };
                            assert_eq!(shape(&m), shape(&q));
                        }
                        Op::SetSession(t, s) => {
                            let t = tid(&format!("t{t}"));
                            let m = mem.set_provider_session(&t, "p", &format!("x{s}")).await.is_ok();
                            let q = sql.set_provider_session(&t, "p", &format!("x{s}")).await.is_ok();
                            assert_eq!(m, q);
                        }
                    }
                }
                for t in 0..3 {
                    let t = tid(&format!("t{t}"));
                    let strip = |x: Option<Thread>| x.map(|x| (x.agent, x.record, x.provider, x.provider_session, x.title));
                    assert_eq!(strip(mem.thread(&t).await.unwrap()), strip(sql.thread(&t).await.unwrap()));
                }
                assert_eq!(mem.sessions().await.unwrap(), sql.sessions().await.unwrap());
                for s in 0..3 {
                    let sid = format!("s{s}");
                    assert_eq!(mem.load(&sid).await.unwrap(), sql.load(&sid).await.unwrap());
                    for t in 0..4 {
                        let id = format!("t{t}");
                        assert_eq!(mem.tool_result(&sid, &id).await.unwrap(), sql.tool_result(&sid, &id).await.unwrap());
                    }
                    for k in 0..2 {
                        let key = format!("k{k}");
                        assert_eq!(mem.state(&sid, &key).await.unwrap(), sql.state(&sid, &key).await.unwrap());
                    }
                }
            });
        }
    }
}

/// Calls that arrive together are committed together: every one is answered after its group's
/// commit, each is exactly-once on its own, and all of them are in the file after a reopen.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_are_committed_in_groups_and_all_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        let s = SqliteStore::open(&path).unwrap();
        let tasks: Vec<_> = (0..400u64)
            .map(|i| {
                let s = s.clone();
                tokio::spawn(async move {
                    let sid = format!("s{}", i % 40);
                    let first = s.append(&sid, &ev(&format!("e{i}"), i + 1)).await.unwrap();
                    let again = s.append(&sid, &ev(&format!("e{i}"), i + 1)).await.unwrap();
                    s.put_tool_result(&sid, &ToolResult::ok(format!("t{i}"), "done"))
                        .await
                        .unwrap();
                    (first, again)
                })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap(), (true, false));
        }
    }
    let s = SqliteStore::open(&path).unwrap();
    let mut n = 0;
    for k in 0..40 {
        let sid = format!("s{k}");
        n += s.load(&sid).await.unwrap().len();
    }
    assert_eq!(n, 400);
    assert!(s.tool_result("s7", "t7").await.unwrap().is_some());
}

/// A database `tether serve` wrote before threads moved into the core (schema 3): each user
/// message recorded twice (`serve.user_message`, and the engine's `tether.user_message` copy),
/// serve's own checkpoint. Migrated to schema 4, its threads stay readable and resume where they
/// were, each user message once.
#[tokio::test]
async fn a_thread_tether_serve_wrote_before_version_4_is_migrated_and_resumes() {
    use tether::{ChatMessage, Role, raw};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    let user = |id: &str, seq: u64, event_id: &str, ty: &str, text: &str| {
        let mut e = Event::new(
            event_id,
            ty,
            json!({"id": id, "text": text}),
            EventKind::Message {
                message_id: id.into(),
                role: Role::User,
                text: text.into(),
                reasoning: None,
                tool_uses: vec![],
            },
        );
        e.seq = Some(seq);
        e
    };
    let answer = |seq: u64, id: &str, text: &str| {
        let mut e = Event::new(
            id,
            "local.model_response",
            json!({"type": "local.model_response", "message": ChatMessage::assistant(text)}),
            EventKind::Message {
                message_id: id.into(),
                role: Role::Assistant,
                text: text.into(),
                reasoning: None,
                tool_uses: vec![],
            },
        );
        e.seq = Some(seq);
        e
    };
    let history = vec![
        ChatMessage::system("be brief"),
        ChatMessage::user("hello"),
        ChatMessage::assistant("hi there"),
    ];
    {
        let v3 = SqliteStore::open_at_version(&path, 3).unwrap();
        // A thread checkpointed by serve after its first exchange.
        for e in [
            user("u1", 1, "user:u1", "serve.user_message", "hello"),
            user("", 2, "s_1:2", "tether.user_message", "hello"),
            answer(3, "s_1.ab-m2", "hi there"),
        ] {
            v3.append("s_1", &e).await.unwrap();
        }
        v3.put_state(
            "s_1",
            "serve.checkpoint",
            &json!({"transcript": history, "seq": 3}),
        )
        .await
        .unwrap();
        v3.put_state("s_1", "transcript", &json!(history)).await.unwrap();
        // A thread killed before serve saved any checkpoint.
        for e in [
            user("v1", 1, "user:v1", "serve.user_message", "first"),
            user("", 2, "s_2:2", "tether.user_message", "first"),
            answer(3, "s_2.cd-m1", "answered"),
        ] {
            v3.append("s_2", &e).await.unwrap();
        }
    }
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(
            "INSERT INTO threads (thread_id, agent, session_id, title, created_ms, updated_ms) VALUES
               ('t-old', 'main', 's_1', 'hello', 1, 1), ('t-old2', 'main', 's_2', 'first', 1, 2);",
        )
        .unwrap();
    }
    let store = Arc::new(SqliteStore::open(&path).unwrap());
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    let t = store.thread(&tid("t-old")).await.unwrap().unwrap();
    assert_eq!((t.provider.as_str(), t.record.as_str()), ("local", "s_1"));
    let events = store.load("s_1").await.unwrap();
    let types: Vec<&str> = events.iter().map(|e| e.raw_type.as_str()).collect();
    assert_eq!(
        types,
        [
            raw::USER_MESSAGE,
            "serve.engine_user_message",
            raw::LOCAL_MODEL_RESPONSE
        ],
        "serve's user message is the one user message; the engine's copy is kept under another name"
    );
    let cp = store
        .state("s_1", tether::thread::CHECKPOINT)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cp["seq"], 3);
    assert_eq!(
        cp["provider"],
        json!(history),
        "serve's checkpoint became the thread's"
    );
    assert_eq!(store.state("s_1", "serve.checkpoint").await.unwrap(), None);

    for (thread, expected) in [
        (
            "t-old",
            vec![(Role::User, "hello"), (Role::Assistant, "hi there")],
        ),
        (
            "t-old2",
            vec![(Role::User, "first"), (Role::Assistant, "answered")],
        ),
    ] {
        let model = Arc::new(ScriptedModel::new(vec![Ok(ScriptedModel::text("more"))]));
        let m: Arc<dyn tether::ChatModel> = model.clone();
        let mut s = Session::builder(LocalLoop::with_model(m).system_prompt("be brief"))
            .thread(store.clone(), tid(thread), "main")
            .open()
            .await
            .unwrap();
        assert!(s.knows_message(if thread == "t-old" { "u1" } else { "v1" }).await);
        s.send_messages(
            vec![tether::UserMessage::with_id("next", "and then?")],
            tether::CancellationToken::new(),
        )
        .await
        .unwrap();
        let sent: Vec<(Role, String)> = model.requests()[0]
            .messages
            .iter()
            .filter(|m| m.role != Role::System)
            .map(|m| (m.role, m.content.clone().unwrap_or_default()))
            .collect();
        let mut want: Vec<(Role, String)> = expected.iter().map(|(r, t)| (*r, (*t).to_owned())).collect();
        want.push((Role::User, "and then?".into()));
        assert_eq!(sent, want, "{thread}: the history once, then the new message");
    }
}
