//! The Workspace handler: confinement, approvals, commands and terminals, on a real directory.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::json;
use tether::workspace::{Approval, ApprovalRequest, Approver, Policy, Workspace};
use tether::{
    Handler, HandlerError, PermissionKind, PermissionOutcome, PermissionRequest, ReadTextFile, SessionInfo,
    TerminalRequest, TerminalResponse, ToolOutput, ToolUse, WriteTextFile,
};

fn info() -> SessionInfo {
    SessionInfo::new("s", "test")
}

struct Count(Arc<AtomicU32>, Approval);

#[async_trait::async_trait]
impl Approver for Count {
    async fn approve(&self, _req: &ApprovalRequest) -> Approval {
        self.0.fetch_add(1, Ordering::SeqCst);
        self.1
    }
}

fn setup() -> (tempfile::TempDir, tempfile::TempDir) {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("a.txt"), "hello\nworld\n").unwrap();
    std::fs::write(outside.path().join("secret.txt"), "secret").unwrap();
    std::os::unix::fs::symlink(outside.path(), root.path().join("escape")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret.txt"), root.path().join("link.txt")).unwrap();
    (root, outside)
}

async fn call(ws: &Workspace, name: &str, input: serde_json::Value) -> ToolOutput {
    ws.call_tool(&ToolUse::new("t", name, input), &info()).await
}

#[tokio::test]
async fn escapes_are_refused_and_nothing_is_touched() {
    let (root, outside) = setup();
    let ws = Workspace::new(root.path()).unwrap().policy(Policy::allow_all());
    let secret = outside.path().join("secret.txt");
    for p in [
        "../x.txt".to_owned(),
        secret.display().to_string(),
        "escape/secret.txt".into(),
        "link.txt".into(),
        "sub/../../x.txt".into(),
    ] {
        let r = call(&ws, "read_file", json!({"path": p})).await;
        assert!(
            matches!(&r, ToolOutput::Error(e) if e.contains("outside the workspace")),
            "{p}: {r:?}"
        );
        let w = call(&ws, "write_file", json!({"path": p, "content": "pwned"})).await;
        assert!(
            matches!(&w, ToolOutput::Error(e) if e.contains("outside the workspace")),
            "{p}: {w:?}"
        );
    }
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "secret");
    assert!(!outside.path().join("x.txt").exists());
    let r = ws
        .read_text_file(&ReadTextFile::new(PathBuf::from("/etc/passwd")), &info())
        .await;
    assert!(matches!(r, Err(HandlerError::OutsideRoot(_))));
    let r = ws
        .terminal(
            &TerminalRequest::Create {
                command: "touch".into(),
                args: vec!["pwned".into()],
                env: vec![],
                cwd: Some(outside.path().to_path_buf()),
                output_byte_limit: None,
            },
            &info(),
        )
        .await;
    assert!(matches!(r, Err(HandlerError::OutsideRoot(_))));
    assert!(!outside.path().join("pwned").exists());
}

