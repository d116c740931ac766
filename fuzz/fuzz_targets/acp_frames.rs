//! ACP JSON-RPC lines: the session/update fast path against the schema's decode.
//! The oracle lives in the crate (`fuzzing` module) so the corpus replays on `cargo test`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tether_acp::fuzzing::check_frame_lines(data);
});
