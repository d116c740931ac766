//! The workspace tools' argument extraction: a tool name and the model's argument text, run by a
//! read-only Workspace; nothing outside its root ever comes back.
//! The oracle lives in the crate (`fuzzing` module) so the corpus replays on `cargo test`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tether::fuzzing::check_workspace_call(data);
});
