//! One store per database file: an exclusive lock held for the store's life.
//!
//! Why a lock file next to the database (`<db>-lock`, beside SQLite's own `-wal` and `-shm`)
//! locked with `flock` (`std::fs::File::try_lock`), and not SQLite's own locking:
//!
//! - SQLite's `PRAGMA locking_mode = EXCLUSIVE` would also keep a second server out, but only
//!   after it has waited out its busy timeout, with "database is locked" and nothing saying who
//!   holds it; it also shuts out every reader, so the `sqlite3` shell could no longer inspect a
//!   running server's database. The lock file is taken at once, and names its holder.
//! - Locking the database file itself is unsafe: SQLite holds POSIX (`fcntl`) locks on it, and
//!   POSIX drops every such lock a process holds on a file when the process closes *any*
//!   descriptor of that file. A second open in the same process, failing and closing its
//!   descriptor, would silently release the first store's SQLite locks. A separate file has no
//!   such interaction.
//! - `flock` locks belong to the open file description, so a second open in the same process
//!   conflicts with the first exactly as one from another process does (POSIX locks would not:
//!   they are per process). The kernel drops the lock when the descriptor closes, which a crash
//!   or `SIGKILL` does: a dead holder never keeps a database locked, and there is no stale-lock
//!   cleanup to get wrong. The descriptor is close-on-exec, so a tool's child process does not
//!   keep the lock alive after the server has gone.
//! - WAL mode needs no change: the `-wal` and `-shm` files stay SQLite's; the lock file only
//!   says which store owns the database.
//!
//! The lock file's name comes from the database's canonical path (symlinks resolved), so two
//! names for one file share a lock. It holds the holder's pid and program name, for the error
//! the next opener gets; what it says is information, the lock itself is the `flock`. Deleting
//! the lock file while a server runs defeats the lock (a second server would lock a new file);
//! it is left in place when the store closes, which is harmless. On file systems without
//! `flock` (some network mounts) opening fails with [`StoreError::Lock`] rather than running
//! unlocked. In-memory databases are private to their connection and take no lock.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::StoreError;

/// The held lock: released when dropped (or when the process dies).
#[derive(Debug)]
pub(crate) struct DbLock {
    _file: File,
}

/// The lock file for the database at `db`.
fn lock_path(db: &Path) -> std::io::Result<PathBuf> {
    let real = match std::fs::canonicalize(db) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // Not created yet: resolve its directory (which must exist for SQLite too).
            let parent = db
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            let name = db.file_name().ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "the database path names no file",
                )
            })?;
            std::fs::canonicalize(parent)?.join(name)
        }
        Err(e) => return Err(e),
    };
    let mut s = real.into_os_string();
    s.push("-lock");
    Ok(s.into())
}

/// What the lock file says about its holder, for the error message.
fn describe_holder(file: &mut File) -> String {
    let mut text = String::new();
    let _ = file.take(256).read_to_string(&mut text);
    let pid: Option<u32> = text
        .lines()
        .find_map(|l| l.strip_prefix("pid "))
        .and_then(|p| p.trim().parse().ok());
    let Some(pid) = pid else {
        return "another process".into();
    };
    if pid == std::process::id() {
        return format!("another store in this process ({pid})");
    }
    match std::fs::read_to_string(format!("/proc/{pid}/comm")) {
        Ok(comm) => format!("process {pid} ({})", comm.trim()),
        Err(_) => format!("process {pid}"),
    }
}

impl DbLock {
    /// Takes the exclusive lock for the database at `db`, or says who holds it.
    pub(crate) fn acquire(db: &Path) -> Result<DbLock, StoreError> {
        let shown = db.display().to_string();
        let path = lock_path(db).map_err(|source| StoreError::Lock {
            path: shown.clone(),
            lock_file: format!("{shown}-lock"),
            source,
        })?;
        let lock_file = path.display().to_string();
        let io = |source| StoreError::Lock {
            path: shown.clone(),
            lock_file: lock_file.clone(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(StoreError::Locked {
                    path: shown.clone(),
                    lock_file: lock_file.clone(),
                    holder: describe_holder(&mut file),
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        // Ours now: say who holds it (best effort; the flock is the lock).
        let me = std::env::current_exe()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_default();
        let _ = file
            .set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .and_then(|_| write!(file, "pid {}\nprogram {me}\n", std::process::id()))
            .and_then(|()| file.flush());
        Ok(DbLock { _file: file })
    }
}
