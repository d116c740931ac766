//! Terminal output is inert, and `tether run -` (issue 11, defect 6 and item 8), through the
//! real binary: a command that rewrites the screen is shown escaped in its approval question,
//! model text, previews and JSON lines carry no raw controls, the prompt can come from standard
//! input (approvals then come from the terminal, or are refused), and a run that timed out while
//! a question waits still exits.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tether_testkit::openai::{FakeOpenAi, Reply};

/// Runs the binary in `dir` with `stdin` as its input; `wrap` runs it under another program
/// (`setsid -w`: no controlling terminal).
fn tether_in(dir: &Path, wrap: &[&str], args: &[&str], stdin: &[u8]) -> Output {
    let bin = env!("CARGO_BIN_EXE_tether");
    let mut cmd = match wrap.split_first() {
        Some((w, rest)) => {
            let mut c = Command::new(w);
            c.args(rest).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    let mut child = cmd
        .args(args)
        .current_dir(dir)
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY")
        .env_remove("TETHER_MODEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the tether binary starts");
    let mut input = child.stdin.take().expect("stdin");
    let data = stdin.to_vec();
    // Written apart: the child may stop reading (a prompt too large) and the pipe fill up.
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(&data);
    });
    let out = child.wait_with_output().expect("tether exits");
    let _ = writer.join();
    out
}

