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

#![warn(missing_docs)]

pub mod bridge;
mod client;
mod connection;
mod error;
mod fast;
/// Entry points for the fuzz targets in `fuzz/`; not part of the API.
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
pub use error::{AcpError, Direction, HandlerError, codes};
pub use handler::{
    AcpUpdate, ClientHandler, HandlerSupport, RawMessage, RefusingHandler, SessionUpdateEvent,
    TerminalRequest, TerminalResponse, TerminateReason, refuse_permission,
};
pub use options::ClientOptions;
pub use provider::AcpAgent;
