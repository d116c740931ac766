//! Where a thread's record lives, and how a turn reads and writes it.
//!
//! (Unless the service keeps the records in a shared database: see [`crate::shared`].)
//!
//! The record is the thread's **Restate object state** (the `TetherThread` object keyed by the
//! thread id), so every tether node reads the same record and it is replicated with the Restate
//! cluster:
//!
//! | state key | value |
//! |---|---|
//! | [`THREAD`] | the [`Thread`] (agent, title, provider session, times) |
//! | [`EVENTS`] | how many events the record holds (`n`) |
//! | `event:{seq}` ([`event_key`]) | the event with sequence number `seq`, for `seq` in `1..=n` |
//! | [`CHECKPOINT_KEY`] | the checkpoint (tether's state key [`CHECKPOINT`]) |
//!
//! One key per event, so a value stays far below Restate's message size and a reader pages
//! through them (the shared `events` handler). The memo (tool results by memo key) is not kept
//! apart: it is read off the record's tool-result events (`tool_result:{memo key}`).
//!
//! A turn reads the record from the object state at its start (journaled: a replay starts from
//! the very same record), runs the engine against an in-memory copy ([`seed`]), and before every
//! step and at its end writes what the engine added (`ctx.set`, see [`Written`]). Those writes
//! are part of the invocation's journal: written once, never twice, and readable by the shared
//! handlers while the turn runs or waits for an approval.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tether::thread::CHECKPOINT;
use tether::{Event, EventKind, EventStore, MemoryStore, Result, Thread, ThreadStore};

/// State key of the thread's [`Thread`].
pub const THREAD: &str = "thread";
/// State key of the number of events in the record.
pub const EVENTS: &str = "events";
/// State key of the checkpoint.
pub const CHECKPOINT_KEY: &str = "checkpoint";
/// The most events one read of the `events` handler returns.
pub const MAX_PAGE: u32 = 128;

/// The state key of the event with sequence number `seq` (`event:{seq}`).
pub fn event_key(seq: u64) -> String {
    format!("event:{seq}")
}

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

/// A page of a record, as the `events` handler is asked for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Page {
    /// The events after this sequence number (0: from the start).
    #[serde(default)]
    pub after: u64,
    /// At most this many (capped at [`MAX_PAGE`]; 0 means [`MAX_PAGE`]).
    #[serde(default)]
    pub limit: u32,
}

impl Page {
    /// The events after `after`, at most `limit` of them.
    pub fn new(after: u64, limit: u32) -> Self {
        Page { after, limit }
    }

    /// How many events it asks for at most: its `limit`, capped at [`MAX_PAGE`] (0 means
    /// [`MAX_PAGE`]).
    pub fn limit(&self) -> u32 {
        match self.limit {
            0 => MAX_PAGE,
            n => n.min(MAX_PAGE),
        }
    }

    /// The sequence numbers this page covers in a record of `count` events.
    // `1..=0` is the empty range on purpose.
    #[allow(clippy::reversed_empty_ranges)]
    pub fn range(&self, count: u64) -> std::ops::RangeInclusive<u64> {
        let limit = self.limit();
        if self.after >= count {
            return 1..=0;
        }
        let first = self.after + 1;
        let last = self.after.saturating_add(u64::from(limit)).min(count);
        first..=last
    }
}

/// A thread's record in a store of tether's (read only), for its import into Restate: `None`
/// when the store does not hold the thread.
pub async fn import(store: &dyn ThreadStore, thread: &tether::ThreadId) -> Result<Option<Snapshot>> {
    let Some(t) = store.thread(thread).await? else {
        return Ok(None);
    };
    let events = store.load(&t.record).await?;
    let checkpoint = store.state(&t.record, CHECKPOINT).await?;
    Ok(Some(Snapshot {
        thread: t,
        events,
        checkpoint,
    }))
}

/// The memo entries a record's tool-result events hold (`tool_result:{memo key}`).
pub fn memo_of(events: &[Event]) -> Vec<tether::ToolResult> {
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

/// What of the engine's in-memory record is in the object state already.
#[derive(Debug, Clone)]
pub struct Written {
    /// The thread as written (its times are the turn's journaled clock, not the memory store's).
    pub thread: Thread,
    /// How many events are written.
    pub events: u64,
    /// The checkpoint as written.
    pub checkpoint: Option<Value>,
}

/// What the engine added to its in-memory record since `written`: the writes to make.
#[derive(Debug, Default)]
pub struct Additions {
    /// New events, in sequence order (their `seq` follow `written.events` without a gap).
    pub events: Vec<Event>,
    /// The new checkpoint, when it changed.
    pub checkpoint: Option<Value>,
    /// The thread, when its provider session changed.
    pub thread: Option<Thread>,
}

impl Written {
    /// What `mem` holds beyond what is written; an error when its events do not follow the
    /// written ones without a gap (the engine only appends, so that is a bug, not an input).
    pub async fn additions(&self, mem: &MemoryStore) -> Result<Additions> {
        let t = &self.thread;
        let mut out = Additions::default();
        let mut next = self.events + 1;
        // Only what is new: a turn writes before each step, and a long thread's record would
        // otherwise be copied whole each time.
        for e in mem.events_after(&t.record, self.events)? {
            match e.seq {
                Some(s) if s < next => {}
                Some(s) if s == next => {
                    next += 1;
                    out.events.push(Event::clone(&e));
                }
                other => {
                    return Err(tether::Error::store(format!(
                        "the turn's record would have a gap: event {} has sequence number {other:?}, {next} \
                         expected",
                        e.id
                    )));
                }
            }
        }
        let checkpoint = mem.state(&t.record, CHECKPOINT).await?;
        if checkpoint.is_some() && checkpoint != self.checkpoint {
            out.checkpoint = checkpoint;
        }
        if let Some(now) = mem.thread(&t.id).await?
            && (now.provider != t.provider || now.provider_session != t.provider_session)
        {
            let mut changed = t.clone();
            changed.provider = now.provider;
            changed.provider_session = now.provider_session;
            out.thread = Some(changed);
        }
        Ok(out)
    }

    /// Notes `a` as written.
    pub fn apply(&mut self, a: &Additions) {
        self.events += a.events.len() as u64;
        if let Some(c) = &a.checkpoint {
            self.checkpoint = Some(c.clone());
        }
        if let Some(t) = &a.thread {
            self.thread = t.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_bounded_and_never_overflow() {
        assert_eq!(Page::new(0, 10).range(3), 1..=3);
        assert_eq!(Page::new(2, 10).range(3), 3..=3);
        assert!(Page::new(3, 10).range(3).is_empty());
        assert_eq!(Page::new(0, 0).range(1000), 1..=u64::from(MAX_PAGE));
        assert_eq!(Page::new(0, 10_000).range(1000), 1..=u64::from(MAX_PAGE));
        assert!(Page::new(u64::MAX, 5).range(u64::MAX).is_empty());
    }
}
