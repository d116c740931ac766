//! Against the scripted fake agent (`tether-testkit`'s `fake-acp-agent`): what no real agent does
//! on demand.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{PermissionAnswer, Recorder, WAIT, fake_agent, text};
use tether::Capabilities;
use tether_acp::schema::{ListSessionsRequest, LoadSessionRequest, NewSessionRequest, SessionId, StopReason};
use tether_acp::{AcpClient, AcpError, AcpUpdate, AgentCommand, ClientOptions, Direction};

struct Fixture {
    client: AcpClient,
    session: SessionId,
    root: tempfile::TempDir,
    rec: Arc<Recorder>,
}

async fn fixture_with(rec: Arc<Recorder>, opts: ClientOptions) -> Fixture {
    let client = AcpClient::spawn(AgentCommand::new(fake_agent()), rec.clone(), opts)
        .await
        .expect("spawn fake agent");
    client.initialize().await.expect("initialize");
    let root = tempfile::tempdir().unwrap();
    let s = client
        .new_session(NewSessionRequest::new(root.path()))
        .await
        .expect("session/new");
    // The update the fake sends right after answering session/new must arrive (the session is
    // registered before the next message is dispatched, so it is not dropped as unknown).
    rec.wait_until("the welcome update", |r| !r.texts().is_empty())
        .await;
    assert_eq!(rec.texts().first().map(String::as_str), Some("welcome"));
    Fixture {
        client,
        session: s.session_id.clone(),
        root,
        rec,
    }
}

async fn fixture(support: Capabilities, permission: PermissionAnswer) -> Fixture {
    fixture_with(Recorder::new(support, permission), ClientOptions::default()).await
}

impl Fixture {
    async fn run(&self, prompt: &str) -> String {
        let before = self.rec.texts().len();
        let out = tokio::time::timeout(WAIT, self.client.prompt(&self.session, text(prompt)))
            .await
            .expect("turn finished in time")
            .expect("turn succeeded");
        assert_eq!(out.stop_reason, Some(StopReason::EndTurn), "{out:?}");
        self.rec.texts()[before..].join("\n")
    }
}

#[tokio::test]
async fn crash_mid_turn_is_a_typed_error_not_a_hang() {
    let f = fixture(Capabilities::none(), PermissionAnswer::Cancelled).await;
    let r = tokio::time::timeout(WAIT, f.client.prompt(&f.session, text("crash")))
        .await
        .expect("no hang");
    match r {
        Err(AcpError::AgentExited { exit }) => {
            assert_eq!(exit.as_deref(), Some("exited with code 3"))
        }
        other => panic!("expected AgentExited, got {other:?}"),
    }
    // The chunk sent before the crash was delivered.
    assert!(f.rec.texts().contains(&"about to crash".to_string()));
    // Later calls fail fast with the same reason.
    let again = f.client.prompt(&f.session, text("echo x")).await;
    assert!(matches!(again, Err(AcpError::AgentExited { .. })), "{again:?}");
}

#[tokio::test]
async fn malformed_line_gets_parse_error_and_connection_survives() {
    let f = fixture(Capabilities::none(), PermissionAnswer::Cancelled).await;
    let said = f.run("malformed").await;
    assert_eq!(said, "parse error code -32700");
    assert_eq!(f.run("echo still alive").await, "still alive");
}

#[tokio::test]
async fn oversized_frame_is_a_clear_error() {
    let rec = Recorder::new(Capabilities::none(), PermissionAnswer::Cancelled);
    let f = fixture_with(rec, ClientOptions::default().with_max_frame_bytes(64 * 1024)).await;
    let r = tokio::time::timeout(WAIT, f.client.prompt(&f.session, text("oversized 200000")))
        .await
        .expect("no hang");
    match &r {
        Err(AcpError::FrameTooLarge {
            direction: Direction::Inbound,
            limit,
            size,
        }) => {
            assert_eq!(*limit, 64 * 1024);
            assert!(*size > *limit);
        }
        other => panic!("expected FrameTooLarge, got {other:?}"),
    }
    let msg = r.unwrap_err().to_string();
    assert!(msg.contains("max_frame_bytes"), "{msg}");
    assert!(matches!(
        f.client.closed_error(),
        Some(AcpError::FrameTooLarge { .. })
    ));
}

