//! An OpenAI chat-completion SSE body: split-invariant, fast path = serde, deltas = response.
//! The oracle lives in the crate (`fuzzing` module) so the corpus replays on `cargo test`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tether_openai::fuzzing::check_sse_stream(data);
});
