//! [`SharedRecord`]: a thread's record in a PostgreSQL database every tether node reaches,
//! instead of the thread object's state on Restate.
//!
//! Why (issue 18 leaves the record's home open: the object state, or a shared store): with the
//! record in the object state every turn makes Restate store each of its events, and every read
//! of a record (a front-end's `GET /v1/threads/...`, a relay catching up, the status read before
//! a turn) is an invocation queued on Restate. Measured with nothing of tether
//! (`examples/restate_floor`, BENCHMARKS.md), one node at 1,000 concurrent turns carries at most
//! 0.27–0.57× the SQLite backend's deltas/s that way, and 0.82× with the record in PostgreSQL
//! written through one batching writer. So here a turn still runs as one exclusive invocation
//! with its model and tool calls as journaled steps, but its events go to the database, and
//! readers read them there.
//!
//! What stays on Restate: nothing of the record. A turn's journal holds its request, its steps
//! (model calls, tool calls, approvals) and its outcome; the thread, its events, its checkpoint
//! and the running turn's marks are rows here. A turn starts from what
//! [`SharedRecord::turn_start`] reads (not journaled): on its first attempt the thread's row as
//! it is, on a replay what that attempt wrote as its start (`started_at`, `started_from`,
//! `started_checkpoint`), so a replay starts from the same record. Before every step it writes
//! what the engine added and waits for the commit: an event is in the database before Restate
//! holds a step that follows it. (Each of the thread, the checkpoint and the length kept on
//! Restate as well cost a journal entry per turn, and Restate's CPU per turn was ~1.35× a bare
//! turn's with them: BENCHMARKS.md.)
//!
//! Tables (created when missing; one database can hold the threads of many nodes and agents):
//!
//! | table | columns |
//! |---|---|
//! | `tether_threads` | `id` (the thread id, key), `agent`, `thread` (the [`Thread`] as JSON), `updated_ms`, `length`, `checkpoint` (JSON), `invocation`, `message`, `announced`, and where the running turn started: `started_at`, `started_from`, `started_checkpoint` |
//! | `tether_events` | `thread`, `seq` (key together), `event` (the [`Event`] as JSON) |
//!
//! Writes are idempotent by (thread, sequence number): a replayed turn writes the same events at
//! the same places. A row past a thread's `length` is the tail of a turn killed before Restate
//! stored its length; readers never see it, and the next turn writes over it.
//!
//! Every write of every turn goes through one writer task that takes all the writes waiting when
//! it wakes into one transaction (as the SQLite store's thread does): written one turn at a time
//! the same writes carried 0.32–0.48× SQLite's deltas/s, batched 0.82×.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;
use tether::{Error, Event, Result, Thread, ThreadId};
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_postgres::Client;

use crate::ThreadStatus;

/// How many connections serve reads (the writer has one more of its own).
const READERS: usize = 4;

/// The tables, created when missing, under a transaction-scoped advisory lock so that nodes
/// starting together do not race on PostgreSQL's catalog.
const SCHEMA: &str = "
select pg_advisory_xact_lock(7411823901);
create table if not exists tether_threads (
    id text primary key,
    agent text not null,
    thread text not null,
    updated_ms bigint not null,
    length bigint not null default 0,
    started_at bigint not null default 0,
    started_from text,
    started_checkpoint text,
    checkpoint text,
    invocation text,
    message text,
    announced text
);
alter table tether_threads add column if not exists started_checkpoint text;
create index if not exists tether_threads_by_agent on tether_threads (agent, updated_ms desc, id);
create table if not exists tether_events (
    thread text not null,
    seq bigint not null,
    event text not null,
    primary key (thread, seq)
);";

const UPSERT_THREADS: &str = "
insert into tether_threads (id, agent, thread, updated_ms, length, checkpoint, invocation, message, announced,
                            started_at, started_from, started_checkpoint)
select * from unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::text[], $7::text[],
                     $8::text[], $9::text[], $10::bigint[], $11::text[], $12::text[])
on conflict (id) do update set
    agent = excluded.agent, thread = excluded.thread, updated_ms = excluded.updated_ms,
    length = excluded.length, checkpoint = coalesce(excluded.checkpoint, tether_threads.checkpoint),
    invocation = excluded.invocation, message = excluded.message, announced = excluded.announced,
    started_at = excluded.started_at, started_from = excluded.started_from,
    started_checkpoint = excluded.started_checkpoint";