#[tokio::test]
async fn unknown_update_kinds_pass_through_raw() {
    let f = fixture(Capabilities::none(), PermissionAnswer::Cancelled).await;
    f.run("unknown").await;
    let events = f.rec.events.lock().unwrap().clone();
    let unknown = events
        .iter()
        .find_map(|e| match &e.update {
            AcpUpdate::Unknown { kind, raw, .. } => Some((kind.clone(), raw.clone())),
            _ => None,
        })
        .expect("unknown kind delivered");
    assert_eq!(unknown.0, "future_kind_xyz");
    assert_eq!(unknown.1["payload"]["a"], 1);
    // The known chunk's unknown field is kept in the raw message.
    let raws = f.rec.raw_messages.lock().unwrap().clone();
    assert!(raws.iter().any(|r| r.contains("\"extraField\":42")));
    assert!(f.rec.texts().contains(&"known".to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flood_of_updates_none_lost_with_a_tiny_queue() {
    let rec = Arc::new(Recorder::build(
        Capabilities::none(),
        PermissionAnswer::Cancelled,
        None,
    ));
    let f = fixture_with(rec, ClientOptions::default().with_queue_capacity(2)).await;
    let n = 20_000;
    f.client
        .prompt(&f.session, text(&format!("flood {n}")))
        .await
        .unwrap();
    let texts = f.rec.texts();
    // "welcome" (sent right after session/new) + n chunks, in order.
    assert_eq!(texts.len(), n + 1);
    assert_eq!(texts[0], "welcome");
    for (i, t) in texts[1..].iter().enumerate() {
        assert_eq!(t, &format!("chunk {i}"));
    }
}

#[tokio::test]
async fn slow_handler_back_pressures_instead_of_dropping() {
    let rec = Arc::new(Recorder::build(
        Capabilities::none(),
        PermissionAnswer::Cancelled,
        Some(Duration::from_millis(1)),
    ));
    let f = fixture_with(rec, ClientOptions::default().with_queue_capacity(1)).await;
    f.client.prompt(&f.session, text("flood 300")).await.unwrap();
    assert_eq!(f.rec.texts().len(), 301);
}

#[tokio::test]
async fn paths_outside_the_roots_are_refused_and_nothing_is_touched() {
    let f = fixture(Capabilities::all(), PermissionAnswer::Cancelled).await;
    let root = std::fs::canonicalize(f.root.path()).unwrap();
    let outside = tempfile::tempdir().unwrap();
    let outside = std::fs::canonicalize(outside.path()).unwrap();
    std::fs::write(outside.join("secret.txt"), "top secret").unwrap();
    std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
    std::fs::write(root.join("inside.txt"), "hello inside").unwrap();

    // Inside: allowed and served.
    assert_eq!(
        f.run(&format!("read {}", root.join("inside.txt").display()))
            .await,
        "ok:{\"content\":\"hello inside\"}"
    );
    assert_eq!(
        f.rec.calls(),
        [format!("read {}", root.join("inside.txt").display())]
    );
    f.rec.calls.lock().unwrap().clear();

    let attempts = [
        format!(
            "read {}/../{}/secret.txt",
            root.display(),
            outside.file_name().unwrap().to_string_lossy()
        ),
        format!("read {}", outside.join("secret.txt").display()),
        format!("read {}", root.join("link/secret.txt").display()),
        "read relative.txt".to_string(),
        format!("write {}/../escaped.txt pwned", root.display()),
        format!("write {} pwned", outside.join("secret.txt").display()),
        format!("write {} pwned", root.join("link/new.txt").display()),
        format!("terminal {} touch pwned", outside.display()),
        format!("terminal {} touch pwned", root.join("link").display()),
        format!("terminal {}/.. touch pwned", root.display()),
    ];
    for a in &attempts {
        let said = f.run(a).await;
        assert!(said.contains("err:-32602"), "{a} → {said}");
    }
    assert!(
        f.rec.calls().is_empty(),
        "handler was called: {:?}",
        f.rec.calls()
    );
    assert_eq!(
        std::fs::read_to_string(outside.join("secret.txt")).unwrap(),
        "top secret"
    );
    assert!(!outside.join("new.txt").exists());
    assert!(!root.parent().unwrap().join("escaped.txt").exists());
    assert!(!outside.join("pwned").exists());

    // Write inside creates the file; terminal without cwd gets the session cwd.
    let said = f
        .run(&format!(
            "write {} fresh content",
            root.join("sub/new.txt").display()
        ))
        .await;
    assert!(said.starts_with("err:") || said.starts_with("ok"), "{said}");
    let said = f
        .run(&format!("write {} fresh content", root.join("new.txt").display()))
        .await;
    assert_eq!(said, "ok:{}");
    assert_eq!(
        std::fs::read_to_string(root.join("new.txt")).unwrap(),
        "fresh content"
    );
    let said = f.run("terminal - true").await;
    assert!(said.contains("create err:-32603"), "{said}");
    let calls = f.rec.calls();
    assert!(
        calls
            .iter()
            .any(|c| c == &format!("terminal/create Some({:?})", root)),
        "{calls:?}"
    );
}

#[tokio::test]
async fn unadvertised_capabilities_get_method_not_found() {
    let f = fixture(Capabilities::none(), PermissionAnswer::Cancelled).await;
    let path = f.root.path().join("x.txt");
    std::fs::write(&path, "x").unwrap();
    assert!(
        f.run(&format!("read {}", path.display()))
            .await
            .starts_with("err:-32601")
    );
    assert!(
        f.run(&format!("write {} y", path.display()))
            .await
            .starts_with("err:-32601")
    );
    assert!(f.run("terminal - true").await.contains("create err:-32601"));
    assert!(f.run("elicit form").await.contains("err:-32601"));
    assert!(f.rec.calls().is_empty());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "x");
}

#[tokio::test]
async fn elicitation_modes_are_checked_and_dispatched() {
    let support = Capabilities::none().with_elicitation(true, false);
    let f = fixture(support, PermissionAnswer::Cancelled).await;
    let said = f.run("elicit form").await;
    assert!(
        said.contains("\"action\":\"accept\"") && said.contains("Ada"),
        "{said}"
    );
    // URL mode not advertised: -32602 per spec.
    assert!(f.run("elicit url").await.contains("err:-32602"));
    assert_eq!(f.rec.calls(), ["form Your name?"]);

    let f = fixture(Capabilities::all(), PermissionAnswer::Cancelled).await;
    assert!(f.run("elicit url").await.contains("decline"));
    // elicitation/complete follows the answer and reaches the handler.
    f.run("echo sync").await;
    assert_eq!(f.rec.completed.lock().unwrap().clone(), ["e1"]);
}

#[tokio::test]
async fn permission_outcome_must_name_an_offered_option() {
    let f = fixture(Capabilities::none(), PermissionAnswer::Select("always".into())).await;
    assert_eq!(
        f.run("permission").await,
        "outcome ok:{\"outcome\":{\"optionId\":\"always\",\"outcome\":\"selected\"}}"
    );
    *f.rec.permission.lock().unwrap() = PermissionAnswer::Select("bogus".into());
    assert!(f.run("permission").await.starts_with("outcome err:-32603"));
}

#[tokio::test]
async fn cancel_answers_pending_permission_at_once() {
    let f = fixture(Capabilities::none(), PermissionAnswer::Hang).await;
    let c = f.client.clone();
    let sid = f.session.clone();
    let turn = tokio::spawn(async move { c.prompt(&sid, text("wait_cancel")).await });
    f.rec
        .wait_until("the permission question", |r| {
            !r.permissions.lock().unwrap().is_empty()
        })
        .await;
    f.client.cancel(&f.session).await.unwrap();
    let out = tokio::time::timeout(WAIT, turn).await.unwrap().unwrap().unwrap();
    assert_eq!(out.stop_reason, Some(StopReason::Cancelled));
    assert!(
        f.rec
            .texts()
            .iter()
            .any(|t| t.contains("\"outcome\":\"cancelled\"")),
        "{:?}",
        f.rec.texts()
    );
}

#[tokio::test]
async fn agent_cancel_request_is_answered_request_cancelled() {
    let f = fixture(Capabilities::none(), PermissionAnswer::Hang).await;
    assert!(f.run("cancel_request").await.starts_with("cancelled err:-32800"));
}

#[tokio::test]
async fn duplicate_inbound_id_is_refused() {
    let f = fixture(Capabilities::none(), PermissionAnswer::Hang).await;
    let c = f.client.clone();
    let sid = f.session.clone();
    let turn = tokio::spawn(async move { c.prompt(&sid, text("dup_id")).await });
    // The agent reports the answer to the second request (the refusal) as soon as it has it;
    // only then is the first one, still with the handler, cancelled.
    f.rec
        .wait_until("the agent's report of the first answer", |r| {
            r.texts().iter().any(|t| t.starts_with("first "))
        })
        .await;
    assert_eq!(f.rec.permissions.lock().unwrap().len(), 1);
    f.client.cancel(&f.session).await.unwrap();
    let _ = tokio::time::timeout(WAIT, turn).await.unwrap();
    let said = f.rec.texts().join("\n");
    assert!(said.contains("first err:-32600"), "{said}");
    assert!(
        said.contains("second ok:{\"outcome\":{\"outcome\":\"cancelled\"}}"),
        "{said}"
    );
    // Only one of the two reached the handler.
    assert_eq!(f.rec.permissions.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn extension_methods_pass_through_and_unknown_get_method_not_found() {
    let f = fixture(Capabilities::none(), PermissionAnswer::Cancelled).await;
    let said = f.run("ext").await;
    assert!(said.contains("ext ok:{\"method\":\"_fake/ping\""), "{said}");
    assert!(said.contains("unknown err:-32601"), "{said}");
    assert_eq!(f.rec.ext_notes.lock().unwrap().clone(), ["_fake/note"]);
}

#[tokio::test]
async fn lenient_answers_and_session_lifecycle() {
    let f = fixture(Capabilities::none(), PermissionAnswer::Cancelled).await;
    // The update sent right after session/new's answer is not lost.
    assert_eq!(f.rec.texts().first().map(String::as_str), Some("welcome"));
    // A legacy `models` field is tolerated and kept raw.
    let s = f
        .client
        .new_session(NewSessionRequest::new(f.root.path()))
        .await
        .unwrap();
    assert_eq!(s.raw["models"]["currentModelId"], "m1");
    assert!(s.modes.is_some());
    // session/load replays history before it returns.
    let before = f.rec.texts().len();
    f.client
        .load_session(LoadSessionRequest::new("old-1", f.root.path()))
        .await
        .unwrap();
    let replayed: Vec<String> = f.rec.texts()[before..]
        .iter()
        .filter(|t| *t != "welcome") // the second session's greeting may land here
        .cloned()
        .collect();
    assert_eq!(replayed, ["earlier answer"]);
    assert!(f.rec.kinds().contains(&"user_message_chunk".to_string()));
    let list = f.client.list_sessions(ListSessionsRequest::new()).await.unwrap();
    assert_eq!(list.sessions.len(), 1);
    f.client.close_session(&SessionId::new("old-1")).await.unwrap();
    assert!(!f.client.knows_session(&SessionId::new("old-1")));
    f.client.set_mode(&f.session, "code").await.unwrap();
    f.client.authenticate("none").await.unwrap();
    f.client.logout().await.unwrap();
    // An unknown stop reason is kept raw.
    let out = f
        .client
        .prompt(&f.session, text("stop weird_reason"))
        .await
        .unwrap();
    assert_eq!(out.stop_reason, None);
    assert_eq!(out.stop_reason_raw, "weird_reason");
}

#[tokio::test]
async fn per_call_timeout_and_version_check() {
    let rec = Recorder::new(Capabilities::none(), PermissionAnswer::Cancelled);
    let f = fixture_with(rec, ClientOptions::default()).await;
    let r = f
        .client
        .prompt_with_timeout(&f.session, text("hang"), Some(Duration::from_millis(300)))
        .await;
    assert!(
        matches!(r, Err(AcpError::Timeout { ref method, .. }) if method == "session/prompt"),
        "{r:?}"
    );
    // The connection is still usable.
    assert_eq!(f.run("echo after").await, "after");

    let rec = Recorder::new(Capabilities::none(), PermissionAnswer::Cancelled);
    let client = AcpClient::spawn(
        AgentCommand::new(fake_agent()).env("FAKE_ACP_PROTOCOL_VERSION", "2"),
        rec,
        ClientOptions::default(),
    )
    .await
    .unwrap();
    let r = client.initialize().await;
    assert!(
        matches!(r, Err(AcpError::UnsupportedVersion { agent: 2, ours: 1 })),
        "{r:?}"
    );
    assert!(client.closed_error().is_some());
}

#[tokio::test]
async fn spawn_failure_is_actionable() {
    let rec = Recorder::new(Capabilities::none(), PermissionAnswer::Cancelled);
    let r = AcpClient::spawn(
        AgentCommand::new("/nonexistent/acp-agent"),
        rec,
        ClientOptions::default(),
    )
    .await;
    let e = r.unwrap_err();
    assert!(matches!(e, AcpError::Spawn { .. }));
    assert!(e.to_string().contains("/nonexistent/acp-agent"));
}
