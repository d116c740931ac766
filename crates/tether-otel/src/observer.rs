//! The spans and metrics of one session, built from its events as they are delivered.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{BoundHistogram, Histogram, Meter};
use opentelemetry::trace::{
    SpanBuilder, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer as _,
};
use opentelemetry_sdk::trace::SdkTracer;
use serde_json::{Map, Value, json};
use tether::{Event, EventKind, EventObserver, EventSink, Mark, ModelCall, Role, SessionResult, ToolUse};
use tokio::sync::mpsc;
use tracing::Dispatch;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::semconv as sc;

/// The key of the session state (see [`tether::EventStore::put_state`]) where a traced session
/// keeps its last request's trace context, so the next request — after a restart too — links to
/// it: `{"traceparent", "open", "pending": {tool_use_id: traceparent}}`. `open` stays `true`
/// when the process died during the request. In the local loop it is written in the store step
/// of each model response ([`tether::EventObserver::state_with`]), not by a write of its own.
pub const STATE_KEY: &str = "tether.otel";

/// The `tracing` target of every span tether-otel makes (filter on it to route them).
pub const TARGET: &str = "tether_otel";

/// The most characters of an error message kept as a span's status description.
const MAX_STATUS: usize = 256;
/// The most characters of a model-given name in a span's name (a tool's).
const MAX_NAME: usize = 64;
/// The most characters of a model- or server-given attribute value (a tool name, a call id, a
/// response id or model).
const MAX_VALUE: usize = 256;
/// The most characters of one content attribute (messages, tool arguments, a tool's result).
const MAX_CONTENT: usize = 64 << 10;

/// `s` as an attribute value from outside (a model, a server): at most `max` characters (cut
/// with `…`); control characters dropped, except line breaks and tabs in content.
fn clip(s: &str, max: usize) -> String {
    // The usual value (a model name, a response id: short, printable ASCII) is copied as it is,
    // without a pass over its characters.
    if s.len() <= max && s.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return s.to_owned();
    }
    let keep = |c: &char| !c.is_control() || (max == MAX_CONTENT && matches!(c, '\n' | '\t' | '\r'));
    let mut out: String = s.chars().filter(keep).take(max).collect();
    if s.chars().filter(keep).nth(max).is_some() {
        out.push('…');
    }
    out
}

/// Builds the GenAI spans and metrics of sessions: make one per application (or per agent), and
/// give each session an observer from it ([`Tracer::observer`] for
/// [`tether::SessionBuilder::observer`], or [`Tracer::attach`] for an open session).
///
/// A tracer from [`crate::Telemetry::tracer`] builds its spans directly on the telemetry's
/// OpenTelemetry SDK tracer: no `tracing` span is made. A request span with no other parent is
/// then a child of the OpenTelemetry span of the current `tracing` span, if it has one (an
/// application's own operation traced through a `tracing-opentelemetry` layer).
///
/// A tracer without an SDK tracer ([`Tracer::new`]), or given a dispatcher
/// ([`Tracer::with_dispatch`]), makes `tracing` spans (target [`TARGET`]) carrying the
/// OpenTelemetry fields `tracing-opentelemetry` reads, so they reach OpenTelemetry through that
/// bridge and any other `tracing` layer sees the same tree. A session's first request span is a
/// child of the current `tracing` span, if any.
#[derive(Clone)]
pub struct Tracer {
    dispatch: Option<Dispatch>,
    /// The SDK tracer spans are built on directly, when no dispatcher was given.
    otel: Option<SdkTracer>,
    metrics: Option<Arc<Metrics>>,
    capture_content: bool,
    agent: Arc<AgentMeta>,
    /// The trace state this process last saved, by session: a session's next request (a server
    /// reopens a thread's session for each run) finds it here instead of reading the store.
    recent: Arc<Mutex<HashMap<String, Prev>>>,
}

/// The most sessions whose last trace state is remembered in memory.
const RECENT: usize = 4096;

#[derive(Clone)]
struct AgentMeta {
    name: Option<String>,
    id: Option<String>,
    description: Option<String>,
    /// The request span's name, `invoke_agent {name}`: built once, not per request.
    span_name: String,
}

impl Default for AgentMeta {
    fn default() -> Self {
        AgentMeta {
            name: None,
            id: None,
            description: None,
            span_name: "invoke_agent".into(),
        }
    }
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer")
            .field("direct", &(self.otel.is_some() && self.dispatch.is_none()))
            .field("metrics", &self.metrics.is_some())
            .field("capture_content", &self.capture_content)
            .field("agent", &self.agent.name)
            .finish()
    }
}

impl Default for Tracer {
    fn default() -> Self {
        Self::new()
    }
}

/// The two histograms of the conventions.
pub(crate) struct Metrics {
    duration: Histogram<f64>,
    tokens: Histogram<u64>,
    /// The attribute sets last recorded, each bound to its histogram (see [`Bound`]).
    bound_duration: Mutex<Bound<f64>>,
    bound_tokens: Mutex<Bound<u64>>,
}

/// The most attribute sets kept bound per histogram.
const BOUND: usize = 16;

/// Histograms bound to the attribute sets recorded last, newest last. The SDK's `record` hashes
/// the whole attribute list (SipHash over every key and value) to find its series, ~2.5 k
/// instructions per record, four records per request; a server's requests mostly repeat a
/// handful of sets (one per agent, model and outcome), so a record here is a comparison with
/// those and a direct write to the bound series. Bound series are the SDK's
/// (`experimental_metrics_bound_instruments`): exported, aggregated and limited exactly as
/// unbound records are; one dropped from this list is unbound.
struct Bound<T>(Vec<(Vec<KeyValue>, BoundHistogram<T>)>);

impl<T> Default for Bound<T> {
    fn default() -> Self {
        Bound(Vec::new())
    }
}

impl<T: Copy> Bound<T> {
    fn record(this: &Mutex<Self>, h: &Histogram<T>, value: T, attrs: &[KeyValue]) {
        let mut b = this.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = b.0.iter().rposition(|(a, _)| a.as_slice() == attrs) {
            b.0[i].1.record(value);
            return;
        }
        let bound = h.bind(attrs);
        bound.record(value);
        if b.0.len() >= BOUND {
            // The oldest set is unbound (its series goes on as any unbound one).
            drop(b.0.remove(0));
        }
        b.0.push((attrs.to_vec(), bound));
    }
}

impl Metrics {
    fn new(meter: &Meter) -> Self {
        Metrics {
            duration: meter
                .f64_histogram(sc::METRIC_OPERATION_DURATION)
                .with_unit("s")
                .with_description("GenAI operation duration.")
                .with_boundaries(sc::DURATION_BUCKETS.to_vec())
                .build(),
            tokens: meter
                .u64_histogram(sc::METRIC_TOKEN_USAGE)
                .with_unit("{token}")
                .with_description("Number of input and output tokens used.")
                .with_boundaries(sc::TOKEN_BUCKETS.to_vec())
                .build(),
            bound_duration: Mutex::default(),
            bound_tokens: Mutex::default(),
        }
    }

    /// Records an operation's duration in seconds.
    fn duration(&self, seconds: f64, attrs: &[KeyValue]) {
        Bound::record(&self.bound_duration, &self.duration, seconds, attrs);
    }

    /// Records a token count (`attrs` carry its `gen_ai.token.type`).
    fn tokens(&self, n: u64, attrs: &[KeyValue]) {
        Bound::record(&self.bound_tokens, &self.tokens, n, attrs);
    }
}

impl Tracer {
    /// A tracer whose spans are `tracing` spans, sent to the `tracing` dispatcher current when an
    /// observer is made, with no metrics and no content.
    pub fn new() -> Self {
        Tracer {
            dispatch: None,
            otel: None,
            metrics: None,
            capture_content: false,
            agent: Arc::default(),
            recent: Default::default(),
        }
    }

    /// Records the metrics (`gen_ai.client.operation.duration`, `gen_ai.client.token.usage`)
    /// with `meter`.
    pub fn with_meter(mut self, meter: &Meter) -> Self {
        self.metrics = Some(Arc::new(Metrics::new(meter)));
        self
    }

    /// Builds the spans directly on `tracer` (an SDK tracer): no `tracing` span is made, unless a
    /// dispatcher is given ([`Tracer::with_dispatch`]), which takes precedence.
    /// [`crate::Telemetry::tracer`] sets its own.
    pub(crate) fn with_sdk_tracer(mut self, tracer: SdkTracer) -> Self {
        self.otel = Some(tracer);
        self
    }

