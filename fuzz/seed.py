#!/usr/bin/env python3
"""Writes the seed inputs of every fuzz target into fuzz/corpus/<target>/seed-*.

Seeds come from the repository's golden files (crates/tether-testkit/golden) and from the wire
shapes the crates' own tests use, so fuzzing starts from real traffic. Re-run after changing it;
then grow and minimise the corpora as fuzz/README.md says. Python 3 standard library only.
"""
import json
import os
import struct
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "crates", "tether-testkit", "golden")
CORPUS = os.path.join(HERE, "corpus")


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def golden(*path, text=True):
    with open(os.path.join(GOLDEN, *path), "rb") as f:
        b = f.read()
    return b.decode() if text else b


def j(v):
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False)


# --- OpenAI chat-completion streams -------------------------------------------------------------

def chunk(delta=None, finish=None, **extra):
    c = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1764000000, "model": "m",
         "system_fingerprint": "fp", "choices": [{"index": 0, "delta": delta or {}, "logprobs": None,
                                                  "finish_reason": finish}]}
    c.update(extra)
    return "data: " + j(c) + "\n\n"


text_stream = (chunk({"role": "assistant", "content": ""}) + chunk({"content": "Hel"}) + chunk({"content": "lo, "})
               + chunk({"content": "w\u00f6rld\n"}) + chunk({}, "stop")
               + "data: " + j({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                                                          "prompt_tokens_details": {"cached_tokens": 1}}}) + "\n\n"
               + "data: [DONE]\n\n")
tool_stream = (chunk({"role": "assistant", "tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                                           "function": {"name": "read_file", "arguments": ""}}]})
               + chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"path\":"}}]})
               + chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\"a.txt\"}"}},
                                       {"index": 1, "id": "call_b", "function": {"name": "list_dir", "arguments": "{}"}}]})
               + chunk({}, "tool_calls") + "data: [DONE]\n\n")
reasoning_stream = (chunk({"reasoning_content": "Let me think"}) + chunk({"reasoning": " more"})
                    + chunk({"content": "42", "refusal": None}) + chunk({"refusal": "no"}) + chunk({}, "stop"))
legacy_stream = (": keep-alive\r\n\r\n" + chunk({"function_call": {"name": "f", "arguments": "{\"a\":"}}).replace("\n\n", "\r\n\r\n")
                 + chunk({"function_call": {"arguments": "1}"}}) + chunk({}, "function_call") + "data:[DONE]\r\r")
error_stream = chunk({"content": "partial"}) + "data: " + j({"error": {"message": "overloaded", "type": "server_error", "code": None}}) + "\n\n"
llama_stream = "".join("data: " + j({"choices": [{"finish_reason": None, "index": 0, "delta": {"content": t}}], "created": 1,
                                     "id": "x", "model": "llama", "object": "chat.completion.chunk"}) + "\n\n"
                       for t in ["a", "b\\", "\"c\"", "\u00e9\U0001f600", ""]) + chunk({}, "length")
for name, body in [("text", text_stream), ("tools", tool_stream), ("reasoning", reasoning_stream),
                   ("legacy_crlf", legacy_stream), ("error", error_stream), ("llama_template", llama_stream),
                   ("truncated", chunk({"content": "cut"})[:-1])]:
    put("openai_sse", name, body)


def http(status, headers, body, chunked=False):
    if isinstance(body, str):
        body = body.encode()
    head = f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    if chunked:
        pieces, out = [body[i:i + 97] for i in range(0, len(body), 97)], b""
        for p in pieces:
            out += b"%x\r\n" % len(p) + p + b"\r\n"
        out += b"0\r\n\r\n"
        return (head + "transfer-encoding: chunked\r\n\r\n").encode() + out
    return (head + f"content-length: {len(body)}\r\n\r\n").encode() + body


