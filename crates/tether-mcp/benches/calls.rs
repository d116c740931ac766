//! Tool calls per second through a tether session to a local stdio MCP server (a no-op tool),
//! against the same server called directly with rmcp, interleaved in one run.
//!
//! `cargo bench -p tether-mcp --bench calls` (`-- <calls per round> <rounds>`, default 2000 5;
//! `--current-thread` runs both sides on a current-thread runtime; `--batch=8` makes 8 calls at
//! a time on both sides: 8 calls a turn, 8 concurrent direct calls; `--in-task` runs each side
//! as a runtime task instead of on the bench's thread).
//! Each side's rate is printed with the CPU time this process used per call.
//! The server is this binary started with `--server` (rmcp's server side, one `noop` tool, on
//! rmcp's `stdio()`); with `BENCH_SERVER_STDIO=poll` it polls its stdio pipes without blocking
//! instead, as event-loop servers (Node, Python asyncio) do. `BENCH_TOOLS=N` makes it list N
//! tools (the others with a realistic schema), as servers with many tools do.
//!
//! - direct: an rmcp client (rmcp's `TokioChildProcess` transport) calls `noop` N times, one
//!   after another.
//! - session: local-loop sessions of 20 turns whose (in-process, scripted) model asks for one
//!   `noop` call per turn, until N calls: each call goes through the engine (memo lookup, the
//!   record, events), the `WithTools` routing and `McpServer` (in-flight registry, timeout,
//!   result as text, tether's stdio transport). The server stays connected across sessions, as
//!   in `tether serve`.
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

/// jemalloc, the allocator of the programs that run MCP servers for users (`tether run --mcp`,
/// `tether serve`), for both sides alike; the system allocator's figures are in BENCHMARKS.md.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// With the programs' options too (a copy of `tether_serve::JEMALLOC_CONF`, which says why;
/// this crate sits below `tether-serve`).
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: &[u8; 35] = b"dirty_decay_ms:20,muzzy_decay_ms:0\0";

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
        let mut tools = vec![Tool::new("noop", "Does nothing", Arc::new(schema))];
        // `BENCH_TOOLS=N`: N tools in all, the others with a schema of the size real servers
        // declare (a filesystem or an issue tracker's server: a few typed, described arguments).
        let n = tool_count();
        for i in 1..n {
            let serde_json::Value::Object(schema) = json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "The file or directory, relative to the root"},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "description": "At most this many entries"},
                    "mode": {"type": "string", "enum": ["text", "json", "lines"], "description": "How to return the content"},
                    "recursive": {"type": "boolean", "default": false}
                },
                "required": ["path"],
                "additionalProperties": false
            }) else {
                unreachable!()
            };
            tools.push(Tool::new(
                format!("tool_{i}"),
                "Reads or lists something under the root and returns it in the chosen form.",
                Arc::new(schema),
            ));
        }
        Ok(ListToolsResult::with_all_items(tools))
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

/// `BENCH_TOOLS` in the bench's environment, passed to the server as `--tools=N` (an MCP
/// server's environment is not the client's).
fn tool_count() -> usize {
    std::env::args()
        .find_map(|a| a.strip_prefix("--tools=").and_then(|n| n.parse().ok()))
        .or_else(|| std::env::var("BENCH_TOOLS").ok().and_then(|v| v.parse().ok()))
        .unwrap_or(1)
}

