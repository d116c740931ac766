//! Concurrency: 1,000 sessions streaming at once (200 paced deltas each) from one in-process
//! `FakeOpenAi`. Prints resident memory per session (VmRSS peak during the run minus VmRSS
//! before; the fake server's connections are in the same process and counted too) and the
//! delay a delta spends between the server writing it and a subscriber receiving it (each delta's
//! text is the server's send time), as p50 / p99 / max.
//!
//! Run: `cargo bench -p tether-openai --bench concurrent`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tether::local::LocalLoop;
use tether::{ChatModel, EventKind, RetryPolicy, Session};
use tether_openai::OpenAiModel;
use tether_testkit::openai::{FakeOpenAi, Reply};

const SESSIONS: usize = 1_000;
const DELTAS: usize = 200;
const PACE: Duration = Duration::from_millis(50);

fn vm_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

async fn one(model: Arc<dyn ChatModel>) -> Vec<u64> {
    let provider = LocalLoop::with_model(model).retry(RetryPolicy::none());
    let mut session = Session::builder(provider).open().await.expect("open");
    let mut rx = session.sink().subscribe(1024).await;
    let sub = tokio::spawn(async move {
        let mut delays = Vec::with_capacity(DELTAS);
        while let Some(e) = rx.recv().await {
            if let EventKind::TextDelta { delta, .. } = &e.kind {
                let now = now_us();
                if let Some(t) = delta.strip_prefix('t').and_then(|d| d.strip_suffix(';'))
                    && let Ok(t) = t.parse::<u64>()
                {
                    delays.push(now.saturating_sub(t));
                }
            }
        }
        delays
    });
    session.send("go").await.expect("send");
    drop(session);
    sub.await.expect("subscriber")
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let fake = FakeOpenAi::start().await;
        let model: Arc<dyn ChatModel> = Arc::new(
            OpenAiModel::builder(fake.url())
                .model("bench")
                .build()
                .expect("model"),
        );
        // Warm up: a few sessions, so the runtime, allocator and TLS-free client are initialised.
        fake.push_all((0..4).map(|_| Reply::stamped_text(10)));
        for _ in 0..4 {
            one(model.clone()).await;
        }
        let before = vm_rss_kib();
        let peak = Arc::new(AtomicU64::new(before));
        let stop = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (peak, stop) = (peak.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    peak.fetch_max(vm_rss_kib(), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };
        fake.push_all((0..SESSIONS).map(|_| Reply::stamped_text(DELTAS).pace(PACE)));
        let t = Instant::now();
        let tasks: Vec<_> = (0..SESSIONS).map(|_| tokio::spawn(one(model.clone()))).collect();
        let mut delays = Vec::with_capacity(SESSIONS * DELTAS);
        for task in tasks {
            delays.extend(task.await.expect("session"));
        }
        let elapsed = t.elapsed();
        stop.store(true, Ordering::Relaxed);
        let _ = sampler.await;
        let after = vm_rss_kib();
        let peak = peak.load(Ordering::Relaxed).max(after);
        assert_eq!(delays.len(), SESSIONS * DELTAS, "every delta delivered");
        delays.sort_unstable();
        let q = |p: f64| delays[((delays.len() as f64 * p) as usize).min(delays.len() - 1)];
        println!(
            "concurrent: {SESSIONS} sessions x {DELTAS} deltas (one every {PACE:?} per stream), wall {elapsed:.2?}"
        );
        println!(
            "  VmRSS before {before} KiB, peak {peak} KiB, after {after} KiB => {:.1} KiB per session (peak - before)",
            (peak.saturating_sub(before)) as f64 / SESSIONS as f64
        );
        println!(
            "  server-write -> subscriber delay: p50 {} us, p99 {} us, max {} us",
            q(0.50),
            q(0.99),
            delays[delays.len() - 1]
        );
    });
}
