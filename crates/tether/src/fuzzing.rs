//! Entry points and helpers for the fuzz targets in `fuzz/` (and the corpus replay tests that
//! run their corpora on every `cargo test`). **Not part of the API**: hidden from the docs, free
//! to change with the targets.
//!
//! Each `check_*` function is one target's oracle: it panics when an invariant breaks, which is
//! what libFuzzer reports as a crash. The helpers here are shared by the other crates' `fuzzing`
//! modules: the ways an input is cut into reads ([`splits`]), a runtime for async parsers
//! ([`block_on`]), and a sink that records the live deltas a model streams ([`Recorder`]).

use std::future::Future;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
#[cfg(feature = "test-util")]
use serde_json::Value;

#[cfg(feature = "test-util")]
use crate::chat::ChatResponse;
use crate::event::{Event, EventKind};
use crate::handler::{Handler, ToolOutput};
#[cfg(feature = "test-util")]
use crate::local::LocalLoop;
#[cfg(feature = "test-util")]
use crate::session::Session;
use crate::sink::{DeltaSink, EventSink};
use crate::store::MemoryStore;
#[cfg(feature = "test-util")]
use crate::testing::ScriptedModel;
use crate::types::{SessionInfo, ToolSpec, ToolUse};

/// The ways a target cuts `data` into network reads: whole, one byte at a time, and at up to
/// eight points derived from the input itself (deterministic, so a crash reproduces). A decoder
/// fed any of them must decode the same thing: the split-invariance oracle.
pub fn splits(data: &[u8]) -> Vec<Vec<&[u8]>> {
    let mut out = vec![vec![data]];
    if data.len() > 1 {
        out.push(data.chunks(1).collect());
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in data {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        let mut cuts: Vec<usize> = (0..1 + (h % 8) as usize)
            .map(|i| {
                h = h
                    .rotate_left(17)
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    .wrapping_add(i as u64);
                (h % data.len() as u64) as usize
            })
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut pieces = Vec::new();
        let mut at = 0;
        for c in cuts.into_iter().chain([data.len()]) {
            pieces.push(&data[at..c]);
            at = c;
        }
        out.push(pieces);
    }
    out
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime for the fuzz targets");
}

/// Runs `f` to completion on this thread's single-threaded runtime (made once: building one per
/// input would cost more than most inputs).
pub fn block_on<F: Future>(f: F) -> F::Output {
    RUNTIME.with(|rt| rt.block_on(f))
}

/// A handler that records every event delivered to it (durable and live), and runs the one tool
/// `probe` by recording its call.
#[derive(Debug, Default)]
pub struct Recorder {
    events: Mutex<Vec<Event>>,
    calls: Mutex<Vec<ToolUse>>,
}

impl Recorder {
    /// A [`DeltaSink`] whose deltas this recorder receives, and the recorder.
    pub fn delta_sink() -> (DeltaSink, Arc<Recorder>) {
        let rec = Arc::new(Recorder::default());
        let sink = EventSink::new(
            SessionInfo::new("fuzz", "fuzz"),
            rec.clone(),
            Arc::new(MemoryStore::default()),
        );
        (DeltaSink::new(sink, "m"), rec)
    }

    /// The events delivered so far.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// What the live deltas delivered so far add up to.
    pub fn live(&self) -> Live {
        Live::of(&self.events())
    }

    /// The `probe` calls the session ran.
    pub fn calls(&self) -> Vec<ToolUse> {
        self.calls.lock().map(|c| c.clone()).unwrap_or_default()
    }
}

#[async_trait]
impl Handler for Recorder {
    fn tools(&self) -> Vec<ToolSpec> {
        vec![ToolSpec::new(
            "probe",
            "records its call",
            serde_json::json!({"type": "object"}),
        )]
    }

    async fn call_tool(&self, call: &ToolUse, _info: &SessionInfo) -> ToolOutput {
        if let Ok(mut c) = self.calls.lock() {
            c.push(call.clone());
        }
        ToolOutput::Ok("recorded".into())
    }

    async fn on_event(&self, event: &Event, _info: &SessionInfo) {
        if let Ok(mut e) = self.events.lock() {
            e.push(event.clone());
        }
    }
}

/// The live deltas of one model call, added up: what a client watching the stream saw, whatever
/// pieces it came in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Live {
    /// The text deltas, concatenated.
    pub text: String,
    /// The reasoning deltas, concatenated.
    pub reasoning: String,
    /// The reasoning signatures, in order.
    pub signatures: Vec<String>,
    /// Each tool call as started: id, name, argument deltas concatenated, and how many times it
    /// was ended.
    pub calls: Vec<(String, String, String, u32)>,
    /// Argument deltas or ends for a call never started (id, what).
    pub orphans: Vec<(String, String)>,
}

