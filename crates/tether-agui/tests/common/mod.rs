#![allow(dead_code)]
//! Shared test helpers.

use std::sync::Arc;

use serde_json::Value;
use tether_agui::{AgUiEvent, Agent, RunAgentInput, RunOptions, run_agent};

/// Declares a unit-struct agent from a body.
#[macro_export]
macro_rules! agent {
    ($name:ident, $state:ty, |$ctx:ident| $body:block) => {
        struct $name;
        impl tether_agui::Agent for $name {
            type State = $state;
            async fn run(
                &self,
                $ctx: &mut tether_agui::RunContext<$state>,
            ) -> tether_agui::AgUiResult<tether_agui::RunOutcome> {
                $body
            }
        }
    };
}

pub fn input() -> RunAgentInput {
    RunAgentInput::new("t1", "r1").with_message(tether_agui::Message::user("u1", "hello"))
}

pub async fn run<A: Agent>(agent: A, input: RunAgentInput) -> Vec<AgUiEvent> {
    run_agent(Arc::new(agent), input, RunOptions::default())
        .collect_all()
        .await
}

pub fn to_json(events: &[AgUiEvent]) -> Vec<Value> {
    events
        .iter()
        .map(|e| serde_json::to_value(e).expect("events serialize"))
        .collect()
}

pub fn types(events: &[AgUiEvent]) -> Vec<&'static str> {
    events.iter().map(|e| e.event_type().as_str()).collect()
}
