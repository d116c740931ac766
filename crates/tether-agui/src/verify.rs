//! The server-side stream verifier.
//!
//! It enforces what `@ag-ui/client@1.0.0`'s `verifyEvents` enforces (first event, nothing
//! after `RUN_ERROR` but a new run, sequential runs, open/close by id for messages, tool calls,
//! steps, reasoning spans and messages and subagents, nothing open at `RUN_FINISHED`,
//! attribution) plus the server MUSTs the client does not check: a tool result only after its
//! call's `TOOL_CALL_END` (and never for a front-end tool), boundary events carrying the
//! input's thread and run ids, `ACTIVITY_DELTA` only after a snapshot, well-formed patches and
//! interrupt lists, and a stream that ends in `RUN_FINISHED` or `RUN_ERROR` ([`Verifier::finish`]).
//!
//! Chunk events are modelled the way the client's `transformChunks` expands them: a chunk
//! with a new id opens an item, continuations may omit the id, and the item is closed by the
//! next non-chunk event of its lane (`RAW`, `ACTIVITY_*`, `REASONING_ENCRYPTED_VALUE` and
//! `SUBAGENT_STARTED` excepted) or by any `RUN_*` / `MESSAGES_SNAPSHOT`.

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::event::AgUiEvent;
use crate::ids::{MessageId, RunId, SubagentRunId, ThreadId, ToolCallId};
use crate::patch::{PatchOperation, is_valid_pointer};
use crate::types::{Message, RunAgentInput, RunFinishedOutcome};

/// Which rule an event broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Rule {
    /// The first event was neither `RUN_STARTED` nor `RUN_ERROR`.
    FirstEvent,
    /// An event other than `RUN_STARTED` (or a late `RUN_ERROR`) after the run ended.
    AfterTerminal,
    /// `RUN_STARTED` while a run is active.
    RunAlreadyActive,
    /// A START for an id that is already open (or a subagent id reused in the run).
    DuplicateStart,
    /// A CONTENT/ARGS/END for an id that is not open.
    NotOpen,
    /// `RUN_FINISHED` while something is still open.
    OpenAtFinish,
    /// `TOOL_CALL_RESULT` before the call's `TOOL_CALL_END`.
    ResultBeforeEnd,
    /// `TOOL_CALL_RESULT` for a call this run never made (nor an unanswered input call).
    UnknownToolCall,
    /// A second `TOOL_CALL_RESULT` for the same call.
    DuplicateResult,
    /// `TOOL_CALL_RESULT` for a front-end tool (the client executes those).
    FrontendToolResult,
    /// A boundary event's `threadId`/`runId` differs from the input's or its run's.
    IdMismatch,
    /// A continuation attributed to a different subagent than its opener.
    OwnerMismatch,
    /// A structurally invalid event (empty interrupt list, duplicate interrupt ids, malformed
    /// JSON Pointer, chunk without its id, delta without a snapshot, ...).
    InvalidEvent,
    /// The stream ended while a run was active.
    Truncated,
}

impl Rule {
    /// The `RUN_ERROR.code` reported for this rule.
    pub fn code(self) -> &'static str {
        match self {
            Rule::FirstEvent => "AGUI_FIRST_EVENT",
            Rule::AfterTerminal => "AGUI_AFTER_TERMINAL",
            Rule::RunAlreadyActive => "AGUI_RUN_ALREADY_ACTIVE",
            Rule::DuplicateStart => "AGUI_DUPLICATE_START",
            Rule::NotOpen => "AGUI_NOT_OPEN",
            Rule::OpenAtFinish => "AGUI_OPEN_AT_FINISH",
            Rule::ResultBeforeEnd => "AGUI_RESULT_BEFORE_END",
            Rule::UnknownToolCall => "AGUI_UNKNOWN_TOOL_CALL",
            Rule::DuplicateResult => "AGUI_DUPLICATE_RESULT",
            Rule::FrontendToolResult => "AGUI_FRONTEND_TOOL_RESULT",
            Rule::IdMismatch => "AGUI_ID_MISMATCH",
            Rule::OwnerMismatch => "AGUI_OWNER_MISMATCH",
            Rule::InvalidEvent => "AGUI_INVALID_EVENT",
            Rule::Truncated => "AGUI_TRUNCATED",
        }
    }
}

