// The playground's controller: settings, the composer, sending a turn, stopping it, and
// continuing the conversation with previous_response_id.

import { ApiClient, errorMessage, serverSentEvents } from "./api.js";
import { AssistantTurn, el } from "./turn.js";

const SETTINGS_STORAGE = "oss-agent.settings";
const INCLUDE = ["web_search_call.action.sources", "code_interpreter_call.outputs"];

const $ = (id) => document.getElementById(id);

const ui = {
  log: $("log"),
  empty: $("empty"),
  model: $("model-name"),
  notice: $("notice"),
  effort: $("effort"),
  web: $("tool-web"),
  python: $("tool-python"),
  toolChoice: $("tool-choice"),
  newChat: $("new-chat"),
  settingsButton: $("settings-button"),
  form: $("composer"),
  input: $("input"),
  send: $("send"),
  stop: $("stop"),
  keyDialog: $("key-dialog"),
  keyMessage: $("key-message"),
  keyInput: $("key-input"),
  keySave: $("key-save"),
  keyCancel: $("key-cancel"),
  settingsDialog: $("settings-dialog"),
  settingsKey: $("settings-key"),
  settingsInstructions: $("settings-instructions"),
  settingsMaxTokens: $("settings-max-tokens"),
  settingsTools: $("settings-tools"),
  settingsError: $("settings-error"),
  settingsSave: $("settings-save"),
  settingsCancel: $("settings-cancel"),
};

// --- settings ----------------------------------------------------------------------------------

function loadSettings() {
  try {
    return JSON.parse(localStorage.getItem(SETTINGS_STORAGE)) || {};
  } catch {
    return {};
  }
}

const settings = {
  effort: "medium",
  web: false,
  python: false,
  toolChoice: "auto",
  instructions: "",
  maxOutputTokens: "",
  extraTools: "",
  ...loadSettings(),
};

function saveSettings() {
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(settings));
}

// The built-in tools a tool choice can force, by the toggle that enables each.
const FORCED_TOOLS = { web_search_preview: "web", code_interpreter: "python" };

ui.effort.value = settings.effort;
ui.web.checked = settings.web;
ui.python.checked = settings.python;
ui.toolChoice.value = settings.toolChoice;
if (!ui.toolChoice.value) ui.toolChoice.value = settings.toolChoice = "auto";
ui.effort.addEventListener("change", () => { settings.effort = ui.effort.value; saveSettings(); });
for (const name of ["web", "python"]) {
  ui[name].addEventListener("change", () => {
    settings[name] = ui[name].checked;
    // A tool that is switched off can no longer be the one forced.
    if (!settings[name] && FORCED_TOOLS[settings.toolChoice] === name) setToolChoice("auto");
    saveSettings();
  });
}
ui.toolChoice.addEventListener("change", () => setToolChoice(ui.toolChoice.value));

/** Choose how the model must use tools; forcing a built-in tool switches it on. */
function setToolChoice(choice) {
  settings.toolChoice = ui.toolChoice.value = choice;
  const toggle = FORCED_TOOLS[choice];
  if (toggle) settings[toggle] = ui[toggle].checked = true;
  saveSettings();
}

function requestTools() {
  const tools = [];
  if (settings.web) tools.push({ type: "web_search_preview" });
  if (settings.python) tools.push({ type: "code_interpreter", container: { type: "auto" } });
  if (settings.extraTools.trim()) tools.push(...JSON.parse(settings.extraTools));
  return tools;
}

/** The request's `tool_choice`: none for "auto" (the server's default). */
function requestToolChoice() {
  if (FORCED_TOOLS[settings.toolChoice]) return { type: settings.toolChoice };
  return settings.toolChoice === "required" ? "required" : null;
}

// --- the API key dialog ------------------------------------------------------------------------

function askForKey(message) {
  return new Promise((resolve) => {
    ui.keyMessage.textContent = message;
    ui.keyInput.value = "";
    const finish = (value) => {
      ui.keySave.removeEventListener("click", save);
      ui.keyCancel.removeEventListener("click", cancel);
      ui.keyDialog.removeEventListener("cancel", cancel);
      ui.keyInput.removeEventListener("keydown", enter);
      ui.keyDialog.close();
      resolve(value);
    };
    const save = (event) => {
      event.preventDefault();
      if (ui.keyInput.value.trim()) finish(ui.keyInput.value.trim());
    };
    const cancel = (event) => {
      event.preventDefault();
      finish(null);
    };
    const enter = (event) => { if (event.key === "Enter") save(event); };
    ui.keySave.addEventListener("click", save);
    ui.keyCancel.addEventListener("click", cancel);
    ui.keyDialog.addEventListener("cancel", cancel);
    ui.keyInput.addEventListener("keydown", enter);
    ui.keyDialog.showModal();
    ui.keyInput.focus();
  });
}

