//! Entry points for the fuzz targets in `fuzz/` and the corpus replay tests. **Not part of the
//! API**: hidden from the docs, free to change with the targets.
//!
//! - [`check_sse_stream`]: a chat-completion SSE body, through the same line splitter,
//!   `feed_read` and accumulator as `OpenAiModel`'s stream reader, cut into reads every way
//!   [`tether::fuzzing::splits`] cuts it, and once more line by line through serde only;
//!   every `data:` payload also through the hand-written fast path against serde.
//! - [`check_http_response`]: raw HTTP response bytes served on a real 127.0.0.1 socket to an
//!   `OpenAiModel` on the lean HTTP/1.1 client (head, chunked or sized body, SSE or JSON), once
//!   in one write and once in many.
//! - [`check_streamed_arguments`]: tool-call argument text streamed in fragments.

use std::sync::OnceLock;

use bytes::Bytes;
use serde_json::{Value, json};
use tether::fuzzing::{Live, Recorder, block_on, splits};
use tether::{ChatModel, ChatRequest, ChatResponse, ToolSpec};

use crate::accum::{Emit, Fed, StreamAccumulator};
use crate::{MAX_LINE, fast, feed_read, wire};
use tether_http::sse::{LineSplitter, data_of};

/// What a client sees of one streamed call: the live deltas, then the response or the error.
#[derive(Debug, PartialEq)]
struct Outcome {
    live: Live,
    result: Result<Value, String>,
}

/// Adds the pending emits to `live`, as `OpenAiModel` forwards them after each read.
fn forward(acc: &StreamAccumulator, live: &mut Live) {
    for e in acc.emits() {
        match e {
            Emit::Text(r) => live.text.push_str(&acc.text()[r.clone()]),
            Emit::Reasoning(r) => live.reasoning.push_str(&acc.reasoning()[r.clone()]),
            Emit::Start(s) => {
                let c = &acc.calls()[*s];
                live.calls.push((c.id.clone(), c.name.clone(), String::new(), 0));
            }
            Emit::Args(s, r) => {
                let c = &acc.calls()[*s];
                let piece = &c.arguments[r.clone()];
                match live.calls.iter_mut().rev().find(|l| l.0 == c.id) {
                    Some(l) => l.2.push_str(piece),
                    None => live.orphans.push((c.id.clone(), format!("args {piece}"))),
                }
            }
            Emit::End(s) => {
                let id = &acc.calls()[*s].id;
                match live.calls.iter_mut().rev().find(|l| &l.0 == id) {
                    Some(l) => l.3 += 1,
                    None => live.orphans.push((id.clone(), "end".into())),
                }
            }
        }
    }
}

/// `OpenAiModel::read_stream` over `reads`, without the network: `fast` feeds each read through
/// `feed_read` (the templated and fast paths), otherwise each line through serde alone.
fn run_stream(reads: &[&[u8]], fast: bool) -> Outcome {
    let mut lines = LineSplitter::new();
    let mut acc = StreamAccumulator::new();
    let mut live = Live::default();
    let mut done = false;
    let fail = |live: Live, e: String| Outcome { live, result: Err(e) };
    for r in reads {
        lines.push(Bytes::copy_from_slice(r));
        let fed = if fast {
            feed_read(&mut lines, &mut acc)
        } else {
            let mut fed = Ok(Fed::More);
            while let Some(line) = lines.next_line() {
                if let Some(data) = data_of(line) {
                    match acc.feed_with(data, false) {
                        Ok(Fed::More) => {}
                        other => {
                            fed = other;
                            break;
                        }
                    }
                }
            }
            fed
        };
        match fed {
            Err(e) => return fail(live, e.to_string()),
            Ok(Fed::Done) => {
                done = true;
                break;
            }
            Ok(Fed::More) => {}
        }
        lines.release();
        forward(&acc, &mut live);
        acc.clear_emits();
        if lines.pending_len() > MAX_LINE {
            return fail(live, "an SSE line exceeded MAX_LINE".into());
        }
    }
    if !done {
        if let Some(line) = lines.finish()
            && let Some(data) = data_of(line)
        {
            match acc.feed_with(data, fast) {
                Ok(f) => done = f == Fed::Done,
                Err(e) => return fail(live, e.to_string()),
            }
        }
        if !done && acc.finish_reason().is_none() {
            return fail(live, "truncated: no finish_reason".into());
        }
    }
    if let Err(e) = acc.finish() {
        return fail(live, e.to_string());
    }
    forward(&acc, &mut live);
    let resp = acc.into_response();
    check_live_matches(&live, &resp);
    let result = Ok(normalized(&resp));
    Outcome { live, result }
}

