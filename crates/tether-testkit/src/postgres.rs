//! A real PostgreSQL server on loopback for the tests of `tether-restate`'s shared record: the
//! machine's own server binaries (Debian's `postgresql` package, under
//! `/usr/lib/postgresql/<version>/bin`), a fresh cluster in a temp dir per server. A missing
//! server fails the test with how to install it, never a silent pass.
//!
//! PostgreSQL refuses to run as root: when the tests run as root (as CI does), the cluster
//! belongs to the `postgres` user the package creates, and its commands run through `runuser`.
//!
//! A test process killed outright (a timeout, a SIGKILL) cannot stop its server: the next
//! [`Postgres`] started on the machine stops the servers and removes the directories of test
//! processes that no longer run (each directory names its process in a file, `owner`).

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
        reap_orphans(&std::env::temp_dir());
        let dir = tempfile::Builder::new()
            .prefix(PREFIX)
            .tempdir()
            .expect("tempdir");
        let me = std::process::id();
        let owner = format!("{me} {}", process_start(me).unwrap_or(0));
        std::fs::write(dir.path().join(OWNER), owner).expect("the owner file");
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

/// The prefix of a server's directory under the temp dir.
const PREFIX: &str = "tether-pg-";
/// The file in a server's directory naming the process that started it: `<pid> <start time>`.
const OWNER: &str = "owner";

/// When process `pid` started (clock ticks after boot, `/proc/<pid>/stat`'s field 22), if it
/// runs (a zombie, dead but not yet reaped, does not): with the pid, it names one process,
/// whatever pid reuse does.
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces), the state first: field 22 of
    // the line is the 20th of these.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    if fields.next()? == "Z" {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// Whether process `pid` runs (exists and is not a zombie).
fn runs(pid: i32) -> bool {
    u32::try_from(pid).ok().and_then(process_start).is_some()
}

