//! The `tether serve` benchmark (not a test): N concurrent AG-UI runs, each relaying D deltas
//! from the testkit's fake OpenAI server, from a load client on loopback; and, in the same run,
//! the same load read directly from the fake server.
//!
//! ```text
//! cargo build --release -p tether-serve --bin tether-serve --example fake_openai --example bench
//! target/release/examples/bench [RUNS=1000] [DELTAS=1000]
//! ```
//!
//! Client, server and fake model are three processes (the fake in bench mode serves the testkit's
//! `FakeOpenAi` directly, on its own runtime). Prints delivered deltas per second (the text
//! characters delivered: the model crate merges the deltas of one network read into one event, so
//! events are not deltas), SSE events per second, p50/p99 time to the first event (the first body
//! byte) and to the first text, and the peak resident memory (VmHWM) of the server process and of
//! the fake server process.

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
    failures: usize,
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
         peak RSS {:.1} MiB ({:.1} KiB per run); failures {}",
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
        f.failures,
    );
}

/// What an SSE body delivered: events, and the characters of the text fields the scanner looks
/// for (the fake's `"content"`, or `"delta"` of AG-UI `TEXT_MESSAGE_CONTENT`).
#[derive(Default)]
struct Scan {
    line: Vec<u8>,
    events: u64,
    chars: u64,
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
                let (events, chars) = scan_line(data, text);
                self.events += events;
                self.chars += chars;
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

/// Fires `runs` requests at once; scans every body.
async fn load(runs: usize, make: impl Fn(usize) -> reqwest::RequestBuilder, text: Text) -> Figures {
    let start = Instant::now();
    let tasks: Vec<_> = (0..runs)
        .map(|i| {
            let req = make(i);
            tokio::spawn(async move {
                let t0 = Instant::now();
                let resp = req.send().await.ok()?;
                let head = t0.elapsed();
                if !resp.status().is_success() {
                    return None;
                }
                let mut body = resp.bytes_stream();
                let mut first = None;
                let mut first_text = None;
                let mut scan = Scan::default();
                while let Some(chunk) = body.next().await {
                    let chunk = chunk.ok()?;
                    if first.is_none() && !chunk.is_empty() {
                        first = Some(t0.elapsed());
                    }
                    scan.feed(&chunk, text);
                    if first_text.is_none() && scan.chars > 0 {
                        first_text = Some(t0.elapsed());
                    }
                }
                Some((
                    first.unwrap_or_default(),
                    first_text.unwrap_or_default(),
                    head,
                    scan,
                ))
            })
        })
        .collect();
    let mut f = Figures {
        deltas: 0,
        events: 0,
        elapsed: Duration::ZERO,
        ttfe: Vec::new(),
        ttft: Vec::new(),
        ttfh: Vec::new(),
        failures: 0,
    };
    for t in tasks {
        match t.await.ok().flatten() {
            Some((ttfe, ttft, head, scan)) => {
                f.ttfh.push(head);
                f.ttfe.push(ttfe);
                f.ttft.push(ttft);
                f.deltas += scan.chars;
                f.events += scan.events;
            }
            None => f.failures += 1,
        }
    }
    f.elapsed = start.elapsed();
    f.ttfe.sort();
    f.ttft.sort();
    f.ttfh.sort();
    f
}

/// Opens `runs` keep-alive connections to `url`'s server (concurrent GETs of `url`; the answer
/// does not matter) and leaves them idle in the client's pool, so that a load then measures the
/// server's time to answer a request rather than the client's and the kernel's time to set up
/// 1,000 TCP connections at once.
async fn warm(client: &reqwest::Client, url: &str, runs: usize) -> usize {
    let tasks: Vec<_> = (0..runs)
        .map(|_| {
            let req = client.get(url);
            tokio::spawn(async move {
                let resp = req.send().await.ok()?;
                resp.bytes().await.ok().map(|_| ())
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        if matches!(t.await, Ok(Some(()))) {
            ok += 1;
        }
    }
    ok
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

    let (fake, fake_url) = spawn_until(
        Command::new(dir.join("fake_openai")).args(["bench", &deltas.to_string()]),
        "listening on ",
    )
    .await;
    let cfg = tmp.join("tether.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nmax_concurrent_runs = {}\n[agents.bench]\nbase_url = \"{fake_url}\"\nmodel = \"bench\"\n",
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
    let (server, server_url) = spawn_until(
        server_cmd
            .arg("--config")
            .arg(&cfg)
            .args(["--bind", "127.0.0.1:0", "--db"])
            .arg(tmp.join("bench.db")),
        "listening on ",
    )
    .await;
    let server_pid = server.id().unwrap_or(0);
    let fake_pid = fake.id().unwrap_or(0);
    let idle_server = vm_rss_kib(server_pid);
    let fresh = || {
        reqwest::Client::builder()
            .pool_max_idle_per_host(runs)
            .build()
            .expect("client")
    };
    let cores = std::thread::available_parallelism().map(usize::from).unwrap_or(0);
    println!("tether serve benchmark: {runs} concurrent runs x {deltas} deltas, {cores} cores, loopback");

    // Each load twice: on new connections (the figures include setting up 1,000 TCP connections
    // at once, client side and kernel), and on connections opened beforehand (the figures are the
    // server's: from writing the request to its first event).
    let mut direct = Vec::new();
    let mut fake_hwm = Vec::new();
    for warmed in [false, true] {
        reset_hwm(fake_pid);
        let c = fresh();
        if warmed {
            warm(&c, &format!("{fake_url}/models"), runs).await;
        }
        let url = format!("{fake_url}/chat/completions");
        direct.push(
            load(
                runs,
                move |_| {
                    c.post(&url).json(&serde_json::json!({"model": "bench", "stream": true, "messages": [{"role": "user", "content": "go"}]}))
                },
                Text::OpenAi,
            )
            .await,
        );
        fake_hwm.push(vm_hwm_kib(fake_pid));
    }

    let mut relayed = Vec::new();
    let mut server_hwm = Vec::new();
    for warmed in [false, true] {
        reset_hwm(server_pid);
        let c = fresh();
        if warmed {
            warm(&c, &format!("{server_url}/healthz"), runs).await;
        }
        let url = format!("{server_url}/v1/agents/bench/run");
        relayed.push(
            load(
                runs,
                move |i| {
                    c.post(&url)
                        .header("accept", "text/event-stream")
                        .json(&serde_json::json!({
                            "threadId": format!("bench-{i}-{warmed}-{}", std::process::id()), "runId": "r1",
                            "messages": [{"id": "u1", "role": "user", "content": "go"}]
                        }))
                },
                Text::AgUi,
            )
            .await,
        );
        server_hwm.push(vm_hwm_kib(server_pid));
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
        "server peak RSS {:.1} / {:.1} MiB total ({:.1} MiB idle before the load)",
        server_hwm[0] as f64 / 1024.0,
        server_hwm[1] as f64 / 1024.0,
        idle_server as f64 / 1024.0
    );
    drop(server);
    drop(fake);
    let _ = std::fs::remove_dir_all(&tmp);
}
