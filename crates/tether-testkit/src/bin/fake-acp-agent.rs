//! A scripted fake ACP agent (JSON-RPC 2.0 over stdio) for tether-acp's tests: it does on demand
//! what no real agent does, driven by the text of each prompt:
//!
//! | prompt | behaviour |
//! |---|---|
//! | `echo <text>` | one `agent_message_chunk`, `end_turn` |
//! | `crash` | one chunk, then exits with code 3 mid-turn |
//! | `malformed` | writes a line that is not JSON, reports the client's error code, `end_turn` |
//! | `oversized <n>` | a `session/update` frame of about `n` bytes |
//! | `unknown` | an unknown update kind, a chunk with unknown fields, `end_turn` |
//! | `flood <n>` | `n` numbered `agent_message_chunk`s, `end_turn` |
//! | `read <path>` | `fs/read_text_file`; reports `ok:<content>` or `err:<code>` |
//! | `write <path> <content>` | `fs/write_text_file`; reports `ok` or `err:<code>` |
//! | `terminal <cwd or -> <cmd> [args…]` | create / wait_for_exit / output / release; reports them |
//! | `permission` | `session/request_permission` (allow / reject), reports the outcome |
//! | `wait_cancel` | a permission request, then waits for `session/cancel`; `cancelled` |
//! | `cancel_request` | a permission request, then `$/cancel_request` for it; reports the answer |
//! | `dup_id` | two requests with the same id; reports each answer as it arrives |
//! | `ext` | a `_fake/ping` request and a `_fake/note` notification; reports the answer |
//! | `elicit <form or url>` | `elicitation/create`; reports the answer |
//! | `tool` | `tool_call` + `tool_call_update` + plan + usage + thought, `end_turn` |
//! | `stop <reason>` | ends the turn with that (possibly unknown) stop reason |
//! | `hang` | never answers the prompt |
//!
//! Raw mode for benchmarks: `fake-acp-agent --flood-raw <n> [session]` writes, with no handshake,
//! exactly the `n` lines `flood <n>` writes for that session (default `fake-1`, the first session)
//! and exits, so a benchmark can read the same bytes from the same producer without a client.
//! `FAKE_ACP_PROTOCOL_VERSION` overrides the version answered to `initialize`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use std::fmt::Write as _;

use serde::Serialize;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, BufWriter};

// The workspace's tokio has no `io-std`; use the standard streams' descriptors as async files.
type Stdout = tokio::fs::File;

fn stdout() -> tokio::fs::File {
    use std::os::fd::AsFd;
    let fd = std::io::stdout()
        .as_fd()
        .try_clone_to_owned()
        .expect("stdout is open");
    tokio::fs::File::from_std(std::fs::File::from(fd))
}

fn stdin() -> tokio::fs::File {
    use std::os::fd::AsFd;
    let fd = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .expect("stdin is open");
    tokio::fs::File::from_std(std::fs::File::from(fd))
}
use tokio::sync::{Mutex, oneshot, watch};

type Pending = Arc<Mutex<HashMap<i64, oneshot::Sender<Value>>>>;

#[derive(Clone)]
struct Agent {
    out: Arc<Mutex<BufWriter<Stdout>>>,
    pending: Pending,
    next_id: Arc<AtomicI64>,
    cancel: watch::Sender<u64>,
}

fn chunk_line(session: &str, text: &str) -> String {
    json!({"jsonrpc":"2.0","method":"session/update","params":{"sessionId":session,"update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":text}}}}).to_string()
}

#[derive(Serialize)]
struct FloodLine<'a> {
    jsonrpc: &'static str,
    method: &'static str,
    params: FloodParams<'a>,
}

#[derive(Serialize)]
struct FloodParams<'a> {
    #[serde(rename = "sessionId")]
    session_id: &'a str,
    update: FloodUpdate<'a>,
}

#[derive(Serialize)]
struct FloodUpdate<'a> {
    #[serde(rename = "sessionUpdate")]
    kind: &'static str,
    content: FloodText<'a>,
}

