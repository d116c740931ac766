//! Whatever an agent does through the handles (including failing half-way), the stream it
//! produces passes a fresh verifier and ends in exactly one terminal event.

use std::sync::Arc;

use proptest::prelude::*;
use serde::{Deserialize, Serialize};
use tether_agui::{
    AgUiError, AgUiEvent, AgUiResult, Agent, RunAgentInput, RunContext, RunOptions, RunOutcome, Verifier,
    run_agent,
};

#[derive(Debug, Clone)]
enum Op {
    Say(String),
    Think(String),
    BackendTool(String),
    FrontendTool,
    Step(Vec<Op>),
    Publish(u8),
    ParallelCalls(u8),
    FailInsideMessage,
    NextRun,
}

fn op() -> impl Strategy<Value = Op> {
    let leaf = prop_oneof![
        "[a-z \"é]{0,8}".prop_map(Op::Say),
        "[a-z]{0,8}".prop_map(Op::Think),
        "[a-z]{0,8}".prop_map(Op::BackendTool),
        Just(Op::FrontendTool),
        any::<u8>().prop_map(Op::Publish),
        (1u8..4).prop_map(Op::ParallelCalls),
        Just(Op::FailInsideMessage),
        Just(Op::NextRun),
    ];
    leaf.prop_recursive(2, 16, 4, |inner| {
        prop::collection::vec(inner, 0..4).prop_map(Op::Step)
    })
}

#[derive(Default, Serialize, Deserialize)]
struct Counter {
    n: u8,
}

struct Script(Vec<Op>);

fn exec(ctx: &mut RunContext<Counter>, op: &Op, runs: &mut u32) -> AgUiResult<()> {
    match op {
        Op::Say(t) => {
            ctx.say(t)?;
        }
        Op::Think(t) => {
            ctx.think(t)?;
        }
        Op::BackendTool(arg) => {
            let mut call = ctx.tool_call("lookup")?;
            call.args_json(&serde_json::json!({ "q": arg }))?;
            call.result("ok")?;
        }
        Op::FrontendTool => {
            let call = ctx.tool_call("confirm")?;
            call.end()?;
        }
        Op::Step(ops) => {
            let mut step = ctx.step(format!("step-{}", ops.len()))?;
            for o in ops {
                exec(&mut step, o, runs)?;
            }
        }
        Op::Publish(n) => {
            ctx.state_mut().n = *n;
            ctx.publish_state()?;
        }
        Op::ParallelCalls(k) => {
            let mut calls = ctx.parallel_tool_calls();
            let slots: Vec<_> = (0..*k)
                .map(|_| calls.start("search"))
                .collect::<AgUiResult<_>>()?;
            for s in &slots {
                calls.args(*s, "{}")?;
            }
            for s in slots {
                calls.result(s, "done")?;
            }
        }
        Op::FailInsideMessage => {
            let mut m = ctx.message()?;
            m.delta("partial")?;
            return Err(AgUiError::agent("SCRIPTED", "failed half-way"));
        }
        Op::NextRun => {
            *runs += 1;
            ctx.next_run(RunOutcome::Success, format!("r1-{runs}"))?;
        }
    }
    Ok(())
}

impl Agent for Script {
    type State = Counter;
    async fn run(&self, ctx: &mut RunContext<Counter>) -> AgUiResult<RunOutcome> {
        let mut runs = 0;
        for op in &self.0 {
            exec(ctx, op, &mut runs)?;
        }
        Ok(RunOutcome::Success)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn every_handle_script_yields_a_conformant_stream(ops in prop::collection::vec(op(), 0..8)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let events: Vec<AgUiEvent> = rt.block_on(async {
            run_agent(Arc::new(Script(ops)), RunAgentInput::new("t1", "r1"), RunOptions::default())
                .collect_all()
                .await
        });
        let mut v = Verifier::new();
        for e in &events {
            prop_assert!(v.observe(e).is_ok(), "{:?} rejected in {:#?}", e, events);
        }
        prop_assert!(v.finish().is_ok());
        let terminals = events
            .iter()
            .filter(|e| matches!(e, AgUiEvent::RunError(_)))
            .count();
        prop_assert!(terminals <= 1);
        let last = events.last().map(|e| e.event_type().as_str());
        prop_assert!(matches!(last, Some("RUN_FINISHED") | Some("RUN_ERROR")));
    }
}
