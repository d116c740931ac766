//! Tracing's fixed cost per run: many short sessions on a real SQLite store file, untraced vs
//! traced (spans and metrics exported over OTLP/HTTP to a receiver on loopback), in one process,
//! phases alternating. Each phase runs `RUNS` sessions at once (as `tether serve` does under
//! load), each a fresh thread (session) whose one request streams `DELTAS` one-character deltas
//! from an in-process model (no network, so what is measured is tether's own work), with the
//! tracer attached as `tether serve` attaches it ([`tether_otel::Tracer::attach`]).
//!
//! It prints, per variant, the median wall-clock time of a phase and the median CPU time this
//! process used per run (`CLOCK_PROCESS_CPUTIME_ID`; on a shared, busy machine the CPU time is
//! the trustworthy figure), and the untraced/traced ratios. A third variant, traced with the
//! store dropping tether-otel's state operations (`put_state`/`state` of
//! [`tether_otel::STATE_KEY`], and the state an append carries), shows how much of the traced
//! cost is that store work; the store operations per run of each variant are counted and
//! printed (an append carrying the trace state is one operation: one store step).
//!
//! Run: `cargo bench -p tether-otel --bench runs` (`-- RUNS DELTAS ROUNDS`, default 1000 1000 5).
//!
//! It also counts the heap allocations per run of each variant (a count of work, which unlike
//! time does not move with the machine's load). `RUNS_ONLY=untraced` (or `traced`) runs one
//! variant only, for a profiler (`perf record`) to compare them.

use std::alloc::{GlobalAlloc, Layout, System};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::Value;
use tether::local::LocalLoop;
use tether::{
    ChatMessage, ChatModel, ChatRequest, ChatResponse, DeltaSink, Event, EventKind, EventStore, RetryPolicy,
    Session, ToolResult,
};
use tether_sqlite::SqliteStore;

/// The system allocator, counting allocations (a relaxed counter: a few nanoseconds each, the
/// same for every variant).
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A model that streams `n` one-character deltas, then answers with their text.
struct Deltas(usize);

#[async_trait]
impl ChatModel for Deltas {
    fn name(&self) -> &str {
        "bench"
    }
    async fn chat(&self, _req: &ChatRequest, deltas: &DeltaSink) -> tether::Result<ChatResponse> {
        for _ in 0..self.0 {
            deltas.text("x").await;
        }
        Ok(ChatResponse::new(ChatMessage::assistant("x".repeat(self.0))).with_finish_reason("stop"))
    }
}

/// The SQLite store, counting the operations on it, and optionally dropping tether-otel's state
/// operations (to show what they cost).
struct Counted {
    inner: SqliteStore,
    skip_otel_state: std::sync::atomic::AtomicBool,
    appends: AtomicU64,
    loads: AtomicU64,
    otel_puts: AtomicU64,
    otel_reads: AtomicU64,
    /// Appends that carried tether-otel's state in the same store step.
    otel_carried: AtomicU64,
    other: AtomicU64,
}

impl Counted {
    fn counts(&self) -> [u64; 6] {
        [
            self.appends.swap(0, Ordering::Relaxed),
            self.loads.swap(0, Ordering::Relaxed),
            self.otel_puts.swap(0, Ordering::Relaxed),
            self.otel_reads.swap(0, Ordering::Relaxed),
            self.other.swap(0, Ordering::Relaxed),
            self.otel_carried.swap(0, Ordering::Relaxed),
        ]
    }
    fn skip(&self, key: &str) -> bool {
        key == tether_otel::STATE_KEY && self.skip_otel_state.load(Ordering::Relaxed)
    }
}

