//! What the tests share: the pinned reference server, the fault server, and waiting on tools.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tether_mcp::{McpServer, ServerConfig, Transport};
use tokio::io::AsyncBufReadExt;

pub use tether_testkit::peers::mcp_everything_server as everything_js;

/// Generous: the reference server is node, on a shared machine.
pub const LONG: Duration = Duration::from_secs(60);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The stdio transport of the reference server.
pub fn everything_stdio() -> Transport {
    Transport::Stdio {
        command: "node".into(),
        args: vec![everything_js().display().to_string(), "stdio".into()],
        env: Vec::new(),
        cwd: None,
    }
}

/// The reference server over streamable HTTP on 127.0.0.1 (a free port), killed when dropped.
pub struct HttpEverything {
    pub child: tokio::process::Child,
    pub url: String,
}

pub async fn everything_http() -> HttpEverything {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().unwrap().port()
    };
    let mut child = tokio::process::Command::new("node")
        .arg(everything_js())
        .arg("streamableHttp")
        .env("PORT", port.to_string())
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("node runs");
    let stderr = child.stderr.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    tokio::time::timeout(LONG, async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if l.contains("listening on port") {
                return;
            }
        }
        panic!("the reference server ended before listening");
    })
    .await
    .expect("the reference server listens");
    // Keep draining its stderr so it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    HttpEverything {
        child,
        url: format!("http://127.0.0.1:{port}/mcp"),
    }
}

/// The fault server example (built by `cargo test -p tether-mcp`, which builds examples).
pub fn fault_server_path() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let p = dir.join("examples").join("fault_server");
    assert!(
        p.exists(),
        "the fault server is not built at {}: run `cargo build -p tether-mcp --example fault_server` (plain `cargo test -p tether-mcp` builds it)",
        p.display()
    );
    p
}

pub fn fault(env: &[(&str, &str)]) -> Transport {
    Transport::Stdio {
        command: fault_server_path().display().to_string(),
        args: Vec::new(),
        env: env.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect(),
        cwd: None,
    }
}

/// Waits until the server lists every tool in `names` (the reference server registers some
/// after the handshake and says so with `list_changed`).
pub async fn wait_for_tools(s: &McpServer, names: &[&str]) {
    use tether::source::ToolSource;
    let mut rx = s.tools_changed();
    tokio::time::timeout(LONG, async {
        loop {
            let have: Vec<String> = s.tools().into_iter().map(|t| t.name).collect();
            if names.iter().all(|n| have.iter().any(|h| h == n)) {
                return;
            }
            rx.changed().await.expect("the server is alive");
        }
    })
    .await
    .unwrap_or_else(|_| {
        let have: Vec<String> = s.tools().into_iter().map(|t| t.name).collect();
        panic!("tools {names:?} never listed; have {have:?}")
    });
}

pub async fn connect(name: &str, t: Transport) -> McpServer {
    McpServer::connect(ServerConfig::new(name, t))
        .await
        .expect("the server starts")
}
