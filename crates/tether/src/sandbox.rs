//! Confinement of the commands tether runs, and the one process runner that spawns them.
//!
//! Every command an agent can start — the workspace's `run_command`, ACP terminals, and the
//! shell-command tools of `tether serve` — is started by [`Sandbox::spawn`] (a live process) or
//! [`Sandbox::run`] (run to completion with an output cap and a timeout). That is the one place
//! where a command is spawned, confined, capped, timed out and killed.
//!
//! # What is confined (Linux, [`SandboxMode::Auto`] or [`SandboxMode::Require`])
//!
//! Applied in the child between `fork` and `exec`, with the ruleset and the filter built before
//! the fork (the child only makes system calls):
//! - **Writes**: only beneath the writable roots ([`CommandSpec::writable`]: the workspace root,
//!   plus [`Sandbox::writable`] extras), a private temporary directory made for the call
//!   (`$TMPDIR`, `$TMP` and `$TEMP` point at it; it is removed when the process ends) and
//!   `/dev/null`; device nodes cannot be made anywhere. Enforced by Landlock (filesystem rights
//!   of ABI 1–5).
//! - **Reads and execution**: the whole filesystem, read-only (as Codex CLI does), except `/dev`,
//!   where only `null`, `zero`, `full`, `random` and `urandom` are readable (so a command cannot
//!   read the user's terminal, `/dev/pts/*`). Directory listing is allowed everywhere.
//! - **Network**, unless [`Sandbox::allow_network`]: `socket()` of any family but `AF_UNIX` fails
//!   with `EPERM` (seccomp: no TCP, UDP, ICMP, raw or packet sockets, no netlink), and Landlock
//!   refuses every TCP `bind`/`connect` as a second layer (ABI 4).
//! - **Other processes**: Landlock scopes (ABI 6) stop the command signalling processes outside
//!   its sandbox (tether itself included) and connecting to abstract UNIX sockets created
//!   outside it; Landlock forbids `ptrace` of processes outside it.
//! - **Kernel interfaces a shell command has no business with** fail with `EPERM` (seccomp):
//!   io_uring (it could open sockets behind the `socket()` filter), `bpf`, `perf_event_open`,
//!   kernel modules, `kexec`, `reboot`, swap, mounts, and the kernel keyrings.
//! - **No controlling terminal**: the command runs in a session of its own (`setsid`), so it
//!   cannot open `/dev/tty` to draw on or read from the user's terminal, and its whole process
//!   group is killed when the call ends, times out, is cancelled or its future is dropped.
//! - **Dies with tether** (Linux): the command gets `SIGKILL` when tether's thread that
//!   started it ends (`PR_SET_PDEATHSIG`), so a killed or crashed tether leaves no command
//!   running on (its own children, if it started any, are not covered).
//! - **Secrets in the environment**: inherited variables whose name contains `KEY`, `TOKEN`,
//!   `SECRET`, `PASSWORD` or `CREDENTIAL` (API keys, `TETHER_TOKEN`) are not passed on. Variables
//!   the caller sets in [`CommandSpec::env`] always are.
//!
//! # What is not confined
//! - Reading: any file the user can read outside `/dev` (e.g. `~/.ssh`) can be read; without
//!   network the only way out is the command's output, which goes to the model.
//! - Pathname UNIX sockets stay reachable (Landlock ABI 7 does not cover `connect` to them): a
//!   local daemon listening on one (Docker, systemd-resolved, an ssh-agent) is a way out.
//! - A process that leaves the command's session (`setsid`) survives the group kill.
//! - CPU, memory and disk use are not limited (only the time and the kept output).
//! - Run as root, the command keeps root's other capabilities (e.g. changing the clock);
//!   Landlock and the filter above apply to root too.
//!
//! # Without Landlock
//! On a kernel without Landlock (before 5.13, or not in the `lsm=` list), or on another OS,
//! [`SandboxMode::Auto`] runs commands unconfined (only the process-group kill and the
//! environment scrubbing apply) and [`Sandbox::warning`] says so once; [`SandboxMode::Require`]
//! refuses to run them. [`SandboxMode::Off`] never confines and passes the environment on whole.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::handler::{ExitStatus, HandlerError};

