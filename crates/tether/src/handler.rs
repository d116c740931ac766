//! [`Handler`]: where the tools stay local.
//!
//! Everything a running agent asks of the user's process reaches one handler: tool calls,
//! observed events, and the client-side requests remote loops make (permission, file reads and
//! writes, terminals, elicitation). Every method has a default: events are ignored and client-side
//! requests are refused, so a handler implements only what it serves.
//!
//! Delivery is **at-least-once**: after a reconnect or a retried turn, the same event or tool use
//! may arrive again. [`crate::SessionResult::events`] is the exactly-once record, and the session
//! engine consults the store's tool-result memo so a redelivered tool use returns the recorded
//! result instead of running the tool twice.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::event::Event;
use crate::types::{SessionInfo, ToolSpec, ToolUse};

/// What a tool call returned.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolOutput {
    /// Success: the text sent back as the result.
    Ok(String),
    /// Failure: the text sent back with `is_error`.
    Error(String),
    /// This tool is not run here (a front-end tool): the session pauses with the call pending
    /// until its result is submitted.
    Pending,
}

impl<E: std::fmt::Display> From<Result<String, E>> for ToolOutput {
    fn from(r: Result<String, E>) -> Self {
        match r {
            Ok(s) => ToolOutput::Ok(s),
            Err(e) => ToolOutput::Error(e.to_string()),
        }
    }
}

/// The kind of a permission option, as ACP defines them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum PermissionKind {
    /// Allow this once.
    AllowOnce,
    /// Allow this and remember it for the session.
    AllowAlways,
    /// Refuse this once.
    RejectOnce,
    /// Refuse this and remember it for the session.
    RejectAlways,
}

impl PermissionKind {
    /// Whether the option allows the action.
    pub fn allows(self) -> bool {
        matches!(self, PermissionKind::AllowOnce | PermissionKind::AllowAlways)
    }
}

/// One choice offered with a permission request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PermissionOption {
    /// The id to answer with.
    pub id: String,
    /// A label for people.
    pub name: String,
    /// What choosing it means.
    pub kind: PermissionKind,
}

impl PermissionOption {
    /// An option with the id to answer with, a label and what choosing it means.
    pub fn new(id: impl Into<String>, name: impl Into<String>, kind: PermissionKind) -> Self {
        PermissionOption {
            id: id.into(),
            name: name.into(),
            kind,
        }
    }
}

/// An agent asks whether it may do something (run a tool, write a file, run a command).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PermissionRequest {
    /// The tool call the request is about.
    pub tool_use_id: String,
    /// A title for people (the tool name or a summary).
    pub title: String,
    /// The call's input, when known.
    #[serde(default)]
    pub input: Value,
    /// What kind of action it is, when the provider says (ACP tool kinds: `read`, `edit`,
    /// `delete`, `move`, `search`, `execute`, `think`, `fetch`, `other`).
    #[serde(default)]
    pub kind: Option<String>,
    /// The options; the answer must name one of them.
    pub options: Vec<PermissionOption>,
    /// The request as the provider sent it.
    #[serde(default)]
    pub raw: Value,
}

impl PermissionRequest {
    /// A request about tool call `tool_use_id`, titled `title`, offering the
    /// [standard options](PermissionRequest::standard_options).
    ///
    /// ```
    /// use tether::{PermissionKind, PermissionRequest};
    /// let r = PermissionRequest::new("call_1", "write notes.txt").with_kind("edit");
    /// assert_eq!(r.option_of(PermissionKind::AllowOnce).map(|o| o.id.as_str()), Some("allow_once"));
    /// ```
    pub fn new(tool_use_id: impl Into<String>, title: impl Into<String>) -> Self {
        PermissionRequest {
            tool_use_id: tool_use_id.into(),
            title: title.into(),
            input: Value::Null,
            kind: None,
            options: Self::standard_options(),
            raw: Value::Null,
        }
    }

    /// The same request with the call's input.
    pub fn with_input(mut self, input: Value) -> Self {
        self.input = input;
        self
    }