#[async_trait]
impl EventStore for Counted {
    async fn append(&self, session_id: &str, event: &Event) -> tether::Result<bool> {
        self.appends.fetch_add(1, Ordering::Relaxed);
        self.inner.append(session_id, event).await
    }
    async fn append_with_state(
        &self,
        session_id: &str,
        event: &Event,
        key: &str,
        value: &Value,
    ) -> tether::Result<bool> {
        self.appends.fetch_add(1, Ordering::Relaxed);
        if key == tether_otel::STATE_KEY {
            self.otel_carried.fetch_add(1, Ordering::Relaxed);
        }
        if self.skip(key) {
            return self.inner.append(session_id, event).await;
        }
        self.inner.append_with_state(session_id, event, key, value).await
    }
    async fn load(&self, session_id: &str) -> tether::Result<Vec<Event>> {
        self.loads.fetch_add(1, Ordering::Relaxed);
        self.inner.load(session_id).await
    }
    async fn tool_result(&self, session_id: &str, tool_use_id: &str) -> tether::Result<Option<ToolResult>> {
        self.other.fetch_add(1, Ordering::Relaxed);
        self.inner.tool_result(session_id, tool_use_id).await
    }
    async fn put_tool_result(&self, session_id: &str, result: &ToolResult) -> tether::Result<()> {
        self.other.fetch_add(1, Ordering::Relaxed);
        self.inner.put_tool_result(session_id, result).await
    }
    async fn put_state(&self, session_id: &str, key: &str, value: &Value) -> tether::Result<()> {
        if key == tether_otel::STATE_KEY {
            self.otel_puts.fetch_add(1, Ordering::Relaxed);
        } else {
            self.other.fetch_add(1, Ordering::Relaxed);
        }
        if self.skip(key) {
            return Ok(());
        }
        self.inner.put_state(session_id, key, value).await
    }
    async fn state(&self, session_id: &str, key: &str) -> tether::Result<Option<Value>> {
        if key == tether_otel::STATE_KEY {
            self.otel_reads.fetch_add(1, Ordering::Relaxed);
        } else {
            self.other.fetch_add(1, Ordering::Relaxed);
        }
        if self.skip(key) {
            return Ok(None);
        }
        self.inner.state(session_id, key).await
    }
    async fn sessions(&self) -> tether::Result<Vec<String>> {
        self.other.fetch_add(1, Ordering::Relaxed);
        self.inner.sessions().await
    }
}

/// CPU time this process has used (all threads).
fn cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// One session, one request of `deltas` deltas, read by a subscriber (as a server relays it).
async fn one_run(store: Arc<Counted>, deltas: usize, tracer: Option<tether_otel::Tracer>) {
    let provider = LocalLoop::new(Deltas(deltas)).retry(RetryPolicy::none());
    let mut session = Session::builder(provider)
        .store(store)
        .open()
        .await
        .expect("open");
    if let Some(t) = &tracer {
        t.attach(session.sink()).await;
    }
    let mut rx = session.sink().subscribe(256).await;
    let reader = tokio::spawn(async move {
        let mut n = 0;
        while let Some(e) = rx.recv().await {
            if let EventKind::TextDelta { delta, .. } = &e.kind {
                n += delta.len();
            }
        }
        n
    });
    let r = session.send("go").await.expect("send");
    assert_eq!(r.text.len(), deltas);
    drop(session);
    assert_eq!(reader.await.expect("reader"), deltas);
}

