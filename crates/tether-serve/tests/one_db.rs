//! Two `tether-serve` processes on one database (issue 11, item 5): both used to start, and
//! concurrent runs on one thread then stored two events under one sequence number. The second
//! must refuse to start, naming the file and the process holding it, while the first keeps
//! serving; once the first is killed, its lock is gone with it.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Generous: starting a debug binary on a loaded 2-core machine can be slow (and a second server
/// that starts, on the old code, is given this long to exit before it fails the test).
const DEADLINE: Duration = Duration::from_secs(30);
const TOKEN: &str = "one-db-test-token";

fn serve(dir: &Path, db: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tether-serve"));
    cmd.args(["--bind", "127.0.0.1:0", "--token", TOKEN, "--db"])
        .arg(db)
        .env_remove("TETHER_TOKEN")
        .current_dir(dir);
    cmd
}

/// A running server and the address it printed.
struct Running {
    child: Child,
    url: String,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &Path, db: &Path) -> Running {
    let child = serve(dir, db)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Owned by `Running` at once, so a failure below still kills and reaps it.
    let mut running = Running {
        child,
        url: String::new(),
    };
    let err = running.child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    loop {
        let line = rx
            .recv_timeout(DEADLINE)
            .unwrap_or_else(|e| panic!("tether-serve never said it was listening: {e}"));
        if let Some(rest) = line.split("listening on ").nth(1) {
            running.url = rest.split_whitespace().next().unwrap_or_default().to_owned();
            return running;
        }
    }
}

/// Runs `cmd` to its exit; a process still running after the deadline (a second server that
/// started) is killed and fails the test with what it printed.
fn exited(mut cmd: Command) -> std::process::Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            let out = rx.recv_timeout(DEADLINE).unwrap().unwrap();
            panic!(
                "the second server did not exit: it started on a database another server holds: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

async fn threads(url: &str) -> reqwest::StatusCode {
    reqwest::Client::new()
        .get(format!("{url}/v1/threads"))
        .bearer_auth(TOKEN)
        .timeout(DEADLINE)
        .send()
        .await
        .unwrap()
        .status()
}

#[tokio::test]
async fn a_second_server_on_the_same_database_refuses_to_start_and_the_first_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tether.db");
    let mut first = start(dir.path(), &db);
    assert_eq!(threads(&first.url).await, 200);

    let second = exited(serve(dir.path(), &db));
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&db.display().to_string())
            && err.contains("already in use")
            && err.contains(&format!("process {}", first.child.id())),
        "the message names the file and its holder: {err}"
    );
    assert!(!err.contains("listening on"), "{err}");

    // The first server still answers, from its database.
    assert_eq!(threads(&first.url).await, 200);
    assert!(
        first.child.try_wait().unwrap().is_none(),
        "the first is still running"
    );

    // A killed server leaves no lock behind: the next one starts.
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let third = start(dir.path(), &db);
    assert_eq!(threads(&third.url).await, 200);
}
