//! One configured agent served over AG-UI: each request reattaches the thread's session from the
//! store, takes the new user message, tool results or approvals, runs it through the session
//! engine and streams what happens as AG-UI events.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tether::{
    ChatModel, Event, EventKind, EventStore, Role, Session, SessionConfig, SessionResult, ToolResult,
    ToolSpec, local::LocalLoop,
};
use tether_agui::{
    Agent, AssistantMessage, Content, EventMapper, FunctionCall, Interrupt, Message, RunContext, RunOutcome,
    TokenUsage, ToolCall,
};
use tether_sqlite::{Claim, SqliteStore};
use tokio_util::sync::CancellationToken;

use crate::approval;
use crate::config::AgentConfig;
use crate::handler::{ServeHandler, schema_or_empty};
use crate::rebuild::{CHECKPOINT, Reattached, USER_MESSAGE, rebuild};

type AgResult<T> = tether_agui::Result<T>;

/// What every agent of a server shares.
pub(crate) struct Shared {
    pub store: SqliteStore,
    pub store_dyn: Arc<dyn EventStore>,
    pub run_timeout: Duration,
    locks: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Shared {
    pub(crate) fn new(store: SqliteStore, run_timeout: Duration) -> Self {
        Shared {
            store_dyn: Arc::new(store.clone()),
            store,
            run_timeout,
            locks: Default::default(),
        }
    }

    fn thread_lock(&self, thread: &str) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        let m = {
            let mut g = self.locks.lock().ok()?;
            g.retain(|_, v| Arc::strong_count(v) > 1 || v.try_lock().is_err());
            g.entry(thread.to_owned()).or_default().clone()
        };
        m.try_lock_owned().ok()
    }
}

/// A configured agent.
pub(crate) struct ServeAgent {
    pub name: String,
    pub cfg: AgentConfig,
    pub model: Arc<dyn ChatModel>,
    pub model_name: String,
    pub shared: Arc<Shared>,
}

fn agent_err(code: &str, e: impl std::fmt::Display) -> tether_agui::Error {
    tether_agui::Error::agent(code, e.to_string())
}

fn tether_err(e: tether::Error) -> tether_agui::Error {
    tether_agui::Error::agent(e.code().to_ascii_uppercase(), e.to_string())
}

/// The error for a backend tool call the run leaves unanswered (the engine should never do
/// that; if it does, the client must not see a success it would wait on forever).
fn unanswered(id: &str, name: &str) -> tether_agui::Error {
    agent_err(
        "UNANSWERED_TOOL_CALL",
        format!(
            "the run left the call `{}` of tool `{}` without a result, and no one but the server can answer              it; nothing more was run. Send another message on this thread to continue",
            crate::server::printable(id),
            crate::server::printable(name)
        ),
    )
}

impl Agent for ServeAgent {
    type State = Value;

    async fn run(&self, ctx: &mut RunContext<Value>) -> AgResult<RunOutcome> {
        let limit = self.shared.run_timeout;
        match tokio::time::timeout(limit, self.run_inner(ctx)).await {
            Ok(r) => r,
            Err(_) => Err(agent_err(
                "RUN_TIMEOUT",
                format!(
                    "the run did not finish within {}s (the server's run_timeout_secs); what it did is saved, \
                     send another message on this thread to continue",
                    limit.as_secs()
                ),
            )),
        }
    }
}

