//! One writer per database, on real files: a second store on the same file is refused (from
//! this process or another), the lock dies with a killed holder, the schema holds one event per
//! sequence number (and says which events break it in an older file), and two processes
//! migrating one fresh file at once both succeed.
//!
//! The child processes are this test binary run again on [`child_process`], told what to do
//! by `TETHER_SQLITE_CHILD`.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::json;
use tether::{Event, EventKind, EventStore, ToolResult};
use tether_sqlite::{SCHEMA_VERSION, SqliteStore, StoreError};

/// Generous: a child process on a loaded 2-core machine can be slow to start.
const DEADLINE: Duration = Duration::from_secs(60);

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

/// Not a test: the body of the child processes the tests below start (it does nothing when run
/// on its own, hence ignored).
///
/// - `hold:<path>`: opens a store on `path`, prints `held <pid>`, and keeps it until stdin
///   closes (or the process is killed).
/// - `migrate:<path>`: prints `ready`, waits for a line on stdin, migrates `path` without the
///   store's lock, and prints `migrated <version>` (or panics, exiting non-zero).
#[test]
#[ignore = "run as a child process by the other tests of this file"]
fn child_process() {
    let Ok(what) = std::env::var("TETHER_SQLITE_CHILD") else {
        return;
    };
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    if let Some(path) = what.strip_prefix("hold:") {
        let store = SqliteStore::open(path).expect("the child opens the store");
        println!("held {}", std::process::id());
        std::io::stdout().flush().unwrap();
        let _ = stdin.read_line(&mut line);
        drop(store);
    } else if let Some(path) = what.strip_prefix("migrate:") {
        println!("ready");
        std::io::stdout().flush().unwrap();
        stdin.read_line(&mut line).unwrap();
        let v = SqliteStore::migrate_unlocked(path).expect("the child migrates the file");
        println!("migrated {v}");
    } else {
        panic!("unknown child task {what}");
    }
}

/// A child process running [`child_process`], with its stdout as lines.
struct Child {
    child: std::process::Child,
    lines: mpsc::Receiver<String>,
}

impl Child {
    fn start(task: String) -> Child {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "child_process",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("TETHER_SQLITE_CHILD", task)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Child { child, lines }
    }

    /// The rest of the first line holding `prefix`, from `prefix` on (libtest prints text of its
    /// own around the child's, on the same line: `test child_process ... ready`).
    fn wait_for(&self, prefix: &str) -> String {
        loop {
            match self.lines.recv_timeout(DEADLINE) {
                Ok(l) => match l.find(prefix) {
                    Some(at) => return l[at..].to_owned(),
                    None => continue,
                },
                Err(e) => panic!("the child never printed `{prefix}…`: {e}"),
            }
        }
    }

    fn send(&mut self, line: &str) {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(line.as_bytes()).unwrap();
        stdin.flush().unwrap();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn assert_locked(err: StoreError, path: &Path, holder: &str) {
    let msg = err.to_string();
    match &err {
        StoreError::Locked {
            path: p,
            holder: h,
            lock_file,
        } => {
            assert_eq!(p, &path.display().to_string());
            assert!(h.contains(holder), "holder `{h}` should name {holder}");
            assert!(lock_file.ends_with("-lock"), "{lock_file}");
        }
        other => panic!("expected Locked, got {other:?}"),
    }
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains("already in use") && msg.contains(holder),
        "{msg}"
    );
}

#[tokio::test]
async fn a_second_store_on_one_file_in_this_process_is_refused_until_the_first_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let first = SqliteStore::open(&path).unwrap();
    let clone = first.clone();
    assert_locked(SqliteStore::open(&path).unwrap_err(), &path, "this process");
    // The refused open touched nothing: the first store still works.
    assert!(first.append("s", &ev("a", 1)).await.unwrap());
    // A clone keeps the lock: dropping the original is not dropping the store.
    drop(first);
    assert!(matches!(SqliteStore::open(&path), Err(StoreError::Locked { .. })));
    assert!(clone.append("s", &ev("b", 2)).await.unwrap());
    // Dropping the last clone releases the lock before `drop` returns.
    drop(clone);
    // Another test of this binary forking a child at that moment shares the lock's open file
    // description until the child's exec closes it (a few milliseconds): retry briefly.
    let mut again = SqliteStore::open(&path);
    for _ in 0..200 {
        if !matches!(again, Err(StoreError::Locked { .. })) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        again = SqliteStore::open(&path);
    }
    let again = again.unwrap();
    assert_eq!(again.load("s").await.unwrap(), vec![ev("a", 1), ev("b", 2)]);
    // Migration tests reopen at a version: the same lock.
    assert!(matches!(
        SqliteStore::open_at_version(&path, 1),
        Err(StoreError::Locked { .. })
    ));
}

