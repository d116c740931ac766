//! A tether thread service on Restate, for the tests and for trying the backend by hand.
//!
//! ```text
//! tether-restate-demo --listen 127.0.0.1:9080 --admin http://127.0.0.1:9070 \
//!     --model-url http://127.0.0.1:8080/v1 --effects effects.log
//! ```
//!
//! It serves the `TetherThread` virtual object on `--listen` (HTTP/2), registers itself with the
//! Restate admin API at `--admin` (as `http://<listen>`), and runs turns with the local loop over
//! the OpenAI-compatible model at `--model-url`; a thread's record is its object's state in
//! Restate (agent `demo`).
//! Its tools append a line to the `--effects` file each time they run (so a test can count
//! effects by invocation): `append_line {"text"}`, and `guarded_append {"text"}`, which needs
//! approval. It prints `ready` on stdout once registered.
//!
//! With `--live 127.0.0.1:PORT` it also serves every turn's events as they happen (token deltas
//! included) at `GET /live/{thread}` as server-sent events, one `data: <event JSON>` each: the
//! out-of-band stream. Unauthenticated: for loopback only.
//!
//! With `--shared-record <connection string>` the threads' records are kept in that PostgreSQL
//! database instead of the object state (see `tether_restate::shared`).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};
use tether::{Handler, SessionInfo, ToolOutput, ToolSpec, ToolUse};
use tether_restate::TetherThread;

struct Args {
    listen: String,
    admin: String,
    model_url: String,
    effects: PathBuf,
    live: Option<String>,
    shared: Option<String>,
}

fn args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let (mut listen, mut admin, mut model_url, mut effects) = (None, None, None, None);
    let (mut live, mut shared) = (None, None);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--listen" => listen = Some(value),
            "--admin" => admin = Some(value),
            "--model-url" => model_url = Some(value),
            "--effects" => effects = Some(value),
            "--live" => live = Some(value),
            "--shared-record" => shared = Some(value),
            other => return Err(format!("unknown option {other}")),
        }
    }
    let need = |v: Option<String>, name: &str| v.ok_or_else(|| format!("{name} is required"));
    Ok(Args {
        listen: need(listen, "--listen")?,
        admin: need(admin, "--admin")?,
        model_url: need(model_url, "--model-url")?,
        effects: PathBuf::from(need(effects, "--effects")?),
        live,
        shared,
    })
}

/// Tools whose effect is a line appended to a file.
struct Effects {
    path: PathBuf,
}

impl Effects {
    fn append(&self, call: &ToolUse) -> ToolOutput {
        let text = call.input.get("text").and_then(Value::as_str).unwrap_or("");
        if text.contains('\n') || text.len() > 1024 {
            return ToolOutput::Error("text must be one line of at most 1024 bytes".into());
        }
        let line = format!("{} {} {text}\n", call.name, call.id);
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .and_then(|mut f| f.write_all(line.as_bytes()).and_then(|()| f.sync_data()));
        match written {
            Ok(()) => ToolOutput::Ok(format!("appended {text}")),
            Err(e) => ToolOutput::Error(format!("could not append: {e}")),
        }
    }
}

#[async_trait]
impl Handler for Effects {
    fn tools(&self) -> Vec<ToolSpec> {
        let schema =
            json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]});
        vec![
            ToolSpec::new(
                "append_line",
                "Appends a line to the effects file.",
                schema.clone(),
            ),
            ToolSpec::new(
                "guarded_append",
                "Appends a line, once a person approves.",
                schema,
            ),
        ]
    }

    async fn call_tool(&self, call: &ToolUse, _info: &SessionInfo) -> ToolOutput {
        match call.name.as_str() {
            "append_line" | "guarded_append" => self.append(call),
            _ => ToolOutput::Error("unknown tool".into()),
        }
    }

    fn needs_approval(&self, call: &ToolUse) -> Option<String> {
        (call.name == "guarded_append").then(|| "append a line to the effects file".to_owned())
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tether-restate-demo: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let model = match tether_openai::OpenAiModel::builder(&args.model_url)
        .model("fake-model")
        .build()
    {
        Ok(m) => Arc::new(m),
        Err(e) => {
            eprintln!("tether-restate-demo: bad model url: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let listener = match tokio::net::TcpListener::bind(&args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("tether-restate-demo: cannot listen on {}: {e}", args.listen);
            return std::process::ExitCode::FAILURE;
        }
    };
    let mut thread = TetherThread::new("demo", model, Arc::new(Effects { path: args.effects }));
    if let Some(connection) = &args.shared {
        match tether_restate::SharedRecord::connect(connection).await {
            Ok(record) => thread = thread.shared_record(record),
            Err(e) => {
                eprintln!("tether-restate-demo: the shared record: {e}");
                return std::process::ExitCode::FAILURE;
            }
        }
    }
    if let Some(addr) = &args.live {
        let (tx, _) = tokio::sync::broadcast::channel(4096);
        let live = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("tether-restate-demo: cannot listen on {addr}: {e}");
                return std::process::ExitCode::FAILURE;
            }
        };
        tokio::spawn(serve_live(live, tx.clone()));
        thread = thread.live(tx);
    }
    let server = tokio::spawn(tether_restate::serve(thread, listener));
    let uri = format!("http://{}", args.listen);
    if let Err(e) = tether_restate::register(&args.admin, &uri, Duration::from_secs(60)).await {
        eprintln!("tether-restate-demo: {e}");
        return std::process::ExitCode::FAILURE;
    }
    println!("ready");
    let _ = std::io::stdout().flush();
    let _ = server.await;
    std::process::ExitCode::SUCCESS
}

/// `GET /live/{thread}`: the thread's events as they happen, as server-sent events.
async fn serve_live(
    listener: tokio::net::TcpListener,
    tx: tokio::sync::broadcast::Sender<tether_restate::LiveEvent>,
) {
    use axum::extract::{Path, State};
    use axum::response::IntoResponse;
    async fn live(
        State(tx): State<tokio::sync::broadcast::Sender<tether_restate::LiveEvent>>,
        Path(thread): Path<String>,
    ) -> axum::response::Response {
        let rx = tx.subscribe();
        let stream = futures_util::stream::unfold(rx, move |mut rx| {
            let thread = thread.clone();
            async move {
                loop {
                    match rx.recv().await {
                        Ok(e) if e.thread.as_str() == thread => {
                            let json = serde_json::to_string(&e.event).unwrap_or_default();
                            let chunk = bytes::Bytes::from(format!("data: {json}\n\n"));
                            return Some((Ok::<_, std::io::Error>(chunk), rx));
                        }
                        Ok(_) => continue,
                        // A subscriber too slow for the channel ends its stream; it reads the rest
                        // from the record.
                        Err(_) => return None,
                    }
                }
            }
        });
        (
            [
                ("content-type", "text/event-stream"),
                ("cache-control", "no-cache"),
            ],
            axum::body::Body::from_stream(stream),
        )
            .into_response()
    }
    let app = axum::Router::new()
        .route("/live/{thread}", axum::routing::get(live))
        .with_state(tx);
    if let Err(e) = axum::serve(listener, app).await {
        eprintln!("tether-restate-demo: the live route stopped: {e}");
    }
}