    /// The same request with the kind of action (ACP tool kinds: `edit`, `execute`, ...).
    pub fn with_kind(mut self, kind: impl Into<String>) -> Self {
        self.kind = Some(kind.into());
        self
    }

    /// The same request with these options instead of the standard ones.
    pub fn with_options(mut self, options: Vec<PermissionOption>) -> Self {
        self.options = options;
        self
    }

    /// The same request with the form the provider sent it in.
    pub fn with_raw(mut self, raw: Value) -> Self {
        self.raw = raw;
        self
    }

    /// The standard allow-once / allow-always / reject-once options, for providers that offer none.
    pub fn standard_options() -> Vec<PermissionOption> {
        vec![
            PermissionOption::new("allow_once", "Allow once", PermissionKind::AllowOnce),
            PermissionOption::new("allow_always", "Always allow", PermissionKind::AllowAlways),
            PermissionOption::new("reject_once", "Reject", PermissionKind::RejectOnce),
        ]
    }

    /// The first option of a kind that refuses, if any.
    pub fn reject_option(&self) -> Option<&PermissionOption> {
        self.options.iter().find(|o| !o.kind.allows())
    }

    /// The first option of the given kind, if any.
    pub fn option_of(&self, kind: PermissionKind) -> Option<&PermissionOption> {
        self.options.iter().find(|o| o.kind == kind)
    }
}

/// The answer to a [`PermissionRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
#[non_exhaustive]
pub enum PermissionOutcome {
    /// One of the offered options was chosen.
    Selected {
        /// The option's id.
        option_id: String,
    },
    /// The request was cancelled (the turn was cancelled, or nobody could answer).
    Cancelled,
}

impl PermissionOutcome {
    /// Whether this outcome allows the action, given the request it answers.
    pub fn allows(&self, req: &PermissionRequest) -> bool {
        match self {
            PermissionOutcome::Selected { option_id } => {
                req.options.iter().any(|o| &o.id == option_id && o.kind.allows())
            }
            PermissionOutcome::Cancelled => false,
        }
    }
}

/// A request to read a text file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ReadTextFile {
    /// The path as the agent gave it.
    pub path: PathBuf,
    /// First line to read (1-based), if limited.
    #[serde(default)]
    pub line: Option<u32>,
    /// How many lines at most, if limited.
    #[serde(default)]
    pub limit: Option<u32>,
}

impl ReadTextFile {
    /// A request to read all of `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        ReadTextFile {
            path: path.into(),
            line: None,
            limit: None,
        }
    }

    /// The same request limited to `limit` lines (at most) from line `line` (1-based).
    pub fn with_range(mut self, line: Option<u32>, limit: Option<u32>) -> Self {
        self.line = line;
        self.limit = limit;
        self
    }
}

/// A request to write a text file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct WriteTextFile {
    /// The path as the agent gave it.
    pub path: PathBuf,
    /// The whole new content.
    pub content: String,
}

impl WriteTextFile {
    /// A request to replace `path`'s content with `content`.
    pub fn new(path: impl Into<PathBuf>, content: impl Into<String>) -> Self {
        WriteTextFile {
            path: path.into(),
            content: content.into(),
        }
    }
}

/// One of the five ACP terminal operations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
#[non_exhaustive]
pub enum TerminalRequest {
    /// Start a command.
    Create {
        /// The program.
        command: String,
        /// Its arguments.
        #[serde(default)]
        args: Vec<String>,
        /// Extra environment variables.
        #[serde(default)]
        env: Vec<(String, String)>,
        /// Working directory.
        #[serde(default)]
        cwd: Option<PathBuf>,
        /// Keep at most this many bytes of output (the oldest are dropped).
        #[serde(default)]
        output_byte_limit: Option<u64>,
    },
    /// Read the output so far.
    Output {
        /// The terminal's id.
        terminal_id: String,
    },
    /// Wait for the command to exit.
    WaitForExit {
        /// The terminal's id.
        terminal_id: String,
    },
    /// Kill the command (the terminal stays readable).
    Kill {
        /// The terminal's id.
        terminal_id: String,
    },
    /// Kill if running and forget the terminal.
    Release {
        /// The terminal's id.
        terminal_id: String,
    },
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ExitStatus {
    /// The exit code, when it exited normally.
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// The signal that ended it, when one did.
    #[serde(default)]
    pub signal: Option<String>,
}

impl ExitStatus {
    /// A normal exit with `code`.
    pub fn code(code: i32) -> Self {
        ExitStatus {
            exit_code: Some(code),
            signal: None,
        }
    }

