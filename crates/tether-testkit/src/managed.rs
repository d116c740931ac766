//! A scripted fake of Claude Managed Agents, over real HTTP on 127.0.0.1.
//!
//! It keeps each session's event log like the real service: events the client posts are echoed
//! (with an id and `processed_at`), and each input plays the next scripted *turn* — a list of
//! server events. An idle whose `stop_reason` is `requires_action` without ids gets the ids of
//! the turn's `agent.custom_tool_use` events (and of `agent.tool_use` events marked
//! `"needs_confirmation": true`), in the flat (`event_ids`) or nested
//! (`requires_action.event_ids`) shape; the next turn plays when all of them are answered.
//! Events go to every open stream (`/events/stream`) and into the history
//! (`GET /events`, paged with `next_page`).
//!
//! Faults ([`ManagedFaults`]): drop the live stream right after the first event of a type, deliver
//! every event twice, answer stream opens with error statuses, page history in small pages, or
//! repeat the last cursor. Agents and environments endpoints exist for provisioning tests, with
//! a forced status for environment creation. `user.interrupt` stops the turn in flight (an idle
//! with `end_turn` follows at once; the script's next turn plays on the next input), and
//! `POST /v1/sessions/{id}/archive` archives a session (later posts to it answer 409). A turn
//! scripted without a boundary event stalls: the stream stays open with nothing more on it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, Uri};
use axum::response::Response;
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::server::{Negotiated, Serve, TestCa};

/// Faults to inject.
#[derive(Debug, Clone, Default)]
pub struct ManagedFaults {
    /// Close every open stream right after delivering the first event of this type.
    pub drop_after: Option<String>,
    /// Right after delivering the first event of this type, the open streams go silent: they
    /// stay open and get nothing more (no event, no heartbeat), while the session goes on (its
    /// history keeps growing). A stream opened later is served normally.
    pub stall_after: Option<String>,
    /// Deliver every event twice on the stream.
    pub duplicate: bool,
    /// Statuses for successive stream opens (then 200).
    pub stream_statuses: Vec<u16>,
    /// Largest history page (default 100).
    pub page_size: Option<usize>,
    /// The last history page repeats the previous cursor instead of ending.
    pub repeat_cursor: bool,
    /// Write `requires_action` ids in the nested shape (`requires_action.event_ids`).
    pub nested_requires_action: bool,
    /// Status for `POST /v1/environments` (e.g. 500 to test rollback, 409 to test adoption).
    pub environment_status: Option<u16>,
}

#[derive(Default)]
struct Sess {
    log: Vec<Value>,
    streams: Vec<mpsc::UnboundedSender<Bytes>>,
    turns: VecDeque<Vec<Value>>,
    waiting: HashSet<String>,
    /// Streams silenced by `stall_after`: kept open, never written to.
    parked: Vec<mpsc::UnboundedSender<Bytes>>,
}

#[derive(Default)]
struct St {
    faults: ManagedFaults,
    script: Vec<Vec<Value>>,
    sessions: HashMap<String, Sess>,
    next_id: u64,
    dropped: bool,
    stalled: bool,
    stream_opens: u32,
    posted: Vec<Value>,
    requests: Vec<(String, String)>,
    agents: Vec<Value>,
    environments: Vec<Value>,
    archived_sessions: Vec<String>,
}

impl St {
    fn id(&mut self, prefix: &str) -> String {
        self.next_id += 1;
        format!("{prefix}_{:04}", self.next_id)
    }

    fn emit(&mut self, sid: &str, mut ev: Value) -> Value {
        if ev.get("id").is_none_or(Value::is_null) {
            ev["id"] = json!(self.id("sevt"));
        }
        if ev.get("processed_at").is_none() {
            ev["processed_at"] = json!("2026-01-01T00:00:00Z");
        }
        let ty = ev["type"].as_str().unwrap_or_default().to_owned();
        let frame = Bytes::from(format!("event: {ty}\ndata: {ev}\n\n"));
        let drop_now = !self.dropped && self.faults.drop_after.as_deref() == Some(ty.as_str());
        let dup = self.faults.duplicate;
        if drop_now {
            self.dropped = true;
        }
        let stall_now = !self.stalled && self.faults.stall_after.as_deref() == Some(ty.as_str());
        if stall_now {
            self.stalled = true;
        }
        if let Some(s) = self.sessions.get_mut(sid) {
            s.log.push(ev.clone());
            s.streams.retain(|tx| {
                let ok = tx.send(frame.clone()).is_ok() && (!dup || tx.send(frame.clone()).is_ok());
                ok && !drop_now
            });
            if stall_now {
                let silenced: Vec<_> = s.streams.drain(..).collect();
                s.parked.extend(silenced);
            }
        }
        ev
    }

