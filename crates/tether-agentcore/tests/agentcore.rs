//! The AgentCore provider against the scripted fake over real HTTP, and the SigV4 test vector.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use tether::{Error, RecordingSleeper, RetryPolicy, Session, Terminal, ToolSet, ToolSpec};
use tether_agentcore::sigv4::sign_request;
use tether_agentcore::{AgentCore, AgentCoreConfig, AwsCredentials, Target};
use tether_testkit::agentcore::{
    FakeAgentCore, Reply, corrupt, event_frame, exception_frame, golden, golden_frames,
};

const ARN: &str = "arn:aws:bedrock-agentcore:us-east-1:123456789012:harness/helper_abc-0123456789";

fn tools(calls: Arc<AtomicU32>) -> ToolSet {
    ToolSet::new().tool(
        ToolSpec::new("lookup", "Look up", json!({"type":"object"})),
        move |input: Value| {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok::<_, String>(format!("value of {}", input["q"].as_str().unwrap_or("?")))
            }
        },
    )
}

fn config(fake: &FakeAgentCore, target: Target, sleeper: &RecordingSleeper) -> AgentCoreConfig {
    let mut c = AgentCoreConfig::new(
        target,
        "us-east-1",
        AwsCredentials::new("AKIDEXAMPLE", "secret", Some("session-token".into())),
    );
    c.endpoint = Some(fake.url());
    c.retry = RetryPolicy::default()
        .with_sleeper(sleeper.clone())
        .with_jitter(false);
    c
}

fn harness() -> Target {
    Target::Harness {
        arn: ARN.into(),
        qualifier: None,
    }
}

#[test]
fn sigv4_matches_the_aws_get_vanilla_test_vector() {
    let creds = AwsCredentials::new("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", None);
    let time = UNIX_EPOCH + Duration::from_secs(1_440_938_160); // 20150830T123600Z
    let headers = vec![("host".to_owned(), "example.amazonaws.com".to_owned())];
    let signed = sign_request(
        "GET",
        "https://example.amazonaws.com/",
        &headers,
        b"",
        &creds,
        "us-east-1",
        "service",
        time,
    )
    .expect("sign");
    let get = |k: &str| {
        signed
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(k))
            .map(|(_, v)| v.clone())
    };
    assert_eq!(get("x-amz-date").as_deref(), Some("20150830T123600Z"));
    assert_eq!(
        get("authorization").as_deref(),
        Some(
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, \
             SignedHeaders=host;x-amz-date, \
             Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"
        )
    );
    // post-vanilla from the same suite.
    let signed = sign_request(
        "POST",
        "https://example.amazonaws.com/",
        &headers,
        b"",
        &creds,
        "us-east-1",
        "service",
        time,
    )
    .expect("sign");
    let auth = signed
        .iter()
        .find(|(n, _)| n == "authorization")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    assert!(auth.ends_with("Signature=5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"));
    let with_token = sign_request(
        "GET",
        "https://example.amazonaws.com/",
        &headers,
        b"",
        &AwsCredentials::new("AKIDEXAMPLE", "x", Some("tok".into())),
        "us-east-1",
        "service",
        SystemTime::now(),
    )
    .expect("sign");
    assert!(
        with_token
            .iter()
            .any(|(k, v)| k == "x-amz-security-token" && v == "tok")
    );
    assert!(!format!("{:?}", creds).contains("wJalr"));
}

