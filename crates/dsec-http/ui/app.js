// The dsec console: a page of plain JavaScript over the /v1 API, served by the server
// itself (no build step, no CDN). The API key is kept in session storage and sent as
// x-api-key; every text from the API is set with textContent, never parsed as HTML.
"use strict";

const KEY = "dsec.key";
const $ = (sel) => document.querySelector(sel);
const state = { who: null, view: null, sandboxes: [], lastEvent: null, events: [], follow: null, timer: null, flash: null, deletedHere: new Set() };

// ------------------------------------------------------------------ API

class ApiError extends Error {
  constructor(status, code, message, requestId) {
    super(message);
    this.status = status;
    this.code = code;
    this.requestId = requestId;
  }
}

async function api(path, options = {}) {
  const headers = Object.assign({ "x-api-key": sessionStorage.getItem(KEY) || "" }, options.headers || {});
  let resp;
  try {
    resp = await fetch(path, Object.assign({}, options, { headers }));
  } catch (e) {
    throw new ApiError(0, "unreachable", "cannot reach the server (" + e.message + ")", null);
  }
  if (!resp.ok) {
    let code = "http_" + resp.status, message = resp.statusText, requestId = resp.headers.get("x-request-id");
    try {
      const body = await resp.json();
      code = body.error.code;
      message = body.error.message;
      requestId = body.error.request_id || requestId;
    } catch (_) { /* not an error body */ }
    if (resp.status === 401 && path !== "/v1/whoami") {
      signOut("The server no longer accepts this key: " + message);
    }
    throw new ApiError(resp.status, code, message, requestId);
  }
  if (resp.status === 204) return null;
  return options.raw ? resp : resp.json();
}

// ------------------------------------------------------------------ DOM helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "data") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

function fill(tbody, rows, empty) {
  tbody.replaceChildren(...rows);
  if (rows.length === 0 && empty) {
    const cols = tbody.parentElement.querySelectorAll("thead th").length || 1;
    tbody.append(el("tr", {}, el("td", { colspan: cols, class: "empty" }, empty)));
  }
}

const time = (ms) => (ms ? new Date(ms).toLocaleString() : "");
const bytes = (n) => {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
};
const labels = (l) => Object.entries(l || {}).map(([k, v]) => k + "=" + v).join(" ");

function status(text, isError) {
  const s = $("#status");
  s.textContent = text;
  s.classList.toggle("error", !!isError);
  s.hidden = !text;
}

function showError(e) {
  const id = e.requestId ? " (request " + e.requestId + ")" : "";
  status((e.code ? e.code + ": " : "") + e.message + id, true);
}

// ------------------------------------------------------------------ sign in

function canWrite() {
  return !!state.who && state.who.scopes.some((s) => s === "sandboxes" || s === "admin");
}

async function signIn(key) {
  sessionStorage.setItem(KEY, key);
  try {
    state.who = await api("/v1/whoami");
  } catch (e) {
    sessionStorage.removeItem(KEY);
    const why = e.status === 401 || e.status === 403
      ? "This key was refused: " + e.message
      : "Cannot sign in: " + e.message;
    showLogin(why);
    return;
  }
  $("#login").hidden = true;
  $("#app").hidden = false;
  const who = $("#who");
  who.replaceChildren(state.who.tenant + " / " + state.who.key_id);
  if (!canWrite()) who.append(el("span", { class: "badge", id: "read-only" }, "read-only"));
  document.querySelectorAll(".writes").forEach((n) => { n.hidden = !canWrite(); });
  follow();
  state.timer = setInterval(refresh, 5000);
  route();
}

function signOut(message) {
  closeTerminal();
  sessionStorage.removeItem(KEY);
  state.lastEvent = null;
  state.events = [];
  state.who = null;
  if (state.follow) state.follow.abort();
  state.follow = null;
  clearInterval(state.timer);
  showLogin(message);
}

