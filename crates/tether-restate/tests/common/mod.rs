//! A real Restate server (installed from npm by `conformance/restate/setup.sh`) and the real
//! `tether-restate-demo` service process, on loopback, for the integration tests.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long something that must happen may take on a busy machine.
pub const PATIENCE: Duration = Duration::from_secs(120);

fn conformance_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../conformance/restate")
}

/// The pinned restate-server binary; a missing one fails the test (never a silent skip).
pub fn restate_server_bin() -> PathBuf {
    let bin = conformance_dir().join("node_modules/.bin/restate-server");
    assert!(
        bin.exists(),
        "the Restate server is not installed at {}: run conformance/restate/setup.sh (scripts/test does)",
        bin.display()
    );
    bin
}

/// A free port on 127.0.0.1 (bound, then released for the process that will listen on it).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// Polls `f` until it returns `Some`, every 20 ms, for up to [`PATIENCE`].
pub async fn until<T>(what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(t) = f().await {
            return t;
        }
        assert!(
            start.elapsed()
                < PATIENCE.min(Duration::from_secs(
                    std::env::var("PATIENCE_S")
                        .ok()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(120)
                )),
            "timed out after {PATIENCE:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A single-node Restate server; killed when dropped.
pub struct Restate {
    child: Child,
    pub admin: String,
    pub ingress: String,
    _dir: tempfile::TempDir,
}

impl Restate {
    /// A single-node server.
    pub async fn start() -> Restate {
        let fabric = free_port();
        Restate::start_node("n1", fabric, None).await
    }

    /// A cluster of `n` nodes on loopback, replication 2 (logs and partitions), the first node
    /// provisioning it; returns once every node is healthy.
    pub async fn start_cluster(n: usize) -> Vec<Restate> {
        let fabrics: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let addresses: Vec<String> = fabrics
            .iter()
            .map(|p| format!("\"http://127.0.0.1:{p}\""))
            .collect();
        let cluster = |i: usize| {
            format!(
                "cluster-name = \"tether-test\"\ndefault-replication = 2\nauto-provision = {}\n",
                i == 0
            )
        };
        let tables = format!(
            "\n[metadata-client]\naddresses = [{}]\n\n[bifrost]\ndefault-provider = \"replicated\"\n",
            addresses.join(", ")
        );
        let starts = (0..n).map(|i| {
            let extra = (cluster(i), tables.clone());
            let fabric = fabrics[i];
            async move { Restate::start_node(&format!("n{}", i + 1), fabric, Some(extra)).await }
        });
        futures_util::future::join_all(starts).await
    }

    /// One node: `cluster` is (top-level keys, tables) added to `conformance/restate/restate.toml`.
    async fn start_node(name: &str, fabric: u16, cluster: Option<(String, String)>) -> Restate {
        let bin = restate_server_bin();
        let dir = tempfile::tempdir().expect("tempdir");
        let (admin, ingress) = (free_port(), free_port());
        let base = std::fs::read_to_string(conformance_dir().join("restate.toml")).expect("restate.toml");
        let (top, tables) = cluster.unwrap_or_default();
        // Top-level keys before the base file's tables, tables after.
        let config = dir.path().join("restate.toml");
        std::fs::write(&config, format!("{top}\n{base}\n{tables}")).expect("write config");
        let log = std::fs::File::create(dir.path().join("restate.log")).expect("log file");
        // Its own process group: `node_modules/.bin/restate-server` is a launcher that starts the
        // server as its child, and killing the launcher alone left the server running.
        use std::os::unix::process::CommandExt;
        let child = Command::new(bin)
            .process_group(0)
            .arg("--no-logo")
            .args(["--listen-mode", "tcp"])
            .arg("--config-file")
            .arg(&config)
            .arg("--base-dir")
            .arg(dir.path())
            .args(["--node-name", name])
            .env("RESTATE_ADMIN__BIND_ADDRESS", format!("127.0.0.1:{admin}"))
            .env("RESTATE_INGRESS__BIND_ADDRESS", format!("127.0.0.1:{ingress}"))
            .env("RESTATE_BIND_ADDRESS", format!("127.0.0.1:{fabric}"))
            .env("RESTATE_ADVERTISED_ADDRESS", format!("http://127.0.0.1:{fabric}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn restate-server");
        let r = Restate {
            child,
            admin: format!("http://127.0.0.1:{admin}"),
            ingress: format!("http://127.0.0.1:{ingress}"),
            _dir: dir,
        };
        let client = reqwest::Client::new();
        let health = format!("{}/health", r.admin);
        let ingress_health = format!("{}/restate/health", r.ingress);
        until("the Restate server to be healthy", async || {
            let a = client.get(&health).send().await.ok()?;
            let i = client.get(&ingress_health).send().await.ok()?;
            (a.status().is_success() && i.status().is_success()).then_some(())
        })
        .await;
        r
    }

    /// SIGKILLs the node.
    pub fn kill(mut self) {
        self.kill_group();
        let _ = self.child.wait();
    }

    /// SIGKILLs the launcher's process group (the server with it).
    fn kill_group(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) on the process group this test started; no memory is involved.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
        let _ = self.child.kill();
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("restate.log")).unwrap_or_default()
    }
}

impl Drop for Restate {
    fn drop(&mut self) {
        self.kill_group();
        let _ = self.child.wait();
    }
}

/// The tether thread service (`tether-restate-demo`), a real subprocess.
pub struct Service {
    child: Child,
}

/// What the service is started with.
#[derive(Clone)]
pub struct ServiceConfig {
    pub listen: String,
    pub admin: String,
    pub model_url: String,
    pub db: PathBuf,
    pub effects: PathBuf,
    /// Where the service serves its live events (`--live`), if anywhere.
    pub live: Option<String>,
}

impl Service {
    /// Starts the service and waits until it says it registered with Restate.
    pub fn start(c: &ServiceConfig) -> Service {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tether-restate-demo"))
            .args([
                "--listen",
                &c.listen,
                "--admin",
                &c.admin,
                "--model-url",
                &c.model_url,
            ])
            .arg("--db")
            .arg(&c.db)
            .arg("--effects")
            .arg(&c.effects)
            .args(c.live.iter().flat_map(|l| ["--live", l.as_str()]))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn tether-restate-demo");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line == "ready" {
                    let _ = tx.send(());
                }
            }
        });
        rx.recv_timeout(PATIENCE)
            .expect("tether-restate-demo did not register with Restate");
        Service { child }
    }

    /// SIGKILLs the service (no chance to finish or flush anything).
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Calls a handler of the thread object through the ingress (no body when `body` is null) and
/// returns (status, body).
pub async fn call(ingress: &str, thread: &str, handler: &str, body: &Value) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{ingress}/TetherThread/{thread}/{handler}"))
        .timeout(PATIENCE);
    // A handler without input takes no body at all.
    if !body.is_null() {
        req = req.json(body);
    }
    let r = req.send().await.expect("ingress call");
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

