//! `tether serve` end to end: real sockets on 127.0.0.1, a real SQLite file, the testkit's fake
//! OpenAI server behind the agents.

mod common;

use common::*;
use serde_json::{Value, json};
use tether_serve::ServerOptions;
use tether_testkit::openai::Reply;

#[tokio::test]
async fn a_thread_streams_text_and_resumes_across_requests_and_restarts() {
    let env = Env::new().await;
    env.fake.push(Reply::text("Hello there.").chunk_chars(3));
    env.fake.push(Reply::text("Second answer."));
    env.fake.push(Reply::text("Third answer."));
    let server = env.start(env.config(""), None).await;

    assert_eq!(get(&server, "/healthz").await, (200, json!({"ok": true})));
    let (s, agents) = get(&server, "/v1/agents").await;
    assert_eq!(s, 200);
    assert_eq!(agents["agents"][0]["name"], "main");

    let m1 = json!([{"id": "u1", "role": "user", "content": "hi"}]);
    let ev = run(&server, "main", &input("t1", "r1", m1.clone()), None).await;
    assert_eq!(types(&ev)[0], "RUN_STARTED");
    assert_eq!(last(&ev)["type"], "RUN_FINISHED");
    assert_eq!(text_of(&ev), "Hello there.");
    assert!(types(&ev).contains(&"STATE_SNAPSHOT"));

    // A follow-up: the client sends the whole conversation again; only the new message counts.
    let mut m2 = m1.as_array().unwrap().clone();
    m2.push(json!({"id": "a1", "role": "assistant", "content": "Hello there."}));
    m2.push(json!({"id": "u2", "role": "user", "content": "more"}));
    let ev = run(&server, "main", &input("t1", "r2", json!(m2)), None).await;
    assert_eq!(text_of(&ev), "Second answer.");
    let sent = env.fake.requests()[1].messages().to_vec();
    let roles: Vec<&str> = sent.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user"]);

    // Restart on the same database: the thread continues with its history.
    server.shutdown();
    server.wait().await;
    let server = env.start(env.config(""), None).await;
    let (_, threads) = get(&server, "/v1/threads?agent=main").await;
    assert_eq!(threads["threads"][0]["threadId"], "t1");
    assert_eq!(threads["threads"][0]["title"], "hi");
    m2.push(json!({"id": "u3", "role": "user", "content": "again"}));
    let ev = run(&server, "main", &input("t1", "r3", json!(m2)), None).await;
    assert_eq!(text_of(&ev), "Third answer.");
    let roles: Vec<String> = env.fake.requests()[2]
        .messages()
        .iter()
        .map(|m| m["role"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "user", "assistant", "user"]
    );

    let (s, events) = get(&server, "/v1/threads/t1/events").await;
    assert_eq!(s, 200);
    let seqs: Vec<u64> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "gapless record"
    );
    let (_, msgs) = get(&server, "/v1/threads/t1/messages").await;
    let texts: Vec<&str> = msgs["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["content"].as_str())
        .collect();
    assert_eq!(
        texts,
        [
            "hi",
            "Hello there.",
            "more",
            "Second answer.",
            "again",
            "Third answer."
        ]
    );
    assert_eq!(get(&server, "/v1/threads/nope/events").await.0, 404);
}

