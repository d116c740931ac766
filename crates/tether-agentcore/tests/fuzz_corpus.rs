//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`)
//! through the same checks the fuzz targets run, so a regression shows in a plain `cargo test`
//! on stable, without nightly or libFuzzer. See `fuzz/README.md`.

use tether::fuzzing::replay;

const DIR: &str = env!("CARGO_MANIFEST_DIR");

#[test]
fn agentcore_eventstream() {
    replay(DIR, "agentcore_eventstream", |d| {
        tether_agentcore::fuzzing::check_eventstream(d)
    });
}

#[test]
fn agentcore_runtime() {
    replay(DIR, "agentcore_runtime", |d| {
        tether_agentcore::fuzzing::check_runtime_body(d)
    });
}

#[test]
fn tool_args_streamed() {
    replay(DIR, "tool_args", |d| {
        tether_agentcore::fuzzing::check_streamed_arguments(&String::from_utf8_lossy(d))
    });
}
