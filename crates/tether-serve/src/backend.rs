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
//! - ends a run only once Restate shows what the turn said of itself (its end, its wait): the
//!   turn says so before its last writes reach Restate, and a client told the run ended may
//!   read the record, or approve, through any node at once;
//! - cancels the invocation (`cancel`) when the client goes away or the run times out;
//! - lets a client whose stream broke (its node died) reconnect on any node: a run sending the
//!   running turn's message again follows that turn from the last event its messages hold
//!   (`reconnect_point`), rather than getting `THREAD_BUSY`.
//!
//! The record is the thread object's state in Restate (written by the turn, step by step,
//! inside its journal), or, with `[server] restate_postgres`, a PostgreSQL database every node
//! reaches (the turn writes it before each step; see `tether_restate::shared`): this agent and
//! the `GET /v1/threads/...` routes read it through the ingress or from the database
//! ([`tether_restate::RestateStore`], see [`thread_store`]), so every tether node in front of
//! the same Restate cluster answers the same. The approval bookkeeping this agent writes
//! (the interrupts it issued, the last sequence number it showed) goes to the thread's
//! `TetherThreadNotes` object, which never waits behind a suspended turn. The node's SQLite file
//! is only read: a thread recorded there before (by the default backend, or by this backend
//! before its record moved to Restate) is read from it and imported by its first turn.
//!
//! A turn whose invocation runs on another node's service is followed live: a turn carries its
//! sender's node URL ([`TurnRequest::announced`], shown by the thread's status while it runs), a
//! start or replay of a turn on another node announces that node's URL in the thread's notes
//! ([`LIVE_AT`]), and a relay elsewhere streams the turn's events from `GET {node}/v1/threads/{id}/live`
//! ([`RestateAgent::live_lines`]), authenticated by [`follow_credential`]; without it (no node
//! URL, a dead peer) the relay reads the record.
//!
//! Not yet: only one agent per server (one `TetherThread` service per deployment), only the
//! local loop (an OpenAI-compatible or embedded model), no front-end tools.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tether::{ThreadId, ThreadStore, ToolUse};
use tether_agui::approval::{self, Outstanding};
use tether_agui::thread::Update;
use tether_agui::{Agent, CheckError, EventMapper, Message, RunAgentInput, RunContext, RunOutcome};
use tether_restate::{
    LiveDrafts, LiveEvent, LivePart, SharedRecord, TetherThread, ThreadHub, TurnRequest, TurnSignal,
    WaitingToolUse, live_part,
};
use tether_sqlite::SqliteStore;
use tokio::sync::broadcast;

use crate::config::{AgentConfig, ServerSection};
use crate::providers::ProviderSpec;

/// State key (in the thread's record) of the highest durable event sequence number a run
/// showed before the turn began waiting: a turn replayed after a suspension sends its events
/// again, and the run that resumes it skips those.
const SHOWN: &str = "restate.shown_seq";

/// How soon a relay with no news reads what the turn waits for, the record, and where the turn
/// runs through the ingress: a turn whose invocation runs on another tether node's service sends
/// this process nothing (it is followed on that node, or read from the record here). Each quiet
/// period doubles the next, up to [`FOLLOW_MAX`]; news brings it back to this.
const FOLLOW_EVERY: Duration = Duration::from_millis(250);

/// How soon a relay first reads (see [`FOLLOW_EVERY`]): a turn running on this node's service
/// has shown itself by then (unless it waits behind others to start), one running on a peer has
/// been looked for ([`LOOK_EVERY`]).
const FOLLOW_FIRST: Duration = Duration::from_millis(500);

/// The pause after a relay's first read of whether Restate shows the wait for approvals the turn
/// said it began (read at once) when it did not; each read that does not doubles the next pause,
/// up to [`FOLLOW_EVERY`]. The turn's writes before its wait reach Restate a moment after it says
/// so (one message from its node's service, appended to Restate's log), so the first read or
/// the second mostly shows them. (A turn says it ended only once Restate holds its writes:
/// [`TurnSignal::Ended`], no read.)
const CONFIRM_FIRST: Duration = Duration::from_millis(5);

/// The longest pause between a quiet relay's reads (see [`FOLLOW_EVERY`]).
///
/// Why a backoff: every read is an invocation on the Restate server, and a relay is quiet
/// mostly while its turn waits to start behind others. At 1,000 concurrent runs, reading every
/// 250 ms (and looking for a peer every 40 ms, [`LOOK_EVERY`]) made the relays' polls outnumber
/// the turns' own invocations, and the turns started twice as late (the serve bench's first
/// text p99 7.5 s against 3.8 s with no polls, 2026-12-04).
const FOLLOW_MAX: Duration = Duration::from_secs(4);

/// How many events of its thread a relay may fall behind before it fails (`STREAM_LAGGED`). The
/// channels are per thread (`ThreadHub`), allocated whole while a relay of the thread runs.
const LIVE_CAPACITY: usize = 256;

/// How many turn signals of its thread a relay may fall behind (a turn sends one or two).
const SIGNAL_CAPACITY: usize = 16;

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
    store: Arc<dyn ThreadStore>,
    restate: Arc<tether_restate::RestateStore>,
    /// The node's SQLite file, where a thread not on Restate yet may have a record for its
    /// first turn to import (see [`TurnRequest::import`]).
    legacy: SqliteStore,
    live: ThreadHub<LiveEvent>,
    /// What the turns running here streamed so far of the messages in progress: shown first
    /// to a relay that begins following one mid-message.
    drafts: LiveDrafts,
    signals: ThreadHub<TurnSignal>,
    /// Told when a turn (an attempt of it) starts on this node's service: a relay of that thread
    /// here then needs not look for the node running it.
    attempts: ThreadHub<()>,
    run_timeout: Duration,
    /// This node's URL as its peers reach it (`[server] node_url`; set once the server is
    /// bound): a turn running on this node's service is announced under it.
    node: NodeUrl,
    /// The server's token, sent when following a turn on a peer (the nodes share it).
    token: Option<String>,
}

/// This node's URL as the other tether nodes reach it: set once the server is bound (unset:
/// turns here are not announced, see `[server] node_url`).
pub(crate) type NodeUrl = Arc<std::sync::OnceLock<String>>;

/// State key (in the thread's notes) of where a turn runs when that is not where its sender said
/// (`{"url": <node URL>, "invocation": <the turn's invocation id>}`, written at each start and
/// replay of a turn on another node than its sender's): a relay on another node streams the
/// turn's live events from it. The invocation id tells it from an earlier turn's note.
const LIVE_AT: &str = "restate.live_at";

/// How long a turn's start waits for its announcement (where it runs) to be written before it
/// goes on without (a peer then relays it from the record).
const ANNOUNCE_WAIT: Duration = Duration::from_secs(1);

/// How soon a relay that follows no peer yet looks where the turn runs, in its first seconds
/// (then with its reads, [`FOLLOW_EVERY`]); each look makes the pause before the next four times
/// as long, up to
/// [`LOOK_MAX`]. A turn that starts on this node's service tells its relays at once
/// ([`RestateAgent::attempts`]): they look no further.
const LOOK_EVERY: Duration = Duration::from_millis(40);

/// A relay's pause after a look or a read is at least this many times as long as the look or
/// read took, and its first look and read come at least this many times as long after it sent
/// its turn as the sending took: an ingress that answers slowly is busy (under load, mostly with
/// turns waiting to start), and polls that keep it busier delay every turn. Lone, the ingress
/// answers in milliseconds and the pauses are as scheduled.
const BUSY_FACTOR: u32 = 4;

/// The longest pause between a relay's looks (see [`LOOK_EVERY`]).
const LOOK_MAX: Duration = Duration::from_secs(1);

/// How long a relay looks for the peer running its turn every [`LOOK_EVERY`].
const LOOK_FOR: Duration = Duration::from_secs(3);

/// How long a relay waits before following again a peer whose stream ended.
const REFOLLOW_AFTER: Duration = Duration::from_secs(2);

/// The longest line a followed peer may send (an event with a large tool result).
const MAX_FOLLOW_LINE: usize = 16 << 20;

/// The header a node following a turn on a peer authenticates with instead of the token: see
/// [`follow_credential`].
pub const FOLLOW_HEADER: &str = "x-tether-follow";

