//! Per-thread fan-out of what a turn sends out of band in one process ([`ThreadHub`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tether::ThreadId;
use tokio::sync::broadcast;

/// A broadcast channel per thread: a turn's live events (or signals) reach only the relays of
/// their own thread.
///
/// Why: with one channel for all threads every relay received every thread's events, so N
/// concurrent runs cost N² receives, and at 1,000 concurrent runs of the serve bench the relays
/// fell more than the channel's capacity behind (`STREAM_LAGGED`, nearly every run). Here each
/// relay reads its own thread's events only.
///
/// A thread's channel is made by its first subscriber; sending to a thread nobody subscribed to
/// drops the message (the record holds every durable event anyway), and channels whose
/// subscribers are all gone are dropped as the map grows.
pub struct ThreadHub<T> {
    inner: Arc<Mutex<Channels<T>>>,
    capacity: usize,
}

struct Channels<T> {
    by_thread: HashMap<ThreadId, broadcast::Sender<T>>,
    /// When the map reaches this size, channels without subscribers are dropped.
    prune_at: usize,
}

impl<T> Clone for ThreadHub<T> {
    fn clone(&self) -> Self {
        ThreadHub {
            inner: self.inner.clone(),
            capacity: self.capacity,
        }
    }
}

/// The map's size at which the first pruning happens.
const PRUNE_FIRST: usize = 64;

impl<T: Clone> ThreadHub<T> {
    /// A hub whose per-thread channels hold `capacity` messages (at least 1) for their slowest
    /// subscriber; one that falls further behind gets `Lagged`.
    pub fn new(capacity: usize) -> Self {
        ThreadHub {
            inner: Arc::new(Mutex::new(Channels {
                by_thread: HashMap::new(),
                prune_at: PRUNE_FIRST,
            })),
            capacity: capacity.max(1),
        }
    }

    fn channels(&self) -> std::sync::MutexGuard<'_, Channels<T>> {
        // A panic while the lock was held leaves the map consistent (every operation on it is a
        // single insert, get or retain), so a poisoned lock is used as is.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A receiver of what is sent to `thread` from now on.
    pub fn subscribe(&self, thread: &ThreadId) -> broadcast::Receiver<T> {
        let mut c = self.channels();
        if let Some(tx) = c.by_thread.get(thread) {
            return tx.subscribe();
        }
        if c.by_thread.len() >= c.prune_at {
            c.by_thread.retain(|_, tx| tx.receiver_count() > 0);
            c.prune_at = (c.by_thread.len() * 2).max(PRUNE_FIRST);
        }
        let (tx, rx) = broadcast::channel(self.capacity);
        c.by_thread.insert(thread.clone(), tx);
        rx
    }

    /// Sends `msg` to `thread`'s subscribers, if any.
    pub fn send(&self, thread: &ThreadId, msg: T) {
        let mut c = self.channels();
        let gone = match c.by_thread.get(thread) {
            Some(tx) => tx.send(msg).is_err(),
            None => false,
        };
        if gone {
            c.by_thread.remove(thread);
        }
    }

    /// How many threads have a channel (for tests).
    pub fn threads(&self) -> usize {
        self.channels().by_thread.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> ThreadId {
        ThreadId::new(s).expect("a thread id")
    }

    #[test]
    fn a_subscriber_gets_only_its_threads_messages() {
        let hub = ThreadHub::new(8);
        let mut a = hub.subscribe(&id("a"));
        let mut b = hub.subscribe(&id("b"));
        hub.send(&id("a"), 1);
        hub.send(&id("b"), 2);
        hub.send(&id("c"), 3);
        hub.send(&id("a"), 4);
        assert_eq!(a.try_recv().ok(), Some(1));
        assert_eq!(a.try_recv().ok(), Some(4));
        assert!(a.try_recv().is_err());
        assert_eq!(b.try_recv().ok(), Some(2));
        assert!(b.try_recv().is_err());
        // Nobody subscribed to c: no channel was made for it.
        assert_eq!(hub.threads(), 2);
    }

    #[test]
    fn channels_without_subscribers_are_dropped() {
        let hub = ThreadHub::<u32>::new(4);
        let rx = hub.subscribe(&id("kept"));
        drop(hub.subscribe(&id("gone")));
        // A send to a thread whose subscribers left drops its channel.
        hub.send(&id("gone"), 1);
        assert_eq!(hub.threads(), 1);
        // Channels whose subscribers left without a send are pruned as the map grows.
        for i in 0..200 {
            drop(hub.subscribe(&id(&format!("t{i}"))));
        }
        assert!(hub.threads() < 100, "{} channels kept", hub.threads());
        hub.send(&id("kept"), 7);
        let mut rx = rx;
        assert_eq!(rx.try_recv().ok(), Some(7));
    }

    #[test]
    fn a_slow_subscriber_lags_on_its_own_threads_messages_only() {
        let hub = ThreadHub::new(2);
        let mut slow = hub.subscribe(&id("slow"));
        let _other = hub.subscribe(&id("busy"));
        for i in 0..100 {
            hub.send(&id("busy"), i);
        }
        hub.send(&id("slow"), 1000);
        assert_eq!(
            slow.try_recv().ok(),
            Some(1000),
            "other threads' traffic made it lag"
        );
    }
}
