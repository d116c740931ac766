//! The `tether serve` benchmark (not a test): N concurrent AG-UI runs, each relaying D deltas
//! from the testkit's fake OpenAI server, from a load client on loopback; and, in the same run,
//! the same load read directly from the fake server.
//!
//! ```text
//! cargo build --release -p tether-serve --bin tether-serve --example fake_openai --example bench
//! target/release/examples/bench [RUNS=1000] [DELTAS=1000]
//! # the backends (issue 18):
//! cargo build --release -p tether-serve --features restate --bin tether-serve --example fake_openai --example bench
//! BENCH_BACKENDS=sqlite,restate1,restate3 target/release/examples/bench [RUNS] [DELTAS]
//! ```
//!
//! Client, server and fake model are three processes (the fake in bench mode serves the testkit's
//! `FakeOpenAi` directly, on its own runtime). Prints delivered deltas per second (the text
//! characters delivered: the model crate merges the deltas of one network read into one event, so
//! events are not deltas), SSE events per second, p50/p99 time to the first event (the first body
//! byte) and to the first text, the peak resident memory (VmHWM) of the server process and of
//! the fake server process, and the CPU time the serving process and the load client used.
//!
//! `BENCH_SERVER_CONFIG="first_output_hold_ms = 0"` adds settings to the server's `[server]`
//! section (there: the same server without first output first).
//!
//! `BENCH_OTEL=1` adds tracing's cost: the relayed load on open connections against two fresh
//! servers, one traced with OTLP export to a receiver on loopback, in alternating order
//! (`BENCH_OTEL_ROUNDS`, default 5, rounds of one load each).
//! `BENCH_OTEL_WRAP="valgrind --tool=callgrind"` runs those two servers under a profiler, for
//! their instruction counts over the same loads.
//!
//! `BENCH_BACKENDS=sqlite,restate1,restate3` compares thread backends instead (issue 18; build
//! with `--features restate`): for each, a fresh `tether serve` (on a fresh Restate node or
//! cluster from `conformance/restate`, replication 2 when several) takes the relayed load on open
//! connections twice: plain runs, and tool-heavy runs (`BENCH_TOOLS`, default 20: that many calls
//! of the workspace tool `read_file`, one per model step, then the text; the fake's `tools` mode).
//! Each variant first runs alone a few times (a run's latency without load: what a durable step
//! costs), then RUNS at once. The summary gives deltas/s and first-text p99 with their ratios to
//! the first backend's, and the per-tool-call time (the lone tool-heavy run minus the lone plain
//! run, over the calls). `BENCH_FLOOR=1` adds, on each Restate backend, the floor of a turn there:
//! RUNS invocations at once of a bare exclusive handler with one journaled step and nothing of
//! tether (`tether-restate`'s `examples/restate_floor`, built with `cargo build --release -p
//! tether-restate --example restate_floor`), against the first backend's plain load. The parts a
//! turn of tether's design adds can be priced there one by one: `BENCH_FLOOR_PEEK=1` reads each
//! object (one shared handler) before its turn, and the floor's own `FLOOR_SETS=n` and
//! `FLOOR_INDEX=1` have each turn write `n` state keys and call a shared index; `FLOOR_PG=…` keeps
//! each turn's record in PostgreSQL instead (see the example's docs).
//!
//! Each load runs on new connections and on connections opened beforehand; a last burst of
//! `GET /healthz` on open connections shows the floor: what 1,000 requests at once take on this
//! machine with no run behind them. The load client is a minimal HTTP/1.1 client on raw sockets
//! (see `Conn`), so that it measures the server rather than itself.

use std::process::Stdio;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

async fn spawn_until(cmd: &mut Command, marker: &str) -> (Child, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let out = child.stdout.take().expect("stdout");
    let err = child.stderr.take().expect("stderr");
    let mut lines = futures_util::stream::select(
        tokio_stream_lines(BufReader::new(out)),
        tokio_stream_lines(BufReader::new(err)),
    );
    while let Some(line) = lines.next().await {
        if let Some(i) = line.find(marker) {
            let rest = line[i + marker.len()..]
                .split_whitespace()
                .next()
                .unwrap_or("")
                .to_owned();
            tokio::spawn(async move { while lines.next().await.is_some() {} });
            return (child, rest);
        }
    }
    panic!("{cmd:?} exited before printing {marker}");
}

fn tokio_stream_lines<R: tokio::io::AsyncBufRead + Unpin + Send + 'static>(
    r: R,
) -> futures_util::stream::BoxStream<'static, String> {
    futures_util::stream::unfold(r.lines(), |mut l| async move {
        match l.next_line().await {
            Ok(Some(s)) => Some((s, l)),
            _ => None,
        }
    })
    .boxed()
}

fn vm_hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

/// Resets the process's peak resident memory (VmHWM) to its current RSS, so that the next
/// reading is the peak of what follows.
fn reset_hwm(pid: u32) {
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
}

/// The process of `tether-serve` itself under a `BENCH_SERVER_WRAP` wrapper started as
/// `wrapper`: its first descendant named `tether-serve` (heaptrack's script runs the server as
/// its child), or the wrapper itself (valgrind runs the server in its own process).
fn wrapped_server(wrapper: u32) -> u32 {
    let procs = processes();
    let mut family = vec![wrapper];
    let mut i = 0;
    while i < family.len() {
        let parent = family[i];
        for (pid, ppid, comm) in &procs {
            if *ppid == parent {
                if comm == "tether-serve" {
                    return *pid;
                }
                family.push(*pid);
            }
        }
        i += 1;
    }
    wrapper
}

/// Stops a server run under `BENCH_SERVER_WRAP` so that its profiler writes its profile: SIGTERM
/// to the server (it shuts down as on Ctrl-C), then waits for the wrapper to finish (heaptrack's
/// script waits for its interpreter to write the file). SIGKILL, what dropping the child sends,
/// would leave no profile.
async fn stop_wrapped(mut wrapper: Child, server: u32) {
    let wrapper_pid = wrapper.id().unwrap_or(0);
    println!(
        "stopping the wrapped server (pid {server}) with SIGTERM; waiting for its profiler to write its output"
    );
    if let Ok(pid) = i32::try_from(server) {
        // SAFETY: kill(2) with a pid of the server process this bench started.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
    match tokio::time::timeout(Duration::from_secs(600), wrapper.wait()).await {
        Ok(Ok(status)) => {
            println!(
                "the wrapped server exited ({status}); heaptrack names its file after the wrapper's pid {wrapper_pid}"
            )
        }
        Ok(Err(e)) => println!("waiting for the wrapped server failed: {e}"),
        Err(_) => println!("the wrapped server did not exit within 600 s; killing it (no profile)"),
    }
}

/// How long one run of a load may take before it counts as failed.
const RUN_TIMEOUT: Duration = Duration::from_secs(600);

/// Alternating loads per server in the BENCH_OTEL phase (odd, so a median exists), unless
/// `BENCH_OTEL_ROUNDS` says how many (made odd). One load of 1,000 runs takes about half a
/// second here, so its rate moves by +-15 % with the machine; more rounds narrow the median.
const OTEL_ROUNDS: usize = 5;

fn otel_rounds() -> usize {
    std::env::var("BENCH_OTEL_ROUNDS")
        .ok()
        .and_then(|r| r.parse::<usize>().ok())
        .map_or(OTEL_ROUNDS, |r| r.max(1) | 1)
}

/// Every process on the machine: (pid, parent pid, command name), from `/proc/<pid>/stat`.
fn processes() -> Vec<(u32, u32, String)> {
    let mut procs = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; the name may hold spaces, inside the parentheses.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = stat[open + 1..close].to_owned();
        let ppid = stat[close + 1..]
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        procs.push((pid, ppid, comm));
    }
    procs
}

