//! Helpers shared by the `tether serve` tests: a temp dir with a workspace, the testkit's fake
//! OpenAI server, the server on 127.0.0.1:0, and HTTP clients (reqwest, and raw sockets for
//! requests a normal client will not send: a forged `Host`, a body trickled byte by byte).

#![allow(dead_code)]

pub mod restate;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};
use tether_serve::{Config, Server, ServerOptions};
use tether_testkit::openai::FakeOpenAi;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Generous: something that must happen, on a loaded 2-core machine.
pub const PATIENCE: Duration = Duration::from_secs(60);

pub struct Env {
    pub dir: tempfile::TempDir,
    pub fake: FakeOpenAi,
    /// The Restate node this suite's turns run on (`TETHER_SERVE_BACKEND=restate`).
    pub restate: Option<restate::Restate>,
    /// The records' database (`TETHER_RESTATE_RECORD=shared`).
    pub postgres: Option<tether_testkit::postgres::Postgres>,
}

impl Env {
    pub async fn new() -> Env {
        Env {
            dir: tempfile::tempdir().unwrap(),
            fake: FakeOpenAi::start().await,
            restate: if restate::enabled() {
                Some(restate::Restate::start().await)
            } else {
                None
            },
            postgres: restate::postgres().await,
        }
    }

    /// One agent, `main`, with the workspace tools over `ws/` and an `append_line` command tool;
    /// `extra` is appended (more tools, a [server] table...).
    pub fn config(&self, extra: &str) -> Config {
        self.config_with("", extra)
    }

    /// As [`Env::config`], with `server` as the `[server]` table's body.
    pub fn config_with(&self, server: &str, extra: &str) -> Config {
        let ws = self.ws();
        std::fs::create_dir_all(&ws).unwrap();
        let backend = self
            .restate
            .as_ref()
            .map(|r| r.server_lines())
            .unwrap_or_default();
        let shared = restate::shared_lines(self.postgres.as_ref());
        let text = format!(
            "\n[server]\n{backend}{shared}{server}\n{}{extra}\n",
            agent_main(&self.fake.url(), &ws)
        );
        Config::parse(&text, "test.toml", self.dir.path()).unwrap()
    }

    pub async fn start(&self, config: Config, token: Option<&str>) -> Server {
        tether_serve::start(
            ServerOptions::new(config, "127.0.0.1:0", self.dir.path().join("tether.db"))
                .with_token(token.map(str::to_owned)),
        )
        .await
        .unwrap()
    }

    pub fn ws(&self) -> std::path::PathBuf {
        self.dir.path().join("ws")
    }
}

/// The agent every test configures: `main`, on the model at `model_url` (the fake), with the
/// workspace tools over `ws` and an `append_line` command tool (no approval) that appends
/// `<tool-use id> <line>` to `log.txt`: one line per invocation.
pub fn agent_main(model_url: &str, ws: &std::path::Path) -> String {
    format!(
        r#"[agents.main]
base_url = "{model_url}"
model = "fake"
system_prompt = "be brief"
[agents.main.workspace]
root = "{ws}"
[[agents.main.commands]]
name = "append_line"
description = "Append a line to log.txt"
command = 'printf "%s %s\n" "$TETHER_TOOL_USE_ID" "$TETHER_ARG_LINE" >> log.txt'
"#,
        ws = ws.display()
    )
}

/// A command tool that needs approval and appends its tool-use id to the file its `name`
/// argument names: one line per invocation.
pub const TOUCH: &str = r#"
[[agents.main.commands]]
name = "touch_file"
description = "Create a file"
command = 'printf "%s\n" "$TETHER_TOOL_USE_ID" >> "$TETHER_ARG_NAME"'
parameters = { type = "object", properties = { name = { type = "string" } }, required = ["name"] }
approve = true
"#;

/// Asserts that a `GET /v1/threads/{id}/events` answer's events are numbered 1, 2, 3… without a
/// gap and that no event id occurs twice.
pub fn assert_gapless(v: &Value) {
    let events = v["events"].as_array().expect("events");
    let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap_or(0)).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>(), "gapless: {v}");
    let mut ids: Vec<&str> = events.iter().map(|e| e["id"].as_str().unwrap_or("")).collect();
    ids.sort_unstable();
    let n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), n, "an event id twice: {v}");
}

