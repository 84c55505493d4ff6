// The dashboard page: reads /state, then follows /events (server-sent events),
// and draws the rank table, the charts (plotly.js served by the command) and the
// run's configuration. No framework, nothing fetched from elsewhere.
"use strict";

const token = new URLSearchParams(location.search).get("token");
const query = token ? "?token=" + encodeURIComponent(token) : "";
const REDRAW_MS = 400;

let view = null;          // the latest state from the server
let receivedAt = 0;       // Date.now() when it came (heartbeats tick from there)
let traces = null;        // chart series built from the points
let chartsDirty = false;
let revision = 0;         // tells Plotly.react that the (same) arrays grew
// plotly's own colours, given by hand so that a rank's raw and smoothed curves share one
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                "#7f7f7f", "#bcbd22", "#17becf"];
const SMOOTHING_DEFAULT = 0.9;

// The loss curves' smoothing, as TensorBoard's slider: the weight of an exponential moving
// average (0: off). Kept in the browser, so a reload keeps the reader's choice.
const smoothing = {
  weight: SMOOTHING_DEFAULT,
  showRaw: true,
  load() {
    try {
      const kept = localStorage.getItem("exogym.smoothing");
      if (kept !== null && Number(kept) >= 0 && Number(kept) < 1) this.weight = Number(kept);
      this.showRaw = localStorage.getItem("exogym.showRaw") !== "false";
    } catch (error) { /* storage disabled: the defaults */ }
  },
  save() {
    try {
      localStorage.setItem("exogym.smoothing", String(this.weight));
      localStorage.setItem("exogym.showRaw", String(this.showRaw));
    } catch (error) { /* storage disabled: the choice lasts until a reload */ }
  },
};

// TensorBoard's smoothing: an exponential moving average debiased for its first points
// (so the curve starts at the data, not at zero); a non-finite value is kept as it is.
function smooth(values, weight) {
  const out = new Array(values.length);
  let last = 0;
  let count = 0;
  for (let i = 0; i < values.length; i += 1) {
    const y = values[i];
    if (y === null || !Number.isFinite(y)) { out[i] = y; continue; }
    last = last * weight + (1 - weight) * y;
    count += 1;
    out[i] = last / (1 - Math.pow(weight, count));
  }
  return out;
}

// A chart's traces for per-step losses: each series smoothed in its own colour, over its
// raw points drawn faintly (when asked for); the raw points alone when smoothing is off.
function lossTraces(list) {
  const out = [];
  list.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const base = { type: "scatter", mode: "lines", name: s.name, legendgroup: s.name };
    if (smoothing.weight <= 0) {
      out.push(Object.assign({}, base, { x: s.x, y: s.y, meta: "raw", line: { color: color } }));
      return;
    }
    if (smoothing.showRaw) {
      out.push(Object.assign({}, base, { x: s.x, y: s.y, meta: "raw", showlegend: false,
                                         opacity: 0.25, line: { color: color, width: 1 },
                                         hoverinfo: "skip" }));
    }
    out.push(Object.assign({}, base, { x: s.x, y: smooth(s.y, smoothing.weight),
                                       meta: "smoothed", line: { color: color, width: 2 } }));
  });
  return out;
}

function validationTraces(list, offset) {  // evaluations are few: never smoothed
  return list.map((s, i) => Object.assign({}, s, {
    meta: "validation",
    line: Object.assign({}, s.line, { color: COLORS[(offset + i) % COLORS.length] }) }));
}

function resetTraces() {
  traces = { lossStep: new Map(), valStep: new Map(), lossBytes: new Map(), rate: new Map() };
}

