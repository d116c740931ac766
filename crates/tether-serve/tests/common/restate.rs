//! The Restate backend switch of the serve suite: with `TETHER_SERVE_BACKEND=restate` (and the
//! `restate` cargo feature) every [`super::Env`] starts a real single-node `restate-server`
//! (installed from npm by `conformance/restate/setup.sh`) and its configuration puts the agent's
//! turns on it, so the suite's scenarios run unchanged on that backend.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether this run of the suite is on the Restate backend.
pub fn enabled() -> bool {
    std::env::var("TETHER_SERVE_BACKEND").is_ok_and(|b| b == "restate")
}

fn conformance_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../conformance/restate")
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// A single-node Restate server; killed when dropped.
pub struct Restate {
    child: Child,
    pub admin: String,
    pub ingress: String,
    dir: tempfile::TempDir,
}

impl Restate {
    /// Starts a node (a missing server fails the test, never a silent skip) and waits until its
    /// admin API and ingress answer.
    pub async fn start() -> Restate {
        let bin = conformance_dir().join("node_modules/.bin/restate-server");
        assert!(
            bin.exists(),
            "the Restate server is not installed at {}: run conformance/restate/setup.sh (scripts/test does)",
            bin.display()
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let (admin, ingress, fabric) = (free_port(), free_port(), free_port());
        let config = dir.path().join("restate.toml");
        std::fs::copy(conformance_dir().join("restate.toml"), &config).expect("restate.toml");
        let log = std::fs::File::create(dir.path().join("restate.log")).expect("log file");
        // Its own process group: `node_modules/.bin/restate-server` is a launcher that starts the
        // server as its child, and the whole group must go when the test ends.
        use std::os::unix::process::CommandExt;
        let child = Command::new(bin)
            .process_group(0)
            .arg("--no-logo")
            .args(["--listen-mode", "tcp"])
            .arg("--config-file")
            .arg(&config)
            .arg("--base-dir")
            .arg(dir.path())
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
            dir,
        };
        let client = reqwest::Client::new();
        let started = Instant::now();
        loop {
            let a = client.get(format!("{}/health", r.admin)).send().await;
            let i = client.get(format!("{}/restate/health", r.ingress)).send().await;
            if a.is_ok_and(|a| a.status().is_success()) && i.is_ok_and(|i| i.status().is_success()) {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "the Restate server did not become healthy: {}",
                r.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        r
    }

    /// The `[server]` lines that put the agent's turns on this node (the service endpoint on a
    /// port of its own).
    pub fn server_lines(&self) -> String {
        format!(
            "backend = \"restate\"\nrestate_ingress = \"{}\"\nrestate_admin = \"{}\"\nrestate_listen = \"127.0.0.1:0\"\n",
            self.ingress, self.admin
        )
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("restate.log")).unwrap_or_default()
    }
}

impl Drop for Restate {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) on the process group this test started; no memory is involved.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
