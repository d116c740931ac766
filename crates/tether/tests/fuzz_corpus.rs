//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`)
//! through the same checks the fuzz targets run, so a regression shows in a plain `cargo test`
//! on stable, without nightly or libFuzzer. See `fuzz/README.md`.

use tether::fuzzing::replay;

const DIR: &str = env!("CARGO_MANIFEST_DIR");

#[test]
fn tool_args() {
    replay(DIR, "tool_args", |d| {
        tether::fuzzing::check_tool_arguments(&String::from_utf8_lossy(d))
    });
}

#[test]
fn workspace_tools() {
    replay(DIR, "workspace_tools", tether::fuzzing::check_workspace_call);
}
