// A small code highlighter: comments, strings, numbers and keywords of the common languages become
// spans with a class; the text itself only ever goes into text nodes.

const KEYWORDS = new Set((
  "and as assert async await break case catch class const continue def default del do elif else enum " +
  "except export extends false final finally fn for from func function go if impl import in interface " +
  "is lambda let loop match mod module mut new nil none not null or package pass private protected pub " +
  "public raise return self static struct super switch this throw trait true try type typeof use var " +
  "void where while with yield int float double char bool string long short unsigned signed auto " +
  "None True False echo fi then done esac local"
).split(" "));

const HASH_COMMENTS = new Set(["py", "python", "sh", "bash", "shell", "zsh", "rb", "ruby", "r", "toml", "yaml", "yml", "perl", "pl", "make", "makefile", "dockerfile"]);

function lexer(lang) {
  const hash = HASH_COMMENTS.has(lang.toLowerCase());
  const comment = hash ? String.raw`#[^\n]*` : String.raw`\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)|--[^\n]*(?=\n|$)`;
  return new RegExp(
    `(${comment})|("""[\\s\\S]*?(?:"""|$)|'''[\\s\\S]*?(?:'''|$)|"(?:\\\\.|[^"\\\\\\n])*"?|'(?:\\\\.|[^'\\\\\\n])*'?|\`(?:\\\\.|[^\`\\\\])*\`?)` +
    String.raw`|(\b(?:0x[\da-fA-F_]+|\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)\b)|([A-Za-z_][\w]*)`, "g");
}

export function highlight(code, lang = "") {
  const out = document.createDocumentFragment();
  if (!lang || code.length > 200000) {
    out.append(document.createTextNode(code));
    return out;
  }
  const re = lexer(lang);
  let last = 0;
  let m;
  const span = (cls, text) => {
    const s = document.createElement("span");
    s.className = cls;
    s.textContent = text;
    out.append(s);
  };
  while ((m = re.exec(code))) {
    if (m[0] === "") { re.lastIndex++; continue; }
    if (m.index > last) out.append(document.createTextNode(code.slice(last, m.index)));
    if (m[1]) span("tok-comment", m[1]);
    else if (m[2]) span("tok-string", m[2]);
    else if (m[3]) span("tok-number", m[3]);
    else if (KEYWORDS.has(m[4])) span("tok-keyword", m[4]);
    else out.append(document.createTextNode(m[4]));
    last = re.lastIndex;
  }
  if (last < code.length) out.append(document.createTextNode(code.slice(last)));
  return out;
}
