//! # tether-sqlite
//!
//! A durable [`EventStore`] on SQLite (bundled, WAL journal): a session's events are appended
//! exactly once (unique on session and event id), tool results are memoized by tool-use id so a
//! redelivered tool call returns the recorded result instead of running the tool again, named
//! state values are kept per session (the thread checkpoint among them), and threads
//! (`tether::ThreadStore`: a thread's agent, provider, provider session and record) are kept
//! for every provider. Everything survives a crash of the process: each write is committed before
//! the call returns.
//!
//! One thread owns the connection and does every read and write. Calls that arrive while it is
//! busy are run together in one transaction (group commit), each inside its own savepoint so a
//! failing call is rolled back alone; every call of the group is answered only after the
//! group's `COMMIT`, so nothing is acknowledged before it is durable.
//!
//! One store per file: [`SqliteStore::open`] takes an exclusive lock on the database (a
//! `<db>-lock` file beside it, held for the store's life and dropped by the kernel if the process
//! dies) and refuses a file another store holds with [`StoreError::Locked`], naming the holder.
//! Two servers on one database would number one session's events twice; the schema refuses that
//! too (one event per session and sequence number: [`StoreError::SequenceTaken`]).
//!
//! The schema is versioned (`PRAGMA user_version`); [`SqliteStore::open`] migrates a database
//! written by an older version in place (reading the version and migrating inside one
//! `BEGIN IMMEDIATE` transaction, so concurrent migrations of one file are serialised) and
//! refuses, with [`StoreError::NewerSchema`], one written by a newer version.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use tether::{EventStore, Session, ScriptedModel, local::LocalLoop};
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("tether.db");
//! let store: Arc<dyn EventStore> = Arc::new(tether_sqlite::SqliteStore::open(&path)?);
//! let model = ScriptedModel::new(vec![Ok(ScriptedModel::text("hi"))]);
//! let result = Session::builder(LocalLoop::new(model)).store(store.clone()).run("Say hi").await?;
//! // Every event of the session is in the database, in order, once.
//! let events = store.load(&result.session_id).await?;
//! assert!(!events.is_empty());
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use rusqlite::{Connection, OptionalExtension, params};
use serde_json::Value;
use tether::{Claim, Event, EventStore, Thread, ThreadId, ThreadStart, ThreadStore, ToolResult};

mod lock;

/// `PRAGMA application_id` of a tether database ("TETH").
pub const APPLICATION_ID: i32 = 0x5445_5448;

/// The migrations, in order: migration `i` (0-based) brings the schema to version `i + 1`.
/// Never edit one that has shipped; append a new one.
const MIGRATIONS: &[&str] = &[
    // v1: sessions, the exactly-once event record, the tool-result memo, named state.
    "CREATE TABLE sessions (
        session_id TEXT PRIMARY KEY NOT NULL,
        created_ms INTEGER NOT NULL,
        updated_ms INTEGER NOT NULL
     );
     CREATE TABLE events (
        session_id TEXT NOT NULL,
        event_id TEXT NOT NULL,
        seq INTEGER,
        body TEXT NOT NULL,
        UNIQUE (session_id, event_id)
     );
     CREATE INDEX events_by_seq ON events (session_id, seq);
     CREATE TABLE tool_results (
        session_id TEXT NOT NULL,
        tool_use_id TEXT NOT NULL,
        content TEXT NOT NULL,
        is_error INTEGER NOT NULL,
        created_ms INTEGER NOT NULL,
        PRIMARY KEY (session_id, tool_use_id)
     );
     CREATE TABLE state (
        session_id TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (session_id, key)
     );",
    // v2: AG-UI threads mapped to provider sessions.
    "CREATE TABLE threads (
        thread_id TEXT PRIMARY KEY NOT NULL,
        agent TEXT NOT NULL,
        session_id TEXT NOT NULL,
        title TEXT NOT NULL DEFAULT '',
        created_ms INTEGER NOT NULL,
        updated_ms INTEGER NOT NULL
     );
     CREATE INDEX threads_by_agent ON threads (agent, updated_ms);",
    // v3: one event per sequence number of a session, enforced by the schema (two writers on
    // one file once stored two events under one number). `check_before` runs first and
    // refuses, naming them, a file that already holds such pairs.
    "DROP INDEX events_by_seq;
     CREATE UNIQUE INDEX events_by_seq ON events (session_id, seq);",
    // v4: threads are the core's (tether::thread), for every provider: each records its provider
    // and that provider's session handle. Threads written before ran `tether serve`'s local loop,
    // whose records this brings to the core's format so they stay readable and resumable:
    // - serve recorded each user message twice, as `serve.user_message` (event id `user:<id>`,
    //   the one the thread's history was rebuilt from) and as the engine's `tether.user_message`;
    //   the first becomes the thread's one `tether.user_message`, the engine's copy is renamed
    //   `serve.engine_user_message` (kept, read by nothing);
    // - serve's checkpoint (`serve.checkpoint`: {transcript, seq}) becomes the thread's
    //   (`tether.checkpoint`: {seq, provider}); the engine's `transcript` state, which the thread
    //   checkpoint replaces, goes (both are caches of the record);
    // - serve's outstanding approval interrupts move to the AG-UI adapter's key.
    "ALTER TABLE threads ADD COLUMN provider TEXT NOT NULL DEFAULT '';
     ALTER TABLE threads ADD COLUMN provider_session TEXT;
     UPDATE threads SET provider = 'local';
     UPDATE events SET body = json_set(body, '$.type', 'serve.engine_user_message')
      WHERE json_extract(body, '$.type') = 'tether.user_message'
        AND session_id IN (SELECT session_id FROM events
                           WHERE json_extract(body, '$.type') = 'serve.user_message');
     UPDATE events SET body = json_set(body, '$.type', 'tether.user_message')
      WHERE json_extract(body, '$.type') = 'serve.user_message';
     INSERT OR REPLACE INTO state (session_id, key, value)
      SELECT session_id, 'tether.checkpoint',
             json_object('seq', coalesce(json_extract(value, '$.seq'), 0),
                         'provider', json(json_extract(value, '$.transcript')))
        FROM state WHERE key = 'serve.checkpoint';
     DELETE FROM state WHERE key IN ('serve.checkpoint', 'transcript');
     UPDATE state SET key = 'agui.interrupts' WHERE key = 'serve.interrupts';",
    // v5: a state value can ride on the row of the event it was written with
    // (`EventStore::append_with_state`: a traced request's trace state, with its model
    // response). In the state table each new session's row went to a leaf page of its index
    // of its own: about three more pages per request through the WAL and the checkpoint, ten
    // more writes. `state` reads the state table first, then the session's latest event
    // carrying the key: a state-table value is always the newer, since storing an event that
    // carries a key deletes that key's row.
    "ALTER TABLE events ADD COLUMN state_key TEXT;
     ALTER TABLE events ADD COLUMN state_value TEXT;",
];