    /// Makes the spans `tracing` spans sent to `dispatch` (bridged to OpenTelemetry by the
    /// dispatcher's `tracing-opentelemetry` layer, [`crate::Telemetry::layer`]), instead of the
    /// current dispatcher's; for a tracer from [`crate::Telemetry::tracer`], instead of
    /// building them directly on the telemetry's SDK tracer.
    pub fn with_dispatch(mut self, dispatch: Dispatch) -> Self {
        self.dispatch = Some(dispatch);
        self
    }

    /// Records content (the conventions' opt-in attributes: `gen_ai.input.messages`,
    /// `gen_ai.output.messages`, `gen_ai.tool.call.arguments`, `gen_ai.tool.call.result`). Off by
    /// default: messages and tool arguments often hold personal or secret data.
    pub fn capture_content(mut self, on: bool) -> Self {
        self.capture_content = on;
        self
    }

    /// Whether content is recorded.
    pub fn captures_content(&self) -> bool {
        self.capture_content
    }

    /// The agent's name (`gen_ai.agent.name`, and the request span's name `invoke_agent {name}`).
    pub fn agent_name(mut self, name: impl Into<String>) -> Self {
        let a = Arc::make_mut(&mut self.agent);
        a.name = Some(name.into()).filter(|s: &String| !s.is_empty());
        a.span_name = match &a.name {
            Some(n) => format!("invoke_agent {n}"),
            None => "invoke_agent".into(),
        };
        self
    }

    /// The agent's id (`gen_ai.agent.id`), e.g. a Managed Agents agent id.
    pub fn agent_id(mut self, id: impl Into<String>) -> Self {
        Arc::make_mut(&mut self.agent).id = Some(id.into()).filter(|s: &String| !s.is_empty());
        self
    }

    /// The agent's description (`gen_ai.agent.description`).
    pub fn agent_description(mut self, d: impl Into<String>) -> Self {
        Arc::make_mut(&mut self.agent).description = Some(d.into()).filter(|s: &String| !s.is_empty());
        self
    }

    /// An observer for one session (give it to [`tether::SessionBuilder::observer`]). The link
    /// to the session's previous request is read from the store in the background at its first
    /// request; [`Tracer::attach`] reads it first.
    pub fn observer(&self) -> Arc<SessionTracer> {
        let backend = match (&self.dispatch, &self.otel) {
            (Some(d), _) => Backend::Bridged(d.clone()),
            (None, Some(t)) => Backend::Direct(t.clone()),
            (None, None) => Backend::Bridged(tracing::dispatcher::get_default(|d| d.clone())),
        };
        Arc::new(SessionTracer {
            shared: Arc::new(Shared {
                tracer: self.clone(),
                backend,
                state: Mutex::new(State::default()),
                writer: Mutex::new(None),
            }),
        })
    }

    /// Attaches an observer to an open session's sink, having read the session's previous trace
    /// context (so a thread resumed after a restart links back at once): from memory when this
    /// process saved it, else from the store. A session whose record began with this sink
    /// ([`EventSink::began_here`]: a new thread whose first messages were stored at open) is not
    /// read, nor is one with no recorded event yet: its first recorded event tells, by its
    /// number, whether anything was recorded before it, and only then is the store read.
    /// Returns `false` when the sink has an observer already.
    pub async fn attach(&self, sink: &EventSink) -> bool {
        let obs = self.observer();
        let sid = sink.info().session_id.clone();
        let cached = self.recent.lock().ok().and_then(|m| m.get(&sid).cloned());
        let prev = match cached {
            Some(p) => Some(p),
            // No event recorded yet (events are numbered from 1): a new session, or one whose
            // events are not seeded into this sink; left to `load_prev`, which tells the two
            // apart by its first recorded event's number.
            None if sink.last_seq().await == 0 => None,
            // The session's record began with this sink (a new thread, its first messages
            // adopted at open): no earlier request saved a state to link to, and the store's
            // thread is spared a read per new thread.
            None if sink.began_here().await => Some(Prev::default()),
            None => Some(match sink.store().state(&sid, STATE_KEY).await {
                Ok(v) => Prev::parse(v.as_ref()),
                Err(e) => {
                    tracing::debug!(error = %e, "tether-otel: could not read the session's trace state");
                    Prev::default()
                }
            }),
        };
        if let Some(prev) = prev {
            let mut st = obs.shared.lock();
            st.prev = Some(prev);
            st.loaded_for = Some(sid);
        }
        sink.set_observer(obs)
    }
}

/// One session's tracer (an [`EventObserver`]): turns its events into `invoke_agent`, `chat` and
/// `execute_tool` spans. Spans still open when it is dropped (the session was dropped in the
/// middle of a request) end with `error.type` `interrupted`.
pub struct SessionTracer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SessionTracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionTracer").finish_non_exhaustive()
    }
}

struct Shared {
    tracer: Tracer,
    backend: Backend,
    state: Mutex<State>,
    writer: Mutex<Option<mpsc::UnboundedSender<Write>>>,
}

/// Where a session's spans are made.
enum Backend {
    /// Directly on the SDK tracer.
    Direct(SdkTracer),
    /// As `tracing` spans under this dispatcher, bridged by its `tracing-opentelemetry` layer.
    Bridged(Dispatch),
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct Write {
    session_id: String,
    /// The state to save; `None` to read the saved one (the previous request's link).
    value: Option<Value>,
}

/// What the previous request left in the store.
#[derive(Default, Clone)]
struct Prev {
    cx: Option<SpanContext>,
    open: bool,
    pending: HashMap<String, SpanContext>,
}

impl Prev {
    fn parse(v: Option<&Value>) -> Prev {
        let Some(v) = v else {
            return Prev::default();
        };
        Prev {
            cx: v
                .get("traceparent")
                .and_then(Value::as_str)
                .and_then(parse_traceparent),
            open: v.get("open").and_then(Value::as_bool).unwrap_or(false),
            pending: v
                .get("pending")
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, v)| Some((k.clone(), parse_traceparent(v.as_str()?)?)))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }
}

#[derive(Default)]
struct State {
    /// The previous request's context; `None` until read from the store.
    prev: Option<Prev>,
    /// The session id `prev` was read (or asked for, or known absent) for.
    loaded_for: Option<String>,
    run: Option<Run>,
    chat: Option<Chat>,
    tools: HashMap<String, Tool>,
    /// When each approval in progress was asked, by tool use id.
    approvals: HashMap<String, Instant>,
}

/// A span that ends when dropped: with `error.type` `interrupted` unless it was ended first.
struct Guarded {
    span: Spanned,
    open: bool,
}

/// A span of either backend.
enum Spanned {
    /// Built on the SDK tracer: the context holding it (what a child span is built under).
    Direct(opentelemetry::Context),
    /// A `tracing` span, with the dispatcher it belongs to: it is closed under it, because the
    /// registry closes a parent whose last child closes through the *current* dispatcher.
    Bridged { span: tracing::Span, dispatch: Dispatch },
}

impl Guarded {
    fn set(&self, key: &'static str, value: impl Into<opentelemetry::Value>) {
        match &self.span {
            Spanned::Direct(cx) => cx.span().set_attribute(KeyValue::new(key, value)),
            Spanned::Bridged { span, .. } => span.set_attribute(key, value),
        }
    }

    /// Sets `attrs` on the span (replacing values of the same keys).
    fn set_all(&self, attrs: Vec<KeyValue>) {
        if attrs.is_empty() {
            return;
        }
        match &self.span {
            Spanned::Direct(cx) => cx.span().set_attributes(attrs),
            Spanned::Bridged { span, .. } => {
                for kv in attrs {
                    span.set_attribute(kv.key, kv.value);
                }
            }
        }
    }

    fn event(&self, name: &'static str, attrs: Vec<KeyValue>) {
        match &self.span {
            Spanned::Direct(cx) => cx.span().add_event(name, attrs),
            Spanned::Bridged { span, .. } => span.add_event(name, attrs),
        }
    }

    fn link(&self, to: SpanContext, attrs: Vec<KeyValue>) {
        match &self.span {
            Spanned::Direct(cx) => {
                if to.is_valid() {
                    cx.span().add_link(to, attrs);
                }
            }
            Spanned::Bridged { span, .. } => span.add_link_with_attributes(to, attrs),
        }
    }

    /// The span's OpenTelemetry context, when it has one (it is sampled into a trace).
    fn context(&self) -> Option<SpanContext> {
        match &self.span {
            Spanned::Direct(cx) => {
                let sc = cx.span().span_context().clone();
                sc.is_valid().then_some(sc)
            }
            Spanned::Bridged { span, .. } => context_of(span),
        }
    }

    /// The span's context as a `traceparent`.
    fn traceparent(&self) -> Option<String> {
        self.context().map(|cx| traceparent(&cx))
    }

    /// What a child of this span is built under.
    fn parent_cx(&self) -> opentelemetry::Context {
        match &self.span {
            Spanned::Direct(cx) => cx.clone(),
            Spanned::Bridged { span, .. } => span.context(),
        }
    }