    fn play(&mut self, sid: &str) {
        let Some(turn) = self.sessions.get_mut(sid).and_then(|s| s.turns.pop_front()) else {
            return;
        };
        self.emit(sid, json!({"type": "session.status_running"}));
        let mut ids = Vec::new();
        for mut ev in turn {
            let ty = ev["type"].as_str().unwrap_or_default().to_owned();
            if ty == "session.status_idle" && ev["stop_reason"]["type"] == "requires_action" {
                let has = ev["stop_reason"]["event_ids"].is_array()
                    || ev["stop_reason"]["requires_action"]["event_ids"].is_array();
                if !has {
                    if self.faults.nested_requires_action {
                        ev["stop_reason"]["requires_action"] = json!({"event_ids": ids});
                    } else {
                        ev["stop_reason"]["event_ids"] = json!(ids);
                    }
                }
                if let Some(s) = self.sessions.get_mut(sid) {
                    s.waiting
                        .extend(ids.iter().filter_map(|v: &Value| v.as_str().map(str::to_owned)));
                }
            }
            let needs =
                ty == "agent.custom_tool_use" || (ty == "agent.tool_use" && ev["needs_confirmation"] == true);
            let ev = self.emit(sid, ev);
            if needs {
                ids.push(ev["id"].clone());
            }
        }
    }
}

type Shared = Arc<Mutex<St>>;

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, St> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

fn error(status: u16, kind: &str, message: &str) -> Response {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(
            json!({"type": "error", "error": {"type": kind, "message": message}}).to_string(),
        ))
        .unwrap_or_default()
}

fn ok(v: Value) -> Response {
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(Body::from(v.to_string()))
        .unwrap_or_default()
}

fn check(h: &HeaderMap) -> Option<Response> {
    let get = |k: &str| h.get(k).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if get("x-api-key").is_empty() || get("x-api-key") == "bad-key" {
        return Some(error(401, "authentication_error", "invalid x-api-key"));
    }
    if !get("anthropic-beta").contains("managed-agents-2026-04-01") {
        return Some(error(
            400,
            "invalid_request_error",
            "the managed-agents beta header is required",
        ));
    }
    None
}

fn query(uri: &Uri, key: &str) -> Option<String> {
    uri.query()?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == key).then(|| v.to_owned())
    })
}

async fn create_session(State(st): State<Shared>, h: HeaderMap, body: Bytes) -> Response {
    if let Some(r) = check(&h) {
        return r;
    }
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if !body["agent"].is_string() || !body["environment_id"].is_string() {
        return error(
            400,
            "invalid_request_error",
            "agent and environment_id are required",
        );
    }
    let mut g = lock(&st);
    g.requests.push(("POST".into(), "/v1/sessions".into()));
    let id = g.id("sesn");
    let turns = g.script.clone().into();
    g.sessions.insert(
        id.clone(),
        Sess {
            turns,
            ..Sess::default()
        },
    );
    ok(json!({"id": id, "type": "session", "status": "idle"}))
}

async fn stream(State(st): State<Shared>, h: HeaderMap, Path(sid): Path<String>) -> Response {
    if let Some(r) = check(&h) {
        return r;
    }
    let mut g = lock(&st);
    g.stream_opens += 1;
    g.requests
        .push(("GET".into(), format!("/v1/sessions/{sid}/events/stream")));
    let n = g.stream_opens as usize;
    if let Some(&status) = g.faults.stream_statuses.get(n - 1)
        && status != 200
    {
        let kind = match status {
            401 => "authentication_error",
            403 => "permission_error",
            429 => "rate_limit_error",
            _ => "api_error",
        };
        return error(status, kind, "fake: stream refused");
    }
    let Some(s) = g.sessions.get_mut(&sid) else {
        return error(404, "not_found_error", "no such session");
    };
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    let _ = tx.send(Bytes::from_static(b"event: ping\ndata: {\"type\":\"ping\"}\n\n"));
    s.streams.push(tx);
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx))
    });
    Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(body))
        .unwrap_or_default()
}

