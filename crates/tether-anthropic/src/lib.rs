//! # tether-anthropic
//!
//! Anthropic for tether:
//! - [`MessagesModel`]: a [`tether::ChatModel`] over the Messages API, for the local loop.
//! - [`ManagedAgents`]: a [`tether::Provider`] for Claude Managed Agents, where the loop runs on
//!   Anthropic's side and custom tools stay local.
//! - [`provision`]: create or find a Managed Agents agent and environment from a spec.
//!
//! This crate knows HTTP and Anthropic's wire formats; it never depends on a front-end crate.

#![warn(missing_docs)]

/// Entry points for the fuzz targets in `fuzz/`; not part of the API.
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod managed;
pub mod messages;
pub mod provision;
pub mod sse;

pub use http::{ApiKey, ClientConfig};
pub use managed::{ManagedAgents, ManagedConfig};
pub use messages::MessagesModel;
pub use provision::{AgentSpec, Provisioned};
