//! The cost of a durable step, in one run: the same turn (N tool calls, so 2N + 1 steps: N + 1
//! model calls and N tool calls, the model an instant fake) run through Restate (a real server
//! and the real service process, on one node and on a 3-node cluster) and run directly (the same engine in process, on a SQLite
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

    // Through Restate: one node, then a 3-node cluster (replication 2); the service a separate
    // process.
    let single = Restate::start().await;
    let one = through_restate(&single.admin, &single.ingress, n, dir.path(), "one").await;
    drop(single);
    let cluster = Restate::start_cluster(3).await;
    let three = through_restate(&cluster[0].admin, &cluster[1].ingress, n, dir.path(), "three").await;
    drop(cluster);

    let per = |d: std::time::Duration| d.as_secs_f64() * 1000.0 / steps;
    println!(
        "{n} tool calls, {steps} steps: direct {:.1} ms ({:.2} ms/step); restate 1 node {:.1} ms ({:.2} ms/step, +{:.2}); restate 3 nodes {:.1} ms ({:.2} ms/step, +{:.2})",
        direct.as_secs_f64() * 1000.0,
        per(direct),
        one.as_secs_f64() * 1000.0,
        per(one),
        per(one) - per(direct),
        three.as_secs_f64() * 1000.0,
        per(three),
        per(three) - per(direct),
    );
}

/// Runs the turn through Restate (after a warm-up turn) and returns its wall time.
async fn through_restate(
    admin: &str,
    ingress: &str,
    n: usize,
    dir: &std::path::Path,
    tag: &str,
) -> std::time::Duration {
    let fake = FakeOpenAi::start().await;
    let config = ServiceConfig {
        listen: format!("127.0.0.1:{}", free_port()),
        admin: admin.to_owned(),
        model_url: fake.url(),
        effects: dir.join(format!("{tag}.log")),
        live: None,
        shared: None,
    };
    let _service = Service::start(&config);
    // A warm-up turn (connections, the deployment's first call).
    // A node other than the one registered with learns of the deployment shortly after.
    fake.push(Reply::text("warm"));
    until("the ingress to know the service", async || {
        let (status, v) = call(ingress, "warm", "turn", &json!({"message_id": "w", "text": "hi"})).await;
        assert!(status == 200 || status == 404, "{status} {v}");
        (status == 200).then_some(())
    })
    .await;
    fake.push_all(script(n, "r"));
    let started = Instant::now();
    let (status, out) = call(
        ingress,
        "bench",
        "turn",
        &json!({"message_id": "m1", "text": "go"}),
    )
    .await;
    let took = started.elapsed();
    assert_eq!(status, 200, "{out}");
    assert_eq!(effects(&config.effects).len(), n);
    took
}

/// A Restate node with the demo service registered, its model the returned fake, once the
/// ingress serves a first turn (of thread `first`, answered "hi").
async fn one_node(dir: &std::path::Path, first: &str) -> (Restate, FakeOpenAi, Service) {
    let restate = Restate::start().await;
    let fake = FakeOpenAi::start().await;
    let config = ServiceConfig {
        listen: format!("127.0.0.1:{}", free_port()),
        admin: restate.admin.clone(),
        model_url: fake.url(),
        effects: dir.join("effects.log"),
        live: None,
        shared: None,
    };
    let service = Service::start(&config);
    fake.push(Reply::text("hi"));
    until("the ingress to know the service", async || {
        let (status, v) = call(
            &restate.ingress,
            first,
            "turn",
            &json!({"message_id": "m", "text": "hi"}),
        )
        .await;
        assert!(status == 200 || status == 404, "{status} {v}");
        (status == 200).then_some(())
    })
    .await;
    (restate, fake, service)
}

/// What a thread read costs with the record in Restate object state: a shared handler reading
/// one state key through the ingress (`running`), the thread's whole record read through the
/// ingress as a front-end reads it ([`tether_restate::RestateStore`]: `thread`, then pages of
/// `events`), beside reading a copy of the same record from a SQLite file. Prints medians;
/// asserts nothing about time.
///
/// `cargo test -p tether-restate --test bench shared_handler -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a benchmark: run with --ignored --nocapture"]
async fn shared_handler_read_cost() {
    const N: usize = 300;
    let dir = tempfile::tempdir().expect("tempdir");
    let (restate, _fake, service) = one_node(dir.path(), "t").await;
    // One client, its connection kept: as a tether node would call the ingress.
    let client = reqwest::Client::new();
    let url = format!("{}/TetherThread/t/running", restate.ingress);
    let mut through = Vec::with_capacity(N);
    for _ in 0..N {
        let started = Instant::now();
        let r = client.post(&url).send().await.expect("running");
        assert!(r.status().is_success());
        let _ = r.bytes().await.expect("body");
        through.push(started.elapsed());
    }
    use tether::{EventStore, ThreadStore};
    let id = ThreadId::new("t").expect("id");
    let remote = store(&restate.ingress);
    let mut record = Vec::with_capacity(N);
    let mut copy = Vec::new();
    for _ in 0..N {
        let started = Instant::now();
        let t = remote.thread(&id).await.expect("thread").expect("recorded");
        copy = remote.load(&t.record).await.expect("load");
        record.push(started.elapsed());
    }
    service.kill();
    let store = tether_sqlite::SqliteStore::open(dir.path().join("read.db")).expect("open a store");
    store.claim_thread(&id, "demo", "r", "hi").await.expect("claim");
    for e in &copy {
        store.append("r", e).await.expect("append");
    }
    let mut direct = Vec::with_capacity(N);
    for _ in 0..N {
        let started = Instant::now();
        let t = store.thread(&id).await.expect("thread").expect("recorded");
        let events = store.load(&t.record).await.expect("load");
        assert!(!events.is_empty());
        direct.push(started.elapsed());
    }
    let median = |v: &mut Vec<std::time::Duration>| {
        v.sort_unstable();
        v[v.len() / 2].as_secs_f64() * 1000.0
    };
    println!(
        "{N} reads: a shared handler through the ingress (one state key) median {:.3} ms; the thread's record ({} events) through the ingress (thread + events) median {:.3} ms; the same from SQLite (thread + load) median {:.3} ms",
        median(&mut through),
        copy.len(),
        median(&mut record),
        median(&mut direct)
    );
}

