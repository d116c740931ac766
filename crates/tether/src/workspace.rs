//! [`Workspace`]: a ready [`Handler`] serving files, searches and commands inside one root
//! directory, under a permission policy.
//!
//! The model-facing tools are `read_file`, `list_dir`, `search_files`, `write_file`, `edit_file`
//! and `run_command`; the same handler serves ACP's client-side file, terminal and permission
//! requests. Every path is confined to the root: `..` that climbs out, absolute paths elsewhere
//! and symlinks that resolve outside are refused with [`HandlerError::OutsideRoot`], and nothing
//! is read, written or run.

use std::collections::{HashMap, HashSet};
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

use crate::handler::{
    Capabilities, ExitStatus, Handler, HandlerError, PermissionKind, PermissionOutcome, PermissionRequest,
    ReadTextFile, TerminalRequest, TerminalResponse, ToolOutput, WriteTextFile,
};
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
pub struct ApprovalRequest {
    /// The class of action: `write`, `command`, or a provider's tool kind.
    pub class: String,
    /// One line for people (`write_file notes.txt (12 bytes)`).
    pub summary: String,
}

/// The approver's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Approval {
    /// Allowed this once.
    Once,
    /// Allowed, and the same class is allowed for the rest of the session.
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
    child: Option<tokio::process::Child>,
    exit: Option<ExitStatus>,
    readers: Vec<tokio::task::JoinHandle<()>>,
}

#[derive(Default)]
struct OutputBuf {
    bytes: Vec<u8>,
    limit: usize,
    truncated: bool,
}

impl OutputBuf {
    fn push(&mut self, chunk: &[u8]) {
        self.bytes.extend_from_slice(chunk);
        if self.bytes.len() > self.limit {
            let cut = self.bytes.len() - self.limit;
            self.bytes.drain(..cut);
            // Keep the text valid UTF-8 by dropping a partial leading character.
            while !self.bytes.is_empty() && (self.bytes[0] & 0xC0) == 0x80 {
                self.bytes.remove(0);
            }
            self.truncated = true;
        }
    }
}

/// Files, searches and commands inside a root directory, under a [`Policy`].
pub struct Workspace {
    root: PathBuf,
    policy: Policy,
    approver: Arc<dyn Approver>,
    output_cap: usize,
    read_cap: usize,
    command_timeout: Duration,
    always: Mutex<HashSet<(String, String)>>,
    terminals: tokio::sync::Mutex<HashMap<String, TermState>>,
    next_terminal: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Workspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workspace")
            .field("root", &self.root)
            .field("policy", &self.policy)
            .finish()
    }
}

const SKIP_DIRS: &[&str] = &[".git", "target", "node_modules"];

