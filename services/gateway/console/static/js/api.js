// The console's calls: every request carries the API key from this tab's sessionStorage as the
// X-API-Key header (never in a URL; no cookie). Errors become ApiError with the server's message.
const KEY = "temper.console.apiKey";

export const session = {
  key: () => sessionStorage.getItem(KEY),
  login: (key) => sessionStorage.setItem(KEY, key),
  logout: () => sessionStorage.removeItem(KEY),
};

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function messageOf(data, fallback) {
  if (!data) return fallback;
  if (typeof data.error === "string") return data.error;
  if (data.error && data.error.message) return data.error.message;  // OpenAI's shape (/v1)
  return fallback;
}

export function headers(json) {
  const out = { "X-API-Key": session.key() || "" };
  if (json) out["Content-Type"] = "application/json";
  return out;
}

async function request(method, path, body) {
  const resp = await fetch(path, {
    method, headers: headers(body !== undefined), credentials: "omit", cache: "no-store",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (e) { data = null; }
  if (!resp.ok) throw new ApiError(resp.status, messageOf(data, `${resp.status} ${resp.statusText}`));
  return data;
}

export const get = (path) => request("GET", path);
export const post = (path, body) => request("POST", path, body === undefined ? {} : body);

export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") q.set(k, String(v));
  const s = q.toString();
  return s ? `?${s}` : "";
}