async fn events(
    State(st): State<Shared>,
    method: Method,
    h: HeaderMap,
    uri: Uri,
    Path(sid): Path<String>,
    body: Bytes,
) -> Response {
    if let Some(r) = check(&h) {
        return r;
    }
    let mut g = lock(&st);
    g.requests.push((method.to_string(), uri.path().to_owned()));
    if !g.sessions.contains_key(&sid) {
        return error(404, "not_found_error", "no such session");
    }
    if method == Method::POST && g.archived_sessions.contains(&sid) {
        return error(409, "invalid_request_error", "the session is archived");
    }
    if method == Method::GET {
        let limit: usize = query(&uri, "limit").and_then(|l| l.parse().ok()).unwrap_or(100);
        let limit = limit.min(g.faults.page_size.unwrap_or(100)).max(1);
        let start: usize = query(&uri, "page")
            .and_then(|p| p.trim_start_matches('c').parse().ok())
            .unwrap_or(0);
        let repeat = g.faults.repeat_cursor;
        let log = g.sessions.get(&sid).map(|s| s.log.clone()).unwrap_or_default();
        let end = (start + limit).min(log.len());
        let data: Vec<Value> = log.get(start..end).map(<[Value]>::to_vec).unwrap_or_default();
        let next = if end < log.len() {
            json!(format!("c{end}"))
        } else if repeat && start > 0 {
            json!(format!("c{start}"))
        } else {
            Value::Null
        };
        return ok(json!({"data": data, "next_page": next}));
    }
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some(evs) = body["events"].as_array().cloned() else {
        return error(400, "invalid_request_error", "events: field required");
    };
    if evs.is_empty() {
        return error(
            400,
            "invalid_request_error",
            "events: value must contain at least 1 item",
        );
    }
    let mut play = false;
    for ev in evs {
        g.posted.push(ev.clone());
        let ty = ev["type"].as_str().unwrap_or_default().to_owned();
        g.emit(&sid, ev.clone());
        let waiting_empty = |g: &mut St, id: Option<&str>| {
            let s = g.sessions.get_mut(&sid)?;
            let had = s.waiting.remove(id?);
            Some(had && s.waiting.is_empty())
        };
        match ty.as_str() {
            "user.message" | "user.define_outcome" => play = true,
            "user.custom_tool_result" | "user.tool_confirmation" => {
                let key = if ty == "user.custom_tool_result" {
                    "custom_tool_use_id"
                } else {
                    "tool_use_id"
                };
                play |= waiting_empty(&mut g, ev[key].as_str()) == Some(true);
            }
            "user.interrupt" => {
                // The turn in flight stops; the script's next turn plays on the next input.
                if let Some(s) = g.sessions.get_mut(&sid) {
                    s.waiting.clear();
                }
                g.emit(
                    &sid,
                    json!({"type": "session.status_idle", "stop_reason": {"type": "end_turn"}}),
                );
            }
            _ => {}
        }
    }
    if play {
        g.play(&sid);
    }
    ok(json!({"data": []}))
}

async fn collection(
    State(st): State<Shared>,
    method: Method,
    h: HeaderMap,
    uri: Uri,
    body: Bytes,
) -> Response {
    if let Some(r) = check(&h) {
        return r;
    }
    let mut g = lock(&st);
    g.requests.push((method.to_string(), uri.path().to_owned()));
    let envs = uri.path().starts_with("/v1/environments");
    if method == Method::GET {
        let data = if envs {
            g.environments.clone()
        } else {
            g.agents.clone()
        };
        return ok(json!({"data": data, "next_page": null}));
    }
    if envs && let Some(s) = g.faults.environment_status {
        return error(s, "api_error", "fake: environment creation refused");
    }
    let mut item: Value = serde_json::from_slice(&body).unwrap_or(json!({}));
    let list = if envs { &g.environments } else { &g.agents };
    if list.iter().any(|a| a["name"] == item["name"]) {
        return error(409, "invalid_request_error", "a resource with this name exists");
    }
    let id = g.id(if envs { "env" } else { "agent" });
    item["id"] = json!(id);
    item["archived_at"] = Value::Null;
    if envs {
        g.environments.push(item.clone());
    } else {
        g.agents.push(item.clone());
    }
    ok(item)
}

async fn archive(State(st): State<Shared>, h: HeaderMap, uri: Uri, Path(id): Path<String>) -> Response {
    if let Some(r) = check(&h) {
        return r;
    }
    let mut g = lock(&st);
    g.requests.push(("POST".into(), uri.path().to_owned()));
    let g = &mut *g;
    for item in g.agents.iter_mut().chain(g.environments.iter_mut()) {
        if item["id"] == id.as_str() {
            item["archived_at"] = json!("2026-01-01T00:00:00Z");
            return ok(item.clone());
        }
    }
    error(404, "not_found_error", "no such resource")
}

