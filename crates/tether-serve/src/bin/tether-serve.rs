//! `tether-serve`: the same server as `tether serve`, as a binary of its own (for tests, the
//! crash-safety script and the benchmark).

use clap::Parser;

/// jemalloc rather than glibc's malloc: under 1,000 concurrent runs it serves the same load with
/// less CPU and an earlier first text (mimalloc, tried before it, took ~24 KiB more peak memory
/// per run; BENCHMARKS.md, "The allocator").
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read at its start (the `_rjem_` prefix is tikv-jemalloc-sys's): freed
/// pages go back to the system 20 ms after they were freed instead of 10 s. With jemalloc's
/// default a burst of runs kept ~10 KiB more peak memory per run than glibc's malloc; with this,
/// as much as glibc's, still faster than it (BENCHMARKS.md, "The allocator").
/// `_RJEM_MALLOC_CONF` in the environment overrides it (`dirty_decay_ms:10000` for the default's
/// speed).
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: &[u8; 35] = b"dirty_decay_ms:20,muzzy_decay_ms:0\0";

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
