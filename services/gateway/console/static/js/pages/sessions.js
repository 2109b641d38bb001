import { get, query } from "../api.js";
import { fmt, h, table } from "../dom.js";

export async function render(page) {
  const data = await get(`/console/api/sessions${query({ limit: 100 })}`);
  page.append(
    h("h1", {}, "Sessions"),
    h("p", { class: "muted" }, `${data.total_count} session(s), newest first`),
    table([
      // the display name (ServiceClient(display_name=...)) where there is one; the id always, to copy
      { label: "session", cell: (s) => h("div", {},
        h("a", { href: `#/session/${encodeURIComponent(s.session_id)}` }, s.display_name || s.session_id),
        s.display_name ? h("div", { class: "muted mono" }, s.session_id) : "") },
      { label: "project", cell: (s) => h("span", { class: "mono" }, s.project_id || "—") },
      { label: "created", cell: (s) => fmt.time(s.created_unix_ms) },
      { label: "last heartbeat", cell: (s) => fmt.ago(s.last_heartbeat_unix_ms) },
      { label: "state", cell: (s) => (s.closed ? `closed (${s.close_status || "—"})` : "open") },
      { label: "tags", cell: (s) => (s.tags || []).join(", ") },
    ], data.sessions, { id: "sessions-table" }),
  );
}
