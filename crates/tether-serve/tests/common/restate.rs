//! The Restate backend switch of the serve suite: with `TETHER_SERVE_BACKEND=restate` (and the
//! `restate` cargo feature) every [`super::Env`] starts a real single-node `restate-server`
//! (`tether_testkit::restate`, installed from npm by `conformance/restate/setup.sh`) and its
//! configuration puts the agent's turns on it, so the suite's scenarios run unchanged on that
//! backend.

pub use tether_testkit::restate::Restate;

/// Whether this run keeps the records in PostgreSQL (`TETHER_RESTATE_RECORD=shared`, with
/// `TETHER_SERVE_BACKEND=restate`): each test then starts its own server
/// (`tether_testkit::postgres`) and its nodes' configurations name it (`restate_postgres`).
pub fn shared() -> bool {
    enabled() && std::env::var("TETHER_RESTATE_RECORD").is_ok_and(|r| r == "shared")
}

/// A PostgreSQL for a test's nodes when [`shared`], else none.
pub async fn postgres() -> Option<tether_testkit::postgres::Postgres> {
    if shared() {
        Some(tether_testkit::postgres::Postgres::start().await)
    } else {
        None
    }
}

/// The `[server]` line naming `pg` as the records' database (empty without one).
pub fn shared_lines(pg: Option<&tether_testkit::postgres::Postgres>) -> String {
    pg.map(|p| format!("restate_postgres = \"{}\"\n", p.connection()))
        .unwrap_or_default()
}

/// Whether this run of the suite is on the Restate backend.
pub fn enabled() -> bool {
    std::env::var("TETHER_SERVE_BACKEND").is_ok_and(|b| b == "restate")
}

/// The `[server]` lines of a node whose turns run on the Restate cluster at `ingress`/`admin`,
/// its service endpoint listening on `127.0.0.1:{listen}` and advertised to Restate as
/// `advertise` (a forwarder in front of several nodes' endpoints).
pub fn node_lines(ingress: &str, admin: &str, listen: u16, advertise: &str) -> String {
    format!(
        "backend = \"restate\"\nrestate_ingress = \"{ingress}\"\nrestate_admin = \"{admin}\"\n\
         restate_listen = \"127.0.0.1:{listen}\"\nrestate_advertise = \"{advertise}\"\n"
    )
}
