//! The `tether serve` benchmark (not a test): N concurrent AG-UI runs, each relaying D deltas
//! from the testkit's fake OpenAI server, from a load client on loopback; and, in the same run,
//! the same load read directly from the fake server.
//!
//! ```text
//! cargo build --release -p tether-serve --bin tether-serve --example fake_openai --example bench
//! target/release/examples/bench [RUNS=1000] [DELTAS=1000]
//! ```
//!
//! Prints relayed deltas per second, p50/p99 time to first event, and the peak resident memory
//! (VmHWM) of the server process and of the fake server process.

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
    deltas: u64,
    elapsed: Duration,
    ttfe: Vec<Duration>,
    failures: usize,
}

fn pct(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn report(name: &str, f: &Figures, hwm_kib: u64, runs: usize) {
    let secs = f.elapsed.as_secs_f64();
    println!(
        "{name}: {} deltas in {:.2}s = {:.0} deltas/s; time to first event p50 {:.1} ms, p99 {:.1} ms; \
         peak RSS {:.1} MiB ({:.1} KiB per run); failures {}",
        f.deltas,
        secs,
        f.deltas as f64 / secs,
        pct(&f.ttfe, 0.50).as_secs_f64() * 1e3,
        pct(&f.ttfe, 0.99).as_secs_f64() * 1e3,
        hwm_kib as f64 / 1024.0,
        hwm_kib as f64 / runs as f64,
        f.failures,
    );
}

/// Fires `runs` requests at once; counts occurrences of `needle` in every body.
async fn load(
    runs: usize,
    make: impl Fn(usize) -> reqwest::RequestBuilder,
    needle: &'static [u8],
) -> Figures {
    let start = Instant::now();
    let tasks: Vec<_> = (0..runs)
        .map(|i| {
            let req = make(i);
            tokio::spawn(async move {
                let t0 = Instant::now();
                let resp = req.send().await.ok()?;
                if !resp.status().is_success() {
                    return None;
                }
                let mut body = resp.bytes_stream();
                let mut first = None;
                let mut count = 0u64;
                let mut carry: Vec<u8> = Vec::new();
                while let Some(chunk) = body.next().await {
                    let chunk = chunk.ok()?;
                    if first.is_none() && !chunk.is_empty() {
                        first = Some(t0.elapsed());
                    }
                    carry.extend_from_slice(&chunk);
                    let mut from = 0;
                    while let Some(p) = find(&carry[from..], needle) {
                        count += 1;
                        from += p + needle.len();
                    }
                    let keep = carry.len().saturating_sub(needle.len());
                    carry.drain(..keep.max(from).min(carry.len()));
                }
                Some((first.unwrap_or_default(), count))
            })
        })
        .collect();
    let mut f = Figures {
        deltas: 0,
        elapsed: Duration::ZERO,
        ttfe: Vec::new(),
        failures: 0,
    };
    for t in tasks {
        match t.await.ok().flatten() {
            Some((ttfe, n)) => {
                f.ttfe.push(ttfe);
                f.deltas += n;
            }
            None => f.failures += 1,
        }
    }
    f.elapsed = start.elapsed();
    f.ttfe.sort();
    f
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
    let (server, server_url) = spawn_until(
        Command::new(bin.join("tether-serve"))
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
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(runs)
        .build()
        .expect("client");
    println!("tether serve benchmark: {runs} concurrent runs x {deltas} deltas, 2-core machine, loopback");

    let c = client.clone();
    let url = format!("{fake_url}/chat/completions");
    let direct = load(
        runs,
        move |_| {
            c.post(&url).json(&serde_json::json!({"model": "bench", "stream": true, "messages": [{"role": "user", "content": "go"}]}))
        },
        b"\"content\":\"x\"",
    )
    .await;
    let fake_hwm = vm_hwm_kib(fake_pid);

    let c = client.clone();
    let url = format!("{server_url}/v1/agents/bench/run");
    let relayed = load(
        runs,
        move |i| {
            c.post(&url)
                .header("accept", "text/event-stream")
                .json(&serde_json::json!({
                    "threadId": format!("bench-{i}-{}", std::process::id()), "runId": "r1",
                    "messages": [{"id": "u1", "role": "user", "content": "go"}]
                }))
        },
        b"TEXT_MESSAGE_CONTENT",
    )
    .await;
    let server_hwm = vm_hwm_kib(server_pid);
    report("direct read of the fake server", &direct, fake_hwm, runs);
    report(
        "relayed through tether serve  ",
        &relayed,
        server_hwm.saturating_sub(idle_server),
        runs,
    );
    println!(
        "server peak RSS {:.1} MiB total ({:.1} MiB idle before the load)",
        server_hwm as f64 / 1024.0,
        idle_server as f64 / 1024.0
    );
    drop(server);
    drop(fake);
    let _ = std::fs::remove_dir_all(&tmp);
}
