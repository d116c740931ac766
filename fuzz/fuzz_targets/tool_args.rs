//! Tool-call argument text: ToolUse decoding, the local loop, and each provider's streamed arguments.
//! The oracle lives in the crate (`fuzzing` module) so the corpus replays on `cargo test`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let args = String::from_utf8_lossy(data);
    tether::fuzzing::check_tool_arguments(&args);
    tether_openai::fuzzing::check_streamed_arguments(&args);
    tether_anthropic::fuzzing::check_streamed_arguments(&args);
    tether_agentcore::fuzzing::check_streamed_arguments(&args);
});