#[tokio::test]
async fn harness_tool_round_trip_resumes_with_two_messages() {
    let fake = FakeAgentCore::start(vec![
        Reply::Frames(golden_frames("tool_turn.json")),
        Reply::Frames(golden_frames("final_turn.json")),
    ])
    .await;
    let sleeper = RecordingSleeper::default();
    let mut cfg = config(&fake, harness(), &sleeper);
    cfg.overrides.insert("maxIterations".into(), json!(5));
    let calls = Arc::new(AtomicU32::new(0));
    let result = Session::builder(AgentCore::new(cfg).expect("provider"))
        .handler(tools(calls.clone()))
        .run("What is x?")
        .await
        .expect("run");
    assert_eq!(result.terminal, Terminal::EndTurn);
    assert_eq!(result.text, "x is 42.");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(result.usage.input_tokens, 130);
    assert_eq!(result.usage.output_tokens, 26);
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].path, "/harnesses/invoke");
    assert!(
        reqs[0]
            .query
            .starts_with("harnessArn=arn%3Aaws%3Abedrock-agentcore")
    );
    assert_eq!(
        reqs[0].body,
        json!({"maxIterations": 5, "messages": [{"role": "user", "content": [{"text": "What is x?"}]}]})
    );
    assert_eq!(reqs[1].body, golden("resume_request.json"));
    let sid = reqs[0]
        .header("x-amzn-bedrock-agentcore-runtime-session-id")
        .unwrap_or_default();
    assert_eq!(sid.len(), 36);
    assert_eq!(
        Some(sid),
        reqs[1].header("x-amzn-bedrock-agentcore-runtime-session-id")
    );
    assert_eq!(reqs[0].header("x-amz-security-token"), Some("session-token"));
    assert_ne!(
        reqs[0].header("x-amzn-bedrock-agentcore-runtime-custom-turn-id"),
        reqs[1].header("x-amzn-bedrock-agentcore-runtime-custom-turn-id")
    );
    assert!(sleeper.slept().is_empty());
}

#[tokio::test]
async fn a_bad_crc_fails_each_attempt_then_ends_in_a_typed_error() {
    let mut frames = golden_frames("final_turn.json");
    frames[1] = corrupt(frames[1].clone());
    let fake = FakeAgentCore::start(vec![Reply::Frames(frames); 3]).await;
    let sleeper = RecordingSleeper::default();
    let err = Session::builder(AgentCore::new(config(&fake, harness(), &sleeper)).expect("provider"))
        .run("hi")
        .await
        .expect_err("crc");
    assert!(
        matches!(&err, Error::Malformed { message: m, .. } if m.contains("checksum") || m.contains("CRC")),
        "{err:?}"
    );
    assert_eq!(fake.requests().len(), 3, "two retries");
    assert_eq!(sleeper.slept().len(), 2);
}

#[tokio::test]
async fn an_exception_frame_is_an_error_event_and_a_typed_error_never_retried() {
    let frames = vec![
        event_frame("messageStart", &json!({"role": "assistant"})),
        exception_frame("throttlingException", "Rate exceeded"),
    ];
    let fake = FakeAgentCore::start(vec![Reply::Frames(frames)]).await;
    let sleeper = RecordingSleeper::default();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let handler = ToolSet::new().on_event(move |e, _| {
        if let Ok(mut g) = s2.lock() {
            g.push(e.clone());
        }
    });
    let err = Session::builder(AgentCore::new(config(&fake, harness(), &sleeper)).expect("provider"))
        .handler(handler)
        .run("hi")
        .await
        .expect_err("exception");
    match &err {
        Error::Stream { message, code } => {
            assert_eq!(code.as_deref(), Some("throttlingException"));
            assert_eq!(message, "Rate exceeded");
        }
        other => panic!("expected a stream error, got {other:?}"),
    }
    assert_eq!(fake.requests().len(), 1);
    let events = seen.lock().map(|g| g.clone()).unwrap_or_default();
    assert!(events.iter().any(|e| e.raw_type == "agentcore.stream_error"));
}

