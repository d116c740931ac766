//! A Claude Managed Agents event stream.
//! The oracle lives in the crate (`fuzzing` module) so the corpus replays on `cargo test`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tether_anthropic::fuzzing::check_managed_stream(data);
});
