// Crash safety (CRASH_PROVIDER=openai, the default; =managed: a Managed Agents agent against the
// testkit fake; =acp: the ACP SDK's example agent, see acpCrash): runs that each call a
// side-effecting tool, with tether serve killed (SIGKILL) at
// a random point of each run, restarted, and the thread resumed. Then every thread's event
// record must have no gap and no duplicate, and every tool use must have run exactly once,
// except where a kill fell between the tool's effect and its record: that is the documented
// at-least-once window ($TETHER_TOOL_USE_ID is the idempotency key for it), and each such case
// is detected and reported by id. Any other second run fails the check.
//
// How a run is counted: the tool appends one line per invocation, with no dedupe:
//   <tool-use id> <server that ran it> <nonce of this invocation>
// and prints `ran <nonce>`, so the stored tool result names the invocation it came from. The
// server is named by $TETHER_CRASH_SERVER, which this script sets in each tether serve's
// environment (and commands inherit); not by $PPID, which is 1 when the server was killed
// between starting the command and the shell reading it. For each tool use the check then
// requires: the recorded invocation is the last one in the file; every earlier one ran in a
// server this script SIGKILLed, one per killed server, none in the server that recorded the
// result. Those earlier ones are the window; anything else (two runs in one server life, a run
// after the result was recorded, a run that no server can account for) is a double run.
//
// Before the random kills, a self-test proves the check can see what it is for: a run held by
// the tool until the server is killed (a forced window: reported as the window, not a failure),
// a run whose tool performs its effect twice (an injected double run: flagged), and a plain run.
// `node crash.mjs --inject-double-run` (or CRASH_INJECT=double) also puts a double run into the
// main scenario: the script must then fail (exit 1), naming the tool use.
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { check, runAgui, startFake, startServe, stop, summary, tempDir, watchdog } from "./lib.mjs";

const RUNS = Number(process.env.CRASH_RUNS || 20);
// Which provider's loop the agent runs: `openai` (tether serve's own local loop over the fake
// model, the default) or `managed` (Claude Managed Agents, the testkit fake as a process,
// `--example fake_managed crash`: every session calls append_line once, then confirms).
const PROVIDER = process.env.CRASH_PROVIDER || "openai";
const INJECT_DOUBLE = process.argv.includes("--inject-double-run") || process.env.CRASH_INJECT === "double";
// Passed explicitly: tether serve may generate a token when given none.
const TOKEN = "crash-test-token";
let step = "starting";
watchdog(300000, () => step);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// `[double]` in the line: the effect happens twice for one invocation, exactly what a runtime
// running the call twice in one server life leaves in the file (the injected double run).
// `[hold]` in the line: the first invocation of that tool use, after its effect, waits (at most
// 30 s) until the script has killed the server and releases it: its result is never recorded.
const ACP_AGENT = new URL("../acp/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js", import.meta.url).pathname;
const agentConfig = (fakeUrl, dir) =>
  PROVIDER === "acp"
    ? `
[agents.crash]
provider = "acp"
command = ["node", ${JSON.stringify(ACP_AGENT)}]
[agents.crash.workspace]
root = "${dir}"
`
    : PROVIDER === "managed"
    ? `
[agents.crash]
provider = "managed"
base_url = "${fakeUrl}"
api_key_env = "CRASH_FAKE_KEY"
agent_id = "agent_crash"
environment_id = "env_crash"
max_turns = 4
`
    : `
[agents.crash]
base_url = "${fakeUrl}"
model = "fake"
max_turns = 4
`;
const toolConfig = (fakeUrl, dir) => `${agentConfig(fakeUrl, dir)}
[[agents.crash.commands]]
name = "append_line"
description = "Append a line to the file"
command = '''
nonce="$$-$(date +%s%N)"
server="\${TETHER_CRASH_SERVER:-unknown}"
printf '%s %s %s\\n' "$TETHER_TOOL_USE_ID" "$server" "$nonce" >> invocations.txt
case "$TETHER_ARG_LINE" in *"[double]"*) printf '%s %s %s\\n' "$TETHER_TOOL_USE_ID" "$server" "$nonce-again" >> invocations.txt ;; esac
case "$TETHER_ARG_LINE" in *"[hold]"*)
  if mkdir "held-$TETHER_TOOL_USE_ID" 2>/dev/null; then
    i=0; while [ ! -e "release-$TETHER_TOOL_USE_ID" ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done
  fi ;;
esac
echo "ran $nonce"
'''
cwd = "${dir}"
parameters = { type = "object", properties = { line = { type = "string" } }, required = ["line"] }
`;