/// CPU time (user + system) a process has used so far; `pid` 0 is this process.
fn cpu_secs(pid: u32) -> f64 {
    let path = match pid {
        0 => "/proc/self/stat".to_owned(),
        p => format!("/proc/{p}/stat"),
    };
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    // The fields after the command name (which may hold spaces, inside parentheses), the state
    // (a letter) first. Every field is kept, so that the indices are the line's: until
    // 2026-12-05 the state was filtered out with the other non-numbers, which shifted these
    // reads onto stime and cutime (system time only), and every "CPU serving" figure before
    // then counted the system time alone.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line: 11 and 12 counted from the state.
    let field = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (field(11) + field(12)) / 100.0
}

/// CPU seconds used so far by each process descended from this one, by pid: (command, seconds).
/// Sampled before and after a load, it says where the load's CPU went (the server, Restate's
/// nodes, PostgreSQL, the fake model), which on a busy 2-core machine is what bounds deltas/s.
/// (A process that ends between the samples is not counted: none does during a load.)
fn tree_cpu() -> std::collections::HashMap<u32, (String, f64)> {
    let me = std::process::id();
    let procs = processes();
    let parent: std::collections::HashMap<u32, u32> = procs.iter().map(|(p, pp, _)| (*p, *pp)).collect();
    let descends = |mut p: u32| {
        for _ in 0..64 {
            match parent.get(&p) {
                Some(&pp) if pp == me => return true,
                Some(&pp) if pp > 1 => p = pp,
                _ => return false,
            }
        }
        false
    };
    procs
        .into_iter()
        .filter(|(pid, _, _)| descends(*pid))
        .map(|(pid, _, c)| (pid, (c, cpu_secs(pid))))
        .collect()
}

/// What each command used between two [`tree_cpu`] samples, largest first ("name 1.2 s, …").
fn cpu_by_command(
    before: &std::collections::HashMap<u32, (String, f64)>,
    after: &std::collections::HashMap<u32, (String, f64)>,
) -> String {
    let mut by: std::collections::BTreeMap<String, f64> = std::collections::BTreeMap::new();
    for (pid, (c, secs)) in after {
        let was = before.get(pid).map_or(0.0, |b| b.1);
        *by.entry(c.clone()).or_default() += secs - was;
    }
    let mut v: Vec<(String, f64)> = by.into_iter().filter(|(_, s)| *s >= 0.01).collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v.iter()
        .map(|(c, s)| format!("{c} {s:.2} s"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn vm_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

struct Figures {
    /// Text characters delivered (each upstream delta is one character).
    deltas: u64,
    /// SSE events received.
    events: u64,
    elapsed: Duration,
    /// Time to the first byte of the body (the first event).
    ttfe: Vec<Duration>,
    /// Time to the first text.
    ttft: Vec<Duration>,
    /// Time to the response head.
    ttfh: Vec<Duration>,
    /// Time to the end of the response (the run's end).
    done: Vec<Duration>,
    /// Runs that failed: no 2xx answer, the connection broke, or a `RUN_ERROR` in the stream.
    failures: usize,
    /// Of the failures, the runs that ended with a `RUN_ERROR` event; the first one's line.
    errors: usize,
    error: Option<String>,
    /// Text characters each run that did not fail received.
    chars: Vec<u64>,
    /// With `BENCH_TRACE`: each run's AG-UI text events in short (see [`Trace`]), in the order
    /// of `chars`.
    traces: Vec<Trace>,
    /// CPU seconds used during the load by the process serving it, and by the load client.
    cpu: (f64, f64),
}

impl Figures {
    fn empty() -> Figures {
        Figures {
            deltas: 0,
            events: 0,
            elapsed: Duration::from_secs(1),
            ttfe: Vec::new(),
            ttft: Vec::new(),
            ttfh: Vec::new(),
            done: Vec::new(),
            failures: 0,
            errors: 0,
            error: None,
            chars: Vec::new(),
            traces: Vec::new(),
            cpu: (0.0, 0.0),
        }
    }
}

/// Prints the total of text characters against what the model sent, and (with `BENCH_TRACE`)
/// each run whose count is not the model's, with what its stream showed (at most 10).
fn mismatches(name: &str, f: &Figures, deltas: usize) {
    let want = deltas as u64 * f.chars.len() as u64;
    let got: u64 = f.chars.iter().sum();
    println!(
        "{name}: text characters {got} of {want} ({:+}) in {} runs that did not fail",
        got as i64 - want as i64,
        f.chars.len()
    );
    let bad: Vec<usize> = (0..f.chars.len())
        .filter(|&i| f.chars[i] != deltas as u64)
        .collect();
    for &i in bad.iter().take(10) {
        let t = f.traces.get(i).map(Trace::summary).unwrap_or_default();
        println!("{name}: a run showed {} characters: {t}", f.chars[i]);
    }
}

fn pct(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn report(name: &str, f: &Figures, hwm_kib: u64, runs: usize) {
    let secs = f.elapsed.as_secs_f64();
    println!(
        "{name}: {} deltas in {:.2}s = {:.0} deltas/s ({} SSE events, {:.0}/s); \
         response head p50 {:.1} ms, p99 {:.1} ms; first event p50 {:.1} ms, p99 {:.1} ms; first text p50 {:.1} ms, p99 {:.1} ms; \
         peak RSS {:.1} MiB ({:.1} KiB per run); CPU {:.2}s serving, {:.2}s client; failures {}",
        f.deltas,
        secs,
        f.deltas as f64 / secs,
        f.events,
        f.events as f64 / secs,
        ms(pct(&f.ttfh, 0.50)),
        ms(pct(&f.ttfh, 0.99)),
        ms(pct(&f.ttfe, 0.50)),
        ms(pct(&f.ttfe, 0.99)),
        ms(pct(&f.ttft, 0.50)),
        ms(pct(&f.ttft, 0.99)),
        hwm_kib as f64 / 1024.0,
        hwm_kib as f64 / runs as f64,
        f.cpu.0,
        f.cpu.1,
        f.failures,
    );
    if let Some(e) = &f.error {
        println!("{name}: {} runs ended with RUN_ERROR, the first: {e}", f.errors);
    }
}

/// What an SSE body delivered: events, and the characters of the text fields the scanner looks
/// for (the fake's `"content"`, or `"delta"` of AG-UI `TEXT_MESSAGE_CONTENT`).
#[derive(Default)]
struct Scan {
    line: Vec<u8>,
    events: u64,
    chars: u64,
    /// The first `RUN_ERROR` event's line, if the run ended with one (an AG-UI run fails in
    /// the stream, after its 200 head).
    error: Option<String>,
    /// With `BENCH_TRACE`: what the run's text events were.
    trace: Trace,
}

/// What a run's AG-UI stream showed of its text (`BENCH_TRACE=1`; off by default, it parses
/// every event): the text message events in order, runs of `TEXT_MESSAGE_CONTENT` of one message
/// folded into one entry with their character count, and the snapshots. A run whose count of
/// characters is wrong is printed with it, so that a gap or a repeat shows where it happened.
#[derive(Default)]
struct Trace {
    on: bool,
    /// (event type, message id, characters) in order.
    steps: Vec<(String, String, u64)>,
    /// Characters per message id (`TEXT_MESSAGE_CONTENT`).
    per_message: std::collections::BTreeMap<String, u64>,
    /// Message ids that had more than one `TEXT_MESSAGE_START`.
    restarted: Vec<String>,
}

impl Trace {
    fn feed(&mut self, data: &[u8], chars: u64) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
            self.steps.push(("UNPARSED".into(), String::new(), 0));
            return;
        };
        let ty = v["type"].as_str().unwrap_or("").to_owned();
        let id = v["messageId"].as_str().unwrap_or("").to_owned();
        match ty.as_str() {
            "TEXT_MESSAGE_CONTENT" => {
                *self.per_message.entry(id.clone()).or_default() += chars;
                if let Some(last) = self.steps.last_mut()
                    && last.0 == ty
                    && last.1 == id
                {
                    last.2 += chars;
                    return;
                }
                self.steps.push((ty, id, chars));
            }
            "TEXT_MESSAGE_START" => {
                if self.steps.iter().any(|(t, i, _)| t == &ty && i == &id) {
                    self.restarted.push(id.clone());
                }
                self.steps.push((ty, id, 0));
            }
            "TEXT_MESSAGE_END" | "RUN_ERROR" | "RUN_FINISHED" => self.steps.push((ty, id, 0)),
            "MESSAGES_SNAPSHOT" => {
                let n = v["messages"].as_array().map_or(0, Vec::len) as u64;
                self.steps.push((ty, String::new(), n));
            }
            _ => {}
        }
    }

    fn summary(&self) -> String {
        let steps: Vec<String> = self
            .steps
            .iter()
            .map(|(t, id, n)| match t.as_str() {
                "TEXT_MESSAGE_CONTENT" => format!("CONTENT({id}, {n} chars)"),
                "MESSAGES_SNAPSHOT" => format!("MESSAGES_SNAPSHOT({n} messages)"),
                _ if id.is_empty() => t.clone(),
                _ => format!("{t}({id})"),
            })
            .collect();
        format!(
            "per message {:?}; started twice {:?}; events: {}",
            self.per_message,
            self.restarted,
            steps.join(" ")
        )
    }
}

impl Scan {
    fn feed(&mut self, chunk: &[u8], text: Text) {
        let mut rest = chunk;
        while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
            let line: &[u8] = if self.line.is_empty() {
                &rest[..nl]
            } else {
                self.line.extend_from_slice(&rest[..nl]);
                &self.line
            };
            if let Some(data) = line.strip_prefix(b"data:") {
                if self.error.is_none() && find(data, b"\"RUN_ERROR\"").is_some() {
                    self.error = Some(String::from_utf8_lossy(&data[..data.len().min(300)]).into_owned());
                }
                let (events, chars) = scan_line(data, text);
                self.events += events;
                self.chars += chars;
                if self.trace.on {
                    self.trace.feed(data, chars);
                }
            }
            self.line.clear();
            rest = &rest[nl + 1..];
        }
        self.line.extend_from_slice(rest);
    }
}

#[derive(Clone, Copy)]
enum Text {
    /// OpenAI chunks: `"content":"..."`.
    OpenAi,
    /// AG-UI: the `"delta":"..."` of `TEXT_MESSAGE_CONTENT`.
    AgUi,
}

/// (events, text characters) of one `data:` line.
fn scan_line(data: &[u8], text: Text) -> (u64, u64) {
    let key: &[u8] = match text {
        Text::OpenAi => b"\"content\":\"",
        Text::AgUi if find(data, b"\"TEXT_MESSAGE_CONTENT\"").is_some() => b"\"delta\":\"",
        Text::AgUi => return (1, 0),
    };
    let Some(at) = find(data, key) else { return (1, 0) };
    let mut n = 0u64;
    let mut bytes = data[at + key.len()..].iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'"' => break,
            b'\\' => {
                n += 1;
                if bytes.next() == Some(&b'u') {
                    bytes.nth(3);
                }
            }
            // Count characters: every byte but UTF-8 continuation bytes.
            b if b & 0xC0 != 0x80 => n += 1,
            _ => {}
        }
    }
    (1, n)
}

