//! Session updates handled per second vs the raw rate of reading the same bytes line by line, in
//! the same run, two ways (prints both rates and their ratio for each; goal ≥ 0.7):
//!
//! 1. **In memory**: a fake agent in this process, over a 64 KiB `tokio::io::duplex` pipe, answers
//!    `initialize` and `session/new`, then writes `N` pre-generated `agent_message_chunk`
//!    notifications in answer to `session/prompt`. Raw = the same bytes through the same kind of
//!    pipe, read line by line (`read_until`) and nothing else. No producer cost at all: this
//!    compares handling with a `memchr`.
//! 2. **From a process**: the testkit's `fake-acp-agent` (built in release mode on first use, or
//!    `FAKE_ACP_AGENT=<path>`) over its stdout pipe. Raw = `fake-acp-agent --flood-raw M`, read line
//!    by line; handled = `tether-acp` spawning `fake-acp-agent` and prompting `flood M`, which
//!    writes the same bytes (each notification encoded as it is sent). Both rates are taken from
//!    the first flood line to the last, so process start-up and the handshake are not counted.
//!
//! `cargo bench -p tether-acp --bench update_throughput` (`ACP_BENCH_N` sets `N`, default 200,000;
//! `ACP_BENCH_PROCESS_N` sets `M`, default 1,000,000; `ACP_BENCH_ONLY=memory|process`).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tether_acp::schema::SessionUpdate;
use tether_acp::schema::{ContentBlock, NewSessionRequest, TextContent};
use tether_acp::{AcpClient, AcpUpdate, AgentCommand, ClientHandler, ClientOptions, SessionUpdateEvent};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

fn flood_bytes(session: &str, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * 160);
    for i in 0..n {
        out.extend_from_slice(
            format!(
                "{{\"jsonrpc\":\"2.0\",\"method\":\"session/update\",\"params\":{{\"sessionId\":\"{session}\",\"update\":{{\"sessionUpdate\":\"agent_message_chunk\",\"content\":{{\"type\":\"text\",\"text\":\"chunk number {i} of the flood\"}}}}}}}}\n"
            )
            .as_bytes(),
        );
    }
    out
}

/// Reads the bytes line by line through the same kind of pipe; returns lines per second.
async fn raw_rate(bytes: Arc<Vec<u8>>, n: usize) -> f64 {
    let (mut w, r) = tokio::io::duplex(64 * 1024);
    let start = Instant::now();
    let writer = tokio::spawn(async move {
        let _ = w.write_all(&bytes).await;
        let _ = w.shutdown().await;
    });
    let mut reader = BufReader::with_capacity(64 * 1024, r);
    let mut buf = Vec::with_capacity(256);
    let mut lines = 0usize;
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => lines += 1,
        }
    }
    let _ = writer.await;
    assert_eq!(lines, n);
    n as f64 / start.elapsed().as_secs_f64()
}

struct Counter(AtomicU64);

#[async_trait]
impl ClientHandler for Counter {
    async fn session_update(&self, event: &SessionUpdateEvent) {
        if let AcpUpdate::Known(_) = &event.update {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The fake agent: answers the handshake, then floods on `session/prompt`.
async fn fake_agent(
    client_out: tokio::io::DuplexStream,
    mut agent_out: tokio::io::DuplexStream,
    bytes: Arc<Vec<u8>>,
) {
    let mut lines = BufReader::new(client_out).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let v: serde_json::Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(_) => continue,
        };
        let id = v["id"].clone();
        let reply = match v["method"].as_str() {
            Some("initialize") => {
                serde_json::json!({"jsonrpc":"2.0","id":id,"result":{"protocolVersion":1,"agentCapabilities":{}}})
            }
            Some("session/new") => {
                serde_json::json!({"jsonrpc":"2.0","id":id,"result":{"sessionId":"bench"}})
            }
            Some("session/prompt") => {
                let _ = agent_out.write_all(&bytes).await;
                serde_json::json!({"jsonrpc":"2.0","id":id,"result":{"stopReason":"end_turn"}})
            }
            _ => continue,
        };
        let _ = agent_out.write_all(format!("{reply}\n").as_bytes()).await;
    }
}

/// Runs one prompt turn through the client; returns updates handled per second.
async fn handled_rate(bytes: Arc<Vec<u8>>, n: usize) -> f64 {
    let (client_w, agent_r) = tokio::io::duplex(64 * 1024);
    let (agent_w, client_r) = tokio::io::duplex(64 * 1024);
    tokio::spawn(fake_agent(agent_r, agent_w, bytes));
    let counter = Arc::new(Counter(AtomicU64::new(0)));
    let client = AcpClient::connect(client_r, client_w, counter.clone(), ClientOptions::default()).await;
    client.initialize().await.expect("initialize");
    let cwd = std::env::temp_dir();
    let s = client
        .new_session(NewSessionRequest::new(cwd))
        .await
        .expect("session/new");
    let start = Instant::now();
    let out = client
        .prompt_with_timeout(
            &s.session_id,
            vec![ContentBlock::Text(TextContent::new("flood"))],
            Some(Duration::from_secs(600)),
        )
        .await
        .expect("prompt");
    let elapsed = start.elapsed();
    assert_eq!(out.stop_reason_raw, "end_turn");
    assert_eq!(counter.0.load(Ordering::Relaxed), n as u64, "updates lost");
    n as f64 / elapsed.as_secs_f64()
}

/// Reads `fake-acp-agent --flood-raw n` line by line; lines per second from the first to the last.
async fn process_raw_rate(bin: &Path, n: usize) -> f64 {
    let mut child = tokio::process::Command::new(bin)
        .args(["--flood-raw", &n.to_string(), "fake-1"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn fake-acp-agent");
    let stdout = child.stdout.take().expect("stdout");
    let mut reader = BufReader::with_capacity(64 * 1024, stdout);
    let mut buf = Vec::with_capacity(256);
    let mut lines = 0usize;
    let mut first = None;
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                lines += 1;
                if lines == 1 {
                    first = Some(Instant::now());
                }
            }
        }
    }
    let elapsed = first.expect("no line").elapsed();
    let _ = child.wait().await;
    assert_eq!(lines, n);
    (n - 1) as f64 / elapsed.as_secs_f64()
}

