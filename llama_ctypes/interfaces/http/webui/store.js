// Conversations, kept in this browser (localStorage): list, create, rename, delete, export, import.

const STORE = "llama_ctypes.conversations.v1";
export const FORMAT = "llama_ctypes.conversations";

export const DEFAULT_SETTINGS = Object.freeze({ system: "", temperature: 0.8, max_tokens: null });

function newId() {
  return (crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random().toString(16).slice(2)}`);
}

function valid(c) {
  return c && typeof c.id === "string" && Array.isArray(c.messages) &&
    c.messages.every((m) => m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string");
}

function clean(c) {
  const s = c.settings || {};
  return {
    id: c.id,
    title: typeof c.title === "string" && c.title ? c.title.slice(0, 200) : "New chat",
    model: typeof c.model === "string" ? c.model : "",
    updated: Number.isFinite(c.updated) ? c.updated : Date.now(),
    settings: {
      system: typeof s.system === "string" ? s.system : DEFAULT_SETTINGS.system,
      temperature: Number.isFinite(s.temperature) ? s.temperature : DEFAULT_SETTINGS.temperature,
      max_tokens: Number.isInteger(s.max_tokens) && s.max_tokens > 0 ? s.max_tokens : null,
    },
    messages: c.messages.map((m) => ({
      role: m.role,
      content: m.content,
      ...(typeof m.reasoning === "string" && m.reasoning ? { reasoning: m.reasoning } : {}),
      ...(typeof m.speed === "number" ? { speed: m.speed } : {}),
      ...(typeof m.note === "string" ? { note: m.note } : {}),
    })),
  };
}

export class Store {
  constructor() {
    this.conversations = [];
    try {
      const raw = JSON.parse(localStorage.getItem(STORE) || "[]");
      if (Array.isArray(raw)) this.conversations = raw.filter(valid).map(clean);
    } catch (_) {
      this.conversations = [];
    }
    this.sort();
  }

  sort() {
    this.conversations.sort((a, b) => b.updated - a.updated);
  }

  // Throws when the browser's storage is full (the caller shows it).
  save() {
    localStorage.setItem(STORE, JSON.stringify(this.conversations));
  }

  get(id) {
    return this.conversations.find((c) => c.id === id) || null;
  }

  create(model, settings = DEFAULT_SETTINGS) {
    const c = { id: newId(), title: "New chat", model, updated: Date.now(), settings: { ...settings }, messages: [] };
    this.conversations.unshift(c);
    return c;
  }

  touch(c) {
    c.updated = Date.now();
    this.sort();
  }

  rename(id, title) {
    const c = this.get(id);
    if (c && title.trim()) {
      c.title = title.trim().slice(0, 200);
      this.save();
    }
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    this.save();
  }

  exportJSON() {
    return JSON.stringify({ format: FORMAT, version: 1, conversations: this.conversations }, null, 2);
  }

  // Adds the conversations of an export (new ids where they clash); returns how many.
  importJSON(text) {
    const data = JSON.parse(text);
    const list = data && data.format === FORMAT && Array.isArray(data.conversations) ? data.conversations : null;
    if (!list) throw new Error("not a conversations file exported from this page");
    const taken = new Set(this.conversations.map((c) => c.id));
    let n = 0;
    for (const c of list) {
      if (!valid(c)) continue;
      const copy = clean(c);
      if (taken.has(copy.id)) copy.id = newId();
      taken.add(copy.id);
      this.conversations.push(copy);
      n++;
    }
    this.sort();
    this.save();
    return n;
  }
}