fn server_cmd() -> (String, Vec<String>) {
    let exe = std::env::current_exe().expect("the bench's own path");
    (
        exe.display().to_string(),
        vec!["--server".into(), format!("--tools={}", tool_count())],
    )
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
        // A model that keeps no copy of the requests: the direct side pays for none either.
        let model = ScriptedModel::new(script).without_request_log();
        let r = Session::builder(LocalLoop::new(model))
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
            // rmcp's `stdio()` reads and writes through tokio's blocking `Stdin`/`Stdout` (a
            // pool thread per read, woken and parked around every message), as a Rust server on
            // rmcp does. `BENCH_SERVER_STDIO=poll`: the server polls its pipes instead, as
            // event-loop servers (Node, Python asyncio) do.
            let served = if std::env::var("BENCH_SERVER_STDIO").as_deref() == Ok("poll") {
                match nonblocking_stdio() {
                    Ok(io) => Noop.serve(io).await.ok(),
                    Err(e) => {
                        eprintln!("bench server: stdin and stdout must be pipes: {e}");
                        None
                    }
                }
            } else {
                Noop.serve(rmcp::transport::stdio()).await.ok()
            };
            if let Some(s) = served {
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
        Some("session") => {
            println!(
                "session {:.0} calls/s",
                rt.block_on(sessions(n, batch, mcp.clone()))
            );
            return;
        }
        Some("local") => {
            println!(
                "local {:.0} calls/s",
                rt.block_on(sessions(n, batch, local_handler()))
            );
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
    // `--in-task`: each side runs as a task of the runtime (as in a server: `tether serve` runs
    // every session on a runtime task) rather than on the bench's own thread through
    // `block_on` (as `#[tokio::main]` runs a program's main future). Both sides alike.
    let in_task = std::env::args().any(|a| a == "--in-task");
    let run = |f: std::pin::Pin<Box<dyn std::future::Future<Output = f64> + Send>>| -> (f64, f64) {
        let cpu = cpu_ns();
        let rate = if in_task {
            rt.block_on(async { rt.spawn(f).await.expect("the side's task") })
        } else {
            rt.block_on(f)
        };
        (rate, (cpu_ns() - cpu) as f64 / n as f64 / 1000.0)
    };
    let mut ratios = Vec::new();
    let mut cpu_ratios = Vec::new();
    for round in 0..rounds {
        let (d, dc) = run(Box::pin(direct(n, batch)));
        let (s, sc) = run(Box::pin(sessions(n, batch, mcp.clone())));
        let (b, bc) = run(Box::pin(sessions(n, batch, local.clone())));
        let server2 = server.clone();
        let (a, ac) = run(Box::pin(async move { source_alone(n, &server2).await }));
        let ratio = s / d;
        ratios.push(ratio);
        cpu_ratios.push(dc / sc);
        println!(
            "round {round}: direct {d:.0} calls/s ({dc:.0} µs CPU/call), session {s:.0} calls/s ({sc:.0} µs CPU/call) (ratio {ratio:.2}, CPU direct/session {:.2}); the same sessions with an in-process no-op tool {b:.0} calls/s ({bc:.0} µs CPU/call); McpServer::call alone {a:.0} calls/s ({ac:.0} µs CPU/call)",
            dc / sc
        );
    }
    ratios.sort_by(|a, b| a.total_cmp(b));
    cpu_ratios.sort_by(|a, b| a.total_cmp(b));
    println!(
        "median ratio {:.2} (min {:.2}, max {:.2}) over {rounds} rounds of {n} calls; CPU per call direct/session median {:.2} (this process's CPU, not the server's)",
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1],
        cpu_ratios[cpu_ratios.len() / 2]
    );
}

/// Stdin and stdout as non-blocking pipes polled by the runtime (not tokio's blocking-pool
/// `Stdin`/`Stdout`).
fn nonblocking_stdio() -> std::io::Result<(tokio::net::unix::pipe::Receiver, tokio::net::unix::pipe::Sender)>
{
    use std::os::fd::AsFd;
    let stdin = std::io::stdin().as_fd().try_clone_to_owned()?;
    let stdout = std::io::stdout().as_fd().try_clone_to_owned()?;
    Ok((
        tokio::net::unix::pipe::Receiver::from_owned_fd(stdin)?,
        tokio::net::unix::pipe::Sender::from_owned_fd(stdout)?,
    ))
}

/// CPU time this process has used so far, in ns: the sum over its threads of the scheduler's
/// run time (`/proc/self/task/*/schedstat`), finer than `getrusage`'s ticks. The MCP server's
/// own CPU (a child process) is not in it; it does the same work per call on both sides.
fn cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()))
        .sum()
}
