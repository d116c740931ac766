//! The real `tether` and `tether-serve` binaries, built on first use.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `cargo build -q -p <package> <target...>` into this test's own target directory and profile
/// (`--release` when the test was built with it), returning that profile's directory.
fn cargo_build(package: &str, target: &[&str]) -> PathBuf {
    let exe = std::env::current_exe().expect("test exe path");
    // target/<profile>/deps/<test> → target/<profile>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.args(["build", "-q", "-p", package]).args(target);
    if dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    let status = cmd.current_dir(repo_root()).status().expect("run cargo build");
    assert!(status.success(), "building {package} {target:?} failed");
    dir
}

/// Builds `bin` of `package` into this test's target directory and returns its path.
fn built(package: &str, bin: &str) -> PathBuf {
    let path = cargo_build(package, &["--bin", bin]).join(bin);
    assert!(path.exists(), "{bin} not found at {}", path.display());
    path
}

/// The `tether` binary.
pub fn tether() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| built("tether-runtime", "tether")).clone()
}

/// The `tether-serve` binary.
pub fn tether_serve() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| built("tether-serve", "tether-serve")).clone()
}

/// A 127.0.0.1 port nothing listens on (bound, then released).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let p = l.local_addr().expect("addr").port();
    drop(l);
    p
}

/// Removes the OTEL_* and tether variables of the test's own environment from `cmd`.
pub fn clean_env(cmd: &mut tokio::process::Command) {
    for (k, _) in std::env::vars_os() {
        if let Some(k) = k.to_str()
            && (k.starts_with("OTEL_")
                || k == "OPENAI_BASE_URL"
                || k == "OPENAI_API_KEY"
                || k == "TETHER_MODEL")
        {
            cmd.env_remove(k);
        }
    }
}

/// The MCP fault server (`tether-mcp`'s example): a real MCP server over stdio.
pub fn fault_server() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let path = cargo_build("tether-mcp", &["--example", "fault_server"])
            .join("examples")
            .join("fault_server");
        assert!(path.exists(), "fault_server not found at {}", path.display());
        path
    })
    .clone()
}
