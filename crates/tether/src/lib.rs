//! # tether
//!
//! Run any AI agent, wherever its loop lives, with the tools kept local.
//!
//! This crate is tether's vocabulary and seams, and knows no wire format:
//! - [`Event`], [`ToolSpec`], [`ToolUse`], [`ToolResult`], [`Usage`], [`SessionInfo`],
//!   [`Terminal`], [`TurnResult`], [`SessionResult`]: what every provider speaks.
//! - [`Provider`] (where the loop lives), [`ChatModel`] (one model call for the local loop),
//!   [`Handler`] (where tools, permissions, files and terminals are served), [`EventStore`]
//!   (the exactly-once record and tool-result memo).
//! - [`Session`]: the engine, written once for every provider.
//! - [`local::LocalLoop`]: the in-process agent loop over any [`ChatModel`], with loop guards.
//! - [`RetryPolicy`]: one retry policy for every provider.
//! - [`workspace::Workspace`]: a ready handler serving files, searches and commands in a root.
//! - [`source`]: tool sources (MCP servers, plugins) composed onto any handler.
//! - [`sandbox::Sandbox`]: the confinement (Landlock, seccomp) and the one runner of commands.
//!
//! A session over the local loop, with a scripted model standing in for a real one
//! (`tether-openai`, `tether-anthropic`, `tether-gguf`) and the [`workspace::Workspace`] handler
//! serving the model's tool call from a directory (`ScriptedModel`, a model that replays a script,
//! is a test double behind the `test-util` feature; a real program uses a provider crate's model):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use tether::{ScriptedModel, Session, local::LocalLoop, workspace::Workspace};
//! let dir = tempfile::tempdir()?;
//! std::fs::write(dir.path().join("notes.txt"), "buy milk")?;
//! let model = ScriptedModel::new(vec![
//!     Ok(ScriptedModel::tool_calls(&[("call_1", "read_file", r#"{"path":"notes.txt"}"#)])),
//!     Ok(ScriptedModel::text("Your note says: buy milk")),
//! ]);
//! let result = Session::builder(LocalLoop::new(model))
//!     .handler(Workspace::new(dir.path())?)
//!     .run("What does my note say?")
//!     .await?;
//! assert_eq!(result.tool_uses[0].name, "read_file");
//! assert_eq!(result.text, "Your note says: buy milk");
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

pub mod chat;
pub mod error;
pub mod event;
// Entry points for the fuzz targets in `fuzz/`; not part of the API (its own docs say so: an
// outer doc here would make rustdoc resolve the module doc's links from the crate root).
#[doc(hidden)]
pub mod fuzzing;
pub mod handler;
#[cfg(feature = "json-scan")]
pub mod json_scan;
pub mod local;
pub mod priority;
pub mod provider;
pub mod raw;
pub mod retry;
pub mod sandbox;
pub mod session;
pub mod sink;
pub mod source;
pub mod store;
#[cfg(feature = "test-util")]
pub mod testing;
pub mod thread;
pub mod types;
pub mod workspace;

pub use chat::{ChatMessage, ChatModel, ChatRequest, ChatResponse, ChatToolCall};
pub use error::{BoxError, ConfigKind, Error, Result, TransportKind};
pub use event::{Event, EventKind, Role};
pub use handler::{
    Capabilities, ElicitationMode, ElicitationRequest, ElicitationResponse, ExitStatus, Handler,
    HandlerError, NoTools, PermissionKind, PermissionOption, PermissionOutcome, PermissionRequest,
    ReadTextFile, TerminalRequest, TerminalResponse, ToolOutput, ToolSet, ToolsVersion, WriteTextFile,
};
pub use provider::{Input, Opened, Provider, Resume, TurnContext};
pub use retry::{RetryPolicy, Sleeper, TokioSleeper};
pub use session::{GuardDecision, GuardInfo, Session, SessionBuilder, SessionConfig, SessionHandle};
pub use sink::{DeltaSink, EventObserver, EventSink, Mark, ModelCall, RunInput, Subscription};
pub use store::{EventStore, MemoryStore};
#[cfg(feature = "test-util")]
pub use testing::{RecordingSleeper, ScriptedModel};
pub use thread::{Checkpoint, Claim, Thread, ThreadId, ThreadStart, ThreadStore};
/// Cancels a request in flight ([`Session::send_cancellable`]); re-exported from tokio-util.
pub use tokio_util::sync::CancellationToken;
pub use types::{
    PendingToolUse, SessionInfo, SessionResult, StopReason, Terminal, ToolResult, ToolSpec, ToolUse,
    ToolUseResult, TurnResult, Usage, UserMessage, Waiting, stop_reason,
};
