// Draws an exported Chrome trace (trace-event JSON) as a Perfetto-style timeline on a canvas: one
// row per track (process / thread), spans nested by depth, counters as step lines. The console's
// own view of what GET /api/v1/sessions/{id}/trace answers (Perfetto UI opens the same file).
import { h } from "./dom.js";

const COLORS = { request: "#9fb4f5", queued: "#f2c46d", running: "#5b7ee5", cycle: "#3cae74", sampling: "#c46bd6" };
const ROW = 18;
const LEFT = 8;  // the canvas's margin before the time axis starts
const FONT = "11px system-ui, sans-serif";

function tracks(trace) {
  const names = new Map(); const procs = new Map();
  for (const e of trace.traceEvents) {
    if (e.ph === "M" && e.name === "process_name") procs.set(e.pid, e.args.name);
    if (e.ph === "M" && e.name === "thread_name") names.set(`${e.pid}/${e.tid}`, e.args.name);
  }
  const spans = new Map(); const counters = new Map();
  for (const e of trace.traceEvents) {
    if (e.ph === "X") {
      const k = `${e.pid}/${e.tid}`;
      if (!spans.has(k)) spans.set(k, []);
      spans.get(k).push(e);
    } else if (e.ph === "C") {
      const series = Object.keys(e.args)[0];
      if (!counters.has(e.name)) counters.set(e.name, []);
      counters.get(e.name).push([e.ts, e.args[series]]);
    }
  }
  const out = [];
  for (const [k, list] of [...spans.entries()].sort((a, b) => {
    const [pa, ta] = a[0].split("/").map(Number); const [pb, tb] = b[0].split("/").map(Number);
    return pa - pb || ta - tb;
  })) {
    list.sort((a, b) => a.ts - b.ts || b.dur - a.dur);
    const stack = []; let depth = 1;
    for (const e of list) {  // depth by nesting: a span inside the one before it goes one row down
      while (stack.length && stack[stack.length - 1].ts + stack[stack.length - 1].dur <= e.ts) stack.pop();
      e._depth = stack.length; stack.push(e); depth = Math.max(depth, stack.length);
    }
    const pid = Number(k.split("/")[0]);
    out.push({ label: `${procs.get(pid) || pid} › ${names.get(k) || k}`, spans: list, depth });
  }
  for (const [name, points] of counters) out.push({ label: `counter › ${name}`, points, depth: 2 });
  return out;
}

// The track labels are text beside the canvas, their column as wide as the longest label (measured
// in the canvas's font), so no label is cut short; the canvas draws the time axis and the tracks.
function labelWidth(rows, font) {
  const g = document.createElement("canvas").getContext("2d");
  g.font = font;
  return Math.ceil(Math.max(120, ...rows.map((r) => g.measureText(r.label).width)) + 16);
}

export function timeline(trace, width = 1200) {
  const rows = tracks(trace);
  // the time axis spans the spans (counters' per-second buckets run to the range's end; they are clipped)
  let t0 = Infinity; let t1 = -Infinity;
  for (const r of rows) for (const e of r.spans || []) { t0 = Math.min(t0, e.ts); t1 = Math.max(t1, e.ts + e.dur); }
  if (!(t1 > t0)) for (const r of rows) for (const [ts] of r.points || []) { t0 = Math.min(t0, ts); t1 = Math.max(t1, ts); }
  const pad = (t1 - t0) * 0.02; t0 -= pad; t1 += pad;
  const box = h("div", { class: "timeline", id: "timeline" });
  if (!rows.length || !(t1 > t0)) { box.append(h("p", { class: "muted" }, "nothing in this range")); return box; }
  const height = 24 + rows.reduce((n, r) => n + r.depth * ROW + 6, 0);
  const labelsWidth = Math.min(labelWidth(rows, FONT), width / 2);
  const plotWidth = width - labelsWidth;
  const labels = h("div", { class: "tl-labels", style: `width:${labelsWidth}px;height:${height}px` });
  const canvas = h("canvas", { width: plotWidth * devicePixelRatio, height: height * devicePixelRatio, style: `width:${plotWidth}px;height:${height}px` });
  const g = canvas.getContext("2d");
  g.scale(devicePixelRatio, devicePixelRatio);
  g.font = FONT;
  const x = (ts) => LEFT + ((ts - t0) / (t1 - t0)) * (plotWidth - LEFT - 10);
  g.fillStyle = "#667085";
  for (let i = 0; i <= 5; i += 1) {
    const ts = t0 + ((t1 - t0) * i) / 5;
    const text = `+${((ts - t0) / 1e6).toFixed(2)} s`;
    g.fillText(text, Math.min(Math.max(0, x(ts) - 14), plotWidth - g.measureText(text).width - 2), 12);
    g.fillStyle = "#eef0f4"; g.fillRect(x(ts), 16, 1, height); g.fillStyle = "#667085";
  }
  let y = 22;
  for (const r of rows) {
    const h0 = r.depth * ROW;
    labels.append(h("div", { class: "tl-label", style: `top:${y + 1}px`, title: r.label }, r.label));
    if (r.spans) {
      for (const e of r.spans) {
        const left = x(e.ts); const w = Math.max(1, x(e.ts + e.dur) - left);
        g.fillStyle = COLORS[e.cat] || "#8892a6";
        g.fillRect(left, y + e._depth * ROW, w, ROW - 2);
        if (w > 40) { g.fillStyle = e.cat === "running" || e.cat === "cycle" ? "#fff" : "#1d2330"; g.fillText(e.name.slice(0, Math.floor(w / 6)), left + 3, y + e._depth * ROW + 12); }
      }
    } else {
      const sorted = r.points.slice().sort((a, b) => a[0] - b[0]);
      const before = sorted.filter(([ts]) => ts < t0);
      const shown = [...(before.length ? [[t0, before[before.length - 1][1]]] : []),
        ...sorted.filter(([ts]) => ts >= t0 && ts <= t1)];  // the value in force at t0, then its changes
      const max = Math.max(1e-9, ...shown.map((p) => p[1]));
      const py = (v) => y + h0 - 2 - (v / max) * (h0 - 4);
      g.fillStyle = "rgba(217, 72, 15, 0.18)"; g.strokeStyle = "#d9480f"; g.beginPath();
      shown.forEach(([ts, v], i) => {  // a counter holds its value until its next change: steps
        if (i === 0) g.moveTo(x(ts), py(v));
        else { g.lineTo(x(ts), py(shown[i - 1][1])); g.lineTo(x(ts), py(v)); }
      });
      if (shown.length) g.lineTo(x(t1), py(shown[shown.length - 1][1]));
      g.stroke(); g.fillStyle = "#667085"; g.fillText(`max ${max.toPrecision(3)}`, plotWidth - 70, y + 10);
    }
    y += h0 + 6;
    g.fillStyle = "#e4e7ec"; g.fillRect(0, y - 3, plotWidth, 1);
    labels.append(h("div", { class: "tl-rule", style: `position:absolute;left:0;right:0;top:${y - 3}px;height:1px;background:#e4e7ec` }));
  }
  box.append(h("div", { class: "tl-body" }, labels, canvas));
  box.append(h("div", { class: "legend" }, Object.entries(COLORS).map(([k, c]) => h("span", {}, h("i", { style: `background:${c}` }), k))));
  return box;
}