/**
 * The tether serve processes of a scenario, each named by the $TETHER_CRASH_SERVER it was
 * started with (s1, s2, ...), and which of them this script SIGKILLed.
 */
class Servers {
  constructor(dir, config) {
    this.dir = dir;
    this.config = config;
    this.db = join(dir, "tether.db");
    this.killed = new Set();
    this.started = new Set();
    this.pids = new Map();
    this.serve = null;
    this.name = null;
  }
  async start() {
    this.name = `s${Servers.count = (Servers.count || 0) + 1}`;
    // Inherited by the server (spawned with this environment) and by its commands.
    process.env.TETHER_CRASH_SERVER = this.name;
    this.serve = await startServe({ dir: this.dir, config: this.config, db: this.db, token: TOKEN });
    this.started.add(this.name);
    this.pids.set(this.name, this.serve.child.pid);
    return this.serve;
  }
  async kill() {
    this.killed.add(this.name);
    await stop(this.serve.child, "SIGKILL");
  }
  /** "s3 (pid 1234)". */
  describe(names) {
    return names.map((n) => `${n} (pid ${this.pids.get(n) ?? "?"})`).join(", ");
  }
  get url() {
    return this.serve.url;
  }
}

async function events(base, thread) {
  const r = await fetch(`${base}/v1/threads/${thread}/events`, {
    headers: { authorization: `Bearer ${TOKEN}` },
    signal: AbortSignal.timeout(30000),
  });
  if (r.status === 404) return [];
  if (!r.ok) throw new Error(`events of ${thread}: HTTP ${r.status}: ${await r.text()}`);
  return (await r.json()).events;
}
function done(evs) {
  if (PROVIDER === "managed") {
    // The remote turn's confirmation, after the tool's result.
    const r = evs.findIndex((e) => e.kind.kind === "tool_result");
    return r >= 0 && evs.slice(r).some((e) => e.kind.kind === "message" && JSON.stringify(e.kind).includes("Appended the line"));
  }
  const responses = evs.filter((e) => e.type === "local.model_response");
  const last = responses[responses.length - 1];
  return !!last && (last.kind.tool_uses || []).length === 0 && evs.some((e) => e.kind.kind === "tool_result");
}
const input = (thread, runId, id, content) => ({
  threadId: thread,
  runId,
  messages: [{ id, role: "user", content }],
  tools: [],
  context: [],
  state: {},
});
/** Resumes a thread until its record shows it finished (bounded). */
async function resume(servers, thread, body, tag) {
  for (let attempt = 1; attempt <= 6 && !done(await events(servers.url, thread)); attempt++) {
    await runAgui(servers.url, "crash", { ...body, runId: `${tag}-${attempt}` }, TOKEN).catch((e) =>
      console.log(`  resume ${thread}: ${e}`),
    );
  }
}

function readInvocations(dir) {
  const file = join(dir, "invocations.txt");
  if (!existsSync(file)) return [];
  return readFileSync(file, "utf8")
    .split("\n")
    .filter(Boolean)
    .map((l) => {
      const [id, server, nonce] = l.split(" ");
      return { id, server, nonce };
    });
}

/**
 * Classifies every tool use from the file and the stored record.
 * recorded: Map tool-use id -> stored result content. killed: Set of SIGKILLed server names.
 * started: Set of every server name. Returns { once, window: [{id, servers}], double: [{id, why}] }.
 */
