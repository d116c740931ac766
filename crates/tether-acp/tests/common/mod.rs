//! Shared test helpers: locating the peers and a recording handler.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use tether::Capabilities;
use tether_acp::schema::{
    ContentBlock, CreateElicitationRequest, CreateElicitationResponse, ElicitationAction,
    ReadTextFileRequest, ReadTextFileResponse, RequestId, RequestPermissionOutcome, RequestPermissionRequest,
    SelectedPermissionOutcome, SessionUpdate, TextContent, WriteTextFileRequest, WriteTextFileResponse,
};
use tether_acp::{
    AcpTerminalRequest, AcpTerminalResponse, AcpUpdate, ClientError, ClientHandler, RawMessage,
    SessionUpdateEvent,
};

/// How long a test waits for something that must happen (generous: a loaded 2-core machine).
pub const WAIT: Duration = Duration::from_secs(60);

#[allow(unused_imports)] // not every test binary uses both peers
pub use tether_testkit::peers::{acp_example_agent as example_agent, fake_acp_agent as fake_agent};

pub fn text(s: &str) -> Vec<ContentBlock> {
    vec![ContentBlock::Text(TextContent::new(s))]
}

/// How the recording handler answers permission requests.
#[derive(Clone, Debug)]
pub enum PermissionAnswer {
    Select(String),
    Cancelled,
    /// Never answers (until cancelled).
    Hang,
}

/// A handler that records everything and answers as configured.
pub struct Recorder {
    pub support: Capabilities,
    pub permission: Mutex<PermissionAnswer>,
    pub events: Mutex<Vec<SessionUpdateEvent>>,
    pub raw_messages: Mutex<Vec<String>>,
    pub permissions: Mutex<Vec<(RequestPermissionRequest, Option<RequestId>)>>,
    /// Every file/terminal/elicitation call that reached the handler.
    pub calls: Mutex<Vec<String>>,
    pub ext_notes: Mutex<Vec<String>>,
    pub completed: Mutex<Vec<String>>,
    pub update_delay: Option<Duration>,
    /// Notified whenever anything is recorded (see [`Recorder::wait_until`]).
    pub changed: tokio::sync::Notify,
}

impl Recorder {
    pub fn new(support: Capabilities, permission: PermissionAnswer) -> Arc<Self> {
        Arc::new(Self::build(support, permission, None))
    }
    pub fn build(
        support: Capabilities,
        permission: PermissionAnswer,
        update_delay: Option<Duration>,
    ) -> Self {
        Recorder {
            support,
            permission: Mutex::new(permission),
            events: Mutex::new(Vec::new()),
            raw_messages: Mutex::new(Vec::new()),
            permissions: Mutex::new(Vec::new()),
            calls: Mutex::new(Vec::new()),
            ext_notes: Mutex::new(Vec::new()),
            completed: Mutex::new(Vec::new()),
            update_delay,
            changed: tokio::sync::Notify::new(),
        }
    }

    /// Waits until `cond` holds, woken by each thing recorded; fails the test after [`WAIT`]
    /// naming `what`.
    pub async fn wait_until(&self, what: &str, cond: impl Fn(&Self) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            // Registered before the check, so a change between the two is not missed.
            notified.as_mut().enable();
            if cond(self) {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!(
                    "timed out after {WAIT:?} waiting for {what}; seen: {:?}",
                    self.kinds()
                );
            }
        }
    }
    pub fn texts(&self) -> Vec<String> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match &e.update {
                AcpUpdate::Known(u) => match u.as_ref() {
                    SessionUpdate::AgentMessageChunk(c) => match &c.content {
                        ContentBlock::Text(t) => Some(t.text.clone()),
                        _ => None,
                    },
                    _ => None,
                },
                _ => None,
            })
            .collect()
    }
    pub fn kinds(&self) -> Vec<String> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .map(|e| e.update.kind())
            .collect()
    }
    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