// Text for plotly (a trace's name in the legend and the hover label, a title): plotly
// reads <a href>, <b>, <br> and the like in such text as markup, so a host or a run named
// '<a href="...">Click to re-authenticate</a>' would be a link on the page. Written with
// entities, which plotly shows as the characters they stand for, it stays text.
function plotlyText(text) {
  return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

function series(map, key, name, extra) {
  let s = map.get(key);
  if (!s) {
    s = Object.assign({ x: [], y: [], name: plotlyText(name), type: "scatter", mode: "lines" },
                      extra || {});
    map.set(key, s);
  }
  return s;
}

function runLabel(run) {
  const runs = view ? view.runs : [];
  return runs.length > 1 && runs[run] ? runs[run].name + " " : "";
}

function addPoints(points) {
  for (const p of points) {
    const label = runLabel(p.run);
    const key = p.run + ":" + p.rank;
    if (p.loss !== null) {
      const s = series(traces.lossStep, key, label + "rank " + p.rank);
      s.x.push(p.step); s.y.push(p.loss);
      const b = series(traces.lossBytes, key, label + "rank " + p.rank);
      b.x.push(p.bytes); b.y.push(p.loss);
    }
    if (p.val_loss !== undefined && p.val_loss !== null && p.rank === 0) {
      const v = series(traces.valStep, String(p.run), label + "validation",
                       { mode: "lines+markers", line: { dash: "dot", width: 3 } });
      v.x.push(p.step); v.y.push(p.val_loss);
    }
    if (p.host_samples_per_s !== null && p.host_samples_per_s !== undefined) {
      const r = series(traces.rate, p.run + ":" + p.host, label + p.host);
      r.x.push(p.host_wall_s); r.y.push(p.host_samples_per_s);
    }
  }
  chartsDirty = true;
}

function fmt(value, digits) {
  if (value === null || value === undefined) return "-";
  const x = Number(value);
  return x !== 0 && Math.abs(x) < 0.001 ? x.toExponential(2) : x.toFixed(digits);
}

function percent(value) {  // 0.875 -> "87.5%"
  return value === null || value === undefined ? "-" : (100 * Number(value)).toFixed(1) + "%";
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return i === 0 ? n.toFixed(0) + " B" : n.toFixed(1) + " " + units[i];
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function drawTable() {
  const table = document.getElementById("ranks");
  table.classList.toggle("single", view.runs.length <= 1);
  // a task that scores accuracy gets its column, as in the terminal's table
  table.classList.toggle("no-acc", !view.ranks.some((r) => r.val_accuracy !== null &&
                                                         r.val_accuracy !== undefined));
  // asynchronous DiLoCo: the global version each rank trains from
  table.classList.toggle("no-version", !view.ranks.some((r) => r.version !== null &&
                                                             r.version !== undefined));
  const body = table.tBodies[0];
  const rows = [];
  for (const r of view.ranks) {
    const tr = document.createElement("tr");
    tr.id = "rank-" + r.run + "-" + r.rank;
    tr.className = "rank-row";
    tr.dataset.run = r.run;
    tr.dataset.rank = r.rank;
    tr.dataset.step = r.step;
    tr.dataset.state = r.state;
    cell(tr, view.runs[r.run] ? view.runs[r.run].name : "", "run-col");
    cell(tr, r.host, "host");
    cell(tr, String(r.rank), "rank");
    cell(tr, r.state, "state state-" + r.state);
    cell(tr, r.max_steps ? r.step + "/" + r.max_steps : String(r.step), "step");
    cell(tr, fmt(r.loss, 4), "loss");
    cell(tr, fmt(r.val_loss, 4), "val-loss");
    cell(tr, percent(r.val_accuracy), "val-acc acc-col");
    cell(tr, fmt(r.samples_per_s, 1), "rate");
    cell(tr, r.version === null || r.version === undefined ? "-" : "v" + r.version,
         "version version-col");
    cell(tr, bytes(r.bytes_sent), "sent");
    const hb = cell(tr, "-", "heartbeat");
    if (r.heartbeat_age_s !== null) hb.dataset.age = r.heartbeat_age_s;
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  tickHeartbeats();
}

function mbit(bps) {  // 38200000 -> "38.2 Mbit/s"
  if (bps === null || bps === undefined) return "-";
  return bps >= 1e9 ? (bps / 1e9).toFixed(2) + " Gbit/s" : (bps / 1e6).toFixed(1) + " Mbit/s";
}

function gib(n) {  // as the terminal: "0.8 GiB", "16 GiB"
  const value = n / 2 ** 30;
  return (value < 10 ? value.toFixed(1) : value.toFixed(0)) + " GiB";
}

function share(value) {  // 0.456 -> "46%"
  return value === null || value === undefined ? "-" : Math.round(100 * value) + "%";
}

function ofTotal(used, total) {
  if (used === null || used === undefined) return "-";
  return total === null || total === undefined ? gib(used) : gib(used) + " of " + gib(total);
}

// Each host's link and health (exogym.report.health): the terminal's hosts table.
function drawHosts() {
  const list = view.hosts || [];
  document.getElementById("hosts-section").hidden = list.length === 0;
  const table = document.getElementById("hosts");
  table.classList.toggle("single", view.runs.length <= 1);
  table.classList.toggle("no-gpu", !list.some((h) => h.gpu_bytes !== null ||
                                                     h.gpu_percent !== null));
  const rows = list.map((h) => {
    const tr = document.createElement("tr");
    tr.className = "host-row" + (h.low_memory ? " low-memory" : "");
    tr.dataset.host = h.host;
    cell(tr, view.runs[h.run] ? view.runs[h.run].name : "", "run-col");
    cell(tr, h.host, "host");
    cell(tr, mbit(h.link_bps), "link");
    cell(tr, h.sync_done === null ? "idle" : share(h.sync_done), "sync");
    cell(tr, share(h.waiting), "waiting");
    cell(tr, h.cpu_percent === null ? "-" : Math.round(h.cpu_percent) + "%", "cpu");
    cell(tr, h.rss_bytes === null ? "-" : gib(h.rss_bytes), "rss");
    cell(tr, ofTotal(h.available_bytes, h.total_bytes) + (h.low_memory ? " LOW" : ""),
         "available");
    cell(tr, h.gpu_percent === null ? "-" : Math.round(h.gpu_percent) + "%", "gpu gpu-col");
    cell(tr, ofTotal(h.gpu_bytes, h.gpu_total_bytes), "gpu-memory gpu-col");
    return tr;
  });
  table.tBodies[0].replaceChildren(...rows);
  // as the launcher says it: "192.168.1.101 has 0.8 GiB of 16 GiB memory left"
  document.getElementById("host-warnings").textContent = list
    .filter((h) => h.low_memory && h.available_bytes !== null && h.total_bytes !== null)
    .map((h) => h.host + " has " + gib(h.available_bytes) + " of " + gib(h.total_bytes) +
                " memory left")
    .join(" · ");
}

function tickHeartbeats() {
  const since = (Date.now() - receivedAt) / 1000;
  for (const td of document.querySelectorAll("td.heartbeat[data-age]")) {
    td.textContent = (Number(td.dataset.age) + since).toFixed(1) + " s ago";
  }
}

function duration(seconds, precise) {  // 20.7 -> "20.7 s" (precise) or "21 s"; 125 -> "2 min 5 s"
  if (seconds < 60) return (precise ? seconds.toFixed(1) : seconds.toFixed(0)) + " s";
  const total = Math.round(seconds);
  if (total < 3600) return Math.floor(total / 60) + " min " + (total % 60) + " s";
  return Math.floor(total / 3600) + " h " + Math.floor((total % 3600) / 60) + " min";
}

// The header's time: a running run's counts on between messages; a finished (or failed)
// run's is its own duration, as the server gave it, and stays put.
function tickElapsed() {
  const status = document.getElementById("status");
  if (status.dataset.prefix === undefined) return;
  let text = status.dataset.prefix;
  if (status.dataset.elapsed !== undefined) {
    const running = status.dataset.running === "1";
    const seconds = Number(status.dataset.elapsed) +
      (running ? (Date.now() - receivedAt) / 1000 : 0);
    text += " · " + duration(seconds, !running);
  }
  status.textContent = text;
}

function drawStatus() {
  document.getElementById("title").textContent = view.title;
  document.title = view.title + " · exogym";
  const run = view.runs[view.runs.length - 1];
  const status = document.getElementById("status");
  if (!run) { status.textContent = "waiting for the run to start"; return; }
  const names = { waiting: "waiting", running: "running", done: "finished", failed: "failed" };
  status.dataset.prefix = run.name + ": " + (names[run.status] || run.status);
  status.dataset.running = run.status === "running" ? "1" : "";
  if (run.elapsed_s === null) delete status.dataset.elapsed;
  else status.dataset.elapsed = run.elapsed_s;
  status.className = "status state-" + (run.status === "running" ? "training" : run.status);
  tickElapsed();
  const lines = [];
  for (const r of view.runs) {
    const s = r.summary;
    if (!s) continue;
    const val = s.final_val_global_loss ?? s.final_val_loss;
    const acc = s.final_val_accuracy === null || s.final_val_accuracy === undefined ? ""
      : ", val acc " + percent(s.final_val_accuracy) + " (rank 0)";
    lines.push(r.name + ": " + s.steps + " steps, train loss " + fmt(s.final_train_loss, 4) +
               ", val loss " + fmt(val, 4) + acc + ", " + bytes(s.bytes_per_node || 0) +
               " sent per node, " + fmt(s.wall_s, 1) + " s");
  }
  for (const change of run.membership || []) {
    if (change.reason === "start") continue;
    lines.push("step " + change.step + ": " + change.reason + "; training on " +
               change.hosts.join(", "));
  }
  document.getElementById("summary").textContent = lines.join(" · ");
  drawFaults(run);
}

// The faults injected into the run (--inject, --inject-random): one line each, as they come.
function drawFaults(run) {
  const box = document.getElementById("faults");
  const list = run.fault_lines || [];
  box.hidden = list.length === 0;
  if (box.childElementCount === list.length + 1) return;
  box.replaceChildren();
  const title = document.createElement("h3");
  const active = (run.faults || []).filter((f) => f.state === "active").length;
  title.textContent = "Injected faults (" + (run.faults || []).length + ")" +
    (active ? ", " + active + " under way" : "");
  box.appendChild(title);
  for (const line of list) {
    const item = document.createElement("div");
    item.className = "fault";
    item.textContent = line;
    box.appendChild(item);
  }
}

let configShown = -1;  // runs whose configuration is drawn (redrawn only when one is added)

function drawConfig() {
  if (configShown === view.runs.length) return;
  configShown = view.runs.length;
  const box = document.getElementById("config");
  const blocks = view.runs.map((run, i) => {
    const details = document.createElement("details");
    details.open = i === view.runs.length - 1;
    const title = document.createElement("summary");
    title.textContent = run.name;
    const list = document.createElement("dl");
    for (const [key, value] of Object.entries(run.config)) {
      const item = document.createElement("div");
      const name = document.createElement("dt");
      const text = document.createElement("dd");
      name.textContent = key;
      text.textContent = typeof value === "object" && value !== null
        ? JSON.stringify(value) : String(value);
      item.append(name, text);
      list.appendChild(item);
    }
    details.append(title, list);
    return details;
  });
  box.replaceChildren(...blocks);
}

function layout(title, xTitle, yTitle, yType) {
  const yaxis = { title: { text: plotlyText(yTitle) }, type: yType || "linear" };
  if (!yType) yaxis.rangemode = "tozero";  // a rate: its drops read against zero
  return { title: { text: plotlyText(title), font: { size: 14 } },
           margin: { l: 55, r: 10, t: 35, b: 40 },
           xaxis: { title: { text: plotlyText(xTitle), standoff: 4 } },
           yaxis: yaxis,
           legend: { orientation: "h", x: 0, y: -0.2, yanchor: "top" },
           uirevision: "keep", datarevision: revision };
}

function ordered(map) {  // traces in run, then rank (or host) order, whatever reported first
  return [...map.entries()]
    .sort((a, b) => a[0].localeCompare(b[0], undefined, { numeric: true }))
    .map((entry) => entry[1]);
}

const drawn = new Set();  // the charts plotly has drawn (those with data)

function plot(id, data, chartLayout) {
  const gd = document.getElementById(id);
  if (!data.some((t) => t.x.length > 0)) {  // nothing to show: the placeholder says why
    if (drawn.delete(id)) Plotly.purge(gd);
    return;
  }
  Plotly.react(gd, data, chartLayout,
               { displaylogo: false, displayModeBar: false, responsive: true });
  drawn.add(id);
}

function drawCharts() {
  if (chartsDirty && typeof Plotly !== "undefined") {
    chartsDirty = false;
    revision += 1;
    const ranks = ordered(traces.lossStep);
    plot("chart-loss-step",
         [...lossTraces(ranks), ...validationTraces(ordered(traces.valStep), ranks.length)],
         layout("loss vs step", "step", "loss", "log"));
    plot("chart-loss-bytes", lossTraces(ordered(traces.lossBytes)),
         layout("loss vs bytes sent", "bytes sent by the rank", "training loss", "log"));
    plot("chart-throughput", ordered(traces.rate),
         layout("throughput per host", "seconds of training (the host's clock)",
                "samples/s (last " + view.rate_window_s + " s)"));
  }
  drawPlaceholders();
}

// Until a chart is drawn, its box says what it will show and what it is waiting for.
function drawPlaceholders() {
  for (const box of document.querySelectorAll(".placeholder")) {
    const id = box.dataset.for;
    box.hidden = drawn.has(id);
    if (box.hidden) continue;
    let why;
    if (window.plotlyFailed) {
      why = "the chart library (plotly.min.js) did not load: reload the page";
    } else if (typeof Plotly === "undefined") {
      why = "loading the chart library…";
    } else if (view === null || !view.runs.length) {
      why = "waiting for the run to start…";
    } else if (id === "chart-throughput" && view.seq > 0) {
      why = "shown once a host has trained for " + view.rate_min_span_s + " s";
    } else {
      why = "waiting for the first step…";
    }
    if (box.dataset.why === why) continue;
    box.dataset.why = why;
    box.classList.toggle("failed", Boolean(window.plotlyFailed));
    const title = document.createElement("strong");
    const text = document.createElement("span");
    title.textContent = box.dataset.title;
    text.textContent = why;
    box.replaceChildren(title, text);
  }
}

function apply(next) {
  if (next.since === 0 || traces === null) resetTraces();
  view = next;
  receivedAt = Date.now();
  addPoints(next.points);
  drawStatus();
  drawTable();
  drawHosts();
  drawConfig();
}

function connect() {
  const line = document.getElementById("connection");
  const events = new EventSource("events" + query);
  const ended = () => view !== null && view.runs.length > 0 &&
    view.runs.every((r) => r.status === "done" || r.status === "failed");
  const say = () => {
    line.textContent = ended() ? "the run has ended; this is its final state" : "live";
  };
  events.onopen = say;
  events.onmessage = (message) => {
    apply(JSON.parse(message.data));
    if (view.closed) {  // the command is exiting: keep what is shown, stop asking
      events.close();
      line.textContent = "the command has exited; this is its final state";
    } else {
      say();
    }
  };
  events.onerror = () => { line.textContent = "reconnecting…"; };
}

fetch("state" + query)
  .then((response) => response.json())
  .then((state) => { if (view === null) apply(state); })
  .finally(connect);
function setUpSmoothing() {
  smoothing.load();
  const slider = document.getElementById("smoothing");
  const shown = document.getElementById("smoothing-value");
  const raw = document.getElementById("show-raw");
  const show = () => {
    shown.textContent = smoothing.weight > 0 ? smoothing.weight.toFixed(2) : "off";
    raw.disabled = smoothing.weight <= 0;  // off: the raw points are the curve
  };
  slider.value = smoothing.weight;
  raw.checked = smoothing.showRaw;
  show();
  slider.addEventListener("input", () => {
    smoothing.weight = Math.min(Math.max(Number(slider.value), 0), 0.99);
    smoothing.save();
    show();
    chartsDirty = traces !== null;
    drawCharts();
  });
  raw.addEventListener("change", () => {
    smoothing.showRaw = raw.checked;
    smoothing.save();
    chartsDirty = traces !== null;
    drawCharts();
  });
}

setUpSmoothing();
drawPlaceholders();
setInterval(drawCharts, REDRAW_MS);
setInterval(() => { tickHeartbeats(); tickElapsed(); }, 1000);