/// A phase: `runs` sessions at once; returns its wall-clock and CPU time and the allocations made.
/// A traced phase ends once its spans are exported (`flush`), so the export's work is its own.
async fn phase(
    store: &Arc<Counted>,
    runs: usize,
    deltas: usize,
    tracer: Option<(&tether_otel::Tracer, &tether_otel::Telemetry)>,
) -> (Duration, Duration, u64) {
    let (t0, c0, a0) = (Instant::now(), cpu(), ALLOCS.load(Ordering::Relaxed));
    let tasks: Vec<_> = (0..runs)
        .map(|_| tokio::spawn(one_run(store.clone(), deltas, tracer.map(|t| t.0.clone()))))
        .collect();
    for t in tasks {
        t.await.expect("run");
    }
    if let Some((_, telemetry)) = tracer {
        tokio::task::block_in_place(|| telemetry.flush());
    }
    (t0.elapsed(), cpu() - c0, ALLOCS.load(Ordering::Relaxed) - a0)
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let runs = args.first().copied().unwrap_or(1000);
    let deltas = args.get(1).copied().unwrap_or(1000);
    let rounds = args.get(2).copied().unwrap_or(5).max(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(Counted {
            inner: SqliteStore::open(dir.path().join("bench.db")).expect("store"),
            skip_otel_state: false.into(),
            appends: 0.into(),
            loads: 0.into(),
            otel_puts: 0.into(),
            otel_reads: 0.into(),
            otel_carried: 0.into(),
            other: 0.into(),
        });
        let sink = tether_testkit::otlp::OtlpSink::start().await;
        let telemetry = tether_otel::Telemetry::new(
            tether_otel::ExportConfig::new(sink.url().to_owned())
                .batch_delay(Duration::from_millis(100))
                .metrics_interval(Duration::from_secs(1)),
        )
        .expect("telemetry");
        let tracer = telemetry.tracer().agent_name("bench").with_dispatch(telemetry.dispatch());

        // Warm up (allocator, store, exporter connection).
        phase(&store, runs, deltas, None).await;
        phase(&store, runs, deltas, Some((&tracer, &telemetry))).await;
        store.counts();
        // One variant only (for a profiler), or all three, alternating.
        let only = std::env::var("RUNS_ONLY").ok();
        let only: Option<usize> = match only.as_deref() {
            None | Some("") => None,
            Some("untraced") => Some(0),
            Some("traced") => Some(1),
            Some(v) => panic!("RUNS_ONLY={v}: expected untraced or traced"),
        };

        let names = ["untraced", "traced", "traced, no otel state ops"];
        let mut wall: [Vec<Duration>; 3] = Default::default();
        let mut cpus: [Vec<Duration>; 3] = Default::default();
        let mut ops = [[0u64; 6]; 3];
        let mut allocs = [0u64; 3];
        for round in 0..rounds {
            // Alternate the order, round by round.
            let order: &[usize] = match only {
                Some(v) => &[v],
                None if round % 2 == 0 => &[0, 1, 2],
                None => &[2, 1, 0],
            };
            for &v in order {
                store.skip_otel_state.store(v == 2, Ordering::Relaxed);
                let traced = (v > 0).then_some((&tracer, &telemetry));
                let (w, c, a) = phase(&store, runs, deltas, traced).await;
                wall[v].push(w);
                cpus[v].push(c);
                allocs[v] += a;
                for (a, b) in ops[v].iter_mut().zip(store.counts()) {
                    *a += b;
                }
            }
        }
        println!("{runs} concurrent runs x {deltas} deltas, {rounds} rounds (medians)");
        let mut wm = [Duration::ZERO; 3];
        let mut cm = [Duration::ZERO; 3];
        for v in 0..3 {
            if wall[v].is_empty() {
                continue;
            }
            wm[v] = median(&mut wall[v]);
            cm[v] = median(&mut cpus[v]);
            let per = |n: u64| n as f64 / (rounds * runs) as f64;
            println!(
                "  {:<27} wall {:>8.1} ms  CPU/run {:>6.1} us  allocations/run {:>6.0}  store ops/run: append {:.1} (carrying otel state {:.1}), load {:.1}, otel put_state {:.1}, otel state {:.1}, other {:.1}",
                names[v],
                wm[v].as_secs_f64() * 1e3,
                cm[v].as_secs_f64() * 1e6 / runs as f64,
                per(allocs[v]),
                per(ops[v][0]),
                per(ops[v][5]),
                per(ops[v][1]),
                per(ops[v][2]),
                per(ops[v][3]),
                per(ops[v][4]),
            );
        }
        let r = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
        if only.is_some() {
            drop(tracer);
            tokio::task::block_in_place(|| telemetry.shutdown());
            return;
        }
        println!(
            "  untraced/traced: wall {:.3}, CPU {:.3}   untraced/(traced, no otel state ops): wall {:.3}, CPU {:.3}",
            r(wm[0], wm[1]),
            r(cm[0], cm[1]),
            r(wm[0], wm[2]),
            r(cm[0], cm[2]),
        );
        drop(tracer);
        tokio::task::block_in_place(|| telemetry.shutdown());
    });
}
