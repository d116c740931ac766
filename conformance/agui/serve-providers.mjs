// tether serve hosting other providers than its own OpenAI-compatible loop, judged by the
// official AG-UI client (@ag-ui/client@1.0.0, HttpAgent.runAgent) with zero console warnings:
//
// - `acp`: the @agentclientprotocol/sdk example agent (a real subprocess) served by tether serve;
//   its mid-turn permission request ends the run with an approval interrupt whose id is random
//   (not `{thread}-permission-{n}`); a forged id and a reused one are refused at admission (409)
//   before RUN_STARTED; the approval from the client resumes the held turn, which finishes.
// - `anthropic`: the local loop over the Anthropic Messages API against the testkit fake
//   (`--example fake_anthropic`); a `write_file` call under `writes = "ask"` is an interrupt;
//   approved from the client it runs once and the turn finishes; after a restart of the server the
//   thread continues with a follow-up message.
// - `managed`: Claude Managed Agents against the testkit fake (`--example fake_managed`): the
//   remote loop's `write_file` custom tool use is an approval interrupt (an altered id is refused),
//   approved it runs once; after a restart the thread reattaches to its remote session.
// - `agentcore`: Bedrock AgentCore's runtime against the testkit fake (`--example
//   fake_agentcore`): the same approval, run once, and a follow-up after a restart in the same
//   runtime session.
// - After the restart, the ACP example agent (no `loadSession`) gives RUN_ERROR CANNOT_RESUME
//   and its thread's record is intact; every thread's record has no gap and no duplicate.
//
//   node serve-providers.mjs     (after `cargo build -p tether-serve --bin tether-serve
//                                  --example fake_anthropic`; run.sh does that)
//
// Prints one line per check, then "N passed, N failed"; exits non-zero on any failure.

import { readFileSync, existsSync, mkdirSync } from "node:fs";
import { join, resolve } from "node:path";
import { HttpAgent } from "@ag-ui/client";
import { check, summary, watchdog, tempDir, spawnUntil, startServe, stop } from "../serve/lib.mjs";

const root = resolve(new URL("../..", import.meta.url).pathname);
const FAKE_ANTHROPIC = process.env.FAKE_ANTHROPIC_BIN || join(root, "target/debug/examples/fake_anthropic");
const FAKE_MANAGED = process.env.FAKE_MANAGED_BIN || join(root, "target/debug/examples/fake_managed");
const FAKE_AGENTCORE = process.env.FAKE_AGENTCORE_BIN || join(root, "target/debug/examples/fake_agentcore");
const ACP_AGENT = join(root, "conformance/acp/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js");

let warnings = [];
const fmt = (a) => a.map((x) => (x instanceof Error ? x.stack : typeof x === "string" ? x : JSON.stringify(x))).join(" ");
console.warn = (...a) => warnings.push("console.warn: " + fmt(a));
console.error = (...a) => warnings.push("console.error: " + fmt(a));

let at = "start";
watchdog(300000, () => at);

const user = (id, content) => ({ id, role: "user", content });

async function run(agent, params = {}) {
  const events = [];
  let failure = null;
  try {
    await agent.runAgent({ runId: `run-${Math.random().toString(16).slice(2)}`, ...params }, { onEvent: ({ event }) => events.push(event) });
  } catch (e) {
    failure = String(e?.stack ?? e);
  }
  return { events, failure, last: events.at(-1) };
}

async function post(base, agent, body) {
  const r = await fetch(`${base}/v1/agents/${agent}/run`, {
    method: "POST",
    headers: { "content-type": "application/json", accept: "text/event-stream" },
    body: JSON.stringify(body),
    signal: AbortSignal.timeout(60000),
  });
  return { status: r.status, text: await r.text() };
}

// A thread's record: sequence numbers 1..n without a gap, every event id once.
function wholeRecord(events) {
  if (!Array.isArray(events) || events.length === 0) return false;
  const ids = new Set(events.map((e) => e.id));
  return ids.size === events.length && events.every((e, i) => e.seq === i + 1);
}

const approve = (interrupts) => interrupts.map((i) => ({ interruptId: i.id, status: "resolved", payload: { approved: true } }));

