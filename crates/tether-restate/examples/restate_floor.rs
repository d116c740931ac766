//! The floor of a turn on Restate (a bench helper, not a test): a service with nothing of tether
//! in it, whose virtual object `BenchFloor` has one exclusive handler doing the least a turn on
//! Restate must do (issue 18 asks that a turn be one exclusive invocation of a thread's virtual
//! object and its model call a journaled step): it notes the time it started, runs one `ctx.run`
//! step whose result is the model's text (`deltas` characters), and returns its start time.
//!
//! ```text
//! target/release/examples/restate_floor <admin URL> <ingress URL>
//! ```
//!
//! Serves on a loopback port, registers itself with the admin API, waits until the ingress
//! serves it, then prints `floor ready`.
//!
//! What a turn of tether's design needs besides can be added, to price each part alone:
//! `FLOOR_SETS=n` has the handler write `n` state keys of ~200 bytes before its step (as a turn
//! writes its record's events, their count, the checkpoint and its own markers), and
//! `FLOOR_INDEX=1` has it send a one-way call to one shared `BenchIndex` object (as a turn sends
//! its thread to its agent's index). The shared `peek` handler reads one key (as a front-end
//! reads a thread's status before sending a turn: the bench's `BENCH_FLOOR_PEEK=1`).
//! `FLOOR_STEPS=n` adds `n` empty journaled steps after the model's.
//!
//! The record kept outside Restate, in a store every node shares (issue 18's other option):
//! `FLOOR_PG=<libpq connection string>` has each turn keep `FLOOR_PG_ROWS` events (12 unless
//! set, ~200 bytes each) and an index entry in PostgreSQL (tables `floor_events` and
//! `floor_index`, emptied at start), idempotently by (thread, sequence number) so that a replay
//! writes nothing twice. Two shapes:
//! - each turn its own statements, as a turn would hold them: a journaled `begin` step reads the
//!   record's length and writes half the events, a journaled `end` step the rest and the index
//!   entry (one statement each, on `FLOOR_PG_CONNS` connections, 8 unless set);
//! - `FLOOR_PG_BATCH=1`: the model's step reads the record's length (so the journal holds it
//!   beside the text, and a replay writes at the same place), and after it the turn's events
//!   and index entry are written; both through one writer task on one connection that takes
//!   every turn waiting at that moment into one statement, as the SQLite store's thread does.
//!
//! `tether serve`'s bench (`BENCH_BACKENDS=…`, with
//! `BENCH_FLOOR=1`) starts it beside each Restate backend and fires its load at it: no turn of
//! tether on Restate can start sooner or finish a load faster than these invocations do.

use std::time::Duration;

use restate_sdk::prelude::*;

/// The floor object.
struct BenchFloor;

/// An index every floor turn may send itself to (`FLOOR_INDEX=1`).
struct BenchIndex;

#[restate_sdk::object]
impl BenchIndex {
    /// Notes a turn's key (one state key written, none read).
    #[handler(lazy_state)]
    async fn add(&self, ctx: ObjectContext<'_>, key: Json<String>) -> Result<(), HandlerError> {
        ctx.set(&format!("t:{}", key.into_inner()), Json(unix_micros()));
        Ok(())
    }
}

