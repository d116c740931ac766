//! The Restate backend switch of the serve suite: with `TETHER_SERVE_BACKEND=restate` (and the
//! `restate` cargo feature) every [`super::Env`] starts a real single-node `restate-server`
//! (`tether_testkit::restate`, installed from npm by `conformance/restate/setup.sh`) and its
//! configuration puts the agent's turns on it, so the suite's scenarios run unchanged on that
//! backend.

pub use tether_testkit::restate::Restate;

/// Whether this run of the suite is on the Restate backend.
pub fn enabled() -> bool {
    std::env::var("TETHER_SERVE_BACKEND").is_ok_and(|b| b == "restate")
}