#[tokio::test]
async fn a_truncated_stream_is_retried_then_ends_in_early_termination() {
    let mut frames = golden_frames("final_turn.json");
    frames.truncate(3); // no messageStop
    let fake = FakeAgentCore::start(vec![Reply::Frames(frames); 3]).await;
    let sleeper = RecordingSleeper::default();
    let result = Session::builder(AgentCore::new(config(&fake, harness(), &sleeper)).expect("provider"))
        .run("hi")
        .await
        .expect("run");
    assert_eq!(result.terminal, Terminal::Terminated);
    assert_eq!(result.stop_reason.to_value()["type"], "early_termination");
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 3);
    let turn = |i: usize| {
        reqs[i]
            .header("x-amzn-bedrock-agentcore-runtime-custom-turn-id")
            .map(str::to_owned)
    };
    assert!(turn(0).is_some());
    assert_eq!(turn(0), turn(1), "a retried turn carries the same turn id");
    assert_eq!(turn(1), turn(2));
    assert_eq!(sleeper.slept().len(), 2);
    // Only the record of attempts that succeeded: none of the truncated frames.
    assert!(
        !result
            .events
            .iter()
            .any(|e| e.raw_type == "agentcore.contentBlockDelta")
    );
}

#[tokio::test]
async fn a_truncated_attempt_then_a_good_one_succeeds() {
    let mut cut = golden_frames("final_turn.json");
    cut.truncate(2);
    let fake = FakeAgentCore::start(vec![
        Reply::Frames(cut),
        Reply::Frames(golden_frames("final_turn.json")),
    ])
    .await;
    let sleeper = RecordingSleeper::default();
    let result = Session::builder(AgentCore::new(config(&fake, harness(), &sleeper)).expect("provider"))
        .run("hi")
        .await
        .expect("run");
    assert_eq!(result.text, "x is 42.");
    let deltas = result
        .events
        .iter()
        .filter(|e| e.raw_type == "agentcore.contentBlockDelta")
        .count();
    assert_eq!(deltas, 2, "only the successful attempt is recorded");
}

#[tokio::test]
async fn validation_errors_are_not_retried() {
    let fake = FakeAgentCore::start(vec![Reply::Status(
        400,
        "ValidationException".into(),
        "bad input".into(),
    )])
    .await;
    let sleeper = RecordingSleeper::default();
    let err = Session::builder(AgentCore::new(config(&fake, harness(), &sleeper)).expect("provider"))
        .run("hi")
        .await
        .expect_err("400");
    assert_eq!(err.status(), Some(400));
    assert_eq!(fake.requests().len(), 1);
}

#[tokio::test]
async fn runtime_json_tool_round_trip() {
    let fake = FakeAgentCore::start(vec![
        Reply::Json(json!({"text": "checking", "tool_uses": [{"id": "t1", "name": "lookup", "input": {"q": "y"}}], "stop_reason": "tool_use"})),
        Reply::Sse("data: {\"type\":\"text\",\"text\":\"y is \"}\n\ndata: {\"type\":\"text\",\"text\":\"7\"}\n\ndata: {\"type\":\"stop\",\"stop_reason\":\"end_turn\"}\n\n".into()),
    ])
    .await;
    let sleeper = RecordingSleeper::default();
    let target = Target::Runtime {
        arn: "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/agent-abc".into(),
        qualifier: Some("DEFAULT".into()),
    };
    let calls = Arc::new(AtomicU32::new(0));
    let result = Session::builder(AgentCore::new(config(&fake, target, &sleeper)).expect("provider"))
        .handler(tools(calls.clone()))
        .run("What is y?")
        .await
        .expect("run");
    assert_eq!(result.text, "y is 7");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let reqs = fake.requests();
    assert!(reqs[0].path.starts_with("/runtimes/arn"));
    assert_eq!(reqs[0].query, "qualifier=DEFAULT");
    assert_eq!(reqs[0].body["prompt"], "What is y?");
    assert!(reqs[0].body["turn_id"].is_string());
    assert_eq!(reqs[1].body["tool_results"][0]["content"], "value of y");
}

