//! Tool sources: tools served from somewhere other than the handler itself (an MCP server, a
//! plugin), composed onto any [`Handler`] with names that never collide silently, filters, and
//! approvals that go through the handler's own permission path.
//!
//! - [`ToolSource`]: a source lists its tools and runs a call with a [`CallContext`] (the session,
//!   the handler to ask for elicitation, and [`ToolEvents`] to report progress into the session).
//! - [`ToolSources`]: an ordered set of sources, each with [`SourceOptions`] (prefix, allow/deny
//!   filters, approval). It computes the names the model sees and routes a call back to its source.
//! - [`WithTools`]: a handler that adds [`ToolSources`] to an inner handler. A call that needs
//!   approval is asked through the inner handler's [`Handler::request_permission`] (a terminal
//!   question in `tether run`), and is never run when refused.
//!
//! Names: a source's tool is exposed under its own name, or as `<source>__<tool>` when the
//! source's [`Prefix`] says so. Two tools under one name are a configuration error
//! ([`ToolsError::Collision`]) when the handler is built; a collision that appears later (a
//! source's tool list changed) withholds the later tool, with a warning, rather than shadowing
//! the earlier one.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde_json::json;

use crate::error::Result;
use crate::event::Event;
use crate::handler::{
    Capabilities, ElicitationRequest, ElicitationResponse, Handler, HandlerError, PermissionKind,
    PermissionOutcome, PermissionRequest, ReadTextFile, TerminalRequest, TerminalResponse, ToolOutput,
    WriteTextFile,
};
use crate::sink::EventSink;
use crate::types::{SessionInfo, ToolSpec, ToolUse};

tokio::task_local! {
    static TOOL_EVENTS: ToolEvents;
}

/// Where a running tool call reports into its session: progress and log events the source's
/// server sends while the call runs.
///
/// The session engine sets it around every [`Handler::call_tool`] it makes; a handler reads it
/// with [`ToolEvents::current`] (it is `None` outside a session's tool call, e.g. when a handler
/// is called directly).
#[derive(Clone)]
pub struct ToolEvents {
    sink: EventSink,
    tool_use_id: String,
    clock: CallClock,
}

impl std::fmt::Debug for ToolEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolEvents")
            .field("tool_use_id", &self.tool_use_id)
            .finish()
    }
}

impl ToolEvents {
    /// The events handle of the tool call running in this task, if the session engine runs it.
    pub fn current() -> Option<ToolEvents> {
        TOOL_EVENTS.try_with(Clone::clone).ok()
    }

    /// Runs `fut` with `self` as [`ToolEvents::current`].
    pub(crate) async fn scope<F: std::future::Future>(self, fut: F) -> F::Output {
        TOOL_EVENTS.scope(self, fut).await
    }

    /// A handle for the call `tool_use_id` of the session behind `sink`.
    pub(crate) fn new(sink: EventSink, tool_use_id: impl Into<String>) -> Self {
        ToolEvents {
            sink,
            tool_use_id: tool_use_id.into(),
            clock: CallClock::new(),
        }
    }

    /// The clock the session engine times this call's timeout by: a source pauses it
    /// ([`CallClock::pause`]) while the call waits for the user (an MCP elicitation), so the
    /// user's time does not count against the tool timeout.
    pub fn clock(&self) -> &CallClock {
        &self.clock
    }

    /// The id of the tool use the events are about.
    pub fn tool_use_id(&self) -> &str {
        &self.tool_use_id
    }

    /// Delivers a live event (subscribers and the handler; not recorded): progress.
    pub async fn live(&self, event: Event) {
        self.sink.emit_live(event).await;
    }

    /// Records a durable event exactly once (by its id) and delivers it.
    pub async fn record(&self, event: Event) -> Result<bool> {
        self.sink.emit(event).await
    }
}

/// A tool call's clock for its timeout, which can be paused: the time a call spends waiting for
/// the user (its server asked them something) is not the call's own work, and does not count.
///
/// Pauses nest (the clock runs again when the last [`ClockPause`] is dropped). Clones share the
/// clock.
#[derive(Debug, Clone)]
pub struct CallClock {
    state: Arc<tokio::sync::watch::Sender<ClockState>>,
    started: tokio::time::Instant,
}

#[derive(Debug, Default)]
struct ClockState {
    /// Pauses in force.
    paused: usize,
    /// When the pause in force began.
    since: Option<tokio::time::Instant>,
    /// The time spent paused before it.
    total: std::time::Duration,
}

impl Default for CallClock {
    fn default() -> Self {
        Self::new()
    }
}

