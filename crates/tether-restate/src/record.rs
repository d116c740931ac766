//! Where a thread's record lives, and how a turn reads and writes it.
//!
//! The record stays tether's: a [`ThreadStore`] (a shared `SqliteStore` file in this crate's
//! service). A turn never writes it while it runs. It starts from a [`Snapshot`] read in a
//! journaled step (so a replay starts from the very same record), runs the engine against an
//! in-memory copy, and ends with one journaled [`commit`] step that appends the turn's events,
//! memo results, checkpoint and provider session. Every write is keyed (event ids, memo keys,
//! state keys), so a commit cut short by a crash and run again writes nothing twice.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tether::thread::CHECKPOINT;
use tether::{
    Claim, Error, Event, EventKind, EventStore, MemoryStore, Result, Thread, ThreadId, ThreadStore,
};

/// A thread's record as a turn starts from it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    /// The thread (claimed for the agent).
    pub thread: Thread,
    /// Its events, in sequence order.
    pub events: Vec<Event>,
    /// Its checkpoint (state key [`CHECKPOINT`]), if any.
    pub checkpoint: Option<Value>,
}

/// A fresh record key for a new thread (random: the step that makes it is journaled).
fn new_record_key() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("rs_{:032x}", nanos ^ (u128::from(std::process::id()) << 96))
}

/// Claims `thread` for `agent` in `store` and reads its record.
pub async fn load(store: &dyn ThreadStore, thread: &ThreadId, agent: &str, title: &str) -> Result<Snapshot> {
    let thread = match store
        .claim_thread(thread, agent, &new_record_key(), title)
        .await?
    {
        Claim::Claimed { thread, .. } => thread,
        Claim::Taken(other) => {
            return Err(Error::ThreadTaken {
                thread: other.id.to_string(),
                agent: other.agent,
            });
        }
        _ => {
            return Err(Error::store(
                "the store answered a claim in a way this backend does not know",
            ));
        }
    };
    let events = store.load(&thread.record).await?;
    let checkpoint = store.state(&thread.record, CHECKPOINT).await?;
    Ok(Snapshot {
        thread,
        events,
        checkpoint,
    })
}

/// The memo entries a record's tool-result events hold (`tool_result:{memo key}`).
fn memo_of(events: &[Event]) -> Vec<tether::ToolResult> {
    events
        .iter()
        .filter_map(|e| {
            let key = e.id.strip_prefix("tool_result:")?;
            match &e.kind {
                EventKind::ToolResult { result } => Some(tether::ToolResult::new(
                    key,
                    result.content.clone(),
                    result.is_error,
                )),
                _ => None,
            }
        })
        .collect()
}

/// An in-memory store holding the snapshot, for the engine to run the turn against.
pub async fn seed(snapshot: &Snapshot) -> Result<Arc<MemoryStore>> {
    let mem = Arc::new(MemoryStore::default());
    let t = &snapshot.thread;
    mem.claim_thread(&t.id, &t.agent, &t.record, &t.title).await?;
    if let Some(s) = &t.provider_session {
        mem.set_provider_session(&t.id, &t.provider, s).await?;
    }
    for e in &snapshot.events {
        mem.append(&t.record, e).await?;
    }
    for r in memo_of(&snapshot.events) {
        mem.put_tool_result(&t.record, &r).await?;
    }
    if let Some(c) = &snapshot.checkpoint {
        mem.put_state(&t.record, CHECKPOINT, c).await?;
    }
    Ok(mem)
}

/// What a turn adds to its thread's record.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Commit {
    /// The thread, as the turn left it (its provider session).
    pub thread: Thread,
    /// The turn's new events, in sequence order.
    pub events: Vec<Event>,
    /// The checkpoint after the turn.
    pub checkpoint: Option<Value>,
}

/// What the turn run against `mem` adds to `snapshot`.
pub async fn diff(snapshot: &Snapshot, mem: &MemoryStore) -> Result<Commit> {
    let t = &snapshot.thread;
    let all = mem.load(&t.record).await?;
    let known: std::collections::HashSet<&str> = snapshot.events.iter().map(|e| e.id.as_str()).collect();
    let events = all
        .into_iter()
        .filter(|e| !known.contains(e.id.as_str()))
        .collect();
    let thread = mem.thread(&t.id).await?.unwrap_or_else(|| t.clone());
    let checkpoint = mem.state(&t.record, CHECKPOINT).await?;
    Ok(Commit {
        thread,
        events,
        checkpoint,
    })
}

/// Writes a turn's additions to the durable store; run again after a crash, it writes nothing
/// twice (events by id, memo entries first-wins, state and provider session overwritten with the
/// same values). Returns how many events were new.
pub async fn commit(store: &dyn ThreadStore, c: &Commit) -> Result<usize> {
    let t = &c.thread;
    let mut added = 0;
    for r in memo_of(&c.events) {
        store.put_tool_result(&t.record, &r).await?;
    }
    for e in &c.events {
        if store.append(&t.record, e).await? {
            added += 1;
        }
    }
    if let Some(v) = &c.checkpoint {
        store.put_state(&t.record, CHECKPOINT, v).await?;
    }
    if let Some(s) = &t.provider_session {
        store.set_provider_session(&t.id, &t.provider, s).await?;
    }
    Ok(added)
}