#[tokio::test]
async fn a_short_session_id_is_refused_before_any_request() {
    let fake = FakeAgentCore::start(vec![]).await;
    let mut cfg = config(&fake, harness(), &RecordingSleeper::default());
    cfg.session_id = Some("too-short".into());
    let err = AgentCore::new(cfg).expect_err("invalid");
    assert_eq!(err.code(), "config");
}

/// Against AWS: `cargo test -p tether-agentcore --test agentcore -- --ignored` with
/// TETHER_AGENTCORE_HARNESS_ARN and the AWS credentials (AWS_ACCESS_KEY_ID,
/// AWS_SECRET_ACCESS_KEY, AWS_REGION) set. Without them it fails, saying which is missing.
#[tokio::test]
#[ignore = "live: needs TETHER_AGENTCORE_HARNESS_ARN and AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_REGION; run with --ignored"]
async fn live_agentcore_round_trip() {
    let arn = std::env::var("TETHER_AGENTCORE_HARNESS_ARN")
        .unwrap_or_else(|_| panic!("this live test needs TETHER_AGENTCORE_HARNESS_ARN in the environment"));
    let cfg = AgentCoreConfig::from_env(Target::Harness { arn, qualifier: None }, None)
        .unwrap_or_else(|e| panic!("this live test needs AWS credentials in the environment: {e}"));
    let result = Session::builder(AgentCore::new(cfg).expect("provider"))
        .run("Reply with the single word: pong")
        .await
        .expect("live run");
    assert_eq!(result.terminal, Terminal::EndTurn);
}

fn runtime() -> Target {
    Target::Runtime {
        arn: "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/agent-abc".into(),
        qualifier: Some("DEFAULT".into()),
    }
}

#[tokio::test]
async fn a_run_timeout_stops_the_runtime_session() {
    let fake = FakeAgentCore::start(vec![Reply::StallSse(
        "data: {\"type\":\"text\",\"text\":\"thinking\"}\n\n".into(),
    )])
    .await;
    let sleeper = RecordingSleeper::default();
    let err = Session::builder(AgentCore::new(config(&fake, runtime(), &sleeper)).expect("provider"))
        .timeout(Duration::from_millis(400))
        .run("hi")
        .await
        .expect_err("the stalled run times out");
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2, "{reqs:?}");
    let stop = &reqs[1];
    assert!(stop.path.ends_with("/stopruntimesession"), "{}", stop.path);
    assert!(stop.path.starts_with("/runtimes/arn%3Aaws"), "{}", stop.path);
    assert_eq!(stop.query, "qualifier=DEFAULT");
    let sid = |r: &tether_testkit::agentcore::Recorded| {
        r.header("x-amzn-bedrock-agentcore-runtime-session-id")
            .map(str::to_owned)
    };
    assert_eq!(sid(stop), sid(&reqs[0]), "the same runtime session");
    assert!(
        stop.body["clientToken"].as_str().is_some_and(|t| t.len() >= 33),
        "{}",
        stop.body
    );
    assert!(
        stop.header("authorization")
            .is_some_and(|a| a.contains("/bedrock-agentcore/aws4_request"))
    );
}

#[tokio::test]
async fn a_finished_runtime_run_is_not_stopped_unless_asked() {
    let reply = || Reply::Json(json!({"text": "done", "stop_reason": "end_turn"}));
    let fake = FakeAgentCore::start(vec![reply(), reply()]).await;
    let sleeper = RecordingSleeper::default();
    Session::builder(AgentCore::new(config(&fake, runtime(), &sleeper)).expect("provider"))
        .run("hi")
        .await
        .expect("run");
    assert_eq!(
        fake.requests().len(),
        1,
        "no StopRuntimeSession after a finished run"
    );
    let mut cfg = config(&fake, runtime(), &sleeper);
    cfg.stop_session_on_close = true;
    Session::builder(AgentCore::new(cfg).expect("provider"))
        .run("hi")
        .await
        .expect("run");
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 3);
    assert!(reqs[2].path.ends_with("/stopruntimesession"));
}