#[tokio::test]
async fn reads_lists_searches_and_edits_inside_the_root() {
    let (root, _o) = setup();
    let ws = Workspace::new(root.path()).unwrap().policy(Policy::allow_all());
    assert_eq!(
        call(&ws, "read_file", json!({"path": "a.txt"})).await,
        ToolOutput::Ok("hello\nworld\n".into())
    );
    assert_eq!(
        call(&ws, "read_file", json!({"path": "a.txt", "line": 2, "limit": 1})).await,
        ToolOutput::Ok("world".into())
    );
    // A line past u32 must not wrap around to line 1 (2^32 + 1 used to read "hello").
    assert_ne!(
        call(
            &ws,
            "read_file",
            json!({"path": "a.txt", "line": 4_294_967_297u64, "limit": 1})
        )
        .await,
        ToolOutput::Ok("hello".into())
    );
    let abs = root.path().join("a.txt").display().to_string();
    assert!(matches!(
        call(&ws, "read_file", json!({"path": abs})).await,
        ToolOutput::Ok(_)
    ));
    let ToolOutput::Ok(list) = call(&ws, "list_dir", json!({})).await else {
        panic!()
    };
    assert!(list.contains("a.txt") && list.contains("escape@"));
    let ToolOutput::Ok(found) = call(&ws, "search_files", json!({"pattern": "world"})).await else {
        panic!()
    };
    assert_eq!(found, "a.txt:2: world");
    assert!(matches!(
        call(
            &ws,
            "write_file",
            json!({"path": "d/new.txt", "content": "x y x"})
        )
        .await,
        ToolOutput::Ok(_)
    ));
    let e = call(
        &ws,
        "edit_file",
        json!({"path": "d/new.txt", "old_string": "x", "new_string": "z"}),
    )
    .await;
    assert!(matches!(&e, ToolOutput::Error(m) if m.contains("occurs 2 times")));
    let e = call(
        &ws,
        "edit_file",
        json!({"path": "d/new.txt", "old_string": "y", "new_string": "q"}),
    )
    .await;
    assert!(matches!(e, ToolOutput::Ok(_)));
    assert_eq!(
        std::fs::read_to_string(root.path().join("d/new.txt")).unwrap(),
        "x q x"
    );
    let e = call(&ws, "read_file", json!({})).await;
    assert!(matches!(&e, ToolOutput::Error(m) if m.contains("`path` is required")));
}

#[tokio::test]
async fn writes_and_commands_ask_and_always_is_remembered() {
    let (root, _o) = setup();
    let n = Arc::new(AtomicU32::new(0));
    let ws = Workspace::new(root.path())
        .unwrap()
        .approver(Count(n.clone(), Approval::Deny));
    let r = call(&ws, "write_file", json!({"path": "b.txt", "content": "x"})).await;
    assert!(matches!(&r, ToolOutput::Error(m) if m.contains("not approved")));
    assert!(!root.path().join("b.txt").exists());
    let r = call(&ws, "run_command", json!({"command": "touch made"})).await;
    assert!(matches!(r, ToolOutput::Error(_)));
    assert!(!root.path().join("made").exists());
    assert_eq!(n.load(Ordering::SeqCst), 2);

    let n = Arc::new(AtomicU32::new(0));
    let ws = Workspace::new(root.path())
        .unwrap()
        .approver(Count(n.clone(), Approval::Always));
    for i in 0..3 {
        let r = ws
            .write_text_file(&WriteTextFile::new(format!("w{i}.txt"), "x"), &info())
            .await;
        assert!(r.is_ok());
    }
    assert_eq!(
        n.load(Ordering::SeqCst),
        1,
        "allow-always is remembered for the session"
    );

    let ro = Workspace::new(root.path()).unwrap().policy(Policy::read_only());
    let req = PermissionRequest::new("t", "rm -rf")
        .with_input(json!({}))
        .with_kind("execute")
        .with_raw(json!({}));
    let out = ro.request_permission(&req, &info()).await;
    assert!(!out.allows(&req));
    let req_read = req.clone().with_kind("read");
    let out = ro.request_permission(&req_read, &info()).await;
    assert_eq!(
        out,
        PermissionOutcome::Selected {
            option_id: "allow_once".into()
        }
    );
    assert!(req.option_of(PermissionKind::RejectOnce).is_some());
}

/// "Always" for a permission of a kind the workspace does not know (an MCP tool, an agent's
/// `other`) covers that request only: it must not allow every other unknown request.
#[tokio::test]
async fn always_for_an_unknown_kind_covers_that_request_only() {
    let (root, _o) = setup();
    let n = Arc::new(AtomicU32::new(0));
    let ws = Workspace::new(root.path())
        .unwrap()
        .approver(Count(n.clone(), Approval::Always));
    let ask = |title: &str| {
        PermissionRequest::new("t", title)
            .with_input(json!({}))
            .with_raw(json!({}))
    };
    let a = ask("search (tool `search` of `web`)");
    assert!(ws.request_permission(&a, &info()).await.allows(&a));
    assert!(ws.request_permission(&a, &info()).await.allows(&a));
    assert_eq!(n.load(Ordering::SeqCst), 1, "the same request is remembered");
    let b = ask("delete_repo (tool `delete_repo` of `github`)");
    assert!(ws.request_permission(&b, &info()).await.allows(&b));
    assert_eq!(
        n.load(Ordering::SeqCst),
        2,
        "another unknown request is asked again"
    );
}

