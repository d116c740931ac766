//! The testkit's fake OpenAI server as a process, answering by rule instead of by a fixed queue
//! (so a test can kill and restart `tether serve` at any point and the model still answers
//! consistently): for each request it picks a testkit [`Reply`] from the conversation, queues it
//! on an in-process `FakeOpenAi` and relays that server's answer.
//!
//! `cargo run -p tether-serve --example fake_openai -- <mode>` prints
//! `listening on http://127.0.0.1:PORT/v1` and serves until killed. Modes:
//! - `ui`: a user message containing "write" gets a `write_file` call (with reasoning); a tool
//!   result gets a streamed confirmation; anything else is echoed.
//! - `crash`: a user message gets an `append_line` call whose id is derived from the message; a
//!   tool result gets a slowly streamed confirmation.
//! - `bench N`: every request gets N one-character content deltas. This mode serves the testkit's
//!   `FakeOpenAi` itself (no front, no lock: every reply is the same, so a task only keeps its
//!   script topped up) and prints that server's URL, so a benchmark measures the fake, not a
//!   proxy that serialises request starts.
//! - `tools K N`: a tool-heavy turn for the benchmark: while the conversation holds fewer than K
//!   tool results, the reply is one call of the workspace tool `read_file` (of `bench-<k>.txt`,
//!   id `call_<k>`); then N one-character content deltas. Chosen per request from the conversation
//!   (no queue, no lock), so any number of runs at once each get the same script.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::Response;
use serde_json::Value;
use tether_testkit::openai::{FakeOpenAi, Reply};

mod relay;

