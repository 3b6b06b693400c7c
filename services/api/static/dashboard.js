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
const state = { job: null, cursor: null, points: { trainer: [], rollout: [], backlog: [] }, evals: [], charts: {}, refreshes: 0, bursts: null };
const BURSTS_EVERY = 10; // polls between timeline refreshes while no new session point arrives
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

// -- bursts -----------------------------------------------------------------------
// The job's trainer sessions (GET /v1/jobs/{id}/bursts): a bar per session on one time axis
// (its start-up lighter), and a row each with the rented seconds, steps and the data's lag.
function fmtTime(t) {
  return typeof t === "number" ? new Date(t * 1000).toLocaleString() : "-";
}

// The end of a session: its time only, when it ended on the day it began.
function fmtEnd(from, to) {
  const a = new Date(from * 1000), b = new Date(to * 1000);
  return a.toDateString() === b.toDateString() ? b.toLocaleTimeString() : fmtTime(to);
}

function fmtSeconds(s) {
  if (typeof s !== "number") return "unknown";
  return s >= 3600 ? (s / 3600).toFixed(2) + " h" : s.toFixed(0) + " s";
}

function renderBursts(b) {
  const body = document.querySelector("#bursts tbody");
  const line = document.getElementById("burst-timeline");
  body.replaceChildren();
  line.replaceChildren();
  const sessions = (b && b.sessions) || [];
  const t = (b && b.totals) || {};
  document.getElementById("burst-totals").textContent = sessions.length
    ? t.sessions + " sessions, " + fmtSeconds(t.billable_s) + " rented, " + t.steps + " steps" + (t.lost ? ", " + t.lost + " without an end report" : "") + (b.truncated ? " (older ones left out)" : "")
    : "";
  if (!sessions.length) {
    body.append(el("tr", {}, el("td", { colspan: 10, class: "empty" }, "no trainer has held this job yet")));
    return;
  }
  const now = Date.now() / 1000;
  const endOf = (s) => s.ended_at ?? (s.status === "training" ? now : s.claimed_at ?? s.process_start);
  const t0 = Math.min(...sessions.map((s) => s.process_start ?? s.claimed_at ?? now));
  const span = Math.max(1, Math.max(...sessions.map(endOf)) - t0);
  for (const s of sessions) {
    const start = s.process_start ?? s.claimed_at ?? t0;
    const end = Math.max(start, endOf(s));
    const bar = el("div", { class: "burst " + s.status, "data-epoch": s.epoch, title: "session " + s.epoch + " (" + s.replica + "): " + s.status + ", " + fmtSeconds(s.billable_s) + " rented, " + (s.steps ?? "?") + " steps" });
    bar.style.left = ((100 * (start - t0)) / span).toFixed(3) + "%";
    bar.style.width = ((100 * (end - start)) / span).toFixed(3) + "%";
    if (typeof s.startup_s === "number" && end > start) {
      const up = el("div", { class: "startup" });
      up.style.width = Math.min(100, (100 * s.startup_s) / (end - start)).toFixed(3) + "%";
      bar.append(up);
    }
    bar.append(el("span", { class: "label" }, (s.steps ?? "?") + " steps"));
    line.append(bar);
    const hist = Object.entries(s.lag_hist || {}).map(([k, n]) => k + ":" + n).join(" ");
    const lag = typeof s.lag_mean === "number" ? s.lag_mean.toFixed(2) + " / " + s.lag_max : "-";
    body.append(
      el(
        "tr",
        { "data-epoch": s.epoch, "data-status": s.status },
        el("td", {}, s.epoch),
        el("td", {}, s.replica),
        el("td", { class: s.status === "lost" ? "warn" : s.status === "training" ? "ok" : "" }, s.status),
        el("td", {}, fmtTime(s.claimed_at) + " → " + (s.ended_at ? fmtEnd(s.claimed_at, s.ended_at) : s.status === "training" ? "now" : "?")),
        el("td", { "data-billable": "" }, typeof s.billable_s === "number" ? s.billable_s.toFixed(1) : "unknown"),
        el("td", { "data-steps": "" }, s.steps ?? "-"),
        el("td", {}, s.groups ?? "-"),
        el("td", { "data-lag": "" }, lag),
        el("td", {}, hist),
        el("td", {}, s.reason || ""),
      ),
    );
  }
}

async function fetchBursts(job) {
  const b = await api("/v1/jobs/" + encodeURIComponent(job) + "/bursts");
  if (job !== state.job) return;
  state.bursts = b;
  state.burstsAt = state.refreshes;
  renderBursts(b);
}

function selectJob(id) {
  if (state.job === id) return;
  state.job = id;
  state.cursor = null;
  state.points = { trainer: [], rollout: [], backlog: [] };
  state.evals = [];
  state.bursts = null;
  renderBursts(null);
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
  // The timeline: at once when a session started or ended, else now and then (a session in
  // progress grows; one lost shows once its lease has moved on).
  const sessionPoint = points.some((p) => p.source === "trainer_session");
  if (state.bursts === null || sessionPoint || state.refreshes - (state.burstsAt ?? 0) >= BURSTS_EVERY) await fetchBursts(job);
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
