// The browser test for MCP elicitations: Debian's chromium driven by playwright-core against tether
// serve hosting an Anthropic local-loop agent (on a scripted Messages API model below) with the
// pinned MCP reference server (@modelcontextprotocol/server-everything, a real subprocess over
// stdio). The model calls the server's `trigger-elicitation-request` tool; the server asks the
// user for input mid-call; tether serve ends the run with an elicitation interrupt, and the UI must
// show the server's message and a form generated from its schema, validate it, and resume with the
// answer. Cases: accepted (the content reaches the server: its tool result, shown in the
// transcript, repeats it), declined (nothing typed is sent), cancelled with Escape, and a hostile
// request (markup, bidi characters, too many fields, an unknown field type: shown as text, and only
// declinable), fed to the UI by intercepting its run request. Screenshots go to artifacts/.
import { spawnSync } from "node:child_process";
import { existsSync, mkdirSync } from "node:fs";
import { createServer } from "node:http";
import { join } from "node:path";
import { check, launchChromium, startServe, stop, summary, tempDir, watchdog } from "./lib.mjs";

const mcpDir = new URL("../mcp/", import.meta.url).pathname;
const EVERYTHING = join(mcpDir, "node_modules/@modelcontextprotocol/server-everything/dist/index.js");
if (!existsSync(EVERYTHING)) {
  // Installed from the committed lockfile (scripts/test does this first; a lone run of this file
  // does it here).
  spawnSync("npm", ["ci", "--no-audit", "--no-fund", "--silent"], { cwd: mcpDir, stdio: "inherit" });
}
if (!existsSync(EVERYTHING)) {
  check("the MCP reference server is installed (cd conformance/mcp && npm ci)", false, EVERYTHING);
  process.exit(summary());
}
// 0. The form's rules (web/src/elicit.js, bundled into the UI), checked directly.
{
  const { LIMITS, collect, parseElicitation } = await import("../../web/src/elicit.js");
  const form = (properties, required = []) =>
    parseElicitation({ id: "i", reason: "elicitation", message: "m", metadata: { mode: "form", requestedSchema: { type: "object", properties, required } } });
  const proto = form(JSON.parse('{"__proto__": {"type": "string"}}'));
  const c = collect(proto, new Map([["__proto__", "x"]])).content;
  check("a field named __proto__ stays a field of the answer", Object.hasOwn(c, "__proto__") && Object.getPrototypeOf(c) === Object.prototype && JSON.stringify(c) === '{"__proto__":"x"}', JSON.stringify(c));
  const dates = form({ d: { type: "string", format: "date" }, t: { type: "string", format: "date-time" } });
  const errs = (m) => [...collect(dates, new Map(Object.entries(m))).errors.keys()].join();
  check("an impossible date is refused", errs({ d: "2026-02-30" }) === "d");
  check("a date-time needs its zone", errs({ t: "2026-12-01T09:30" }) === "t" && errs({ t: "2026-12-01T09:30:00+01:00", d: "2024-02-29" }) === "");
  const big = form({ a: { type: "string" }, b: { type: "string" }, c2: { type: "string" }, d: { type: "string" }, e: { type: "string" }, f: { type: "string" }, g: { type: "string" } });
  const long = "é".repeat(LIMITS.string);
  const r = collect(big, new Map(["a", "b", "c2", "d", "e", "f", "g"].map((k) => [k, long])));
  check(`an answer over ${LIMITS.content} bytes is refused`, r.content === null && r.errors.has(""));
  check("an enum of non-strings is unsupported", form({ n: { type: "string", enum: [1, 2] } }).problems.length === 1);
  check("a nested object is unsupported", form({ o: { type: "object", properties: {} } }).problems.length === 1);
  check("a required field the schema does not describe is a problem", form({}, ["ghost"]).problems.length === 1);
  check("an unsupported request can never be accepted", collect(form({ o: { type: "object" } }), new Map()).content === null);
  check(
    "an optional field left empty is left out; a boolean the user set is sent as set",
    JSON.stringify(collect(form({ s: { type: "string" }, n: { type: "number" }, b: { type: "boolean" } }), new Map([["s", ""], ["n", " "], ["b", false]])).content) === '{"b":false}',
  );
  const bools = form({ opt: { type: "boolean" }, optOn: { type: "boolean", default: true }, req: { type: "boolean" }, reqOn: { type: "boolean", default: true } }, ["req", "reqOn"]);
  const untouched = collect(bools, new Map()).content;
  check(
    "an optional boolean left untouched is not sent (not even with a default); a required one is sent as shown",
    JSON.stringify(untouched) === '{"req":false,"reqOn":true}',
    JSON.stringify(untouched),
  );
}