/// Stops the server and removes the directory of every test server under `tmp` whose test
/// process no longer runs. A directory without an owner file (one being set up) is left alone.
/// The server is signalled only if its command line names that directory, so a pid reused by
/// another process is never signalled.
fn reap_orphans(tmp: &Path) {
    for entry in std::fs::read_dir(tmp).into_iter().flatten().flatten() {
        let path = entry.path();
        // The entry's own type, not its target's: a link planted under the shared temp dir
        // would otherwise lead the reaper to read an owner and signal a process elsewhere.
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if !entry.file_name().to_string_lossy().starts_with(PREFIX) || !is_dir {
            continue;
        }
        let Ok(owner) = std::fs::read_to_string(path.join(OWNER)) else {
            continue;
        };
        let mut fields = owner.split_whitespace().map(|f| f.parse::<u64>().ok());
        let (Some(Some(pid)), Some(Some(start))) = (fields.next(), fields.next()) else {
            continue;
        };
        let alive = u32::try_from(pid)
            .ok()
            .and_then(process_start)
            .is_some_and(|s| s == start);
        if alive {
            continue;
        }
        let data = path.join("data");
        let server = std::fs::read_to_string(data.join("postmaster.pid"))
            .ok()
            .and_then(|p| p.lines().next().and_then(|l| l.trim().parse::<i32>().ok()));
        if let Some(server) = server {
            let cmdline = std::fs::read(format!("/proc/{server}/cmdline")).unwrap_or_default();
            let names_dir = String::from_utf8_lossy(&cmdline).contains(&*data.to_string_lossy());
            if names_dir {
                // Its immediate shutdown first; killed if it is still there after 5 s (a server
                // stuck, or a process that ignores SIGQUIT, as one started in the background of
                // a shell without job control does).
                for (signal, grace) in [(libc::SIGQUIT, 5), (libc::SIGKILL, 1)] {
                    // SAFETY: kill(2) on a process whose command line names this directory.
                    unsafe { libc::kill(server, signal) };
                    let asked = Instant::now();
                    while asked.elapsed() < Duration::from_secs(grace) && runs(server) {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    if !runs(server) {
                        break;
                    }
                }
            }
        }
        let _ = std::fs::remove_dir_all(&path);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory owned by a process that ran and is gone: its pid names no process with
    /// that start time.
    fn owned_by_the_dead(dir: &Path) {
        let mut gone = Command::new("true").spawn().expect("true");
        let _ = gone.wait();
        std::fs::write(dir.join(OWNER), format!("{} 1", gone.id())).expect("owner");
    }

    /// A stand-in "server" whose command line names `data` and whose pid the `postmaster.pid`
    /// in `pid_dir` gives, with SIGQUIT's default action whatever this test inherited (a shell
    /// without job control starts background commands with it ignored), and no pipe of ours
    /// held open by its sleeps.
    fn stand_in(data: &Path, pid_dir: &Path) -> std::process::Child {
        let mut server = Command::new("sh");
        server
            .args(["-c", "while :; do sleep 1; done"])
            .arg(data)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: signal(2) in the child before exec, async-signal-safe; no memory is touched.
        unsafe {
            server.pre_exec(|| {
                libc::signal(libc::SIGQUIT, libc::SIG_DFL);
                Ok(())
            });
        }
        let server = server.spawn().expect("sh");
        std::fs::write(
            pid_dir.join("postmaster.pid"),
            format!("{}\n{}\n", server.id(), data.display()),
        )
        .expect("postmaster.pid");
        server
    }

    /// A dead test process's directory goes, its server stopped (the process whose command line
    /// names the directory); a live process's directory, and one without an owner, stay.
    #[test]
    fn orphans_of_dead_test_processes_are_reaped() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let orphan = tmp.path().join("tether-pg-orphan");
        let data = orphan.join("data");
        std::fs::create_dir_all(&data).expect("dirs");
        owned_by_the_dead(&orphan);
        let mut server = stand_in(&data, &data);
        // A process that runs (this one), and a directory being set up (no owner yet).
        let live = tmp.path().join("tether-pg-live");
        std::fs::create_dir_all(&live).expect("dir");
        let me = std::process::id();
        std::fs::write(
            live.join(OWNER),
            format!("{me} {}", process_start(me).expect("mine")),
        )
        .expect("owner");
        let fresh = tmp.path().join("tether-pg-fresh");
        std::fs::create_dir_all(&fresh).expect("dir");

        reap_orphans(tmp.path());

        assert!(!orphan.exists(), "the dead process's directory is left");
        // Signalled and gone: reaped here (it is this test's child), at most 10 s later.
        let asked = Instant::now();
        let mut status = server.try_wait().expect("wait");
        while status.is_none() && asked.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
            status = server.try_wait().expect("wait");
        }
        assert!(
            status.is_some(),
            "its server still runs: stat {:?}, command line {:?}",
            std::fs::read_to_string(format!("/proc/{}/stat", server.id())),
            std::fs::read(format!("/proc/{}/cmdline", server.id()))
                .map(|c| String::from_utf8_lossy(&c).into_owned())
        );
        let _ = server.kill();
        assert!(
            live.exists() && fresh.exists(),
            "a live or unowned directory was removed"
        );
    }

    /// A link named like a server's directory is not followed: whatever it points to (here a
    /// dead owner and a "server" whose command line names the path through the link), nothing
    /// is signalled and nothing removed.
    #[test]
    fn a_planted_link_is_not_followed() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let target = tmp.path().join("elsewhere");
        std::fs::create_dir_all(target.join("data")).expect("dirs");
        owned_by_the_dead(&target);
        let link = tmp.path().join("tether-pg-planted");
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        let data = link.join("data");
        let mut victim = stand_in(&data, &target.join("data"));

        reap_orphans(tmp.path());

        // A signal would have ended it at once (SIGQUIT's default action).
        std::thread::sleep(Duration::from_millis(200));
        let status = victim.try_wait().expect("wait");
        let _ = victim.kill();
        let _ = victim.wait();
        assert!(
            status.is_none(),
            "the process named through the link was signalled"
        );
        assert!(
            link.symlink_metadata().is_ok() && target.join(OWNER).exists(),
            "the link or what it points to was removed"
        );
    }
}