function showLogin(message) {
  $("#app").hidden = true;
  $("#login").hidden = false;
  const err = $("#login-error");
  err.textContent = message || "";
  err.hidden = !message;
  $("#key").value = "";
  $("#key").focus();
}

// ------------------------------------------------------------------ live events

// Follows GET /v1/events (Server-Sent Events read with fetch: EventSource cannot send
// the key), from the last event seen; reconnects after a second when the stream ends.
async function follow() {
  const ctl = new AbortController();
  state.follow = ctl;
  const after = state.lastEvent === null ? "" : "?after=" + state.lastEvent;
  try {
    const resp = await api("/v1/events" + after, { raw: true, signal: ctl.signal });
    live(true);
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
        const name = (block.split("\n").find((l) => l.startsWith("event:")) || "").slice(6).trim();
        if (data && name !== "error") onEvent(JSON.parse(data));
      }
    }
  } catch (e) {
    if (ctl.signal.aborted) return;
  }
  live(false);
  if (state.follow === ctl && state.who) setTimeout(() => { if (state.follow === ctl) follow(); }, 1000);
}

// Whether the event stream is connected: the list follows changes as they happen, else
// it is refreshed every 5 s.
function live(on) {
  const n = $("#live");
  n.textContent = on ? "live" : "reconnecting";
  n.className = on ? "live on" : "live";
}

let refreshSoon = null;
function onEvent(ev) {
  state.lastEvent = ev.id;
  state.events.unshift(ev);
  state.events.length = Math.min(state.events.length, 500);
  if (state.view === "events") renderEvents();
  if (state.view === "sandbox" && ev.sandbox === state.arg && (ev.kind === "deleted" || ev.kind === "expired")) {
    // Gone: back to the list rather than asking for a record that is no more.
    if (!state.deletedHere.has(ev.sandbox)) state.flash = "Sandbox " + ev.sandbox + " was " + ev.kind + ".";
    location.hash = "sandboxes";
    return;
  }
  clearTimeout(refreshSoon);
  refreshSoon = setTimeout(refresh, 100);
}

// ------------------------------------------------------------------ views