    /// An end by `signal` (its name, e.g. `SIGKILL`).
    pub fn signal(signal: impl Into<String>) -> Self {
        ExitStatus {
            exit_code: None,
            signal: Some(signal.into()),
        }
    }
}

/// The answer to a [`TerminalRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
#[non_exhaustive]
pub enum TerminalResponse {
    /// A terminal was created.
    Created {
        /// Its id.
        terminal_id: String,
    },
    /// Output so far.
    Output {
        /// The retained output.
        output: String,
        /// Whether older output was dropped to stay within the limit.
        truncated: bool,
        /// The exit status, when the command has ended.
        exit_status: Option<ExitStatus>,
    },
    /// The command exited.
    Exited(ExitStatus),
    /// Done (kill, release).
    Done,
}

/// An agent asks the user for structured input (a form) or to visit a URL.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ElicitationRequest {
    /// The request's id, when the protocol has one.
    #[serde(default)]
    pub id: Option<String>,
    /// What the agent says to the user.
    pub message: String,
    /// Form or URL.
    pub mode: ElicitationMode,
    /// The request as the provider sent it.
    #[serde(default)]
    pub raw: Value,
}

impl ElicitationRequest {
    /// A request saying `message`, in `mode`.
    pub fn new(message: impl Into<String>, mode: ElicitationMode) -> Self {
        ElicitationRequest {
            id: None,
            message: message.into(),
            mode,
            raw: Value::Null,
        }
    }

    /// The same request with the protocol's id for it.
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// The same request with the form the provider sent it in.
    pub fn with_raw(mut self, raw: Value) -> Self {
        self.raw = raw;
        self
    }
}

/// The two kinds of elicitation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
#[non_exhaustive]
pub enum ElicitationMode {
    /// Fill in a form described by a JSON Schema.
    Form {
        /// The schema of the requested content.
        schema: Value,
    },
    /// Visit a URL out of band.
    Url {
        /// The URL.
        url: String,
    },
}

/// The answer to an [`ElicitationRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
#[non_exhaustive]
pub enum ElicitationResponse {
    /// The user accepted (with form content, for forms).
    Accept {
        /// The content.
        #[serde(default)]
        content: Option<Value>,
    },
    /// The user declined.
    Decline,
    /// The request was cancelled.
    Cancel,
}

/// Why a client-side request was not served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum HandlerError {
    /// This handler does not serve that kind of request.
    #[error("not supported by this handler: {0}")]
    Unsupported(String),
    /// Refused by policy or by the user.
    #[error("refused: {0}")]
    Refused(String),
    /// The path is outside the allowed roots.
    #[error("outside the workspace: {0}")]
    OutsideRoot(String),
    /// The thing asked for does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// The request's parameters are wrong.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// It failed while being served.
    #[error("failed: {0}")]
    Failed(String),
}

/// Which client-side requests a handler serves (ACP advertises them as client capabilities).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Capabilities {
    /// `read_text_file`.
    pub read_files: bool,
    /// `write_text_file`.
    pub write_files: bool,
    /// The `terminal` operations.
    pub terminals: bool,
    /// Form elicitation.
    pub elicitation_form: bool,
    /// URL elicitation.
    pub elicitation_url: bool,
}

impl Capabilities {
    /// No client-side request served (permission requests and events are baseline).
    pub fn none() -> Self {
        Self::default()
    }

