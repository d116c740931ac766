//! The Rust side of the `conformance/agui` harness.
//!
//! Serves every scenario with tether's real local loop (`LocalLoop` over `OpenAiModel`)
//! against `tether_testkit::openai::FakeOpenAi`, one fake server per scenario and variant, on
//! `127.0.0.1`. Prints `PORT=<port>` once listening.
//!
//! Routes:
//! - `POST /agent/{scenario}/{variant}`: the AG-UI endpoint (variant `sse` or `proto`; the
//!   harness sets `Accept` for the proto variant);
//! - `POST /__proto`: JSONL events in, our protobuf frames out (for byte comparison);
//! - `GET /__scenarios`: the scenario names.
//!
//! Exits when its standard input closes (so the harness never leaks it) or after 10 minutes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tether::local::LocalLoop;
use tether::{ChatModel, EventKind, MemoryStore, Session, ToolSet, ToolSpec};
use tether_agui::server::{EndpointOptions, endpoint};
use tether_agui::{AgUiEvent, Encoding, ThreadAgent, Update};
use tether_openai::OpenAiModel;
use tether_testkit::openai::{FakeOpenAi, Reply};

const SCENARIOS: &[&str] = &[
    "text",
    "reasoning",
    "tool",
    "parallel",
    "frontend",
    "state",
    "interrupt",
    "error",
    "two-runs",
    "flaky",
    "dropped",
    "diverged",
    "dropped-tool",
];

