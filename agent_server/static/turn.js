// One assistant turn on the page: it follows a Responses API event stream and keeps a view per
// output item (reasoning panel, tool step, answer). Every string from the server goes into the
// DOM through textContent or the safe Markdown renderer, never as HTML.

import { CITE_CLOSE, CITE_OPEN, renderMarkdown, safeUrl } from "./markdown.js";

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = text;
  return node;
}

function externalLink(url, text) {
  const href = safeUrl(url);
  if (!href) return el("span", "url", text || url);
  const link = el("a", null, text || url);
  link.href = href;
  link.target = "_blank";
  link.rel = "noopener noreferrer nofollow";
  return link;
}

function hostOf(url) {
  try {
    return new URL(url).host || url;
  } catch {
    return url;
  }
}

function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

// --- reasoning ---------------------------------------------------------------------------------

/** "0.4 s", "12.3 s"; under a tenth of a second in milliseconds, not "0.0 s". */
export function duration(seconds) {
  return seconds < 0.1 ? `${Math.max(1, Math.round(seconds * 1000))} ms` : `${seconds.toFixed(1)} s`;
}

class ReasoningView {
  /** started: when the model began on this step (the request, or the end of the item before):
   * its header tokens and the prompt's prefill are part of the time it took. */
  constructor(container, started) {
    this.text = "";
    this.started = started;
    this.node = el("details", "reasoning");
    this.node.dataset.state = "streaming";
    const summary = el("summary");
    this.label = el("span", "reasoning-label", "Thinking");
    this.preview = el("span", "reasoning-preview");
    summary.append(el("span", "chevron"), this.label, this.preview);
    this.body = el("div", "reasoning-text");
    this.node.append(summary, this.body);
    container.appendChild(this.node);
  }

  append(delta) {
    this.text += delta;
    this.body.textContent = this.text;
    const last = this.text.trim().split("\n").pop() || "";
    this.preview.textContent = last.length > 90 ? `…${last.slice(-90)}` : last;
  }

  done(item) {
    const parts = (item.content || []).concat(item.summary || []);
    const text = parts.map((part) => part.text || "").join("\n\n");
    if (text) {
      this.text = text;
      this.body.textContent = text;
    }
    const seconds = (performance.now() - this.started) / 1000;
    this.label.textContent = item.status === "incomplete" ? "Reasoning (cut short)" : `Reasoned for ${duration(seconds)}`;
    this.preview.textContent = "";
    this.node.dataset.state = "done";
  }

  stop() {
    if (this.node.dataset.state === "streaming") {
      this.label.textContent = "Reasoning (stopped)";
      this.preview.textContent = "";
      this.node.dataset.state = "done";
    }
  }
}

// --- answer text -------------------------------------------------------------------------------

const CLOSES_A_SENTENCE = ".,;:!?";

class MessageView {
  constructor(container) {
    this.text = "";
    this.annotations = [];
    this.node = el("div", "answer markdown");
    this.node.dataset.state = "streaming";
    container.appendChild(this.node);
    this.pending = false;
  }

  append(delta) {
    this.text += delta;
    this.schedule();
  }

  annotate(index, annotation) {
    this.annotations[index] = annotation;
    this.schedule();
  }

  done(item) {
    const part = (item.content || []).find((p) => p.type === "output_text" || p.type === "refusal");
    if (part) {
      this.text = part.text ?? part.refusal ?? this.text;
      this.annotations = part.annotations || this.annotations;
    }
    this.node.dataset.state = "done";
    this.render();
  }

  stop() {
    this.node.dataset.state = "done";
    this.render();
  }

  /** Re-render on the next frame, but spend at most about a third of the time rendering: a long
   * answer (whose Markdown takes a while to rebuild) is then redrawn less often, not janky. */
  schedule() {
    if (this.pending) return;
    this.pending = true;
    const wait = Math.max(0, 2 * (this.renderMs || 0) - (performance.now() - (this.renderedAt || 0)));
    setTimeout(() => requestAnimationFrame(() => {
      this.pending = false;
      this.render();
    }), wait);
  }