export function classify(invocations, recorded, killed, started) {
  const out = { once: [], window: [], double: [] };
  const byId = new Map();
  for (const inv of invocations) {
    if (!byId.has(inv.id)) byId.set(inv.id, []);
    byId.get(inv.id).push(inv);
  }
  for (const [id, runs] of byId) {
    if (!recorded.has(id)) out.double.push({ id, why: `ran ${runs.length} time(s) but no thread records its result` });
  }
  for (const [id, content] of recorded) {
    const runs = byId.get(id) || [];
    const nonce = (/ran (\S+)/.exec(content) || [])[1];
    const r = runs.findIndex((x) => x.nonce === nonce);
    const stray = runs.filter((x) => !started.has(x.server));
    if (runs.length === 0) out.double.push({ id, why: "its result is recorded but the tool never ran" });
    else if (r < 0) out.double.push({ id, why: `the recorded result (${JSON.stringify(content)}) is from no invocation in the file` });
    else if (stray.length)
      out.double.push({
        id,
        why: `ran in server(s) ${stray.map((x) => x.server)}, none of this script's (did the command see $TETHER_CRASH_SERVER?)`,
      });
    else if (r !== runs.length - 1) {
      const after = runs.slice(r + 1);
      out.double.push({ id, why: `ran ${runs.length} times: ${after.length} run(s) after the one whose result was recorded (server ${after.map((x) => x.server)})` });
    } else {
      const before = runs.slice(0, r);
      const recorder = runs[r].server;
      const servers = before.map((x) => x.server);
      const bad = before.filter((x) => !killed.has(x.server) || x.server === recorder);
      const repeated = servers.filter((p, k) => servers.indexOf(p) !== k);
      if (bad.length || repeated.length) {
        out.double.push({
          id,
          why: `ran ${runs.length} times: unrecorded run(s) in server(s) ${[...bad.map((x) => x.server), ...repeated]} that ${bad.length ? "were not killed before recording" : "ran it twice in one life"}`,
        });
      } else if (before.length) out.window.push({ id, servers });
      else out.once.push(id);
    }
  }
  return out;
}

/** The stored tool results of a thread: [[tool-use id, content]]. */
function results(evs) {
  return evs.filter((e) => e.kind.kind === "tool_result").map((e) => [e.kind.result.tool_use_id, String(e.kind.result.content)]);
}

/** Waits until `path` exists (the tool is inside its effect), with a generous deadline. */
async function until(path, ms = 60000) {
  const end = Date.now() + ms;
  while (!existsSync(path)) {
    if (Date.now() > end) throw new Error(`${path} never appeared`);
    await sleep(20);
  }
}

/** The self-test: a forced window, an injected double run and a plain run, classified. */
async function selfTest(fake) {
  const dir = tempDir("tether-crash-self-");
  const servers = new Servers(dir, toolConfig(fake.url, dir));
  await servers.start();
  const threads = { hold: "self-hold", double: "self-double", plain: "self-plain" };
  try {
    // The forced window: the effect is in the file, then the server dies before the record.
    step = "self-test: the held run";
    const held = input(threads.hold, "h-0", "uh", "self test line [hold]");
    const pending = runAgui(servers.url, "crash", held, TOKEN).catch(() => null);
    // The file exists from the moment the tool's shell opens it, before its line is written:
    // wait for the line itself.
    await until(join(dir, "invocations.txt"));
    let first;
    for (const end = Date.now() + 60000; !(first = readInvocations(dir)[0])?.nonce; ) {
      if (Date.now() > end) throw new Error("the held run's invocation line never appeared");
      await sleep(20);
    }
    const heldId = first.id;
    await until(join(dir, `held-${heldId}`));
    await servers.kill();
    writeFileSync(join(dir, `release-${heldId}`), "");
    await pending;
    await servers.start();
    step = "self-test: resuming the held run";
    await resume(servers, threads.hold, held, "h");
    step = "self-test: the double run and the plain run";
    for (const [thread, line] of [
      [threads.double, "self test line [double]"],
      [threads.plain, "self test line plain"],
    ]) {
      const body = input(thread, `${thread}-0`, `u-${thread}`, line);
      await runAgui(servers.url, "crash", body, TOKEN);
      await resume(servers, thread, body, thread);
    }
    const recorded = new Map();
    const idOf = {};
    for (const [k, thread] of Object.entries(threads)) {
      const rs = results(await events(servers.url, thread));
      check(`self-test: ${k} thread recorded one tool result`, rs.length === 1, JSON.stringify(rs));
      for (const [id, content] of rs) recorded.set(id, content);
      idOf[k] = rs[0]?.[0];
    }
    const c = classify(readInvocations(dir), recorded, servers.killed, servers.started);
    check(
      `self-test: the injected double run of ${idOf.double} is flagged`,
      c.double.length === 1 && c.double[0].id === idOf.double,
      JSON.stringify(c),
    );
    check(
      `self-test: the kill between effect and record of ${idOf.hold} is reported as the at-least-once window`,
      c.window.length === 1 && c.window[0].id === idOf.hold,
      JSON.stringify(c),
    );
    check(`self-test: the plain run ${idOf.plain} ran once`, c.once.length === 1 && c.once[0] === idOf.plain, JSON.stringify(c));
  } finally {
    await stop(servers.serve.child, "SIGKILL");
  }
}

