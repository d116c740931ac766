//! `tether`: run AI agents with the tools kept local.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod acp_cmd;
mod elicit;
mod print;
mod providers;
mod run;
mod term;

/// jemalloc rather than glibc's malloc, as `tether-serve` (BENCHMARKS.md, "The allocator").
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, as `tether-serve`'s ([`tether_serve::JEMALLOC_CONF`] says which and why).
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: &[u8; 35] = tether_serve::JEMALLOC_CONF;

/// Run any AI agent, wherever its loop lives, with the tools kept local.
#[derive(Parser, Debug)]
#[command(name = "tether", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once; boxing buys nothing
enum Command {
    /// Run one prompt to completion with the workspace tools over the current directory.
    Run(run::RunArgs),
    /// Drive an external ACP agent interactively: `tether acp [--cwd DIR] [--yes] -- <agent command…>`.
    Acp(acp_cmd::AcpArgs),
    /// Serve the agents of a config file over AG-UI, with durable sessions and a web UI.
    Serve(tether_serve::ServeArgs),
}

fn main() -> ExitCode {
    // The log on stderr (errors, and telemetry's one export warning), and OpenTelemetry export
    // when OTEL_EXPORTER_OTLP_ENDPOINT is set (off, at no cost, otherwise).
    let telemetry = tether_otel::init(
        tracing_subscriber::EnvFilter::try_from_env("TETHER_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error,tether_otel=warn")),
    );
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tether: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let code = match cli.command {
        Command::Run(args) => {
            let code = rt.block_on(run::run(args));
            // An approval question may still wait on the terminal in a blocking thread after a
            // timeout or a cancel: exit without waiting for an answer nobody needs.
            rt.shutdown_background();
            code
        }
        Command::Acp(args) => {
            let code = rt.block_on(acp_cmd::run(args));
            rt.shutdown_background();
            code
        }
        Command::Serve(args) => rt.block_on(tether_serve::serve(args)),
    };
    if let Some(t) = telemetry {
        // Exports what is batched; bounded (5 s), so a collector that is down cannot hold us.
        t.shutdown();
    }
    code
}
