//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`)
//! through the same checks the fuzz targets run, so a regression shows in a plain `cargo test`
//! on stable, without nightly or libFuzzer. See `fuzz/README.md`.

use tether::fuzzing::replay;

const DIR: &str = env!("CARGO_MANIFEST_DIR");

#[test]
fn agui_input() {
    replay(DIR, "agui_input", |d| {
        tether_agui::fuzzing::check_run_agent_input(d)
    });
}
