// tokenmill's live dashboard: polls dashboard/data (the server's metrics history, one reading a second)
// and dashboard/requests (the in-flight table), and draws them with uPlot. No build step.
"use strict";

const KEEP_S = 600;  // what the charts show: the last ten minutes
const POLL_MS = 1000;
const TABLE_MS = 2000;
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd"];

// [frame key, label, scale factor to the unit shown, optional: drawn only where the server reports it]
const CHARTS = [
  {id: "requests", title: "Requests", unit: "", series: [["running", "running", 1], ["waiting", "waiting", 1]]},
  {id: "cache", title: "KV cache used and prefix-cache hit rate (%)", unit: "%",
   series: [["kv_usage", "KV cache used", 100], ["prefix_hit_rate", "prefix-cache hits", 100]]},
  {id: "ttft", title: "Time to first token (ms)", unit: "ms", series: [["ttft_p50", "p50", 1000], ["ttft_p99", "p99", 1000]]},
  {id: "itl", title: "Inter-token latency (ms)", unit: "ms", series: [["itl_p50", "p50", 1000], ["itl_p99", "p99", 1000]]},
  {id: "tps", title: "Tokens/s", unit: "", series: [["prompt_tps", "prompt", 1], ["generation_tps", "generation", 1]]},
  {id: "events", title: "Events/s", unit: "",
   series: [["finished_per_s", "requests finished", 1], ["preemptions_per_s", "preemptions", 1], ["shed_per_s", "refused", 1]]},
  {id: "device", title: "Device and engine CPU (%)", unit: "%",
   series: [["device_busy", "device busy", 100], ["flops_utilization", "of peak FLOP/s", 100],
            ["bandwidth_utilization", "of peak bandwidth", 100], ["engine_cpu_utilization", "engine CPU", 100],
            ["gpu_utilization", "GPU (NVML)", 100, true]]},
  {id: "simcheck", title: "The simulator against the served traffic (ms; step error %)", unit: "",
   onlyIf: "replay_ttft_predicted",
   series: [["replay_ttft_observed", "TTFT served", 1000], ["replay_ttft_predicted", "TTFT replayed", 1000],
            ["replay_tpot_observed", "TPOT served", 1000], ["replay_tpot_predicted", "TPOT replayed", 1000],
            ["step_prediction_error", "step-time error %", 100]]},
  {id: "spec", title: "Speculative decoding acceptance (%)", unit: "%", onlyIf: "spec_acceptance",
   series: [["spec_acceptance", "acceptance rate", 100]]},
];

// [frame key, label, scale, decimals, unit]
const TILES = [
  ["running", "running", 1, 0, ""], ["waiting", "waiting", 1, 0, ""], ["kv_usage", "KV cache used", 100, 1, "%"],
  ["generation_tps", "generation tokens/s", 1, 1, ""], ["prompt_tps", "prompt tokens/s", 1, 1, ""],
  ["ttft_p99", "TTFT p99", 1000, 0, " ms"], ["itl_p99", "ITL p99", 1000, 0, " ms"],
  ["device_busy", "device busy", 100, 0, "%"], ["flops_utilization", "of peak FLOP/s", 100, 1, "%"],
  ["generation_tokens_total", "generation tokens", 1, 0, ""], ["finished_total", "requests finished", 1, 0, ""],
  ["preemptions_total", "preemptions", 1, 0, ""],
];

const state = {since: 0, cols: null, charts: {}, lastOk: 0};

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function url(path) {  // relative to the page: works behind a path prefix, never carries URL credentials
  return new URL(path, location.origin + location.pathname).toString();
}

function buildTiles() {
  const box = document.getElementById("tiles");
  for (const [key, label] of TILES) {
    const t = el("div", {class: "tile"});
    t.append(el("div", {class: "label"}, label), el("div", {class: "value", id: "v-" + key, "data-value": ""}, "-"));
    box.append(t);
  }
}

function chartWidth(box) { return Math.max(300, box.clientWidth - 10); }

