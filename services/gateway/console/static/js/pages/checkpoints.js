import { post, get } from "../api.js";
import { errorBox, fmt, h, runLink, table } from "../dom.js";

// Every change is a POST with a JSON body (the server validates it); then the page is drawn again,
// with what was done shown above the table.
let flash = null;
const KINDS = { CHECKPOINT_KIND_SAMPLER: "sampler", CHECKPOINT_KIND_TRAINING: "training", CHECKPOINT_KIND_EXTERNAL: "external" };

export function checkpointTable(checkpoints, redraw) {
  const status = h("p", { class: flash ? "ok" : "muted", id: "checkpoint-status" }, flash || "");
  flash = null;
  const act = async (button, path, body, done) => {
    button.disabled = true;
    try { await post(path, body); flash = done; await redraw(); }
    catch (err) { status.className = "error"; status.textContent = err.message; button.disabled = false; }
  };
  const actions = (c) => {
    const publish = h("button", { type: "button", class: "publish", onclick: (e) => act(e.target,
      "/console/api/checkpoints/publish", { path: c.path, published: !c.published },
      `${c.published ? "unpublished" : "published"} ${c.path}`) }, c.published ? "Unpublish" : "Publish");
    const ttl = h("input", { type: "number", min: 0, step: 1, placeholder: "TTL s", class: "ttl", style: "width:7em" });
    const setTtl = h("button", { type: "button", onclick: (e) => act(e.target, "/console/api/checkpoints/ttl",
      { path: c.path, ttl_seconds: ttl.value === "" ? NaN : Number(ttl.value) }, `TTL set on ${c.path}`) }, "Set TTL");
    const copy = h("button", { type: "button", class: "copy", onclick: async () => {
      try { await navigator.clipboard.writeText(c.path); status.className = "ok"; status.textContent = `copied ${c.path}`; }
      catch (err) { status.className = "muted"; status.textContent = `copy this path: ${c.path}`; }
    } }, "Copy path");
    const del = h("button", { type: "button", class: "delete", onclick: (e) => {
      if (window.confirm(`Delete ${c.path}? Its files go too.`)) act(e.target, "/console/api/checkpoints/delete", { path: c.path }, `deleted ${c.path}`);
    } }, "Delete");
    // a temporary checkpoint is for sampling while it is in use: it is neither published nor kept
    if (c.temporary) return h("span", {}, copy, " ", del);
    return h("span", {}, publish, " ", ttl, setTtl, " ", copy, " ", del);
  };
  return h("div", {}, status, table([
    { label: "path", cell: (c) => h("code", { class: "path" }, c.path) },
    { label: "run", cell: (c) => runLink(c.training_run_id) },
    { label: "kind", cell: (c) => [KINDS[c.kind] || c.kind, c.temporary ? h("span", { class: "temporary-mark muted" }, " (temporary)") : null] },
    { label: "size", num: true, cell: (c) => fmt.bytes(c.size_bytes) },
    { label: "saved", cell: (c) => fmt.time(c.created_unix_ms) },
    { label: "published", cell: (c) => (c.published ? "yes" : "no") },
    { label: "expires", cell: (c) => (c.temporary ? `if unused, ${fmt.time(c.expires_unix_ms)}`
      : c.expires_unix_ms ? fmt.time(c.expires_unix_ms) : "never") },
    { label: "", cell: actions },
  ], checkpoints, { class: "checkpoints", rowClass: (c) => (c.temporary ? "temporary" : "") }));
}

export async function render(page, _id, ctx) {
  const data = await get("/console/api/checkpoints");
  page.append(h("h1", {}, "Checkpoints"),
    h("p", { class: "muted" }, "Temporary checkpoints (save_weights_and_get_sampling_client) are removed once no sampling client used them for a while; until then they can be sampled here and in the Playground."),
    checkpointTable(data.checkpoints, ctx.redraw));
}

export { errorBox };
