// Markdown to DOM nodes. Model output is never parsed as HTML: every piece of text becomes a text
// node (textContent), and only the elements built here exist, so "<script>" or "<img onerror=...>"
// in a reply shows as those characters. Links keep http(s) and mailto targets only.

import { highlight } from "./highlight.js";

function el(tag, cls) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  return node;
}

const SAFE_URL = /^(https?:\/\/|mailto:)/i;

// Inline: `code`, **bold**, __bold__, *italic*, _italic_, [text](url). Every span is bounded in
// length, so an unclosed marker costs a bounded scan, not one to the end of a long answer.
const INLINE = /(`{1,8})([^`][\s\S]{0,2000}?)\1(?!`)|\*\*(?=\S)([\s\S]{0,500}?\S)\*\*|__(?=\S)([\s\S]{0,500}?\S)__|\*(?=[^\s*])([^*]{0,500}?[^\s*])\*|\b_(?=[^\s_])([^_]{0,500}?[^\s_])_\b|\[([^\]\n]{1,500})\]\(([^)\s]{1,2000})\)/;

export function renderInline(text, parent) {
  let rest = text;
  while (rest) {
    const m = INLINE.exec(rest);
    if (!m) {
      appendText(parent, rest);
      break;
    }
    appendText(parent, rest.slice(0, m.index));
    if (m[1]) {
      const code = el("code");
      code.textContent = m[2].replace(/^ (.*) $/, "$1");
      parent.append(code);
    } else if (m[3] !== undefined || m[4] !== undefined) {
      const strong = el("strong");
      renderInline(m[3] ?? m[4], strong);
      parent.append(strong);
    } else if (m[5] !== undefined || m[6] !== undefined) {
      const em = el("em");
      renderInline(m[5] ?? m[6], em);
      parent.append(em);
    } else {
      const url = m[8];
      if (SAFE_URL.test(url)) {
        const a = el("a");
        a.href = url;
        a.target = "_blank";
        a.rel = "noopener noreferrer nofollow";
        renderInline(m[7], a);
        parent.append(a);
      } else {
        appendText(parent, m[0]);
      }
    }
    rest = rest.slice(m.index + m[0].length);
  }
}

function appendText(parent, text) {
  if (!text) return;
  const lines = text.split("\n");
  lines.forEach((line, i) => {
    if (i > 0) parent.append(el("br"));
    if (line) parent.append(document.createTextNode(line));
  });
}

const FENCE = /^ {0,3}(```+|~~~+)\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})[ \t]+(.*)$/;
// The nesting of quotes rendered as such; deeper markers stay text (no recursion without end).
const MAX_DEPTH = 8;

// A heading's text without its closing #s, in linear time (a regex here backtracks on long lines).
function headingText(raw) {
  let text = raw.trimEnd();
  let end = text.length;
  while (end > 0 && text[end - 1] === "#") end--;
  if (end < text.length && (end === 0 || text[end - 1] === " " || text[end - 1] === "\t")) text = text.slice(0, end);
  return text.trim();
}
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const BULLET = /^(\s*)([-*+])\s+(.*)$/;
const NUMBERED = /^(\s*)(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;

// Renders `source` into a DocumentFragment. An unclosed code fence (a reply still streaming)
// runs to the end.
export function renderMarkdown(source, depth = 0) {
  const out = document.createDocumentFragment();
  const lines = String(source).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  let para = [];

  const flush = () => {
    if (para.length) {
      const p = el("p");
      renderInline(para.join("\n"), p);
      out.append(p);
      para = [];
    }
  };

  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = FENCE.exec(line))) {
      flush();
      const marker = m[1];
      const lang = m[2] || "";
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trimStart().startsWith(marker)) body.push(lines[i++]);
      i++;
      out.append(codeBlock(body.join("\n"), lang));
      continue;
    }
    if (!line.trim()) {
      flush();
      i++;
      continue;
    }
    if ((m = HEADING.exec(line))) {
      flush();
      const h = el(`h${Math.min(m[1].length + 2, 6)}`);
      renderInline(headingText(m[2]), h);
      out.append(h);
      i++;
      continue;
    }
    if (RULE.test(line)) {
      flush();
      out.append(el("hr"));
      i++;
      continue;
    }
    if (depth < MAX_DEPTH && QUOTE.test(line)) {
      flush();
      const inner = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        inner.push(m[1]);
        i++;
      }
      const q = el("blockquote");
      q.append(renderMarkdown(inner.join("\n"), depth + 1));
      out.append(q);
      continue;
    }
    if (BULLET.test(line) || NUMBERED.test(line)) {
      flush();
      const ordered = !BULLET.test(line);
      const list = el(ordered ? "ol" : "ul");
      if (ordered) {
        const start = parseInt(NUMBERED.exec(line)[2], 10);
        if (start !== 1) list.start = start;
      }
      while (i < lines.length) {
        m = (ordered ? NUMBERED : BULLET).exec(lines[i]);
        if (!m) {
          // a continuation line of the item before (indented), else the list ends
          if (lines[i].trim() && /^\s{2,}/.test(lines[i]) && list.lastChild) {
            list.lastChild.append(el("br"));
            renderInline(lines[i].trim(), list.lastChild);
            i++;
            continue;
          }
          break;
        }
        const item = el("li");
        renderInline(m[3], item);
        list.append(item);
        i++;
      }
      out.append(list);
      continue;
    }
    para.push(line);
    i++;
  }
  flush();
  return out;
}

function codeBlock(code, lang) {
  const wrap = el("div", "code-block");
  const bar = el("div", "code-bar");
  const name = el("span", "code-lang");
  name.textContent = lang || "text";
  const copy = el("button", "code-copy");
  copy.type = "button";
  copy.textContent = "Copy";
  copy.addEventListener("click", () => {
    navigator.clipboard?.writeText(code).then(() => { copy.textContent = "Copied"; }, () => {});
  });
  bar.append(name, copy);
  const pre = el("pre");
  const codeEl = el("code");
  if (lang) codeEl.dataset.lang = lang;
  codeEl.append(highlight(code, lang));
  pre.append(codeEl);
  wrap.append(bar, pre);
  return wrap;
}