const artifacts = new URL("artifacts/", import.meta.url).pathname;
mkdirSync(artifacts, { recursive: true });
let at = "starting";
watchdog(300000, () => at);

// ---- The model: a scripted Anthropic Messages API on 127.0.0.1, answering by rule. A user turn
// mentioning "elicit" gets a streamed call of `trigger-elicitation-request`; a tool result gets a
// text repeating it; anything else is echoed.
function sse(events) {
  return events.map((e) => `event: ${e.type}\ndata: ${JSON.stringify(e)}\n\n`).join("");
}
function stream(block, delta, stop) {
  return sse([
    { type: "message_start", message: { id: "msg_fake", type: "message", role: "assistant", model: "fake", content: [], stop_reason: null, stop_sequence: null, usage: { input_tokens: 1, output_tokens: 1 } } },
    { type: "content_block_start", index: 0, content_block: block },
    { type: "content_block_delta", index: 0, delta },
    { type: "content_block_stop", index: 0 },
    { type: "message_delta", delta: { stop_reason: stop, stop_sequence: null }, usage: { output_tokens: 1 } },
    { type: "message_stop" },
  ]);
}
let calls = 0;
function reply(body) {
  const last = body?.messages?.at(-1);
  const blocks = typeof last?.content === "string" ? [{ type: "text", text: last.content }] : Array.isArray(last?.content) ? last.content : [];
  const result = blocks.find((b) => b.type === "tool_result");
  if (result) {
    const said = typeof result.content === "string" ? result.content : (result.content || []).map((c) => c.text || "").join("\n");
    return stream({ type: "text", text: "" }, { type: "text_delta", text: `Done: the tool said ${said.split("\n")[0]}` }, "end_turn");
  }
  const said = blocks.map((b) => b.text || "").join("");
  if (said.includes("elicit")) {
    calls++;
    return stream(
      { type: "tool_use", id: `toolu_elicit_${calls}`, name: "trigger-elicitation-request", input: {} },
      { type: "input_json_delta", partial_json: "{}" },
      "tool_use",
    );
  }
  return stream({ type: "text", text: "" }, { type: "text_delta", text: `You said: ${said}` }, "end_turn");
}
const model = createServer((req, res) => {
  let data = "";
  req.on("data", (d) => (data += d));
  req.on("end", () => {
    let body = null;
    try {
      body = JSON.parse(data);
    } catch {
      // answered as an empty conversation
    }
    if (req.method !== "POST" || !req.url.startsWith("/v1/messages")) {
      res.writeHead(404).end();
      return;
    }
    res.writeHead(200, { "content-type": "text/event-stream" });
    res.end(reply(body));
  });
});
await new Promise((r) => model.listen(0, "127.0.0.1", r));
const modelUrl = `http://127.0.0.1:${model.address().port}`;

process.env.TETHER_TEST_ELICIT_KEY = "sk-test";
const dir = tempDir("tether-ui-elicit-");
const serve = await startServe({
  dir,
  token: "generate",
  config: `
[agents.main]
provider = "anthropic"
base_url = "${modelUrl}"
api_key_env = "TETHER_TEST_ELICIT_KEY"
description = "The MCP reference server's tools"
[[agents.main.mcp]]
name = "everything"
command = "node"
args = [${JSON.stringify(EVERYTHING)}, "stdio"]
`,
});