#[tokio::test]
async fn command_output_is_capped_and_terminals_work() {
    let (root, _o) = setup();
    let ws = Workspace::new(root.path())
        .unwrap()
        .policy(Policy::allow_all())
        .output_cap(100);
    let ToolOutput::Ok(out) = call(&ws, "run_command", json!({"command": "seq 1 1000"})).await else {
        panic!()
    };
    assert!(out.starts_with("exit code: 0"));
    assert!(out.contains("1000") && !out.contains("\n1\n"));
    assert!(out.contains("[output truncated"));
    let r = call(&ws, "run_command", json!({"command": "echo oops >&2; exit 3"})).await;
    assert!(matches!(&r, ToolOutput::Error(m) if m.contains("exit code: 3") && m.contains("oops")));

    let TerminalResponse::Created { terminal_id } = ws
        .terminal(
            &TerminalRequest::Create {
                command: "sh".into(),
                args: vec!["-c".into(), "echo hi; exit 7".into()],
                env: vec![],
                cwd: None,
                output_byte_limit: Some(1000),
            },
            &info(),
        )
        .await
        .unwrap()
    else {
        panic!()
    };
    let w = ws
        .terminal(
            &TerminalRequest::WaitForExit {
                terminal_id: terminal_id.clone(),
            },
            &info(),
        )
        .await
        .unwrap();
    assert!(matches!(w, TerminalResponse::Exited(ref s) if s.exit_code == Some(7)));
    let o = ws
        .terminal(
            &TerminalRequest::Output {
                terminal_id: terminal_id.clone(),
            },
            &info(),
        )
        .await
        .unwrap();
    assert!(matches!(o, TerminalResponse::Output { ref output, truncated: false, .. } if output == "hi\n"));
    ws.terminal(
        &TerminalRequest::Release {
            terminal_id: terminal_id.clone(),
        },
        &info(),
    )
    .await
    .unwrap();
    let gone = ws
        .terminal(&TerminalRequest::Output { terminal_id }, &info())
        .await;
    assert!(matches!(gone, Err(HandlerError::NotFound(_))));
}

// ---- Reads are capped in bytes, regular files only, never blocking (issue 11 items 2 and 3) ----

fn mkfifo(p: &std::path::Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(
        unsafe { libc::mkfifo(c.as_ptr(), 0o644) },
        0,
        "mkfifo {}",
        p.display()
    );
}

/// Runs `f` on a runtime of its own and gives up after `secs`; the runtime is then shut down
/// without waiting for blocking threads, so a call stuck in the kernel fails the test instead of
/// hanging it.
fn within<T: Send + 'static>(
    secs: u64,
    f: impl std::future::Future<Output = T> + Send + 'static,
) -> Option<T> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let r = rt.block_on(async { tokio::time::timeout(std::time::Duration::from_secs(secs), f).await });
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    r.ok()
}