/// What must hold before the migration to `version` runs.
fn check_before(version: u32, c: &Connection, p: &str) -> Result<(), StoreError> {
    match version {
        3 => check_unique_seq(c, p),
        _ => Ok(()),
    }
}

/// Most duplicate sequence numbers a [`StoreError::DuplicateSequence`] lists.
const DUPLICATES_SHOWN: usize = 10;

/// Refuses to add the unique (session, seq) index over events that already break it, listing
/// them, rather than failing with SQLite's bare "UNIQUE constraint failed".
fn check_unique_seq(c: &Connection, p: &str) -> Result<(), StoreError> {
    let mut st = c
        .prepare(
            "SELECT e.session_id, e.seq, e.event_id FROM events e
             JOIN (SELECT session_id, seq FROM events WHERE seq IS NOT NULL
                   GROUP BY session_id, seq HAVING count(*) > 1) d
               ON e.session_id = d.session_id AND e.seq = d.seq
             ORDER BY e.session_id, e.seq, e.rowid",
        )
        .map_err(|e| sql(p, e))?;
    let rows = st
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, String>(2)?,
            ))
        })
        .map_err(|e| sql(p, e))?;
    let mut all: Vec<SeqDuplicate> = Vec::new();
    for row in rows {
        let (session_id, seq, event_id) = row.map_err(|e| sql(p, e))?;
        match all.last_mut() {
            Some(d) if d.session_id == session_id && d.seq == seq => d.event_ids.push(event_id),
            _ => all.push(SeqDuplicate {
                session_id,
                seq,
                event_ids: vec![event_id],
            }),
        }
    }
    if all.is_empty() {
        return Ok(());
    }
    Err(StoreError::DuplicateSequence {
        path: p.into(),
        total: all.len(),
        duplicates: all.into_iter().take(DUPLICATES_SHOWN).collect(),
    })
}

/// The schema version this build writes (and the newest it can open).
pub const SCHEMA_VERSION: u32 = MIGRATIONS.len() as u32;

/// Why the store could not be opened or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// SQLite failed.
    #[error("SQLite error on {path}: {source}")]
    Sqlite {
        /// The database file.
        path: String,
        /// The SQLite error.
        #[source]
        source: rusqlite::Error,
    },
    /// The database was written by a newer version of tether.
    #[error(
        "{path} has schema version {found}, but this build of tether supports up to version {supported}; \
         upgrade tether, or point it at another database file"
    )]
    NewerSchema {
        /// The database file.
        path: String,
        /// The version found in the file.
        found: u32,
        /// The newest version this build knows.
        supported: u32,
    },
    /// The file is an SQLite database, but not one of tether's.
    #[error("{path} is an SQLite database of another application ({detail}); point tether at another file")]
    Foreign {
        /// The database file.
        path: String,
        /// What gave it away.
        detail: String,
    },
    /// A stored value could not be decoded.
    #[error("corrupt record in {path}: {detail}")]
    Corrupt {
        /// The database file.
        path: String,
        /// What could not be decoded.
        detail: String,
    },
    /// The connection's lock was poisoned by a panic in another thread.
    #[error("the store's connection lock was poisoned by a panic; restart the process")]
    Poisoned,
    /// A blocking task could not be joined.
    #[error("a store task failed: {0}")]
    Join(String),
    /// The transaction a call was part of could not be committed: nothing of it was stored.
    #[error("SQLite error on {path}: committing failed: {message}")]
    Commit {
        /// The database file.
        path: String,
        /// Why.
        message: String,
    },
    /// Another store has the database open (a second `tether serve` on the same `--db`, or a
    /// second [`SqliteStore::open`] in this process): one writer per file, or two servers would
    /// number one session's events twice.
    #[error(
        "{path} is already in use by {holder} (it holds the lock on {lock_file}); \
         stop that process first, or point this one at another database file"
    )]
    Locked {
        /// The database file.
        path: String,
        /// The lock file next to it.
        lock_file: String,
        /// Who holds it, as far as the lock file says ("process 1234 (tether-serve)").
        holder: String,
    },
    /// The exclusive lock could not be taken for a reason other than another holder (the
    /// directory is read-only, the file system has no locks): the store refuses to open
    /// without it.
    #[error(
        "cannot lock {lock_file} for {path}: {source}; tether opens a database only while it \
         holds that lock (check the directory is writable and on a local file system)"
    )]
    Lock {
        /// The database file.
        path: String,
        /// The lock file next to it.
        lock_file: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file holds events sharing one sequence number within a session (written by two
    /// servers at once, before tether locked its database): the schema that forbids them cannot
    /// be added until each pair is resolved by hand.
    #[error(
        "{path} holds {total} sequence number(s) used by more than one event of a session, so its \
         record is contradictory: {}{}. Back the file up, then keep one event of each (e.g. \
         sqlite3 {path} \"DELETE FROM events WHERE session_id = '…' AND event_id = '…'\"), or start \
         a new database file",
        list_duplicates(duplicates),
        if *total > duplicates.len() { format!(" and {} more", total - duplicates.len()) } else { String::new() }
    )]
    DuplicateSequence {
        /// The database file.
        path: String,
        /// How many (session, seq) pairs are duplicated.
        total: usize,
        /// The first of them (at most 10).
        duplicates: Vec<SeqDuplicate>,
    },
    /// An event was appended at a sequence number its session already uses for another event:
    /// nothing was written. Another writer is numbering the same session.
    #[error(
        "{path}: session {session_id} already has event {existing_event_id} at sequence number \
         {seq}; event {event_id} was not stored (is another process writing this session?)"
    )]
    SequenceTaken {
        /// The database file.
        path: String,
        /// The session.
        session_id: String,
        /// The sequence number.
        seq: u64,
        /// The event refused.
        event_id: String,
        /// The event stored at that number.
        existing_event_id: String,
    },
    /// A new thread's first event is already in the thread's record
    /// ([`ThreadStore::start_thread`]): nothing of the thread's start was stored.
    #[error(
        "{path}: thread {thread} cannot start: its record {record} already holds event {event_id} \
         (is another process writing this thread?); nothing of the start was stored"
    )]
    AlreadyStarted {
        /// The database file.
        path: String,
        /// The thread.
        thread: String,
        /// The thread's record key.
        record: String,
        /// The event found already stored.
        event_id: String,
    },
}

