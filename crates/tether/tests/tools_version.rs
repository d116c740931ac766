//! The engine reads a handler's tools again only when its `tools_version` changes (a list of
//! tens of tools with their schemas costs more to copy than the rest of a turn), and a change
//! reaches the next model request.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde_json::json;
use tether::local::LocalLoop;
use tether::{Handler, ScriptedModel, Session, SessionInfo, ToolOutput, ToolSpec, ToolUse};

/// A handler whose `grow` tool adds a tool `grown` to its list; it counts how often its list is
/// read, and has a version only when `versioned`.
struct Growing {
    versioned: bool,
    list: Mutex<Vec<&'static str>>,
    version: AtomicU64,
    reads: AtomicUsize,
}

impl Growing {
    fn new(versioned: bool) -> Arc<Self> {
        Arc::new(Growing {
            versioned,
            list: Mutex::new(vec!["noop", "grow"]),
            version: AtomicU64::new(0),
            reads: AtomicUsize::new(0),
        })
    }
}

#[async_trait]
impl Handler for Growing {
    fn tools(&self) -> Vec<ToolSpec> {
        self.reads.fetch_add(1, SeqCst);
        self.list
            .lock()
            .unwrap()
            .iter()
            .map(|n| ToolSpec::new(*n, *n, json!({"type": "object"})))
            .collect()
    }
    fn tools_version(&self) -> Option<u64> {
        self.versioned.then(|| self.version.load(SeqCst))
    }
    async fn call_tool(&self, call: &ToolUse, _info: &SessionInfo) -> ToolOutput {
        if call.name == "grow" {
            self.list.lock().unwrap().push("grown");
            // After the new list is readable.
            self.version.fetch_add(1, SeqCst);
        }
        ToolOutput::Ok("ok".into())
    }
}

async fn run(h: Arc<Growing>) -> Vec<Vec<String>> {
    let model = Arc::new(ScriptedModel::new(vec![
        Ok(ScriptedModel::tool_calls(&[("c1", "noop", "{}")])),
        Ok(ScriptedModel::tool_calls(&[("c2", "grow", "{}")])),
        Ok(ScriptedModel::tool_calls(&[("c3", "grown", "{}")])),
        Ok(ScriptedModel::text("done")),
    ]));
    let r = Session::builder(LocalLoop::with_model(model.clone()))
        .handler_arc(h)
        .run("go")
        .await
        .unwrap();
    assert_eq!(r.text, "done");
    model
        .requests()
        .iter()
        .map(|q| q.tools.iter().map(|t| t.name.clone()).collect())
        .collect()
}

#[tokio::test]
async fn a_versioned_list_is_read_again_only_after_its_version_changes() {
    let h = Growing::new(true);
    let declared = run(h.clone()).await;
    assert_eq!(declared.len(), 4);
    assert_eq!(declared[0], ["noop", "grow"]);
    assert_eq!(declared[1], ["noop", "grow"]);
    // `grow` ran in turn 2: turn 3 declares the new list.
    assert_eq!(declared[2], ["noop", "grow", "grown"]);
    assert_eq!(declared[3], ["noop", "grow", "grown"]);
    // Once when the session opened, once after the change: not once a turn.
    assert_eq!(h.reads.load(SeqCst), 2);
}

#[tokio::test]
async fn a_list_without_a_version_is_read_every_turn() {
    let h = Growing::new(false);
    let declared = run(h.clone()).await;
    assert_eq!(declared[1], ["noop", "grow"]);
    assert_eq!(declared[2], ["noop", "grow", "grown"]);
    assert!(h.reads.load(SeqCst) >= 4, "read {} times", h.reads.load(SeqCst));
}
