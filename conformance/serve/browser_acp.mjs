// The browser test for an ACP agent: Debian's chromium driven by playwright-core against tether
// serve hosting the @agentclientprotocol/sdk example agent (a real subprocess, run in the agent's
// workspace root). The agent's mid-turn permission request appears in the UI as the approval
// dialog; approving it in the browser lets the held turn finish; the thread reopens from the list
// with its messages. Screenshots go to artifacts/.
import { existsSync, mkdirSync } from "node:fs";
import { join } from "node:path";
import { check, launchChromium, startServe, stop, summary, tempDir } from "./lib.mjs";

const ACP_AGENT = new URL("../acp/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js", import.meta.url).pathname;
if (!existsSync(ACP_AGENT)) {
  check("the ACP example agent is installed (conformance/acp/setup.sh)", false, ACP_AGENT);
  process.exit(summary());
}
const artifacts = new URL("artifacts/", import.meta.url).pathname;
mkdirSync(artifacts, { recursive: true });
const dir = tempDir("tether-ui-acp-");
const ws = join(dir, "ws");
mkdirSync(ws);
const serve = await startServe({
  dir,
  token: "generate",
  config: `
[agents.example]
provider = "acp"
command = ["node", ${JSON.stringify(ACP_AGENT)}]
description = "The ACP SDK's example agent"
[agents.example.workspace]
root = "${ws}"
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
  await page.goto(serve.uiUrl);
  await page.waitForFunction(() => document.querySelector("#agent-select")?.options.length > 0, null, { timeout: 10000 });
  check("the ACP agent is listed", (await page.locator("#agent-select option").count()) === 1);
  await page.fill("#prompt", "improve the project config");
  await page.press("#prompt", "Enter");
  await page.waitForSelector("#approval[open]", { timeout: 30000 });
  const asked = await page.textContent("#approval-text");
  check("the agent's permission request becomes the approval dialog", /configuration file/i.test(asked || ""), asked);
  check(
    "the text the agent streamed before asking is shown",
    (await page.locator(".msg.assistant:has-text(\"I'll help you with that\")").count()) >= 1,
  );
  await page.screenshot({ path: join(artifacts, "acp-approval.png") });
  await page.click("#approve");
  await page.waitForSelector(".msg.assistant:has-text('successfully updated the configuration')", { timeout: 30000 });
  check("approved in the browser, the held turn finishes", true);
  await page.screenshot({ path: join(artifacts, "acp-ui.png"), fullPage: true });

  await page.reload();
  await page.waitForSelector("#threads li", { timeout: 10000 });
  await page.click("#threads li >> nth=0");
  await page.waitForSelector(".msg.assistant:has-text('successfully updated the configuration')", { timeout: 10000 });
  check(
    "the thread reopens with the user's message",
    (await page.locator(".msg.user:has-text('improve the project config')").count()) === 1,
  );
  await page.screenshot({ path: join(artifacts, "acp-reopened.png"), fullPage: true });
  const agui = warnings.filter((w) => /AG-UI|verify|protocol|Cannot/i.test(w));
  check("the AG-UI client reported no warnings", agui.length === 0, agui.join(" | "));
} catch (e) {
  check("browser flow (ACP agent)", false, String(e?.stack || e));
} finally {
  await browser.close();
  await stop(serve.child);
  code = summary();
}
process.exit(code);