async fn archive_session(
    State(st): State<Shared>,
    h: HeaderMap,
    uri: Uri,
    Path(sid): Path<String>,
) -> Response {
    if let Some(r) = check(&h) {
        return r;
    }
    let mut g = lock(&st);
    g.requests.push(("POST".into(), uri.path().to_owned()));
    if !g.sessions.contains_key(&sid) {
        return error(404, "not_found_error", "no such session");
    }
    if !g.archived_sessions.contains(&sid) {
        g.archived_sessions.push(sid.clone());
    }
    if let Some(s) = g.sessions.get_mut(&sid) {
        s.streams.clear(); // open streams end
    }
    ok(json!({"id": sid, "type": "session", "archived_at": "2026-01-01T00:00:00Z"}))
}

/// The fake Managed Agents server.
pub struct FakeManaged {
    server: crate::server::Running,
    state: Shared,
}

impl FakeManaged {
    /// Starts a fake whose sessions play `turns` (one per input that unblocks them).
    pub async fn start(turns: Vec<Vec<Value>>, faults: ManagedFaults) -> Self {
        Self::start_with(turns, faults, Serve::plain()).await
    }

    /// Starts a fake as [`FakeManaged::start`], serving as `serve` says (e.g. [`Serve::tls`]:
    /// TLS with a generated CA, HTTP/2 by ALPN).
    pub async fn start_with(turns: Vec<Vec<Value>>, faults: ManagedFaults, serve: Serve) -> Self {
        let state = Arc::new(Mutex::new(St {
            faults,
            script: turns,
            ..St::default()
        }));
        let app = Router::new()
            .route("/v1/sessions", post(create_session))
            .route("/v1/sessions/{sid}/events/stream", get(stream))
            .route("/v1/sessions/{sid}/events", get(events).post(events))
            .route("/v1/sessions/{sid}/archive", post(archive_session))
            .route("/v1/agents", get(collection).post(collection))
            .route("/v1/environments", get(collection).post(collection))
            .route("/v1/agents/{id}/archive", post(archive))
            .route("/v1/environments/{id}/archive", post(archive))
            .with_state(state.clone());
        let server = crate::anthropic::serve(app, serve).await;
        FakeManaged { server, state }
    }

    /// Creates a session directly (for reattach tests) with `history` already in its log and
    /// `waiting` ids blocking it; it plays the fake's turns afterwards.
    pub fn seed_session(&self, history: Vec<Value>, waiting: &[&str]) -> String {
        let mut g = lock(&self.state);
        let id = g.id("sesn");
        let turns = g.script.clone().into();
        g.sessions.insert(
            id.clone(),
            Sess {
                log: history,
                turns,
                waiting: waiting.iter().map(|s| (*s).to_owned()).collect(),
                ..Sess::default()
            },
        );
        id
    }

    /// The origin to use as the base URL (`http://127.0.0.1:<port>`, `https://…` over TLS).
    pub fn url(&self) -> String {
        self.server.origin()
    }

    /// The CA to trust when serving TLS (`None` over plain HTTP).
    pub fn ca(&self) -> Option<&TestCa> {
        self.server.ca()
    }

    /// What every request so far arrived over (TLS version, ALPN, HTTP version), in arrival order.
    pub fn negotiated(&self) -> Vec<Negotiated> {
        self.server.negotiated()
    }

    /// Every event the client posted, in order.
    pub fn posted(&self) -> Vec<Value> {
        lock(&self.state).posted.clone()
    }

    /// A session's full event log.
    pub fn log(&self, session_id: &str) -> Vec<Value> {
        lock(&self.state)
            .sessions
            .get(session_id)
            .map(|s| s.log.clone())
            .unwrap_or_default()
    }

    /// How many times a stream was opened (or refused).
    pub fn stream_opens(&self) -> u32 {
        lock(&self.state).stream_opens
    }

    /// `(method, path)` of every request, in order.
    pub fn requests(&self) -> Vec<(String, String)> {
        lock(&self.state).requests.clone()
    }

    /// Sessions archived so far (`POST /v1/sessions/{id}/archive`); posting events to one
    /// answers 409.
    pub fn archived_sessions(&self) -> Vec<String> {
        lock(&self.state).archived_sessions.clone()
    }

    /// Agents created so far (with `archived_at`).
    pub fn agents(&self) -> Vec<Value> {
        lock(&self.state).agents.clone()
    }

    /// Environments created so far.
    pub fn environments(&self) -> Vec<Value> {
        lock(&self.state).environments.clone()
    }
}

/// Reads `golden/managed/<name>` as JSON.
pub fn golden(name: &str) -> Value {
    let text = crate::anthropic::read_golden("managed", name);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("golden managed/{name}: {e}"))
}
