//! Approval interrupts that cannot be forged: one protocol for every question a thread asks.
//!
//! A thread asks the user two kinds of questions:
//! - **tool approvals**: a tool call the handler says needs approval
//!   ([`tether::Handler::needs_approval`]) waits, durably, in the thread (the engine's pending
//!   tool use, [`tether::Waiting::Approval`]); it survives restarts;
//! - **permission requests** a remote loop makes mid-turn (an ACP agent's
//!   `session/request_permission`, a Managed Agents tool confirmation), and **elicitations** (an
//!   MCP server asking the user for input during a tool call): the turn waits on them, so the
//!   adapter holds the session live in memory until the answer comes.
//!
//! Both end the run with an AG-UI interrupt. Its id is 128 random bits from the OS
//! (`approval_<32 hex>`), recorded in the thread's state (key [`INTERRUPTS`]) with the thread,
//! the run that issued it, and what it asks about (the tool use or the permission request: its id,
//! its tool and a digest of its input). The record always holds exactly the interrupts the thread
//! is waiting on: a run rewrites it when it ends, and removes the ones a resume answers before
//! anything runs, so each id is usable once.
//!
//! A resume is accepted only if every entry names an interrupt outstanding on *this* thread for a
//! question still waiting; anything else (an id never issued, one already answered, one issued on
//! another thread, an entry named twice) refuses the whole request before anything runs: with
//! HTTP 409 `INTERRUPT_NOT_ISSUED` (400 `INVALID_RESUME` for a duplicate) before `RUN_STARTED`
//! when the server checks at admission ([`crate::ThreadAgent::check_resume`]), as AG-UI asks of
//! unacceptable input; with `RUN_ERROR` of the same code if a concurrent request changed the
//! thread in between.
//!
//! Fail closed: only `status: "resolved"` with a payload holding `approved: true` (the JSON
//! boolean) approves; every other answer to an issued interrupt is a denial. An elicitation is
//! accepted only by `{"action": "accept", "content": {...}}` ([`elicitation_answer`]); anything
//! else declines (or cancels).

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tether::{
    ElicitationMode, ElicitationRequest, ElicitationResponse, EventStore, PermissionKind, PermissionOutcome,
    PermissionRequest, ToolUse,
};

use crate::types::{ResumeEntry, ResumeStatus};

/// The state key holding a thread's outstanding interrupts.
pub const INTERRUPTS: &str = "agui.interrupts";

/// What an interrupt asks about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Asked {
    /// A tool call waiting for approval (durable).
    #[default]
    Tool,
    /// A permission request a remote loop made mid-turn (held live).
    Permission,
    /// An elicitation (an MCP server asking the user for input) made mid-turn (held live).
    Elicitation,
}

impl Asked {
    /// Whether the question is held live in memory (lost when the process holding it ends).
    pub fn is_live(self) -> bool {
        !matches!(self, Asked::Tool)
    }
}

/// A question held live while the turn that asked it waits.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Held<'a> {
    /// A permission request.
    Permission(&'a PermissionRequest),
    /// An elicitation.
    Elicitation(&'a ElicitationRequest),
}

impl Held<'_> {
    /// The record an interrupt for this question carries (`thread`, `run` issued it).
    fn issued(&self, thread: &str, run: &str) -> Issued {
        match self {
            Held::Permission(req) => Issued {
                kind: Asked::Permission,
                thread_id: thread.to_owned(),
                run_id: run.to_owned(),
                tool_use_id: req.tool_use_id.clone(),
                tool_name: req.title.clone(),
                args_digest: digest(&req.input),
            },
            Held::Elicitation(req) => Issued {
                kind: Asked::Elicitation,
                thread_id: thread.to_owned(),
                run_id: run.to_owned(),
                tool_use_id: req.id.clone().unwrap_or_default(),
                tool_name: req.message.chars().take(200).collect(),
                args_digest: elicitation_digest(req),
            },
        }
    }

    /// Whether `rec` was issued for this question.
    pub fn matches(&self, rec: &Issued) -> bool {
        let mine = self.issued(&rec.thread_id, &rec.run_id);
        rec.kind == mine.kind
            && rec.tool_use_id == mine.tool_use_id
            && rec.tool_name == mine.tool_name
            && rec.args_digest == mine.args_digest
    }
}

