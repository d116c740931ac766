// AG-UI conformance: runs the official client (@ag-ui/client@1.0.0, HttpAgent.runAgent) against
// tether-agui's conformance server for every scenario, over SSE and over protobuf.
//
//   node run-scenarios.mjs http://127.0.0.1:PORT
//
// A scenario passes only if: runAgent() resolves for every step; the client made zero
// console.warn / console.error calls; each step's last event is RUN_FINISHED (or RUN_ERROR where
// expected); the client's reconstructed messages and state equal the expected ones; and every
// event's protobuf frame is byte-identical to @ag-ui/proto@1.0.0's encode(). Prints one line per
// scenario and variant, then "N passed, N failed"; exits non-zero on any failure.

import { isDeepStrictEqual } from "node:util";
import { HttpAgent } from "@ag-ui/client";
import { encode, decode } from "@ag-ui/proto";

const PROTO = "application/vnd.ag-ui.event+proto";
const base = process.argv[2];
if (!base) {
  process.stderr.write("usage: node run-scenarios.mjs http://127.0.0.1:PORT\n");
  process.exit(2);
}
const only = process.argv[3];

// Every client warning or error fails the scenario that was running.
const out = (s) => process.stdout.write(s + "\n");
let warnings = [];
const fmt = (a) => a.map((x) => (x instanceof Error ? x.stack : typeof x === "string" ? x : JSON.stringify(x))).join(" ");
console.warn = (...a) => warnings.push("console.warn: " + fmt(a));
console.error = (...a) => warnings.push("console.error: " + fmt(a));

const user = (id, content) => ({ id, role: "user", content });

// What the comparison looks at: roles, text, tool calls, tool results (ids of the fake model's
// calls are fixed; message ids are the session's and vary).
function project(messages) {
  return messages.map((m) => {
    const o = { role: m.role };
    if (typeof m.content === "string" && m.content !== "") o.content = m.content;
    if (m.toolCalls?.length) o.toolCalls = m.toolCalls.map((c) => ({ id: c.id, name: c.function.name, arguments: c.function.arguments }));
    if (m.toolCallId) o.toolCallId = m.toolCallId;
    return o;
  });
}

const lastType = (events) => events.at(-1)?.type;
const types = (events) => events.map((e) => e.type);