pub fn client() -> reqwest::Client {
    reqwest::Client::new()
}

pub fn input(thread: &str, run: &str, messages: Value) -> Value {
    json!({"threadId": thread, "runId": run, "messages": messages, "tools": [], "context": [], "state": {}, "forwardedProps": {}})
}

pub fn user(id: &str, text: &str) -> Value {
    json!([{"id": id, "role": "user", "content": text}])
}

/// POSTs a run and returns the response (any status).
pub async fn post_run(server: &Server, agent: &str, body: &Value, token: Option<&str>) -> reqwest::Response {
    let mut req = client()
        .post(format!("http://{}/v1/agents/{agent}/run", server.addr()))
        .header("accept", "text/event-stream")
        .json(body);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    req.send().await.unwrap()
}

/// POSTs a run and returns its decoded SSE events (asserting 200).
pub async fn run(server: &Server, agent: &str, body: &Value, token: Option<&str>) -> Vec<Value> {
    let resp = post_run(server, agent, body, token).await;
    assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    sse_events(&resp.text().await.unwrap())
}

/// The `data:` payloads of an SSE body.
pub fn sse_events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|frame| frame.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

pub fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

pub fn text_of(events: &[Value]) -> String {
    events
        .iter()
        .filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT")
        .map(|e| e["delta"].as_str().unwrap())
        .collect()
}

/// A run's body whose one message is the user's `prompt`, with id `{thread}-u1` (the same on
/// every request of the thread, so a resume re-sends it as the browser does).
pub fn prompt_input(thread: &str, run: &str, prompt: &str) -> Value {
    input(
        thread,
        run,
        json!([{"id": format!("{thread}-u1"), "role": "user", "content": prompt}]),
    )
}

/// `body` answering interrupt `id` with `payload` (`{"approved": true}`, an elicitation answer).
pub fn with_resume(mut body: Value, id: &Value, payload: Value) -> Value {
    body["resume"] = json!([{"interruptId": id, "status": "resolved", "payload": payload}]);
    body
}

/// POSTs a run to agent `agent` of the server at `addr`: the status and the whole body.
pub async fn post_at(addr: SocketAddr, agent: &str, body: &Value) -> (u16, String) {
    let resp = client()
        .post(format!("http://{addr}/v1/agents/{agent}/run"))
        .header("accept", "text/event-stream")
        .json(body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// POSTs a run to `addr` and returns its decoded SSE events (asserting 200).
pub async fn run_at(addr: SocketAddr, agent: &str, body: &Value) -> Vec<Value> {
    let (status, text) = post_at(addr, agent, body).await;
    assert_eq!(status, 200, "{text}");
    sse_events(&text)
}

/// The one interrupt a run ended with (asserting it ended with exactly one).
pub fn interrupt_of(events: &[Value]) -> Value {
    let fin = last(events);
    assert_eq!(fin["type"], "RUN_FINISHED", "{events:?}");
    assert_eq!(fin["outcome"]["type"], "interrupt", "{fin}");
    let list = fin["outcome"]["interrupts"].as_array().unwrap();
    assert_eq!(list.len(), 1, "{fin}");
    list[0].clone()
}

/// Asserts the run finished without an interrupt.
pub fn finished_ok(events: &[Value]) {
    let fin = last(events);
    assert_eq!(fin["type"], "RUN_FINISHED", "{events:?}");
    assert_ne!(fin["outcome"]["type"], "interrupt", "{fin}");
}

/// The `TOOL_CALL_RESULT` event of tool call `id`, if the run has one.
pub fn result_of<'a>(events: &'a [Value], id: &str) -> Option<&'a Value> {
    events
        .iter()
        .find(|e| e["type"] == "TOOL_CALL_RESULT" && e["toolCallId"] == id)
}

#[allow(unused_imports)] // not every test binary uses every helper
pub use tether_testkit::peers::{mcp_everything_server as everything_js, repo_root};

pub fn last(events: &[Value]) -> &Value {
    events.last().unwrap()
}

pub async fn get(server: &Server, path: &str) -> (u16, Value) {
    get_with(server, path, None).await
}