impl CallClock {
    /// A clock started now.
    pub fn new() -> Self {
        CallClock {
            state: Arc::new(tokio::sync::watch::Sender::new(ClockState::default())),
            started: tokio::time::Instant::now(),
        }
    }

    /// Stops the clock until the returned guard is dropped.
    pub fn pause(&self) -> ClockPause {
        self.state.send_modify(|s| {
            if s.paused == 0 {
                s.since = Some(tokio::time::Instant::now());
            }
            s.paused += 1;
        });
        ClockPause {
            state: self.state.clone(),
        }
    }

    /// Whether a pause is in force.
    pub fn is_paused(&self) -> bool {
        self.state.borrow().paused > 0
    }

    /// The time the clock ran since it started (pauses left out).
    pub fn elapsed(&self) -> std::time::Duration {
        let now = tokio::time::Instant::now();
        let s = self.state.borrow();
        let paused = s.total
            + s.since
                .map(|t| now.saturating_duration_since(t))
                .unwrap_or_default();
        now.saturating_duration_since(self.started).saturating_sub(paused)
    }

    /// Runs `fut` until it ends (`Some`) or the clock has run for `limit` (`None`; `fut` is
    /// dropped). While the clock is paused the limit does not come nearer.
    pub async fn timeout<F: std::future::Future>(
        &self,
        limit: std::time::Duration,
        fut: F,
    ) -> Option<F::Output> {
        tokio::pin!(fut);
        let mut rx = self.state.subscribe();
        loop {
            if rx.borrow_and_update().paused > 0 {
                tokio::select! {
                    out = &mut fut => return Some(out),
                    // The sender lives as long as `self`: an error cannot happen here.
                    _ = rx.wait_for(|s| s.paused == 0) => continue,
                }
            }
            let left = limit.saturating_sub(self.elapsed());
            if left.is_zero() {
                return None;
            }
            tokio::select! {
                out = &mut fut => return Some(out),
                _ = tokio::time::sleep(left) => {}
                // A pause began: wait for its end above instead of for the limit.
                _ = rx.wait_for(|s| s.paused > 0) => {}
            }
        }
    }
}

/// A pause of a [`CallClock`]: the clock runs again when the last one is dropped.
#[derive(Debug)]
pub struct ClockPause {
    state: Arc<tokio::sync::watch::Sender<ClockState>>,
}

impl Drop for ClockPause {
    fn drop(&mut self) {
        self.state.send_modify(|s| {
            s.paused = s.paused.saturating_sub(1);
            if s.paused == 0
                && let Some(t) = s.since.take()
            {
                s.total += tokio::time::Instant::now().saturating_duration_since(t);
            }
        });
    }
}

/// What a [`ToolSource`] is given with a call: who is calling, and the way back to the user.
#[derive(Clone)]
#[non_exhaustive]
pub struct CallContext {
    /// The session the call belongs to.
    pub info: SessionInfo,
    /// The handler that serves the session's client-side requests: a source's server asking the
    /// user something (an MCP elicitation) asks it through [`Handler::elicit`].
    pub handler: Arc<dyn Handler>,
    /// Where progress and logs go, when the session engine runs the call.
    pub events: Option<ToolEvents>,
}

impl std::fmt::Debug for CallContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallContext")
            .field("info", &self.info)
            .field("events", &self.events)
            .finish()
    }
}

impl CallContext {
    /// A call made for session `info`, whose server's requests go to `handler`, with no event
    /// channel (a call made outside the session engine).
    pub fn new(info: SessionInfo, handler: Arc<dyn Handler>) -> Self {
        CallContext {
            info,
            handler,
            events: None,
        }
    }

    /// The same context reporting progress and logs through `events`.
    pub fn with_events(mut self, events: Option<ToolEvents>) -> Self {
        self.events = events;
        self
    }
}

/// A source of tools: lists them and runs calls of them (by the source's own names).
#[async_trait]
pub trait ToolSource: Send + Sync + 'static {
    /// The tools as the source names them now (it may change between turns).
    fn tools(&self) -> Vec<ToolSpec>;

    /// Runs one call; `call.name` is the source's own name for the tool. A dropped future is a
    /// cancelled call: the source stops the work it started (and tells its server).
    async fn call(&self, call: &ToolUse, cx: CallContext) -> ToolOutput;

    /// A number that changes whenever [`tools`](Self::tools) may start returning something else
    /// (it must change *after* the new list is readable), so [`ToolSources`] can keep the names
    /// and routes it derived from the list instead of rebuilding them on every turn and call.
    /// `None` (the default): the source cannot tell, and its list is read again each time.
    fn tools_version(&self) -> Option<u64> {
        None
    }
}