if (!existsSync(ACP_AGENT)) {
  check("the ACP example agent is installed (conformance/acp/setup.sh)", false, ACP_AGENT);
  process.exit(summary());
}

const dir = tempDir("tether-providers-");
const ws = join(dir, "ws");
mkdirSync(ws);
at = "starting the fake Anthropic API";
const [fake, fm] = await spawnUntil(FAKE_ANTHROPIC, [], /listening on (http:\/\/\S+)/);
const origin = fm[1];
at = "starting the fake Managed Agents API";
const [fakeManaged, mm] = await spawnUntil(FAKE_MANAGED, [], /listening on (http:\/\/\S+)/);
at = "starting the fake AgentCore data plane";
const [fakeCore, cm] = await spawnUntil(FAKE_AGENTCORE, [], /listening on (http:\/\/\S+)/);
// The fake checks that requests are SigV4-signed, not by whom.
process.env.AWS_ACCESS_KEY_ID = "AKIDFAKE";
process.env.AWS_SECRET_ACCESS_KEY = "fake-secret";
process.env.AWS_SESSION_TOKEN = "";
process.env.FAKE_ANTHROPIC_KEY = "sk-fake";
const config = `
[agents.gemini]
provider = "acp"
description = "the ACP SDK example agent"
command = ["node", ${JSON.stringify(ACP_AGENT)}]
[agents.gemini.workspace]
root = "ws"

[agents.claude]
provider = "anthropic"
base_url = "${origin}"
api_key_env = "FAKE_ANTHROPIC_KEY"
model = "fake-claude"
[agents.claude.workspace]
root = "ws"
writes = "ask"

[agents.managed]
provider = "managed"
base_url = "${mm[1]}"
api_key_env = "FAKE_ANTHROPIC_KEY"
agent_id = "agent_fake"
environment_id = "env_fake"
[agents.managed.workspace]
root = "ws"
writes = "ask"

[agents.core]
provider = "agentcore"
base_url = "${cm[1]}"
runtime_arn = "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/agent-fake"
region = "us-east-1"
[agents.core.workspace]
root = "ws"
writes = "ask"
`;
const db = join(dir, "tether.db");
at = "starting tether serve";
let serve = await startServe({ dir, config, db });
let base = serve.url;