  /** The text with each url_citation span replaced by a marker the renderer turns into a link.
   * Annotation offsets count Unicode code points (the server is Python), hence Array.from. */
  marked() {
    const citations = this.annotations
      .map((a, n) => ({ ...a, n }))
      .filter((a) => a && a.type === "url_citation" && Number.isInteger(a.start_index) && a.end_index >= a.start_index)
      .sort((a, b) => a.start_index - b.start_index);
    // The marker characters are the page's own: in the text (the model may write them, or quote
    // a page that has them) they would fake a citation, so they go. One for one: offsets hold.
    const chars = Array.from(this.text).map((c) => (c === CITE_OPEN || c === CITE_CLOSE ? "\uFFFD" : c));
    let out = "";
    let last = 0;
    for (const a of citations) {
      if (a.start_index < last || a.end_index > chars.length) continue;
      // Punctuation right after a citation goes before its chip, which then follows the
      // sentence: "fact [chip]." reads as a stray space before the full stop.
      let end = a.end_index;
      while (end < chars.length && CLOSES_A_SENTENCE.includes(chars[end])) end += 1;
      const before = chars.slice(last, a.start_index).join("");
      const punctuation = chars.slice(a.end_index, end).join("");
      out += punctuation ? `${before.trimEnd()}${punctuation} ` : before;
      out += CITE_OPEN + a.n + CITE_CLOSE;
      last = end;
    }
    return out + chars.slice(last).join("");
  }

  render() {
    const started = performance.now();
    const annotations = this.annotations;
    const label = (n) => annotations[n]?.title || hostOf(annotations[n]?.url || "");
    const fragment = renderMarkdown(this.marked(), {
      citation: (n) => {
        const link = externalLink(annotations[n].url, label(n));
        link.classList.add("citation");
        link.title = annotations[n].url;
        return link;
      },
      citationText: (n) => `[${label(n)}]`,
    });
    this.node.replaceChildren(fragment);
    this.renderedAt = performance.now();
    this.renderMs = this.renderedAt - started;
  }
}

// --- tool steps --------------------------------------------------------------------------------

const STEP_KINDS = {
  web_search_call: "web",
  code_interpreter_call: "python",
  function_call: "function",
  mcp_call: "function",
  mcp_list_tools: "function",
};

class StepView {
  constructor(container, item) {
    this.item = item;
    this.args = "";
    this.node = el("details", "step");
    this.node.dataset.kind = STEP_KINDS[item.type] || "other";
    this.node.dataset.type = item.type;
    this.node.dataset.state = "running";
    const summary = el("summary");
    this.badge = el("span", "step-badge");
    this.title = el("span", "step-title");
    this.status = el("span", "step-status");
    summary.append(el("span", "chevron"), this.badge, this.title, this.status);
    this.body = el("div", "step-body");
    this.node.append(summary, this.body);
    container.appendChild(this.node);
    this.update(item);
  }

  appendArguments(delta) {
    this.args += delta;
    this.update({ ...this.item, code: this.args, arguments: this.args });
  }

  section(label, content) {
    const section = el("div", "step-section");
    section.appendChild(el("div", "step-label", label));
    section.appendChild(content);
    this.body.appendChild(section);
    return section;
  }

  pre(text, className = "") {
    return el("pre", `step-pre ${className}`.trim(), text);
  }

  update(item) {
    this.item = item;
    const status = item.status || "in_progress";
    this.node.dataset.state = status === "in_progress" || status === "searching" || status === "interpreting"
      ? "running" : status === "failed" ? "failed" : status === "incomplete" ? "incomplete" : "done";
    this.status.textContent = { running: "running…", failed: "failed", incomplete: "stopped", done: "" }[this.node.dataset.state];
    this.body.replaceChildren();
    const render = {
      web_search_call: () => this.renderWeb(item),
      code_interpreter_call: () => this.renderPython(item),
      function_call: () => this.renderFunction(item),
      mcp_call: () => this.renderMcp(item),
      mcp_list_tools: () => this.renderMcpList(item),
    }[item.type];
    if (render) render();
    else {
      this.badge.textContent = "tool";
      this.title.textContent = item.type;
      this.section("Item", this.pre(JSON.stringify(item, null, 2)));
    }
  }