#[async_trait]
impl<S: ToolSource + ?Sized> ToolSource for Arc<S> {
    fn tools(&self) -> Vec<ToolSpec> {
        (**self).tools()
    }
    fn tools_version(&self) -> Option<u64> {
        (**self).tools_version()
    }
    async fn call(&self, call: &ToolUse, cx: CallContext) -> ToolOutput {
        (**self).call(call, cx).await
    }
}

/// When a source's tools are exposed as `<source>__<tool>`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Prefix {
    /// Never: a name taken by another tool is a configuration error.
    #[default]
    Never,
    /// Always.
    Always,
    /// Only the tools whose bare name another source or the handler also has.
    OnCollision,
}

/// Which of a source's tools need the user's approval before each call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ApprovalRule {
    /// None of them.
    #[default]
    Never,
    /// All of them.
    Always,
    /// The tools these patterns match (the source's own names; `*` matches any run of
    /// characters).
    Tools(Vec<String>),
}

/// How one source is added: its name, prefix, filters and approval.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SourceOptions {
    /// The source's name (used in prefixes, approvals and messages).
    pub name: String,
    /// When its tools are prefixed.
    pub prefix: Prefix,
    /// When set, only the tools these patterns match are exposed.
    pub allow: Option<Vec<String>>,
    /// The tools these patterns match are never exposed nor called.
    pub deny: Vec<String>,
    /// Which tools are asked for.
    pub approval: ApprovalRule,
}

impl SourceOptions {
    /// A source named `name`: no prefix, no filter, no approval.
    pub fn new(name: impl Into<String>) -> Self {
        SourceOptions {
            name: name.into(),
            prefix: Prefix::Never,
            allow: None,
            deny: Vec::new(),
            approval: ApprovalRule::Never,
        }
    }

    /// Sets the prefix rule.
    pub fn prefix(mut self, p: Prefix) -> Self {
        self.prefix = p;
        self
    }

    /// Exposes only the tools these patterns match.
    pub fn allow<I: IntoIterator<Item = S>, S: Into<String>>(mut self, patterns: I) -> Self {
        self.allow = Some(patterns.into_iter().map(Into::into).collect());
        self
    }

    /// Never exposes nor calls the tools these patterns match.
    pub fn deny<I: IntoIterator<Item = S>, S: Into<String>>(mut self, patterns: I) -> Self {
        self.deny = patterns.into_iter().map(Into::into).collect();
        self
    }

    /// Sets which tools are asked for.
    pub fn approval(mut self, a: ApprovalRule) -> Self {
        self.approval = a;
        self
    }

    /// Whether the source's tool `tool` (its own name) passes the filters.
    pub fn admits(&self, tool: &str) -> bool {
        let allowed = match &self.allow {
            Some(a) => a.iter().any(|p| glob(p, tool)),
            None => true,
        };
        allowed && !self.deny.iter().any(|p| glob(p, tool))
    }

    /// Whether calls of `tool` (its own name) are asked for.
    pub fn asks(&self, tool: &str) -> bool {
        match &self.approval {
            ApprovalRule::Never => false,
            ApprovalRule::Always => true,
            ApprovalRule::Tools(ps) => ps.iter().any(|p| glob(p, tool)),
        }
    }
}

/// `*` matches any run of characters; everything else matches itself.
fn glob(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    // Iterative wildcard match with one backtrack point.
    let (mut i, mut j, mut star, mut mark) = (0usize, 0usize, None::<usize>, 0usize);
    while j < n.len() {
        if i < p.len() && p[i] != '*' && p[i] == n[j] {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if let Some(s) = star {
            i = s + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    while i < p.len() && p[i] == '*' {
        i += 1;
    }
    i == p.len()
}

/// Why tool sources cannot be composed as configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ToolsError {
    /// Two tools would be exposed under one name.
    #[error(
        "two tools are named `{name}`: {first} and {second}; give one of the sources a prefix (`prefix = \"always\"` or `\"on_collision\"`) or filter one of them out"
    )]
    Collision {
        /// The name.
        name: String,
        /// Who has it first (`the handler`, `MCP server x`).
        first: String,
        /// Who has it too.
        second: String,
    },
    /// Two sources share a name.
    #[error("two tool sources are named `{0}`; source names must be unique")]
    DuplicateSource(String),
}

struct Entry {
    opts: SourceOptions,
    source: Arc<dyn ToolSource>,
}

/// Where an exposed tool name leads.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Route {
    /// The index of the source, in the order added.
    pub source: usize,
    /// The source's name.
    pub source_name: String,
    /// The tool's own name at the source.
    pub tool: String,
    /// Whether calls of it are asked for.
    pub asks: bool,
}

