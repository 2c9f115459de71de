"""The dashboard page: one self-contained HTML document, no external assets.

It polls ``/v1/status`` every 2 s and renders targets x the six counts, the rate
limiter's health and the targets held fleet-wide (the first few by name). Values are
written with ``textContent`` only, so nothing read from the fleet is ever parsed as HTML.
"""

from __future__ import annotations

DASHBOARD_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>jetfleet</title>
<style>
  body { font: 15px/1.4 system-ui, sans-serif; margin: 2rem; color: #1d2733; }
  h1 { font-size: 1.4rem; margin: 0 0 .25rem; }
  p.meta { color: #5b6775; margin: 0 0 1rem; }
  table { border-collapse: collapse; min-width: 40rem; }
  th, td { padding: .35rem .8rem; border-bottom: 1px solid #d8dee6; }
  th { text-align: left; background: #f2f5f8; }
  td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
  tfoot td { font-weight: 600; border-top: 2px solid #9aa6b3; }
  .error { color: #a4161a; }
  a { color: #1b5fa8; }
</style>
</head>
<body>
<h1>jetfleet</h1>
<p class="meta">
  admitting: <span id="admitting">-</span> &middot;
  rate limiter: <span id="limiter">-</span> &middot;
  held: <span id="held">-</span> &middot;
  updated: <span id="updated">never</span> &middot;
  <a href="/v1/status">/v1/status</a> &middot; <a href="/metrics">/metrics</a>
  <span id="error" class="error"></span>
</p>
<table>
  <thead><tr><th>target</th><th class="n">submitted</th><th class="n">queued</th>
    <th class="n">leased</th><th class="n">committed</th><th class="n">dead</th>
    <th class="n">rejected</th></tr></thead>
  <tbody id="rows"></tbody>
  <tfoot id="totals"></tfoot>
</table>
<script>
"use strict";
const FIELDS = ["submitted", "queued", "leased", "committed", "dead", "rejected"];
const HOLDS_NAMED = 5;

function row(name, counts) {
  const tr = document.createElement("tr");
  const label = document.createElement("td");
  label.textContent = name;
  tr.appendChild(label);
  for (const field of FIELDS) {
    const td = document.createElement("td");
    td.className = "n";
    td.textContent = String(counts[field] ?? 0);
    tr.appendChild(td);
  }
  return tr;
}

function held(status) {
  const holds = (status.holds ?? []).slice(0, HOLDS_NAMED);
  const named = holds.map((h) => h.target + " " + Math.ceil(h.seconds_left) + " s");
  const more = (status.held ?? 0) - holds.length;
  return String(status.held ?? 0) + (named.length ? " (" + named.join(", ") +
    (more > 0 ? ", +" + more : "") + ")" : "");
}

async function refresh() {
  try {
    const response = await fetch("/v1/status", {cache: "no-store"});
    if (!response.ok) throw new Error("status " + response.status);
    const status = await response.json();
    const rows = document.getElementById("rows");
    rows.replaceChildren(...Object.keys(status.targets).sort()
      .map((name) => row(name, status.targets[name])));
    document.getElementById("totals").replaceChildren(row("total", status.totals));
    document.getElementById("admitting").textContent = String(status.admitting);
    const limiter = document.getElementById("limiter");
    limiter.textContent = status.rate_limiter ?? "-";
    limiter.className = status.rate_limiter === "ok" ? "" : "error";
    document.getElementById("held").textContent = held(status);
    document.getElementById("updated").textContent = new Date().toLocaleTimeString();
    document.getElementById("error").textContent = "";
  } catch (err) {
    // Keep the last numbers on screen and say they are stale.
    document.getElementById("error").textContent = "(refresh failed: " + err.message + ")";
  }
}

refresh();
setInterval(refresh, 2000);
</script>
</body>
</html>
"""