/// A digest of what an elicitation shows the user (its message and mode).
fn elicitation_digest(req: &ElicitationRequest) -> String {
    digest(&serde_json::json!({"message": req.message, "mode": req.mode}))
}

/// One interrupt a thread issued.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct Issued {
    /// What it asks about.
    #[serde(default)]
    pub kind: Asked,
    /// The AG-UI thread it was issued on.
    pub thread_id: String,
    /// The run that issued it first.
    pub run_id: String,
    /// The tool use (or the permission request's tool call) it asks about.
    pub tool_use_id: String,
    /// That tool use's tool (or the request's title).
    pub tool_name: String,
    /// A digest of that tool use's arguments (FNV-1a over their JSON).
    pub args_digest: String,
}

/// A thread's outstanding interrupts, by id.
pub type Outstanding = BTreeMap<String, Issued>;

/// What a resume decided.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct Answers {
    /// Tool uses approved (by id): each runs once, and only if it is still that call.
    pub approved: Vec<String>,
    /// Tool uses denied (by id).
    pub denied: Vec<String>,
    /// The held permission request's answer, when the resume answered it.
    pub permission: Option<PermissionOutcome>,
    /// The held elicitation's answer, when the resume answered it.
    pub elicitation: Option<ElicitationResponse>,
    /// The interrupt ids answered (removed from the outstanding set before anything runs).
    pub used: Vec<String>,
    /// Answered interrupts whose question is gone (a permission request the process that held
    /// it took with it): recorded as lost, nothing else.
    pub lost: Vec<Issued>,
}

/// Why a resume was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The id is not outstanding on this thread for a question still waiting.
    NotIssued {
        /// The id named.
        id: String,
        /// The thread.
        thread: String,
    },
    /// The same id twice in one resume.
    Duplicate {
        /// The id named twice.
        id: String,
    },
}

impl Refusal {
    /// The error code clients match on.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::NotIssued { .. } => "INTERRUPT_NOT_ISSUED",
            Refusal::Duplicate { .. } => "INVALID_RESUME",
        }
    }

    /// The HTTP status for a refusal at admission.
    pub fn status(&self) -> axum::http::StatusCode {
        match self {
            Refusal::NotIssued { .. } => axum::http::StatusCode::CONFLICT,
            Refusal::Duplicate { .. } => axum::http::StatusCode::BAD_REQUEST,
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::NotIssued { id, thread } => write!(
                f,
                "resume names interrupt `{}`, which is not waiting for an answer on thread `{}` (never issued \
                 there, or already answered); nothing was run. Answer only the interrupts of the thread's last \
                 RUN_FINISHED",
                printable(id),
                printable(thread)
            ),
            Refusal::Duplicate { id } => write!(
                f,
                "resume names interrupt `{}` more than once; nothing was run",
                printable(id)
            ),
        }
    }
}

impl std::error::Error for Refusal {}

/// A client-supplied string for an error message: at most 100 characters, control characters
/// escaped (it may end up on a terminal).
pub fn printable(s: &str) -> String {
    let mut out: String = s.chars().take(100).flat_map(char::escape_default).collect();
    if s.chars().nth(100).is_some() {
        out.push('…');
    }
    out
}

/// A fresh interrupt id: 128 bits from the OS's random source.
pub fn new_id() -> std::io::Result<String> {
    use rand::TryRngCore;
    let mut b = [0u8; 16];
    rand::rngs::OsRng
        .try_fill_bytes(&mut b)
        .map_err(|e| std::io::Error::other(format!("the OS random source failed: {e}")))?;
    let mut s = String::with_capacity(9 + 32);
    s.push_str("approval_");
    for x in b {
        use std::fmt::Write;
        let _ = write!(s, "{x:02x}");
    }
    Ok(s)
}