completion = j({"id": "chatcmpl-2", "object": "chat.completion", "model": "m", "choices": [{"index": 0, "message": {
    "role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": [{"id": "call_1", "type": "function",
    "function": {"name": "probe", "arguments": "{\"x\":1}"}}]}, "finish_reason": "tool_calls"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 6}})
for name, data in [
    ("sse_chunked", http("200 OK", [("content-type", "text/event-stream")], text_stream, chunked=True)),
    ("sse_length", http("200 OK", [("content-type", "text/event-stream; charset=utf-8")], tool_stream)),
    ("sse_close", b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + reasoning_stream.encode()),
    ("json", http("200 OK", [("content-type", "application/json")], completion)),
    ("continue_then_json", b"HTTP/1.1 100 Continue\r\n\r\n" + http("200 OK", [("content-type", "application/json")], completion, chunked=True)),
    ("429", http("429 Too Many Requests", [("content-type", "application/json"), ("retry-after-ms", "250"), ("x-should-retry", "true")],
                 j({"error": {"message": "slow down", "type": "rate_limit", "code": "rate_limit_exceeded"}}))),
    ("500_text", http("500 Internal Server Error", [("content-type", "text/plain")], "boom")),
    ("chunk_ext_trailer", b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                          + b"%x;ext=1\r\n" % len(text_stream) + text_stream.encode() + b"\n0\r\nx-trailer: 1\r\n\r\n"),
]:
    put("openai_http", name, data)

# --- Anthropic ----------------------------------------------------------------------------------

for f in sorted(os.listdir(os.path.join(GOLDEN, "anthropic"))):
    if f.endswith(".sse"):
        put("anthropic_messages", f[:-4], golden("anthropic", f))
for f in ["final_text.json", "thinking_tool_use.json"]:
    put("anthropic_messages", "whole_" + f[:-5], golden("anthropic", f))
text = golden("anthropic", "thinking_tool_use.sse")
put("anthropic_messages", "crlf", text.replace("\n", "\r\n"))
put("anthropic_messages", "cr", text.replace("\n", "\r"))
put("anthropic_messages", "no_event_names", "".join(l + "\n" for l in text.split("\n") if not l.startswith("event:")))

turns = json.loads(golden("managed", "tool_round_trip.json"))
n = 0
for turn in turns:
    body = ""
    for ev in turn:
        n += 1
        ev = dict(ev, id=f"sevt_{n}", processed_at="2026-01-01T00:00:00Z")
        body += f"event: {ev['type']}\ndata: {j(ev)}\n\n"
    put("anthropic_managed", f"turn{n}", body)
put("anthropic_managed", "errors", "event: ping\ndata: {}\n\n: comment\n\n"
    + "data: " + j({"type": "session.error", "id": "e1", "error": {"type": "overloaded", "message": "busy", "retry_status": {"type": "retrying"}}}) + "\n\n"
    + "data: " + j({"type": "session.status_idle", "id": "e2", "stop_reason": {"type": "requires_action", "event_ids": ["t1", "t2"]}}) + "\n\n"
    + "data: " + j({"type": "session.status_terminated", "id": "e3"}) + "\n\n"
    + "event: error\ndata: " + j({"type": "error", "error": {"type": "overloaded_error", "message": "x"}}) + "\n\n")

# --- AgentCore ----------------------------------------------------------------------------------

def es_frame(headers, payload):
    h = b""
    for k, v in headers:
        k, v = k.encode(), v.encode()
        h += bytes([len(k)]) + k + b"\x07" + struct.pack(">H", len(v)) + v
    total = 16 + len(h) + len(payload)
    out = struct.pack(">II", total, len(h))
    out += struct.pack(">I", zlib.crc32(out))
    out += h + payload
    return out + struct.pack(">I", zlib.crc32(out))


def described(frames):
    """The target's structured mode: 0x01, then per frame kind, type length, type, payload length, payload."""
    out = b"\x01"
    for kind, ty, payload in frames:
        ty, payload = ty.encode(), payload.encode() if isinstance(payload, str) else payload
        out += bytes([kind, len(ty)]) + ty + struct.pack(">H", len(payload)) + payload
    return out


for f in ["tool_turn.json", "final_turn.json"]:
    evs = json.loads(golden("agentcore", f))
    put("agentcore_eventstream", "described_" + f[:-5], described([(0, e["event"], j(e["payload"])) for e in evs]))
    raw = b"".join(es_frame([(":message-type", "event"), (":event-type", e["event"]), (":content-type", "application/json")],
                            j(e["payload"]).encode()) for e in evs)
    put("agentcore_eventstream", "raw_" + f[:-5], b"\x00" + raw)
put("agentcore_eventstream", "exception", described([
    (0, "messageStart", j({"role": "assistant"})), (3, "contentBlockDelta", j({"delta": {"text": "x"}})),
    (1, "throttlingException", j({"message": "slow down"})), (2, "InternalFailure", "it broke"), (4, "", "\x00\x00\x00\x10")]))

runtime = "".join("data: " + j(e) + "\n\n" for e in [
    {"type": "text", "text": "Hello "}, {"type": "text_delta", "text": "w\u00f6rld"},
    {"type": "tool_use", "id": "tu_1", "name": "lookup", "input": {"q": "x"}},
    {"type": "usage", "usage": {"inputTokens": 3, "outputTokens": 4}}, {"type": "stop", "stop_reason": "tool_use"}])
put("agentcore_runtime", "events", runtime)
put("agentcore_runtime", "converse_crlf", "".join("data: " + j({e["event"]: e["payload"]}) + "\r\n\r\n"
                                                  for e in json.loads(golden("agentcore", "final_turn.json"))))
put("agentcore_runtime", "whole_reply", j({"result": "done", "tool_uses": [{"toolUseId": "t", "name": "n", "input": "{\"a\":1}"}],
                                           "stop_reason": "tool_use"}))
put("agentcore_runtime", "plain_text", "data: just text\ndata: two lines\n\n")

# --- ACP ----------------------------------------------------------------------------------------

S = "fuzz-session"
ROOT = "/tmp/tether-fuzz-acp"


def rpc(**kw):
    return j(dict({"jsonrpc": "2.0"}, **kw))


def update(kind, text, **extra):
    u = {"sessionUpdate": kind, "content": {"type": "text", "text": text}}
    u.update(extra)
    return rpc(method="session/update", params={"sessionId": S, "update": u})


lines = [
    update("agent_message_chunk", "hi"),
    update("agent_thought_chunk", "hmm"),
    update("user_message_chunk", "q", messageId="m1"),
    rpc(method="session/update", params={"update": {"content": {"text": "a\"b\\n\u00e9", "type": "text"},
                                                    "sessionUpdate": "agent_message_chunk"}, "sessionId": S, "_meta": {"a": 1}}),
    rpc(method="session/update", params={"sessionId": S, "update": {"sessionUpdate": "tool_call", "toolCallId": "c1", "title": "t"}}),
    rpc(method="session/update", params={"sessionId": S, "update": {"sessionUpdate": "agent_message_chunk",
                                                                    "content": {"type": "text", "text": "k", "annotations": {"priority": 1}}}}),
    rpc(method="session/update", params={"sessionId": "other", "update": {"sessionUpdate": "agent_message_chunk",
                                                                          "content": {"type": "text", "text": "dropped"}}}),
]
put("acp_frames", "updates", "\n".join(lines))
put("acp_frames", "spaced", ' { "jsonrpc" : "2.0" , "method" : "session/update" , "params" : { "sessionId" : "s1" , "update" : '
                            '{ "sessionUpdate" : "agent_message_chunk" , "content" : { "type" : "text" , "text" : "x y" } } } } \t')
put("acp_connection", "updates", "\n".join(lines) + "\n")
put("acp_connection", "requests", "\n".join([
    rpc(id=1, method="fs/read_text_file", params={"sessionId": S, "path": ROOT + "/a.txt"}),
    rpc(id=2, method="fs/read_text_file", params={"sessionId": S, "path": ROOT + "/../etc/passwd"}),
    rpc(id=3, method="fs/write_text_file", params={"sessionId": S, "path": ROOT + "/sub/new.txt", "content": "x"}),
    rpc(id="s", method="session/request_permission", params={"sessionId": S, "toolCall": {"toolCallId": "c1"},
        "options": [{"optionId": "allow", "name": "Allow", "kind": "allow_once"}]}),
    rpc(id=4, method="terminal/create", params={"sessionId": S, "command": "ls", "cwd": ROOT + "/sub"}),
    rpc(id=5, method="terminal/output", params={"sessionId": S, "terminalId": "t1"}),
    rpc(id=6, method="elicitation/create", params={"sessionId": S, "mode": "form", "message": "name?",
                                                   "requestedSchema": {"type": "object", "properties": {}}}),
    rpc(id=7, method="_ext/thing", params={"a": 1}),
    rpc(id=8, method="unknown/method", params={}),
    rpc(method="$/cancel_request", params={"requestId": 1}),
    rpc(id=9, result={"ok": True}),
    rpc(id=10, error={"code": -32000, "message": "x"}),
    '{"jsonrpc":"2.0","id":1,"method":"fs/read_text_file"', "not json", "[1,2]", "\r",
]) + "\n")
put("acp_connection", "oversized", update("agent_message_chunk", "x" * 3000) + "\n" + update("agent_message_chunk", "after") + "\n")

# --- AG-UI --------------------------------------------------------------------------------------

put("agui_input", "minimal", j({"threadId": "t1", "runId": "r1", "messages": []}))
put("agui_input", "full", j({
    "threadId": "t1", "runId": "r2", "parentRunId": "r1", "protocolVersion": "1.0",
    "state": {"count": 1, "items": [1.5, "x", None]},
    "messages": [
        {"id": "s", "role": "system", "content": "be brief"},
        {"id": "u1", "role": "user", "content": "hello"},
        {"id": "u2", "role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image", "source": {"type": "url", "value": "https://x/y.png"}}]},
        {"id": "a1", "role": "assistant", "content": "calling", "toolCalls": [{"id": "tc1", "type": "function", "function": {"name": "get", "arguments": "{\"a\":1}"}}]},
        {"id": "t1m", "role": "tool", "toolCallId": "tc1", "content": "result"},
        {"id": "d1", "role": "developer", "content": "dev note"},
        {"id": "r1", "role": "reasoning", "content": "thinking"},
    ],
    "tools": [{"name": "confirm", "description": "ask the user", "parameters": {"type": "object"}}],
    "context": [{"description": "page", "value": "/home"}],
    "forwardedProps": {"x": True},
    "resume": [{"interruptId": "approval:abc", "status": "resolved", "payload": {"approved": True}},
               {"interruptId": "i2", "status": "cancelled"}],
}))
put("agui_input", "accept", "text/event-stream;q=0.5, application/vnd.ag-ui.event+proto")

