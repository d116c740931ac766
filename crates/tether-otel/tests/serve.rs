//! `tether serve` traced (the real `tether-serve` binary): a thread killed with SIGKILL in the
//! middle of a run and resumed by a restarted server links its new spans to those before the
//! crash; an approval shows as a tool call left waiting by one run and run by the next.

mod bins;
mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{Receiver, Span};
use serde_json::{Value, json};
use tether_testkit::openai::{FakeOpenAi, Reply};
use tokio::io::{AsyncBufReadExt, BufReader};

/// The bearer token the test servers run with (`--token`), and every run request carries.
const TOKEN: &str = "otel-test-token";

struct Serve {
    child: tokio::process::Child,
    url: String,
}

async fn start_serve(dir: &std::path::Path, otlp: &str) -> Serve {
    let bin = tokio::task::spawn_blocking(bins::tether_serve)
        .await
        .expect("build");
    let mut cmd = tokio::process::Command::new(bin);
    bins::clean_env(&mut cmd);
    cmd.args([
        "--config",
        "tether.toml",
        "--bind",
        "127.0.0.1:0",
        "--db",
        "tether.db",
        "--token",
        TOKEN,
    ])
    .current_dir(dir)
    .env("OTEL_EXPORTER_OTLP_ENDPOINT", otlp)
    // Spans leave within 20 ms of ending, so those before the kill are out when it comes.
    .env("OTEL_BSP_SCHEDULE_DELAY", "20")
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .kill_on_drop(true);
    let mut child = cmd.spawn().expect("tether-serve starts");
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let url = tokio::time::timeout(Duration::from_secs(60), async {
        while let Ok(Some(l)) = lines.next_line().await {
            if let Some(rest) = l.split("listening on ").nth(1) {
                return rest.split_whitespace().next().map(str::to_owned);
            }
        }
        None
    })
    .await
    .expect("tether-serve listens")
    .expect("the listening line");
    // Keep draining stderr so the server never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Serve { child, url }
}

fn body(thread: &str, run: &str) -> Value {
    json!({"threadId": thread, "runId": run, "messages": [{"id": "u1", "role": "user", "content": "wait, then answer"}],
           "tools": [], "context": [], "state": {}, "forwardedProps": {}})
}

fn config(fake: &FakeOpenAi, ws: &std::path::Path) -> String {
    format!(
        r#"
[agents.main]
base_url = "{url}"
model = "m"
[agents.main.workspace]
root = "{ws}"
[[agents.main.commands]]
name = "wait"
description = "Wait for something"
command = 'if [ -f started ]; then echo ready; else touch started; sleep 120; fi'
"#,
        url = fake.url(),
        ws = ws.display()
    )
}