function route() {
  if (!state.who) return;
  const hash = location.hash.replace(/^#/, "") || "sandboxes";
  const [view, arg] = hash.split("/");
  const name = ["sandboxes", "sandbox", "nodes", "images", "pools", "events"].includes(view) ? view : "sandboxes";
  const target = arg ? decodeURIComponent(arg) : null;
  if (name !== "sandbox" || target !== state.arg) {
    closeTerminal();
    $("#term").hidden = true;
    $("#term-state").textContent = "";
    $("#exec-out").hidden = true;
  }
  state.view = name;
  state.arg = target;
  document.querySelectorAll(".view").forEach((v) => { v.hidden = v.id !== "view-" + name; });
  document.querySelectorAll("#tabs a").forEach((a) => {
    a.classList.toggle("active", a.dataset.view === name || (name === "sandbox" && a.dataset.view === "sandboxes"));
  });
  status(state.flash || "");
  state.flash = null;
  refresh();
}

async function refresh() {
  if (!state.who) return;
  try {
    switch (state.view) {
      case "sandboxes": return await renderSandboxes();
      case "sandbox": return await renderSandbox(state.arg);
      case "nodes": return await renderNodes();
      case "images": return await renderImages();
      case "pools": return await renderPools();
      case "events": return renderEvents();
    }
  } catch (e) {
    showError(e);
  }
}

function matches(sb, words) {
  const hay = [sb.id, sb.state, sb.tenant || "", sb.image || "", sb.node || "", labels(sb.labels)].join(" ").toLowerCase();
  return words.every((w) => hay.includes(w));
}

async function renderSandboxes() {
  const list = await api("/v1/sandboxes");
  state.sandboxes = list.sandboxes;
  const words = $("#filter").value.toLowerCase().split(/\s+/).filter(Boolean);
  const shown = list.sandboxes.filter((sb) => matches(sb, words));
  shown.sort((a, b) => b.created_at - a.created_at);
  $("#sandbox-count").textContent = shown.length + " of " + list.sandboxes.length;
  fill($("#sandboxes tbody"), shown.map((sb) => el("tr", {
    class: "link", data: { id: sb.id }, onclick: () => { location.hash = "sandbox/" + encodeURIComponent(sb.id); },
  },
  el("td", { class: "mono" }, sb.id),
  el("td", { class: "state-" + sb.state }, sb.state),
  el("td", {}, sb.image || (sb.layers || []).join(" + ")),
  el("td", {}, sb.tenant || ""),
  el("td", {}, sb.node || ""),
  el("td", { class: "mono" }, labels(sb.labels)),
  el("td", {}, time(sb.created_at)),
  el("td", {}, time(sb.expires_at)))), "No sandboxes.");
}

async function renderSandbox(id) {
  $("#sandbox-title").textContent = id;
  const del = $("#delete");
  del.hidden = !canWrite();
  let sb;
  try {
    sb = await api("/v1/sandboxes/" + encodeURIComponent(id));
  } catch (e) {
    if (e.status === 404 || e.code === "expired") {
      state.flash = state.flash || "Sandbox " + id + " is gone.";
      location.hash = "sandboxes";
      return;
    }
    throw e;
  }
  const facts = [["state", sb.state], ["image", sb.image || ""], ["tenant", sb.tenant || ""], ["node", sb.node],
    ["ip", sb.ip || ""], ["backend", sb.backend], ["cpu / memory / disk",
      [sb.resources.cpu_millis, sb.resources.memory_mb, sb.resources.disk_mb].map((v) => v ?? "-").join(" / ")],
    ["labels", labels(sb.labels)], ["created", time(sb.created_at)], ["expires", time(sb.expires_at)],
    ["last active", time(sb.last_active_at)]];
  if (sb.failure) facts.push(["failure", sb.failure]);
  if (sb.unhealthy_cause) facts.push(["unhealthy", sb.unhealthy_cause]);
  $("#sandbox-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  const phases = (sb.timings && sb.timings.phases) || [];
  fill($("#phases tbody"), phases.map((p) => el("tr", {}, el("td", {}, p.phase), el("td", {}, p.ms.toFixed(2)))),
    "Not recorded.");
  $("#sandbox-json").textContent = JSON.stringify(sb, null, 2);
  const [procs, events] = await Promise.all([
    api("/v1/sandboxes/" + encodeURIComponent(id) + "/processes").catch(() => ({ processes: [] })),
    sandboxEvents(id),
  ]);
  fill($("#processes tbody"), procs.processes.map((p) => el("tr", {},
    el("td", {}, p.pid), el("td", {}, p.tag || ""),
    el("td", { class: "mono" }, Array.isArray(p.cmd) ? p.cmd.join(" ") : p.cmd),
    el("td", {}, p.exit ? "exited " + (p.exit.exit_code ?? "signal " + p.exit.signal) : "running"))), "None.");
  fill($("#sandbox-events tbody"), events.map((ev) => el("tr", {},
    el("td", {}, time(ev.at_ms)), el("td", {}, ev.kind), el("td", {}, ev.cause || ev.command || ""))), "None kept.");
}

async function sandboxEvents(id) {
  try {
    const resp = await api("/v1/events?after=0&no_follow=true&sandbox=" + encodeURIComponent(id), { raw: true });
    const text = await resp.text();
    return text.split("\n\n").map((b) => b.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join(""))
      .filter(Boolean).map((d) => JSON.parse(d)).filter((ev) => ev.kind);
  } catch (_) {
    return [];
  }
}

// A sandbox limit as shown: 0 (or none) means the node sets none.
function limit(max) {
  return max ? String(max) : "no limit";
}

async function renderNodes() {
  const [health, utilization] = await Promise.all([api("/v1/health"), api("/v1/utilization")]);
  renderUtilization(utilization);
  let rows = [];
  try {
    const list = await api("/v1/nodes");
    rows = list.nodes.map((n) => el("tr", {},
      el("td", {}, n.name), el("td", {}, !n.live ? "lost" : n.draining ? "draining" : "ready"),
      el("td", {}, n.sandboxes + " / " + limit(n.max_sandboxes)),
      el("td", {}, (n.cpu_millis_used / 1000).toFixed(1) + " / " + (n.cpu_millis / 1000).toFixed(1)),
      el("td", {}, bytes(n.memory_bytes_used) + " / " + bytes(n.memory_bytes)),
      el("td", {}, n.version || "")));
  } catch (_) {
    // Not allowed to list nodes: the health still says what this server holds.
  }
  if (rows.length === 0) {
    const c = health.capacity || {};
    rows = [el("tr", {},
      el("td", {}, health.node), el("td", {}, health.status),
      el("td", {}, health.sandboxes + " / " + limit(c.max_sandboxes)),
      el("td", {}, ((c.cpu_millis_requested || 0) / 1000).toFixed(1) + " / " + ((c.cpu_millis_allocatable || 0) / 1000).toFixed(1)),
      el("td", {}, bytes(c.memory_available_bytes) + " free"),
      el("td", {}, health.version))];
  }
  fill($("#nodes tbody"), rows, "No nodes.");
  const layers = await api("/v1/images/layers").catch(() => ({ lazy: [] }));
  fill($("#layers tbody"), layers.lazy.map((l) => el("tr", {},
    el("td", { class: "mono" }, l.digest.slice(0, 19)), el("td", {}, bytes(l.cached_bytes)),
    el("td", {}, bytes(l.fetched_bytes)), el("td", {}, l.faults),
    el("td", {}, (l.mean_fetch_us / 1000).toFixed(2) + " ms"))), "No layers served on demand.");
}

// The utilization chart: sandboxes (scaled to the most in the hour) and CPU asked for
// (share of what the nodes offer), one point per sample.
function renderUtilization(u) {
  const svg = $("#utilization");
  const NS = "http://www.w3.org/2000/svg";
  const samples = u.samples || [];
  const [w, h] = [720, 160];
  const most = Math.max(1, ...samples.map((s) => s.sandboxes));
  // The span the samples cover (at least ten of them, at most the hour), so a server
  // that started a minute ago does not draw a sliver at the right edge.
  const t1 = samples.length ? samples[samples.length - 1].at_ms : Date.now();
  const first = samples.length ? samples[0].at_ms : t1;
  const t0 = t1 - Math.min(3600 * 1000, Math.max(t1 - first, 10 * (u.interval_s || 10) * 1000));
  const x = (s) => ((s.at_ms - t0) / (t1 - t0 || 1)) * w;
  const line = (cls, y) => {
    const p = document.createElementNS(NS, "polyline");
    p.setAttribute("class", cls);
    p.setAttribute("points", samples.map((s) => x(s).toFixed(1) + "," + (h - 4 - y(s) * (h - 8)).toFixed(1)).join(" "));
    return p;
  };
  svg.replaceChildren(
    line("sandboxes", (s) => s.sandboxes / most),
    line("cpu", (s) => (s.cpu_millis_allocatable ? Math.min(1, s.cpu_millis_requested / s.cpu_millis_allocatable) : 0)),
  );
  const last = samples[samples.length - 1];
  $("#utilization-legend").textContent = last
    ? "sandboxes (blue, up to " + most + "): " + last.sandboxes + " now, " + last.ready + " ready, " + last.paused +
      " paused; CPU asked for (orange, share of " + (last.cpu_millis_allocatable / 1000).toFixed(1) + " CPUs): " +
      (last.cpu_millis_requested / 1000).toFixed(1) + "; " + samples.length + " samples every " + u.interval_s + " s, over the last " + Math.round((t1 - t0) / 60000) + " min"
    : "No samples yet.";
}

async function renderImages() {
  const list = await api("/v1/images");
  fill($("#images tbody"), list.images.map((i) => el("tr", {},
    el("td", {}, i.name), el("td", { class: "mono" }, i.digest.slice(0, 19)),
    el("td", {}, (i.layers || []).length || 1), el("td", {}, bytes(i.size_bytes)),
    el("td", {}, time(i.created_at)), el("td", {}, i.source))), "No images.");
}

async function renderPools() {
  const pools = await api("/v1/pools").catch(() => ({ pools: [] }));
  fill($("#pools tbody"), pools.pools.map((p) => el("tr", {},
    el("td", {}, p.spec.name), el("td", {}, p.tenant), el("td", {}, p.target), el("td", {}, p.ready),
    el("td", {}, p.creating), el("td", {}, p.claimed), el("td", {}, p.queue_length),
    el("td", {}, p.last_error || ""))), "No pools.");
  const queue = await api("/v1/queue").catch((e) => ({ error: e.message }));
  $("#queue").textContent = JSON.stringify(queue, null, 2);
}

function renderEvents() {
  fill($("#events tbody"), state.events.map((ev) => el("tr", {},
    el("td", {}, ev.id), el("td", {}, time(ev.at_ms)), el("td", {}, ev.kind),
    el("td", { class: "mono" }, ev.sandbox || (ev.pool ? "pool/" + ev.pool : "") || (ev.node ? "node/" + ev.node : "")),
    el("td", {}, ev.tenant || ""),
    el("td", {}, ev.cause || ev.command || ""))), "No events since the console opened.");
}

// ------------------------------------------------------------------ actions

async function deleteSandbox() {
  const del = $("#delete");
  if (!del.classList.contains("armed")) {
    del.classList.add("armed");
    del.textContent = "Confirm delete";
    setTimeout(() => { del.classList.remove("armed"); del.textContent = "Delete"; }, 5000);
    return;
  }
  del.classList.remove("armed");
  del.textContent = "Delete";
  const id = state.arg;
  state.deletedHere.add(id);
  try {
    await api("/v1/sandboxes/" + encodeURIComponent(id), { method: "DELETE" });
    const done = "Deleted " + id + ".";
    // Its deleted event may have brought the list back already (its route may still
    // be on its way): say it now, and to that route; the note is dropped after it.
    status(done);
    state.flash = done;
    location.hash = "sandboxes";
    setTimeout(() => { if (state.flash === done) state.flash = null; }, 0);
  } catch (e) {
    state.deletedHere.delete(id);
    showError(e);
  }
}

async function runCommand(ev) {
  ev.preventDefault();
  const out = $("#exec-out");
  out.hidden = false;
  out.textContent = "$ " + $("#exec-cmd").value + "\n";
  try {
    const r = await api("/v1/sandboxes/" + encodeURIComponent(state.arg) + "/exec", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ cmd: $("#exec-cmd").value, timeout_s: 60 }),
    });
    out.append(r.stdout, r.stderr, "[exit " + (r.exit_code ?? "signal " + r.signal) + (r.oom_killed ? ", OOM-killed" : "") + "]\n");
  } catch (e) {
    out.append("error: " + e.message + "\n");
  }
}

