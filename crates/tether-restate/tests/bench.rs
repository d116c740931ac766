//! The cost of a durable step, in one run: the same turn (N tool calls, so 2N + 1 steps: N + 1
//! model calls and N tool calls, the model an instant fake) run through Restate (a real server
//! and the real service process) and run directly (the same engine in process, on a SQLite
//! store). Prints the numbers; asserts nothing about time.
//!
//! `cargo test -p tether-restate --test bench -- --ignored --nocapture` (debug build unless
//! `--release`; `TETHER_RESTATE_BENCH_TOOLS` sets N, default 40; at most 49: the engine's default turn limit is 50).

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::*;
use serde_json::json;
use tether::local::LocalLoop;
use tether::{Session, ThreadId, ToolSet, ToolSpec, UserMessage};
use tether_testkit::openai::{FakeOpenAi, Reply};

fn script(n: usize, tag: &str) -> Vec<Reply> {
    let mut v: Vec<Reply> = (0..n)
        .map(|i| {
            Reply::tool_calls(&[(
                &format!("{tag}{i}") as &str,
                "append_line",
                &format!(r#"{{"text":"{tag}{i}"}}"#) as &str,
            )])
        })
        .collect();
    v.push(Reply::text("done"));
    v
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "a benchmark: run with --ignored --nocapture"]
async fn durable_step_overhead() {
    let n: usize = std::env::var("TETHER_RESTATE_BENCH_TOOLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let steps = (2 * n + 1) as f64;
    let dir = tempfile::tempdir().expect("tempdir");

    // Directly: the engine in process, the record in SQLite.
    let fake = FakeOpenAi::start().await;
    fake.push_all(script(n, "d"));
    let effects_path = dir.path().join("direct.log");
    let p = effects_path.clone();
    let tools = Arc::new(ToolSet::new().tool(
        ToolSpec::new("append_line", "Appends a line.", json!({"type": "object"})),
        move |input: serde_json::Value| {
            let p = p.clone();
            async move {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&p)?;
                f.write_all(format!("{}\n", input["text"].as_str().unwrap_or("")).as_bytes())?;
                f.sync_data()?;
                Ok::<_, std::io::Error>("appended".to_owned())
            }
        },
    ));
    let store = Arc::new(tether_sqlite::SqliteStore::open(dir.path().join("direct.db")).expect("store"));
    let mut direct = std::time::Duration::ZERO;
    // The first turn warms up (connections, the store); the second is measured.
    for (round, thread) in ["warm", "bench"].into_iter().enumerate() {
        if round == 1 {
            fake.push_all(script(n, "d"));
        }
        let model = tether_openai::OpenAiModel::builder(fake.url())
            .model("fake-model")
            .build()
            .expect("model");
        let started = Instant::now();
        let mut session = Session::builder(LocalLoop::new(model))
            .handler_arc(tools.clone())
            .thread(store.clone(), ThreadId::new(thread).expect("id"), "bench")
            .open()
            .await
            .expect("open");
        let r = session
            .send_messages(vec![UserMessage::with_id("m1", "go")], Default::default())
            .await
            .expect("direct turn");
        direct = started.elapsed();
        assert_eq!(r.text, "done");
    }
    assert_eq!(effects(&effects_path).len(), 2 * n);

    // Through Restate: one node, the service a separate process.
    let restate = Restate::start().await;
    let fake = FakeOpenAi::start().await;
    let config = ServiceConfig {
        listen: format!("127.0.0.1:{}", free_port()),
        admin: restate.admin.clone(),
        model_url: fake.url(),
        db: dir.path().join("restate.db"),
        effects: dir.path().join("restate.log"),
    };
    let _service = Service::start(&config);
    // A warm-up turn (connections, the deployment's first call).
    fake.push(Reply::text("warm"));
    let warm = call(
        &restate.ingress,
        "warm",
        "turn",
        &json!({"message_id": "w", "text": "hi"}),
    )
    .await;
    assert_eq!(warm.0, 200, "{}", warm.1);
    fake.push_all(script(n, "r"));
    let started = Instant::now();
    let (status, out) = call(
        &restate.ingress,
        "bench",
        "turn",
        &json!({"message_id": "m1", "text": "go"}),
    )
    .await;
    let durable = started.elapsed();
    assert_eq!(status, 200, "{out}");
    assert_eq!(effects(&config.effects).len(), n);

    let per_direct = direct.as_secs_f64() * 1000.0 / steps;
    let per_durable = durable.as_secs_f64() * 1000.0 / steps;
    println!(
        "{n} tool calls, {steps} steps: direct {:.1} ms ({per_direct:.2} ms/step), restate {:.1} ms ({per_durable:.2} ms/step), overhead {:.2} ms per durable step",
        direct.as_secs_f64() * 1000.0,
        durable.as_secs_f64() * 1000.0,
        per_durable - per_direct
    );
}