/// Starts a turn without waiting for it; returns its invocation id.
pub async fn send_turn(ingress: &str, thread: &str, body: &Value) -> String {
    let (status, v) = call(ingress, thread, "turn/send", body).await;
    assert!(status < 300, "turn/send: {status} {v}");
    v["invocationId"].as_str().expect("invocationId").to_owned()
}

/// Waits for an invocation's result; returns (status, body).
pub async fn attach(ingress: &str, invocation: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .get(format!("{ingress}/restate/invocation/{invocation}/attach"))
        .timeout(PATIENCE)
        .send()
        .await
        .expect("attach");
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

/// The lines of the effects file (each tool run appends one).
pub fn effects(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Checks a thread's record: sequence numbers 1..=n without gap, ids unique; returns its events.
pub async fn check_record(db: &Path, thread: &str) -> Vec<tether::Event> {
    use tether::{EventStore, ThreadStore};
    let store = tether_sqlite::SqliteStore::open(db).expect("open the record");
    let t = store
        .thread(&tether::ThreadId::new(thread).expect("id"))
        .await
        .expect("thread")
        .expect("the thread is recorded");
    let events = store.load(&t.record).await.expect("load");
    let seqs: Vec<u64> = events.iter().map(|e| e.seq.unwrap_or(0)).collect();
    let want: Vec<u64> = (1..=events.len() as u64).collect();
    assert_eq!(seqs, want, "the record of {thread} has a gap or a duplicate");
    let mut ids: Vec<&str> = events.iter().map(|e| e.id.as_str()).collect();
    ids.sort_unstable();
    let n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), n, "the record of {thread} repeats an event id");
    events
}
