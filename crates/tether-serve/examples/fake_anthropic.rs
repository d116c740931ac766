//! The testkit's fake Anthropic Messages API as a process, answering by rule (as
//! `fake_openai`): for each request it picks a testkit [`Reply`] from the conversation, queues it
//! on an in-process `FakeMessages` and relays that server's answer, so `tether serve` can be
//! killed and restarted at any point and the model still answers consistently.
//!
//! `cargo run -p tether-serve --example fake_anthropic` prints `listening on http://127.0.0.1:PORT`
//! (the API origin) and serves until killed. A user message containing "write" gets a streamed
//! `write_file` call (its id derived from the message); a tool result gets a streamed
//! confirmation; anything else is echoed.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Value, json};
use tether_testkit::anthropic::{FakeMessages, Reply, sse_body};

mod relay;

struct App {
    fake: FakeMessages,
    lock: tokio::sync::Mutex<()>,
    client: reqwest::Client,
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// A streamed message whose content is `blocks` (each `(start, deltas)`).
fn stream(blocks: &[(Value, Vec<Value>)], stop: &str) -> Reply {
    let mut ev = vec![json!({"type": "message_start", "message": {
        "id": "msg_fake", "type": "message", "role": "assistant", "model": "fake", "content": [],
        "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 10, "output_tokens": 1}}})];
    for (i, (start, deltas)) in blocks.iter().enumerate() {
        ev.push(json!({"type": "content_block_start", "index": i, "content_block": start}));
        for d in deltas {
            ev.push(json!({"type": "content_block_delta", "index": i, "delta": d}));
        }
        ev.push(json!({"type": "content_block_stop", "index": i}));
    }
    ev.push(
        json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null},
        "usage": {"output_tokens": 5}}),
    );
    ev.push(json!({"type": "message_stop"}));
    Reply::Sse(sse_body(&ev))
}

fn text(t: &str) -> Reply {
    let deltas = t
        .as_bytes()
        .chunks(4)
        .map(|c| json!({"type": "text_delta", "text": String::from_utf8_lossy(c)}))
        .collect();
    stream(&[(json!({"type": "text", "text": ""}), deltas)], "end_turn")
}

fn choose(body: &Value) -> Reply {
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let last = msgs.last().cloned().unwrap_or(Value::Null);
    // The last user turn: plain text, or blocks (text, tool_result).
    let blocks: Vec<Value> = match last.get("content") {
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(a)) => a.clone(),
        _ => Vec::new(),
    };
    if let Some(r) = blocks.iter().find(|b| b["type"] == "tool_result") {
        let said = match &r["content"] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        return text(&format!("Done: the tool said {}", said.trim()));
    }
    let said: String = blocks.iter().filter_map(|b| b["text"].as_str()).collect();
    if said.contains("write") {
        let id = format!("toolu_{:016x}", fnv(&said));
        let input = json!({"path": "hello.txt", "content": "hello from claude\n"}).to_string();
        return stream(
            &[
                (
                    json!({"type": "text", "text": ""}),
                    vec![json!({"type": "text_delta", "text": "Writing it."})],
                ),
                (
                    json!({"type": "tool_use", "id": id, "name": "write_file", "input": {}}),
                    vec![json!({"type": "input_json_delta", "partial_json": input})],
                ),
            ],
            "tool_use",
        );
    }
    text(&format!("You said: {said}"))
}

/// Queues the reply this request gets and sends the request to the fake, which takes the reply
/// before it answers: one request at a time between the two, so replies and requests pair up.
async fn forward(app: Arc<App>, headers: HeaderMap, body: Bytes) -> reqwest::Result<reqwest::Response> {
    let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let reply = choose(&parsed);
    let _guard = app.lock.lock().await;
    app.fake.push(reply);
    let mut req = app
        .client
        .post(format!("{}/v1/messages", app.fake.url()))
        .body(body);
    for (k, v) in headers.iter() {
        if k == "host" || k == "content-length" {
            continue;
        }
        req = req.header(k.as_str(), v.as_bytes());
    }
    req.send().await
}

async fn handle(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    relay::relay(forward(app, headers, body)).await
}

#[tokio::main]
async fn main() {
    let app = Arc::new(App {
        fake: FakeMessages::start(Vec::new()).await,
        lock: tokio::sync::Mutex::new(()),
        client: reqwest::Client::new(),
    });
    let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("fake_anthropic: cannot bind 127.0.0.1:0: {e}");
            std::process::exit(1);
        }
    };
    let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    println!("listening on http://{addr}");
    let router = axum::Router::new()
        .route("/v1/messages", axum::routing::post(handle))
        .with_state(app);
    if let Err(e) = axum::serve(listener, router).await {
        eprintln!("fake_anthropic: {e}");
    }
}