    fn end(mut self, error: Option<(&str, &str)>) {
        if let Some((ty, msg)) = error {
            self.fail(ty, msg);
        }
        self.open = false;
    }

    fn fail(&self, ty: &str, msg: &str) {
        self.set(sc::ERROR_TYPE, ty.to_owned());
        let msg: String = msg.chars().take(MAX_STATUS).collect();
        match &self.span {
            Spanned::Direct(cx) => cx.span().set_status(Status::error(msg)),
            Spanned::Bridged { span, .. } => span.set_status(Status::error(msg)),
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        if self.open {
            self.fail(
                "interrupted",
                "the session was dropped before this operation ended",
            );
        }
        match &mut self.span {
            Spanned::Direct(cx) => cx.span().end(),
            Spanned::Bridged { span, dispatch } => {
                let span = std::mem::replace(span, tracing::Span::none());
                tracing::dispatcher::with_default(dispatch, move || drop(span));
            }
        }
    }
}

/// A handler's tools by name: each one's description and meta.
type Specs = HashMap<String, (String, Map<String, Value>)>;

struct Run {
    g: Guarded,
    started: Instant,
    provider: Option<String>,
    /// The request span's context, and as a `traceparent`: built once.
    cx: Option<SpanContext>,
    traceparent: Option<String>,
    linked: bool,
    /// Child spans (model calls, tool calls) started so far.
    children: u32,
    input: u64,
    output: u64,
    cache_read: u64,
    /// The handler's tools (description, meta) by name, asked of the handler at the request's
    /// first tool call (a handler's tools change between requests, not during one): a request
    /// without tool calls, the common case in a chat server, never builds them.
    specs: Option<Specs>,
    /// What the store holds for this request: `Some(open)` once a state naming it was written
    /// (`open`: saved as still running). `None`: nothing yet.
    written: Option<bool>,
    /// Whether the request wrote its state itself (through the session's writer task, which
    /// runs behind the session): then its end writes too, through the same queue, so no earlier
    /// write of its own can land after the last state.
    wrote: bool,
    /// The `open` of the state handed over with a model response being recorded
    /// ([`EventObserver::state_with`]): written once that response is delivered (recorded).
    staged: Option<bool>,
}

struct Chat {
    g: Guarded,
    started: Instant,
    /// Opened by an explicit start (a model call mark, a `span.model_request_start`), not
    /// inferred from output.
    explicit: bool,
    provider: String,
    model: String,
    server: Option<(String, u16)>,
    text: String,
    reasoning: String,
}

struct Tool {
    g: Guarded,
}

impl EventObserver for SessionTracer {
    fn on_event(&self, e: &Event, sink: &EventSink) {
        // The local loop's token and argument deltas carry nothing a span needs: the hot path
        // returns before any lock.
        if e.seq.is_none() && e.raw_type.starts_with("local.") {
            return;
        }
        self.handle(e, sink);
    }

    fn on_mark(&self, mark: &Mark<'_>, sink: &EventSink) {
        let mut st = self.shared.lock();
        match *mark {
            Mark::RunStart { provider, .. } => self.run_start(&mut st, provider, sink),
            Mark::RunEnd { result } => self.run_end(&mut st, result, sink),
            Mark::ModelCall(call) => self.model_call(&mut st, call, sink),
            Mark::ToolStart { tool_use } => self.open_tool(&mut st, tool_use, "function", None, sink, true),
            Mark::PermissionRequest { tool_use_id } => {
                // An approval asked during a tool call (an ACP agent's permission request): the
                // wait shows on the tool's span, between this mark and its outcome.
                st.approvals.insert(tool_use_id.to_owned(), Instant::now());
                // Both ids come from the agent: clipped like every value from outside.
                let attrs = vec![KeyValue::new(sc::TOOL_CALL_ID, clip(tool_use_id, MAX_VALUE))];
                approval_event(&st, tool_use_id, "tether.approval_requested", attrs);
            }
            Mark::PermissionOutcome { tool_use_id, outcome } => {
                let mut attrs = vec![KeyValue::new(sc::TOOL_CALL_ID, clip(tool_use_id, MAX_VALUE))];
                if !outcome.is_empty() {
                    attrs.push(KeyValue::new("tether.approval.outcome", clip(outcome, MAX_VALUE)));
                }
                if let Some(t) = st.approvals.remove(tool_use_id) {
                    attrs.push(KeyValue::new(
                        "tether.approval.wait_ms",
                        i64::try_from(t.elapsed().as_millis()).unwrap_or(i64::MAX),
                    ));
                }
                approval_event(&st, tool_use_id, "tether.approval_answered", attrs);
            }
            // A mark a later tether shows that this tracer does not know yet.
            _ => {}
        }
    }

    /// Spans come from requests, model calls and tool calls, never from a token: the sink does
    /// not call the tracer for a [`tether::DeltaSink`]'s deltas at all.
    fn wants_deltas(&self) -> bool {
        false
    }

    /// The request's trace state rides on the local loop's model responses, which the session
    /// records anyway (one store step, no write of tether-otel's own): a response with tool
    /// calls saves the request as `open` (its tools run next: a crash during them leaves a
    /// request to link to as `interrupted_run`), one without saves it as ended (the local loop's
    /// request ends with it: the next request links to it as `previous_run`). The request's end
    /// then writes nothing unless it leaves something else to say (tools waiting for an answer;
    /// a model call after a final response). Remote loops' messages do not tell whether their
    /// request goes on, so theirs is written by the request as before.
    fn state_with(&self, e: &Event) -> Option<(&'static str, Value)> {
        if e.raw_type != tether::raw::LOCAL_MODEL_RESPONSE {
            return None;
        }
        let EventKind::Message {
            role: Role::Assistant,
            tool_uses,
            ..
        } = &e.kind
        else {
            return None;
        };
        let mut st = self.shared.lock();
        let run = st.run.as_mut()?;
        let open = !tool_uses.is_empty();
        run.staged = Some(open);
        Some((STATE_KEY, saved_state(run.traceparent.as_deref(), open, None)))
    }
}

/// An approval's event `name`, on its tool's span, else on the request's.
fn approval_event(st: &State, tool_use_id: &str, name: &'static str, attrs: Vec<KeyValue>) {
    match (st.tools.get(tool_use_id), &st.run) {
        (Some(t), _) => t.g.event(name, attrs),
        (None, Some(r)) => r.g.event(name, attrs),
        _ => {}
    }
}

/// The trace state saved for a session (see [`STATE_KEY`]).
fn saved_state(traceparent: Option<&str>, open: bool, pending: Option<Map<String, Value>>) -> Value {
    let mut m = Map::new();
    m.insert(
        "traceparent".into(),
        traceparent.map_or(Value::Null, |t| Value::String(t.to_owned())),
    );
    m.insert("open".into(), Value::Bool(open));
    if let Some(p) = pending {
        m.insert("pending".into(), Value::Object(p));
    }
    Value::Object(m)
}

impl Drop for SessionTracer {
    fn drop(&mut self) {
        // Children first, so the request span closes last.
        let mut st = self.shared.lock();
        st.chat = None;
        st.tools.clear();
        st.run = None;
    }
}

/// The OpenTelemetry context of a bridged `span`, when it has one (it is sampled into a trace).
fn context_of(span: &tracing::Span) -> Option<SpanContext> {
    let cx = span.context();
    let s = cx.span();
    let sc = s.span_context();
    sc.is_valid().then(|| sc.clone())
}

/// `cx` as a W3C `traceparent`, in one allocation of its exact size.
fn traceparent(cx: &SpanContext) -> String {
    // Written digit by digit: `format!` with `{:032x}` took ~1.5 k instructions a call, twice per
    // request.
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = Vec::with_capacity(55);
    out.extend_from_slice(b"00-");
    let hex = |out: &mut Vec<u8>, bytes: &[u8]| {
        for b in bytes {
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xf)]);
        }
    };
    hex(&mut out, &cx.trace_id().to_bytes());
    out.push(b'-');
    hex(&mut out, &cx.span_id().to_bytes());
    out.push(b'-');
    hex(&mut out, &[cx.trace_flags().to_u8()]);
    // Only ASCII hex digits and dashes were written.
    String::from_utf8(out).unwrap_or_default()
}

/// A W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`) as a remote span context.
pub(crate) fn parse_traceparent(s: &str) -> Option<SpanContext> {
    let mut it = s.trim().split('-');
    let (v, t, p, f) = (it.next()?, it.next()?, it.next()?, it.next()?);
    if it.next().is_some() || v != "00" || t.len() != 32 || p.len() != 16 || f.len() != 2 {
        return None;
    }
    let trace = TraceId::from_hex(t).ok()?;
    let span = SpanId::from_hex(p).ok()?;
    let flags = u8::from_str_radix(f, 16).ok()?;
    let cx = SpanContext::new(trace, span, TraceFlags::new(flags), true, TraceState::default());
    cx.is_valid().then_some(cx)
}