const browser = await launchChromium();
let code = 1;
let page = null;
try {
  page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
  const warnings = [];
  page.on("console", (m) => {
    if (m.type() === "warning" || m.type() === "error") warnings.push(m.text());
  });
  // Every run request the UI sends (its `resume` is what the server hears), and every event the
  // server streamed back.
  const runs = [];
  const streamed = [];
  page.on("request", (r) => {
    if (r.method() === "POST" && /\/v1\/agents\/[^/]+\/run$/.test(new URL(r.url()).pathname)) runs.push(JSON.parse(r.postData() || "null"));
  });
  page.on("response", async (r) => {
    if (!/\/v1\/agents\/[^/]+\/run$/.test(new URL(r.url()).pathname)) return;
    const text = await r.text().catch(() => "");
    for (const f of text.split("\n\n")) {
      const line = f.split("\n").find((l) => l.startsWith("data: "));
      if (line) streamed.push(JSON.parse(line.slice(6)));
    }
  });
  const lastResume = () => runs.at(-1)?.resume;
  await page.goto(serve.uiUrl);
  await page.waitForFunction(() => document.querySelector("#agent-select")?.options.length > 0, null, { timeout: 10000 });

  // 1. Accepted.
  at = "the first elicitation";
  await page.fill("#prompt", "please elicit my details");
  await page.press("#prompt", "Enter");
  await page.waitForSelector("#elicit[open]", { timeout: 30000 });
  check("an elicitation opens the input form, not the approval dialog", (await page.locator("#approval[open]").count()) === 0);
  const message = await page.textContent("#elicit-text");
  check("the form shows the server's message", message === "Please provide inputs for the following fields:", message);
  const source = await page.textContent("#elicit-source");
  check("the form names the tool whose server asks", /trigger-elicitation-request/.test(source || ""), source);
  const fieldCount = await page.locator("#elicit-fields .field").count();
  check("every field of the server's schema is a form field (13)", fieldCount === 13, String(fieldCount));
  check("every field of the reference server's schema is supported", (await page.locator("#elicit-fields .field.unsupported").count()) === 0 && (await page.locator("#elicit-problems li").count()) === 0);
  check("Accept is enabled", await page.isEnabled("#elicit-accept"));
  const f = (name) => `#elicit-fields [data-field="${name}"]`;
  check("a default is pre-filled", (await page.inputValue(`${f("firstLine")} input`)) === "It was a dark and stormy night.");
  check("a titled enum shows its titles", (await page.locator(`${f("legacyTitledEnum")} option`, { hasText: "Dogs" }).count()) === 1);
  check("a multi-select shows its choices", (await page.locator(`${f("titledMultipleSelectEnum")} label.choice`).count()) === 3);
  await page.screenshot({ path: join(artifacts, "elicit-form.png") });

  // Client-side validation: a required field left empty and a malformed email keep the form open.
  const sentBefore = runs.length;
  await page.click("#elicit-accept");
  check("an empty required field keeps the form open", (await page.locator("#elicit[open]").count()) === 1);
  check("and says which field", /required/.test((await page.textContent(`${f("name")} .err`)) || ""));
  await page.fill(`${f("name")} input`, "Ada Lovelace");
  await page.fill(`${f("email")} input`, "not an email");
  await page.fill(`${f("integer")} input`, "500");
  await page.click("#elicit-accept");
  check("a malformed email keeps the form open", (await page.locator("#elicit[open]").count()) === 1);
  check("and says what is expected", /email address/.test((await page.textContent(`${f("email")} .err`)) || ""));
  check("an integer out of range is refused", /at most 100/.test((await page.textContent(`${f("integer")} .err`)) || ""));
  check("nothing was sent while the form was invalid", runs.length === sentBefore);
  await page.fill(`${f("email")} input`, "ada@example.com");
  await page.fill(`${f("integer")} input`, "7");
  await page.check(`${f("check")} input`);
  await page.selectOption(`${f("legacyTitledEnum")} select`, "pet-2");
  await page.screenshot({ path: join(artifacts, "elicit-filled.png") });
  await page.click("#elicit-accept");
  await page.waitForSelector(".tool .result:has-text('Name: Ada Lovelace')", { timeout: 30000 });
  const result = (await page.textContent(".tool .result")) || "";
  check("accepted, the tool's result shows the content the server received", /Email: ada@example\.com/.test(result) && /Agreed to terms: true/.test(result) && /Favorite Integer: 7/.test(result) && /Pet Type|pet-2/.test(result), result);
  const r1 = lastResume();
  const accepted = r1?.[0];
  check(
    "the resume is exactly one resolved entry with action accept and the typed content",
    r1?.length === 1 &&
      accepted.status === "resolved" &&
      /^approval_[0-9a-f]{32}$/.test(accepted.interruptId) &&
      Object.keys(accepted.payload).join() === "action,content" &&
      accepted.payload.action === "accept" &&
      accepted.payload.content.name === "Ada Lovelace" &&
      accepted.payload.content.email === "ada@example.com" &&
      accepted.payload.content.integer === 7 &&
      accepted.payload.content.check === true &&
      accepted.payload.content.legacyTitledEnum === "pet-2" &&
      accepted.payload.content.number === 3.14 &&
      !("homepage" in accepted.payload.content),
    JSON.stringify(r1),
  );
  await page.waitForSelector(".msg.assistant:has-text('Done: the tool said')", { timeout: 30000 });
  check("the turn finishes after the answer", true);
  await page.waitForFunction(() => document.querySelector("#status").textContent === "idle", null, { timeout: 10000 });
  const states = streamed.filter((e) => e.type === "STATE_SNAPSHOT" || e.type === "STATE_DELTA");
  const panel = (await page.textContent("#state")) || "";
  check(
    `the state panel shows what the agent published (${states.length} state events)`,
    states.length ? panel.trim().startsWith("{") : /published no state/.test(panel),
    panel,
  );
  await page.screenshot({ path: join(artifacts, "elicit-accepted.png"), fullPage: true });

  // 1b. Accepted with the optional checkbox left untouched: it is not sent (an untouched box is
  //     not the user saying "no").
  at = "the elicitation with an untouched checkbox";
  await page.click("#new-thread");
  await page.fill("#prompt", "elicit, leaving the box alone");
  await page.press("#prompt", "Enter");
  await page.waitForSelector("#elicit[open]", { timeout: 30000 });
  check("the optional checkbox starts unchecked", !(await page.isChecked(`${f("check")} input`)));
  await page.fill(`${f("name")} input`, "Grace Hopper");
  await page.click("#elicit-accept");
  await page.waitForSelector(".msg.assistant:has-text('Done: the tool said')", { timeout: 30000 });
  const untouchedContent = lastResume()?.[0]?.payload?.content;
  check(
    "an optional boolean left untouched is not in the accepted content",
    untouchedContent?.name === "Grace Hopper" && !("check" in untouchedContent),
    JSON.stringify(untouchedContent),
  );
  await page.waitForFunction(() => document.querySelector("#status").textContent === "idle", null, { timeout: 10000 });

  // 2. Declined: what was typed is not sent.
  at = "the declined elicitation";
  await page.click("#new-thread");
  await page.fill("#prompt", "elicit again");
  await page.press("#prompt", "Enter");
  await page.waitForSelector("#elicit[open]", { timeout: 30000 });
  await page.fill(`${f("name")} input`, "Mallory");
  await page.click("#elicit-decline");
  await page.waitForSelector(".tool .result:has-text('declined')", { timeout: 30000 });
  const declined = (await page.textContent(".tool .result")) || "";
  check("declined, the server hears a decline", /User declined/.test(declined) && /"action": "decline"/.test(declined), declined);
  check("nothing typed reached the server", !declined.includes("Mallory"), declined);
  const r2 = lastResume();
  check("the resume says decline, without content", JSON.stringify(r2?.[0]?.payload) === '{"action":"decline"}' && r2?.[0]?.status === "resolved", JSON.stringify(r2));

  // 3. Cancelled with Escape.
  at = "the cancelled elicitation";
  await page.click("#new-thread");
  await page.fill("#prompt", "elicit once more");
  await page.press("#prompt", "Enter");
  await page.waitForSelector("#elicit[open]", { timeout: 30000 });
  await page.keyboard.press("Escape");
  await page.waitForSelector(".tool .result:has-text('cancelled')", { timeout: 30000 });
  check("Escape cancels: the server hears a cancel", /User cancelled/.test((await page.textContent(".tool .result")) || ""));
  check("the resume says cancel", JSON.stringify(lastResume()?.[0]?.payload) === '{"action":"cancel"}', JSON.stringify(lastResume()));
  await page.waitForFunction(() => document.querySelector("#status").textContent === "idle", null, { timeout: 10000 });

  // 4. A hostile request (what a malicious MCP server could send through tether serve), fed to the
  //    UI by answering its run request here: shown as text only, bounded, and only declinable.
  at = "the hostile elicitation";
  const hostileId = `approval_${"ab".repeat(16)}`;
  const props = { name: { type: "string", title: '<img src=x onerror="window.__pwned=1">' }, blob: { type: "object", title: "Blob" } };
  for (let i = 0; i < 200; i++) props[`f${i}`] = { type: "string" };
  let hostileResume = null;
  let issue = {
    id: hostileId,
    reason: "elicitation",
    message: `<b onmouseover="window.__pwned=1">Trust me</b>\u202egnp.exe ${"x".repeat(10000)}`,
    metadata: { mode: "form", requestedSchema: { type: "object", properties: props, required: ["name"] } },
  };
  await page.route("**/v1/agents/main/run", async (route) => {
    const body = JSON.parse(route.request().postData() || "{}");
    const base = { threadId: body.threadId, runId: body.runId };
    const events = [{ type: "RUN_STARTED", ...base }];
    if (body.resume) {
      hostileResume = body.resume;
      events.push({ type: "RUN_FINISHED", ...base, outcome: { type: "success" } });
    } else {
      events.push({ type: "RUN_FINISHED", ...base, outcome: { type: "interrupt", interrupts: [issue] } });
    }
    await route.fulfill({ status: 200, headers: { "content-type": "text/event-stream" }, body: events.map((e) => `data: ${JSON.stringify(e)}\n\n`).join("") });
  });
  await page.click("#new-thread");
  await page.fill("#prompt", "anything");
  await page.press("#prompt", "Enter");
  await page.waitForSelector("#elicit[open]", { timeout: 30000 });
  const shown = (await page.textContent("#elicit-text")) || "";
  check("markup in the server's message is shown as text", shown.startsWith('<b onmouseover="window.__pwned=1">Trust me</b>') && (await page.locator("#elicit b, #elicit img").count()) === 0, shown.slice(0, 80));
  check("a bidi override in the message is shown escaped", shown.includes("\\u{202e}gnp.exe") && !shown.includes("\u202e"));
  check("a long message is cut short", shown.length < 4100 && shown.endsWith("…"), String(shown.length));
  check("at most 32 fields are shown", (await page.locator("#elicit-fields .field").count()) === 32);
  check("a markup title is shown as text", (await page.textContent(`${f("name")} label`))?.startsWith('<img src=x onerror="window.__pwned=1">'));
  const problems = (await page.locator("#elicit-problems li").allTextContents()).join(" | ");
  check("too many fields and an unknown field type are named", /202 fields/.test(problems) && /Blob: unsupported \(field type "object"\)/.test(problems), problems);
  check("the unsupported field is marked in the form", /Unsupported/.test((await page.textContent(`${f("blob")}`)) || ""));
  check("such a request cannot be accepted", !(await page.isEnabled("#elicit-accept")));
  await page.screenshot({ path: join(artifacts, "elicit-hostile.png") });
  await page.click("#elicit-decline");
  await page.waitForFunction(() => document.querySelector("#status").textContent === "idle", null, { timeout: 10000 });
  check(
    "it can be declined, and the answer carries no content",
    JSON.stringify(hostileResume) === JSON.stringify([{ interruptId: hostileId, status: "resolved", payload: { action: "decline" } }]),
    JSON.stringify(hostileResume),
  );
  check("no script of the server's ran", (await page.evaluate(() => window.__pwned)) === undefined);

  // 5. A URL to visit: an http(s) one is a link that opens apart from the UI; any other scheme is
  //    only text; accepting sends no content.
  at = "the URL elicitations";
  for (const [url, link] of [
    ["https://example.com/connect?x=1", true],
    ["javascript:window.__pwned=1", false],
  ]) {
    issue = { id: hostileId, reason: "elicitation", message: "Connect your account", metadata: { mode: "url", url, elicitationId: "e1" } };
    hostileResume = null;
    await page.click("#new-thread");
    await page.fill("#prompt", "anything");
    await page.press("#prompt", "Enter");
    await page.waitForSelector("#elicit[open]", { timeout: 30000 });
    const a = page.locator("#elicit-url a");
    const shownUrl = (await page.textContent("#elicit-url")) || "";
    if (link) {
      check("a URL request shows its https address as a link that opens apart", (await a.count()) === 1 && (await a.getAttribute("href")) === url && (await a.getAttribute("rel")) === "noopener noreferrer" && (await a.getAttribute("target")) === "_blank");
      check("a URL request shows no form fields", (await page.locator("#elicit-fields .field").count()) === 0);
    } else {
      check("a URL of another scheme is only text", (await a.count()) === 0 && shownUrl.includes(url), shownUrl);
    }
    await page.click("#elicit-accept");
    await page.waitForFunction(() => document.querySelector("#status").textContent === "idle", null, { timeout: 10000 });
    check(`accepting a URL request (${url.split(":")[0]}) sends no content`, JSON.stringify(hostileResume?.[0]?.payload) === '{"action":"accept"}', JSON.stringify(hostileResume));
  }
  check("still no script of the server's ran", (await page.evaluate(() => window.__pwned)) === undefined);

  // 6. An approval whose text hides a bidi override (a model names the tool call's summary) still
  //    opens the approval dialog, with the override shown escaped; Deny answers it.
  at = "the approval with a bidi override";
  issue = { id: hostileId, reason: "approval", message: "Allow write_file \u202etxt.exe?" };
  hostileResume = null;
  await page.click("#new-thread");
  await page.fill("#prompt", "anything");
  await page.press("#prompt", "Enter");
  await page.waitForSelector("#approval[open]", { timeout: 30000 });
  const asked = (await page.textContent("#approval-text")) || "";
  check("an approval's bidi override is shown escaped", asked === "Allow write_file \\u{202e}txt.exe?", asked);
  await page.click("#deny");
  await page.waitForFunction(() => document.querySelector("#status").textContent === "idle", null, { timeout: 10000 });
  check("Deny answers the approval as cancelled", hostileResume?.[0]?.status === "cancelled", JSON.stringify(hostileResume));
  await page.unroute("**/v1/agents/main/run");

  const agui = warnings.filter((w) => /AG-UI|verify|protocol|Cannot/i.test(w));
  check("the AG-UI client reported no warnings", agui.length === 0, agui.join(" | "));
} catch (e) {
  check(`browser flow (MCP elicitation), at ${at}`, false, String(e?.stack || e));
  await page?.screenshot({ path: join(artifacts, "elicit-failed.png") }).catch(() => {});
} finally {
  await browser.close();
  await stop(serve.child);
  model.close();
  code = summary();
}
process.exit(code);
