// Line charts with the vendored uPlot (window.uPlot, static/vendor/uplot). One series per chart.
import { h } from "./dom.js";

const COLORS = ["#3559e0", "#d9480f", "#1f8a4c", "#9c36b5", "#b7791f", "#0b7285"];

// A step axis ticks whole steps only: uPlot picks the smallest of these increments that leaves room.
const WHOLE = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6, 1e7];
const wholeLabels = (u, splits) => splits.map((v) => (Math.abs(v - Math.round(v)) < 1e-9 ? String(Math.round(v)) : ""));

export function lineChart(title, xs, series, opts = {}) {
  // series: [{label, values}] aligned with xs; opts.time: xs are unix seconds; opts.xLabel;
  // opts.integerX: xs are whole numbers (steps), ticked as such
  const box = h("div", { class: "chart", dataset: { chart: title } }, h("h3", {}, title));
  if (!xs.length) { box.append(h("p", { class: "muted" }, "no data in this range")); return box; }
  const width = opts.width || 600;
  const plot = new window.uPlot({
    width, height: opts.height || 220,
    scales: { x: { time: !!opts.time } },
    axes: [{ label: opts.xLabel || "", ...(opts.integerX ? { incrs: WHOLE, values: wholeLabels } : {}) }, { size: 60 }],
    series: [{ label: opts.xLabel || "x" }, ...series.map((s, i) => ({
      label: s.label, stroke: COLORS[i % COLORS.length], width: 2, points: { show: xs.length < 60 },
    }))],
  }, [xs, ...series.map((s) => s.values)], box);
  box.plot = plot;
  return box;
}
