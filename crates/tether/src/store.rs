//! [`EventStore`]: the exactly-once record, the tool-result memo and session state, per session.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::event::Event;
use crate::thread::{Claim, Thread, ThreadId, ThreadStore};
use crate::types::ToolResult;

/// Durable storage of sessions: events appended exactly once (keyed by event id), tool results
/// memoized by key, and small named state values (a provider's transcript, a thread mapping) so
/// a session can be loaded back after a restart.
///
/// The memo is what turns at-least-once tool delivery into an exactly-once effect: the engine
/// looks a tool use up before running it and records the result before resuming the provider.
/// The engine's key is [`crate::ToolUse::memo_key`] (the id with a digest of the name and
/// arguments, so a model reusing an id for another call is never answered from the memo); the
/// result it stores carries that key as its `tool_use_id`. A result an application stores under
/// a pending use's bare id (an approval's denial) is taken when the session resumes.
#[async_trait]
pub trait EventStore: Send + Sync + 'static {
    /// Appends an event; returns `false` (and stores nothing) when its id is already stored.
    async fn append(&self, session_id: &str, event: &Event) -> Result<bool>;
    /// [`append`](Self::append) of an event the caller shares (the session's sink, which keeps
    /// the same event for its record): a store that keeps events as they are ([`MemoryStore`])
    /// keeps this one without copying it. The default calls `append`.
    async fn append_shared(&self, session_id: &str, event: &Arc<Event>) -> Result<bool> {
        self.append(session_id, event).await
    }
    /// Every stored event of a session, in sequence order.
    async fn load(&self, session_id: &str) -> Result<Vec<Event>>;
    /// The result recorded under `tool_use_id` (a memo key), if any.
    async fn tool_result(&self, session_id: &str, tool_use_id: &str) -> Result<Option<ToolResult>>;
    /// Records a result under its `tool_use_id` (a memo key; the first record wins).
    async fn put_tool_result(&self, session_id: &str, result: &ToolResult) -> Result<()>;
    /// [`put_tool_result`](Self::put_tool_result) with the result handed over, for a caller
    /// that has no further use for it (the engine's memo of each call): a store that keeps
    /// results as they are ([`MemoryStore`]) takes it without copying it. The default calls
    /// `put_tool_result`.
    async fn put_tool_result_owned(&self, session_id: &str, result: ToolResult) -> Result<()> {
        self.put_tool_result(session_id, &result).await
    }
    /// Stores a named value for the session (overwriting).
    async fn put_state(&self, session_id: &str, key: &str, value: &Value) -> Result<()>;
    /// [`put_state`](Self::put_state) with the value handed over, for a caller that has no
    /// further use for it (the engine's checkpoint after each turn): a store that keeps values
    /// as they are ([`MemoryStore`]) takes it without copying it. The default calls `put_state`.
    async fn put_state_owned(&self, session_id: &str, key: &str, value: Value) -> Result<()> {
        self.put_state(session_id, key, &value).await
    }
    /// [`append`](Self::append) and, when the event is appended, [`put_state`](Self::put_state)
    /// of `key` in the same store step: what an [`crate::EventObserver`] hands over with a
    /// durable event ([`crate::EventObserver::state_with`]) rides on the write the session makes
    /// anyway instead of costing a write of its own. A store that commits in transactions does
    /// both in one; the default calls the two in turn. Returns what `append` returns; when the
    /// event was already stored, the state is not written.
    async fn append_with_state(
        &self,
        session_id: &str,
        event: &Event,
        key: &str,
        value: &Value,
    ) -> Result<bool> {
        if !self.append(session_id, event).await? {
            return Ok(false);
        }
        self.put_state(session_id, key, value).await?;
        Ok(true)
    }
    /// Reads a named value of the session.
    async fn state(&self, session_id: &str, key: &str) -> Result<Option<Value>>;
    /// Ids of all sessions with stored events or state.
    async fn sessions(&self) -> Result<Vec<String>>;
}

/// An [`EventStore`] in memory: for tests, the CLI, and sessions that need no durability.
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<HashMap<String, SessionData>>,
    threads: Mutex<HashMap<ThreadId, Thread>>,
}

#[derive(Debug, Default)]
struct SessionData {
    events: Vec<Arc<Event>>,
    ids: std::collections::HashSet<String>,
    tools: HashMap<String, ToolResult>,
    state: HashMap<String, Value>,
}