#[derive(Serialize)]
struct FloodText<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

/// Floods `n` numbered `agent_message_chunk`s. Each is encoded on its own, as an agent streaming
/// tokens would, but with a typed encoder into a reused buffer written in 64 KiB pieces, so the
/// producer is as fast as a real agent could be and the benchmark measures the client.
async fn flood<W: AsyncWriteExt + Unpin>(out: &mut W, session: &str, n: usize) {
    let mut buf: Vec<u8> = Vec::with_capacity(80 * 1024);
    let mut text = String::new();
    for i in 0..n {
        text.clear();
        let _ = write!(text, "chunk {i}");
        let line = FloodLine {
            jsonrpc: "2.0",
            method: "session/update",
            params: FloodParams {
                session_id: session,
                update: FloodUpdate {
                    kind: "agent_message_chunk",
                    content: FloodText {
                        kind: "text",
                        text: &text,
                    },
                },
            },
        };
        let _ = serde_json::to_writer(&mut buf, &line);
        buf.push(b'\n');
        if buf.len() >= 64 * 1024 {
            let _ = out.write_all(&buf).await;
            buf.clear();
        }
    }
    let _ = out.write_all(&buf).await;
    let _ = out.flush().await;
}

impl Agent {
    async fn write(&self, line: &str) {
        let mut out = self.out.lock().await;
        let _ = out.write_all(line.as_bytes()).await;
        let _ = out.write_all(b"\n").await;
        let _ = out.flush().await;
    }
    async fn send(&self, v: Value) {
        self.write(&v.to_string()).await;
    }
    async fn respond(&self, id: &Value, result: Value) {
        self.send(json!({"jsonrpc":"2.0","id":id,"result":result})).await;
    }
    async fn update(&self, session: &str, update: Value) {
        self.send(
            json!({"jsonrpc":"2.0","method":"session/update","params":{"sessionId":session,"update":update}}),
        )
        .await;
    }
    async fn say(&self, session: &str, text: &str) {
        self.write(&chunk_line(session, text)).await;
    }
    /// Sends a request with a given id and waits for the answer (the whole response object).
    async fn request_with_id(&self, id: i64, method: &str, params: Value) -> Value {
        let (tx, rx) = oneshot::channel();
        self.pending.lock().await.insert(id, tx);
        self.send(json!({"jsonrpc":"2.0","id":id,"method":method,"params":params}))
            .await;
        rx.await.unwrap_or(Value::Null)
    }
    async fn request(&self, method: &str, params: Value) -> Value {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        self.request_with_id(id, method, params).await
    }
}

fn describe(answer: &Value) -> String {
    if let Some(e) = answer.get("error") {
        format!("err:{}:{}", e["code"], e["message"].as_str().unwrap_or(""))
    } else {
        format!("ok:{}", answer.get("result").cloned().unwrap_or(Value::Null))
    }
}