function buildChart(spec, cols) {
  spec.shown = spec.series.filter(([key, , , optional]) => !optional || (cols[key] || []).some(v => v !== null));
  const box = el("div", {class: "chart", id: "chart-" + spec.id});
  document.getElementById("charts").append(box);
  const opts = {
    title: spec.title, width: chartWidth(box), height: 200,
    scales: {x: {time: true}, y: {range: (u, min, max) => [0, Math.max(max || 0, 1)]}},
    series: [{}].concat(spec.shown.map(([, label], i) => ({label: label, stroke: COLORS[i % COLORS.length],
                                                           width: 2, spanGaps: false}))),
    axes: [{}, {size: 60}],
  };
  state.charts[spec.id] = {spec, plot: new uPlot(opts, [[]].concat(spec.shown.map(() => [])), box), box};
}

function append(frames) {
  const n = frames.time.length;
  if (!n) return;
  if (!state.cols) state.cols = Object.fromEntries(Object.keys(frames).map(k => [k, []]));
  for (const [k, v] of Object.entries(frames)) (state.cols[k] = state.cols[k] || []).push(...v);
  const cutoff = frames.time[n - 1] - KEEP_S;
  let drop = 0;
  while (drop < state.cols.time.length && state.cols.time[drop] < cutoff) drop++;
  if (drop) for (const k of Object.keys(state.cols)) state.cols[k].splice(0, drop);
  state.since = frames.time[n - 1];
}

function scaled(values, factor) { return values.map(v => (v === null || v === undefined) ? null : v * factor); }