try {
  // ---- ACP ----
  at = "acp: first run";
  warnings = [];
  const acp = new HttpAgent({ url: `${base}/v1/agents/gemini/run`, threadId: "acp-thread-1", initialMessages: [user("u1", "Improve the project config.")] });
  const first = await run(acp);
  const ints = first.last?.outcome?.interrupts ?? [];
  check("acp: the run streams to @ag-ui/client and ends in RUN_FINISHED", !first.failure && first.last?.type === "RUN_FINISHED", first.failure ?? JSON.stringify(first.last));
  check(
    "acp: the agent's permission request is an approval interrupt",
    first.last?.outcome?.type === "interrupt" && ints.length === 1,
    JSON.stringify(first.last),
  );
  check(
    "acp: the interrupt id is random, not {thread}-permission-{n}",
    ints.length === 1 && !/permission-\d+$/.test(ints[0].id) && ints[0].id.length >= 20,
    JSON.stringify(ints),
  );
  check(
    "acp: the text before the question reached the client",
    acp.messages.some((m) => m.role === "assistant" && String(m.content ?? "").includes("I'll help you with that")),
    JSON.stringify(acp.messages),
  );
  at = "acp: forged resume";
  const forged = await post(base, "gemini", {
    threadId: "acp-thread-1",
    runId: "forged",
    messages: [],
    tools: [],
    context: [],
    state: null,
    forwardedProps: {},
    resume: [{ interruptId: "approval-guessed-0000", status: "resolved", payload: { approved: true } }],
  });
  check("acp: a resume naming an interrupt never issued is refused before RUN_STARTED (409)", forged.status === 409 && !forged.text.includes("RUN_STARTED"), `${forged.status} ${forged.text.slice(0, 300)}`);
  at = "acp: approved resume";
  const second = await run(acp, { resume: approve(ints) });
  check("acp: the approved resume finishes the turn (RUN_FINISHED success)", !second.failure && second.last?.type === "RUN_FINISHED" && second.last?.outcome?.type !== "interrupt", second.failure ?? JSON.stringify(second.last));
  check(
    "acp: the agent went on with the allowing option",
    acp.messages.some((m) => m.role === "assistant" && String(m.content ?? "").includes("successfully updated the configuration")),
    JSON.stringify(acp.messages.map((m) => [m.role, m.content])),
  );
  at = "acp: reused resume";
  const reused = await post(base, "gemini", {
    threadId: "acp-thread-1",
    runId: "reused",
    messages: [],
    tools: [],
    context: [],
    state: null,
    forwardedProps: {},
    resume: approve(ints),
  });
  check("acp: the same interrupt id used again is refused (409)", reused.status === 409, `${reused.status} ${reused.text.slice(0, 300)}`);
  at = "acp: follow-up";
  acp.addMessage(user("u2", "And once more."));
  const third = await run(acp);
  check("acp: a follow-up message continues the thread (a new turn asks again)", !third.failure && third.last?.outcome?.type === "interrupt", third.failure ?? JSON.stringify(third.last));
  check("acp: @ag-ui/client made no warnings", warnings.length === 0, warnings.join("\n"));

  // ---- Anthropic ----
  at = "anthropic: first run";
  warnings = [];
  const claude = new HttpAgent({ url: `${base}/v1/agents/claude/run`, threadId: "claude-thread-1", initialMessages: [user("c1", "Please write a file.")] });
  const a1 = await run(claude);
  const aints = a1.last?.outcome?.interrupts ?? [];
  check("anthropic: write_file under writes=ask is an approval interrupt", !a1.failure && a1.last?.outcome?.type === "interrupt" && aints.length === 1, a1.failure ?? JSON.stringify(a1.last));
  check("anthropic: nothing was written before the approval", !existsSync(join(ws, "hello.txt")));
  at = "anthropic: approved resume";
  const a2 = await run(claude, { resume: approve(aints) });
  check("anthropic: the approved call runs and the turn finishes", !a2.failure && a2.last?.type === "RUN_FINISHED" && a2.last?.outcome?.type !== "interrupt", a2.failure ?? JSON.stringify(a2.last));
  check("anthropic: the file was written once", existsSync(join(ws, "hello.txt")) && readFileSync(join(ws, "hello.txt"), "utf8") === "hello from claude\n");
  check(
    "anthropic: the model's answer after the tool result reached the client",
    claude.messages.some((m) => m.role === "assistant" && String(m.content ?? "").startsWith("Done: the tool said")),
    JSON.stringify(claude.messages.map((m) => [m.role, m.content])),
  );
  // ---- Managed Agents ----
  at = "managed: first run";
  warnings = [];
  const managed = new HttpAgent({ url: `${base}/v1/agents/managed/run`, threadId: "managed-thread-1", initialMessages: [user("m1", "Write managed.txt.")] });
  const m1 = await run(managed);
  const mints = m1.last?.outcome?.interrupts ?? [];
  check("managed: the remote loop's write_file under writes=ask is an approval interrupt", !m1.failure && m1.last?.outcome?.type === "interrupt" && mints.length === 1, m1.failure ?? JSON.stringify(m1.last));
  check("managed: nothing was written before the approval", !existsSync(join(ws, "managed.txt")));
  at = "managed: denied-by-forgery resume";
  const mforged = await post(base, "managed", {
    threadId: "managed-thread-1", runId: "forged", messages: [], tools: [], context: [], state: null, forwardedProps: {},
    resume: [{ interruptId: mints[0]?.id + "x", status: "resolved", payload: { approved: true } }],
  });
  check("managed: an altered interrupt id is refused before RUN_STARTED (409)", mforged.status === 409, `${mforged.status} ${mforged.text.slice(0, 300)}`);
  at = "managed: approved resume";
  const m2 = await run(managed, { resume: approve(mints) });
  check("managed: the approved call runs and the remote turn finishes", !m2.failure && m2.last?.type === "RUN_FINISHED" && m2.last?.outcome?.type !== "interrupt", m2.failure ?? JSON.stringify(m2.last));
  check("managed: the file was written once", existsSync(join(ws, "managed.txt")) && readFileSync(join(ws, "managed.txt"), "utf8") === "hello from managed agents\n");
  check(
    "managed: the agent's answer after the tool result reached the client",
    managed.messages.some((m) => m.role === "assistant" && String(m.content ?? "").includes("Wrote managed.txt.")),
    JSON.stringify(managed.messages.map((m) => [m.role, m.content])),
  );
  check("managed: @ag-ui/client made no warnings", warnings.length === 0, warnings.join("\n"));

  // ---- AgentCore ----
  at = "agentcore: first run";
  warnings = [];
  const core = new HttpAgent({ url: `${base}/v1/agents/core/run`, threadId: "core-thread-1", initialMessages: [user("k1", "Write agentcore.txt.")] });
  const k1 = await run(core);
  const kints = k1.last?.outcome?.interrupts ?? [];
  check("agentcore: the runtime's write_file under writes=ask is an approval interrupt", !k1.failure && k1.last?.outcome?.type === "interrupt" && kints.length === 1, k1.failure ?? JSON.stringify(k1.last));
  check("agentcore: nothing was written before the approval", !existsSync(join(ws, "agentcore.txt")));
  at = "agentcore: approved resume";
  const k2 = await run(core, { resume: approve(kints) });
  check("agentcore: the approved call runs and the runtime's turn finishes", !k2.failure && k2.last?.type === "RUN_FINISHED" && k2.last?.outcome?.type !== "interrupt", k2.failure ?? JSON.stringify(k2.last));
  check("agentcore: the file was written once", existsSync(join(ws, "agentcore.txt")) && readFileSync(join(ws, "agentcore.txt"), "utf8") === "hello from agentcore\n");
  check(
    "agentcore: the runtime's answer after the tool result reached the client",
    core.messages.some((m) => m.role === "assistant" && String(m.content ?? "").includes("Wrote agentcore.txt.")),
    JSON.stringify(core.messages.map((m) => [m.role, m.content])),
  );
  check("agentcore: @ag-ui/client made no warnings", warnings.length === 0, warnings.join("\n"));

  at = "restart";
  const acpBefore = await (await fetch(`${base}/v1/threads/acp-thread-1/events`)).json();
  await stop(serve.child);
  serve = await startServe({ dir, config, db });
  base = serve.url;

  at = "acp: after a restart";
  warnings = [];
  const acpAgain = new HttpAgent({ url: `${base}/v1/agents/gemini/run`, threadId: "acp-thread-1", initialMessages: acp.messages });
  acpAgain.addMessage(user("u3", "Still there?"));
  const r4 = await run(acpAgain);
  check(
    "acp: resuming an agent without loadSession after a restart is RUN_ERROR CANNOT_RESUME",
    r4.last?.type === "RUN_ERROR" && r4.last?.code === "CANNOT_RESUME" && /cannot resume a session/.test(r4.last?.message ?? ""),
    JSON.stringify(r4.last),
  );
  const acpAfter = await (await fetch(`${base}/v1/threads/acp-thread-1/events`)).json();
  const key = (e) => JSON.stringify(e);
  check(
    "acp: nothing was lost from the thread's record",
    acpBefore.events.length > 0 && acpBefore.events.every((e, i) => key(e) === key(acpAfter.events[i])),
    `${acpBefore.events?.length} before, ${acpAfter.events?.length} after`,
  );
  check("acp: the thread's record has no gap and no duplicate", wholeRecord(acpAfter.events), JSON.stringify(acpAfter.events?.map((e) => [e.seq, e.id])));
  check("acp: @ag-ui/client made no warnings after the restart", warnings.length === 0, warnings.join("\n"));

  at = "managed: after a restart";
  warnings = [];
  const mAgain = new HttpAgent({ url: `${base}/v1/agents/managed/run`, threadId: "managed-thread-1", initialMessages: managed.messages });
  mAgain.addMessage(user("m2", "Anything else?"));
  const m3 = await run(mAgain);
  check("managed: after a restart of the server the thread reattaches and continues", !m3.failure && m3.last?.type === "RUN_FINISHED", m3.failure ?? JSON.stringify(m3.last));
  check(
    "managed: the follow-up was answered by the same remote session",
    mAgain.messages.some((m) => m.role === "assistant" && String(m.content ?? "").includes("Follow-up answer 1.")),
    JSON.stringify(mAgain.messages.map((m) => [m.role, m.content])),
  );
  const mev = await (await fetch(`${base}/v1/threads/managed-thread-1/events`)).json();
  check("managed: the thread's record has no gap and no duplicate", wholeRecord(mev.events), JSON.stringify(mev.events.map((e) => [e.seq, e.id])));
  check("managed: @ag-ui/client made no warnings after the restart", warnings.length === 0, warnings.join("\n"));

  at = "agentcore: after a restart";
  warnings = [];
  const kAgain = new HttpAgent({ url: `${base}/v1/agents/core/run`, threadId: "core-thread-1", initialMessages: core.messages });
  kAgain.addMessage(user("k2", "Anything else?"));
  const k3 = await run(kAgain);
  check("agentcore: after a restart of the server the thread resumes its runtime session and continues", !k3.failure && k3.last?.type === "RUN_FINISHED", k3.failure ?? JSON.stringify(k3.last));
  check(
    "agentcore: the follow-up was answered",
    kAgain.messages.some((m) => m.role === "assistant" && String(m.content ?? "").includes("Follow-up answer 1.")),
    JSON.stringify(kAgain.messages.map((m) => [m.role, m.content])),
  );
  const kev = await (await fetch(`${base}/v1/threads/core-thread-1/events`)).json();
  check("agentcore: the thread's record has no gap and no duplicate", wholeRecord(kev.events), JSON.stringify(kev.events?.map((e) => [e.seq, e.id])));
  check("agentcore: @ag-ui/client made no warnings after the restart", warnings.length === 0, warnings.join("\n"));

  at = "anthropic: after a restart";
  warnings = [];
  const again = new HttpAgent({ url: `${base}/v1/agents/claude/run`, threadId: "claude-thread-1", initialMessages: claude.messages });
  again.addMessage(user("c2", "Thanks, bye."));
  const a3 = await run(again);
  check("anthropic: after a restart of the server the thread continues with a follow-up", !a3.failure && a3.last?.type === "RUN_FINISHED", a3.failure ?? JSON.stringify(a3.last));
  check(
    "anthropic: the follow-up was answered",
    again.messages.some((m) => m.role === "assistant" && String(m.content ?? "").includes("You said: Thanks, bye.")),
    JSON.stringify(again.messages.map((m) => [m.role, m.content])),
  );
  const aev = await (await fetch(`${base}/v1/threads/claude-thread-1/events`)).json();
  const amsg = await (await fetch(`${base}/v1/threads/claude-thread-1/messages`)).json();
  const shown = (amsg.messages ?? []).map((m) => [m.role, m.content ?? null]);
  check(
    "anthropic: the reopened thread (GET /v1/threads/{id}/messages) shows the user's messages and the answers",
    shown.some(([r, c]) => r === "user" && c === "Please write a file.") &&
      shown.some(([r, c]) => r === "user" && c === "Thanks, bye.") &&
      shown.some(([r, c]) => r === "assistant" && String(c).includes("You said: Thanks, bye.")) &&
      (amsg.messages ?? []).some((m) => m.role === "tool"),
    JSON.stringify(shown),
  );
  check("anthropic: the thread's record has no gap and no duplicate", wholeRecord(aev.events), JSON.stringify(aev.events?.map((e) => [e.seq, e.id])));
  check("anthropic: @ag-ui/client made no warnings after the restart", warnings.length === 0, warnings.join("\n"));
} catch (e) {
  check(`no exception (at ${at})`, false, String(e?.stack ?? e));
} finally {
  await stop(serve.child);
  await stop(fake);
  await stop(fakeManaged);
  await stop(fakeCore);
}
process.exit(summary());