#[tokio::test]
async fn another_name_for_the_same_file_is_the_same_lock() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("real.db");
    let _first = SqliteStore::open(&path).unwrap();
    let link = dir.path().join("link.db");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    assert_locked(SqliteStore::open(&link).unwrap_err(), &link, "this process");
    let dotted = dir.path().join(".").join("real.db");
    assert!(matches!(
        SqliteStore::open(&dotted),
        Err(StoreError::Locked { .. })
    ));
}

#[tokio::test]
async fn in_memory_stores_take_no_lock_and_readers_are_not_shut_out() {
    let a = SqliteStore::open_in_memory().unwrap();
    let b = SqliteStore::open_in_memory().unwrap();
    assert!(a.append("s", &ev("x", 1)).await.unwrap());
    assert!(b.load("s").await.unwrap().is_empty(), "each is its own");

    // The lock keeps out a second store, not a reader: the sqlite3 shell (here a plain
    // connection) can still inspect a running server's database.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let store = SqliteStore::open(&path).unwrap();
    store.append("s", &ev("x", 1)).await.unwrap();
    let reader = rusqlite::Connection::open(&path).unwrap();
    let n: i64 = reader
        .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 1);
}

#[tokio::test]
async fn a_store_held_by_another_process_is_refused_and_freed_when_that_process_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let mut holder = Child::start(format!("hold:{}", path.display()));
    let held = holder.wait_for("held ");
    let pid = held.trim_start_matches("held ").trim().to_owned();
    assert_locked(
        SqliteStore::open(&path).unwrap_err(),
        &path,
        &format!("process {pid}"),
    );
    // SIGKILL: no destructor runs, the kernel drops the lock with the process.
    holder.child.kill().unwrap();
    holder.child.wait().unwrap();
    let store = SqliteStore::open(&path).expect("a dead holder keeps no lock");
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);

    // And the other way round: while this process holds it, a child cannot open it.
    let refused = Command::new(std::env::current_exe().unwrap())
        .args(["child_process", "--exact", "--ignored", "--nocapture"])
        .env("TETHER_SQLITE_CHILD", format!("hold:{}", path.display()))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "the child's open must fail");
    assert!(
        err.contains("Locked") && err.contains(&format!("process {}", std::process::id())),
        "{err}"
    );
}

#[tokio::test]
async fn one_event_per_sequence_number_and_a_conflict_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let s = SqliteStore::open(&path).unwrap();
    assert!(s.append_event("s", &ev("a", 1)).await.unwrap());
    match s.append_event("s", &ev("b", 1)).await {
        Err(StoreError::SequenceTaken {
            session_id,
            seq,
            event_id,
            existing_event_id,
            ..
        }) => {
            assert_eq!(
                (
                    session_id.as_str(),
                    seq,
                    event_id.as_str(),
                    existing_event_id.as_str()
                ),
                ("s", 1, "b", "a")
            );
        }
        other => panic!("expected SequenceTaken, got {other:?}"),
    }
    // Through the EventStore trait: an error (not `Ok(false)`, which would tell the engine the
    // event is already recorded and lose it).
    let err = s.append("s", &ev("b", 1)).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("already has event a at sequence number 1"),
        "{err}"
    );
    // A repeated id is still the quiet "already stored", whatever its number.
    assert!(!s.append("s", &ev("a", 1)).await.unwrap());
    assert!(!s.append("s", &ev("a", 7)).await.unwrap());
    // Other sessions, and the next number, are free; events without a number do not conflict.
    assert!(s.append("t", &ev("b", 1)).await.unwrap());
    assert!(s.append("s", &ev("b", 2)).await.unwrap());
    let mut live = ev("c", 0);
    live.seq = None;
    let mut live2 = ev("d", 0);
    live2.seq = None;
    assert!(s.append("s", &live).await.unwrap());
    assert!(s.append("s", &live2).await.unwrap());
    let ids: Vec<String> = s.load("s").await.unwrap().into_iter().map(|e| e.id).collect();
    assert_eq!(ids, ["a", "b", "c", "d"]);
}