/// The values of `keys` in the object `v`, found in one pass over its entries: for the few
/// keys of a model response, comparing each entry's key is cheaper than hashing each key (a JSON
/// object's map hashes with SipHash).
fn fields<'a, const N: usize>(v: &'a Value, keys: [&str; N]) -> [Option<&'a Value>; N] {
    let mut out = [None; N];
    if let Value::Object(m) = v {
        for (k, val) in m {
            if let Some(i) = keys.iter().position(|want| *want == k.as_str()) {
                out[i].get_or_insert(val);
            }
        }
    }
    out
}

fn str_of<'a>(v: &'a Value, k: &str) -> Option<&'a str> {
    v.get(k).and_then(Value::as_str).filter(|s| !s.is_empty())
}

impl SessionTracer {
    /// A span named `name` of `kind` (`internal` or `client`), under `parent`; without one, under
    /// the current `tracing` span (directly: its OpenTelemetry context, if it has one).
    /// `attrs` are the span's first attributes: given to the SDK with the span (what a sampler
    /// sees), not set one by one after it (a lock and a dynamic call each).
    fn span(
        &self,
        parent: Option<&Guarded>,
        name: &str,
        kind: &'static str,
        attrs: Vec<KeyValue>,
    ) -> Guarded {
        let span = match &self.shared.backend {
            Backend::Direct(tracer) => {
                let parent = match parent {
                    Some(p) => p.parent_cx(),
                    None => tracing::Span::current().context(),
                };
                let kind = if kind == "client" {
                    SpanKind::Client
                } else {
                    SpanKind::Internal
                };
                let builder = SpanBuilder::from_name(name.to_owned())
                    .with_kind(kind)
                    .with_attributes(attrs);
                let span = tracer.build_with_context(builder, &parent);
                Spanned::Direct(opentelemetry::Context::new().with_span(span))
            }
            Backend::Bridged(dispatch) => {
                let parent = parent.and_then(|p| match &p.span {
                    Spanned::Bridged { span, .. } => Some(span),
                    Spanned::Direct(_) => None,
                });
                let span = tracing::dispatcher::with_default(dispatch, || match parent {
                    Some(p) => {
                        tracing::info_span!(target: "tether_otel", parent: p, "gen_ai", otel.name = name, otel.kind = kind)
                    }
                    None => {
                        tracing::info_span!(target: "tether_otel", "gen_ai", otel.name = name, otel.kind = kind)
                    }
                });
                for kv in attrs {
                    span.set_attribute(kv.key, kv.value);
                }
                Spanned::Bridged {
                    span,
                    dispatch: dispatch.clone(),
                }
            }
        };
        Guarded { span, open: true }
    }

    fn handle(&self, e: &Event, sink: &EventSink) {
        let shared = &self.shared;
        let mut st = shared.lock();
        if e.seq.is_some() && st.loaded_for.is_none() {
            self.load_prev(&mut st, e, sink);
        }
        match e.raw_type.as_str() {
            "span.model_request_start" => {
                if st.chat.is_none() {
                    self.open_chat(&mut st, ChatStart::inferred(true), sink);
                }
                return;
            }
            "local.duplicate_tool_call" => {
                if let Some(t) = str_of(&e.raw, "id").and_then(|id| st.tools.remove(id)) {
                    t.g.set("tether.tool.duplicate", true);
                    t.g.end(None);
                }
                return;
            }
            "agent.tool_result" | "agent.mcp_tool_result" => {
                if let Some(id) = str_of(&e.raw, "tool_use_id") {
                    let err = e.raw.get("is_error").and_then(Value::as_bool).unwrap_or(false);
                    self.end_tool(&mut st, id, err, None, sink);
                }
                return;
            }
            _ => {}
        }
        if st.run.is_none() {
            return;
        }
        let local = e.raw_type.starts_with("local.");
        match &e.kind {
            EventKind::TextDelta { delta, .. } | EventKind::ReasoningDelta { delta, .. } if !local => {
                if st.chat.is_none() {
                    self.open_chat(&mut st, ChatStart::inferred(false), sink);
                }
                if shared.tracer.capture_content
                    && let Some(c) = st.chat.as_mut()
                {
                    if matches!(e.kind, EventKind::TextDelta { .. }) {
                        c.text.push_str(delta);
                    } else {
                        c.reasoning.push_str(delta);
                    }
                }
            }
            EventKind::Message {
                role: Role::Assistant,
                tool_uses,
                text,
                ..
            } if e.is_durable() => {
                if e.raw_type == "local.model_response" {
                    // Recorded: so is the state handed over with it.
                    if let Some(run) = st.run.as_mut()
                        && let Some(open) = run.staged.take()
                    {
                        run.written = Some(open);
                        if open {
                            // What a next request of this process links to if this one never
                            // ends (its session dropped).
                            let prev = Prev {
                                cx: run.cx.clone(),
                                open: true,
                                pending: HashMap::new(),
                            };
                            self.remember(&sink.info().session_id, prev);
                        }
                    }
                    self.model_response(&mut st, e, sink);
                } else {
                    if st.chat.is_none() {
                        self.open_chat(&mut st, ChatStart::inferred(false), sink);
                    }
                    if shared.tracer.capture_content
                        && let Some(c) = st.chat.as_mut()
                        && c.text.is_empty()
                    {
                        c.text.push_str(text);
                    }
                }
                let kind = if local { "function" } else { "extension" };
                for u in tool_uses {
                    self.open_tool(&mut st, u, kind, Some(e), sink, false);
                }
            }
            EventKind::ToolCall { tool_use, .. } if e.is_durable() => {
                let kind = if local || e.raw_type == "agent.custom_tool_use" {
                    "function"
                } else {
                    "extension"
                };
                self.open_tool(&mut st, tool_use, kind, Some(e), sink, false);
            }
            EventKind::ToolCallStart {
                tool_use_id, name, ..
            } if e.is_durable() => {
                let u = ToolUse::new(
                    tool_use_id,
                    name,
                    e.raw.get("rawInput").cloned().unwrap_or(Value::Null),
                );
                self.open_tool(&mut st, &u, "extension", Some(e), sink, false);
            }
            EventKind::ToolResult { result } => {
                self.end_tool(
                    &mut st,
                    &result.tool_use_id,
                    result.is_error,
                    Some(&result.content),
                    sink,
                );
            }
            EventKind::Usage { usage } if e.raw_type != "local.usage" => {
                let (i, o, c) = (usage.input_tokens, usage.output_tokens, usage.cache_read_tokens);
                match st.chat.take() {
                    Some(chat) => {
                        self.close_chat(&mut st, chat, ChatEnd::usage(i, o, c, &e.raw), sink);
                    }
                    None => {
                        let (provider, model) = {
                            let run = st.run.as_ref();
                            (
                                run.and_then(|r| r.provider.clone()).unwrap_or_default(),
                                String::new(),
                            )
                        };
                        self.add_usage(&mut st, (i, o, c), &provider, &model);
                    }
                }
            }
            EventKind::Other if e.raw_type == "span.model_request_end" => {
                if let Some(chat) = st.chat.take() {
                    self.close_chat(&mut st, chat, ChatEnd::usage(0, 0, 0, &e.raw), sink);
                }
            }
            EventKind::Retry {
                attempt,
                delay_ms,
                error,
            } => {
                let name = if e.raw_type == "tether.reconnect" {
                    "tether.reconnect"
                } else {
                    "tether.retry"
                };
                let mut attrs = vec![
                    KeyValue::new("tether.retry.attempt", i64::from(*attempt)),
                    KeyValue::new(
                        "tether.retry.delay_ms",
                        i64::try_from(*delay_ms).unwrap_or(i64::MAX),
                    ),
                    KeyValue::new(
                        "exception.message",
                        error.chars().take(MAX_STATUS).collect::<String>(),
                    ),
                ];
                if let Some(s) = e.raw.get("status").and_then(Value::as_u64) {
                    attrs.push(KeyValue::new(sc::ERROR_TYPE, s.to_string()));
                }
                match (&st.chat, &st.run) {
                    (Some(c), _) => c.g.event(name, attrs),
                    (None, Some(r)) => r.g.event(name, attrs),
                    _ => {}
                }
            }
            EventKind::Error { code, message } => {
                if let Some(r) = &st.run {
                    r.g.event(
                        "tether.provider_error",
                        vec![
                            KeyValue::new(sc::ERROR_TYPE, code.clone()),
                            KeyValue::new(
                                "exception.message",
                                message.chars().take(MAX_STATUS).collect::<String>(),
                            ),
                        ],
                    );
                }
            }
            _ => {}
        }
    }

