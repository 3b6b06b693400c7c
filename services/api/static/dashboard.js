// burstrl dashboard: polls the api's authenticated JSON endpoints and draws with uPlot.
// No framework, no build step: the api serves this file as is, and machines are offline.
"use strict";

const TOKEN_KEY = "burstrl.token";
const POLL_MS = 3000;
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"];
// Trainer metrics are grouped into charts by name; each key goes to the first group that matches.
const GROUPS = [
  { name: "reward", title: "Train reward (batch) and its parts", match: (k) => /^reward/.test(k) },
  { name: "kl", title: "KL (to reference; sampler/trainer mismatch)", match: (k) => /kl|k3/.test(k) },
  { name: "loss", title: "Loss, gradient norm, entropy", match: (k) => /^(loss|grad_norm|entropy)$/.test(k) },
  { name: "clip", title: "Clipping and importance sampling", match: (k) => /clip|is_frac/.test(k) },
  { name: "staleness", title: "Staleness (policy versions)", match: (k) => /stale/.test(k) },
  { name: "timing", title: "Seconds per step", match: (k) => /_s$/.test(k) },
  { name: "other", title: "Other trainer metrics", match: () => true },
];
const NOT_SERIES = new Set(["id", "at", "source", "step"]);

// Exposed for tests and for poking at from the devtools console.
const state = { job: null, cursor: null, points: { trainer: [], rollout: [], backlog: [] }, evals: [], charts: {}, refreshes: 0 };
window.burstrl = state;
state.seriesLength = (name) => {
  const c = state.charts[name];
  return c ? c.plot.data[0].length : 0;
};

class AuthError extends Error {}

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

async function api(path) {
  const headers = token() ? { Authorization: "Bearer " + token() } : {};
  const resp = await fetch(path, { headers, cache: "no-store" });
  if (resp.status === 401) throw new AuthError("token missing or wrong");
  if (!resp.ok) throw new Error(path + ": HTTP " + resp.status);
  return resp.json();
}

// DOM helper that only ever sets text (values come from Redis: never innerHTML them).
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c ?? "")));
  return e;
}

function setStatus(text, error) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = error ? "error" : "";
}

// { a: 1, parts: { x: 2 } } -> { a: 1, "parts/x": 2 }: numeric leaves only.
function flatten(obj, prefix, out) {
  out = out || {};
  for (const [k, v] of Object.entries(obj)) {
    const key = prefix ? prefix + "/" + k : k;
    if (typeof v === "number" && Number.isFinite(v)) out[key] = v;
    else if (typeof v === "boolean") out[key] = v ? 1 : 0;
    else if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, key, out);
  }
  return out;
}

// -- tables -----------------------------------------------------------------------
function renderServices(services) {
  const body = document.querySelector("#services tbody");
  body.replaceChildren();
  if (!services.length) body.append(el("tr", {}, el("td", { colspan: 8, class: "empty" }, "no service is heartbeating")));
  for (const s of services) {
    const versions = Object.entries(s.policy_versions || {}).map(([j, v]) => j + ": v" + v).join(", ");
    const reasons = Object.entries(s.reasons || {}).map(([k, v]) => k + ": " + v).join("; ");
    body.append(
      el(
        "tr",
        { "data-role": s.role },
        el("td", {}, s.role),
        el("td", {}, s.replica),
        el("td", {}, (s.host || "") + ":" + (s.port || "")),
        // Ready with reasons: a job-scoped problem (say, a refused policy version); the service serves.
        el(
          "td",
          { class: s.ready ? (Object.keys(s.reasons || {}).length ? "warn" : "ok") : "bad" },
          s.ready ? (Object.keys(s.reasons || {}).length ? "degraded" : "ready") : "not ready",
        ),
        el("td", {}, s.age_s),
        el("td", {}, versions),
        // Rollout: wall time not spent in the engine over its last window (the home cards idling).
        el("td", { "data-idle": "" }, typeof s.idle_frac === "number" ? (100 * s.idle_frac).toFixed(1) + "%" : ""),
        el("td", {}, reasons),
      ),
    );
  }
}

