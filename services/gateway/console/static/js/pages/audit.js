import { get, query } from "../api.js";
import { fmt, h, table } from "../dom.js";

export async function render(page, _id, ctx) {
  const tenant = h("input", { id: "audit-tenant", placeholder: "tenant (admins: any)", value: "" });
  const action = h("input", { id: "audit-action", placeholder: "action, e.g. checkpoint.publish" });
  const box = h("div", {});
  let token = "";
  const load = async (more) => {
    const page_ = await get(`/console/api/audit${query({ tenant: tenant.value, action: action.value, page_size: 100, page_token: more ? token : "" })}`);
    token = page_.next_page_token;
    const rows = table([
      { label: "when", cell: (e) => fmt.time(e.at_unix_ms) },
      { label: "tenant", cell: (e) => e.tenant },
      { label: "who", cell: (e) => (e.key_prefix ? h("code", {}, e.key_prefix) : e.actor) },
      { label: "action", cell: (e) => h("code", {}, e.action) },
      { label: "target", cell: (e) => h("code", {}, e.target) },
      { label: "details", cell: (e) => Object.entries(e.details || {}).map(([k, v]) => `${k}=${v}`).join(", ") },
    ], page_.entries, { id: "audit-table" });
    if (more) box.append(rows); else box.replaceChildren(rows);
    older.hidden = !token;
  };
  const older = h("button", { type: "button", hidden: true, onclick: () => load(true) }, "Older entries");
  const filter = h("form", { class: "toolbar", onsubmit: async (e) => { e.preventDefault(); await load(false); } },
    tenant, action, h("button", { type: "submit" }, "Filter"));
  page.append(h("h1", {}, ctx.me.is_admin ? "Audit log (every tenant)" : `Audit log of ${ctx.me.tenant}`), filter, box, older);
  await load(false);
}
