//! [`Workspace`]: a ready [`Handler`] serving files, searches and commands inside one root
//! directory, under a permission policy.
//!
//! The model-facing tools are `read_file`, `list_dir`, `search_files`, `write_file`, `edit_file`
//! and `run_command`; the same handler serves ACP's client-side file, terminal and permission
//! requests. Every path the file tools take is confined to the root: `..` that climbs out,
//! absolute paths elsewhere and symlinks that resolve outside are refused with
//! [`HandlerError::OutsideRoot`], and nothing is read or written. Only regular files are read,
//! written or searched (FIFOs, sockets and devices are refused or skipped, never waited on), a
//! read returns at most [`Workspace::read_cap`] bytes whatever its `line` and `limit`, and the
//! permission check comes before anything is opened.
//!
//! Commands (`run_command`, ACP terminals) are not confined by path checks: they run in the
//! [`Sandbox`] (see [`crate::sandbox`] for what it does and does not confine).

use std::collections::{HashMap, HashSet};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

use crate::handler::{
    Capabilities, ExitStatus, Handler, HandlerError, PermissionKind, PermissionOutcome, PermissionRequest,
    ReadTextFile, TerminalRequest, TerminalResponse, ToolOutput, WriteTextFile,
};
use crate::sandbox::{CommandSpec, GroupKiller, OutputBuf, Process, Sandbox, exit_of};
use crate::types::{SessionInfo, ToolSpec, ToolUse};

/// Whether a class of action is allowed, asked about, or refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Done without asking.
    Allow,
    /// Asked of the [`Approver`] each time (unless it answered "always").
    Ask,
    /// Refused.
    Deny,
}

/// The workspace's permission policy: reads, writes (write, edit, delete, move) and commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Policy {
    /// Reading and listing files, searching.
    pub reads: Access,
    /// Writing and editing files.
    pub writes: Access,
    /// Running commands.
    pub commands: Access,
}

impl Default for Policy {
    /// Reads allowed; writes and commands asked.
    fn default() -> Self {
        Policy {
            reads: Access::Allow,
            writes: Access::Ask,
            commands: Access::Ask,
        }
    }
}

impl Policy {
    /// A policy for reads, writes and commands.
    pub fn new(reads: Access, writes: Access, commands: Access) -> Self {
        Policy {
            reads,
            writes,
            commands,
        }
    }

    /// Everything allowed (`--yes`).
    pub fn allow_all() -> Self {
        Policy {
            reads: Access::Allow,
            writes: Access::Allow,
            commands: Access::Allow,
        }
    }

    /// Reads only; writes and commands refused.
    pub fn read_only() -> Self {
        Policy {
            reads: Access::Allow,
            writes: Access::Deny,
            commands: Access::Deny,
        }
    }
}

/// What the approver is asked.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ApprovalRequest {
    /// The class of action: `write`, `command`, or a provider's tool kind.
    pub class: String,
    /// One line for people (`write_file notes.txt (12 bytes)`).
    pub summary: String,
}

impl ApprovalRequest {
    /// A request of class `class` (`write`, `command`, ...) summarised in one line.
    pub fn new(class: impl Into<String>, summary: impl Into<String>) -> Self {
        ApprovalRequest {
            class: class.into(),
            summary: summary.into(),
        }
    }
}

/// The approver's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Approval {
    /// Allowed this once.
    Once,
    /// Allowed, and the same class is allowed for the rest of the session (for a permission
    /// request of a kind the workspace does not know, only the same request, by its title).
    Always,
    /// Refused.
    Deny,
}

/// Asks a person (or a policy) whether an action may happen.
#[async_trait]
pub trait Approver: Send + Sync + 'static {
    /// Answers one request.
    async fn approve(&self, req: &ApprovalRequest) -> Approval;
}

/// Refuses everything that is asked.
#[derive(Debug, Clone, Copy, Default)]
pub struct DenyAll;

#[async_trait]
impl Approver for DenyAll {
    async fn approve(&self, _req: &ApprovalRequest) -> Approval {
        Approval::Deny
    }
}

/// Allows everything that is asked.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApproveAll;

#[async_trait]
impl Approver for ApproveAll {
    async fn approve(&self, _req: &ApprovalRequest) -> Approval {
        Approval::Once
    }
}

struct TermState {
    output: Arc<Mutex<OutputBuf>>,
    process: Option<Process>,
    killer: GroupKiller,
    exit: Option<ExitStatus>,
    readers: Vec<tokio::task::JoinHandle<()>>,
}

/// Files, searches and commands inside a root directory, under a [`Policy`].
pub struct Workspace {
    root: PathBuf,
    policy: Policy,
    approver: Arc<dyn Approver>,
    output_cap: usize,
    read_cap: usize,
    command_timeout: Duration,
    sandbox: Sandbox,
    always: Mutex<HashSet<(String, String)>>,
    terminals: tokio::sync::Mutex<HashMap<String, TermState>>,
    next_terminal: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Workspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workspace")
            .field("root", &self.root)
            .field("policy", &self.policy)
            .field("sandbox", &self.sandbox)
            .finish()
    }
}

const SKIP_DIRS: &[&str] = &[".git", "target", "node_modules"];
/// Most entries `list_dir` shows.
const LIST_CAP: usize = 2000;
/// Largest file `search_files` looks into.
const SEARCH_FILE_CAP: u64 = 4 * 1024 * 1024;
/// Most matches `search_files` returns.
const SEARCH_MATCHES: usize = 200;

