//! A real PostgreSQL server on loopback for the tests of `tether-restate`'s shared record: the
//! machine's own server binaries (Debian's `postgresql` package, under
//! `/usr/lib/postgresql/<version>/bin`), a fresh cluster in a temp dir per server. A missing
//! server fails the test with how to install it, never a silent pass.
//!
//! PostgreSQL refuses to run as root: when the tests run as root (as CI does), the cluster
//! belongs to the `postgres` user the package creates, and its commands run through `runuser`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::restate::free_port;

/// How long a server may take to accept connections on a busy machine.
pub const STARTUP: Duration = Duration::from_secs(60);

/// The directory of the newest installed PostgreSQL's server binaries.
///
/// # Panics
/// When none is installed, saying how to install one.
pub fn bin_dir() -> PathBuf {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((version, bin))
        })
        .collect();
    found.sort();
    match found.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "no PostgreSQL server under /usr/lib/postgresql: install Debian's `postgresql` package \
             (apt-get install postgresql; scripts/test does)"
        ),
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions and touches no memory.
    unsafe { libc::geteuid() == 0 }
}

/// `program` with `args`, as the `postgres` user when this process is root.
fn command(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// One PostgreSQL server; stopped at once (SIGQUIT, its immediate shutdown, which also frees its
/// shared memory; SIGKILL after 5 s) and its files removed when dropped.
pub struct Postgres {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
    dir: tempfile::TempDir,
}

impl Postgres {
    /// A new cluster (user `tether`, trusted on loopback, fsync off: a test's server need not
    /// survive a power cut), accepting connections.
    ///
    /// # Panics
    /// When PostgreSQL is missing or does not start within [`STARTUP`] (with its log).
    pub async fn start() -> Postgres {
        Postgres::start_with(false).await
    }

    /// As [`Postgres::start`], with PostgreSQL's default durability (fsync on, every commit
    /// flushed): for benchmarks, which must not flatter the database.
    ///
    /// # Panics
    /// As [`Postgres::start`].
    pub async fn start_durable() -> Postgres {
        Postgres::start_with(true).await
    }

    async fn start_with(durable: bool) -> Postgres {
        let bin = bin_dir();
        let dir = tempfile::Builder::new()
            .prefix("tether-pg-")
            .tempdir()
            .expect("tempdir");
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:"])
                .arg(dir.path())
                .status()
                .is_ok_and(|s| s.success());
            assert!(
                ok,
                "chown of the PostgreSQL test directory to the postgres user failed"
            );
        }
        let data = dir.path().join("data");
        let out = command(&bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-A", "trust", "-U", "tether", "--no-sync", "-E", "UTF8"])
            .stdin(Stdio::null())
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let port = free_port();
        let log = dir.path().join("postgres.log");
        let log_file = std::fs::File::create(&log).expect("log file");
        if is_root() {
            let _ = Command::new("chown").arg("postgres:").arg(&log).status();
        }
        // Its own process group: `runuser` starts the server as its child.
        let child = command(&bin.join("postgres"))
            .process_group(0)
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-k"])
            .arg(dir.path())
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "max_connections=200"])
            .args(if durable {
                &[][..]
            } else {
                &["-c", "fsync=off"][..]
            })
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("log"))
            .stderr(log_file)
            .spawn()
            .expect("spawn postgres");
        let pg = Postgres { child, port, dir };
        let started = Instant::now();
        loop {
            let ready = Command::new(bin.join("pg_isready"))
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &port.to_string(),
                    "-U",
                    "tether",
                    "-d",
                    "postgres",
                    "-q",
                ])
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                break;
            }
            assert!(
                started.elapsed() < STARTUP,
                "PostgreSQL did not accept connections within {STARTUP:?}: {}",
                pg.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        pg
    }

    /// A libpq connection string to its `postgres` database.
    pub fn connection(&self) -> String {
        format!("host=127.0.0.1 port={} user=tether dbname=postgres", self.port)
    }

    /// The server's log so far (for a failing assertion's message).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let group = i32::try_from(self.child.id()).ok();
        if let Some(pid) = group {
            // SAFETY: kill(2) on the process group this test started; no memory is involved.
            unsafe { libc::kill(-pid, libc::SIGQUIT) };
        }
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(5) {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(pid) = group {
            // SAFETY: as above.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
