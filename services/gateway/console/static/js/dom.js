// Small DOM helpers. Text always goes in as text nodes (never as HTML), so nothing a user or another
// tenant named can run as script here.
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function table(columns, rows, attrs) {
  // columns: [{label, num?, cell: row => Node|string}]; attrs.rowClass: row => a class for its <tr>
  const { rowClass, ...tableAttrs } = attrs || {};
  return h("table", tableAttrs,
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { class: c.num ? "num" : "" }, c.label)))),
    h("tbody", {}, rows.length
      ? rows.map((r) => h("tr", { class: rowClass ? rowClass(r) || null : null },
        columns.map((c) => h("td", { class: c.num ? "num" : "" }, c.cell(r)))))
      : h("tr", {}, h("td", { colspan: columns.length, class: "muted" }, "nothing yet"))));
}

export const fmt = {
  time: (ms) => (ms ? new Date(ms).toLocaleString() : "—"),
  bytes: (n) => {
    if (!n) return "0 B";
    const u = ["B", "KB", "MB", "GB", "TB"]; let i = 0; let v = n;
    while (v >= 1000 && i < u.length - 1) { v /= 1000; i += 1; }
    return `${v.toFixed(v < 10 && i ? 1 : 0)} ${u[i]}`;
  },
  num: (n, digits = 4) => (n === null || n === undefined || Number.isNaN(n) ? "—"
    : Number.isInteger(n) ? n.toLocaleString() : Number(n).toPrecision(digits)),
  secs: (s) => (s === null || s === undefined ? "—" : s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`),
  ago: (ms) => {
    if (!ms) return "—";
    const s = (Date.now() - ms) / 1000;
    if (s < 60) return `${Math.max(0, Math.round(s))} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${Math.round(s / 3600)} h ago`;
    return `${Math.round(s / 86400)} d ago`;
  },
};

export function lora(cfg) {
  if (!cfg) return "—";
  const parts = [`rank ${cfg.rank}`];
  if (cfg.expert_rank) parts.push(`experts rank ${cfg.expert_rank}`);
  for (const [k, label] of [["train_attn", "attn"], ["train_mlp", "mlp"], ["train_unembed", "unembed"]]) if (cfg[k]) parts.push(label);
  return parts.join(", ");
}

export function runLink(id) { return h("a", { href: `#/run/${encodeURIComponent(id)}` }, id); }
export function sessionLink(id) { return h("a", { href: `#/session/${encodeURIComponent(id)}` }, id); }

export function errorBox(err) { return h("p", { class: "error" }, String(err && err.message ? err.message : err)); }
