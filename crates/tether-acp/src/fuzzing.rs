//! Entry points for the fuzz targets in `fuzz/` and the corpus replay tests. **Not part of the
//! API**: hidden from the docs, free to change with the targets.
//!
//! - [`check_frame_lines`]: JSON-RPC lines through the `session/update` fast path against the
//!   general decode (the schema crate's), one after another so recycled buffers are exercised.
//! - [`check_connection`]: an agent's stdout, byte for byte, into a real [`AcpClient`] over an
//!   in-process pipe, after a scripted `initialize` and `session/new`: framing, dispatch,
//!   validation (capabilities, sessions, path confinement) and answers, cut into reads every way
//!   [`tether::fuzzing::splits`] cuts it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use serde_json::value::RawValue;
use tether::fuzzing::{block_on, splits};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::connection::parse_update;
use crate::fast::{FastCache, decode_text_chunk};
use crate::handler::{
    AcpTerminalRequest, AcpTerminalResponse, ClientHandler, RawMessage, SessionUpdateEvent,
};
use crate::schema::{
    NewSessionRequest, ReadTextFileRequest, ReadTextFileResponse, RequestId, WriteTextFileRequest,
    WriteTextFileResponse,
};
use crate::{AcpClient, ClientError, ClientOptions};

/// The general path for a notification line, as the dispatcher takes it when the fast path
/// declines.
fn general(line: &str) -> Option<SessionUpdateEvent> {
    let v: Value = serde_json::from_str(line).ok()?;
    if v.get("id").is_some() || v.get("method")?.as_str()? != "session/update" {
        return None;
    }
    let params = serde_json::to_string(v.get("params")?).ok()?;
    parse_update(&params).ok()
}

/// Each line of `data`: whatever the fast path accepts, it decodes exactly as the general path
/// does (also in a buffer recycled from the line before).
pub fn check_frame_lines(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut cache = FastCache::default();
    for line in text.split('\n') {
        if let Some(fast) = decode_text_chunk(line, &mut cache) {
            let slow = general(line)
                .unwrap_or_else(|| panic!("the fast path accepted a line the general path rejects: {line}"));
            assert_eq!(fast, slow, "{line}");
            cache.recycle(fast);
        }
    }
}

/// The frame limit the client runs with (small, so inputs reach it).
const MAX_FRAME: usize = 2048;
/// The one session the scripted agent opens.
const SESSION: &str = "fuzz-session";
/// The id of the request the harness sends after the input: once it is answered, every request
/// before it has been (the handler answers at once, in order).
const END_ID: &str = "fuzz-end-7f3a9c";

/// The session's root: `$TMPDIR/tether-fuzz-acp` (a fixed path, so corpus inputs can name files
/// in it), made once per process; it only ever holds the two files made here.
pub fn root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let dir = std::env::temp_dir().join("tether-fuzz-acp");
        let _ = std::fs::create_dir_all(dir.join("sub"));
        let _ = std::fs::write(dir.join("a.txt"), "a\n");
        dir.canonicalize().unwrap_or(dir)
    })
}

/// Records what reaches it, answers at once, and never touches the file system. Every path it
/// is handed must be inside the session root: the connection confines them.
#[derive(Default)]
struct Probe {
    updates: Mutex<Vec<String>>,
    calls: Mutex<Vec<String>>,
}

impl Probe {
    fn call(&self, what: String) {
        if let Ok(mut c) = self.calls.lock() {
            c.push(what);
        }
    }

    fn confined(path: &Path, what: &str) {
        assert!(
            path.starts_with(root()),
            "{what} reached the handler with {} outside the root {}",
            path.display(),
            root().display()
        );
    }
}

#[async_trait]
impl ClientHandler for Probe {
    fn supports(&self) -> tether::Capabilities {
        tether::Capabilities::all()
    }

    async fn session_update_with_message(&self, event: &SessionUpdateEvent, m: &RawMessage<'_>) {
        assert!(
            m.json().len() <= MAX_FRAME,
            "a {}-byte frame was delivered past the {MAX_FRAME}-byte limit",
            m.json().len()
        );
        if let Ok(mut u) = self.updates.lock() {
            u.push(format!("{event:?}"));
        }
    }

    async fn read_text_file(&self, r: ReadTextFileRequest) -> Result<ReadTextFileResponse, ClientError> {
        Self::confined(&r.path, "fs/read_text_file");
        self.call(format!("read {:?}", r.path));
        Ok(ReadTextFileResponse::new("content"))
    }