const SCENARIOS = {
  text: {
    messages: [user("u1", "Hi!")],
    steps: [{}],
    expect: {
      messages: [
        { role: "user", content: "Hi!" },
        { role: "assistant", content: "Hello from tether! How can I help?" },
      ],
    },
    check: ({ steps }) => {
      const fin = steps[0].events.at(-1);
      return isDeepStrictEqual(fin.usage?.[0]?.inputTokens, 12) ? null : `usage not reported: ${JSON.stringify(fin)}`;
    },
  },
  reasoning: {
    messages: [user("u1", "What is 2 + 2?")],
    steps: [{}],
    expect: {
      messages: [
        { role: "user", content: "What is 2 + 2?" },
        { role: "reasoning", content: "The user asks for 2 + 2. That is 4." },
        { role: "assistant", content: "2 + 2 = 4." },
      ],
    },
    check: ({ steps }) => (types(steps[0].events).includes("REASONING_MESSAGE_CONTENT") ? null : "no reasoning streamed"),
  },
  tool: {
    messages: [user("u1", "Add 2 and 3.")],
    steps: [{}],
    expect: {
      messages: [
        { role: "user", content: "Add 2 and 3." },
        { role: "assistant", content: "Let me add those.", toolCalls: [{ id: "call_add", name: "add", arguments: '{"a":2,"b":3}' }] },
        { role: "tool", content: "5", toolCallId: "call_add" },
        { role: "assistant", content: "2 + 3 = 5." },
      ],
    },
  },
  parallel: {
    messages: [user("u1", "Add 1+2 and 10+20.")],
    steps: [{}],
    expect: {
      messages: [
        { role: "user", content: "Add 1+2 and 10+20." },
        {
          role: "assistant",
          toolCalls: [
            { id: "call_a", name: "add", arguments: '{"a":1,"b":2}' },
            { id: "call_b", name: "add", arguments: '{"a":10,"b":20}' },
          ],
        },
        { role: "tool", content: "3", toolCallId: "call_a" },
        { role: "tool", content: "30", toolCallId: "call_b" },
        { role: "assistant", content: "The sums are 3 and 30." },
      ],
      sortTools: true,
    },
    check: ({ steps }) => {
      // The provider streamed the two calls interleaved; the stream must show it.
      const t = steps[0].events.filter((e) => e.type.startsWith("TOOL_CALL_")).map((e) => `${e.type}:${e.toolCallId}`);
      const firstEnd = t.findIndex((x) => x.startsWith("TOOL_CALL_END"));
      const starts = t.slice(0, firstEnd).filter((x) => x.startsWith("TOOL_CALL_START")).length;
      return starts === 2 ? null : `calls were not interleaved: ${t.join(", ")}`;
    },
  },
  frontend: {
    messages: [user("u1", "Deploy the site.")],
    steps: [
      {
        params: { tools: [{ name: "confirm", description: "Ask the user to confirm", parameters: { type: "object", properties: { question: { type: "string" } } } }] },
        check: (events) => {
          const fin = events.at(-1);
          const ok = fin.type === "RUN_FINISHED" && fin.outcome?.type === "success" && isDeepStrictEqual(fin.outcome.pendingToolCallIds, ["call_confirm"]);
          return ok ? null : `expected pendingToolCallIds [call_confirm], got ${JSON.stringify(fin)}`;
        },
      },
      {
        before: (agent) => agent.addMessage({ id: "tool-1", role: "tool", toolCallId: "call_confirm", content: "yes" }),
        params: { tools: [{ name: "confirm", description: "Ask the user to confirm", parameters: { type: "object", properties: { question: { type: "string" } } } }] },
      },
    ],
    expect: {
      messages: [
        { role: "user", content: "Deploy the site." },
        { role: "assistant", toolCalls: [{ id: "call_confirm", name: "confirm", arguments: '{"question":"Deploy now?"}' }] },
        { role: "tool", content: "yes", toolCallId: "call_confirm" },
        { role: "assistant", content: "Deploying, as you confirmed." },
      ],
    },
  },
  state: {
    messages: [user("u1", "Plan the release.")],
    initialState: { title: "Release board for tether 1.0", owner: "release-team", tasks: [] },
    steps: [{}],
    expect: {
      state: { title: "Release board for tether 1.0", owner: "release-team", tasks: ["write the release notes", "tag v1.0"] },
      messages: [
        { role: "user", content: "Plan the release." },
        { role: "assistant", toolCalls: [{ id: "call_t1", name: "add_task", arguments: '{"title":"write the release notes"}' }] },
        { role: "tool", content: '{"added":"write the release notes"}', toolCallId: "call_t1" },
        { role: "assistant", toolCalls: [{ id: "call_t2", name: "add_task", arguments: '{"title":"tag v1.0"}' }] },
        { role: "tool", content: '{"added":"tag v1.0"}', toolCallId: "call_t2" },
        { role: "assistant", content: "Added both tasks." },
      ],
    },
    check: ({ steps }) => {
      const t = types(steps[0].events).filter((x) => x.startsWith("STATE_"));
      return t[0] === "STATE_SNAPSHOT" && t.slice(1).length >= 1 && t.slice(1).every((x) => x === "STATE_DELTA")
        ? null
        : `expected one STATE_SNAPSHOT then STATE_DELTAs, got ${t.join(", ")}`;
    },
  },
  interrupt: {
    messages: [user("u1", "Delete notes.txt.")],
    steps: [
      {
        check: (events) => {
          const fin = events.at(-1);
          return fin.outcome?.type === "interrupt" && fin.outcome.interrupts?.[0]?.toolCallId === "call_del"
            ? null
            : `expected an interrupt for call_del, got ${JSON.stringify(fin)}`;
        },
      },
      {
        params: (prev) => ({
          resume: prev.events.at(-1).outcome.interrupts.map((i) => ({ interruptId: i.id, status: "resolved", payload: { approved: true } })),
        }),
      },
    ],
    expect: {
      messages: [
        { role: "user", content: "Delete notes.txt." },
        { role: "assistant", toolCalls: [{ id: "call_del", name: "delete_file", arguments: '{"path":"notes.txt"}' }] },
        { role: "tool", content: "deleted notes.txt", toolCallId: "call_del" },
        { role: "assistant", content: "Deleted notes.txt." },
      ],
    },
  },
  error: {
    messages: [user("u1", "Hello?")],
    steps: [{ terminal: "RUN_ERROR" }],
    expect: { messages: [{ role: "user", content: "Hello?" }] },
    check: ({ steps }) => {
      const e = steps[0].events.at(-1);
      return e.code && e.message.includes("does not exist") ? null : `RUN_ERROR lacks code/message: ${JSON.stringify(e)}`;
    },
  },
  "two-runs": {
    messages: [user("u1", "First question?")],
    steps: [{}, { before: (agent) => agent.addMessage(user("u2", "And again?")) }],
    expect: {
      messages: [
        { role: "user", content: "First question?" },
        { role: "assistant", content: "First answer." },
        { role: "user", content: "And again?" },
        { role: "assistant", content: "Second answer." },
      ],
    },
  },
  // A retried model call is seen once: one assistant message, ending with the text the record
  // keeps (tether's sink holds back what the retry repeats; what it changed is withdrawn with a
  // MESSAGES_SNAPSHOT, which the client applies).
  flaky: {
    messages: [user("u1", "Are you there?")],
    steps: [{}],
    expect: {
      messages: [
        { role: "user", content: "Are you there?" },
        { role: "assistant", content: "Recovered after a 503." },
      ],
    },
    check: ({ steps }) => {
      const ev = steps[0].events;
      const retry = ev.find((e) => e.type === "CUSTOM" && e.name === "tether.retry");
      return retry ? onceStreamed(ev, "Recovered after a 503.") : "no tether.retry event";
    },
  },
  dropped: {
    messages: [user("u1", "Tell me.")],
    steps: [{}],
    expect: {
      messages: [
        { role: "user", content: "Tell me." },
        { role: "assistant", content: "partial answer, then the rest of it." },
      ],
    },
    check: ({ steps }) => {
      const ev = steps[0].events;
      const p = partialFirst(ev, "TEXT_MESSAGE_CONTENT");
      if (p) return p;
      if (ev.some((e) => e.type === "MESSAGES_SNAPSHOT")) return "a repeated answer needs no snapshot";
      return onceStreamed(ev, "partial answer, then the rest of it.");
    },
  },
  diverged: {
    messages: [user("u1", "Tell me.")],
    steps: [{}],
    expect: {
      messages: [
        { role: "user", content: "Tell me." },
        { role: "assistant", content: "after drop complete" },
      ],
    },
    check: ({ steps }) => {
      const ev = steps[0].events;
      const p = partialFirst(ev, "TEXT_MESSAGE_CONTENT");
      if (p) return p;
      return ev.some((e) => e.type === "MESSAGES_SNAPSHOT") ? null : "the partial text was not withdrawn";
    },
  },
  "dropped-tool": {
    messages: [user("u1", "Add 2 and 3.")],
    steps: [{}],
    expect: {
      messages: [
        { role: "user", content: "Add 2 and 3." },
        { role: "assistant", content: "Let me add those.", toolCalls: [{ id: "call_add", name: "add", arguments: '{"a":2,"b":3}' }] },
        { role: "tool", content: "5", toolCallId: "call_add" },
        { role: "assistant", content: "2 + 3 = 5." },
      ],
    },
    check: ({ steps }) => {
      const ev = steps[0].events;
      const p = partialFirst(ev, "TOOL_CALL_ARGS");
      if (p) return p;
      const starts = ev.filter((e) => e.type === "TOOL_CALL_START").length;
      return starts === 1 ? null : `${starts} TOOL_CALL_START events for one call`;
    },
  },
};