const api = new ApiClient(askForKey);

// --- the settings dialog -----------------------------------------------------------------------

ui.settingsButton.addEventListener("click", () => {
  ui.settingsKey.value = api.key;
  ui.settingsInstructions.value = settings.instructions;
  ui.settingsMaxTokens.value = settings.maxOutputTokens;
  ui.settingsTools.value = settings.extraTools;
  ui.settingsError.textContent = "";
  ui.settingsDialog.showModal();
});
ui.settingsCancel.addEventListener("click", (event) => {
  event.preventDefault();
  ui.settingsDialog.close();
});
ui.settingsSave.addEventListener("click", (event) => {
  event.preventDefault();
  const tools = ui.settingsTools.value.trim();
  if (tools) {
    try {
      if (!Array.isArray(JSON.parse(tools))) throw new Error("it is not a JSON array");
    } catch (e) {
      ui.settingsError.textContent = `Extra tools must be a JSON array of tool objects: ${e.message}`;
      return;
    }
  }
  const maxTokens = ui.settingsMaxTokens.value.trim();
  if (maxTokens && !(Number.isInteger(Number(maxTokens)) && Number(maxTokens) > 0)) {
    ui.settingsError.textContent = "Max output tokens must be a positive whole number.";
    return;
  }
  api.key = ui.settingsKey.value.trim();
  settings.instructions = ui.settingsInstructions.value;
  settings.maxOutputTokens = maxTokens;
  settings.extraTools = tools;
  saveSettings();
  ui.settingsDialog.close();
  loadModel();
});

// --- the model ---------------------------------------------------------------------------------

let model = null;

async function loadModel() {
  try {
    const response = await api.fetch("v1/models");
    if (!response) {
      ui.model.textContent = "API key needed";
      return null;
    }
    if (!response.ok) throw new Error(await errorMessage(response));
    const body = await response.json();
    const card = body.data[0];
    model = card.id;
    ui.model.textContent = model;
    ui.model.title = card.context_length ? `context ${card.context_length} tokens` : "";
    showNotice(card);
    return model;
  } catch (e) {
    ui.model.textContent = "server unreachable";
    ui.model.title = String(e.message || e);
    return null;
  }
}

/** What the server says about its model: a random-weight one writes noise, and is cut short. */
function showNotice(card) {
  ui.notice.hidden = !card.random_weights;
  if (!card.random_weights) return;
  const limit = card.default_max_output_tokens;
  ui.notice.replaceChildren(
    `${card.id} has random weights: it writes noise, not answers`,
    limit ? `, and stops after ${limit} tokens unless Settings sets a limit. ` : ". ",
    "To watch it use a tool, pick one under Tools, below the message box. ",
    "For real answers, restart the server with ",
    el("code", null, "--model"),
    " and a gpt-oss checkpoint (see the README).",
  );
}

// --- the conversation --------------------------------------------------------------------------

const conversation = {
  previousResponseId: null, // the last response that can be continued (completed or incomplete)
  controller: null,
  turn: null,
  // The function calls the response at previousResponseId ended in: until a response answers
  // them, every request sends their outputs (the server continues such a response only so).
  pendingCalls: [],
};

function setBusy(busy) {
  document.body.dataset.busy = busy ? "true" : "false";
  ui.log.setAttribute("aria-busy", busy ? "true" : "false");
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  ui.input.placeholder = busy ? "Generating… (Stop to interrupt)" : "Message the agent…";
}

function nearBottom() {
  return ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 120;
}

function followStream(stick) {
  if (stick) ui.log.scrollTop = ui.log.scrollHeight;
}

function addUserBubble(text, className = "") {
  ui.empty.hidden = true;
  const turn = el("section", `turn user ${className}`.trim());
  turn.appendChild(el("div", "bubble", text));
  ui.log.appendChild(turn);
  return turn;
}