/// A broken rule and what broke it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub struct Violation {
    /// The rule.
    pub rule: Rule,
    /// A sentence naming the event and the id involved.
    pub detail: String,
}

impl Violation {
    fn new(rule: Rule, detail: impl Into<String>) -> Self {
        Self {
            rule,
            detail: detail.into(),
        }
    }

    /// The `RUN_ERROR.code`.
    pub fn code(&self) -> &'static str {
        self.rule.code()
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.detail, self.rule.code())
    }
}

type Owner = Option<SubagentRunId>;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    BeforeFirst,
    Active,
    Finished,
    Errored,
}

#[derive(Debug, Default, Clone)]
struct Lane {
    text: Option<MessageId>,
    /// `role` / `name` the active text chunk item declared.
    text_role: Option<crate::event::TextMessageRole>,
    text_name: Option<String>,
    tool: Option<ToolCallId>,
    /// `toolCallName` / `parentMessageId` the active tool chunk item declared.
    tool_name: Option<String>,
    tool_parent: Option<MessageId>,
    reasoning: Option<MessageId>,
}

/// A chunk continuation may repeat an attribute of its item, but not change it.
fn same_attr<T: PartialEq + Clone + std::fmt::Debug>(
    slot: &mut Option<T>,
    now: Option<&T>,
    what: &str,
) -> Result<(), Violation> {
    match (slot.as_ref(), now) {
        (Some(a), Some(b)) if a != b => Err(Violation::new(
            Rule::InvalidEvent,
            format!("a chunk continuation changes {what} from {a:?} to {b:?}"),
        )),
        (None, Some(b)) => {
            *slot = Some(b.clone());
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Checks a stream of events, one at a time.
#[derive(Debug, Clone)]
pub struct Verifier {
    expected_thread: Option<ThreadId>,
    expected_first_run: Option<RunId>,
    frontend_tools: HashSet<String>,
    input_unanswered: HashSet<ToolCallId>,
    runs: usize,
    phase: Phase,
    thread: Option<ThreadId>,
    run: Option<RunId>,
    messages: HashMap<MessageId, Owner>,
    message_owners: HashMap<MessageId, Owner>,
    calls: HashMap<ToolCallId, (Owner, String)>,
    ended_calls: HashMap<ToolCallId, String>,
    answered: HashSet<ToolCallId>,
    pending: Vec<ToolCallId>,
    steps: HashSet<(Owner, String)>,
    spans: HashMap<MessageId, Owner>,
    reasoning: HashMap<MessageId, Owner>,
    subagents: HashSet<SubagentRunId>,
    finished_subagents: HashSet<SubagentRunId>,
    activities: HashSet<MessageId>,
    lanes: HashMap<Owner, Lane>,
}

impl Default for Verifier {
    fn default() -> Self {
        Self::new()
    }
}

impl Verifier {
    /// A verifier with no expectations about ids.
    pub fn new() -> Self {
        Self {
            expected_thread: None,
            expected_first_run: None,
            frontend_tools: HashSet::new(),
            input_unanswered: HashSet::new(),
            runs: 0,
            phase: Phase::BeforeFirst,
            thread: None,
            run: None,
            messages: HashMap::new(),
            message_owners: HashMap::new(),
            calls: HashMap::new(),
            ended_calls: HashMap::new(),
            answered: HashSet::new(),
            pending: Vec::new(),
            steps: HashSet::new(),
            spans: HashMap::new(),
            reasoning: HashMap::new(),
            subagents: HashSet::new(),
            finished_subagents: HashSet::new(),
            activities: HashSet::new(),
            lanes: HashMap::new(),
        }
    }

    /// A verifier for the stream answering `input`: every run must be on the input's thread,
    /// the first run must carry the input's run id, front-end tools (`input.tools`) must not
    /// get results, and calls the input leaves unanswered may receive results.
    pub fn for_input(input: &RunAgentInput) -> Self {
        let mut v = Self::new();
        v.expected_thread = Some(input.thread_id.clone());
        v.expected_first_run = Some(input.run_id.clone());
        v.frontend_tools = input.tools.iter().map(|t| t.name.clone()).collect();
        let mut asked = Vec::new();
        let mut answered = HashSet::new();
        for m in &input.messages {
            match m {
                Message::Assistant(a) => {
                    for tc in a.tool_calls.iter().flatten() {
                        asked.push(tc.id.clone());
                    }
                }
                Message::Tool(t) => {
                    answered.insert(t.tool_call_id.clone());
                }
                _ => {}
            }
        }
        v.input_unanswered = asked.into_iter().filter(|id| !answered.contains(id)).collect();
        v
    }

    /// Whether a run is active (started, not yet finished or errored).
    pub fn in_run(&self) -> bool {
        self.phase == Phase::Active
    }

    /// Whether at least one run ended and no run is active.
    pub fn ended(&self) -> bool {
        matches!(self.phase, Phase::Finished | Phase::Errored)
    }

    /// The active (or last) run's id.
    pub fn run_id(&self) -> Option<&RunId> {
        self.run.as_ref()
    }

    /// The thread id of the stream's runs.
    pub fn thread_id(&self) -> Option<&ThreadId> {
        self.thread.as_ref()
    }

    /// Calls of the current run that were ended without a result, in order.
    pub fn pending_tool_calls(&self) -> Vec<ToolCallId> {
        self.pending
            .iter()
            .filter(|id| !self.answered.contains(*id))
            .cloned()
            .collect()
    }

    /// Whether `id` is an open tool call.
    pub fn is_call_open(&self, id: &str) -> bool {
        self.calls.contains_key(id)
    }

    /// Everything currently open, as `"kind id"` strings.
    pub fn open_items(&self) -> Vec<String> {
        let mut items = Vec::new();
        items.extend(self.messages.keys().map(|k| format!("text message {k}")));
        items.extend(self.calls.keys().map(|k| format!("tool call {k}")));
        items.extend(self.steps.iter().map(|(_, s)| format!("step {s}")));
        items.extend(self.spans.keys().map(|k| format!("reasoning {k}")));
        items.extend(self.reasoning.keys().map(|k| format!("reasoning message {k}")));
        items.extend(self.subagents.iter().map(|k| format!("subagent {k}")));
        items.sort();
        items
    }

    /// Checks the end of the stream: the last run must have ended.
    pub fn finish(&self) -> Result<(), Violation> {
        match self.phase {
            Phase::Finished | Phase::Errored => Ok(()),
            Phase::BeforeFirst => Err(Violation::new(
                Rule::Truncated,
                "the stream ended before any run started",
            )),
            Phase::Active => Err(Violation::new(
                Rule::Truncated,
                format!(
                    "the stream ended inside run {} without RUN_FINISHED or RUN_ERROR",
                    self.run.as_deref().unwrap_or("?")
                ),
            )),
        }
    }

    fn reset_run(&mut self) {
        self.messages.clear();
        self.message_owners.clear();
        self.calls.clear();
        self.ended_calls.clear();
        self.answered.clear();
        self.pending.clear();
        self.steps.clear();
        self.spans.clear();
        self.reasoning.clear();
        self.subagents.clear();
        self.finished_subagents.clear();
        self.lanes.clear();
    }

    /// Closes the active chunk items of `lane` (all lanes when `None`), except `keep`.
    fn close_chunks(&mut self, lane: Option<&Owner>, keep: ChunkKind) {
        let owners: Vec<Owner> = match lane {
            Some(o) => vec![o.clone()],
            None => self.lanes.keys().cloned().collect(),
        };
        for o in owners {
            let Some(l) = self.lanes.get_mut(&o) else {
                continue;
            };
            if keep != ChunkKind::Text {
                l.text = None;
            }
            if keep != ChunkKind::Reasoning {
                l.reasoning = None;
            }
            if keep != ChunkKind::Tool
                && let Some(id) = l.tool.take()
            {
                // The synthesized TOOL_CALL_END.
                if let Some((_, name)) = self.calls.remove(&id) {
                    self.ended_calls.insert(id.clone(), name);
                    self.pending.push(id);
                }
            }
        }
    }

    fn check_owner(
        kind: &str,
        id: &str,
        opener: &Owner,
        now: Option<&SubagentRunId>,
    ) -> Result<(), Violation> {
        if opener.as_ref() != now {
            return Err(Violation::new(
                Rule::OwnerMismatch,
                format!(
                    "{kind} {id} was opened by {} but continued by {}",
                    owner_name(opener.as_ref()),
                    owner_name(now)
                ),
            ));
        }
        Ok(())
    }

    /// Checks one event and records its effect. On `Err` the event must not be sent.
    pub fn observe(&mut self, event: &AgUiEvent) -> Result<(), Violation> {
        let ty = event.event_type();
        // Lifecycle gate.
        match (&self.phase, event) {
            (Phase::BeforeFirst, AgUiEvent::RunStarted(_) | AgUiEvent::RunError(_)) => {}
            (Phase::BeforeFirst, _) => {
                return Err(Violation::new(
                    Rule::FirstEvent,
                    format!("first event must be RUN_STARTED or RUN_ERROR, not {ty}"),
                ));
            }
            (Phase::Active, _) => {}
            (Phase::Finished, AgUiEvent::RunStarted(_) | AgUiEvent::RunError(_)) => {}
            (Phase::Errored, AgUiEvent::RunStarted(_)) => {}
            (Phase::Finished | Phase::Errored, _) => {
                return Err(Violation::new(
                    Rule::AfterTerminal,
                    format!("{ty} after the run ended; only RUN_STARTED may follow"),
                ));
            }
        }

        let owner = event.attribution().cloned();
        // Chunk bookkeeping: which events close open chunk items.
        match event {
            AgUiEvent::TextMessageChunk(_)
            | AgUiEvent::ToolCallChunk(_)
            | AgUiEvent::ReasoningMessageChunk(_)
            | AgUiEvent::Raw(_)
            | AgUiEvent::ActivitySnapshot(_)
            | AgUiEvent::ActivityDelta(_)
            | AgUiEvent::ReasoningEncryptedValue(_)
            | AgUiEvent::SubagentStarted(_) => {}
            AgUiEvent::RunStarted(_)
            | AgUiEvent::RunFinished(_)
            | AgUiEvent::RunError(_)
            | AgUiEvent::MessagesSnapshot(_) => self.close_chunks(None, ChunkKind::None),
            AgUiEvent::SubagentFinished(e) => {
                let o = Some(e.subagent_run_id.clone());
                self.close_chunks(Some(&o), ChunkKind::None)
            }
            AgUiEvent::SubagentError(e) => {
                let o = Some(e.subagent_run_id.clone());
                self.close_chunks(Some(&o), ChunkKind::None)
            }
            _ => self.close_chunks(Some(&owner), ChunkKind::None),
        }

        match event {
            AgUiEvent::RunStarted(e) => {
                if self.phase == Phase::Active {
                    return Err(Violation::new(
                        Rule::RunAlreadyActive,
                        format!(
                            "RUN_STARTED {} while run {} is active",
                            e.run_id,
                            self.run.as_deref().unwrap_or("?")
                        ),
                    ));
                }
                let expected_thread = self.thread.as_ref().or(self.expected_thread.as_ref());
                if let Some(t) = expected_thread
                    && *t != e.thread_id
                {
                    return Err(Violation::new(
                        Rule::IdMismatch,
                        format!(
                            "RUN_STARTED threadId {} differs from the input's {t}",
                            e.thread_id
                        ),
                    ));
                }
                if self.runs == 0
                    && let Some(r) = &self.expected_first_run
                    && *r != e.run_id
                {
                    return Err(Violation::new(
                        Rule::IdMismatch,
                        format!("RUN_STARTED runId {} differs from the input's {r}", e.run_id),
                    ));
                }
                self.reset_run();
                self.runs += 1;
                self.phase = Phase::Active;
                self.thread = Some(e.thread_id.clone());
                self.run = Some(e.run_id.clone());
            }
            AgUiEvent::RunFinished(e) => {
                if self.thread.as_ref() != Some(&e.thread_id) || self.run.as_ref() != Some(&e.run_id) {
                    return Err(Violation::new(
                        Rule::IdMismatch,
                        format!(
                            "RUN_FINISHED for {}/{} but the active run is {}/{}",
                            e.thread_id,
                            e.run_id,
                            self.thread.as_deref().unwrap_or("?"),
                            self.run.as_deref().unwrap_or("?")
                        ),
                    ));
                }
                if self.phase != Phase::Active {
                    return Err(Violation::new(
                        Rule::AfterTerminal,
                        "RUN_FINISHED after the run ended",
                    ));
                }
                let open = self.open_items();
                if !open.is_empty() {
                    return Err(Violation::new(
                        Rule::OpenAtFinish,
                        format!("RUN_FINISHED while still open: {}", open.join(", ")),
                    ));
                }
                if let Some(RunFinishedOutcome::Interrupt { interrupts }) = &e.outcome {
                    if interrupts.is_empty() {
                        return Err(Violation::new(
                            Rule::InvalidEvent,
                            "an interrupt outcome needs at least one interrupt",
                        ));
                    }
                    let mut seen = HashSet::new();
                    for i in interrupts {
                        if !seen.insert(&i.id) {
                            return Err(Violation::new(
                                Rule::InvalidEvent,
                                format!("interrupt id {} is used twice in one run", i.id),
                            ));
                        }
                    }
                }
                if let Some(RunFinishedOutcome::Success {
                    pending_tool_call_ids: Some(ids),
                }) = &e.outcome
                {
                    for id in ids {
                        if !self.ended_calls.contains_key(id) && !self.input_unanswered.contains(id) {
                            return Err(Violation::new(
                                Rule::UnknownToolCall,
                                format!("pendingToolCallIds names {id}, which this run never ended"),
                            ));
                        }
                    }
                }
                self.phase = Phase::Finished;
            }
            AgUiEvent::RunError(_) => {
                self.phase = Phase::Errored;
            }
            AgUiEvent::StepStarted(e) => {
                if !self.steps.insert((owner.clone(), e.step_name.clone())) {
                    return Err(Violation::new(
                        Rule::DuplicateStart,
                        format!("STEP_STARTED {} while that step is running", e.step_name),
                    ));
                }
            }
            AgUiEvent::StepFinished(e) => {
                if !self.steps.remove(&(owner.clone(), e.step_name.clone())) {
                    return Err(Violation::new(
                        Rule::NotOpen,
                        format!("STEP_FINISHED {} for a step that is not running", e.step_name),
                    ));
                }
            }
            AgUiEvent::TextMessageStart(e) => {
                if self.messages.contains_key(&e.message_id) || self.chunk_text_open(&e.message_id) {
                    return Err(Violation::new(
                        Rule::DuplicateStart,
                        format!("TEXT_MESSAGE_START {} while it is open", e.message_id),
                    ));
                }
                self.messages.insert(e.message_id.clone(), owner.clone());
                self.message_owners.insert(e.message_id.clone(), owner);
            }
            AgUiEvent::TextMessageContent(e) => {
                let Some(o) = self.messages.get(&e.message_id) else {
                    return Err(not_open("TEXT_MESSAGE_CONTENT", "text message", &e.message_id));
                };
                Self::check_owner("text message", &e.message_id, o, owner.as_ref())?;
            }
            AgUiEvent::TextMessageEnd(e) => {
                let Some(o) = self.messages.get(&e.message_id) else {
                    return Err(not_open("TEXT_MESSAGE_END", "text message", &e.message_id));
                };
                Self::check_owner("text message", &e.message_id, o, owner.as_ref())?;
                self.messages.remove(&e.message_id);
            }
            AgUiEvent::TextMessageChunk(e) => {
                self.close_chunks(Some(&owner), ChunkKind::Text);
                let lane = self.lanes.entry(owner.clone()).or_default();
                let continues = match (&e.message_id, &lane.text) {
                    (Some(id), Some(active)) => id == active,
                    (None, Some(_)) => true,
                    _ => false,
                };
                if continues {
                    same_attr(&mut lane.text_role, e.role.as_ref(), "role")?;
                    same_attr(&mut lane.text_name, e.name.as_ref(), "name")?;
                } else {
                    lane.text_role = e.role;
                    lane.text_name = e.name.clone();
                }
                match (&e.message_id, &lane.text) {
                    (Some(id), Some(active)) if id == active => {}
                    (Some(id), _) => {
                        if self.messages.contains_key(id) {
                            return Err(Violation::new(
                                Rule::DuplicateStart,
                                format!(
                                    "TEXT_MESSAGE_CHUNK {id} for a message opened with TEXT_MESSAGE_START"
                                ),
                            ));
                        }
                        lane.text = Some(id.clone());
                        self.message_owners.insert(id.clone(), owner.clone());
                    }
                    (None, Some(_)) => {}
                    (None, None) => {
                        return Err(Violation::new(
                            Rule::InvalidEvent,
                            "the first TEXT_MESSAGE_CHUNK of a message must carry messageId",
                        ));
                    }
                }
            }
            AgUiEvent::ToolCallStart(e) => {
                if self.calls.contains_key(&e.tool_call_id) || self.ended_calls.contains_key(&e.tool_call_id)
                {
                    return Err(Violation::new(
                        Rule::DuplicateStart,
                        format!("TOOL_CALL_START {} for a call already started", e.tool_call_id),
                    ));
                }
                if let Some(parent) = &e.parent_message_id
                    && let Some(po) = self.message_owners.get(parent)
                    && *po != owner
                {
                    return Err(Violation::new(
                        Rule::OwnerMismatch,
                        format!(
                            "tool call {} belongs to {} but its parent message {parent} to {}",
                            e.tool_call_id,
                            owner_name(owner.as_ref()),
                            owner_name(po.as_ref())
                        ),
                    ));
                }
                self.calls
                    .insert(e.tool_call_id.clone(), (owner, e.tool_call_name.clone()));
            }
            AgUiEvent::ToolCallArgs(e) => {
                let Some((o, _)) = self.calls.get(&e.tool_call_id) else {
                    return Err(not_open("TOOL_CALL_ARGS", "tool call", &e.tool_call_id));
                };
                Self::check_owner("tool call", &e.tool_call_id, o, owner.as_ref())?;
            }
            AgUiEvent::ToolCallEnd(e) => {
                let Some((o, _)) = self.calls.get(&e.tool_call_id) else {
                    return Err(not_open("TOOL_CALL_END", "tool call", &e.tool_call_id));
                };
                Self::check_owner("tool call", &e.tool_call_id, o, owner.as_ref())?;
                if let Some((_, name)) = self.calls.remove(&e.tool_call_id) {
                    self.ended_calls.insert(e.tool_call_id.clone(), name);
                    self.pending.push(e.tool_call_id.clone());
                }
            }
            AgUiEvent::ToolCallChunk(e) => {
                self.close_chunks(Some(&owner), ChunkKind::Tool);
                let active = self.lanes.get(&owner).and_then(|l| l.tool.clone());
                {
                    let lane = self.lanes.entry(owner.clone()).or_default();
                    let continues = match (&e.tool_call_id, &active) {
                        (Some(id), Some(a)) => id == a,
                        (None, Some(_)) => true,
                        _ => false,
                    };
                    if continues {
                        same_attr(&mut lane.tool_name, e.tool_call_name.as_ref(), "toolCallName")?;
                        same_attr(
                            &mut lane.tool_parent,
                            e.parent_message_id.as_ref(),
                            "parentMessageId",
                        )?;
                    } else {
                        lane.tool_name = e.tool_call_name.clone();
                        lane.tool_parent = e.parent_message_id.clone();
                    }
                }
                match (&e.tool_call_id, active) {
                    (Some(id), Some(active)) if *id == active => {}
                    (Some(id), active) => {
                        if let Some(prev) = active {
                            // A new id closes the previous chunk item.
                            if let Some((_, name)) = self.calls.remove(&prev) {
                                self.ended_calls.insert(prev.clone(), name);
                                self.pending.push(prev);
                            }
                        }
                        let Some(name) = &e.tool_call_name else {
                            return Err(Violation::new(
                                Rule::InvalidEvent,
                                format!("the first TOOL_CALL_CHUNK of call {id} must carry toolCallName"),
                            ));
                        };
                        if self.calls.contains_key(id) || self.ended_calls.contains_key(id) {
                            return Err(Violation::new(
                                Rule::DuplicateStart,
                                format!("TOOL_CALL_CHUNK {id} for a call already started"),
                            ));
                        }
                        self.calls.insert(id.clone(), (owner.clone(), name.clone()));
                        self.lanes.entry(owner.clone()).or_default().tool = Some(id.clone());
                    }
                    (None, Some(_)) => {}
                    (None, None) => {
                        return Err(Violation::new(
                            Rule::InvalidEvent,
                            "the first TOOL_CALL_CHUNK of a call must carry toolCallId and toolCallName",
                        ));
                    }
                }
            }
            AgUiEvent::ToolCallResult(e) => {
                let id = &e.tool_call_id;
                if self.calls.contains_key(id) {
                    return Err(Violation::new(
                        Rule::ResultBeforeEnd,
                        format!("TOOL_CALL_RESULT for {id} before its TOOL_CALL_END"),
                    ));
                }
                if self.answered.contains(id) {
                    return Err(Violation::new(
                        Rule::DuplicateResult,
                        format!("a second TOOL_CALL_RESULT for {id}"),
                    ));
                }
                match self.ended_calls.get(id) {
                    Some(name) if self.frontend_tools.contains(name) => {
                        return Err(Violation::new(
                            Rule::FrontendToolResult,
                            format!(
                                "TOOL_CALL_RESULT for {id}, a call of front-end tool {name}: the client answers it"
                            ),
                        ));
                    }
                    Some(_) => {}
                    None if self.input_unanswered.contains(id) => {}
                    None => {
                        return Err(Violation::new(
                            Rule::UnknownToolCall,
                            format!("TOOL_CALL_RESULT for {id}, a call this run never made"),
                        ));
                    }
                }
                self.answered.insert(id.clone());
                self.input_unanswered.remove(id);
            }
            AgUiEvent::StateDelta(e) => check_patch("STATE_DELTA", &e.delta)?,
            AgUiEvent::ActivitySnapshot(e) => {
                self.activities.insert(e.message_id.clone());
            }
            AgUiEvent::ActivityDelta(e) => {
                if !self.activities.contains(&e.message_id) {
                    return Err(Violation::new(
                        Rule::InvalidEvent,
                        format!("ACTIVITY_DELTA for {} before its ACTIVITY_SNAPSHOT", e.message_id),
                    ));
                }
                check_patch("ACTIVITY_DELTA", &e.patch)?;
            }
            AgUiEvent::ReasoningStart(e) => {
                if self.spans.contains_key(&e.message_id) {
                    return Err(Violation::new(
                        Rule::DuplicateStart,
                        format!("REASONING_START {} while it is open", e.message_id),
                    ));
                }
                self.spans.insert(e.message_id.clone(), owner);
            }
            AgUiEvent::ReasoningEnd(e) => {
                let Some(o) = self.spans.get(&e.message_id) else {
                    return Err(not_open("REASONING_END", "reasoning span", &e.message_id));
                };
                Self::check_owner("reasoning span", &e.message_id, o, owner.as_ref())?;
                self.spans.remove(&e.message_id);
            }
            AgUiEvent::ReasoningMessageStart(e) => {
                if self.reasoning.contains_key(&e.message_id) {
                    return Err(Violation::new(
                        Rule::DuplicateStart,
                        format!("REASONING_MESSAGE_START {} while it is open", e.message_id),
                    ));
                }
                self.reasoning.insert(e.message_id.clone(), owner);
            }
            AgUiEvent::ReasoningMessageContent(e) => {
                let Some(o) = self.reasoning.get(&e.message_id) else {
                    return Err(not_open(
                        "REASONING_MESSAGE_CONTENT",
                        "reasoning message",
                        &e.message_id,
                    ));
                };
                Self::check_owner("reasoning message", &e.message_id, o, owner.as_ref())?;
            }
            AgUiEvent::ReasoningMessageEnd(e) => {
                let Some(o) = self.reasoning.get(&e.message_id) else {
                    return Err(not_open(
                        "REASONING_MESSAGE_END",
                        "reasoning message",
                        &e.message_id,
                    ));
                };
                Self::check_owner("reasoning message", &e.message_id, o, owner.as_ref())?;
                self.reasoning.remove(&e.message_id);
            }
            AgUiEvent::ReasoningMessageChunk(e) => {
                self.close_chunks(Some(&owner), ChunkKind::Reasoning);
                let lane = self.lanes.entry(owner.clone()).or_default();
                match (&e.message_id, &lane.reasoning) {
                    (Some(id), Some(active)) if id == active => {}
                    (Some(id), _) => {
                        if self.reasoning.contains_key(id) {
                            return Err(Violation::new(
                                Rule::DuplicateStart,
                                format!(
                                    "REASONING_MESSAGE_CHUNK {id} for a message opened with REASONING_MESSAGE_START"
                                ),
                            ));
                        }
                        lane.reasoning = Some(id.clone());
                    }
                    (None, Some(_)) => {}
                    (None, None) => {
                        return Err(Violation::new(
                            Rule::InvalidEvent,
                            "the first REASONING_MESSAGE_CHUNK must carry messageId",
                        ));
                    }
                }
            }
            AgUiEvent::SubagentStarted(e) => {
                let id = &e.subagent_run_id;
                if self.subagents.contains(id) || self.finished_subagents.contains(id) {
                    return Err(Violation::new(
                        Rule::DuplicateStart,
                        format!("SUBAGENT_STARTED {id}: subagent ids are not reused within a run"),
                    ));
                }
                if let Some(p) = &e.parent_subagent_run_id
                    && !self.subagents.contains(p)
                    && !self.finished_subagents.contains(p)
                {
                    return Err(Violation::new(
                        Rule::NotOpen,
                        format!("SUBAGENT_STARTED {id} names parent {p}, which never started"),
                    ));
                }
                self.subagents.insert(id.clone());
            }
            AgUiEvent::SubagentFinished(e) => {
                if !self.subagents.remove(&e.subagent_run_id) {
                    return Err(not_open("SUBAGENT_FINISHED", "subagent", &e.subagent_run_id));
                }
                self.finished_subagents.insert(e.subagent_run_id.clone());
            }
            AgUiEvent::SubagentError(e) => {
                if !self.subagents.remove(&e.subagent_run_id) {
                    return Err(not_open("SUBAGENT_ERROR", "subagent", &e.subagent_run_id));
                }
                self.finished_subagents.insert(e.subagent_run_id.clone());
            }
            AgUiEvent::MessagesSnapshot(e) => {
                // The snapshot is the conversation now: an ended call it no longer holds is gone
                // from the client (a restarted message withdrew it), pends no result and may be
                // started again.
                let held: HashSet<&str> = e
                    .messages
                    .iter()
                    .filter_map(|m| match m {
                        Message::Assistant(a) => a.tool_calls.as_ref(),
                        _ => None,
                    })
                    .flatten()
                    .map(|c| c.id.as_str())
                    .collect();
                self.ended_calls.retain(|id, _| held.contains(id.as_str()));
                self.pending.retain(|id| held.contains(id.as_str()));
            }
            AgUiEvent::StateSnapshot(_)
            | AgUiEvent::Raw(_)
            | AgUiEvent::Custom(_)
            | AgUiEvent::ReasoningEncryptedValue(_) => {}
        }
        Ok(())
    }

    fn chunk_text_open(&self, id: &MessageId) -> bool {
        self.lanes.values().any(|l| l.text.as_ref() == Some(id))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkKind {
    None,
    Text,
    Tool,
    Reasoning,
}

fn owner_name(o: Option<&SubagentRunId>) -> String {
    match o {
        Some(s) => format!("subagent {s}"),
        None => "the main agent".to_owned(),
    }
}

fn not_open(event: &str, kind: &str, id: &str) -> Violation {
    Violation::new(
        Rule::NotOpen,
        format!("{event} for {kind} {id}, which is not open"),
    )
}

fn check_patch(event: &str, ops: &[PatchOperation]) -> Result<(), Violation> {
    for (i, op) in ops.iter().enumerate() {
        if !is_valid_pointer(op.path()) || op.from().is_some_and(|f| !is_valid_pointer(f)) {
            return Err(Violation::new(
                Rule::InvalidEvent,
                format!(
                    "{event} operation {i} has a malformed JSON Pointer {:?}",
                    op.path()
                ),
            ));
        }
    }
    Ok(())
}