impl ServeAgent {
    async fn run_inner(&self, ctx: &mut RunContext<Value>) -> AgResult<RunOutcome> {
        let input = ctx.input().clone();
        let thread = input.thread_id.to_string();
        let Some(_guard) = self.shared.thread_lock(&thread) else {
            return Err(agent_err(
                "THREAD_BUSY",
                format!("another run is in progress on thread {thread}; wait for it to finish"),
            ));
        };
        let store = &self.shared.store;
        let title: String = input
            .last_user_text()
            .unwrap_or_default()
            .chars()
            .take(80)
            .collect();
        let new_sid = format!("s_{:016x}", rand::random::<u64>());
        let sid = match store
            .claim_thread(&thread, &self.name, &new_sid, &title)
            .await
            .map_err(|e| agent_err("STORE", e))?
        {
            Claim::Claimed(t) => t.session_id,
            Claim::Taken(t) => {
                return Err(agent_err(
                    "THREAD_AGENT_MISMATCH",
                    format!(
                        "thread {thread} belongs to agent `{}`, not `{}`",
                        t.agent, self.name
                    ),
                ));
            }
            other => return Err(agent_err("STORE", format!("unexpected claim {other:?}"))),
        };

        let mut rb = Box::pin(rebuild(
            self.shared.store_dyn.as_ref(),
            &sid,
            self.cfg.system_prompt.as_deref(),
        ))
        .await
        .map_err(tether_err)?;

        // What this request brings. The answers to approvals first, checked against the
        // interrupts outstanding on this thread before anything runs (see `approval`).
        let mut outstanding = if input.resume.is_empty() && rb.pending.is_empty() {
            None
        } else {
            Some(
                approval::load(self.shared.store_dyn.as_ref(), &sid)
                    .await
                    .map_err(tether_err)?,
            )
        };
        let answers = match &outstanding {
            Some(out) => approval::decide(out, &thread, &input.resume, Some(&rb.pending))
                .map_err(|r| agent_err(r.code(), r))?,
            None => approval::Answers::default(),
        };
        if let (Some(out), false) = (&mut outstanding, answers.used.is_empty()) {
            // Used up before any tool runs: an answer counts once, whatever happens next (and
            // the id is never handed out again, even for the same call).
            for id in &answers.used {
                out.remove(id);
            }
            approval::save(self.shared.store_dyn.as_ref(), &sid, out)
                .await
                .map_err(tether_err)?;
        }
        let approved_ids: HashSet<String> = answers.approved.keys().cloned().collect();
        let denied = answers.denied;
        let pending_ids: HashSet<String> = rb.pending.iter().map(|u| u.id.clone()).collect();
        let mut fe_results = Vec::new();
        let mut new_users: Vec<(String, String)> = Vec::new();
        for m in &input.messages {
            match m {
                Message::Tool(t) if pending_ids.contains(t.tool_call_id.as_str()) => {
                    let content = t.content.to_text();
                    fe_results.push(match &t.error {
                        Some(err) => ToolResult::error(
                            t.tool_call_id.as_str(),
                            if content.is_empty() { err.clone() } else { content },
                        ),
                        None => ToolResult::ok(t.tool_call_id.as_str(), content),
                    });
                }
                Message::User(u) if !rb.user_ids.contains(u.id.as_str()) => {
                    new_users.push((u.id.to_string(), u.content.to_text()));
                }
                _ => {}
            }
        }
        let fe_specs: Vec<ToolSpec> = input
            .tools
            .iter()
            .map(|t| ToolSpec::new(&t.name, &t.description, schema_or_empty(t.parameters.clone())))
            .collect();
        let handler = Arc::new(approval::Gate::new(
            ServeHandler::new(&self.cfg, fe_specs, approved_ids.clone())
                .map_err(|e| agent_err("CONFIG", e))?,
            answers.approved,
        ));

        let history = serde_json::to_value(&rb.history).map_err(|e| agent_err("STORE", e))?;
        let inner = LocalLoop::with_model(self.model.clone())
            .model_name(self.model_name.clone())
            .session_id(format!("{sid}.{:08x}", rand::random::<u32>()))
            .transcript(&history)
            .map_err(tether_err)?;
        let provider = Reattached {
            inner,
            session_id: sid.clone(),
            pending: rb.pending.clone(),
        };
        let config = SessionConfig {
            max_turns: self.cfg.max_turns.max(1),
            // Bounded by the config check (at most a week), so the sum cannot overflow.
            tool_timeout: Some(Duration::from_secs(
                self.cfg
                    .tool_timeout_secs
                    .clamp(1, crate::config::MAX_DURATION_SECS)
                    + 5,
            )),
            terminal_tool: self
                .cfg
                .terminal_tool
                .as_ref()
                .map(|t| ToolSpec::new(&t.name, &t.description, schema_or_empty(t.parameters.clone()))),
            ..SessionConfig::default()
        };
        let last_seq = rb.last_seq();
        let mut session = Box::pin(
            Session::builder_boxed(Box::new(provider))
                .handler_arc(handler.clone())
                .store(self.shared.store_dyn.clone())
                .config(config)
                // The rebuild just loaded them: no second load.
                .stored_events(std::mem::take(&mut rb.events))
                .open(),
        )
        .await
        .map_err(tether_err)?;
        // Traced (GenAI spans, linked to the thread's earlier runs) when telemetry is on.
        tether_otel::attach_global(session.sink(), &self.name).await;
        let mut rx = session.sink().subscribe(256).await;

        let mut mapper = Mapper::new(&input, &self.model_name, last_seq);
        for u in &rb.pending {
            mapper.names.insert(u.id.clone(), u.name.clone());
        }
        mapper.state_init(ctx, &self.name, &thread);
        let cancel = CancellationToken::new();
        let mut last: Option<SessionResult> = None;

        // 1. Answer what the thread waits on, and continue.
        if !rb.pending.is_empty() {
            let sink = session.sink().clone();
            let mut answered: Vec<ToolResult> = fe_results.clone();
            for id in &denied {
                if let Some(u) = rb.pending.iter().find(|u| &u.id == id) {
                    let summary = handler
                        .inner
                        .approval_need(u)
                        .map(|n| n.summary)
                        .unwrap_or_else(|| u.name.clone());
                    answered.push(ToolResult::error(
                        id,
                        format!("the user denied this action ({summary})"),
                    ));
                }
            }
            if !new_users.is_empty() {
                for u in &rb.pending {
                    if !answered.iter().any(|r| r.tool_use_id == u.id) && !approved_ids.contains(&u.id) {
                        answered.push(ToolResult::error(
                            &u.id,
                            "not answered: the user sent a new message instead",
                        ));
                    }
                }
            }
            for r in &answered {
                self.shared
                    .store_dyn
                    .put_tool_result(&sid, r)
                    .await
                    .map_err(tether_err)?;
                sink.emit(Event::new(
                    format!("tool_result:{}", r.tool_use_id),
                    "tether.tool_result",
                    serde_json::to_value(r).unwrap_or(Value::Null),
                    EventKind::ToolResult { result: r.clone() },
                ))
                .await
                .map_err(tether_err)?;
            }
            // Boxed (here and below): the run's task then holds only the future running now,
            // not the largest of them inline (about 7 KiB less per run).
            let r = Box::pin(pump(session.resume(cancel.clone()), &mut rx, &mut mapper, ctx)).await?;
            last = Some(r.map_err(tether_err)?);
        }

        // 2. The new user message (or one a crash left unanswered).
        let still_paused = last.as_ref().is_some_and(|r| !r.pending_tool_uses.is_empty());
        let mut text_parts = Vec::new();
        if let Some(t) = &rb.trailing_user {
            text_parts.push(t.clone());
        }
        if !still_paused {
            let sink = session.sink().clone();
            for (id, text) in &new_users {
                sink.record(
                    format!("user:{id}"),
                    USER_MESSAGE,
                    json!({"id": id, "text": text}),
                    EventKind::Message {
                        message_id: id.clone(),
                        role: Role::User,
                        text: text.clone(),
                        reasoning: None,
                        tool_uses: Vec::new(),
                    },
                )
                .await
                .map_err(tether_err)?;
                text_parts.push(text.clone());
            }
            if !text_parts.is_empty() {
                let r = Box::pin(pump(
                    session.send_cancellable(text_parts.join("\n\n"), cancel.clone()),
                    &mut rx,
                    &mut mapper,
                    ctx,
                ))
                .await?;
                last = Some(r.map_err(tether_err)?);
            }
        }
        mapper.close_open(ctx)?;

        // 3. Checkpoint and outcome.
        let pending = match &last {
            Some(r) => r.pending_tool_uses.clone(),
            None => session.pending_tool_uses(),
        };
        if pending.is_empty()
            && let Some(t) = session.transcript()
        {
            let seq = mapper.max_seq;
            self.shared
                .store_dyn
                .put_state(&sid, CHECKPOINT, &json!({"transcript": t, "seq": seq}))
                .await
                .map_err(tether_err)?;
        }
        // (The claim at the start of the run marked the thread as used.)
        mapper.status = if pending.is_empty() { "idle" } else { "waiting" };
        mapper.publish(ctx)?;
        if let Some(r) = &last {
            // The session's usage events were mapped as they came; its total only when none was.
            if !mapper.events.usage_seen() && r.usage.total() > 0 {
                ctx.add_usage(TokenUsage {
                    model: (!self.model_name.is_empty()).then(|| self.model_name.clone()),
                    input_tokens: Some(r.usage.input_tokens),
                    output_tokens: Some(r.usage.output_tokens),
                    total_tokens: Some(r.usage.total()),
                    ..Default::default()
                });
            }
            if r.stop_reason != json!("stop") && r.stop_reason != json!("pending_tools") {
                ctx.set_result(json!({"stopReason": r.stop_reason}));
            }
        }
        // What is left waiting: calls for approval become interrupts (recorded, see `approval`);
        // front-end calls are the browser's to answer. Anything else would be a backend call
        // nobody will answer: never a success.
        let gate = &handler.inner;
        let mut asks: Vec<&tether::ToolUse> = Vec::new();
        for u in &pending {
            if gate.is_frontend(&u.name) {
                continue;
            }
            if gate.approval_need(u).is_some() {
                asks.push(u);
            } else {
                return Err(unanswered(&u.id, &u.name));
            }
        }
        let ask_ids: HashSet<&str> = asks.iter().map(|u| u.id.as_str()).collect();
        for id in ctx.pending_tool_calls() {
            let name = mapper.names.get(id.as_str()).map(String::as_str).unwrap_or("");
            if !ask_ids.contains(id.as_str()) && !gate.is_frontend(name) {
                return Err(unanswered(id.as_str(), name));
            }
        }
        let previous = outstanding.unwrap_or_default();
        let issued = approval::reissue(&previous, &thread, input.run_id.as_str(), &asks)
            .map_err(|e| agent_err("INTERNAL", e))?;
        if issued != previous {
            approval::save(self.shared.store_dyn.as_ref(), &sid, &issued)
                .await
                .map_err(tether_err)?;
        }
        if !issued.is_empty() {
            let mut interrupts = Vec::with_capacity(issued.len());
            for u in &asks {
                let Some((id, _)) = issued.iter().find(|(_, rec)| rec.tool_use_id == u.id) else {
                    continue;
                };
                let summary = gate
                    .approval_need(u)
                    .map(|n| n.summary)
                    .unwrap_or_else(|| u.name.clone());
                let mut schema = serde_json::Map::new();
                schema.insert("type".into(), json!("object"));
                schema.insert("properties".into(), json!({"approved": {"type": "boolean"}}));
                schema.insert("required".into(), json!(["approved"]));
                interrupts.push(
                    Interrupt::new(id.as_str(), "approval")
                        .with_message(format!("Allow {summary}?"))
                        .with_tool_call(u.id.as_str())
                        .with_response_schema(schema),
                );
            }
            return Ok(RunOutcome::Interrupt(interrupts));
        }
        Ok(RunOutcome::Success)
    }
}

