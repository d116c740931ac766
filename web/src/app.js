// The tether serve web UI: pick an agent, chat over AG-UI (@ag-ui/client), approve interrupts,
// watch the state panel, reopen past threads.
import { HttpAgent } from "@ag-ui/client";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "tether.token";
let agents = [];
let agentName = "";
let agent = null; // the HttpAgent of the current thread
let running = false;
let renderQueued = false;

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

function showState(state) {
  $("state").textContent = JSON.stringify(state ?? {}, null, 2);
}

function newAgent(threadId, messages) {
  agent = new HttpAgent({
    url: `/v1/agents/${encodeURIComponent(agentName)}/run`,
    headers: headers(),
    threadId,
    initialMessages: messages || [],
    initialState: {},
  });
  showState({});
  render();
  markCurrent();
}

function approve(interrupt) {
  return new Promise((resolve) => {
    const d = $("approval");
    $("approval-text").textContent = interrupt.message || `Allow ${interrupt.reason}?`;
    let args = "";
    for (const m of agent.messages)
      for (const c of m.toolCalls || []) if (c.id === interrupt.toolCallId) args = prettyArgs(c.function.arguments);
    $("approval-args").textContent = args;
    d.onclose = () => resolve(d.returnValue === "approve");
    d.returnValue = "";
    d.showModal();
  });
}

async function runOnce(resume) {
  let finished = null;
  agent.headers = headers();
  await agent.runAgent(
    { runId: uid("run_"), resume },
    {
      onMessagesChanged: () => queueRender(),
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
      setStatus("waiting for approval");
      resume = [];
      for (const i of interrupts) {
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
