//! A traced run calling a real MCP server (`tether-mcp`'s fault server over stdio): the tool's
//! `execute_tool` span carries the MCP attributes, and the server receives the span's context
//! in the request's `params._meta.traceparent`.

mod bins;
mod common;

use common::{Receiver, one};
use serde_json::{Value, json};
use tether::Session;
use tether::local::LocalLoop;
use tether::source::{SourceOptions, ToolSources, WithTools};
use tether_mcp::{McpServer, ServerConfig, Transport};
use tether_testkit::openai::{FakeOpenAi, Reply};

async fn fault_server() -> McpServer {
    let path = tokio::task::spawn_blocking(bins::fault_server)
        .await
        .expect("build");
    let t = Transport::Stdio {
        command: path.display().to_string(),
        args: Vec::new(),
        env: Vec::new(),
        cwd: None,
    };
    McpServer::connect(ServerConfig::new("faults", t))
        .await
        .expect("the fault server starts")
}

async fn run(
    traced: Option<&tether_otel::Tracer>,
    fake: &FakeOpenAi,
    server: &McpServer,
) -> tether::SessionResult {
    fake.push(Reply::tool_calls(&[("m1", "meta", "{}")]));
    fake.push(Reply::text("done"));
    let sources = ToolSources::new()
        .add(server.clone(), SourceOptions::new("faults"))
        .expect("sources");
    let model = tether_openai::OpenAiModel::builder(fake.url())
        .model("m")
        .build()
        .expect("model");
    let mut b = Session::builder(LocalLoop::new(model))
        .handler(WithTools::new(tether::NoTools, sources).expect("handler"));
    if let Some(t) = traced {
        b = b.observer(t.observer());
    }
    let r = b.run("call meta").await.expect("run");
    assert_eq!(r.text, "done");
    r
}

/// What the server answered: the `_meta` it received.
fn meta_seen(r: &tether::SessionResult) -> Value {
    let text = r
        .events
        .iter()
        .find_map(|e| match &e.kind {
            tether::EventKind::ToolResult { result } => Some(result.content.clone()),
            _ => None,
        })
        .expect("the tool's result");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_server_receives_the_tool_span_as_meta_traceparent() {
    let rx = Receiver::start().await;
    let t = common::telemetry(&rx, false);
    let tracer = t.tracer().agent_name("helper").with_dispatch(t.dispatch());
    let server = fault_server().await;
    let fake = FakeOpenAi::start().await;
    let r = run(Some(&tracer), &fake, &server).await;
    tokio::task::block_in_place(|| t.flush());
    let spans = rx.wait_spans("the run's spans", |s| s.len() >= 4).await;
    let tool = one(&spans, "execute_tool meta");
    let run = one(&spans, "invoke_agent helper");
    assert_eq!(tool.parent, run.span_id);
    assert_eq!(tool.attr("mcp.method.name"), Some(&json!("tools/call")));
    assert_eq!(tool.attr("mcp.server.name"), Some(&json!("faults")));
    assert_eq!(tool.attr("network.transport"), Some(&json!("pipe")));
    assert!(
        tool.attr("mcp.protocol.version")
            .and_then(Value::as_str)
            .is_some_and(|v| !v.is_empty()),
        "{tool:#?}"
    );
    let meta = meta_seen(&r);
    assert_eq!(
        meta["traceparent"],
        json!(format!("00-{}-{}-01", tool.trace_id, tool.span_id)),
        "the server got the tool span's context: {meta}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untraced_run_sends_no_traceparent_to_an_mcp_server() {
    let server = fault_server().await;
    let fake = FakeOpenAi::start().await;
    let r = run(None, &fake, &server).await;
    let meta = meta_seen(&r);
    assert!(meta.get("traceparent").is_none(), "{meta}");
}
