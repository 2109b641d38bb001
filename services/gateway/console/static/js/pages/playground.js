import { get, session } from "../api.js";
import { errorBox, fmt, h } from "../dom.js";

// Chat with a base model or one of your sampler checkpoints through the OpenAI-compatible route
// (POST /v1/chat/completions, stream: true): tokens are shown as the server-sent events arrive.
// An attached PNG or JPEG goes with the message as an image_url part holding a data: URL (a
// vision-language model sees it; a text-only model answers 400, shown as the error).
function dataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error || new Error("could not read the image"));
    reader.readAsDataURL(file);
  });
}

async function* events(resp) {
  const reader = resp.body.getReader(); const decoder = new TextDecoder(); let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) if (line.startsWith("data:")) yield line.slice(5).trim();
    }
  }
}

export async function render(page) {
  const models = await get("/console/api/models");
  const model = h("select", { id: "pg-model" },
    h("optgroup", { label: "base models" }, models.base_models.map((m) => h("option", { value: m }, m))),
    h("optgroup", { label: "your sampler checkpoints" }, models.checkpoints.map((c) => h("option", { value: c.path, dataset: { temporary: c.temporary ? "true" : "false" } },
      c.temporary ? `${c.path} (temporary, if unused until ${fmt.time(c.expires_unix_ms)})` : c.path))));
  const maxTokens = h("input", { id: "pg-max-tokens", type: "number", min: 1, max: 4096, value: 32, style: "width:6em" });
  const temperature = h("input", { id: "pg-temperature", type: "number", min: 0, max: 2, step: 0.1, value: 0.7, style: "width:5em" });
  const chat = h("div", { id: "chat" });
  const input = h("textarea", { id: "pg-input", rows: 3, cols: 80, placeholder: "Say something…" });
  const image = h("input", { id: "pg-image", type: "file", accept: "image/png,image/jpeg" });
  const history = [];
  const send = h("button", { type: "submit", class: "primary", id: "pg-send" }, "Send");
  const form = h("form", { id: "pg-form", onsubmit: async (e) => {
    e.preventDefault();
    const text = input.value.trim();
    const file = image.files && image.files[0];
    if (!text && !file) return;
    send.disabled = true;
    let url = null;
    try { url = file ? await dataUrl(file) : null; } catch (err) { chat.append(errorBox(err)); send.disabled = false; return; }
    input.value = ""; image.value = "";
    history.push({ role: "user", content: url
      ? [{ type: "text", text }, { type: "image_url", image_url: { url } }] : text });
    chat.append(h("div", { class: "msg user" }, url ? h("img", { class: "pg-thumb", src: url, alt: file.name }) : null, text));
    const answer = h("div", { class: "msg assistant", dataset: { chunks: "0" } });
    chat.append(answer);
    try {
      const resp = await fetch("/v1/chat/completions", {
        method: "POST", credentials: "omit", cache: "no-store",
        headers: { Authorization: `Bearer ${session.key()}`, "Content-Type": "application/json" },
        body: JSON.stringify({ model: model.value, messages: history, stream: true,
          max_tokens: Number(maxTokens.value), temperature: Number(temperature.value) }),
      });
      if (!resp.ok) { const body = await resp.json().catch(() => ({})); throw new Error((body.error && body.error.message) || resp.statusText); }
      let content = "";
      for await (const data of events(resp)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "error");
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          content += delta.content; answer.textContent = content;
          answer.dataset.chunks = String(Number(answer.dataset.chunks) + 1);
        }
      }
      answer.dataset.done = "true";
      history.push({ role: "assistant", content });
    } catch (err) { answer.replaceWith(errorBox(err)); history.pop(); }
    send.disabled = false;
  } }, input, h("div", { class: "toolbar" }, h("label", {}, "image", image), send));
  page.append(h("h1", {}, "Playground"),
    h("div", { class: "toolbar" }, h("label", {}, "model", model), h("label", {}, "max tokens", maxTokens),
      h("label", {}, "temperature", temperature)),
    chat, form);
}