const UPSERT_EVENTS: &str = "
insert into tether_events (thread, seq, event)
select * from unnest($1::text[], $2::bigint[], $3::text[])
on conflict (thread, seq) do update set event = excluded.event";

/// What a turn writes at once: its thread's row (with the record's new length and the running
/// turn's marks) and the events it added.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Write {
    /// The thread as the turn holds it.
    pub thread: Thread,
    /// The events added, with their sequence numbers (following the record without a gap).
    pub events: Vec<Event>,
    /// The record's length once these are in.
    pub length: u64,
    /// The checkpoint, when it changed (`None` keeps the one written before).
    pub checkpoint: Option<Value>,
    /// The running turn's invocation id (`None` once it ended).
    pub invocation: Option<String>,
    /// The client id of the message the thread's last turn was sent with.
    pub message: Option<String>,
    /// Where the running turn's sender said it runs.
    pub announced: Option<String>,
    /// The record's length when the running turn started (what a replay of it starts from).
    pub started_at: u64,
    /// The thread as the running turn found it in the database when it started (`None` when
    /// it found none): what a replay of it starts from.
    pub started_from: Option<Thread>,
    /// The checkpoint the running turn started from (`None`: none), for its replays.
    pub started_checkpoint: Option<Value>,
}

/// Where a turn starts in its thread's shared record ([`SharedRecord::turn_start`]): what its
/// first attempt found, so that every replay starts from the same record.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Start {
    /// The thread (`None` before a first turn wrote it).
    pub thread: Option<Thread>,
    /// How many events of the record the turn starts from.
    pub length: u64,
    /// The checkpoint the turn starts from (`None`: none was written).
    pub checkpoint: Option<Value>,
}

impl Write {
    /// A write of `thread`'s row at `length`, with no events, no new checkpoint and no marks.
    pub fn new(thread: Thread, length: u64) -> Self {
        Write {
            thread,
            events: Vec::new(),
            length,
            checkpoint: None,
            invocation: None,
            message: None,
            announced: None,
            started_at: 0,
            started_from: None,
            started_checkpoint: None,
        }
    }

    /// With where the running turn started, as [`SharedRecord::turn_start`] gave it.
    pub fn started(mut self, start: &Start) -> Self {
        self.started_at = start.length;
        self.started_from = start.thread.clone();
        self.started_checkpoint = start.checkpoint.clone();
        self
    }

    /// With these events added (sequence numbers up to `length`).
    pub fn events(mut self, events: Vec<Event>) -> Self {
        self.events = events;
        self
    }

    /// With a new checkpoint.
    pub fn checkpoint(mut self, checkpoint: Option<Value>) -> Self {
        self.checkpoint = checkpoint;
        self
    }

    /// With the running turn's marks (see [`ThreadStatus`]).
    pub fn marks(
        mut self,
        invocation: Option<String>,
        message: Option<String>,
        announced: Option<String>,
    ) -> Self {
        self.invocation = invocation;
        self.message = message;
        self.announced = announced;
        self
    }
}

type Job = (Write, oneshot::Sender<Result<()>>);

/// A thread record in PostgreSQL shared by every tether node (see the module documentation).
/// Cheap to clone: clones share the writer and the connections.
#[derive(Clone)]
pub struct SharedRecord {
    inner: Arc<Inner>,
}

struct Inner {
    config: tokio_postgres::Config,
    writer: mpsc::UnboundedSender<Job>,
    readers: Vec<Mutex<Option<Arc<Client>>>>,
    next: AtomicUsize,
}

impl std::fmt::Debug for SharedRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the connection string: it may hold a password.
        f.debug_struct("SharedRecord")
            .field("hosts", &self.inner.config.get_hosts().len())
            .field("dbname", &self.inner.config.get_dbname())
            .finish()
    }
}

fn db_error(what: &str, e: tokio_postgres::Error) -> Error {
    // tokio-postgres says only "db error" or "error connecting to server" itself; what the
    // server said, or why the connection failed, is its source.
    let mut why = String::new();
    let mut cause: Option<&dyn std::error::Error> = std::error::Error::source(&e);
    while let Some(c) = cause {
        why.push_str(": ");
        why.push_str(&c.to_string());
        cause = c.source();
    }
    Error::store_with(format!("the shared record (PostgreSQL): {what}{why}"), e)
}

fn decode<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> Result<T> {
    serde_json::from_str(text)
        .map_err(|e| Error::store_with(format!("the shared record holds a bad {what}"), e))
}