/// The live deltas add up to the response: the text, the reasoning, and each call once, started
/// with its id and name, its arguments whole, ended once.
fn check_live_matches(live: &Live, resp: &ChatResponse) {
    assert_eq!(
        live.text,
        resp.message.content.clone().unwrap_or_default(),
        "live text"
    );
    assert_eq!(
        live.reasoning,
        resp.message.reasoning.clone().unwrap_or_default(),
        "live reasoning"
    );
    assert!(
        live.orphans.is_empty(),
        "deltas for calls never started: {:?}",
        live.orphans
    );
    let mut shown: Vec<_> = live.calls.clone();
    let mut kept: Vec<_> = resp
        .message
        .tool_calls
        .iter()
        .map(|c| (c.id.clone(), c.name.clone(), c.arguments.clone(), 1))
        .collect();
    shown.sort();
    kept.sort();
    assert_eq!(shown, kept, "the calls shown live are not the calls kept");
    // A call always has an id (one is invented when the stream names none). Its name may be
    // empty: the engine answers such a call with an error result (the model is told), rather
    // than the accumulator failing the whole response.
    for c in &resp.message.tool_calls {
        assert!(!c.id.is_empty(), "a call without an id: {c:?}");
    }
    if resp.message.content.is_none() {
        assert!(!resp.message.tool_calls.is_empty(), "no content and no calls");
    }
}

/// The response as JSON, with the random base of ids invented for calls of a stream that named
/// no completion id replaced by `R` (they differ between runs by design).
fn normalized(resp: &ChatResponse) -> Value {
    let mut text = serde_json::to_string(resp).unwrap_or_default();
    if resp.raw["id"].is_null() {
        for c in &resp.message.tool_calls {
            if let Some(rest) = c.id.strip_prefix("call_")
                && let Some((base, _)) = rest.split_once('_')
                && base.len() == 16
            {
                text = text.replace(base, "R");
            }
        }
    }
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

/// The live ids are normalized as the response's are. After an error only the error is
/// compared: what was forwarded before it depends on where the reads ended (the deltas of the
/// read that failed are not forwarded), and the retry above the model deals with it.
fn normalized_outcome(mut o: Outcome) -> Outcome {
    if o.result.is_err() {
        o.live = Live::default();
    }
    if let Ok(v) = &o.result
        && v["raw"]["id"].is_null()
    {
        for c in &mut o.live.calls {
            if let Some(rest) = c.0.strip_prefix("call_")
                && let Some((base, idx)) = rest.split_once('_')
                && base.len() == 16
            {
                c.0 = format!("call_R_{idx}");
            }
        }
    }
    o
}

/// The fast path's reading of one `data:` payload equals serde's, whenever it accepts it.
pub fn check_chunk_line(data: &[u8]) {
    let data = data.trim_ascii();
    let Some(light) = fast::chunk(data) else {
        return;
    };
    let full: wire::Chunk<'_> = serde_json::from_slice(data).unwrap_or_else(|e| {
        panic!(
            "the fast path accepted what serde rejects ({e}): {}",
            String::from_utf8_lossy(data)
        )
    });
    let s = |o: &Option<wire::Str<'_>>| o.as_ref().map(|s| s.0.to_string());
    let l = |o: &Option<std::borrow::Cow<'_, str>>| o.as_ref().map(|s| s.to_string());
    assert_eq!(l(&light.id), s(&full.id), "id");
    assert_eq!(l(&light.model), s(&full.model), "model");
    assert!(full.usage.as_ref().is_none_or(Value::is_null), "usage");
    assert!(full.error.as_ref().is_none_or(Value::is_null), "error");
    let (mut content, mut refusal, mut rc, mut r, mut finish) = (None, None, None, None, None);
    if let Some(ch) = &full.choices.0 {
        finish = s(&ch.finish_reason);
        if let Some(d) = &ch.delta {
            content = s(&d.content);
            refusal = s(&d.refusal);
            rc = s(&d.reasoning_content);
            r = s(&d.reasoning);
            assert!(d.tool_calls.is_empty() && d.function_call.is_none(), "tool calls");
        }
    }
    assert_eq!(l(&light.content), content, "content");
    assert_eq!(l(&light.refusal), refusal, "refusal");
    assert_eq!(l(&light.reasoning_content), rc, "reasoning_content");
    assert_eq!(l(&light.reasoning), r, "reasoning");
    assert_eq!(l(&light.finish_reason), finish, "finish_reason");
    if let Some((a, b)) = light.content_span {
        let token = data.get(a..b).expect("the content span lies in the line");
        let decoded: String = serde_json::from_slice(token).expect("the content span is a string token");
        assert_eq!(Some(decoded), content, "the content span");
    }
}

