// The server's API as the page uses it: the model list and streamed chat completions.
// Paths are relative to the page, so the page works under an --api-prefix too.

const KEY_STORE = "llama_ctypes.apiKey";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    const err = body && body.error;
    if (err && typeof err.message === "string") message = err.message;
    else if (typeof err === "string") message = err;
  } catch (_) { /* not JSON: keep the status line */ }
  return new ApiError(response.status, message);
}

export async function listModels() {
  const response = await fetch("v1/models", { headers: headers() });
  if (!response.ok) throw await errorOf(response);
  const body = await response.json();
  return (body.data || []).map((m) => m.id).filter((id) => typeof id === "string");
}

// Yields the chunks of a streamed chat completion until its [DONE]; `signal` aborts the request (the
// server then cancels the generation and frees its slot). A stream cut before [DONE] is an error.
export async function* streamChat(body, signal) {
  const response = await fetch("v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify({ ...body, stream: true }), signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new ApiError(502, "the connection closed before the answer was complete");
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      let chunk;
      try {
        chunk = JSON.parse(data);
      } catch (_) {
        throw new ApiError(502, "the server sent a stream event that is not JSON");
      }
      if (chunk.error) {
        const err = chunk.error;
        throw new ApiError(err.code || 500, typeof err === "string" ? err : err.message || "error");
      }
      yield chunk;
    }
  }
}
