//! [`RestateStore`]: tether's [`ThreadStore`] over threads whose record is Restate object state,
//! for a front-end (any tether node) that reads them.
//!
//! Every read is a call of a shared handler through the Restate ingress: `thread`, `events`
//! (paged) and `checkpoint` on the thread's `TetherThread` object, `list` on the agent's
//! `TetherThreads` index, `get` on the thread's `TetherThreadNotes`. The record itself is written
//! only by the thread's turns (inside the invocation's journal), so the store refuses to write it
//! (`append`, `put_tool_result`, `claim_thread`, `set_provider_session` and the checkpoint are
//! [`tether::Error::Store`] errors); any other state key a front-end writes (`put_state`: its
//! approval bookkeeping) is a note on the thread's `TetherThreadNotes` object, which never waits
//! behind a running turn.
//!
//! Every thread this store answers with has its id as its record key (the record on Restate is
//! the thread object's state). With [`RestateStore::with_legacy`], a thread not on Restate yet is
//! read from a local store (the SQLite file of a node that ran threads before they moved to
//! Restate; its own record key is looked up there); its first turn on Restate imports its record
//! (see [`crate::TetherThread::import`]), and from then on Restate's copy is the record.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tether::thread::CHECKPOINT;
use tether::{
    Claim, ConfigKind, Error, Event, EventStore, Result, Thread, ThreadId, ThreadStore, ToolResult,
};

use crate::record::{MAX_PAGE, Page, memo_of};

/// How long one ingress call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long an ingress call that got no answer, or an answer saying the cluster cannot serve it
/// yet ([`retryable`]), is sent again: long enough for a cluster to move a lost node's
/// partitions to the survivors (seconds on loopback), for a client behind a load balancer or
/// forwarder over several nodes' ingresses to reach a live one.
pub const FAILOVER: Duration = Duration::from_secs(30);

/// Whether an ingress call that failed this way may be sent again: `None` when no answer came
/// (the connection was refused or broke: the node behind the address died, or a pooled
/// connection to it was stale), or the statuses of a gateway or a node that cannot serve the
/// call yet (502, 503, 504). The calls tether makes through the ingress are
/// safe to repeat: shared handlers read, a note's `put` writes the same value, a turn is sent
/// with an idempotency key; an `approve` whose first attempt took effect finds the turn no
/// longer waiting on that tool use (409) when repeated, which its caller reports.
pub fn retryable(status: Option<u16>) -> bool {
    matches!(status, None | Some(502..=504))
}

/// The pause before the `attempt`-th repetition of an ingress call (50 ms, growing to 500 ms).
pub fn retry_pause(attempt: u32) -> Duration {
    Duration::from_millis(50u64.saturating_mul(1u64 << attempt.min(4)).min(500))
}

/// A [`ThreadStore`] reading threads on Restate through the ingress (see the module
/// documentation). Cheap to clone.
#[derive(Clone)]
pub struct RestateStore {
    ingress: reqwest::Url,
    http: reqwest::Client,
    agents: Vec<String>,
    legacy: Option<Arc<dyn ThreadStore>>,
    shared: Option<crate::SharedRecord>,
}

impl std::fmt::Debug for RestateStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestateStore")
            .field("ingress", &self.ingress.as_str())
            .field("agents", &self.agents)
            .field("legacy", &self.legacy.is_some())
            .field("shared", &self.shared)
            .finish()
    }
}

fn refused(what: &str) -> Error {
    Error::store(format!(
        "{what}: a thread's record on Restate is written only by its turn (the TetherThread object's \
         `turn` handler); a front-end reads it"
    ))
}

impl RestateStore {
    /// A store reading through the Restate ingress at `ingress` (e.g. `http://127.0.0.1:8080`),
    /// listing the threads of `agents` (the index is kept per agent).
    pub fn new(ingress: &str, agents: impl IntoIterator<Item = impl Into<String>>) -> Result<Self> {
        let url = reqwest::Url::parse(ingress).map_err(|e| {
            Error::config_with(
                ConfigKind::Invalid,
                format!("the Restate ingress {ingress:?} is not a URL"),
                e,
            )
        })?;
        if url.cannot_be_a_base() {
            return Err(Error::config(
                ConfigKind::Invalid,
                format!("the Restate ingress {ingress:?} cannot be a base URL"),
            ));
        }
        Ok(RestateStore {
            ingress: url,
            http: reqwest::Client::new(),
            agents: agents.into_iter().map(Into::into).collect(),
            legacy: None,
            shared: None,
        })
    }

