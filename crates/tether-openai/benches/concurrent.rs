//! Concurrency: 1,000 sessions streaming at once (200 paced deltas each) from a `FakeOpenAi` run
//! in a **separate process** (this same binary, re-executed with `TETHER_BENCH_FAKE_SERVER` set),
//! so the client's figures exclude the server's connections, tasks and buffers.
//!
//! Prints:
//! - resident memory per session: VmRSS of the tether process at its peak during the run minus
//!   before it (every measuring buffer is allocated and touched before the "before" sample), and
//!   the same for the server process, labelled apart;
//! - the delay a delta spends inside tether: from the instant `OpenAiModel` received the network
//!   read carrying it (before line splitting and parsing; `tether_openai::probe`, feature
//!   `bench-probe`) to the instant the subscriber's `recv` returned the event carrying it, as
//!   p50 / p99 / max;
//! - for comparison, server write → subscriber (each delta's text is the server's send time, so
//!   this includes the fake server, loopback TCP and scheduling between the two processes).
//!
//! Pacing: one delta every 50 ms per stream (~20 tokens/s, a realistic model speed), the 1,000
//! sessions started evenly over one 50 ms period, so the load is a steady ~20,000 deltas/s
//! rather than bursts of 1,000 deltas at once (sessions of real users are not in phase).
//!
//! Run: `cargo bench -p tether-openai --features bench-probe --bench concurrent`.

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tether::local::LocalLoop;
use tether::{ChatModel, EventKind, RetryPolicy, Session};
use tether_openai::OpenAiModel;
use tether_testkit::openai::{FakeOpenAi, Reply};

const SESSIONS: usize = 1_000;
const DELTAS: usize = 200;
const PACE: Duration = Duration::from_millis(50);
const WARMUP: usize = 4;
const SERVER_ENV: &str = "TETHER_BENCH_FAKE_SERVER";

fn vm_rss_kib(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
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

/// The stamps (`t<micros>;`) in a piece of text.
fn stamps(text: &str) -> impl Iterator<Item = u64> + '_ {
    text.split(';')
        .filter_map(|s| s.strip_prefix('t'))
        .filter_map(|s| s.parse().ok())
}

/// The server process: a FakeOpenAi with the whole script, its URL on stdout, until stdin closes.
fn serve() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("server runtime");
    rt.block_on(async {
        let fake = FakeOpenAi::start().await;
        fake.push_all((0..WARMUP).map(|_| Reply::stamped_text(10)));
        fake.push_all((0..SESSIONS).map(|_| Reply::stamped_text(DELTAS).pace(PACE)));
        println!("{}", fake.url());
        std::io::stdout().flush().expect("flush");
        // Until the bench closes our stdin.
        tokio::task::spawn_blocking(|| {
            let mut sink = String::new();
            while std::io::stdin()
                .lock()
                .read_line(&mut sink)
                .map(|n| n > 0)
                .unwrap_or(false)
            {}
        })
        .await
        .expect("stdin");
        drop(fake);
    });
}

/// One session; `out` gets (stamp, instant the subscriber received it) for each delta.
async fn one(model: Arc<dyn ChatModel>, mut out: Vec<(u64, Instant, u64)>) -> Vec<(u64, Instant, u64)> {
    let provider = LocalLoop::with_model(model).retry(RetryPolicy::none());
    let mut session = Session::builder(provider).open().await.expect("open");
    let mut rx = session.sink().subscribe(1024).await;
    let sub = tokio::spawn(async move {
        while let Some(e) = rx.recv().await {
            let at = Instant::now();
            if let EventKind::TextDelta { delta, .. } = &e.kind {
                let wall = now_us();
                for s in stamps(delta) {
                    out.push((s, at, wall));
                }
            }
        }
        out
    });
    session.send("go").await.expect("send");
    drop(session);
    sub.await.expect("subscriber")
}

fn quantiles(v: &mut [u64]) -> (u64, u64, u64) {
    v.sort_unstable();
    let q = |p: f64| v[((v.len() as f64 * p) as usize).min(v.len() - 1)];
    (q(0.50), q(0.99), v[v.len() - 1])
}