// The failed attempt showed something (a `type` event) before the retry, or the scenario tests
// nothing.
function partialFirst(events, type) {
  const retry = events.findIndex((e) => e.type === "CUSTOM" && e.name === "tether.retry");
  if (retry < 0) return "the stream was not retried";
  const first = events.findIndex((e) => e.type === type);
  return first >= 0 && first < retry ? null : `no ${type} before the retry: the cut came before anything was shown`;
}

// The answer went out in one text message, each character once.
function onceStreamed(events, text) {
  const starts = events.filter((e) => e.type === "TEXT_MESSAGE_START");
  const shown = events.filter((e) => e.type === "TEXT_MESSAGE_CONTENT").map((e) => e.delta).join("");
  if (starts.length !== 1) return `${starts.length} text messages for one answer`;
  return shown === text ? null : `streamed ${JSON.stringify(shown)}, expected ${JSON.stringify(text)} once`;
}

function splitProto(bytes) {
  const frames = [];
  let i = 0;
  while (i < bytes.length) {
    if (i + 4 > bytes.length) throw new Error("truncated length prefix");
    const len = new DataView(bytes.buffer, bytes.byteOffset + i, 4).getUint32(0, false);
    if (i + 4 + len > bytes.length) throw new Error("truncated frame");
    frames.push(bytes.subarray(i + 4, i + 4 + len));
    i += 4 + len;
  }
  return frames;
}

