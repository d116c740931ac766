//! The step seam: how the engine's model calls and tool calls become journaled steps.
//!
//! The engine ([`tether::Session`] with the local loop) runs as ordinary async Rust. It is given
//! a [`StepModel`] as its [`ChatModel`] and a [`StepHandler`] as its [`Handler`]; both only send
//! a [`Step`] down a channel and wait for its answer. The Restate handler that owns the
//! invocation's context receives the steps, one at a time in the order the engine asks for
//! them, and runs each inside `ctx.run` (see [`crate::object`]). Restate therefore sees a
//! journal of `run` entries in the engine's order, and only this crate knows the SDK.
//!
//! The order must be the same when a turn is replayed after a crash: the engine asks for the
//! same steps in the same order when it starts from the same record and gets the same step
//! results back. That is why the turn runs tool calls one at a time
//! ([`tether::SessionConfig::tool_concurrency`] = 1) and starts from a journaled snapshot of the
//! record (see [`crate::record`]).

use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tether::chat::{ChatRequest, ChatResponse};
use tether::{
    ChatModel, DeltaSink, Error, Event, Handler, PendingToolUse, Result, SessionInfo, ToolOutput, ToolUse,
};
use tokio::sync::{mpsc, oneshot};

/// One step the engine asks the durable-execution engine to run (or to replay from its journal).
#[derive(Debug)]
#[non_exhaustive]
pub enum Step {
    /// One model call; its deltas go to `deltas` live (out of band), its response is journaled.
    Model {
        /// The request.
        request: ChatRequest,
        /// Where the call's token deltas go while it runs.
        deltas: DeltaSink,
        /// The response, or the failure the engine gets.
        reply: oneshot::Sender<Result<ChatResponse>>,
    },
    /// One tool call; its output is journaled.
    Tool {
        /// The call.
        call: Box<ToolUse>,
        /// The session the call belongs to.
        info: Box<SessionInfo>,
        /// The tool's output.
        reply: oneshot::Sender<ToolOutput>,
    },
    /// The turn waits for a person to approve (or deny) tool uses.
    Approval {
        /// The tool uses waiting.
        pending: Vec<PendingToolUse>,
        /// The decision that came in.
        reply: oneshot::Sender<Result<Decision>>,
    },
}

/// What a person decided about a tool use waiting for approval (the body of the `approve`
/// handler), or a cancel of the waiting turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Decision {
    /// An answer for one tool use: only `approved: true` approves.
    Answer {
        /// The tool use's id.
        tool_use_id: String,
        /// Whether it may run.
        approved: bool,
    },
    /// The turn is cancelled: every waiting tool use gets an error result, and the turn ends.
    Cancel,
}

/// A tool's output as the journal keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "text", rename_all = "snake_case")]
pub(crate) enum JournaledOutput {
    Ok(String),
    Error(String),
    Pending,
}

impl From<ToolOutput> for JournaledOutput {
    fn from(o: ToolOutput) -> Self {
        match o {
            ToolOutput::Ok(s) => JournaledOutput::Ok(s),
            ToolOutput::Error(s) => JournaledOutput::Error(s),
            ToolOutput::Pending => JournaledOutput::Pending,
            // A kind this crate does not know yet: never run as a success.
            _ => JournaledOutput::Error(
                "the tool returned an output kind the Restate backend cannot journal".into(),
            ),
        }
    }
}

impl From<JournaledOutput> for ToolOutput {
    fn from(o: JournaledOutput) -> Self {
        match o {
            JournaledOutput::Ok(s) => ToolOutput::Ok(s),
            JournaledOutput::Error(s) => ToolOutput::Error(s),
            JournaledOutput::Pending => ToolOutput::Pending,
        }
    }
}

/// The engine's end of the step channel.
#[derive(Debug, Clone)]
pub struct StepClient {
    tx: mpsc::Sender<Step>,
}

/// The error the engine gets when the step runner is gone (the invocation ended or was dropped).
fn runner_gone() -> Error {
    Error::Provider {
        provider: "restate".into(),
        message: "the durable step runner stopped before answering (the invocation ended)".into(),
    }
}

impl StepClient {
    /// A client and the receiving end the step runner reads.
    pub fn channel() -> (StepClient, mpsc::Receiver<Step>) {
        let (tx, rx) = mpsc::channel(1);
        (StepClient { tx }, rx)
    }

    /// Waits for a decision about the pending tool uses.
    pub async fn approval(&self, pending: Vec<PendingToolUse>) -> Result<Decision> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Step::Approval { pending, reply })
            .await
            .map_err(|_| runner_gone())?;
        rx.await.map_err(|_| runner_gone())?
    }
}

/// A [`ChatModel`] whose every call is a journaled step.
pub struct StepModel {
    inner: Arc<dyn ChatModel>,
    steps: StepClient,
}

impl StepModel {
    /// Wraps `inner` (which the step runner calls) for an engine that sends its calls to `steps`.
    pub fn new(inner: Arc<dyn ChatModel>, steps: StepClient) -> Self {
        StepModel { inner, steps }
    }
}

#[async_trait]
impl ChatModel for StepModel {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn default_model(&self) -> &str {
        self.inner.default_model()
    }

    fn endpoint(&self) -> Option<&str> {
        self.inner.endpoint()
    }

    async fn chat(&self, req: &ChatRequest, deltas: &DeltaSink) -> Result<ChatResponse> {
        let (reply, rx) = oneshot::channel();
        self.steps
            .tx
            .send(Step::Model {
                request: req.clone(),
                deltas: deltas.clone(),
                reply,
            })
            .await
            .map_err(|_| runner_gone())?;
        rx.await.map_err(|_| runner_gone())?
    }
}

/// A [`Handler`] whose every tool call is a journaled step; everything else is the inner
/// handler's.
pub struct StepHandler {
    inner: Arc<dyn Handler>,
    steps: StepClient,
}

impl StepHandler {
    /// Wraps `inner` (whose tools the step runner calls) for an engine that sends its tool calls
    /// to `steps`.
    pub fn new(inner: Arc<dyn Handler>, steps: StepClient) -> Self {
        StepHandler { inner, steps }
    }
}

#[async_trait]
impl Handler for StepHandler {
    fn tools(&self) -> Vec<tether::ToolSpec> {
        self.inner.tools()
    }
    fn tools_version(&self) -> Option<u64> {
        self.inner.tools_version()
    }

    async fn call_tool(&self, call: &ToolUse, info: &SessionInfo) -> ToolOutput {
        let (reply, rx) = oneshot::channel();
        let sent = self
            .steps
            .tx
            .send(Step::Tool {
                call: Box::new(call.clone()),
                info: Box::new(info.clone()),
                reply,
            })
            .await;
        if sent.is_err() {
            return ToolOutput::Error(runner_gone().to_string());
        }
        rx.await
            .unwrap_or_else(|_| ToolOutput::Error(runner_gone().to_string()))
    }

    fn needs_approval(&self, call: &ToolUse) -> Option<String> {
        self.inner.needs_approval(call)
    }

    async fn on_event(&self, event: &Event, info: &SessionInfo) {
        self.inner.on_event(event, info).await
    }

    fn capabilities(&self) -> tether::Capabilities {
        self.inner.capabilities()
    }
}