/// Whether commands are confined, and what happens where the kernel cannot confine them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum SandboxMode {
    /// Confined where the kernel supports it; elsewhere run unconfined, with a warning once.
    #[default]
    Auto,
    /// Confined, or refused: where the kernel cannot confine a command, it is not run.
    Require,
    /// Never confined, and the environment passed on whole (the process-group kill, the
    /// private `$TMPDIR` and the output cap still apply).
    Off,
}

impl SandboxMode {
    /// The name used in flags and configuration (`auto`, `require`, `off`).
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxMode::Auto => "auto",
            SandboxMode::Require => "require",
            SandboxMode::Off => "off",
        }
    }
}

impl std::fmt::Display for SandboxMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SandboxMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(SandboxMode::Auto),
            "require" => Ok(SandboxMode::Require),
            "off" => Ok(SandboxMode::Off),
            other => Err(format!(
                "unknown sandbox mode `{other}`: use auto, require or off"
            )),
        }
    }
}

/// What the running kernel lets tether confine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Support {
    /// The Landlock ABI version (0: no Landlock).
    pub landlock_abi: u32,
    /// Whether a seccomp filter can be installed on this architecture and kernel.
    pub seccomp: bool,
}

impl Support {
    /// The running kernel's support, probed once.
    pub fn current() -> Support {
        static SUPPORT: OnceLock<Support> = OnceLock::new();
        *SUPPORT.get_or_init(probe)
    }

    /// Whether commands can be confined (filesystem writes by Landlock, network by seccomp).
    pub fn confines(&self) -> bool {
        self.landlock_abi >= 1 && self.seccomp
    }

    /// One line for people: what is and is not available.
    pub fn describe(&self) -> String {
        if self.landlock_abi == 0 {
            return "this kernel has no Landlock (it needs Linux 5.13 or later with `landlock` in the \
                    boot-time `lsm=` list)"
                .into();
        }
        if !self.seccomp {
            return "seccomp filters are not available here (unsupported architecture or kernel)".into();
        }
        let mut s = format!("Landlock ABI {}", self.landlock_abi);
        if self.landlock_abi < 4 {
            s.push_str(" (no TCP rules: the network is closed by seccomp alone)");
        }
        if self.landlock_abi < 6 {
            s.push_str(" (no signal scoping: a command can signal other processes of the user)");
        }
        s
    }
}

#[cfg(target_os = "linux")]
fn probe() -> Support {
    Support {
        landlock_abi: linux::landlock_abi(),
        seccomp: linux::seccomp_available(),
    }
}

#[cfg(not(target_os = "linux"))]
fn probe() -> Support {
    Support {
        landlock_abi: 0,
        seccomp: false,
    }
}

/// How the commands of a workspace or an agent are confined: the mode, the network, and the
/// extra writable directories. See the module docs for what is and is not confined.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sandbox {
    mode: SandboxMode,
    network: bool,
    writable: Vec<PathBuf>,
}

impl Sandbox {
    /// A sandbox in `mode`, without network, writable only beneath each command's own roots.
    pub fn new(mode: SandboxMode) -> Self {
        Sandbox {
            mode,
            network: false,
            writable: Vec::new(),
        }
    }

    /// Lets commands use the network (default: no network).
    pub fn allow_network(mut self, yes: bool) -> Self {
        self.network = yes;
        self
    }

    /// Adds a directory commands may write beneath (besides each command's own roots).
    pub fn writable(mut self, dir: impl Into<PathBuf>) -> Self {
        self.writable.push(dir.into());
        self
    }

    /// The mode.
    pub fn mode(&self) -> SandboxMode {
        self.mode
    }

    /// Whether commands may use the network.
    pub fn network(&self) -> bool {
        self.network
    }