/// An ordered set of tool sources, each with its options.
#[derive(Default)]
pub struct ToolSources {
    entries: Vec<Arc<Entry>>,
    /// The mapping last built, with what it was built from: reused while the handler's names and
    /// every source's [`ToolSource::tools_version`] are the same (a turn declares the tools and
    /// a call routes by them: without it each rebuilt the whole mapping from fresh copies of
    /// every source's list).
    cache: Mutex<Option<Cached>>,
    /// [`ToolSources::tools_version`]'s numbers.
    version: crate::handler::ToolsVersion,
}

impl Clone for ToolSources {
    fn clone(&self) -> Self {
        ToolSources {
            entries: self.entries.clone(),
            cache: Mutex::new(None),
            version: crate::handler::ToolsVersion::new(),
        }
    }
}

/// A [`Mapping`] and what it was built from.
struct Cached {
    taken: Vec<String>,
    versions: Vec<u64>,
    mapping: Arc<Mapping>,
}

impl std::fmt::Debug for ToolSources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|e| &e.opts.name))
            .finish()
    }
}

/// The exposed tools and where each leads.
struct Mapping {
    tools: Vec<ToolSpec>,
    routes: HashMap<String, Route>,
    collisions: Vec<ToolsError>,
}

impl ToolSources {
    /// No sources.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a source (sources added earlier win a late collision).
    pub fn add(mut self, source: impl ToolSource, opts: SourceOptions) -> Result<Self, ToolsError> {
        self.push(Arc::new(source), opts)?;
        Ok(self)
    }

    /// Adds a shared source.
    pub fn push(&mut self, source: Arc<dyn ToolSource>, opts: SourceOptions) -> Result<(), ToolsError> {
        if self.entries.iter().any(|e| e.opts.name == opts.name) {
            return Err(ToolsError::DuplicateSource(opts.name));
        }
        self.entries.push(Arc::new(Entry { opts, source }));
        if let Ok(mut c) = self.cache.lock() {
            *c = None;
        }
        Ok(())
    }

    /// Whether there are no sources.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The sources' options, in order.
    pub fn options(&self) -> impl Iterator<Item = &SourceOptions> {
        self.entries.iter().map(|e| &e.opts)
    }

    /// The mapping beside `taken`, reused from the last one built while nothing it depends on
    /// changed (see [`ToolSource::tools_version`]); built afresh, and not kept, when a source
    /// has no version (then the `bool` is `true`). A kept mapping's collisions are logged once,
    /// when it is built.
    fn current(&self, taken: &[String]) -> (Arc<Mapping>, bool) {
        // The versions are read before the lists (`mapping` reads them after): a list that
        // changes in between is then kept under the older version, and rebuilt next time.
        let Some(versions) = self.versions() else {
            return (Arc::new(self.mapping(taken)), true);
        };
        if let Ok(c) = self.cache.lock()
            && let Some(c) = c.as_ref()
            && c.versions == versions
            && c.taken == taken
        {
            return (c.mapping.clone(), false);
        }
        let mapping = Arc::new(self.mapping(taken));
        for c in &mapping.collisions {
            tracing::warn!("a tool was left out: {c}");
        }
        if let Ok(mut c) = self.cache.lock() {
            *c = Some(Cached {
                taken: taken.to_vec(),
                versions,
                mapping: mapping.clone(),
            });
        }
        (mapping, false)
    }

    /// A number that changes whenever a source's [`ToolSource::tools_version`] does (so what
    /// [`tools`](Self::tools) returns for the same `taken` may change); `None` when a source has
    /// no version. For a [`Handler`] that declares the sources' tools beside its own, as its
    /// part of [`Handler::tools_version`].
    pub fn tools_version(&self) -> Option<u64> {
        self.version.of(&self.versions()?)
    }

    /// Every source's [`ToolSource::tools_version`], in order; `None` when one has none.
    fn versions(&self) -> Option<Vec<u64>> {
        self.entries.iter().map(|e| e.source.tools_version()).collect()
    }

