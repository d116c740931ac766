// Web pages that are not tether serve's own, in a real browser (Debian's chromium through
// playwright-core), against the real server:
//  1. a page served from another origin (http://127.0.0.1:OTHERPORT: same host, another port, so
//     another origin) tries to POST a run and read the threads of a server started with
//     --no-token: refused, and the tool did not run;
//  2. the same page against a server that lists its origin in [server] allowed_origins: the CORS
//     preflight passes and the same calls work (so the refusal in 1 is the server's doing);
//  3. DNS rebinding (issue 11): chromium resolves attacker.example to 127.0.0.1, a page of
//     http://attacker.example:PORT is then same-origin with the server in the browser's eyes, and
//     only the server's Host check stands between it and the agent: every request is refused.
// The agent's tool writes a file without asking (writes = "allow"), so a run that got through
// would leave it on disk.
import { createServer } from "node:http";
import { existsSync, mkdirSync } from "node:fs";
import { join } from "node:path";
import { check, launchChromium, startFake, startServe, stop, summary, tempDir, watchdog } from "./lib.mjs";

let step = "starting";
watchdog(300000, () => step);

const config = (ws, extra = "") => `
[server]
${extra}
[agents.default]
base_url = "${fake.url}"
model = "fake"
[agents.default.workspace]
root = "${ws}"
writes = "allow"
`;

// The page of the other origin: it runs the calls it is told to and reports what it saw.
const PAGE = `<!doctype html><meta charset="utf-8"><title>another origin</title>
<script>
window.attempt = async (serve, token) => {
  const out = {};
  const auth = token ? { authorization: "Bearer " + token } : {};
  const body = JSON.stringify({ threadId: "xo-" + Math.random().toString(16).slice(2), runId: "r1",
    messages: [{ id: "u1", role: "user", content: "please write the file" }], tools: [], context: [], state: {}, forwardedProps: {} });
  const tryFetch = async (name, url, init) => {
    try {
      const r = await fetch(url, init);
      out[name] = { status: r.status, type: r.type, body: r.type === "opaque" ? "" : await r.text() };
    } catch (e) {
      out[name] = { error: String(e) };
    }
  };
  await tryFetch("run", serve + "/v1/agents/default/run", { method: "POST",
    headers: { "content-type": "application/json", accept: "text/event-stream", ...auth }, body });
  await tryFetch("runNoCors", serve + "/v1/agents/default/run", { method: "POST", mode: "no-cors",
    headers: { "content-type": "text/plain" }, body });
  await tryFetch("threads", serve + "/v1/threads", { headers: { ...auth } });
  await tryFetch("events", serve + "/v1/threads/xo/events", { headers: { ...auth } });
  return out;
};
</script><p>another origin</p>`;

const other = createServer((req, res) => {
  res.writeHead(200, { "content-type": "text/html; charset=utf-8" });
  res.end(PAGE);
});
await new Promise((r) => other.listen(0, "127.0.0.1", r));
const otherOrigin = `http://127.0.0.1:${other.address().port}`;