impl MemoryStore {
    fn with<T>(&self, f: impl FnOnce(&mut HashMap<String, SessionData>) -> T) -> Result<T> {
        let mut g = self
            .inner
            .lock()
            .map_err(|_| Error::store("memory store lock poisoned"))?;
        Ok(f(&mut g))
    }

    fn with_threads<T>(&self, f: impl FnOnce(&mut HashMap<ThreadId, Thread>) -> T) -> Result<T> {
        let mut g = self
            .threads
            .lock()
            .map_err(|_| Error::store("memory store lock poisoned"))?;
        Ok(f(&mut g))
    }

    /// Runs `f` on the session's data, created empty if the session has none yet. The key is
    /// copied only when the session is new: every write goes through here.
    fn with_session<T>(&self, session_id: &str, f: impl FnOnce(&mut SessionData) -> T) -> Result<T> {
        self.with(|m| {
            let s = match m.get_mut(session_id) {
                Some(s) => s,
                None => m.entry(session_id.to_owned()).or_default(),
            };
            f(s)
        })
    }
}

impl MemoryStore {
    /// The session's events numbered above `after` (and any unnumbered ones among the newest),
    /// oldest first: what a writer that has copied the record up to `after` elsewhere still has
    /// to copy. It reads back from the newest event, so a long record costs only what is new
    /// (`load` copies every event).
    ///
    /// ```
    /// use tether::{Event, EventKind, EventStore, MemoryStore};
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let store = MemoryStore::default();
    /// for (seq, id) in [(1, "a"), (2, "b"), (3, "c")] {
    ///     let e = Event::new(id, "demo", serde_json::json!({}), EventKind::Other).with_seq(seq);
    ///     store.append("s", &e).await.unwrap();
    /// }
    /// let new = store.events_after("s", 1).unwrap();
    /// assert_eq!(new.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(), ["b", "c"]);
    /// # })
    /// ```
    pub fn events_after(&self, session_id: &str, after: u64) -> Result<Vec<Arc<Event>>> {
        self.with(|m| {
            let Some(s) = m.get(session_id) else {
                return Vec::new();
            };
            let older = s
                .events
                .iter()
                .rposition(|e| e.seq.is_some_and(|n| n <= after))
                .map_or(0, |i| i + 1);
            s.events[older..].to_vec()
        })
    }