/// Drives `fut` while relaying the session's events into the run.
async fn pump<F>(
    fut: F,
    rx: &mut tether::Subscription,
    m: &mut Mapper,
    ctx: &mut RunContext<Value>,
) -> AgResult<tether::Result<SessionResult>>
where
    F: std::future::Future<Output = tether::Result<SessionResult>>,
{
    tokio::pin!(fut);
    let mut open = true;
    loop {
        tokio::select! {
            biased;
            ev = rx.recv(), if open => match ev {
                Some(ev) => m.map(&ev, ctx).await?,
                None => open = false,
            },
            r = &mut fut => {
                while let Ok(ev) = rx.try_recv() {
                    m.map(&ev, ctx).await?;
                }
                return Ok(r);
            }
        }
    }
}

/// The run's AG-UI events ([`EventMapper`], the same mapping as `tether_agui`'s own session
/// agent) and the state panel the UI shows next to them (status, turns, each tool call's state).
struct Mapper {
    events: EventMapper,
    names: HashMap<String, String>,
    max_seq: u64,
    status: &'static str,
    tools: serde_json::Map<String, Value>,
    turns: u64,
}

impl Mapper {
    fn new(input: &tether_agui::RunAgentInput, model: &str, max_seq: u64) -> Self {
        let mut events = EventMapper::new(input);
        if !model.is_empty() {
            events = events.model(model);
        }
        Mapper {
            events,
            names: HashMap::new(),
            max_seq,
            status: "running",
            tools: serde_json::Map::new(),
            turns: 0,
        }
    }