/// A chat-completion SSE body: the same outcome (deltas, response or error) however it is cut
/// into reads, and through serde alone; the deltas add up to the response; every payload the fast
/// path accepts, it reads as serde does.
pub fn check_sse_stream(body: &[u8]) {
    for line in body.split(|&b| b == b'\n' || b == b'\r') {
        if let Some(data) = data_of(line) {
            check_chunk_line(data);
        }
    }
    let reference = normalized_outcome(run_stream(&[body], false));
    for reads in splits(body) {
        let got = normalized_outcome(run_stream(&reads, true));
        assert_eq!(
            got,
            reference,
            "cut into {} reads, the stream decoded differently from serde line by line",
            reads.len()
        );
    }
}

/// Tool-call argument text streamed in fragments (as `splits` cuts it), each one JSON-escaped
/// in its own chunk: the call comes out with the text whole, shown live whole, and decoded as
/// [`tether::ToolUse::from_arguments`] decodes it.
pub fn check_streamed_arguments(args: &str) {
    let expected = tether::fuzzing::expected_tool_use("call_1", "probe", args);
    for pieces in splits(args.as_bytes()) {
        // Cut on character boundaries only: each fragment is a JSON string.
        let mut frags: Vec<String> = Vec::new();
        let mut at = 0;
        let mut end = 0;
        for p in pieces {
            end += p.len();
            if args.is_char_boundary(end) {
                frags.push(args[at..end].to_owned());
                at = end;
            }
        }
        let mut body = String::new();
        let chunk = |v: Value| format!("data: {v}\n\n");
        body.push_str(&chunk(json!({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "probe", "arguments": ""}}
        ]}}]})));
        for f in &frags {
            body.push_str(&chunk(json!({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": f}}
            ]}}]})));
        }
        body.push_str(&chunk(
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
        ));
        body.push_str("data: [DONE]\n\n");
        let out = run_stream(&[body.as_bytes()], true);
        let Ok(resp) = out.result else {
            panic!("a well-formed tool-call stream failed: {:?}", out.result)
        };
        let calls = &resp["message"]["tool_calls"];
        assert_eq!(
            calls[0]["arguments"].as_str(),
            Some(args),
            "the arguments came out changed"
        );
        assert_eq!(out.live.calls.len(), 1);
        assert_eq!(out.live.calls[0].2, args, "the live arguments");
        let call = tether::ChatToolCall::new("call_1", "probe", args);
        assert_eq!(call.to_tool_use(), expected);
    }
}