impl Live {
    /// Adds up the live deltas among `events`.
    pub fn of(events: &[Event]) -> Live {
        let mut l = Live::default();
        for e in events {
            match &e.kind {
                EventKind::TextDelta { delta, .. } => l.text.push_str(delta),
                EventKind::ReasoningDelta { delta, .. } => l.reasoning.push_str(delta),
                EventKind::ReasoningSignature { value, .. } => l.signatures.push(value.clone()),
                EventKind::ToolCallStart {
                    tool_use_id, name, ..
                } => l
                    .calls
                    .push((tool_use_id.clone(), name.clone(), String::new(), 0)),
                EventKind::ToolCallArgs { tool_use_id, delta } => {
                    match l.calls.iter_mut().rev().find(|c| &c.0 == tool_use_id) {
                        Some(c) => c.2.push_str(delta),
                        None => l.orphans.push((tool_use_id.clone(), format!("args {delta}"))),
                    }
                }
                EventKind::ToolCallEnd { tool_use_id } => {
                    match l.calls.iter_mut().rev().find(|c| &c.0 == tool_use_id) {
                        Some(c) => c.3 += 1,
                        None => l.orphans.push((tool_use_id.clone(), "end".into())),
                    }
                }
                _ => {}
            }
        }
        l
    }
}

#[cfg(feature = "test-util")]
/// Checks [`ToolUse::from_arguments`], the one place a model's argument text becomes a tool
/// input, and that the local loop runs a call only on an input it decoded:
/// - empty (or blank) text is `{}`; a JSON object is its value; anything else (text that does
///   not parse, JSON that is not an object) keeps `{}` and records why; the raw text is kept;
/// - a tool use survives the JSON round trip the store puts it through;
/// - in a session, a call whose arguments did not decode never reaches the handler (the model is
///   told why instead), and one that did reaches it with exactly that input, once.
pub fn check_tool_arguments(args: &str) {
    let u = ToolUse::from_arguments("call_1", "probe", args);
    assert_eq!(u.raw_input.as_deref(), Some(args));
    match serde_json::from_str::<Value>(args) {
        _ if args.trim().is_empty() => {
            assert_eq!(u.input, serde_json::json!({}));
            assert_eq!(u.input_error, None);
        }
        Ok(v) if v.is_object() => {
            assert_eq!(u.input, v);
            assert_eq!(u.input_error, None);
        }
        Ok(_) => {
            // Valid JSON that is not an object: refused like text that does not parse.
            assert_eq!(u.input, serde_json::json!({}));
            assert!(
                u.input_error.is_some(),
                "{args:?} is not an object but has no input_error"
            );
        }
        Err(_) => {
            assert_eq!(u.input, serde_json::json!({}));
            assert!(
                u.input_error.is_some(),
                "{args:?} did not decode but has no input_error"
            );
        }
    }
    let text = serde_json::to_string(&u).expect("a ToolUse serializes");
    let back: ToolUse = serde_json::from_str(&text).expect("a serialized ToolUse decodes");
    assert_eq!(back, u, "the JSON round trip changed the tool use");

    let model = ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("call_1", "probe", args)])),
        Ok(ScriptedModel::text("done")),
    ]);
    let rec = Arc::new(Recorder::default());
    let result = block_on(
        Session::builder(LocalLoop::new(model))
            .handler_arc(rec.clone())
            .run("go"),
    )
    .expect("a session over a scripted model succeeds");
    let calls = rec.calls();
    match &u.input_error {
        Some(_) => {
            assert!(
                calls.is_empty(),
                "a call with undecodable arguments reached the handler"
            );
            let answered = rec.events().iter().any(|e| {
                matches!(&e.kind, EventKind::ToolResult { result }
                    if result.tool_use_id == "call_1" && result.is_error)
            });
            assert!(answered, "the undecodable call was not answered with an error");
        }
        None => {
            assert_eq!(calls.len(), 1, "the call ran {} times", calls.len());
            assert_eq!(calls[0].input, u.input);
        }
    }
    assert_eq!(result.text, "done");
}

/// The tool use every provider must produce for `args` (what `check_tool_arguments` checks):
/// for the other crates' argument paths to compare against.
pub fn expected_tool_use(id: &str, name: &str, args: &str) -> ToolUse {
    ToolUse::from_arguments(id, name, args)
}

#[cfg(feature = "test-util")]
/// A response calling `probe` with `args`, for models that replay one.
pub fn probe_call(args: &str) -> ChatResponse {
    ScriptedModel::tool_calls(&[("call_1", "probe", args)])
}

/// Runs `check` on every file of the committed corpus of fuzz target `target`
/// (`fuzz/corpus/<target>/`, and `fuzz/regressions/<target>/` when it exists), so that the
/// corpora run on every plain `cargo test`, on stable, without libFuzzer. `manifest_dir` is the
/// calling crate's `CARGO_MANIFEST_DIR` (a crate of `crates/`). Every file is checked; the test
/// then fails naming each file whose check panicked. A missing or empty corpus fails too: a
/// replay that checks nothing must not pass.
pub fn replay(manifest_dir: &str, target: &str, check: impl Fn(&[u8]) + std::panic::RefUnwindSafe) {
    let fuzz = std::path::Path::new(manifest_dir).join("../../fuzz");
    let mut files = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(fuzz.join(dir).join(target)) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_file()) {
                files.push(e.path());
            }
        }
    }
    files.sort();
    assert!(
        !files.is_empty(),
        "no corpus for fuzz target `{target}` under {}",
        fuzz.display()
    );
    let mut failed = Vec::new();
    for f in &files {
        let data = std::fs::read(f).unwrap_or_else(|e| panic!("cannot read {}: {e}", f.display()));
        if std::panic::catch_unwind(|| check(&data)).is_err() {
            failed.push(f.display().to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} corpus inputs of `{target}` failed (reproduce one with `cargo +nightly fuzz run {target} <file>` in fuzz/):\n{}",
        failed.len(),
        files.len(),
        failed.join("\n")
    );
}