fn encode<T: serde::Serialize>(what: &str, v: &T) -> Result<String> {
    serde_json::to_string(v)
        .map_err(|e| Error::store_with(format!("encoding {what} for the shared record"), e))
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn parse(connection: &str) -> Result<tokio_postgres::Config> {
    connection.parse().map_err(|e| {
        Error::config_with(
            tether::ConfigKind::Invalid,
            "the shared record's PostgreSQL connection string does not parse",
            e,
        )
    })
}

async fn connect(config: &tokio_postgres::Config) -> Result<Client> {
    let (client, conn) = config
        .connect(tokio_postgres::NoTls)
        .await
        .map_err(|e| db_error("connecting", e))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::warn!("a connection to the shared record ended: {e}");
        }
    });
    Ok(client)
}

impl SharedRecord {
    /// Connects to the database `connection` names (a libpq connection string, such as
    /// `host=127.0.0.1 port=5432 user=tether dbname=tether`, or a `postgresql://` URL), creates
    /// the tables when missing and starts the writer. TLS is not supported: run it on loopback or
    /// a private network.
    pub async fn connect(connection: &str) -> Result<Self> {
        Self::open(parse(connection)?).await
    }

    async fn open(config: tokio_postgres::Config) -> Result<Self> {
        let writer = connect(&config).await?;
        writer
            .batch_execute(&format!("begin;{SCHEMA}commit;"))
            .await
            .map_err(|e| db_error("creating its tables", e))?;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(write_all(config.clone(), writer, rx));
        Ok(SharedRecord {
            inner: Arc::new(Inner {
                config,
                writer: tx,
                readers: (0..READERS).map(|_| Mutex::new(None)).collect(),
                next: AtomicUsize::new(0),
            }),
        })
    }

    /// As [`SharedRecord::connect`], with `password` for the database (kept out of the
    /// connection string, which a configuration file may hold). Refused when the connection
    /// string names a password itself.
    pub async fn connect_with_password(connection: &str, password: &str) -> Result<Self> {
        let mut config = parse(connection)?;
        if config.get_password().is_some() {
            return Err(Error::config(
                tether::ConfigKind::Invalid,
                "the shared record's PostgreSQL connection string holds a password: give it apart",
            ));
        }
        config.password(password);
        Self::open(config).await
    }

    /// Whether `connection` (a libpq connection string or URL) names a password (`false` when it
    /// does not parse: [`SharedRecord::connect`] says why).
    pub fn holds_password(connection: &str) -> bool {
        connection
            .parse::<tokio_postgres::Config>()
            .is_ok_and(|c| c.get_password().is_some())
    }

    /// Writes `w` with whatever other writes wait at the moment, in one transaction; returns once
    /// it is committed.
    pub async fn write(&self, w: Write) -> Result<()> {
        let (done, answer) = oneshot::channel();
        self.inner
            .writer
            .send((w, done))
            .map_err(|_| Error::store("the shared record's writer has stopped"))?;
        answer
            .await
            .map_err(|_| Error::store("the shared record's writer stopped before it answered"))?
    }

    /// A reading connection (connected again when its connection ended).
    async fn reader(&self) -> Result<Arc<Client>> {
        let slot = &self.inner.readers[self.inner.next.fetch_add(1, Ordering::Relaxed) % READERS];
        let mut held = slot.lock().await;
        if let Some(c) = held.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let c = Arc::new(connect(&self.inner.config).await?);
        *held = Some(c.clone());
        Ok(c)
    }