#[tokio::test]
async fn a_one_line_mib_file_read_with_a_limit_comes_back_capped() {
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("wide.txt"), "x".repeat(1 << 20)).unwrap();
    let ws = Workspace::new(root.path()).unwrap();
    for input in [
        json!({"path": "wide.txt", "limit": 1}),
        json!({"path": "wide.txt", "line": 1, "limit": 1}),
        json!({"path": "wide.txt"}),
    ] {
        let ToolOutput::Ok(out) = call(&ws, "read_file", input.clone()).await else {
            panic!("{input}")
        };
        assert!(out.len() <= 256 * 1024 + 200, "{input}: {} bytes", out.len());
        assert!(out.contains("\n[truncated:"), "{input}: no truncation note");
    }
    // A small cap and a line range: the cap holds in the middle of a file too.
    let ws = Workspace::new(root.path()).unwrap().read_cap(10);
    std::fs::write(root.path().join("lines.txt"), "one\ntwo\nthree\nfour\n").unwrap();
    assert_eq!(
        call(
            &ws,
            "read_file",
            json!({"path": "lines.txt", "line": 2, "limit": 2})
        )
        .await,
        ToolOutput::Ok("two\nthree".into())
    );
    let ToolOutput::Ok(out) = call(&ws, "read_file", json!({"path": "lines.txt", "line": 2})).await else {
        panic!()
    };
    assert!(
        out.starts_with("two\nthree\n[truncated: a read returns at most 10 bytes"),
        "{out}"
    );
    // A character cut by the cap is dropped, not returned broken or refused.
    std::fs::write(root.path().join("utf.txt"), "ééééééé").unwrap();
    let ToolOutput::Ok(out) = call(&ws, "read_file", json!({"path": "utf.txt"})).await else {
        panic!()
    };
    assert!(
        out.starts_with("ééééé\n[truncated: showing the first 10 of 14 bytes"),
        "{out}"
    );
}

#[test]
fn a_fifo_is_refused_skipped_and_listed_without_blocking() {
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("a.txt"), "needle here\n").unwrap();
    std::fs::create_dir(root.path().join("sub")).unwrap();
    mkfifo(&root.path().join("pipe"));
    mkfifo(&root.path().join("sub/needle.fifo"));
    let ws = Arc::new(Workspace::new(root.path()).unwrap().policy(Policy::allow_all()));
    let r = within(30, {
        let ws = ws.clone();
        async move {
            let mut out = Vec::new();
            for (name, input) in [
                ("read_file", json!({"path": "pipe"})),
                ("read_file", json!({"path": "pipe", "line": 1, "limit": 1})),
                (
                    "edit_file",
                    json!({"path": "pipe", "old_string": "a", "new_string": "b"}),
                ),
                ("write_file", json!({"path": "pipe", "content": "x"})),
                ("search_files", json!({"pattern": "needle"})),
                ("list_dir", json!({})),
            ] {
                out.push(call(&ws, name, input).await);
            }
            out
        }
    })
    .expect("no workspace call may block on a FIFO");
    for r in &r[..4] {
        assert!(
            matches!(r, ToolOutput::Error(e) if e.contains("FIFO") && e.contains("only regular files")),
            "{r:?}"
        );
    }
    // The FIFO is skipped, name and all; the regular file is searched.
    assert_eq!(r[4], ToolOutput::Ok("a.txt:1: needle here".into()));
    assert_eq!(r[5], ToolOutput::Ok("a.txt\npipe|\nsub/".into()));
    // ACP's read_text_file takes the same path.
    let acp = within(30, {
        let ws = ws.clone();
        async move { ws.read_text_file(&ReadTextFile::new("pipe"), &info()).await }
    })
    .expect("read_text_file must not block on a FIFO");
    assert!(
        matches!(acp, Err(HandlerError::Invalid(ref m)) if m.contains("FIFO")),
        "{acp:?}"
    );
}