/** Send one request (a user message or function outputs) and stream its answer in. */
async function send(input, { label, labelClass } = {}) {
  if (conversation.controller) return;
  let tools;
  try {
    tools = requestTools();
  } catch (e) {
    addUserBubble(label ?? input);
    new AssistantTurn(ui.log).fail(`The extra tools in Settings are not valid JSON: ${e.message}`);
    return;
  }
  addUserBubble(label ?? input, labelClass);
  const turn = new AssistantTurn(ui.log, { limitSet: Boolean(settings.maxOutputTokens) });
  followStream(true);
  const controller = new AbortController();
  conversation.controller = controller;
  conversation.turn = turn;
  setBusy(true);
  try {
    const chosenModel = model || (await loadModel()) || "gpt-oss";
    const body = {
      model: chosenModel,
      input,
      stream: true,
      store: true,
      reasoning: { effort: settings.effort },
      include: INCLUDE,
    };
    if (tools.length) body.tools = tools;
    const toolChoice = requestToolChoice();
    if (toolChoice) body.tool_choice = toolChoice;
    if (settings.instructions.trim()) body.instructions = settings.instructions;
    if (settings.maxOutputTokens) body.max_output_tokens = Number(settings.maxOutputTokens);
    if (conversation.previousResponseId) body.previous_response_id = conversation.previousResponseId;
    const response = await api.fetch("v1/responses", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (response === null) {
      turn.fail("No API key was given, so nothing was sent.");
      return;
    }
    if (!response.ok) {
      turn.fail(await errorMessage(response));
      return;
    }
    for await (const event of serverSentEvents(response)) {
      const stick = nearBottom();
      turn.handle(event);
      followStream(stick);
      // The response has ended: the server may still be closing tool sessions and storing it
      // before it closes the stream, but the page need not wait (nor can a Stop undo it).
      if (turn.state !== "streaming") break;
    }
    if (turn.state === "streaming") turn.fail("The connection closed before the response finished.");
  } catch (e) {
    if (controller.signal.aborted) {
      if (turn.state === "streaming") turn.stop();
    }
    else turn.fail(`Request failed: ${e.message || e}`);
  } finally {
    conversation.controller = null;
    setBusy(false);
    if (turn.response && ["completed", "incomplete"].includes(turn.state)) {
      conversation.previousResponseId = turn.response.id;
      conversation.pendingCalls = [];
    }
    offerFunctionOutputs(turn);
    followStream(nearBottom());
    ui.input.focus();
  }
}

/** A turn that ends in function calls waits for their outputs, typed in by the user. */
function offerFunctionOutputs(turn) {
  const calls = turn.pendingFunctionCalls();
  if (!calls.length) return;
  for (const { view } of calls) view.askForOutput();
  const button = el("button", "primary small", calls.length > 1 ? "Send outputs" : "Send output");
  button.type = "button";
  const bar = el("div", "function-bar");
  bar.appendChild(button);
  turn.items.appendChild(bar);
  conversation.pendingCalls = calls;
  button.addEventListener("click", () => {
    if (conversation.controller) return;
    const outputs = pendingOutputs("");
    bar.remove();
    send(outputs, {
      label: conversation.pendingCalls.map(({ item }, i) => `${item.name} → ${outputs[i].output}`).join("\n"),
      labelClass: "tool-output",
    });
  });
}

/** The pending calls' outputs as input items: what their boxes hold (or `fallback`), shown as sent. */
function pendingOutputs(fallback) {
  return conversation.pendingCalls.map(({ item, view }) => {
    const output = view.outputBox ? view.outputBox.value || fallback : view.output;
    if (view.outputBox) view.setOutput(output);
    return { type: "function_call_output", call_id: item.call_id, output };
  });
}

/** A typed message; after unanswered function calls, it goes with their outputs. */
function sendMessage(text) {
  if (!conversation.pendingCalls.length) return send(text);
  const outputs = pendingOutputs("(no output: the user wrote a message instead)");
  for (const bar of ui.log.querySelectorAll(".function-bar")) bar.remove();
  return send([...outputs, { role: "user", content: text }], { label: text });
}

function stop() {
  conversation.controller?.abort();
}

function newChat() {
  stop();
  conversation.previousResponseId = null;
  conversation.pendingCalls = [];
  for (const turn of [...ui.log.querySelectorAll(".turn")]) turn.remove();
  ui.empty.hidden = false;
  ui.input.focus();
}

// --- the composer ------------------------------------------------------------------------------

function autosize() {
  ui.input.style.height = "auto";
  ui.input.style.height = `${Math.min(ui.input.scrollHeight, 240)}px`;
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.input.value.trim();
  if (!text || conversation.controller) return;
  ui.input.value = "";
  autosize();
  sendMessage(text);
});
ui.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.form.requestSubmit();
  }
});
ui.input.addEventListener("input", autosize);
ui.stop.addEventListener("click", stop);
ui.newChat.addEventListener("click", newChat);
for (const chip of document.querySelectorAll("[data-suggestion]")) {
  chip.addEventListener("click", () => {
    // (a suggestion to use a tool makes it the model's first step: even a random model takes it)
    if (chip.dataset.toolChoice) setToolChoice(chip.dataset.toolChoice);
    ui.input.value = chip.dataset.suggestion;
    autosize();
    ui.input.focus();
  });
}
document.addEventListener("keydown", (event) => {
  // An Esc that closes a dialog (Settings, the key prompt) is that dialog's, not a Stop.
  if (event.key === "Escape" && conversation.controller && !document.querySelector("dialog[open]")) stop();
});

setBusy(false);
loadModel();
ui.input.focus();
document.body.dataset.ready = "true";
