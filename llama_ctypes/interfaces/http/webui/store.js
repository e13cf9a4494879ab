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

function readStored() {
  try {
    const raw = JSON.parse(localStorage.getItem(STORE) || "[]");
    return Array.isArray(raw) ? raw.filter(valid).map(clean) : [];
  } catch (_) {
    return [];
  }
}

// Several tabs share the list: every save merges with what is stored (per conversation, the newer
// copy wins; deletions made here are applied), so one tab never writes over another's changes.
export class Store {
  constructor() {
    this.conversations = readStored();
    this.deleted = new Set();
    this.seen = new Set(this.conversations.map((c) => c.id)); // ids this tab has seen stored
    this.sort();
  }

  sort() {
    this.conversations.sort((a, b) => b.updated - a.updated);
  }

  // What is stored merged with what is here; `keep` (a conversation being written to) stays ours.
  // (A conversation this tab saw stored that is gone from storage was deleted by another tab.)
  merged(keep = null) {
    const stored = readStored();
    const byId = new Map(stored.map((c) => [c.id, c]));
    for (const c of this.conversations) {
      const theirs = byId.get(c.id);
      if (theirs ? c === keep || c.updated >= theirs.updated : c === keep || !this.seen.has(c.id)) byId.set(c.id, c);
    }
    for (const id of this.deleted) byId.delete(id);
    for (const c of stored) this.seen.add(c.id);
    return [...byId.values()];
  }

  // Another tab saved: take its changes, keeping `keep` as it is here.
  refresh(keep = null) {
    this.conversations = this.merged(keep);
    this.sort();
  }

  // Throws when the browser's storage is full; nothing is then half-stored, and the list here is
  // what it was before the change (`undo` puts it back).
  save(undo = null) {
    const list = this.merged();
    try {
      localStorage.setItem(STORE, JSON.stringify(list));
    } catch (err) {
      if (undo) undo();
      throw err;
    }
    this.deleted.clear();
    for (const c of list) this.seen.add(c.id);
    this.conversations = list;
    this.sort();
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
    c.updated = Math.max(Date.now(), c.updated + 1);
    this.sort();
  }

  rename(id, title) {
    const c = this.get(id);
    if (!c || !title.trim()) return;
    const before = [c.title, c.updated];
    c.title = title.trim().slice(0, 200);
    this.touch(c);
    this.save(() => { [c.title, c.updated] = before; });
  }

  remove(id) {
    const before = this.conversations;
    this.conversations = before.filter((c) => c.id !== id);
    this.deleted.add(id);
    this.save(() => {
      this.conversations = before;
      this.deleted.delete(id);
    });
  }

  exportJSON() {
    return JSON.stringify({ format: FORMAT, version: 1, conversations: this.conversations }, null, 2);
  }

  // Adds the conversations of an export (new ids where they clash; times no later than now);
  // returns how many. Nothing is added when they do not fit in the browser's storage.
  importJSON(text) {
    const data = JSON.parse(text);
    const list = data && data.format === FORMAT && Array.isArray(data.conversations) ? data.conversations : null;
    if (!list) throw new Error("not a conversations file exported from this page");
    const taken = new Set(this.conversations.map((c) => c.id));
    const added = [];
    for (const c of list) {
      if (!valid(c)) continue;
      const copy = clean(c);
      if (taken.has(copy.id)) copy.id = newId();
      copy.updated = Math.min(copy.updated, Date.now());
      taken.add(copy.id);
      added.push(copy);
    }
    const before = this.conversations;
    this.conversations = [...before, ...added];
    this.save(() => { this.conversations = before; });
    return added.length;
  }
}