    async fn write_text_file(&self, r: WriteTextFileRequest) -> Result<WriteTextFileResponse, ClientError> {
        Self::confined(&r.path, "fs/write_text_file");
        self.call(format!("write {:?}", r.path));
        Ok(WriteTextFileResponse::new())
    }

    async fn terminal(
        &self,
        request: AcpTerminalRequest,
        _id: &RequestId,
    ) -> Result<AcpTerminalResponse, ClientError> {
        if let AcpTerminalRequest::Create(c) = &request
            && let Some(cwd) = &c.cwd
        {
            Self::confined(cwd, "terminal/create");
        }
        self.call(format!("terminal {}", request.method()));
        Err(ClientError::internal("no terminals here"))
    }

    async fn ext_method(&self, method: &str, _params: &RawValue) -> Result<Value, ClientError> {
        self.call(format!("ext {method}"));
        Ok(Value::Null)
    }
}

/// What one conversation produced: the updates delivered (in order), the handler calls and the
/// answers written to the agent (sorted: requests run concurrently), how the connection ended.
#[derive(Debug, PartialEq)]
struct Transcript {
    updates: Vec<String>,
    calls: Option<Vec<String>>,
    answers: Option<Vec<String>>,
    end: String,
}

/// The error's variant name (its fields, such as a partial frame's size, depend on the reads).
fn variant(e: &crate::AcpError) -> String {
    let d = format!("{e:?}");
    d.split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or_default()
        .to_owned()
}

async fn converse(reads: &[&[u8]]) -> Transcript {
    let (client_io, agent_io) = tokio::io::duplex(64 * 1024);
    let (client_r, client_w) = tokio::io::split(client_io);
    let (agent_r, mut agent_w) = tokio::io::split(agent_io);
    let probe = Arc::new(Probe::default());
    let opts = ClientOptions::default()
        .with_max_frame_bytes(MAX_FRAME)
        .with_request_timeout(Duration::from_secs(30))
        .with_initialize_timeout(Duration::from_secs(30));
    let client = AcpClient::connect(client_r, client_w, probe.clone(), opts).await;
    let mut from_client = BufReader::new(agent_r).lines();

    // The scripted prologue: answer `initialize` and `session/new`.
    let answer = |line: &str, result: Value| -> String {
        let id = serde_json::from_str::<Value>(line)
            .map(|v| v["id"].clone())
            .unwrap_or(Value::Null);
        format!(
            "{}\n",
            serde_json::json!({"jsonrpc": "2.0", "id": id, "result": result})
        )
    };
    let init = {
        let c = &client;
        async move { c.initialize().await }
    };
    let script = async {
        let line = from_client.next_line().await.ok().flatten().unwrap_or_default();
        let reply = answer(
            &line,
            serde_json::json!({"protocolVersion": 1, "agentCapabilities": {}}),
        );
        let _ = agent_w.write_all(reply.as_bytes()).await;
    };
    let (init, ()) = tokio::join!(init, script);
    init.expect("the scripted initialize succeeds");
    let new = {
        let c = &client;
        async move { c.new_session(NewSessionRequest::new(root())).await }
    };
    let script = async {
        let line = from_client.next_line().await.ok().flatten().unwrap_or_default();
        let reply = answer(&line, serde_json::json!({"sessionId": SESSION}));
        let _ = agent_w.write_all(reply.as_bytes()).await;
    };
    let (new, ()) = tokio::join!(new, script);
    new.expect("the scripted session/new succeeds");

    // The input, then the end marker; read the client's answers until the marker's.
    let feed = async {
        for r in reads {
            if agent_w.write_all(r).await.is_err() {
                return;
            }
        }
        let end = format!("\n{{\"jsonrpc\":\"2.0\",\"id\":\"{END_ID}\",\"method\":\"_fuzz/end\"}}\n");
        let _ = agent_w.write_all(end.as_bytes()).await;
    };
    let collect = async {
        let mut answers = Vec::new();
        let mut ended = false;
        while let Ok(Some(line)) = from_client.next_line().await {
            if line.contains(END_ID) {
                ended = true;
                break;
            }
            check_answer(&line);
            answers.push(line);
        }
        (answers, ended)
    };
    let ((), (mut answers, ended)) =
        tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(feed, collect) })
            .await
            .expect("the client neither answered the end marker nor closed within 60 s");
    // The agent's stdout ends (a half close: the pipe stays open for the client's writes).
    let _ = agent_w.shutdown().await;
    let end = tokio::time::timeout(Duration::from_secs(60), client.closed())
        .await
        .expect("the client did not close within 60 s of its input ending");
    let updates = probe.updates.lock().map(|u| u.clone()).unwrap_or_default();
    let mut calls = probe.calls.lock().map(|c| c.clone()).unwrap_or_default();
    calls.sort();
    answers.sort();
    Transcript {
        updates,
        calls: ended.then_some(calls),
        answers: ended.then_some(answers),
        end: if ended {
            variant(&end)
        } else {
            format!("before the end marker: {}", variant(&end))
        },
    }
}