/// A minimal HTTP/1.1 client for the load: one TCP connection, one request at a time, the body
/// (plain or chunked) handed over as it arrives.
///
/// Why not reqwest: with reqwest the load client measured itself. Each body chunk crosses two
/// tasks (hyper's connection task, then the caller's) in a process that also scans 1,000
/// streams on the same 2 cores, and the fake model, which only writes bytes, showed a p99 of
/// 200–290 ms to its first byte. This client reads the socket in the task that timestamps the
/// bytes, as `wrk` does.
struct Conn {
    stream: tokio::net::TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(addr: std::net::SocketAddr) -> std::io::Result<Conn> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Conn {
            stream,
            buf: Vec::with_capacity(16 * 1024),
        })
    }

    /// Reads more bytes into `buf`; `Ok(false)` at the end of the stream.
    async fn fill(&mut self) -> std::io::Result<bool> {
        use tokio::io::AsyncReadExt;
        if self.buf.capacity() - self.buf.len() < 4096 {
            self.buf.reserve(16 * 1024);
        }
        Ok(self.stream.read_buf(&mut self.buf).await? > 0)
    }

    /// Sends `req` and reads the response, calling `head` once the head is in and `body` with
    /// each piece of the body. Returns the status.
    async fn exchange(
        &mut self,
        req: &[u8],
        mut head: impl FnMut(),
        mut body: impl FnMut(&[u8]),
    ) -> std::io::Result<u16> {
        use tokio::io::AsyncWriteExt;
        let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_owned());
        self.stream.write_all(req).await?;
        self.buf.clear();
        let (status, framing, used) = loop {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut resp = httparse::Response::new(&mut headers);
            if let httparse::Status::Complete(used) =
                resp.parse(&self.buf).map_err(|e| bad(&e.to_string()))?
            {
                let status = resp.code.unwrap_or(0);
                let mut framing = Framing::Close;
                for h in resp.headers.iter() {
                    if h.name.eq_ignore_ascii_case("content-length") {
                        let n = std::str::from_utf8(h.value)
                            .ok()
                            .and_then(|v| v.trim().parse().ok());
                        framing = Framing::Length(n.ok_or_else(|| bad("content-length"))?);
                    } else if h.name.eq_ignore_ascii_case("transfer-encoding")
                        && h.value.ends_with(b"chunked")
                    {
                        framing = Framing::Chunked(Chunks::Size(0));
                    }
                }
                break (status, framing, used);
            }
            if !self.fill().await? {
                return Err(bad("closed before the response head"));
            }
        };
        head();
        self.buf.drain(..used);
        let mut framing = framing;
        loop {
            let n = self.buf.len();
            let done = framing.feed(&self.buf, &mut body).map_err(bad)?;
            if let Some(consumed) = done {
                self.buf.drain(..consumed);
                return Ok(status);
            }
            self.buf.drain(..n);
            if !self.fill().await? {
                return match framing {
                    Framing::Close => Ok(status),
                    _ => Err(bad("closed inside the body")),
                };
            }
        }
    }
}

/// How a response body ends.
enum Framing {
    Length(usize),
    Chunked(Chunks),
    Close,
}

/// Where a chunked decoder is.
enum Chunks {
    /// Reading a size line (the value so far).
    Size(usize),
    /// Skipping a size line's extension up to its LF.
    Ext(usize),
    /// In a chunk's data (bytes left).
    Data(usize),
    /// After a chunk's data: its CRLF (bytes left).
    DataEnd(u8),
    /// After the last chunk: skipping trailer lines; whether the current line is empty.
    Trailer(bool),
}

impl Framing {
    /// Takes all of `bytes`; `Some(n)` when the body ended after `n` of them.
    fn feed(&mut self, bytes: &[u8], body: &mut impl FnMut(&[u8])) -> Result<Option<usize>, &'static str> {
        match self {
            Framing::Close => {
                body(bytes);
                Ok(None)
            }
            Framing::Length(left) => {
                let take = (*left).min(bytes.len());
                body(&bytes[..take]);
                *left -= take;
                Ok((*left == 0).then_some(take))
            }
            Framing::Chunked(state) => {
                let mut i = 0;
                while i < bytes.len() {
                    match state {
                        Chunks::Size(n) => {
                            let b = bytes[i];
                            i += 1;
                            match b {
                                b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                                    let d = (b as char).to_digit(16).unwrap_or(0) as usize;
                                    *n = n.checked_mul(16).ok_or("chunk size")? + d;
                                }
                                b'\r' | b';' | b' ' => *state = Chunks::Ext(*n),
                                b'\n' if *n == 0 => *state = Chunks::Trailer(true),
                                b'\n' => *state = Chunks::Data(*n),
                                _ => return Err("bad chunk size"),
                            }
                        }
                        Chunks::Ext(n) => {
                            if bytes[i] == b'\n' {
                                *state = if *n == 0 {
                                    Chunks::Trailer(true)
                                } else {
                                    Chunks::Data(*n)
                                };
                            }
                            i += 1;
                        }
                        Chunks::Data(left) => {
                            let take = (*left).min(bytes.len() - i);
                            body(&bytes[i..i + take]);
                            i += take;
                            *left -= take;
                            if *left == 0 {
                                *state = Chunks::DataEnd(2);
                            }
                        }
                        Chunks::DataEnd(left) => {
                            i += 1;
                            *left -= 1;
                            if *left == 0 {
                                *state = Chunks::Size(0);
                            }
                        }
                        Chunks::Trailer(empty) => {
                            let b = bytes[i];
                            i += 1;
                            match b {
                                b'\n' if *empty => return Ok(Some(i)),
                                b'\n' => *empty = true,
                                b'\r' => {}
                                _ => *empty = false,
                            }
                        }
                    }
                }
                Ok(None)
            }
        }
    }
}

