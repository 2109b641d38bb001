import { get, headers, query } from "../api.js";
import { lineChart } from "../charts.js";
import { errorBox, fmt, h, runLink, table } from "../dom.js";
import { timeline } from "../timeline.js";

// A session: its runs and sampling clients, Session Metrics over a chosen range (active sample
// requests, trainer busy fraction, tokens per second trained / sampled / prefilled), the Perfetto
// export and the same trace drawn as a timeline.
const RANGES = [["whole session", 0], ["last 15 minutes", 15 * 60], ["last hour", 3600], ["last 6 hours", 6 * 3600], ["last 24 hours", 86400]];

function rangeParams(seconds, session) {
  if (!seconds) return {};
  const end = session.closed ? session.closed_unix_ms + 1 : Date.now() + 1;
  return { from_unix_ms: Math.max(0, end - seconds * 1000), to_unix_ms: end };
}

async function fetchTrace(sessionId, params) {
  const resp = await fetch(`/api/v1/sessions/${encodeURIComponent(sessionId)}/trace${query(params)}`,
    { headers: headers(false), credentials: "omit", cache: "no-store" });
  const text = await resp.text();
  if (!resp.ok) { let m = text; try { m = JSON.parse(text).error; } catch (e) { /* text as is */ } throw new Error(m); }
  return text;
}

function metricsCharts(m) {
  const opts = { time: true, xLabel: "time" };
  return h("div", { class: "charts", id: "session-charts" },
    lineChart("active sample requests", m.t, [{ label: "average in flight", values: m.active_sample_requests }], opts),
    lineChart("trainer busy fraction (this session's runs)", m.t, [{ label: "busy", values: m.trainer_busy_fraction }], opts),
    lineChart("tokens per second", m.t, [
      { label: "trained", values: m.tokens_trained_per_s },
      { label: "sampled", values: m.tokens_sampled_per_s },
      { label: "prefilled", values: m.tokens_prefilled_per_s }], opts));
}

export async function render(page, sessionId) {
  const detail = await get(`/console/api/sessions/${encodeURIComponent(sessionId)}`);
  const s = detail.session;
  const status = h("p", { class: "muted", id: "trace-status" });
  const chartsBox = h("div", {});
  const timelineBox = h("div", {});
  const picker = h("select", { id: "range" }, RANGES.map(([label, secs]) => h("option", { value: secs }, label)));
  const params = () => rangeParams(Number(picker.value), s);
  const drawMetrics = async () => {
    try {
      const m = await get(`/console/api/sessions/${encodeURIComponent(sessionId)}/metrics${query(params())}`);
      chartsBox.replaceChildren(metricsCharts(m));
    } catch (err) { chartsBox.replaceChildren(errorBox(err)); }
  };
  picker.addEventListener("change", drawMetrics);
  const download = h("button", { type: "button", class: "primary", id: "download-trace", onclick: async () => {
    status.className = "muted"; status.textContent = "building the trace…";
    try {
      const text = await fetchTrace(sessionId, params());
      const url = URL.createObjectURL(new Blob([text], { type: "application/json" }));
      const a = h("a", { href: url, download: `temper-trace-${sessionId.replace(/[^A-Za-z0-9._-]/g, "_")}.json` });
      document.body.append(a); a.click(); a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
      status.className = "ok"; status.textContent = "Downloaded: open it in Perfetto UI (Open trace file).";
    } catch (err) { status.className = "error"; status.textContent = err.message; }
  } }, "Download Perfetto trace");
  const show = h("button", { type: "button", id: "show-timeline", onclick: async () => {
    try { timelineBox.replaceChildren(timeline(JSON.parse(await fetchTrace(sessionId, params())))); }
    catch (err) { timelineBox.replaceChildren(errorBox(err)); }
  } }, "Show timeline");
  page.append(
    h("h1", {}, `Session ${s.display_name || s.session_id}`),
    s.display_name ? h("p", { class: "muted mono" }, s.session_id) : "",
    h("div", { class: "cards" },
      [["project", s.project_id || "—"], ["created", fmt.time(s.created_unix_ms)], ["last heartbeat", fmt.ago(s.last_heartbeat_unix_ms)],
        ["state", s.closed ? `closed (${s.close_status})` : "open"], ["sample requests", fmt.num(s.sample_requests)],
        ["prompt tokens", fmt.num(s.prompt_tokens)], ["tokens sampled", fmt.num(s.tokens_sampled)]]
        .map(([label, value]) => h("div", { class: "card" }, h("div", { class: "muted" }, label), h("div", { class: "value" }, value)))),
    h("h2", {}, "Training runs"),
    table([
      { label: "run", cell: (r) => runLink(r.training_run_id) },
      { label: "model", cell: (r) => h("span", { class: "mono" }, r.base_model) },
      { label: "last request", cell: (r) => fmt.ago(r.last_request_unix_ms) },
    ], detail.runs),
    h("h2", {}, "Sampling clients"),
    table([{ label: "sampler", cell: (id) => h("code", {}, id) }], s.sampler_ids || []),
    h("h2", {}, "Session Metrics"),
    h("div", { class: "toolbar" }, "Range ", picker, download, show),
    status, chartsBox, timelineBox,
  );
  await drawMetrics();
}
