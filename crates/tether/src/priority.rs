//! First output first: runs still waiting for their first output go before the streams of runs
//! already answering.
//!
//! A server that takes many runs at once spends its CPU on two kinds of work: starting runs
//! (reading the request, claiming the thread, sending the model request, relaying the first
//! piece of the answer) and streaming the runs already answering. Served in arrival order, a
//! burst of new runs waits behind every delta of the streams before it, and the last run's first
//! word comes at the end of the whole load. A [`Priority`] reorders that work: while any run
//! holds a [`Starting`] guard, a session that paces on the priority
//! ([`crate::SessionBuilder::priority`]) waits after each model delta it delivers, up to the
//! priority's hold, before it reads its model's stream again.
//!
//! Nothing is lost or reordered within a run: the model's output waits in the connection, and the
//! next read takes everything that arrived (a local loop's model merges one read into one delta,
//! so a paced stream costs fewer, larger events). The hold bounds what a streaming run can be
//! delayed by: one hold per delta, however many runs keep starting; a model that writes slower
//! than one read per hold is never slowed at all.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::time::Duration;
//! use tether::priority::Priority;
//!
//! let priority = Priority::new(Duration::from_millis(20));
//! // Nobody is starting: a stream goes on at once.
//! priority.pace().await;
//! let starting = priority.starting();
//! assert_eq!(priority.waiting(), 1);
//! // The run's first output went out: the streams go on.
//! drop(starting);
//! assert_eq!(priority.waiting(), 0);
//! # }
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// Shared by the runs of one server (clone it; clones are the same priority): counts the runs
/// waiting for their first output and holds the streams of the others while any does. See the
/// [module documentation](self).
#[derive(Clone)]
pub struct Priority {
    inner: Arc<Inner>,
}

struct Inner {
    /// Runs holding a [`Starting`] guard.
    starting: AtomicUsize,
    /// Woken when `starting` drops to zero.
    idle: Notify,
    /// The longest a stream waits in one [`Priority::pace`].
    hold: Duration,
}

impl std::fmt::Debug for Priority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Priority")
            .field("starting", &self.waiting())
            .field("hold", &self.inner.hold)
            .finish()
    }
}

impl Priority {
    /// A priority whose streams wait at most `hold` per delivered delta while runs are starting.
    pub fn new(hold: Duration) -> Self {
        Priority {
            inner: Arc::new(Inner {
                starting: AtomicUsize::new(0),
                idle: Notify::new(),
                hold,
            }),
        }
    }

    /// The most a stream waits in one [`Priority::pace`].
    pub fn hold(&self) -> Duration {
        self.inner.hold
    }

    /// Marks a run as waiting for its first output until the guard is dropped: drop it when
    /// the run's first output has gone out (or the run ends without any).
    pub fn starting(&self) -> Starting {
        self.inner.starting.fetch_add(1, Ordering::AcqRel);
        Starting {
            inner: self.inner.clone(),
        }
    }

    /// How many runs are waiting for their first output now.
    pub fn waiting(&self) -> usize {
        self.inner.starting.load(Ordering::Acquire)
    }

    /// Waits while any run is starting, at most the hold; returns at once when none is.
    ///
    /// Cancel safe: it only waits.
    pub async fn pace(&self) {
        if self.waiting() == 0 {
            return;
        }
        let wait = async {
            loop {
                let idle = self.inner.idle.notified();
                tokio::pin!(idle);
                // Registered before the count is read again: a guard dropped in between wakes it.
                idle.as_mut().enable();
                if self.waiting() == 0 {
                    return;
                }
                idle.await;
            }
        };
        let _ = tokio::time::timeout(self.inner.hold, wait).await;
    }
}

/// A run waiting for its first output ([`Priority::starting`]); dropping it ends the wait of
/// the streams once no other run is starting.
#[must_use = "the run counts as starting until the guard is dropped"]
pub struct Starting {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Starting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Starting")
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        if self.inner.starting.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.inner.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_stream_waits_while_a_run_starts_and_goes_on_when_it_has_output() {
        let p = Priority::new(Duration::from_secs(1));
        let starting = p.starting();
        let paced = tokio::spawn({
            let p = p.clone();
            async move { p.pace().await }
        });
        // Time does not move on its own here (paused): the stream waits for the run.
        tokio::task::yield_now().await;
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(
            !paced.is_finished(),
            "the stream went on while a run was starting"
        );
        let before = tokio::time::Instant::now();
        drop(starting);
        paced.await.unwrap();
        assert_eq!(
            tokio::time::Instant::now(),
            before,
            "released by the guard, not the hold"
        );
        assert_eq!(p.waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_waits_no_longer_than_the_hold() {
        let p = Priority::new(Duration::from_millis(20));
        let _starting = p.starting();
        let t0 = tokio::time::Instant::now();
        p.pace().await;
        assert_eq!(t0.elapsed(), Duration::from_millis(20));
    }

    #[tokio::test(start_paused = true)]
    async fn it_waits_until_every_starting_run_has_output() {
        let p = Priority::new(Duration::from_secs(10));
        let (a, b) = (p.starting(), p.starting());
        let paced = tokio::spawn({
            let p = p.clone();
            async move { p.pace().await }
        });
        tokio::task::yield_now().await;
        drop(a);
        tokio::task::yield_now().await;
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!paced.is_finished(), "one run still starting");
        drop(b);
        paced.await.unwrap();
    }

    #[tokio::test]
    async fn with_nobody_starting_it_does_not_wait() {
        let p = Priority::new(Duration::from_secs(3600));
        tokio::time::timeout(Duration::from_secs(5), p.pace())
            .await
            .expect("pace returned at once");
    }
}