impl Workspace {
    /// A workspace over `root` (which must exist), with the default policy (reads allowed, writes
    /// and commands asked), an approver that refuses (set one with [`Workspace::approver`]), and
    /// commands confined by the default [`Sandbox`] (no network, writes beneath the root only).
    pub fn new(root: impl AsRef<Path>) -> std::io::Result<Self> {
        let root = root.as_ref().canonicalize()?;
        Ok(Workspace {
            root,
            policy: Policy::default(),
            approver: Arc::new(DenyAll),
            output_cap: 64 * 1024,
            read_cap: 256 * 1024,
            command_timeout: Duration::from_secs(120),
            sandbox: Sandbox::default(),
            always: Mutex::new(HashSet::new()),
            terminals: tokio::sync::Mutex::new(HashMap::new()),
            next_terminal: std::sync::atomic::AtomicU64::new(1),
        })
    }

    /// The permission policy.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Who answers what the policy asks.
    pub fn approver(mut self, approver: impl Approver) -> Self {
        self.approver = Arc::new(approver);
        self
    }

    /// The most output bytes kept from a command (default 64 KiB; older output is dropped).
    pub fn output_cap(mut self, bytes: usize) -> Self {
        self.output_cap = bytes.max(1);
        self
    }

    /// The most bytes one `read_file` returns, whatever its `line` and `limit` (default 256 KiB).
    pub fn read_cap(mut self, bytes: usize) -> Self {
        self.read_cap = bytes.max(1);
        self
    }

    /// How long `run_command` may run (default 120 s).
    pub fn command_timeout(mut self, d: Duration) -> Self {
        self.command_timeout = d;
        self
    }

    /// How commands (`run_command`, terminals) are confined (default: [`Sandbox::default`],
    /// confined where the kernel can, no network, writable beneath the root only).
    pub fn sandbox(mut self, sandbox: Sandbox) -> Self {
        self.sandbox = sandbox;
        self
    }

    /// The canonical root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Resolves `..` and `.` in a path given by an agent without touching the filesystem, and
    /// refuses it when it climbs out of the root.
    fn lexical(&self, path: &Path) -> Result<PathBuf, HandlerError> {
        let joined = if path.is_absolute() {
            path.to_path_buf()
        } else {
            self.root.join(path)
        };
        let mut out = PathBuf::new();
        for c in joined.components() {
            match c {
                Component::ParentDir => {
                    if !out.pop() {
                        return Err(outside(path));
                    }
                }
                Component::CurDir => {}
                other => out.push(other),
            }
        }
        if !out.starts_with(&self.root) {
            return Err(outside(path));
        }
        Ok(out)
    }

    /// Resolves a path given by an agent to a path inside the root, or refuses it.
    ///
    /// Relative paths are taken from the root; absolute ones must lie inside it. `..` is resolved
    /// lexically, then the longest existing prefix is resolved through symlinks; the result must
    /// still be inside the root. A dangling symlink is refused (writing through it could create a
    /// file outside). Files are then opened beneath the root without following any symlink, so a
    /// symlink swapped in after this check is refused too.
    pub fn resolve(&self, path: &Path) -> Result<PathBuf, HandlerError> {
        let out = self.lexical(path)?;
        let mut existing = out.clone();
        let mut rest = Vec::new();
        while std::fs::symlink_metadata(&existing).is_err() {
            match existing.file_name() {
                Some(n) => rest.push(n.to_os_string()),
                None => return Err(outside(path)),
            }
            if !existing.pop() {
                return Err(outside(path));
            }
        }
        let canon = existing
            .canonicalize()
            .map_err(|e| HandlerError::Refused(format!("{}: {e} (a dangling symlink?)", path.display())))?;
        if !canon.starts_with(&self.root) {
            return Err(outside(path));
        }
        let mut full = canon;
        for n in rest.into_iter().rev() {
            full.push(n);
        }
        Ok(full)
    }

    fn rel(&self, p: &Path) -> String {
        let r = p
            .strip_prefix(&self.root)
            .map(|r| r.display().to_string())
            .unwrap_or_else(|_| p.display().to_string());
        if r.is_empty() { ".".into() } else { r }
    }

    async fn check(
        &self,
        access: Access,
        class: &str,
        summary: String,
        info: &SessionInfo,
    ) -> Result<(), HandlerError> {
        match access {
            Access::Allow => Ok(()),
            Access::Deny => Err(HandlerError::Refused(format!(
                "{summary}: {class} actions are not allowed in this workspace"
            ))),
            Access::Ask => {
                let key = (info.session_id.clone(), class.to_owned());
                if self.always.lock().map(|g| g.contains(&key)).unwrap_or(false) {
                    return Ok(());
                }
                let req = ApprovalRequest {
                    class: class.to_owned(),
                    summary: summary.clone(),
                };
                match self.approver.approve(&req).await {
                    Approval::Once => Ok(()),
                    Approval::Always => {
                        if let Ok(mut g) = self.always.lock() {
                            g.insert(key);
                        }
                        Ok(())
                    }
                    Approval::Deny => Err(HandlerError::Refused(format!("{summary}: not approved"))),
                }
            }
        }
    }