#[tokio::test]
async fn edit_file_asks_for_reads_and_writes_before_it_opens_the_file() {
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("secret.txt"), "the password is hunter2").unwrap();
    let ws = Workspace::new(root.path()).unwrap().policy(Policy::new(
        tether::workspace::Access::Deny,
        tether::workspace::Access::Allow,
        tether::workspace::Access::Deny,
    ));
    let hit = call(
        &ws,
        "edit_file",
        json!({"path": "secret.txt", "old_string": "hunter2", "new_string": "x"}),
    )
    .await;
    let miss = call(
        &ws,
        "edit_file",
        json!({"path": "secret.txt", "old_string": "letmein", "new_string": "x"}),
    )
    .await;
    let strip = |o: &ToolOutput| match o {
        ToolOutput::Error(e) => e.replace("hunter2", "").replace("letmein", ""),
        other => panic!("edit with reads denied must be refused: {other:?}"),
    };
    assert_eq!(
        strip(&hit),
        strip(&miss),
        "the answer must not depend on the contents"
    );
    assert!(strip(&hit).contains("read actions are not allowed"), "{hit:?}");
    assert_eq!(
        std::fs::read_to_string(root.path().join("secret.txt")).unwrap(),
        "the password is hunter2"
    );

    // Asked: the person sees the request before anything is read, and a refusal says nothing.
    struct Record(Arc<Mutex<Vec<String>>>);
    #[async_trait::async_trait]
    impl Approver for Record {
        async fn approve(&self, req: &ApprovalRequest) -> Approval {
            self.0
                .lock()
                .unwrap()
                .push(format!("{}: {}", req.class, req.summary));
            Approval::Deny
        }
    }
    let asked = Arc::new(Mutex::new(Vec::new()));
    let ws = Workspace::new(root.path())
        .unwrap()
        .policy(Policy::new(
            tether::workspace::Access::Ask,
            tether::workspace::Access::Ask,
            tether::workspace::Access::Deny,
        ))
        .approver(Record(asked.clone()));
    let r = call(
        &ws,
        "edit_file",
        json!({"path": "secret.txt", "old_string": "hunter2", "new_string": "x"}),
    )
    .await;
    assert!(
        matches!(&r, ToolOutput::Error(e) if e.contains("not approved") && !e.contains("replacement")),
        "{r:?}"
    );
    assert_eq!(*asked.lock().unwrap(), ["read: read secret.txt"]);
}

use std::sync::Mutex;

// ---- Escapes through every file tool (issue 17 item 8) ----

#[tokio::test]
async fn edit_list_and_search_refuse_escapes_and_do_not_follow_links_out() {
    let (root, outside) = setup();
    std::fs::write(outside.path().join("other.txt"), "secret line").unwrap();
    // A symlinked directory inside the tree pointing out, one level down.
    std::fs::create_dir(root.path().join("d")).unwrap();
    std::os::unix::fs::symlink(outside.path(), root.path().join("d/out")).unwrap();
    let ws = Workspace::new(root.path()).unwrap().policy(Policy::allow_all());
    let abs_out = outside.path().display().to_string();
    for p in [
        "..".to_owned(),
        "../".to_owned() + outside.path().file_name().unwrap().to_str().unwrap(),
        abs_out.clone(),
        "escape".into(),
        "d/out".into(),
        "d/../../x".into(),
    ] {
        let l = call(&ws, "list_dir", json!({"path": p})).await;
        assert!(
            matches!(&l, ToolOutput::Error(e) if e.contains("outside the workspace")),
            "list {p}: {l:?}"
        );
        let s = call(&ws, "search_files", json!({"pattern": "secret", "path": p})).await;
        assert!(
            matches!(&s, ToolOutput::Error(e) if e.contains("outside the workspace")),
            "search {p}: {s:?}"
        );
    }
    for p in [
        "link.txt".to_owned(),
        "escape/secret.txt".into(),
        "d/out/other.txt".into(),
        format!("{abs_out}/secret.txt"),
        "../secret.txt".into(),
    ] {
        let e = call(
            &ws,
            "edit_file",
            json!({"path": p, "old_string": "secret", "new_string": "pwned"}),
        )
        .await;
        assert!(
            matches!(&e, ToolOutput::Error(m) if m.contains("outside the workspace")),
            "edit {p}: {e:?}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(outside.path().join("secret.txt")).unwrap(),
        "secret"
    );
    // Searching the whole root does not follow the links out.
    let s = call(&ws, "search_files", json!({"pattern": "secret"})).await;
    assert_eq!(s, ToolOutput::Ok("no matches".into()));
    // The links are listed as links.
    let ToolOutput::Ok(l) = call(&ws, "list_dir", json!({"path": "d"})).await else {
        panic!()
    };
    assert_eq!(l, "out@");
}

#[tokio::test]
async fn dangling_symlinks_are_refused_and_create_nothing_outside() {
    let (root, outside) = setup();
    let target = outside.path().join("created-through-link.txt");
    std::os::unix::fs::symlink(&target, root.path().join("dangling-out")).unwrap();
    std::os::unix::fs::symlink(root.path().join("missing"), root.path().join("dangling-in")).unwrap();
    let ws = Workspace::new(root.path()).unwrap().policy(Policy::allow_all());
    for p in ["dangling-out", "dangling-in"] {
        for (name, input) in [
            ("read_file", json!({"path": p})),
            ("write_file", json!({"path": p, "content": "x"})),
            (
                "edit_file",
                json!({"path": p, "old_string": "a", "new_string": "b"}),
            ),
            ("list_dir", json!({"path": p})),
        ] {
            let r = call(&ws, name, input).await;
            assert!(
                matches!(&r, ToolOutput::Error(e) if e.contains("dangling symlink")),
                "{name} {p}: {r:?}"
            );
        }
    }
    assert!(!target.exists());
    assert!(!root.path().join("missing").exists());
    // Listing shows them as links; searching skips them.
    let ToolOutput::Ok(l) = call(&ws, "list_dir", json!({})).await else {
        panic!()
    };
    assert!(l.contains("dangling-out@") && l.contains("dangling-in@"), "{l}");
    assert!(matches!(
        call(&ws, "search_files", json!({"pattern": "x"})).await,
        ToolOutput::Ok(_)
    ));
}

// ---- Commands: killed with their whole group, and confined ----

fn gone(pid: i32) -> bool {
    // Gone, or a zombie waiting for init: either way it runs no more.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s
            .rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z')),
    }
}