#[tokio::test]
async fn a_harness_timeout_sends_no_stop() {
    let fake = FakeAgentCore::start(vec![Reply::StallFrames(vec![event_frame(
        "messageStart",
        &json!({"role": "assistant"}),
    )])])
    .await;
    let sleeper = RecordingSleeper::default();
    let err = Session::builder(AgentCore::new(config(&fake, harness(), &sleeper)).expect("provider"))
        .timeout(Duration::from_millis(400))
        .run("hi")
        .await
        .expect_err("timeout");
    assert!(matches!(err, Error::Timeout(_)), "{err:?}");
    assert_eq!(fake.requests().len(), 1, "the harness API has no stop call");
}

#[tokio::test]
async fn a_stream_silent_past_the_idle_timeout_fails_the_attempt_and_is_retried() {
    let mut head = golden_frames("final_turn.json");
    head.truncate(2); // messageStart and a delta, then silence
    let fake = FakeAgentCore::start(vec![
        Reply::StallFrames(head),
        Reply::Frames(golden_frames("final_turn.json")),
    ])
    .await;
    let sleeper = RecordingSleeper::default();
    let mut cfg = config(&fake, harness(), &sleeper);
    // Under test, so short; but the retried stream must beat it, so not too short for a loaded
    // machine.
    cfg.idle_timeout = Duration::from_secs(2);
    let result = Session::builder(AgentCore::new(cfg).expect("provider"))
        .run("hi")
        .await
        .expect("run");
    assert_eq!(result.text, "x is 42.");
    assert_eq!(fake.requests().len(), 2);
    assert_eq!(sleeper.slept().len(), 1, "one backoff before the retry");
    let retry = result
        .events
        .iter()
        .find(|e| e.raw_type == "agentcore.retry")
        .expect("a retry event");
    assert_eq!(retry.raw["attempt"], 1);
}