    /// Reads a regular text file: at most [`Workspace::read_cap`] bytes, optionally from a 1-based
    /// `line` and at most `limit` lines. The file is streamed, never loaded whole; FIFOs, sockets
    /// and devices are refused without blocking.
    pub async fn read(
        &self,
        path: &Path,
        line: Option<u32>,
        limit: Option<u32>,
        info: &SessionInfo,
    ) -> Result<String, HandlerError> {
        let lex = self.lexical(path)?;
        self.check(
            self.policy.reads,
            "read",
            format!("read {}", self.rel(&lex)),
            info,
        )
        .await?;
        let p = self.resolve(path)?;
        let (root, cap, shown) = (self.root.clone(), self.read_cap, path.to_path_buf());
        blocking(move |cancel| {
            let file = fsio::open_in(&root, &p, fsio::Mode::Read).map_err(|e| fs_err(&shown, e))?;
            let part = fsio::read_part(file, line, limit, cap, cancel).map_err(|e| fs_err(&shown, e))?;
            part.render(&shown, line.is_some() || limit.is_some(), cap)
        })
        .await?
    }

    /// Writes a whole regular file, creating parent directories.
    pub async fn write(&self, path: &Path, content: &str, info: &SessionInfo) -> Result<(), HandlerError> {
        let lex = self.lexical(path)?;
        self.check(
            self.policy.writes,
            "write",
            format!("write {} ({} bytes)", self.rel(&lex), content.len()),
            info,
        )
        .await?;
        let p = self.resolve(path)?;
        if let Some(parent) = p.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| io_err(path, e))?;
            // Re-check after creating directories: a racing symlink must not lead outside.
            self.resolve(path)?;
        }
        let (root, shown, content) = (self.root.clone(), path.to_path_buf(), content.to_owned());
        blocking(move |_| {
            let file = fsio::open_in(&root, &p, fsio::Mode::Write).map_err(|e| fs_err(&shown, e))?;
            fsio::replace_contents(file, content.as_bytes()).map_err(|e| fs_err(&shown, e))
        })
        .await?
    }

    async fn edit(
        &self,
        path: &Path,
        old: &str,
        new: &str,
        all: bool,
        info: &SessionInfo,
    ) -> Result<String, HandlerError> {
        if old.is_empty() {
            return Err(HandlerError::Invalid("old_string must not be empty".into()));
        }
        let lex = self.lexical(path)?;
        // Both permissions before the file is opened: the count of matches, or "not found",
        // tells what the file holds.
        self.check(
            self.policy.reads,
            "read",
            format!("read {}", self.rel(&lex)),
            info,
        )
        .await?;
        self.check(
            self.policy.writes,
            "write",
            format!("edit {}", self.rel(&lex)),
            info,
        )
        .await?;
        let p = self.resolve(path)?;
        let (root, shown, cap) = (self.root.clone(), path.to_path_buf(), self.read_cap * 16);
        let (old, new) = (old.to_owned(), new.to_owned());
        let rel = self.rel(&p);
        blocking(move |cancel| {
            let file = fsio::open_in(&root, &p, fsio::Mode::ReadWrite).map_err(|e| fs_err(&shown, e))?;
            let part = fsio::read_part(
                file.try_clone().map_err(|e| fs_err(&shown, e))?,
                None,
                None,
                cap,
                cancel,
            )
            .map_err(|e| fs_err(&shown, e))?;
            if part.truncated {
                return Err(HandlerError::Invalid(format!(
                    "{} is larger than {cap} bytes; edit_file works on smaller files",
                    shown.display()
                )));
            }
            let text = String::from_utf8(part.bytes)
                .map_err(|_| HandlerError::Invalid(format!("{} is not UTF-8 text", shown.display())))?;
            let count = text.matches(old.as_str()).count();
            if count == 0 {
                return Err(HandlerError::Invalid(format!(
                    "old_string was not found in {}",
                    shown.display()
                )));
            }
            if count > 1 && !all {
                return Err(HandlerError::Invalid(format!(
                    "old_string occurs {count} times in {}; give more context or set replace_all",
                    shown.display()
                )));
            }
            let out = if all {
                text.replace(old.as_str(), &new)
            } else {
                text.replacen(old.as_str(), &new, 1)
            };
            fsio::replace_contents(file, out.as_bytes()).map_err(|e| fs_err(&shown, e))?;
            Ok(format!("edited {rel} ({count} replacement(s))"))
        })
        .await?
    }

    async fn list(&self, path: &Path, info: &SessionInfo) -> Result<String, HandlerError> {
        let lex = self.lexical(path)?;
        self.check(
            self.policy.reads,
            "read",
            format!("list {}", self.rel(&lex)),
            info,
        )
        .await?;
        let p = self.resolve(path)?;
        let shown = path.to_path_buf();
        blocking(move |cancel| {
            let meta = std::fs::metadata(&p).map_err(|e| io_err(&shown, e))?;
            if !meta.is_dir() {
                return Err(HandlerError::Invalid(format!(
                    "{} is not a directory; use read_file",
                    shown.display()
                )));
            }
            let rd = std::fs::read_dir(&p).map_err(|e| io_err(&shown, e))?;
            let mut names = Vec::new();
            let mut more = false;
            for e in rd {
                if cancel.load(Ordering::Relaxed) {
                    return Err(HandlerError::Failed("cancelled".into()));
                }
                let e = e.map_err(|e| io_err(&shown, e))?;
                if names.len() >= LIST_CAP {
                    more = true;
                    break;
                }
                let mut n = e.file_name().to_string_lossy().into_owned();
                if let Ok(t) = e.file_type() {
                    n.push_str(fsio::type_mark(&t));
                }
                names.push(n);
            }
            names.sort();
            if more {
                names.push(format!("[stopped at {LIST_CAP} entries]"));
            }
            Ok(if names.is_empty() {
                "(empty directory)".into()
            } else {
                names.join("\n")
            })
        })
        .await?
    }

    async fn search(&self, pattern: &str, path: &Path, info: &SessionInfo) -> Result<String, HandlerError> {
        if pattern.is_empty() {
            return Err(HandlerError::Invalid("pattern must not be empty".into()));
        }
        let lex = self.lexical(path)?;
        self.check(
            self.policy.reads,
            "read",
            format!("search {}", self.rel(&lex)),
            info,
        )
        .await?;
        let p = self.resolve(path)?;
        let root = self.root.clone();
        let pattern = pattern.to_owned();
        let found =
            blocking(move |cancel| search_blocking(&root, &p, &pattern, SEARCH_MATCHES, cancel)).await?;
        Ok(if found.is_empty() {
            "no matches".into()
        } else {
            found.join("\n")
        })
    }

    /// The sandboxed runner's spec for a command of this workspace.
    fn spec(&self, program: &str, args: Vec<std::ffi::OsString>, cwd: PathBuf) -> CommandSpec {
        CommandSpec {
            program: program.into(),
            args,
            env: Vec::new(),
            cwd,
            writable: vec![self.root.clone()],
            stdin: None,
            output_cap: self.output_cap,
            timeout: self.command_timeout,
        }
    }

    async fn run_command(&self, command: &str, info: &SessionInfo) -> Result<String, HandlerError> {
        self.check(self.policy.commands, "command", format!("run `{command}`"), info)
            .await?;
        let spec = self.spec("sh", vec!["-c".into(), command.into()], self.root.clone());
        let out = self.sandbox.run(&spec).await?;
        out.report(&format!("`{command}`"), &spec)
            .map_err(HandlerError::Failed)
    }
}