/// A request as bytes: `POST path` with a JSON body, or `GET path`.
fn http_request(
    host: &str,
    method: &str,
    path: &str,
    accept: &str,
    body: Option<&serde_json::Value>,
    token: Option<&str>,
) -> Vec<u8> {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let mut r = format!("{method} {path} HTTP/1.1\r\nhost: {host}\r\naccept: {accept}\r\n");
    if let Some(t) = token {
        r.push_str(&format!("authorization: Bearer {t}\r\n"));
    }
    if method == "POST" {
        r.push_str(&format!(
            "content-type: application/json\r\ncontent-length: {}\r\n",
            body.len()
        ));
    }
    r.push_str("\r\n");
    r.push_str(&body);
    r.into_bytes()
}

/// Fires `runs` requests at once (on `conns` when given, else each on a new connection);
/// scans every body.
async fn load(
    addr: std::net::SocketAddr,
    conns: Option<Vec<Conn>>,
    runs: usize,
    make: impl Fn(usize) -> Vec<u8>,
    text: Text,
) -> Figures {
    let start = Instant::now();
    let mut conns = conns.map(|c| c.into_iter());
    let trace = std::env::var_os("BENCH_TRACE").is_some();
    let tasks: Vec<_> = (0..runs)
        .map(|i| {
            let req = make(i);
            let open = conns.as_mut().and_then(Iterator::next);
            tokio::spawn(async move {
                let t0 = Instant::now();
                let mut conn = match open {
                    Some(c) => c,
                    None => Conn::open(addr).await.ok()?,
                };
                let mut head = None;
                let mut first = None;
                let mut first_text = None;
                let mut scan = Scan::default();
                scan.trace.on = trace;
                let exchange = conn.exchange(
                    &req,
                    || head = Some(t0.elapsed()),
                    |chunk| {
                        if first.is_none() && !chunk.is_empty() {
                            first = Some(t0.elapsed());
                        }
                        scan.feed(chunk, text);
                        if first_text.is_none() && scan.chars > 0 {
                            first_text = Some(t0.elapsed());
                        }
                    },
                );
                // A run that does not end within RUN_TIMEOUT counts as a failure rather than
                // holding the bench forever (a stuck backend).
                let status = tokio::time::timeout(RUN_TIMEOUT, exchange).await.ok()?.ok()?;
                if !(200..300).contains(&status) {
                    return None;
                }
                if let Some(e) = scan.error {
                    return Some(Err(e));
                }
                Some(Ok((
                    first.unwrap_or_default(),
                    first_text.unwrap_or_default(),
                    head.unwrap_or_default(),
                    t0.elapsed(),
                    scan,
                )))
            })
        })
        .collect();
    let mut f = Figures {
        elapsed: Duration::ZERO,
        ..Figures::empty()
    };
    for t in tasks {
        match t.await.ok().flatten() {
            Some(Err(e)) => {
                f.failures += 1;
                f.errors += 1;
                f.error.get_or_insert(e);
            }
            Some(Ok((ttfe, ttft, head, done, scan))) => {
                f.ttfh.push(head);
                f.done.push(done);
                f.ttfe.push(ttfe);
                f.ttft.push(ttft);
                f.deltas += scan.chars;
                f.chars.push(scan.chars);
                f.traces.push(scan.trace);
                f.events += scan.events;
            }
            None => f.failures += 1,
        }
    }
    f.elapsed = start.elapsed();
    f.ttfe.sort();
    f.ttft.sort();
    f.ttfh.sort();
    f.done.sort();
    f
}

