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

pub use tether_testkit::restate::{Restate, free_port};

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
    pub effects: PathBuf,
    /// Where the service serves its live events (`--live`), if anywhere.
    pub live: Option<String>,
    /// The PostgreSQL database its records are kept in (`--shared-record`), if any.
    pub shared: Option<String>,
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
            .arg("--effects")
            .arg(&c.effects)
            .args(c.live.iter().flat_map(|l| ["--live", l.as_str()]))
            .args(c.shared.iter().flat_map(|l| ["--shared-record", l.as_str()]))
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

/// The threads of the demo's agent, read through the ingress (the service must run: the reads
/// are its shared handlers).
pub fn store(ingress: &str) -> tether_restate::RestateStore {
    tether_restate::RestateStore::new(ingress, ["demo"]).expect("a store")
}

/// Checks a thread's record, read through the ingress (the service must run): sequence numbers
/// 1..=n without gap, ids unique; returns its events.
pub async fn check_record(ingress: &str, thread: &str) -> Vec<tether::Event> {
    use tether::{EventStore, ThreadStore};
    let store = store(ingress);
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