/// Runs blocking filesystem work on the blocking pool. Dropping the returned future (a timeout,
/// a cancel) raises the flag the work checks between chunks and entries, so the thread stops
/// promptly; the work itself never waits on a FIFO, a socket or a device.
async fn blocking<T, F>(f: F) -> Result<T, HandlerError>
where
    T: Send + 'static,
    F: FnOnce(&AtomicBool) -> T + Send + 'static,
{
    struct RaiseOnDrop(Arc<AtomicBool>);
    impl Drop for RaiseOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let flag = Arc::new(AtomicBool::new(false));
    let _raise = RaiseOnDrop(flag.clone());
    tokio::task::spawn_blocking(move || f(&flag))
        .await
        .map_err(|e| HandlerError::Failed(e.to_string()))
}

fn take_output(buf: &Arc<Mutex<OutputBuf>>) -> (String, bool) {
    buf.lock().map(|b| b.text()).unwrap_or_default()
}

fn spawn_readers(
    child: &mut tokio::process::Child,
    buf: &Arc<Mutex<OutputBuf>>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut v = Vec::new();
    if let Some(mut out) = child.stdout.take() {
        let b = buf.clone();
        v.push(tokio::spawn(async move {
            let mut chunk = [0u8; 8192];
            while let Ok(n) = out.read(&mut chunk).await {
                if n == 0 {
                    break;
                }
                if let Ok(mut g) = b.lock() {
                    g.push(&chunk[..n]);
                }
            }
        }));
    }
    if let Some(mut err) = child.stderr.take() {
        let b = buf.clone();
        v.push(tokio::spawn(async move {
            let mut chunk = [0u8; 8192];
            while let Ok(n) = err.read(&mut chunk).await {
                if n == 0 {
                    break;
                }
                if let Ok(mut g) = b.lock() {
                    g.push(&chunk[..n]);
                }
            }
        }));
    }
    v
}

fn search_blocking(root: &Path, start: &Path, pattern: &str, max: usize, cancel: &AtomicBool) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![start.to_path_buf()];
    while let Some(p) = stack.pop() {
        if out.len() >= max || cancel.load(Ordering::Relaxed) {
            break;
        }
        let Ok(meta) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if meta.is_dir() {
            let Ok(rd) = std::fs::read_dir(&p) else {
                continue;
            };
            let mut entries: Vec<PathBuf> = rd
                .filter_map(|e| e.ok())
                .filter(|e| !SKIP_DIRS.contains(&e.file_name().to_string_lossy().as_ref()))
                .map(|e| e.path())
                .collect();
            entries.sort();
            entries.reverse();
            stack.extend(entries);
            continue;
        }
        // Symlinks, FIFOs, sockets and devices are skipped; only regular files are opened.
        if !meta.is_file() || meta.len() > SEARCH_FILE_CAP {
            continue;
        }
        let Ok(file) = fsio::open_in(root, &p, fsio::Mode::Read) else {
            continue;
        };
        let Ok(part) = fsio::read_part(file, None, None, SEARCH_FILE_CAP as usize, cancel) else {
            continue;
        };
        let Ok(text) = String::from_utf8(part.bytes) else {
            continue;
        };
        let rel = p.strip_prefix(root).unwrap_or(&p).display().to_string();
        if rel.contains(pattern) && out.len() < max {
            out.push(format!("{rel}: (file name matches)"));
        }
        for (i, line) in text.lines().enumerate() {
            if line.contains(pattern) {
                let shown: String = line.chars().take(200).collect();
                out.push(format!("{rel}:{}: {shown}", i + 1));
                if out.len() >= max {
                    out.push(format!("[stopped at {max} matches]"));
                    break;
                }
            }
        }
    }
    out
}