    fn run_start(&self, st: &mut State, tp: &str, sink: &EventSink) {
        if let Some(run) = st.run.take() {
            self.end_children(
                st,
                Some(("interrupted", "a new request began before this one ended")),
                sink,
                &[],
            );
            run.g
                .end(Some(("interrupted", "a new request began before this one ended")));
        }
        let tracer = &self.shared.tracer;
        if tracer.capture_content && !sink.full_payloads() {
            sink.set_full_payloads(true);
        }
        let tp = if tp.is_empty() { "local" } else { tp };
        let local = tp == "local";
        let provider = sc::provider_of(tp).map(str::to_owned);
        let mut attrs = Vec::with_capacity(6);
        attrs.push(KeyValue::new(sc::OPERATION_NAME, "invoke_agent"));
        if let Some(p) = &provider {
            attrs.push(KeyValue::new(sc::PROVIDER_NAME, p.clone()));
        }
        if let Some(a) = &tracer.agent.name {
            attrs.push(KeyValue::new(sc::AGENT_NAME, a.clone()));
        }
        if let Some(a) = &tracer.agent.id {
            attrs.push(KeyValue::new(sc::AGENT_ID, a.clone()));
        }
        if let Some(a) = &tracer.agent.description {
            attrs.push(KeyValue::new(sc::AGENT_DESCRIPTION, a.clone()));
        }
        let sid = &sink.info().session_id;
        if !sid.is_empty() {
            attrs.push(KeyValue::new(sc::CONVERSATION_ID, sid.clone()));
        }
        let g = self.span(
            None,
            &tracer.agent.span_name,
            if local { "internal" } else { "client" },
            attrs,
        );
        let mut run = Run {
            g,
            started: Instant::now(),
            provider,
            cx: None,
            traceparent: None,
            linked: false,
            children: 0,
            input: 0,
            output: 0,
            cache_read: 0,
            specs: None,
            written: None,
            wrote: false,
            staged: None,
        };
        if let Some(prev) = &st.prev {
            link_prev(&mut run, prev);
        }
        run.cx = run.g.context();
        run.traceparent = run.cx.as_ref().map(traceparent);
        sink.set_traceparent("", run.traceparent.clone());
        // The request is saved as `open` (what a resumed thread links to as `interrupted_run`)
        // only once it outlives its first model or tool call (see `child_started`): until one of
        // its spans has ended, none has been exported, so a crash before then leaves nothing
        // of it to link to. A request of one model call saves its state once, at its end.
        st.run = Some(run);
    }

    /// Counts a child span of the request; from the second on, makes sure the store holds the
    /// request as `open` (usually it does already: the model response that called the tools
    /// carried it, see [`SessionTracer::state_with`]).
    fn child_started(&self, st: &mut State, sink: &EventSink) {
        let Some(run) = st.run.as_mut() else {
            return;
        };
        run.children += 1;
        if run.children >= 2 && run.written != Some(true) {
            run.written = Some(true);
            run.wrote = true;
            let value = saved_state(run.traceparent.as_deref(), true, None);
            let prev = Prev {
                cx: run.cx.clone(),
                open: true,
                pending: HashMap::new(),
            };
            let sid = sink.info().session_id.clone();
            self.remember(&sid, prev);
            self.persist(sink, sid, Some(value));
        }
    }

    /// At the session's first recorded event seen, makes sure the previous request's context is
    /// known: none when the event is the session's first ever (numbered 1), else read from the
    /// store (off the session's task; the link is added to the request span when it arrives).
    fn load_prev(&self, st: &mut State, e: &Event, sink: &EventSink) {
        let info = sink.info();
        let sid = info.session_id.as_str();
        if sid.is_empty() {
            return;
        }
        st.loaded_for = Some(sid.to_owned());
        let cached = self
            .shared
            .tracer
            .recent
            .lock()
            .ok()
            .and_then(|m| m.get(sid).cloned());
        if let Some(p) = cached {
            st.prev = Some(p);
        } else if e.seq == Some(1) {
            st.prev = Some(Prev::default());
        } else {
            self.persist(sink, sid.to_owned(), None);
            return;
        }
        if let (Some(run), Some(prev)) = (st.run.as_mut(), st.prev.as_ref()) {
            link_prev(run, prev);
        }
    }

    fn run_end(&self, st: &mut State, result: &tether::Result<SessionResult>, sink: &EventSink) {
        let Some(mut run) = st.run.take() else {
            return;
        };
        let ok = result.is_ok();
        let (ety, msg) = match result {
            Ok(_) => (String::new(), String::new()),
            Err(e) => (sc::error_type(e), e.to_string()),
        };
        let pending: Vec<String> = match result {
            Ok(r) => r.pending_tool_uses.iter().map(|u| u.id.clone()).collect(),
            Err(_) => Vec::new(),
        };
        let fail = (!ok).then_some((ety.as_str(), msg.as_str()));
        // Spans of tools waiting for an answer from outside (an approval, a front-end tool):
        // their contexts are kept so the request that runs them links back.
        let mut waiting = Map::new();
        let mut waiting_cx = HashMap::new();
        for id in &pending {
            if let Some(t) = st.tools.remove(id) {
                t.g.set("tether.tool.pending", true);
                t.g.event("tether.awaiting_result", Vec::new());
                if let Some(cx) = t.g.context() {
                    waiting.insert(id.clone(), Value::String(traceparent(&cx)));
                    waiting_cx.insert(id.clone(), cx);
                }
                t.g.end(None);
            }
        }
        st.approvals.clear();
        self.end_children(st, fail, sink, &pending);
        // The request's usage as the session summed it (every model call once).
        if let Ok(r) = result {
            run.input = r.usage.input_tokens;
            run.output = r.usage.output_tokens;
            run.cache_read = r.usage.cache_read_tokens;
        }
        // A provider that reported no usage leaves the attributes out rather than claiming 0.
        if run.input > 0 || run.output > 0 || run.cache_read > 0 {
            run.g.set(sc::USAGE_INPUT, run.input as i64);
            run.g.set(sc::USAGE_OUTPUT, run.output as i64);
        }
        if run.cache_read > 0 {
            run.g.set(sc::USAGE_CACHE_READ, run.cache_read as i64);
        }
        if !pending.is_empty() {
            run.g.event(
                "tether.awaiting_input",
                vec![KeyValue::new(
                    "tether.pending_tool_call.ids",
                    opentelemetry::Value::Array(
                        pending
                            .iter()
                            .map(|s| opentelemetry::StringValue::from(s.clone()))
                            .collect::<Vec<_>>()
                            .into(),
                    ),
                )],
            );
        }
        let provider = run.provider.clone().unwrap_or_else(|| "local".into());
        if run.provider.is_none() {
            run.g.set(sc::PROVIDER_NAME, provider.clone());
        }
        if let Some(m) = &self.shared.tracer.metrics {
            let mut attrs = vec![
                KeyValue::new(sc::OPERATION_NAME, "invoke_agent"),
                KeyValue::new(sc::PROVIDER_NAME, provider),
            ];
            if let Some((t, _)) = fail {
                attrs.push(KeyValue::new(sc::ERROR_TYPE, t.to_owned()));
            }
            m.duration(run.started.elapsed().as_secs_f64(), &attrs);
        }
        // What the store holds already says all when the request's last model response saved
        // it as ended and no tool waits: nothing to write (the usual request of a chat server).
        let saved = run.written == Some(false) && waiting.is_empty() && !run.wrote;
        run.g.end(fail);
        sink.set_traceparent("", None);
        let info = sink.info();
        let prev = Prev {
            cx: run.cx.take(),
            open: false,
            pending: waiting_cx,
        };
        self.remember(&info.session_id, prev);
        if !saved {
            let value = saved_state(run.traceparent.as_deref(), false, Some(waiting));
            self.persist(sink, info.session_id.clone(), Some(value));
        }
    }

    /// Ends the open chat and tool spans (not those in `skip`), with `fail` when the request
    /// failed.
    fn end_children(&self, st: &mut State, fail: Option<(&str, &str)>, sink: &EventSink, skip: &[String]) {
        if let Some(chat) = st.chat.take() {
            let end = match fail {
                Some((t, m)) => ChatEnd::failed(t, m),
                None => ChatEnd::default(),
            };
            self.close_chat(st, chat, end, sink);
        }
        let ids: Vec<String> = st.tools.keys().filter(|k| !skip.contains(k)).cloned().collect();
        for id in ids {
            if let Some(t) = st.tools.remove(&id) {
                sink.set_traceparent(&id, None);
                t.g.end(fail);
            }
        }
    }