function renderJobs(jobs) {
  const body = document.querySelector("#jobs tbody");
  body.replaceChildren();
  if (!jobs.length) body.append(el("tr", {}, el("td", { colspan: 9, class: "empty" }, "no jobs yet")));
  for (const j of jobs) {
    const ledger = Object.entries(j.ledger).map(([k, v]) => k + "=" + v).join(" ");
    const queues = Object.entries(j.queues)
      .map(([k, q]) => k + " " + q.length + " / " + q.pending + " / " + (q.lag ?? "-"))
      .join("\n");
    const adoption = el("td", {});
    if (!j.adoption.length) adoption.append(el("span", { class: "empty" }, "no replica reports this job"));
    for (const a of j.adoption) {
      const line = el("div", { class: a.behind > 0 ? "behind" : "" }, a.role + " " + a.replica + ": v" + a.version);
      if (a.behind > 0) line.append(" (" + a.behind + " behind)");
      adoption.append(line);
    }
    const acc = j.last_eval ? "v" + j.last_eval.version + ": " + Number(j.last_eval.accuracy).toFixed(3) : "-";
    const backlog = el("td", { "data-backlog": "", style: "white-space: pre" }, backlogText(j.backlog));
    if (j.backlog && j.backlog.full) backlog.className = "warn";
    const row = el(
      "tr",
      { "data-job": j.id, class: j.id === state.job ? "selected" : "" },
      el("td", {}, j.id),
      el("td", {}, j.state),
      el("td", {}, j.task),
      el("td", {}, "v" + j.policy_version + " / " + j.steps),
      el("td", {}, ledger),
      el("td", { style: "white-space: pre" }, queues),
      backlog,
      adoption,
      el("td", {}, acc),
    );
    row.addEventListener("click", () => selectJob(j.id));
    body.append(row);
  }
  const sel = document.getElementById("job-select");
  const ids = jobs.map((j) => j.id);
  if (sel.options.length !== ids.length || [...sel.options].some((o, i) => o.value !== ids[i])) {
    sel.replaceChildren(...ids.map((id) => el("option", { value: id }, id)));
  }
  if (state.job === null && ids.length) selectJob(ids[0]);
  sel.value = state.job || "";
}

// The disk tier of a job's queue: what it holds, how old, how full (null: a windowed job).
function backlogText(b) {
  if (!b) return "none (windowed)";
  const mb = (b.bytes / 1e6).toFixed(1);
  const lines = [b.groups + " groups, " + mb + " MB in " + b.segments + " segments (" + b.order + " first)"];
  if (b.groups) lines.push("oldest " + b.oldest_versions + " versions, " + Number(b.oldest_hours).toFixed(2) + " h behind");
  lines.push("budget " + b.max_groups + " groups, " + (b.max_bytes / 1e6).toFixed(0) + " MB");
  if (b.full) lines.push("FULL: " + b.full);
  return lines.join("\n");
}

// -- charts -----------------------------------------------------------------------
function drawChart(name, title, xLabel, keys, data, timeX) {
  let c = state.charts[name];
  const sig = keys.join("|");
  if (c && c.sig !== sig) {
    c.plot.destroy();
    c.box.remove();
    c = null;
  }
  if (c) {
    c.plot.setData(data);
    return;
  }
  const box = el("div", { class: "chart", "data-chart": name });
  document.getElementById("charts").append(box);
  const opts = {
    title,
    width: 520,
    height: 240,
    scales: { x: { time: !!timeX } },
    // Steps and versions are integers: no 0.25-version ticks.
    axes: [timeX ? { label: xLabel } : { label: xLabel, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000] }, {}],
    series: [
      { label: xLabel },
      ...keys.map((k, i) => ({ label: k, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true, points: { size: 4 } })),
    ],
  };
  state.charts[name] = { plot: new uPlot(opts, data, box), sig, box };
}

function columns(points, xOf) {
  const keys = new Set();
  const rows = points.map((p) => {
    const f = flatten(p);
    for (const k of Object.keys(f)) if (!NOT_SERIES.has(k)) keys.add(k);
    return [xOf(p), f];
  });
  rows.sort((a, b) => a[0] - b[0]);
  return { keys: [...keys].sort(), rows };
}

