//! A small MCP server on rmcp's server side (stdio), for faults no reference server produces on
//! demand. Its tools:
//!
//! - `noop`: answers `ok` (the benchmark's tool).
//! - `echo {text}`: answers `$FAULT_TAG` and the text (also the name two servers share in the collision tests).
//! - `count`: appends a line to `$FAULT_COUNT_FILE` and answers how many lines it holds (a side
//!   effect a resume must not repeat).
//! - `crash`: the process exits in the middle of the call; why is written on its stderr 300 ms
//!   later, by a process it left behind.
//! - `hang`: never answers (and, if `$FAULT_HANG_ALL` is set, stops reading: a hung server).
//! - `malformed`: writes a line that is not JSON-RPC to stdout, then answers `after garbage`.
//! - `grow`: adds the tool `grown` and sends `notifications/tools/list_changed`.
//! - `slow {secs}`: sends a progress notification, then sleeps; its cancellation is written to
//!   `$FAULT_CANCEL_FILE` when the client cancels it.
//! - `meta`: answers the request's `_meta` as JSON (what a traced client propagates).
//!
//! `FAULT_PREFIX` prefixes every tool name; `FAULT_FAIL_START=1` exits before the handshake
//! after writing to stderr (a server that never starts).

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ErrorData, ListToolsResult,
    PaginatedRequestParams, ProgressNotificationParam, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ServerHandler, ServiceExt};
use serde_json::{Value, json};

#[derive(Clone, Default)]
struct Fault {
    grown: Arc<AtomicBool>,
}

fn tool(name: &str, desc: &str, props: Value) -> Tool {
    let schema = json!({"type": "object", "properties": props});
    let Value::Object(m) = schema else { unreachable!() };
    let prefix = std::env::var("FAULT_PREFIX").unwrap_or_default();
    Tool::new(format!("{prefix}{name}"), desc.to_owned(), Arc::new(m))
}

fn text(t: impl Into<String>) -> Result<CallToolResponse, ErrorData> {
    let r: CallToolResult = serde_json::from_value(json!({"content": [{"type": "text", "text": t.into()}]}))
        .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
    Ok(r.into())
}

impl ServerHandler for Fault {
    fn get_info(&self) -> ServerConfig {
        let caps: ServerCapabilities =
            serde_json::from_value(json!({"tools": {"listChanged": true}})).unwrap_or_default();
        ServerConfig::new(caps)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let mut tools = vec![
            tool("noop", "Does nothing", json!({})),
            tool("echo", "Echoes text", json!({"text": {"type": "string"}})),
            tool("count", "Counts its calls in a file", json!({})),
            tool("crash", "Exits mid-call", json!({})),
            tool("hang", "Never answers", json!({})),
            tool("malformed", "Writes garbage to stdout", json!({})),
            tool("grow", "Adds a tool", json!({})),
            tool("slow", "Sleeps", json!({"secs": {"type": "number"}})),
            tool("meta", "Answers the request's _meta", json!({})),
        ];
        if self.grown.load(Ordering::SeqCst) {
            tools.push(tool("grown", "Added by grow", json!({})));
        }
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let prefix = std::env::var("FAULT_PREFIX").unwrap_or_default();
        let name = request
            .name
            .strip_prefix(prefix.as_str())
            .unwrap_or(&request.name)
            .to_owned();
        let args = request.arguments.unwrap_or_default();
        match name.as_str() {
            "noop" => text("ok"),
            // rmcp hands the request's `_meta` to the handler in the context.
            "meta" => text(
                serde_json::to_value(&context.meta)
                    .unwrap_or_default()
                    .to_string(),
            ),
            "echo" => text(format!(
                "{}{}",
                std::env::var("FAULT_TAG").unwrap_or_default(),
                args.get("text").and_then(Value::as_str).unwrap_or("")
            )),
            "count" => {
                let path = std::env::var("FAULT_COUNT_FILE")
                    .map_err(|_| ErrorData::internal_error("FAULT_COUNT_FILE unset", None))?;
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
                let _ = writeln!(f, "called");
                let n = std::fs::read_to_string(&path)
                    .map(|s| s.lines().count())
                    .unwrap_or(0);
                text(format!("count {n}"))
            }
            "crash" => {
                // Its last words come from a process it leaves behind, 300 ms after it exited
                // (as a wrapper's child may write them): the client sees the connection end
                // before the stderr that says why, and must wait for that stderr to end.
                let _ = std::process::Command::new("sh")
                    .args(["-c", "sleep 0.3; echo 'fault_server: crashing on purpose' >&2"])
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .spawn();
                std::process::exit(3);
            }
            "hang" => {
                if std::env::var_os("FAULT_HANG_ALL").is_some() {
                    // A hung process: it stops serving anything (pings included).
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                }
                std::future::pending::<()>().await;
                text("unreachable")
            }
            "malformed" => {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(b"this is not json-rpc {{{\n");
                let _ = out.flush();
                text("after garbage")
            }
            "grow" => {
                self.grown.store(true, Ordering::SeqCst);
                if let Err(e) = context.peer.notify_tool_list_changed().await {
                    eprintln!("fault_server: list_changed not sent: {e}");
                }
                text("grown")
            }
            "slow" => {
                let secs = args.get("secs").and_then(Value::as_f64).unwrap_or(60.0);
                if let Some(token) = context.meta.get_progress_token() {
                    let p: ProgressNotificationParam = serde_json::from_value(json!({
                        "progressToken": token, "progress": 1, "total": 2, "message": "started"
                    }))
                    .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
                    let _ = context.peer.notify_progress(p).await;
                }
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_secs_f64(secs)) => text("slept"),
                    _ = context.ct.cancelled() => {
                        if let Ok(path) = std::env::var("FAULT_CANCEL_FILE") {
                            let _ = std::fs::write(path, "cancelled");
                        }
                        text("cancelled")
                    }
                }
            }
            other => Err(ErrorData::invalid_params(format!("no tool {other}"), None)),
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    if std::env::var_os("FAULT_FAIL_START").is_some() {
        eprintln!("fault_server: refusing to start: FAULT_FAIL_START is set");
        std::process::exit(2);
    }
    let service = match Fault::default().serve(rmcp::transport::stdio()).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fault_server: {e}");
            std::process::exit(1);
        }
    };
    let _ = service.waiting().await;
}