function parseSse(text) {
  const events = [];
  for (const frame of text.split("\n\n")) {
    const data = frame
      .split("\n")
      .filter((l) => l.startsWith("data:"))
      .map((l) => l.slice(5).replace(/^ /, ""))
      .join("\n");
    if (data) events.push(JSON.parse(data));
  }
  return events;
}

const hex = (b) => Buffer.from(b).toString("hex");

async function protoParity(variant, captured) {
  const problems = [];
  for (const { contentType, bytes } of captured) {
    if (variant === "proto") {
      if (contentType !== PROTO) problems.push(`content-type ${contentType}`);
      for (const frame of splitProto(bytes)) {
        const again = encode(decode(frame));
        if (hex(again) !== hex(frame)) problems.push(`frame differs from @ag-ui/proto re-encoding: ours ${hex(frame)} theirs ${hex(again)}`);
      }
    } else {
      if (!contentType?.startsWith("text/event-stream")) problems.push(`content-type ${contentType}`);
      const events = parseSse(new TextDecoder().decode(bytes));
      const resp = await fetch(`${base}/__proto`, { method: "POST", body: events.map((e) => JSON.stringify(e)).join("\n") });
      const ours = splitProto(new Uint8Array(await resp.arrayBuffer()));
      if (ours.length !== events.length) problems.push(`${ours.length} frames for ${events.length} events`);
      events.forEach((e, i) => {
        const theirs = encode(e);
        if (ours[i] && hex(ours[i]) !== hex(theirs)) problems.push(`${e.type}: ours ${hex(ours[i])} theirs ${hex(theirs)}`);
      });
    }
  }
  return problems;
}

async function runScenario(name, spec, variant) {
  warnings = [];
  const problems = [];
  const captured = [];
  const fetchImpl = async (url, init) => {
    const headers = new Headers(init?.headers);
    if (variant === "proto") headers.set("accept", `${PROTO}, text/event-stream;q=0.5`);
    const resp = await fetch(url, { ...init, headers });
    const copy = resp.clone();
    captured.push(copy.arrayBuffer().then((b) => ({ contentType: resp.headers.get("content-type"), bytes: new Uint8Array(b) })));
    return resp;
  };
  const agent = new HttpAgent({
    url: `${base}/agent/${name}/${variant}`,
    threadId: `thread-${name}-${variant}`,
    initialMessages: structuredClone(spec.messages),
    initialState: spec.initialState ? structuredClone(spec.initialState) : undefined,
    fetch: fetchImpl,
  });
  const steps = [];
  for (const [i, step] of spec.steps.entries()) {
    if (step.before) step.before(agent);
    const params = typeof step.params === "function" ? step.params(steps.at(-1)) : step.params ?? {};
    const events = [];
    let failure = null;
    try {
      await agent.runAgent({ runId: `${name}-${variant}-${i + 1}`, ...params }, { onEvent: ({ event }) => events.push(event) });
    } catch (e) {
      failure = String(e?.stack ?? e);
    }
    steps.push({ events, failure });
    if (failure) problems.push(`step ${i + 1}: runAgent rejected: ${failure}`);
    const want = step.terminal ?? "RUN_FINISHED";
    if (lastType(events) !== want) problems.push(`step ${i + 1}: last event ${lastType(events)}, expected ${want} (${types(events).join(" ")})`);
    const c = step.check?.(events);
    if (c) problems.push(`step ${i + 1}: ${c}`);
  }
  let got = project(agent.messages);
  let want = spec.expect.messages;
  if (spec.expect.sortTools) {
    const key = (m) => (m.role === "tool" ? `tool:${m.toolCallId}` : "");
    const sortRun = (ms) => {
      const out = [...ms];
      out.sort((a, b) => (a.role === "tool" && b.role === "tool" ? key(a).localeCompare(key(b)) : 0));
      return out;
    };
    got = sortRun(got);
    want = sortRun(want);
  }
  if (want && !isDeepStrictEqual(got, want)) problems.push(`messages differ:\n    got  ${JSON.stringify(got)}\n    want ${JSON.stringify(want)}`);
  if (spec.expect.state && !isDeepStrictEqual(agent.state, spec.expect.state))
    problems.push(`state differs:\n    got  ${JSON.stringify(agent.state)}\n    want ${JSON.stringify(spec.expect.state)}`);
  const c = spec.check?.({ steps, agent });
  if (c) problems.push(c);
  try {
    problems.push(...(await protoParity(variant, await Promise.all(captured))));
  } catch (e) {
    problems.push(`protobuf parity: ${e?.stack ?? e}`);
  }
  if (warnings.length) problems.push(...warnings.map((w) => `client ${w}`));
  return { problems, steps };
}