    fn model_call(&self, st: &mut State, call: &ModelCall<'_>, sink: &EventSink) {
        if st.run.is_none() {
            return;
        }
        if call.attempt > 1 && st.chat.as_ref().is_some_and(|c| c.explicit) {
            // A retry of the call in flight: one span covers all its attempts.
            return;
        }
        if let Some(chat) = st.chat.take() {
            self.close_chat(st, chat, ChatEnd::default(), sink);
        }
        let some = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        let endpoint = call.endpoint.and_then(some);
        // A model in this process (the local loop reports no endpoint for it) is an internal
        // call; one behind HTTP a client call.
        let kind = if endpoint.is_some() { "client" } else { "internal" };
        let start = ChatStart {
            explicit: true,
            kind,
            provider: some(call.provider),
            model: some(call.model),
            endpoint,
        };
        self.open_chat(st, start, sink);
        if self.shared.tracer.capture_content
            && let Some(c) = &st.chat
            && let Ok(h) = serde_json::to_value(&call.request.messages)
        {
            c.g.set(
                sc::INPUT_MESSAGES,
                clip(&sc::messages(&h).to_string(), MAX_CONTENT),
            );
        }
    }

    fn open_chat(&self, st: &mut State, start: ChatStart, sink: &EventSink) {
        let ChatStart {
            explicit,
            kind,
            provider,
            model,
            endpoint,
        } = start;
        let Some(run) = st.run.as_mut() else {
            return;
        };
        if run.provider.is_none()
            && let Some(p) = &provider
        {
            run.provider = Some(p.clone());
            run.g.set(sc::PROVIDER_NAME, p.clone());
        }
        let provider = provider
            .or_else(|| run.provider.clone())
            .unwrap_or_else(|| "local".into());
        let model = model.unwrap_or_default();
        let mut name = String::with_capacity(5 + model.len());
        name.push_str("chat");
        if !model.is_empty() {
            name.push(' ');
            name.push_str(&model);
        }
        let mut attrs = Vec::with_capacity(6);
        attrs.push(KeyValue::new(sc::OPERATION_NAME, "chat"));
        attrs.push(KeyValue::new(sc::PROVIDER_NAME, provider.clone()));
        if !model.is_empty() {
            attrs.push(KeyValue::new(sc::REQUEST_MODEL, model.clone()));
        }
        let sid = &sink.info().session_id;
        if !sid.is_empty() {
            attrs.push(KeyValue::new(sc::CONVERSATION_ID, sid.clone()));
        }
        let server = endpoint.as_deref().and_then(sc::server_of);
        if let Some((h, p)) = &server {
            attrs.push(KeyValue::new(sc::SERVER_ADDRESS, h.clone()));
            attrs.push(KeyValue::new(sc::SERVER_PORT, i64::from(*p)));
        }
        let g = self.span(Some(&run.g), &name, kind, attrs);
        sink.set_traceparent("", g.traceparent());
        st.chat = Some(Chat {
            g,
            started: Instant::now(),
            explicit,
            provider,
            model,
            server,
            text: String::new(),
            reasoning: String::new(),
        });
        self.child_started(st, sink);
    }

    fn model_response(&self, st: &mut State, e: &Event, sink: &EventSink) {
        let Some(chat) = st.chat.take() else {
            return;
        };
        let [resp, u, finish, message] = fields(&e.raw, ["response", "usage", "finish_reason", "message"]);
        let [i, o, c] = fields(
            u.unwrap_or(&Value::Null),
            ["input_tokens", "output_tokens", "cache_read_tokens"],
        )
        .map(|v| v.and_then(Value::as_u64).unwrap_or(0));
        let mut end = ChatEnd::usage(i, o, c, resp.unwrap_or(&Value::Null));
        end.has_usage = u.is_some_and(Value::is_object);
        end.finish = finish
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned);
        if self.shared.tracer.capture_content
            && let Some(m) = message
        {
            end.message = Some(sc::message(m, end.finish.as_deref()));
        }
        self.close_chat(st, chat, end, sink);
    }

    fn close_chat(&self, st: &mut State, chat: Chat, end: ChatEnd, sink: &EventSink) {
        let g = &chat.g;
        // Given to the span together (one lock of the span, not one per attribute).
        let mut attrs = Vec::with_capacity(6);
        if let Some(id) = &end.response_id {
            attrs.push(KeyValue::new(sc::RESPONSE_ID, id.clone()));
        }
        if let Some(m) = &end.response_model {
            attrs.push(KeyValue::new(sc::RESPONSE_MODEL, m.clone()));
        }
        if let Some(f) = &end.finish {
            attrs.push(KeyValue::new(
                sc::FINISH_REASONS,
                opentelemetry::Value::Array(vec![opentelemetry::StringValue::from(f.clone())].into()),
            ));
        }
        if end.has_usage {
            attrs.push(KeyValue::new(sc::USAGE_INPUT, end.input as i64));
            attrs.push(KeyValue::new(sc::USAGE_OUTPUT, end.output as i64));
            if end.cache_read > 0 {
                attrs.push(KeyValue::new(sc::USAGE_CACHE_READ, end.cache_read as i64));
            }
        }
        g.set_all(attrs);
        if self.shared.tracer.capture_content {
            let output = end.message.clone().or_else(|| {
                (!chat.text.is_empty() || !chat.reasoning.is_empty()).then(|| {
                    let mut parts = Vec::new();
                    if !chat.reasoning.is_empty() {
                        parts.push(json!({"type": "reasoning", "content": chat.reasoning}));
                    }
                    if !chat.text.is_empty() {
                        parts.push(json!({"type": "text", "content": chat.text}));
                    }
                    json!({"role": "assistant", "parts": parts})
                })
            });
            if let Some(o) = output {
                g.set(
                    sc::OUTPUT_MESSAGES,
                    clip(&Value::Array(vec![o]).to_string(), MAX_CONTENT),
                );
            }
        }
        if let Some(m) = &self.shared.tracer.metrics {
            let mut attrs = Vec::with_capacity(8);
            attrs.push(KeyValue::new(sc::OPERATION_NAME, "chat"));
            attrs.push(KeyValue::new(sc::PROVIDER_NAME, chat.provider.clone()));
            if !chat.model.is_empty() {
                attrs.push(KeyValue::new(sc::REQUEST_MODEL, chat.model.clone()));
            }
            if let Some(rm) = &end.response_model {
                attrs.push(KeyValue::new(sc::RESPONSE_MODEL, rm.clone()));
            }
            if let Some((h, p)) = &chat.server {
                attrs.push(KeyValue::new(sc::SERVER_ADDRESS, h.clone()));
                attrs.push(KeyValue::new(sc::SERVER_PORT, i64::from(*p)));
            }
            // One list for the three records, its last entry swapped between them (no copies
            // of the attribute values: this runs once per model call).
            if let Some((t, _)) = &end.error {
                attrs.push(KeyValue::new(sc::ERROR_TYPE, t.clone()));
                m.duration(chat.started.elapsed().as_secs_f64(), &attrs);
                attrs.pop();
            } else {
                m.duration(chat.started.elapsed().as_secs_f64(), &attrs);
            }
            if end.has_usage {
                attrs.push(KeyValue::new(sc::TOKEN_TYPE, "input"));
                m.tokens(end.input, &attrs);
                if let Some(last) = attrs.last_mut() {
                    *last = KeyValue::new(sc::TOKEN_TYPE, "output");
                }
                m.tokens(end.output, &attrs);
            }
        }
        if let Some(run) = st.run.as_mut() {
            if end.has_usage {
                run.input += end.input;
                run.output += end.output;
                run.cache_read += end.cache_read;
            }
            sink.set_traceparent("", run.traceparent.clone());
        }
        let Chat { g, .. } = chat;
        g.end(end.error.as_ref().map(|(t, m)| (t.as_str(), m.as_str())));
    }

    /// Usage reported outside any model call (no chat span open): counted on the request and in
    /// the token metric.
    fn add_usage(&self, st: &mut State, (i, o, c): (u64, u64, u64), provider: &str, model: &str) {
        if let Some(run) = st.run.as_mut() {
            run.input += i;
            run.output += o;
            run.cache_read += c;
        }
        if let Some(m) = &self.shared.tracer.metrics {
            let mut attrs = vec![
                KeyValue::new(sc::OPERATION_NAME, "chat"),
                KeyValue::new(sc::PROVIDER_NAME, provider.to_owned()),
            ];
            if !model.is_empty() {
                attrs.push(KeyValue::new(sc::REQUEST_MODEL, model.to_owned()));
            }
            let mut ia = attrs.clone();
            ia.push(KeyValue::new(sc::TOKEN_TYPE, "input"));
            m.tokens(i, &ia);
            attrs.push(KeyValue::new(sc::TOKEN_TYPE, "output"));
            m.tokens(o, &attrs);
        }
    }

    fn open_tool(
        &self,
        st: &mut State,
        u: &ToolUse,
        kind: &str,
        e: Option<&Event>,
        sink: &EventSink,
        started: bool,
    ) {
        if u.id.is_empty() || st.tools.contains_key(&u.id) {
            return;
        }
        // A tool call ends the model output before it (an inferred chat span).
        if st.chat.as_ref().is_some_and(|c| !c.explicit)
            && let Some(chat) = st.chat.take()
        {
            self.close_chat(st, chat, ChatEnd::default(), sink);
        }
        let Some(run) = st.run.as_mut() else {
            return;
        };
        let specs = run.specs.get_or_insert_with(|| {
            sink.handler()
                .tools()
                .into_iter()
                .map(|t| (t.name, (t.description, t.meta)))
                .collect()
        });
        let spec = specs.get(&u.name);
        let name = if u.name.is_empty() {
            "execute_tool".to_owned()
        } else {
            format!("execute_tool {}", clip(&u.name, MAX_NAME))
        };
        let attrs = vec![
            KeyValue::new(sc::OPERATION_NAME, "execute_tool"),
            KeyValue::new(sc::TOOL_NAME, clip(&u.name, MAX_VALUE)),
            KeyValue::new(sc::TOOL_CALL_ID, clip(&u.id, MAX_VALUE)),
            KeyValue::new(sc::TOOL_TYPE, kind.to_owned()),
        ];
        let g = self.span(Some(&run.g), &name, "internal", attrs);
        if let Some((d, _)) = spec
            && !d.is_empty()
        {
            g.set(sc::TOOL_DESCRIPTION, d.clone());
        }
        // MCP: from the tool's spec (an MCP tool source sets `mcp.server`), or from a Managed
        // Agents MCP tool use.
        let mcp_server = spec
            .and_then(|(_, m)| m.get("mcp.server").and_then(Value::as_str).map(str::to_owned))
            .or_else(|| {
                e.filter(|e| e.raw_type == "agent.mcp_tool_use")
                    .map(|e| str_of(&e.raw, "mcp_server_name").unwrap_or_default().to_owned())
            });
        if let Some(server) = mcp_server {
            g.set(sc::MCP_METHOD_NAME, "tools/call");
            if !server.is_empty() {
                g.set("mcp.server.name", server);
            }
            if let Some((_, m)) = spec {
                for (k, attr) in [
                    ("mcp.session.id", sc::MCP_SESSION_ID),
                    ("mcp.protocol.version", sc::MCP_PROTOCOL_VERSION),
                    ("server.address", sc::SERVER_ADDRESS),
                ] {
                    if let Some(v) = m.get(k).and_then(Value::as_str) {
                        g.set(attr, v.to_owned());
                    }
                }
                if let Some(p) = m.get("server.port").and_then(Value::as_i64) {
                    g.set(sc::SERVER_PORT, p);
                }
                match m.get("mcp.transport").and_then(Value::as_str) {
                    Some("stdio") => g.set(sc::NETWORK_TRANSPORT, "pipe"),
                    Some("http") => g.set(sc::NETWORK_TRANSPORT, "tcp"),
                    _ => {}
                }
            }
        }
        if self.shared.tracer.capture_content && !u.input.is_null() {
            g.set(sc::TOOL_CALL_ARGUMENTS, clip(&u.input.to_string(), MAX_CONTENT));
        }
        // A tool the previous request left waiting (an approval): this run links to its span.
        if started && let Some(cx) = st.prev.as_ref().and_then(|p| p.pending.get(&u.id)) {
            g.link(
                cx.clone(),
                vec![KeyValue::new("tether.link.type", "awaited_result")],
            );
        }
        sink.set_traceparent(&u.id, g.traceparent());
        st.tools.insert(u.id.clone(), Tool { g });
        self.child_started(st, sink);
    }

    fn end_tool(&self, st: &mut State, id: &str, is_error: bool, content: Option<&str>, sink: &EventSink) {
        let Some(t) = st.tools.remove(id) else {
            return;
        };
        sink.set_traceparent(id, None);
        if self.shared.tracer.capture_content
            && !is_error
            && let Some(c) = content
        {
            t.g.set(sc::TOOL_CALL_RESULT, clip(c, MAX_CONTENT));
        }
        let msg = content.unwrap_or("the tool reported an error").to_owned();
        t.g.end(is_error.then_some(("tool_error", msg.as_str())));
    }

    /// Keeps `value` as the session's last trace state in this process's memory (what its next
    /// request links to without reading the store).
    fn remember(&self, session_id: &str, prev: Prev) {
        if session_id.is_empty() {
            return;
        }
        if let Ok(mut m) = self.shared.tracer.recent.lock() {
            if let Some(p) = m.get_mut(session_id) {
                *p = prev;
                return;
            }
            if m.len() >= RECENT {
                m.clear();
            }
            m.insert(session_id.to_owned(), prev);
        }
    }

    /// Saves the session's trace state, or with `None` reads the saved one (in order, off the
    /// session's task).
    fn persist(&self, sink: &EventSink, session_id: String, value: Option<Value>) {
        if session_id.is_empty() {
            return;
        }
        let mut w = self.shared.writer.lock().unwrap_or_else(|p| p.into_inner());
        if w.is_none() {
            let Ok(rt) = tokio::runtime::Handle::try_current() else {
                return;
            };
            let (tx, rx) = mpsc::unbounded_channel();
            rt.spawn(writer(rx, sink.store().clone(), Arc::downgrade(&self.shared)));
            *w = Some(tx);
        }
        if let Some(tx) = w.as_ref() {
            let _ = tx.send(Write { session_id, value });
        }
    }
}

