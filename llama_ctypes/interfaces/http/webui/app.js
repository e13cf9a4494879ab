// The chat page: conversations (store.js), the model picker, streamed answers with a stop button,
// reasoning in a collapsible block, per-conversation settings, and the API key when the server asks.

import { ApiError, listModels, setApiKey, streamChat } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { DEFAULT_SETTINGS, Store } from "./store.js";

const $ = (id) => document.getElementById(id);
const MODEL_STORE = "llama_ctypes.model";

const store = new Store();
const state = {
  current: null, // the conversation shown
  models: [],
  running: null, // { controller, conversation, message, node } while an answer streams
};

// ---- errors ----------------------------------------------------------------------------------
function showError(message) {
  $("error-text").textContent = message;
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error-text").textContent = "";
}

function storageError(err) {
  showError(`This browser could not keep the conversations (${err.message}); export them and delete some.`);
}

// Runs a change of the list; a full storage is shown, and the change undone by the store.
function guarded(fn) {
  try {
    fn();
    return true;
  } catch (err) {
    storageError(err);
    return false;
  }
}

function persist() {
  guarded(() => store.save());
}

// ---- models ----------------------------------------------------------------------------------
async function loadModels() {
  try {
    state.models = await listModels();
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) {
      askKey();
      return;
    }
    showError(`Could not list the models: ${err.message}`);
    return;
  }
  const select = $("model");
  select.replaceChildren(...state.models.map((id) => {
    const option = document.createElement("option");
    option.value = id;
    option.textContent = id;
    return option;
  }));
  if (!state.models.length) showError("The server has no model loaded.");
  syncModel();
}

function preferredModel() {
  const saved = localStorage.getItem(MODEL_STORE);
  return state.models.includes(saved) ? saved : state.models[0] || "";
}

function syncModel() {
  const c = state.current;
  const model = c && state.models.includes(c.model) ? c.model : preferredModel();
  $("model").value = model;
}

function askKey() {
  const dialog = $("apikey");
  if (!dialog.open) dialog.showModal();
  $("apikey-input").focus();
}

// ---- conversations ---------------------------------------------------------------------------
function renderList() {
  const list = $("conversations");
  list.replaceChildren(...store.conversations.map((c) => {
    const item = document.createElement("li");
    item.dataset.id = c.id;
    if (state.current && c.id === state.current.id) item.classList.add("active");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conv-title";
    open.textContent = c.title;
    open.title = c.title;
    open.addEventListener("click", () => select(c.id));
    const rename = document.createElement("button");
    rename.type = "button";
    rename.className = "conv-rename";
    rename.textContent = "✎";
    rename.setAttribute("aria-label", `Rename ${c.title}`);
    rename.addEventListener("click", () => startRename(item, c));
    const del = document.createElement("button");
    del.type = "button";
    del.className = "conv-delete";
    del.textContent = "×";
    del.setAttribute("aria-label", `Delete ${c.title}`);
    del.addEventListener("click", () => {
      if (!confirm(`Delete "${c.title}"?`)) return;
      if (state.running && state.running.conversation === c) stop();
      if (!guarded(() => store.remove(c.id))) return;
      if (state.current && state.current.id === c.id) state.current = null;
      renderList();
      renderMessages();
    });
    item.append(open, rename, del);
    return item;
  }));
}

function startRename(item, c) {
  const input = document.createElement("input");
  input.className = "conv-rename-input";
  input.value = c.title;
  input.setAttribute("aria-label", "New title");
  let finished = false;
  const done = (commit) => {
    if (finished) return; // (Escape re-renders the list, and the input's blur then fires)
    finished = true;
    if (commit) guarded(() => store.rename(c.id, input.value));
    renderList();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") done(true);
    else if (e.key === "Escape") done(false);
  });
  input.addEventListener("blur", () => done(true));
  item.replaceChildren(input);
  input.focus();
  input.select();
}

function select(id) {
  state.current = store.get(id);
  renderList();
  renderMessages();
  syncModel();
  closeSidebar();
}