/// Opening and reading files inside the root without blocking and without following symlinks.
mod fsio {
    use std::fs::File;
    use std::io::{Read, Seek, Write};
    use std::path::Path;
    use std::sync::atomic::{AtomicBool, Ordering};

    use crate::handler::HandlerError;

    /// How a file is opened.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) enum Mode {
        Read,
        Write,
        ReadWrite,
    }

    /// What kind of file a non-regular file is, for messages.
    fn kind(ft: &std::fs::FileType) -> &'static str {
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileTypeExt;
            if ft.is_fifo() {
                return "a FIFO";
            }
            if ft.is_socket() {
                return "a socket";
            }
            if ft.is_char_device() || ft.is_block_device() {
                return "a device";
            }
        }
        if ft.is_dir() {
            "a directory"
        } else if ft.is_symlink() {
            "a symlink"
        } else {
            "not a regular file"
        }
    }

    /// The mark `list_dir` puts after a name: `/` directory, `@` symlink, `|` FIFO, `=` socket,
    /// `#` device.
    pub(super) fn type_mark(ft: &std::fs::FileType) -> &'static str {
        if ft.is_dir() {
            return "/";
        }
        if ft.is_symlink() {
            return "@";
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileTypeExt;
            if ft.is_fifo() {
                return "|";
            }
            if ft.is_socket() {
                return "=";
            }
            if ft.is_char_device() || ft.is_block_device() {
                return "#";
            }
        }
        ""
    }

    /// Opens `path` (a resolved path inside `root`) as a regular file. Never blocks: opened with
    /// `O_NONBLOCK` (a FIFO opens at once, or fails) and checked with `fstat` on the opened
    /// descriptor. On Linux it is opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`
    /// from the root, so a symlink or `..` swapped in since the path was resolved is refused.
    pub(super) fn open_in(root: &Path, path: &Path, mode: Mode) -> std::io::Result<File> {
        let file = open_raw(root, path, mode)?;
        let ft = file.metadata()?.file_type();
        if !ft.is_file() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("is {}; only regular files are read and written", kind(&ft)),
            ));
        }
        Ok(file)
    }

    #[cfg(target_os = "linux")]
    fn open_raw(root: &Path, path: &Path, mode: Mode) -> std::io::Result<File> {
        use std::ffi::CString;
        use std::os::fd::{FromRawFd, OwnedFd};
        use std::os::unix::ffi::OsStrExt;

        let rel = path
            .strip_prefix(root)
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "outside the workspace"))?;
        let rel = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        let c_root = CString::new(root.as_os_str().as_bytes())?;
        let c_rel = CString::new(rel.as_os_str().as_bytes())?;
        // SAFETY: a plain open of a NUL-terminated path; the descriptor is owned at once.
        let dir = unsafe {
            libc::open(
                c_root.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if dir < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `dir` was just opened and is owned by nothing else.
        let dir = unsafe { OwnedFd::from_raw_fd(dir) };
        let access = match mode {
            Mode::Read => libc::O_RDONLY,
            Mode::Write => libc::O_WRONLY | libc::O_CREAT,
            Mode::ReadWrite => libc::O_RDWR,
        };
        let flags = access | libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NOCTTY;
        // The kernel's `struct open_how` (libc's is non-exhaustive).
        #[repr(C)]
        struct OpenHow {
            flags: u64,
            mode: u64,
            resolve: u64,
        }
        let how = OpenHow {
            flags: flags as u64,
            mode: if mode == Mode::Write { 0o666 } else { 0 },
            resolve: libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS,
        };
        use std::os::fd::AsRawFd;
        // SAFETY: openat2 with a valid directory descriptor, a NUL-terminated path and a
        // correctly sized `open_how`.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir.as_raw_fd(),
                c_rel.as_ptr(),
                &how as *const OpenHow,
                std::mem::size_of::<OpenHow>(),
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                // Kernels before 5.6: fall back to a plain non-blocking, non-following open.
                Some(libc::ENOSYS) => open_plain(path, mode),
                Some(libc::ELOOP) | Some(libc::EXDEV) => Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    "a symlink is in the way (changed since the path was checked); refused",
                )),
                _ => Err(e),
            };
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(unsafe { File::from_raw_fd(fd as i32) })
    }

    #[cfg(not(target_os = "linux"))]
    fn open_raw(_root: &Path, path: &Path, mode: Mode) -> std::io::Result<File> {
        open_plain(path, mode)
    }

    fn open_plain(path: &Path, mode: Mode) -> std::io::Result<File> {
        let mut o = std::fs::OpenOptions::new();
        match mode {
            Mode::Read => o.read(true),
            Mode::Write => o.write(true).create(true),
            Mode::ReadWrite => o.read(true).write(true),
        };
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            o.custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY);
        }
        o.open(path)
    }

    /// Replaces a regular file's contents.
    pub(super) fn replace_contents(mut file: File, bytes: &[u8]) -> std::io::Result<()> {
        file.set_len(0)?;
        file.rewind()?;
        file.write_all(bytes)?;
        file.flush()
    }

    /// Part of a file, as read.
    #[derive(Debug)]
    pub(super) struct Part {
        pub(super) bytes: Vec<u8>,
        /// More was there than the cap allowed.
        pub(super) truncated: bool,
        /// The file's size when opened.
        pub(super) size: u64,
    }

    fn cancelled() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::Interrupted, "cancelled")
    }

    /// Reads at most `cap` bytes: from the start, or from 1-based line `line` for at most `limit`
    /// lines. Streams in chunks (memory stays near `cap`) and stops when `cancel` is raised.
    pub(super) fn read_part(
        mut file: File,
        line: Option<u32>,
        limit: Option<u32>,
        cap: usize,
        cancel: &AtomicBool,
    ) -> std::io::Result<Part> {
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut chunk = vec![0u8; 64 * 1024];
        let mut bytes = Vec::new();
        let mut truncated = false;
        let ranged = line.is_some() || limit.is_some();
        let mut skip = line.unwrap_or(1).max(1) as u64 - 1;
        let mut lines_left = limit.map(u64::from).unwrap_or(u64::MAX);
        if lines_left == 0 {
            return Ok(Part {
                bytes,
                truncated,
                size,
            });
        }
        'outer: loop {
            if cancel.load(Ordering::Relaxed) {
                return Err(cancelled());
            }
            let n = match file.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            let mut data = &chunk[..n];
            if ranged {
                while skip > 0 {
                    match data.iter().position(|&b| b == b'\n') {
                        Some(i) => {
                            skip -= 1;
                            data = &data[i + 1..];
                        }
                        None => continue 'outer,
                    }
                }
                // Take up to the end of the last wanted line.
                let mut end = data.len();
                let mut from = 0;
                while let Some(i) = data[from..].iter().position(|&b| b == b'\n') {
                    lines_left -= 1;
                    if lines_left == 0 {
                        end = from + i + 1;
                        break;
                    }
                    from += i + 1;
                }
                data = &data[..end];
            }
            let room = cap.saturating_sub(bytes.len());
            if data.len() > room {
                bytes.extend_from_slice(&data[..room]);
                truncated = true;
                break;
            }
            bytes.extend_from_slice(data);
            if ranged && lines_left == 0 {
                break;
            }
        }
        Ok(Part {
            bytes,
            truncated,
            size,
        })
    }

    impl Part {
        /// The text to return: UTF-8 (a character cut by the cap is dropped), the wanted lines
        /// joined by `\n` when `ranged`, and a note when the cap cut it.
        pub(super) fn render(self, shown: &Path, ranged: bool, cap: usize) -> Result<String, HandlerError> {
            let text = match std::str::from_utf8(&self.bytes) {
                Ok(t) => t,
                Err(e) if self.truncated && e.error_len().is_none() => {
                    // SAFETY-free: valid_up_to marks a valid prefix.
                    std::str::from_utf8(&self.bytes[..e.valid_up_to()]).unwrap_or_default()
                }
                Err(_) => {
                    return Err(HandlerError::Invalid(format!(
                        "{} is not UTF-8 text",
                        shown.display()
                    )));
                }
            };
            let mut out = if ranged {
                text.lines().collect::<Vec<_>>().join("\n")
            } else {
                text.to_owned()
            };
            if self.truncated {
                if ranged {
                    out.push_str(&format!(
                        "\n[truncated: a read returns at most {cap} bytes; ask for fewer lines (`limit`) \
                         or start at a later `line`]"
                    ));
                } else {
                    out.push_str(&format!(
                        "\n[truncated: showing the first {} of {} bytes; read the rest with `line` and `limit`]",
                        text.len(),
                        self.size
                    ));
                }
            }
            Ok(out)
        }
    }
}