struct App {
    fake: FakeOpenAi,
    mode: String,
    lock: tokio::sync::Mutex<()>,
    client: reqwest::Client,
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

fn choose(app: &App, body: &Value) -> Reply {
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let last = msgs.last().cloned().unwrap_or(Value::Null);
    let role = last.get("role").and_then(Value::as_str).unwrap_or("");
    let content = last
        .get("content")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    match (app.mode.as_str(), role) {
        ("crash", "user") => {
            let id = format!("call_{:016x}", fnv(&content));
            let args = serde_json::json!({"line": content}).to_string();
            Reply::tool_calls(&[(id.as_str(), "append_line", args.as_str())])
        }
        ("crash", _) => Reply::text(format!("Appended the line; the tool said: {}", content.trim()))
            .chunk_chars(2)
            .pace(Duration::from_millis(3)),
        (_, "user") if content.contains("write") => {
            let id = format!("call_write_{}", msgs.len());
            Reply::tool_calls(&[(
                id.as_str(),
                "write_file",
                r#"{"path":"hello.txt","content":"hello from tether\n"}"#,
            )])
            .reasoning("The user wants a file; writing needs their approval.")
        }
        (_, "tool") => Reply::text("Done: I wrote hello.txt for you.").chunk_chars(4),
        _ => Reply::text(format!("You said: {content}")).chunk_chars(4),
    }
}

/// Queues the reply this request gets and sends the request to the fake, which takes the reply
/// before it answers: one request at a time between the two, so replies and requests pair up.
async fn forward(app: Arc<App>, body: Bytes) -> reqwest::Result<reqwest::Response> {
    let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let reply = choose(&app, &parsed);
    let _guard = app.lock.lock().await;
    app.fake.push(reply);
    app.client
        .post(format!("{}/chat/completions", app.fake.url()))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
}

async fn handle(State(app): State<Arc<App>>, body: Bytes) -> Response {
    relay::relay(forward(app, body)).await
}

/// Replies queued ahead of the requests in bench mode; refilled when half are used.
const BENCH_AHEAD: usize = 8192;

/// Bench mode: the testkit's server answers directly; a task keeps its script full (the replies
/// are clones sharing one encoded body, so queueing many costs a few hundred bytes each).
async fn bench(reply: Reply) {
    let fake = match FakeOpenAi::try_start().await {
        Ok(f) => f,
        Err(e) => {
            eprintln!("fake_openai: cannot bind 127.0.0.1:0: {e}");
            std::process::exit(1);
        }
    };
    fake.push_all(std::iter::repeat_n(reply.clone(), BENCH_AHEAD));
    println!("listening on {}", fake.url());
    loop {
        tokio::time::sleep(Duration::from_millis(2)).await;
        let left = fake.remaining();
        if left < BENCH_AHEAD / 2 {
            fake.push_all(std::iter::repeat_n(reply.clone(), BENCH_AHEAD - left));
        }
    }
}

/// One OpenAI stream chunk (`data: ...` and its blank line) with this `delta` and finish reason.
fn sse_chunk(out: &mut Vec<u8>, delta: Value, finish: Option<&str>) {
    let chunk = serde_json::json!({
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "bench",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
    });
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(chunk.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// The `tools K N` mode's script: the stream bodies, encoded once.
struct Tools {
    calls: usize,
    /// The closing text: N one-character deltas.
    text: Bytes,
}

impl Tools {
    fn new(calls: usize, n: usize) -> Tools {
        let mut out = Vec::with_capacity(n * 130 + 512);
        sse_chunk(
            &mut out,
            serde_json::json!({"role": "assistant", "content": ""}),
            None,
        );
        for _ in 0..n {
            sse_chunk(&mut out, serde_json::json!({"content": "x"}), None);
        }
        sse_chunk(&mut out, serde_json::json!({}), Some("stop"));
        out.extend_from_slice(b"data: [DONE]\n\n");
        Tools {
            calls,
            text: Bytes::from(out),
        }
    }

    /// The stream answering a conversation holding `done` tool results.
    fn body(&self, done: usize) -> Bytes {
        if done >= self.calls {
            return self.text.clone();
        }
        let mut out = Vec::with_capacity(768);
        let call = serde_json::json!({"tool_calls": [{
            "index": 0, "id": format!("call_{done}"), "type": "function",
            "function": {"name": "read_file", "arguments": format!(r#"{{"path":"bench-{done}.txt"}}"#)}
        }]});
        sse_chunk(&mut out, call, None);
        sse_chunk(&mut out, serde_json::json!({}), Some("tool_calls"));
        out.extend_from_slice(b"data: [DONE]\n\n");
        Bytes::from(out)
    }
}

async fn tools_handle(State(tools): State<Arc<Tools>>, body: Bytes) -> Response {
    let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let done = parsed
        .get("messages")
        .and_then(Value::as_array)
        .map(|m| {
            m.iter()
                .filter(|m| m.get("role").and_then(Value::as_str) == Some("tool"))
                .count()
        })
        .unwrap_or(0);
    let mut out = Response::new(Body::from(tools.body(done)));
    out.headers_mut().insert(
        "content-type",
        axum::http::HeaderValue::from_static("text/event-stream"),
    );
    out
}

async fn listen() -> tokio::net::TcpListener {
    match tokio::net::TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("fake_openai: cannot bind 127.0.0.1:0: {e}");
            std::process::exit(1);
        }
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().cloned().unwrap_or_else(|| "ui".into());
    let arg = |i: usize| args.get(i).and_then(|s| s.parse().ok());
    if mode == "bench" {
        let n = arg(1).unwrap_or(1000);
        return bench(Reply::long_text(n, "x")).await;
    }
    if mode == "tools" {
        let tools = Arc::new(Tools::new(arg(1).unwrap_or(20), arg(2).unwrap_or(1000)));
        let listener = listen().await;
        let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
        println!("listening on http://{addr}/v1");
        let router = axum::Router::new()
            .route("/v1/chat/completions", axum::routing::post(tools_handle))
            .route("/v1/models", axum::routing::get(|| async { "{}" }))
            .with_state(tools);
        if let Err(e) = axum::serve(listener, router).await {
            eprintln!("fake_openai: {e}");
        }
        return;
    }
    let app = Arc::new(App {
        fake: FakeOpenAi::start().await,
        mode,
        lock: tokio::sync::Mutex::new(()),
        client: reqwest::Client::new(),
    });
    let listener = listen().await;
    let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    println!("listening on http://{addr}/v1");
    let router = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(handle))
        .with_state(app);
    if let Err(e) = axum::serve(listener, router).await {
        eprintln!("fake_openai: {e}");
    }
}