    /// Reads the records, threads and statuses from `shared`, the database the turns write them
    /// to ([`crate::TetherThread::shared_record`]), instead of calling the thread objects through
    /// the ingress: a read no longer queues on Restate. What a running turn waits for, the notes
    /// and every write still go through the ingress.
    pub fn with_shared(mut self, shared: crate::SharedRecord) -> Self {
        self.shared = Some(shared);
        self
    }

    /// Reads a thread that is not on Restate yet from `legacy` (read only: nothing is written
    /// there), until its first turn on Restate imports it.
    pub fn with_legacy(mut self, legacy: Arc<dyn ThreadStore>) -> Self {
        self.legacy = Some(legacy);
        self
    }

    fn url(&self, service: &str, key: &str, handler: &str) -> reqwest::Url {
        let mut u = self.ingress.clone();
        if let Ok(mut seg) = u.path_segments_mut() {
            seg.pop_if_empty().push(service).push(key).push(handler);
        }
        u
    }

    /// Calls `handler` of object `service`/`key` through the ingress with `body` (none when
    /// `null`) and decodes its answer; sent again for up to [`FAILOVER`] while it fails in a
    /// [`retryable`] way.
    async fn call<T: DeserializeOwned>(
        &self,
        service: &str,
        key: &str,
        handler: &str,
        body: &Value,
    ) -> Result<T> {
        let started = tokio::time::Instant::now();
        let mut attempt = 0;
        loop {
            match self.call_once(service, key, handler, body).await {
                Err((status, _)) if retryable(status) && started.elapsed() < FAILOVER => {
                    tokio::time::sleep(retry_pause(attempt)).await;
                    attempt += 1;
                }
                r => return r.map_err(|(_, e)| e),
            }
        }
    }

    /// One attempt of [`RestateStore::call`]; a failure carries the answer's status (`None`:
    /// no answer).
    async fn call_once<T: DeserializeOwned>(
        &self,
        service: &str,
        key: &str,
        handler: &str,
        body: &Value,
    ) -> std::result::Result<T, (Option<u16>, Error)> {
        let what = format!("{service}/{handler}");
        let mut req = self
            .http
            .post(self.url(service, key, handler))
            .timeout(CALL_TIMEOUT);
        if !body.is_null() {
            req = req.json(body);
        }
        let resp = req.send().await.map_err(|e| {
            (
                None,
                Error::store_with(format!("calling {what} through the Restate ingress"), e),
            )
        })?;
        let status = resp.status();
        let code = Some(status.as_u16());
        let text = resp.text().await.map_err(|e| {
            (
                code,
                Error::store_with(format!("reading the answer of {what}"), e),
            )
        })?;
        if !status.is_success() {
            let text: String = text.chars().take(1024).collect();
            return Err((
                code,
                Error::store(format!("{what} answered {}: {text}", status.as_u16())),
            ));
        }
        // A handler without output answers with an empty body.
        let text = if text.trim().is_empty() {
            "null"
        } else {
            text.as_str()
        };
        serde_json::from_str(text).map_err(|e| {
            (
                code,
                Error::store_with(format!("the answer of {what} is not what tether expects"), e),
            )
        })
    }

    /// The thread, its record's length and its running turn, in one call through the ingress
    /// (see [`ThreadStatus`](crate::ThreadStatus)). A thread Restate does not hold yet is looked
    /// up in the legacy store, as [`ThreadStore::thread`] does.
    pub async fn status(&self, thread: &ThreadId) -> Result<crate::ThreadStatus> {
        let mut status: crate::ThreadStatus = match &self.shared {
            Some(s) => s.status(thread).await?,
            None => {
                self.call(crate::SERVICE, thread.as_str(), "status", &Value::Null)
                    .await?
            }
        };
        if status.thread.is_none()
            && let Some(l) = &self.legacy
        {
            status.thread = l.thread(thread).await?.map(on_restate);
        }
        Ok(status)
    }

