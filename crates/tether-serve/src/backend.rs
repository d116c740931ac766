//! The Restate backend of `tether serve` (`[server] backend = "restate"`, cargo feature
//! `restate`): a thread's turn runs as a `turn` invocation of the `TetherThread` virtual object
//! (crate `tether-restate`) instead of in this process over the SQLite store.
//!
//! The seam is the agent behind an AG-UI run route. With the default backend it is
//! `ThreadAgent`, which opens the thread's `Session` in process. Here it is [`RestateAgent`],
//! which
//! - sends a new user message as a `turn` invocation through the Restate ingress
//!   (`/TetherThread/{thread}/turn/send`, idempotent by the message and run ids);
//! - relays the turn's events to the client's AG-UI stream as they happen: the `TetherThread`
//!   service runs inside this process (its endpoint on a listener of its own, registered with the
//!   admin API at start) and sends every event (token deltas included) and every change of the
//!   turn's state (waiting for approvals, ended) out of band on broadcast channels;
//! - ends the run with the same approval interrupts as the default backend (issued and checked
//!   by `tether_agui::approval`, recorded in the thread's record) when the turn waits, and turns
//!   a resume into `approve` calls that complete the turn's awakeable;
//! - cancels the invocation (`cancel`) when the client goes away or the run times out.
//!
//! The record stays in the store: the turn commits it (journaled) when it ends, and the
//! `GET /v1/threads/...` routes read it as they do with the default backend.
//!
//! Not yet: only one agent per server (one `TetherThread` service per deployment), only the
//! local loop (an OpenAI-compatible or embedded model), no front-end tools, and no relay of a
//! turn's events to another tether node (the turn's events reach the clients of the node that
//! runs it).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tether::{EventStore, ThreadId, ThreadStore, ToolUse};
use tether_agui::approval::{self, Outstanding};
use tether_agui::thread::Update;
use tether_agui::{Agent, CheckError, EventMapper, Message, RunAgentInput, RunContext, RunOutcome};
use tether_restate::{LiveEvent, TetherThread, TurnRequest, TurnSignal, WaitingToolUse};
use tether_sqlite::SqliteStore;
use tokio::sync::broadcast;

use crate::config::{AgentConfig, ServerSection};
use crate::providers::ProviderSpec;

/// State key (in the thread's record) of the highest durable event sequence number a run
/// showed before the turn began waiting: a turn replayed after a suspension sends its events
/// again, and the run that resumes it skips those.
const SHOWN: &str = "restate.shown_seq";

/// How many events a relay may fall behind before it fails (`STREAM_LAGGED`).
const LIVE_CAPACITY: usize = 8192;