function render() {
  const c = state.cols;
  if (!c) return;
  for (const spec of CHARTS) {
    if (spec.onlyIf && !(c[spec.onlyIf] || []).some(v => v !== null)) continue;
    if (!state.charts[spec.id]) buildChart(spec, c);
    const data = [c.time].concat(spec.shown.map(([key, , f]) => scaled(c[key] || c.time.map(() => null), f)));
    state.charts[spec.id].plot.setData(data);
  }
  const last = c.time.length - 1;
  for (const [key, , f, digits, unit] of TILES) {
    const v = (c[key] || [])[last];
    const e = document.getElementById("v-" + key);
    e.dataset.value = (v === null || v === undefined) ? "" : String(v);
    e.textContent = (v === null || v === undefined) ? "-" : (v * f).toFixed(digits) + unit;
  }
  document.body.dataset.sampleTime = String(c.time[last]);
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const r = await fetch(url("dashboard/data?since=" + state.since), {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const d = await r.json();
    document.getElementById("model").textContent = d.model;
    document.getElementById("device").textContent = d.device;
    document.getElementById("device").title = d.roofline_source;
    document.getElementById("window").textContent = d.window;
    append(d.frames);
    render();
    state.lastOk = Date.now();
    status.textContent = "live";
    status.classList.remove("error");
  } catch (e) {
    status.textContent = "no data: " + e.message;
    status.classList.add("error");
  }
  setTimeout(poll, POLL_MS);
}

function age(s) { return s < 60 ? s.toFixed(1) + " s" : (s / 60).toFixed(1) + " min"; }

async function pollRequests() {
  try {
    const r = await fetch(url("dashboard/requests"), {cache: "no-store"});
    if (r.ok) {
      const d = await r.json();
      const body = document.querySelector("#requests tbody");
      body.replaceChildren(...d.requests.map(q => {
        const tr = el("tr", {"data-id": q.id});
        tr.addEventListener("click", () => showTimeline(q.id));
        tr.append(el("td", {}, q.id), el("td", {}, q.state), el("td", {}, q.computed_tokens + " / " + q.total_tokens),
                  el("td", {}, q.output_tokens + " / " + q.max_tokens), el("td", {}, age(q.age_s)));
        return tr;
      }));
      document.getElementById("requests-count").textContent = "(" + d.total + ")";
    }
  } catch (e) { /* the status line reports a dead server */ }
  setTimeout(pollRequests, TABLE_MS);
}

// ---- a request's timeline as a waterfall (GET v1/requests/{id}/timeline) ------------------------------

const MAX_TIMELINE_ROWS = 400;

function ms(s) { return (1000 * s).toFixed(s < 0.1 ? 1 : 0) + " ms"; }

function timelineRow(label, title, t0, t1, total, cls) {
  const row = el("div", {class: "tl-row", title: title});
  const track = el("div", {class: "tl-track"});
  const bar = el("div", {class: "tl-bar " + cls});
  bar.style.left = (100 * t0 / total) + "%";
  bar.style.width = cls === "tl-mark" ? "" : Math.max(0.15, 100 * (t1 - t0) / total) + "%";
  track.append(bar);
  row.append(el("div", {class: "tl-label"}, label), track);
  return row;
}

async function showTimeline(id) {
  const box = document.getElementById("timeline");
  const summary = document.getElementById("timeline-summary");
  document.getElementById("timeline-id").value = id;
  const r = await fetch(url("v1/requests/" + encodeURIComponent(id) + "/timeline"), {cache: "no-store"});
  const d = await r.json();
  if (!r.ok) {
    box.replaceChildren();
    box.removeAttribute("data-request");
    summary.replaceChildren(el("span", {class: "error"}, (d.error && d.error.message) || ("HTTP " + r.status)));
    return;
  }
  const steps = d.events.filter(e => e.event === "step");
  const last = d.events.reduce((m, e) => Math.max(m, e.t + (e.duration || 0)), 0);
  const total = Math.max(last, 1e-6);
  const rows = [];
  if (steps.length) rows.push(timelineRow("queued", "from arrival to its first step", 0, steps[0].t, total, "tl-queue"));
  for (const e of d.events) {
    if (rows.length >= MAX_TIMELINE_ROWS) break;
    if (e.event === "step") {
      const others = e.batch.map(b => b.request_id + ": " + b.kind + " " + b.tokens).join("\n");
      const n = e.batch_size - 1;
      rows.push(timelineRow("step " + e.step + ": " + e.kind + " " + e.tokens + " + " + n + " other" + (n === 1 ? "" : "s"), ms(e.duration) + (others ? "\nwith:\n" + others : ""),
                            e.t, e.t + e.duration, total, e.kind === "prefill" ? "tl-prefill" : "tl-decode"));
    } else if (e.event === "preempted") {
      rows.push(timelineRow("preempted for " + e.needed_by, e.reason, e.t, e.t, total, "tl-preempted tl-mark"));
    } else if (e.event === "kv_transfer") {
      rows.push(timelineRow("KV " + e.direction + ": " + e.blocks + " blocks", e.error || ms(e.duration),
                            e.t, e.t + e.duration, total, "tl-kv"));
    } else if (e.event === "first_token" || e.event === "finished") {
      rows.push(timelineRow(e.event.replace("_", " ") + " at " + ms(e.t), e.reason || "", e.t, e.t, total, "tl-mark"));
    }
  }
  box.replaceChildren(...rows);
  box.setAttribute("data-request", d.request_id);
  box.setAttribute("data-steps", String(steps.length));
  const lines = [d.request_id + ": " + d.status + ", " + d.prompt_tokens + " prompt tokens (" + d.cached_tokens +
                 " cached), " + d.output_tokens + " output, " + d.num_preemptions + " preemptions" +
                 (d.ttft_s !== null ? ", TTFT " + ms(d.ttft_s) : "")];
  if (d.ttft_blame) lines.push("TTFT: " + d.ttft_blame.summary);
  for (const s of d.itl_blame.spikes.slice(0, 3)) lines.push("a " + ms(s.gap_s) + " gap at step " + s.step + ": " + s.cause);
  if (d.note) lines.push(d.note);
  summary.replaceChildren(...lines.map(t => el("div", {}, t)));
}

document.getElementById("timeline-form").addEventListener("submit", ev => {
  ev.preventDefault();
  const id = document.getElementById("timeline-id").value.trim();
  if (id) showTimeline(id).catch(e => { document.getElementById("timeline-summary").textContent = e.message; });
});

window.addEventListener("resize", () => {
  for (const c of Object.values(state.charts)) c.plot.setSize({width: chartWidth(c.box), height: 200});
});

buildTiles();
poll();
pollRequests();