  renderWeb(item) {
    const action = item.action || {};
    if (action.type === "open_page") {
      this.badge.textContent = "open";
      this.title.textContent = action.url ? `Opened ${hostOf(action.url)}` : "Opening a page";
      if (action.url) this.section("Page", externalLink(action.url));
    } else if (action.type === "find_in_page") {
      this.badge.textContent = "find";
      this.title.textContent = action.pattern ? `Found “${action.pattern}” in the page` : "Finding in the page";
      this.section("Pattern", this.pre(action.pattern || ""));
      if (action.url) this.section("Page", externalLink(action.url));
    } else {
      this.badge.textContent = "search";
      this.title.textContent = action.query ? `Searched “${action.query}”` : "Searching the web";
      if (action.query) this.section("Query", this.pre(action.query));
      const sources = action.sources || [];
      if (sources.length) {
        const list = el("ol", "sources");
        for (const source of sources) {
          const li = el("li");
          li.appendChild(externalLink(source.url, source.title || source.url));
          list.appendChild(li);
        }
        this.section(`Results (${sources.length})`, list);
      }
    }
  }

  renderPython(item) {
    this.badge.textContent = "python";
    this.title.textContent = this.node.dataset.state === "running" ? "Running Python" : "Ran Python";
    this.section("Code", this.pre(item.code || "", "code"));
    const logs = (item.outputs || []).filter((o) => o.type === "logs").map((o) => o.logs).join("");
    if (logs) this.section("Output", this.pre(logs, "output"));
    for (const image of (item.outputs || []).filter((o) => o.type === "image")) {
      this.section("Image", externalLink(image.url, "image output"));
    }
  }

  renderFunction(item) {
    this.badge.textContent = "function";
    this.title.textContent = `${item.name || "function"}(…)`;
    this.section("Arguments", this.pre(prettyJson(item.arguments || ""), "code"));
    if (this.output !== undefined) this.section("Result", this.pre(this.output, "output"));
  }

  renderMcp(item) {
    this.badge.textContent = "tool";
    this.title.textContent = `${item.server_label ? `${item.server_label}.` : ""}${item.name || "tool"}(…)`;
    this.section("Arguments", this.pre(prettyJson(item.arguments || ""), "code"));
    if (item.output) this.section("Result", this.pre(item.output, "output"));
    if (item.error) this.section("Error", this.pre(typeof item.error === "string" ? item.error : JSON.stringify(item.error), "error"));
  }

  renderMcpList(item) {
    this.badge.textContent = "tools";
    const tools = item.tools || [];
    this.title.textContent = `Listed ${tools.length} tool${tools.length === 1 ? "" : "s"} on ${item.server_label || "a server"}`;
    if (tools.length) this.section("Tools", this.pre(tools.map((t) => t.name).join("\n")));
  }

  /** A function call the page must answer: a box for its output. */
  askForOutput() {
    this.node.open = true;
    this.node.dataset.state = "waiting";
    this.status.textContent = "needs output";
    this.outputBox = el("textarea", "function-output");
    this.outputBox.rows = 2;
    this.outputBox.placeholder = `What ${this.item.name} returned (sent back to the model)`;
    this.section("Result", this.outputBox);
  }

  setOutput(text) {
    this.output = text;
    this.outputBox = null;
    this.update(this.item);
  }

  stop() {
    if (this.node.dataset.state === "running") {
      this.node.dataset.state = "incomplete";
      this.status.textContent = "stopped";
    }
  }
}

// --- the turn ----------------------------------------------------------------------------------

export class AssistantTurn {
  /** options.limitSet: the request set max_output_tokens (else a cut is the server's default). */
  constructor(log, { limitSet = false } = {}) {
    this.limitSet = limitSet;
    this.node = el("section", "turn assistant");
    this.node.dataset.state = "streaming";
    this.items = el("div", "items");
    this.typing = el("div", "typing");
    this.typing.append(el("span"), el("span"), el("span"));
    this.meta = el("div", "meta");
    this.node.append(this.items, this.typing, this.meta);
    log.appendChild(this.node);
    this.views = new Map(); // output_index -> view
    this.response = null;
    this.started = performance.now();
    this.stepStarted = this.started; // when the model began on its current output item
  }

  get state() {
    return this.node.dataset.state;
  }

  view(index) {
    return this.views.get(index);
  }

