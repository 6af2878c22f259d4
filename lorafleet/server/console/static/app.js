// The console page: sign in (the key goes to the server once and is dropped from the form),
// then every view is rendered from server-sent events. The CSRF token lives in this module's
// memory only; the session itself is an HttpOnly cookie this script cannot read.
import { lineChart } from "./charts.js";

const API = "/console/api";
const $ = (sel) => document.querySelector(sel);
const state = { csrf: null, tenant: null, operator: false, run: null, view: "tenant", source: null, lastRun: "", lastCkpts: "", seen: {} };

function text(tag, value, cls) {
  const node = document.createElement(tag);
  node.textContent = value == null ? "" : String(value);
  if (cls) node.className = cls;
  return node;
}

function ago(ts) {
  if (!ts) return "";
  const s = Math.max(0, Date.now() / 1000 - ts);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  return new Date(ts * 1000).toLocaleString();
}

function bytes(n) {
  if (n == null) return "";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function segs(id) { return id.split("/").map(encodeURIComponent).join("/"); }

async function api(method, path, body) {
  const headers = {};
  if (method !== "GET") headers["X-CSRF-Token"] = state.csrf || "";
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(API + path, {
    method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const data = await resp.json().catch(() => ({}));
  if (resp.status === 401) { showSignIn(); throw new Error(data.error || "signed out"); }
  if (!resp.ok) throw new Error(data.error || `${method} ${path}: ${resp.status}`);
  return data;
}

// ------------------------------------------------------------------ sign in / out
function showSignIn(message) {
  closeStream();
  state.csrf = null;
  $("#signin-view").hidden = false;
  for (const id of ["#tenant-view", "#operator-view", "#tabs", "#whoami", "#live"]) $(id).hidden = true;
  $("#signin-error").textContent = message || "";
}

function showApp(who) {
  state.csrf = who.csrf;
  state.tenant = who.tenant;
  state.operator = who.operator;
  $("#signin-view").hidden = true;
  $("#tabs").hidden = false;
  $("#whoami").hidden = false;
  $("#whoami").textContent = `tenant ${who.tenant}${who.operator ? " (operator)" : ""}`;
  $("#operator-tab").hidden = !who.operator;
  switchView("tenant");
}

$("#signin").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const input = $("#key");
  const key = input.value;
  input.value = "";  // the key leaves the page with this request and nowhere else
  try {
    const resp = await fetch(`${API}/session`, {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify({ key }),
    });
    const data = await resp.json().catch(() => ({}));
    if (!resp.ok) { showSignIn(data.error || "sign-in failed"); return; }
    showApp(data);
  } catch (err) {
    showSignIn(String(err));
  }
});

$("#signout").addEventListener("click", async () => {
  try { await api("DELETE", "/session"); } finally { showSignIn("Signed out."); }
});

// ------------------------------------------------------------------ live updates
function closeStream() {
  if (state.source) { state.source.close(); state.source = null; }
  $("#live").hidden = true;
}

function connect() {
  closeStream();
  let url = `${API}/events?view=${state.view}`;
  if (state.view === "tenant" && state.run) url += `&run=${encodeURIComponent(state.run)}`;
  const source = new EventSource(url);
  state.source = source;
  source.addEventListener("open", () => { $("#live").hidden = false; });
  source.addEventListener("snapshot", (ev) => {
    const data = JSON.parse(ev.data);
    if (data.overview) renderOverview(data.overview);
    if (data.run) renderRun(data.run);
    if (data.operator) renderOperator(data.operator);
  });
  state.seen = {};
  source.addEventListener("failure", async (ev) => {
    const data = JSON.parse(ev.data);
    $("#action-error").textContent = data.error || "";
    if (state.run) { state.run = null; $("#run-detail").hidden = true; }
    if (state.view === "operator") {
      // a tenants reload may have taken the operator flag away: back to the tenant's own view
      // (reconnecting to the operator view would only be refused, leaving stale fleet data)
      closeStream();
      let who = null;
      try { who = await api("GET", "/session"); } catch (err) { $("#action-error").textContent = err.message; }
      if (!state.csrf) return;  // signed out: api() showed the sign-in form
      if (who && !who.operator) { showApp(who); return; }
    }
    setTimeout(connect, 1000);
  });
  source.addEventListener("signed_out", () => showSignIn("Your session ended; sign in again."));
  source.addEventListener("error", () => { $("#live").hidden = true; });
}

function switchView(view) {
  state.view = view;
  $("#tenant-view").hidden = view !== "tenant";
  $("#operator-view").hidden = view !== "operator";
  $("#tenant-tab").classList.toggle("active", view === "tenant");
  $("#operator-tab").classList.toggle("active", view === "operator");
  connect();
}

$("#tenant-tab").addEventListener("click", () => switchView("tenant"));
$("#operator-tab").addEventListener("click", () => switchView("operator"));

function selectRun(id) {
  state.run = id;
  state.lastRun = "";
  state.series = null;
  state.lastCkpts = "";
  $("#run-title").textContent = id;
  $("#run-detail").hidden = false;
  for (const tr of document.querySelectorAll("#runs tbody tr")) tr.classList.toggle("selected", tr.dataset.run === id);
  connect();
}

// ------------------------------------------------------------------ tenant view
// Each part of a view is redrawn only when its own data changed: a snapshot comes every
// second while a run trains, and the page should cost the machine as little as it can.
function changed(part, value) {
  const encoded = JSON.stringify(value);
  if (state.seen[part] === encoded) return false;
  state.seen[part] = encoded;
  return true;
}

function renderOverview(o) {
  if (changed("runs", o.runs)) renderRuns(o);
  if (changed("samplers", [o.samplers, o.rollout])) renderSamplers(o);
  if (changed("usage", o.usage)) renderUsage(o.usage);
}

function renderRuns(o) {
  const body = $("#runs tbody");
  body.replaceChildren();
  for (const r of o.runs) {
    const tr = document.createElement("tr");
    tr.dataset.run = r.id;
    tr.dataset.state = r.state;
    if (r.id === state.run) tr.classList.add("selected");
    tr.append(text("td", r.id, "mono"), text("td", r.state, `state-${r.state}`), text("td", r.queued),
      text("td", r.in_flight), text("td", ago(r.last_activity)), text("td", r.lora_rank));
    tr.addEventListener("click", () => selectRun(r.id));
    body.appendChild(tr);
  }
  $("#no-runs").hidden = o.runs.length > 0;
}

function renderSamplers(o) {
  const engine = o.rollout.engine || "embedded sampler";
  $("#rollout-engine").textContent = `Rollout engine: ${engine}${o.rollout.sync ? ` (sync: ${o.rollout.sync})` : ""}`;
  const samplers = $("#samplers tbody");
  samplers.replaceChildren();
  for (const s of o.samplers) {
    const tr = document.createElement("tr");
    tr.append(text("td", s.tinker_path, "mono"), text("td", s.held_by.length ? s.held_by.join(", ") : engine));
    samplers.appendChild(tr);
  }
  renderReplicas($("#replicas tbody"), o.rollout.replicas, false);
}

function renderReplicas(body, replicas, operator) {
  body.replaceChildren();
  for (const r of replicas) {
    const tr = document.createElement("tr");
    const canary = r.last_canary ? `${r.last_canary.ok ? "ok" : "FAILED"} ${r.last_canary.version || ""} (max diff ${r.last_canary.max_abs_diff})` : "none yet";
    const cells = [text("td", r.name)];
    if (operator) cells.push(text("td", r.url, "mono"));
    cells.push(text("td", r.state), text("td", r.versions.join(", "), "mono"), text("td", canary), text("td", r.restarts));
    if (operator) cells.push(text("td", r.error || ""));
    tr.append(...cells);
    body.appendChild(tr);
  }
}

function renderUsage(u) {
  const today = new Date().toISOString().slice(0, 10);
  const day = (u.days[today] || { totals: {} }).totals;
  const quotaOf = {
    trained_tokens: u.quotas.trained_tokens_per_day, sampled_tokens: u.quotas.sampled_tokens_per_day,
  };
  const body = $("#usage tbody");
  body.replaceChildren();
  for (const [counter, total] of Object.entries(u.totals)) {
    const tr = document.createElement("tr");
    const quota = quotaOf[counter];
    tr.append(text("td", counter), text("td", fmtNum(day[counter] || 0)), text("td", fmtNum(total)),
      text("td", quota == null ? "" : `${fmtNum(quota)} / day`));
    body.appendChild(tr);
  }
  const storage = document.createElement("tr");
  storage.append(text("td", "checkpoint storage"), text("td", ""), text("td", bytes(u.storage.checkpoint_bytes)),
    text("td", u.quotas.storage_bytes == null ? "" : bytes(u.quotas.storage_bytes)));
  body.appendChild(storage);
  for (const name of ["registered_runs", "resident_runs", "queued_ops", "max_lora_rank"]) {
    if (u.quotas[name] == null) continue;
    const tr = document.createElement("tr");
    tr.append(text("td", name), text("td", ""), text("td", ""), text("td", u.quotas[name]));
    body.appendChild(tr);
  }
  const days = Object.keys(u.days).sort();
  const points = days.map((d, i) => [i, u.days[d].totals.trained_tokens || 0]);
  lineChart($("#usage-chart"), [{ name: "trained_tokens", source: "per day", points }], { xLabel: days.length ? `days ${days[0]} .. ${days[days.length - 1]}` : "day" });
}

function fmtNum(v) { return Number.isInteger(v) ? v.toLocaleString() : Number(v.toPrecision(4)).toLocaleString(); }

// The server sends a run's curves whole first (`series`), then only the points after those it
// sent (`series_delta`); the page appends them, skipping steps it holds, and thins a curve that
// grows past twice MAX_POINTS by dropping every other point of it.
const MAX_POINTS = 1000;

function mergeSeries(held, delta) {
  const byKey = new Map(held.map((c) => [`${c.name}\u0000${c.source}`, c]));
  for (const d of delta) {
    const key = `${d.name}\u0000${d.source}`;
    let curve = byKey.get(key);
    if (!curve) {
      curve = { name: d.name, source: d.source, points: [] };
      byKey.set(key, curve);
      held.push(curve);
    }
    const lastStep = curve.points.length ? curve.points[curve.points.length - 1][0] : -1;
    for (const p of d.points) if (p[0] > lastStep) curve.points.push(p);
    if (curve.points.length > 2 * MAX_POINTS) {
      const newest = curve.points[curve.points.length - 1];
      curve.points = curve.points.filter((_, i) => i % 2 === 0);
      if (curve.points[curve.points.length - 1] !== newest) curve.points.push(newest);
    }
  }
  return held;
}

function renderRun(r) {
  if (r.id !== state.run) return;
  if (r.series) state.series = r.series.map((c) => ({ ...c, points: c.points.slice() }));
  else if (r.series_delta) state.series = mergeSeries(state.series || [], r.series_delta);
  const series = JSON.stringify(state.series || []);
  if (series !== state.lastRun) {
    state.lastRun = series;
    lineChart($("#curve"), state.series || []);
  }
  const ckpts = JSON.stringify(r.checkpoints);
  if (ckpts === state.lastCkpts) return;  // keeps a TTL being typed
  state.lastCkpts = ckpts;
  const body = $("#checkpoints tbody");
  body.replaceChildren();
  for (const c of r.checkpoints) {
    const tr = document.createElement("tr");
    tr.dataset.path = c.tinker_path;
    const ttl = document.createElement("input");
    ttl.className = "ttl-input";
    ttl.type = "number";
    ttl.min = "1";
    ttl.placeholder = "none";
    const setTtl = text("button", "Set TTL", "ttl-set");
    setTtl.type = "button";
    setTtl.addEventListener("click", () => act(() => api("PUT", `/runs/${encodeURIComponent(r.id)}/checkpoints/${segs(c.checkpoint_id)}/ttl`,
      { ttl_seconds: ttl.value === "" ? null : Number(ttl.value) })));
    const del = text("button", "Delete", "delete danger");
    del.type = "button";
    del.addEventListener("click", () => {
      if (!confirm(`Delete ${c.tinker_path}?`)) return;
      act(() => api("DELETE", `/runs/${encodeURIComponent(r.id)}/checkpoints/${segs(c.checkpoint_id)}`));
    });
    const actions = document.createElement("td");
    actions.append(ttl, setTtl, del);
    if (c.downloadable) {
      const link = text("a", "PEFT zip", "download");
      link.href = `${API}/runs/${encodeURIComponent(r.id)}/checkpoints/${segs(c.checkpoint_id)}/zip`;
      link.setAttribute("download", "");
      actions.append(" ", link);
    }
    const expires = text("td", c.expires_at_s ? new Date(c.expires_at_s * 1000).toISOString() : "never", "expires");
    tr.append(text("td", c.checkpoint_id, "mono"), text("td", c.checkpoint_type), text("td", bytes(c.size_bytes)),
      expires, document.createElement("td"), actions);
    tr.children[4].textContent = c.expires_at_s ? `${Math.max(0, Math.round(c.expires_at_s - Date.now() / 1000))}` : "";
    body.appendChild(tr);
  }
}

async function act(request) {
  $("#action-error").textContent = "";
  try {
    await request();
    if (state.run) renderRun(await api("GET", `/runs/${encodeURIComponent(state.run)}`));
  } catch (err) {
    $("#action-error").textContent = err.message;
  }
}

// ------------------------------------------------------------------ operator view
function stat(dl, name, value) {
  const div = document.createElement("div");
  div.append(text("dt", name), text("dd", value));
  dl.appendChild(div);
}

function renderOperator(op) {
  const fleet = $("#fleet");
  fleet.replaceChildren();
  stat(fleet, "rounds", op.rounds);
  stat(fleet, "rounds per second", op.rounds_per_s.toFixed(2));
  stat(fleet, "queued ops", `${op.queued_ops} / ${op.max_queued_ops}`);
  if (op.train_tokens_per_round) stat(fleet, "train tokens per round (mean)", op.train_tokens_per_round.mean.toFixed(0));
  const body = $("#op-tenants tbody");
  body.replaceChildren();
  for (const [name, t] of Object.entries(op.tenants)) {
    const tr = document.createElement("tr");
    tr.dataset.tenant = name;
    tr.append(text("td", name, "mono"), text("td", t.queued_ops || 0), text("td", (t.deficit || 0).toFixed(1)),
      text("td", t.weight == null ? "" : t.weight), text("td", fmtNum(t.usage.trained_tokens || 0)),
      text("td", fmtNum(t.usage.sampled_tokens || 0)), text("td", (t.usage.compute_seconds || 0).toFixed(2)),
      text("td", bytes(t.storage_bytes)));
    body.appendChild(tr);
  }
  const foot = $("#op-tenants tfoot");
  foot.replaceChildren();
  const total = document.createElement("tr");
  const u = op.usage_totals;
  total.append(text("th", "total"), text("td", op.queued_ops), text("td", ""), text("td", ""),
    text("td", fmtNum(u.trained_tokens || 0)), text("td", fmtNum(u.sampled_tokens || 0)),
    text("td", (u.compute_seconds || 0).toFixed(2)),
    text("td", bytes(Object.values(op.tenants).reduce((a, t) => a + t.storage_bytes, 0))));
  foot.appendChild(total);
  const tiers = $("#tiers");
  tiers.replaceChildren();
  for (const [tier, n] of Object.entries(op.tiers)) stat(tiers, tier, n);
  const batches = $("#batches tbody");
  batches.replaceChildren();
  for (const [kind, n] of Object.entries(op.batches)) {
    const tr = document.createElement("tr");
    tr.append(text("td", kind), text("td", n), text("td", op.mixed_batches[kind] || 0),
      text("td", op.cross_tenant_batches[kind] || 0), text("td", op.max_batch_clients[kind] || 0));
    batches.appendChild(tr);
  }
  $("#op-rollout-engine").textContent = `Rollout engine: ${op.rollout.engine || "embedded sampler"}`;
  renderReplicas($("#op-replicas tbody"), op.rollout.replicas, true);
}

// ------------------------------------------------------------------ start
(async () => {
  try {
    const resp = await fetch(`${API}/session`, { credentials: "same-origin" });
    if (resp.ok) showApp(await resp.json()); else showSignIn();
  } catch (err) {
    showSignIn(String(err));
  }
  document.body.dataset.ready = "1";  // signed in or not is now known (tests, benches)
})();
