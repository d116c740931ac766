//! [`RetryPolicy`]: the one retry policy every provider uses, with an injectable sleep.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};

/// Waits for a duration. Injected so tests run instantly and can assert the delays chosen.
pub trait Sleeper: Send + Sync + 'static {
    /// A future that completes after `d`.
    fn sleep(&self, d: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// Sleeps with tokio's timer.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioSleeper;

impl Sleeper for TokioSleeper {
    fn sleep(&self, d: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(tokio::time::sleep(d))
    }
}

/// Returns at once and records every requested delay: for tests.
#[derive(Debug, Clone, Default)]
pub struct RecordingSleeper {
    slept: Arc<Mutex<Vec<Duration>>>,
}

impl RecordingSleeper {
    /// The delays requested so far.
    pub fn slept(&self) -> Vec<Duration> {
        self.slept.lock().map(|g| g.clone()).unwrap_or_default()
    }
}

impl Sleeper for RecordingSleeper {
    fn sleep(&self, d: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        if let Ok(mut g) = self.slept.lock() {
            g.push(d);
        }
        Box::pin(async {})
    }
}

/// How transient failures are retried, for every provider.
///
/// Transient is [`Error::is_transient`]: 408, 409, 429 (not quota exhaustion), 5xx, 529 and
/// transport failures. The delay is the server's `retry-after-ms` / `retry-after` when given and
/// within [`RetryPolicy::retry_after_cap`] (a longer requested delay is not retried at all), else
/// exponential backoff `base · 2^n` capped at `max_backoff`, with up to 25 % jitter subtracted.
#[derive(Clone)]
pub struct RetryPolicy {
    /// Retries after the first attempt (default 3).
    pub max_retries: u32,
    /// The first backoff (default 500 ms).
    pub base: Duration,
    /// The largest backoff (default 8 s).
    pub max_backoff: Duration,
    /// The largest server-requested delay honoured (default 120 s).
    pub retry_after_cap: Duration,
    /// Whether to subtract jitter (default true).
    pub jitter: bool,
    /// The sleep used between attempts.
    pub sleeper: Arc<dyn Sleeper>,
}

impl std::fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("max_retries", &self.max_retries)
            .field("base", &self.base)
            .field("max_backoff", &self.max_backoff)
            .field("retry_after_cap", &self.retry_after_cap)
            .field("jitter", &self.jitter)
            .finish()
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_retries: 3,
            base: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
            retry_after_cap: Duration::from_secs(120),
            jitter: true,
            sleeper: Arc::new(TokioSleeper),
        }
    }
}

impl RetryPolicy {
    /// A policy that never retries.
    pub fn none() -> Self {
        RetryPolicy {
            max_retries: 0,
            ..Default::default()
        }
    }

    /// The same policy with another sleeper (tests inject [`RecordingSleeper`]).
    pub fn with_sleeper(mut self, sleeper: impl Sleeper) -> Self {
        self.sleeper = Arc::new(sleeper);
        self
    }

    /// The same policy with another retry count.
    pub fn with_max_retries(mut self, n: u32) -> Self {
        self.max_retries = n;
        self
    }

    /// The delay before retry number `retries_so_far + 1` after `err`, or `None` to give up.
    pub fn delay_for(&self, err: &Error, retries_so_far: u32) -> Option<Duration> {
        if retries_so_far >= self.max_retries || !err.is_transient() {
            return None;
        }
        if let Some(ra) = err.retry_after() {
            if ra > self.retry_after_cap {
                return None;
            }
            if !ra.is_zero() {
                return Some(ra);
            }
        }
        let exp = self
            .base
            .saturating_mul(1u32.checked_shl(retries_so_far.min(20)).unwrap_or(u32::MAX));
        let d = exp.min(self.max_backoff);
        if self.jitter {
            let u: f64 = rand::random::<f64>();
            Some(d.mul_f64(1.0 - 0.25 * u))
        } else {
            Some(d)
        }
    }