impl Workspace {
    /// A workspace over `root` (which must exist), with the default policy (reads allowed, writes
    /// and commands asked) and an approver that refuses: set one with [`Workspace::approver`].
    pub fn new(root: impl AsRef<Path>) -> std::io::Result<Self> {
        let root = root.as_ref().canonicalize()?;
        Ok(Workspace {
            root,
            policy: Policy::default(),
            approver: Arc::new(DenyAll),
            output_cap: 64 * 1024,
            read_cap: 256 * 1024,
            command_timeout: Duration::from_secs(120),
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

    /// How long `run_command` may run (default 120 s).
    pub fn command_timeout(mut self, d: Duration) -> Self {
        self.command_timeout = d;
        self
    }

    /// The canonical root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Resolves a path given by an agent to a path inside the root, or refuses it.
    ///
    /// Relative paths are taken from the root; absolute ones must lie inside it. `..` is resolved
    /// lexically, then the longest existing prefix is resolved through symlinks; the result must
    /// still be inside the root.
    pub fn resolve(&self, path: &Path) -> Result<PathBuf, HandlerError> {
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
        p.strip_prefix(&self.root)
            .map(|r| r.display().to_string())
            .unwrap_or_else(|_| p.display().to_string())
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

    /// Reads a file (optionally from a 1-based line, at most `limit` lines).
    pub async fn read(
        &self,
        path: &Path,
        line: Option<u32>,
        limit: Option<u32>,
        info: &SessionInfo,
    ) -> Result<String, HandlerError> {
        let p = self.resolve(path)?;
        self.check(self.policy.reads, "read", format!("read {}", self.rel(&p)), info)
            .await?;
        let meta = tokio::fs::metadata(&p).await.map_err(|e| io_err(path, e))?;
        if meta.is_dir() {
            return Err(HandlerError::Invalid(format!(
                "{} is a directory; use list_dir",
                path.display()
            )));
        }
        if meta.len() as usize > self.read_cap * 16 && line.is_none() && limit.is_none() {
            return Err(HandlerError::Invalid(format!(
                "{} is {} bytes; read it in parts with `line` and `limit`",
                path.display(),
                meta.len()
            )));
        }
        let bytes = tokio::fs::read(&p).await.map_err(|e| io_err(path, e))?;
        let text = String::from_utf8(bytes)
            .map_err(|_| HandlerError::Invalid(format!("{} is not UTF-8 text", path.display())))?;
        if line.is_none() && limit.is_none() {
            if text.len() > self.read_cap {
                let mut cut = self.read_cap;
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                return Ok(format!(
                    "{}\n[truncated: showing {cut} of {} bytes; read the rest with `line` and `limit`]",
                    &text[..cut],
                    text.len()
                ));
            }
            return Ok(text);
        }
        let start = line.unwrap_or(1).max(1) as usize - 1;
        let n = limit.map(|l| l as usize).unwrap_or(usize::MAX);
        Ok(text.lines().skip(start).take(n).collect::<Vec<_>>().join("\n"))
    }

    /// Writes a whole file, creating parent directories.
    pub async fn write(&self, path: &Path, content: &str, info: &SessionInfo) -> Result<(), HandlerError> {
        let p = self.resolve(path)?;
        self.check(
            self.policy.writes,
            "write",
            format!("write {} ({} bytes)", self.rel(&p), content.len()),
            info,
        )
        .await?;
        if let Some(parent) = p.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| io_err(path, e))?;
            // Re-check after creating directories: a racing symlink must not lead outside.
            self.resolve(path)?;
        }
        tokio::fs::write(&p, content).await.map_err(|e| io_err(path, e))
    }

    async fn edit(
        &self,
        path: &Path,
        old: &str,
        new: &str,
        all: bool,
        info: &SessionInfo,
    ) -> Result<String, HandlerError> {
        let p = self.resolve(path)?;
        if old.is_empty() {
            return Err(HandlerError::Invalid("old_string must not be empty".into()));
        }
        let text = tokio::fs::read_to_string(&p).await.map_err(|e| io_err(path, e))?;
        let count = text.matches(old).count();
        if count == 0 {
            return Err(HandlerError::Invalid(format!(
                "old_string was not found in {}",
                path.display()
            )));
        }
        if count > 1 && !all {
            return Err(HandlerError::Invalid(format!(
                "old_string occurs {count} times in {}; give more context or set replace_all",
                path.display()
            )));
        }
        self.check(
            self.policy.writes,
            "write",
            format!("edit {} ({count} replacement(s))", self.rel(&p)),
            info,
        )
        .await?;
        let out = if all {
            text.replace(old, new)
        } else {
            text.replacen(old, new, 1)
        };
        tokio::fs::write(&p, out).await.map_err(|e| io_err(path, e))?;
        Ok(format!("edited {} ({count} replacement(s))", self.rel(&p)))
    }

    async fn list(&self, path: &Path, info: &SessionInfo) -> Result<String, HandlerError> {
        let p = self.resolve(path)?;
        self.check(self.policy.reads, "read", format!("list {}", self.rel(&p)), info)
            .await?;
        let mut rd = tokio::fs::read_dir(&p).await.map_err(|e| io_err(path, e))?;
        let mut names = Vec::new();
        while let Some(e) = rd.next_entry().await.map_err(|e| io_err(path, e))? {
            let mut n = e.file_name().to_string_lossy().into_owned();
            match e.file_type().await {
                Ok(t) if t.is_dir() => n.push('/'),
                Ok(t) if t.is_symlink() => n.push('@'),
                _ => {}
            }
            names.push(n);
        }
        names.sort();
        Ok(if names.is_empty() {
            "(empty directory)".into()
        } else {
            names.join("\n")
        })
    }

    async fn search(&self, pattern: &str, path: &Path, info: &SessionInfo) -> Result<String, HandlerError> {
        if pattern.is_empty() {
            return Err(HandlerError::Invalid("pattern must not be empty".into()));
        }
        let p = self.resolve(path)?;
        self.check(
            self.policy.reads,
            "read",
            format!("search {}", self.rel(&p)),
            info,
        )
        .await?;
        let root = self.root.clone();
        let pattern = pattern.to_owned();
        let found = tokio::task::spawn_blocking(move || search_blocking(&root, &p, &pattern, 200))
            .await
            .map_err(|e| HandlerError::Failed(e.to_string()))?;
        Ok(if found.is_empty() {
            "no matches".into()
        } else {
            found.join("\n")
        })
    }

    async fn run_command(&self, command: &str, info: &SessionInfo) -> Result<String, HandlerError> {
        self.check(self.policy.commands, "command", format!("run `{command}`"), info)
            .await?;
        let mut child = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(command)
            .current_dir(&self.root)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| HandlerError::Failed(format!("could not start sh: {e}")))?;
        let buf = Arc::new(Mutex::new(OutputBuf {
            limit: self.output_cap,
            ..Default::default()
        }));
        let readers = spawn_readers(&mut child, &buf);
        let status = match tokio::time::timeout(self.command_timeout, child.wait()).await {
            Ok(s) => s.map_err(|e| HandlerError::Failed(e.to_string()))?,
            Err(_) => {
                let _ = child.kill().await;
                for r in readers {
                    let _ = r.await;
                }
                let out = take_output(&buf);
                return Err(HandlerError::Failed(format!(
                    "`{command}` timed out after {:?} and was killed\n{}",
                    self.command_timeout, out.0
                )));
            }
        };
        for r in readers {
            let _ = r.await;
        }
        let (out, truncated) = take_output(&buf);
        let mut text = format!(
            "exit code: {}\n{out}",
            status
                .code()
                .map(|c| c.to_string())
                .unwrap_or_else(|| "killed".into())
        );
        if truncated {
            text.push_str(&format!(
                "\n[output truncated: only the last {} bytes kept]",
                self.output_cap
            ));
        }
        if status.success() {
            Ok(text)
        } else {
            Err(HandlerError::Failed(text))
        }
    }
}

fn take_output(buf: &Arc<Mutex<OutputBuf>>) -> (String, bool) {
    match buf.lock() {
        Ok(b) => (String::from_utf8_lossy(&b.bytes).into_owned(), b.truncated),
        Err(_) => (String::new(), false),
    }
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

fn search_blocking(root: &Path, start: &Path, pattern: &str, max: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![start.to_path_buf()];
    while let Some(p) = stack.pop() {
        if out.len() >= max {
            break;
        }
        let Ok(meta) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if meta.file_type().is_symlink() {
            continue;
        }
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
        if meta.len() > 4 * 1024 * 1024 {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&p) else {
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
                "Read a UTF-8 text file in the workspace. Optional 1-based `line` and `limit` read part of it.",
                schema(
                    json!({"path": {"type": "string"}, "line": {"type": "integer"}, "limit": {"type": "integer"}}),
                    &["path"],
                ),
            ),
            ToolSpec::new(
                "list_dir",
                "List a directory of the workspace (directories end with /, symlinks with @).",
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
                "Run a shell command in the workspace root; returns its exit code and (capped) output.",
                schema(json!({"command": {"type": "string"}}), &["command"]),
            ),
        ]
    }

    async fn call_tool(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        let i = &call.input;
        let r: Result<String, HandlerError> = async {
            match call.name.as_str() {
                "read_file" => {
                    let line = i.get("line").and_then(Value::as_u64).map(|v| v as u32);
                    let limit = i.get("limit").and_then(Value::as_u64).map(|v| v as u32);
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
        let key = (info.session_id.clone(), class.to_owned());
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
                let mut cmd = tokio::process::Command::new(command);
                cmd.args(args)
                    .envs(env.iter().cloned())
                    .current_dir(&dir)
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .kill_on_drop(true);
                let mut child = cmd
                    .spawn()
                    .map_err(|e| HandlerError::Failed(format!("could not start `{command}`: {e}")))?;
                let limit = output_byte_limit
                    .map(|l| l as usize)
                    .unwrap_or(self.output_cap)
                    .min(self.output_cap.max(1) * 16);
                let output = Arc::new(Mutex::new(OutputBuf {
                    limit: limit.max(1),
                    ..Default::default()
                }));
                let readers = spawn_readers(&mut child, &output);
                let n = self
                    .next_terminal
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let id = format!("term-{n}");
                self.terminals.lock().await.insert(
                    id.clone(),
                    TermState {
                        output,
                        child: Some(child),
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
                    && let Some(c) = t.child.as_mut()
                    && let Ok(Some(s)) = c.try_wait()
                {
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
                    t.child.take()
                };
                let Some(mut child) = child else {
                    return Err(HandlerError::Invalid(format!(
                        "terminal {terminal_id} is already being waited on"
                    )));
                };
                let status = child
                    .wait()
                    .await
                    .map_err(|e| HandlerError::Failed(e.to_string()))?;
                let exit = exit_of(status);
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
                if let Some(c) = t.child.as_mut() {
                    let _ = c.kill().await;
                    if let Ok(s) = c.wait().await {
                        t.exit = Some(exit_of(s));
                    }
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
                if let Some(mut c) = t.child {
                    let _ = c.kill().await;
                }
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

fn exit_of(s: std::process::ExitStatus) -> ExitStatus {
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
