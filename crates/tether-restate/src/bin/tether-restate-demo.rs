//! A tether thread service on Restate, for the tests and for trying the backend by hand.
//!
//! ```text
//! tether-restate-demo --listen 127.0.0.1:9080 --admin http://127.0.0.1:9070 \
//!     --model-url http://127.0.0.1:8080/v1 --db threads.db --effects effects.log
//! ```
//!
//! It serves the `TetherThread` virtual object on `--listen` (HTTP/2), registers itself with the
//! Restate admin API at `--admin` (as `http://<listen>`), and runs turns with the local loop over
//! the OpenAI-compatible model at `--model-url`, recording threads in the SQLite file `--db`.
//! Its tools append a line to the `--effects` file each time they run (so a test can count
//! effects by invocation): `append_line {"text"}`, and `guarded_append {"text"}`, which needs
//! approval. It prints `ready` on stdout once registered.

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
    db: PathBuf,
    effects: PathBuf,
}

fn args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let (mut listen, mut admin, mut model_url, mut db, mut effects) = (None, None, None, None, None);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--listen" => listen = Some(value),
            "--admin" => admin = Some(value),
            "--model-url" => model_url = Some(value),
            "--db" => db = Some(value),
            "--effects" => effects = Some(value),
            other => return Err(format!("unknown option {other}")),
        }
    }
    let need = |v: Option<String>, name: &str| v.ok_or_else(|| format!("{name} is required"));
    Ok(Args {
        listen: need(listen, "--listen")?,
        admin: need(admin, "--admin")?,
        model_url: need(model_url, "--model-url")?,
        db: PathBuf::from(need(db, "--db")?),
        effects: PathBuf::from(need(effects, "--effects")?),
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
    let store = match tether_sqlite::SqliteStore::open(&args.db) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            eprintln!("tether-restate-demo: cannot open {}: {e}", args.db.display());
            return std::process::ExitCode::FAILURE;
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
    let thread = TetherThread::new("demo", model, Arc::new(Effects { path: args.effects }), store);
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
