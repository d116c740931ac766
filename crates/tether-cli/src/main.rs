//! `tether`: run AI agents with the tools kept local.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod acp_cmd;
mod providers;
mod run;

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

#[tokio::main]
async fn main() -> ExitCode {
    // The log on stderr (errors, and telemetry's one export warning), and OpenTelemetry export
    // when OTEL_EXPORTER_OTLP_ENDPOINT is set (off, at no cost, otherwise).
    let telemetry = tether_otel::init(
        tracing_subscriber::EnvFilter::try_from_env("TETHER_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error,tether_otel=warn")),
    );
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Run(args) => run::run(args).await,
        Command::Acp(args) => acp_cmd::run(args).await,
        Command::Serve(args) => tether_serve::serve(args).await,
    };
    if let Some(t) = telemetry {
        // Exports what is batched; bounded (5 s), so a collector that is down cannot hold us.
        t.shutdown();
    }
    code
}