async fn post_run(url: &str, body: &Value) -> reqwest::Result<String> {
    reqwest::Client::new()
        .post(format!("{url}/v1/agents/main/run"))
        .header("accept", "text/event-stream")
        .bearer_auth(TOKEN)
        .json(body)
        .timeout(Duration::from_secs(120))
        .send()
        .await?
        .text()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_resumed_after_sigkill_links_to_its_spans_before_the_crash() {
    let rx = Receiver::start().await;
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[("c1", "wait", "{}")]).usage(5, 1));
    fake.push(Reply::text("done").usage(9, 2));
    let dir = tempfile::tempdir().expect("tempdir");
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).expect("ws");
    // The first call hangs (the server is killed during it); the call a resume makes returns.
    std::fs::write(dir.path().join("tether.toml"), config(&fake, &ws)).expect("config");

    let mut first = start_serve(dir.path(), &rx.url).await;
    let url = first.url.clone();
    let running = tokio::spawn(async move { post_run(&url, &body("t1", "r1")).await });
    // The model call has ended (its span is exported) and the tool is running.
    let before = rx
        .wait_spans("the chat span before the crash", |s| {
            s.iter().any(|s| s.name == "chat m")
        })
        .await;
    let marker = ws.join("started");
    for _ in 0..600 {
        if marker.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(marker.exists(), "the tool started");
    first.child.start_kill().expect("SIGKILL");
    let _ = first.child.wait().await;
    let _ = running.await;
    let chat_before: Span = before.iter().find(|s| s.name == "chat m").cloned().expect("chat");
    // The killed run's request span never ended, so it was never exported: its chat span names
    // it as parent.
    assert!(
        !before.iter().any(|s| s.span_id == chat_before.parent),
        "the killed run's span was exported: {before:#?}"
    );

    let second = start_serve(dir.path(), &rx.url).await;
    let events = post_run(&second.url, &body("t1", "r2"))
        .await
        .expect("resumed run");
    assert!(events.contains("RUN_FINISHED"), "{events}");
    let after = rx
        .wait_spans("the resumed run's request span", |s| {
            s.iter()
                .any(|s| s.name == "invoke_agent main" && s.trace_id != chat_before.trace_id)
        })
        .await;
    let resumed: Vec<&Span> = after
        .iter()
        .filter(|s| s.name == "invoke_agent main" && s.trace_id != chat_before.trace_id)
        .collect();
    let r = resumed[0];
    assert_eq!(r.links.len(), 1, "{r:#?}");
    let (trace, span, attrs) = &r.links[0];
    assert_eq!(
        trace, &chat_before.trace_id,
        "the link names the trace before the crash"
    );
    assert_eq!(
        span, &chat_before.parent,
        "the link names the killed run's request span"
    );
    assert_eq!(attrs.get("tether.link.type"), Some(&json!("interrupted_run")));
    assert!(r.events.iter().any(|(n, _)| n == "tether.resumed"), "{r:#?}");
    assert_eq!(r.attr("gen_ai.agent.name"), Some(&json!("main")));
    assert_eq!(
        r.attr("gen_ai.conversation.id"),
        chat_before.attr("gen_ai.conversation.id")
    );
    // The resumed run ran the tool and the next model call, inside its own trace.
    let after = rx
        .wait_spans("the resumed run's children", |s| {
            s.iter()
                .any(|s| s.parent == r.span_id && s.name == "execute_tool wait")
                && s.iter().any(|s| s.parent == r.span_id && s.name == "chat m")
        })
        .await;
    let tool = after
        .iter()
        .find(|s| s.parent == r.span_id && s.name == "execute_tool wait")
        .expect("tool");
    assert_eq!(tool.status, 0, "{tool:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_is_a_tool_call_one_run_leaves_waiting_and_the_next_runs() {
    let rx = Receiver::start().await;
    let fake = FakeOpenAi::start().await;
    fake.push(Reply::tool_calls(&[(
        "call_w",
        "write_file",
        r#"{"path":"hello.txt","content":"hello"}"#,
    )]));
    fake.push(Reply::text("Wrote it."));
    let dir = tempfile::tempdir().expect("tempdir");
    let ws = dir.path().join("ws");
    std::fs::create_dir_all(&ws).expect("ws");
    std::fs::write(dir.path().join("tether.toml"), config(&fake, &ws)).expect("config");
    let serve = start_serve(dir.path(), &rx.url).await;

    // Run 1 asks for approval (write_file needs one) and ends with an interrupt.
    let r1 = post_run(&serve.url, &body("t-ok", "r1")).await.expect("run 1");
    assert!(r1.contains("\"interrupt\""), "{r1}");
    let interrupt = r1
        .split("\n\n")
        .filter_map(|f| f.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|e| e["type"] == "RUN_FINISHED")
        .and_then(|e| e["outcome"]["interrupts"][0]["id"].as_str().map(str::to_owned))
        .expect("the interrupt id");
    // Run 2 approves; the tool runs.
    let mut b2 = body("t-ok", "r2");
    b2["messages"].as_array_mut().expect("messages").push(json!({"id": "a1", "role": "assistant",
        "toolCalls": [{"id": "call_w", "type": "function", "function": {"name": "write_file", "arguments": "{}"}}]}));
    b2["resume"] = json!([{"interruptId": interrupt, "status": "resolved", "payload": {"approved": true}}]);
    let r2 = post_run(&serve.url, &b2).await.expect("run 2");
    assert!(r2.contains("Wrote it."), "{r2}");

    let spans = rx
        .wait_spans("both runs' tool spans", |s| {
            s.iter().filter(|s| s.name == "execute_tool write_file").count() == 2
                && s.iter().filter(|s| s.name == "invoke_agent main").count() == 2
        })
        .await;
    let mut tools: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "execute_tool write_file")
        .collect();
    tools.sort_by_key(|s| s.start);
    let (waiting, ran) = (tools[0], tools[1]);
    // Run 1 left it waiting, visibly.
    assert_eq!(
        waiting.attr("tether.tool.pending"),
        Some(&json!(true)),
        "{waiting:#?}"
    );
    assert!(waiting.events.iter().any(|(n, _)| n == "tether.awaiting_result"));
    assert_eq!(waiting.status, 0, "waiting for an approval is no error");
    let mut runs: Vec<&Span> = spans.iter().filter(|s| s.name == "invoke_agent main").collect();
    runs.sort_by_key(|s| s.start);
    assert_eq!(waiting.parent, runs[0].span_id);
    assert!(
        runs[0].events.iter().any(|(n, _)| n == "tether.awaiting_input"),
        "{:#?}",
        runs[0]
    );
    // Run 2 ran it, linked to the span that waited: the wait is the gap between the two.
    assert_eq!(ran.parent, runs[1].span_id);
    assert_eq!(ran.links.len(), 1, "{ran:#?}");
    assert_eq!(
        (&ran.links[0].0, &ran.links[0].1),
        (&waiting.trace_id, &waiting.span_id)
    );
    assert_eq!(
        ran.links[0].2.get("tether.link.type"),
        Some(&json!("awaited_result"))
    );
    assert_eq!(ran.status, 0, "{ran:#?}");
    // And run 2 follows run 1.
    assert_eq!(runs[1].links.len(), 1);
    assert_eq!(
        (&runs[1].links[0].0, &runs[1].links[0].1),
        (&runs[0].trace_id, &runs[0].span_id)
    );
    assert_eq!(
        runs[1].links[0].2.get("tether.link.type"),
        Some(&json!("previous_run"))
    );
}
