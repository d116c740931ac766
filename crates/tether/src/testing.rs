//! Test doubles (feature `test-util`, off by default): a scripted [`ChatModel`] and a sleeper
//! that records the delays a retry policy chose. Kept out of the default build so a program
//! using tether never links, nor sees in its docs, what only tests need; a crate's tests enable
//! the feature through their dev-dependency:
//!
//! ```toml
//! [dev-dependencies]
//! tether-core = { version = "0.1", features = ["test-util"] }
//! ```
//!
//! Both are re-exported at the crate root (`tether::ScriptedModel`, `tether::RecordingSleeper`).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;

use crate::chat::{ChatMessage, ChatModel, ChatRequest, ChatResponse, ChatToolCall};
use crate::error::Result;
use crate::retry::Sleeper;
use crate::sink::DeltaSink;

/// A [`ChatModel`] that replays scripted responses in order: for tests and examples.
///
/// ```
/// use tether::{ChatMessage, ChatResponse, ScriptedModel};
/// let m = ScriptedModel::new(vec![Ok(ScriptedModel::text("hello"))]);
/// assert_eq!(m.remaining(), 1);
/// ```
#[derive(Debug, Default)]
pub struct ScriptedModel {
    script: std::sync::Mutex<std::collections::VecDeque<Result<ChatResponse>>>,
    requests: std::sync::Mutex<Vec<ChatRequest>>,
    keep_requests: bool,
}

impl ScriptedModel {
    /// A model that answers with `script`, one entry per call.
    pub fn new(script: Vec<Result<ChatResponse>>) -> Self {
        ScriptedModel {
            script: std::sync::Mutex::new(script.into()),
            requests: Default::default(),
            keep_requests: true,
        }
    }

    /// The same model keeping no copy of the requests it gets ([`ScriptedModel::requests`] stays
    /// empty): for benchmarks, where that copy of the whole history each turn is a cost no real
    /// model client has.
    pub fn without_request_log(mut self) -> Self {
        self.keep_requests = false;
        self
    }

    /// A plain text response with finish reason `stop`.
    pub fn text(text: &str) -> ChatResponse {
        ChatResponse {
            message: ChatMessage::assistant(text),
            finish_reason: Some("stop".into()),
            usage: None,
            raw: Value::Null,
        }
    }

    /// A response calling tools: `(id, name, arguments)`.
    pub fn tool_calls(calls: &[(&str, &str, &str)]) -> ChatResponse {
        let mut m = ChatMessage::assistant("");
        m.content = None;
        m.tool_calls = calls
            .iter()
            .map(|(id, name, args)| ChatToolCall {
                id: (*id).into(),
                name: (*name).into(),
                arguments: (*args).into(),
            })
            .collect();
        ChatResponse {
            message: m,
            finish_reason: Some("tool_calls".into()),
            usage: None,
            raw: Value::Null,
        }
    }

    /// Responses not yet used.
    pub fn remaining(&self) -> usize {
        self.script.lock().map(|s| s.len()).unwrap_or(0)
    }

    /// The requests received so far.
    pub fn requests(&self) -> Vec<ChatRequest> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

#[async_trait]
impl ChatModel for ScriptedModel {
    fn name(&self) -> &str {
        "scripted"
    }

    async fn chat(&self, req: &ChatRequest, deltas: &DeltaSink) -> Result<ChatResponse> {
        if self.keep_requests
            && let Ok(mut r) = self.requests.lock()
        {
            r.push(req.clone());
        }
        let next = self.script.lock().ok().and_then(|mut s| s.pop_front());
        let resp = next.unwrap_or_else(|| {
            Err(crate::Error::malformed(
                "the scripted model has no more responses",
            ))
        })?;
        if let Some(t) = &resp.message.content {
            deltas.text(t).await;
        }
        for c in &resp.message.tool_calls {
            deltas.tool_call_start(&c.id, &c.name).await;
            deltas.tool_call_args(&c.id, &c.arguments).await;
            deltas.tool_call_end(&c.id).await;
        }
        Ok(resp)
    }
}

/// Returns at once and records every requested delay: for tests.
#[derive(Debug, Clone, Default)]
pub struct RecordingSleeper {
    slept: Arc<Mutex<Vec<Duration>>>,
}

impl RecordingSleeper {
    /// The delays requested so far.
    pub fn slept(&self) -> Vec<Duration> {
        self.slept.lock().map(|g| g.clone()).unwrap_or_default()
    }
}

impl Sleeper for RecordingSleeper {
    fn sleep(&self, d: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        if let Ok(mut g) = self.slept.lock() {
            g.push(d);
        }
        Box::pin(async {})
    }
}