    /// What to tell the user at start when commands will not be confined as configured: `None`
    /// when they will be (or when the mode is `off`, which the user chose).
    pub fn warning(&self) -> Option<String> {
        let s = Support::current();
        match self.mode {
            SandboxMode::Off => None,
            _ if s.confines() => None,
            SandboxMode::Auto => Some(format!(
                "commands run by the agent are NOT confined: {}. They can write anywhere you can \
                 and reach the network. Use `--sandbox require` (tether run) or `mode = \"require\"` \
                 in the agent's [sandbox] table (tether serve) to refuse commands instead.",
                s.describe()
            )),
            SandboxMode::Require => Some(format!(
                "commands will be refused: the sandbox is required but {}.",
                s.describe()
            )),
        }
    }

    /// Starts a command: confined per this sandbox, in a session and process group of its own,
    /// with stdout and stderr piped (and stdin piped when [`CommandSpec::stdin`] is set, else
    /// `/dev/null`). The returned [`Process`] kills the whole group when dropped.
    pub fn spawn(&self, spec: &CommandSpec) -> Result<Process, HandlerError> {
        let support = Support::current();
        let confine = match self.mode {
            SandboxMode::Off => false,
            _ if support.confines() => true,
            SandboxMode::Require => {
                return Err(HandlerError::Refused(format!(
                    "the sandbox is required but {}; the command was not run",
                    support.describe()
                )));
            }
            _ => {
                static WARNED: AtomicBool = AtomicBool::new(false);
                if !WARNED.swap(true, Ordering::Relaxed) {
                    tracing::warn!("running a command unconfined: {}", support.describe());
                }
                false
            }
        };
        let tmp = TempDir::create()
            .map_err(|e| HandlerError::Failed(format!("could not make a temporary directory: {e}")))?;
        let mut cmd = tokio::process::Command::new(&spec.program);
        cmd.args(&spec.args)
            .current_dir(&spec.cwd)
            .stdin(if spec.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if self.mode != SandboxMode::Off {
            for (k, _) in std::env::vars_os() {
                if is_secret_name(&k) {
                    cmd.env_remove(&k);
                }
            }
        }
        cmd.env("TMPDIR", &tmp.0).env("TMP", &tmp.0).env("TEMP", &tmp.0);
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        #[cfg(target_os = "linux")]
        {
            let prepared = if confine {
                let mut writable: Vec<&Path> = spec.writable.iter().map(PathBuf::as_path).collect();
                writable.extend(self.writable.iter().map(PathBuf::as_path));
                writable.push(&tmp.0);
                Some(linux::prepare(&writable, self.network).map_err(|e| {
                    HandlerError::Failed(format!("could not build the command's sandbox: {e}"))
                })?)
            } else {
                None
            };
            let parent = std::process::id();
            // SAFETY: the closure only makes system calls (setsid, prctl, getppid,
            // landlock_restrict_self, seccomp) on data built before the fork; it allocates nothing
            // and takes no lock.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setsid() < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // The command dies with tether: a killed server's command must not go on
                    // (a late second effect of a tool the restarted server runs again, a forked
                    // child holding the server's files). The signal follows the thread that
                    // spawned it, which is a runtime worker living as long as tether's runtime;
                    // a `Process` dropped earlier kills the group anyway. A parent that died
                    // before the prctl is caught by the getppid check.
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    if libc::getppid() as u32 != parent {
                        return Err(std::io::Error::other("tether exited while starting the command"));
                    }
                    match &prepared {
                        Some(p) => p.apply_in_child(),
                        None => Ok(()),
                    }
                });
            }
        }
        #[cfg(all(unix, not(target_os = "linux")))]
        {
            let _ = confine;
            // SAFETY: setsid is async-signal-safe.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::setsid() < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        #[cfg(not(unix))]
        let _ = confine;
        let child = cmd.spawn().map_err(|e| {
            HandlerError::Failed(format!(
                "could not start `{}`: {e}",
                spec.program.to_string_lossy()
            ))
        })?;
        let pgid = child.id().and_then(|p| i32::try_from(p).ok());
        Ok(Process {
            child,
            group: GroupKiller(Arc::new(Mutex::new(pgid))),
            _tmp: tmp,
        })
    }

    /// Runs a command to completion: confined, its stdout and stderr kept together up to
    /// [`CommandSpec::output_cap`] bytes (the oldest dropped), killed with its whole process
    /// group at [`CommandSpec::timeout`] or when this future is dropped. Whatever the command
    /// left running in its group is killed when it exits.
    pub async fn run(&self, spec: &CommandSpec) -> Result<CommandOutput, HandlerError> {
        let mut p = self.spawn(spec)?;
        let buf = Arc::new(Mutex::new(OutputBuf::new(spec.output_cap)));
        let stdin = p.child.stdin.take();
        let out = p.child.stdout.take();
        let err = p.child.stderr.take();
        let input = spec.stdin.clone();
        let feed = async move {
            if let (Some(mut w), Some(bytes)) = (stdin, input) {
                // A command that does not read its input closes the pipe: not an error.
                let _ = w.write_all(&bytes).await;
            }
        };
        let drain = async {
            tokio::join!(feed, pump(out, buf.clone()), pump(err, buf.clone()));
        };
        let group = p.group.clone();
        let work = async {
            tokio::pin!(drain);
            let mut drained = false;
            let status = loop {
                tokio::select! {
                    s = p.child.wait() => break s,
                    () = &mut drain, if !drained => drained = true,
                }
            };
            // What the command left behind in its group dies with it; then the pipes close.
            group.kill();
            if !drained {
                // Only a process that left the group can still hold the pipes open.
                let _ = tokio::time::timeout(Duration::from_secs(2), &mut drain).await;
            }
            status
        };
        let (status, timed_out) = match tokio::time::timeout(spec.timeout, work).await {
            Ok(s) => (
                Some(s.map_err(|e| HandlerError::Failed(format!("waiting for the command failed: {e}")))?),
                false,
            ),
            Err(_) => {
                p.group.kill();
                let status = tokio::time::timeout(Duration::from_secs(5), p.child.wait())
                    .await
                    .ok()
                    .and_then(Result::ok);
                (status, true)
            }
        };
        // The group was killed when the command was reaped (or at the timeout, before the
        // wait): not again, seconds later, when its number may belong to another group.
        p.group.forget();
        let (output, truncated) = buf.lock().map(|b| b.text()).unwrap_or_default();
        Ok(CommandOutput {
            exit: status.map(exit_of).unwrap_or_default(),
            output,
            truncated,
            timed_out,
        })
    }
}

