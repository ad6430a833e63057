// A small, safe Markdown subset renderer for model output.
//
// Safety: the output is built with createElement / textContent only. Nothing the model writes
// is ever parsed as HTML, so raw tags like <script> or <img onerror=...> show up as plain text.
// Link targets are kept only when they are http(s) or mailto URLs.
//
// Subset: paragraphs (single newlines become line breaks), ATX headings, fenced code blocks,
// bullet and numbered lists (nested by indentation), block quotes, pipe tables, horizontal
// rules; inline code, **bold**, *italic*, ~~strike~~, [links](url), bare URLs, and citation
// markers (CITE_OPEN n CITE_CLOSE, placed by the caller) which become the caller's citation links.

export const CITE_OPEN = "\uE000";
export const CITE_CLOSE = "\uE001";
const CITE_MARK = /\uE000(\d+)\uE001/g;

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_DIVIDER = /^\s*\|?\s*:?-{1,}:?\s*(\|\s*:?-{1,}:?\s*)*\|?\s*$/;
const ESCAPABLE = /[\\`*_{}\[\]()#+\-.!|~<>]/;

/** The href for `url` if it is safe to link to (http, https, mailto), else null. */
export function safeUrl(url) {
  try {
    const parsed = new URL(url, document.baseURI);
    return ["http:", "https:", "mailto:"].includes(parsed.protocol) ? parsed.href : null;
  } catch {
    return null;
  }
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

/**
 * Render `text` into a DocumentFragment.
 * options.citation(n) -> Node: the element for citation marker n.
 * options.citationText(n) -> string: what marker n reads as inside code.
 */
export function renderMarkdown(text, options = {}) {
  const ctx = {
    citation: options.citation || ((n) => document.createTextNode(`[${n}]`)),
    citationText: options.citationText || ((n) => `[${n}]`),
  };
  const fragment = document.createDocumentFragment();
  renderBlocks(text.replace(/\r\n?/g, "\n").split("\n"), fragment, ctx);
  return fragment;
}

function isBlank(line) {
  return /^\s*$/.test(line);
}

function startsBlock(line, next) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    LIST_ITEM.test(line) || (line.includes("|") && next !== undefined && TABLE_DIVIDER.test(next) && next.includes("-"));
}

function renderBlocks(lines, parent, ctx) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (isBlank(line)) {
      i++;
      continue;
    }
    let m;
    if ((m = line.match(FENCE))) {
      const fence = m[1];
      const body = [];
      i++;
      while (i < lines.length && !isClosingFence(lines[i], fence)) {
        body.push(lines[i]);
        i++;
      }
      i++; // the closing fence (an unclosed fence, mid-stream, runs to the end)
      parent.appendChild(codeBlock(body.join("\n"), m[2], ctx));
      continue;
    }
    if ((m = line.match(HEADING))) {
      const heading = el(`h${m[1].length}`);
      renderInline(m[2], heading, ctx);
      parent.appendChild(heading);
      i++;
      continue;
    }
    if (RULE.test(line)) {
      parent.appendChild(el("hr"));
      i++;
      continue;
    }
    if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && !isBlank(lines[i]) && (m = lines[i].match(QUOTE))) {
        body.push(m[1]);
        i++;
      }
      const quote = el("blockquote");
      renderBlocks(body, quote, ctx);
      parent.appendChild(quote);
      continue;
    }
    if (LIST_ITEM.test(line)) {
      i = renderList(lines, i, parent, ctx);
      continue;
    }
    if (line.includes("|") && i + 1 < lines.length && TABLE_DIVIDER.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      i = renderTable(lines, i, parent, ctx);
      continue;
    }
    const body = [line];
    i++;
    while (i < lines.length && !isBlank(lines[i]) && !startsBlock(lines[i], lines[i + 1])) {
      body.push(lines[i]);
      i++;
    }
    const paragraph = el("p");
    body.forEach((text, k) => {
      if (k > 0) paragraph.appendChild(el("br"));
      renderInline(text.trim(), paragraph, ctx);
    });
    parent.appendChild(paragraph);
  }
}

function isClosingFence(line, fence) {
  const run = line.trim();
  return run.length >= fence.length && run === fence[0].repeat(run.length);
}

function codeBlock(code, language, ctx) {
  const wrapper = el("div", "code-block");
  const bar = el("div", "code-bar");
  bar.appendChild(el("span", "code-lang", language || "text"));
  const copy = el("button", "code-copy", "Copy");
  copy.type = "button";
  const plain = code.replace(CITE_MARK, (_, n) => ctx.citationText(Number(n)));
  copy.addEventListener("click", async () => {
    copy.textContent = (await copyText(plain)) ? "Copied" : "Copy failed";
    setTimeout(() => { copy.textContent = "Copy"; }, 1200);
  });
  bar.appendChild(copy);
  wrapper.appendChild(bar);
  const pre = el("pre");
  const codeEl = el("code", null, plain);
  if (language) codeEl.dataset.language = language;
  pre.appendChild(codeEl);
  wrapper.appendChild(pre);
  return wrapper;
}

/** Put `text` on the clipboard. navigator.clipboard exists only in a secure context (https or
 * localhost); a server reached over plain http on the LAN gets the selection-and-copy fallback. */
async function copyText(text) {
  try {
    if (navigator.clipboard) {
      await navigator.clipboard.writeText(text);
      return true;
    }
  } catch {
    // denied: fall back
  }
  const focused = document.activeElement;
  const area = document.createElement("textarea");
  area.value = text;
  area.readOnly = true;
  area.style.position = "fixed";
  area.style.top = "0";
  area.style.opacity = "0";
  document.body.appendChild(area);
  area.select();
  let ok = false;
  try {
    ok = document.execCommand("copy");
  } catch {
    ok = false;
  }
  area.remove();
  focused?.focus?.();
  return ok;
}

function indentOf(line) {
  const m = line.match(/^\s*/)[0];
  return m.replace(/\t/g, "    ").length;
}

function renderList(lines, start, parent, ctx) {
  const first = lines[start].match(LIST_ITEM);
  const baseIndent = indentOf(lines[start]);
  const ordered = /\d/.test(first[2]);
  const list = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  let i = start;
  const items = [];
  let sawBlank = false;
  let contentIndent = baseIndent + 2; // where the current item's text starts ("1. " is 3 wide)
  while (i < lines.length) {
    const line = lines[i];
    const m = line.match(LIST_ITEM);
    if (m && indentOf(line) <= baseIndent + 1 && /\d/.test(m[2]) === ordered) {
      items.push([m[3]]);
      contentIndent = m[3] ? line.length - m[3].length : m[1].length + m[2].length + 1;
      i++;
      continue;
    }
    if (isBlank(line)) {
      // A blank line ends the list unless the list (or this item) goes on after it.
      const next = lines[i + 1];
      if (next === undefined || (indentOf(next) <= baseIndent && !(LIST_ITEM.test(next) && /\d/.test(next.match(LIST_ITEM)[2]) === ordered))) break;
      sawBlank = true;
      items[items.length - 1].push("");
      i++;
      continue;
    }
    if (indentOf(line) > baseIndent) {
      // Continuation or nested content of the current item, dedented relative to it.
      items[items.length - 1].push(line.replace(new RegExp(`^\\s{0,${contentIndent}}`), ""));
      i++;
      continue;
    }
    if (!startsBlock(line, lines[i + 1]) && items[items.length - 1].length === 1) {
      items[items.length - 1].push(line.trim()); // a lazy continuation line
      i++;
      continue;
    }
    break;
  }
  for (const body of items) {
    const item = el("li");
    const loose = sawBlank && body.length > 1;
    if (!loose && body.slice(1).every((l) => !startsBlock(l) && !isBlank(l))) {
      body.forEach((text, k) => {
        if (k > 0) item.appendChild(el("br"));
        renderInline(text.trim(), item, ctx);
      });
    } else if (!loose && !startsBlock(body[0])) {
      // Tight item: first line inline, the rest (e.g. a nested list) as blocks.
      renderInline(body[0].trim(), item, ctx);
      renderBlocks(body.slice(1), item, ctx);
    } else {
      renderBlocks(body, item, ctx);
    }
    list.appendChild(item);
  }
  parent.appendChild(list);
  return i;
}

function splitRow(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  const cells = [];
  let cell = "";
  let inCode = false;
  for (let k = 0; k < row.length; k++) {
    const c = row[k];
    if (c === "\\" && row[k + 1] === "|") {
      cell += "|";
      k++;
    } else if (c === "`") {
      inCode = !inCode;
      cell += c;
    } else if (c === "|" && !inCode) {
      cells.push(cell.trim());
      cell = "";
    } else {
      cell += c;
    }
  }
  cells.push(cell.trim());
  return cells;
}