function renderCharts() {
  // Trainer: one x per optimizer step, keys grouped into charts.
  const t = columns(state.points.trainer, (p) => (typeof p.step === "number" ? p.step : p.at));
  const groups = {};
  for (const k of t.keys) {
    const g = GROUPS.find((g) => g.match(k));
    (groups[g.name] = groups[g.name] || []).push(k);
  }
  for (const g of GROUPS) {
    const keys = groups[g.name];
    if (!keys) continue;
    drawChart(g.name, g.title, "step", keys, [t.rows.map((r) => r[0]), ...keys.map((k) => t.rows.map((r) => r[1][k] ?? null))]);
  }
  // Held-out evaluation: one x per policy version.
  if (state.evals.length) {
    const keys = ["accuracy", "greedy_accuracy", "mean_reward"].filter((k) => state.evals.some((e) => k in e));
    const ev = [...state.evals].sort((a, b) => a.version - b.version);
    drawChart("eval", "Held-out evaluation per policy version", "version", keys, [ev.map((e) => e.version), ...keys.map((k) => ev.map((e) => e[k] ?? null))]);
  }
  // Rollout throughput over wall-clock time.
  if (state.points.rollout.length) {
    const pts = state.points.rollout.map((p) => ({ ...p, groups_per_s: p.seconds > 0 ? p.groups / p.seconds : null }));
    const r = columns(pts, (p) => p.at);
    drawChart("rollout", "Rollout", "time", r.keys, [r.rows.map((x) => x[0]), ...r.keys.map((k) => r.rows.map((x) => x[1][k] ?? null))], true);
  }
  // The backlog over wall-clock time, with rollout's idle fraction beside it.
  if (state.points.backlog && state.points.backlog.length) {
    const pts = state.points.backlog.map((p) => ({ at: p.at, groups: p.groups, MB: p.bytes / 1e6, oldest_versions: p.oldest_versions }));
    const b = columns(pts, (p) => p.at);
    drawChart("backlog", "Backlog (disk tier)", "time", b.keys, [b.rows.map((x) => x[0]), ...b.keys.map((k) => b.rows.map((x) => x[1][k] ?? null))], true);
    const idle = state.points.backlog.filter((p) => typeof p.rollout_idle_frac === "number").map((p) => ({ at: p.at, rollout_idle_frac: p.rollout_idle_frac }));
    if (idle.length) {
      const i = columns(idle, (p) => p.at);
      drawChart("idle", "Rollout idle fraction", "time", i.keys, [i.rows.map((x) => x[0]), ...i.keys.map((k) => i.rows.map((x) => x[1][k] ?? null))], true);
    }
  }
  if (!Object.keys(state.charts).length) {
    const box = document.getElementById("charts");
    if (!box.querySelector(".empty")) box.append(el("p", { class: "empty" }, "no metric points yet"));
  } else {
    document.querySelectorAll("#charts > .empty").forEach((e) => e.remove());
  }
}

function selectJob(id) {
  if (state.job === id) return;
  state.job = id;
  state.cursor = null;
  state.points = { trainer: [], rollout: [], backlog: [] };
  state.evals = [];
  for (const c of Object.values(state.charts)) c.plot.destroy();
  state.charts = {};
  document.getElementById("charts").replaceChildren();
  document.querySelectorAll("#jobs tr[data-job]").forEach((tr) => tr.classList.toggle("selected", tr.dataset.job === id));
  refreshJob().catch(showError);
}

// One metrics fetch at a time: the poll and a job switch must not both fetch from the
// same cursor and append the same points twice.
let jobFetch = null;
function refreshJob() {
  if (!jobFetch) jobFetch = fetchJob().finally(() => (jobFetch = null));
  return jobFetch;
}

async function fetchJob() {
  const job = state.job;
  if (!job) return;
  const q = state.cursor ? "?after=" + encodeURIComponent(state.cursor) : "";
  const [points, status] = await Promise.all([
    api("/v1/jobs/" + encodeURIComponent(job) + "/metrics" + q),
    api("/v1/jobs/" + encodeURIComponent(job)),
  ]);
  if (job !== state.job) return; // the user switched jobs while we waited; the next poll fetches
  for (const p of points) (state.points[p.source] = state.points[p.source] || []).push(p);
  if (points.length) state.cursor = points[points.length - 1].id;
  state.evals = status.evals || [];
  renderCharts();
}

function showError(e) {
  if (e instanceof AuthError) setStatus("enter the API token (BURSTRL_TOKEN) above", true);
  else setStatus(String(e.message || e), true);
}

async function refresh() {
  try {
    const ov = await api("/v1/dashboard");
    renderServices(ov.services);
    renderJobs(ov.jobs);
    await refreshJob();
    setStatus("updated " + new Date().toLocaleTimeString());
  } catch (e) {
    showError(e);
  } finally {
    state.refreshes += 1;
  }
}

async function loop() {
  await refresh();
  setTimeout(loop, POLL_MS);
}

document.getElementById("login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const input = document.getElementById("token");
  sessionStorage.setItem(TOKEN_KEY, input.value.trim());
  input.value = "";
  refresh();
});
document.getElementById("logout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  setStatus("token forgotten", true);
});
document.getElementById("job-select").addEventListener("change", (ev) => selectJob(ev.target.value));
loop();