    fn state_init(&mut self, ctx: &mut RunContext<Value>, agent: &str, thread: &str) {
        let mut s = match ctx.state() {
            Value::Object(m) => m.clone(),
            _ => serde_json::Map::new(),
        };
        s.insert("agent".into(), json!(agent));
        s.insert("thread".into(), json!(thread));
        s.insert("status".into(), json!("running"));
        s.insert("turns".into(), json!(0));
        s.insert("tools".into(), json!({}));
        ctx.set_state(Value::Object(s));
    }

    fn publish(&mut self, ctx: &mut RunContext<Value>) -> AgResult<()> {
        if let Value::Object(s) = ctx.state_mut() {
            s.insert("status".into(), json!(self.status));
            s.insert("turns".into(), json!(self.turns));
            s.insert("tools".into(), Value::Object(self.tools.clone()));
        }
        ctx.publish_state()
    }

    fn close_open(&mut self, ctx: &mut RunContext<Value>) -> AgResult<()> {
        self.events.close(ctx)
    }

    async fn map(&mut self, ev: &Event, ctx: &mut RunContext<Value>) -> AgResult<()> {
        ctx.ready().await?;
        self.events.map(ctx, ev)?;
        match &ev.kind {
            EventKind::ToolCallStart {
                tool_use_id, name, ..
            } => {
                self.names.insert(tool_use_id.clone(), name.clone());
            }
            EventKind::ToolCall { tool_use, .. } => {
                self.names.insert(tool_use.id.clone(), tool_use.name.clone());
            }
            EventKind::Message {
                role: Role::Assistant,
                tool_uses,
                ..
            } => {
                self.turns += 1;
                for u in tool_uses {
                    self.names.insert(u.id.clone(), u.name.clone());
                    self.tools
                        .insert(u.id.clone(), json!({"name": u.name, "status": "called"}));
                }
            }
            EventKind::ToolResult { result } => {
                let status = if result.is_error { "error" } else { "done" };
                let name = self.names.get(&result.tool_use_id).cloned().unwrap_or_default();
                self.tools.insert(
                    result.tool_use_id.clone(),
                    json!({"name": name, "status": status}),
                );
            }
            _ => {}
        }
        if let Some(s) = ev.seq {
            self.max_seq = self.max_seq.max(s);
            self.publish(ctx)?;
        }
        Ok(())
    }
}