fn outside(path: &Path) -> HandlerError {
    HandlerError::OutsideRoot(format!(
        "{} is outside the workspace; use a path inside it",
        path.display()
    ))
}

fn io_err(path: &Path, e: std::io::Error) -> HandlerError {
    match e.kind() {
        std::io::ErrorKind::NotFound => HandlerError::NotFound(path.display().to_string()),
        _ => HandlerError::Failed(format!("{}: {e}", path.display())),
    }
}

/// An error of [`fsio`]: wrong kinds of file and swapped symlinks are the caller's to fix.
fn fs_err(path: &Path, e: std::io::Error) -> HandlerError {
    #[cfg(unix)]
    if e.raw_os_error() == Some(libc::ENXIO) {
        return HandlerError::Invalid(format!(
            "{} is a FIFO or device; only regular files are read and written",
            path.display()
        ));
    }
    match e.kind() {
        std::io::ErrorKind::InvalidInput => HandlerError::Invalid(format!("{} {e}", path.display())),
        std::io::ErrorKind::PermissionDenied => HandlerError::Refused(format!("{}: {e}", path.display())),
        std::io::ErrorKind::Interrupted => HandlerError::Failed(format!("{}: {e}", path.display())),
        _ => io_err(path, e),
    }
}

fn str_arg<'a>(input: &'a Value, key: &str) -> Result<&'a str, HandlerError> {
    input
        .get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| HandlerError::Invalid(format!("`{key}` is required and must be a string")))
}

fn path_arg(input: &Value, key: &str, default: Option<&str>) -> Result<PathBuf, HandlerError> {
    match input.get(key).and_then(Value::as_str) {
        Some(s) => Ok(PathBuf::from(s)),
        None => default
            .map(PathBuf::from)
            .ok_or_else(|| HandlerError::Invalid(format!("`{key}` is required and must be a string"))),
    }
}

fn schema(props: Value, required: &[&str]) -> Value {
    json!({"type": "object", "properties": props, "required": required})
}