    /// Every client-side request served.
    pub fn all() -> Self {
        Capabilities {
            read_files: true,
            write_files: true,
            terminals: true,
            elicitation_form: true,
            elicitation_url: true,
        }
    }

    /// The same, serving file reads and writes (`read`, `write`).
    pub fn with_files(mut self, read: bool, write: bool) -> Self {
        self.read_files = read;
        self.write_files = write;
        self
    }

    /// The same, serving the terminal operations or not.
    pub fn with_terminals(mut self, on: bool) -> Self {
        self.terminals = on;
        self
    }

    /// The same, serving form and URL elicitation (`form`, `url`).
    pub fn with_elicitation(mut self, form: bool, url: bool) -> Self {
        self.elicitation_form = form;
        self.elicitation_url = url;
        self
    }
}

/// Where the tools stay local: the one seam between a running agent and the user's process.
///
/// Every method has a default (no tools, events ignored, client-side requests refused), so an
/// implementation overrides only what it serves. `info` identifies the running session; handlers
/// that don't need it ignore it. See the module docs for delivery semantics.
///
/// ```
/// use tether::{Handler, SessionInfo, ToolOutput, ToolSpec, ToolUse};
///
/// struct Echo;
///
/// #[async_trait::async_trait]
/// impl Handler for Echo {
///     fn tools(&self) -> Vec<ToolSpec> {
///         vec![ToolSpec::new("echo", "Echo the input", serde_json::json!({"type":"object"}))]
///     }
///     async fn call_tool(&self, call: &ToolUse, _info: &SessionInfo) -> ToolOutput {
///         ToolOutput::Ok(call.input.to_string())
///     }
/// }
/// ```
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// The tools this handler serves, declared to the model.
    fn tools(&self) -> Vec<ToolSpec> {
        Vec::new()
    }

    /// A number that changes whenever [`tools`](Self::tools) may start returning something
    /// else (it must change *after* the new list is readable), so the engine keeps the list it
    /// read instead of copying it again every turn: a list of tens of tools with their schemas
    /// costs more to copy than the rest of a turn. `None`, the default: the handler cannot
    /// tell, and its list is read again each turn. A handler whose list never changes returns
    /// `Some` of a constant.
    ///
    /// ```
    /// use tether::{Handler, NoTools, ToolSet};
    /// assert_eq!(NoTools.tools_version(), Some(0));
    /// assert_eq!(ToolSet::new().tools_version(), Some(0)); // built once, never changed
    /// ```
    fn tools_version(&self) -> Option<u64> {
        None
    }

    /// Runs one tool call. At-least-once: make side effects idempotent on `call.id`, or let the
    /// session's store memo do it.
    async fn call_tool(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        let _ = info;
        ToolOutput::Error(format!("no tool named `{}` is available", call.name))
    }

    /// Whether `call` must be approved by the user before it runs, and if so a one-line summary
    /// to show them (`write_file notes.txt`). The engine asks before running a call: an
    /// unapproved one is left pending, waiting for approval ([`crate::Waiting::Approval`]), until
    /// the application approves that exact call ([`crate::Session::approve`]; it then runs once)
    /// or answers it ([`crate::Session::answer_tool_use`], e.g. with a denial). A call answered
    /// from the memo (it ran before) is not asked about again. The default needs no approval.
    fn needs_approval(&self, call: &ToolUse) -> Option<String> {
        let _ = call;
        None
    }

    /// Observes an event (durable or live). At-least-once.
    async fn on_event(&self, event: &Event, info: &SessionInfo) {
        let _ = (event, info);
    }

    /// Answers a permission request. The default refuses (picks a reject option, else cancels).
    async fn request_permission(&self, req: &PermissionRequest, info: &SessionInfo) -> PermissionOutcome {
        let _ = info;
        match req.reject_option() {
            Some(o) => PermissionOutcome::Selected {
                option_id: o.id.clone(),
            },
            None => PermissionOutcome::Cancelled,
        }
    }

    /// Reads a text file. The default refuses.
    async fn read_text_file(&self, req: &ReadTextFile, info: &SessionInfo) -> Result<String, HandlerError> {
        let _ = (req, info);
        Err(HandlerError::Unsupported("reading files".into()))
    }

    /// Writes a text file. The default refuses.
    async fn write_text_file(&self, req: &WriteTextFile, info: &SessionInfo) -> Result<(), HandlerError> {
        let _ = (req, info);
        Err(HandlerError::Unsupported("writing files".into()))
    }

    /// Serves a terminal operation. The default refuses.
    async fn terminal(
        &self,
        req: &TerminalRequest,
        info: &SessionInfo,
    ) -> Result<TerminalResponse, HandlerError> {
        let _ = (req, info);
        Err(HandlerError::Unsupported("terminals".into()))
    }

    /// Answers an elicitation. The default declines.
    async fn elicit(&self, req: &ElicitationRequest, info: &SessionInfo) -> ElicitationResponse {
        let _ = (req, info);
        ElicitationResponse::Decline
    }

    /// An accepted URL elicitation completed out of band.
    async fn elicitation_complete(&self, elicitation_id: &str, info: &SessionInfo) {
        let _ = (elicitation_id, info);
    }

    /// Which client-side requests this handler serves.
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
}

