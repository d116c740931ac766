// Crash safety: 20 runs, each calling a side-effecting tool (it appends a line to a file); tether
// serve is killed with SIGKILL at a random point of each run, restarted, and the thread resumed.
// Then every thread's event record must have no gap and no duplicate, and each tool-use id must
// appear exactly once in the file.
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { check, runAgui, startFake, startServe, stop, summary, tempDir, watchdog } from "./lib.mjs";

const RUNS = Number(process.env.CRASH_RUNS || 20);
let step = "starting";
watchdog(300000, () => step);
const dir = tempDir("tether-crash-");
const fake = await startFake("crash");
// The command logs every invocation, and appends the call's line unless the file already has it
// ($TETHER_TOOL_USE_ID is the idempotency key tether gives shell tools: the memo never re-runs a
// recorded call, the key covers a kill between the effect and its record).
const config = `
[agents.crash]
base_url = "${fake.url}"
model = "fake"
max_turns = 4
[[agents.crash.commands]]
name = "append_line"
description = "Append a line to the file"
command = 'echo "$TETHER_TOOL_USE_ID" >> invocations.txt; grep -qxF "$TETHER_TOOL_USE_ID" lines.txt 2>/dev/null || echo "$TETHER_TOOL_USE_ID" >> lines.txt; echo appended'
cwd = "${dir}"
parameters = { type = "object", properties = { line = { type = "string" } }, required = ["line"] }
`;
const db = join(dir, "tether.db");
let serve = await startServe({ dir, config, db });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function events(base, thread) {
  const r = await fetch(`${base}/v1/threads/${thread}/events`, { signal: AbortSignal.timeout(30000) });
  if (r.status === 404) return [];
  return (await r.json()).events;
}
function done(evs) {
  const responses = evs.filter((e) => e.type === "local.model_response");
  const last = responses[responses.length - 1];
  return !!last && (last.kind.tool_uses || []).length === 0 && evs.some((e) => e.kind.kind === "tool_result");
}

let kills = 0;
try {
  for (let i = 0; i < RUNS; i++) {
    const thread = `crash-t${i}`;
    const body = { threadId: thread, runId: `r${i}-0`, messages: [{ id: `u${i}`, role: "user", content: `line ${i} of the crash test` }], tools: [], context: [], state: {} };
    step = `run ${i}: first request`;
    const pending = runAgui(serve.url, "crash", body).catch(() => null);
    await sleep(Math.floor(Math.random() * 120));
    step = `run ${i}: SIGKILL`;
    await stop(serve.child, "SIGKILL");
    kills++;
    step = `run ${i}: the killed request's end`;
    await pending;
    step = `run ${i}: restart`;
    serve = await startServe({ dir, config, db });
    step = `run ${i}: resuming`;
    for (let attempt = 1; attempt <= 6 && !done(await events(serve.url, thread)); attempt++) {
      await runAgui(serve.url, "crash", { ...body, runId: `r${i}-${attempt}` }).catch((e) => console.log(`  resume ${thread}: ${e}`));
    }
  }
  step = "the final check";
  // One more hard kill and restart, then check everything from the database.
  await stop(serve.child, "SIGKILL");
  serve = await startServe({ dir, config, db });
  const lines = existsSync(join(dir, "lines.txt")) ? readFileSync(join(dir, "lines.txt"), "utf8").split("\n").filter(Boolean) : [];
  const invocations = existsSync(join(dir, "invocations.txt")) ? readFileSync(join(dir, "invocations.txt"), "utf8").split("\n").filter(Boolean) : [];
  const toolIds = [];
  for (let i = 0; i < RUNS; i++) {
    const evs = await events(serve.url, `crash-t${i}`);
    const seqs = evs.map((e) => e.seq);
    const gapless = seqs.length > 0 && seqs.every((s, k) => s === k + 1);
    const ids = new Set(evs.map((e) => e.id));
    check(`thread ${i}: record has no gap (${seqs.length} events)`, gapless, JSON.stringify(seqs));
    check(`thread ${i}: record has no duplicate`, ids.size === evs.length);
    check(`thread ${i}: finished after resuming`, done(evs));
    const results = evs.filter((e) => e.kind.kind === "tool_result").map((e) => e.kind.result.tool_use_id);
    check(`thread ${i}: one tool result`, results.length === 1, JSON.stringify(results));
    toolIds.push(...results);
  }
  for (const id of toolIds) {
    const n = lines.filter((l) => l === id).length;
    check(`tool use ${id} is in the file exactly once`, n === 1, `${n} times`);
  }
  check(`the file has one line per run (${RUNS})`, lines.length === RUNS, `${lines.length} lines`);
  const reran = invocations.length - new Set(invocations).size;
  console.log(`info: ${kills} SIGKILLs; ${invocations.length} tool invocations for ${new Set(invocations).size} tool uses (${reran} re-run after a kill landed between the effect and its record)`);
} catch (e) {
  check("crash-safety flow", false, String(e?.stack || e));
} finally {
  step = "stopping the server and the fake";
  await stop(serve.child, "SIGKILL");
  await stop(fake.child, "SIGKILL");
}
process.exit(summary());
