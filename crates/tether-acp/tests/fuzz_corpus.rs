//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`)
//! through the same checks the fuzz targets run, so a regression shows in a plain `cargo test`
//! on stable, without nightly or libFuzzer. See `fuzz/README.md`.

use tether::fuzzing::replay;

const DIR: &str = env!("CARGO_MANIFEST_DIR");

#[test]
fn acp_frames() {
    replay(DIR, "acp_frames", tether_acp::fuzzing::check_frame_lines);
}

#[test]
fn acp_connection() {
    replay(DIR, "acp_connection", |d| {
        tether_acp::fuzzing::check_connection(d)
    });
}
