import { get } from "../api.js";
import { fmt, h, runLink, table } from "../dom.js";

const RATE = /per_minute$/;

function limitBar(l) {
  if (!l.limit) return h("span", { class: "muted" }, "unlimited");
  const share = Math.min(1, l.used / l.limit);
  return h("div", { class: `bar${share >= 1 ? " full" : ""}`, title: `${(share * 100).toFixed(0)} %` },
    h("span", { style: `width:${(share * 100).toFixed(1)}%` }));
}

export async function render(page) {
  const u = await get("/console/api/usage");
  page.append(
    h("h1", {}, `Usage of ${u.tenant}`),
    h("div", { class: "cards" },
      [["tokens trained", fmt.num(u.tokens_trained)], ["tokens sampled", fmt.num(u.tokens_sampled)],
        ["optimizer steps", fmt.num(u.steps)], ["storage", fmt.bytes(u.storage_bytes)], ["fair-share weight", fmt.num(u.weight)]]
        .map(([label, value]) => h("div", { class: "card" }, h("div", { class: "muted" }, label), h("div", { class: "value" }, value)))),
    h("h2", {}, "Limits"),
    table([
      { label: "limit", cell: (l) => h("code", {}, l.name) },
      { label: "use", num: true, cell: (l) => (l.name.includes("storage") ? fmt.bytes(l.used) : fmt.num(l.used)) },
      { label: "of", num: true, cell: (l) => (l.limit ? (l.name.includes("storage") ? fmt.bytes(l.limit) : fmt.num(l.limit)) : "∞") },
      { label: "", cell: limitBar },
      { label: "wait now", num: true, cell: (l) => (RATE.test(l.name) ? fmt.secs(l.wait_seconds) : "—") },
    ], u.limits, { id: "limits-table" }),
    h("h2", {}, "Per run"),
    table([
      { label: "run", cell: (r) => runLink(r.training_run_id) },
      { label: "tokens trained", num: true, cell: (r) => fmt.num(r.tokens_trained) },
      { label: "steps", num: true, cell: (r) => fmt.num(r.steps) },
    ], u.runs),
    h("h2", {}, "Per sampling client"),
    table([
      { label: "sampler", cell: (s) => h("code", {}, s.sampler_id) },
      { label: "tokens sampled", num: true, cell: (s) => fmt.num(s.tokens_sampled) },
    ], u.samplers),
  );
}