// ------------------------------------------------------------------ terminal

// A shell on a PTY in the sandbox over a WebSocket: keys typed in the box go to it as
// they are pressed; what it prints is shown with terminal control sequences dropped
// (this is a plain text view, not a terminal emulator).
const term = { ws: null, text: "" };
const TERM_KEYS = {
  Enter: "\r", Backspace: "\x7f", Tab: "\t", Escape: "\x1b", ArrowUp: "\x1b[A", ArrowDown: "\x1b[B",
  ArrowRight: "\x1b[C", ArrowLeft: "\x1b[D", Home: "\x1b[H", End: "\x1b[F", Delete: "\x1b[3~",
};

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  let bin = "";
  bytes.forEach((b) => { bin += String.fromCharCode(b); });
  return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function termWrite(data) {
  const plain = data
    .replace(/\x1b\][^\x07\x1b]*(\x07|\x1b\\)/g, "")
    .replace(/\x1b\[[0-?]*[ -\/]*[@-~]/g, "")
    .replace(/\x1b[@-Z\\-_]/g, "");
  let t = term.text;
  for (const c of plain) {
    if (c === "\r" || c === "\x07") continue;
    if (c === "\b") { if (t.length && !t.endsWith("\n")) t = t.slice(0, -1); continue; }
    t += c;
  }
  term.text = t.length > 200000 ? t.slice(-150000) : t;
  const pre = $("#term");
  pre.textContent = term.text;
  pre.scrollTop = pre.scrollHeight;
}

