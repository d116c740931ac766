//! Raw HTTP response bytes to an OpenAiModel on the lean HTTP/1.1 client, over a real socket.
//! The oracle lives in the crate (`fuzzing` module) so the corpus replays on `cargo test`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tether_openai::fuzzing::check_http_response(data);
});
