// The console's router: #/<page>/<id> picks a view from pages/; the login form keeps the key in
// sessionStorage (api.js). Each view draws itself into #page from the JSON routes.
import { ApiError, get, session } from "./api.js";
import { errorBox, h } from "./dom.js";

const PAGES = {
  sessions: () => import("./pages/sessions.js"),
  session: () => import("./pages/session.js"),
  runs: () => import("./pages/runs.js"),
  run: () => import("./pages/run.js"),
  checkpoints: () => import("./pages/checkpoints.js"),
  usage: () => import("./pages/usage.js"),
  keys: () => import("./pages/keys.js"),
  audit: () => import("./pages/audit.js"),
  playground: () => import("./pages/playground.js"),
  operator: () => import("./pages/operator.js"),
};

// Pages that show one thing take its id (#/run/<id>; #/runs/<id> is the same); the others take none.
const WITH_ID = new Set(["run", "session"]);
const ALIASES = { runs: "run", sessions: "session" };

const $ = (id) => document.getElementById(id);
let me = null;
let drawing = 0;

// An unknown route, or an id the server does not know (or another tenant's: the same 404): said so,
// never a list drawn in its place.
function notFound(message) {
  return [h("p", { class: "error", id: "not-found" }, message),
    h("p", {}, h("a", { href: "#/runs" }, "Back to your training runs"))];
}

async function whoami() {
  me = await get("/console/api/me");
  $("who").textContent = `${me.tenant}${me.is_admin ? " (admin)" : ""} · key ${me.key_prefix || ""}`;
  $("nav-operator").hidden = !me.is_admin;
}

function showLogin(message) {
  me = null;
  $("nav").hidden = true; $("logout").hidden = true; $("who").textContent = "";
  $("page").replaceChildren();
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("login-key").focus();
}

async function draw() {
  const ticket = ++drawing;
  if (!session.key()) return showLogin();
  try {
    if (!me) await whoami();
  } catch (err) {
    session.logout();
    return showLogin(err instanceof ApiError && err.status === 401 ? "That key was refused." : String(err.message));
  }
  $("login").hidden = true; $("nav").hidden = false; $("logout").hidden = false;
  const [first, ...rest] = (location.hash.replace(/^#\/?/, "") || "runs").split("/");
  const id = rest.length && rest.join("/") ? decodeURIComponent(rest.join("/")) : null;
  const name = id !== null && ALIASES[first] ? ALIASES[first] : first;
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.page === first);
  const page = $("page");
  page.replaceChildren(h("p", { class: "muted" }, "loading…"));
  const load = PAGES[name];
  if (!load || WITH_ID.has(name) !== (id !== null)) { page.replaceChildren(...notFound(`There is no page #/${location.hash.replace(/^#\/?/, "")}.`)); return; }
  try {
    const view = await load();
    const fresh = h("div", { id: "view", dataset: { page: name } });
    await view.render(fresh, id, { me, redraw: draw });
    if (ticket === drawing) page.replaceChildren(fresh);
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) { session.logout(); return showLogin("The key was refused."); }
    if (ticket !== drawing) return;
    if (err instanceof ApiError && err.status === 404) page.replaceChildren(...notFound(`Not found: ${err.message}`));
    else page.replaceChildren(errorBox(err));
  }
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("login-key").value.trim();
  if (!key) return;
  session.login(key);
  $("login-key").value = "";
  if (!location.hash) location.hash = "#/runs";
  draw();
});
$("logout").addEventListener("click", () => { session.logout(); showLogin(); });
window.addEventListener("hashchange", draw);
draw();
