//! Entry points for the fuzz targets in `fuzz/` and the corpus replay tests. **Not part of the
//! API**: hidden from the docs, free to change with the targets.
//!
//! [`check_run_agent_input`]: a request body as the server decodes it ([`decode_input`]), then
//! served by [`run_agent`] to an agent that reads the input the way agents do, every event of
//! the stream encoded both ways; the same bytes as an `Accept` header for the encoding
//! negotiation.

use serde_json::Value;
use tether::fuzzing::block_on;

use crate::context::{RunContext, RunOptions, RunOutcome};
use crate::encode::Encoding;
use crate::event::AgUiEvent;
use crate::run::{Agent, run_agent};
use crate::server::decode_input;

/// An agent that uses what a request carries: the last user text, the state, the tools.
struct Reader;

impl Agent for Reader {
    type State = Value;
    async fn run(&self, ctx: &mut RunContext<Value>) -> crate::AgUiResult<RunOutcome> {
        let text = ctx.last_user_text().unwrap_or_default();
        ctx.say(format!("you said: {text}"))?;
        let tools: Vec<String> = ctx.input().tools.iter().map(|t| t.name.clone()).collect();
        for name in tools {
            let _ = ctx.input().tool(&name);
        }
        Ok(RunOutcome::Success)
    }
}

/// A request body: decoding it never panics; what decodes survives the JSON round trip; served,
/// the run's stream starts with `RUN_STARTED` and ends with exactly one terminal event, and every
/// event encodes as SSE (whose JSON decodes back to the event) and as protobuf.
pub fn check_run_agent_input(body: &[u8]) {
    let _ = Encoding::negotiate(std::str::from_utf8(body).ok());
    let Ok(input) = decode_input(body) else {
        return;
    };
    let text = serde_json::to_vec(&input).expect("a RunAgentInput serializes");
    let again = decode_input(&text).expect("a serialized RunAgentInput decodes");
    assert_eq!(again, input, "the JSON round trip changed the input");

    let _ = crate::mapper::EventMapper::new(&input);
    for echo in [false, true] {
        let options = RunOptions {
            echo_input: echo,
            ..RunOptions::default()
        };
        let input = input.clone();
        let events = block_on(async {
            run_agent(std::sync::Arc::new(Reader), input, options)
                .collect_all()
                .await
        });
        assert!(
            matches!(events.first(), Some(AgUiEvent::RunStarted(_))),
            "the stream did not start with RUN_STARTED: {:?}",
            events.first()
        );
        let terminals = events
            .iter()
            .filter(|e| matches!(e, AgUiEvent::RunFinished(_) | AgUiEvent::RunError(_)))
            .count();
        assert_eq!(terminals, 1, "{terminals} terminal events");
        assert!(matches!(
            events.last(),
            Some(AgUiEvent::RunFinished(_) | AgUiEvent::RunError(_))
        ));
        for e in &events {
            let mut sse = Vec::new();
            Encoding::Sse
                .encode_into(e, &mut sse)
                .unwrap_or_else(|err| panic!("{:?} does not encode as SSE: {err}", e.event_type()));
            let payload = sse
                .strip_prefix(b"data: ")
                .and_then(|s| s.strip_suffix(b"\n\n"))
                .expect("one SSE data frame");
            let back: AgUiEvent = serde_json::from_slice(payload).expect("an encoded event decodes");
            assert_eq!(&back, e, "the SSE round trip changed the event");
            let mut proto = Vec::new();
            Encoding::Protobuf
                .encode_into(e, &mut proto)
                .expect("protobuf encoding");
        }
    }
}