  /** Apply one Responses API stream event. */
  handle(event) {
    switch (event.type) {
      case "response.created":
      case "response.in_progress":
        this.response = event.response;
        this.node.dataset.responseId = event.response.id;
        break;
      case "response.output_item.added": {
        const item = event.item;
        let view;
        if (item.type === "reasoning") view = new ReasoningView(this.items, this.stepStarted);
        else if (item.type === "message") view = new MessageView(this.items);
        else view = new StepView(this.items, item);
        this.views.set(event.output_index, view);
        break;
      }
      case "response.reasoning_text.delta":
      case "response.reasoning_summary_text.delta":
        this.view(event.output_index)?.append(event.delta);
        break;
      case "response.output_text.delta":
      case "response.refusal.delta":
        this.view(event.output_index)?.append(event.delta);
        break;
      case "response.output_text.annotation.added":
        this.view(event.output_index)?.annotate(event.annotation_index, event.annotation);
        break;
      case "response.code_interpreter_call_code.delta":
      case "response.function_call_arguments.delta":
      case "response.mcp_call_arguments.delta":
        this.view(event.output_index)?.appendArguments(event.delta);
        break;
      case "response.web_search_call.searching":
      case "response.code_interpreter_call.interpreting": {
        const view = this.view(event.output_index);
        if (view instanceof StepView) view.update({ ...view.item, status: "in_progress" });
        break;
      }
      case "response.output_item.done": {
        const view = this.view(event.output_index);
        // An item without a status (mcp_list_tools) is finished once it is done: failed if it has an error.
        const item = event.item.status ? event.item : { ...event.item, status: event.item.error ? "failed" : "completed" };
        if (view instanceof StepView) view.update(item);
        else view?.done(event.item);
        this.stepStarted = performance.now();
        break;
      }
      case "response.completed":
      case "response.incomplete":
      case "response.failed":
        this.finish(event.response);
        break;
      case "error":
        this.fail(event.message || (event.error && event.error.message) || "The stream reported an error.");
        break;
      default:
        break;
    }
  }

  finish(response) {
    this.response = response;
    this.node.dataset.state = response.status;
    for (const view of this.views.values()) if (view.node.dataset.state === "streaming" || view.node.dataset.state === "running") view.stop();
    const parts = [response.status];
    if (response.status === "incomplete" && response.incomplete_details) parts[0] = this.whyIncomplete(response);
    const usage = response.usage;
    if (usage) {
      const reasoning = usage.output_tokens_details?.reasoning_tokens;
      parts.push(`${usage.input_tokens} in · ${usage.output_tokens} out${reasoning ? ` (${reasoning} reasoning)` : ""} tokens`);
    }
    parts.push(`${((performance.now() - this.started) / 1000).toFixed(1)} s`);
    this.meta.textContent = parts.join(" · ");
    if (response.status === "failed" && response.error) this.showError(response.error.message || "The response failed.");
    else if (![...this.views.values()].some((view) => !(view instanceof MessageView) || view.text.trim())) {
      // (a random-weight model's tokens may never form a message: say so, not an empty turn)
      this.items.appendChild(el("div", "no-output", "No answer: nothing the model wrote reads as a message."));
    }
  }

  /** Why the answer stopped short, in the user's terms: a limit the page did not set is the
   * server's default, or the end of the model's context. */
  whyIncomplete(response) {
    const reason = response.incomplete_details.reason;
    if (reason !== "max_output_tokens" || this.limitSet) return `incomplete (${reason})`;
    if (response.max_output_tokens) {
      return `stopped at ${response.max_output_tokens} tokens, the server's default limit (Settings sets another)`;
    }
    return "stopped: the model's context is full";
  }

  /** The function calls this turn ends with, which the page has to answer. */
  pendingFunctionCalls() {
    if (!this.response || this.response.status !== "completed") return [];
    const calls = [];
    (this.response.output || []).forEach((item, index) => {
      if (item.type === "function_call") calls.push({ item, view: this.view(index) });
    });
    return calls.filter((c) => c.view instanceof StepView);
  }

  stop() {
    this.node.dataset.state = "stopped";
    for (const view of this.views.values()) view.stop();
    const seconds = ((performance.now() - this.started) / 1000).toFixed(1);
    this.meta.textContent = `stopped · ${seconds} s · the next message continues from the last finished answer`;
  }

  fail(message) {
    this.node.dataset.state = "failed";
    for (const view of this.views.values()) view.stop();
    this.showError(message);
  }

  showError(message) {
    const box = el("div", "error-box", message);
    box.setAttribute("role", "alert");
    this.items.appendChild(box);
  }
}
