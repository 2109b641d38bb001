import { get } from "../api.js";
import { fmt, h, table } from "../dom.js";

// Operator pages (admin keys): workers, lanes, scheduler replicas and their lane leases, fair share,
// recent failures and recoveries.
export async function render(page) {
  const c = await get("/console/api/cluster");
  const mem = (w) => (w.memory_capacity_bytes ? `${fmt.bytes(w.memory_used_bytes)} / ${fmt.bytes(w.memory_capacity_bytes)}` : fmt.bytes(w.memory_used_bytes));
  page.append(
    h("h1", {}, "Cluster"),
    h("p", { class: "muted" }, `as of ${fmt.time(c.at_unix_ms)}`),
    h("h2", {}, "Workers"),
    table([
      { label: "role", cell: (w) => w.role },
      { label: "address", cell: (w) => h("code", {}, w.address) },
      { label: "model", cell: (w) => h("span", { class: "mono" }, w.base_model) },
      { label: "state", cell: (w) => h("span", { class: `state-${w.state}` }, w.state) },
      { label: "incarnation", cell: (w) => h("code", {}, String(w.incarnation)) },
      { label: "runs placed", num: true, cell: (w) => fmt.num(w.runs_placed) },
      { label: "memory", num: true, cell: mem },
      { label: "device", cell: (w) => w.device },
      { label: "heard", num: true, cell: (w) => (w.seconds_since_heard >= 0 ? `${fmt.num(w.seconds_since_heard, 2)} s ago` : "—") },
    ], c.workers, { id: "workers-table" }),
    h("h2", {}, "Trainer lanes"),
    table([
      { label: "trainer", cell: (l) => h("code", {}, l.trainer_address) },
      { label: "queue depth", num: true, cell: (l) => fmt.num(l.queue_depth) },
      { label: "cycles / min", num: true, cell: (l) => fmt.num(l.cycles_per_minute, 3) },
      { label: "cycles", num: true, cell: (l) => fmt.num(l.cycles_total) },
    ], c.lanes, { id: "lanes-table" }),
    h("h2", {}, "Scheduler replicas"),
    ...replicas(c),
    h("h2", {}, "Fair share"),
    table([
      { label: "tenant", cell: (t) => t.tenant },
      { label: "weight", num: true, cell: (t) => fmt.num(t.weight) },
      { label: "share", num: true, cell: (t) => `${(t.share * 100).toFixed(1)} %` },
      { label: "queued requests", num: true, cell: (t) => fmt.num(t.queued_requests) },
      { label: "train tokens, last minute", num: true, cell: (t) => fmt.num(t.train_tokens_last_minute) },
    ], c.fair_share, { id: "share-table" }),
    h("h2", {}, "Recent failures and recoveries"),
    table([
      { label: "when", cell: (e) => fmt.time(e.at_unix_ms) },
      { label: "kind", cell: (e) => h("span", { class: e.kind === "failure" ? "state-down" : "state-up" }, e.kind) },
      { label: "what", cell: (e) => e.what },
      { label: "worker", cell: (e) => h("code", {}, e.worker) },
      { label: "run", cell: (e) => e.training_run_id },
    ], c.events, { id: "events-table" }),
  );
}

// One scheduler: a line instead of a table of one (it runs every lane, without leases). Replicas: who they are, then
// every lane once, with the replica whose lease names it (or none) and that lease's token and times.
function replicas(c) {
  if (!c.replicated) {
    return [h("p", { class: "muted", id: "replicas-note" }, "One scheduler (not replicated) runs all the trainer lanes above, without leases.")];
  }
  const held = (r) => r.lanes.filter((l) => l.live).length;
  const lanes = c.replicas.flatMap((r) => r.lanes.map((l) => ({ ...l, replica: r })))
    .concat(c.free_lanes.map((l) => ({ ...l, replica: null })))
    .sort((a, b) => a.trainer_address.localeCompare(b.trainer_address));
  const lease = (l) => (l.live ? "held" : !l.token ? "never taken" : l.replica ? "expired" : "released");
  const left = (l) => (l.token === 0 ? "—" : l.seconds_left >= 0 ? fmt.secs(l.seconds_left) : `expired ${fmt.secs(-l.seconds_left)} ago`);
  return [
    table([
      { label: "address", cell: (r) => h("span", {}, h("code", {}, r.address), r.answering ? h("span", { class: "muted" }, " (answered)") : null) },
      { label: "owner", cell: (r) => h("code", {}, r.owner) },
      { label: "state", cell: (r) => h("span", { class: r.live ? "state-up" : "state-down" }, r.live ? "live" : "silent") },
      { label: "heard", num: true, cell: (r) => `${fmt.secs(r.seconds_since_heard)} ago` },
      { label: "started", cell: (r) => fmt.time(r.started_at_unix_ms) },
      { label: "lanes held", num: true, cell: (r) => fmt.num(held(r)) },
    ], c.replicas, { id: "replicas-table" }),
    h("h3", {}, "Lane leases"),
    table([
      { label: "trainer", cell: (l) => h("code", {}, l.trainer_address) },
      { label: "replica", cell: (l) => (l.replica ? h("code", {}, l.replica.address) : h("span", { class: "muted" }, "none")) },
      { label: "lease", cell: (l) => h("span", { class: l.live ? "state-up" : "state-down" }, lease(l)) },
      { label: "token", num: true, cell: (l) => fmt.num(l.token) },
      { label: "lease age", num: true, cell: (l) => (l.token ? fmt.secs(l.lease_age_seconds) : "—") },
      { label: "time left", num: true, cell: left },
    ], lanes, { id: "replica-lanes-table" }),
  ];
}
