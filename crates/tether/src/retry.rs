//! [`RetryPolicy`]: the one retry policy every provider uses, with an injectable sleep.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
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

/// How transient failures are retried, for every provider.
///
/// Transient is [`Error::is_transient`]: 408, 409, 429 (not quota exhaustion), 5xx, 529 and
/// transport failures. The delay is the server's `retry-after-ms` / `retry-after` when given and
/// within [`RetryPolicy::retry_after_cap`] (a longer requested delay is not retried at all), else
/// exponential backoff `base · 2^n` capped at `max_backoff`, with up to 25 % jitter subtracted.
#[derive(Clone)]
#[non_exhaustive]
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

    /// The same policy with another sleeper (tests inject `RecordingSleeper`, feature `test-util`).
    pub fn with_sleeper(mut self, sleeper: impl Sleeper) -> Self {
        self.sleeper = Arc::new(sleeper);
        self
    }

    /// The same policy with another retry count.
    pub fn with_max_retries(mut self, n: u32) -> Self {
        self.max_retries = n;
        self
    }

    /// The same policy with another first backoff and largest backoff.
    pub fn with_backoff(mut self, base: Duration, max_backoff: Duration) -> Self {
        self.base = base;
        self.max_backoff = max_backoff;
        self
    }

    /// The same policy honouring server-requested delays up to `cap`.
    pub fn with_retry_after_cap(mut self, cap: Duration) -> Self {
        self.retry_after_cap = cap;
        self
    }

    /// The same policy with jitter on or off.
    pub fn with_jitter(mut self, jitter: bool) -> Self {
        self.jitter = jitter;
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

/// The longest delay [`parse_retry_after`] reports (24 hours): a header asking for more (up to
/// `1e20` seconds, or infinity) reads as this. Any [`RetryPolicy::retry_after_cap`] below it then
/// declines to retry, which is what such a header means; no value a server sends can overflow a
/// [`Duration`] or panic.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 60 * 60);

/// Parses a `retry-after-ms` or `retry-after` header value into a delay.
///
/// `retry-after-ms` is milliseconds; `retry-after` is seconds (fractions allowed) or an HTTP
/// date (RFC 9110: `Wed, 21 Oct 2026 07:28:00 GMT`, and the obsolete RFC 850 and asctime forms),
/// read as the time from now until then (a date already past is a zero delay, which
/// [`RetryPolicy::delay_for`] takes as no hint: backoff applies). Values are read
/// with bounds, since they come from the server: negative, NaN or unparsable values are ignored
/// (the other header, then backoff, applies), and anything above [`MAX_RETRY_AFTER`] (infinity
/// and far dates included) is [`MAX_RETRY_AFTER`].
///
/// ```
/// use std::time::Duration;
/// use tether::retry::parse_retry_after;
/// assert_eq!(parse_retry_after(None, Some("2")), Some(Duration::from_secs(2)));
/// assert_eq!(parse_retry_after(Some("250"), Some("9")), Some(Duration::from_millis(250)));
/// // A date in the past: retry now.
/// assert_eq!(parse_retry_after(None, Some("Sun, 06 Nov 1994 08:49:37 GMT")), Some(Duration::ZERO));
/// assert_eq!(parse_retry_after(None, Some("soon")), None);
/// ```
pub fn parse_retry_after(ms: Option<&str>, secs: Option<&str>) -> Option<Duration> {
    retry_after_at(ms, secs, std::time::SystemTime::now())
}

/// [`parse_retry_after`] with `now` given (an HTTP date is read against it).
fn retry_after_at(ms: Option<&str>, secs: Option<&str>, now: std::time::SystemTime) -> Option<Duration> {
    if let Some(d) = ms.and_then(|s| bounded_secs(s, 1000.0)) {
        return Some(d);
    }
    let s = secs?;
    bounded_secs(s, 1.0).or_else(|| http_date_delay(s, now))
}

/// The delay from `now` until the HTTP date `s` (zero when it is past), at most
/// [`MAX_RETRY_AFTER`]; `None` when `s` is not an HTTP date. `httpdate` is the parser hyper
/// uses; it takes only the three forms RFC 9110 names, in GMT, and never panics on input.
fn http_date_delay(s: &str, now: std::time::SystemTime) -> Option<Duration> {
    // A date is 24 to 30 characters; a longer value is not one (and is not parsed).
    let s = s.trim();
    if s.len() > 64 {
        return None;
    }
    let at = httpdate::parse_http_date(s).ok()?;
    Some(
        at.duration_since(now)
            .unwrap_or(Duration::ZERO)
            .min(MAX_RETRY_AFTER),
    )
}

/// `s` as a number of `1/per_sec` seconds, clamped to [`MAX_RETRY_AFTER`]; `None` when it is not
/// a number, negative or NaN.
fn bounded_secs(s: &str, per_sec: f64) -> Option<Duration> {
    let v = s.trim().parse::<f64>().ok()?;
    if v.is_nan() || v < 0.0 {
        return None;
    }
    let secs = v / per_sec;
    if secs >= MAX_RETRY_AFTER.as_secs_f64() {
        return Some(MAX_RETRY_AFTER);
    }
    Duration::try_from_secs_f64(secs)
        .ok()
        .map(|d| d.min(MAX_RETRY_AFTER))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TransportKind;
    use crate::testing::RecordingSleeper;

    #[test]
    fn retry_after_reads_http_dates_against_now() {
        use std::time::{SystemTime, UNIX_EPOCH};
        // Sun, 06 Nov 1994 08:49:37 GMT, in the three forms RFC 9110 names.
        let date = UNIX_EPOCH + Duration::from_secs(784_111_777);
        let forms = [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
        ];
        for f in forms {
            let before = date - Duration::from_secs(30);
            assert_eq!(
                retry_after_at(None, Some(f), before),
                Some(Duration::from_secs(30)),
                "{f}"
            );
            // A date already past: retry now.
            assert_eq!(
                retry_after_at(None, Some(f), date + Duration::from_secs(5)),
                Some(Duration::ZERO)
            );
        }
        // A far date is the cap; retry-after-ms still wins; what is not a date is ignored.
        assert_eq!(
            retry_after_at(None, Some("Sun, 06 Nov 1994 08:49:37 GMT"), UNIX_EPOCH),
            Some(MAX_RETRY_AFTER)
        );
        assert_eq!(
            retry_after_at(Some("250"), Some("Sun, 06 Nov 1994 08:49:37 GMT"), UNIX_EPOCH),
            Some(Duration::from_millis(250))
        );
        for bad in [
            "",
            "soon",
            "Sun, 06 Nov 1994 08:49:37 CET",
            "Sun, 32 Nov 1994 08:49:37 GMT",
            &"x".repeat(10_000),
        ] {
            assert_eq!(
                retry_after_at(None, Some(bad), SystemTime::now()),
                None,
                "{bad:.40}"
            );
        }
    }

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
        let e = Error::transport(TransportKind::Reset, String::new(), String::new());
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
        // An HTTP date already past (2015): retry now.
        assert_eq!(
            parse_retry_after(None, Some("Wed, 21 Oct 2015 07:28:00 GMT")),
            Some(Duration::ZERO)
        );
    }

    /// `Duration::from_secs_f64(1e20)` panics: a hostile `retry-after` used to take the process
    /// down. Huge values read as the maximum, which the policy's cap then declines to wait for.
    #[test]
    fn hostile_retry_after_values_are_bounded() {
        for v in ["1e20", "1e400", "inf", "+inf", "18446744073709551616", "1e19"] {
            assert_eq!(parse_retry_after(None, Some(v)), Some(MAX_RETRY_AFTER), "{v}");
            assert_eq!(parse_retry_after(Some(v), None), Some(MAX_RETRY_AFTER), "{v} ms");
        }
        for v in ["-1", "NaN", "-inf", "nan", "", "  ", "1,5", "0x10"] {
            assert_eq!(parse_retry_after(None, Some(v)), None, "{v}");
        }
        // An invalid ms header falls back to the seconds one.
        assert_eq!(
            parse_retry_after(Some("NaN"), Some("2")),
            Some(Duration::from_secs(2))
        );
        assert_eq!(parse_retry_after(None, Some("-0")), Some(Duration::ZERO));
        let e = Error::Http {
            status: 429,
            message: String::new(),
            code: None,
            retry_after: parse_retry_after(None, Some("1e20")),
            should_retry: None,
            endpoint: "t".into(),
        };
        assert_eq!(
            RetryPolicy::default().delay_for(&e, 0),
            None,
            "too long to wait for"
        );
    }

    proptest::proptest! {
        /// Whatever a server sends in either header, parsing never panics and the delay is
        /// bounded; a delay the policy chooses from it is bounded by its caps.
        #[test]
        fn any_retry_after_header_is_bounded(ms in proptest::option::of(".{0,40}"), secs in proptest::option::of(".{0,40}")) {
            let d = parse_retry_after(ms.as_deref(), secs.as_deref());
            proptest::prop_assert!(d.is_none_or(|d| d <= MAX_RETRY_AFTER));
            let e = Error::Http { status: 503, message: String::new(), code: None, retry_after: d, should_retry: None, endpoint: "t".into() };
            let p = RetryPolicy::default();
            if let Some(w) = p.delay_for(&e, 0) {
                proptest::prop_assert!(w <= p.retry_after_cap.max(p.max_backoff));
            }
        }

        /// Numbers in every notation (huge, tiny, negative, exponents) never panic.
        #[test]
        fn any_number_is_bounded(v in proptest::num::f64::ANY, exp in -400i32..400) {
            for s in [v.to_string(), format!("{v:e}"), format!("1e{exp}"), format!("{}e{exp}", v.abs())] {
                let d = parse_retry_after(Some(&s), Some(&s));
                proptest::prop_assert!(d.is_none_or(|d| d <= MAX_RETRY_AFTER), "{}", s);
            }
        }
    }
}
