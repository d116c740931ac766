//! `TetherThreads`: the index of an agent's threads (keyed by agent name), for listing them.
//!
//! A thread's record is the state of its own `TetherThread` object, and Restate has no way to
//! list objects through the ingress. So each turn sends its thread here (a one-way call,
//! journaled with the turn: sent once), and the shared `list` handler reads the index. Chosen
//! over Restate's admin SQL (`/query` on the state table) because the admin API is an operator's
//! interface (it needs the admin URL and rights on every tether node, and is not a stable API),
//! while this is an ordinary object behind the ingress every node already calls.

use restate_sdk::prelude::*;
use tether::Thread;

/// The index object (see the module documentation).
#[derive(Debug, Default, Clone, Copy)]
pub struct TetherThreads;

fn key(thread: &Thread) -> String {
    format!("thread:{}", thread.id.as_str())
}

#[restate_sdk::object]
impl TetherThreads {
    /// Adds or updates a thread of the agent (sent by the thread's turn).
    ///
    /// With lazy state: it writes one key and reads none, and Restate would otherwise send the
    /// whole index (every thread of the agent) with each call.
    #[handler(lazy_state)]
    async fn add(&self, ctx: ObjectContext<'_>, thread: Json<Thread>) -> Result<(), HandlerError> {
        let thread = thread.into_inner();
        if thread.agent != ctx.key() {
            return Err(TerminalError::new_with_code(400, "the thread belongs to another agent").into());
        }
        ctx.set(&key(&thread), Json(thread));
        Ok(())
    }

    /// The agent's threads, most recently used first.
    #[handler]
    async fn list(&self, ctx: SharedObjectContext<'_>) -> Result<Json<Vec<Thread>>, HandlerError> {
        let mut threads = Vec::new();
        for k in ctx.get_keys().await? {
            if !k.starts_with("thread:") {
                continue;
            }
            if let Some(Json(t)) = ctx.get::<Json<Thread>>(&k).await? {
                threads.push(t);
            }
        }
        threads.sort_by(|a: &Thread, b: &Thread| {
            b.updated_ms
                .cmp(&a.updated_ms)
                .then_with(|| a.id.as_str().cmp(b.id.as_str()))
        });
        Ok(Json(threads))
    }
}