/// One [`Handler::tools_version`] made of several: the versions a handler's tool list is built
/// from (an inner handler's, its tool sources', a counter of its own). The same parts give the
/// same number; any change of a part gives a new one. For handlers that wrap others.
///
/// ```
/// use tether::ToolsVersion;
/// let v = ToolsVersion::new();
/// let a = v.of(&[0, 7]);
/// assert_eq!(v.of(&[0, 7]), a);
/// assert_ne!(v.of(&[0, 8]), a);
/// ```
#[derive(Debug, Default)]
pub struct ToolsVersion {
    last: std::sync::Mutex<Option<(Vec<u64>, u64)>>,
}

impl ToolsVersion {
    /// No parts seen yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The version for `parts`: the last one while `parts` are the last parts, else the next.
    /// `None` only if a panic poisoned the lock (the list is then read every time).
    pub fn of(&self, parts: &[u64]) -> Option<u64> {
        let mut g = self.last.lock().ok()?;
        let next = match g.as_ref() {
            Some((p, n)) if p.as_slice() == parts => return Some(*n),
            Some((_, n)) => n.wrapping_add(1),
            None => 0,
        };
        *g = Some((parts.to_vec(), next));
        Some(next)
    }
}

/// A handler with no tools that refuses everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTools;

#[async_trait]
impl Handler for NoTools {
    fn tools_version(&self) -> Option<u64> {
        Some(0)
    }
}

#[async_trait]
impl<H: Handler + ?Sized> Handler for Arc<H> {
    fn tools(&self) -> Vec<ToolSpec> {
        (**self).tools()
    }
    fn tools_version(&self) -> Option<u64> {
        (**self).tools_version()
    }
    async fn call_tool(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        (**self).call_tool(call, info).await
    }
    fn needs_approval(&self, call: &ToolUse) -> Option<String> {
        (**self).needs_approval(call)
    }
    async fn on_event(&self, event: &Event, info: &SessionInfo) {
        (**self).on_event(event, info).await
    }
    async fn request_permission(&self, req: &PermissionRequest, info: &SessionInfo) -> PermissionOutcome {
        (**self).request_permission(req, info).await
    }
    async fn read_text_file(&self, req: &ReadTextFile, info: &SessionInfo) -> Result<String, HandlerError> {
        (**self).read_text_file(req, info).await
    }
    async fn write_text_file(&self, req: &WriteTextFile, info: &SessionInfo) -> Result<(), HandlerError> {
        (**self).write_text_file(req, info).await
    }
    async fn terminal(
        &self,
        req: &TerminalRequest,
        info: &SessionInfo,
    ) -> Result<TerminalResponse, HandlerError> {
        (**self).terminal(req, info).await
    }
    async fn elicit(&self, req: &ElicitationRequest, info: &SessionInfo) -> ElicitationResponse {
        (**self).elicit(req, info).await
    }
    async fn elicitation_complete(&self, id: &str, info: &SessionInfo) {
        (**self).elicitation_complete(id, info).await
    }
    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }
}