/// The credential for following `thread`'s turn on a peer (`GET /v1/threads/{id}/live` with
/// header [`FOLLOW_HEADER`]): HMAC-SHA256 of the thread id under the nodes' shared token, in
/// lower-case hex. The token never leaves the node: the peer URL a follower
/// calls comes from the thread's notes, which whoever reaches the Restate ingress can write,
/// and a credential sent there opens only that thread's live route.
pub fn follow_credential(token: &str, thread: &str) -> String {
    use hmac::{KeyInit, Mac};
    let mut mac = match hmac::Hmac::<sha2::Sha256>::new_from_slice(token.as_bytes()) {
        Ok(m) => m,
        Err(_) => return String::new(), // HMAC takes keys of any length
    };
    mac.update(b"tether live\0");
    mac.update(thread.as_bytes());
    let mut out = String::with_capacity(64);
    for b in mac.finalize().into_bytes() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// One line of `GET /v1/threads/{id}/live` (newline-delimited JSON): what this node's service
/// sends of a turn running here, for a relay on another node.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum FollowLine {
    /// Sent first: the events from here on are all sent (what came before is in the record).
    Subscribed,
    /// An event of the turn: a durable one, or a live one without an offset.
    Event(tether::Event),
    /// A live delta of the turn and its offset in its part (see `tether_restate::LiveEvent`).
    Live {
        /// Where the delta starts in its part.
        offset: u64,
        /// The delta.
        event: tether::Event,
    },
    /// A change of the turn's state; `waiting` and `ended` end the stream.
    Signal(TurnSignal),
    /// The follower fell too far behind: the stream ends (the record has the durable events).
    Lagged,
}

