//! Approval interrupts that cannot be forged.
//!
//! A tool call the config marks `ask` ends the run with an AG-UI interrupt. Its id is 128 random
//! bits from the OS (`approval_<32 hex>`), and the thread's session records it in the store
//! (state key [`INTERRUPTS`]) with the thread, the run that issued it and the tool use it is for
//! (name and a digest of the arguments). The record always holds exactly the interrupts the
//! thread is waiting on: a run rewrites it when it ends, and removes the ones a resume answers
//! before any tool runs, so each id is usable once.
//!
//! A resume is accepted only if every entry names an interrupt outstanding on *this* thread for a
//! tool use still waiting; anything else (an id never issued, one already answered, one issued on
//! another thread, an entry named twice) refuses the whole request before any tool runs: with HTTP
//! 409 `INTERRUPT_NOT_ISSUED` (400 `INVALID_RESUME` for a duplicate) before `RUN_STARTED` when the
//! server can tell at admission, as AG-UI asks of unacceptable input; with `RUN_ERROR` of the same
//! code if a concurrent request changed the thread in between.
//!
//! Fail closed: only `status: "resolved"` with a payload holding `approved: true` (the JSON
//! boolean) approves; every other answer to an issued interrupt is a denial.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tether::{EventStore, Handler, SessionInfo, ToolOutput, ToolSpec, ToolUse};
use tether_agui::ResumeEntry;

use crate::handler::ServeHandler;

/// The state key holding a session's outstanding interrupts.
pub(crate) const INTERRUPTS: &str = "serve.interrupts";

/// One interrupt the server issued.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Issued {
    /// The AG-UI thread it was issued on.
    pub thread_id: String,
    /// The run that issued it first.
    pub run_id: String,
    /// The tool use it asks about.
    pub tool_use_id: String,
    /// That tool use's tool.
    pub tool_name: String,
    /// A digest of that tool use's arguments (FNV-1a over their JSON).
    pub args_digest: String,
}

/// A session's outstanding interrupts, by id.
pub(crate) type Outstanding = BTreeMap<String, Issued>;

/// What a resume decided, by tool use.
#[derive(Debug, Default)]
pub(crate) struct Answers {
    /// Tool uses approved, with the call they approve (run once, only if the call is that one).
    pub approved: HashMap<String, ToolUse>,
    /// Tool uses denied.
    pub denied: Vec<String>,
    /// The interrupt ids answered (removed from the outstanding set before any tool runs).
    pub used: Vec<String>,
}

/// Why a resume was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The id is not outstanding on this thread.
    NotIssued { id: String, thread: String },
    /// The same id twice in one resume.
    Duplicate { id: String },
}

impl Refusal {
    /// The error code clients match on.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            Refusal::NotIssued { .. } => "INTERRUPT_NOT_ISSUED",
            Refusal::Duplicate { .. } => "INVALID_RESUME",
        }
    }

    /// The HTTP status at admission.
    pub(crate) fn status(&self) -> axum::http::StatusCode {
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
                crate::server::printable(id),
                crate::server::printable(thread)
            ),
            Refusal::Duplicate { id } => write!(
                f,
                "resume names interrupt `{}` more than once; nothing was run",
                crate::server::printable(id)
            ),
        }
    }
}

// The id, the argument digest and what counts as an approval are tether-agui's (the
// ThreadAgent protocol), so both adapters issue and accept interrupts the same way.
pub(crate) use tether_agui::approval::{is_approval, new_id};

/// FNV-1a over the arguments' JSON ([`tether_agui::approval::digest`]).
pub(crate) fn args_digest(u: &ToolUse) -> String {
    tether_agui::approval::digest(&u.input)
}

/// Whether `u` is the tool use `rec` was issued for.
fn same_call(rec: &Issued, u: &ToolUse) -> bool {
    rec.tool_use_id == u.id && rec.tool_name == u.name && rec.args_digest == args_digest(u)
}

/// Reads a session's outstanding interrupts (none when the record is missing or unreadable:
/// an unreadable record approves nothing).
pub(crate) async fn load(store: &dyn EventStore, sid: &str) -> tether::Result<Outstanding> {
    Ok(store
        .state(sid, INTERRUPTS)
        .await?
        .and_then(|v| serde_json::from_value(v).ok())
        .unwrap_or_default())
}

/// Saves a session's outstanding interrupts.
pub(crate) async fn save(store: &dyn EventStore, sid: &str, out: &Outstanding) -> tether::Result<()> {
    let v = serde_json::to_value(out).unwrap_or(Value::Null);
    store.put_state(sid, INTERRUPTS, &v).await
}

