//! Remote loops get the same tree as the local loop: Claude Managed Agents (the testkit's fake,
//! over real HTTP) and an ACP agent (the `@agentclientprotocol/sdk` example agent, a real node
//! process).

mod bins;
mod common;

use std::path::PathBuf;

use async_trait::async_trait;
use common::{CLIENT, ERROR, INTERNAL, Receiver, Span, named, one};
use serde_json::json;
use tether::{
    Handler, PermissionOutcome, PermissionRequest, Session, SessionInfo, ToolOutput, ToolSpec, ToolUse,
};
use tether_acp::{AcpAgent, AgentCommand};
use tether_anthropic::{ClientConfig, ManagedAgents, ManagedConfig};
use tether_otel::{Telemetry, Tracer};
use tether_testkit::managed::{FakeManaged, ManagedFaults};

fn telemetry(rx: &Receiver) -> (Telemetry, Tracer) {
    let t = common::telemetry(rx, false);
    let tracer = t.tracer().agent_name("helper").with_dispatch(t.dispatch());
    (t, tracer)
}

/// Checks the tree every provider shares: one request span (the root, of `kind`) with the model
/// calls and tool calls as its children, the conventions' operation names, and `provider`.
fn assert_tree(spans: &[Span], kind: i32, provider: &str, chats: usize) -> (Span, Vec<Span>, Vec<Span>) {
    let run = one(spans, "invoke_agent helper").clone();
    assert_eq!(run.parent, "");
    assert_eq!(run.kind, kind);
    assert_eq!(run.attr("gen_ai.operation.name"), Some(&json!("invoke_agent")));
    assert_eq!(run.attr("gen_ai.provider.name"), Some(&json!(provider)));
    let chat: Vec<Span> = spans
        .iter()
        .filter(|s| s.attr("gen_ai.operation.name") == Some(&json!("chat")))
        .cloned()
        .collect();
    let tools: Vec<Span> = spans
        .iter()
        .filter(|s| s.attr("gen_ai.operation.name") == Some(&json!("execute_tool")))
        .cloned()
        .collect();
    assert_eq!(chat.len(), chats, "{spans:#?}");
    assert_eq!(spans.len(), 1 + chat.len() + tools.len(), "{spans:#?}");
    for s in chat.iter().chain(&tools) {
        assert_eq!(s.trace_id, run.trace_id);
        assert_eq!(s.parent, run.span_id, "{} is not a child of the run", s.name);
        assert!(s.start >= run.start && s.end <= run.end);
    }
    for c in &chat {
        assert_eq!(c.kind, CLIENT);
        assert_eq!(c.attr("gen_ai.provider.name"), Some(&json!(provider)));
    }
    for t in &tools {
        assert_eq!(t.kind, INTERNAL);
        assert!(t.name.starts_with("execute_tool "), "{}", t.name);
    }
    (run, chat, tools)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_managed_agents_run_has_the_same_tree() {
    let rx = Receiver::start().await;
    let (t, tracer) = telemetry(&rx);
    let turns = vec![
        vec![
            json!({"type": "span.model_request_start"}),
            json!({"type": "agent.thinking", "thinking": "Two tools."}),
            json!({"type": "span.model_request_end", "model_usage": {"input_tokens": 10, "output_tokens": 5}}),
            json!({"type": "agent.custom_tool_use", "name": "ok_tool", "input": {"x": 1}}),
            json!({"type": "agent.custom_tool_use", "name": "bad_tool", "input": {}}),
            json!({"type": "session.status_idle", "stop_reason": {"type": "requires_action"}}),
        ],
        vec![
            json!({"type": "span.model_request_start"}),
            json!({"type": "agent.message", "content": [{"type": "text", "text": "done"}]}),
            json!({"type": "span.model_request_end", "model_usage": {"input_tokens": 20, "output_tokens": 7}}),
            json!({"type": "session.status_idle", "stop_reason": {"type": "end_turn"}}),
        ],
    ];
    let fake = FakeManaged::start(turns, ManagedFaults::default()).await;
    let provider = ManagedAgents::new(ManagedConfig::new(
        ClientConfig::new("sk-test").base_url(fake.url()),
        "agent_1",
        "env_1",
    ))
    .expect("provider");
    let result = Session::builder(provider)
        .handler(common::tools())
        .observer(tracer.agent_id("agent_1").observer())
        .run("use the tools")
        .await
        .expect("run");
    assert_eq!(result.text, "done");
    tokio::task::block_in_place(|| t.flush());
    let spans = rx.wait_spans("the managed run's spans", |s| s.len() >= 5).await;
    let (run, mut chat, tools) = assert_tree(&spans, CLIENT, "anthropic", 2);
    assert_eq!(run.attr("gen_ai.agent.id"), Some(&json!("agent_1")));
    assert_eq!(
        run.attr("gen_ai.conversation.id"),
        Some(&json!(result.session_id))
    );
    assert_eq!(
        run.attr("gen_ai.usage.input_tokens"),
        Some(&json!(result.usage.input_tokens))
    );
    assert_eq!(
        run.attr("gen_ai.usage.output_tokens"),
        Some(&json!(result.usage.output_tokens))
    );
    chat.sort_by_key(|c| c.start);
    assert_eq!(chat[0].attr("gen_ai.usage.input_tokens"), Some(&json!(10)));
    assert_eq!(chat[1].attr("gen_ai.usage.output_tokens"), Some(&json!(7)));
    let ok = one(&spans, "execute_tool ok_tool");
    let bad = one(&spans, "execute_tool bad_tool");
    assert_eq!(tools.len(), 2);
    assert_eq!(ok.attr("gen_ai.tool.type"), Some(&json!("function")));
    assert_eq!(ok.status, 0);
    assert_eq!(bad.attr("error.type"), Some(&json!("tool_error")));
    assert_eq!(bad.status, ERROR);
    assert!(chat[0].end <= ok.start && ok.end <= chat[1].start);
}

fn example_agent() -> PathBuf {
    let p = bins::repo_root()
        .join("conformance/acp/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js");
    // The judge must be there: a missing one fails the test (scripts/test installs it).
    assert!(
        p.exists(),
        "the ACP example agent is not installed at {}: run conformance/acp/setup.sh",
        p.display()
    );
    p
}

/// Allows what the agent asks permission for.
struct Allow;

#[async_trait]
impl Handler for Allow {
    fn tools(&self) -> Vec<ToolSpec> {
        Vec::new()
    }

    async fn call_tool(&self, _call: &ToolUse, _info: &SessionInfo) -> ToolOutput {
        ToolOutput::Error("no local tools".into())
    }

    async fn request_permission(&self, req: &PermissionRequest, _info: &SessionInfo) -> PermissionOutcome {
        match req.options.iter().find(|o| o.id == "allow") {
            Some(o) => PermissionOutcome::Selected {
                option_id: o.id.clone(),
            },
            None => PermissionOutcome::Cancelled,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acp_run_has_the_same_tree_with_its_approval_visible() {
    let agent_js = example_agent();
    let rx = Receiver::start().await;
    let (t, tracer) = telemetry(&rx);
    let root = tempfile::tempdir().expect("tempdir");
    let agent = AcpAgent::new(AgentCommand::new("node").arg(agent_js), root.path());
    let mut session = Session::builder(agent)
        .handler(Allow)
        .observer(tracer.observer())
        .open()
        .await
        .expect("open");
    let result = session.send("hello").await.expect("prompt");
    assert!(result.text.contains("successfully updated"), "{}", result.text);
    let _ = session.close().await;
    tokio::task::block_in_place(|| t.flush());
    let spans = rx
        .wait_spans("the ACP run's spans", |s| {
            s.iter().any(|s| s.name == "invoke_agent helper")
        })
        .await;
    let (run, mut chat, tools) = assert_tree(&spans, CLIENT, "acp", 3);
    assert_eq!(
        run.attr("gen_ai.conversation.id"),
        Some(&json!(result.session_id))
    );
    let read = one(&spans, "execute_tool Reading project files");
    let edit = one(&spans, "execute_tool Modifying critical configuration file");
    assert_eq!(tools.len(), 2);
    for (s, id) in [(read, "call_1"), (edit, "call_2")] {
        assert_eq!(s.attr("gen_ai.tool.call.id"), Some(&json!(id)));
        assert_eq!(s.attr("gen_ai.tool.type"), Some(&json!("extension")));
        assert_eq!(s.status, 0, "{s:#?}");
    }
    // The edit waited for an approval: asked and answered, on its span.
    let names: Vec<&str> = edit.events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["tether.approval_requested", "tether.approval_answered"],
        "{edit:#?}"
    );
    assert_eq!(
        edit.events[1].1.get("tether.approval.outcome"),
        Some(&json!("allow"))
    );
    // Model output, tool, model output, tool, model output.
    chat.sort_by_key(|c| c.start);
    assert!(chat[0].end <= read.start && read.end <= chat[1].start);
    assert!(chat[1].end <= edit.start && edit.end <= chat[2].start);
    assert!(named(&spans, "chat").len() == 3);
}
