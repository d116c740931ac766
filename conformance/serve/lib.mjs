// Shared helpers: start the fake model and tether serve as real processes on 127.0.0.1.
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync, writeSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";

const root = resolve(new URL("../..", import.meta.url).pathname);
export const SERVE_BIN = process.env.TETHER_SERVE_BIN || join(root, "target/debug/tether-serve");
export const FAKE_BIN = process.env.FAKE_OPENAI_BIN || join(root, "target/debug/examples/fake_openai");

let passed = 0;
let failed = 0;
export function check(name, ok, detail = "") {
  if (ok) passed++;
  else failed++;
  console.log(`${ok ? "PASS" : "FAIL"} ${name}${!ok && detail ? `: ${detail}` : ""}`);
}
export function summary() {
  console.log(`${passed} passed, ${failed} failed`);
  return failed === 0 ? 0 : 1;
}

/**
 * Fails the script with `what` still in progress if it has not finished within `ms`: a hang then
 * names where it hung (written synchronously, so the report survives the exit).
 */
export function watchdog(ms, what) {
  const t = setTimeout(() => {
    writeSync(1, `FAIL watchdog: still running after ${ms / 1000}s, at: ${what()}\n`);
    writeSync(1, `${passed} passed, ${failed + 1} failed\n`);
    process.exit(1);
  }, ms);
  t.unref();
}

/** The temporary directories this script made (`tempDir`). */
const made = [];
// Removed when the script exits having passed; kept, and named on stderr, when a check failed
// or the script did not finish (their files are what one looks at then). A server killed on
// purpose may still be writing into one: removal is best effort.
process.on("exit", (code) => {
  for (const d of made) {
    if (code === 0 && failed === 0) {
      try {
        rmSync(d, { recursive: true, force: true });
      } catch {}
    } else {
      writeSync(2, `kept ${d}\n`);
    }
  }
});

/** A new directory under the system's temporary directory, removed at a passing exit. */
export function tempDir(prefix) {
  const d = mkdtempSync(join(tmpdir(), prefix));
  made.push(d);
  return d;
}

/** Spawns `cmd` and resolves with [child, match] once a line of its output matches `re`. */
export function spawnUntil(cmd, args, re, opts = {}) {
  return new Promise((resolveP, reject) => {
    const child = spawn(cmd, args, { stdio: ["ignore", "pipe", "pipe"], ...opts });
    let buf = "";
    const timer = setTimeout(() => reject(new Error(`${cmd} did not start: ${buf}`)), 30000);
    const onData = (d) => {
      buf += d.toString();
      const m = buf.match(re);
      if (m) {
        clearTimeout(timer);
        resolveP([child, m]);
      }
    };
    child.stdout.on("data", onData);
    child.stderr.on("data", onData);
    child.on("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`${cmd} exited with ${code}: ${buf}`));
    });
  }).then(([child, m]) => {
    child.removeAllListeners("exit");
    child.stdout.resume();
    child.stderr.resume();
    return [child, m];
  });
}

export async function startFake(mode) {
  const [child, m] = await spawnUntil(FAKE_BIN, [mode], /listening on (http:\/\/\S+\/v1)/);
  return { child, url: m[1] };
}

/**
 * Starts tether serve on 127.0.0.1:0. `token`: a string is passed as --token; `"generate"` passes
 * none, so the server generates one, and its printed UI URL (`uiUrl`, the token in its fragment)
 * and `token` are returned; anything else (the default) runs it with --no-token, allowed on
 * loopback only.
 */
export async function startServe({ dir, config, token, db }) {
  const cfg = join(dir, "tether.toml");
  writeFileSync(cfg, config);
  const args = ["--config", cfg, "--bind", "127.0.0.1:0", "--db", db || join(dir, "tether.db")];
  if (token === "generate") {
    // nothing: the default
  } else if (token) args.push("--token", token);
  else args.push("--no-token");
  const [child, m] = await spawnUntil(SERVE_BIN, args, /listening on (http:\/\/\S+) [\s\S]*tether serve: open (\S+)[^\n]*\n/, {
    cwd: dir,
    env: { ...process.env, TETHER_TOKEN: "" },
  });
  const out = { child, url: m[1], uiUrl: m[2], token: typeof token === "string" && token !== "generate" ? token : undefined };
  if (token === "generate") {
    const t = m[2].split("#token=")[1];
    if (!t) throw new Error(`tether serve printed no token URL: ${m[0]}`);
    out.token = t;
  }
  return out;
}

/** The chromium flags every browser test uses (Debian's chromium, headless, nothing phoning home). */
export const CHROMIUM_ARGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];

/**
 * Launches Debian's chromium through playwright-core with a fresh profile (playwright's launch
 * makes a new temporary --user-data-dir each time). `extra` adds flags.
 */
export async function launchChromium(extra = []) {
  const { chromium } = await import("playwright-core");
  return chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: [...CHROMIUM_ARGS, ...extra],
  });
}

export function stop(child, signal = "SIGTERM") {
  return new Promise((r) => {
    if (child.exitCode !== null || child.signalCode !== null) return r();
    child.once("exit", () => r());
    child.kill(signal);
  });
}

/** POSTs a RunAgentInput and returns the decoded SSE events (or throws on a dropped stream). */
export async function runAgui(base, agent, body, token) {
  const headers = { "content-type": "application/json", accept: "text/event-stream" };
  if (token) headers.authorization = `Bearer ${token}`;
  // Bounded: a run that never ends fails the step that sent it instead of hanging the suite.
  const r = await fetch(`${base}/v1/agents/${agent}/run`, {
    method: "POST",
    headers,
    body: JSON.stringify(body),
    signal: AbortSignal.timeout(60000),
  });
  if (!r.ok) throw new Error(`HTTP ${r.status}: ${await r.text()}`);
  const text = await r.text();
  return text
    .split("\n\n")
    .map((f) => f.split("\n").find((l) => l.startsWith("data: ")))
    .filter(Boolean)
    .map((l) => JSON.parse(l.slice(6)));
}