function renderTable(lines, start, parent, ctx) {
  const header = splitRow(lines[start]);
  const aligns = splitRow(lines[start + 1]).map((spec) =>
    spec.startsWith(":") && spec.endsWith(":") ? "center" : spec.endsWith(":") ? "right" : spec.startsWith(":") ? "left" : "");
  const wrapper = el("div", "table-wrap");
  const table = el("table");
  const head = el("thead");
  const headRow = el("tr");
  header.forEach((text, k) => {
    const th = el("th");
    if (aligns[k]) th.className = `align-${aligns[k]}`;
    renderInline(text, th, ctx);
    headRow.appendChild(th);
  });
  head.appendChild(headRow);
  table.appendChild(head);
  const body = el("tbody");
  let i = start + 2;
  while (i < lines.length && !isBlank(lines[i]) && lines[i].includes("|")) {
    const row = el("tr");
    const cells = splitRow(lines[i]);
    for (let k = 0; k < header.length; k++) {
      const td = el("td");
      if (aligns[k]) td.className = `align-${aligns[k]}`;
      renderInline(cells[k] ?? "", td, ctx);
      row.appendChild(td);
    }
    body.appendChild(row);
    i++;
  }
  table.appendChild(body);
  wrapper.appendChild(table);
  parent.appendChild(wrapper);
  return i;
}

