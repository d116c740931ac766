// The tether serve web UI: pick an agent, chat over AG-UI (@ag-ui/client), approve interrupts,
// answer a tool server's questions (MCP elicitations), watch the state panel, reopen past threads.
import { HttpAgent } from "@ag-ui/client";
import { LIMITS, answer, collect, parseElicitation, visible } from "./elicit.js";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "tether.token";
let agents = [];
let agentName = "";
let agent = null; // the HttpAgent of the current thread
let running = false;
let renderQueued = false;
let stateSeen = false; // whether the current thread's agent has published state (STATE_SNAPSHOT/DELTA)

// The token: `tether serve` prints the UI's URL with it in the fragment (#token=…), which a
// browser never sends to a server (so it stays out of logs and Referer). Taken from there once,
// kept in this tab's sessionStorage, and removed from the address bar and history.
function takeTokenFromUrl() {
  const params = new URLSearchParams(location.hash.slice(1));
  const t = params.get("token");
  if (t === null) return;
  sessionStorage.setItem(TOKEN_KEY, t.trim());
  params.delete("token");
  const rest = params.toString();
  history.replaceState(null, "", location.pathname + location.search + (rest ? `#${rest}` : ""));
}
takeTokenFromUrl();
// Older versions kept the token in localStorage (shared by every tab, kept forever): drop it.
localStorage.removeItem(TOKEN_KEY);

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

function headers() {
  const t = token();
  return t ? { Authorization: `Bearer ${t}` } : {};
}

