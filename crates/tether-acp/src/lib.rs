//! # tether-acp
//!
//! An [Agent Client Protocol](https://agentclientprotocol.com) (v1) **client**: tether launches an
//! external coding agent (Gemini CLI, Claude Code, Codex, …) as a child process and speaks
//! JSON-RPC 2.0 over its stdio, while the agent's file, terminal, permission and elicitation
//! requests are served locally by a [`ClientHandler`].
//!
//! - [`AcpClient`]: the connection and the client API (`initialize`, sessions, prompt turns,
//!   cancellation, extension methods).
//! - [`ClientHandler`]: what the agent may ask of the client; the connection validates every
//!   request (id, capability, params, session, path confinement) before the handler sees it.
//! - [`schema`]: the protocol types, re-exported from `agent-client-protocol-schema` (v1).
//!
//! This crate knows no front-end.
//!
//! An ACP agent is a [`tether::Provider`] ([`AcpAgent`]): nothing starts until a session opens,
//! which spawns the agent, initializes it and opens an ACP session in `cwd`.
//!
//! ```
//! use tether::{Session, SessionResult};
//! use tether_acp::{AcpAgent, AgentCommand};
//!
//! async fn ask(agent: AcpAgent, prompt: &str) -> tether::Result<SessionResult> {
//!     // The agent's file, terminal and permission requests go to the session's handler.
//!     let handler = tether::workspace::Workspace::new(".")?;
//!     Session::builder(agent).handler(handler).run(prompt).await
//! }
//!
//! let command = AgentCommand::from_argv(&["npx", "@zed-industries/claude-code-acp"]).expect("a program");
//! let agent = AcpAgent::new(command, std::env::current_dir()?);
//! assert!(agent.client().is_none()); // not spawned yet
//! # let _ = ask;
//! # Ok::<(), std::io::Error>(())
//! ```

#![deny(missing_docs)]

pub mod bridge;
mod client;
mod connection;
mod error;
mod fast;
// Entry points for the fuzz targets in `fuzz/`; not part of the API (its own docs say so: an
// outer doc here would make rustdoc resolve the module doc's links from the crate root).
#[doc(hidden)]
pub mod fuzzing;
mod handler;
mod options;
mod provider;
pub mod roots;

/// ACP v1 protocol types (from the official `agent-client-protocol-schema` crate).
pub use agent_client_protocol_schema::v1 as schema;

pub use bridge::HandlerBridge;
pub use client::{AcpClient, AgentCommand, PromptOutcome, Received};
pub use error::{AcpError, ClientError, Direction, codes};
pub use handler::{
    AcpTerminalRequest, AcpTerminalResponse, AcpUpdate, ClientHandler, RawMessage, RefusingHandler,
    SessionUpdateEvent, TerminateReason, client_capabilities, refuse_permission,
};
pub use options::ClientOptions;
pub use provider::AcpAgent;