async fn wait_gone(pid: i32) -> bool {
    for _ in 0..400 {
        if gone(pid) {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    false
}

async fn wait_for_file(p: &std::path::Path) -> String {
    for _ in 0..600 {
        if let Ok(s) = std::fs::read_to_string(p)
            && s.ends_with('\n')
        {
            return s;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("{} never appeared", p.display());
}

#[tokio::test]
async fn a_timed_out_command_is_killed_with_everything_it_started() {
    let root = tempfile::tempdir().unwrap();
    let ws = Workspace::new(root.path())
        .unwrap()
        .policy(Policy::allow_all())
        .command_timeout(std::time::Duration::from_secs(1));
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        call(
            &ws,
            "run_command",
            json!({"command": "sleep 300 & echo $! > pid; echo started; wait"}),
        ),
    )
    .await
    .expect("the call returns at its timeout");
    assert!(
        matches!(&r, ToolOutput::Error(e) if e.contains("timed out after 1s") && e.contains("started")),
        "{r:?}"
    );
    let pid: i32 = std::fs::read_to_string(root.path().join("pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(wait_gone(pid).await, "the command's child {pid} is still running");
}

#[tokio::test]
async fn a_cancelled_command_leaves_no_process_behind() {
    let root = tempfile::tempdir().unwrap();
    let ws = Arc::new(Workspace::new(root.path()).unwrap().policy(Policy::allow_all()));
    let task = tokio::spawn({
        let ws = ws.clone();
        async move {
            call(
                &ws,
                "run_command",
                json!({"command": "sleep 300 & echo $! > pid; wait"}),
            )
            .await
        }
    });
    let pid: i32 = wait_for_file(&root.path().join("pid"))
        .await
        .trim()
        .parse()
        .unwrap();
    assert!(!gone(pid));
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert!(
        wait_gone(pid).await,
        "the cancelled command's child {pid} is still running"
    );
}

#[tokio::test]
async fn a_finished_command_returns_at_once_and_leaves_nothing_running() {
    let root = tempfile::tempdir().unwrap();
    let ws = Workspace::new(root.path()).unwrap().policy(Policy::allow_all());
    // The background sleep holds the output pipe open: the call must still return.
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        call(
            &ws,
            "run_command",
            json!({"command": "sleep 300 & echo $! > pid; echo done"}),
        ),
    )
    .await
    .expect("the call returns when the command has exited");
    assert!(
        matches!(&r, ToolOutput::Ok(o) if o == "exit code: 0\ndone\n"),
        "{r:?}"
    );
    let pid: i32 = std::fs::read_to_string(root.path().join("pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(wait_gone(pid).await, "{pid} was left running");
}

#[tokio::test]
async fn a_terminal_can_be_killed_while_another_request_waits_on_it() {
    let root = tempfile::tempdir().unwrap();
    let ws = Arc::new(Workspace::new(root.path()).unwrap().policy(Policy::allow_all()));
    let TerminalResponse::Created { terminal_id } = ws
        .terminal(
            &TerminalRequest::Create {
                command: "sh".into(),
                args: vec!["-c".into(), "sleep 300 & echo $! > pid; wait".into()],
                env: vec![],
                cwd: None,
                output_byte_limit: None,
            },
            &info(),
        )
        .await
        .unwrap()
    else {
        panic!()
    };
    let pid: i32 = wait_for_file(&root.path().join("pid"))
        .await
        .trim()
        .parse()
        .unwrap();
    let waiter = tokio::spawn({
        let (ws, id) = (ws.clone(), terminal_id.clone());
        async move {
            ws.terminal(&TerminalRequest::WaitForExit { terminal_id: id }, &info())
                .await
        }
    });
    ws.terminal(
        &TerminalRequest::Kill {
            terminal_id: terminal_id.clone(),
        },
        &info(),
    )
    .await
    .unwrap();
    let exited = tokio::time::timeout(std::time::Duration::from_secs(30), waiter)
        .await
        .expect("the wait ends when the terminal is killed")
        .unwrap()
        .unwrap();
    assert!(
        matches!(exited, TerminalResponse::Exited(ref s) if s.signal.as_deref() == Some("signal 9")),
        "{exited:?}"
    );
    assert!(wait_gone(pid).await);
}

#[cfg(target_os = "linux")]
mod sandbox {
    use super::*;
    use tether::sandbox::{Sandbox, SandboxMode, Support};

    fn confined(root: &std::path::Path) -> Workspace {
        assert!(
            Support::current().confines(),
            "these tests need a kernel that can confine commands: {}",
            Support::current().describe()
        );
        Workspace::new(root).unwrap().policy(Policy::allow_all())
    }

    async fn sh(ws: &Workspace, script: &str) -> (bool, String) {
        match call(ws, "run_command", json!({ "command": script })).await {
            ToolOutput::Ok(o) => (true, o),
            ToolOutput::Error(e) => (false, e),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_confined_command_cannot_write_outside_the_root() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let ws = confined(root.path());
        let target = outside.path().join("pwned");
        let (ok, out) = sh(&ws, &format!("echo x > {}", target.display())).await;
        assert!(!ok && out.contains("Permission denied"), "{out}");
        let (ok, out) = sh(
            &ws,
            &format!(
                "cd .. && touch {0}/pwned2; mkdir {0}/d; ln -s /etc {0}/l",
                outside.path().display()
            ),
        )
        .await;
        assert!(!ok, "{out}");
        assert_eq!(
            std::fs::read_dir(outside.path()).unwrap().count(),
            0,
            "nothing was made outside"
        );
        // Nor can it make a device node, even in the root (it would open the raw disk).
        let (ok, out) = sh(&ws, "mknod disk b 8 0").await;
        assert!(!ok && !root.path().join("disk").exists(), "{out}");
        // Nor can it signal the process that started it.
        let (ok, out) = sh(&ws, &format!("kill -0 {}", std::process::id())).await;
        assert!(!ok, "{out}");
    }

    #[tokio::test]
    async fn a_confined_command_cannot_reach_the_network() {
        let root = tempfile::tempdir().unwrap();
        let ws = confined(root.path());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let (ok, out) = sh(&ws, &format!("bash -c 'echo hi > /dev/tcp/127.0.0.1/{port}'")).await;
        assert!(!ok, "{out}");
        let py = "import socket\n\
                  for fam, typ in [(socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET, socket.SOCK_DGRAM), (socket.AF_INET6, socket.SOCK_DGRAM), (socket.AF_NETLINK, socket.SOCK_RAW)]:\n\
                  \x20   try:\n\
                  \x20       socket.socket(fam, typ)\n\
                  \x20       print('opened', fam, typ)\n\
                  \x20   except OSError as e:\n\
                  \x20       print('refused', e.errno)\n";
        std::fs::write(root.path().join("net.py"), py).unwrap();
        let (ok, out) = sh(&ws, "python3 net.py").await;
        assert!(ok, "{out}");
        assert_eq!(out.matches("refused 1").count(), 4, "{out}");
        assert!(
            matches!(listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "nothing connected"
        );
        // UNIX sockets stay usable (local IPC).
        let (ok, out) = sh(
            &ws,
            "python3 -c 'import socket; socket.socket(socket.AF_UNIX); print(\"unix ok\")'",
        )
        .await;
        assert!(ok && out.contains("unix ok"), "{out}");

        // The switch lets it through.
        let open = confined(root.path()).sandbox(Sandbox::new(SandboxMode::Auto).allow_network(true));
        let (ok, out) = sh(&open, &format!("bash -c 'echo hi > /dev/tcp/127.0.0.1/{port}'")).await;
        assert!(ok, "{out}");
    }

    #[tokio::test]
    async fn a_confined_command_does_its_work_inside_the_root() {
        let root = tempfile::tempdir().unwrap();
        let ws = confined(root.path());
        let (ok, out) = sh(
            &ws,
            "mkdir -p src/deep && printf 'alpha\\nbeta\\n' > src/deep/f.txt && sed -i s/beta/gamma/ src/deep/f.txt \
             && ls src/deep && grep -n gamma src/deep/f.txt && sh -c 'cat src/deep/f.txt | wc -l' \
             && t=$(mktemp) && echo tmp > \"$t\" && cat \"$t\" && echo \"$TMPDIR\" \
             && ln -s deep/f.txt src/link && mv src/deep/f.txt src/g.txt && rm -r src/deep \
             && cat /etc/hostname > /dev/null && echo ok",
        )
        .await;
        assert!(ok, "{out}");
        assert!(out.contains("f.txt\n2:gamma\n2\ntmp\n"), "{out}");
        assert!(out.trim_end().ends_with("ok"), "{out}");
        assert_eq!(
            std::fs::read_to_string(root.path().join("src/g.txt")).unwrap(),
            "alpha\ngamma\n"
        );
        let tmp = out
            .lines()
            .find(|l| l.contains("tether-cmd-"))
            .expect("TMPDIR is private");
        assert!(
            !std::path::Path::new(tmp).exists(),
            "the private temporary directory is removed"
        );
    }

    #[tokio::test]
    async fn off_runs_unconfined_and_the_mode_parses() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let ws = confined(root.path()).sandbox(Sandbox::new(SandboxMode::Off));
        let (ok, out) = sh(&ws, &format!("touch {}/made", outside.path().display())).await;
        assert!(ok && outside.path().join("made").exists(), "{out}");
        assert_eq!("require".parse::<SandboxMode>(), Ok(SandboxMode::Require));
        assert!(
            "strict"
                .parse::<SandboxMode>()
                .unwrap_err()
                .contains("auto, require or off")
        );
        assert_eq!(
            Sandbox::new(SandboxMode::Auto).warning(),
            None,
            "this kernel confines"
        );
    }
}
