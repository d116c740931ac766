// The browser test: Debian's chromium driven by playwright-core against tether serve and the
// testkit's fake OpenAI server. tether serve generates its token; the UI is opened at the URL it
// printed (the token in the fragment), takes the token, keeps it for the tab and strips it from
// the address bar. Send a prompt that leads to a write needing approval, approve it in the
// dialog, see the tool result and the final text, reload, reopen the thread from the list.
// Screenshots go to artifacts/.
import { existsSync, mkdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { check, launchChromium, startFake, startServe, stop, summary, tempDir } from "./lib.mjs";

const artifacts = new URL("artifacts/", import.meta.url).pathname;
mkdirSync(artifacts, { recursive: true });
const dir = tempDir("tether-ui-");
const ws = join(dir, "ws");
mkdirSync(ws);
const fake = await startFake("ui");
const serve = await startServe({
  dir,
  token: "generate",
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
const browser = await launchChromium();
let code = 1;
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
  const warnings = [];
  page.on("console", (m) => {
    if (m.type() === "warning" || m.type() === "error") warnings.push(m.text());
  });
  // Without the token the UI asks for it (and the API refuses).
  const bare = await browser.newPage();
  await bare.goto(serve.url + "/");
  await bare.waitForSelector("#token-dialog[open]", { timeout: 10000 });
  check("without the token the UI asks for it", true);
  await bare.close();

  check("the printed URL carries the token in its fragment", serve.uiUrl === `${serve.url}/#token=${serve.token}`, serve.uiUrl);
  const requests = [];
  page.on("request", (r) => requests.push({ url: r.url(), auth: r.headers().authorization || "" }));
  await page.goto(serve.uiUrl);
  await page.waitForFunction(() => document.querySelector("#agent-select")?.options.length > 0, null, { timeout: 10000 });
  check("agents are listed", (await page.locator("#agent-select option").count()) === 1);
  check("the UI took the token without asking", (await page.locator("#token-dialog[open]").count()) === 0);
  check("the token is gone from the address bar", !page.url().includes(serve.token) && !page.url().includes("#"), page.url());
  check("the token is kept in sessionStorage", (await page.evaluate(() => sessionStorage.getItem("tether.token"))) === serve.token);
  check("and not in localStorage", (await page.evaluate(() => localStorage.getItem("tether.token"))) === null);

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

  const v1 = requests.filter((r) => new URL(r.url).pathname.startsWith("/v1/"));
  check(`every /v1 call carried the bearer token (${v1.length} calls)`, v1.length > 0 && v1.every((r) => r.auth === `Bearer ${serve.token}`), JSON.stringify(v1.filter((r) => r.auth !== `Bearer ${serve.token}`)));
  check("no request URL carried the token", requests.every((r) => !r.url.includes(serve.token)));

  await page.reload();
  await page.waitForSelector("#threads li", { timeout: 10000 });
  check("the token is kept across a reload of the tab", !(await page.locator("#token-dialog[open]").count()));
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