/// FNV-1a over a JSON value's text: ties a record to the exact input it was issued for.
pub fn digest(v: &Value) -> String {
    let text = v.to_string();
    let h = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// Whether `u` is the tool use `rec` was issued for.
fn same_call(rec: &Issued, u: &ToolUse) -> bool {
    rec.kind == Asked::Tool
        && rec.tool_use_id == u.id
        && rec.tool_name == u.name
        && rec.args_digest == digest(&u.input)
}

/// Reads a thread's outstanding interrupts (none when the record is missing or unreadable: an
/// unreadable record approves nothing).
pub async fn load(store: &dyn EventStore, record: &str) -> tether::Result<Outstanding> {
    Ok(store
        .state(record, INTERRUPTS)
        .await?
        .and_then(|v| serde_json::from_value(v).ok())
        .unwrap_or_default())
}

/// Saves a thread's outstanding interrupts.
pub async fn save(store: &dyn EventStore, record: &str, out: &Outstanding) -> tether::Result<()> {
    let v = serde_json::to_value(out).unwrap_or(Value::Null);
    store.put_state(record, INTERRUPTS, &v).await
}

/// Checks a request's `resume[]` against its thread's outstanding interrupts before the run
/// starts (an endpoint's admission: refuse with [`Refusal::status`] before `RUN_STARTED`), for
/// the threads of agent `agent` in `store`. One check for every backend that runs a thread's
/// turns (`ThreadAgent` in process, `tether serve`'s Restate backend): the run checks again
/// against what the thread waits on.
///
/// A thread id that is not valid, and a thread of another agent, pass here: the run says why it
/// refuses them (nothing of this agent is outstanding there).
pub async fn check_resume(
    store: &dyn tether::ThreadStore,
    agent: &str,
    input: &crate::types::RunAgentInput,
) -> Result<(), crate::thread::CheckError> {
    use crate::thread::CheckError;
    if input.resume.is_empty() {
        return Ok(());
    }
    let thread = input.thread_id.as_str();
    let Ok(id) = tether::ThreadId::new(thread) else {
        return Ok(());
    };
    let outstanding = match store.thread(&id).await.map_err(CheckError::Store)? {
        Some(t) if t.agent != agent => return Ok(()),
        Some(t) => load(store, &t.record).await.map_err(CheckError::Store)?,
        None => Outstanding::new(),
    };
    decide(&outstanding, thread, &input.resume, None)
        .map(|_| ())
        .map_err(CheckError::Refused)
}

/// The AG-UI interrupt `id` asking to approve tool use `tool_use_id` (what it does:
/// `summary`), with the response schema `{"approved": boolean}`: the same for every backend.
pub fn tool_interrupt(id: &str, tool_use_id: &str, summary: &str) -> crate::types::Interrupt {
    let mut schema = serde_json::Map::new();
    schema.insert("type".into(), serde_json::json!("object"));
    schema.insert(
        "properties".into(),
        serde_json::json!({"approved": {"type": "boolean"}}),
    );
    schema.insert("required".into(), serde_json::json!(["approved"]));
    crate::types::Interrupt::new(id, "approval")
        .with_message(format!("Allow {summary}?"))
        .with_tool_call(tool_use_id)
        .with_response_schema(schema)
}

/// What the thread waits on, when known (inside the run, with the thread's lock held).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct WaitingOn<'a> {
    /// Tool uses waiting for approval.
    pub calls: &'a [ToolUse],
    /// The question held live, if any.
    pub held: Option<Held<'a>>,
}

impl<'a> WaitingOn<'a> {
    /// What a thread waits on: tool uses waiting for approval, and the question held live, if
    /// any (for a backend outside this crate: the struct is non-exhaustive).
    pub fn new(calls: &'a [ToolUse], held: Option<Held<'a>>) -> Self {
        WaitingOn { calls, held }
    }
}