/// A peer followed by a relay: its lines, read by a task aborted when this is dropped.
struct Follow {
    url: String,
    lines: tokio::sync::mpsc::Receiver<FollowLine>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Follow {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn bad_url(what: &str, url: &str, e: impl std::fmt::Display) -> String {
    format!("[server] {what} = {url:?} is not a URL: {e}")
}

/// The store the threads of `agents` are read through on this backend: Restate's ingress
/// (`restate_ingress`), or the shared record's database (`restate_postgres`), falling back to
/// the node's SQLite file `legacy` for threads not on Restate yet (read only).
pub(crate) fn thread_store<'a>(
    server: &ServerSection,
    agents: impl IntoIterator<Item = &'a String>,
    legacy: &SqliteStore,
    shared: Option<&SharedRecord>,
) -> Result<Arc<dyn ThreadStore>, String> {
    let ingress = server
        .restate_ingress
        .clone()
        .unwrap_or_else(|| "http://127.0.0.1:8080".into());
    let mut store = tether_restate::RestateStore::new(&ingress, agents.into_iter().cloned())
        .map_err(|e| e.to_string())?
        .with_legacy(Arc::new(legacy.clone()));
    if let Some(s) = shared {
        store = store.with_shared(s.clone());
    }
    Ok(Arc::new(store))
}

/// The shared record `[server] restate_postgres` names, connected (its tables created when
/// missing), with the password from the variable `restate_postgres_password_env` names; `None`
/// when the records stay in Restate's object state.
pub(crate) async fn shared_record(server: &ServerSection) -> Result<Option<SharedRecord>, String> {
    let Some(connection) = &server.restate_postgres else {
        if server.restate_postgres_password_env.is_some() {
            return Err("restate_postgres_password_env is set without restate_postgres".into());
        }
        return Ok(None);
    };
    if SharedRecord::holds_password(connection) {
        return Err(
            "restate_postgres holds a password: put it in an environment variable and name that \
             variable in restate_postgres_password_env"
                .into(),
        );
    }
    let connected = match &server.restate_postgres_password_env {
        Some(var) => {
            let password = std::env::var(var)
                .map_err(|_| format!("restate_postgres_password_env names {var:?}, which is not set"))?;
            SharedRecord::connect_with_password(connection, &password).await
        }
        None => SharedRecord::connect(connection).await,
    };
    connected.map(Some).map_err(|e| format!("restate_postgres: {e}"))
}

/// Starts the `TetherThread` service of agent `name` on its listener, registers it with the
/// admin API, and returns the agent that sends turns to it. `store` is the node's SQLite file
/// (threads from before Restate), `shared` the records' database if they are kept in one.
pub(crate) async fn start(
    name: &str,
    cfg: &AgentConfig,
    spec: ProviderSpec,
    (store, shared): (&SqliteStore, Option<SharedRecord>),
    server: &ServerSection,
    run_timeout: Duration,
    (node, token): (NodeUrl, Option<String>),
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
    // Per thread: a relay reads its own thread's events only.
    let live = ThreadHub::new(LIVE_CAPACITY);
    let drafts = LiveDrafts::new();
    let signals = ThreadHub::new(SIGNAL_CAPACITY);
    let attempts = ThreadHub::new(1);
    // One client of the threads on Restate, for this agent's reads and as its `ThreadStore`.
    let mut reads = tether_restate::RestateStore::new(&ingress_text, [name])
        .map_err(|e| e.to_string())?
        .with_legacy(Arc::new(store.clone()));
    if let Some(s) = &shared {
        reads = reads.with_shared(s.clone());
    }
    let restate = Arc::new(reads);
    let threads: Arc<dyn ThreadStore> = restate.clone();
    let mut thread = TetherThread::new(name, local.model.clone(), Arc::new(handler))
        .import(Arc::new(store.clone()))
        .live_hub(live.clone())
        .live_drafts(drafts.clone())
        .signal_hub(signals.clone())
        .on_attempt(announcer(node.clone(), threads.clone(), attempts.clone()));
    if !local.model_name.is_empty() {
        thread = thread.model_name(local.model_name.clone());
    }
    if let Some(s) = shared {
        thread = thread.shared_record(s);
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
    // The ingress this node sends turns to may learn of the deployment after the admin API
    // (another node of a cluster): runs are taken once it serves the service.
    tether_restate::wait_until_served(&ingress_text, Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    let agent = RestateAgent {
        name: name.to_owned(),
        model: local.model_name.clone(),
        ingress,
        http: reqwest::Client::new(),
        store: threads,
        restate,
        live,
        drafts,
        signals,
        attempts,
        run_timeout,
        node,
        token,
        legacy: store.clone(),
    };
    Ok((Arc::new(agent), endpoint))
}

/// At each start or replay of a turn on this node's service: tells this node's relays of the
/// thread (`attempts`: they need not look for it), and writes that the thread's turn runs here
/// ([`LIVE_AT`] = this node's URL and the turn's invocation), awaited for at most
/// [`ANNOUNCE_WAIT`] before the turn's first step, so that a relay on another node follows it
/// live. Without a node URL nothing is written, and nothing either when the turn's sender was
/// this node ([`TurnRequest::announced`], which the thread's status shows while the turn runs):
/// a turn mostly runs where it was sent, and under
/// 1,000 concurrent runs on one Restate node this write, one more exclusive invocation before
/// every turn's first step, made the first text come twice as late (the serve bench's first
/// text p99 3.1–3.3 s with it, 1.7 s without, 2026-12-05). What that skips: a turn replayed here
/// after it had moved to another node (a failover away and back) leaves the note naming that
/// node; a relay elsewhere then follows nothing live and shows the turn from its record, as it
/// does when any announcement fails.
///
/// (Written beside the turn instead, not awaited, the announcements competed with the turns'
/// own invocations at the ingress: under 1,000 concurrent runs the first text came no sooner,
/// and a relay elsewhere could look before the turn was announced.)
fn announcer(
    node: NodeUrl,
    store: Arc<dyn ThreadStore>,
    attempts: ThreadHub<()>,
) -> tether_restate::OnAttempt {
    Arc::new(move |attempt: tether_restate::Attempt| {
        let thread = attempt.thread;
        attempts.send(&thread, ());
        let node = node.clone();
        let store = store.clone();
        Box::pin(async move {
            let Some(url) = node.get() else { return };
            if attempt.announced.as_deref() == Some(url.as_str()) {
                return;
            }
            let at = json!({"url": url, "invocation": attempt.invocation});
            let put = store.put_state(thread.as_str(), LIVE_AT, &at);
            match tokio::time::timeout(ANNOUNCE_WAIT, put).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!("announcing where {} runs failed: {e}", thread.as_str()),
                Err(_) => tracing::debug!("announcing where {} runs took too long", thread.as_str()),
            }
        })
    })
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

/// A turn said it waits (in this process, or from the peer running it): its relay reads
/// Restate at once, then less often, until Restate shows the wait (see [`CONFIRM_FIRST`]).
fn confirm_wait(
    pause: &mut Duration,
    confirm: std::pin::Pin<&mut tokio::time::Sleep>,
    unconfirmed: &mut bool,
) {
    *pause = CONFIRM_FIRST;
    confirm.reset(tokio::time::Instant::now());
    *unconfirmed = true;
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
    /// (0: unreachable) and the body. Sent again for up to `tether_restate::store::FAILOVER`
    /// while it gets no answer or one saying the cluster cannot serve it yet (a Restate node
    /// behind the ingress address died, its partitions moving to the survivors).
    async fn call(
        &self,
        thread: &ThreadId,
        handler: &[&str],
        body: &Value,
        idempotency: Option<&str>,
    ) -> Result<Value, (u16, String)> {
        let started = tokio::time::Instant::now();
        let mut attempt = 0;
        loop {
            match self.call_once(thread, handler, body, idempotency).await {
                Err((status, _))
                    if tether_restate::store::retryable((status != 0).then_some(status))
                        && started.elapsed() < tether_restate::store::FAILOVER =>
                {
                    tokio::time::sleep(tether_restate::store::retry_pause(attempt)).await;
                    attempt += 1;
                }
                r => return r,
            }
        }
    }

    /// One attempt of [`RestateAgent::call`].
    async fn call_once(
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

    /// The invocation id of the thread's running turn, if any.
    async fn invocation(&self, thread: &ThreadId) -> tether_agui::AgUiResult<Option<String>> {
        let v = self
            .call(thread, &["invocation"], &Value::Null, None)
            .await
            .map_err(|(s, m)| restate_error(format!("asking for the running turn failed ({s}): {m}")))?;
        Ok(v.as_str().map(str::to_owned))
    }

    /// Waits for the turn `invocation` to end (from any node: Restate's attach) and returns its
    /// outcome, or its failure's status and message. Never resolves when the ingress cannot be
    /// reached: the relay then learns the end from this process's signals or its time limit.
    async fn attach(&self, invocation: &str) -> Result<tether_restate::TurnOutcome, (u16, String)> {
        let u = self.invocation_url(invocation, "attach");
        let Ok(resp) = self.http.get(u).send().await else {
            return std::future::pending().await;
        };
        let status = resp.status().as_u16();
        let Ok(text) = resp.text().await else {
            return std::future::pending().await;
        };
        if (200..300).contains(&status) {
            return serde_json::from_str(&text)
                .map_err(|e| (500, format!("the turn's outcome could not be read: {e}")));
        }
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_owned))
            .unwrap_or(text);
        Err((status, message.chars().take(2048).collect()))
    }

    /// `{ingress}/restate/invocation/{invocation}/{what}`.
    fn invocation_url(&self, invocation: &str, what: &str) -> reqwest::Url {
        let mut u = self.ingress.clone();
        if let Ok(mut seg) = u.path_segments_mut() {
            seg.pop_if_empty()
                .push("restate")
                .push("invocation")
                .push(invocation)
                .push(what);
        }
        u
    }

    /// Whether Restate says the turn `invocation`, which the thread still names as running, is
    /// over: a turn killed through Restate's admin API never cleared its mark, and without this
    /// its thread would refuse every new message as busy. Its output answers 470 while it runs
    /// (or is paused); anything else but a failure to answer (a result, 409 killed, 404 gone)
    /// means it is over. When Restate does not answer, the turn is taken as running: a second
    /// turn is never sent beside one that may run.
    async fn is_over(&self, invocation: &str) -> bool {
        let req = self
            .http
            .get(self.invocation_url(invocation, "output"))
            .timeout(Duration::from_secs(5));
        match req.send().await.map(|r| r.status().as_u16()) {
            Ok(s) => matches!(s, 200..=299 | 400..=499) && !matches!(s, 408 | 429 | 470),
            Err(_) => false,
        }
    }

    /// What the thread's turn waits for and the record's events after `after` (every page),
    /// in one call through the ingress when the news fits a page (see `tether_restate::Progress`;
    /// a relay reads it when its own process sent it nothing for a while).
    async fn progress(
        &self,
        thread: &ThreadId,
        after: u64,
    ) -> tether::Result<(Vec<WaitingToolUse>, Vec<tether::Event>)> {
        let first = self
            .restate
            .progress(thread.as_str(), after, tether_restate::record::MAX_PAGE)
            .await?;
        let mut events = first.events;
        if events.len() >= tether_restate::record::MAX_PAGE as usize {
            let from = events.last().and_then(|e| e.seq).unwrap_or(after);
            events.extend(self.record_after(thread, from).await?);
        }
        Ok((first.waiting, events))
    }

    /// The thread's durable events after `after`, read through the ingress.
    async fn record_after(&self, thread: &ThreadId, after: u64) -> tether::Result<Vec<tether::Event>> {
        let mut out: Vec<tether::Event> = Vec::new();
        loop {
            let from = out.last().and_then(|e| e.seq).unwrap_or(after);
            let page = self
                .restate
                .events_after(thread.as_str(), from, tether_restate::record::MAX_PAGE)
                .await?;
            let n = page.len();
            out.extend(page);
            if n < tether_restate::record::MAX_PAGE as usize {
                return Ok(out);
            }
        }
    }

    /// Sends one decision to the waiting turn. The turn waits for one decision at a time (a new
    /// awakeable after each), so an answer to a tool use the turn does not wait on yet is retried
    /// until it does.
    ///
    /// Each attempt carries an idempotency key (the thread, the run, the tool use, the answer and
    /// the attempt's number): when an attempt took effect but its answer was lost (the node
    /// behind the ingress died) and [`RestateAgent::call`] sends it again, Restate answers the
    /// repeat with the first attempt's result instead of running `approve` a second time, which
    /// would find the turn no longer waiting on that tool use (409) and fail a run whose approval
    /// happened. A 409 starts a new attempt with a new key (a key's result is kept, so repeating
    /// a refused attempt's key would be refused again). `what` names the decision in the key
    /// (`[tool use id, "approved"]`, `["cancel"]`).
    async fn decide(
        &self,
        thread: &ThreadId,
        run: &str,
        what: &[&str],
        decision: Value,
    ) -> tether_agui::AgUiResult<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        for attempt in 0u64.. {
            let attempt = attempt.to_string();
            let mut parts = vec![thread.as_str(), run];
            parts.extend_from_slice(what);
            parts.push(&attempt);
            let key = idempotency_key(&parts);
            match self.call(thread, &["approve"], &decision, Some(&key)).await {
                Ok(_) => return Ok(()),
                Err((409, _)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err((s, m)) => return Err(restate_error(format!("answering the turn failed ({s}): {m}"))),
            }
        }
        Err(restate_error(
            "answering the turn failed: out of attempts".to_owned(),
        ))
    }

    /// The body of `GET /v1/threads/{id}/live` on this node (see [`RestateAgent::may_follow`]): newline-delimited [`FollowLine`]s,
    /// `subscribed` first, then every event and signal of the thread's turn that runs on this
    /// node's service, until the turn waits or ends here (that signal is the last line), the
    /// reader falls behind (`lagged`) or goes away. A turn not running here sends nothing; the
    /// reader stops following it when the turn is announced elsewhere.
    /// Whether a request may follow `thread` here: no token is configured, or `given` is the
    /// thread's [`follow_credential`] (compared in constant time).
    pub(crate) fn may_follow(&self, thread: &ThreadId, given: Option<&str>) -> bool {
        let Some(token) = &self.token else { return true };
        let Some(given) = given else { return false };
        let want = follow_credential(token, thread.as_str());
        want.len() == given.len()
            && want
                .bytes()
                .zip(given.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }

    pub(crate) fn live_lines(&self, thread: ThreadId) -> tokio::sync::mpsc::Receiver<bytes::Bytes> {
        let mut events = self.live.subscribe(&thread);
        let mut signals = self.signals.subscribe(&thread);
        // Read after subscribing: what the channel brings again the follower drops by offset.
        let drafts = self.drafts.of(&thread);
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        tokio::spawn(async move {
            let send = |l: FollowLine| {
                let tx = tx.clone();
                async move {
                    let Ok(mut v) = serde_json::to_vec(&l) else {
                        return false;
                    };
                    v.push(b'\n');
                    tx.send(bytes::Bytes::from(v)).await.is_ok()
                }
            };
            if !send(FollowLine::Subscribed).await {
                return;
            }
            // The messages in progress so far, from their start: the follower shows them live
            // from the beginning rather than only once recorded.
            for (part, id, text) in drafts {
                if !send(FollowLine::Live {
                    offset: 0,
                    event: part.delta(id, text),
                })
                .await
                {
                    return;
                }
            }
            loop {
                let line = tokio::select! {
                    biased;
                    () = tx.closed() => return,
                    ev = events.recv() => match ev {
                        Ok(ev) if ev.thread == thread => follow_line(ev),
                        Ok(_) => continue,
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            send(FollowLine::Lagged).await;
                            return;
                        }
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                    sig = signals.recv() => match sig {
                        Ok(sig) if signal_thread(&sig) == Some(&thread) => {
                            // Every event sent before the signal is in the channel already.
                            loop {
                                match events.try_recv() {
                                    Ok(ev) if ev.thread == thread => {
                                        if !send(follow_line(ev)).await {
                                            return;
                                        }
                                    }
                                    Ok(_) => {}
                                    Err(broadcast::error::TryRecvError::Lagged(_)) => {
                                        send(FollowLine::Lagged).await;
                                        return;
                                    }
                                    Err(_) => break,
                                }
                            }
                            send(FollowLine::Signal(sig)).await;
                            return;
                        }
                        Ok(_) => continue,
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            send(FollowLine::Lagged).await;
                            return;
                        }
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                };
                if !send(line).await {
                    return;
                }
            }
        });
        rx
    }

    /// Follows the thread's running turn where it runs: where a start or replay of it on another
    /// node than its sender's announced it ([`LIVE_AT`], for this invocation), else where its
    /// sender said ([`tether_restate::ThreadStatus::announced`]); unless that is this node, the
    /// peer followed now, or the peer whose stream ended (`left`) less than [`REFOLLOW_AFTER`]
    /// ago.
    async fn look(
        &self,
        thread: &ThreadId,
        peer: &mut Option<Follow>,
        left: &Option<(String, tokio::time::Instant)>,
    ) {
        let (status, note) = tokio::join!(
            self.restate.status(thread),
            self.store.state(thread.as_str(), LIVE_AT)
        );
        let Ok(status) = status else { return };
        let Some(running) = status.invocation else { return };
        let moved = note
            .ok()
            .flatten()
            .filter(|n| n["invocation"].as_str() == Some(running.as_str()))
            .and_then(|n| n["url"].as_str().map(str::to_owned));
        let Some(url) = moved.or(status.announced) else {
            return;
        };
        let url = url.as_str();
        if self.node.get().is_some_and(|own| own == url)
            || peer.as_ref().is_some_and(|p| p.url == url)
            || left
                .as_ref()
                .is_some_and(|(u, at)| u == url && at.elapsed() < REFOLLOW_AFTER)
        {
            return;
        }
        *peer = self.follow(thread, url);
    }

    /// Streams `GET {url}/v1/threads/{thread}/live` (with the credential [`follow_credential`]
    /// derives from this server's token) into a channel;
    /// `None` when `url` is not an http(s) URL. The stream ends at the first line that is not a
    /// [`FollowLine`] or is longer than [`MAX_FOLLOW_LINE`].
    fn follow(&self, thread: &ThreadId, url: &str) -> Option<Follow> {
        let mut target = reqwest::Url::parse(url).ok()?;
        if !matches!(target.scheme(), "http" | "https") || target.cannot_be_a_base() {
            return None;
        }
        target
            .path_segments_mut()
            .ok()?
            .pop_if_empty()
            .extend(["v1", "threads", thread.as_str(), "live"]);
        let mut req = self.http.get(target);
        if let Some(t) = &self.token {
            req = req.header(FOLLOW_HEADER, follow_credential(t, thread.as_str()));
        }
        let (tx, lines) = tokio::sync::mpsc::channel(1024);
        let task = tokio::spawn(async move {
            let Ok(Ok(mut resp)) = tokio::time::timeout(Duration::from_secs(5), req.send()).await else {
                return;
            };
            if resp.status() != reqwest::StatusCode::OK {
                tracing::debug!("following a turn: {} answered {}", resp.url(), resp.status());
                return;
            }
            let mut buf: Vec<u8> = Vec::new();
            while let Ok(Some(chunk)) = resp.chunk().await {
                let scanned = buf.len();
                buf.extend_from_slice(&chunk);
                let mut start = 0;
                let mut from = scanned;
                while let Some(i) = buf[from..].iter().position(|b| *b == b'\n') {
                    let end = from + i;
                    let Ok(line) = serde_json::from_slice::<FollowLine>(&buf[start..end]) else {
                        return;
                    };
                    if tx.send(line).await.is_err() {
                        return;
                    }
                    start = end + 1;
                    from = start;
                }
                buf.drain(..start);
                if buf.len() > MAX_FOLLOW_LINE {
                    return;
                }
            }
        });
        Some(Follow {
            url: url.to_owned(),
            lines,
            task,
        })
    }

    /// Relays what the ended turn's record holds after what this run showed: read unless the
    /// run showed all of it (the turn says how long it is; a turn always adds to it, so 0 is a
    /// service that did not say).
    async fn rest_of_record(
        &self,
        ctx: &mut RunContext<Value>,
        mapper: &mut EventMapper,
        parts: &mut LiveParts,
        thread: &ThreadId,
        out: &Result<tether_restate::TurnOutcome, (u16, String)>,
        max_seq: &mut u64,
    ) -> tether_agui::AgUiResult<()> {
        if matches!(out, Ok(o) if o.length > 0 && o.length <= *max_seq) {
            return Ok(());
        }
        for ev in self.record_after(thread, *max_seq).await.map_err(store_error)? {
            relay(ctx, mapper, parts, &ev, None, max_seq).await?;
        }
        Ok(())
    }

    /// Checks a request's `resume[]` before the run starts (the admission's check, as the
    /// default backend's).
    pub(crate) async fn check_resume(&self, input: &RunAgentInput) -> Result<(), CheckError> {
        approval::check_resume(self.store.as_ref(), &self.name, input).await
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
        let mut events = self.live.subscribe(&thread);
        let mut signals = self.signals.subscribe(&thread);
        let mut attempts = self.attempts.subscribe(&thread);
        let mut mapper = EventMapper::new(ctx.input()).model(self.model.clone());
        let mut parts = LiveParts::default();
        update(
            ctx,
            Update::Started {
                agent: &self.name,
                thread: thread.as_str(),
            },
        )?;
        let user = ctx.input().messages.iter().rev().find_map(|m| match m {
            Message::User(u) => Some((u.id.to_string(), u.content.to_text())),
            _ => None,
        });
        // The thread, its record's length, whether a turn runs and the message the last turn was
        // sent with come in one read (`status`): each read is an invocation through the ingress,
        // and under load one waits behind the other turns' invocations.
        let status = self.restate.status(&thread).await.map_err(store_error)?;
        let existing = status.thread;
        if let Some(t) = &existing
            && t.agent != self.name
        {
            return Err(tether_agui::AgUiError::agent(
                "THREAD_AGENT_MISMATCH",
                format!("thread {} belongs to agent `{}`", thread.as_str(), t.agent),
            ));
        }
        // The calls this run answered (id and arguments' digest): a turn replayed after a
        // suspension signals it waits for them again, a model that reuses an id asks anew.
        let mut answered: HashSet<(String, String)> = HashSet::new();
        let shown: u64;
        // Which turn's end this run reports: the one it started (by run id), or, resuming, the
        // waiting one.
        let mut ours: Option<String> = None;
        // The turn this run relays (its end is read from Restate too: the turn may run on
        // another node's service).
        let invocation: Option<String>;
        // Set when this run reconnects to the running turn its message started: the sequence
        // number of the last event the client holds.
        // With whether the turn was running then.
        let mut reconnect: Option<(u64, bool)> = None;
        // How long Restate took to accept the turn this run sent (zero when it sent none): how
        // busy its ingress is, which the relay's first polls wait on (see `BUSY_FACTOR`).
        let mut send_took = Duration::ZERO;
        let resume = ctx.input().resume.clone();
        if !resume.is_empty() {
            let Some(rec) = &existing else {
                return Err(refused(&thread, &resume));
            };
            let mut outstanding = approval::load(self.store.as_ref(), &rec.record)
                .await
                .map_err(store_error)?;
            let waiting = self.waiting(&thread).await?;
            invocation = self.invocation(&thread).await?;
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
            approval::save(self.store.as_ref(), &rec.record, &outstanding)
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
                    let answer = if approved { "approved" } else { "denied" };
                    self.decide(
                        &thread,
                        ctx.run_id().as_str(),
                        &[id, answer],
                        json!({"decision": "answer", "tool_use_id": id, "approved": approved}),
                    )
                    .await?;
                    answered.insert((id.clone(), digest));
                }
            }
        } else {
            if let Some((id, _)) = &user {
                if let Some(rec) = &existing
                    && !approval::load(self.store.as_ref(), &rec.record)
                        .await
                        .map_err(store_error)?
                        .is_empty()
                {
                    // The user moved on while a turn waited for approval: that turn ends (its
                    // waiting calls answered as cancelled), and the new message is the next turn.
                    // (A turn killed through Restate's admin API left its wait marked: nothing
                    // to cancel, the next turn answers its calls.)
                    let live = match &status.invocation {
                        Some(inv) => !self.is_over(inv).await,
                        None => false,
                    };
                    if live && !self.waiting(&thread).await?.is_empty() {
                        self.decide(
                            &thread,
                            ctx.run_id().as_str(),
                            &["cancel"],
                            json!({"decision": "cancel"}),
                        )
                        .await?;
                    }
                    approval::save(self.store.as_ref(), &rec.record, &Outstanding::new())
                        .await
                        .map_err(store_error)?;
                } else {
                    // A client whose stream of this turn broke (the tether node relaying it died,
                    // or its connection did) sends its message again, on any node: it follows the
                    // turn from where its messages end. The turn may be running, or between
                    // attempts (its node lost: Restate sends it to another), or over: a message
                    // is checked against the record when a turn runs, when the client holds part
                    // of a turn, or when it is the message the thread's last turn was sent with.
                    // Any other message does not queue behind a running turn (as the default
                    // backend).
                    let running = match (&existing, &status.invocation) {
                        (Some(_), Some(inv)) => !self.is_over(inv).await,
                        _ => false,
                    };
                    // (The message is the turn's from its first step on. Sent again before that,
                    // on another node, it starts a second turn, which finds it answered; this run
                    // shows the first turn's events meanwhile, as it follows the thread.)
                    let resent = running
                        || holds_after_last_user(&ctx.input().messages)
                        || status.message.as_deref() == Some(id.as_str());
                    if resent {
                        let record = self.record_after(&thread, 0).await.map_err(store_error)?;
                        match reconnect_point(&record, id, &ctx.input().messages) {
                            Some(at) => reconnect = Some((at, running)),
                            None if running => {
                                return Err(tether_agui::AgUiError::agent(
                                    "THREAD_BUSY",
                                    format!(
                                        "another run is in progress on thread {}; wait for it to finish",
                                        approval::printable(thread.as_str())
                                    ),
                                ));
                            }
                            None => {}
                        }
                    }
                }
            }
            if let Some((at, true)) = reconnect {
                shown = at;
                invocation = self.invocation(&thread).await?;
            } else if let Some((id, text)) = user {
                // The turn's events follow the record as it is now (the record read through the
                // ingress starts there).
                let mut base = status.length;
                if base == 0
                    && let Some(rec) = &existing
                {
                    // A thread not on Restate yet: its turn imports the node's record first.
                    base = self.store.load(&rec.record).await.map_err(store_error)?.len() as u64;
                }
                // A reconnect to a turn not running now: the message is sent again (the turn goes
                // on with what it left, or finds its message answered), and the run shows what
                // the client lacks from where its messages end.
                shown = reconnect.map_or(base, |(at, _)| at);
                let run = ctx.run_id().as_str().to_owned();
                // The turn is told this node as where it runs (it mostly does): it shows that in
                // its status, and skips writing it (see `announcer`). No write before the send.
                let announced = match reconnect {
                    None => self.node.get().cloned(),
                    Some(_) => None,
                };
                // The turn's time is this node's clock, and a new thread's turn is told whether this
                // node holds an older record of it: a turn sent with both reads neither in a step
                // of its own (one journaled step fewer before the first text). A record held only
                // by another node's file is not imported then (it would be only by a turn that
                // happened to run there).
                let mut req = TurnRequest::new(id.clone(), text)
                    .run(run.clone())
                    .announced(announced.clone())
                    .clock_now();
                if existing.is_none() {
                    let held = self.legacy.thread(&thread).await.map_err(store_error)?;
                    req = req.import(held.is_some());
                }
                let req = serde_json::to_value(req).map_err(|e| restate_error(e.to_string()))?;
                // Keyed by run too: a retried request of this run starts no second turn, while the
                // same message sent again by a new run (after a failed turn) is a new turn, which
                // goes on with what the failed one left.
                let key = idempotency_key(&[thread.as_str(), &id, &run]);
                let began = tokio::time::Instant::now();
                let sent = self
                    .call(&thread, &["turn", "send"], &req, Some(&key))
                    .await
                    .map_err(|(s, m)| restate_error(format!("sending the turn failed ({s}): {m}")))?;
                send_took = began.elapsed();
                invocation = sent["invocationId"].as_str().map(str::to_owned);
                ours = Some(run);
            } else {
                update(ctx, Update::Finished { waiting: false })?;
                return Ok(RunOutcome::Success);
            }
        }

        // Relay until the turn waits or ends, the client goes away or the run times out.
        let client_gone = ctx.cancel_token().clone();
        let timeout = tokio::time::sleep(self.run_timeout);
        tokio::pin!(timeout);
        let mut max_seq = shown;
        if matches!(reconnect, Some((_, true))) {
            // Reconnected to a running turn: what the client lacks of the record, then the
            // messages in progress here from their start (the live channel goes on from there).
            for ev in self.record_after(&thread, max_seq).await.map_err(store_error)? {
                relay(ctx, &mut mapper, &mut parts, &ev, None, &mut max_seq).await?;
            }
            for (part, id, text) in self.drafts.of(&thread) {
                relay(
                    ctx,
                    &mut mapper,
                    &mut parts,
                    &part.delta(id, text),
                    Some(0),
                    &mut max_seq,
                )
                .await?;
            }
        }
        let attached = async {
            match &invocation {
                Some(id) => self.attach(id).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(attached);
        let mut follow_pause = FOLLOW_EVERY;
        // A turn waits to start behind the turns Restate took before it: on a busy ingress
        // (slow to accept this one) the first read comes later, as every later poll does.
        let follow = tokio::time::sleep(FOLLOW_FIRST.max(send_took * BUSY_FACTOR));
        tokio::pin!(follow);
        // Whether this process sent nothing of the turn since the last tick.
        let mut quiet = true;
        // The peer node whose service runs the turn, followed live (its token deltas too); and
        // how soon this relay looks for it at first.
        let mut peer: Option<Follow> = None;
        // The peer whose stream ended last, and when: not followed again at once.
        let mut left: Option<(String, tokio::time::Instant)> = None;
        let looking = tokio::time::Instant::now();
        // The first look after one period: a turn running here has sent its first event by then
        // (its user message), and this node need not ask where the turn runs.
        let mut look_pause = LOOK_EVERY.max(send_took * BUSY_FACTOR);
        let look = tokio::time::sleep(look_pause);
        tokio::pin!(look);
        // Whether the turn showed itself here (it started on this node's service, or its events
        // came from this process): then no peer is looked for until this process goes quiet.
        let mut here = false;
        // Whether the turn said (in this process, or from the peer running it) it waits for
        // approvals that Restate does not show yet. The turn says it before its writes reach
        // Restate (a handler's writes go with its next step), and a client told the run waits
        // approves at once, through any node: the run waits only on Restate's word, read until
        // it shows the wait (see [`CONFIRM_FIRST`]). Its end needs no read: a turn says it
        // ended once Restate holds its writes.
        let mut unconfirmed = false;
        let mut confirm_pause = CONFIRM_FIRST;
        let confirm = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(confirm);
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
                    Ok(sig) if signal_thread(&sig) == Some(&thread) => {
                        quiet = false;
                        match judge(sig, &thread, &answered, ours.as_ref()) {
                            // A turn says it ended once Restate holds all it wrote.
                            Some(r @ Relayed::Ended(_)) => break r,
                            Some(Relayed::Waiting(_)) => {
                                confirm_wait(&mut confirm_pause, confirm.as_mut(), &mut unconfirmed);
                            }
                            None => {}
                        }
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => return Err(lagged()),
                    Err(broadcast::error::RecvError::Closed) => return Err(restate_error("the service stopped")),
                },
                ev = events.recv() => match ev {
                    Ok(ev) if ev.thread == thread => {
                        quiet = false;
                        here = true;
                        relay(ctx, &mut mapper, &mut parts, &ev.event, ev.offset, &mut max_seq).await?
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => return Err(lagged()),
                    Err(broadcast::error::RecvError::Closed) => return Err(restate_error("the service stopped")),
                },
                line = next_line(&mut peer) => match line {
                    // The peer sends everything from here on: what came before is in the record.
                    Some(FollowLine::Subscribed) => {
                        quiet = false;
                        for ev in self.record_after(&thread, max_seq).await.map_err(store_error)? {
                            relay(ctx, &mut mapper, &mut parts, &ev, None, &mut max_seq).await?;
                        }
                    }
                    Some(FollowLine::Event(ev)) => {
                        quiet = false;
                        relay(ctx, &mut mapper, &mut parts, &ev, None, &mut max_seq).await?;
                    }
                    Some(FollowLine::Live { event, offset }) => {
                        quiet = false;
                        relay(ctx, &mut mapper, &mut parts, &event, Some(offset), &mut max_seq).await?;
                    }
                    Some(FollowLine::Signal(sig)) => {
                        quiet = false;
                        match judge(sig, &thread, &answered, ours.as_ref()) {
                            Some(r @ Relayed::Ended(_)) => break r,
                            Some(Relayed::Waiting(_)) => {
                                confirm_wait(&mut confirm_pause, confirm.as_mut(), &mut unconfirmed);
                            }
                            None => {}
                        }
                    }
                    // The peer's stream ended (its turn moved, the peer died, this relay lagged):
                    // the ticks below read the record, and look where the turn runs now.
                    Some(FollowLine::Lagged) | None => {
                        left = peer.take().map(|p| (p.url.clone(), tokio::time::Instant::now()));
                    }
                },
                _ = attempts.recv(), if !here => here = true,
                _ = &mut look, if peer.is_none() && !here && looking.elapsed() < LOOK_FOR => {
                    let began = tokio::time::Instant::now();
                    self.look(&thread, &mut peer, &left).await;
                    look_pause = (look_pause * 4).min(LOOK_MAX).max(began.elapsed() * BUSY_FACTOR);
                    look.as_mut().reset(tokio::time::Instant::now() + look_pause);
                }
                // Restate shows the wait once it holds the approvals the turn waits for
                // (written after every event before them).
                _ = &mut confirm, if unconfirmed => {
                    if let Ok((waiting, more)) = self.progress(&thread, max_seq).await {
                        for ev in more {
                            relay(ctx, &mut mapper, &mut parts, &ev, None, &mut max_seq).await?;
                        }
                        if waits_anew(&waiting, &answered) {
                            break Relayed::Waiting(waiting);
                        }
                    }
                    confirm_pause = (confirm_pause * 2).min(FOLLOW_EVERY);
                    confirm.as_mut().reset(tokio::time::Instant::now() + confirm_pause);
                }
                // The turn ended (seen from Restate): its record is complete (read below).
                out = &mut attached => break Relayed::Ended(out),
                _ = &mut follow => {
                    // News since the last tick: no read, the next tick one period on. None: read
                    // now, and the next tick later.
                    let was_quiet = std::mem::replace(&mut quiet, true);
                    follow_pause = if was_quiet {
                        (follow_pause * 2).min(FOLLOW_MAX)
                    } else {
                        FOLLOW_EVERY
                    };
                    follow.as_mut().reset(tokio::time::Instant::now() + follow_pause);
                    if !was_quiet {
                        continue;
                    }
                    let began = tokio::time::Instant::now();
                    // Where the turn runs may have changed (a replay on another node); and,
                    // nothing from this process, the turn may run on another node's service:
                    // what it waits for and the record after what was shown, in one read.
                    let (_, read) = tokio::join!(
                        self.look(&thread, &mut peer, &left),
                        self.progress(&thread, max_seq)
                    );
                    let Ok((waiting, more)) = read else { continue };
                    if !more.is_empty() {
                        // The turn goes on elsewhere: read again soon.
                        follow_pause = FOLLOW_EVERY;
                    }
                    follow_pause = follow_pause.max(began.elapsed() * BUSY_FACTOR);
                    follow.as_mut().reset(tokio::time::Instant::now() + follow_pause);
                    for ev in more {
                        relay(ctx, &mut mapper, &mut parts, &ev, None, &mut max_seq).await?;
                    }
                    if waits_anew(&waiting, &answered) {
                        break Relayed::Waiting(waiting);
                    }
                }
            }
        };
        // Every event sent before the signal is in the channel already.
        loop {
            match events.try_recv() {
                Ok(ev) if ev.thread == thread => {
                    relay(ctx, &mut mapper, &mut parts, &ev.event, ev.offset, &mut max_seq).await?
                }
                Ok(_) => {}
                Err(broadcast::error::TryRecvError::Lagged(_)) => return Err(lagged()),
                Err(_) => break,
            }
        }
        if let Relayed::Ended(out) = &relayed {
            self.rest_of_record(ctx, &mut mapper, &mut parts, &thread, out, &mut max_seq)
                .await?;
        }
        match relayed {
            Relayed::Waiting(tool_uses) => {
                mapper.close(ctx)?;
                // The record key on Restate is the thread id.
                let record = thread.as_str();
                let outstanding = approval::load(self.store.as_ref(), record)
                    .await
                    .map_err(store_error)?;
                let calls = calls_of(&tool_uses);
                let refs: Vec<&ToolUse> = calls.iter().collect();
                let issued =
                    approval::reissue(&outstanding, thread.as_str(), ctx.run_id().as_str(), &refs, None)
                        .map_err(|e| tether_agui::AgUiError::agent("INTERNAL", e.to_string()))?;
                approval::save(self.store.as_ref(), record, &issued)
                    .await
                    .map_err(store_error)?;
                self.store
                    .put_state(record, SHOWN, &json!(max_seq))
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

/// Whether the client's messages hold anything after its last user message: part of the turn
/// that message started (a client re-sending it after its stream broke), not a new message.
fn holds_after_last_user(messages: &[Message]) -> bool {
    messages
        .iter()
        .rposition(|m| matches!(m, Message::User(_)))
        .is_some_and(|i| i + 1 < messages.len())
}

/// The thread a signal is about.
fn signal_thread(sig: &TurnSignal) -> Option<&ThreadId> {
    match sig {
        TurnSignal::Waiting { thread, .. } | TurnSignal::Ended { thread, .. } => Some(thread),
        _ => None,
    }
}

/// Whether the turn waits for a decision on a tool use this run has not answered (a turn
/// replayed after a suspension waits again for those it answered; a model that reuses an id
/// with other arguments asks anew).
fn waits_anew(waiting: &[WaitingToolUse], answered: &HashSet<(String, String)>) -> bool {
    waiting
        .iter()
        .any(|u| !answered.contains(&(u.id.clone(), approval::digest(&u.input))))
}

/// What a signal about `thread` means for a relay: the turn waits for a decision this run has
/// not given, or the turn this run reports (`ours`; any, when `None`) ended.
fn judge(
    sig: TurnSignal,
    thread: &ThreadId,
    answered: &HashSet<(String, String)>,
    ours: Option<&String>,
) -> Option<Relayed> {
    match sig {
        TurnSignal::Waiting { thread: t, tool_uses } if &t == thread => {
            waits_anew(&tool_uses, answered).then_some(Relayed::Waiting(tool_uses))
        }
        TurnSignal::Ended {
            thread: t,
            run,
            outcome,
            ..
        } if &t == thread => ours.is_none_or(|m| *m == run).then_some(Relayed::Ended(outcome)),
        _ => None,
    }
}

/// The next line of the followed peer (pending forever when none is followed).
async fn next_line(peer: &mut Option<Follow>) -> Option<FollowLine> {
    match peer {
        Some(p) => p.lines.recv().await,
        None => std::future::pending().await,
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

/// Where a client reconnecting to a running turn left it: the sequence number of the last event
/// of the thread's `record` that its `messages` hold (an assistant message by its id or its tool
/// calls, a tool call, a tool result by its call's id), at least its own message's; `None` when
/// `message_id` is not the record's last user message (a new message, not a reconnect).
///
/// An AG-UI client sends the messages it holds with every run, so this is where its stream broke,
/// whichever node it was on: the reconnected run relays what follows, nothing twice.
fn reconnect_point(record: &[tether::Event], message_id: &str, messages: &[Message]) -> Option<u64> {
    let user = record.iter().rev().find_map(|e| match &e.kind {
        tether::EventKind::Message {
            role: tether::Role::User,
            message_id: m,
            ..
        } => Some((e.seq, m)),
        _ => None,
    })?;
    let (Some(user_seq), m) = user else {
        return None;
    };
    if m != message_id {
        return None;
    }
    let mut ids = HashSet::new();
    let mut calls = HashSet::new();
    let mut results = HashSet::new();
    for m in messages {
        ids.insert(m.id().as_str());
        match m {
            Message::Assistant(a) => calls.extend(a.tool_calls.iter().flatten().map(|c| c.id.as_str())),
            Message::Tool(t) => {
                results.insert(t.tool_call_id.as_str());
            }
            _ => {}
        }
    }
    let held = |e: &tether::Event| match &e.kind {
        tether::EventKind::Message {
            role: tether::Role::Assistant,
            message_id,
            tool_uses,
            ..
        } => ids.contains(message_id.as_str()) || tool_uses.iter().any(|u| calls.contains(u.id.as_str())),
        tether::EventKind::ToolCall { tool_use, .. } => calls.contains(tool_use.id.as_str()),
        tether::EventKind::ToolResult { result } => results.contains(result.tool_use_id.as_str()),
        _ => false,
    };
    Some(
        record
            .iter()
            .filter(|e| held(e))
            .filter_map(|e| e.seq)
            .filter(|&s| s > user_seq)
            .max()
            .unwrap_or(user_seq),
    )
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

/// The line of `GET /v1/threads/{id}/live` for one of the turn's events.
fn follow_line(ev: LiveEvent) -> FollowLine {
    match ev.offset {
        Some(offset) => FollowLine::Live {
            offset,
            event: ev.event,
        },
        None => FollowLine::Event(ev.event),
    }
}

/// What a run showed of each part the turn streams live (a message's text or reasoning, a
/// call's arguments), by the parts' offsets ([`LiveEvent::offset`]): so that each character
/// reaches the client once, whatever mix of sources brings it.
///
/// A relay gets the same part from several places: this process's live channel, a peer's live
/// stream, the record (the whole message, read when the relay goes quiet, when it starts
/// following a peer, or when the turn ends: it may arrive before the rest of the live text), and
/// a model step that runs again in a replayed turn (the same part from its start). A delta is
/// shown only where it continues what the client holds: a repeat is dropped, an overlap cut,
/// and a part whose beginning this run missed (it began following mid-message, or a delta had
/// no offset) is not shown live at all: the record's message shows it whole (or, when the client
/// holds its beginning, goes on from there: `EventMapper`).
#[derive(Default)]
struct LiveParts {
    parts: std::collections::HashMap<(LivePart, String), LivePartShown>,
}

#[derive(Default)]
struct LivePartShown {
    /// What the client was shown of the part, from its start.
    text: String,
    /// No more of the part is shown live (its beginning was missed, or a delta disagreed with
    /// what was shown).
    muted: bool,
}

/// What of a live delta the client is shown.
#[derive(Debug, PartialEq)]
enum Admit {
    /// Not a delta: shown as it is.
    Event,
    /// Nothing.
    Nothing,
    /// The delta, from this byte on (0: all of it).
    From(usize),
}

impl LiveParts {
    /// What the client is shown of `ev` at `offset` (see the type's documentation), counting it as
    /// shown; a durable message or call ends the tracking of its parts.
    fn admit(&mut self, ev: &tether::Event, offset: Option<u64>) -> Admit {
        let Some((part, id, delta)) = live_part(&ev.kind) else {
            self.forget(ev);
            return Admit::Event;
        };
        let p = self.parts.entry((part, id.to_owned())).or_default();
        if p.muted {
            return Admit::Nothing;
        }
        let held = p.text.len();
        let start = match offset.and_then(|o| usize::try_from(o).ok()) {
            Some(o) if o <= held => o,
            // Missed the part's beginning, or no offset to tell.
            _ => {
                p.muted = true;
                return Admit::Nothing;
            }
        };
        let repeated = (held - start).min(delta.len());
        if !delta.is_char_boundary(repeated)
            || p.text.as_bytes().get(start..start + repeated) != delta.as_bytes().get(..repeated)
        {
            // Not what the client holds (a step that ran again said something else): the record
            // decides.
            p.muted = true;
            return Admit::Nothing;
        }
        if repeated == delta.len() {
            return Admit::Nothing;
        }
        p.text.push_str(&delta[repeated..]);
        Admit::From(repeated)
    }

    fn forget(&mut self, ev: &tether::Event) {
        if !ev.is_durable() {
            return;
        }
        match &ev.kind {
            tether::EventKind::Message {
                message_id,
                tool_uses,
                ..
            } => {
                self.parts.remove(&(LivePart::Text, message_id.clone()));
                self.parts.remove(&(LivePart::Reasoning, message_id.clone()));
                for u in tool_uses {
                    self.parts.remove(&(LivePart::Arguments, u.id.clone()));
                }
            }
            tether::EventKind::ToolCall { tool_use, .. } => {
                self.parts.remove(&(LivePart::Arguments, tool_use.id.clone()));
            }
            _ => {}
        }
    }
}

/// `ev`, a live delta, with its text from byte `from` on.
fn delta_from(ev: &tether::Event, from: usize) -> tether::Event {
    let mut out = ev.clone();
    match &mut out.kind {
        tether::EventKind::TextDelta { delta, .. }
        | tether::EventKind::ReasoningDelta { delta, .. }
        | tether::EventKind::ToolCallArgs { delta, .. } => {
            delta.drain(..from.min(delta.len()));
        }
        _ => {}
    }
    out
}

/// Maps one of the turn's events to the client's stream, skipping durable events already shown
/// (`max_seq`: before the turn waited, or by this run; a replayed turn sends them again, and the
/// record read through the ingress holds those this process sent too) and live text the client
/// holds or cannot be shown in order (`parts`, by the delta's `offset`). Every event a relay
/// shows goes through here.
async fn relay(
    ctx: &mut RunContext<Value>,
    mapper: &mut EventMapper,
    parts: &mut LiveParts,
    ev: &tether::Event,
    offset: Option<u64>,
    max_seq: &mut u64,
) -> tether_agui::AgUiResult<()> {
    if let Some(seq) = ev.seq {
        if seq <= *max_seq {
            parts.forget(ev);
            return Ok(());
        }
        *max_seq = seq;
    }
    let cut;
    let ev = match parts.admit(ev, offset) {
        Admit::Nothing => return Ok(()),
        Admit::Event | Admit::From(0) => ev,
        Admit::From(n) => {
            cut = delta_from(ev, n);
            &cut
        }
    };
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
    use super::{
        LIVE_AT, LiveParts, announcer, holds_after_last_user, idempotency_key, reconnect_point, relay,
    };
    use serde_json::{Value, json};
    use std::sync::Arc;
    use tether::{Event, EventKind, Role, ToolResult, ToolUse};
    use tether_agui::{
        AgUiResult, Agent, EventMapper, Message, RunAgentInput, RunContext, RunOptions, RunOutcome, Verifier,
    };

    /// The shared record's settings are checked before any connection: a password in the
    /// connection string, a password variable without a database or one that is not set are
    /// each refused with what to do; no database named keeps the records on Restate.
    #[tokio::test]
    async fn the_shared_records_settings_are_checked() {
        use crate::config::ServerSection;
        let mut s = ServerSection::default();
        assert!(super::shared_record(&s).await.expect("no database").is_none());
        s.restate_postgres_password_env = Some("TETHER_TEST_PG_PASSWORD_UNSET".into());
        let e = super::shared_record(&s)
            .await
            .expect_err("a variable without a database");
        assert!(e.contains("without restate_postgres"), "{e}");
        s.restate_postgres = Some("host=127.0.0.1 user=tether password=hunter2".into());
        s.restate_postgres_password_env = None;
        let e = super::shared_record(&s)
            .await
            .expect_err("a password in the file");
        assert!(
            e.contains("restate_postgres_password_env") && !e.contains("hunter2"),
            "{e}"
        );
        s.restate_postgres = Some("postgresql://tether:hunter2@127.0.0.1/tether".into());
        let e = super::shared_record(&s).await.expect_err("a password in a URL");
        assert!(!e.contains("hunter2"), "{e}");
        s.restate_postgres = Some("host=127.0.0.1 user=tether".into());
        s.restate_postgres_password_env = Some("TETHER_TEST_PG_PASSWORD_UNSET".into());
        let e = super::shared_record(&s).await.expect_err("an unset variable");
        assert!(
            e.contains("TETHER_TEST_PG_PASSWORD_UNSET") && e.contains("not set"),
            "{e}"
        );
    }

    /// A turn starting on this node writes where it runs, tagged with its invocation, unless its
    /// sender (this node) said so in the turn (which the thread's status shows); a turn sent
    /// from another node, or sent without saying, writes it. This node's relays of the thread
    /// hear of every start.
    #[tokio::test]
    async fn a_turn_announces_where_it_runs_unless_its_sender_here_did() {
        use tether::EventStore;
        use tether_restate::{Attempt, ThreadHub};
        let here = "http://10.0.0.1:8787".to_owned();
        let node: super::NodeUrl = Arc::new(std::sync::OnceLock::new());
        node.set(here.clone()).expect("a URL");
        let store = Arc::new(tether::MemoryStore::default());
        let attempts = ThreadHub::new(1);
        let announce = announcer(node, store.clone(), attempts.clone());
        let thread = |t: &str| tether::ThreadId::new(t).expect("an id");
        let mut heard = attempts.subscribe(&thread("t1"));
        announce(Attempt::new(thread("t1"), Some(here.clone()))).await;
        assert_eq!(
            store.state("t1", LIVE_AT).await.expect("a read"),
            None,
            "the sender here wrote it"
        );
        assert!(heard.try_recv().is_ok(), "the relays here heard of the start");
        announce(Attempt::new(thread("t2"), Some("http://10.0.0.2:8787".into())).invocation("inv-2")).await;
        announce(Attempt::new(thread("t3"), None).invocation("inv-3")).await;
        for (t, inv) in [("t2", "inv-2"), ("t3", "inv-3")] {
            assert_eq!(
                store.state(t, LIVE_AT).await.expect("a read"),
                Some(json!({"url": here, "invocation": inv})),
                "{t}"
            );
        }
    }

    /// A relay fed a fixed list of (event, offset), as the sources of `run_inner` bring them.
    struct Relay(Vec<(Event, Option<u64>)>);

    impl Agent for Relay {
        type State = Value;
        async fn run(&self, ctx: &mut RunContext<Value>) -> AgUiResult<RunOutcome> {
            let mut mapper = EventMapper::new(ctx.input());
            let mut parts = LiveParts::default();
            let mut max_seq = 0;
            for (ev, offset) in &self.0 {
                relay(ctx, &mut mapper, &mut parts, ev, *offset, &mut max_seq).await?;
            }
            mapper.close(ctx)?;
            Ok(RunOutcome::Success)
        }
    }

    /// The AG-UI events a relay sends for `feed` (checked by the verifier).
    async fn relayed(feed: Vec<(Event, Option<u64>)>) -> Vec<Value> {
        let input = RunAgentInput::new("t1", "r1");
        let mut v = Verifier::for_input(&input);
        let out = tether_agui::run_agent(Arc::new(Relay(feed)), input, RunOptions::default())
            .collect_all()
            .await;
        for e in &out {
            if let Err(err) = v.observe(e) {
                panic!("{e:?} rejected: {err} in {out:#?}");
            }
        }
        out.iter()
            .map(|e| serde_json::to_value(e).unwrap_or_default())
            .collect()
    }

    fn delta(id: &str, text: &str, offset: u64) -> (Event, Option<u64>) {
        let kind = EventKind::TextDelta {
            message_id: id.into(),
            delta: text.into(),
        };
        (Event::new("", "test", json!(null), kind), Some(offset))
    }

    fn recorded(seq: u64, id: &str, text: &str, calls: Vec<ToolUse>) -> (Event, Option<u64>) {
        let kind = EventKind::Message {
            message_id: id.into(),
            role: Role::Assistant,
            text: text.into(),
            reasoning: None,
            tool_uses: calls,
        };
        (
            Event::new(format!("e{seq}"), "test", json!(null), kind).with_seq(seq),
            None,
        )
    }

    /// The text the client got (every `TEXT_MESSAGE_CONTENT`, in order), and how many
    /// `TEXT_MESSAGE_START` and `MESSAGES_SNAPSHOT` it got.
    fn shown(events: &[Value]) -> (String, usize, usize) {
        let count = |t: &str| events.iter().filter(|e| e["type"] == t).count();
        let text = events
            .iter()
            .filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT")
            .filter_map(|e| e["delta"].as_str())
            .collect();
        (text, count("TEXT_MESSAGE_START"), count("MESSAGES_SNAPSHOT"))
    }

    /// The serve bench's tool-heavy load on Restate (issue 18): a relay that went quiet reads the
    /// record, and the record's message arrives while the rest of its live text still waits in
    /// the channel. The client gets every character once: the beginning live, the rest from the
    /// record, nothing withdrawn, nothing sent again (before: the message was withdrawn and sent
    /// whole, its beginning counted twice).
    #[tokio::test]
    async fn the_record_arriving_before_the_rest_of_the_live_text_shows_each_character_once() {
        let ev = relayed(vec![
            delta("a1", "Hel", 0),
            delta("a1", "lo", 3),
            recorded(2, "a1", "Hello, world", vec![]),
            delta("a1", ", wor", 5),
            delta("a1", "ld", 10),
            // The live channel's copy of the record's message.
            recorded(2, "a1", "Hello, world", vec![]),
        ])
        .await;
        assert_eq!(shown(&ev), ("Hello, world".into(), 1, 0), "{ev:#?}");
    }

    /// A relay that begins following a turn mid-message (a peer's stream, a reconnect) never
    /// shows the part it got as if it were the message: the message is shown whole, once.
    #[tokio::test]
    async fn a_message_whose_beginning_was_missed_is_shown_whole_once() {
        let ev = relayed(vec![
            delta("a1", ", wor", 5),
            delta("a1", "ld", 10),
            recorded(2, "a1", "Hello, world", vec![]),
        ])
        .await;
        assert_eq!(shown(&ev), ("Hello, world".into(), 1, 0), "{ev:#?}");
        // A delta without an offset (an older peer) counts as a missed beginning.
        let (e, _) = delta("a1", "Hello", 0);
        let ev = relayed(vec![(e, None), recorded(2, "a1", "Hello, world", vec![])]).await;
        assert_eq!(shown(&ev), ("Hello, world".into(), 1, 0), "{ev:#?}");
    }

    /// A model step that runs again (a replayed turn) streams its message from the start: what
    /// the client holds is not sent again, and the rest follows once.
    #[tokio::test]
    async fn a_step_streamed_again_continues_where_the_client_is() {
        let ev = relayed(vec![
            delta("a1", "Hello", 0),
            delta("a1", ", wo", 5),
            delta("a1", "Hel", 0),
            delta("a1", "lo, world", 3),
            recorded(2, "a1", "Hello, world", vec![]),
        ])
        .await;
        assert_eq!(shown(&ev), ("Hello, world".into(), 1, 0), "{ev:#?}");
        // The step said something else the second time: no more of it is shown live, and the
        // record's message replaces what the client holds.
        let ev = relayed(vec![
            delta("a1", "Hello", 0),
            delta("a1", "Hi there", 0),
            recorded(2, "a1", "Hi there", vec![]),
        ])
        .await;
        let (text, _, snapshots) = shown(&ev);
        assert_eq!((text.as_str(), snapshots), ("HelloHi there", 1), "{ev:#?}");
    }

    /// A call's arguments, like text: the record's call arriving before the rest of the live
    /// arguments goes on from what the client holds.
    #[tokio::test]
    async fn arguments_cut_by_the_record_arrive_once() {
        let start = EventKind::ToolCallStart {
            tool_use_id: "c1".into(),
            name: "read_file".into(),
            message_id: Some("a1".into()),
        };
        let args = |d: &str, at: u64| {
            let kind = EventKind::ToolCallArgs {
                tool_use_id: "c1".into(),
                delta: d.into(),
            };
            (Event::new("", "test", json!(null), kind), Some(at))
        };
        let call = ToolUse::new("c1", "read_file", json!({"path": "x"}));
        let whole = call.input.to_string();
        let ev = relayed(vec![
            (Event::new("", "test", json!(null), start), None),
            args(&whole[..4], 0),
            recorded(2, "a1", "", vec![call]),
            args(&whole[4..], 4),
        ])
        .await;
        let sent: String = ev
            .iter()
            .filter(|e| e["type"] == "TOOL_CALL_ARGS")
            .filter_map(|e| e["delta"].as_str())
            .collect();
        assert_eq!(sent, whole, "{ev:#?}");
        assert_eq!(
            ev.iter().filter(|e| e["type"] == "TOOL_CALL_START").count(),
            1,
            "{ev:#?}"
        );
    }

    fn message(seq: u64, id: &str, role: Role, calls: &[&str]) -> Event {
        Event::new(
            format!("e{seq}"),
            "test",
            json!(null),
            EventKind::Message {
                message_id: id.into(),
                role,
                text: String::new(),
                reasoning: None,
                tool_uses: calls.iter().map(|c| ToolUse::new(*c, "t", json!({}))).collect(),
            },
        )
        .with_seq(seq)
    }

    fn result(seq: u64, call: &str) -> Event {
        Event::new(
            format!("e{seq}"),
            "test",
            json!(null),
            EventKind::ToolResult {
                result: ToolResult::ok(call, "ok"),
            },
        )
        .with_seq(seq)
    }

    fn held(v: serde_json::Value) -> Vec<Message> {
        serde_json::from_value(v).unwrap()
    }

    /// Only messages after the client's last user message make a run a possible reconnect.
    #[test]
    fn a_run_holding_part_of_its_turn_is_told_from_a_new_message() {
        let msgs = |v: serde_json::Value| -> Vec<Message> { serde_json::from_value(v).expect("messages") };
        let user = json!({"id": "u1", "role": "user", "content": "hi"});
        let answer = json!({"id": "a1", "role": "assistant", "content": "hello"});
        let next = json!({"id": "u2", "role": "user", "content": "more"});
        assert!(!holds_after_last_user(&msgs(json!([user]))));
        assert!(holds_after_last_user(&msgs(json!([user, answer]))));
        assert!(!holds_after_last_user(&msgs(json!([user, answer, next]))));
        assert!(!holds_after_last_user(&[]));
    }

    /// A reconnecting client is followed from the last event its messages hold; a message that
    /// is not the record's last user message is no reconnect.
    #[test]
    fn a_reconnect_resumes_after_what_the_client_holds() {
        let record = [
            message(1, "old", Role::User, &[]),
            message(2, "a1", Role::Assistant, &[]),
            message(3, "u1", Role::User, &[]),
            message(4, "a2", Role::Assistant, &["c1"]),
            result(5, "c1"),
            message(6, "a3", Role::Assistant, &["c2"]),
        ];
        let user = json!({"id": "u1", "role": "user", "content": "hi"});
        let call = json!({"id": "a2", "role": "assistant", "toolCalls": [
            {"id": "c1", "type": "function", "function": {"name": "t", "arguments": "{}"}}]});
        let tool = json!({"id": "r1", "role": "tool", "toolCallId": "c1", "content": "ok"});
        assert_eq!(reconnect_point(&record, "u1", &held(json!([user]))), Some(3));
        assert_eq!(
            reconnect_point(&record, "u1", &held(json!([user, call]))),
            Some(4)
        );
        assert_eq!(
            reconnect_point(&record, "u1", &held(json!([user, call, tool]))),
            Some(5)
        );
        // The calls alone identify the assistant message, whatever id the client gave it.
        let renamed = json!({"id": "x", "role": "assistant", "toolCalls": [
            {"id": "c1", "type": "function", "function": {"name": "t", "arguments": "{}"}}]});
        assert_eq!(
            reconnect_point(&record, "u1", &held(json!([user, renamed]))),
            Some(4)
        );
        // An earlier user message, or a new one, is not the running turn's.
        assert_eq!(reconnect_point(&record, "old", &held(json!([user]))), None);
        assert_eq!(reconnect_point(&record, "u2", &held(json!([user]))), None);
        // Events before the client's own message do not count.
        let earlier = json!({"id": "a1", "role": "assistant", "content": "x"});
        assert_eq!(
            reconnect_point(&record, "u1", &held(json!([earlier, user]))),
            Some(3)
        );
    }

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
