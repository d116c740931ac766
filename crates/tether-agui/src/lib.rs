//! # tether-agui
//!
//! Serves any tether session to a browser over [AG-UI](https://docs.ag-ui.com) 1.0, conformant
//! to the official TypeScript client (`@ag-ui/client@1.0.0`).
//!
//! - [`event`] and [`types`]: every AG-UI 1.0 event, `RunAgentInput` and the message types,
//!   serialized exactly as the schema says.
//! - [`encode`] and [`proto`]: the SSE and protobuf encoders, the latter byte-identical with
//!   `@ag-ui/proto@1.0.0`.
//! - [`verify`]: the server-side verifier that every served stream passes through.
//! - [`RunContext`] and its RAII handles; [`Agent`] and [`run_agent`].
//! - [`server`]: the axum router.
//!
//! This crate knows no provider crate; it depends only on the `tether` vocabulary.
//!
//! Events serialize as the AG-UI schema says and encode as SSE (or protobuf, [`Encoding`]):
//!
//! ```
//! use tether_agui::{AgUiEvent, encode::encode_sse};
//! let event = AgUiEvent::run_started("thread-1", "run-1");
//! let sse = String::from_utf8(encode_sse(&event)?).expect("SSE is UTF-8");
//! assert!(sse.starts_with("data: {"));
//! assert!(sse.contains(r#""type":"RUN_STARTED""#));
//! assert!(sse.contains(r#""threadId":"thread-1""#));
//! assert!(sse.ends_with("\n\n"));
//! # Ok::<(), serde_json::Error>(())
//! ```

#![deny(missing_docs)]

pub mod approval;
mod bytediff;
pub mod context;
pub mod encode;
pub mod error;
pub mod event;
// Entry points for the fuzz targets in `fuzz/`; not part of the API (its own docs say so: an
// outer doc here would make rustdoc resolve the module doc's links from the crate root).
#[doc(hidden)]
pub mod fuzzing;
pub mod ids;
pub mod mapper;
pub mod messages;
pub mod patch;
pub mod proto;
pub mod run;
pub mod server;
mod swar;
pub mod thread;
pub mod types;
pub mod verify;

pub use context::{
    AgentState, CallSlot, EventReceiver, MessageHandle, ParallelToolCalls, ReasoningHandle, RunContext,
    RunOptions, RunOutcome, StepGuard, ToolCallHandle, state_update, state_update_json,
};
pub use encode::Encoding;
pub use error::{AgUiError, AgUiResult};
pub use event::{AgUiEvent, EventType, PROTOCOL_VERSION};
pub use ids::{InterruptId, MessageId, RunId, SubagentRunId, ThreadId, ToolCallId};
pub use mapper::EventMapper;
pub use messages::thread_messages;
pub use run::{Agent, EventStream, run_agent};
pub use server::{AgUiRouterExt, EndpointOptions, StreamGuard, router};
pub use thread::{CheckError, PermissionPolicy, StateReducer, ThreadAgent, ThreadFactory, Update};
pub use types::*;
pub use verify::{Rule, Verifier, Violation};

#[allow(deprecated)]
pub use context::CancelToken;
/// The AG-UI event; renamed [`AgUiEvent`] so it is not confused with [`tether::Event`].
#[deprecated(note = "renamed `AgUiEvent`")]
pub type Event = AgUiEvent;
/// This crate's error; renamed [`AgUiError`] so it is not confused with [`tether::Error`].
#[deprecated(note = "renamed `AgUiError`")]
pub type Error = AgUiError;
/// This crate's result; renamed [`AgUiResult`] so it is not confused with [`tether::Result`].
#[deprecated(note = "renamed `AgUiResult`")]
pub type Result<T, E = AgUiError> = AgUiResult<T, E>;
