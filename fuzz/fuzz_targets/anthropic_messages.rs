//! An Anthropic Messages SSE body (and the same bytes as a whole message).
//! The oracle lives in the crate (`fuzzing` module) so the corpus replays on `cargo test`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tether_anthropic::fuzzing::check_messages_stream(data);
});