function uid(prefix) {
  const b = new Uint8Array(8);
  crypto.getRandomValues(b);
  return prefix + Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

function askToken() {
  return new Promise((resolve) => {
    const d = $("token-dialog");
    $("token-input").value = token();
    d.onclose = () => {
      sessionStorage.setItem(TOKEN_KEY, $("token-input").value.trim());
      resolve();
    };
    d.showModal();
  });
}

async function api(path) {
  for (let attempt = 0; attempt < 3; attempt++) {
    const r = await fetch(path, { headers: headers() });
    if (r.status === 401) {
      await askToken();
      continue;
    }
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status} ${await r.text()}`);
    return r.json();
  }
  throw new Error("the server refused the token");
}

function banner(text) {
  const b = $("banner");
  b.textContent = text || "";
  b.hidden = !text;
}

function setStatus(s) {
  $("status").textContent = s;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function textOf(content) {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map((p) => (p.type === "text" ? p.text : "")).join("");
  return content == null ? "" : JSON.stringify(content);
}

function prettyArgs(s) {
  try {
    return JSON.stringify(JSON.parse(s), null, 2);
  } catch {
    return s || "";
  }
}

function render() {
  renderQueued = false;
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  box.replaceChildren();
  if (!agent) return;
  const results = new Map();
  for (const m of agent.messages) if (m.role === "tool") results.set(m.toolCallId, m);
  for (const m of agent.messages) {
    if (m.role === "user") {
      box.append(el("div", "msg user", textOf(m.content)));
    } else if (m.role === "reasoning") {
      const d = el("details", "msg reasoning");
      d.append(el("summary", "", "Reasoning"), el("div", "", m.content || ""));
      box.append(d);
    } else if (m.role === "assistant") {
      if (m.content) box.append(el("div", "msg assistant", m.content));
      for (const c of m.toolCalls || []) {
        const d = el("details", "tool");
        d.open = true;
        d.dataset.toolCallId = c.id;
        d.append(el("summary", "", `tool · ${c.function.name}`), el("pre", "args", prettyArgs(c.function.arguments)));
        const r = results.get(c.id);
        if (r) d.append(el("pre", r.error ? "result error" : "result", textOf(r.content)));
        else d.append(el("pre", "result pending", "…"));
        box.append(d);
      }
    }
  }
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function queueRender() {
  if (!renderQueued) {
    renderQueued = true;
    requestAnimationFrame(render);
  }
}

// The state panel shows only what the agent published: an agent that publishes none (those
// served by ThreadAgent, for one) gets a note, not an invented `{}`.
function showState(state) {
  const s = $("state");
  s.classList.toggle("none", !stateSeen);
  s.textContent = stateSeen ? JSON.stringify(state ?? {}, null, 2) : "This agent has published no state.";
}

function newAgent(threadId, messages) {
  agent = new HttpAgent({
    url: `/v1/agents/${encodeURIComponent(agentName)}/run`,
    headers: headers(),
    threadId,
    initialMessages: messages || [],
    initialState: {},
  });
  stateSeen = false;
  showState();
  render();
  markCurrent();
}

function approve(interrupt) {
  return new Promise((resolve) => {
    const d = $("approval");
    // What the user approves comes from the model or a remote agent: shown as text, bounded, and
    // with control and bidi characters visible (they could make it read as something else).
    $("approval-text").textContent = visible(interrupt.message || `Allow ${interrupt.reason}?`, LIMITS.message);
    let args = "";
    for (const m of agent.messages)
      for (const c of m.toolCalls || []) if (c.id === interrupt.toolCallId) args = prettyArgs(c.function.arguments);
    $("approval-args").textContent = visible(args, LIMITS.string);
    d.onclose = () => resolve(d.returnValue === "approve");
    d.returnValue = "";
    d.showModal();
  });
}

// The tool calls of the thread still waiting for their result (the one whose server asks).
function pendingTools() {
  const done = new Set(agent.messages.filter((m) => m.role === "tool").map((m) => m.toolCallId));
  const names = [];
  for (const m of agent.messages) for (const c of m.toolCalls || []) if (!done.has(c.id)) names.push(c.function.name);
  return names;
}

let fieldSeq = 0;

// One field of an elicitation form: its element, and a reader of the user's input. Element ids
// are our own (never the server's field names, which could collide with the page's).
function fieldInput(f) {
  const id = `elicit-f${++fieldSeq}`;
  const box = el(f.kind === "multiselect" ? "fieldset" : "div", "field");
  box.dataset.field = f.name;
  const title = `${f.label}${f.required ? " (required)" : ""}`;
  const desc = f.description ? el("div", "desc", f.description) : null;
  const err = el("div", "err");
  let read = () => undefined;
  if (f.kind === "unsupported") {
    box.classList.add("unsupported");
    box.append(el("label", "", title), el("div", "desc", `Unsupported: ${f.unsupported}`));
    if (desc) box.append(desc);
    return { box, read, err };
  }
  if (f.kind === "boolean") {
    const input = el("input");
    input.type = "checkbox";
    input.id = id;
    input.checked = f.default === true;
    const label = el("label");
    label.htmlFor = id;
    label.append(input, document.createTextNode(` ${title}`));
    box.append(label);
    if (desc) box.append(desc);
    box.append(err);
    // Untouched, it reads as unset (an optional boolean is then not sent): only what the user set
    // is their answer.
    let touched = false;
    input.addEventListener("change", () => (touched = true));
    return { box, read: () => (touched ? input.checked : undefined), err };
  }
  if (f.kind === "multiselect") {
    box.append(el("legend", "", title));
    if (desc) box.append(desc);
    const boxes = f.options.map((o) => {
      const input = el("input");
      input.type = "checkbox";
      input.value = o.value;
      input.checked = Array.isArray(f.default) && f.default.includes(o.value);
      const label = el("label", "choice");
      label.append(input, document.createTextNode(` ${o.label}`));
      box.append(label);
      return input;
    });
    box.append(err);
    return { box, read: () => boxes.filter((b) => b.checked).map((b) => b.value), err };
  }
  const label = el("label", "", title);
  label.htmlFor = id;
  box.append(label);
  if (desc) box.append(desc);
  let input;
  if (f.kind === "select") {
    input = el("select");
    input.append(new Option(f.required ? "— choose —" : "(none)", ""));
    for (const o of f.options) input.append(new Option(o.label, o.value));
    input.value = f.default ?? "";
    read = () => input.value;
  } else if (f.kind === "number" || f.kind === "integer") {
    input = el("input");
    input.type = "number";
    input.step = f.kind === "integer" ? "1" : "any";
    if (f.minimum !== undefined) input.min = String(f.minimum);
    if (f.maximum !== undefined) input.max = String(f.maximum);
    if (f.default !== undefined) input.value = String(f.default);
    // A number input reports text it cannot read as empty: say so instead.
    read = () => (input.validity.badInput ? "not a number" : input.value);
  } else {
    input = el("input");
    input.type = { email: "email", uri: "url", date: "date" }[f.format] || "text";
    if (f.format === "date-time") input.placeholder = "2026-12-01T09:30:00Z";
    input.maxLength = f.maxLength;
    if (f.minLength) input.minLength = f.minLength;
    if (f.default !== undefined) input.value = f.default;
    read = () => input.value;
  }
  input.id = id;
  input.autocomplete = "off";
  box.append(input, err);
  return { box, read, err };
}

// Asks the user an elicitation: the server's message (as text), the form its schema describes,
// Accept (only once the input is valid, and never for a request that is not fully understood),
// Decline, Cancel (also Escape). Resolves with the resume entry.
function elicit(interrupt) {
  return new Promise((resolve) => {
    const d = $("elicit");
    const form = $("elicit-form");
    const parsed = parseElicitation(interrupt);
    const pending = pendingTools();
    $("elicit-source").textContent = pending.length
      ? `The server of the tool ${visible(pending.join(", "), 200)} asks, while the call waits:`
      : "A tool's server asks, while its call waits:";
    $("elicit-text").textContent = parsed.message || "(no message)";
    const url = $("elicit-url");
    url.replaceChildren();
    url.hidden = parsed.mode !== "url";
    if (parsed.mode === "url") {
      url.append(document.createTextNode("It asks you to open: "));
      if (parsed.href) {
        const a = el("a", "", parsed.url);
        a.href = parsed.href;
        a.target = "_blank";
        a.rel = "noopener noreferrer";
        url.append(a);
      } else url.append(el("code", "", parsed.url));
    }
    const problems = $("elicit-problems");
    problems.replaceChildren(...parsed.problems.map((p) => el("li", "", p)));
    problems.hidden = !parsed.problems.length;
    const fields = parsed.fields.map((f) => [f, fieldInput(f)]);
    $("elicit-fields").replaceChildren(...fields.map(([, x]) => x.box));
    const error = $("elicit-error");
    error.hidden = true;
    const blocked = parsed.mode === "unsupported" || parsed.problems.length > 0;
    $("elicit-accept").disabled = blocked;
    $("elicit-accept").title = blocked ? "This request is not fully supported: decline or cancel it." : "";
    let content = null;
    // Enter in a field must not submit (the first button is Cancel, and nothing is sent unread).
    form.onkeydown = (e) => {
      if (e.key === "Enter" && e.target instanceof HTMLInputElement) e.preventDefault();
    };
    form.onsubmit = (e) => {
      if (e.submitter?.value !== "accept") return;
      if (parsed.mode === "url") return;
      const r = collect(parsed, new Map(fields.map(([f, x]) => [f.name, x.read()])));
      for (const [f, x] of fields) x.err.textContent = r.errors.get(f.name) || "";
      error.textContent = r.errors.get("") || (r.blocked ? "This request can only be declined or cancelled." : "Check the fields marked above.");
      error.hidden = r.content !== null;
      if (r.content === null) {
        e.preventDefault();
        return;
      }
      content = r.content;
    };
    d.onclose = () => {
      const v = d.returnValue;
      if (v === "accept" && !blocked && (parsed.mode === "url" || content)) resolve(answer(interrupt.id, "accept", content));
      else resolve(answer(interrupt.id, v === "decline" ? "decline" : "cancel"));
    };
    d.returnValue = "";
    d.showModal();
    $("elicit-fields").scrollTop = 0;
    // Start in the first field (the dialog would focus the first scrollable box).
    $("elicit-fields").querySelector("input, select")?.focus();
  });
}

async function runOnce(resume) {
  let finished = null;
  agent.headers = headers();
  await agent.runAgent(
    { runId: uid("run_"), resume },
    {
      onMessagesChanged: () => queueRender(),
      onStateSnapshotEvent: () => {
        stateSeen = true;
      },
      onStateDeltaEvent: () => {
        stateSeen = true;
      },
      onStateChanged: ({ state }) => showState(state),
      onRunStartedEvent: () => setStatus("running"),
      onRunFinishedEvent: ({ event }) => {
        finished = event;
      },
      onRunErrorEvent: ({ event }) => {
        banner(`Run failed (${event.code || "error"}): ${event.message}`);
      },
    },
  );
  return finished;
}

async function send(text) {
  if (running || !agent) return;
  running = true;
  banner("");
  $("send").disabled = true;
  try {
    if (text) agent.addMessage({ id: uid("msg_"), role: "user", content: text });
    queueRender();
    let resume;
    for (;;) {
      const fin = await runOnce(resume);
      render();
      const interrupts = fin?.outcome?.type === "interrupt" ? fin.outcome.interrupts : [];
      if (!interrupts.length) break;
      setStatus("waiting for you");
      resume = [];
      for (const i of interrupts) {
        if (i.reason === "elicitation") {
          resume.push(await elicit(i));
          continue;
        }
        const yes = await approve(i);
        resume.push(
          yes
            ? { interruptId: i.id, status: "resolved", payload: { approved: true } }
            : { interruptId: i.id, status: "cancelled" },
        );
      }
    }
  } catch (e) {
    banner(String(e?.message || e));
  } finally {
    running = false;
    $("send").disabled = false;
    setStatus("idle");
    render();
    loadThreads();
  }
}

function markCurrent() {
  for (const li of $("threads").children) li.classList.toggle("current", agent && li.dataset.thread === agent.threadId);
}

async function loadThreads() {
  try {
    const { threads } = await api(`/v1/threads?agent=${encodeURIComponent(agentName)}`);
    const ul = $("threads");
    ul.replaceChildren();
    for (const t of threads) {
      const li = el("li", "", t.title || t.threadId);
      li.dataset.thread = t.threadId;
      li.title = `${t.threadId} — ${new Date(t.updatedMs).toLocaleString()}`;
      li.onclick = () => openThread(t.threadId);
      ul.append(li);
    }
    markCurrent();
  } catch (e) {
    banner(String(e?.message || e));
  }
}

async function openThread(threadId) {
  if (running) return;
  try {
    const { messages } = await api(`/v1/threads/${encodeURIComponent(threadId)}/messages`);
    newAgent(threadId, messages);
    const u = new URL(location.href);
    u.searchParams.set("thread", threadId);
    history.replaceState(null, "", u);
  } catch (e) {
    banner(String(e?.message || e));
  }
}

function newThread() {
  if (running) return;
  newAgent(uid("thread_"), []);
  const u = new URL(location.href);
  u.searchParams.delete("thread");
  history.replaceState(null, "", u);
}

async function init() {
  try {
    ({ agents } = await api("/v1/agents"));
  } catch (e) {
    banner(String(e?.message || e));
    return;
  }
  const sel = $("agent-select");
  for (const a of agents) sel.append(new Option(a.name, a.name));
  const pick = (name) => {
    agentName = name;
    const a = agents.find((x) => x.name === name);
    $("agent-desc").textContent = a ? `${a.description || ""} ${a.model ? `(${a.model})` : ""}`.trim() : "";
    newThread();
    loadThreads();
  };
  sel.onchange = () => pick(sel.value);
  $("new-thread").onclick = newThread;
  $("composer").onsubmit = (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text) return;
    $("prompt").value = "";
    send(text);
  };
  $("prompt").onkeydown = (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  };
  if (agents.length) pick(agents[0].name);
  const t = new URL(location.href).searchParams.get("thread");
  if (t) openThread(t);
}

init();