/// Checks a resume against what is outstanding. `pending`, when known (inside the run, under the
/// thread's lock), are the tool uses the thread waits on: a record whose call is not among them is
/// stale and approves nothing. At admission it is `None` and only the records are checked.
pub(crate) fn decide(
    outstanding: &Outstanding,
    thread: &str,
    resume: &[ResumeEntry],
    pending: Option<&[ToolUse]>,
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
        let call = match pending {
            Some(p) => Some(p.iter().find(|u| same_call(rec, u)).ok_or_else(not_issued)?),
            None => None,
        };
        answers.used.push(id.to_owned());
        if is_approval(r) {
            if let Some(u) = call {
                answers.approved.insert(u.id.clone(), u.clone());
            }
        } else {
            answers.denied.push(rec.tool_use_id.clone());
        }
    }
    Ok(answers)
}

/// The interrupts a run ends with: the outstanding record of each call waiting for approval,
/// keeping the id already issued for the same call (a client that asks again gets the same
/// question), else a fresh one.
pub(crate) fn reissue(
    previous: &Outstanding,
    thread: &str,
    run: &str,
    calls: &[&ToolUse],
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
                        thread_id: thread.to_owned(),
                        run_id: run.to_owned(),
                        tool_use_id: u.id.clone(),
                        tool_name: u.name.clone(),
                        args_digest: args_digest(u),
                    },
                );
            }
        }
    }
    Ok(out)
}

/// The handler a run uses: [`ServeHandler`] behind a gate that lets a call needing approval run
/// only if this request approved that exact call (same id, tool and arguments), and only once. A
/// model that reuses an approved call's id for another call in a later turn gets it held for
/// approval, not run.
pub(crate) struct Gate {
    pub inner: ServeHandler,
    approved: Mutex<HashMap<String, ToolUse>>,
}

impl Gate {
    pub(crate) fn new(inner: ServeHandler, approved: HashMap<String, ToolUse>) -> Self {
        Gate {
            inner,
            approved: Mutex::new(approved),
        }
    }

    fn take_approval(&self, call: &ToolUse) -> bool {
        let Ok(mut map) = self.approved.lock() else {
            return false;
        };
        match map.get(&call.id) {
            Some(u) if u.name == call.name && u.input == call.input => {
                map.remove(&call.id);
                true
            }
            _ => false,
        }
    }
}

#[async_trait]
impl Handler for Gate {
    fn tools(&self) -> Vec<ToolSpec> {
        self.inner.tools()
    }

    async fn call_tool(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        if !self.inner.is_frontend(&call.name)
            && self.inner.approval_need(call).is_some()
            && !self.take_approval(call)
        {
            return ToolOutput::Pending;
        }
        self.inner.call_tool(call, info).await
    }
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
        ToolUse {
            id: id.into(),
            name: "run_command".into(),
            input: json!({"command": cmd}),
            input_error: None,
            raw_input: None,
        }
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
        let first = reissue(&Outstanding::new(), "t", "r1", &[&u]).unwrap();
        let again = reissue(&first, "t", "r2", &[&u]).unwrap();
        assert_eq!(first, again, "the same question keeps its id");
        let other = call("c1", "rm -rf ~");
        let changed = reissue(&first, "t", "r3", &[&other]).unwrap();
        assert_ne!(
            first.keys().next(),
            changed.keys().next(),
            "another call gets another id"
        );
        let elsewhere = reissue(&first, "t2", "r4", &[&u]).unwrap();
        assert_ne!(first.keys().next(), elsewhere.keys().next());
    }

    #[test]
    fn a_resume_must_name_what_is_outstanding_on_this_thread() {
        let u = call("c1", "ls");
        let out = reissue(&Outstanding::new(), "t", "r1", &[&u]).unwrap();
        let id = out.keys().next().unwrap().clone();
        let yes = json!({"status": "resolved", "payload": {"approved": true}});
        let ok = decide(
            &out,
            "t",
            &[entry(&id, yes.clone())],
            Some(std::slice::from_ref(&u)),
        )
        .unwrap();
        assert_eq!(ok.used, std::slice::from_ref(&id));
        assert!(ok.approved.contains_key("c1"));
        // Wrong thread, unknown id, the old predictable form, a duplicate, a stale record.
        for (thread, rid) in [("t2", id.as_str()), ("t", "approval_00"), ("t", "approval:c1")] {
            let e = decide(
                &out,
                thread,
                &[entry(rid, yes.clone())],
                Some(std::slice::from_ref(&u)),
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
        let e = decide(&out, "t", &[entry(&id, yes.clone())], Some(&[call("c1", "rm")])).unwrap_err();
        assert_eq!(
            e.code(),
            "INTERRUPT_NOT_ISSUED",
            "the call changed under the same id"
        );
        // A denial is recorded as such.
        let d = decide(
            &out,
            "t",
            &[entry(&id, json!({"status": "resolved"}))],
            Some(&[u]),
        )
        .unwrap();
        assert_eq!(d.denied, ["c1"]);
        assert!(d.approved.is_empty());
    }
}