/// Checks a resume against what is outstanding. `waiting`, when known, is what the thread
/// waits on: a record whose question is not among it approves nothing (a tool record: the
/// resume is refused; a permission record without a held request: the question was lost with
/// the process that held it, and is reported in [`Answers::lost`]). At admission it is `None`
/// and only the records are checked.
pub fn decide(
    outstanding: &Outstanding,
    thread: &str,
    resume: &[ResumeEntry],
    waiting: Option<WaitingOn<'_>>,
) -> Result<Answers, Refusal> {
    let mut seen = HashSet::new();
    let mut answers = Answers::default();
    for r in resume {
        let id = r.interrupt_id.as_str();
        if !seen.insert(id) {
            return Err(Refusal::Duplicate { id: id.to_owned() });
        }
        let not_issued = || Refusal::NotIssued {
            id: id.to_owned(),
            thread: thread.to_owned(),
        };
        let rec = outstanding
            .get(id)
            .filter(|rec| rec.thread_id == thread)
            .ok_or_else(not_issued)?;
        answers.used.push(id.to_owned());
        let Some(w) = waiting else { continue };
        match rec.kind {
            Asked::Tool => {
                let call = w
                    .calls
                    .iter()
                    .find(|u| same_call(rec, u))
                    .ok_or_else(not_issued)?;
                if is_approval(r) {
                    answers.approved.push(call.id.clone());
                } else {
                    answers.denied.push(call.id.clone());
                }
            }
            Asked::Permission | Asked::Elicitation => match w.held {
                Some(h) if h.matches(rec) => match h {
                    Held::Permission(req) => answers.permission = Some(permission_answer(req, r)),
                    Held::Elicitation(req) => answers.elicitation = Some(elicitation_answer(req, r)),
                },
                Some(_) => return Err(not_issued()),
                None => answers.lost.push(rec.clone()),
            },
        }
    }
    Ok(answers)
}

/// Fail closed: approved only by `resolved` with `{"approved": true}`.
pub fn is_approval(r: &ResumeEntry) -> bool {
    matches!(r.status, ResumeStatus::Resolved)
        && r.payload
            .as_ref()
            .and_then(|p| p.get("approved"))
            .is_some_and(|v| *v == Value::Bool(true))
}

/// The answer to a held permission request: an approval picks the allowing option the payload
/// names (`optionId`), else the first allow-once, else the first allowing one; anything else picks
/// a refusing option (or cancels when the request offers none).
pub fn permission_answer(req: &PermissionRequest, r: &ResumeEntry) -> PermissionOutcome {
    let select = |o: Option<&tether::PermissionOption>| {
        o.map(|o| PermissionOutcome::Selected {
            option_id: o.id.clone(),
        })
        .unwrap_or(PermissionOutcome::Cancelled)
    };
    if !is_approval(r) {
        return select(req.reject_option());
    }
    let named = r
        .payload
        .as_ref()
        .and_then(|p| p.get("optionId"))
        .and_then(Value::as_str)
        .and_then(|id| req.options.iter().find(|o| o.id == id && o.kind.allows()));
    select(
        named
            .or_else(|| req.option_of(PermissionKind::AllowOnce))
            .or_else(|| req.options.iter().find(|o| o.kind.allows())),
    )
}

/// The most an accepted elicitation's content may hold (its JSON text, in bytes).
pub const MAX_ELICITATION_CONTENT: usize = 64 * 1024;

/// The answer to a held elicitation, failing closed: `resolved` with a payload whose `action` is
/// `"accept"` accepts, with `content` (a JSON object of at most [`MAX_ELICITATION_CONTENT`]
/// bytes; required for a form, ignored for a URL); `"cancel"`, or a `cancelled` status, cancels;
/// anything else (no payload, another action, content that is not an object or too big)
/// declines.
pub fn elicitation_answer(req: &ElicitationRequest, r: &ResumeEntry) -> ElicitationResponse {
    if !matches!(r.status, ResumeStatus::Resolved) {
        return ElicitationResponse::Cancel;
    }
    let Some(p) = r.payload.as_ref() else {
        return ElicitationResponse::Decline;
    };
    match p.get("action").and_then(Value::as_str) {
        Some("accept") => match (&req.mode, p.get("content")) {
            (ElicitationMode::Url { .. }, _) => ElicitationResponse::Accept { content: None },
            (_, Some(c @ Value::Object(_))) if c.to_string().len() <= MAX_ELICITATION_CONTENT => {
                ElicitationResponse::Accept {
                    content: Some(c.clone()),
                }
            }
            _ => ElicitationResponse::Decline,
        },
        Some("cancel") => ElicitationResponse::Cancel,
        _ => ElicitationResponse::Decline,
    }
}

