//! The SQLite store against real files: exactly-once append, the memo, state, threads, reopen
//! after a restart, migrations, refusals, and the session engine on top of it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::json;
use tether::{
    Event, EventKind, EventStore, MemoryStore, ScriptedModel, Session, ToolResult, ToolSet, ToolSpec,
    local::LocalLoop,
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

#[tokio::test]
async fn threads_map_to_sessions_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        let s = SqliteStore::open(&path).unwrap();
        let t = s.put_thread("t1", "default", "local_1", "hello").await.unwrap();
        assert_eq!(
            (t.agent.as_str(), t.session_id.as_str(), t.title.as_str()),
            ("default", "local_1", "hello")
        );
        s.put_thread("t2", "coder", "local_2", "").await.unwrap();
        // An update keeps the title when none is given, and the creation time.
        let again = s.put_thread("t1", "default", "local_1", "").await.unwrap();
        assert_eq!(again.title, "hello");
        assert_eq!(again.created_ms, t.created_ms);
    }
    let s = SqliteStore::open(&path).unwrap();
    assert_eq!(s.thread("t1").await.unwrap().unwrap().session_id, "local_1");
    assert_eq!(s.thread("nope").await.unwrap(), None);
    let coder: Vec<String> = s
        .threads(Some("coder"))
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.thread_id)
        .collect();
    assert_eq!(coder, ["t2"]);
    assert_eq!(s.threads(None).await.unwrap().len(), 2);
    s.touch_thread("t1").await.unwrap();
}

#[tokio::test]
async fn a_claim_creates_keeps_or_refuses_a_thread_in_one_call() {
    use tether_sqlite::Claim;
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open(dir.path().join("c.db")).unwrap();
    let Claim::Claimed(new) = s.claim_thread("t1", "main", "s_1", "first words").await.unwrap() else {
        panic!("a new thread is claimed")
    };
    assert_eq!(
        (new.session_id.as_str(), new.title.as_str()),
        ("s_1", "first words")
    );
    // The agent's own thread keeps its session and title whatever the call proposes.
    let Claim::Claimed(again) = s
        .claim_thread("t1", "main", "s_other", "later words")
        .await
        .unwrap()
    else {
        panic!("the agent's own thread is claimed again")
    };
    assert_eq!(
        (again.session_id.as_str(), again.title.as_str()),
        ("s_1", "first words")
    );
    assert_eq!(again.created_ms, new.created_ms);
    // Another agent's thread is refused and left as it was.
    match s.claim_thread("t1", "coder", "s_2", "x").await.unwrap() {
        Claim::Taken(t) => assert_eq!((t.agent.as_str(), t.session_id.as_str()), ("main", "s_1")),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.thread("t1").await.unwrap().unwrap().agent, "main");
    // A thread stored without a title takes the first one offered.
    s.put_thread("t2", "main", "s_3", "").await.unwrap();
    let Claim::Claimed(t2) = s.claim_thread("t2", "main", "s_x", "now titled").await.unwrap() else {
        panic!()
    };
    assert_eq!((t2.session_id.as_str(), t2.title.as_str()), ("s_3", "now titled"));
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
    s.put_thread("t", "a", "s", "").await.unwrap();
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
    let transcript = store.state("sess", "transcript").await.unwrap().unwrap();
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
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..3, 0u8..6).prop_map(|(s, e)| Op::Append(s, e)),
            (0u8..3, 0u8..4, any::<bool>()).prop_map(|(s, t, e)| Op::Memo(s, t, e)),
            (0u8..3, 0u8..2, any::<i64>()).prop_map(|(s, k, v)| Op::State(s, k, v)),
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
                    }
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