    fn mapping(&self, taken: &[String]) -> Mapping {
        let lists: Vec<Vec<ToolSpec>> = self
            .entries
            .iter()
            .map(|e| {
                e.source
                    .tools()
                    .into_iter()
                    .filter(|t| e.opts.admits(&t.name))
                    .collect()
            })
            .collect();
        // How many owners each bare name has (the handler counts as one).
        let mut owners: HashMap<&str, usize> = HashMap::new();
        for n in taken {
            *owners.entry(n.as_str()).or_default() += 1;
        }
        for list in &lists {
            let mut seen = HashSet::new();
            for t in list {
                if seen.insert(t.name.as_str()) {
                    *owners.entry(t.name.as_str()).or_default() += 1;
                }
            }
        }
        let mut who: HashMap<String, String> = taken
            .iter()
            .map(|n| (n.clone(), "the handler's own tool".to_owned()))
            .collect();
        let mut m = Mapping {
            tools: Vec::new(),
            routes: HashMap::new(),
            collisions: Vec::new(),
        };
        for (i, (e, list)) in self.entries.iter().zip(&lists).enumerate() {
            for t in list {
                let prefixed = match e.opts.prefix {
                    Prefix::Always => true,
                    Prefix::Never => false,
                    Prefix::OnCollision => owners.get(t.name.as_str()).copied().unwrap_or(0) > 1,
                };
                let exposed = if prefixed {
                    format!("{}__{}", e.opts.name, t.name)
                } else {
                    t.name.clone()
                };
                let me = format!("`{}` of source `{}`", t.name, e.opts.name);
                if let Some(first) = who.get(&exposed) {
                    m.collisions.push(ToolsError::Collision {
                        name: exposed.clone(),
                        first: first.clone(),
                        second: me,
                    });
                    continue;
                }
                who.insert(exposed.clone(), me);
                m.routes.insert(
                    exposed.clone(),
                    Route {
                        source: i,
                        source_name: e.opts.name.clone(),
                        tool: t.name.clone(),
                        asks: e.opts.asks(&t.name),
                    },
                );
                m.tools.push(ToolSpec {
                    name: exposed,
                    ..t.clone()
                });
            }
        }
        m
    }

    /// Checks the sources' tools as they are now against each other and `taken` (the names the
    /// handler serves itself): the first collision is the error.
    pub fn check(&self, taken: &[String]) -> Result<(), ToolsError> {
        match self.mapping(taken).collisions.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The tools exposed beside `taken`, renamed per the prefixes and filtered. A tool whose name
    /// is already taken is left out with a warning (a collision that appeared after
    /// [`check`](Self::check), when a source's list changed).
    pub fn tools(&self, taken: &[String]) -> Vec<ToolSpec> {
        let (m, uncached) = self.current(taken);
        // A kept mapping's collisions were said when it was built (once per change of the
        // lists, not on every turn).
        if uncached {
            for c in &m.collisions {
                tracing::warn!("a tool was left out: {c}");
            }
        }
        m.tools.clone()
    }

    /// Where the exposed name `name` leads, if a source serves it.
    pub fn route(&self, name: &str, taken: &[String]) -> Option<Route> {
        if taken.iter().any(|t| t == name) {
            return None;
        }
        self.current(taken).0.routes.get(name).cloned()
    }

    /// The mapping [`route`](Self::route) reads, to borrow a route from instead of copying it;
    /// `None` when `name` is one of `taken`.
    fn routes_for(&self, name: &str, taken: &[String]) -> Option<Arc<Mapping>> {
        if taken.iter().any(|t| t == name) {
            return None;
        }
        Some(self.current(taken).0)
    }

    /// Runs a call routed by [`route`](Self::route) (no approval asked here: the caller's gate
    /// has decided). The call reaches the source under the tool's own name.
    pub async fn call_routed(&self, route: &Route, call: &ToolUse, cx: CallContext) -> ToolOutput {
        let Some(e) = self.entries.get(route.source) else {
            return ToolOutput::Error(format!("no tool named `{}`", call.name));
        };
        if !e.opts.admits(&route.tool) {
            return ToolOutput::Error(format!(
                "tool `{}` is not allowed by the configuration of `{}`; it was not run",
                route.tool, e.opts.name
            ));
        }
        if route.tool == call.name {
            // Exposed under its own name: the call as it is.
            return e.source.call(call, cx).await;
        }
        let mut own = call.clone();
        own.name = route.tool.clone();
        e.source.call(&own, cx).await
    }
}

/// A handler with tool sources added to an inner handler's own tools.
///
/// ```
/// use tether::source::{ToolSources, WithTools};
/// use tether::ToolSet;
/// let h = WithTools::new(ToolSet::new(), ToolSources::new()).unwrap();
/// # let _ = h;
/// ```
pub struct WithTools<H: ?Sized> {
    inner: Arc<H>,
    sources: ToolSources,
    /// (session, exposed tool) the user allowed for the rest of the session.
    always: Mutex<HashSet<(String, String)>>,
    /// The inner handler's tool names under its [`Handler::tools_version`], so a call does not
    /// copy its whole list to learn them.
    taken: Mutex<Option<(u64, Arc<[String]>)>>,
    /// What this handler's [`Handler::tools_version`] was computed from (the inner handler's
    /// and the sources' versions) and the number it gave.
    version: crate::handler::ToolsVersion,
}

impl<H: Handler> WithTools<H> {
    /// `inner` with `sources` added; fails on a collision among their tools as they are now.
    pub fn new(inner: H, sources: ToolSources) -> Result<Self, ToolsError> {
        Self::from_arc(Arc::new(inner), sources)
    }
}

impl<H: Handler + ?Sized> WithTools<H> {
    /// Like [`WithTools::new`], with a shared inner handler.
    pub fn from_arc(inner: Arc<H>, sources: ToolSources) -> Result<Self, ToolsError> {
        let taken = own_names(&*inner);
        sources.check(&taken)?;
        Ok(WithTools {
            inner,
            sources,
            always: Mutex::new(HashSet::new()),
            taken: Mutex::new(None),
            version: crate::handler::ToolsVersion::new(),
        })
    }

