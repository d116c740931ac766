//! Throughput: 10,000 streamed deltas from `FakeOpenAi`, read (a) by a minimal SSE client
//! (reqwest byte stream + line split, counting `data:` lines) and (b) relayed through a full
//! tether `Session` (LocalLoop + OpenAiModel) to a subscriber. Prints both rates and b/a, and
//! where the time goes: (c) the model alone, (d) with a detached sink, (e) a session whose stream
//! has a single delta and (f) the minimal client on that stream (e - f: the fixed cost of opening
//! a session and running a turn, apart from the HTTP round trip); and (g) the session of (b)
//! traced by `tether-otel`, its spans and metrics exported over OTLP/HTTP to a receiver on
//! loopback during the run (b and g alternate, round by round).
//!
//! Run: `cargo bench -p tether-openai --bench relay`.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tether::local::LocalLoop;
use tether::{ChatMessage, ChatModel, ChatRequest, DeltaSink, EventKind, EventSink, RetryPolicy, Session};
use tether_openai::OpenAiModel;
use tether_testkit::openai::{FakeOpenAi, Reply};

const DELTAS: usize = 10_000;
const ROUNDS: usize = 30;

/// (a): the floor — bytes off the socket, split into lines, `data:` lines counted.
async fn raw_client(client: &reqwest::Client, url: &str) -> usize {
    let resp = client
        .post(format!("{url}/chat/completions"))
        .header("content-type", "application/json")
        .body(r#"{"model":"bench","stream":true,"messages":[{"role":"user","content":"go"}]}"#)
        .send()
        .await
        .expect("raw request");
    let mut body = resp.bytes_stream();
    let mut carry: Vec<u8> = Vec::new();
    let mut data_lines = 0;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.expect("raw body");
        let mut start = 0;
        for nl in memchr::memchr_iter(b'\n', &chunk) {
            let line: &[u8] = if carry.is_empty() {
                &chunk[start..nl]
            } else {
                carry.extend_from_slice(&chunk[start..nl]);
                &carry
            };
            if line.starts_with(b"data:") {
                data_lines += 1;
            }
            carry.clear();
            start = nl + 1;
        }
        carry.extend_from_slice(&chunk[start..]);
    }
    data_lines
}

/// (b): the same stream through Session + LocalLoop + OpenAiModel to a subscriber; (g) the same
/// with the session traced.
async fn through_tether(model: &OpenAiModel, deltas: usize) -> usize {
    through_tether_traced(model, deltas, None).await
}

async fn through_tether_traced(
    model: &OpenAiModel,
    deltas: usize,
    tracer: Option<&tether_otel::Tracer>,
) -> usize {
    let provider = LocalLoop::new(model.clone()).retry(RetryPolicy::none());
    let mut builder = Session::builder(provider);
    if let Some(t) = tracer {
        builder = builder.observer(t.observer());
    }
    let mut session = builder.open().await.expect("open");
    let mut rx = session.sink().subscribe(1024).await;
    let counter = tokio::spawn(async move {
        // Deltas arrive merged per network read, so count the text they carry: every one of the
        // stream's 4-byte deltas must reach the subscriber.
        let mut n = 0;
        while let Some(e) = rx.recv().await {
            if let EventKind::TextDelta { delta, .. } = &e.kind {
                n += delta.len() / 4;
            }
        }
        n
    });
    let r = session.send("go").await.expect("send");
    assert_eq!(r.text.len(), deltas * 4);
    drop(session);
    counter.await.expect("counter")
}