/// The Restate service endpoint a server runs: stopped by [`Endpoint::stop`], aborted when
/// dropped.
pub(crate) struct Endpoint {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Endpoint {
    /// Closes the endpoint's connections and waits until it (and the store it holds) is gone.
    pub(crate) async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

/// An agent whose turns run on Restate (see the module's documentation).
pub(crate) struct RestateAgent {
    name: String,
    model: String,
    ingress: reqwest::Url,
    http: reqwest::Client,
    store: SqliteStore,
    live: broadcast::Sender<LiveEvent>,
    signals: broadcast::Sender<TurnSignal>,
    run_timeout: Duration,
}

fn bad_url(what: &str, url: &str, e: impl std::fmt::Display) -> String {
    format!("[server] {what} = {url:?} is not a URL: {e}")
}

/// Starts the `TetherThread` service of agent `name` on its listener, registers it with the
/// admin API, and returns the agent that sends turns to it.
pub(crate) async fn start(
    name: &str,
    cfg: &AgentConfig,
    spec: ProviderSpec,
    store: &SqliteStore,
    server: &ServerSection,
    run_timeout: Duration,
) -> Result<(Arc<RestateAgent>, Endpoint), String> {
    let ProviderSpec::Local(local) = spec else {
        return Err(format!(
            "the restate backend runs the local loop only (an OpenAI-compatible or GGUF model); this agent's \
             provider is `{}`",
            spec.kind()
        ));
    };
    if !cfg.frontend_tools.is_empty() {
        return Err("the restate backend does not serve front-end tools yet".into());
    }
    let ingress_text = server
        .restate_ingress
        .clone()
        .unwrap_or_else(|| "http://127.0.0.1:8080".into());
    let ingress =
        reqwest::Url::parse(&ingress_text).map_err(|e| bad_url("restate_ingress", &ingress_text, e))?;
    if ingress.cannot_be_a_base() {
        return Err(bad_url(
            "restate_ingress",
            &ingress_text,
            "it cannot be a base URL",
        ));
    }
    let admin = server
        .restate_admin
        .clone()
        .unwrap_or_else(|| "http://127.0.0.1:9070".into());
    reqwest::Url::parse(&admin).map_err(|e| bad_url("restate_admin", &admin, e))?;
    let listen = server
        .restate_listen
        .clone()
        .unwrap_or_else(|| "127.0.0.1:9080".into());
    let handler = crate::handler::ServeHandler::new(cfg)?;
    let (live, _) = broadcast::channel(LIVE_CAPACITY);
    let (signals, _) = broadcast::channel(1024);
    let mut thread = TetherThread::new(
        name,
        local.model.clone(),
        Arc::new(handler),
        Arc::new(store.clone()),
    )
    .live(live.clone())
    .signals(signals.clone());
    if !local.model_name.is_empty() {
        thread = thread.model_name(local.model_name.clone());
    }
    if let Some(s) = local.system.clone().filter(|s| !s.trim().is_empty()) {
        thread = thread.system_prompt(s);
    }
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|e| format!("cannot listen on [server] restate_listen = {listen:?}: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("restate_listen: {e}"))?;
    let advertise = server
        .restate_advertise
        .clone()
        .unwrap_or_else(|| format!("http://{addr}"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(tether_restate::serve_until(thread, listener, async move {
        let _ = stopped.await;
    }));
    let endpoint = Endpoint {
        stop: Some(stop),
        task: Some(task),
    };
    tether_restate::register(&admin, &advertise, Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    let agent = RestateAgent {
        name: name.to_owned(),
        model: local.model_name.clone(),
        ingress,
        http: reqwest::Client::new(),
        store: store.clone(),
        live,
        signals,
        run_timeout,
    };
    Ok((Arc::new(agent), endpoint))
}

fn store_error(e: tether::Error) -> tether_agui::AgUiError {
    tether_agui::AgUiError::agent("STORE", e.to_string())
}

fn restate_error(message: impl Into<String>) -> tether_agui::AgUiError {
    tether_agui::AgUiError::agent("RESTATE", message)
}

fn calls_of(waiting: &[WaitingToolUse]) -> Vec<ToolUse> {
    waiting
        .iter()
        .map(|w| ToolUse::new(&w.id, &w.name, w.input.clone()))
        .collect()
}

/// How a relay ended.
enum Relayed {
    /// The turn waits for these tool uses.
    Waiting(Vec<WaitingToolUse>),
    /// The turn ended (`Err`: its failure's code and message).
    Ended(Result<tether_restate::TurnOutcome, (u16, String)>),
}

impl RestateAgent {
    /// The ingress URL of `handler` on `thread`'s object (`/TetherThread/{thread}/{handler}`,
    /// the thread id one escaped path segment).
    fn url(&self, thread: &ThreadId, handler: &[&str]) -> reqwest::Url {
        let mut u = self.ingress.clone();
        if let Ok(mut seg) = u.path_segments_mut() {
            seg.pop_if_empty()
                .push(tether_restate::SERVICE)
                .push(thread.as_str());
            for h in handler {
                seg.push(h);
            }
        }
        u
    }

    /// Calls a handler of the thread's object through the ingress; `Err` carries the status
    /// (0: unreachable) and the body.
    async fn call(
        &self,
        thread: &ThreadId,
        handler: &[&str],
        body: &Value,
        idempotency: Option<&str>,
    ) -> Result<Value, (u16, String)> {
        let mut req = self
            .http
            .post(self.url(thread, handler))
            .timeout(Duration::from_secs(30));
        // A handler without input takes no body (Restate refuses one).
        if !body.is_null() {
            req = req.json(body);
        }
        if let Some(k) = idempotency {
            req = req.header("idempotency-key", k);
        }
        let resp = req.send().await.map_err(|e| (0, e.to_string()))?;
        let status = resp.status().as_u16();
        let text = resp.text().await.map_err(|e| (status, e.to_string()))?;
        if !(200..300).contains(&status) {
            return Err((status, text.chars().take(2048).collect()));
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// What the thread's running turn waits for (empty: nothing, or no turn).
    async fn waiting(&self, thread: &ThreadId) -> tether_agui::AgUiResult<Vec<WaitingToolUse>> {
        let v = self
            .call(thread, &["waiting"], &Value::Null, None)
            .await
            .map_err(|(s, m)| restate_error(format!("asking what the turn waits for failed ({s}): {m}")))?;
        serde_json::from_value(v)
            .map_err(|e| restate_error(format!("the waiting handler answered oddly: {e}")))
    }

    /// Whether a turn of the thread runs (see `TetherThread::running`).
    async fn running(&self, thread: &ThreadId) -> tether_agui::AgUiResult<bool> {
        let v = self
            .call(thread, &["running"], &Value::Null, None)
            .await
            .map_err(|(s, m)| restate_error(format!("asking whether a turn runs failed ({s}): {m}")))?;
        v.as_bool()
            .ok_or_else(|| restate_error(format!("the running handler answered oddly: {v}")))
    }

    /// Sends one decision to the waiting turn. The turn waits for one decision at a time (a new
    /// awakeable after each), so an answer to a tool use the turn does not wait on yet is retried
    /// until it does.
    async fn decide(&self, thread: &ThreadId, decision: Value) -> tether_agui::AgUiResult<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            match self.call(thread, &["approve"], &decision, None).await {
                Ok(_) => return Ok(()),
                Err((409, _)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err((s, m)) => return Err(restate_error(format!("answering the turn failed ({s}): {m}"))),
            }
        }
    }

    /// Checks a request's `resume[]` before the run starts (the admission's check, as the
    /// default backend's).
    pub(crate) async fn check_resume(&self, input: &RunAgentInput) -> Result<(), CheckError> {
        approval::check_resume(&self.store, &self.name, input).await
    }

    async fn run_inner(&self, ctx: &mut RunContext<Value>) -> tether_agui::AgUiResult<RunOutcome> {
        let thread = ThreadId::new(ctx.input().thread_id.as_str())
            .map_err(|e| tether_agui::AgUiError::agent("INVALID_THREAD", e.to_string()))?;
        if !ctx.input().tools.is_empty() {
            // Refused rather than ignored: the model would never be offered the client's tools.
            return Err(tether_agui::AgUiError::agent(
                "FRONTEND_TOOLS_UNSUPPORTED",
                "this server runs its turns on Restate, which does not run front-end tools yet: send the \
                 run without `tools`, or use the default backend",
            ));
        }
        // Subscribed before anything is sent: nothing the turn does is missed.
        let mut events = self.live.subscribe();
        let mut signals = self.signals.subscribe();
        let mut mapper = EventMapper::new(ctx.input()).model(self.model.clone());
        update(
            ctx,
            Update::Started {
                agent: &self.name,
                thread: thread.as_str(),
            },
        )?;
        let existing = self.store.thread(&thread).await.map_err(store_error)?;
        if let Some(t) = &existing
            && t.agent != self.name
        {
            return Err(tether_agui::AgUiError::agent(
                "THREAD_AGENT_MISMATCH",
                format!("thread {} belongs to agent `{}`", thread.as_str(), t.agent),
            ));
        }
        let user = ctx.input().messages.iter().rev().find_map(|m| match m {
            Message::User(u) => Some((u.id.to_string(), u.content.to_text())),
            _ => None,
        });
        // The calls this run answered (id and arguments' digest): a turn replayed after a
        // suspension signals it waits for them again, a model that reuses an id asks anew.
        let mut answered: HashSet<(String, String)> = HashSet::new();
        let mut shown: u64 = 0;
        // Which turn's end this run reports: the one it started (by run id), or, resuming, the
        // waiting one.
        let mut ours: Option<String> = None;
        let resume = ctx.input().resume.clone();
        if !resume.is_empty() {
            let Some(rec) = &existing else {
                return Err(refused(&thread, &resume));
            };
            let mut outstanding = approval::load(&self.store, &rec.record)
                .await
                .map_err(store_error)?;
            let waiting = self.waiting(&thread).await?;
            let calls = calls_of(&waiting);
            let answers = approval::decide(
                &outstanding,
                thread.as_str(),
                &resume,
                Some(approval::WaitingOn::new(&calls, None)),
            )
            .map_err(|r| tether_agui::AgUiError::agent(r.code(), r.to_string()))?;
            // Used up before anything runs: an answer counts once.
            for id in &answers.used {
                outstanding.remove(id);
            }
            approval::save(&self.store, &rec.record, &outstanding)
                .await
                .map_err(store_error)?;
            shown = self
                .store
                .state(&rec.record, SHOWN)
                .await
                .map_err(store_error)?
                .and_then(|v| v.as_u64())
                .unwrap_or(0);
            for (ids, approved) in [(&answers.approved, true), (&answers.denied, false)] {
                for id in ids {
                    let digest = waiting
                        .iter()
                        .find(|w| &w.id == id)
                        .map(|w| approval::digest(&w.input))
                        .unwrap_or_default();
                    self.decide(
                        &thread,
                        json!({"decision": "answer", "tool_use_id": id, "approved": approved}),
                    )
                    .await?;
                    answered.insert((id.clone(), digest));
                }
            }
        } else if let Some((id, text)) = user {
            if let Some(rec) = &existing
                && !approval::load(&self.store, &rec.record)
                    .await
                    .map_err(store_error)?
                    .is_empty()
            {
                // The user moved on while a turn waited for approval: that turn ends (its
                // waiting calls answered as cancelled), and the new message is the next turn.
                if !self.waiting(&thread).await?.is_empty() {
                    self.decide(&thread, json!({"decision": "cancel"})).await?;
                }
                approval::save(&self.store, &rec.record, &Outstanding::new())
                    .await
                    .map_err(store_error)?;
            } else if existing.is_some() && self.running(&thread).await? {
                // As the default backend: a new message does not queue behind a running turn.
                return Err(tether_agui::AgUiError::agent(
                    "THREAD_BUSY",
                    format!(
                        "another run is in progress on thread {}; wait for it to finish",
                        approval::printable(thread.as_str())
                    ),
                ));
            }
            let run = ctx.run_id().as_str().to_owned();
            let req = serde_json::to_value(TurnRequest {
                message_id: id.clone(),
                text,
                run: run.clone(),
            })
            .map_err(|e| restate_error(e.to_string()))?;
            // Keyed by run too: a retried request of this run starts no second turn, while the
            // same message sent again by a new run (after a failed turn) is a new turn, which
            // goes on with what the failed one left.
            let key = idempotency_key(&[thread.as_str(), &id, &run]);
            self.call(&thread, &["turn", "send"], &req, Some(&key))
                .await
                .map_err(|(s, m)| restate_error(format!("sending the turn failed ({s}): {m}")))?;
            ours = Some(run);
        } else {
            update(ctx, Update::Finished { waiting: false })?;
            return Ok(RunOutcome::Success);
        }

        // Relay until the turn waits or ends, the client goes away or the run times out.
        let client_gone = ctx.cancel_token().clone();
        let timeout = tokio::time::sleep(self.run_timeout);
        tokio::pin!(timeout);
        let mut max_seq = shown;
        let relayed = loop {
            tokio::select! {
                biased;
                _ = client_gone.cancelled() => {
                    let _ = self.call(&thread, &["cancel"], &Value::Null, None).await;
                    return Err(tether_agui::AgUiError::Cancelled);
                }
                _ = &mut timeout => {
                    let _ = self.call(&thread, &["cancel"], &Value::Null, None).await;
                    return Err(tether_agui::AgUiError::agent(
                        "RUN_TIMEOUT",
                        format!(
                            "the run did not finish within {}s (the server's run time limit); the turn was \
                             cancelled, what it did is saved",
                            self.run_timeout.as_secs()
                        ),
                    ));
                }
                sig = signals.recv() => match sig {
                    Ok(TurnSignal::Waiting { thread: t, tool_uses }) if t == thread => {
                        if tool_uses
                            .iter()
                            .any(|u| !answered.contains(&(u.id.clone(), approval::digest(&u.input))))
                        {
                            break Relayed::Waiting(tool_uses);
                        }
                    }
                    Ok(TurnSignal::Ended { thread: t, run, outcome, .. }) if t == thread => {
                        if ours.as_ref().is_none_or(|m| *m == run) {
                            break Relayed::Ended(outcome);
                        }
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => return Err(lagged()),
                    Err(broadcast::error::RecvError::Closed) => return Err(restate_error("the service stopped")),
                },
                ev = events.recv() => match ev {
                    Ok(ev) if ev.thread == thread => relay(ctx, &mut mapper, &ev.event, &mut max_seq, shown).await?,
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => return Err(lagged()),
                    Err(broadcast::error::RecvError::Closed) => return Err(restate_error("the service stopped")),
                },
            }
        };
        // Every event sent before the signal is in the channel already.
        loop {
            match events.try_recv() {
                Ok(ev) if ev.thread == thread => {
                    relay(ctx, &mut mapper, &ev.event, &mut max_seq, shown).await?
                }
                Ok(_) => {}
                Err(broadcast::error::TryRecvError::Lagged(_)) => return Err(lagged()),
                Err(_) => break,
            }
        }
        match relayed {
            Relayed::Waiting(tool_uses) => {
                mapper.close(ctx)?;
                let rec = self
                    .store
                    .thread(&thread)
                    .await
                    .map_err(store_error)?
                    .ok_or_else(|| restate_error("the waiting turn's thread is not in the store"))?;
                let outstanding = approval::load(&self.store, &rec.record)
                    .await
                    .map_err(store_error)?;
                let calls = calls_of(&tool_uses);
                let refs: Vec<&ToolUse> = calls.iter().collect();
                let issued =
                    approval::reissue(&outstanding, thread.as_str(), ctx.run_id().as_str(), &refs, None)
                        .map_err(|e| tether_agui::AgUiError::agent("INTERNAL", e.to_string()))?;
                approval::save(&self.store, &rec.record, &issued)
                    .await
                    .map_err(store_error)?;
                self.store
                    .put_state(&rec.record, SHOWN, &json!(max_seq))
                    .await
                    .map_err(store_error)?;
                update(ctx, Update::Finished { waiting: true })?;
                let interrupts = tool_uses
                    .iter()
                    .filter_map(|w| {
                        issued
                            .iter()
                            .find(|(_, r)| r.tool_use_id == w.id)
                            .map(|(id, _)| approval::tool_interrupt(id, &w.id, &w.summary))
                    })
                    .collect();
                Ok(RunOutcome::Interrupt(interrupts))
            }
            Relayed::Ended(Ok(outcome)) => {
                mapper.close(ctx)?;
                update(ctx, Update::Finished { waiting: false })?;
                let stop = &outcome.stop_reason;
                if stop != &json!("stop") && stop != &json!("end_turn") && !stop.is_null() {
                    ctx.set_result(json!({"stopReason": stop}));
                }
                Ok(RunOutcome::Success)
            }
            Relayed::Ended(Err((409, _))) => Err(tether_agui::AgUiError::Cancelled),
            Relayed::Ended(Err((code, message))) => Err(tether_agui::AgUiError::agent(
                if code == 400 {
                    "INVALID_INPUT"
                } else {
                    "TURN_FAILED"
                },
                message,
            )),
        }
    }
}

/// The `idempotency-key` of a turn sent by a run: its parts percent-encoded (every byte but
/// ASCII letters, digits, `-`, `_` and `.`) and joined by `/`, so the key is a valid header value
/// whatever the client's ids hold, and two different (thread, message, run) never share a key.
fn idempotency_key(parts: &[&str]) -> String {
    let mut key = String::new();
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            key.push('/');
        }
        for b in p.bytes() {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.') {
                key.push(char::from(b));
            } else {
                key.push_str(&format!("%{b:02X}"));
            }
        }
    }
    key
}

fn lagged() -> tether_agui::AgUiError {
    tether_agui::AgUiError::agent(
        "STREAM_LAGGED",
        "this run's stream fell too far behind the turn; the turn goes on and its record is complete: \
         read it from GET /v1/threads/{thread}/messages",
    )
}

fn refused(thread: &ThreadId, resume: &[tether_agui::ResumeEntry]) -> tether_agui::AgUiError {
    let r = approval::Refusal::NotIssued {
        id: resume
            .first()
            .map(|r| r.interrupt_id.to_string())
            .unwrap_or_default(),
        thread: thread.as_str().to_owned(),
    };
    tether_agui::AgUiError::agent(r.code(), r.to_string())
}

/// Maps one of the turn's events to the client's stream, skipping durable events already shown
/// before the turn waited (a replayed turn sends them again).
async fn relay(
    ctx: &mut RunContext<Value>,
    mapper: &mut EventMapper,
    ev: &tether::Event,
    max_seq: &mut u64,
    shown: u64,
) -> tether_agui::AgUiResult<()> {
    if let Some(seq) = ev.seq {
        if seq <= shown {
            return Ok(());
        }
        *max_seq = (*max_seq).max(seq);
    }
    ctx.ready().await?;
    mapper.map(ctx, ev)?;
    update(ctx, Update::Event(ev))
}

fn update(ctx: &mut RunContext<Value>, u: Update<'_>) -> tether_agui::AgUiResult<()> {
    if crate::server::panel(ctx.state_mut(), u) {
        ctx.publish_state()?;
    }
    Ok(())
}

impl Agent for RestateAgent {
    type State = Value;

    async fn run(&self, ctx: &mut RunContext<Value>) -> tether_agui::AgUiResult<RunOutcome> {
        Box::pin(self.run_inner(ctx)).await
    }
}

#[cfg(test)]
mod tests {
    use super::idempotency_key;

    proptest::proptest! {
        /// Different (thread, message, run) never share a key, and every key is a valid header
        /// value.
        #[test]
        fn idempotency_keys_are_unambiguous(a in proptest::collection::vec("\\PC{0,6}|[/%.]{0,3}", 3), b in proptest::collection::vec("\\PC{0,6}|[/%.]{0,3}", 3)) {
            let ka = idempotency_key(&[&a[0], &a[1], &a[2]]);
            let kb = idempotency_key(&[&b[0], &b[1], &b[2]]);
            proptest::prop_assert_eq!(ka == kb, a == b);
            proptest::prop_assert!(reqwest::header::HeaderValue::from_str(&ka).is_ok());
        }
    }
}