pub async fn get_with(server: &Server, path: &str, token: Option<&str>) -> (u16, Value) {
    let mut req = client().get(format!("http://{}{path}", server.addr()));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let r = req.send().await.unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

/// A response read off a raw socket.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

/// Sends `head` (request line and headers, without the blank line; `Connection: close` is added)
/// and `body` as one write on a new connection, as curl would, and reads the whole answer.
pub async fn raw(addr: SocketAddr, head: &str, body: &str) -> RawResponse {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut buf))
        .await
        .expect("the server answered")
        .unwrap();
    parse_response(&buf)
}

/// Parses a complete HTTP/1.1 response (a chunked body is de-chunked).
pub fn parse_response(buf: &[u8]) -> RawResponse {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    let n = match resp.parse(buf).unwrap() {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => panic!("partial response: {}", String::from_utf8_lossy(buf)),
    };
    let headers: Vec<(String, String)> = resp
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_ascii_lowercase(),
                String::from_utf8_lossy(h.value).into_owned(),
            )
        })
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let raw_body = &buf[n..];
    let body = if chunked {
        let mut out = Vec::new();
        let mut rest = raw_body;
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let size = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap().trim(), 16).unwrap();
            if size == 0 {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
            rest = &rest[eol + 2 + size + 2..];
        }
        out
    } else {
        raw_body.to_vec()
    };
    RawResponse {
        status: resp.code.unwrap(),
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// A request whose body is sent later, piece by piece: the head goes out with
/// `Expect: 100-continue`, and [`Trickle::wait_reading`] returns once the server answered
/// `100 Continue`, which hyper sends when the handler starts reading the body.
pub struct Trickle {
    pub stream: TcpStream,
}

impl Trickle {
    pub async fn open(addr: SocketAddr, head: &str, content_length: usize) -> Trickle {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let req = format!(
            "{head}\r\nContent-Length: {content_length}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(req.as_bytes()).await.unwrap();
        Trickle { stream }
    }

    /// Waits for `100 Continue` (the handler is reading the body).
    pub async fn wait_reading(&mut self) {
        let mut got = Vec::new();
        let mut b = [0u8; 1];
        tokio::time::timeout(PATIENCE, async {
            while !got.ends_with(b"\r\n\r\n") {
                let n = self.stream.read(&mut b).await.unwrap();
                assert!(
                    n > 0,
                    "closed before 100 Continue: {}",
                    String::from_utf8_lossy(&got)
                );
                got.push(b[0]);
            }
        })
        .await
        .expect("100 Continue");
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 100"), "{text}");
    }

    /// Sends `bytes` of the body.
    pub async fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await
    }

    /// Reads the answer to its end (what arrived before a reset counts: a server that answers
    /// before reading the whole body may reset the connection after its answer).
    pub async fn response(self) -> RawResponse {
        self.drip_until_answered(None).await
    }

    /// Sends one more byte of the body every `every` (if given) until the server answers, and
    /// reads that answer.
    pub async fn drip_until_answered(self, every: Option<Duration>) -> RawResponse {
        let (mut rd, mut wr) = self.stream.into_split();
        let mut buf = Vec::new();
        let mut tmp = [0u8; 4096];
        let mut tick = tokio::time::interval(every.unwrap_or(Duration::from_secs(3600)));
        tick.tick().await;
        let mut dripping = every.is_some();
        let deadline = tokio::time::sleep(PATIENCE);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                r = rd.read(&mut tmp) => match r {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        buf.extend_from_slice(&tmp[..n]);
                        dripping = false;
                    }
                },
                _ = tick.tick(), if dripping => {
                    if wr.write_all(b" ").await.is_err() {
                        dripping = false;
                    }
                }
                () = &mut deadline => panic!("no answer within {PATIENCE:?}: {}", String::from_utf8_lossy(&buf)),
            }
        }
        parse_response(&buf)
    }
}

/// The head of a run request for `agent` with `Host: host`.
pub fn run_head(agent: &str, host: &str, extra: &str) -> String {
    let mut h = format!(
        "POST /v1/agents/{agent}/run HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nAccept: text/event-stream"
    );
    if !extra.is_empty() {
        h.push_str("\r\n");
        h.push_str(extra);
    }
    h
}
