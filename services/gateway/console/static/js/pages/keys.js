import { get, post } from "../api.js";
import { errorBox, fmt, h, table } from "../dom.js";

export async function render(page, _id, ctx) {
  const data = await get("/console/api/keys");
  const out = h("div", { id: "key-result" });
  const label = h("input", { id: "key-label", maxlength: 128, placeholder: "label (optional)" });
  const create = h("form", { id: "create-key", onsubmit: async (e) => {
    e.preventDefault();
    try {
      const made = await post("/console/api/keys/create", { label: label.value });
      out.replaceChildren(h("p", { class: "ok" }, "New key (shown once, copy it now): "), h("code", { id: "new-key" }, made.api_key));
      const list = await get("/console/api/keys");
      tableBox.replaceChildren(keyTable(list));
    } catch (err) { out.replaceChildren(errorBox(err)); }
  } }, label, h("button", { type: "submit", class: "primary" }, "Create key"));
  const revoke = async (k) => {
    if (k.id === data.caller.id && !window.confirm("This is the key you are logged in with. Revoke it?")) return;
    try { await post("/console/api/keys/revoke", { prefix: k.prefix }); await ctx.redraw(); } catch (err) { out.replaceChildren(errorBox(err)); }
  };
  const keyTable = (list) => table([
    { label: "prefix", cell: (k) => h("code", {}, k.prefix) },
    { label: "label", cell: (k) => k.label },
    { label: "role", cell: (k) => (k.is_admin ? "admin" : "tenant") },
    { label: "created", cell: (k) => fmt.time(k.created_unix_ms) },
    { label: "last used", cell: (k) => fmt.ago(k.last_used_unix_ms) },
    { label: "state", cell: (k) => (k.revoked_unix_ms ? `revoked ${fmt.time(k.revoked_unix_ms)}` : k.id === list.caller.id ? "active (this one)" : "active") },
    { label: "", cell: (k) => (k.revoked_unix_ms ? "" : h("button", { type: "button", class: "revoke", onclick: () => revoke(k) }, "Revoke")) },
  ], list.keys, { id: "keys-table" });
  const tableBox = h("div", {}, keyTable(data));
  page.append(h("h1", {}, `API keys of ${ctx.me.tenant}`), create, out, tableBox);
}