/// What a front-end's small reads cost on a long thread against a short one: `status` (the
/// thread, its length and its running turn: three state keys) and `progress` of the record's last
/// event, on a thread of one short turn and on one whose record holds 1 MiB of text, alternating
/// through the ingress on one kept connection. `progress` runs with lazy state and should not
/// grow with the record; `status` runs with eager state (Restate sends the whole record with
/// each read: it is read once before a turn, which reads the record whole anyway) and does.
/// Prints medians and their ratio; asserts nothing about time.
///
/// `cargo test -p tether-restate --test bench small_reads -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a benchmark: run with --ignored --nocapture"]
async fn small_reads_on_a_long_thread() {
    const N: usize = 200;
    const TURNS: usize = 16;
    let dir = tempfile::tempdir().expect("tempdir");
    let (restate, fake, _service) = one_node(dir.path(), "short").await;
    let text = "x".repeat(64 * 1024);
    // Its last turn short, so that the last event read is the same size on both threads.
    for i in 0..=TURNS {
        fake.push(Reply::text(if i < TURNS {
            text.clone()
        } else {
            "hi".to_owned()
        }));
        let (status, v) = call(
            &restate.ingress,
            "long",
            "turn",
            &json!({"message_id": format!("m{i}"), "text": "more"}),
        )
        .await;
        assert_eq!(status, 200, "{v}");
    }
    let client = reqwest::Client::new();
    let read = async |thread: &str, handler: &str, body: Option<serde_json::Value>| {
        let mut req = client.post(format!("{}/TetherThread/{thread}/{handler}", restate.ingress));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let started = Instant::now();
        let r = req.send().await.expect("a read");
        assert!(r.status().is_success(), "{}", r.status());
        let v: serde_json::Value = r.json().await.expect("json");
        (started.elapsed(), v)
    };
    let (_, long) = read("long", "status", None).await;
    let (_, short) = read("short", "status", None).await;
    let lengths = (
        short["length"].as_u64().expect("a length"),
        long["length"].as_u64().expect("a length"),
    );
    let mut times: [Vec<std::time::Duration>; 4] = Default::default();
    for _ in 0..N {
        for (k, (thread, len)) in [("short", lengths.0), ("long", lengths.1)]
            .into_iter()
            .enumerate()
        {
            times[k].push(read(thread, "status", None).await.0);
            let (took, v) = read(thread, "progress", Some(json!({"after": len - 1}))).await;
            assert_eq!(v["events"].as_array().map(Vec::len), Some(1), "{v}");
            times[2 + k].push(took);
        }
    }
    let median = |v: &mut Vec<std::time::Duration>| {
        v.sort_unstable();
        v[v.len() / 2].as_secs_f64() * 1000.0
    };
    let [mut ss, mut sl, mut ps, mut pl] = times;
    let (ss, sl, ps, pl) = (median(&mut ss), median(&mut sl), median(&mut ps), median(&mut pl));
    println!(
        "{N} reads each, a thread of {} events against one of {} ({TURNS} x 64 KiB of text): status median {ss:.3} / {sl:.3} ms ({:.2}x), progress of the last event {ps:.3} / {pl:.3} ms ({:.2}x)",
        lengths.0,
        lengths.1,
        sl / ss,
        pl / ps
    );
}

/// What a turn costs as its thread grows: a turn gets its thread's whole state with its
/// invocation, reads every event of its record (Restate journals every value a handler reads: a
/// `GetEagerState` entry holds it, so each turn writes its record again into its own journal),
/// and seeds its engine with it. Times lone one-step
/// turns on a fresh thread and on one of 200 and 400 events (two per turn, 512 bytes of text
/// each), medians of 9 turns alternating. Prints the medians; asserts nothing about time.
///
/// `cargo test -p tether-restate --test bench turn_on_a_long -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a benchmark: run with --ignored --nocapture"]
async fn turn_on_a_long_thread() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (restate, fake, _service) = one_node(dir.path(), "warm").await;
    let text = "z".repeat(512);
    let turn = async |thread: &str, i: usize| {
        fake.push(Reply::text(text.clone()));
        let started = Instant::now();
        let (status, out) = call(
            &restate.ingress,
            thread,
            "turn",
            &json!({"message_id": format!("m{i}"), "text": "more"}),
        )
        .await;
        assert_eq!(status, 200, "{out}");
        started.elapsed()
    };
    for i in 0..200 {
        turn("long-400", i).await;
        if i < 100 {
            turn("long-200", i).await;
        }
    }
    let mut times: [Vec<std::time::Duration>; 3] = Default::default();
    for i in 0..9 {
        times[0].push(turn(&format!("fresh-{i}"), 0).await);
        times[1].push(turn("long-200", 1000 + i).await);
        times[2].push(turn("long-400", 1000 + i).await);
    }
    let [a, b, c] = times.map(|mut v| {
        v.sort_unstable();
        v[v.len() / 2].as_secs_f64() * 1000.0
    });
    println!(
        "a one-step turn, median of 9: fresh thread {a:.2} ms; 200-event thread {b:.2} ms ({:.2}x); 400-event thread {c:.2} ms ({:.2}x)",
        b / a,
        c / a
    );
}