    /// The inner handler.
    pub fn inner(&self) -> &Arc<H> {
        &self.inner
    }

    /// The sources.
    pub fn sources(&self) -> &ToolSources {
        &self.sources
    }

    /// The inner handler's tool names, kept while its [`Handler::tools_version`] stays the same
    /// (read again each time when it has none).
    fn taken(&self) -> Arc<[String]> {
        // The version is read before the list: a list that changes in between is kept under
        // the older version, and read again next time.
        let Some(v) = self.inner.tools_version() else {
            return own_names(&*self.inner).into();
        };
        if let Ok(g) = self.taken.lock()
            && let Some((kept, names)) = g.as_ref()
            && *kept == v
        {
            return names.clone();
        }
        let names: Arc<[String]> = own_names(&*self.inner).into();
        if let Ok(mut g) = self.taken.lock() {
            *g = Some((v, names.clone()));
        }
        names
    }

    /// Asks the inner handler whether `call` of `route` may run; `None` when it may, else why not.
    async fn approve(&self, route: &Route, call: &ToolUse, info: &SessionInfo) -> Option<String> {
        let key = (info.session_id.clone(), call.name.clone());
        if self.always.lock().map(|g| g.contains(&key)).unwrap_or(false) {
            return None;
        }
        let req = PermissionRequest {
            tool_use_id: call.id.clone(),
            title: format!("{} (tool `{}` of `{}`)", call.name, route.tool, route.source_name),
            input: call.input.clone(),
            kind: None,
            options: PermissionRequest::standard_options(),
            raw: json!({"source": route.source_name, "tool": route.tool}),
        };
        let outcome = self.inner.request_permission(&req, info).await;
        if !outcome.allows(&req) {
            return Some(format!(
                "the user refused the call of `{}` ({} of `{}`); it was not run",
                call.name, route.tool, route.source_name
            ));
        }
        if let PermissionOutcome::Selected { option_id } = &outcome
            && req
                .options
                .iter()
                .any(|o| &o.id == option_id && o.kind == PermissionKind::AllowAlways)
            && let Ok(mut g) = self.always.lock()
        {
            g.insert(key);
        }
        None
    }
}

fn own_names<H: Handler + ?Sized>(h: &H) -> Vec<String> {
    h.tools().into_iter().map(|t| t.name).collect()
}

#[async_trait]
impl<H: Handler + ?Sized> Handler for WithTools<H> {
    fn tools(&self) -> Vec<ToolSpec> {
        let mut own = self.inner.tools();
        let taken: Vec<String> = own.iter().map(|t| t.name.clone()).collect();
        own.extend(self.sources.tools(&taken));
        own
    }

    /// Changes whenever the inner handler's or a source's version does; `None` when one of
    /// them has none.
    fn tools_version(&self) -> Option<u64> {
        // The sources' combined version and the inner handler's.
        self.version
            .of(&[self.sources.tools_version()?, self.inner.tools_version()?])
    }

    async fn call_tool(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        let taken = self.taken();
        let mapping = self.sources.routes_for(&call.name, &taken);
        let Some(route) = mapping.as_ref().and_then(|m| m.routes.get(&call.name)) else {
            return self.inner.call_tool(call, info).await;
        };
        if route.asks
            && let Some(refusal) = self.approve(route, call, info).await
        {
            return ToolOutput::Error(refusal);
        }
        let cx = CallContext {
            info: info.clone(),
            handler: Arc::new(self.inner.clone()) as Arc<dyn Handler>,
            events: ToolEvents::current(),
        };
        self.sources.call_routed(route, call, cx).await
    }