function newChat() {
  state.current = null;
  renderList();
  renderMessages();
  syncModel();
  closeSidebar();
  $("input").focus();
}

// ---- messages --------------------------------------------------------------------------------
function messageNode(message) {
  const node = document.createElement("article");
  node.className = `msg ${message.role}`;
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const reasoningText = document.createElement("div");
  reasoningText.className = "reasoning-text";
  reasoning.append(summary, reasoningText);
  const content = document.createElement("div");
  content.className = "content";
  const meta = document.createElement("div");
  meta.className = "meta";
  node.append(reasoning, content, meta);
  fillMessage(node, message);
  return node;
}

function fillMessage(node, message) {
  const [reasoning, content, meta] = node.children;
  reasoning.hidden = !message.reasoning;
  reasoning.lastChild.textContent = message.reasoning || "";
  if (message.role === "assistant") content.replaceChildren(renderMarkdown(message.content));
  else content.textContent = message.content;
  const notes = [];
  if (typeof message.speed === "number") notes.push(`${message.speed.toFixed(1)} tokens/s`);
  if (message.note) notes.push(message.note);
  meta.textContent = notes.join(" · ");
  meta.hidden = !notes.length;
}

function renderMessages() {
  const box = $("messages");
  const c = state.current;
  if (!c || !c.messages.length) {
    const empty = document.createElement("p");
    empty.className = "empty";
    empty.textContent = "Send a message to start.";
    box.replaceChildren(empty);
    return;
  }
  box.replaceChildren(...c.messages.map((m) => {
    const node = messageNode(m);
    if (state.running && state.running.message === m) {
      state.running.node = node;
      node.classList.add("streaming");
    }
    return node;
  }));
  box.scrollTop = box.scrollHeight;
}

// ---- sending ---------------------------------------------------------------------------------
function setRunning(running) {
  $("send").hidden = running;
  $("stop").hidden = !running;
}