#[tokio::test]
async fn the_memo_holds_one_result_per_tool_use() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        let s = SqliteStore::open(&path).unwrap();
        s.put_tool_result("s", &ToolResult::ok("call_1", "first"))
            .await
            .unwrap();
        s.put_tool_result("s", &ToolResult::ok("call_1", "contradicting"))
            .await
            .unwrap();
        assert_eq!(
            s.tool_result("s", "call_1").await.unwrap().unwrap().content,
            "first"
        );
    }
    // The schema itself refuses a second row, whoever writes it.
    let c = rusqlite::Connection::open(&path).unwrap();
    let err = c
        .execute(
            "INSERT INTO tool_results (session_id, tool_use_id, content, is_error, created_ms)
             VALUES ('s', 'call_1', 'other', 0, 0)",
            [],
        )
        .unwrap_err();
    assert_eq!(
        err.sqlite_error_code(),
        Some(rusqlite::ErrorCode::ConstraintViolation)
    );
}

/// A v2 file written by two servers at once holds events sharing a sequence number: the
/// migration to the unique index refuses, naming them and changing nothing; once they are
/// resolved it goes through.
#[tokio::test]
async fn migrating_a_file_with_duplicate_sequence_numbers_names_them_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    {
        let v2 = SqliteStore::open_at_version(&path, 2).unwrap();
        assert_eq!(v2.schema_version().unwrap(), 2);
        for (id, seq) in [("a", 1), ("b", 2), ("b-twin", 2), ("c", 3), ("c-twin", 3)] {
            assert!(v2.append("s1", &ev(id, seq)).await.unwrap());
        }
        assert!(v2.append("s2", &ev("a", 1)).await.unwrap());
    }
    let err = SqliteStore::open(&path).unwrap_err();
    match &err {
        StoreError::DuplicateSequence {
            total, duplicates, ..
        } => {
            assert_eq!(*total, 2);
            assert_eq!(
                duplicates
                    .iter()
                    .map(|d| (d.session_id.as_str(), d.seq, d.event_ids.join(",")))
                    .collect::<Vec<_>>(),
                [("s1", 2, "b,b-twin".to_owned()), ("s1", 3, "c,c-twin".to_owned())]
            );
        }
        other => panic!("expected DuplicateSequence, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("session s1 seq 2: events b, b-twin") && msg.contains("Back the file up"),
        "{msg}"
    );
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        let v: u32 = c.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
        assert_eq!(v, 2, "the refused migration changed nothing");
        c.execute_batch("DELETE FROM events WHERE event_id IN ('b-twin', 'c-twin')")
            .unwrap();
    }
    let s = SqliteStore::open(&path).unwrap();
    assert_eq!(s.schema_version().unwrap(), SCHEMA_VERSION);
    let ids: Vec<String> = s.load("s1").await.unwrap().into_iter().map(|e| e.id).collect();
    assert_eq!(ids, ["a", "b", "c"]);
    assert!(matches!(
        s.append_event("s1", &ev("d", 3)).await,
        Err(StoreError::SequenceTaken { .. })
    ));
}

/// Two processes migrating one fresh file at the same moment, without the lock (as two older
/// tether builds, or any two connections, would): both succeed, and the file ends at the
/// current version with its schema created once. Several rounds, since the race is a race.
#[test]
fn two_processes_migrating_one_fresh_file_at_once_both_succeed() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..6 {
        let path = dir.path().join(format!("race{round}.db"));
        let mut a = Child::start(format!("migrate:{}", path.display()));
        let mut b = Child::start(format!("migrate:{}", path.display()));
        a.wait_for("ready");
        b.wait_for("ready");
        a.send("go\n");
        b.send("go\n");
        for c in [&a, &b] {
            assert_eq!(
                c.wait_for("migrated"),
                format!("migrated {SCHEMA_VERSION}"),
                "round {round}"
            );
        }
        for c in [&mut a, &mut b] {
            assert!(c.child.wait().unwrap().success(), "round {round}");
        }
        let s = SqliteStore::open(&path).unwrap();
        assert_eq!(s.schema_version().unwrap(), SCHEMA_VERSION);
    }
}

/// The same race between two connections of one process, many times over (cheaper than
/// processes, so more rounds).
#[test]
fn two_connections_migrating_one_fresh_file_at_once_both_succeed() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..40 {
        let path = dir.path().join(format!("race{round}.db"));
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let runs: Vec<_> = (0..2)
            .map(|_| {
                let (path, barrier) = (path.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    SqliteStore::migrate_unlocked(&path)
                })
            })
            .collect();
        for r in runs {
            let v = r.join().unwrap();
            assert_eq!(v.unwrap(), SCHEMA_VERSION, "round {round}");
        }
    }
}