fn script(scenario: &str) -> Vec<Reply> {
    match scenario {
        "text" => vec![Reply::text("Hello from tether! How can I help?").usage(12, 9)],
        "reasoning" => vec![
            Reply::text("2 + 2 = 4.")
                .reasoning("The user asks for 2 + 2. That is 4.")
                .usage(10, 20),
        ],
        "tool" => vec![
            Reply::tool_calls(&[("call_add", "add", r#"{"a":2,"b":3}"#)]).with_text("Let me add those."),
            Reply::text("2 + 3 = 5."),
        ],
        "parallel" => vec![
            Reply::tool_calls(&[
                ("call_a", "add", r#"{"a":1,"b":2}"#),
                ("call_b", "add", r#"{"a":10,"b":20}"#),
            ])
            .interleaved(),
            Reply::text("The sums are 3 and 30."),
        ],
        "frontend" => vec![
            Reply::tool_calls(&[("call_confirm", "confirm", r#"{"question":"Deploy now?"}"#)]),
            Reply::text("Deploying, as you confirmed."),
        ],
        "state" => vec![
            Reply::tool_calls(&[("call_t1", "add_task", r#"{"title":"write the release notes"}"#)]),
            Reply::tool_calls(&[("call_t2", "add_task", r#"{"title":"tag v1.0"}"#)]),
            Reply::text("Added both tasks."),
        ],
        "interrupt" => vec![
            Reply::tool_calls(&[("call_del", "delete_file", r#"{"path":"notes.txt"}"#)]),
            Reply::text("Deleted notes.txt."),
        ],
        "error" => vec![Reply::error(
            400,
            "The model `nope` does not exist",
            "model_not_found",
        )],
        "two-runs" => vec![Reply::text("First answer."), Reply::text("Second answer.")],
        // A 503, then the answer: the local loop retries; the client sees one message.
        "flaky" => vec![Reply::server_error(503), Reply::text("Recovered after a 503.")],
        // The stream ends after its first delta, before any finish_reason (a dropped stream as
        // the client sees it: what came before the cut reached it, surely, unlike an abort whose
        // last writes may be lost); the retried call streams the same answer again.
        "dropped" => vec![
            Reply::text("partial answer, then the rest of it.").truncate_after(2),
            Reply::text("partial answer, then the rest of it."),
        ],
        // The stream is cut; the retried call says something else: the partial text is withdrawn.
        "diverged" => vec![
            Reply::text("partial words that will vanish").truncate_after(2),
            Reply::text("after drop complete"),
        ],
        // The stream is cut inside a tool call's arguments; the retried call makes the same call.
        "dropped-tool" => vec![
            Reply::tool_calls(&[("call_add", "add", r#"{"a":2,"b":3}"#)])
                .with_text("Let me add those.")
                .truncate_after(6),
            Reply::tool_calls(&[("call_add", "add", r#"{"a":2,"b":3}"#)]).with_text("Let me add those."),
            Reply::text("2 + 3 = 5."),
        ],
        _ => Vec::new(),
    }
}

fn tools() -> ToolSet {
    ToolSet::new()
        .tool(
            ToolSpec::new(
                "add",
                "Add two integers",
                json!({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"integer"}}}),
            ),
            |input: Value| async move {
                let a = input["a"].as_i64().ok_or("a must be an integer")?;
                let b = input["b"].as_i64().ok_or("b must be an integer")?;
                Ok::<_, &str>((a + b).to_string())
            },
        )
        .tool(
            ToolSpec::new("add_task", "Add a task to the board", json!({"type":"object"})),
            |input: Value| async move {
                let title = input["title"].as_str().ok_or("title is required")?;
                Ok::<_, &str>(json!({"added": title}).to_string())
            },
        )
        .tool(
            ToolSpec::new("delete_file", "Delete a file", json!({"type":"object"})),
            |input: Value| async move {
                let path = input["path"].as_str().ok_or("path is required")?;
                Ok::<_, &str>(format!("deleted {path}"))
            },
        )
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Board {
    #[serde(default)]
    title: String,
    #[serde(default)]
    owner: String,
    #[serde(default)]
    tasks: Vec<String>,
}

fn factory(url: String) -> impl Fn(&tether_agui::RunAgentInput) -> tether::Result<tether::SessionBuilder> {
    move |_input| {
        let model = OpenAiModel::builder(url.clone()).model("fake").build()?;
        let model: Arc<dyn ChatModel> = Arc::new(model);
        Ok(Session::builder(LocalLoop::with_model(model)).handler(tools()))
    }
}

async fn proto_frames(body: Bytes) -> (StatusCode, Vec<u8>) {
    let mut out = Vec::new();
    for line in String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| !l.trim().is_empty())
    {
        match serde_json::from_str::<AgUiEvent>(line) {
            Ok(e) => {
                if Encoding::Protobuf.encode_into(&e, &mut out).is_err() {
                    return (StatusCode::INTERNAL_SERVER_ERROR, Vec::new());
                }
            }
            Err(e) => return (StatusCode::BAD_REQUEST, e.to_string().into_bytes()),
        }
    }
    (StatusCode::OK, out)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut app = Router::new()
        .route("/__proto", post(proto_frames))
        .route("/__scenarios", get(|| async { axum::Json(SCENARIOS) }));
    let mut fakes: HashMap<String, FakeOpenAi> = HashMap::new();
    let options = EndpointOptions::default();
    for scenario in SCENARIOS {
        for variant in ["sse", "proto"] {
            let fake = FakeOpenAi::start().await;
            fake.push_all(script(scenario));
            let path = format!("/agent/{scenario}/{variant}");
            // Each scenario's threads in a store of their own (in memory: the server lives for
            // one harness run).
            let base = ThreadAgent::new(
                "conformance",
                Arc::new(MemoryStore::default()),
                factory(fake.url()),
            );
            app = match *scenario {
                "interrupt" => app.route(
                    &path,
                    endpoint(base.require_approval(["delete_file"]), options.clone()),
                ),
                "state" => app.route(
                    &path,
                    endpoint(
                        base.with_state(|board: &mut Board, u: Update<'_>| {
                            if let Update::Event(ev) = u
                                && let EventKind::ToolResult { result } = &ev.kind
                                && let Ok(v) = serde_json::from_str::<Value>(&result.content)
                                && let Some(t) = v["added"].as_str()
                            {
                                board.tasks.push(t.to_owned());
                                return true;
                            }
                            false
                        }),
                        options.clone(),
                    ),
                ),
                _ => app.route(&path, endpoint(base, options.clone())),
            };
            fakes.insert(path, fake);
        }
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("PORT={}", listener.local_addr()?.port());
    let stop = async {
        // Stop when the harness closes our stdin, or after 10 minutes at most.
        let stdin = tokio::task::spawn_blocking(|| {
            let mut sink = String::new();
            while std::io::stdin()
                .read_line(&mut sink)
                .map(|n| n > 0)
                .unwrap_or(false)
            {
                sink.clear();
            }
        });
        tokio::select! {
            _ = stdin => {}
            _ = tokio::time::sleep(Duration::from_secs(600)) => {}
        }
    };
    axum::serve(listener, app).with_graceful_shutdown(stop).await?;
    drop(fakes);
    Ok(())
}
