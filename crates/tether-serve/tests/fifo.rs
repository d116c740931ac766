//! The real `tether-serve` binary against hostile workspace contents: a FIFO read by a tool must
//! neither hang the run nor stop SIGTERM from ending the server within its shutdown grace, and a
//! command tool runs confined. Also: the binary's allocator options.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tether_testkit::openai::{FakeOpenAi, Reply};

const TOKEN: &str = "fifo-test-token";

struct Served {
    child: Child,
    addr: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the binary on `config` with a 2 s grace and waits for its "listening on" line.
fn serve(dir: &Path, config: &str) -> Served {
    let cfg = dir.join("tether.toml");
    std::fs::write(&cfg, config).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tether-serve"))
        .arg("--config")
        .arg(&cfg)
        .args([
            "--bind",
            "127.0.0.1:0",
            "--token",
            TOKEN,
            "--shutdown-grace",
            "2",
            "--db",
        ])
        .arg(dir.join("t.db"))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tether-serve starts");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listening on http://").nth(1) {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_owned());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("tether-serve says where it listens");
    Served { child, addr }
}

async fn run(addr: &str, thread: &str) -> Vec<Value> {
    let body = json!({"threadId": thread, "runId": "r1", "messages": [{"id": "u1", "role": "user", "content": "go"}],
        "tools": [], "context": [], "state": {}, "forwardedProps": {}});
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/agents/main/run"))
        .bearer_auth(TOKEN)
        .header("accept", "text/event-stream")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.text()
        .await
        .unwrap()
        .split("\n\n")
        .filter_map(|f| f.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn results(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["type"] == "TOOL_CALL_RESULT")
        .map(|e| e["content"].as_str().unwrap_or_default().to_owned())
        .collect()
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_stops_the_server_within_its_grace_after_a_fifo_read() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[
        ("c1", "read_file", r#"{"path":"pipe"}"#),
        ("c2", "search_files", r#"{"pattern":"needle"}"#),
    ]));
    fake.push(Reply::text("not a file"));
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    mkfifo(&ws.join("pipe"));
    std::fs::write(ws.join("a.txt"), "needle\n").unwrap();
    let config = format!(
        "[agents.main]\nbase_url = \"{}\"\nmodel = \"m\"\n[agents.main.workspace]\nroot = \"{}\"\n",
        fake.url(),
        ws.display()
    );
    let mut served = serve(dir.path(), &config);
    // The old code blocked a thread in open(2) on the FIFO: the run never ended by itself.
    let events = tokio::time::timeout(Duration::from_secs(60), run(&served.addr, "t1"))
        .await
        .expect("the run ends");
    let r = results(&events);
    assert!(r.iter().any(|c| c.contains("pipe is a FIFO")), "{r:?}");
    assert!(r.iter().any(|c| c.contains("a.txt:1: needle")), "{r:?}");
    assert_eq!(events.last().unwrap()["type"], "RUN_FINISHED");

    let pid = served.child.id() as libc::pid_t;
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let start = Instant::now();
    // The grace is 2 s; a stuck blocking thread kept the old server alive for ever.
    let status = loop {
        if let Some(s) = served.child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > Duration::from_secs(30) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let status = status.expect("tether-serve did not stop after SIGTERM");
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_command_tool_runs_confined() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[("c1", "probe", r#"{"name":"x"}"#)]));
    fake.push(Reply::text("done"));
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let config = format!(
        r#"[agents.main]
base_url = "{url}"
model = "m"
[agents.main.workspace]
root = "{ws}"
[[agents.main.commands]]
name = "probe"
command = '''echo "$TETHER_ARG_NAME" > inside.txt; touch {out}/pwned || echo no-write; bash -c 'echo > /dev/tcp/127.0.0.1/{port}' || echo no-net'''
"#,
        url = fake.url(),
        ws = ws.display(),
        out = outside.path().display(),
    );
    let _served = serve(dir.path(), &config);
    let events = tokio::time::timeout(Duration::from_secs(60), run(&_served.addr, "t2"))
        .await
        .expect("the run ends");
    let r = results(&events);
    assert!(
        r.iter().any(|c| c.contains("no-write") && c.contains("no-net")),
        "{r:?}"
    );
    assert_eq!(std::fs::read_to_string(ws.join("inside.txt")).unwrap(), "x\n");
    assert!(!outside.path().join("pwned").exists());
}

/// The binary's compiled-in jemalloc options take effect (a misnamed symbol would be linked and
/// silently ignored): freed pages go back after 20 ms, and the environment still overrides them.
#[test]
fn the_allocator_options_are_read_and_the_environment_overrides_them() {
    let decay = |conf: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_tether-serve"))
            .arg("--help")
            .env("_RJEM_MALLOC_CONF", conf)
            .output()
            .expect("tether-serve --help");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        let opt = |name: &str| {
            err.lines()
                .find(|l| l.trim_start().starts_with(name))
                .map(|l| l.trim().to_owned())
                .unwrap_or_else(|| panic!("no {name} in jemalloc's statistics: {err}"))
        };
        (opt("opt.dirty_decay_ms:"), opt("opt.muzzy_decay_ms:"))
    };
    let (dirty, muzzy) = decay("stats_print:true");
    assert!(dirty.starts_with("opt.dirty_decay_ms: 20 "), "{dirty}");
    assert!(muzzy.starts_with("opt.muzzy_decay_ms: 0 "), "{muzzy}");
    let (dirty, _) = decay("stats_print:true,dirty_decay_ms:10000");
    assert!(dirty.starts_with("opt.dirty_decay_ms: 10000 "), "{dirty}");
}
