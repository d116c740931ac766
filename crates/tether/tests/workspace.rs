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
        .read_text_file(
            &ReadTextFile {
                path: PathBuf::from("/etc/passwd"),
                line: None,
                limit: None,
            },
            &info(),
        )
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
            .write_text_file(
                &WriteTextFile {
                    path: format!("w{i}.txt").into(),
                    content: "x".into(),
                },
                &info(),
            )
            .await;
        assert!(r.is_ok());
    }
    assert_eq!(
        n.load(Ordering::SeqCst),
        1,
        "allow-always is remembered for the session"
    );

    let ro = Workspace::new(root.path()).unwrap().policy(Policy::read_only());
    let req = PermissionRequest {
        tool_use_id: "t".into(),
        title: "rm -rf".into(),
        input: json!({}),
        kind: Some("execute".into()),
        options: PermissionRequest::standard_options(),
        raw: json!({}),
    };
    let out = ro.request_permission(&req, &info()).await;
    assert!(!out.allows(&req));
    let req_read = PermissionRequest {
        kind: Some("read".into()),
        ..req.clone()
    };
    let out = ro.request_permission(&req_read, &info()).await;
    assert_eq!(
        out,
        PermissionOutcome::Selected {
            option_id: "allow_once".into()
        }
    );
    assert!(req.option_of(PermissionKind::RejectOnce).is_some());
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