#[async_trait]
impl Handler for Workspace {
    fn tools(&self) -> Vec<ToolSpec> {
        vec![
            ToolSpec::new(
                "read_file",
                "Read a UTF-8 text file in the workspace (at most 256 KiB per call). Optional 1-based `line` and `limit` read part of it.",
                schema(
                    json!({"path": {"type": "string"}, "line": {"type": "integer"}, "limit": {"type": "integer"}}),
                    &["path"],
                ),
            ),
            ToolSpec::new(
                "list_dir",
                "List a directory of the workspace (directories end with /, symlinks with @, FIFOs with |, sockets with =, devices with #).",
                schema(
                    json!({"path": {"type": "string", "description": "default: the workspace root"}}),
                    &[],
                ),
            ),
            ToolSpec::new(
                "search_files",
                "Find lines containing `pattern` (plain text) in the workspace's files, as path:line: text.",
                schema(
                    json!({"pattern": {"type": "string"}, "path": {"type": "string"}}),
                    &["pattern"],
                ),
            ),
            ToolSpec::new(
                "write_file",
                "Write a whole file in the workspace (created with its directories if missing).",
                schema(
                    json!({"path": {"type": "string"}, "content": {"type": "string"}}),
                    &["path", "content"],
                ),
            ),
            ToolSpec::new(
                "edit_file",
                "Replace `old_string` with `new_string` in a file; `old_string` must occur exactly once unless `replace_all`.",
                schema(
                    json!({"path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"}, "replace_all": {"type": "boolean"}}),
                    &["path", "old_string", "new_string"],
                ),
            ),
            ToolSpec::new(
                "run_command",
                "Run a shell command in the workspace root; returns its exit code and (capped) output. Commands are sandboxed: they can write only inside the workspace (and $TMPDIR) and have no network unless allowed.",
                schema(json!({"command": {"type": "string"}}), &["command"]),
            ),
        ]
    }

    /// The workspace's tools are the same for its whole life.
    fn tools_version(&self) -> Option<u64> {
        Some(0)
    }

    async fn call_tool(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        let i = &call.input;
        let r: Result<String, HandlerError> = async {
            match call.name.as_str() {
                "read_file" => {
                    // Saturating: 2^32 + 1 must not wrap to line 1.
                    let arg = |k: &str| {
                        i.get(k)
                            .and_then(Value::as_u64)
                            .map(|v| u32::try_from(v).unwrap_or(u32::MAX))
                    };
                    let (line, limit) = (arg("line"), arg("limit"));
                    self.read(&path_arg(i, "path", None)?, line, limit, info).await
                }
                "list_dir" => self.list(&path_arg(i, "path", Some("."))?, info).await,
                "search_files" => {
                    self.search(str_arg(i, "pattern")?, &path_arg(i, "path", Some("."))?, info)
                        .await
                }
                "write_file" => {
                    let p = path_arg(i, "path", None)?;
                    let content = str_arg(i, "content")?;
                    self.write(&p, content, info).await?;
                    Ok(format!("wrote {} ({} bytes)", p.display(), content.len()))
                }
                "edit_file" => {
                    let all = i.get("replace_all").and_then(Value::as_bool).unwrap_or(false);
                    self.edit(
                        &path_arg(i, "path", None)?,
                        str_arg(i, "old_string")?,
                        str_arg(i, "new_string")?,
                        all,
                        info,
                    )
                    .await
                }
                "run_command" => self.run_command(str_arg(i, "command")?, info).await,
                other => Err(HandlerError::Unsupported(format!(
                    "no workspace tool named `{other}`"
                ))),
            }
        }
        .await;
        match r {
            Ok(s) => ToolOutput::Ok(s),
            Err(e) => ToolOutput::Error(e.to_string()),
        }
    }

    async fn request_permission(&self, req: &PermissionRequest, info: &SessionInfo) -> PermissionOutcome {
        let (access, class) = match req.kind.as_deref() {
            Some("read" | "search" | "think" | "fetch") => (self.policy.reads, "read"),
            Some("edit" | "delete" | "move") => (self.policy.writes, "write"),
            Some("execute") => (self.policy.commands, "command"),
            _ => (Access::Ask, "other"),
        };
        let pick = |kinds: &[PermissionKind]| {
            kinds
                .iter()
                .find_map(|k| req.option_of(*k))
                .map(|o| PermissionOutcome::Selected {
                    option_id: o.id.clone(),
                })
        };
        let reject = || {
            pick(&[PermissionKind::RejectOnce, PermissionKind::RejectAlways])
                .unwrap_or(PermissionOutcome::Cancelled)
        };
        // "Always" covers a class the workspace knows (every read, write or command); a request
        // of a kind it does not know (an MCP tool, an agent's `other`) is remembered by its own
        // title only, so allowing one such tool always never allows every other one.
        let scope = if class == "other" {
            format!("other:{}", req.title)
        } else {
            class.to_owned()
        };
        let key = (info.session_id.clone(), scope);
        match access {
            Access::Allow => {
                pick(&[PermissionKind::AllowOnce, PermissionKind::AllowAlways]).unwrap_or_else(reject)
            }
            Access::Deny => reject(),
            Access::Ask => {
                if self.always.lock().map(|g| g.contains(&key)).unwrap_or(false) {
                    return pick(&[PermissionKind::AllowOnce, PermissionKind::AllowAlways])
                        .unwrap_or_else(reject);
                }
                let summary = format!("{} ({})", req.title, req.kind.as_deref().unwrap_or("other"));
                match self
                    .approver
                    .approve(&ApprovalRequest {
                        class: class.to_owned(),
                        summary,
                    })
                    .await
                {
                    Approval::Once => {
                        pick(&[PermissionKind::AllowOnce, PermissionKind::AllowAlways]).unwrap_or_else(reject)
                    }
                    Approval::Always => {
                        if let Ok(mut g) = self.always.lock() {
                            g.insert(key);
                        }
                        pick(&[PermissionKind::AllowAlways, PermissionKind::AllowOnce]).unwrap_or_else(reject)
                    }
                    Approval::Deny => reject(),
                }
            }
        }
    }

    async fn read_text_file(&self, req: &ReadTextFile, info: &SessionInfo) -> Result<String, HandlerError> {
        self.read(&req.path, req.line, req.limit, info).await
    }

    async fn write_text_file(&self, req: &WriteTextFile, info: &SessionInfo) -> Result<(), HandlerError> {
        self.write(&req.path, &req.content, info).await
    }

    async fn terminal(
        &self,
        req: &TerminalRequest,
        info: &SessionInfo,
    ) -> Result<TerminalResponse, HandlerError> {
        match req {
            TerminalRequest::Create {
                command,
                args,
                env,
                cwd,
                output_byte_limit,
            } => {
                let dir = match cwd {
                    Some(c) => self.resolve(c)?,
                    None => self.root.clone(),
                };
                let shown = std::iter::once(command.as_str())
                    .chain(args.iter().map(String::as_str))
                    .collect::<Vec<_>>()
                    .join(" ");
                self.check(self.policy.commands, "command", format!("run `{shown}`"), info)
                    .await?;
                let mut spec = self.spec(command, args.iter().map(Into::into).collect(), dir);
                spec.env = env.iter().map(|(k, v)| (k.into(), v.into())).collect();
                let mut process = self.sandbox.spawn(&spec)?;
                let limit = output_byte_limit
                    .map(|l| l as usize)
                    .unwrap_or(self.output_cap)
                    .min(self.output_cap.max(1) * 16);
                let output = Arc::new(Mutex::new(OutputBuf::new(limit)));
                let readers = spawn_readers(&mut process.child, &output);
                let killer = process.killer();
                let n = self
                    .next_terminal
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let id = format!("term-{n}");
                self.terminals.lock().await.insert(
                    id.clone(),
                    TermState {
                        output,
                        process: Some(process),
                        killer,
                        exit: None,
                        readers,
                    },
                );
                Ok(TerminalResponse::Created { terminal_id: id })
            }
            TerminalRequest::Output { terminal_id } => {
                let mut terms = self.terminals.lock().await;
                let t = terms
                    .get_mut(terminal_id)
                    .ok_or_else(|| HandlerError::NotFound(format!("terminal {terminal_id}")))?;
                if t.exit.is_none()
                    && let Some(p) = t.process.as_mut()
                    && let Ok(Some(s)) = p.child.try_wait()
                {
                    t.killer.disarm();
                    t.exit = Some(exit_of(s));
                }
                let (output, truncated) = take_output(&t.output);
                Ok(TerminalResponse::Output {
                    output,
                    truncated,
                    exit_status: t.exit.clone(),
                })
            }
            TerminalRequest::WaitForExit { terminal_id } => {
                // Take the child out so other terminals stay usable while this one is awaited.
                let child = {
                    let mut terms = self.terminals.lock().await;
                    let t = terms
                        .get_mut(terminal_id)
                        .ok_or_else(|| HandlerError::NotFound(format!("terminal {terminal_id}")))?;
                    if let Some(e) = &t.exit {
                        return Ok(TerminalResponse::Exited(e.clone()));
                    }
                    t.process.take()
                };
                let Some(mut process) = child else {
                    return Err(HandlerError::Invalid(format!(
                        "terminal {terminal_id} is already being waited on"
                    )));
                };
                let exit = process
                    .wait()
                    .await
                    .map_err(|e| HandlerError::Failed(e.to_string()))?;
                let mut terms = self.terminals.lock().await;
                if let Some(t) = terms.get_mut(terminal_id) {
                    for r in t.readers.drain(..) {
                        let _ = r.await;
                    }
                    t.exit = Some(exit.clone());
                }
                Ok(TerminalResponse::Exited(exit))
            }
            TerminalRequest::Kill { terminal_id } => {
                let mut terms = self.terminals.lock().await;
                let t = terms
                    .get_mut(terminal_id)
                    .ok_or_else(|| HandlerError::NotFound(format!("terminal {terminal_id}")))?;
                // The whole group, even while another request waits on the process.
                if t.exit.is_none() {
                    t.killer.kill();
                }
                if let Some(p) = t.process.as_mut()
                    && let Ok(exit) = p.wait().await
                {
                    t.exit = Some(exit);
                }
                Ok(TerminalResponse::Done)
            }
            TerminalRequest::Release { terminal_id } => {
                let t = self
                    .terminals
                    .lock()
                    .await
                    .remove(terminal_id)
                    .ok_or_else(|| HandlerError::NotFound(format!("terminal {terminal_id}")))?;
                if t.exit.is_none() {
                    t.killer.kill();
                }
                drop(t.process);
                for r in t.readers {
                    r.abort();
                }
                Ok(TerminalResponse::Done)
            }
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_files: true,
            write_files: true,
            terminals: true,
            elicitation_form: false,
            elicitation_url: false,
        }
    }
}