fn is_secret_name(name: &std::ffi::OsStr) -> bool {
    let n = name.to_string_lossy().to_ascii_uppercase();
    ["KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL"]
        .iter()
        .any(|w| n.contains(w))
}

async fn pump<R: tokio::io::AsyncRead + Unpin>(r: Option<R>, buf: Arc<Mutex<OutputBuf>>) {
    let Some(mut r) = r else { return };
    let mut chunk = [0u8; 8192];
    while let Ok(n) = r.read(&mut chunk).await {
        if n == 0 {
            break;
        }
        if let Ok(mut g) = buf.lock() {
            g.push(&chunk[..n]);
        }
    }
}

/// What to run: a program, its arguments and environment, where, and its bounds.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CommandSpec {
    /// The program (looked up in `PATH`).
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Variables set for it (on top of the inherited environment, never scrubbed).
    pub env: Vec<(OsString, OsString)>,
    /// The working directory.
    pub cwd: PathBuf,
    /// The directories it may write beneath (typically the workspace root).
    pub writable: Vec<PathBuf>,
    /// Bytes written to its stdin, then closed (`None`: stdin is `/dev/null`).
    pub stdin: Option<Vec<u8>>,
    /// The most output bytes kept by [`Sandbox::run`] (the oldest are dropped).
    pub output_cap: usize,
    /// How long [`Sandbox::run`] lets it run.
    pub timeout: Duration,
}

impl CommandSpec {
    /// `sh -c <script>` in `cwd`, writable beneath `cwd`, 64 KiB of output, 120 s.
    pub fn shell(script: &str, cwd: impl Into<PathBuf>) -> Self {
        let cwd = cwd.into();
        CommandSpec {
            program: "sh".into(),
            args: vec!["-c".into(), script.into()],
            env: Vec::new(),
            writable: vec![cwd.clone()],
            cwd,
            stdin: None,
            output_cap: 64 * 1024,
            timeout: Duration::from_secs(120),
        }
    }