/// A workspace root for [`check_workspace_call`], made once per process under the temp
/// directory: a few files, and a symlink `escape` to a sibling directory outside the root whose
/// one file holds [`SECRET`].
pub fn workspace_root() -> &'static std::path::Path {
    static ROOT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        remove_dead_roots();
        let base = std::env::temp_dir().join(format!("tether-fuzz-ws-{}", std::process::id()));
        let root = base.join("root");
        let outside = base.join("outside");
        let _ = std::fs::create_dir_all(root.join("sub"));
        let _ = std::fs::create_dir_all(&outside);
        let _ = std::fs::write(root.join("a.txt"), "alpha\nbeta\ngamma\n");
        let _ = std::fs::write(root.join("sub/b.txt"), "one line, no newline");
        let _ = std::fs::write(outside.join("secret.txt"), SECRET);
        #[cfg(unix)]
        {
            let _ = std::os::unix::fs::symlink(&outside, root.join("escape"));
            let _ = std::os::unix::fs::symlink(outside.join("secret.txt"), root.join("secret-link"));
        }
        root.canonicalize().unwrap_or(root)
    })
}

/// Removes the roots [`workspace_root`] made in processes that have ended (nothing removes a
/// root at exit: it lives in a static), so test runs do not pile them up under the temp
/// directory. Linux only (a process is alive while `/proc/<pid>` exists); a pid reused since is
/// taken as alive, and a root that cannot be removed is left.
fn remove_dead_roots() {
    if !cfg!(target_os = "linux") {
        return;
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("tether-fuzz-ws-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// What a file outside the workspace root holds; no workspace tool may ever return it.
pub const SECRET: &str = "TETHER-FUZZ-SECRET-6d2f";

/// How many times `text` holds [`SECRET`], counted by hash rather than by a string search:
/// libFuzzer learns the strings a target compares against, and put the secret into a path
/// argument that the tool's error then echoed (a false alarm, found exactly so). It cannot invert
/// a hash, so it no longer learns the secret at all.
fn secrets_in(text: &str) -> usize {
    fn fnv(b: &[u8]) -> u64 {
        b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
            (h ^ x as u64).wrapping_mul(0x0100_0000_01b3)
        })
    }
    let want = fnv(SECRET.as_bytes());
    text.as_bytes()
        .windows(SECRET.len())
        .filter(|w| fnv(w) == want)
        .count()
}

/// The workspace tools' argument extraction: the first byte picks a tool (or an unknown name),
/// the rest is the model's argument text. The call is decoded as the engine decodes it and, when
/// it decodes, run by a [`crate::workspace::Workspace`] that may read but not write or run
/// commands. Never a panic; a refusal or error is a typed tool error; nothing outside the root
/// (reached through `..`, an absolute path or a symlink) is ever returned.
pub fn check_workspace_call(data: &[u8]) {
    use crate::workspace::{Policy, Workspace};
    const TOOLS: [&str; 7] = [
        "read_file",
        "list_dir",
        "search_files",
        "write_file",
        "edit_file",
        "run_command",
        "no_such_tool",
    ];
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let name = TOOLS[pick as usize % TOOLS.len()];
    let u = ToolUse::from_arguments("call_1", name, &String::from_utf8_lossy(rest));
    if u.input_error.is_some() {
        return;
    }
    let ws = Workspace::new(workspace_root())
        .expect("the fuzz workspace root exists")
        .policy(Policy::read_only());
    let info = SessionInfo::new("fuzz", "fuzz");
    let out = block_on(async {
        tokio::time::timeout(std::time::Duration::from_secs(20), ws.call_tool(&u, &info)).await
    })
    .unwrap_or_else(|_| panic!("`{name}` with {} did not answer within 20 s", u.input));
    let text = match &out {
        ToolOutput::Ok(s) => s,
        ToolOutput::Error(s) => s,
        other => panic!("a workspace tool answered neither Ok nor Error: {other:?}"),
    };
    // The secret may come back only as often as the arguments named it (echoed in an error).
    assert!(
        secrets_in(text) <= secrets_in(&String::from_utf8_lossy(rest)),
        "`{name}` with {} returned a file outside the root",
        u.input
    );
    if matches!(name, "write_file" | "edit_file" | "run_command" | "no_such_tool") {
        assert!(
            matches!(out, ToolOutput::Error(_)),
            "`{name}` succeeded under a policy denying it: {text}"
        );
    }
}