/**
 * The ACP variant: the SDK's example agent does not advertise `loadSession`, so a thread whose
 * server was killed mid-turn cannot go on in a new agent process. Each run is killed at a random
 * point of its turn (the agent takes seconds to reach its permission question), the server
 * restarted, and the thread asked again: its run must end either in the typed RUN_ERROR
 * CANNOT_RESUME (the thread had an agent session) or as a fresh turn (the kill came before the
 * thread was opened), and every thread's record must have no gap and no duplicate, nothing lost
 * of what was recorded before the kill.
 */
async function acpCrash() {
  const dir = tempDir("tether-crash-acp-");
  servers = new Servers(dir, toolConfig("", dir));
  await servers.start();
  const before = new Map();
  const seen = { typed: 0, fresh: 0 };
  for (let i = 0; i < RUNS; i++) {
    const thread = `acp-t${i}`;
    const body = input(thread, `a${i}-0`, `u${i}`, `question ${i}`);
    step = `acp run ${i}: first request`;
    const pending = runAgui(servers.url, "crash", body, TOKEN).catch(() => null);
    await sleep(Math.floor(Math.random() * 2500));
    step = `acp run ${i}: SIGKILL`;
    await servers.kill();
    await pending;
    step = `acp run ${i}: restart`;
    await servers.start();
    before.set(thread, await events(servers.url, thread));
    step = `acp run ${i}: asking again`;
    const evs = await runAgui(servers.url, "crash", { ...body, runId: `a${i}-1` }, TOKEN).catch((e) => [{ type: "FAILED", message: String(e) }]);
    const last = evs.at(-1) ?? {};
    const typed = last.type === "RUN_ERROR" && last.code === "CANNOT_RESUME";
    const fresh = last.type === "RUN_FINISHED" && before.get(thread).length === 0;
    check(`acp thread ${i}: after the kill, CANNOT_RESUME or a fresh turn`, typed || fresh, JSON.stringify(last));
    if (typed) seen.typed++;
    if (fresh) seen.fresh++;
  }
  console.log(`info: ${RUNS} SIGKILLs mid-turn; ${seen.typed} threads resumed with CANNOT_RESUME, ${seen.fresh} killed before their thread opened`);
  check("acp: some kills fell after the agent session was opened", seen.typed > 0, JSON.stringify(seen));
  step = "acp: the final check";
  await servers.kill();
  await servers.start();
  for (let i = 0; i < RUNS; i++) {
    const thread = `acp-t${i}`;
    const evs = await events(servers.url, thread);
    const seqs = evs.map((e) => e.seq);
    const prior = before.get(thread);
    check(`acp thread ${i}: record has no gap (${seqs.length} events)`, seqs.every((s, k) => s === k + 1), JSON.stringify(seqs));
    check(`acp thread ${i}: record has no duplicate`, new Set(evs.map((e) => e.id)).size === evs.length);
    check(
      `acp thread ${i}: nothing recorded before the kill was lost`,
      prior.every((e, k) => JSON.stringify(e) === JSON.stringify(evs[k])),
      `${prior.length} before, ${evs.length} after`,
    );
  }
  await stop(servers.serve.child, "SIGKILL");
  servers = null;
}