    /// The same command with these variables set (on top of the inherited environment).
    pub fn with_env(mut self, env: Vec<(OsString, OsString)>) -> Self {
        self.env = env;
        self
    }

    /// The same command, writable beneath these directories only.
    pub fn with_writable(mut self, writable: Vec<PathBuf>) -> Self {
        self.writable = writable;
        self
    }

    /// The same command with `stdin` written to its standard input, then closed.
    pub fn with_stdin(mut self, stdin: Vec<u8>) -> Self {
        self.stdin = Some(stdin);
        self
    }

    /// The same command keeping at most `cap` output bytes.
    pub fn with_output_cap(mut self, cap: usize) -> Self {
        self.output_cap = cap;
        self
    }

    /// The same command, killed after `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// How a command run by [`Sandbox::run`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CommandOutput {
    /// Its exit code or the signal that ended it (both empty when it could not be reaped).
    pub exit: ExitStatus,
    /// Its stdout and stderr, as they arrived, lossily decoded as UTF-8.
    pub output: String,
    /// Whether older output was dropped to stay within the cap.
    pub truncated: bool,
    /// Whether it was killed at its timeout.
    pub timed_out: bool,
}

impl CommandOutput {
    /// Whether it exited with code 0.
    pub fn success(&self) -> bool {
        self.exit.exit_code == Some(0) && !self.timed_out
    }

    /// How it ended, in the one format every command tool reports (the workspace's
    /// `run_command`, `tether serve`'s command tools), for the model to read: `exit code: N`
    /// (or the signal that ended it, or `killed`) on the first line, then the output, then a
    /// note when older output was dropped at `spec`'s cap; a command killed at `spec`'s timeout
    /// says so instead. `what` names the command in that message. `Ok` only for exit code 0.
    pub fn report(&self, what: &str, spec: &CommandSpec) -> std::result::Result<String, String> {
        let mut text = if self.timed_out {
            format!(
                "{what} timed out after {:?} and was killed (with every process it started)\n{}",
                spec.timeout, self.output
            )
        } else {
            let status = match (&self.exit.exit_code, &self.exit.signal) {
                (Some(c), _) => c.to_string(),
                (None, Some(s)) => s.clone(),
                (None, None) => "killed".to_owned(),
            };
            format!("exit code: {status}\n{}", self.output)
        };
        if self.truncated {
            text.push_str(&format!(
                "\n[output truncated: only the last {} bytes kept]",
                spec.output_cap
            ));
        }
        if self.success() { Ok(text) } else { Err(text) }
    }
}

/// Kills a process group; shared so a terminal can be killed while another task waits on it.
#[derive(Debug, Clone)]
pub struct GroupKiller(Arc<Mutex<Option<i32>>>);

impl GroupKiller {
    /// Sends SIGKILL to every process of the group (nothing once disarmed).
    pub fn kill(&self) {
        #[cfg(unix)]
        if let Ok(g) = self.0.lock()
            && let Some(pgid) = *g
            && pgid > 1
        {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
    }

    /// Kills the group one last time and forgets it (its id may be reused from now on).
    pub fn disarm(&self) {
        self.kill();
        self.forget();
    }

    /// Forgets the group without a signal: for a caller that killed it when it reaped the
    /// command. Once the command is reaped and the group empty, its number is free, and
    /// (`pid_max` is often 32,768, and a busy machine wraps it) a later kill could reach a
    /// group that took it since.
    fn forget(&self) {
        if let Ok(mut g) = self.0.lock() {
            *g = None;
        }
    }
}

/// A running command started by [`Sandbox::spawn`]. Dropping it kills its whole process group
/// and removes its temporary directory.
#[derive(Debug)]
pub struct Process {
    /// The child (its pipes can be taken).
    pub child: tokio::process::Child,
    group: GroupKiller,
    _tmp: TempDir,
}

impl Process {
    /// A handle that kills the process group from elsewhere.
    pub fn killer(&self) -> GroupKiller {
        self.group.clone()
    }

