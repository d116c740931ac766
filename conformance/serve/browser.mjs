// The browser test: Debian's chromium driven by playwright-core against tether serve and the
// testkit's fake OpenAI server. Open the UI, give the token once, send a prompt that leads to a
// write needing approval, approve it in the dialog, see the tool result and the final text,
// reload, reopen the thread from the list. Screenshots go to artifacts/.
import { chromium } from "playwright-core";
import { existsSync, mkdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { check, startFake, startServe, stop, summary, tempDir } from "./lib.mjs";

const artifacts = new URL("artifacts/", import.meta.url).pathname;
mkdirSync(artifacts, { recursive: true });
const dir = tempDir("tether-ui-");
const ws = join(dir, "ws");
mkdirSync(ws);
const TOKEN = "browser-test-token";
const fake = await startFake("ui");
const serve = await startServe({
  dir,
  token: TOKEN,
  config: `
[agents.default]
base_url = "${fake.url}"
model = "fake"
description = "Workspace tools (writes need approval)"
[agents.default.workspace]
root = "${ws}"
writes = "ask"
`,
});
const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || "/usr/bin/chromium", args: ["--no-sandbox"] });
let code = 1;
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
  const warnings = [];
  page.on("console", (m) => {
    if (m.type() === "warning" || m.type() === "error") warnings.push(m.text());
  });
  await page.goto(serve.url + "/");
  await page.waitForSelector("#token-dialog[open]", { timeout: 10000 });
  check("the UI asks for the token", true);
  await page.fill("#token-input", TOKEN);
  await page.click("#token-save");
  await page.waitForFunction(() => document.querySelector("#agent-select")?.options.length > 0);
  check("agents are listed", (await page.locator("#agent-select option").count()) === 1);

  await page.fill("#prompt", "please write a greeting file");
  await page.press("#prompt", "Enter");
  await page.waitForSelector("#approval[open]", { timeout: 20000 });
  const asked = await page.textContent("#approval-text");
  check("a write becomes an approval dialog", /write_file hello\.txt/.test(asked), asked);
  check("nothing is written before approval", !existsSync(join(ws, "hello.txt")));
  await page.screenshot({ path: join(artifacts, "approval.png") });
  await page.click("#approve");
  await page.waitForSelector(".msg.assistant:has-text('Done: I wrote hello.txt')", { timeout: 20000 });
  const result = await page.textContent(".tool .result");
  check("the tool call shows its result", /hello\.txt/.test(result || ""), result);
  check("the tool call shows its arguments", /hello from tether/.test(await page.textContent(".tool .args")));
  check("reasoning is shown collapsed", (await page.locator("details.reasoning").count()) >= 1);
  check("the file was written", existsSync(join(ws, "hello.txt")) && readFileSync(join(ws, "hello.txt"), "utf8") === "hello from tether\n");
  await page.waitForFunction(() => document.querySelector("#state").textContent.includes('"idle"'), null, { timeout: 10000 });
  check("the state panel follows STATE_SNAPSHOT/STATE_DELTA", /"tools"/.test(await page.textContent("#state")));
  await page.screenshot({ path: join(artifacts, "ui.png"), fullPage: true });

  await page.reload();
  await page.waitForSelector("#threads li", { timeout: 10000 });
  check("the token is kept in the browser", !(await page.locator("#token-dialog[open]").count()));
  await page.click("#threads li >> nth=0");
  await page.waitForSelector(".msg.assistant:has-text('Done: I wrote hello.txt')", { timeout: 10000 });
  check("a past thread reopens with its messages", (await page.locator(".msg.user:has-text('please write a greeting file')").count()) === 1);
  check("the reopened thread keeps the tool call and result", /hello\.txt/.test((await page.textContent(".tool .result")) || ""));
  await page.screenshot({ path: join(artifacts, "reopened.png"), fullPage: true });
  const agui = warnings.filter((w) => /AG-UI|verify|protocol|Cannot/i.test(w));
  check("the AG-UI client reported no warnings", agui.length === 0, agui.join(" | "));
} catch (e) {
  check("browser flow", false, String(e?.stack || e));
} finally {
  await browser.close();
  await stop(serve.child);
  await stop(fake.child);
  code = summary();
}
process.exit(code);