fn link_prev(run: &mut Run, prev: &Prev) {
    if run.linked {
        return;
    }
    if let Some(cx) = &prev.cx {
        let ty = if prev.open {
            "interrupted_run"
        } else {
            "previous_run"
        };
        run.g
            .link(cx.clone(), vec![KeyValue::new("tether.link.type", ty)]);
        if prev.open {
            run.g.event(
                "tether.resumed",
                vec![KeyValue::new(
                    "tether.resumed.reason",
                    "the previous request never ended (the process stopped during it)",
                )],
            );
        }
        run.linked = true;
    }
}

async fn writer(
    mut rx: mpsc::UnboundedReceiver<Write>,
    store: Arc<dyn tether::EventStore>,
    shared: Weak<Shared>,
) {
    let mut warned = false;
    while let Some(w) = rx.recv().await {
        let Some(value) = w.value else {
            let prev = match store.state(&w.session_id, STATE_KEY).await {
                Ok(v) => v,
                Err(e) => {
                    tracing::debug!(error = %e, "tether-otel: could not read the session's trace state");
                    None
                }
            };
            if let Some(s) = shared.upgrade() {
                let mut st = s.lock();
                let prev = Prev::parse(prev.as_ref());
                if let Some(run) = st.run.as_mut() {
                    link_prev(run, &prev);
                }
                st.prev = Some(prev);
            }
            continue;
        };
        if let Err(e) = store.put_state(&w.session_id, STATE_KEY, &value).await
            && !warned
        {
            warned = true;
            tracing::warn!(error = %e, "tether-otel: could not save the session's trace context; a resumed session will not link to its earlier spans");
        }
    }
}

/// How a chat span starts: from an explicit start (a model call mark, a
/// `span.model_request_start`) or inferred from output; its kind, provider, model and endpoint
/// when known.
struct ChatStart {
    explicit: bool,
    kind: &'static str,
    provider: Option<String>,
    model: Option<String>,
    endpoint: Option<String>,
}

impl ChatStart {
    /// A model call of a remote loop, nothing known but that it happens.
    fn inferred(explicit: bool) -> Self {
        ChatStart {
            explicit,
            kind: "client",
            provider: None,
            model: None,
            endpoint: None,
        }
    }
}

/// How a chat span ends.
#[derive(Default)]
struct ChatEnd {
    has_usage: bool,
    input: u64,
    output: u64,
    cache_read: u64,
    response_id: Option<String>,
    response_model: Option<String>,
    finish: Option<String>,
    message: Option<Value>,
    error: Option<(String, String)>,
}

impl ChatEnd {
    /// Usage, and the response's `id` and `model` when `raw` has them.
    fn usage(i: u64, o: u64, c: u64, raw: &Value) -> Self {
        let [id, model] = fields(raw, ["id", "model"]);
        ChatEnd {
            has_usage: i > 0 || o > 0 || c > 0,
            input: i,
            output: o,
            cache_read: c,
            response_id: id
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(|s| clip(s, MAX_VALUE)),
            response_model: model
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(|s| clip(s, MAX_VALUE)),
            ..Default::default()
        }
    }