# --- Tool arguments -----------------------------------------------------------------------------

for name, args in [("object", '{"path":"a.txt","line":1,"limit":2}'), ("empty", ""), ("blank", " \n"),
                   ("invalid", '{"path":'), ("array", "[1,2]"), ("string", '"x"'), ("null", "null"),
                   ("unicode", '{"q":"\u00e9\U0001f600\\ud83d\\ude00\\n"}'), ("nested", '{"a":{"b":[{"c":null}]}}'),
                   ("number", '{"n":1e400}'), ("trailing", '{"a":1} x'), ("command", '{"command":"echo \\u001b[2J"}')]:
    put("tool_args", name, args)

# --- Workspace tools (first byte: the tool, by index) --------------------------------------------

TOOLS = ["read_file", "list_dir", "search_files", "write_file", "edit_file", "run_command", "no_such_tool"]
for name, tool, args in [
    ("read", "read_file", {"path": "a.txt"}), ("read_lines", "read_file", {"path": "a.txt", "line": 2, "limit": 1}),
    ("read_huge_line", "read_file", {"path": "a.txt", "line": 4294967297, "limit": 18446744073709551615}),
    ("read_escape", "read_file", {"path": "escape/secret.txt"}), ("read_link", "read_file", {"path": "secret-link"}),
    ("read_dotdot", "read_file", {"path": "../outside/secret.txt"}), ("read_abs", "read_file", {"path": "/etc/hostname"}),
    ("list", "list_dir", {}), ("list_escape", "list_dir", {"path": "escape"}), ("list_sub", "list_dir", {"path": "./sub/../sub"}),
    ("search", "search_files", {"pattern": "a"}), ("search_secret", "search_files", {"pattern": "TETHER", "path": "."}),
    ("write", "write_file", {"path": "new.txt", "content": "x"}),
    ("edit", "edit_file", {"path": "a.txt", "old_string": "beta", "new_string": "b", "replace_all": True}),
    ("command", "run_command", {"command": "cat escape/secret.txt"}), ("unknown", "no_such_tool", {}),
    ("wrong_types", "read_file", {"path": 5, "line": "x"}),
]:
    put("workspace_tools", name, bytes([TOOLS.index(tool)]) + j(args).encode())