/// Opens `runs` keep-alive connections to `addr` at once, each answering one `GET path` (the
/// answer does not matter), so that a load on them measures the server's time to answer a
/// request rather than the client's and the kernel's time to set up 1,000 TCP connections.
async fn warm(addr: std::net::SocketAddr, path: &str, runs: usize) -> Vec<Conn> {
    let req = std::sync::Arc::new(http_request(&addr.to_string(), "GET", path, "*/*", None, None));
    let tasks: Vec<_> = (0..runs)
        .map(|_| {
            let req = req.clone();
            tokio::spawn(async move {
                let mut c = Conn::open(addr).await.ok()?;
                c.exchange(&req, || {}, |_| {}).await.ok()?;
                Some(c)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        if let Ok(Some(c)) = t.await {
            out.push(c);
        }
    }
    out
}

/// `http://host:port/base` as the socket address and the path prefix.
fn split_url(url: &str) -> (std::net::SocketAddr, String) {
    let rest = url.strip_prefix("http://").expect("an http:// URL");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let addr = host.parse().expect("a numeric host:port");
    (
        addr,
        if path.is_empty() {
            String::new()
        } else {
            format!("/{path}")
        },
    )
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

#[tokio::main]
async fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let runs = args.first().copied().unwrap_or(1000);
    let deltas = args.get(1).copied().unwrap_or(1000);
    let exe = std::env::current_exe().expect("exe");
    let dir = exe.parent().expect("dir").to_path_buf();
    let bin = dir.parent().expect("profile dir").to_path_buf();
    let tmp = std::env::temp_dir().join(format!("tether-bench-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&tmp);

    // BENCH_BACKENDS=sqlite,restate1,restate3: the backends compared instead (issue 18).
    if let Ok(list) = std::env::var("BENCH_BACKENDS") {
        let backends: Vec<Backend> = list
            .split(',')
            .map(|b| {
                Backend::parse(b.trim()).unwrap_or_else(|| {
                    panic!(
                        "BENCH_BACKENDS: unknown backend `{b}` (sqlite, restate1, restate3, restateN, restate1pg, restateNpg)"
                    )
                })
            })
            .collect();
        let tools = std::env::var("BENCH_TOOLS")
            .ok()
            .and_then(|t| t.parse().ok())
            .unwrap_or(20);
        compare(&dir, &bin, &tmp, runs, deltas, tools, &backends).await;
        let _ = std::fs::remove_dir_all(&tmp);
        return;
    }

    let (fake, fake_url) = spawn_until(
        Command::new(dir.join("fake_openai")).args(["bench", &deltas.to_string()]),
        "listening on ",
    )
    .await;
    let cfg = tmp.join("tether.toml");
    // BENCH_SERVER_CONFIG: more `[server]` settings, e.g. "first_output_hold_ms = 0".
    let extra = std::env::var("BENCH_SERVER_CONFIG").unwrap_or_default();
    std::fs::write(
        &cfg,
        format!(
            "[server]\nmax_concurrent_runs = {}\n{extra}\n[agents.bench]\nbase_url = \"{fake_url}\"\nmodel = \"bench\"\n",
            runs + 16
        ),
    )
    .expect("config");
    // BENCH_SERVER_WRAP, e.g. "valgrind --tool=callgrind" or "heaptrack": runs the server under it
    // (for profiling; the figures are then the profiler's).
    let wrap: Vec<String> = std::env::var("BENCH_SERVER_WRAP")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let mut server_cmd = match wrap.split_first() {
        Some((tool, args)) => {
            let mut c = Command::new(tool);
            c.args(args).arg(bin.join("tether-serve"));
            c
        }
        None => Command::new(bin.join("tether-serve")),
    };
    // No --token: the server generates one and prints the UI's URL carrying it, as a user sees
    // it; every run request carries it (the token check is on the measured path).
    let (server, ui_url) = spawn_until(
        server_cmd
            .arg("--config")
            .arg(&cfg)
            .args(["--bind", "127.0.0.1:0", "--db"])
            .arg(tmp.join("bench.db")),
        "tether serve: open ",
    )
    .await;
    let (server_url, token) = ui_url
        .split_once("/#token=")
        .map(|(u, t)| (u.to_owned(), t.to_owned()))
        .expect("the server prints its URL with the generated token");
    // Under a wrapper the figures are read from the server process itself (a wrapper such as
    // heaptrack's script runs it as a child).
    let wrapper_pid = server.id().unwrap_or(0);
    let server_pid = match wrap.is_empty() {
        true => wrapper_pid,
        false => wrapped_server(wrapper_pid),
    };
    let fake_pid = fake.id().unwrap_or(0);
    let idle_server = vm_rss_kib(server_pid);
    let cores = std::thread::available_parallelism().map(usize::from).unwrap_or(0);
    println!("tether serve benchmark: {runs} concurrent runs x {deltas} deltas, {cores} cores, loopback");
    let (fake_addr, fake_base) = split_url(&fake_url);
    let (server_addr, _) = split_url(&server_url);

    // Each load twice: on new connections (the figures include setting up 1,000 TCP connections
    // at once, client side and kernel), and on connections opened beforehand (the figures are the
    // server's: from writing the request to its first event).
    let mut direct = Vec::new();
    let mut fake_hwm = Vec::new();
    for warmed in [false, true] {
        reset_hwm(fake_pid);
        let conns = match warmed {
            true => Some(warm(fake_addr, &format!("{fake_base}/models"), runs).await),
            false => None,
        };
        let path = format!("{fake_base}/chat/completions");
        let body = serde_json::json!({"model": "bench", "stream": true, "messages": [{"role": "user", "content": "go"}]});
        let req = http_request(
            &fake_addr.to_string(),
            "POST",
            &path,
            "text/event-stream",
            Some(&body),
            None,
        );
        let cpu0 = (cpu_secs(fake_pid), cpu_secs(0));
        let mut f = load(fake_addr, conns, runs, move |_| req.clone(), Text::OpenAi).await;
        f.cpu = (cpu_secs(fake_pid) - cpu0.0, cpu_secs(0) - cpu0.1);
        direct.push(f);
        fake_hwm.push(vm_hwm_kib(fake_pid));
    }

    let mut relayed = Vec::new();
    let mut server_hwm = Vec::new();
    for warmed in [false, true] {
        reset_hwm(server_pid);
        let conns = match warmed {
            true => Some(warm(server_addr, "/healthz", runs).await),
            false => None,
        };
        let host = server_addr.to_string();
        let token = token.clone();
        let cpu0 = (cpu_secs(server_pid), cpu_secs(0));
        let mut f = load(
            server_addr,
            conns,
            runs,
            move |i| {
                let body = serde_json::json!({
                    "threadId": format!("bench-{i}-{warmed}-{}", std::process::id()), "runId": "r1",
                    "messages": [{"id": "u1", "role": "user", "content": "go"}]
                });
                http_request(
                    &host,
                    "POST",
                    "/v1/agents/bench/run",
                    "text/event-stream",
                    Some(&body),
                    Some(&token),
                )
            },
            Text::AgUi,
        )
        .await;
        f.cpu = (cpu_secs(server_pid) - cpu0.0, cpu_secs(0) - cpu0.1);
        relayed.push(f);
        server_hwm.push(vm_hwm_kib(server_pid));
    }
    // The floor: the same burst of requests on open connections, to a route that does nothing
    // (GET /healthz). What the machine, the client and the server's front take for 1,000
    // requests at once, with no run behind them.
    let conns = warm(server_addr, "/healthz", runs).await;
    let host = server_addr.to_string();
    let cpu0 = (cpu_secs(server_pid), cpu_secs(0));
    let mut floor = load(
        server_addr,
        Some(conns),
        runs,
        move |_| http_request(&host, "GET", "/healthz", "*/*", None, None),
        Text::AgUi,
    )
    .await;
    floor.cpu = (cpu_secs(server_pid) - cpu0.0, cpu_secs(0) - cpu0.1);

    // BENCH_OTEL=1: tracing's cost. Two fresh servers, one traced and exporting spans and metrics
    // over OTLP/HTTP to a receiver on loopback, one not, take the same load on open connections,
    // three times each, in alternating order.
    let mut otel = None;
    if std::env::var_os("BENCH_OTEL").is_some() {
        let sink = tether_testkit::otlp::OtlpSink::start().await;
        // BENCH_OTEL_WRAP, e.g. "valgrind --tool=callgrind": runs both servers of this phase
        // under it. Their instruction counts for the same loads tell tracing's CPU cost apart
        // from the machine's noise, which moves these short loads' rates by +-15 %.
        let otel_wrap: Vec<String> = std::env::var("BENCH_OTEL_WRAP")
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        let spawn = |traced: bool| {
            let mut c = match otel_wrap.split_first() {
                Some((tool, args)) => {
                    let mut c = Command::new(tool);
                    c.args(args).arg(bin.join("tether-serve"));
                    c
                }
                None => Command::new(bin.join("tether-serve")),
            };
            c.arg("--config")
                .arg(&cfg)
                .args(["--bind", "127.0.0.1:0", "--db"])
                .arg(tmp.join(format!("bench-otel-{traced}.db")));
            if traced {
                c.env("OTEL_EXPORTER_OTLP_ENDPOINT", sink.url())
                    .env("OTEL_BSP_SCHEDULE_DELAY", "200");
            }
            c
        };
        // Each server generates its token and prints the UI's URL carrying it.
        let url_token = |ui: &str| {
            ui.split_once("/#token=")
                .map(|(u, t)| (u.to_owned(), t.to_owned()))
                .expect("the server prints its URL with the generated token")
        };
        let (plain, plain_ui) = spawn_until(&mut spawn(false), "tether serve: open ").await;
        let (traced, traced_ui) = spawn_until(&mut spawn(true), "tether serve: open ").await;
        let (plain_url, plain_token) = url_token(&plain_ui);
        let (traced_url, traced_token) = url_token(&traced_ui);
        let (plain_addr, _) = split_url(&plain_url);
        let (traced_addr, _) = split_url(&traced_url);
        let (plain_pid, traced_pid) = (
            plain.id().expect("the untraced server runs"),
            traced.id().expect("the traced server runs"),
        );
        let (plain_pid, traced_pid) = match otel_wrap.is_empty() {
            true => (plain_pid, traced_pid),
            false => (wrapped_server(plain_pid), wrapped_server(traced_pid)),
        };
        let (mut off, mut on) = (Vec::new(), Vec::new());
        // CPU seconds each server spent per million deltas: unlike deltas/s, this does not move
        // with what else the machine runs, so it shows tracing's cost on a busy machine too.
        let (mut off_cpu, mut on_cpu) = (Vec::new(), Vec::new());
        let rounds = otel_rounds();
        for round in 0..rounds {
            let traced_first = round % 2 == 1;
            for is_traced in [traced_first, !traced_first] {
                let (addr, token) = if is_traced {
                    (traced_addr, traced_token.clone())
                } else {
                    (plain_addr, plain_token.clone())
                };
                let pid = if is_traced { traced_pid } else { plain_pid };
                let cpu0 = cpu_secs(pid);
                let f = agui_load(addr, runs, format!("{is_traced}{round}"), token).await;
                let cpu = (cpu_secs(pid) - cpu0) / (f.deltas.max(1) as f64 / 1e6);
                let rate = f.deltas as f64 / f.elapsed.as_secs_f64();
                if is_traced {
                    on.push(rate);
                    on_cpu.push(cpu);
                } else {
                    off.push(rate);
                    off_cpu.push(cpu);
                }
            }
        }
        if otel_wrap.is_empty() {
            drop((plain, traced));
        } else {
            println!("BENCH_OTEL_WRAP: untraced server pid {plain_pid}, traced server pid {traced_pid}");
            stop_wrapped(plain, plain_pid).await;
            stop_wrapped(traced, traced_pid).await;
        }
        otel = Some((off, on, off_cpu, on_cpu, sink));
    }

    // Peak memory per run: the phase's peak over the process's RSS when idle before any load.
    report("direct, new connections    ", &direct[0], fake_hwm[0], runs);
    report("direct, open connections   ", &direct[1], fake_hwm[1], runs);
    for (i, name) in ["relayed, new connections   ", "relayed, open connections  "]
        .iter()
        .enumerate()
    {
        report(name, &relayed[i], server_hwm[i].saturating_sub(idle_server), runs);
    }
    println!(
        "first text p99, relayed / direct: new connections {:.2}x, open connections {:.2}x (issue 12's goal: <= 1.2x on open connections)",
        ms(pct(&relayed[0].ttft, 0.99)) / ms(pct(&direct[0].ttft, 0.99)),
        ms(pct(&relayed[1].ttft, 0.99)) / ms(pct(&direct[1].ttft, 0.99)),
    );
    println!(
        "floor, open connections    : GET /healthz: first byte p50 {:.1} ms, p99 {:.1} ms; CPU {:.2}s serving, {:.2}s client; failures {}",
        ms(pct(&floor.ttfe, 0.50)),
        ms(pct(&floor.ttfe, 0.99)),
        floor.cpu.0,
        floor.cpu.1,
        floor.failures,
    );
    println!(
        "server peak RSS {:.1} / {:.1} MiB total ({:.1} MiB idle before the load)",
        server_hwm[0] as f64 / 1024.0,
        server_hwm[1] as f64 / 1024.0,
        idle_server as f64 / 1024.0
    );
    if let Some((mut off, mut on, mut off_cpu, mut on_cpu, sink)) = otel {
        let all = |v: &[f64]| v.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", ");
        let all_cpu = |v: &[f64]| v.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>().join(", ");
        println!(
            "tracing (BENCH_OTEL): untraced deltas/s {}; traced {}",
            all(&off),
            all(&on)
        );
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        // Each round's two loads ran one after the other: their ratio leaves out what the
        // machine did between rounds.
        let mut pairs: Vec<f64> = on.iter().zip(&off).map(|(t, u)| t / u).collect();
        let rounds = off.len();
        let (a, b) = (med(&mut off), med(&mut on));
        println!(
            "tracing (BENCH_OTEL), open connections, median of {rounds} alternating loads: untraced {a:.0} deltas/s, \
             traced with OTLP export {b:.0} deltas/s; traced/untraced {:.3} (goal >= 0.95; median of the rounds' \
             own ratios {:.3}); the receiver got {} exports, {} KiB",
            b / a,
            med(&mut pairs),
            sink.exports(),
            sink.bytes() / 1024
        );
        println!(
            "tracing (BENCH_OTEL): server CPU seconds per million deltas, untraced {}; traced {}",
            all_cpu(&off_cpu),
            all_cpu(&on_cpu)
        );
        let (c, d) = (med(&mut off_cpu), med(&mut on_cpu));
        println!(
            "tracing (BENCH_OTEL), median server CPU per million deltas: untraced {c:.3} s, traced {d:.3} s; \
             untraced/traced {:.3} (the deltas/s ratio a CPU-bound server would show; goal >= 0.95)",
            c / d
        );
    }
    if wrap.is_empty() {
        drop(server);
    } else {
        stop_wrapped(server, server_pid).await;
    }
    drop(fake);
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The AG-UI load of the relayed phases, on connections opened beforehand, on threads named
/// after `tag`.
async fn agui_load(addr: std::net::SocketAddr, runs: usize, tag: String, token: String) -> Figures {
    let conns = warm(addr, "/healthz", runs).await;
    let host = addr.to_string();
    load(
        addr,
        Some(conns),
        runs,
        move |i| {
            let body = serde_json::json!({
                "threadId": format!("bench-{tag}-{i}-{}", std::process::id()), "runId": "r1",
                "messages": [{"id": "u1", "role": "user", "content": "go"}]
            });
            http_request(
                &host,
                "POST",
                "/v1/agents/bench/run",
                "text/event-stream",
                Some(&body),
                Some(&token),
            )
        },
        Text::AgUi,
    )
    .await
}

/// A thread backend of `tether serve` the comparison runs (`BENCH_BACKENDS`).
#[derive(Clone, Copy, PartialEq)]
enum Backend {
    /// The default: threads in the server's SQLite file.
    Sqlite,
    /// `[server] backend = "restate"` on a Restate cluster of this many nodes (1: a single node;
    /// more: replication 2, the server's ingress and admin on the first node).
    Restate(usize),
    /// The same with the records in PostgreSQL (`restate_postgres`: the machine's server,
    /// started for the run with its default durability), `restate1pg` and the like.
    RestateShared(usize),
}

impl Backend {
    fn parse(s: &str) -> Option<Backend> {
        match s {
            "sqlite" => Some(Backend::Sqlite),
            _ => {
                let rest = s.strip_prefix("restate")?;
                let (n, shared) = match rest.strip_suffix("pg") {
                    Some(n) => (n, true),
                    None => (rest, false),
                };
                let n = if n.is_empty() { Some(1) } else { n.parse().ok() };
                n.filter(|n| *n >= 1).map(if shared {
                    Backend::RestateShared
                } else {
                    Backend::Restate
                })
            }
        }
    }

    fn name(self) -> String {
        match self {
            Backend::Sqlite => "sqlite".into(),
            Backend::Restate(1) => "restate, 1 node".into(),
            Backend::Restate(n) => format!("restate, {n} nodes"),
            Backend::RestateShared(1) => "restate+pg, 1 node".into(),
            Backend::RestateShared(n) => format!("restate+pg, {n} nodes"),
        }
    }
}

/// What one backend measured for one variant (plain or tool-heavy).
struct Measured {
    /// Run times of single runs alone on the server (no other load), sorted.
    lone: Vec<Duration>,
    /// The concurrent load on open connections.
    load: Figures,
    /// The server's peak RSS over its idle RSS during the load, KiB.
    hwm_kib: u64,
}

/// Lone runs per variant and backend (odd, so a median exists).
const LONE_RUNS: usize = 5;

/// Runs the relayed load on each backend, twice: the plain run (one model step of `deltas`
/// deltas) and the tool-heavy run (`tools` calls of the workspace tool `read_file`, one per model
/// step, then the text). Each variant first runs alone `LONE_RUNS` times (latency without load:
/// what a durable step costs), then `runs` at once on open connections. Prints the figures and
/// their ratios to the first backend's.
async fn compare(
    dir: &std::path::Path,
    bin: &std::path::Path,
    tmp: &std::path::Path,
    runs: usize,
    deltas: usize,
    tools: usize,
    backends: &[Backend],
) {
    let cores = std::thread::available_parallelism().map(usize::from).unwrap_or(0);
    println!(
        "tether serve backends: {runs} concurrent runs x {deltas} deltas, tool-heavy variant {tools} tool calls per run, {cores} cores, loopback, load average {}",
        load_average()
    );
    let (_plain_fake, plain_url) = spawn_until(
        Command::new(dir.join("fake_openai")).args(["bench", &deltas.to_string()]),
        "listening on ",
    )
    .await;
    let (_tools_fake, tools_url) = spawn_until(
        Command::new(dir.join("fake_openai")).args(["tools", &tools.to_string(), &deltas.to_string()]),
        "listening on ",
    )
    .await;
    let ws = tmp.join("ws");
    std::fs::create_dir_all(&ws).expect("workspace");
    // The files the tool-heavy runs read, one per call (the fake's `tools` mode asks for
    // bench-<k>.txt in call k).
    for k in 0..tools {
        std::fs::write(
            ws.join(format!("bench-{k}.txt")),
            format!("file {k} of the tool-heavy run\n"),
        )
        .expect("a file for the tool-heavy runs");
    }

    let mut results: Vec<(Backend, [Measured; 2])> = Vec::new();
    let mut floors: Vec<Option<Floor>> = Vec::new();
    for (b, &backend) in backends.iter().enumerate() {
        let nodes = match backend {
            Backend::Sqlite => Vec::new(),
            Backend::Restate(1) | Backend::RestateShared(1) => {
                vec![tether_testkit::restate::Restate::start().await]
            }
            Backend::Restate(n) | Backend::RestateShared(n) => {
                tether_testkit::restate::Restate::start_cluster(n).await
            }
        };
        let postgres = match backend {
            Backend::RestateShared(_) => Some(tether_testkit::postgres::Postgres::start_durable().await),
            _ => None,
        };
        let mut server_lines = nodes.first().map(|n| n.server_lines()).unwrap_or_default();
        if let Some(pg) = &postgres {
            server_lines.push_str(&format!("restate_postgres = \"{}\"\n", pg.connection()));
        }
        let mut measured = Vec::new();
        // BENCH_VARIANTS=plain or tools: that variant only (the other is then not measured and
        // its figures in the summary are zero).
        let only = std::env::var("BENCH_VARIANTS").ok();
        for (v, url) in [(0, &plain_url), (1, &tools_url)] {
            if only.as_deref().is_some_and(|o| o != ["plain", "tools"][v]) {
                measured.push(Measured {
                    lone: vec![Duration::ZERO],
                    load: Figures::empty(),
                    hwm_kib: 0,
                });
                continue;
            }
            let agent = match v {
                0 => format!("[agents.bench]\nbase_url = \"{plain_url}\"\nmodel = \"bench\"\n"),
                _ => format!(
                    "[agents.bench]\nbase_url = \"{url}\"\nmodel = \"bench\"\nmax_turns = {}\n[agents.bench.workspace]\nroot = \"{}\"\nreads = \"allow\"\n",
                    tools + 2,
                    ws.display()
                ),
            };
            let cfg = tmp.join(format!("tether-{b}-{v}.toml"));
            std::fs::write(
                &cfg,
                format!(
                    "[server]\nmax_concurrent_runs = {}\n{server_lines}{agent}",
                    runs + 16
                ),
            )
            .expect("config");
            let (server, ui_url) = spawn_until(
                Command::new(bin.join("tether-serve"))
                    .arg("--config")
                    .arg(&cfg)
                    .args(["--bind", "127.0.0.1:0", "--db"])
                    .arg(tmp.join(format!("bench-{b}-{v}.db"))),
                "tether serve: open ",
            )
            .await;
            let (server_url, token) = ui_url
                .split_once("/#token=")
                .map(|(u, t)| (u.to_owned(), t.to_owned()))
                .expect("the server prints its URL with the generated token");
            let (addr, _) = split_url(&server_url);
            let pid = server.id().unwrap_or(0);
            let mut lone = Vec::new();
            for i in 0..LONE_RUNS {
                let f = agui_load(addr, 1, format!("lone-{b}-{v}-{i}"), token.clone()).await;
                assert_eq!(
                    f.failures,
                    0,
                    "a lone run failed on {}: {:?} ({})",
                    backend.name(),
                    f.error,
                    nodes.first().map(|n| n.log()).unwrap_or_default()
                );
                lone.extend(f.done);
            }
            lone.sort();
            let idle = vm_rss_kib(pid);
            reset_hwm(pid);
            let conns = warm(addr, "/healthz", runs).await;
            let cpu0 = (cpu_secs(pid), cpu_secs(0));
            let tree0 = tree_cpu();
            let tag = format!("load-{b}-{v}");
            let host = addr.to_string();
            let mut load = load(
                addr,
                Some(conns),
                runs,
                move |i| {
                    let body = serde_json::json!({
                        "threadId": format!("bench-{tag}-{i}-{}", std::process::id()), "runId": "r1",
                        "messages": [{"id": "u1", "role": "user", "content": "go"}]
                    });
                    http_request(
                        &host,
                        "POST",
                        "/v1/agents/bench/run",
                        "text/event-stream",
                        Some(&body),
                        Some(&token),
                    )
                },
                Text::AgUi,
            )
            .await;
            load.cpu = (cpu_secs(pid) - cpu0.0, cpu_secs(0) - cpu0.1);
            let tree = cpu_by_command(&tree0, &tree_cpu());
            let hwm_kib = vm_hwm_kib(pid).saturating_sub(idle);
            let name = format!("{}, {}", backend.name(), ["plain", "tool-heavy"][v]);
            println!(
                "{name}: CPU during the load: {tree}; the load client {:.2} s",
                load.cpu.1
            );
            println!(
                "{name}: lone runs {} ms (median {:.1} ms)",
                lone.iter()
                    .map(|d| format!("{:.1}", ms(*d)))
                    .collect::<Vec<_>>()
                    .join(", "),
                ms(lone[lone.len() / 2])
            );
            report(
                &format!("{name}, {runs} at once, open connections"),
                &load,
                hwm_kib,
                runs,
            );
            let short = load.chars.iter().filter(|&&c| c < deltas as u64).count();
            let long = load.chars.iter().filter(|&&c| c > deltas as u64).count();
            println!(
                "{name}: run time p50 {:.1} ms, p99 {:.1} ms; runs that showed less text than the model sent: {short}, more: {long}",
                ms(pct(&load.done, 0.50)),
                ms(pct(&load.done, 0.99))
            );
            mismatches(&name, &load, deltas);
            drop(server);
            measured.push(Measured { lone, load, hwm_kib });
        }
        // BENCH_FLOOR=1: the least a turn on this Restate backend costs (see `floor_load`).
        let floor = match (nodes.first(), std::env::var_os("BENCH_FLOOR").is_some()) {
            (Some(node), true) => Some(floor_load(dir, node, runs, deltas).await),
            _ => None,
        };
        drop(nodes);
        let [plain, heavy]: [Measured; 2] = measured.try_into().ok().expect("two variants");
        results.push((backend, [plain, heavy]));
        floors.push(floor);
    }

    println!(
        "--- summary ({runs} runs x {deltas} deltas; tool-heavy: {tools} tool calls per run; ratios against {}) ---",
        backends[0].name()
    );
    let med = |v: &[Duration]| v.get(v.len() / 2).copied().unwrap_or_default();
    let rate = |f: &Figures| f.deltas as f64 / f.elapsed.as_secs_f64();
    let steps = (2 * tools + 1) as f64;
    let base = &results[0].1;
    let base_call = (ms(med(&base[1].lone)) - ms(med(&base[0].lone))) / tools.max(1) as f64;
    // A variant left out (`BENCH_VARIANTS`) ran no load: said so, not printed as NaN.
    let ran = |v: &Measured| v.load.done.len() + v.load.failures > 0;
    for (backend, [plain, heavy]) in &results {
        let part = |v: &Measured, b: &Measured, tools_run: bool| {
            if !ran(v) {
                return "not run".to_owned();
            }
            let ratio = |x: f64, y: f64| {
                if ran(b) {
                    format!("{:.2}x", x / y)
                } else {
                    "-".to_owned()
                }
            };
            let mut out = format!(
                "{:>9.0} deltas/s ({}), first text p99 {:>7.1} ms ({})",
                rate(&v.load),
                ratio(rate(&v.load), rate(&b.load)),
                ms(pct(&v.load.ttft, 0.99)),
                ratio(ms(pct(&v.load.ttft, 0.99)), ms(pct(&b.load.ttft, 0.99))),
            );
            if tools_run {
                out.push_str(&format!(
                    ", run p50 {:.0} ms, {:.0} durable steps/s",
                    ms(pct(&v.load.done, 0.50)),
                    runs as f64 * steps / v.load.elapsed.as_secs_f64()
                ));
            } else {
                out.push_str(&format!(", {:.1} KiB/run", v.hwm_kib as f64 / runs as f64));
            }
            out.push_str(&format!(", failures {}", v.load.failures));
            out
        };
        let lone = if ran(plain) && ran(heavy) {
            let per_call = (ms(med(&heavy.lone)) - ms(med(&plain.lone))) / tools.max(1) as f64;
            format!(
                "plain run {:.1} ms, tool-heavy {:.1} ms, per tool call {:.2} ms ({:+.2} ms vs {}), per step {:.2} ms",
                ms(med(&plain.lone)),
                ms(med(&heavy.lone)),
                per_call,
                per_call - base_call,
                backends[0].name(),
                ms(med(&heavy.lone)) / steps,
            )
        } else if ran(plain) {
            format!("plain run {:.1} ms", ms(med(&plain.lone)))
        } else {
            format!("tool-heavy run {:.1} ms", ms(med(&heavy.lone)))
        };
        println!(
            "{:<17} plain: {} | tool-heavy: {} | lone: {lone}",
            backend.name(),
            part(plain, &base[0], false),
            part(heavy, &base[1], true),
        );
    }
    for ((backend, _), floor) in results.iter().zip(&floors) {
        let Some(f) = floor else { continue };
        println!(
            "{:<17} floor (a bare exclusive handler, one journaled step of {deltas} characters; no tether): \
             {runs} invocations in {:.0} ms, handler start p50 {:.1} ms, p99 {:.1} ms ({:.2}x {}'s plain first text p99), \
             invocation p99 {:.1} ms, failures {}; lone invocation {:.1} ms | ceiling: {:.0} deltas/s ({:.2}x {}'s plain deltas/s)",
            backend.name(),
            ms(f.elapsed),
            ms(pct(&f.start, 0.50)),
            ms(pct(&f.start, 0.99)),
            ms(pct(&f.start, 0.99)) / ms(pct(&base[0].load.ttft, 0.99)),
            backends[0].name(),
            ms(pct(&f.done, 0.99)),
            f.failures,
            ms(f.lone),
            (runs * deltas) as f64 / f.elapsed.as_secs_f64(),
            (runs * deltas) as f64 / f.elapsed.as_secs_f64() / rate(&base[0].load),
            backends[0].name(),
        );
    }
    println!("load average after: {}", load_average());
}

/// What the Restate floor measured (see [`floor_load`]).
struct Floor {
    /// The whole load: from the first request sent to the last answer read.
    elapsed: Duration,
    /// Per invocation, from the request sent to the handler's start (the service's clock).
    start: Vec<Duration>,
    /// Per invocation, from the request sent to its answer read.
    done: Vec<Duration>,
    failures: usize,
    /// Median of lone invocations, one at a time.
    lone: Duration,
}

/// The floor of a turn on Restate: `examples/restate_floor` (of `tether-restate`: build it with
/// `cargo build --release -p tether-restate --example restate_floor`) registered with `node`,
/// then `runs` invocations of its bare exclusive handler at once through the node's ingress on
/// open connections, each on a key of its own (as each run has a thread of its own) with one
/// journaled step of `deltas` characters. A turn of tether on Restate is such an invocation and
/// more (the engine, the model's stream, the record), so no such turn can start sooner than
/// these handlers start, and no such load end sooner than these invocations end.
async fn floor_load(
    dir: &std::path::Path,
    node: &tether_testkit::restate::Restate,
    runs: usize,
    deltas: usize,
) -> Floor {
    let (_service, _) = spawn_until(
        Command::new(dir.join("restate_floor")).args([&node.admin, &node.ingress]),
        "floor ready ",
    )
    .await;
    let (addr, _) = split_url(&node.ingress);
    let unix = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0)
    };
    // BENCH_FLOOR_PEEK=1: each turn is preceded by a shared read of its object, as a
    // front-end reads a thread's status before it sends a turn.
    let peek = std::env::var_os("BENCH_FLOOR_PEEK").is_some();
    // BENCH_FLOOR_SEND=1: each turn sent as tether's relay sends one (`…/turn/send` with an
    // idempotency key, then an attach to its invocation) instead of one request-response call.
    // BENCH_FLOOR_SEND=call: one request-response call with an idempotency key (what a relay
    // that waited on its call would send).
    let keyed_call = std::env::var("BENCH_FLOOR_SEND").is_ok_and(|v| v == "call");
    let send = std::env::var_os("BENCH_FLOOR_SEND").is_some() && !keyed_call;
    let fire = |conns: Vec<Conn>, tag: String| async move {
        let began = Instant::now();
        let tasks: Vec<_> = conns
            .into_iter()
            .enumerate()
            .map(|(i, mut conn)| {
                let object = format!("/BenchFloor/{tag}-{i}-{}", std::process::id());
                let req = if keyed_call {
                    let body = serde_json::json!(deltas).to_string();
                    format!(
                        "POST {object}/turn HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
                         idempotency-key: {object}-m1\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    )
                    .into_bytes()
                } else if send {
                    let body = serde_json::json!(deltas).to_string();
                    format!(
                        "POST {object}/turn/send HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
                         idempotency-key: {object}-m1\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    )
                    .into_bytes()
                } else {
                    http_request(
                        &addr.to_string(),
                        "POST",
                        &format!("{object}/turn"),
                        "application/json",
                        Some(&serde_json::json!(deltas)),
                        None,
                    )
                };
                // No content type: Restate refuses one for a handler that takes no input.
                let peek_req = peek.then(|| {
                    format!("POST {object}/peek HTTP/1.1\r\nhost: {addr}\r\ncontent-length: 0\r\n\r\n")
                        .into_bytes()
                });
                tokio::spawn(async move {
                    let (t0, sent) = (Instant::now(), unix());
                    if let Some(p) = &peek_req {
                        let status = tokio::time::timeout(RUN_TIMEOUT, conn.exchange(p, || {}, |_| {}))
                            .await
                            .ok()?
                            .ok()?;
                        (200..300).contains(&status).then_some(())?;
                    }
                    let mut body = Vec::new();
                    let mut status = tokio::time::timeout(
                        RUN_TIMEOUT,
                        conn.exchange(&req, || {}, |b| body.extend_from_slice(b)),
                    )
                    .await
                    .ok()?
                    .ok()?;
                    if send {
                        let sent: serde_json::Value = serde_json::from_slice(&body).ok()?;
                        let id = sent["invocationId"].as_str()?.to_owned();
                        let attach = format!(
                            "GET /restate/invocation/{id}/attach HTTP/1.1\r\nhost: {addr}\r\n\r\n"
                        );
                        body.clear();
                        status = tokio::time::timeout(
                            RUN_TIMEOUT,
                            conn.exchange(attach.as_bytes(), || {}, |b| body.extend_from_slice(b)),
                        )
                        .await
                        .ok()?
                        .ok()?;
                    }
                    let started: u64 = serde_json::from_slice(&body).ok()?;
                    (200..300)
                        .contains(&status)
                        .then(|| (Duration::from_micros(started.saturating_sub(sent)), t0.elapsed()))
                })
            })
            .collect();
        let mut f = Floor {
            elapsed: Duration::ZERO,
            start: Vec::new(),
            done: Vec::new(),
            failures: 0,
            lone: Duration::ZERO,
        };
        for t in tasks {
            match t.await.ok().flatten() {
                Some((start, done)) => {
                    f.start.push(start);
                    f.done.push(done);
                }
                None => f.failures += 1,
            }
        }
        f.elapsed = began.elapsed();
        f.start.sort();
        f.done.sort();
        f
    };
    let mut lone = Vec::new();
    for i in 0..LONE_RUNS {
        let conns = warm(addr, "/restate/health", 1).await;
        lone.extend(fire(conns, format!("floor-lone-{i}")).await.done);
    }
    lone.sort();
    let conns = warm(addr, "/restate/health", runs).await;
    let tree0 = tree_cpu();
    let mut f = fire(conns, "floor-load".into()).await;
    println!(
        "floor: CPU during the load: {}",
        cpu_by_command(&tree0, &tree_cpu())
    );
    f.lone = lone.get(lone.len() / 2).copied().unwrap_or_default();
    f
}

/// The machine's load averages (1, 5, 15 minutes), as /proc/loadavg gives them.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
