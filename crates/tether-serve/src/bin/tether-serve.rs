//! `tether-serve`: the same server as `tether serve`, as a binary of its own (for tests, the
//! crash-safety script and the benchmark).

use clap::Parser;

#[derive(Parser)]
#[command(name = "tether-serve", about = "Serve tether agents over AG-UI with a web UI")]
struct Cli {
    #[command(flatten)]
    args: tether_serve::ServeArgs,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .try_init();
    tether_serve::serve(Cli::parse().args).await
}
