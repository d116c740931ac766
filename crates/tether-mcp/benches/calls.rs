//! Tool calls per second through a tether session to a local stdio MCP server (a no-op tool),
//! against the same server called directly with rmcp, interleaved in one run.
//!
//! `cargo bench -p tether-mcp --bench calls` (`-- <calls per round> <rounds>`, default 2000 5).
//! The server is this binary started with `--server` (rmcp's server side, one `noop` tool).
//!
//! - direct: an rmcp client calls `noop` N times, one after another.
//! - session: a local-loop session whose (in-process, scripted) model asks for one `noop` call
//!   per turn, N turns: each call goes through the engine (memo lookup, the record, events), the
//!   `WithTools` routing and `McpServer` (in-flight registry, timeout, result as text).

use std::sync::Arc;
use std::time::Instant;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ErrorData, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig as McpServerInfo, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ServerHandler, ServiceExt};
use serde_json::json;
use tether::local::LocalLoop;
use tether::source::{SourceOptions, ToolSources, WithTools};
use tether::{ScriptedModel, Session};
use tether_mcp::{McpServer, ServerConfig, Transport};

#[derive(Clone)]
struct Noop;

impl ServerHandler for Noop {
    fn get_info(&self) -> McpServerInfo {
        McpServerInfo::new(
            serde_json::from_value::<ServerCapabilities>(json!({"tools": {}})).unwrap_or_default(),
        )
    }
    async fn list_tools(
        &self,
        _r: Option<PaginatedRequestParams>,
        _c: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let serde_json::Value::Object(schema) = json!({"type": "object"}) else {
            unreachable!()
        };
        Ok(ListToolsResult::with_all_items(vec![Tool::new(
            "noop",
            "Does nothing",
            Arc::new(schema),
        )]))
    }
    async fn call_tool(
        &self,
        _r: CallToolRequestParams,
        _c: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let r: CallToolResult = serde_json::from_value(json!({"content": [{"type": "text", "text": "ok"}]}))
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        Ok(r.into())
    }
}

fn server_cmd() -> (String, Vec<String>) {
    let exe = std::env::current_exe().expect("the bench's own path");
    (exe.display().to_string(), vec!["--server".into()])
}

async fn direct(n: usize) -> f64 {
    let (cmd, args) = server_cmd();
    let mut c = tokio::process::Command::new(cmd);
    c.args(args);
    let transport = rmcp::transport::TokioChildProcess::new(c).expect("spawn");
    let client = ().serve(transport).await.expect("handshake");
    let t = Instant::now();
    for i in 0..n {
        let mut args = serde_json::Map::new();
        args.insert("i".into(), json!(i));
        let r = client
            .peer()
            .call_tool(CallToolRequestParams::new("noop").with_arguments(args))
            .await
            .expect("call");
        assert!(!r.content.is_empty());
    }
    let rate = n as f64 / t.elapsed().as_secs_f64();
    let _ = client.cancel().await;
    rate
}

async fn session(n: usize) -> f64 {
    let (command, args) = server_cmd();
    let server = McpServer::connect(ServerConfig::new(
        "bench",
        Transport::Stdio {
            command,
            args,
            env: Vec::new(),
            cwd: None,
        },
    ))
    .await
    .expect("connect");
    let sources = ToolSources::new()
        .add(server, SourceOptions::new("bench"))
        .unwrap();
    let mut script: Vec<tether::Result<tether::ChatResponse>> = (0..n)
        .map(|i| {
            let id = format!("c{i}");
            let a = format!("{{\"i\":{i}}}");
            Ok(ScriptedModel::tool_calls(&[(id.as_str(), "noop", a.as_str())]))
        })
        .collect();
    script.push(Ok(ScriptedModel::text("done")));
    let model = ScriptedModel::new(script);
    let t = Instant::now();
    let r = Session::builder(LocalLoop::new(model))
        .handler(WithTools::new(tether::NoTools, sources).unwrap())
        .max_turns(n as u32 + 2)
        .run("go")
        .await
        .expect("the session runs");
    let rate = n as f64 / t.elapsed().as_secs_f64();
    assert_eq!(r.text, "done");
    assert_eq!(r.tool_uses.len(), n);
    rate
}

fn main() {
    if std::env::args().any(|a| a == "--server") {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            if let Ok(s) = Noop.serve(rmcp::transport::stdio()).await {
                let _ = s.waiting().await;
            }
        });
        return;
    }
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let n: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(2000);
    let rounds: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(5);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut ratios = Vec::new();
    for round in 0..rounds {
        let d = rt.block_on(direct(n));
        let s = rt.block_on(session(n));
        let ratio = s / d;
        ratios.push(ratio);
        println!("round {round}: direct {d:.0} calls/s, session {s:.0} calls/s, ratio {ratio:.2}");
    }
    ratios.sort_by(|a, b| a.total_cmp(b));
    println!(
        "median ratio {:.2} (min {:.2}, max {:.2}) over {rounds} rounds of {n} calls",
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1]
    );
}