    /// Waits for the command to exit, then kills whatever it left running in its group.
    pub async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        let s = self.child.wait().await;
        self.group.disarm();
        s.map(exit_of)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.group.kill();
    }
}

/// A private temporary directory for one command, removed when dropped.
#[derive(Debug)]
struct TempDir(PathBuf);

/// The prefix of a command's temporary directory (then the process id, a counter, a random
/// number).
const TEMP_PREFIX: &str = "tether-cmd-";

impl TempDir {
    fn create() -> std::io::Result<TempDir> {
        static N: AtomicU64 = AtomicU64::new(0);
        static SWEPT: OnceLock<()> = OnceLock::new();
        let base = std::env::temp_dir();
        // A process killed outright (SIGKILL, a crash) never dropped its commands' directories:
        // the first command of each process removes those of processes that are gone.
        SWEPT.get_or_init(|| sweep_stale(&base));
        for _ in 0..8 {
            let name = format!(
                "{TEMP_PREFIX}{}-{}-{:08x}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed),
                rand::random::<u32>()
            );
            let p = base.join(name);
            let mut b = std::fs::DirBuilder::new();
            #[cfg(unix)]
            std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
            match b.create(&p) {
                Ok(()) => return Ok(TempDir(p)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::other("no free temporary directory name"))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Removes from `base` the command directories of processes that no longer run: only a real
/// directory (not a symbolic link) named as [`TempDir::create`] names them, owned by this
/// process's user, whose process id has no `/proc` entry. Anything else in a shared temporary
/// directory, another user's or a live process's, is left alone. Linux only (elsewhere nothing
/// is removed); errors are ignored (a directory left behind costs a few bytes).
fn sweep_stale(base: &Path) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt;
        let Ok(me) = std::fs::metadata("/proc/self").map(|m| m.uid()) else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(base) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.strip_prefix(TEMP_PREFIX))
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok())
            else {
                continue;
            };
            let path = entry.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if !meta.is_dir() || meta.uid() != me || Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            let _ = std::fs::remove_dir_all(&path);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = base;
}

/// Output kept from a command: the last `limit` bytes.
#[derive(Debug, Default)]
pub(crate) struct OutputBuf {
    bytes: Vec<u8>,
    limit: usize,
    truncated: bool,
}

impl OutputBuf {
    pub(crate) fn new(limit: usize) -> Self {
        OutputBuf {
            bytes: Vec::new(),
            limit: limit.max(1),
            truncated: false,
        }
    }

    pub(crate) fn push(&mut self, chunk: &[u8]) {
        self.bytes.extend_from_slice(chunk);
        if self.bytes.len() > self.limit {
            let mut cut = self.bytes.len() - self.limit;
            // Keep the text valid UTF-8 by dropping a partial leading character.
            while cut < self.bytes.len() && (self.bytes[cut] & 0xC0) == 0x80 {
                cut += 1;
            }
            self.bytes.drain(..cut);
            self.truncated = true;
        }
    }

    pub(crate) fn text(&self) -> (String, bool) {
        (String::from_utf8_lossy(&self.bytes).into_owned(), self.truncated)
    }
}

/// The [`ExitStatus`] of a finished process.
pub(crate) fn exit_of(s: std::process::ExitStatus) -> ExitStatus {
    #[cfg(unix)]
    let signal = {
        use std::os::unix::process::ExitStatusExt;
        s.signal().map(|n| format!("signal {n}"))
    };
    #[cfg(not(unix))]
    let signal = None;
    ExitStatus {
        exit_code: s.code(),
        signal,
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::collections::BTreeMap;
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::path::Path;
    use std::sync::{Arc, OnceLock};

    use landlock::{
        ABI, Access, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, PathBeneath, PathFd, Ruleset,
        RulesetAttr, RulesetCreatedAttr, Scope,
    };
    use seccompiler::{
        BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
        SeccompRule, TargetArch,
    };

    /// The Landlock ABI tether's rules are written and tested for; newer kernels apply it as is.
    const ABI_TARGET: ABI = ABI::V7;

    /// Built before the fork; applied in the child.
    pub(super) struct Prepared {
        ruleset: Option<OwnedFd>,
        filter: Arc<BpfProgram>,
    }

    pub(super) fn landlock_abi() -> u32 {
        // SAFETY: LANDLOCK_CREATE_RULESET_VERSION with a null attribute only returns a number.
        let v = unsafe {
            libc::syscall(
                libc::SYS_landlock_create_ruleset,
                std::ptr::null::<u8>(),
                0usize,
                1u32, // LANDLOCK_CREATE_RULESET_VERSION
            )
        };
        u32::try_from(v).unwrap_or(0)
    }

    pub(super) fn seccomp_available() -> bool {
        // SAFETY: PR_GET_SECCOMP reads the calling thread's mode.
        let mode = unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) };
        mode >= 0 && filter(false).is_ok()
    }

