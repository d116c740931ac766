//! `tether`: run AI agents with the tools kept local.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod acp_cmd;
mod elicit;
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TETHER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => run::run(args).await,
        Command::Acp(args) => acp_cmd::run(args).await,
        Command::Serve(args) => tether_serve::serve(args).await,
    }
}