let fake;
if (PROVIDER === "acp") {
  // The ACP SDK's example agent (no loadSession): nothing to fake.
  fake = { child: null, url: "" };
} else if (PROVIDER === "managed") {
  const { spawnUntil } = await import("./lib.mjs");
  const bin = process.env.FAKE_MANAGED_BIN || new URL("../../target/debug/examples/fake_managed", import.meta.url).pathname;
  const [child, m] = await spawnUntil(bin, ["crash"], /listening on (http:\/\/\S+)/);
  fake = { child, url: m[1] };
  process.env.CRASH_FAKE_KEY = "sk-fake";
} else {
  fake = await startFake("crash");
}
let servers = null;
try {
  // The classifier's self-test drives the tool's markers through the model's arguments, which
  // the fake model takes from the user's message: the openai run does it; the managed fake's
  // tool input is fixed, so its run relies on the same (already self-tested) classifier.
  if (PROVIDER === "openai") await selfTest(fake);
  if (PROVIDER === "acp") {
    await acpCrash();
    process.exit(summary());
  }

  const dir = tempDir("tether-crash-");
  servers = new Servers(dir, toolConfig(fake.url, dir));
  await servers.start();
  let kills = 0;
  for (let i = 0; i < RUNS; i++) {
    const thread = `crash-t${i}`;
    const line = `line ${i} of the crash test${INJECT_DOUBLE && i === 0 ? " [double]" : ""}`;
    const body = input(thread, `r${i}-0`, `u${i}`, line);
    step = `run ${i}: first request`;
    const pending = runAgui(servers.url, "crash", body, TOKEN).catch(() => null);
    await sleep(Math.floor(Math.random() * 120));
    step = `run ${i}: SIGKILL`;
    await servers.kill();
    kills++;
    step = `run ${i}: the killed request's end`;
    await pending;
    step = `run ${i}: restart`;
    await servers.start();
    step = `run ${i}: resuming`;
    await resume(servers, thread, body, `r${i}`);
  }
  step = "the final check";
  // One more hard kill and restart, then check everything from the database.
  await servers.kill();
  await servers.start();
  const recorded = new Map();
  for (let i = 0; i < RUNS; i++) {
    const evs = await events(servers.url, `crash-t${i}`);
    const seqs = evs.map((e) => e.seq);
    const gapless = seqs.length > 0 && seqs.every((s, k) => s === k + 1);
    const ids = new Set(evs.map((e) => e.id));
    check(`thread ${i}: record has no gap (${seqs.length} events)`, gapless, JSON.stringify(seqs));
    check(`thread ${i}: record has no duplicate`, ids.size === evs.length);
    check(`thread ${i}: finished after resuming`, done(evs));
    const rs = results(evs);
    check(`thread ${i}: one tool result`, rs.length === 1, JSON.stringify(rs));
    for (const [id, content] of rs) recorded.set(id, content);
  }
  const invocations = readInvocations(dir);
  const c = classify(invocations, recorded, servers.killed, servers.started);
  for (const d of c.double) check(`tool use ${d.id} ran exactly once (or once more in the at-least-once window)`, false, d.why);
  check(
    `every tool use ran exactly once, outside the at-least-once window (${c.once.length + c.window.length} tool uses, ${invocations.length} invocations)`,
    c.double.length === 0,
    `${c.double.length} double run(s)`,
  );
  for (const w of c.window) {
    console.log(
      `info: at-least-once window: tool use ${w.id} ran again after server ${servers.describe(w.servers)} was killed between its effect and its record ($TETHER_TOOL_USE_ID is the idempotency key)`,
    );
  }
  console.log(`info: ${kills} SIGKILLs; ${invocations.length} tool invocations for ${recorded.size} tool uses; ${c.window.length} in the at-least-once window`);
} catch (e) {
  check("crash-safety flow", false, String(e?.stack || e));
} finally {
  step = "stopping the server and the fake";
  if (servers?.serve) await stop(servers.serve.child, "SIGKILL");
  if (fake.child) await stop(fake.child, "SIGKILL");
}
process.exit(summary());