    fn failed(ty: &str, msg: &str) -> Self {
        ChatEnd {
            error: Some((ty.to_owned(), msg.to_owned())),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A memory store that counts its state reads.
    #[derive(Default)]
    struct CountingReads {
        inner: tether::MemoryStore,
        reads: std::sync::atomic::AtomicUsize,
    }

    #[async_trait::async_trait]
    impl tether::EventStore for CountingReads {
        async fn append(&self, sid: &str, e: &Event) -> tether::Result<bool> {
            self.inner.append(sid, e).await
        }
        async fn load(&self, sid: &str) -> tether::Result<Vec<Event>> {
            self.inner.load(sid).await
        }
        async fn tool_result(&self, sid: &str, id: &str) -> tether::Result<Option<tether::ToolResult>> {
            self.inner.tool_result(sid, id).await
        }
        async fn put_tool_result(&self, sid: &str, r: &tether::ToolResult) -> tether::Result<()> {
            self.inner.put_tool_result(sid, r).await
        }
        async fn put_state(&self, sid: &str, k: &str, v: &Value) -> tether::Result<()> {
            self.inner.put_state(sid, k, v).await
        }
        async fn state(&self, sid: &str, k: &str) -> tether::Result<Option<Value>> {
            self.reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.inner.state(sid, k).await
        }
        async fn sessions(&self) -> tether::Result<Vec<String>> {
            self.inner.sessions().await
        }
    }

    fn user(id: &str, seq: u64) -> Event {
        let mut e = Event::new(
            id,
            tether::raw::USER_MESSAGE,
            json!({"text": id}),
            EventKind::Other,
        );
        e.seq = Some(seq);
        e
    }

    #[test]
    fn fields_finds_what_get_finds() {
        let v = json!({"usage": {"input_tokens": 3}, "id": "r1", "model": null, "x": 1});
        let keys = ["id", "usage", "model", "absent", "x"];
        let got = fields(&v, keys);
        for (k, g) in keys.iter().zip(got) {
            assert_eq!(g, v.get(k), "{k}");
        }
        assert_eq!(fields(&json!([1, 2]), ["id"]), [None]);
        assert_eq!(fields(&Value::Null, ["id", "model"]), [None, None]);
    }

    /// A new thread (its first messages adopted at open) is attached without a read of the
    /// store; a thread reopened on its stored events (after a restart) is read once, for the
    /// link to its previous request.
    #[tokio::test]
    async fn only_a_thread_with_an_earlier_record_has_its_trace_state_read() {
        let store = Arc::new(CountingReads::default());
        let reads = || store.reads.load(std::sync::atomic::Ordering::Relaxed);
        let open = || {
            EventSink::new(
                tether::SessionInfo::new("t1", "test"),
                Arc::new(tether::NoTools),
                store.clone(),
            )
        };
        let sink = open();
        sink.adopt(vec![user("u1", 1)]).await.unwrap();
        assert!(Tracer::new().attach(&sink).await);
        assert_eq!(reads(), 0, "a new thread has nothing to read");

        let sink = open();
        sink.seed(&[user("u1", 1)]).await;
        sink.adopt(vec![user("u2", 2)]).await.unwrap();
        assert!(Tracer::new().attach(&sink).await);
        assert_eq!(reads(), 1, "a reopened thread's state is read");
    }

    #[test]
    fn values_from_outside_are_clipped_and_cleaned() {
        assert_eq!(clip("read\u{1b}[2J_file\n", MAX_NAME), "read[2J_file");
        assert_eq!(clip(&"x".repeat(70), MAX_NAME), format!("{}…", "x".repeat(64)));
        assert_eq!(clip("a\nb\u{0}", MAX_CONTENT), "a\nb");
        assert_eq!(clip("short", MAX_VALUE), "short");
        assert_eq!(clip("gpt-4o-mini", 4), "gpt-…");
        assert_eq!(clip("tab\there", MAX_VALUE), "tabhere");
        assert_eq!(clip("naïve", MAX_VALUE), "naïve");
    }

    /// One exported histogram point: its histogram's name, its `model` attribute, count, sum.
    type Point = (String, String, u64, f64);

    /// Keeps what the last export held.
    #[derive(Clone, Default)]
    struct Points(Arc<Mutex<Vec<Point>>>);

    impl opentelemetry_sdk::metrics::exporter::PushMetricExporter for Points {
        async fn export(
            &self,
            rm: &opentelemetry_sdk::metrics::data::ResourceMetrics,
        ) -> opentelemetry_sdk::error::OTelSdkResult {
            use opentelemetry_sdk::metrics::data::{AggregatedMetrics as A, MetricData as D};
            let mut out = self.0.lock().unwrap();
            out.clear();
            for m in rm.scope_metrics().flat_map(|s| s.metrics()) {
                fn model<'a>(mut a: impl Iterator<Item = &'a KeyValue>) -> String {
                    a.find(|kv| kv.key.as_str() == "model")
                        .map(|kv| kv.value.to_string())
                        .unwrap_or_default()
                }
                match m.data() {
                    A::F64(D::Histogram(h)) => {
                        for p in h.data_points() {
                            out.push((m.name().into(), model(p.attributes()), p.count(), p.sum()));
                        }
                    }
                    A::U64(D::Histogram(h)) => {
                        for p in h.data_points() {
                            let sum = p.sum() as f64;
                            out.push((m.name().into(), model(p.attributes()), p.count(), sum));
                        }
                    }
                    _ => {}
                }
            }
            Ok(())
        }
        fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
            Ok(())
        }
        fn shutdown_with_timeout(&self, _: std::time::Duration) -> opentelemetry_sdk::error::OTelSdkResult {
            Ok(())
        }
        fn temporality(&self) -> opentelemetry_sdk::metrics::Temporality {
            opentelemetry_sdk::metrics::Temporality::Cumulative
        }
    }

    #[test]
    fn bound_series_count_every_record_also_past_the_bound_sets() {
        use opentelemetry::metrics::MeterProvider as _;
        let points = Points::default();
        let provider = opentelemetry_sdk::metrics::SdkMeterProvider::builder()
            .with_reader(opentelemetry_sdk::metrics::PeriodicReader::builder(points.clone()).build())
            .build();
        let m = Metrics::new(&provider.meter("test"));
        let set = |i: usize| {
            vec![
                KeyValue::new("op", "chat"),
                KeyValue::new("model", format!("m{i}")),
            ]
        };
        // m0 three times (bound at the first, then found), then more sets than are kept bound,
        // then m0 again (unbound by then: bound anew) and m1 (dropped too).
        for _ in 0..3 {
            m.duration(1.0, &set(0));
            m.tokens(5, &set(0));
        }
        for i in 1..=BOUND + 2 {
            m.duration(2.0, &set(i));
        }
        m.duration(1.0, &set(0));
        m.duration(2.0, &set(1));
        assert_eq!(m.bound_duration.lock().unwrap().0.len(), BOUND);
        provider.force_flush().unwrap();
        let got = points.0.lock().unwrap().clone();
        let find = |name: &str, model: &str| {
            got.iter()
                .find(|(n, m, ..)| n == name && m == model)
                .map(|(_, _, c, s)| (*c, *s))
        };
        assert_eq!(find(sc::METRIC_OPERATION_DURATION, "m0"), Some((4, 4.0)));
        assert_eq!(find(sc::METRIC_TOKEN_USAGE, "m0"), Some((3, 15.0)));
        assert_eq!(find(sc::METRIC_OPERATION_DURATION, "m1"), Some((2, 4.0)));
        for i in 2..=BOUND + 2 {
            assert_eq!(
                find(sc::METRIC_OPERATION_DURATION, &format!("m{i}")),
                Some((1, 2.0)),
                "m{i}"
            );
        }
    }

    #[test]
    fn traceparents_are_written_as_w3c_says_and_read_back() {
        for (t, p, f) in [
            (
                0x0af7651916cd43dd8448eb211c80319c_u128,
                0xb7ad6b7169203331_u64,
                1_u8,
            ),
            (1, 0xff, 0),
            (u128::MAX, u64::MAX, 0xff),
        ] {
            let cx = SpanContext::new(
                TraceId::from(t),
                SpanId::from(p),
                TraceFlags::new(f),
                false,
                TraceState::default(),
            );
            let s = traceparent(&cx);
            assert_eq!(s, format!("00-{t:032x}-{p:016x}-{f:02x}"));
            let back = parse_traceparent(&s).expect("a valid traceparent");
            assert_eq!(
                (back.trace_id(), back.span_id(), back.trace_flags()),
                (cx.trace_id(), cx.span_id(), cx.trace_flags())
            );
        }
    }

    #[test]
    fn traceparents_parse_strictly() {
        assert!(parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").is_some());
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
    }
}
