//! An AG-UI RunAgentInput request body, served by run_agent; the same bytes as an Accept header.
//! The oracle lives in the crate (`fuzzing` module) so the corpus replays on `cargo test`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tether_agui::fuzzing::check_run_agent_input(data);
});
