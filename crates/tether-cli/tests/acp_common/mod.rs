//! What the ACP tests of the `tether` binary share: the two agents they drive (the ACP SDK's
//! example agent, the judge, and the testkit's scripted `fake-acp-agent`), a one-shot runner
//! with a deadline, and an interactive `tether acp` driven line by line.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a test waits for something that must happen (generous: a loaded 2-core machine).
pub const WAIT: Duration = Duration::from_secs(60);

pub use tether_testkit::peers::{acp_example_agent as example_agent, fake_acp_agent as fake_agent};

/// The command line of the example agent (after `--`).
pub fn example_argv() -> Vec<String> {
    vec!["node".into(), example_agent().display().to_string()]
}

/// The command line of the fake agent (after `--`).
pub fn fake_argv() -> Vec<String> {
    vec![fake_agent().display().to_string()]
}

fn base_command(dir: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tether"));
    cmd.current_dir(dir)
        .env_remove("TETHER_PROVIDER")
        .env_remove("TETHER_MODEL")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY");
    cmd
}

/// How a one-shot `tether` ended.
#[derive(Debug)]
pub struct Ran {
    /// The exit code (`None`: killed by a signal).
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `tether <args> -- <agent…>` in `dir` with `stdin` written to it, `env` set, and fails the
/// test if it has not exited within [`WAIT`].
pub fn tether(dir: &Path, args: &[&str], agent: &[String], stdin: &str, env: &[(&str, &str)]) -> Ran {
    let mut cmd = base_command(dir);
    cmd.args(args)
        .arg("--")
        .args(agent)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("the tether binary starts");
    if let Some(mut i) = child.stdin.take() {
        let _ = i.write_all(stdin.as_bytes());
    }
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
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "tether {args:?} did not exit within {WAIT:?}\nstdout:\n{}\nstderr:\n{}",
                out_t.join().unwrap(),
                err_t.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ran {
        code: status.code(),
        stdout: out_t.join().unwrap(),
        stderr: err_t.join().unwrap(),
    }
}

/// An interactive `tether acp`, its stdout read line by line.
pub struct Cli {
    pub child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    /// How many of `seen` [`Cli::wait_for`] has consumed.
    consumed: usize,
    stderr: std::thread::JoinHandle<String>,
}

impl Cli {
    /// Starts `tether acp --cwd <cwd> <extra…> -- <agent…>`.
    pub fn start(extra: &[&str], cwd: &Path, agent: &[String]) -> Cli {
        Self::start_with_env(extra, cwd, agent, &[])
    }

    /// [`Cli::start`] with environment variables set.
    pub fn start_with_env(extra: &[&str], cwd: &Path, agent: &[String], env: &[(&str, &str)]) -> Cli {
        let mut cmd = base_command(cwd);
        cmd.arg("acp")
            .arg("--cwd")
            .arg(cwd)
            .args(extra)
            .arg("--")
            .args(agent)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start tether acp");
        let stdout = child.stdout.take().expect("stdout");
        let mut stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        });
        Cli {
            stdin: child.stdin.take(),
            child,
            lines: rx,
            seen: Vec::new(),
            consumed: 0,
            stderr,
        }
    }

    /// Types `line` (which may hold several lines) and Enter, in one write.
    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(format!("{line}\n").as_bytes()).unwrap();
        stdin.flush().unwrap();
    }

    /// Sends SIGINT to `tether acp` (what Ctrl-C at a terminal does to its foreground process).
    pub fn interrupt(&self) {
        let pid = self.child.id().to_string();
        let st = Command::new("kill").args(["-INT", &pid]).status().unwrap();
        assert!(st.success());
    }

    /// Waits for a line containing `needle` after the lines earlier waits consumed, returning
    /// everything seen so far; the matching line and those before it are consumed.
    pub fn wait_for(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(i) = self.seen[self.consumed..].iter().position(|l| l.contains(needle)) {
                self.consumed += i + 1;
                return self.seen.join("\n");
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => panic!(
                    "timed out waiting for {needle:?}; output so far:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Closes stdin (Ctrl-D), waits for the exit; returns the status, all stdout and stderr.
    pub fn finish(mut self) -> (std::process::ExitStatus, String, String) {
        drop(self.stdin.take());
        let deadline = Instant::now() + WAIT;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "tether acp did not exit after end of input; output:\n{}",
                    self.seen.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // The rest of its output, up to the end of the pipe (the reader thread then hangs up).
        while let Ok(l) = self.lines.recv_timeout(WAIT) {
            self.seen.push(l);
        }
        let stderr = self.stderr.join().unwrap_or_default();
        (status, self.seen.join("\n"), stderr)
    }
}