#[async_trait]
impl ClientHandler for Recorder {
    fn supports(&self) -> Capabilities {
        self.support
    }
    async fn session_update_with_message(&self, event: &SessionUpdateEvent, message: &RawMessage<'_>) {
        if let Some(d) = self.update_delay {
            tokio::time::sleep(d).await;
        }
        self.events.lock().unwrap().push(event.clone());
        self.raw_messages.lock().unwrap().push(message.json().to_owned());
        self.changed.notify_waiters();
    }
    async fn request_permission_with_message(
        &self,
        request: &RequestPermissionRequest,
        message: &RawMessage<'_>,
    ) -> RequestPermissionOutcome {
        self.permissions
            .lock()
            .unwrap()
            .push((request.clone(), message.id()));
        self.changed.notify_waiters();
        let answer = self.permission.lock().unwrap().clone();
        match answer {
            PermissionAnswer::Select(id) => {
                RequestPermissionOutcome::Selected(SelectedPermissionOutcome::new(id))
            }
            PermissionAnswer::Cancelled => RequestPermissionOutcome::Cancelled,
            PermissionAnswer::Hang => {
                std::future::pending::<()>().await;
                RequestPermissionOutcome::Cancelled
            }
        }
    }
    async fn read_text_file(&self, r: ReadTextFileRequest) -> Result<ReadTextFileResponse, ClientError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("read {}", r.path.display()));
        std::fs::read_to_string(&r.path)
            .map(ReadTextFileResponse::new)
            .map_err(|e| ClientError::not_found(e.to_string()))
    }
    async fn write_text_file(&self, r: WriteTextFileRequest) -> Result<WriteTextFileResponse, ClientError> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("write {}", r.path.display()));
        std::fs::write(&r.path, &r.content)
            .map(|_| WriteTextFileResponse::new())
            .map_err(|e| ClientError::internal(e.to_string()))
    }
    async fn terminal(
        &self,
        request: AcpTerminalRequest,
        _id: &RequestId,
    ) -> Result<AcpTerminalResponse, ClientError> {
        self.calls.lock().unwrap().push(format!(
            "{} {:?}",
            request.method(),
            match &request {
                AcpTerminalRequest::Create(c) => c.cwd.clone(),
                _ => None,
            }
        ));
        Err(ClientError::refused(
            "terminals are not run by the recording handler",
        ))
    }
    async fn form_elicitation(
        &self,
        r: CreateElicitationRequest,
    ) -> Result<CreateElicitationResponse, ClientError> {
        self.calls.lock().unwrap().push(format!("form {}", r.message));
        let content: Value = serde_json::json!({"name": "Ada"});
        let action: ElicitationAction =
            serde_json::from_value(serde_json::json!({"action":"accept","content":content}))
                .map_err(|e| ClientError::internal(e.to_string()))?;
        Ok(CreateElicitationResponse::new(action))
    }
    async fn url_elicitation(
        &self,
        r: CreateElicitationRequest,
    ) -> Result<CreateElicitationResponse, ClientError> {
        self.calls.lock().unwrap().push(format!("url {}", r.message));
        Ok(CreateElicitationResponse::new(ElicitationAction::Decline))
    }
    async fn elicitation_complete(&self, n: tether_acp::schema::CompleteElicitationNotification) {
        self.completed.lock().unwrap().push(n.elicitation_id.to_string());
        self.changed.notify_waiters();
    }
    async fn ext_method(
        &self,
        method: &str,
        params: &serde_json::value::RawValue,
    ) -> Result<Value, ClientError> {
        Ok(
            serde_json::json!({"method": method, "params": serde_json::from_str::<Value>(params.get()).unwrap_or(Value::Null)}),
        )
    }
    async fn ext_notification(&self, method: &str, _params: &serde_json::value::RawValue) {
        self.ext_notes.lock().unwrap().push(method.to_owned());
        self.changed.notify_waiters();
    }
}