/// Counts flood chunks (text starting `chunk `) and notes when the first and the `n`th arrived.
struct FloodCounter {
    n: u64,
    seen: AtomicU64,
    first: OnceLock<Instant>,
    last: OnceLock<Instant>,
}

#[async_trait]
impl ClientHandler for FloodCounter {
    async fn session_update(&self, event: &SessionUpdateEvent) {
        if let AcpUpdate::Known(u) = &event.update
            && let SessionUpdate::AgentMessageChunk(c) = u.as_ref()
            && let ContentBlock::Text(t) = &c.content
            && t.text.starts_with("chunk ")
        {
            let seen = self.seen.fetch_add(1, Ordering::Relaxed) + 1;
            if seen == 1 {
                let _ = self.first.set(Instant::now());
            }
            if seen == self.n {
                let _ = self.last.set(Instant::now());
            }
        }
    }
}

/// Spawns `fake-acp-agent` and prompts `flood n`; updates handled per second from the first to
/// the last.
async fn process_handled_rate(bin: &Path, n: usize) -> f64 {
    let counter = Arc::new(FloodCounter {
        n: n as u64,
        seen: AtomicU64::new(0),
        first: OnceLock::new(),
        last: OnceLock::new(),
    });
    let client = AcpClient::spawn(AgentCommand::new(bin), counter.clone(), ClientOptions::default())
        .await
        .expect("spawn fake-acp-agent");
    client.initialize().await.expect("initialize");
    let s = client
        .new_session(NewSessionRequest::new(std::env::temp_dir()))
        .await
        .expect("session/new");
    let out = client
        .prompt_with_timeout(
            &s.session_id,
            vec![ContentBlock::Text(TextContent::new(format!("flood {n}")))],
            Some(Duration::from_secs(600)),
        )
        .await
        .expect("prompt");
    assert_eq!(out.stop_reason_raw, "end_turn");
    assert_eq!(counter.seen.load(Ordering::Relaxed), n as u64, "updates lost");
    let (Some(first), Some(last)) = (counter.first.get(), counter.last.get()) else {
        panic!("no updates timed");
    };
    client.shutdown().await;
    (n - 1) as f64 / last.duration_since(*first).as_secs_f64()
}

fn best(v: &[f64]) -> f64 {
    v.iter().cloned().fold(0.0, f64::max)
}

fn main() {
    let env_n = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let n = env_n("ACP_BENCH_N", 200_000);
    let m = env_n("ACP_BENCH_PROCESS_N", 1_000_000);
    let only = std::env::var("ACP_BENCH_ONLY").unwrap_or_default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    if only != "process" {
        let bytes = Arc::new(flood_bytes("bench", n));
        rt.block_on(async {
            // Warm up both paths once.
            let _ = raw_rate(bytes.clone(), n).await;
            let _ = handled_rate(bytes.clone(), n).await;
            let mut raw = Vec::new();
            let mut handled = Vec::new();
            for _ in 0..3 {
                raw.push(raw_rate(bytes.clone(), n).await);
                handled.push(handled_rate(bytes.clone(), n).await);
            }
            let (r, h) = (best(&raw), best(&handled));
            println!(
                "in memory: {n} updates per run ({} bytes), best of 3",
                bytes.len()
            );
            println!("  raw line reading:         {r:>12.0} lines/s");
            println!("  session updates handled:  {h:>12.0} updates/s");
            println!("  ratio handled/raw:        {:>12.3} (goal >= 0.7)", h / r);
        });
    }
    if only != "memory" {
        let bin = tether_testkit::peers::fake_acp_agent();
        rt.block_on(async {
            let _ = process_raw_rate(&bin, m / 10).await;
            let _ = process_handled_rate(&bin, m / 10).await;
            let mut raw = Vec::new();
            let mut handled = Vec::new();
            for _ in 0..3 {
                raw.push(process_raw_rate(&bin, m).await);
                handled.push(process_handled_rate(&bin, m).await);
            }
            let (r, h) = (best(&raw), best(&handled));
            println!("from a fake-acp-agent process: {m} updates per run, best of 3");
            println!("  raw line reading:         {r:>12.0} lines/s");
            println!("  session updates handled:  {h:>12.0} updates/s");
            println!("  ratio handled/raw:        {:>12.3} (goal >= 0.7)", h / r);
        });
    }
}
