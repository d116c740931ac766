//! `tether-serve`: the same server as `tether serve`, as a binary of its own (for tests, the
//! crash-safety script and the benchmark).

use clap::Parser;

/// jemalloc rather than glibc's malloc: under 1,000 concurrent runs it serves the same load with
/// less CPU and an earlier first text (mimalloc, tried before it, took ~24 KiB more peak memory
/// per run; BENCHMARKS.md, "The allocator").
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options ([`tether_serve::JEMALLOC_CONF`] says which and why).
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: &[u8; 35] = tether_serve::JEMALLOC_CONF;

#[derive(Parser)]
#[command(name = "tether-serve", about = "Serve tether agents over AG-UI with a web UI")]
struct Cli {
    #[command(flatten)]
    args: tether_serve::ServeArgs,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
    // OpenTelemetry export when OTEL_EXPORTER_OTLP_ENDPOINT is set.
    let telemetry = tether_otel::init(tracing_subscriber::EnvFilter::new(filter));
    let code = tether_serve::serve(Cli::parse().args).await;
    if let Some(t) = telemetry {
        t.shutdown();
    }
    code
}