/// A thread's conversation as AG-UI messages, rebuilt from its stored events (to reopen it).
pub(crate) fn thread_messages(events: &[Event]) -> Vec<Message> {
    let mut out = Vec::new();
    for e in events {
        match (&e.kind, e.raw_type.as_str()) {
            (EventKind::Message { message_id, text, .. }, USER_MESSAGE) => {
                out.push(Message::user(message_id.as_str(), text.clone()));
            }
            (
                EventKind::Message {
                    message_id,
                    role: Role::Assistant,
                    text,
                    tool_uses,
                    ..
                },
                _,
            ) => {
                let calls: Vec<ToolCall> = tool_uses
                    .iter()
                    .map(|u| ToolCall {
                        id: u.id.as_str().into(),
                        kind: "function".into(),
                        function: FunctionCall {
                            name: u.name.clone(),
                            arguments: u.raw_input.clone().unwrap_or_else(|| u.input.to_string()),
                        },
                        encrypted_value: None,
                        metadata: None,
                    })
                    .collect();
                out.push(Message::Assistant(AssistantMessage {
                    id: message_id.as_str().into(),
                    content: (!text.is_empty()).then(|| text.clone()),
                    tool_calls: (!calls.is_empty()).then_some(calls),
                    ..Default::default()
                }));
            }
            (EventKind::ToolResult { result }, _) => {
                let mut m = tether_agui::ToolMessage {
                    id: format!("{}-result", result.tool_use_id).into(),
                    tool_call_id: result.tool_use_id.as_str().into(),
                    content: Content::Text(result.content.clone()),
                    ..Default::default()
                };
                if result.is_error {
                    m.error = Some(result.content.clone());
                }
                out.push(Message::Tool(m));
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every concurrent run holds its future in its task: keep it small (the engine's futures
    /// are boxed where they are awaited).
    #[tokio::test]
    async fn a_runs_future_stays_small() {
        let store = SqliteStore::open_in_memory().unwrap();
        let shared = Arc::new(Shared::new(store, Duration::from_secs(5)));
        let cfg: crate::config::Config = toml::from_str("[agents.a]\nmodel = \"m\"\n").unwrap();
        let (_, acfg) = cfg.agents.iter().next().unwrap();
        let agent = ServeAgent {
            name: "a".into(),
            cfg: acfg.clone(),
            model: crate::model::openai("http://127.0.0.1:1/v1", None, "m", true).unwrap(),
            model_name: "m".into(),
            shared,
        };
        let input: tether_agui::RunAgentInput =
            serde_json::from_value(json!({"threadId": "t", "runId": "r", "messages": []})).unwrap();
        let (mut ctx, _rx) = RunContext::<Value>::new(input, &Default::default());
        let f = Agent::run(&agent, &mut ctx);
        let size = std::mem::size_of_val(&f);
        assert!(size <= 6 * 1024, "the run future is {size} bytes");
    }
}