// --- inline ----------------------------------------------------------------------------------

const LINK = /^\[((?:[^\[\]\\]|\\.){0,1000})\]\(\s*<?([^\s<>()]*(?:\([^\s<>()]*\)[^\s<>()]*)*)>?(?:\s+"[^"]*")?\s*\)/;
const BARE_URL = /^https?:\/\/[^\s<>"'`\uE000\uE001]+/;

/** Where the closing `delimiter` of an emphasis span opened at `from` is, or -1. A closer must
 * follow a non-space (in "*args and **kwargs" nothing closes the "*"), and an opener met on the
 * way takes the next closer ("*a *b* c*" nests), as in CommonMark. */
function closing(text, delimiter, from) {
  let k = from;
  let depth = 0;
  while ((k = text.indexOf(delimiter, k)) !== -1) {
    if (delimiter === "*" && text[k + 1] === "*") { // a `**` run belongs to strong spans
      while (text[k] === "*") k++;
      continue;
    }
    const before = text[k - 1];
    const after = text[k + delimiter.length];
    if (k > from && !/\s/.test(before) && before !== "\\") {
      if ((delimiter === "_" || delimiter === "__") && after !== undefined && /\w/.test(after)) {
        k += delimiter.length;
        continue;
      }
      if (depth === 0) return k;
      depth--;
    } else if (after !== undefined && !/\s/.test(after) && !(delimiter[0] === "_" && /\w/.test(before ?? ""))) {
      depth++; // an opener of the same kind: the next closer is its own
    }
    k += delimiter.length;
  }
  return -1;
}

function renderInline(text, parent, ctx) {
  let buffer = "";
  const flush = () => {
    if (buffer) parent.appendChild(document.createTextNode(buffer));
    buffer = "";
  };
  let i = 0;
  while (i < text.length) {
    const c = text[i];
    const rest = text.slice(i);
    if (c === "\\" && i + 1 < text.length && ESCAPABLE.test(text[i + 1])) {
      buffer += text[i + 1];
      i += 2;
      continue;
    }
    if (c === CITE_OPEN) {
      const end = text.indexOf(CITE_CLOSE, i);
      if (end > i) {
        flush();
        parent.appendChild(ctx.citation(Number(text.slice(i + 1, end))));
        i = end + 1;
        continue;
      }
    }
    if (c === "`") {
      const ticks = rest.match(/^`+/)[0];
      const end = text.indexOf(ticks, i + ticks.length);
      if (end !== -1) {
        flush();
        let code = text.slice(i + ticks.length, end);
        if (/^ .* $/.test(code)) code = code.slice(1, -1);
        parent.appendChild(el("code", null, code.replace(CITE_MARK, (_, n) => ctx.citationText(Number(n)))));
        i = end + ticks.length;
        continue;
      }
      buffer += ticks;
      i += ticks.length;
      continue;
    }
    if ((rest.startsWith("**") || rest.startsWith("__")) && rest.length > 2 && !/\s/.test(rest[2])) {
      const delimiter = rest.slice(0, 2);
      const wordStart = delimiter === "__" ? i === 0 || !/\w/.test(text[i - 1]) : true;
      const end = wordStart ? closing(text, delimiter, i + 2) : -1;
      if (end !== -1) {
        flush();
        const strong = el("strong");
        renderInline(text.slice(i + 2, end), strong, ctx);
        parent.appendChild(strong);
        i = end + 2;
        continue;
      }
    }
    if (rest.startsWith("~~") && rest.length > 2 && !/\s/.test(rest[2])) {
      const end = closing(text, "~~", i + 2);
      if (end !== -1) {
        flush();
        const del = el("del");
        renderInline(text.slice(i + 2, end), del, ctx);
        parent.appendChild(del);
        i = end + 2;
        continue;
      }
    }
    if ((c === "*" || c === "_") && rest.length > 1 && !/\s/.test(rest[1]) && rest[1] !== c) {
      const wordStart = c === "_" ? i === 0 || !/\w/.test(text[i - 1]) : true;
      const end = wordStart ? closing(text, c, i + 1) : -1;
      if (end !== -1) {
        flush();
        const em = el("em");
        renderInline(text.slice(i + 1, end), em, ctx);
        parent.appendChild(em);
        i = end + 1;
        continue;
      }
    }
    if (c === "[") {
      const m = rest.match(LINK);
      if (m) {
        flush();
        const href = safeUrl(m[2]);
        if (href) {
          const link = el("a");
          link.href = href;
          link.target = "_blank";
          link.rel = "noopener noreferrer nofollow";
          renderInline(m[1], link, ctx);
          parent.appendChild(link);
        } else {
          renderInline(m[1], parent, ctx); // an unsafe target: keep the words, drop the link
        }
        i += m[0].length;
        continue;
      }
    }
    if ((c === "h" || c === "H") && (i === 0 || !/[\w/]/.test(text[i - 1]))) {
      const m = rest.match(BARE_URL);
      if (m) {
        // Trailing punctuation is the sentence's; a ")" too, unless it closes a "(" in the URL.
        let url = m[0];
        for (;;) {
          const last = url[url.length - 1];
          if (/[.,;:!?\]]/.test(last)) url = url.slice(0, -1);
          else if (last === ")" && url.split(")").length > url.split("(").length) url = url.slice(0, -1);
          else break;
        }
        const href = safeUrl(url);
        if (href) {
          flush();
          const link = el("a", null, url);
          link.href = href;
          link.target = "_blank";
          link.rel = "noopener noreferrer nofollow";
          parent.appendChild(link);
          i += url.length;
          continue;
        }
      }
    }
    buffer += c;
    i++;
  }
  flush();
}
