//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`)
//! through the same checks the fuzz targets run, so a regression shows in a plain `cargo test`
//! on stable, without nightly or libFuzzer. See `fuzz/README.md`.

use tether::fuzzing::replay;

const DIR: &str = env!("CARGO_MANIFEST_DIR");

#[test]
fn anthropic_messages() {
    replay(DIR, "anthropic_messages", |d| {
        tether_anthropic::fuzzing::check_messages_stream(d)
    });
}

#[test]
fn anthropic_managed() {
    replay(DIR, "anthropic_managed", |d| {
        tether_anthropic::fuzzing::check_managed_stream(d)
    });
}

#[test]
fn tool_args_streamed() {
    replay(DIR, "tool_args", |d| {
        tether_anthropic::fuzzing::check_streamed_arguments(&String::from_utf8_lossy(d))
    });
}