// Self-tests: deliberately broken streams the same criteria must reject (the harness bites).
const sse = (...events) => events.map((e) => `data: ${typeof e === "string" ? e : JSON.stringify(e)}\n\n`).join("");
const RS = { type: "RUN_STARTED", threadId: "t", runId: "r" };
const RF = { type: "RUN_FINISHED", threadId: "t", runId: "r" };
const BROKEN = {
  "content without start": sse(RS, { type: "TEXT_MESSAGE_CONTENT", messageId: "m", delta: "x" }, RF),
  "tool call open at RUN_FINISHED": sse(RS, { type: "TOOL_CALL_START", toolCallId: "c", toolCallName: "f" }, RF),
  "parentMessageId null": sse(RS, { type: "TOOL_CALL_START", toolCallId: "c", toolCallName: "f", parentMessageId: null }, { type: "TOOL_CALL_END", toolCallId: "c" }, RF),
  "unknown field": sse(RS, { ...RF, extra: 1 }),
  "truncated stream": sse(RS, { type: "TEXT_MESSAGE_START", messageId: "m" }),
  "CRLF framing": sse(RS, RF).replaceAll("\n", "\r\n"),
};

async function judge(body) {
  warnings = [];
  const agent = new HttpAgent({
    url: "http://stream.invalid/agent",
    threadId: "t",
    fetch: async () => new Response(body, { headers: { "content-type": "text/event-stream" } }),
  });
  const events = [];
  let failure = null;
  try {
    await agent.runAgent({ runId: "r" }, { onEvent: ({ event }) => events.push(event) });
  } catch (e) {
    failure = String(e);
  }
  return failure || warnings.length || !["RUN_FINISHED", "RUN_ERROR"].includes(lastType(events));
}

let passed = 0;
let failed = 0;
if (!only) {
  for (const [name, body] of Object.entries(BROKEN)) {
    if (await judge(body)) {
      passed++;
      out(`ok - self-test: a stream with ${name} is rejected`);
    } else {
      failed++;
      out(`not ok - self-test: a stream with ${name} was accepted`);
    }
  }
  if (!(await judge(sse(RS, { type: "TEXT_MESSAGE_START", messageId: "m" }, { type: "TEXT_MESSAGE_END", messageId: "m" }, RF)))) {
    passed++;
    out("ok - self-test: a conformant stream is accepted");
  } else {
    failed++;
    out("not ok - self-test: a conformant stream was rejected");
  }
}
for (const [name, spec] of Object.entries(SCENARIOS)) {
  if (only && name !== only) continue;
  for (const variant of ["sse", "proto"]) {
    let result;
    try {
      result = await runScenario(name, spec, variant);
    } catch (e) {
      result = { problems: [`harness error: ${e?.stack ?? e}`], steps: [] };
    }
    if (result.problems.length === 0) {
      passed++;
      out(`ok - ${name} (${variant})`);
    } else {
      failed++;
      out(`not ok - ${name} (${variant})`);
      for (const p of result.problems) out(`    ${p}`);
      if (process.env.AGUI_DEBUG) for (const s of result.steps) out(`    events: ${JSON.stringify(s.events)}`);
    }
  }
}
out(`${passed} passed, ${failed} failed`);
process.exit(failed === 0 && passed > 0 ? 0 : 1);