    /// Appends the event `make` gives, unless its id is stored already.
    fn append_arc(&self, session_id: &str, id: &str, make: impl FnOnce() -> Arc<Event>) -> Result<bool> {
        self.with_session(session_id, |s| {
            if !s.ids.insert(id.to_owned()) {
                return false;
            }
            s.events.push(make());
            true
        })
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[async_trait]
impl ThreadStore for MemoryStore {
    async fn claim_thread(
        &self,
        thread: &ThreadId,
        agent: &str,
        new_record: &str,
        title: &str,
    ) -> Result<Claim> {
        self.with_threads(|m| match m.get_mut(thread) {
            Some(t) if t.agent != agent => Claim::Taken(t.clone()),
            Some(t) => {
                t.updated_ms = now_ms().max(t.updated_ms);
                if t.title.is_empty() {
                    t.title = title.to_owned();
                }
                Claim::Claimed {
                    thread: t.clone(),
                    created: false,
                }
            }
            None => {
                let now = now_ms();
                let t = Thread {
                    id: thread.clone(),
                    agent: agent.to_owned(),
                    provider: String::new(),
                    record: new_record.to_owned(),
                    provider_session: None,
                    title: title.to_owned(),
                    created_ms: now,
                    updated_ms: now,
                };
                m.insert(thread.clone(), t.clone());
                Claim::Claimed {
                    thread: t,
                    created: true,
                }
            }
        })
    }

    async fn set_provider_session(&self, thread: &ThreadId, provider: &str, session: &str) -> Result<()> {
        self.with_threads(|m| match m.get_mut(thread) {
            Some(t) => {
                t.provider = provider.to_owned();
                t.provider_session = Some(session.to_owned());
                Ok(())
            }
            None => Err(Error::store(format!("no thread {thread} to record a session on"))),
        })?
    }

    async fn thread(&self, thread: &ThreadId) -> Result<Option<Thread>> {
        self.with_threads(|m| m.get(thread).cloned())
    }

    async fn threads(&self, agent: Option<&str>) -> Result<Vec<Thread>> {
        self.with_threads(|m| {
            let mut v: Vec<Thread> = m
                .values()
                .filter(|t| agent.is_none_or(|a| t.agent == a))
                .cloned()
                .collect();
            v.sort_by(|a, b| b.updated_ms.cmp(&a.updated_ms).then_with(|| a.id.cmp(&b.id)));
            v
        })
    }
}

#[async_trait]
impl EventStore for MemoryStore {
    async fn append(&self, session_id: &str, event: &Event) -> Result<bool> {
        self.append_arc(session_id, &event.id, || Arc::new(event.clone()))
    }

    async fn append_shared(&self, session_id: &str, event: &Arc<Event>) -> Result<bool> {
        self.append_arc(session_id, &event.id, || event.clone())
    }

    async fn load(&self, session_id: &str) -> Result<Vec<Event>> {
        self.with(|m| {
            m.get(session_id)
                .map(|s| s.events.iter().map(|e| Event::clone(e)).collect())
                .unwrap_or_default()
        })
    }

    async fn tool_result(&self, session_id: &str, tool_use_id: &str) -> Result<Option<ToolResult>> {
        self.with(|m| m.get(session_id).and_then(|s| s.tools.get(tool_use_id).cloned()))
    }

    async fn put_tool_result(&self, session_id: &str, result: &ToolResult) -> Result<()> {
        self.with_session(session_id, |s| {
            s.tools
                .entry(result.tool_use_id.clone())
                .or_insert_with(|| result.clone());
        })
    }

    async fn put_tool_result_owned(&self, session_id: &str, result: ToolResult) -> Result<()> {
        // Dropped outside the lock when a result is recorded under its key already.
        let unused = self.with_session(session_id, |s| match s.tools.entry(result.tool_use_id.clone()) {
            std::collections::hash_map::Entry::Occupied(_) => Some(result),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(result);
                None
            }
        })?;
        drop(unused);
        Ok(())
    }

    async fn put_state(&self, session_id: &str, key: &str, value: &Value) -> Result<()> {
        self.with_session(session_id, |s| {
            s.state.insert(key.to_owned(), value.clone());
        })
    }

    async fn put_state_owned(&self, session_id: &str, key: &str, value: Value) -> Result<()> {
        // Dropped outside the lock: the value it replaces can be a whole transcript.
        let old = self.with_session(session_id, |s| s.state.insert(key.to_owned(), value))?;
        drop(old);
        Ok(())
    }

    async fn state(&self, session_id: &str, key: &str) -> Result<Option<Value>> {
        self.with(|m| m.get(session_id).and_then(|s| s.state.get(key).cloned()))
    }

    async fn sessions(&self) -> Result<Vec<String>> {
        self.with(|m| {
            let mut v: Vec<String> = m.keys().cloned().collect();
            v.sort();
            v
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EventKind;

    fn ids(events: &[Arc<Event>]) -> Vec<&str> {
        events.iter().map(|e| e.id.as_str()).collect()
    }

    /// The tail above a sequence number, whatever came before it; unnumbered events among the
    /// newest come with it (a caller checks the numbers), and an unknown session has none.
    #[tokio::test]
    async fn events_after_returns_the_tail_above_a_number() {
        let store = MemoryStore::default();
        let event = |id: &str| Event::new(id, "t", Value::Null, EventKind::Other);
        store.append("s", &event("a").with_seq(1)).await.unwrap();
        store.append("s", &event("b").with_seq(2)).await.unwrap();
        store.append("s", &event("c").with_seq(3)).await.unwrap();
        assert_eq!(ids(&store.events_after("s", 0).unwrap()), ["a", "b", "c"]);
        assert_eq!(ids(&store.events_after("s", 2).unwrap()), ["c"]);
        assert!(store.events_after("s", 3).unwrap().is_empty());
        assert!(store.events_after("s", 9).unwrap().is_empty());
        assert!(store.events_after("other", 0).unwrap().is_empty());
        store.append("s", &event("d")).await.unwrap();
        assert_eq!(ids(&store.events_after("s", 3).unwrap()), ["d"]);
        assert_eq!(ids(&store.events_after("s", 1).unwrap()), ["b", "c", "d"]);
    }
}
