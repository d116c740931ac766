//! The workspace tools through the real `tether run` binary, driven by a scripted model: bounded
//! memory on a huge file, FIFOs that neither hang a tool nor the exit, a hung command ended at
//! the run's timeout with everything it started, and commands confined.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tether_testkit::openai::{FakeOpenAi, Reply};

/// How a `tether` child ended.
struct Ran {
    /// The exit code (`None`: killed by a signal, or by us at the deadline).
    code: Option<i32>,
    /// Whether it exited before the deadline.
    exited: bool,
    stdout: String,
    stderr: String,
    /// Its peak resident set, in KiB (from `wait4`).
    max_rss_kib: i64,
}

/// Runs `tether` in `dir` and waits at most `deadline` for it to exit (then kills it). Reaped
/// with `wait4` (which gives its peak memory), not `Child::wait`.
#[allow(clippy::zombie_processes)]
fn tether(dir: &Path, args: &[&str], env: &[(&str, &str)], deadline: Duration) -> Ran {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tether"));
    cmd.args(args)
        .current_dir(dir)
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY")
        .env_remove("TETHER_MODEL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("the tether binary starts");
    let pid = child.id() as libc::pid_t;
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let mut status = 0;
    // SAFETY: rusage is plain data, filled in by wait4.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let mut exited = true;
    loop {
        // SAFETY: wait4 on our own child, with valid out-pointers.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut ru) };
        if r == pid {
            break;
        }
        assert!(r == 0, "wait4 failed: {}", std::io::Error::last_os_error());
        if start.elapsed() > deadline {
            exited = false;
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // SAFETY: as above, now blocking until it is gone.
            unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    Ran {
        code,
        exited,
        stdout: out_t.join().unwrap(),
        stderr: err_t.join().unwrap(),
        max_rss_kib: ru.ru_maxrss,
    }
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s
            .rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z')),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_one_gb_sparse_file_is_read_with_bounded_memory() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[(
        "c1",
        "read_file",
        r#"{"path":"huge.bin","line":1,"limit":1}"#,
    )]));
    fake.push(Reply::text("read it"));
    let dir = tempfile::tempdir().unwrap();
    let f = std::fs::File::create(dir.path().join("huge.bin")).unwrap();
    f.set_len(1 << 30).unwrap();
    drop(f);
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let ran = tokio::task::spawn_blocking(move || {
        tether(
            &d,
            &["run", "--base-url", &url, "--model", "m", "read huge.bin"],
            &[],
            Duration::from_secs(120),
        )
    })
    .await
    .unwrap();
    assert!(
        ran.exited && ran.code == Some(0),
        "{}\n{}",
        ran.stdout,
        ran.stderr
    );
    // The tool result went back to the model capped, with the note.
    let sent = fake.requests()[1].messages().to_vec();
    let tool = sent.iter().find(|m| m["role"] == "tool").unwrap();
    let content = tool["content"].as_str().unwrap();
    assert!(
        content.len() < 300 * 1024,
        "{} bytes went to the model",
        content.len()
    );
    assert!(
        content.contains("[truncated: a read returns at most 262144 bytes"),
        "{}",
        &content[content.len() - 200..]
    );
    eprintln!("tether peak RSS: {} KiB", ran.max_rss_kib);
    // The old code read the whole file (and more): 1 GiB and up.
    assert!(
        ran.max_rss_kib < 200 * 1024,
        "tether peaked at {} MiB",
        ran.max_rss_kib / 1024
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fifo_neither_hangs_a_tool_nor_the_exit() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[
        ("c1", "read_file", r#"{"path":"pipe"}"#),
        ("c2", "search_files", r#"{"pattern":"needle"}"#),
    ]));
    fake.push(Reply::text("the pipe is not a file"));
    let dir = tempfile::tempdir().unwrap();
    mkfifo(&dir.path().join("pipe"));
    std::fs::write(dir.path().join("a.txt"), "needle\n").unwrap();
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let ran = tokio::task::spawn_blocking(move || {
        tether(
            &d,
            &["run", "--base-url", &url, "--timeout", "8", "look"],
            &[],
            Duration::from_secs(60),
        )
    })
    .await
    .unwrap();
    // The old code blocked in open(2) on the FIFO: the run timed out at 8 s and never exited.
    assert!(ran.exited, "tether did not exit\n{}\n{}", ran.stdout, ran.stderr);
    assert_eq!(ran.code, Some(0), "{}\n{}", ran.stdout, ran.stderr);
    assert!(
        ran.stdout.contains("✗ invalid request: pipe is a FIFO"),
        "{}",
        ran.stdout
    );
    assert!(ran.stdout.contains("✓ a.txt:1: needle"), "{}", ran.stdout);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hung_command_ends_at_the_run_timeout_with_everything_it_started() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[(
        "c1",
        "run_command",
        r#"{"command":"sleep 300 & echo $! > pid; wait"}"#,
    )]));
    fake.push(Reply::text("never reached"));
    let dir = tempfile::tempdir().unwrap();
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let ran = tokio::task::spawn_blocking(move || {
        tether(
            &d,
            &["run", "--base-url", &url, "--yes", "--timeout", "3", "hang"],
            &[],
            Duration::from_secs(60),
        )
    })
    .await
    .unwrap();
    assert!(ran.exited, "tether did not exit\n{}\n{}", ran.stdout, ran.stderr);
    assert_eq!(ran.code, Some(2), "{}\n{}", ran.stdout, ran.stderr);
    assert!(ran.stderr.contains("did not finish within 3s"), "{}", ran.stderr);
    let pid: i32 = std::fs::read_to_string(dir.path().join("pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let start = Instant::now();
    while !gone(pid) && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(gone(pid), "the command's child {pid} outlived tether");
}

#[tokio::test(flavor = "multi_thread")]
async fn commands_are_confined_and_do_not_see_api_keys() {
    let fake = FakeOpenAi::start().await;
    let outside = tempfile::tempdir().unwrap();
    let cmd = format!(
        "echo key=${{OPENAI_API_KEY:-none}}; echo inside > made.txt; touch {}/pwned",
        outside.path().display()
    );
    let args = serde_json::json!({ "command": cmd }).to_string();
    fake.push(Reply::tool_calls(&[("c1", "run_command", &args)]));
    fake.push(Reply::text("done"));
    let dir = tempfile::tempdir().unwrap();
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let ran = tokio::task::spawn_blocking(move || {
        tether(
            &d,
            &["run", "--base-url", &url, "--yes", "--sandbox", "require", "go"],
            &[("OPENAI_API_KEY", "sk-very-secret")],
            Duration::from_secs(60),
        )
    })
    .await
    .unwrap();
    assert_eq!(ran.code, Some(0), "{}\n{}", ran.stdout, ran.stderr);
    assert!(!ran.stderr.contains("warning"), "{}", ran.stderr);
    let sent = fake.requests()[1].messages().to_vec();
    let tool = sent.iter().find(|m| m["role"] == "tool").unwrap();
    let content = tool["content"].as_str().unwrap();
    assert!(
        content.contains("key=none") && !content.contains("sk-very-secret"),
        "{content}"
    );
    assert!(content.contains("Permission denied"), "{content}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("made.txt")).unwrap(),
        "inside\n"
    );
    assert!(!outside.path().join("pwned").exists());
    // The key still reached the model endpoint: only the command lost it.
    assert_eq!(
        fake.requests()[0].header("authorization"),
        Some("Bearer sk-very-secret")
    );
    // A mistyped mode is refused with the choices.
    let d = dir.path().to_path_buf();
    let ran = tokio::task::spawn_blocking(move || {
        tether(
            &d,
            &["run", "--sandbox", "strict", "go"],
            &[],
            Duration::from_secs(60),
        )
    })
    .await
    .unwrap();
    assert_eq!(ran.code, Some(2));
    assert!(ran.stderr.contains("auto, require or off"), "{}", ran.stderr);
}