#[tokio::test]
async fn a_write_needs_approval_through_an_interrupt() {
    let env = Env::new().await;
    env.fake.push(Reply::tool_calls(&[(
        "call_w",
        "write_file",
        r#"{"path":"hello.txt","content":"hello"}"#,
    )]));
    env.fake.push(Reply::text("Wrote it."));
    env.fake.push(Reply::tool_calls(&[(
        "call_w2",
        "write_file",
        r#"{"path":"nope.txt","content":"x"}"#,
    )]));
    env.fake.push(Reply::text("Understood."));
    let server = env.start(env.config(""), None).await;

    let m = json!([{"id": "u1", "role": "user", "content": "write hello"}]);
    let ev = run(&server, "main", &input("t", "r1", m.clone()), None).await;
    let fin = last(&ev);
    assert_eq!(fin["type"], "RUN_FINISHED");
    assert_eq!(fin["outcome"]["type"], "interrupt", "{fin}");
    let intr = &fin["outcome"]["interrupts"][0];
    assert_eq!(intr["toolCallId"], "call_w");
    assert!(
        !env.ws().join("hello.txt").exists(),
        "nothing is written before approval"
    );

    // The client answers the interrupt; the assistant message with the call is in its history.
    let mut m2 = m.as_array().unwrap().clone();
    m2.push(json!({"id": "a1", "role": "assistant", "toolCalls": [{"id": "call_w", "type": "function", "function": {"name": "write_file", "arguments": "{}"}}]}));
    let mut body = input("t", "r2", json!(m2));
    body["resume"] =
        json!([{"interruptId": intr["id"], "status": "resolved", "payload": {"approved": true}}]);
    let ev = run(&server, "main", &body, None).await;
    assert_eq!(last(&ev)["type"], "RUN_FINISHED", "{ev:?}");
    assert!(
        ev.iter()
            .any(|e| e["type"] == "TOOL_CALL_RESULT" && e["toolCallId"] == "call_w")
    );
    assert_eq!(text_of(&ev), "Wrote it.");
    assert_eq!(
        std::fs::read_to_string(env.ws().join("hello.txt")).unwrap(),
        "hello"
    );

    // A denial: the tool does not run and the model hears why.
    m2.push(json!({"id": "u2", "role": "user", "content": "write another"}));
    let ev = run(&server, "main", &input("t", "r3", json!(m2.clone())), None).await;
    let intr = last(&ev)["outcome"]["interrupts"][0].clone();
    let mut body = input("t", "r4", json!(m2));
    body["resume"] = json!([{"interruptId": intr["id"], "status": "cancelled"}]);
    let ev = run(&server, "main", &body, None).await;
    assert_eq!(text_of(&ev), "Understood.");
    assert!(!env.ws().join("nope.txt").exists());
    let sent = env.fake.requests()[3].messages().to_vec();
    let tool = sent.iter().rev().find(|m| m["role"] == "tool").unwrap();
    assert!(tool["content"].as_str().unwrap().contains("denied"), "{tool}");
}