function termSend(input) {
  if (term.ws && term.ws.readyState === WebSocket.OPEN) term.ws.send(JSON.stringify(input));
}

function openTerminal() {
  closeTerminal();
  term.text = "";
  const pre = $("#term");
  pre.hidden = false;
  pre.textContent = "";
  $("#term-state").textContent = "connecting";
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const url = scheme + "//" + location.host + "/v1/sandboxes/" + encodeURIComponent(state.arg) + "/terminal?cols=100&rows=30";
  const ws = new WebSocket(url, ["dsec.terminal.v1", "dsec.key." + base64url(sessionStorage.getItem(KEY) || "")]);
  term.ws = ws;
  ws.onopen = () => {
    $("#term-state").textContent = "connected";
    $("#term-open").hidden = true;
    $("#term-close").hidden = false;
    pre.focus();
  };
  ws.onmessage = (m) => {
    const ev = JSON.parse(m.data);
    if (ev.type === "stdout" || ev.type === "stderr") termWrite(ev.data);
    else if (ev.type === "exit") termWrite("\n[exited " + (ev.exit_code ?? "on signal " + ev.signal) + "]\n");
    else if (ev.type === "error") termWrite("\n[" + ev.error.code + ": " + ev.error.message + "]\n");
  };
  ws.onclose = (ev) => {
    if (term.ws !== ws) return;
    term.ws = null;
    $("#term-state").textContent = ev.code === 1000 || ev.code === 1005 ? "closed" : "closed (" + ev.code + ")";
    $("#term-open").hidden = false;
    $("#term-close").hidden = true;
  };
}

