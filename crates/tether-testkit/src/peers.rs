//! Where the tests' peer programs are: the testkit's own scripted ACP agent (`fake-acp-agent`,
//! a binary of this package, built on first use) and the third-party judges installed by the
//! conformance setups (the ACP SDK's example agent, the MCP reference server). A judge that is
//! missing fails the test with how to install it, never a silent pass.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The repository's root (this crate lives at `crates/tether-testkit`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The testkit's scripted ACP agent, built once per process with the profile of the running
/// test or bench (`target/<profile>/deps/<exe>` → `target/<profile>/fake-acp-agent`).
/// `FAKE_ACP_AGENT=<path>` overrides it.
///
/// # Panics
/// When `cargo build` of the agent fails: a test cannot go on without its peer.
pub fn fake_acp_agent() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            if let Some(p) = std::env::var_os("FAKE_ACP_AGENT") {
                return p.into();
            }
            let exe = std::env::current_exe().expect("the running executable's path");
            let dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("the target profile directory")
                .to_path_buf();
            let release = dir.file_name().is_some_and(|n| n == "release");
            let mut args = vec!["build", "-q", "-p", "tether-testkit", "--bin", "fake-acp-agent"];
            if release {
                args.push("--release");
            }
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let status = Command::new(cargo)
                .args(&args)
                .current_dir(repo_root())
                .status()
                .expect("run cargo build for fake-acp-agent");
            assert!(status.success(), "building fake-acp-agent failed");
            let bin = dir.join("fake-acp-agent");
            assert!(bin.exists(), "fake-acp-agent not found at {}", bin.display());
            bin
        })
        .clone()
}

/// The ACP SDK's example agent (`conformance/acp`), the third-party judge of the ACP tests.
///
/// # Panics
/// When it is not installed, saying how to install it.
pub fn acp_example_agent() -> PathBuf {
    installed(
        "conformance/acp/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js",
        "the ACP SDK example agent",
        "conformance/acp/setup.sh",
    )
}

/// The pinned MCP reference server (`conformance/mcp`).
///
/// # Panics
/// When it is not installed, saying how to install it.
pub fn mcp_everything_server() -> PathBuf {
    installed(
        "conformance/mcp/node_modules/@modelcontextprotocol/server-everything/dist/index.js",
        "the MCP reference server",
        "(cd conformance/mcp && npm ci)",
    )
}

fn installed(rel: &str, what: &str, setup: &str) -> PathBuf {
    let p = repo_root().join(rel);
    assert!(
        p.exists(),
        "{what}, which judges this test, is not installed at {}: run {setup} \
         (scripts/test runs it before cargo test)",
        p.display()
    );
    p
}