fn env_number(name: &str) -> usize {
    env_or(name, 0)
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[restate_sdk::object]
impl BenchFloor {
    /// One "turn": its start time (microseconds since the Unix epoch, read before any step), then
    /// one journaled step producing `deltas` characters of text.
    #[handler]
    async fn turn(&self, ctx: ObjectContext<'_>, deltas: Json<u64>) -> Result<Json<u64>, HandlerError> {
        let started = unix_micros();
        let n = usize::try_from(deltas.into_inner()).unwrap_or(0).min(1 << 20);
        let filler = "y".repeat(200);
        for i in 0..env_number("FLOOR_SETS").min(1000) {
            ctx.set(&format!("k{i}"), Json(filler.clone()));
        }
        if env_number("FLOOR_INDEX") > 0 {
            ctx.object_client::<BenchIndexClient>("index")
                .add(Json(ctx.key().to_owned()))
                .send();
        }
        let rows = env_or("FLOOR_PG_ROWS", 12).min(1000);
        let key = ctx.key().to_owned();
        let store = STORE.get();
        if let Some(Store::Each(pg)) = store {
            let key = key.clone();
            ctx.run(|| async move { each_write(pg, &key, rows / 2, false).await.map(Json) })
                .name("begin")
                .await?;
        }
        let (length, text) = ctx
            .run(|| {
                let key = key.clone();
                async move {
                    let length = match store {
                        Some(Store::Batch(tx)) => batch(tx, Job::Length(key)).await?,
                        _ => 0,
                    };
                    Ok::<_, HandlerError>(Json((length, "x".repeat(n))))
                }
            })
            .name("model")
            .await?
            .into_inner();
        debug_assert_eq!(text.len(), n);
        for _ in 0..env_number("FLOOR_STEPS").min(100) {
            ctx.run(|| async { Ok::<_, HandlerError>(()) })
                .name("empty")
                .await?;
        }
        match store {
            Some(Store::Each(pg)) => {
                ctx.run(|| async move { each_write(pg, &key, rows - rows / 2, true).await.map(|_| ()) })
                    .name("end")
                    .await?;
            }
            Some(Store::Batch(tx)) => {
                batch(
                    tx,
                    Job::Write {
                        key,
                        from: length,
                        rows,
                    },
                )
                .await?;
            }
            None => {}
        }
        Ok(Json(started))
    }

    /// Reads one key of the object (a status read's stand-in).
    #[handler(lazy_state)]
    async fn peek(&self, ctx: SharedObjectContext<'_>) -> Result<Json<bool>, HandlerError> {
        Ok(Json(ctx.get::<Json<String>>("k0").await?.is_some()))
    }
}

/// Where floor turns keep their record, with `FLOOR_PG`.
enum Store {
    /// Each turn its own statements, on a few connections taken in turn.
    Each(Vec<tokio_postgres::Client>),
    /// One writer taking every waiting turn into one statement.
    Batch(tokio::sync::mpsc::UnboundedSender<(Job, tokio::sync::oneshot::Sender<i64>)>),
}

static STORE: std::sync::OnceLock<Store> = std::sync::OnceLock::new();
static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A turn's request to the batching writer.
enum Job {
    /// The record's length (the next event's sequence number).
    Length(String),
    /// `rows` events from sequence number `from`, and the thread in the index.
    Write { key: String, from: i64, rows: usize },
}

#[derive(Debug)]
struct StoreError(String);

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StoreError {}

fn store_error(e: impl std::fmt::Display) -> HandlerError {
    HandlerError::from(StoreError(e.to_string()))
}

const EVENTS: &str = "insert into floor_events (thread, seq, body)
     select * from unnest($1::text[], $2::bigint[], $3::text[]) on conflict do nothing";
const INDEX: &str = "insert into floor_index (agent, thread)
     select 'floor', k from unnest($1::text[]) as k on conflict do nothing";

/// One turn's statement: the record's length, `rows` events after it, and (`index`) the thread
/// in the index; the length it wrote at.
async fn each_write(
    pg: &[tokio_postgres::Client],
    key: &str,
    rows: usize,
    index: bool,
) -> Result<i64, HandlerError> {
    let c = &pg[NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % pg.len()];
    let ords: Vec<i64> = (0..rows as i64).collect();
    let bodies: Vec<String> = ords.iter().map(|_| "y".repeat(200)).collect();
    let keys = [key];
    let row = c
        .query_one(
            "with l as (select coalesce(max(seq) + 1, 0)::bigint as n from floor_events where thread = $1),
                  i as (insert into floor_index (agent, thread) select 'floor', k from unnest($4::text[]) as k
                        on conflict do nothing),
                  e as (insert into floor_events (thread, seq, body)
                        select $1, l.n + s, b from l, unnest($2::bigint[], $3::text[]) as u(s, b) on conflict do nothing)
             select n from l",
            &[&key, &ords, &bodies, &if index { &keys[..] } else { &[] }],
        )
        .await
        .map_err(store_error)?;
    Ok(row.get(0))
}

async fn batch(
    tx: &tokio::sync::mpsc::UnboundedSender<(Job, tokio::sync::oneshot::Sender<i64>)>,
    job: Job,
) -> Result<i64, HandlerError> {
    let (done, answer) = tokio::sync::oneshot::channel();
    tx.send((job, done)).map_err(store_error)?;
    answer.await.map_err(store_error)
}

/// The batching writer: every job waiting when it wakes, in one read and one write.
async fn batcher(
    mut c: tokio_postgres::Client,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<(Job, tokio::sync::oneshot::Sender<i64>)>,
) {
    while let Some(first) = rx.recv().await {
        let mut jobs = vec![first];
        while let Ok(j) = rx.try_recv() {
            jobs.push(j);
        }
        let (mut reads, mut writes) = (Vec::new(), Vec::new());
        for (job, done) in jobs {
            match job {
                Job::Length(key) => reads.push((key, done)),
                Job::Write { key, from, rows } => writes.push((key, from, rows, done)),
            }
        }
        if !reads.is_empty() {
            let keys: Vec<&str> = reads.iter().map(|r| r.0.as_str()).collect();
            let lengths: std::collections::HashMap<String, i64> = match c
                .query(
                    "select thread, max(seq) + 1 from floor_events where thread = any($1) group by thread",
                    &[&keys],
                )
                .await
            {
                Ok(rows) => rows.iter().map(|r| (r.get(0), r.get(1))).collect(),
                Err(e) => {
                    eprintln!("floor store: {e}");
                    continue;
                }
            };
            for (key, done) in reads {
                let _ = done.send(lengths.get(&key).copied().unwrap_or(0));
            }
        }
        if !writes.is_empty() {
            let (mut t, mut q, mut b) = (Vec::new(), Vec::new(), Vec::new());
            for (key, from, rows, _) in &writes {
                for i in 0..*rows as i64 {
                    t.push(key.as_str());
                    q.push(from + i);
                    b.push("y".repeat(200));
                }
            }
            let keys: Vec<&str> = writes.iter().map(|w| w.0.as_str()).collect();
            let written = async {
                let tx = c.transaction().await?;
                tx.execute(EVENTS, &[&t, &q, &b]).await?;
                tx.execute(INDEX, &[&keys]).await?;
                tx.commit().await
            };
            if let Err(e) = written.await {
                eprintln!("floor store: {e}");
                continue;
            }
            for (_, from, _, done) in writes {
                let _ = done.send(from);
            }
        }
    }
}

fn unix_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(admin), Some(ingress)) = (args.next(), args.next()) else {
        eprintln!("usage: restate_floor <admin URL> <ingress URL>");
        std::process::exit(2);
    };
    if let Ok(url) = std::env::var("FLOOR_PG") {
        let batched = env_number("FLOOR_PG_BATCH") > 0;
        let conns = if batched {
            1
        } else {
            env_or("FLOOR_PG_CONNS", 8).clamp(1, 64)
        };
        let mut clients = Vec::new();
        for _ in 0..conns {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .expect("PostgreSQL");
            tokio::spawn(conn);
            clients.push(client);
        }
        clients[0]
            .batch_execute(
                "create table if not exists floor_events (thread text, seq bigint, body text, primary key (thread, seq));
                 create table if not exists floor_index (agent text, thread text, primary key (agent, thread));
                 truncate floor_events; truncate floor_index;",
            )
            .await
            .expect("the floor's tables");
        let store = if batched {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            tokio::spawn(batcher(clients.remove(0), rx));
            Store::Batch(tx)
        } else {
            Store::Each(clients)
        };
        let _ = STORE.set(store);
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let uri = format!("http://{}", listener.local_addr().expect("address"));
    let endpoint =
        restate_sdk::hyper::HyperEndpoint::new(Endpoint::builder().bind(BenchFloor).bind(BenchIndex).build());
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            // As tether's own service (`tether_restate::serve`): no Nagle delay on small frames.
            let _ = stream.set_nodelay(true);
            let conn = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .serve_connection(hyper_util::rt::TokioIo::new(stream), endpoint.clone());
            tokio::spawn(conn);
        }
    });
    tether_restate::register(&admin, &uri, Duration::from_secs(60))
        .await
        .expect("registration");
    // A node's ingress learns of a deployment a moment after the admin API accepts it.
    let client = reqwest::Client::new();
    let url = format!("{}/BenchFloor/ready/turn", ingress.trim_end_matches('/'));
    let started = std::time::Instant::now();
    loop {
        let ok = client
            .post(&url)
            .json(&1)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the ingress never served BenchFloor"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("floor ready {uri}");
    std::future::pending::<()>().await;
}