type BoxFut<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type ToolFn = Arc<dyn Fn(ToolUse, SessionInfo) -> BoxFut<ToolOutput> + Send + Sync>;
type EventFn = Arc<dyn Fn(&Event, &SessionInfo) + Send + Sync>;

/// A handler built from closures: one per tool, with or without the [`SessionInfo`].
///
/// ```
/// use tether::{ToolSet, ToolSpec};
/// let tools = ToolSet::new()
///     .tool(ToolSpec::new("add", "Add a and b", serde_json::json!({"type":"object"})),
///         |input| async move {
///             let a = input["a"].as_i64().ok_or("a must be a number")?;
///             let b = input["b"].as_i64().ok_or("b must be a number")?;
///             Ok::<_, &str>((a + b).to_string())
///         });
/// assert_eq!(tools.names(), vec!["add"]);
/// ```
#[derive(Clone, Default)]
pub struct ToolSet {
    specs: Vec<ToolSpec>,
    fns: HashMap<String, ToolFn>,
    events: Option<EventFn>,
}

impl std::fmt::Debug for ToolSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolSet").field("tools", &self.names()).finish()
    }
}

impl ToolSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tool run by `f(input)`; `Ok` text is the result, `Err` becomes an error result.
    pub fn tool<F, Fut, E>(self, spec: ToolSpec, f: F) -> Self
    where
        F: Fn(Value) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<String, E>> + Send + 'static,
        E: std::fmt::Display + 'static,
    {
        self.tool_with_info(spec, move |call, _info| f(call.input))
    }

    /// Adds a tool run by `f(call, info)`, which also sees the tool-use id and the session.
    pub fn tool_with_info<F, Fut, E>(mut self, spec: ToolSpec, f: F) -> Self
    where
        F: Fn(ToolUse, SessionInfo) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<String, E>> + Send + 'static,
        E: std::fmt::Display + 'static,
    {
        let f = Arc::new(f);
        let name = spec.name.clone();
        self.specs.retain(|s| s.name != name);
        self.specs.push(spec);
        self.fns.insert(
            name,
            Arc::new(move |call, info| {
                let fut = f(call, info);
                Box::pin(async move { ToolOutput::from(fut.await) })
            }),
        );
        self
    }

    /// Declares a tool that is not run here (a front-end tool): calls to it pause the session.
    pub fn pending_tool(mut self, spec: ToolSpec) -> Self {
        let name = spec.name.clone();
        self.specs.retain(|s| s.name != name);
        self.specs.push(spec);
        self.fns
            .insert(name, Arc::new(|_, _| Box::pin(async { ToolOutput::Pending })));
        self
    }

    /// Observes every event with `f`.
    pub fn on_event(mut self, f: impl Fn(&Event, &SessionInfo) + Send + Sync + 'static) -> Self {
        self.events = Some(Arc::new(f));
        self
    }

    /// The tools' names, in the order added.
    pub fn names(&self) -> Vec<&str> {
        self.specs.iter().map(|s| s.name.as_str()).collect()
    }
}

#[async_trait]
impl Handler for ToolSet {
    fn tools(&self) -> Vec<ToolSpec> {
        self.specs.clone()
    }
    /// A set's tools are fixed when it is built (its builder methods take it by value).
    fn tools_version(&self) -> Option<u64> {
        Some(0)
    }

    async fn call_tool(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        match self.fns.get(&call.name) {
            Some(f) => f(call.clone(), info.clone()).await,
            None => ToolOutput::Error(format!(
                "no tool named `{}`; available: {}",
                call.name,
                self.names().join(", ")
            )),
        }
    }

    async fn on_event(&self, event: &Event, info: &SessionInfo) {
        if let Some(f) = &self.events {
            f(event, info);
        }
    }
}