    async fn on_event(&self, event: &Event, info: &SessionInfo) {
        self.inner.on_event(event, info).await
    }
    async fn request_permission(&self, req: &PermissionRequest, info: &SessionInfo) -> PermissionOutcome {
        self.inner.request_permission(req, info).await
    }
    async fn read_text_file(&self, req: &ReadTextFile, info: &SessionInfo) -> Result<String, HandlerError> {
        self.inner.read_text_file(req, info).await
    }
    async fn write_text_file(&self, req: &WriteTextFile, info: &SessionInfo) -> Result<(), HandlerError> {
        self.inner.write_text_file(req, info).await
    }
    async fn terminal(
        &self,
        req: &TerminalRequest,
        info: &SessionInfo,
    ) -> Result<TerminalResponse, HandlerError> {
        self.inner.terminal(req, info).await
    }
    async fn elicit(&self, req: &ElicitationRequest, info: &SessionInfo) -> ElicitationResponse {
        self.inner.elicit(req, info).await
    }
    async fn elicitation_complete(&self, id: &str, info: &SessionInfo) {
        self.inner.elicitation_complete(id, info).await
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::ToolSet;

    struct Fixed(Vec<&'static str>);

    #[async_trait]
    impl ToolSource for Fixed {
        fn tools(&self) -> Vec<ToolSpec> {
            self.0
                .iter()
                .map(|n| ToolSpec::new(*n, *n, json!({"type": "object"})))
                .collect()
        }
        async fn call(&self, call: &ToolUse, _cx: CallContext) -> ToolOutput {
            ToolOutput::Ok(format!("ran {}", call.name))
        }
    }

    /// A source whose list can change, with a version, counting how often its list is read.
    struct Versioned {
        list: Mutex<Vec<&'static str>>,
        version: std::sync::atomic::AtomicU64,
        reads: std::sync::atomic::AtomicUsize,
    }

    #[async_trait]
    impl ToolSource for Versioned {
        fn tools(&self) -> Vec<ToolSpec> {
            self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Fixed(self.list.lock().unwrap().clone()).tools()
        }
        async fn call(&self, call: &ToolUse, _cx: CallContext) -> ToolOutput {
            ToolOutput::Ok(format!("ran {}", call.name))
        }
        fn tools_version(&self) -> Option<u64> {
            Some(self.version.load(std::sync::atomic::Ordering::SeqCst))
        }
    }

    #[tokio::test]
    async fn a_versioned_source_is_read_again_only_when_its_version_changes() {
        use std::sync::atomic::Ordering::SeqCst;
        let src = Arc::new(Versioned {
            list: Mutex::new(vec!["echo"]),
            version: 0.into(),
            reads: 0.into(),
        });
        let s = ToolSources::new()
            .add(src.clone(), SourceOptions::new("a").prefix(Prefix::Always))
            .unwrap();
        let h = WithTools::new(ToolSet::new(), s).unwrap();
        let info = SessionInfo::new("s", "t");
        let before = src.reads.load(SeqCst);
        for i in 0..3 {
            assert_eq!(names(&h), vec!["a__echo"]);
            let out = h
                .call_tool(&ToolUse::new(format!("{i}"), "a__echo", json!({})), &info)
                .await;
            assert_eq!(out, ToolOutput::Ok("ran echo".into()));
        }
        assert_eq!(
            src.reads.load(SeqCst) - before,
            1,
            "the list is read once while unchanged"
        );
        // The list changes, then the version: the next turn and call see the new list.
        *src.list.lock().unwrap() = vec!["sum"];
        src.version.fetch_add(1, SeqCst);
        assert_eq!(names(&h), vec!["a__sum"]);
        let out = h.call_tool(&ToolUse::new("9", "a__echo", json!({})), &info).await;
        assert!(
            matches!(out, ToolOutput::Error(_)),
            "a removed tool is not routed: {out:?}"
        );
        let out = h.call_tool(&ToolUse::new("10", "a__sum", json!({})), &info).await;
        assert_eq!(out, ToolOutput::Ok("ran sum".into()));
    }

    #[test]
    fn with_tools_has_a_version_while_every_part_has_one_and_it_changes_with_them() {
        use std::sync::atomic::Ordering::SeqCst;
        let src = Arc::new(Versioned {
            list: Mutex::new(vec!["echo"]),
            version: 0.into(),
            reads: 0.into(),
        });
        let s = ToolSources::new()
            .add(src.clone(), SourceOptions::new("a"))
            .unwrap();
        let h = WithTools::new(ToolSet::new(), s).unwrap();
        let v = h.tools_version();
        assert!(v.is_some());
        assert_eq!(h.tools_version(), v, "the same while nothing changes");
        src.version.fetch_add(1, SeqCst);
        let w = h.tools_version();
        assert!(w.is_some() && w != v, "{v:?} then {w:?}");
        assert_eq!(h.tools_version(), w);
        // A source without a version: the handler cannot tell either.
        let s = ToolSources::new()
            .add(Fixed(vec!["echo"]), SourceOptions::new("a"))
            .unwrap();
        assert_eq!(WithTools::new(ToolSet::new(), s).unwrap().tools_version(), None);
        // Nor with an inner handler that has none.
        struct Unversioned;
        #[async_trait]
        impl Handler for Unversioned {}
        let s = ToolSources::new().add(src, SourceOptions::new("a")).unwrap();
        assert_eq!(WithTools::new(Unversioned, s).unwrap().tools_version(), None);
    }

    fn names(h: &impl Handler) -> Vec<String> {
        h.tools().into_iter().map(|t| t.name).collect()
    }

    #[test]
    fn globs() {
        assert!(glob("*", ""));
        assert!(glob("get-*", "get-sum"));
        assert!(glob("*-sum", "get-sum"));
        assert!(glob("g*t*m", "get-sum"));
        assert!(!glob("get-*", "echo"));
        assert!(!glob("echo", "echo2"));
        assert!(glob("e*o", "echo"));
    }

    #[test]
    fn a_collision_without_a_prefix_is_an_error_naming_both() {
        let s = ToolSources::new()
            .add(Fixed(vec!["echo"]), SourceOptions::new("a"))
            .unwrap()
            .add(Fixed(vec!["echo"]), SourceOptions::new("b"))
            .unwrap();
        let Err(e) = WithTools::new(ToolSet::new(), s) else {
            panic!("a collision must fail")
        };
        let m = e.to_string();
        assert!(
            m.contains("`echo`")
                && m.contains("source `a`")
                && m.contains("source `b`")
                && m.contains("prefix"),
            "{m}"
        );
    }

    #[test]
    fn a_collision_with_the_handlers_own_tool_is_an_error() {
        let own = ToolSet::new().tool(ToolSpec::new("read_file", "", json!({})), |_| async {
            Ok::<_, String>(String::new())
        });
        let s = ToolSources::new()
            .add(Fixed(vec!["read_file"]), SourceOptions::new("fs"))
            .unwrap();
        assert!(matches!(
            WithTools::new(own, s),
            Err(ToolsError::Collision { .. })
        ));
    }

    #[tokio::test]
    async fn prefixes_route_back_to_the_sources_own_names() {
        let s = ToolSources::new()
            .add(
                Fixed(vec!["echo", "only_a"]),
                SourceOptions::new("a").prefix(Prefix::OnCollision),
            )
            .unwrap()
            .add(
                Fixed(vec!["echo"]),
                SourceOptions::new("b").prefix(Prefix::Always),
            )
            .unwrap();
        let h = WithTools::new(ToolSet::new(), s).unwrap();
        assert_eq!(names(&h), vec!["a__echo", "only_a", "b__echo"]);
        let info = SessionInfo::new("s", "test");
        let out = h.call_tool(&ToolUse::new("1", "b__echo", json!({})), &info).await;
        assert_eq!(out, ToolOutput::Ok("ran echo".into()));
        let out = h.call_tool(&ToolUse::new("2", "echo", json!({})), &info).await;
        assert!(
            matches!(out, ToolOutput::Error(_)),
            "the bare name is not exposed: {out:?}"
        );
    }

    #[tokio::test]
    async fn a_denied_tool_is_neither_listed_nor_called() {
        let s = ToolSources::new()
            .add(Fixed(vec!["echo", "rm"]), SourceOptions::new("a").deny(["rm"]))
            .unwrap();
        let h = WithTools::new(ToolSet::new(), s).unwrap();
        assert_eq!(names(&h), vec!["echo"]);
        let out = h
            .call_tool(&ToolUse::new("1", "rm", json!({})), &SessionInfo::new("s", "t"))
            .await;
        assert!(matches!(out, ToolOutput::Error(_)));
    }

    #[tokio::test]
    async fn an_approval_goes_through_the_inner_handlers_permission_path() {
        // ToolSet refuses permission by default (the Handler default).
        let s = ToolSources::new()
            .add(
                Fixed(vec!["echo", "rm"]),
                SourceOptions::new("a").approval(ApprovalRule::Tools(vec!["rm".into()])),
            )
            .unwrap();
        let h = WithTools::new(ToolSet::new(), s).unwrap();
        let info = SessionInfo::new("s", "t");
        let out = h.call_tool(&ToolUse::new("1", "rm", json!({})), &info).await;
        match out {
            ToolOutput::Error(m) => assert!(m.contains("refused"), "{m}"),
            o => panic!("{o:?}"),
        }
        let out = h.call_tool(&ToolUse::new("2", "echo", json!({})), &info).await;
        assert_eq!(out, ToolOutput::Ok("ran echo".into()));
    }
}
