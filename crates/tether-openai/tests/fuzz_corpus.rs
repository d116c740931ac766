//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`)
//! through the same checks the fuzz targets run, so a regression shows in a plain `cargo test`
//! on stable, without nightly or libFuzzer. See `fuzz/README.md`.

use tether::fuzzing::replay;

const DIR: &str = env!("CARGO_MANIFEST_DIR");

#[test]
fn openai_sse() {
    replay(DIR, "openai_sse", tether_openai::fuzzing::check_sse_stream);
}

#[test]
fn openai_http() {
    replay(DIR, "openai_http", |d| {
        tether_openai::fuzzing::check_http_response(d)
    });
}

#[test]
fn tool_args_streamed() {
    replay(DIR, "tool_args", |d| {
        tether_openai::fuzzing::check_streamed_arguments(&String::from_utf8_lossy(d))
    });
}
