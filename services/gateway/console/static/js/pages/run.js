import { get, query } from "../api.js";
import { lineChart } from "../charts.js";
import { fmt, h, lora, sessionLink, table } from "../dom.js";
import { checkpointTable } from "./checkpoints.js";

// The run page: its facts, its loss and metric curves over steps and over time (from the rows the
// scheduler keeps, ListRunMetrics), its last requests, and its checkpoints.
function curves(rows, byTime) {
  const x = (r) => (byTime ? r.answered_unix_ms / 1000 : r.step);
  const fb = rows.filter((r) => r.kind === "forward_backward" && r.status === "done" && r.loss !== null);
  const optim = rows.filter((r) => r.kind === "optim_step" && r.status === "done");
  const opts = { time: byTime, integerX: !byTime, xLabel: byTime ? "time" : "step" };
  // loss:sum / weights:sum, computed by the gateway (console/loss.py): the cookbook's train_mean_nll.
  // Null where the loss has no weights (RL losses); such rows leave the chart out.
  const weighted = fb.filter((r) => r.loss_per_weight !== null && r.loss_per_weight !== undefined);
  const charts = [
    lineChart("loss (sum)", fb.map(x), [{ label: "loss:sum", values: fb.map((r) => r.loss) }], opts),
    ...(weighted.length ? [lineChart("loss per weight (train_mean_nll)", weighted.map(x),
      [{ label: "loss:sum / weights:sum", values: weighted.map((r) => r.loss_per_weight) }], opts)] : []),
    lineChart("tokens per forward_backward", fb.map(x), [{ label: "num_tokens", values: fb.map((r) => r.num_tokens) }], opts),
  ];
  const gn = optim.filter((r) => r.grad_norm !== null);
  if (gn.length) charts.push(lineChart("grad norm", gn.map(x), [{ label: "grad_norm", values: gn.map((r) => r.grad_norm) }], opts));
  const lr = optim.filter((r) => r.learning_rate !== null);
  if (lr.length) charts.push(lineChart("learning rate", lr.map(x), [{ label: "learning_rate", values: lr.map((r) => r.learning_rate) }], opts));
  const timed = rows.filter((r) => r.status === "done");
  charts.push(lineChart("time queued and on the trainer (s)", timed.map(x), [
    { label: "queued", values: timed.map((r) => r.queued_seconds) },
    { label: "trainer", values: timed.map((r) => r.trainer_seconds) }], opts));
  const other = new Set();
  for (const r of fb) for (const k of Object.keys(r.metrics || {})) if (k !== "loss:sum") other.add(k);
  for (const k of [...other].sort()) {
    const have = fb.filter((r) => r.metrics[k] !== undefined);
    charts.push(lineChart(k, have.map(x), [{ label: k, values: have.map((r) => r.metrics[k]) }], opts));
  }
  return h("div", { class: "charts", id: "run-charts" }, charts);
}

export async function render(page, runId, ctx) {
  const [detail, metrics] = await Promise.all([
    get(`/console/api/runs/${encodeURIComponent(runId)}`),
    get(`/console/api/runs/${encodeURIComponent(runId)}/metrics${query({ from_step: 0 })}`),
  ]);
  const run = detail.run;
  const rows = metrics.metrics;
  const holder = h("div", {}, curves(rows, false));
  const axis = h("select", { id: "curve-axis", onchange: () => holder.replaceChildren(curves(rows, axis.value === "time")) },
    h("option", { value: "step" }, "over steps"), h("option", { value: "time" }, "over time"));
  page.append(
    h("h1", {}, `Run ${run.training_run_id}`),
    h("div", { class: "cards" },
      [["model", run.base_model], ["family", run.family || "—"],
        ...(run.num_experts ? [["experts", `${run.num_experts} (top-${run.num_experts_per_tok})`],
          ["expert rank", fmt.num(run.lora_config.expert_rank)]] : []),
        ["LoRA", lora(run.lora_config)], ["mode", run.deterministic ? "deterministic" : "default"],
        ["steps", fmt.num(run.steps)],
        ["tokens trained", fmt.num(run.tokens_trained)], ["next seq", fmt.num(run.next_seq_id)],
        ["last request", fmt.ago(run.last_request_unix_ms)]]
        .map(([label, value]) => h("div", { class: "card", dataset: { card: label } }, h("div", { class: "muted" }, label),
          h("div", { class: "value mono" }, value)))),
    h("p", {}, "session ", sessionLink(run.training_run_id.split(":train:")[0]), ` · ${rows.length} request(s) kept`),
    h("div", { class: "toolbar" }, "Curves ", axis),
    holder,
    h("h2", {}, "Last requests"),
    table([
      { label: "seq", num: true, cell: (r) => r.seq_id },
      { label: "kind", cell: (r) => r.kind },
      { label: "status", cell: (r) => (r.error ? `${r.status}: ${r.error}` : r.status) },
      { label: "step", num: true, cell: (r) => r.step },
      { label: "loss", num: true, cell: (r) => fmt.num(r.loss) },
      { label: "loss / Σ weights", num: true, cell: (r) => fmt.num(r.loss_per_weight) },
      { label: "tokens", num: true, cell: (r) => fmt.num(r.num_tokens) },
      { label: "queued", num: true, cell: (r) => fmt.secs(r.queued_seconds) },
      { label: "trainer", num: true, cell: (r) => fmt.secs(r.trainer_seconds) },
      { label: "co-batched with", num: true, cell: (r) => r.cobatched_with },
      { label: "trainer · cycle", cell: (r) => (r.trainer ? `${r.trainer} · ${r.cycle}` : "—") },
      { label: "answered", cell: (r) => fmt.time(r.answered_unix_ms) },
    ], rows.slice(-20).reverse(), { id: "requests-table" }),
    h("h2", {}, "Checkpoints"),
    checkpointTable(detail.checkpoints, ctx.redraw),
  );
}
