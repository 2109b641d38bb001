import { get, query } from "../api.js";
import { fmt, h, lora, runLink, sessionLink, table } from "../dom.js";

export async function render(page) {
  const data = await get(`/console/api/runs${query({ limit: 100 })}`);
  page.append(
    h("h1", {}, "Training runs"),
    h("p", { class: "muted" }, `${data.total_count} run(s), newest first`),
    table([
      { label: "run", cell: (r) => runLink(r.training_run_id) },
      { label: "session", cell: (r) => sessionLink(r.training_run_id.split(":train:")[0]) },
      { label: "model", cell: (r) => h("span", { class: "mono" }, r.base_model) },
      { label: "family", cell: (r) => (r.num_experts ? `${r.family} · ${r.num_experts} experts` : r.family || "—") },
      { label: "LoRA", cell: (r) => lora(r.lora_config) },
      { label: "steps", num: true, cell: (r) => fmt.num(r.steps) },
      { label: "tokens trained", num: true, cell: (r) => fmt.num(r.tokens_trained) },
      { label: "status", cell: (r) => r.status || "—" },
      { label: "last request", cell: (r) => fmt.ago(r.last_request_unix_ms) },
    ], data.runs, { id: "runs-table" }),
  );
}