fn permission_params(session: &str) -> Value {
    json!({
        "sessionId": session,
        "toolCall": {"toolCallId": "call_p", "title": "Edit config", "kind": "edit", "status": "pending"},
        "options": [
            {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
            {"optionId": "always", "name": "Always allow", "kind": "allow_always"},
            {"optionId": "reject", "name": "Reject", "kind": "reject_once"}
        ]
    })
}

async fn run_prompt(agent: Agent, id: Value, session: String, text: String) {
    let mut cancel_rx = agent.cancel.subscribe();
    let cancel_seen = *cancel_rx.borrow_and_update();
    let mut words = text.split_whitespace();
    let cmd = words.next().unwrap_or("");
    let rest: Vec<&str> = words.collect();
    let mut stop = "end_turn".to_string();
    match cmd {
        "echo" => agent.say(&session, &rest.join(" ")).await,
        "crash" => {
            agent.say(&session, "about to crash").await;
            std::process::exit(3);
        }
        "oversized" => {
            let n: usize = rest.first().and_then(|s| s.parse().ok()).unwrap_or(1 << 20);
            agent.say(&session, &"x".repeat(n)).await;
        }
        "unknown" => {
            agent
                .update(
                    &session,
                    json!({"sessionUpdate":"future_kind_xyz","payload":{"a":1}}),
                )
                .await;
            agent
                .update(
                    &session,
                    json!({"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"known"},"extraField":42}),
                )
                .await;
        }
        "flood" => {
            let n: usize = rest.first().and_then(|s| s.parse().ok()).unwrap_or(1000);
            let mut out = agent.out.lock().await;
            flood(&mut *out, &session, n).await;
        }
        "read" => {
            let path = rest.first().copied().unwrap_or("");
            let a = agent
                .request("fs/read_text_file", json!({"sessionId":session,"path":path}))
                .await;
            agent.say(&session, &describe(&a)).await;
        }
        "write" => {
            let path = rest.first().copied().unwrap_or("");
            let content = rest.get(1..).map(|r| r.join(" ")).unwrap_or_default();
            let a = agent
                .request(
                    "fs/write_text_file",
                    json!({"sessionId":session,"path":path,"content":content}),
                )
                .await;
            agent.say(&session, &describe(&a)).await;
        }
        "terminal" => {
            let cwd = rest.first().copied().unwrap_or("-");
            let command = rest.get(1).copied().unwrap_or("true");
            let args: Vec<&str> = rest.get(2..).map(|r| r.to_vec()).unwrap_or_default();
            let mut params =
                json!({"sessionId":session,"command":command,"args":args,"outputByteLimit":4096});
            if cwd != "-" {
                params["cwd"] = json!(cwd);
            }
            let created = agent.request("terminal/create", params).await;
            agent
                .say(&session, &format!("create {}", describe(&created)))
                .await;
            if let Some(tid) = created["result"]["terminalId"].as_str() {
                let p = json!({"sessionId":session,"terminalId":tid});
                let w = agent.request("terminal/wait_for_exit", p.clone()).await;
                agent.say(&session, &format!("wait {}", describe(&w))).await;
                let o = agent.request("terminal/output", p.clone()).await;
                agent.say(&session, &format!("output {}", describe(&o))).await;
                let r = agent.request("terminal/release", p.clone()).await;
                agent.say(&session, &format!("release {}", describe(&r))).await;
            }
        }
        "permission" => {
            let a = agent
                .request("session/request_permission", permission_params(&session))
                .await;
            agent.say(&session, &format!("outcome {}", describe(&a))).await;
        }
        "wait_cancel" => {
            let a = agent
                .request("session/request_permission", permission_params(&session))
                .await;
            agent.say(&session, &format!("outcome {}", describe(&a))).await;
            let _ = cancel_rx.wait_for(|v| *v != cancel_seen).await;
            stop = "cancelled".into();
        }
        "cancel_request" => {
            let id = agent.next_id.fetch_add(1, Ordering::SeqCst);
            let a2 = agent.clone();
            let params = permission_params(&session);
            let waiter =
                tokio::spawn(
                    async move { a2.request_with_id(id, "session/request_permission", params).await },
                );
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            agent
                .send(json!({"jsonrpc":"2.0","method":"$/cancel_request","params":{"requestId":id}}))
                .await;
            let a = waiter.await.unwrap_or(Value::Null);
            agent.say(&session, &format!("cancelled {}", describe(&a))).await;
        }
        "dup_id" => {
            let id = agent.next_id.fetch_add(1, Ordering::SeqCst);
            let (tx, rx) = oneshot::channel();
            agent.pending.lock().await.insert(id, tx);
            // Two requests with the same id, the first one slow (a permission question).
            agent
                .send(json!({"jsonrpc":"2.0","id":id,"method":"session/request_permission","params":permission_params(&session)}))
                .await;
            agent
                .send(json!({"jsonrpc":"2.0","id":id,"method":"session/request_permission","params":permission_params(&session)}))
                .await;
            let first = rx.await.unwrap_or(Value::Null);
            let (tx2, rx2) = oneshot::channel();
            agent.pending.lock().await.insert(id, tx2);
            // Said as soon as it is known (and the second answer can be taken): a client can
            // wait for it before cancelling the permission question.
            agent.say(&session, &format!("first {}", describe(&first))).await;
            let second = rx2.await.unwrap_or(Value::Null);
            agent
                .say(&session, &format!("second {}", describe(&second)))
                .await;
        }
        "ext" => {
            agent
                .send(json!({"jsonrpc":"2.0","method":"_fake/note","params":{"n":1}}))
                .await;
            let a = agent.request("_fake/ping", json!({"x":1})).await;
            let b = agent.request("fake/unknown", json!({})).await;
            agent
                .say(
                    &session,
                    &format!("ext {} unknown {}", describe(&a), describe(&b)),
                )
                .await;
        }
        "elicit" => {
            let mode = rest.first().copied().unwrap_or("form");
            let params = if mode == "url" {
                json!({"sessionId":session,"mode":"url","elicitationId":"e1","url":"https://example.invalid/auth","message":"Sign in"})
            } else {
                json!({"sessionId":session,"mode":"form","message":"Your name?","requestedSchema":{"type":"object","properties":{"name":{"type":"string"}}}})
            };
            let a = agent.request("elicitation/create", params).await;
            if mode == "url" {
                agent
                    .send(json!({"jsonrpc":"2.0","method":"elicitation/complete","params":{"elicitationId":"e1"}}))
                    .await;
            }
            agent.say(&session, &format!("elicit {}", describe(&a))).await;
        }
        "tool" => {
            agent.update(&session, json!({"sessionUpdate":"agent_thought_chunk","content":{"type":"text","text":"thinking"}})).await;
            agent.update(&session, json!({"sessionUpdate":"tool_call","toolCallId":"t1","title":"List files","kind":"execute","status":"pending","rawInput":{"cmd":"ls"}})).await;
            agent
                .update(
                    &session,
                    json!({"sessionUpdate":"tool_call_update","toolCallId":"t1","status":"in_progress"}),
                )
                .await;
            agent.update(&session, json!({"sessionUpdate":"tool_call_update","toolCallId":"t1","status":"completed","content":[{"type":"content","content":{"type":"text","text":"a.txt"}}],"rawOutput":{"files":["a.txt"]}})).await;
            agent.update(&session, json!({"sessionUpdate":"plan","entries":[{"content":"step one","priority":"high","status":"completed"}]})).await;
            agent.update(&session, json!({"sessionUpdate":"usage_update","used":1200,"size":200000,"cost":{"amount":0.01,"currency":"USD"}})).await;
            agent.say(&session, "done").await;
        }
        "stop" => stop = rest.first().copied().unwrap_or("end_turn").to_string(),
        "hang" => {
            let _ = cancel_rx.wait_for(|v| *v != cancel_seen).await;
            stop = "cancelled".into();
        }
        _ => agent.say(&session, &format!("unknown command {cmd:?}")).await,
    }
    if cmd == "hang" && stop != "cancelled" {
        return;
    }
    agent.respond(&id, json!({"stopReason": stop})).await;
}

async fn run_malformed(agent: Agent, id: Value, session: String, errors: watch::Receiver<Option<Value>>) {
    let mut errors = errors;
    agent.write("this is not json {").await;
    let got = errors.wait_for(Option::is_some).await.map(|v| v.clone());
    let code = got
        .ok()
        .flatten()
        .and_then(|e| e.get("code").cloned())
        .unwrap_or(Value::Null);
    agent.say(&session, &format!("parse error code {code}")).await;
    agent.respond(&id, json!({"stopReason":"end_turn"})).await;
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--flood-raw") {
        let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(100_000);
        let session = args.get(3).map(String::as_str).unwrap_or("fake-1");
        flood(&mut stdout(), session, n).await;
        return;
    }
    let version: i64 = std::env::var("FAKE_ACP_PROTOCOL_VERSION")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let agent = Agent {
        out: Arc::new(Mutex::new(BufWriter::with_capacity(64 * 1024, stdout()))),
        pending: Arc::new(Mutex::new(HashMap::new())),
        next_id: Arc::new(AtomicI64::new(0)),
        cancel: watch::channel(0).0,
    };
    let (err_tx, err_rx) = watch::channel::<Option<Value>>(None);
    let mut sessions = 0u32;
    let mut lines = BufReader::new(stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            eprintln!("fake-acp-agent: unparseable line from client: {line}");
            continue;
        };
        let method = msg.get("method").and_then(Value::as_str).map(str::to_owned);
        let id = msg.get("id").cloned();
        let params = msg.get("params").cloned().unwrap_or(Value::Null);
        match (method.as_deref(), id) {
            (None, Some(id)) => {
                if id.is_null() {
                    let _ = err_tx.send(msg.get("error").cloned());
                    continue;
                }
                if let Some(n) = id.as_i64()
                    && let Some(tx) = agent.pending.lock().await.remove(&n)
                {
                    let _ = tx.send(msg.clone());
                }
            }
            (Some(m), Some(id)) => match m {
                "initialize" => {
                    eprintln!("fake-acp-agent: client capabilities {}", params["clientCapabilities"]);
                    agent
                        .respond(
                            &id,
                            json!({
                                "protocolVersion": version,
                                "agentCapabilities": {
                                    "loadSession": true,
                                    "promptCapabilities": {"image": false},
                                    "sessionCapabilities": {"resume": {}, "list": {}, "close": {}},
                                    "auth": {"logout": {}},
                                    "futureCapability": {"x": 1}
                                },
                                "authMethods": [{"id": "none", "name": "No auth"}],
                                "agentInfo": {"name": "fake-acp-agent", "version": "0.0.1"}
                            }),
                        )
                        .await;
                }
                "session/new" => {
                    sessions += 1;
                    agent
                        .respond(
                            &id,
                            json!({
                                "sessionId": format!("fake-{sessions}"),
                                "models": {"availableModels": [{"modelId": "m1", "name": "Model 1"}], "currentModelId": "m1"},
                                "modes": {"currentModeId": "code", "availableModes": [{"id": "code", "name": "Code"}]}
                            }),
                        )
                        .await;
                    // An update right after the answer: must not be lost to a registration race.
                    agent
                        .say(&format!("fake-{sessions}"), "welcome")
                        .await;
                }
                "session/load" => {
                    let sid = params["sessionId"].as_str().unwrap_or("").to_owned();
                    agent.update(&sid, json!({"sessionUpdate":"user_message_chunk","content":{"type":"text","text":"earlier question"}})).await;
                    agent.say(&sid, "earlier answer").await;
                    agent.respond(&id, json!({})).await;
                }
                "session/resume" | "session/close" | "session/set_mode" | "authenticate"
                | "logout" => agent.respond(&id, json!({})).await,
                "session/list" => {
                    agent
                        .respond(&id, json!({"sessions": [{"sessionId": "fake-1", "cwd": "/tmp", "title": "first"}]}))
                        .await
                }
                "session/set_config_option" => {
                    agent.respond(&id, json!({"configOptions": []})).await
                }
                "session/prompt" => {
                    let session = params["sessionId"].as_str().unwrap_or("").to_owned();
                    let text: String = params["prompt"]
                        .as_array()
                        .map(|blocks| {
                            blocks
                                .iter()
                                .filter_map(|b| b["text"].as_str())
                                .collect::<Vec<_>>()
                                .join(" ")
                        })
                        .unwrap_or_default();
                    if text.trim() == "malformed" {
                        tokio::spawn(run_malformed(agent.clone(), id, session, err_rx.clone()));
                    } else {
                        tokio::spawn(run_prompt(agent.clone(), id, session, text));
                    }
                }
                other => {
                    agent
                        .send(json!({"jsonrpc":"2.0","id":id,"error":{"code":-32601,"message":format!("method not found: {other}")}}))
                        .await
                }
            },
            (Some("session/cancel"), None) => {
                agent.cancel.send_modify(|v| *v += 1);
            }
            (Some(m), None) => eprintln!("fake-acp-agent: notification {m}"),
            (None, None) => {}
        }
    }
}
