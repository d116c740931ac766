//! An AgentCore runtime container's SSE or JSON body.
//! The oracle lives in the crate (`fuzzing` module) so the corpus replays on `cargo test`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tether_agentcore::fuzzing::check_runtime_body(data);
});
