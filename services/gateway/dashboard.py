"""The dashboard page: one self-contained HTML document, no external assets, no build step.

It polls the gateway's JSON reads every ``POLL_MS`` (``/v1/status``, ``/v1/targets``,
``/v1/workers``, ``/v1/versions/series``, ``/v1/dead-letters``) and renders the fleet
overview, the per-target, per-worker and per-identity tables, the per-version success-rate
chart (inline SVG drawn by the page's own script), the quarantines and proposals, the dead
letters and the pause switch. Control buttons POST with the token the operator typed
(kept in the tab's ``sessionStorage`` only). Everything read from the fleet is written
with ``textContent`` (or as an SVG attribute computed from numbers), never parsed as HTML.
See docs/dashboard.md.
"""

from __future__ import annotations

POLL_MS = 2000

DASHBOARD_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>jetfleet</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5rem; color: #1d2733; }
  h1 { font-size: 1.4rem; margin: 0 0 .25rem; }
  h2 { font-size: 1.05rem; margin: 1.4rem 0 .4rem; }
  p.meta { color: #5b6775; margin: 0 0 .6rem; }
  table { border-collapse: collapse; min-width: 36rem; margin-bottom: .4rem; }
  th, td { padding: .25rem .7rem; border-bottom: 1px solid #d8dee6; }
  th { text-align: left; background: #f2f5f8; }
  td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
  tfoot td { font-weight: 600; border-top: 2px solid #9aa6b3; }
  .error, .bad { color: #a4161a; }
  .good { color: #1b7a3a; }
  .controls { background: #f7f9fb; border: 1px solid #d8dee6; padding: .5rem .7rem; }
  .controls input, .controls select { margin-right: .5rem; }
  .empty { color: #5b6775; font-style: italic; }
  #chart { border: 1px solid #d8dee6; background: #fff; }
  .legend span { margin-right: 1rem; }
  a { color: #1b5fa8; }
</style>
</head>
<body>
<h1>jetfleet</h1>
<p class="meta">
  updated: <span id="updated">never</span> &middot;
  <a href="/v1/status">/v1/status</a> &middot; <a href="/metrics">/metrics</a>
  <span id="error" class="error"></span>
</p>
<div class="controls">
  <label>token <input id="token" type="password" size="24" autocomplete="off"></label>
  <label>why <input id="why" size="30" placeholder="reason, for the audit log"></label>
  <span id="action-result" role="status"></span>
</div>

<h2>Fleet</h2>
<table id="overview">
  <thead><tr><th class="n">submitted</th><th class="n">queued</th><th class="n">leased</th>
    <th class="n">committed</th><th class="n">dead</th><th class="n">rejected</th>
    <th class="n">admitting</th><th class="n">unaccounted</th><th>conserved</th>
    <th>rate limiter</th><th>held</th><th>paused</th></tr></thead>
  <tbody><tr>
    <td class="n" id="count-submitted">-</td><td class="n" id="count-queued">-</td>
    <td class="n" id="count-leased">-</td><td class="n" id="count-committed">-</td>
    <td class="n" id="count-dead">-</td><td class="n" id="count-rejected">-</td>
    <td class="n" id="admitting">-</td><td class="n" id="unaccounted">-</td>
    <td id="conserved">-</td><td id="limiter">-</td><td id="held">-</td>
    <td id="paused">-</td></tr></tbody>
</table>
<div class="controls">
  <select id="pause-scope">
    <option value="fleet">fleet</option><option value="target">target</option>
    <option value="region">region</option><option value="worker">worker</option>
    <option value="identity">identity</option></select>
  <input id="pause-name" size="14" placeholder="name (not for fleet)">
  <input id="pause-for" size="6" placeholder="for (30m)">
  <select id="pause-mode"><option value="drain">drain</option>
    <option value="now">now</option></select>
  <button id="pause">Pause</button> <button id="resume">Resume</button>
</div>
<table><thead><tr><th>scope</th><th>name</th><th>left</th><th>mode</th><th>by</th>
  <th>why</th></tr></thead><tbody id="pauses"></tbody></table>

<h2>Targets</h2>
<table>
  <thead><tr><th>target</th><th class="n">rate now</th><th class="n">cap</th>
    <th class="n">burst</th><th>hold</th><th>breaker</th><th class="n">queued</th>
    <th class="n">in flight</th><th class="n">committed</th><th class="n">dead</th>
    <th class="n">rejected</th></tr></thead>
  <tbody id="targets"></tbody>
</table>

<h2>Workers</h2>
<p class="meta">regions with a running worker: <span id="regions">-</span></p>
<table><thead><tr><th>worker</th><th>identities</th><th class="n">successes</th>
  <th class="n">blocks</th><th class="n">failures</th><th class="n">success rate</th>
  <th class="n">seen</th></tr></thead><tbody id="workers"></tbody></table>

<h2>Identities</h2>
<table><thead><tr><th>identity</th><th>owner</th><th class="n">successes</th>
  <th class="n">blocks</th><th class="n">failures</th><th class="n">success rate</th>
  <th class="n">seen</th></tr></thead><tbody id="identities"></tbody></table>

<h2>Success rate by version tuple</h2>
<svg id="chart" width="720" height="220" viewBox="0 0 720 220"
  xmlns="http://www.w3.org/2000/svg"></svg>
<div id="legend" class="legend"></div>

<h2>Quarantines</h2>
<table><thead><tr><th>target</th><th>scope</th><th>name</th><th>left</th><th>set by</th>
  <th>reason</th></tr></thead><tbody id="quarantines"></tbody></table>
<h2>Egress proposals</h2>
<table><thead><tr><th>id</th><th>state</th><th>subnet</th><th>target</th>
  <th>identities</th><th>reason</th><th></th></tr></thead>
  <tbody id="proposals"></tbody></table>

<h2>Dead letters <span id="dlq-total" class="meta"></span></h2>
<table><thead><tr><th class="n">id</th><th>target</th><th>job</th><th>reason</th>
  <th class="n">attempts</th><th></th></tr></thead><tbody id="letters"></tbody></table>

<script>
"use strict";
const POLL_MS = __POLL_MS__;
const COUNTS = ["submitted", "queued", "leased", "committed", "dead", "rejected"];
const COLOURS = ["#1b5fa8", "#c4432b", "#1b7a3a", "#8a4fbf", "#c98a00", "#0d8a8a"];
const SVG = "http://www.w3.org/2000/svg";
const tokenInput = document.getElementById("token");
tokenInput.value = sessionStorage.getItem("jetfleet-token") || "";
tokenInput.addEventListener("change", () => {
  sessionStorage.setItem("jetfleet-token", tokenInput.value);
  refresh();
});

function headers() {
  const token = tokenInput.value.trim();
  return token ? {"Authorization": "Bearer " + token} : {};
}

function text(id, value) {
  document.getElementById(id).textContent = String(value);
}

function cell(tr, value, numeric) {
  const td = document.createElement("td");
  if (numeric) td.className = "n";
  td.textContent = value === null || value === undefined ? "-" : String(value);
  tr.appendChild(td);
  return td;
}

// What a row shows: its class, data attributes and cells (a button's label is its text).
function rowKey(tr) {
  return JSON.stringify([tr.className, Object.assign({}, tr.dataset),
    Array.from(tr.children, (td) => [td.className, td.colSpan, td.textContent])]);
}

// Which row a row is: its id or name, else its place in the table.
function rowName(tr, i) {
  return tr.dataset.id || tr.dataset.name || "#" + i;
}

// The table is changed in place: a row whose content has not changed keeps its node and
// is never detached (Chromium drops a click whose mouse-down node was removed before the
// mouse-up, even if it is put back), so a refresh never loses an operator's click on
// it, whatever else in the table changed.
function fill(id, rows, columns, emptyText) {
  const body = document.getElementById(id);
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = cell(tr, emptyText, false);
    td.className = "empty";
    td.colSpan = columns;
    rows = [tr];
  }
  const old = Array.from(body.children);
  const byName = new Map(old.map((tr, i) => [rowName(tr, i), tr]));
  const keep = new Set();
  const wanted = rows.map((tr, i) => {
    const prev = byName.get(rowName(tr, i));
    if (prev && !keep.has(prev) && rowKey(prev) === rowKey(tr)) {
      keep.add(prev);
      return prev;
    }
    return tr;
  });
  const keptInPlace = old.filter((tr) => keep.has(tr));
  if (wanted.filter((tr) => keep.has(tr)).some((tr, i) => tr !== keptInPlace[i])) {
    body.replaceChildren(...wanted);  // kept rows reordered: nothing to keep in place
    return;
  }
  for (const tr of old) if (!keep.has(tr)) tr.remove();
  let next = null;
  for (let i = wanted.length - 1; i >= 0; i--) {
    if (!keep.has(wanted[i])) body.insertBefore(wanted[i], next);
    next = wanted[i];
  }
}

function rate(ok, total) {
  return total ? (100 * ok / total).toFixed(1) + " %" : "-";
}

function ago(seconds) {
  return seconds === null || seconds === undefined ? "-" : Math.round(seconds) + " s ago";
}

function button(label, className, action) {
  const b = document.createElement("button");
  b.textContent = label;
  b.className = className;
  b.addEventListener("click", action);
  return b;
}

async function control(path, body) {
  const result = document.getElementById("action-result");
  result.className = "";
  result.textContent = "sending...";
  body.why = document.getElementById("why").value;
  try {
    const response = await fetch(path, {
      method: "POST", cache: "no-store",
      headers: Object.assign({"Content-Type": "application/json"}, headers()),
      body: JSON.stringify(body)});
    const answer = await response.json();
    if (!response.ok) {
      result.className = "error";
      result.textContent = "refused (" + response.status + "): " + (answer.error || "");
    } else {
      result.className = "good";
      result.textContent = "done: " + path + (answer.replayed ?
        " as " + answer.replayed.join(", ") : "");
    }
  } catch (err) {
    result.className = "error";
    result.textContent = "failed: " + err.message;
  }
  refresh();
}

function pauseBody() {
  const body = {scope: document.getElementById("pause-scope").value,
    name: document.getElementById("pause-name").value,
    mode: document.getElementById("pause-mode").value};
  const forText = document.getElementById("pause-for").value.trim();
  if (forText) body["for"] = forText;
  if (body.scope === "fleet") body.name = "";
  return body;
}

document.getElementById("pause").addEventListener("click",
  () => control("/v1/pause", pauseBody()));
document.getElementById("resume").addEventListener("click", () => {
  const body = pauseBody();
  delete body["for"];
  delete body.mode;
  control("/v1/resume", body);
});

function renderStatus(status) {
  for (const field of COUNTS) text("count-" + field, status.totals[field] ?? 0);
  text("admitting", status.admitting);
  text("unaccounted", status.unaccounted);
  const conserved = document.getElementById("conserved");
  conserved.textContent = status.conserved ? "yes" : "no";
  conserved.className = status.conserved ? "good" : "bad";
  const limiter = document.getElementById("limiter");
  limiter.textContent = status.rate_limiter;
  limiter.className = status.rate_limiter === "ok" ? "good" : "bad";
  text("held", status.held);
  const pauses = status.pauses || [];
  const paused = document.getElementById("paused");
  paused.textContent = pauses.length ? "yes (" + pauses.length + ")" : "no";
  paused.className = pauses.length ? "bad" : "good";
  fill("pauses", pauses.map((p) => {
    const tr = document.createElement("tr");
    cell(tr, p.record.scope); cell(tr, p.record.scope === "fleet" ? "" : p.record.name);
    cell(tr, p.record.for_s ? Math.round(p.left_s) + " s" : "until resumed");
    cell(tr, p.record.mode || "drain"); cell(tr, p.record.by || ""); cell(tr, p.record.why || "");
    return tr;
  }), 6, "no pause in force");
  fill("quarantines", (status.quarantines || []).map((q) => {
    const tr = document.createElement("tr");
    cell(tr, q.target); cell(tr, q.scope); cell(tr, q.name);
    cell(tr, q.left_s === null || q.left_s === undefined ? "until released" :
      Math.round(q.left_s) + " s");
    cell(tr, q.set_by || ""); cell(tr, q.reason || "");
    return tr;
  }), 6, "no quarantine in force");
  fill("proposals", (status.proposals || []).map((p) => {
    const tr = document.createElement("tr");
    tr.className = "proposal";
    tr.dataset.id = p.id;
    cell(tr, p.id); cell(tr, p.state || "proposed"); cell(tr, p.subnet); cell(tr, p.target);
    cell(tr, (p.identities || []).join(", "));
    cell(tr, (p.answered_by ? p.answered_by + ": " : "") + (p.reason || ""));
    const td = document.createElement("td");
    if ((p.state || "proposed") === "proposed") {
      const path = "/v1/proposals/" + encodeURIComponent(p.id) + "/";
      td.append(button("Approve", "approve", () => control(path + "approve", {})),
        " ", button("Reject", "reject", () => control(path + "reject", {})));
    }
    tr.appendChild(td);
    return tr;
  }), 7, "no egress proposal");
  return status;
}

function renderTargets(doc, status) {
  fill("targets", doc.targets.map((t) => {
    const counts = (status && status.targets[t.target]) || {};
    const tr = document.createElement("tr");
    cell(tr, t.target);
    const now = cell(tr, t.rate_now.toFixed(1) + "/s", true);
    if (t.rate_now > t.rate_cap) now.className = "n bad";
    cell(tr, t.rate_cap + "/s (" + t.rate_from + ")", true);
    cell(tr, t.burst, true);
    cell(tr, t.held_s === null ? "no" : Math.ceil(t.held_s) + " s");
    const breaker = cell(tr, t.breaker);
    if (t.breaker !== "closed") breaker.className = "bad";
    cell(tr, counts.queued, true); cell(tr, counts.leased, true);
    cell(tr, counts.committed, true); cell(tr, counts.dead, true);
    cell(tr, counts.rejected, true);
    return tr;
  }), 11, "no target declared");
}

function actorRows(rows, extra) {
  return rows.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.name = r.name;
    cell(tr, r.name); cell(tr, extra(r));
    cell(tr, r.ok, true); cell(tr, r.blocked, true); cell(tr, r.failed, true);
    cell(tr, rate(r.ok, r.ok + r.blocked + r.failed), true);
    cell(tr, ago(r.seen_s_ago), true);
    return tr;
  });
}

function renderActors(doc) {
  text("regions", doc.regions.length ? doc.regions.join(", ") : "none announced");
  fill("workers", actorRows(doc.workers, (r) => r.identities.join(", ")), 7,
    "no outcome in the last " + Math.round(doc.window_s / 60) + " min");
  fill("identities", actorRows(doc.identities, (r) => r.owner || "(unclaimed)"), 7,
    "no identity seen");
}

function renderChart(doc) {
  const svg = document.getElementById("chart");
  const W = 720, H = 220, L = 40, R = 10, T = 10, B = 25;
  const parts = [];
  const line = (x1, y1, x2, y2, colour) => {
    const l = document.createElementNS(SVG, "line");
    l.setAttribute("x1", x1); l.setAttribute("y1", y1);
    l.setAttribute("x2", x2); l.setAttribute("y2", y2);
    l.setAttribute("stroke", colour);
    return l;
  };
  const label = (x, y, value, anchor) => {
    const t = document.createElementNS(SVG, "text");
    t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("font-size", "10");
    t.setAttribute("text-anchor", anchor);
    t.textContent = value;
    return t;
  };
  for (const pct of [0, 50, 100]) {
    const y = T + (H - T - B) * (1 - pct / 100);
    parts.push(line(L, y, W - R, y, "#e3e8ee"), label(L - 4, y + 3, pct + "%", "end"));
  }
  const all = doc.versions.flatMap((v) => v.points.map((p) => p.t));
  const end = Math.max(doc.now_s || 0, ...all);
  const start = Math.min(end - doc.bucket_s * 6, ...all);
  const span = Math.max(end - start, doc.bucket_s);
  const x = (t) => L + (W - L - R) * (t - start) / span;
  const y = (p) => T + (H - T - B) * (1 - p.ok / p.total);
  parts.push(label(L, H - 8, Math.round((end - start) / 60) + " min ago", "start"),
    label(W - R, H - 8, "now", "end"));
  const legend = [];
  doc.versions.forEach((v, i) => {
    const colour = COLOURS[i % COLOURS.length];
    const points = v.points.filter((p) => p.total > 0);
    if (points.length > 1) {
      const path = document.createElementNS(SVG, "polyline");
      path.setAttribute("points", points.map((p) => x(p.t) + "," + y(p)).join(" "));
      path.setAttribute("fill", "none"); path.setAttribute("stroke", colour);
      path.setAttribute("class", "series");
      parts.push(path);
    }
    for (const p of points) {
      const c = document.createElementNS(SVG, "circle");
      c.setAttribute("cx", x(p.t)); c.setAttribute("cy", y(p)); c.setAttribute("r", "3");
      c.setAttribute("fill", colour); c.setAttribute("class", "point");
      const tip = document.createElementNS(SVG, "title");
      tip.textContent = v.id + ": " + p.ok + "/" + p.total;
      c.appendChild(tip);
      parts.push(c);
    }
    const item = document.createElement("span");
    item.style.color = colour;
    item.textContent = "\\u25CF " + v.id + (v.incumbent ? " (incumbent)" :
      v.approved ? " (approved)" : "");
    legend.push(item);
  });
  svg.replaceChildren(...parts);
  if (!legend.length) {
    const none = document.createElement("span");
    none.className = "empty";
    none.textContent = "no outcome events yet";
    legend.push(none);
  }
  document.getElementById("legend").replaceChildren(...legend);
}

function renderLetters(doc) {
  text("dlq-total", "(" + doc.total + " kept" + (doc.letters.length < doc.total ?
    ", newest " + doc.letters.length + " shown" : "") + ")");
  fill("letters", doc.letters.map((l) => {
    const tr = document.createElement("tr");
    tr.className = "letter";
    tr.dataset.id = String(l.id);
    cell(tr, l.id, true); cell(tr, l.target); cell(tr, l.job); cell(tr, l.reason);
    cell(tr, l.attempts.length, true);
    const td = document.createElement("td");
    td.appendChild(button("Replay", "replay",
      () => control("/v1/dead-letters/" + l.id + "/replay", {})));
    tr.appendChild(td);
    return tr;
  }), 6, "no dead letter");
}

async function read(path) {
  const response = await fetch(path, {cache: "no-store", headers: headers()});
  const body = await response.json();
  if (!response.ok) throw new Error(path + ": " + response.status + " " + (body.error || ""));
  return body;
}

let refreshing = false;
async function refresh() {
  if (refreshing) return;
  refreshing = true;
  const errors = [];
  const run = async (path, render) => {
    try { return render(await read(path)); } catch (err) { errors.push(err.message); }
  };
  try {
    const status = await run("/v1/status", renderStatus);
    await Promise.all([
      run("/v1/targets", (doc) => renderTargets(doc, status)),
      run("/v1/workers", renderActors),
      run("/v1/versions/series", renderChart),
      run("/v1/dead-letters", renderLetters)]);
    text("updated", new Date().toLocaleTimeString());
    // Keep the last numbers on screen and say they are stale.
    text("error", errors.length ? "(refresh failed: " + errors.join("; ") + ")" : "");
  } finally {
    refreshing = false;
  }
}

refresh();
setInterval(refresh, POLL_MS);
</script>
</body>
</html>
""".replace("__POLL_MS__", str(POLL_MS))
