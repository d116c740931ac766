//! The sandbox runner's process lifetime: a command never outlives what started it.

#![cfg(target_os = "linux")]

use std::time::{Duration, Instant};

use tether::sandbox::{CommandSpec, Sandbox, SandboxMode};

/// The state letter of `/proc/<pid>/stat` (`Z`: exited, not yet reaped), or `None` when gone.
fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// A command whose starter goes away without killing it (here: the thread that spawned it ends
/// with its `Process` leaked, as when tether is SIGKILLed mid-call) is killed with it. Before,
/// it ran on: a killed server's tool command finished its effect after the restarted server had
/// run the tool again (the serve crash test's double run under load).
#[test]
fn a_command_dies_with_the_thread_that_started_it() {
    for mode in [SandboxMode::Off, SandboxMode::Auto] {
        let dir = tempfile::tempdir().expect("tempdir");
        let cwd = dir.path().to_path_buf();
        let pid = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let p = Sandbox::new(mode)
                    .spawn(&CommandSpec::shell("exec sleep 60", &cwd))
                    .expect("spawn");
                let pid = p.child.id().expect("a pid");
                std::mem::forget(p); // no kill on drop: only the thread's end is left
                pid
            })
        })
        .join()
        .expect("the thread");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match state(pid) {
                None | Some('Z') => break,
                Some(s) => assert!(
                    Instant::now() < deadline,
                    "{mode:?}: the command (pid {pid}) still runs (state {s}) after its starter ended"
                ),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
