//! Tool calls per second through a tether session to a local stdio MCP server (a no-op tool),
//! against the same server called directly with rmcp, interleaved in one run.
//!
//! `cargo bench -p tether-mcp --bench calls` (`-- <calls per round> <rounds>`, default 2000 5;
//! `--current-thread` runs both sides on a current-thread runtime; `--batch=8` makes 8 calls at
//! a time on both sides: 8 calls a turn, 8 concurrent direct calls).
//! The server is this binary started with `--server` (rmcp's server side, one `noop` tool).
//!
//! - direct: an rmcp client calls `noop` N times, one after another.
//! - session: local-loop sessions of 20 turns whose (in-process, scripted) model asks for one
//!   `noop` call per turn, until N calls: each call goes through the engine (memo lookup, the
//!   record, events), the `WithTools` routing and `McpServer` (in-flight registry, timeout,
//!   result as text). The server stays connected across sessions, as in `tether serve`.
//! - the same sessions with an in-process no-op tool: the engine's own cost per call.

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

async fn direct(n: usize, batch: usize) -> f64 {
    let (cmd, args) = server_cmd();
    let mut c = tokio::process::Command::new(cmd);
    c.args(args);
    let transport = rmcp::transport::TokioChildProcess::new(c).expect("spawn");
    // The protocol version tether speaks, so both sides run the same protocol.
    let mut info = rmcp::model::ClientConfig::default();
    info.protocol_version = rmcp::model::ProtocolVersion::V_2025_11_25;
    let client = info.serve(transport).await.expect("handshake");
    let t = Instant::now();
    let mut i = 0;
    while i < n {
        let k = batch.min(n - i);
        let calls = (i..i + k).map(|j| {
            let mut args = serde_json::Map::new();
            args.insert("i".into(), json!(j));
            client
                .peer()
                .call_tool(CallToolRequestParams::new("noop").with_arguments(args))
        });
        for r in futures_util::future::join_all(calls).await {
            assert!(!r.expect("call").content.is_empty());
        }
        i += k;
    }
    let rate = n as f64 / t.elapsed().as_secs_f64();
    let _ = client.cancel().await;
    rate
}

/// Calls per session: one call a turn, so the transcript each turn carries stays short (a
/// session's history grows with its turns; 1,000 turns in one session measure the history).
const PER_SESSION: usize = 20;

async fn sessions(n: usize, batch: usize, handler: Arc<dyn tether::Handler>) -> f64 {
    let t = Instant::now();
    let mut done = 0;
    while done < n {
        let k = (PER_SESSION * batch).min(n - done);
        let turns: Vec<Vec<(String, String)>> = (0..k)
            .map(|i| (format!("c{i}"), format!("{{\"i\":{}}}", done + i)))
            .collect::<Vec<_>>()
            .chunks(batch)
            .map(<[_]>::to_vec)
            .collect();
        let mut script: Vec<tether::Result<tether::ChatResponse>> = turns
            .iter()
            .map(|calls| {
                let calls: Vec<(&str, &str, &str)> = calls
                    .iter()
                    .map(|(id, a)| (id.as_str(), "noop", a.as_str()))
                    .collect();
                Ok(ScriptedModel::tool_calls(&calls))
            })
            .collect();
        script.push(Ok(ScriptedModel::text("done")));
        let r = Session::builder(LocalLoop::new(ScriptedModel::new(script)))
            .handler_arc(handler.clone())
            .max_turns(turns.len() as u32 + 2)
            .run("go")
            .await
            .expect("the session runs");
        assert_eq!(r.text, "done");
        assert_eq!(r.tool_uses.len(), k);
        done += k;
    }
    n as f64 / t.elapsed().as_secs_f64()
}

async fn mcp_handler() -> (Arc<dyn tether::Handler>, McpServer) {
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
        .add(server.clone(), SourceOptions::new("bench"))
        .unwrap();
    (
        Arc::new(WithTools::new(tether::NoTools, sources).unwrap()),
        server,
    )
}

/// The source alone (no session): `McpServer::call` in a loop, as the engine would call it.
async fn source_alone(n: usize, server: &McpServer) -> f64 {
    use tether::source::{CallContext, ToolSource};
    let t = Instant::now();
    for i in 0..n {
        let cx = CallContext::new(tether::SessionInfo::new("s", "bench"), Arc::new(tether::NoTools));
        let out = server
            .call(
                &tether::ToolUse::new(format!("c{i}"), "noop", json!({"i": i})),
                cx,
            )
            .await;
        assert_eq!(out, tether::ToolOutput::Ok("ok".into()));
    }
    n as f64 / t.elapsed().as_secs_f64()
}

/// The same sessions with an in-process no-op tool: what the engine itself costs per call.
fn local_handler() -> Arc<dyn tether::Handler> {
    Arc::new(tether::ToolSet::new().tool(
        tether::ToolSpec::new("noop", "Does nothing", json!({"type": "object"})),
        |_| async { Ok::<_, String>("ok".to_owned()) },
    ))
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
    // `--batch=B`: B calls at a time on both sides (B calls a turn; B concurrent direct calls).
    let batch: usize = std::env::args()
        .find_map(|a| a.strip_prefix("--batch=").and_then(|b| b.parse().ok()))
        .unwrap_or(1usize)
        .max(1);
    let n: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(2000);
    let rounds: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(5);
    // `--current-thread`: every task on one thread (no cross-thread wake-ups on either side).
    let rt = if std::env::args().any(|a| a == "--current-thread") {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let (mcp, server) = rt.block_on(mcp_handler());
    // `--only=direct` / `--only=source`: one side alone (for a profiler).
    match std::env::args()
        .find_map(|a| a.strip_prefix("--only=").map(str::to_owned))
        .as_deref()
    {
        Some("direct") => {
            println!("direct {:.0} calls/s", rt.block_on(direct(n, batch)));
            return;
        }
        Some("source") => {
            println!(
                "McpServer::call alone {:.0} calls/s",
                rt.block_on(source_alone(n, &server))
            );
            return;
        }
        _ => {}
    }
    let local = local_handler();
    let mut ratios = Vec::new();
    for round in 0..rounds {
        let d = rt.block_on(direct(n, batch));
        let s = rt.block_on(sessions(n, batch, mcp.clone()));
        let b = rt.block_on(sessions(n, batch, local.clone()));
        let a = rt.block_on(source_alone(n, &server));
        let ratio = s / d;
        ratios.push(ratio);
        println!(
            "round {round}: direct {d:.0} calls/s, session {s:.0} calls/s (ratio {ratio:.2}); the same sessions with an in-process no-op tool {b:.0} calls/s; McpServer::call alone {a:.0} calls/s"
        );
    }
    ratios.sort_by(|a, b| a.total_cmp(b));
    println!(
        "median ratio {:.2} (min {:.2}, max {:.2}) over {rounds} rounds of {n} calls",
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1]
    );
}