fn main() {
    if std::env::var_os(SERVER_ENV).is_some() {
        return serve();
    }
    // Cargo passes `--bench`; ignore arguments.
    let mut server = Command::new(std::env::current_exe().expect("current exe"))
        .env(SERVER_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the fake server process");
    let server_pid = server.id().to_string();
    let mut url = String::new();
    std::io::BufReader::new(server.stdout.take().expect("server stdout"))
        .read_line(&mut url)
        .expect("server url");
    let url = url.trim().to_owned();

    // Measuring buffers, allocated and touched now so they are in the "before" sample.
    let arrivals: Arc<Mutex<Vec<(u64, Instant)>>> = {
        let n = SESSIONS * DELTAS + WARMUP * 10;
        let mut v = vec![(0, Instant::now()); n];
        v.clear();
        Arc::new(Mutex::new(v))
    };
    let per_session: Vec<Vec<(u64, Instant, u64)>> = (0..SESSIONS)
        .map(|_| {
            let mut v = vec![(0, Instant::now(), 0); DELTAS];
            v.clear();
            v
        })
        .collect();
    {
        let arrivals = arrivals.clone();
        tether_openai::probe::install(move |text, at| {
            if let Ok(mut a) = arrivals.lock() {
                a.extend(stamps(text).map(|s| (s, at)));
            }
        });
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let model: Arc<dyn ChatModel> =
            Arc::new(OpenAiModel::builder(&url).model("bench").build().expect("model"));
        // Warm up: a few sessions, so the runtime, allocator and client are initialised.
        for _ in 0..WARMUP {
            one(model.clone(), Vec::with_capacity(10)).await;
        }
        let (before, server_before) = (vm_rss_kib("self"), vm_rss_kib(&server_pid));
        let peaks = Arc::new(Mutex::new((before, server_before)));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sampler = {
            let (peaks, stop, pid) = (peaks.clone(), stop.clone(), server_pid.clone());
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let (c, s) = (vm_rss_kib("self"), vm_rss_kib(&pid));
                    if let Ok(mut p) = peaks.lock() {
                        *p = (p.0.max(c), p.1.max(s));
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };
        let t = Instant::now();
        let stagger = PACE / SESSIONS as u32;
        let mut tasks = Vec::with_capacity(SESSIONS);
        for (i, buf) in per_session.into_iter().enumerate() {
            let model = model.clone();
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(stagger * i as u32).await;
                one(model, buf).await
            }));
        }
        // The per-session buffers come back as they are (no copy while the others still run).
        let mut results = Vec::with_capacity(SESSIONS);
        for task in tasks {
            results.push(task.await.expect("session"));
        }
        let elapsed = t.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = sampler.await;
        let (after, server_after) = (vm_rss_kib("self"), vm_rss_kib(&server_pid));
        let (peak, server_peak) = *peaks.lock().expect("peaks");
        let (peak, server_peak) = (peak.max(after), server_peak.max(server_after));
        drop(server.stdin.take());
        let _ = server.wait();

        let received: Vec<(u64, Instant, u64)> = results.into_iter().flatten().collect();
        assert_eq!(received.len(), SESSIONS * DELTAS, "every delta delivered");
        let mut arrived: Vec<(u64, Instant)> = std::mem::take(&mut *arrivals.lock().expect("arrivals"));
        arrived.sort_unstable_by_key(|a| a.0);
        let mut inside = Vec::with_capacity(received.len());
        let mut end_to_end = Vec::with_capacity(received.len());
        for (stamp, at, wall) in &received {
            end_to_end.push(wall.saturating_sub(*stamp));
            if let Ok(i) = arrived.binary_search_by_key(stamp, |a| a.0) {
                inside.push(at.saturating_duration_since(arrived[i].1).as_micros() as u64);
            }
        }
        assert_eq!(inside.len(), received.len(), "every delta probed");
        let (p50, p99, max) = quantiles(&mut inside);
        let (e50, e99, emax) = quantiles(&mut end_to_end);
        let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / SESSIONS as f64;
        println!(
            "concurrent: {SESSIONS} sessions x {DELTAS} deltas, one every {PACE:?} per stream, starts spread over {PACE:?}; wall {elapsed:.2?} (ideal {:.2?})",
            PACE * (DELTAS as u32 + 3)
        );
        println!(
            "  tether process  VmRSS before {before} KiB, peak {peak} KiB, after {after} KiB => {:.1} KiB per session (peak - before; goal <= 64)",
            per(peak, before)
        );
        println!(
            "  server process  VmRSS before {server_before} KiB, peak {server_peak} KiB => {:.1} KiB per session (not tether)",
            per(server_peak, server_before)
        );
        println!(
            "  inside tether (read received -> subscriber recv): p50 {p50} us, p99 {p99} us, max {max} us (goal p99 <= 1000)"
        );
        println!("  server write -> subscriber recv (incl. server, TCP): p50 {e50} us, p99 {e99} us, max {emax} us");
    });
}