/// One sequence number shared by several events of a session (see
/// [`StoreError::DuplicateSequence`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SeqDuplicate {
    /// The session.
    pub session_id: String,
    /// The sequence number.
    pub seq: i64,
    /// The events sharing it, in the order they were stored.
    pub event_ids: Vec<String>,
}

fn list_duplicates(d: &[SeqDuplicate]) -> String {
    d.iter()
        .map(|d| {
            format!(
                "session {} seq {}: events {}",
                d.session_id,
                d.seq,
                d.event_ids.join(", ")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

impl From<StoreError> for tether::Error {
    fn from(e: StoreError) -> Self {
        tether::Error::store_with("", e)
    }
}

/// A durable [`EventStore`] on one SQLite file. Cheap to clone (clones share the connection and
/// its thread, which ends when the last clone is dropped).
///
/// A store holds its database file exclusively for its life: a second [`SqliteStore::open`] of
/// the same file, from this process or another, fails with [`StoreError::Locked`] until the
/// last clone of the first is dropped (or its process dies).
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

/// What the clones of a store share. Dropping the last one stops the store's thread, waits for
/// it, closes the connection, and only then releases the file's lock (fields drop in order).
struct Inner {
    conn: Arc<Mutex<Connection>>,
    path: Arc<str>,
    jobs: Option<std::sync::mpsc::Sender<Job>>,
    worker: Option<std::thread::JoinHandle<()>>,
    _lock: Option<lock::DbLock>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the channel ends the worker once it has answered every call it took.
        drop(self.jobs.take());
        if let Some(w) = self.worker.take()
            && w.thread().id() != std::thread::current().id()
        {
            let _ = w.join();
        }
    }
}

/// What a job answers once its group's transaction has ended: `Ok` when it committed.
type Answer = Box<dyn FnOnce(Result<(), &str>) + Send>;
/// One call, run on the store's thread inside its own savepoint.
type Job = Box<dyn FnOnce(&mut Connection, &str) -> Answer + Send>;

/// Prepared statements kept per connection (more than the store has).
const STATEMENT_CACHE: usize = 48;

/// How long a statement waits for another connection's lock on the file.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Most calls committed together.
const GROUP_MAX: usize = 512;

/// The store's thread: takes every call waiting, runs them in one transaction, commits, answers.
fn worker(conn: Arc<Mutex<Connection>>, path: Arc<str>, jobs: std::sync::mpsc::Receiver<Job>) {
    let mut group: Vec<Job> = Vec::new();
    let mut answers: Vec<Answer> = Vec::new();
    while let Ok(first) = jobs.recv() {
        group.push(first);
        while group.len() < GROUP_MAX {
            match jobs.try_recv() {
                Ok(j) => group.push(j),
                Err(_) => break,
            }
        }
        let mut g = match conn.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        // Without the group transaction (BEGIN failed: the database is busy or broken), each
        // call's savepoint is a transaction of its own and reports its own failure.
        let grouped = run(&g, "BEGIN IMMEDIATE").is_ok();
        for job in group.drain(..) {
            answers.push(job(&mut g, &path));
        }
        let committed = if grouped {
            let r = run(&g, "COMMIT").map_err(|e| e.to_string());
            if r.is_err() {
                let _ = run(&g, "ROLLBACK");
            }
            r
        } else {
            Ok(())
        };
        drop(g);
        let outcome = committed.as_ref().map(|_| ()).map_err(String::as_str);
        for a in answers.drain(..) {
            a(outcome);
        }
    }
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.inner.path)
            .finish()
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path`, in WAL mode, migrating an older schema.
    ///
    /// Takes the file's exclusive lock first: [`StoreError::Locked`] when another store (another
    /// `tether serve`, or another open in this process) has it.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_to(path.as_ref(), SCHEMA_VERSION)
    }

    /// An in-memory database (nothing survives the process): for tests. Private to the store,
    /// so it takes no lock.
    pub fn open_in_memory() -> Result<Self, StoreError> {
        let mut conn = Connection::open_in_memory().map_err(|e| sql(":memory:", e))?;
        configure(&conn, ":memory:")?;
        migrate(&mut conn, ":memory:", SCHEMA_VERSION)?;
        Self::start(conn, ":memory:", None)
    }

    /// Opens the database migrating it only up to `version`: for testing migrations from an
    /// older schema. Not for use outside tests.
    #[doc(hidden)]
    pub fn open_at_version(path: impl AsRef<Path>, version: u32) -> Result<Self, StoreError> {
        Self::open_to(path.as_ref(), version.min(SCHEMA_VERSION))
    }

    /// Migrates the database at `path` to the current schema on a connection of its own,
    /// *without* taking the store's lock, and returns the version it ended at: for testing that
    /// migrations racing on one file are safe without the lock. Not for use outside tests.
    #[doc(hidden)]
    pub fn migrate_unlocked(path: impl AsRef<Path>) -> Result<u32, StoreError> {
        let shown = path.as_ref().display().to_string();
        let mut conn = Connection::open(path.as_ref()).map_err(|e| sql(&shown, e))?;
        configure(&conn, &shown)?;
        migrate(&mut conn, &shown, SCHEMA_VERSION)
    }

    fn open_to(path: &Path, version: u32) -> Result<Self, StoreError> {
        let shown = path.display().to_string();
        // The lock before anything touches the file: a second server must not even migrate it.
        let lock = lock::DbLock::acquire(path)?;
        let mut conn = Connection::open(path).map_err(|e| sql(&shown, e))?;
        configure(&conn, &shown)?;
        migrate(&mut conn, &shown, version)?;
        Self::start(conn, &shown, Some(lock))
    }

    /// Starts the store's thread on a configured, migrated connection.
    fn start(conn: Connection, path: &str, lock: Option<lock::DbLock>) -> Result<Self, StoreError> {
        let conn = Arc::new(Mutex::new(conn));
        let path: Arc<str> = path.into();
        let (jobs, rx) = std::sync::mpsc::channel::<Job>();
        let (c, p) = (conn.clone(), path.clone());
        let worker = std::thread::Builder::new()
            .name("tether-sqlite".into())
            .spawn(move || worker(c, p, rx))
            .map_err(|e| StoreError::Join(format!("cannot start the store's thread: {e}")))?;
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                conn,
                path,
                jobs: Some(jobs),
                worker: Some(worker),
                _lock: lock,
            }),
        })
    }

    /// The database file's path as given.
    pub fn path(&self) -> &str {
        &self.inner.path
    }

    /// The schema version of the open database.
    pub fn schema_version(&self) -> Result<u32, StoreError> {
        self.with_conn(|c, p| {
            c.query_row("PRAGMA user_version", [], |r| r.get(0))
                .map_err(|e| sql(p, e))
        })
    }

    fn with_conn<T>(
        &self,
        f: impl FnOnce(&mut Connection, &str) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut g = self.inner.conn.lock().map_err(|_| StoreError::Poisoned)?;
        f(&mut g, &self.inner.path)
    }

    /// Runs `f` on the store's thread, inside a savepoint (rolled back when `f` fails), and
    /// answers once the transaction it ran in has committed.
    async fn blocking<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection, &str) -> Result<T, StoreError> + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel::<Result<T, StoreError>>();
        let job: Job = Box::new(move |c, p| {
            let r = Savepoint::begin(c, p).and_then(|sp| {
                // On failure (or a panic), dropping the savepoint rolls back what `f` wrote.
                let v = f(c, p)?;
                sp.release(p).map(|()| v)
            });
            let path = p.to_owned();
            Box::new(move |committed: Result<(), &str>| {
                let r = match committed {
                    Ok(()) => r,
                    Err(m) => Err(r.err().unwrap_or(StoreError::Commit {
                        path,
                        message: m.to_owned(),
                    })),
                };
                let _ = tx.send(r);
            })
        });
        self.inner
            .jobs
            .as_ref()
            .ok_or_else(|| StoreError::Join("the store is closing".into()))?
            .send(job)
            .map_err(|_| StoreError::Join("the store's thread has stopped".into()))?;
        rx.await
            .map_err(|_| StoreError::Join("the store's thread dropped a call".into()))?
    }

    /// [`EventStore::append`] with the store's own error: `Ok(false)` when the event's id is
    /// already stored (nothing written), [`StoreError::SequenceTaken`] when its sequence number
    /// is another event's in the session (nothing written; the schema has one event per number).
    pub async fn append_event(&self, session_id: &str, event: &Event) -> Result<bool, StoreError> {
        let e = Encoded::new(&self.inner.path, event)?;
        let sid = session_id.to_owned();
        self.blocking(move |c, p| {
            let inserted = insert_event(c, p, &sid, &e)?;
            if inserted {
                touch_session(c, p, &sid)?;
            }
            Ok(inserted)
        })
        .await
    }
}

/// An event encoded for the store's thread.
struct Encoded {
    id: String,
    seq: Option<u64>,
    body: String,
}

impl Encoded {
    fn new(path: &str, event: &Event) -> Result<Self, StoreError> {
        let body = serde_json::to_string(event)
            .map_err(|e| corrupt(path, format!("event {} does not encode: {e}", event.id)))?;
        Ok(Encoded {
            id: event.id.clone(),
            seq: event.seq,
            body,
        })
    }
}

/// Inserts one event of session `sid`: `Ok(false)` when its id is already stored,
/// [`StoreError::SequenceTaken`] when its number is another event's.
fn insert_event(c: &Connection, p: &str, sid: &str, e: &Encoded) -> Result<bool, StoreError> {
    insert_event_with(c, p, sid, e, None)
}

/// [`insert_event`], the row carrying state `(key, encoded value)` when given (see
/// [`EventStore::append_with_state`]).
fn insert_event_with(
    c: &Connection,
    p: &str,
    sid: &str,
    e: &Encoded,
    state: Option<(&str, &str)>,
) -> Result<bool, StoreError> {
    // Only a repeated id is "already stored"; a repeated sequence number under another id
    // violates the unique index and is reported, never ignored.
    let seq = e.seq.map(|s| s as i64);
    let inserted = match state {
        // The columns every schema version has (a file opened at an older version for a test
        // of its migration is still written).
        None => c
            .prepare_cached(
                "INSERT INTO events (session_id, event_id, seq, body) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (session_id, event_id) DO NOTHING",
            )
            .and_then(|mut st| st.execute(params![sid, e.id, seq, e.body])),
        Some((k, v)) => c
            .prepare_cached(
                "INSERT INTO events (session_id, event_id, seq, body, state_key, state_value)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (session_id, event_id) DO NOTHING",
            )
            .and_then(|mut st| st.execute(params![sid, e.id, seq, e.body, k, v])),
    };
    match inserted {
        Ok(n) => Ok(n == 1),
        Err(err) if err.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation) => {
            let Some(seq) = e.seq else { return Err(sql(p, err)) };
            let existing: Option<String> = c
                .prepare_cached("SELECT event_id FROM events WHERE session_id = ?1 AND seq = ?2")
                .and_then(|mut st| st.query_row(params![sid, seq as i64], |r| r.get(0)))
                .optional()
                .map_err(|e| sql(p, e))?;
            match existing {
                Some(existing_event_id) => Err(StoreError::SequenceTaken {
                    path: p.into(),
                    session_id: sid.to_owned(),
                    seq,
                    event_id: e.id.clone(),
                    existing_event_id,
                }),
                None => Err(sql(p, err)),
            }
        }
        Err(err) => Err(sql(p, err)),
    }
}

/// Claims thread `t` for agent `a` (see [`ThreadStore::claim_thread`]), in the caller's
/// savepoint.
fn claim_in(
    c: &Connection,
    p: &str,
    t: &str,
    a: &str,
    new_record: String,
    title: &str,
) -> Result<Claim, StoreError> {
    let existing = get_thread(c, p, t)?;
    let created = existing.is_none();
    let record = match existing {
        Some(row) if row.agent != a => {
            return match row.thread() {
                Some(other) => Ok(Claim::Taken(other)),
                None => Err(corrupt(p, format!("thread {t} has an invalid id"))),
            };
        }
        Some(row) => row.record,
        None => new_record,
    };
    c.prepare_cached(
        "INSERT INTO threads (thread_id, agent, session_id, title, created_ms, updated_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?5)
         ON CONFLICT (thread_id) DO UPDATE SET
           title = CASE WHEN title = '' THEN ?4 ELSE title END,
           updated_ms = max(updated_ms, ?5)",
    )
    .and_then(|mut st| st.execute(params![t, a, record, title, now_ms()]))
    .map_err(|e| sql(p, e))?;
    written_thread(c, p, t).map(|thread| Claim::Claimed { thread, created })
}

/// Records thread `t`'s provider session, in the caller's savepoint.
fn set_session_in(c: &Connection, p: &str, t: &str, provider: &str, session: &str) -> Result<(), StoreError> {
    let n = c
        .prepare_cached("UPDATE threads SET provider = ?2, provider_session = ?3 WHERE thread_id = ?1")
        .and_then(|mut st| st.execute(params![t, provider, session]))
        .map_err(|e| sql(p, e))?;
    if n == 0 {
        return Err(corrupt(p, format!("no thread {t} to record a session on")));
    }
    Ok(())
}

/// A thread's start, owned for the store's thread ([`ThreadStart`]).
struct Start {
    provider: String,
    session: String,
    events: Vec<Encoded>,
}

impl Start {
    fn new(path: &str, start: &ThreadStart<'_>) -> Result<Self, StoreError> {
        Ok(Start {
            provider: start.provider.to_owned(),
            session: start.session.to_owned(),
            events: start
                .events
                .iter()
                .map(|e| Encoded::new(path, e))
                .collect::<Result<_, _>>()?,
        })
    }
}

/// Starts thread `t` (see [`ThreadStore::start_thread`]), in the caller's savepoint: its
/// provider session, then its first events under `record`, each new.
fn start_in(c: &Connection, p: &str, t: &str, record: &str, start: &Start) -> Result<(), StoreError> {
    set_session_in(c, p, t, &start.provider, &start.session)?;
    for e in &start.events {
        if !insert_event(c, p, record, e)? {
            return Err(StoreError::AlreadyStarted {
                path: p.into(),
                thread: t.into(),
                record: record.into(),
                event_id: e.id.clone(),
            });
        }
    }
    if !start.events.is_empty() {
        touch_session(c, p, record)?;
    }
    Ok(())
}

/// Connection settings, before any migration: busy timeout, statement cache, WAL, sync level.
fn configure(conn: &Connection, path: &str) -> Result<(), StoreError> {
    conn.busy_timeout(BUSY_TIMEOUT).map_err(|e| sql(path, e))?;
    // Every statement the store runs stays prepared (rusqlite keeps 16 by default; the store
    // has about 20, and an evicted one is parsed again on its next use).
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    // The journal mode: WAL for files (in-memory databases report "memory"). Two connections
    // switching a fresh file at once both read it, then both need its exclusive lock: SQLite
    // answers one of them BUSY at once, without the busy handler (that wait could deadlock), so
    // the switch is retried here until the other has finished (then it is a no-op).
    let deadline = std::time::Instant::now() + BUSY_TIMEOUT;
    loop {
        match conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get::<_, String>(0)) {
            Ok(_) => break,
            Err(e)
                if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy)
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(foreign_or_sql(path, e)),
        }
    }
    conn.execute_batch("PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON;")
        .map_err(|e| sql(path, e))?;
    Ok(())
}

/// Brings the schema to `target` and returns the version the file is at.
///
/// Race-free: the version is read inside a `BEGIN IMMEDIATE` transaction (the write lock taken
/// before the first read), and every pending migration runs in that same transaction, so two
/// connections migrating one file at once are serialised: the second reads the version the
/// first committed and has nothing left to do. (Reading `user_version` before the transaction
/// let both see an empty file, and the second then failed creating tables that existed.)
fn migrate(conn: &mut Connection, path: &str, target: u32) -> Result<u32, StoreError> {
    let tx = conn
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .map_err(|e| sql(path, e))?;
    let app: i32 = tx
        .query_row("PRAGMA application_id", [], |r| r.get(0))
        .map_err(|e| sql(path, e))?;
    let version: u32 = tx
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(|e| sql(path, e))?;
    if app != 0 && app != APPLICATION_ID {
        return Err(StoreError::Foreign {
            path: path.into(),
            detail: format!("application_id {app:#x}"),
        });
    }
    if app == 0 && version == 0 {
        let tables: i64 = tx
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'",
                [],
                |r| r.get(0),
            )
            .map_err(|e| sql(path, e))?;
        if tables > 0 {
            return Err(StoreError::Foreign {
                path: path.into(),
                detail: format!("{tables} tables and no tether schema version"),
            });
        }
    }
    if version > SCHEMA_VERSION {
        return Err(StoreError::NewerSchema {
            path: path.into(),
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    if version >= target {
        return Ok(version);
    }
    for v in version..target {
        check_before(v + 1, &tx, path)?;
        tx.execute_batch(MIGRATIONS[v as usize])
            .map_err(|e| sql(path, e))?;
    }
    tx.execute_batch(&format!(
        "PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = {target};"
    ))
    .map_err(|e| sql(path, e))?;
    tx.commit().map_err(|e| sql(path, e))?;
    tracing::info!(path, from = version, to = target, "migrated the tether database");
    Ok(target)
}

/// The columns a thread is read from, in [`thread_row`]'s order.
const THREAD_COLUMNS: &str =
    "thread_id, agent, session_id, title, created_ms, updated_ms, provider, provider_session";

/// A thread's row as stored (its id is checked when it becomes a [`Thread`]).
struct ThreadRow {
    id: String,
    agent: String,
    record: String,
    title: String,
    created_ms: i64,
    updated_ms: i64,
    provider: String,
    provider_session: Option<String>,
}

fn thread_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ThreadRow> {
    Ok(ThreadRow {
        id: r.get(0)?,
        agent: r.get(1)?,
        record: r.get(2)?,
        title: r.get(3)?,
        created_ms: r.get(4)?,
        updated_ms: r.get(5)?,
        provider: r.get(6)?,
        provider_session: r.get(7)?,
    })
}

impl ThreadRow {
    /// The thread, or `None` for a row whose id is not a valid [`ThreadId`] (written before ids
    /// were checked).
    fn thread(self) -> Option<Thread> {
        Some(
            Thread::new(
                ThreadId::new(self.id).ok()?,
                self.agent,
                self.record,
                self.created_ms,
            )
            .with_provider(self.provider, self.provider_session)
            .with_title(self.title)
            .with_updated_ms(self.updated_ms),
        )
    }
}

fn get_thread(c: &Connection, p: &str, thread_id: &str) -> Result<Option<ThreadRow>, StoreError> {
    c.prepare_cached(&format!(
        "SELECT {THREAD_COLUMNS} FROM threads WHERE thread_id = ?1"
    ))
    .and_then(|mut st| st.query_row(params![thread_id], thread_row))
    .optional()
    .map_err(|e| sql(p, e))
}

/// Runs a statement without parameters through the statement cache (the store's thread runs
/// `BEGIN`, `COMMIT` and a savepoint per call thousands of times a second; `execute_batch`
/// would parse each of them every time).
fn run(c: &Connection, statement: &str) -> rusqlite::Result<()> {
    c.prepare_cached(statement)?.execute([]).map(|_| ())
}

/// One call's savepoint: released by [`Savepoint::release`], rolled back when dropped without
/// it (the call failed or panicked). rusqlite's own savepoint formats and parses its SQL on
/// every use.
struct Savepoint<'c> {
    conn: &'c Connection,
    released: bool,
}

impl<'c> Savepoint<'c> {
    fn begin(conn: &'c Connection, p: &str) -> Result<Self, StoreError> {
        run(conn, "SAVEPOINT tether_call").map_err(|e| sql(p, e))?;
        Ok(Savepoint {
            conn,
            released: false,
        })
    }

    fn release(mut self, p: &str) -> Result<(), StoreError> {
        self.released = true;
        run(self.conn, "RELEASE tether_call").map_err(|e| sql(p, e))
    }
}

impl Drop for Savepoint<'_> {
    fn drop(&mut self) {
        if !self.released {
            let _ = run(self.conn, "ROLLBACK TO tether_call");
            let _ = run(self.conn, "RELEASE tether_call");
        }
    }
}

/// The thread just written (read back as stored).
fn written_thread(c: &Connection, p: &str, thread_id: &str) -> Result<Thread, StoreError> {
    get_thread(c, p, thread_id)?
        .and_then(ThreadRow::thread)
        .ok_or_else(|| StoreError::Corrupt {
            path: p.into(),
            detail: format!("thread {thread_id} vanished after being written"),
        })
}

fn sql(path: &str, source: rusqlite::Error) -> StoreError {
    StoreError::Sqlite {
        path: path.into(),
        source,
    }
}

fn foreign_or_sql(path: &str, source: rusqlite::Error) -> StoreError {
    match source.sqlite_error_code() {
        Some(rusqlite::ErrorCode::NotADatabase) => StoreError::Foreign {
            path: path.into(),
            detail: "the file is not an SQLite database".into(),
        },
        _ => sql(path, source),
    }
}

fn touch_session(c: &Connection, p: &str, session_id: &str) -> Result<(), StoreError> {
    let now = now_ms();
    c.prepare_cached(
        "INSERT INTO sessions (session_id, created_ms, updated_ms) VALUES (?1, ?2, ?2)
         ON CONFLICT (session_id) DO UPDATE SET updated_ms = ?2",
    )
    .and_then(|mut st| st.execute(params![session_id, now]))
    .map_err(|e| sql(p, e))?;
    Ok(())
}

/// Stores state `k` of session `sid` (the value encoded), in the caller's savepoint.
fn put_state_in(c: &Connection, p: &str, sid: &str, k: &str, v: &str) -> Result<(), StoreError> {
    c.prepare_cached(
        "INSERT INTO state (session_id, key, value) VALUES (?1, ?2, ?3)
         ON CONFLICT (session_id, key) DO UPDATE SET value = ?3",
    )
    .and_then(|mut st| st.execute(params![sid, k, v]))
    .map_err(|e| sql(p, e))?;
    Ok(())
}

fn corrupt(p: &str, what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt {
        path: p.into(),
        detail: what.to_string(),
    }
}

#[async_trait]
impl EventStore for SqliteStore {
    async fn append(&self, session_id: &str, event: &Event) -> tether::Result<bool> {
        Ok(self.append_event(session_id, event).await?)
    }

    /// One step (one savepoint on the store's thread, one commit): the event and, when it is
    /// new, the state value.
    async fn append_with_state(
        &self,
        session_id: &str,
        event: &Event,
        key: &str,
        value: &Value,
    ) -> tether::Result<bool> {
        let e = Encoded::new(&self.inner.path, event)?;
        let (sid, k) = (session_id.to_owned(), key.to_owned());
        let v = serde_json::to_string(value)
            .map_err(|e| tether::Error::store_with("a state value does not encode", e))?;
        Ok(self
            .blocking(move |c, p| {
                // The value rides on the event's row (no page of the state table written); a
                // value of the key in the state table is older now, so it goes.
                let inserted = insert_event_with(c, p, &sid, &e, Some((&k, &v)))?;
                if inserted {
                    c.prepare_cached("DELETE FROM state WHERE session_id = ?1 AND key = ?2")
                        .and_then(|mut st| st.execute(params![sid, k]))
                        .map_err(|e| sql(p, e))?;
                    touch_session(c, p, &sid)?;
                }
                Ok(inserted)
            })
            .await?)
    }

    async fn load(&self, session_id: &str) -> tether::Result<Vec<Event>> {
        let sid = session_id.to_owned();
        Ok(self
            .blocking(move |c, p| {
                let mut st = c
                    .prepare_cached(
                        "SELECT body FROM events WHERE session_id = ?1 ORDER BY seq IS NULL, seq, rowid",
                    )
                    .map_err(|e| sql(p, e))?;
                let rows = st
                    .query_map(params![sid], |r| r.get::<_, String>(0))
                    .map_err(|e| sql(p, e))?;
                let mut out = Vec::new();
                for body in rows {
                    let body = body.map_err(|e| sql(p, e))?;
                    out.push(
                        serde_json::from_str::<Event>(&body)
                            .map_err(|e| corrupt(p, format!("event: {e}")))?,
                    );
                }
                Ok(out)
            })
            .await?)
    }

    async fn tool_result(&self, session_id: &str, tool_use_id: &str) -> tether::Result<Option<ToolResult>> {
        let (sid, tid) = (session_id.to_owned(), tool_use_id.to_owned());
        Ok(self
            .blocking(move |c, p| {
                c.prepare_cached(
                    "SELECT content, is_error FROM tool_results WHERE session_id = ?1 AND tool_use_id = ?2",
                )
                .and_then(|mut st| {
                    st.query_row(params![sid, tid], |r| {
                        Ok(ToolResult::new(
                            tid.clone(),
                            r.get::<_, String>(0)?,
                            r.get::<_, i64>(1)? != 0,
                        ))
                    })
                })
                .optional()
                .map_err(|e| sql(p, e))
            })
            .await?)
    }

    async fn put_tool_result(&self, session_id: &str, result: &ToolResult) -> tether::Result<()> {
        let (sid, r) = (session_id.to_owned(), result.clone());
        Ok(self
            .blocking(move |c, p| {
                c.prepare_cached(
                    "INSERT OR IGNORE INTO tool_results (session_id, tool_use_id, content, is_error, created_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                )
                .and_then(|mut st| st.execute(params![sid, r.tool_use_id, r.content, r.is_error as i64, now_ms()]))
                .map_err(|e| sql(p, e))?;
                touch_session(c, p, &sid)?;
                Ok(())
            })
            .await?)
    }

    async fn put_state(&self, session_id: &str, key: &str, value: &Value) -> tether::Result<()> {
        let (sid, k) = (session_id.to_owned(), key.to_owned());
        let v = serde_json::to_string(value)
            .map_err(|e| tether::Error::store_with("a state value does not encode", e))?;
        Ok(self
            .blocking(move |c, p| {
                put_state_in(c, p, &sid, &k, &v)?;
                touch_session(c, p, &sid)?;
                Ok(())
            })
            .await?)
    }

    async fn state(&self, session_id: &str, key: &str) -> tether::Result<Option<Value>> {
        let (sid, k) = (session_id.to_owned(), key.to_owned());
        Ok(self
            .blocking(move |c, p| {
                let mut v: Option<String> = c
                    .prepare_cached("SELECT value FROM state WHERE session_id = ?1 AND key = ?2")
                    .and_then(|mut st| st.query_row(params![sid, k], |r| r.get(0)))
                    .optional()
                    .map_err(|e| sql(p, e))?;
                if v.is_none() {
                    // Not in the state table: the latest event that carried it, if any.
                    v = c
                        .prepare_cached(
                            "SELECT state_value FROM events WHERE session_id = ?1 AND state_key = ?2
                             ORDER BY seq DESC LIMIT 1",
                        )
                        .and_then(|mut st| st.query_row(params![sid, k], |r| r.get(0)))
                        .optional()
                        .map_err(|e| sql(p, e))?;
                }
                v.map(|s| serde_json::from_str(&s).map_err(|e| corrupt(p, format!("state {k}: {e}"))))
                    .transpose()
            })
            .await?)
    }

    async fn sessions(&self) -> tether::Result<Vec<String>> {
        Ok(self
            .blocking(|c, p| {
                let mut st = c
                    .prepare_cached("SELECT session_id FROM sessions ORDER BY session_id")
                    .map_err(|e| sql(p, e))?;
                let rows = st
                    .query_map([], |r| r.get::<_, String>(0))
                    .map_err(|e| sql(p, e))?;
                rows.collect::<Result<Vec<_>, _>>().map_err(|e| sql(p, e))
            })
            .await?)
    }
}

#[async_trait]
impl ThreadStore for SqliteStore {
    /// One call (one transaction) where a read then a write would take two: a server claims a
    /// thread at the start of every run.
    async fn claim_thread(
        &self,
        thread: &ThreadId,
        agent: &str,
        new_record: &str,
        title: &str,
    ) -> tether::Result<Claim> {
        let (t, a, s, ti) = (
            thread.to_string(),
            agent.to_owned(),
            new_record.to_owned(),
            title.to_owned(),
        );
        Ok(self.blocking(move |c, p| claim_in(c, p, &t, &a, s, &ti)).await?)
    }

    async fn set_provider_session(
        &self,
        thread: &ThreadId,
        provider: &str,
        session: &str,
    ) -> tether::Result<()> {
        let (t, pr, s) = (thread.to_string(), provider.to_owned(), session.to_owned());
        Ok(self
            .blocking(move |c, p| set_session_in(c, p, &t, &pr, &s))
            .await?)
    }

    /// One call (one transaction): the provider session and the first events are stored
    /// together or not at all.
    async fn start_thread(
        &self,
        thread: &ThreadId,
        record: &str,
        start: &ThreadStart<'_>,
    ) -> tether::Result<()> {
        let st = Start::new(&self.inner.path, start)?;
        let (t, r) = (thread.to_string(), record.to_owned());
        Ok(self.blocking(move |c, p| start_in(c, p, &t, &r, &st)).await?)
    }

    /// One call (one transaction): a new thread is created already started, so a server's new
    /// run waits for the store once before its first model request.
    async fn claim_thread_starting(
        &self,
        thread: &ThreadId,
        agent: &str,
        new_record: &str,
        title: &str,
        start: &ThreadStart<'_>,
    ) -> tether::Result<Claim> {
        let st = Start::new(&self.inner.path, start)?;
        let (t, a, s, ti) = (
            thread.to_string(),
            agent.to_owned(),
            new_record.to_owned(),
            title.to_owned(),
        );
        Ok(self
            .blocking(move |c, p| match claim_in(c, p, &t, &a, s, &ti)? {
                Claim::Claimed {
                    thread,
                    created: true,
                } => {
                    start_in(c, p, &t, &thread.record, &st)?;
                    Ok(Claim::Claimed {
                        thread: thread.with_provider(st.provider, Some(st.session)),
                        created: true,
                    })
                }
                other => Ok(other),
            })
            .await?)
    }

    async fn thread(&self, thread: &ThreadId) -> tether::Result<Option<Thread>> {
        let t = thread.to_string();
        Ok(self
            .blocking(move |c, p| Ok(get_thread(c, p, &t)?.and_then(ThreadRow::thread)))
            .await?)
    }

    async fn threads(&self, agent: Option<&str>) -> tether::Result<Vec<Thread>> {
        let a = agent.map(str::to_owned);
        Ok(self
            .blocking(move |c, p| {
                let mut st = c
                    .prepare_cached(&format!(
                        "SELECT {THREAD_COLUMNS} FROM threads
                         WHERE ?1 IS NULL OR agent = ?1 ORDER BY updated_ms DESC, thread_id"
                    ))
                    .map_err(|e| sql(p, e))?;
                let rows = st.query_map(params![a], thread_row).map_err(|e| sql(p, e))?;
                let mut out = Vec::new();
                for row in rows {
                    let row = row.map_err(|e| sql(p, e))?;
                    let id = row.id.clone();
                    match row.thread() {
                        Some(t) => out.push(t),
                        None => tracing::warn!(thread = %id.escape_debug(), "skipping a thread whose id is not valid"),
                    }
                }
                Ok(out)
            })
            .await?)
    }
}

/// The default database file name used by `tether serve`.
pub fn default_path() -> PathBuf {
    PathBuf::from("tether.db")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SQLite failure reaches a tether caller as `Error::Store` whose source chain holds the
    /// store's own error and, under it, rusqlite's: matchable and downcastable, not only text.
    #[test]
    fn a_sqlite_error_keeps_its_source_through_tether_error() {
        use std::error::Error as _;
        let c = Connection::open_in_memory().unwrap();
        let raw = c.execute("INSERT INTO missing VALUES (1)", []).unwrap_err();
        let text = raw.to_string();
        let e: tether::Error = sql("/tmp/x.db", raw).into();
        assert!(matches!(&e, tether::Error::Store { .. }), "{e:?}");
        assert_eq!(e.code(), "store");
        assert!(e.to_string().contains(&text), "{e}");
        let store = e
            .source()
            .and_then(|s| s.downcast_ref::<StoreError>())
            .expect("a StoreError source");
        assert!(matches!(store, StoreError::Sqlite { .. }), "{store:?}");
        let sqlite = store
            .source()
            .and_then(|s| s.downcast_ref::<rusqlite::Error>())
            .expect("rusqlite's error");
        assert!(sqlite.to_string().contains("no such table"), "{sqlite}");
    }

    fn rows(c: &Connection) -> i64 {
        c.query_row("SELECT count(*) FROM t", [], |r| r.get(0)).unwrap()
    }

    /// A call's savepoint keeps its writes when released and undoes them when dropped, inside
    /// the group transaction, and the next call can take a savepoint of the same name.
    #[test]
    fn a_call_savepoint_keeps_or_undoes_only_its_own_writes() {
        let c = Connection::open_in_memory().unwrap();
        c.execute_batch("CREATE TABLE t (x INTEGER)").unwrap();
        run(&c, "BEGIN IMMEDIATE").unwrap();
        let sp = Savepoint::begin(&c, "mem").unwrap();
        c.execute("INSERT INTO t VALUES (1)", []).unwrap();
        sp.release("mem").unwrap();
        let sp = Savepoint::begin(&c, "mem").unwrap();
        c.execute("INSERT INTO t VALUES (2)", []).unwrap();
        assert_eq!(rows(&c), 2);
        drop(sp);
        assert_eq!(rows(&c), 1, "the failed call's write is undone");
        let sp = Savepoint::begin(&c, "mem").unwrap();
        c.execute("INSERT INTO t VALUES (3)", []).unwrap();
        sp.release("mem").unwrap();
        run(&c, "COMMIT").unwrap();
        assert_eq!(rows(&c), 2);
        // Outside a transaction a savepoint is one of its own.
        let sp = Savepoint::begin(&c, "mem").unwrap();
        c.execute("INSERT INTO t VALUES (4)", []).unwrap();
        drop(sp);
        assert_eq!(rows(&c), 2);
        assert!(c.is_autocommit(), "no transaction is left open");
    }
}