/// The interrupts a run ends with: the outstanding record of each tool call waiting for
/// approval, keeping the id already issued for the same call (a client that asks again gets the
/// same question), else a fresh one; and a fresh one for the question held live, if any.
pub fn reissue(
    previous: &Outstanding,
    thread: &str,
    run: &str,
    calls: &[&ToolUse],
    held: Option<Held<'_>>,
) -> std::io::Result<Outstanding> {
    let mut out = Outstanding::new();
    for u in calls {
        let kept = previous
            .iter()
            .find(|(_, rec)| rec.thread_id == thread && same_call(rec, u));
        match kept {
            Some((id, rec)) => {
                out.insert(id.clone(), rec.clone());
            }
            None => {
                out.insert(
                    new_id()?,
                    Issued {
                        kind: Asked::Tool,
                        thread_id: thread.to_owned(),
                        run_id: run.to_owned(),
                        tool_use_id: u.id.clone(),
                        tool_name: u.name.clone(),
                        args_digest: digest(&u.input),
                    },
                );
            }
        }
    }
    if let Some(h) = held {
        out.insert(new_id()?, h.issued(thread, run));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn entry(id: &str, v: Value) -> ResumeEntry {
        let mut e = json!({"interruptId": id});
        for (k, x) in v.as_object().unwrap() {
            e[k] = x.clone();
        }
        serde_json::from_value(e).unwrap()
    }

    fn call(id: &str, cmd: &str) -> ToolUse {
        ToolUse::new(id, "run_command", json!({"command": cmd}))
    }

    fn calls(c: &[ToolUse]) -> Option<WaitingOn<'_>> {
        Some(WaitingOn { calls: c, held: None })
    }

    #[test]
    fn only_an_explicit_true_approves() {
        let yes = [json!({"status": "resolved", "payload": {"approved": true}})];
        let no = [
            json!({"status": "resolved"}),
            json!({"status": "resolved", "payload": {}}),
            json!({"status": "resolved", "payload": {"approved": "true"}}),
            json!({"status": "resolved", "payload": {"approved": 1}}),
            json!({"status": "resolved", "payload": {"approved": null}}),
            json!({"status": "resolved", "payload": {"approved": false}}),
            json!({"status": "resolved", "payload": true}),
            json!({"status": "cancelled", "payload": {"approved": true}}),
        ];
        for v in yes {
            assert!(is_approval(&entry("i", v.clone())), "{v}");
        }
        for v in no {
            assert!(!is_approval(&entry("i", v.clone())), "{v}");
        }
    }

    #[test]
    fn ids_are_unguessable_and_reused_only_for_the_same_call() {
        let a = new_id().unwrap();
        let b = new_id().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), "approval_".len() + 32);
        let u = call("c1", "ls");
        let first = reissue(&Outstanding::new(), "t", "r1", &[&u], None).unwrap();
        let again = reissue(&first, "t", "r2", &[&u], None).unwrap();
        assert_eq!(first, again, "the same question keeps its id");
        let other = call("c1", "rm -rf ~");
        let changed = reissue(&first, "t", "r3", &[&other], None).unwrap();
        assert_ne!(
            first.keys().next(),
            changed.keys().next(),
            "another call gets another id"
        );
        let elsewhere = reissue(&first, "t2", "r4", &[&u], None).unwrap();
        assert_ne!(first.keys().next(), elsewhere.keys().next());
    }

    #[test]
    fn a_resume_must_name_what_is_outstanding_on_this_thread() {
        let u = call("c1", "ls");
        let out = reissue(&Outstanding::new(), "t", "r1", &[&u], None).unwrap();
        let id = out.keys().next().unwrap().clone();
        let yes = json!({"status": "resolved", "payload": {"approved": true}});
        let ok = decide(
            &out,
            "t",
            &[entry(&id, yes.clone())],
            calls(std::slice::from_ref(&u)),
        )
        .unwrap();
        assert_eq!(ok.used, std::slice::from_ref(&id));
        assert_eq!(ok.approved, ["c1"]);
        // Wrong thread, unknown id, the old predictable forms, a duplicate, a stale record.
        for (thread, rid) in [
            ("t2", id.as_str()),
            ("t", "approval_00"),
            ("t", "approval:c1"),
            ("t", "t-permission-1"),
        ] {
            let e = decide(
                &out,
                thread,
                &[entry(rid, yes.clone())],
                calls(std::slice::from_ref(&u)),
            )
            .unwrap_err();
            assert_eq!(e.code(), "INTERRUPT_NOT_ISSUED", "{thread} {rid}");
        }
        let e = decide(
            &out,
            "t",
            &[entry(&id, yes.clone()), entry(&id, yes.clone())],
            None,
        )
        .unwrap_err();
        assert_eq!(e.code(), "INVALID_RESUME");
        let e = decide(&out, "t", &[entry(&id, yes.clone())], calls(&[call("c1", "rm")])).unwrap_err();
        assert_eq!(
            e.code(),
            "INTERRUPT_NOT_ISSUED",
            "the call changed under the same id"
        );
        let d = decide(
            &out,
            "t",
            &[entry(&id, json!({"status": "resolved"}))],
            calls(&[u]),
        )
        .unwrap();
        assert_eq!(d.denied, ["c1"]);
        assert!(d.approved.is_empty());
    }

    fn request() -> PermissionRequest {
        PermissionRequest::new("call_2", "Modify config")
            .with_input(json!({"path": "config.json"}))
            .with_kind("edit")
            .with_options(vec![
                tether::PermissionOption::new("allow", "Allow", PermissionKind::AllowOnce),
                tether::PermissionOption::new("always", "Always", PermissionKind::AllowAlways),
                tether::PermissionOption::new("reject", "Skip", PermissionKind::RejectOnce),
            ])
    }

    #[test]
    fn a_permission_interrupt_answers_only_the_request_held_and_fails_closed() {
        let req = request();
        let out = reissue(&Outstanding::new(), "t", "r1", &[], Some(Held::Permission(&req))).unwrap();
        let id = out.keys().next().unwrap().clone();
        let held = Some(WaitingOn {
            calls: &[],
            held: Some(Held::Permission(&req)),
        });
        let pick = |payload: Value| {
            decide(&out, "t", &[entry(&id, payload)], held)
                .unwrap()
                .permission
                .unwrap()
        };
        let sel = |s: &str| PermissionOutcome::Selected { option_id: s.into() };
        assert_eq!(
            pick(json!({"status": "resolved", "payload": {"approved": true}})),
            sel("allow")
        );
        assert_eq!(
            pick(json!({"status": "resolved", "payload": {"approved": true, "optionId": "always"}})),
            sel("always")
        );
        assert_eq!(
            pick(json!({"status": "resolved", "payload": {"approved": true, "optionId": "reject"}})),
            sel("allow"),
            "an approval never picks a refusing option"
        );
        assert_eq!(
            pick(json!({"status": "resolved", "payload": {"optionId": "allow"}})),
            sel("reject"),
            "an option without approved: true is a denial"
        );
        assert_eq!(pick(json!({"status": "cancelled"})), sel("reject"));
        // Another request under the same tool call id: not what was shown.
        let mut other = request();
        other.input = json!({"path": "/etc/passwd"});
        let e = decide(
            &out,
            "t",
            &[entry(
                &id,
                json!({"status": "resolved", "payload": {"approved": true}}),
            )],
            Some(WaitingOn {
                calls: &[],
                held: Some(Held::Permission(&other)),
            }),
        )
        .unwrap_err();
        assert_eq!(e.code(), "INTERRUPT_NOT_ISSUED");
        // Nothing held (the process that held it is gone): the question is lost, nothing approved.
        let lost = decide(
            &out,
            "t",
            &[entry(
                &id,
                json!({"status": "resolved", "payload": {"approved": true}}),
            )],
            Some(WaitingOn {
                calls: &[],
                held: None,
            }),
        )
        .unwrap();
        assert_eq!(lost.lost.len(), 1);
        assert!(lost.permission.is_none() && lost.approved.is_empty());
    }

    fn form() -> ElicitationRequest {
        ElicitationRequest::new(
            "Your name?",
            ElicitationMode::Form {
                schema: json!({"type": "object", "properties": {"name": {"type": "string"}}}),
            },
        )
    }

    #[test]
    fn an_elicitation_answer_fails_closed() {
        let req = form();
        let answer = |v: Value| elicitation_answer(&req, &entry("i", v));
        assert_eq!(
            answer(
                json!({"status": "resolved", "payload": {"action": "accept", "content": {"name": "Ada"}}})
            ),
            ElicitationResponse::Accept {
                content: Some(json!({"name": "Ada"}))
            }
        );
        for v in [
            json!({"status": "resolved"}),
            json!({"status": "resolved", "payload": {}}),
            json!({"status": "resolved", "payload": {"action": "accept"}}),
            json!({"status": "resolved", "payload": {"action": "accept", "content": "Ada"}}),
            json!({"status": "resolved", "payload": {"action": "accept", "content": ["Ada"]}}),
            json!({"status": "resolved", "payload": {"action": "ACCEPT", "content": {}}}),
            json!({"status": "resolved", "payload": {"action": "decline", "content": {"name": "x"}}}),
            json!({"status": "resolved", "payload": {"action": "accept",
                "content": {"name": "x".repeat(MAX_ELICITATION_CONTENT)}}}),
        ] {
            assert_eq!(answer(v.clone()), ElicitationResponse::Decline, "{v}");
        }
        assert_eq!(
            answer(json!({"status": "resolved", "payload": {"action": "cancel"}})),
            ElicitationResponse::Cancel
        );
        assert_eq!(
            answer(json!({"status": "cancelled", "payload": {"action": "accept", "content": {}}})),
            ElicitationResponse::Cancel
        );
        // A URL elicitation's acceptance carries no content.
        let url = {
            let mut v = form();
            v.mode = ElicitationMode::Url {
                url: "https://example.com/auth".into(),
            };
            v
        };
        assert_eq!(
            elicitation_answer(
                &url,
                &entry(
                    "i",
                    json!({"status": "resolved", "payload": {"action": "accept", "content": {"x": 1}}})
                )
            ),
            ElicitationResponse::Accept { content: None }
        );
    }

    #[test]
    fn an_elicitation_interrupt_answers_only_the_elicitation_held() {
        let req = form();
        let out = reissue(&Outstanding::new(), "t", "r1", &[], Some(Held::Elicitation(&req))).unwrap();
        let (id, rec) = out.iter().next().unwrap();
        assert_eq!(rec.kind, Asked::Elicitation);
        let yes = json!({"status": "resolved", "payload": {"action": "accept", "content": {"name": "Ada"}}});
        let held = |r: &ElicitationRequest| {
            decide(
                &out,
                "t",
                &[entry(id, yes.clone())],
                Some(WaitingOn {
                    calls: &[],
                    held: Some(Held::Elicitation(r)),
                }),
            )
        };
        assert!(matches!(
            held(&req).unwrap().elicitation,
            Some(ElicitationResponse::Accept { .. })
        ));
        let mut other = form();
        other.message = "Your password?".into();
        assert_eq!(held(&other).unwrap_err().code(), "INTERRUPT_NOT_ISSUED");
        // A permission request held under it: not what was shown.
        let perm = request();
        let e = decide(
            &out,
            "t",
            &[entry(id, yes.clone())],
            Some(WaitingOn {
                calls: &[],
                held: Some(Held::Permission(&perm)),
            }),
        )
        .unwrap_err();
        assert_eq!(e.code(), "INTERRUPT_NOT_ISSUED");
        // Nothing held: lost.
        let lost = decide(
            &out,
            "t",
            &[entry(id, yes)],
            Some(WaitingOn {
                calls: &[],
                held: None,
            }),
        )
        .unwrap();
        assert_eq!(lost.lost.len(), 1);
        assert!(lost.elicitation.is_none());
    }
}