/// (c): OpenAiModel alone, deltas discarded: parsing + accumulation, no event delivery.
async fn model_alone(model: &OpenAiModel, deltas: &DeltaSink) -> usize {
    let req = ChatRequest::new(String::new(), vec![ChatMessage::user("go")], Vec::new());
    let r = model.chat(&req, deltas).await.expect("chat");
    r.message.content.map(|c| c.len() / 4).unwrap_or(0)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let fake = FakeOpenAi::start().await;
        let reply = Reply::long_text(DELTAS, "tok ");
        let client = reqwest::Client::new();
        let model = OpenAiModel::builder(fake.url())
            .model("bench")
            .build()
            .expect("model");

        // (g): traced, exporting to a receiver on loopback (batches every 100 ms, so exports run
        // during the streams).
        let sink = tether_testkit::otlp::OtlpSink::start().await;
        let telemetry = tether_otel::Telemetry::new(
            tether_otel::ExportConfig::new(sink.url().to_owned())
                .batch_delay(Duration::from_millis(100))
                .metrics_interval(Duration::from_secs(1)),
        )
        .expect("telemetry");
        let tracer = telemetry.tracer().agent_name("bench").with_dispatch(telemetry.dispatch());
        let mut tg = Vec::new();

        // Warm up both paths (connections, allocator).
        for _ in 0..3 {
            fake.push(reply.clone());
            through_tether_traced(&model, DELTAS, Some(&tracer)).await;
            fake.push(reply.clone());
            raw_client(&client, &fake.url()).await;
            fake.push(reply.clone());
            through_tether(&model, DELTAS).await;
        }
        let (mut ta, mut tb, mut tc, mut td) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut te, mut tf) = (Vec::new(), Vec::new());
        let tiny = Reply::long_text(1, "tok ");
        let detached = DeltaSink::new(EventSink::detached(), "m");
        for _ in 0..ROUNDS {
            fake.push(reply.clone());
            let t = Instant::now();
            let n = raw_client(&client, &fake.url()).await;
            ta.push(t.elapsed());
            assert_eq!(
                n,
                DELTAS + 4,
                "data lines (deltas + role + finish + usage + DONE)"
            );

            fake.push(reply.clone());
            let t = Instant::now();
            let n = through_tether(&model, DELTAS).await;
            tb.push(t.elapsed());
            assert_eq!(n, DELTAS);

            fake.push(reply.clone());
            let t = Instant::now();
            let n = through_tether_traced(&model, DELTAS, Some(&tracer)).await;
            tg.push(t.elapsed());
            assert_eq!(n, DELTAS);

            fake.push(tiny.clone());
            let t = Instant::now();
            assert_eq!(through_tether(&model, 1).await, 1);
            te.push(t.elapsed());

            fake.push(tiny.clone());
            let t = Instant::now();
            assert_eq!(raw_client(&client, &fake.url()).await, 1 + 4);
            tf.push(t.elapsed());

            fake.push(reply.clone());
            let t = Instant::now();
            assert_eq!(model_alone(&model, &DeltaSink::discard()).await, DELTAS);
            tc.push(t.elapsed());

            fake.push(reply.clone());
            let t = Instant::now();
            assert_eq!(model_alone(&model, &detached).await, DELTAS);
            td.push(t.elapsed());
        }
        let med = |v: &mut Vec<Duration>| {
            v.sort();
            v[v.len() / 2]
        };
        let (a, b) = (med(&mut ta), med(&mut tb));
        let ra = DELTAS as f64 / a.as_secs_f64();
        let rb = DELTAS as f64 / b.as_secs_f64();
        println!("relay: {DELTAS} deltas per stream, median of {ROUNDS} rounds");
        println!("  (a) minimal SSE client : {a:>10.2?} per stream, {ra:>12.0} deltas/s");
        println!("  (b) tether Session     : {b:>10.2?} per stream, {rb:>12.0} deltas/s");
        println!("  ratio b/a              : {:.2} (goal >= 0.8)", rb / ra);
        let g = med(&mut tg);
        let rg = DELTAS as f64 / g.as_secs_f64();
        println!(
            "  (g) traced, OTLP export: {g:>10.2?} per stream, {rg:>12.0} deltas/s; g/b {:.3} (goal >= 0.95)",
            rg / rb
        );
        let (c, d) = (med(&mut tc), med(&mut td));
        let rc = DELTAS as f64 / c.as_secs_f64();
        let rd = DELTAS as f64 / d.as_secs_f64();
        println!("  where the time goes:");
        println!(
            "  (c) OpenAiModel, DeltaSink::discard()          : {c:>10.2?}, {rc:>12.0} deltas/s ({:.2} of a)",
            rc / ra
        );
        println!(
            "  (d) OpenAiModel, DeltaSink on a detached sink : {d:>10.2?}, {rd:>12.0} deltas/s ({:.2} of a)",
            rd / ra
        );
        let (e, f) = (med(&mut te), med(&mut tf));
        println!("  (e) tether Session, a 1-delta stream           : {e:>10.2?}");
        println!(
            "  (f) minimal SSE client, a 1-delta stream       : {f:>10.2?} => a session's fixed cost (e - f) {:.2?}; b - c = {:.2?}",
            e.saturating_sub(f),
            b.saturating_sub(c)
        );
        tokio::task::block_in_place(|| telemetry.shutdown());
    });
}