#[tokio::test]
async fn a_stream_silent_past_the_idle_timeout_without_retries_is_a_transport_error() {
    let fake = FakeAgentCore::start(vec![Reply::StallFrames(vec![event_frame(
        "messageStart",
        &json!({"role": "assistant"}),
    )])])
    .await;
    let sleeper = RecordingSleeper::default();
    let mut cfg = config(&fake, harness(), &sleeper);
    cfg.idle_timeout = Duration::from_millis(200);
    cfg.invoke_retries = 0;
    let err = Session::builder(AgentCore::new(cfg).expect("provider"))
        .run("hi")
        .await
        .expect_err("idle");
    assert!(
        matches!(
            &err,
            Error::Transport {
                kind: tether::TransportKind::Idle | tether::TransportKind::Timeout,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.is_transient());
}

/// A stream that never ends is cut at the response cap, once: the error is typed and the
/// invocation is not retried (a retry would bring the same).
#[tokio::test]
async fn a_stream_that_never_ends_is_cut_at_the_response_cap() {
    let head = vec![event_frame("messageStart", &json!({"role": "assistant"}))];
    let repeat = event_frame(
        "contentBlockDelta",
        &json!({"contentBlockIndex": 0, "delta": {"text": "x".repeat(1000)}}),
    );
    let fake = FakeAgentCore::start(vec![Reply::EndlessFrames { head, repeat }]).await;
    let sleeper = RecordingSleeper::default();
    let mut cfg = config(&fake, harness(), &sleeper);
    cfg.max_response_bytes = 128 << 10;
    let err = Session::builder(AgentCore::new(cfg).expect("provider"))
        .timeout(Duration::from_secs(60))
        .run("hi")
        .await
        .expect_err("capped");
    assert!(
        matches!(err, Error::ResponseTooLarge { limit } if limit == 128 << 10),
        "{err:?}"
    );
    assert_eq!(fake.requests().len(), 1, "not retried");
    assert!(sleeper.slept().is_empty());

    // Endless tool input counts too.
    let head = vec![
        event_frame("messageStart", &json!({"role": "assistant"})),
        event_frame(
            "contentBlockStart",
            &json!({"contentBlockIndex": 1, "start": {"toolUse": {"toolUseId": "t1", "name": "lookup"}}}),
        ),
    ];
    let repeat = event_frame(
        "contentBlockDelta",
        &json!({"contentBlockIndex": 1, "delta": {"toolUse": {"input": "1".repeat(1000)}}}),
    );
    let fake = FakeAgentCore::start(vec![Reply::EndlessFrames { head, repeat }]).await;
    let mut cfg = config(&fake, harness(), &sleeper);
    cfg.max_response_bytes = 128 << 10;
    let err = Session::builder(AgentCore::new(cfg).expect("provider"))
        .timeout(Duration::from_secs(60))
        .run("hi")
        .await
        .expect_err("capped");
    assert!(matches!(err, Error::ResponseTooLarge { .. }), "{err:?}");
}

/// A harness thread whose process died while a local tool ran: a new process resumes it on the
/// recorded runtime session id, runs the tool once and sends its result back with the assistant
/// message the record holds (the same resume request as in one process).
#[tokio::test]
async fn a_thread_resumes_its_runtime_session_after_its_process_died_mid_tool() {
    use tether::{EventStore, Handler, MemoryStore, SessionInfo, ThreadId, ThreadStore, ToolOutput, ToolUse};
    let fake = FakeAgentCore::start(vec![
        Reply::Frames(golden_frames("tool_turn.json")),
        Reply::Frames(golden_frames("final_turn.json")),
    ])
    .await;
    let sleeper = RecordingSleeper::default();
    let cfg = || {
        let mut c = config(&fake, harness(), &sleeper);
        c.overrides.insert("maxIterations".into(), json!(5));
        c
    };
    let store = Arc::new(MemoryStore::default());
    let thread = ThreadId::new("ac-1").unwrap();
    struct Hangs;
    #[async_trait::async_trait]
    impl Handler for Hangs {
        fn tools(&self) -> Vec<ToolSpec> {
            vec![ToolSpec::new("lookup", "Look up", json!({"type":"object"}))]
        }
        async fn call_tool(&self, _c: &ToolUse, _i: &SessionInfo) -> ToolOutput {
            std::future::pending().await
        }
    }
    let mut s = Session::builder(AgentCore::new(cfg()).unwrap())
        .handler(Hangs)
        .thread(store.clone(), thread.clone(), "core")
        .open()
        .await
        .unwrap();
    let sent = tokio::time::timeout(Duration::from_millis(500), s.send("What is x?")).await;
    assert!(sent.is_err(), "the tool hangs");
    std::mem::forget(s);
    let t = store.thread(&thread).await.unwrap().unwrap();
    let sid = t.provider_session.clone().unwrap();

    let calls = Arc::new(AtomicU32::new(0));
    let mut s = Session::builder(AgentCore::new(cfg()).unwrap())
        .handler(tools(calls.clone()))
        .thread(store.clone(), thread.clone(), "core")
        .open()
        .await
        .unwrap();
    assert_eq!(s.opened().session_id, sid);
    assert_eq!(s.pending_tool_uses().len(), 1);
    let r = s.resume(tether::CancellationToken::new()).await.unwrap();
    assert_eq!(r.text, "x is 42.");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(
        reqs[1].body,
        golden("resume_request.json"),
        "the same resume as in one process"
    );
    assert_eq!(
        Some(sid.as_str()),
        reqs[1].header("x-amzn-bedrock-agentcore-runtime-session-id")
    );
    let all = store.load(&t.record).await.unwrap();
    for (i, e) in all.iter().enumerate() {
        assert_eq!(e.seq, Some(i as u64 + 1), "gap at {}", e.id);
    }
}
