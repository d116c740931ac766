//! Driving an [`Agent`] over one request: `RUN_STARTED` first, exactly one terminal last,
//! every event verified, the run cancelled (and its task aborted) when the stream is dropped.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use futures_util::{FutureExt, Stream};
use tokio::task::JoinHandle;

use crate::context::{AgentState, EventReceiver, RunContext, RunOptions, RunOutcome};
use crate::error::{AgUiError, AgUiResult};
use crate::event::AgUiEvent;
use crate::types::RunAgentInput;

/// An AG-UI agent: writes one run through a [`RunContext`].
///
/// ```
/// use tether_agui::{Agent, RunContext, RunOutcome, AgUiResult};
///
/// struct Echo;
/// impl Agent for Echo {
///     type State = ();
///     async fn run(&self, ctx: &mut RunContext) -> AgUiResult<RunOutcome> {
///         let text = ctx.last_user_text().unwrap_or_default();
///         ctx.say(format!("you said: {text}"))?;
///         Ok(RunOutcome::Success)
///     }
/// }
/// ```
pub trait Agent: Send + Sync + 'static {
    /// The typed state (`()` for none).
    type State: AgentState;

    /// Runs once. `Err` becomes `RUN_ERROR`; handles still open are closed by their `Drop`.
    fn run(&self, ctx: &mut RunContext<Self::State>) -> impl Future<Output = AgUiResult<RunOutcome>> + Send;
}

impl<A: Agent> Agent for Arc<A> {
    type State = A::State;
    fn run(&self, ctx: &mut RunContext<Self::State>) -> impl Future<Output = AgUiResult<RunOutcome>> + Send {
        (**self).run(ctx)
    }
}

/// The events of one served request. Dropping it cancels the run; a run that does not wind
/// down within a few seconds of that is aborted.
#[derive(Debug)]
pub struct EventStream {
    rx: EventReceiver,
    cancel: tether::CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl EventStream {
    /// The run's cancellation token.
    pub fn cancel_token(&self) -> &tether::CancellationToken {
        &self.cancel
    }

    /// Collects every event (for tests).
    pub async fn collect_all(mut self) -> Vec<AgUiEvent> {
        let mut out = Vec::new();
        while let Some(e) = self.rx.recv().await {
            out.push(e);
        }
        out
    }

    /// Polls for the next event.
    pub fn poll_next_event(&mut self, cx: &mut TaskContext<'_>) -> Poll<Option<AgUiEvent>> {
        self.rx.poll_recv(cx)
    }

    /// The next event if one is ready right now.
    pub fn try_next_event(&mut self) -> Option<AgUiEvent> {
        self.rx.try_recv()
    }

    /// Moves every event that is ready right now into `out` (at most `max`).
    pub fn drain_ready(&mut self, out: &mut Vec<AgUiEvent>, max: usize) {
        while out.len() < max
            && let Some(e) = self.try_next_event()
        {
            out.push(e);
        }
    }
}

impl Stream for EventStream {
    type Item = AgUiEvent;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<AgUiEvent>> {
        self.rx.poll_recv(cx)
    }
}

/// How long a cancelled run may take to wind down (its handles closing, a bridged session
/// interrupting its provider) before its task is aborted.
const CANCEL_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

impl Drop for EventStream {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            if task.is_finished() {
                return;
            }
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(async move {
                        let abort = task.abort_handle();
                        if tokio::time::timeout(CANCEL_GRACE, task).await.is_err() {
                            abort.abort();
                        }
                    });
                }
                Err(_) => task.abort(),
            }
        }
    }
}

/// Serves `input` with `agent` on a new task and returns its events.
///
/// The stream starts with `RUN_STARTED` and ends with exactly one `RUN_FINISHED` or
/// `RUN_ERROR`, whatever the agent does: a rule violation becomes `RUN_ERROR`, an `Err` or a
/// panic becomes `RUN_ERROR`, open handles are closed by their `Drop` before the terminal.
///
/// `RUN_STARTED` is queued before the run's task is spawned: a server polling the stream as soon
/// as this returns writes it with the response head, without waiting for the new task to be
/// scheduled (under load, a queue of other runs' tasks away).
pub fn run_agent<A: Agent>(agent: Arc<A>, input: RunAgentInput, options: RunOptions) -> EventStream {
    let (tx, rx) = EventReceiver::channel(options.buffer);
    let cancel = tether::CancellationToken::new();
    let mut ctx = RunContext::<A::State>::with_sender(Arc::new(input), tx, cancel.clone(), &options);
    let started = ctx.start(options.echo_input);
    let runtime = options.runtime.clone();
    let run = async move {
        let result = match started {
            Ok(()) => {
                let fut = AssertUnwindSafe(agent.run(&mut ctx)).catch_unwind();
                match fut.await {
                    Ok(r) => r,
                    Err(panic) => {
                        let what = panic
                            .downcast_ref::<&str>()
                            .map(|s| (*s).to_owned())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "panic".to_owned());
                        Err(AgUiError::agent(
                            "AGENT_PANIC",
                            format!("the agent panicked: {what}"),
                        ))
                    }
                }
            }
            Err(e) => Err(e),
        };
        // Boxed: the end's future (~1 KB) would otherwise size the run's task for its whole life.
        Box::pin(ctx.finish(result)).await;
    };
    let task = match runtime {
        Some(rt) => rt.spawn(run),
        None => tokio::spawn(run),
    };
    EventStream {
        rx,
        cancel,
        task: Some(task),
    }
}