    /// What the running turn of thread `record` waits for and a page of its record (the events
    /// after `after`, at most `limit`), in one call through the ingress (see
    /// [`Progress`](crate::Progress)).
    pub async fn progress(&self, record: &str, after: u64, limit: u32) -> Result<crate::Progress> {
        let Some(s) = &self.shared else {
            return self
                .call(crate::SERVICE, record, "progress", &page(after, limit)?)
                .await;
        };
        // What the turn waits for first: it records its events before it waits.
        let waiting: Vec<crate::WaitingToolUse> =
            self.call(crate::SERVICE, record, "waiting", &Value::Null).await?;
        let events = s
            .events_after(record, after, Page::new(after, limit).limit())
            .await?;
        Ok(crate::Progress { waiting, events })
    }

    /// Writes several notes of thread `record` in one call through the ingress (the notes
    /// object's `put_all`; a `null` value removes its note): what [`EventStore::put_state`]
    /// does for one, for a front-end that writes a few before a turn and would otherwise queue
    /// once per note. At most [`MAX_NOTES`](crate::notes::MAX_NOTES) notes; the checkpoint is
    /// refused as there.
    pub async fn put_notes(&self, record: &str, notes: &[(&str, Value)]) -> Result<()> {
        if notes.iter().any(|(k, _)| *k == CHECKPOINT) {
            return Err(refused("writing the checkpoint"));
        }
        let body = serde_json::to_value(
            notes
                .iter()
                .map(|(k, v)| crate::notes::Note::new(*k, v.clone()))
                .collect::<Vec<_>>(),
        )
        .map_err(|e| Error::store_with("encoding notes", e))?;
        self.call::<Value>(crate::NOTES, record, "put_all", &body)
            .await
            .map(drop)
    }

    /// A page of a thread's record: the events after `after`, at most `limit` (at most
    /// [`MAX_PAGE`]). What a client reconnecting to any node reads to catch up.
    pub async fn events_after(&self, record: &str, after: u64, limit: u32) -> Result<Vec<Event>> {
        match &self.shared {
            Some(s) => {
                s.events_after(record, after, Page::new(after, limit).limit())
                    .await
            }
            None => {
                self.call(crate::SERVICE, record, "events", &page(after, limit)?)
                    .await
            }
        }
    }
}

/// The body of a page request (the `events` and `progress` handlers).
fn page(after: u64, limit: u32) -> Result<Value> {
    serde_json::to_value(Page::new(after, limit)).map_err(|e| Error::store_with("encoding a page request", e))
}

/// A legacy thread as this store answers with it: its record key is its id.
fn on_restate(mut t: Thread) -> Thread {
    t.record = t.id.as_str().to_owned();
    t
}

impl RestateStore {
    /// The legacy store and the record key it keeps the thread `record` (a thread id) under.
    async fn legacy_record(&self, record: &str) -> Result<Option<(&dyn ThreadStore, String)>> {
        let Some(l) = &self.legacy else {
            return Ok(None);
        };
        let Ok(id) = ThreadId::new(record) else {
            return Ok(None);
        };
        Ok(l.thread(&id).await?.map(|t| (l.as_ref(), t.record)))
    }

    /// The record on Restate (empty when Restate has none under this key).
    async fn load_restate(&self, session_id: &str) -> Result<Vec<Event>> {
        let mut all: Vec<Event> = Vec::new();
        loop {
            let after = all.len() as u64;
            let page = self.events_after(session_id, after, MAX_PAGE).await?;
            let n = page.len();
            for e in page {
                if e.seq != Some(all.len() as u64 + 1) {
                    return Err(Error::store(format!(
                        "the record {session_id} read through Restate has a gap at event {}",
                        all.len() + 1
                    )));
                }
                all.push(e);
            }
            if n < MAX_PAGE as usize {
                return Ok(all);
            }
        }
    }
}

