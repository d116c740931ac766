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
//! reads a thread's status before sending a turn: the bench's `BENCH_FLOOR_PEEK=1`). `tether serve`'s bench (`BENCH_BACKENDS=…`, with
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
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(0)
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
        let text = ctx
            .run(|| async move { Ok::<_, HandlerError>(Json("x".repeat(n))) })
            .name("model")
            .await?
            .into_inner();
        debug_assert_eq!(text.len(), n);
        Ok(Json(started))
    }

    /// Reads one key of the object (a status read's stand-in).
    #[handler(lazy_state)]
    async fn peek(&self, ctx: SharedObjectContext<'_>) -> Result<Json<bool>, HandlerError> {
        Ok(Json(ctx.get::<Json<String>>("k0").await?.is_some()))
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
