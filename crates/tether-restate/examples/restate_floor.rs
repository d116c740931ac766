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
//! serves it, then prints `floor ready`. `tether serve`'s bench (`BENCH_BACKENDS=…`, with
//! `BENCH_FLOOR=1`) starts it beside each Restate backend and fires its load at it: no turn of
//! tether on Restate can start sooner or finish a load faster than these invocations do.

use std::time::Duration;

use restate_sdk::prelude::*;

/// The floor object.
struct BenchFloor;

#[restate_sdk::object]
impl BenchFloor {
    /// One "turn": its start time (microseconds since the Unix epoch, read before any step), then
    /// one journaled step producing `deltas` characters of text.
    #[handler]
    async fn turn(&self, ctx: ObjectContext<'_>, deltas: Json<u64>) -> Result<Json<u64>, HandlerError> {
        let started = unix_micros();
        let n = usize::try_from(deltas.into_inner()).unwrap_or(0).min(1 << 20);
        let text = ctx
            .run(|| async move { Ok::<_, HandlerError>(Json("x".repeat(n))) })
            .name("model")
            .await?
            .into_inner();
        debug_assert_eq!(text.len(), n);
        Ok(Json(started))
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
    let endpoint = restate_sdk::hyper::HyperEndpoint::new(Endpoint::builder().bind(BenchFloor).build());
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