/// Every line the client writes is one JSON-RPC 2.0 message: a response (`result` xor `error`)
/// or an error with a null id for a malformed frame.
fn check_answer(line: &str) {
    let v: Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("the client wrote invalid JSON ({e}): {line}"));
    assert_eq!(v["jsonrpc"], "2.0", "{line}");
    assert!(v.get("id").is_some(), "an answer without an id: {line}");
    assert!(
        v.get("result").is_some() != v.get("error").is_some(),
        "an answer needs exactly one of result and error: {line}"
    );
    if let Some(e) = v.get("error") {
        assert!(e["code"].is_i64() && e["message"].is_string(), "{line}");
    }
}

/// An agent's stdout: never a panic or a hang; every answer well-formed and each request answered
/// at most once; paths confined; and the same updates, handler calls and answers however the
/// bytes are cut into reads.
pub fn check_connection(data: &[u8]) {
    let all = splits(data);
    let reference = block_on(converse(&all[0]));
    check_once(&reference);
    for reads in &all[1..] {
        let got = block_on(converse(reads));
        if got.calls.is_none() || reference.calls.is_none() {
            // The input closed the connection (an oversized frame): only what came before it
            // is comparable.
            assert_eq!(got.updates, reference.updates, "cut into {} reads", reads.len());
            assert_eq!(
                got.calls.is_none(),
                reference.calls.is_none(),
                "cut into {} reads",
                reads.len()
            );
        } else {
            let (got, reference) = without_cancelled(got, &reference);
            assert_eq!(got, reference, "cut into {} reads", reads.len());
        }
    }
}

/// Two races of the protocol itself, where either answer is right: a request the agent cancels
/// (`$/cancel_request`) is answered with its result or `-32800`, depending on whether its handler
/// finished first; a request reusing the id of an earlier one is refused (`request id already in
/// use`) only while that one is still running. The ids either transcript answered so are dropped
/// from both, and then the handler calls are not compared.
fn without_cancelled(mut a: Transcript, b: &Transcript) -> (Transcript, Transcript) {
    let mut b = Transcript {
        updates: b.updates.clone(),
        calls: b.calls.clone(),
        answers: b.answers.clone(),
        end: b.end.clone(),
    };
    let id_of = |l: &String| {
        serde_json::from_str::<Value>(l)
            .map(|v| v["id"].to_string())
            .unwrap_or_default()
    };
    let cancelled: Vec<String> = [&a, &b]
        .iter()
        .flat_map(|t| t.answers.iter().flatten())
        .filter(|l| l.contains("\"code\":-32800") || l.contains("request id already in use"))
        .map(id_of)
        .collect();
    if !cancelled.is_empty() {
        for t in [&mut a, &mut b] {
            if let Some(ans) = &mut t.answers {
                ans.retain(|l| !cancelled.contains(&id_of(l)));
            }
            t.calls = None;
        }
    }
    (a, b)
}

/// No request id is answered twice (a null id answers malformed frames, so may repeat).
fn check_once(t: &Transcript) {
    let mut ids: Vec<String> = t
        .answers
        .iter()
        .flatten()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| v["id"].clone())
        .filter(|id| !id.is_null())
        .map(|id| id.to_string())
        .collect();
    let n = ids.len();
    ids.sort();
    ids.dedup();
    if ids.len() != n {
        // A duplicate id in the input is answered twice by design ("already in use"): only the
        // first use runs. Check that each id ran at most once instead.
        let runs = t.calls.iter().flatten().count();
        assert!(runs <= n, "{t:?}");
    }
}