function closeTerminal() {
  if (term.ws) {
    const ws = term.ws;
    term.ws = null;
    ws.close();
    $("#term-state").textContent = "closed";
    $("#term-open").hidden = false;
    $("#term-close").hidden = true;
  }
}

function termKey(e) {
  if (!term.ws) return;
  let data = null;
  if (e.ctrlKey && e.key.length === 1) {
    const c = e.key.toUpperCase().charCodeAt(0);
    if (c >= 64 && c <= 95) data = String.fromCharCode(c - 64);
  } else if (e.key.length === 1 && !e.metaKey && !e.altKey) {
    data = e.key;
  } else {
    data = TERM_KEYS[e.key] || null;
  }
  if (data !== null) {
    e.preventDefault();
    termSend({ type: "stdin", data });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("#login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    signIn($("#key").value.trim());
  });
  $("#logout").addEventListener("click", () => signOut(""));
  $("#filter").addEventListener("input", () => refresh());
  $("#delete").addEventListener("click", deleteSandbox);
  $("#exec-form").addEventListener("submit", runCommand);
  $("#term-open").addEventListener("click", openTerminal);
  $("#term-close").addEventListener("click", closeTerminal);
  $("#term").addEventListener("keydown", termKey);
  $("#term").addEventListener("paste", (e) => {
    e.preventDefault();
    termSend({ type: "stdin", data: e.clipboardData.getData("text") });
  });
  window.addEventListener("hashchange", route);
  const key = sessionStorage.getItem(KEY);
  if (key) signIn(key); else showLogin("");
});