    /// The filter for commands with or without network, compiled once.
    fn filter(network: bool) -> Result<Arc<BpfProgram>, String> {
        static WITH: OnceLock<Result<Arc<BpfProgram>, String>> = OnceLock::new();
        static WITHOUT: OnceLock<Result<Arc<BpfProgram>, String>> = OnceLock::new();
        let cell = if network { &WITH } else { &WITHOUT };
        cell.get_or_init(|| compile(network).map(Arc::new)).clone()
    }

    fn compile(network: bool) -> Result<BpfProgram, String> {
        let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(|e| e.to_string())?;
        let mut denied: Vec<i64> = vec![
            libc::SYS_io_uring_setup,
            libc::SYS_io_uring_enter,
            libc::SYS_io_uring_register,
            libc::SYS_bpf,
            libc::SYS_perf_event_open,
            libc::SYS_init_module,
            libc::SYS_finit_module,
            libc::SYS_delete_module,
            libc::SYS_kexec_load,
            libc::SYS_kexec_file_load,
            libc::SYS_reboot,
            libc::SYS_swapon,
            libc::SYS_swapoff,
            libc::SYS_mount,
            libc::SYS_umount2,
            libc::SYS_pivot_root,
            libc::SYS_move_mount,
            libc::SYS_open_tree,
            libc::SYS_fsopen,
            libc::SYS_fsmount,
            libc::SYS_fsconfig,
            libc::SYS_fspick,
            libc::SYS_add_key,
            libc::SYS_request_key,
            libc::SYS_keyctl,
        ];
        // x32 system calls share x86_64's audit arch with this bit set in the number.
        #[cfg(target_arch = "x86_64")]
        {
            const X32: i64 = 0x4000_0000;
            let x32: Vec<i64> = denied.iter().map(|n| n | X32).collect();
            denied.extend(x32);
        }
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
            denied.into_iter().map(|n| (n, Vec::new())).collect();
        if !network {
            // socket(domain, …) with any domain but AF_UNIX.
            let not_unix = || -> Result<Vec<SeccompRule>, String> {
                let cond =
                    SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, libc::AF_UNIX as u64)
                        .map_err(|e| e.to_string())?;
                Ok(vec![SeccompRule::new(vec![cond]).map_err(|e| e.to_string())?])
            };
            rules.insert(libc::SYS_socket, not_unix()?);
            #[cfg(target_arch = "x86_64")]
            rules.insert(libc::SYS_socket | 0x4000_0000, not_unix()?);
        }
        let f = SeccompFilter::new(
            rules,
            SeccompAction::Allow,
            SeccompAction::Errno(libc::EPERM as u32),
            arch,
        )
        .map_err(|e| e.to_string())?;
        BpfProgram::try_from(f).map_err(|e| e.to_string())
    }

    /// Builds the Landlock ruleset (read-only filesystem but `/dev`, writable `writable`, no TCP
    /// unless `network`, scoped signals and abstract sockets) and the seccomp filter.
    pub(super) fn prepare(writable: &[&Path], network: bool) -> Result<Prepared, String> {
        let filter = filter(network)?;
        let read = AccessFs::from_read(ABI_TARGET);
        let all = AccessFs::from_all(ABI_TARGET);
        // Never granted anywhere: a device node made in the workspace (by root) would open the
        // raw disk or memory beneath every rule.
        let writes = all & !(AccessFs::MakeChar | AccessFs::MakeBlock);
        let file_read: BitFlags<AccessFs> = AccessFs::ReadFile | AccessFs::Execute;
        let mut ruleset = Ruleset::default()
            .set_compatibility(CompatLevel::BestEffort)
            .handle_access(all)
            .map_err(|e| e.to_string())?;
        if !network {
            ruleset = ruleset
                .handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp)
                .map_err(|e| e.to_string())?;
        }
        let mut created = ruleset
            .scope(Scope::Signal | Scope::AbstractUnixSocket)
            .map_err(|e| e.to_string())?
            .create()
            .map_err(|e| e.to_string())?;
        let mut add = |path: &Path, access: BitFlags<AccessFs>| -> Result<(), String> {
            let Ok(fd) = PathFd::new(path) else {
                // Gone or unreadable: nothing to grant.
                return Ok(());
            };
            let access = if path.is_dir() {
                access
            } else {
                access & AccessFs::from_file(ABI_TARGET)
            };
            if access.is_empty() {
                return Ok(());
            }
            created
                .as_mut()
                .add_rule(PathBeneath::new(fd, access))
                .map(|_| ())
                .map_err(|e| format!("{}: {e}", path.display()))
        };
        // Listing any directory; reading and running everything but /dev.
        add(Path::new("/"), AccessFs::ReadDir.into())?;
        let top = std::fs::read_dir("/").map_err(|e| format!("/: {e}"))?;
        for entry in top.flatten() {
            if entry.file_name() == "dev" {
                continue;
            }
            add(&entry.path(), read)?;
        }
        for dev in ["/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"] {
            add(Path::new(dev), file_read)?;
        }
        add(
            Path::new("/dev/null"),
            AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::Truncate,
        )?;
        for w in writable {
            add(w, writes)?;
        }
        let ruleset: Option<OwnedFd> = created.into();
        Ok(Prepared { ruleset, filter })
    }

    impl Prepared {
        /// Restricts the calling (forked) process: no new privileges, the Landlock ruleset, the
        /// seccomp filter. Only system calls: safe between fork and exec.
        pub(super) fn apply_in_child(&self) -> std::io::Result<()> {
            // SAFETY: plain system calls on a file descriptor and a filter built before the fork.
            unsafe {
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(fd) = &self.ruleset
                    && libc::syscall(libc::SYS_landlock_restrict_self, fd.as_raw_fd(), 0u32) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            seccompiler::apply_filter(&self.filter)
                .map_err(|_| std::io::Error::from_raw_os_error(libc::EPERM))
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod sweep_tests {
    use super::{TEMP_PREFIX, sweep_stale};

    /// The directories of a process that is gone are removed; a live process's, a symbolic
    /// link named like one (and what it points to), and anything else are left.
    #[test]
    fn only_a_gone_processs_directories_are_swept() {
        let base = tempfile::tempdir().expect("a temporary directory");
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let gone = child.id();
        child.wait().expect("wait");
        let stale = base.path().join(format!("{TEMP_PREFIX}{gone}-0-deadbeef"));
        std::fs::create_dir(&stale).expect("mkdir");
        std::fs::write(stale.join("left.txt"), "x").expect("write");
        let live = base
            .path()
            .join(format!("{TEMP_PREFIX}{}-0-00000001", std::process::id()));
        std::fs::create_dir(&live).expect("mkdir");
        let target = base.path().join("precious");
        std::fs::create_dir(&target).expect("mkdir");
        std::fs::write(target.join("keep.txt"), "x").expect("write");
        let link = base.path().join(format!("{TEMP_PREFIX}{gone}-1-00000002"));
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        let other = base.path().join(format!("{TEMP_PREFIX}notapid"));
        std::fs::create_dir(&other).expect("mkdir");
        sweep_stale(base.path());
        assert!(!stale.exists(), "a gone process's directory is removed");
        for kept in [&live, &link, &other, &target.join("keep.txt")] {
            assert!(std::fs::symlink_metadata(kept).is_ok(), "{kept:?} is left");
        }
    }
}