async function send() {
  const input = $("input");
  const text = input.value.trim();
  if (!text || state.running) return;
  const model = $("model").value;
  if (!model) {
    showError("No model to send to.");
    return;
  }
  clearError();
  let c = state.current;
  if (!c) {
    c = state.current = store.create(model, lastSettings());
  }
  c.model = model;
  localStorage.setItem(MODEL_STORE, model);
  if (!c.messages.length) c.title = text.slice(0, 60);
  c.messages.push({ role: "user", content: text });
  const answer = { role: "assistant", content: "" };
  c.messages.push(answer);
  store.touch(c);
  persist();
  input.value = "";
  const controller = new AbortController();
  state.running = { controller, conversation: c, message: answer, node: null };
  setRunning(true);
  renderList();
  renderMessages();

  const s = c.settings;
  const history = c.messages.slice(0, -1).map((m) => ({ role: m.role, content: m.content }));
  const body = {
    model,
    messages: s.system ? [{ role: "system", content: s.system }, ...history] : history,
    temperature: s.temperature,
  };
  if (s.max_tokens) body.max_tokens = s.max_tokens;

  // (redrawn at most every 100 ms: a long answer is rendered again whole each time)
  let frame = 0;
  const redraw = () => {
    frame = 0;
    const run = state.running;
    if (run && run.node && run.node.isConnected) {
      fillMessage(run.node, answer);
      const box = $("messages");
      if (box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
    }
  };
  try {
    for await (const chunk of streamChat(body, controller.signal)) {
      const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
      if (typeof delta.content === "string") answer.content += delta.content;
      if (typeof delta.reasoning_content === "string") answer.reasoning = (answer.reasoning || "") + delta.reasoning_content;
      if (chunk.timings && Number.isFinite(chunk.timings.predicted_per_second)) {
        answer.speed = chunk.timings.predicted_per_second;
        $("speed").textContent = `${answer.speed.toFixed(1)} tokens/s`;
      }
      if (!frame) frame = setTimeout(redraw, 100);
    }
  } catch (err) {
    if (err.name === "AbortError") {
      answer.note = "stopped";
    } else {
      answer.note = `error: ${err.message}`;
      showError(err.message);
      if (err instanceof ApiError && err.status === 401) askKey();
    }
    if (!answer.content && !answer.reasoning) {
      // Nothing came back: the turn is taken out (the next request must not carry an empty answer),
      // and the message goes back to the box to be sent again.
      c.messages.splice(c.messages.indexOf(answer) - 1, 2);
      if (!input.value) input.value = text;
      if (!c.messages.length && c.title === text.slice(0, 60)) c.title = "New chat";
    }
  } finally {
    if (frame) clearTimeout(frame);
    state.running = null;
    setRunning(false);
    store.touch(c);
    persist();
    renderList();
    if (state.current === c) renderMessages();
  }
}

function stop() {
  if (state.running) state.running.controller.abort();
}

function lastSettings() {
  const c = state.current || store.conversations[0];
  return c ? { ...c.settings } : { ...DEFAULT_SETTINGS };
}

// ---- settings, import, export ------------------------------------------------------------------
function openSettings() {
  const s = state.current ? state.current.settings : lastSettings();
  $("set-system").value = s.system;
  $("set-temperature").value = s.temperature;
  $("set-max-tokens").value = s.max_tokens || "";
  $("settings").showModal();
}

function saveSettings() {
  const temperature = parseFloat($("set-temperature").value);
  const maxTokens = parseInt($("set-max-tokens").value, 10);
  const settings = {
    system: $("set-system").value,
    temperature: Number.isFinite(temperature) && temperature >= 0 ? temperature : DEFAULT_SETTINGS.temperature,
    max_tokens: Number.isInteger(maxTokens) && maxTokens > 0 ? maxTokens : null,
  };
  if (!state.current) state.current = store.create($("model").value, settings);
  else state.current.settings = settings;
  persist();
  renderList();
}

function exportAll() {
  const blob = new Blob([store.exportJSON()], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = "conversations.json";
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function importFile(file) {
  try {
    const n = store.importJSON(await file.text());
    renderList();
    if (!n) showError("That file holds no conversation.");
  } catch (err) {
    showError(`Could not import ${file.name}: ${err.message}`);
  }
}

// ---- layout ----------------------------------------------------------------------------------
function closeSidebar() {
  document.body.classList.remove("sidebar-open");
  $("menu").setAttribute("aria-expanded", "false");
}

function wire() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("model").addEventListener("change", () => {
    const model = $("model").value;
    localStorage.setItem(MODEL_STORE, model);
    if (state.current && !state.running) {
      state.current.model = model;
      persist();
    }
  });
  $("settings-button").addEventListener("click", openSettings);
  $("settings").addEventListener("close", () => {
    if ($("settings").returnValue === "save") saveSettings();
  });
  $("apikey").addEventListener("close", () => {
    setApiKey($("apikey-input").value.trim());
    $("apikey-input").value = "";
    loadModels();
  });
  $("export").addEventListener("click", exportAll);
  $("import").addEventListener("click", () => $("import-file").click());
  $("import-file").addEventListener("change", (e) => {
    const file = e.target.files && e.target.files[0];
    if (file) importFile(file);
    e.target.value = "";
  });
  $("error-close").addEventListener("click", clearError);
  $("menu").addEventListener("click", () => {
    const open = document.body.classList.toggle("sidebar-open");
    $("menu").setAttribute("aria-expanded", String(open));
  });
  window.addEventListener("storage", (e) => {
    // Another tab changed the list: take its changes (this tab's answer in progress stays as it is).
    if (!e.key || !e.key.startsWith("llama_ctypes.conversations")) return;
    const running = state.running && state.running.conversation;
    store.refresh(running);
    if (state.current) state.current = store.get(state.current.id);
    renderList();
    if (!running) renderMessages();
  });
}

wire();
state.current = store.conversations[0] || null;
renderList();
renderMessages();
loadModels();