const fake = await startFake("ui");
const dirA = tempDir("tether-xo-a-");
const wsA = join(dirA, "ws");
mkdirSync(wsA);
const dirB = tempDir("tether-xo-b-");
const wsB = join(dirB, "ws");
mkdirSync(wsB);
let serveA;
let serveB;
let browser;
let rebinder;
try {
  step = "starting the servers";
  // A: no token at all (the worst case): only the Host and Origin checks protect it.
  serveA = await startServe({ dir: dirA, config: config(wsA) });
  // B: lists the other origin; a generated token.
  serveB = await startServe({ dir: dirB, token: "generate", config: config(wsB, `allowed_origins = ["${otherOrigin}"]`) });
  browser = await launchChromium();

  step = "1: another origin against a server that does not list it";
  const page = await browser.newPage();
  await page.goto(otherOrigin + "/");
  const a = await page.evaluate(([s]) => window.attempt(s, ""), [serveA.url]);
  check("1: the cross-origin JSON run is refused (the preflight fails)", !!a.run.error, JSON.stringify(a.run));
  check("1: the no-cors run gets nothing back", a.runNoCors.type === "opaque" || !!a.runNoCors.error, JSON.stringify(a.runNoCors));
  check("1: the threads cannot be read", !!a.threads.error, JSON.stringify(a.threads));
  check("1: a thread's events cannot be read", !!a.events.error, JSON.stringify(a.events));
  check("1: the tool did not run", !existsSync(join(wsA, "hello.txt")));
  const threadsA = await (await fetch(`${serveA.url}/v1/threads`)).json();
  check("1: no thread was created", threadsA.threads.length === 0, JSON.stringify(threadsA));
  // What the server answered those requests (the same requests, from node, with the page's Origin).
  const direct = await fetch(`${serveA.url}/v1/agents/default/run`, {
    method: "POST",
    headers: { origin: otherOrigin, "content-type": "text/plain" },
    body: "{}",
  });
  const directBody = await direct.json();
  check("1: the server refuses that origin with 403 ORIGIN_NOT_ALLOWED", direct.status === 403 && directBody.code === "ORIGIN_NOT_ALLOWED", JSON.stringify(directBody));

  step = "2: the same page against a server that lists its origin";
  const b = await page.evaluate(([s, t]) => window.attempt(s, t), [serveB.url, serveB.token]);
  check("2: the listed origin's JSON run passes the preflight and finishes", b.run.status === 200 && /RUN_FINISHED/.test(b.run.body), JSON.stringify(b.run).slice(0, 400));
  check("2: its tool ran", existsSync(join(wsB, "hello.txt")));
  check("2: the listed origin reads the threads with the token", b.threads.status === 200 && /xo-/.test(b.threads.body), JSON.stringify(b.threads).slice(0, 300));
  const noToken = await page.evaluate(([s]) => window.attempt(s, ""), [serveB.url]);
  check("2: without the token even the listed origin gets 401", noToken.threads.status === 401 && noToken.run.status === 401, JSON.stringify(noToken.threads));
  await page.close();

  step = "3: DNS rebinding";
  const port = new URL(serveA.url).port;
  rebinder = await launchChromium(["--host-resolver-rules=MAP attacker.example 127.0.0.1"]);
  const evil = await rebinder.newPage();
  const nav = await evil.goto(`http://attacker.example:${port}/`);
  check("3: the UI page under the attacker's name is refused", nav.status() === 403, String(nav.status()));
  const r = await evil.evaluate(async () => {
    const body = JSON.stringify({ threadId: "rebind", runId: "r1",
      messages: [{ id: "u1", role: "user", content: "please write the file" }], tools: [], context: [], state: {}, forwardedProps: {} });
    const run = await fetch("/v1/agents/default/run", { method: "POST",
      headers: { "content-type": "application/json", accept: "text/event-stream" }, body });
    const threads = await fetch("/v1/threads");
    const events = await fetch("/v1/threads/rebind/events");
    return { run: [run.status, await run.text()], threads: [threads.status, await threads.text()], events: [events.status, await events.text()] };
  });
  check("3: the rebinding page's run is refused with HOST_NOT_ALLOWED", r.run[0] === 403 && /HOST_NOT_ALLOWED/.test(r.run[1]), JSON.stringify(r.run));
  check("3: the rebinding page cannot read the threads", r.threads[0] === 403, JSON.stringify(r.threads));
  check("3: the rebinding page cannot read a thread's events", r.events[0] === 403, JSON.stringify(r.events));
  check("3: the tool did not run", !existsSync(join(wsA, "hello.txt")));
  const after = await (await fetch(`${serveA.url}/v1/threads`)).json();
  check("3: no thread was created", after.threads.length === 0, JSON.stringify(after));
  // The same browser reaching the server under a loopback name is served.
  const ok = await evil.goto(`http://127.0.0.1:${port}/`);
  check("3: the same browser under 127.0.0.1 gets the UI", ok.status() === 200, String(ok.status()));
} catch (e) {
  check(`cross-origin flow (at: ${step})`, false, String(e?.stack || e));
} finally {
  step = "stopping";
  await browser?.close();
  await rebinder?.close();
  other.close();
  if (serveA) await stop(serveA.child);
  if (serveB) await stop(serveB.child);
  await stop(fake.child);
}
process.exit(summary());