    /// The row `sql` finds, if any (`what` names the read in its error).
    async fn row(
        &self,
        what: &str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Option<tokio_postgres::Row>> {
        let c = self.reader().await?;
        c.query_opt(sql, params).await.map_err(|e| db_error(what, e))
    }

    /// The rows `sql` finds (`what` names the read in its error).
    async fn rows(
        &self,
        what: &str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>> {
        let c = self.reader().await?;
        c.query(sql, params).await.map_err(|e| db_error(what, e))
    }

    /// The thread, its record's length and its running turn's marks (see [`ThreadStatus`]).
    pub async fn status(&self, thread: &ThreadId) -> Result<ThreadStatus> {
        let row = self
            .row(
                "reading a thread",
                "select thread, length, invocation, message, announced from tether_threads where id = $1",
                &[&thread.as_str()],
            )
            .await?;
        let Some(row) = row else {
            return Ok(ThreadStatus::default());
        };
        Ok(ThreadStatus {
            thread: Some(decode("thread", row.get(0))?),
            length: to_u64(row.get(1)),
            invocation: row.get(2),
            message: row.get(3),
            announced: row.get(4),
        })
    }

    /// Where a turn (invocation `invocation`) of `thread` starts in its record: the thread, the
    /// record's length and the checkpoint as the database holds them (nothing before a first
    /// turn wrote them), unless the thread's running turn is this invocation, which wrote before
    /// (a replay after a crash or a suspension): then what it started from then
    /// ([`Write::started`]), so that it starts from the same record, thread and checkpoint again
    /// (its journal must replay as it was written) and writes its events at the same places.
    pub async fn turn_start(&self, thread: &ThreadId, invocation: &str) -> Result<Start> {
        let row = self
            .row(
                "reading a thread",
                "select thread, length, checkpoint, started_from, started_at, started_checkpoint, invocation
                 from tether_threads where id = $1",
                &[&thread.as_str()],
            )
            .await?;
        let Some(row) = row else {
            return Ok(Start::default());
        };
        // This invocation's replay: the columns it wrote as where it started.
        let replay = row.get::<_, Option<&str>>(6) == Some(invocation);
        let (t, length, checkpoint) = if replay { (3, 4, 5) } else { (0, 1, 2) };
        Ok(Start {
            thread: row
                .get::<_, Option<&str>>(t)
                .map(|t| decode("thread", t))
                .transpose()?,
            length: to_u64(row.get(length)),
            checkpoint: row
                .get::<_, Option<&str>>(checkpoint)
                .map(|c| decode("checkpoint", c))
                .transpose()?,
        })
    }

    /// Clears the marks of the turn `invocation` of `thread` if they are still there (a turn
    /// that failed before its last write); returns whether they were.
    pub async fn turn_over(&self, thread: &str, invocation: &str) -> Result<bool> {
        let n = self
            .reader()
            .await?
            .execute(
                "update tether_threads set invocation = null, announced = null where id = $1 and invocation = $2",
                &[&thread, &invocation],
            )
            .await
            .map_err(|e| db_error("clearing a turn's marks", e))?;
        Ok(n > 0)
    }

    /// The thread (`None` before its first turn wrote it).
    pub async fn thread(&self, thread: &ThreadId) -> Result<Option<Thread>> {
        let row = self
            .row(
                "reading a thread",
                "select thread from tether_threads where id = $1",
                &[&thread.as_str()],
            )
            .await?;
        row.map(|r| decode("thread", r.get(0))).transpose()
    }

    /// The threads of `agents`, the most recently used first.
    pub async fn threads(&self, agents: &[&str]) -> Result<Vec<Thread>> {
        let rows = self
            .rows(
                "listing threads",
                "select thread from tether_threads where agent = any($1) order by updated_ms desc, id",
                &[&agents],
            )
            .await?;
        rows.iter().map(|r| decode("thread", r.get(0))).collect()
    }

    /// The events of the record after `after`, at most `limit`, in sequence order (none past the
    /// record's length).
    pub async fn events_after(&self, thread: &str, after: u64, limit: u32) -> Result<Vec<Event>> {
        let rows = self
            .rows(
                "reading a record",
                "select e.event from tether_events e join tether_threads t on t.id = e.thread
                 where e.thread = $1 and e.seq > $2 and e.seq <= least($2 + $3, t.length) order by e.seq",
                &[&thread, &to_i64(after), &i64::from(limit)],
            )
            .await?;
        let events: Vec<Event> = rows
            .iter()
            .map(|r| decode("event", r.get(0)))
            .collect::<Result<_>>()?;
        for (i, e) in events.iter().enumerate() {
            if e.seq != Some(after + i as u64 + 1) {
                return Err(Error::store(format!(
                    "the shared record of {thread} has a gap at event {}",
                    after + i as u64 + 1
                )));
            }
        }
        Ok(events)
    }

    /// The record's first `length` events, all of them or an error.
    pub async fn events_upto(&self, thread: &str, length: u64) -> Result<Vec<Event>> {
        if length == 0 {
            return Ok(Vec::new());
        }
        let rows = self
            .rows(
                "reading a record",
                "select event from tether_events where thread = $1 and seq between 1 and $2 order by seq",
                &[&thread, &to_i64(length)],
            )
            .await?;
        let events: Vec<Event> = rows
            .iter()
            .map(|r| decode("event", r.get(0)))
            .collect::<Result<_>>()?;
        if events.len() as u64 != length
            || events
                .iter()
                .enumerate()
                .any(|(i, e)| e.seq != Some(i as u64 + 1))
        {
            return Err(Error::store(format!(
                "the shared record of {thread} lacks events: {} of {length} found in order",
                events.len()
            )));
        }
        Ok(events)
    }

    /// The thread's checkpoint (`None` when none was written).
    pub async fn checkpoint(&self, thread: &str) -> Result<Option<Value>> {
        let row = self
            .row(
                "reading a checkpoint",
                "select checkpoint from tether_threads where id = $1",
                &[&thread],
            )
            .await?;
        match row.and_then(|r| r.get::<_, Option<String>>(0)) {
            Some(text) => Ok(Some(decode("checkpoint", &text)?)),
            None => Ok(None),
        }
    }
}

/// The writer: every write waiting when it wakes in one transaction (split where a thread comes
/// twice, which one statement cannot update twice), each write answered once committed.
async fn write_all(config: tokio_postgres::Config, client: Client, mut rx: mpsc::UnboundedReceiver<Job>) {
    let mut client = Some(client);
    while let Some(first) = rx.recv().await {
        let mut jobs = vec![first];
        while let Ok(j) = rx.try_recv() {
            jobs.push(j);
        }
        while !jobs.is_empty() {
            let mut seen = HashSet::new();
            let split = jobs
                .iter()
                .position(|(w, _)| !seen.insert(w.thread.id.clone()))
                .unwrap_or(jobs.len());
            let rest = jobs.split_off(split);
            let c = match client.take().filter(|c| !c.is_closed()) {
                Some(c) => Ok(c),
                None => connect(&config).await,
            };
            let outcome = match c {
                Ok(mut c) => {
                    let r = commit(&mut c, &jobs).await;
                    client = Some(c);
                    r
                }
                Err(e) => Err(e),
            };
            for (_, done) in jobs {
                let _ = done.send(match &outcome {
                    Ok(()) => Ok(()),
                    Err(e) => Err(Error::store(e.to_string())),
                });
            }
            jobs = rest;
        }
    }
}

async fn commit(c: &mut Client, jobs: &[Job]) -> Result<()> {
    let n = jobs.len();
    let (mut ids, mut agents, mut threads, mut updated, mut lengths) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let mut started_from = Vec::with_capacity(n);
    let mut started_checkpoint = Vec::with_capacity(n);
    let (mut checkpoints, mut invocations, mut messages, mut announced, mut started) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut ev_thread, mut ev_seq, mut ev_body) = (Vec::new(), Vec::new(), Vec::new());
    for (w, _) in jobs {
        let id = w.thread.id.as_str();
        ids.push(id);
        agents.push(w.thread.agent.as_str());
        threads.push(encode("a thread", &w.thread)?);
        updated.push(w.thread.updated_ms);
        lengths.push(to_i64(w.length));
        checkpoints.push(
            w.checkpoint
                .as_ref()
                .map(|c| encode("a checkpoint", c))
                .transpose()?,
        );
        invocations.push(w.invocation.as_deref());
        messages.push(w.message.as_deref());
        announced.push(w.announced.as_deref());
        started.push(to_i64(w.started_at));
        started_from.push(
            w.started_from
                .as_ref()
                .map(|t| encode("a thread", t))
                .transpose()?,
        );
        started_checkpoint.push(
            w.started_checkpoint
                .as_ref()
                .map(|c| encode("a checkpoint", c))
                .transpose()?,
        );
        for e in &w.events {
            let Some(seq) = e.seq else {
                return Err(Error::store(format!("event {} has no sequence number", e.id)));
            };
            ev_thread.push(id);
            ev_seq.push(to_i64(seq));
            ev_body.push(encode("an event", e)?);
        }
    }
    let tx = c
        .transaction()
        .await
        .map_err(|e| db_error("beginning a write", e))?;
    if !ev_thread.is_empty() {
        tx.execute(UPSERT_EVENTS, &[&ev_thread, &ev_seq, &ev_body])
            .await
            .map_err(|e| db_error("writing events", e))?;
    }
    tx.execute(
        UPSERT_THREADS,
        &[
            &ids,
            &agents,
            &threads,
            &updated,
            &lengths,
            &checkpoints,
            &invocations,
            &messages,
            &announced,
            &started,
            &started_from,
            &started_checkpoint,
        ],
    )
    .await
    .map_err(|e| db_error("writing threads", e))?;
    tx.commit().await.map_err(|e| db_error("committing a write", e))
}