#[tokio::test]
async fn front_end_tools_end_the_run_pending_and_take_results_next_time() {
    let env = Env::new().await;
    env.fake
        .push(Reply::tool_calls(&[("call_c", "confirm", r#"{"q":"ok?"}"#)]));
    env.fake.push(Reply::text("Confirmed."));
    let server = env.start(env.config(""), None).await;
    let tools = json!([{"name": "confirm", "description": "ask", "parameters": {"type": "object"}}]);
    let mut body = input("t", "r1", json!([{"id": "u1", "role": "user", "content": "go"}]));
    body["tools"] = tools.clone();
    let ev = run(&server, "main", &body, None).await;
    let fin = last(&ev);
    if common::restate::enabled() {
        // The Restate backend runs no front-end tools yet: it says so rather than run the turn
        // without offering them to the model.
        assert_eq!(fin["type"], "RUN_ERROR", "{ev:?}");
        assert_eq!(fin["code"], "FRONTEND_TOOLS_UNSUPPORTED", "{fin}");
        assert!(
            env.fake.requests().is_empty(),
            "the refused run never reached the model"
        );
        return;
    }
    assert_eq!(fin["outcome"]["pendingToolCallIds"], json!(["call_c"]), "{fin}");
    assert!(!ev.iter().any(|e| e["type"] == "TOOL_CALL_RESULT"));

    let mut body = input(
        "t",
        "r2",
        json!([
            {"id": "u1", "role": "user", "content": "go"},
            {"id": "a1", "role": "assistant", "toolCalls": [{"id": "call_c", "type": "function", "function": {"name": "confirm", "arguments": "{}"}}]},
            {"id": "tm1", "role": "tool", "toolCallId": "call_c", "content": "yes"}
        ]),
    );
    body["tools"] = tools;
    let ev = run(&server, "main", &body, None).await;
    assert_eq!(text_of(&ev), "Confirmed.");
    let sent = env.fake.requests()[1].messages().to_vec();
    assert_eq!(sent.last().unwrap()["content"], "yes");
}

/// A tool ran and its result was recorded, then the model call after it failed (as a crash
/// would leave it): the next request answers the call from the memo without running it again.
#[tokio::test]
async fn a_recorded_tool_result_is_not_run_again_on_resume() {
    let env = Env::new().await;
    env.fake.push(Reply::tool_calls(&[(
        "call_a",
        "append_line",
        r#"{"line":"one"}"#,
    )]));
    env.fake.push(Reply::error(400, "boom", "invalid_request_error"));
    env.fake.push(Reply::text("Appended."));
    let server = env.start(env.config(""), None).await;
    let body = input(
        "t",
        "r1",
        json!([{"id": "u1", "role": "user", "content": "append one"}]),
    );
    let ev = run(&server, "main", &body, None).await;
    assert_eq!(last(&ev)["type"], "RUN_ERROR", "{ev:?}");
    let log = env.ws().join("log.txt");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "call_a one\n");

    let mut body = input(
        "t",
        "r2",
        json!([{"id": "u1", "role": "user", "content": "append one"}]),
    );
    body["runId"] = json!("r2");
    let ev = run(&server, "main", &body, None).await;
    assert_eq!(text_of(&ev), "Appended.", "{ev:?}");
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "call_a one\n",
        "ran exactly once"
    );
    let sent = env.fake.requests()[2].messages().to_vec();
    let roles: Vec<&str> = sent.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool"]);
}

#[tokio::test]
async fn refusals_token_body_size_run_time_and_concurrency() {
    // No token on a non-loopback bind: refused before anything listens.
    let env = Env::new().await;
    let err = tether_serve::start(ServerOptions::new(
        env.config(""),
        "0.0.0.0:0",
        env.dir.path().join("x.db"),
    ))
    .await
    .unwrap_err();
    assert!(err.to_string().contains("without a token"), "{err}");

    let mut cfg = env.config("");
    cfg.server.max_body_bytes = 2048;
    cfg.server.run_timeout_secs = 1;
    cfg.server.max_concurrent_runs = 1;
    let server = env.start(cfg, Some("s3cret")).await;
    let url = format!("http://{}/v1/agents/main/run", server.addr());
    let body = input("t", "r1", json!([{"id": "u1", "role": "user", "content": "hi"}]));

    let r = client()
        .get(format!("http://{}/v1/agents", server.addr()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client()
        .post(&url)
        .bearer_auth("wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["code"], "UNAUTHORIZED");
    assert_eq!(get(&server, "/healthz").await.0, 200, "health needs no token");

    let big = input(
        "t",
        "r1",
        json!([{"id": "u1", "role": "user", "content": "x".repeat(4096)}]),
    );
    let r = client()
        .post(&url)
        .bearer_auth("s3cret")
        .header("accept", "text/event-stream")
        .json(&big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);

    // A model that stalls: the run hits its limit and ends in RUN_ERROR with a clear code; while
    // it runs, a second run is over the concurrency limit.
    env.fake.push(Reply::text("never finished").stall_after(1));
    let first = client()
        .post(&url)
        .bearer_auth("s3cret")
        .header("accept", "text/event-stream")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    let second = client()
        .post(&url)
        .bearer_auth("s3cret")
        .header("accept", "text/event-stream")
        .json(&input(
            "t2",
            "r1",
            json!([{"id": "u1", "role": "user", "content": "hi"}]),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(second.status(), 429);
    let text = first.text().await.unwrap();
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|f| f.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let fin = last(&events);
    assert_eq!(fin["type"], "RUN_ERROR");
    assert_eq!(fin["code"], "RUN_TIMEOUT", "{fin}");

    // The ended run gave its place back (the refusals above took none: the first run got in).
    env.fake.push(Reply::text("room again"));
    let third = run(
        &server,
        "main",
        &input("t3", "r1", json!([{"id": "u1", "role": "user", "content": "hi"}])),
        Some("s3cret"),
    )
    .await;
    assert_eq!(text_of(&third), "room again");
}

/// Reads an SSE response until a frame of type `ty` arrives; returns everything read so far.
async fn read_until(resp: &mut reqwest::Response, ty: &str) -> String {
    let needle = format!("\"type\":\"{ty}\"");
    let mut text = String::new();
    tokio::time::timeout(PATIENCE, async {
        while !text.contains(&needle) {
            let chunk = resp.chunk().await.unwrap().expect("the stream ended first");
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {ty} within {PATIENCE:?}: {text}"));
    text
}

/// A graceful shutdown closes the listener at once, lets the turn in progress stream to its end,
/// and returns when its connection has closed. (Synchronised on events: the first text delta
/// says the model is streaming; `stopped_accepting` says the listener is closed.)
#[tokio::test]
async fn shutdown_lets_a_running_turn_finish_and_takes_no_new_connections() {
    let env = Env::new().await;
    env.fake.push(
        Reply::text("slow and steady")
            .chunk_chars(1)
            .pace(std::time::Duration::from_millis(20)),
    );
    let server = env.start(env.config(""), None).await;
    let addr = server.addr();
    let body = input("t-sd", "r1", user("u1", "hi"));
    let mut resp = post_run(&server, "main", &body, None).await;
    assert_eq!(resp.status(), 200);
    let mut text = read_until(&mut resp, "TEXT_MESSAGE_CONTENT").await;
    server.shutdown();
    tokio::time::timeout(PATIENCE, server.stopped_accepting())
        .await
        .expect("the listener closes");
    let late = client().get(format!("http://{addr}/healthz")).send().await;
    assert!(
        late.is_err(),
        "a new connection after shutdown was accepted: {late:?}"
    );
    while let Some(chunk) = resp.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let events = sse_events(&text);
    assert_eq!(text_of(&events), "slow and steady");
    assert_eq!(last(&events)["type"], "RUN_FINISHED");
    tokio::time::timeout(PATIENCE, server.wait())
        .await
        .expect("the server stops once its last connection has closed");
}

/// Issue 11, item 4: four clients trickling their bodies held every run slot (the slot was
/// taken before the body was read), so every real run got 429. Now the slot is taken once the
/// body is in, and a body that does not arrive within `body_timeout_secs` gets 408.
#[tokio::test]
async fn clients_trickling_their_bodies_hold_no_run_slot() {
    let env = Env::new().await;
    env.fake.push(Reply::text("served"));
    let cfg = env.config_with("max_concurrent_runs = 4\nbody_timeout_secs = 3", "");
    let server = env.start(cfg, None).await;
    let addr = server.addr();
    let host = addr.to_string();
    let mut tricklers = Vec::new();
    for _ in 0..5 {
        let mut t = Trickle::open(addr, &run_head("main", &host, ""), 100_000).await;
        // The handler is reading this body: on the old code it held a run slot from here on.
        t.wait_reading().await;
        t.send(b"{").await.unwrap();
        tricklers.push(t);
    }
    // One byte every 200 ms each, until the server answers them.
    let drips: Vec<_> = tricklers
        .into_iter()
        .map(|t| tokio::spawn(t.drip_until_answered(Some(std::time::Duration::from_millis(200)))))
        .collect();
    let ev = run(&server, "main", &input("t-real", "r1", user("u1", "hi")), None).await;
    assert_eq!(text_of(&ev), "served", "{ev:?}");
    assert_eq!(last(&ev)["type"], "RUN_FINISHED");
    for d in drips {
        let r = d.await.unwrap();
        assert_eq!(r.status, 408, "{r:?}");
        assert_eq!(r.json()["code"], "BODY_TIMEOUT", "{r:?}");
    }
}

/// Issue 17: THREAD_BUSY had no test. A second run on a thread whose run is still going is
/// refused with that code.
#[tokio::test]
async fn a_second_run_on_a_busy_thread_gets_thread_busy() {
    let env = Env::new().await;
    env.fake
        .push(Reply::text("never finished").chunk_chars(1).stall_after(4));
    let server = env.start(env.config(""), None).await;
    let mut first = post_run(&server, "main", &input("t", "r1", user("u1", "hi")), None).await;
    assert_eq!(first.status(), 200);
    read_until(&mut first, "TEXT_MESSAGE_CONTENT").await;
    let ev = run(&server, "main", &input("t", "r2", user("u2", "again")), None).await;
    let fin = last(&ev);
    assert_eq!(fin["type"], "RUN_ERROR", "{ev:?}");
    assert_eq!(fin["code"], "THREAD_BUSY", "{fin}");
    assert_eq!(
        env.fake.requests().len(),
        1,
        "the refused run never reached the model"
    );
    drop(first);
}

/// Issue 17: THREAD_AGENT_MISMATCH had no test. A thread belongs to the agent that started it.
#[tokio::test]
async fn a_thread_of_another_agent_is_refused() {
    let env = Env::new().await;
    env.fake.push(Reply::text("main's answer"));
    let other = format!(
        "[agents.other]\nbase_url = \"{}\"\nmodel = \"fake\"\n",
        env.fake.url()
    );
    if common::restate::enabled() {
        // The Restate backend serves one agent per server (one TetherThread service per
        // deployment): a second agent is a configuration error at start, not a panic.
        let err = tether_serve::start(ServerOptions::new(
            env.config(&other),
            "127.0.0.1:0",
            env.dir.path().join("tether.db"),
        ))
        .await
        .unwrap_err();
        assert!(err.to_string().contains("one agent per server"), "{err}");
        return;
    }
    let server = env.start(env.config(&other), None).await;
    let ev = run(&server, "main", &input("t", "r1", user("u1", "hi")), None).await;
    assert_eq!(text_of(&ev), "main's answer");
    let ev = run(&server, "other", &input("t", "r2", user("u2", "mine now")), None).await;
    let fin = last(&ev);
    assert_eq!(fin["type"], "RUN_ERROR", "{ev:?}");
    assert_eq!(fin["code"], "THREAD_AGENT_MISMATCH", "{fin}");
    assert!(fin["message"].as_str().unwrap().contains("main"), "{fin}");
    assert_eq!(env.fake.requests().len(), 1);
}

/// Issue 17: SHUTTING_DOWN had no test. A run whose body completes after the shutdown began is
/// refused (503) and never reaches the model; synchronised on `100 Continue` (the server is
/// reading the body) and on `shutdown()` returning.
#[tokio::test]
async fn a_run_during_the_drain_gets_shutting_down() {
    let env = Env::new().await;
    let server = env.start(env.config(""), None).await;
    let addr = server.addr();
    let body = input("t", "r1", user("u1", "hi")).to_string();
    let mut t = Trickle::open(addr, &run_head("main", &addr.to_string(), ""), body.len()).await;
    t.wait_reading().await;
    server.shutdown();
    t.send(body.as_bytes()).await.unwrap();
    let r = t.response().await;
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(r.json()["code"], "SHUTTING_DOWN", "{r:?}");
    assert!(env.fake.requests().is_empty());
    tokio::time::timeout(PATIENCE, server.wait())
        .await
        .expect("the server stops");
}

/// Issue 17: the thread routes with a wrong token had no test.
#[tokio::test]
async fn the_thread_routes_need_the_token() {
    let env = Env::new().await;
    env.fake.push(Reply::text("hello"));
    let server = env.start(env.config(""), Some("right-token")).await;
    run(
        &server,
        "main",
        &input("t1", "r1", user("u1", "hi")),
        Some("right-token"),
    )
    .await;
    for path in [
        "/v1/threads",
        "/v1/threads?agent=main",
        "/v1/threads/t1/events",
        "/v1/threads/t1/messages",
        "/v1/agents",
        "/v1/nope",
        "/nope",
    ] {
        for token in [None, Some("wrong-token"), Some("right-token ")] {
            let (status, body) = get_with(&server, path, token).await;
            if token == Some("right-token ") {
                // Surrounding spaces are trimmed: still the right token.
                assert_ne!(status, 401, "{path}");
                continue;
            }
            assert_eq!(status, 401, "{path} with {token:?}");
            assert_eq!(body["code"], "UNAUTHORIZED", "{path}");
        }
        let (status, _) = get_with(&server, path, Some("right-token")).await;
        assert!(status == 200 || status == 404, "{path}: {status}");
    }
    let (s, ev) = get_with(&server, "/v1/threads/t1/events", Some("right-token")).await;
    assert_eq!(s, 200);
    assert!(!ev["events"].as_array().unwrap().is_empty());
    // The UI and the health check are public (the UI then asks for the token).
    assert_eq!(get(&server, "/").await.0, 200);
    assert_eq!(get(&server, "/healthz").await.0, 200);
}

/// `[server] node_url` (what the other nodes of a cluster call this one) must be an http(s)
/// URL with a host: anything else is refused at start, naming the key.
#[tokio::test]
async fn a_node_url_that_is_no_http_url_is_refused_at_start() {
    let env = Env::new().await;
    for bad in [
        "ftp://10.0.0.5:7878",
        "10.0.0.5:7878",
        "http://",
        "http://exa mple",
    ] {
        let config = env.config_with(&format!("node_url = \"{bad}\"\n"), "");
        let err = tether_serve::start(ServerOptions::new(
            config,
            "127.0.0.1:0",
            env.dir.path().join("n.db"),
        ))
        .await
        .err()
        .unwrap_or_else(|| panic!("{bad} was taken"));
        assert!(
            matches!(&err, tether_serve::ServeError::Config(tether_serve::ConfigError::Invalid { path, .. }) if path == "[server] node_url"),
            "{bad}: {err}"
        );
    }
}

/// The model asks for the same call (tool and arguments) in two steps, under two ids: the
/// second is not run again (the local loop's duplicate guard) but answered under its own id, so
/// the client sees a result for each call and the run finishes (it ended in
/// `UNANSWERED_TOOL_CALL` while the guard's answer was recorded as a directive).
#[tokio::test]
async fn the_same_call_in_two_steps_gets_a_result_for_each() {
    let env = Env::new().await;
    let config = env.config("");
    std::fs::write(env.ws().join("a.txt"), "alpha").unwrap();
    env.fake
        .push(Reply::tool_calls(&[("c1", "read_file", r#"{"path":"a.txt"}"#)]))
        .push(Reply::tool_calls(&[("c2", "read_file", r#"{"path":"a.txt"}"#)]))
        .push(Reply::text("Read twice."));
    let server = env.start(config, None).await;
    let ev = run(
        &server,
        "main",
        &prompt_input("t-same", "r1", "read it twice"),
        None,
    )
    .await;
    finished_ok(&ev);
    let first = result_of(&ev, "c1").unwrap_or_else(|| panic!("no result for c1: {ev:?}"));
    assert_eq!(first["content"], "alpha", "{first}");
    let second = result_of(&ev, "c2").unwrap_or_else(|| panic!("no result for c2: {ev:?}"));
    assert!(
        second["content"]
            .as_str()
            .is_some_and(|c| c.contains("\"duplicate\":true")),
        "{second}"
    );
    assert_eq!(text_of(&ev), "Read twice.");
    server.shutdown();
    server.wait().await;
}