async fn tether(dir: &Path, wrap: &[&str], args: &[&str], stdin: &[u8]) -> Output {
    let (dir, wrap, args, stdin) = (
        dir.to_path_buf(),
        wrap.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        args.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        stdin.to_vec(),
    );
    tokio::task::spawn_blocking(move || {
        let wrap: Vec<&str> = wrap.iter().map(String::as_str).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        tether_in(&dir, &wrap, &args, &stdin)
    })
    .await
    .unwrap()
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Characters that drive a terminal (newline and tab allowed where prose may hold them).
fn raw_controls(s: &str, allow_newlines: bool) -> Vec<char> {
    s.chars()
        .filter(|c| {
            let c = *c;
            if allow_newlines && (c == '\n' || c == '\t') {
                return false;
            }
            matches!(c, '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        })
        .collect()
}

const ERASER: &str = "touch pwned\r\u{1b}[2K\u{1b}[1Aecho harmless";

fn eraser_call() -> Reply {
    let args = json!({ "command": ERASER }).to_string();
    Reply::tool_calls(&[("c1", "run_command", &args)])
}

#[tokio::test(flavor = "multi_thread")]
async fn a_command_that_rewrites_the_screen_is_shown_escaped_and_refused() {
    let fake = FakeOpenAi::start().await;
    fake.push(eraser_call());
    fake.push(Reply::text("ok"));
    let dir = tempfile::tempdir().unwrap();
    let url = fake.url();
    let o = tether(dir.path(), &[], &["run", "--base-url", &url, "do it"], b"n\n").await;
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(
        err.contains("? allow run `touch pwned\\r\\x1b[2K\\x1b[1Aecho harmless`? [y]es"),
        "the exact command, escaped: {err:?}"
    );
    assert_eq!(raw_controls(&err, true), Vec::<char>::new(), "{err:?}");
    assert_eq!(raw_controls(&out, true), Vec::<char>::new(), "{out:?}");
    assert!(
        !dir.path().join("pwned").exists(),
        "the refused command did not run"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn model_text_and_tool_previews_print_inert() {
    let evil = "title\u{1b}]0;pwned\u{7} csi\u{9b}2J rtl\u{202e}txt.exe\u{2066}\nline two\tend";
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[("c1", "read_file", r#"{"path":"evil.txt"}"#)]).with_text(evil));
    fake.push(Reply::text("done"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("evil.txt"), "red\u{1b}[31m\u{9b}1;1H here").unwrap();
    let url = fake.url();
    let o = tether(
        dir.path(),
        &[],
        &["run", "--base-url", &url, "--yes", "read it"],
        b"",
    )
    .await;
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(
        out.contains("title\\x1b]0;pwned\\x07 csi\\u{9b}2J rtl\\u{202e}txt.exe\\u{2066}\nline two\tend"),
        "prose keeps its newline and tab, nothing else: {out:?}"
    );
    assert!(
        out.contains("red\\x1b[31m\\u{9b}1;1H here"),
        "the preview, escaped: {out:?}"
    );
    assert_eq!(raw_controls(&out, true), Vec::<char>::new(), "{out:?}");
    assert_eq!(raw_controls(&err, true), Vec::<char>::new(), "{err:?}");

    // --json: every line parses, holds no raw control, and decodes to the model's text.
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text(evil));
    let url = fake.url();
    let o = tether(
        dir.path(),
        &[],
        &["run", "--base-url", &url, "--json", "say it"],
        b"",
    )
    .await;
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert_eq!(raw_controls(&out, true), Vec::<char>::new(), "{out:?}");
    let said: String = out
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("a JSON line"))
        .filter_map(|v| v["event"]["kind"]["delta"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(said, evil);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prompt_comes_from_stdin_with_dash() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::text("It is here."));
    let dir = tempfile::tempdir().unwrap();
    let url = fake.url();
    let prompt = "What is in\nthis directory? ✓\n";
    let o = tether(
        dir.path(),
        &[],
        &["run", "--base-url", &url, "-"],
        prompt.as_bytes(),
    )
    .await;
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("It is here."), "{out}");
    let sent = fake.requests()[0].messages().last().cloned().unwrap();
    assert_eq!(sent["content"], prompt);

    for (input, says) in [
        (b" \n".to_vec(), "the prompt on standard input is empty"),
        (b"caf\xe9?".to_vec(), "not UTF-8 text"),
        (vec![b'a'; (1 << 20) + 10], "larger than 1 MiB"),
    ] {
        let o = tether(dir.path(), &[], &["run", "--base-url", &url, "-"], &input).await;
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(says), "{err}");
    }
    assert_eq!(fake.requests().len(), 1, "nothing was sent for a bad prompt");
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_prompt_on_stdin_and_no_terminal_approvals_are_refused() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[(
        "c1",
        "run_command",
        r#"{"command":"touch made"}"#,
    )]));
    fake.push(Reply::text("ok"));
    let dir = tempfile::tempdir().unwrap();
    let url = fake.url();
    // `setsid -w`: a new session, so no controlling terminal to open. The `y` after the prompt
    // is part of the prompt, not an answer.
    let o = tether(
        dir.path(),
        &["setsid", "-w"],
        &["run", "--base-url", &url, "-"],
        b"make a file\ny\n",
    )
    .await;
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    assert!(err.contains("? allow run `touch made`?"), "{err}");
    assert!(err.contains("no terminal to ask"), "{err}");
    assert!(!dir.path().join("made").exists());
    assert!(out.contains("✗ refused"), "{out}");
}

/// Runs `tether` with its prompt on a pipe and a pseudo-terminal as its controlling terminal
/// (python's `pty.fork`), answering `answer` to the first question seen on the terminal.
/// Returns what appeared on the terminal.
fn on_a_terminal(dir: &Path, args: &[&str], prompt: &str, answer: &str) -> String {
    let script = r#"
import os, pty, sys, json, time
args = json.loads(sys.argv[1]); prompt = sys.argv[2].encode(); answer = sys.argv[3].encode()
r, w = os.pipe()
pid, fd = pty.fork()
if pid == 0:
    os.close(w)
    os.dup2(r, 0)
    os.execv(args[0], args)
os.close(r)
os.write(w, prompt)
os.close(w)
seen = b""
answered = False
deadline = time.time() + 120
while time.time() < deadline:
    try:
        chunk = os.read(fd, 4096)
    except OSError:
        break
    if not chunk:
        break
    seen += chunk
    if not answered and b"[N]o: " in seen:
        os.write(fd, answer)
        answered = True
os.waitpid(pid, 0)
sys.stdout.write(seen.decode("utf-8", "replace"))
"#;
    let mut full = vec![env!("CARGO_BIN_EXE_tether").to_string()];
    full.extend(args.iter().map(|s| s.to_string()));
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(serde_json::to_string(&full).unwrap())
        .arg(prompt)
        .arg(answer)
        .current_dir(dir)
        .env_remove("OPENAI_BASE_URL")
        .env_remove("TETHER_MODEL")
        .output()
        .expect("python3 runs (scripts/test installs nothing for it: it is on every CI image)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_prompt_on_stdin_approvals_are_asked_on_the_terminal() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[(
        "c1",
        "run_command",
        r#"{"command":"touch made"}"#,
    )]));
    fake.push(Reply::text("ok"));
    let dir = tempfile::tempdir().unwrap();
    let url = fake.url();
    let d = dir.path().to_path_buf();
    let screen = tokio::task::spawn_blocking(move || {
        on_a_terminal(&d, &["run", "--base-url", &url, "-"], "make a file\n", "y\r")
    })
    .await
    .unwrap();
    assert!(screen.contains("? allow run `touch made`? [y]es"), "{screen}");
    assert!(
        dir.path().join("made").exists(),
        "the command ran once allowed: {screen}"
    );
    let sent = fake.requests()[0].messages().last().cloned().unwrap();
    assert_eq!(sent["content"], "make a file\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_that_times_out_while_a_question_waits_still_exits() {
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[(
        "c1",
        "run_command",
        r#"{"command":"touch made"}"#,
    )]));
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(["run", "--base-url", &fake.url(), "--timeout", "2", "make a file"])
        .current_dir(dir.path())
        .env_remove("TETHER_MODEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Standard input stays open and silent: the question is never answered.
    let _stdin = child.stdin.take();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let Some(status) = status else {
        let _ = child.kill();
        panic!("tether did not exit after its timeout while a question waited on stdin");
    };
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("did not finish within 2s"), "{err}");
    assert!(!dir.path().join("made").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn tether_acp_prints_agent_text_and_questions_inert() {
    let agent = tokio::task::spawn_blocking(tether_testkit::peers::fake_acp_agent)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().to_path_buf();
    let screen = tokio::task::spawn_blocking(move || {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tether"))
            .arg("acp")
            .arg("--cwd")
            .arg(&cwd)
            .arg("--")
            .arg(&agent)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start tether acp");
        let mut stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<u8>();
        std::thread::spawn(move || {
            for b in std::io::BufReader::new(stdout).bytes().map_while(Result::ok) {
                if tx.send(b).is_err() {
                    break;
                }
            }
        });
        let mut seen = Vec::new();
        let mut wait_for = |what: &str| {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !String::from_utf8_lossy(&seen).contains(what) {
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left) {
                    Ok(b) => seen.push(b),
                    Err(_) => panic!(
                        "no {what:?} from tether acp; saw {:?}",
                        String::from_utf8_lossy(&seen)
                    ),
                }
            }
        };
        // The agent says back what it is told (controls included) ...
        stdin
            .write_all("echo hi\u{1b}[2Jthere\u{9b}31m\u{202e}xe.txt\n".as_bytes())
            .unwrap();
        wait_for("[stop: end_turn]");
        // ... and asks to run a command that would erase its own question.
        stdin
            .write_all("terminal - touch pwned\u{1b}[2K\u{1b}[1Aharmless\n".as_bytes())
            .unwrap();
        wait_for("[N]o");
        stdin.write_all(b"n\n").unwrap();
        wait_for("[stop: end_turn]\n> \n");
        drop(stdin);
        let _ = child.wait();
        while let Ok(b) = rx.recv_timeout(Duration::from_secs(5)) {
            seen.push(b);
        }
        String::from_utf8(seen).expect("UTF-8 output")
    })
    .await
    .unwrap();
    assert!(
        screen.contains("hi\\x1b[2Jthere\\u{9b}31m\\u{202e}xe.txt"),
        "{screen:?}"
    );
    assert!(
        screen.contains("pwned\\x1b[2K\\x1b[1Aharmless"),
        "the question shows the command: {screen:?}"
    );
    assert_eq!(raw_controls(&screen, true), Vec::<char>::new(), "{screen:?}");
    assert!(!dir.path().join("pwned").exists());
}
