//! # tether-anthropic
//!
//! Anthropic for tether:
//! - [`MessagesModel`]: a [`tether::ChatModel`] over the Messages API, for the local loop.
//! - [`ManagedAgents`]: a [`tether::Provider`] for Claude Managed Agents, where the loop runs on
//!   Anthropic's side and custom tools stay local.
//! - [`provision`]: create or find a Managed Agents agent and environment from a spec.
//!
//! This crate knows HTTP and Anthropic's wire formats; it never depends on a front-end crate.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> tether::Result<()> {
//! # // A scripted Messages API on 127.0.0.1 stands in for api.anthropic.com here.
//! # use tether_testkit::anthropic::{FakeMessages, Reply};
//! # let fake = FakeMessages::start(vec![Reply::Json(serde_json::json!({
//! #     "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
//! #     "content": [{"type": "text", "text": "Hello!"}],
//! #     "stop_reason": "end_turn", "usage": {"input_tokens": 9, "output_tokens": 3}
//! # }))]).await;
//! use tether::{Session, local::LocalLoop};
//! use tether_anthropic::{ClientConfig, MessagesModel};
//! // ClientConfig::from_env() reads ANTHROPIC_API_KEY (and ANTHROPIC_BASE_URL).
//! let config = ClientConfig::new("sk-ant-...")
//! #   .base_url(fake.url())
//!     ;
//! let model = MessagesModel::new(config, "claude-sonnet-4-5")?.stream(false);
//! let result = Session::builder(LocalLoop::new(model)).run("Say hello").await?;
//! assert_eq!(result.text, "Hello!");
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

// Entry points for the fuzz targets in `fuzz/`; not part of the API (its own docs say so: an
// outer doc here would make rustdoc resolve the module doc's links from the crate root).
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod managed;
pub mod messages;
pub mod provision;
mod sse;

pub use http::{ApiKey, ClientConfig};
pub use managed::{ManagedAgents, ManagedConfig};
pub use messages::MessagesModel;
pub use provision::{AgentSpec, Provisioned};