/// A scripted upstream on 127.0.0.1 that answers each connection with the bytes it is given.
struct Upstream {
    url: String,
    tx: std::sync::mpsc::Sender<(Vec<u8>, Vec<usize>)>,
}

/// One upstream for the process, on its own thread: it accepts a connection, reads the request
/// head (up to the blank line and the declared body), writes the response in the pieces given,
/// closes its side, and drains until the client closes.
fn upstream() -> &'static Upstream {
    static UP: OnceLock<Upstream> = OnceLock::new();
    UP.get_or_init(|| {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let url = format!("http://{}/v1", listener.local_addr().expect("local addr"));
        let (tx, rx) = std::sync::mpsc::channel::<(Vec<u8>, Vec<usize>)>();
        std::thread::spawn(move || {
            for (reply, cuts) in rx {
                let Ok((mut s, _)) = listener.accept() else {
                    continue;
                };
                let _ = s.set_nodelay(true);
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    req.extend_from_slice(&buf[..n]);
                    if let Some(end) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&req[..end]).to_ascii_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse().ok())
                            .unwrap_or(0);
                        if req.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                let mut at = 0;
                for c in cuts.into_iter().chain([reply.len()]) {
                    let c = c.clamp(at, reply.len());
                    if s.write_all(&reply[at..c]).is_err() {
                        break;
                    }
                    at = c;
                }
                let _ = s.shutdown(std::net::Shutdown::Write);
                // Until the client closes (it may keep reading a body that never ends otherwise).
                while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
            }
        });
        Upstream { url, tx }
    })
}

/// One call of an `OpenAiModel` on the lean client against `reply` written in `cuts`.
fn call_upstream(reply: &[u8], cuts: Vec<usize>, read_buffer: usize) -> Outcome {
    let up = upstream();
    let _ = up.tx.send((reply.to_vec(), cuts));
    let model = crate::OpenAiModel::builder(up.url.clone())
        .model("m")
        .read_buffer(read_buffer)
        .connect_timeout(std::time::Duration::from_secs(10))
        .request_timeout(std::time::Duration::from_secs(20))
        .stream_idle_timeout(std::time::Duration::from_secs(20))
        .build()
        .expect("a model for 127.0.0.1");
    let req = ChatRequest::new(
        "",
        vec![tether::ChatMessage::user("hi")],
        vec![ToolSpec::new("probe", "", json!({"type": "object"}))],
    );
    let (deltas, rec) = Recorder::delta_sink();
    let result = block_on(model.chat(&req, &deltas));
    let live = rec.live();
    if let Ok(resp) = &result {
        check_live_matches(&live, resp);
    }
    normalized_outcome(Outcome {
        live,
        result: result.map(|r| normalized(&r)).map_err(|e| e.to_string()),
    })
}

/// Raw HTTP response bytes from the upstream: the model returns a response or a typed error
/// (never panics or hangs), its live deltas add up to the response, and the outcome is the same
/// whether the bytes arrive in one write or in many, read through a large buffer or a small one.
pub fn check_http_response(reply: &[u8]) {
    let whole = call_upstream(reply, Vec::new(), 64 * 1024);
    let pieces = splits(reply);
    let cuts: Vec<usize> = pieces
        .last()
        .map(|p| {
            p.iter()
                .scan(0, |at, s| {
                    *at += s.len();
                    Some(*at)
                })
                .collect()
        })
        .unwrap_or_default();
    let cut = call_upstream(reply, cuts, 1024);
    match (&whole.result, &cut.result) {
        (Ok(_), Ok(_)) => assert_eq!(whole, cut, "the same response read in pieces differed"),
        (Err(_), Err(_)) => {}
        _ => panic!(
            "the same response succeeded one way and failed the other:\nwhole: {:?}\ncut: {:?}",
            whole.result, cut.result
        ),
    }
}