#[async_trait]
impl EventStore for RestateStore {
    async fn append(&self, _session_id: &str, _event: &Event) -> Result<bool> {
        Err(refused("appending an event"))
    }

    async fn load(&self, session_id: &str) -> Result<Vec<Event>> {
        let all = self.load_restate(session_id).await?;
        match self.legacy_record(session_id).await? {
            Some((l, record)) if all.is_empty() => l.load(&record).await,
            _ => Ok(all),
        }
    }

    async fn tool_result(&self, session_id: &str, tool_use_id: &str) -> Result<Option<ToolResult>> {
        Ok(memo_of(&self.load(session_id).await?)
            .into_iter()
            .find(|r| r.tool_use_id == tool_use_id))
    }

    async fn put_tool_result(&self, _session_id: &str, _result: &ToolResult) -> Result<()> {
        Err(refused("recording a tool result"))
    }

    async fn put_state(&self, session_id: &str, key: &str, value: &Value) -> Result<()> {
        if key == CHECKPOINT {
            return Err(refused("writing the checkpoint"));
        }
        let note = serde_json::to_value(crate::notes::Note::new(key, value.clone()))
            .map_err(|e| Error::store_with("encoding a note", e))?;
        self.call::<Value>(crate::NOTES, session_id, "put", &note)
            .await
            .map(drop)
    }

    async fn state(&self, session_id: &str, key: &str) -> Result<Option<Value>> {
        let v: Value = if key == CHECKPOINT {
            match &self.shared {
                Some(s) => s.checkpoint(session_id).await?.unwrap_or(Value::Null),
                None => {
                    self.call(crate::SERVICE, session_id, "checkpoint", &Value::Null)
                        .await?
                }
            }
        } else {
            self.call(crate::NOTES, session_id, "get", &json!(key)).await?
        };
        if !v.is_null() {
            return Ok(Some(v));
        }
        match self.legacy_record(session_id).await? {
            Some((l, record)) => l.state(&record, key).await,
            None => Ok(None),
        }
    }

    async fn sessions(&self) -> Result<Vec<String>> {
        Ok(self.threads(None).await?.into_iter().map(|t| t.record).collect())
    }
}

#[async_trait]
impl ThreadStore for RestateStore {
    async fn claim_thread(
        &self,
        _thread: &ThreadId,
        _agent: &str,
        _new_record: &str,
        _title: &str,
    ) -> Result<Claim> {
        Err(refused("claiming a thread"))
    }

    async fn set_provider_session(&self, _thread: &ThreadId, _provider: &str, _session: &str) -> Result<()> {
        Err(refused("recording a provider session"))
    }

    async fn thread(&self, thread: &ThreadId) -> Result<Option<Thread>> {
        let t: Option<Thread> = match &self.shared {
            Some(s) => s.thread(thread).await?,
            None => {
                self.call(crate::SERVICE, thread.as_str(), "thread", &Value::Null)
                    .await?
            }
        };
        match (&self.legacy, t) {
            (Some(l), None) => Ok(l.thread(thread).await?.map(on_restate)),
            (_, t) => Ok(t),
        }
    }

    async fn threads(&self, agent: Option<&str>) -> Result<Vec<Thread>> {
        let agents: Vec<&str> = match agent {
            Some(a) => vec![a],
            None => self.agents.iter().map(String::as_str).collect(),
        };
        let mut all = Vec::new();
        match &self.shared {
            Some(s) => all = s.threads(&agents).await?,
            None => {
                for a in agents {
                    let mut some: Vec<Thread> = self.call(crate::INDEX, a, "list", &Value::Null).await?;
                    all.append(&mut some);
                }
            }
        }
        if let Some(l) = &self.legacy {
            let known: std::collections::HashSet<ThreadId> = all.iter().map(|t| t.id.clone()).collect();
            all.extend(
                l.threads(agent)
                    .await?
                    .into_iter()
                    .filter(|t| !known.contains(&t.id))
                    .map(on_restate),
            );
        }
        all.sort_by(|a, b| {
            b.updated_ms
                .cmp(&a.updated_ms)
                .then_with(|| a.id.as_str().cmp(b.id.as_str()))
        });
        Ok(all)
    }
}