    /// Runs `op` until it succeeds, fails for good, or the retries are used up.
    ///
    /// `on_retry(attempt, &err, delay)` is called before each wait (1-based attempt that failed).
    pub async fn run<T, F, Fut>(
        &self,
        mut op: F,
        mut on_retry: impl FnMut(u32, &Error, Duration),
    ) -> Result<T>
    where
        F: FnMut(u32) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let mut retries = 0u32;
        loop {
            match op(retries + 1).await {
                Ok(v) => return Ok(v),
                Err(e) => match self.delay_for(&e, retries) {
                    Some(d) => {
                        tracing::warn!(attempt = retries + 1, delay_ms = d.as_millis() as u64, error = %e, "retrying");
                        on_retry(retries + 1, &e, d);
                        self.sleeper.sleep(d).await;
                        retries += 1;
                    }
                    None => return Err(e),
                },
            }
        }
    }
}

/// Parses a `retry-after-ms` or `retry-after` header value into a delay.
///
/// `retry-after-ms` is milliseconds; `retry-after` is seconds (fractions allowed). HTTP dates
/// are not supported and yield `None` (the policy then falls back to backoff).
pub fn parse_retry_after(ms: Option<&str>, secs: Option<&str>) -> Option<Duration> {
    if let Some(v) = ms.and_then(|s| s.trim().parse::<f64>().ok())
        && v.is_finite()
        && v >= 0.0
    {
        return Some(Duration::from_secs_f64(v / 1000.0));
    }
    if let Some(v) = secs.and_then(|s| s.trim().parse::<f64>().ok())
        && v.is_finite()
        && v >= 0.0
    {
        return Some(Duration::from_secs_f64(v));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TransportKind;

    fn e500() -> Error {
        Error::Http {
            status: 500,
            message: "boom".into(),
            code: None,
            retry_after: None,
            should_retry: None,
            endpoint: "t".into(),
        }
    }

    #[tokio::test]
    async fn backs_off_exponentially_then_gives_up() {
        let s = RecordingSleeper::default();
        let p = RetryPolicy {
            jitter: false,
            ..RetryPolicy::default().with_sleeper(s.clone())
        };
        let mut calls = 0;
        let r: Result<()> = p
            .run(
                |_| {
                    calls += 1;
                    async { Err(e500()) }
                },
                |_, _, _| {},
            )
            .await;
        assert!(r.is_err());
        assert_eq!(calls, 4);
        assert_eq!(
            s.slept(),
            vec![
                Duration::from_millis(500),
                Duration::from_millis(1000),
                Duration::from_millis(2000)
            ]
        );
    }

    #[tokio::test]
    async fn honours_retry_after_within_the_cap() {
        let p = RetryPolicy::default();
        let mut e = e500();
        if let Error::Http { retry_after, .. } = &mut e {
            *retry_after = Some(Duration::from_millis(1500));
        }
        assert_eq!(p.delay_for(&e, 0), Some(Duration::from_millis(1500)));
        if let Error::Http { retry_after, .. } = &mut e {
            *retry_after = Some(Duration::from_secs(500));
        }
        assert_eq!(p.delay_for(&e, 0), None);
    }

    #[tokio::test]
    async fn jitter_stays_within_a_quarter() {
        let p = RetryPolicy::default();
        let e = Error::Transport {
            kind: TransportKind::Reset,
            message: String::new(),
            endpoint: String::new(),
        };
        for _ in 0..100 {
            let d = p.delay_for(&e, 2).unwrap_or_default();
            assert!(
                d <= Duration::from_secs(2) && d >= Duration::from_millis(1500),
                "{d:?}"
            );
        }
    }

    #[test]
    fn parses_retry_after_headers() {
        assert_eq!(
            parse_retry_after(Some("250"), Some("9")),
            Some(Duration::from_millis(250))
        );
        assert_eq!(
            parse_retry_after(None, Some("1.5")),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(
            parse_retry_after(None, Some("Wed, 21 Oct 2015 07:28:00 GMT")),
            None
        );
    }
}
