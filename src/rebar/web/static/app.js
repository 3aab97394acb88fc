// Built from web/ by `npm --prefix web run build`; edit the sources there, not this file.

// src/answer_stats.ts
function answerStats(answer2) {
  const { firstTokenAt, lastTokenAt, numTokens } = answer2;
  const ttftMs = firstTokenAt === null ? null : firstTokenAt - answer2.startedAt;
  let tokensPerSecond = null;
  if (firstTokenAt !== null && lastTokenAt !== null && lastTokenAt > firstTokenAt && numTokens > 1) {
    tokensPerSecond = (numTokens - 1) * 1e3 / (lastTokenAt - firstTokenAt);
  }
  return { ttftMs, tokensPerSecond, numTokens };
}
function formatStats(stats) {
  const parts = [];
  if (stats.ttftMs !== null) {
    parts.push(`first token ${(stats.ttftMs / 1e3).toFixed(2)} s`);
  }
  if (stats.tokensPerSecond !== null) {
    parts.push(`${stats.tokensPerSecond.toFixed(1)} tokens/s`);
  }
  parts.push(`${stats.numTokens} ${stats.numTokens === 1 ? "token" : "tokens"}`);
  return parts.join(" · ");
}

// src/http.ts
function requestHeaders(apiKey, requestId) {
  const headers = { "X-Request-ID": requestId };
  if (apiKey.trim() !== "") {
    headers["Authorization"] = `Bearer ${apiKey.trim()}`;
  }
  return headers;
}
async function errorMessage(response) {
  const fallback = `HTTP ${response.status}${response.statusText ? " " + response.statusText : ""}`;
  let body;
  try {
    body = await response.json();
  } catch {
    return fallback;
  }
  if (typeof body === "object" && body !== null && "error" in body) {
    const error = body.error;
    if (typeof error === "object" && error !== null && "message" in error && typeof error.message === "string") {
      return error.message;
    }
  }
  return fallback;
}
var RequestError = class extends Error {
  constructor(message, requestId, status) {
    super(message);
    this.requestId = requestId;
    this.status = status;
    this.name = "RequestError";
  }
  requestId;
  status;
};

// src/retry.ts
var DEFAULT_RETRY_POLICY = {
  maxAttempts: 4,
  baseDelayMs: 500,
  maxDelayMs: 8e3,
  maxRetryAfterMs: 12e4
};
function parseRetryAfter(value, nowMs) {
  if (value === null) {
    return null;
  }
  const text = value.trim();
  if (/^\d+$/.test(text)) {
    return Number(text) * 1e3;
  }
  const date = Date.parse(text);
  if (Number.isNaN(date) || !/[a-z]/i.test(text)) {
    return null;
  }
  return Math.max(0, date - nowMs);
}
function backoffDelayMs(numFailed, policy, random) {
  const ceiling = Math.min(policy.maxDelayMs, policy.baseDelayMs * 2 ** Math.max(0, numFailed - 1));
  return Math.round(ceiling / 2 + random() * (ceiling / 2));
}
function decideRetry(failure, numFailed, policy, random, nowMs) {
  if (!isRetryable(failure)) {
    return { retry: false, reason: "not retryable" };
  }
  if (numFailed >= policy.maxAttempts) {
    return { retry: false, reason: `gave up after ${numFailed} tries` };
  }
  const backoff = backoffDelayMs(numFailed, policy, random);
  if (failure.kind === "network") {
    return { retry: true, delayMs: backoff };
  }
  const retryAfter = parseRetryAfter(failure.retryAfter, nowMs);
  if (retryAfter !== null && retryAfter > policy.maxRetryAfterMs) {
    return { retry: false, reason: `the server asks to wait ${Math.ceil(retryAfter / 1e3)} s` };
  }
  if (failure.status === 429) {
    return { retry: true, delayMs: retryAfter ?? backoff };
  }
  return { retry: true, delayMs: Math.max(backoff, retryAfter ?? 0) };
}
function isRetryable(failure) {
  return failure.kind === "network" || failure.status === 429 || failure.status === 503 || failure.status === 504;
}
function describeFailure(failure) {
  if (failure.kind === "network") {
    return "Connection lost";
  }
  switch (failure.status) {
    case 429:
      return "Rate limited";
    case 503:
      return "Server busy";
    case 504:
      return "Gateway timed out";
    default:
      return `HTTP ${failure.status}`;
  }
}

// src/sse.ts
var LINE_BREAK = /\r\n|\r|\n/;
var SSEParser = class {
  // `stream: true` keeps a partial UTF-8 sequence until the next chunk completes it.
  decoder = new TextDecoder("utf-8");
  partialLine = "";
  // A chunk ended in "\r": a "\n" opening the next chunk is the rest of that line break.
  endedWithCR = false;
  dataLines = [];
  eventType = "";
  lastEventId = null;
  /** The messages completed by `chunk`, in order. */
  push(chunk) {
    return this.feed(this.decoder.decode(chunk, { stream: true }));
  }
  /**
   * Flush at the end of the body. Per the specification an event without its closing blank line
   * is dropped, so a truncated stream never yields a half-received event.
   */
  end() {
    const messages = this.feed(this.decoder.decode());
    this.partialLine = "";
    this.dataLines = [];
    this.eventType = "";
    return messages;
  }
  feed(text) {
    if (this.endedWithCR && text.length > 0) {
      this.endedWithCR = false;
      if (text.startsWith("\n")) {
        text = text.slice(1);
      }
    }
    if (text.endsWith("\r")) {
      this.endedWithCR = true;
    }
    const lines = (this.partialLine + text).split(LINE_BREAK);
    this.partialLine = lines.pop() ?? "";
    const messages = [];
    for (const line of lines) {
      const message = this.processLine(line);
      if (message !== null) {
        messages.push(message);
      }
    }
    return messages;
  }
  processLine(line) {
    if (line === "") {
      return this.dispatch();
    }
    if (line.startsWith(":")) {
      return { kind: "comment", text: withoutLeadingSpace(line.slice(1)) };
    }
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    const value = colon === -1 ? "" : withoutLeadingSpace(line.slice(colon + 1));
    if (field === "data") {
      this.dataLines.push(value);
    } else if (field === "event") {
      this.eventType = value;
    } else if (field === "id" && !value.includes("\0")) {
      this.lastEventId = value;
    }
    return null;
  }
  dispatch() {
    const dataLines = this.dataLines;
    const eventType = this.eventType;
    this.dataLines = [];
    this.eventType = "";
    if (dataLines.length === 0) {
      return null;
    }
    return { kind: "event", event: eventType || "message", data: dataLines.join("\n"), id: this.lastEventId };
  }
};
function withoutLeadingSpace(value) {
  return value.startsWith(" ") ? value.slice(1) : value;
}

// src/tool_calls.ts
function mergeToolCallDeltas(calls, deltas) {
  if (!Array.isArray(deltas)) {
    return calls;
  }
  let merged = calls;
  for (const delta of deltas) {
    if (isRecord(delta)) {
      merged = mergeOne(merged, delta);
    }
  }
  return merged;
}
function mergeOne(calls, delta) {
  const fn = isRecord(delta["function"]) ? delta["function"] : {};
  const id = stringOr(delta["id"], "");
  const last = calls[calls.length - 1];
  const startsNext = last === void 0 || id !== "" && id !== last.id;
  const index = typeof delta["index"] === "number" ? delta["index"] : startsNext ? calls.length : last.index;
  const call = calls.find((c) => c.index === index) ?? { index, id: "", name: "", arguments: "" };
  const next = {
    index,
    // As OpenAI's SDK merges them: a name or id that comes again replaces it, arguments add up.
    id: id || call.id,
    name: stringOr(fn["name"], "") || call.name,
    arguments: call.arguments + stringOr(fn["arguments"], "")
  };
  return [...calls.filter((c) => c.index !== index), next].sort((a, b) => a.index - b.index);
}
function formatArguments(text) {
  let value;
  try {
    value = JSON.parse(text);
  } catch {
    return text;
  }
  return typeof value === "object" && value !== null ? JSON.stringify(value, null, 2) : text;
}
function isRecord(value) {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}
function stringOr(value, fallback) {
  return typeof value === "string" ? value : fallback;
}

// src/chat_stream.ts
var TryFailed = class extends Error {
  constructor(failure, message) {
    super(message);
    this.failure = failure;
  }
  failure;
};
async function streamChat(request, observer, signal, policy, deps) {
  for (let attempt = 1; ; attempt++) {
    const requestId = deps.newRequestId();
    const startedAt = deps.now();
    const state = newTryState();
    observer.onAttempt(attempt, requestId);
    try {
      await runTry(request, requestId, state, observer, signal, deps);
      return answer(state, requestId, attempt, startedAt, false);
    } catch (error) {
      if (signal.aborted) {
        return answer(state, requestId, attempt, startedAt, true);
      }
      if (!(error instanceof TryFailed)) {
        throw error;
      }
      const decision = decideRetry(error.failure, attempt, policy, deps.random, deps.wallClock());
      if (!decision.retry) {
        const status = error.failure.kind === "http" ? error.failure.status : null;
        const suffix = attempt > 1 ? ` (after ${attempt} tries)` : "";
        throw new RequestError(error.message + suffix, requestId, status);
      }
      observer.onRetry({
        failure: error.failure,
        reason: describeFailure(error.failure),
        nextAttempt: attempt + 1,
        maxAttempts: policy.maxAttempts,
        delayMs: decision.delayMs,
        failedRequestId: requestId
      });
      await deps.sleep(decision.delayMs, signal);
      if (signal.aborted) {
        return answer(state, requestId, attempt, startedAt, true);
      }
    }
  }
}
function newTryState() {
  return {
    text: "",
    reasoning: "",
    toolCalls: [],
    finishReason: null,
    firstTokenAt: null,
    lastTokenAt: null,
    numOutputChunks: 0,
    usageTokens: null,
    done: false
  };
}
function answer(state, requestId, attempt, startedAt, stopped) {
  return {
    text: state.text,
    reasoning: state.reasoning,
    toolCalls: state.toolCalls,
    finishReason: state.finishReason,
    stopped,
    requestId,
    attempt,
    startedAt,
    firstTokenAt: state.firstTokenAt,
    lastTokenAt: state.lastTokenAt,
    numTokens: state.usageTokens ?? state.numOutputChunks
  };
}
async function runTry(request, requestId, state, observer, signal, deps) {
  let response;
  try {
    response = await deps.fetch(request.endpoint, {
      method: "POST",
      headers: {
        ...requestHeaders(request.apiKey, requestId),
        "Content-Type": "application/json",
        Accept: "text/event-stream"
      },
      body: JSON.stringify(requestBody(request)),
      signal
    });
  } catch (error) {
    throw new TryFailed({ kind: "network" }, `Could not reach the server: ${messageOf(error)}`);
  }
  if (!response.ok) {
    const failure = { kind: "http", status: response.status, retryAfter: response.headers.get("Retry-After") };
    throw new TryFailed(failure, `${response.status}: ${await errorMessage(response)}`);
  }
  if (response.body === null) {
    throw new RequestError("The server sent an empty response", requestId, response.status);
  }
  await readEvents(response.body, requestId, state, observer, deps);
}
function requestBody(request) {
  return {
    model: request.model,
    messages: request.messages,
    temperature: request.temperature,
    max_tokens: request.maxTokens,
    stream: true,
    stream_options: { include_usage: true }
  };
}
async function readEvents(body, requestId, state, observer, deps) {
  const reader = body.getReader();
  const parser = new SSEParser();
  try {
    for (; ; ) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (error) {
        throw new TryFailed({ kind: "network" }, `The connection broke mid-answer: ${messageOf(error)}`);
      }
      const messages = chunk.done ? parser.end() : parser.push(chunk.value);
      for (const message of messages) {
        if (message.kind === "event") {
          applyEvent(message.data, requestId, state, observer, deps);
        }
      }
      if (state.done) {
        return;
      }
      if (chunk.done) {
        throw new TryFailed({ kind: "network" }, "The stream ended before the answer was complete");
      }
    }
  } finally {
    reader.releaseLock();
  }
}
function applyEvent(data, requestId, state, observer, deps) {
  if (data === "[DONE]") {
    state.done = true;
    return;
  }
  let chunk;
  try {
    chunk = JSON.parse(data);
  } catch {
    throw new RequestError("The server sent an event that is not JSON", requestId, null);
  }
  if (chunk.error !== void 0) {
    throw new RequestError(chunk.error.message ?? "The server reported an error mid-stream", requestId, null);
  }
  if (typeof chunk.usage?.completion_tokens === "number") {
    state.usageTokens = chunk.usage.completion_tokens;
  }
  const choice = chunk.choices?.[0];
  if (applyDelta(choice?.delta ?? {}, state)) {
    const now = deps.now();
    state.firstTokenAt ??= now;
    state.lastTokenAt = now;
    state.numOutputChunks += 1;
    observer.onOutput({ text: state.text, reasoning: state.reasoning, toolCalls: state.toolCalls });
  }
  if (choice?.finish_reason) {
    state.finishReason = choice.finish_reason;
  }
}
function applyDelta(delta, state) {
  const { reasoning_content: reasoning, content } = delta;
  let grew = false;
  if (typeof reasoning === "string" && reasoning !== "") {
    state.reasoning += reasoning;
    grew = true;
  }
  if (typeof content === "string" && content !== "") {
    state.text += content;
    grew = true;
  }
  const toolCalls = mergeToolCallDeltas(state.toolCalls, delta.tool_calls);
  if (toolCalls !== state.toolCalls) {
    state.toolCalls = toolCalls;
    grew = true;
  }
  return grew;
}
function messageOf(error) {
  return error instanceof Error ? error.message : String(error);
}

// src/handed_key.ts
function keyFromFragment(hash) {
  const params = new URLSearchParams(hash.startsWith("#") ? hash.slice(1) : hash);
  const key = params.get("key")?.trim() ?? "";
  return key === "" || /\s/.test(key) ? null : key;
}
function takeHandedKey(location, history) {
  const key = keyFromFragment(location.hash);
  if (key !== null) {
    history.replaceState(history.state, "", location.pathname + location.search);
  }
  return key;
}

// src/models.ts
async function listModels(endpoint, apiKey, requestId) {
  let response;
  try {
    response = await fetch(endpoint, { headers: requestHeaders(apiKey, requestId) });
  } catch (error) {
    throw new RequestError(`Could not reach the server: ${error instanceof Error ? error.message : String(error)}`, requestId, null);
  }
  if (!response.ok) {
    throw new RequestError(await errorMessage(response), requestId, response.status);
  }
  let body;
  try {
    body = await response.json();
  } catch {
    throw new RequestError("The model list is not JSON", requestId, response.status);
  }
  return (body.data ?? []).flatMap((model) => typeof model.id === "string" ? [model.id] : []);
}
function pickModel(available, saved) {
  return available.includes(saved) ? saved : available[0] ?? "";
}

// src/request_id.ts
function newRequestId() {
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return "web-" + Array.from(bytes, (byte) => byte.toString(16).padStart(2, "0")).join("");
}

// src/storage.ts
var DEFAULT_SETTINGS = { model: "", systemPrompt: "", temperature: 0.7, maxTokens: 256 };
var KEYS = { settings: "rebar.chat.settings", apiKey: "rebar.chat.apiKey", conversation: "rebar.chat.conversation" };
var ChatStorage = class {
  constructor(storage) {
    this.storage = storage;
  }
  storage;
  loadSettings() {
    const raw = this.readJson(KEYS.settings);
    if (!isRecord2(raw)) {
      return DEFAULT_SETTINGS;
    }
    return {
      model: typeof raw["model"] === "string" ? raw["model"] : DEFAULT_SETTINGS.model,
      systemPrompt: typeof raw["systemPrompt"] === "string" ? raw["systemPrompt"] : DEFAULT_SETTINGS.systemPrompt,
      temperature: finiteOr(raw["temperature"], DEFAULT_SETTINGS.temperature),
      maxTokens: finiteOr(raw["maxTokens"], DEFAULT_SETTINGS.maxTokens)
    };
  }
  saveSettings(settings) {
    this.write(KEYS.settings, JSON.stringify(settings));
  }
  loadApiKey() {
    return this.read(KEYS.apiKey) ?? "";
  }
  saveApiKey(apiKey) {
    this.write(KEYS.apiKey, apiKey);
  }
  loadConversation() {
    const raw = this.readJson(KEYS.conversation);
    return Array.isArray(raw) ? raw.flatMap((item) => turnFrom(item) ?? []) : [];
  }
  saveConversation(turns) {
    this.write(KEYS.conversation, JSON.stringify(turns));
  }
  read(key) {
    try {
      return this.storage.getItem(key);
    } catch {
      return null;
    }
  }
  readJson(key) {
    const text = this.read(key);
    if (text === null) {
      return null;
    }
    try {
      return JSON.parse(text);
    } catch {
      return null;
    }
  }
  write(key, value) {
    try {
      this.storage.setItem(key, value);
    } catch {
    }
  }
};
function isRecord2(value) {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}
function finiteOr(value, fallback) {
  return typeof value === "number" && Number.isFinite(value) ? value : fallback;
}
function turnFrom(value) {
  if (!isRecord2(value)) {
    return null;
  }
  const { role, content, note, error } = value;
  const errorOk = error === null || isRecord2(error) && typeof error["message"] === "string" && typeof error["requestId"] === "string";
  if (role !== "user" && role !== "assistant" || typeof content !== "string" || typeof note !== "string" || !errorOk) {
    return null;
  }
  const reasoning = typeof value["reasoning"] === "string" ? value["reasoning"] : "";
  const toolCalls = Array.isArray(value["toolCalls"]) ? value["toolCalls"].filter(isToolCall) : [];
  return { role, content, reasoning, toolCalls, note, error };
}
function isToolCall(value) {
  return isRecord2(value) && typeof value["index"] === "number" && typeof value["id"] === "string" && typeof value["name"] === "string" && typeof value["arguments"] === "string";
}

// src/view.ts
var SPEAKERS = { user: "You", assistant: "Assistant" };
var TurnView = class {
  element;
  reasoning;
  reasoningText;
  content;
  toolCalls;
  callBlocks = [];
  note;
  error;
  constructor(role) {
    this.element = element("article", `turn ${role}`);
    this.element.setAttribute("aria-label", SPEAKERS[role]);
    const speaker = element("h2", "speaker");
    speaker.textContent = SPEAKERS[role];
    this.reasoning = document.createElement("details");
    this.reasoning.className = "reasoning";
    const summary = element("summary", "");
    summary.textContent = "Reasoning";
    this.reasoningText = element("div", "reasoning-text");
    this.reasoning.append(summary, this.reasoningText);
    this.content = element("div", "content");
    this.toolCalls = element("div", "tool-calls");
    this.note = element("p", "note");
    this.error = element("p", "error");
    this.reasoning.hidden = true;
    this.toolCalls.hidden = true;
    this.note.hidden = true;
    this.error.hidden = true;
    this.element.append(speaker, this.reasoning, this.content, this.toolCalls, this.note, this.error);
  }
  /** Everything a turn shows: its output, note and error. */
  showTurn(turn) {
    this.setOutput({ text: turn.content, reasoning: turn.reasoning, toolCalls: turn.toolCalls });
    this.setNote(turn.note);
    this.setError(turn.error);
  }
  setOutput(output) {
    this.reasoningText.textContent = output.reasoning;
    this.reasoning.hidden = output.reasoning === "";
    this.content.textContent = output.text;
    this.setToolCalls(output.toolCalls);
  }
  /** While true, screen readers wait for the answer instead of reading every token. */
  setStreaming(streaming) {
    this.element.setAttribute("aria-busy", String(streaming));
    this.element.classList.toggle("streaming", streaming);
  }
  /** Marks output left by a failed try, shown until the next try's output replaces it. */
  setStale(stale) {
    this.element.classList.toggle("stale", stale);
  }
  setNote(note) {
    this.note.textContent = note;
    this.note.hidden = note === "";
  }
  setError(error) {
    this.error.replaceChildren();
    this.error.hidden = error === null;
    this.error.setAttribute("role", error === null ? "none" : "alert");
    if (error !== null) {
      const id = element("code", "request-id");
      id.textContent = error.requestId;
      this.error.append(`${error.message} — request id `, id);
    }
  }
  /** One block per call, kept from update to update and rewritten as its arguments grow. */
  setToolCalls(calls) {
    this.callBlocks.splice(calls.length).forEach((block) => block.element.remove());
    calls.forEach((call, i) => {
      let block = this.callBlocks[i];
      if (block === void 0) {
        block = new ToolCallBlock();
        this.callBlocks.push(block);
        this.toolCalls.append(block.element);
      }
      block.show(call);
    });
    this.toolCalls.hidden = calls.length === 0;
  }
};
var ConversationView = class {
  constructor(container) {
    this.container = container;
  }
  container;
  show(turns) {
    this.container.replaceChildren();
    for (const turn of turns) {
      this.append(turn.role).showTurn(turn);
    }
    this.scrollToEnd(true);
  }
  append(role) {
    const view = new TurnView(role);
    this.container.append(view.element);
    return view;
  }
  /** Follow a growing answer, unless the reader has scrolled up to read something else. */
  scrollToEnd(force = false) {
    const c = this.container;
    const nearEnd = c.scrollHeight - c.scrollTop - c.clientHeight < 80;
    if (force || nearEnd) {
      c.scrollTop = c.scrollHeight;
    }
  }
};
var StatusLine = class {
  constructor(line) {
    this.line = line;
  }
  line;
  timer = null;
  show(text, kind = "info") {
    this.stopCountdown();
    this.line.textContent = text;
    this.line.dataset["kind"] = kind;
  }
  /** `render(seconds)` every second until `delayMs` has passed (or the next `show`/`clear`). */
  countdown(delayMs, render) {
    const endsAt = Date.now() + delayMs;
    const tick = () => {
      this.line.textContent = render(Math.max(0, Math.ceil((endsAt - Date.now()) / 1e3)));
    };
    this.show("");
    tick();
    this.timer = setInterval(tick, 250);
  }
  clear() {
    this.show("");
  }
  stopCountdown() {
    if (this.timer !== null) {
      clearInterval(this.timer);
      this.timer = null;
    }
  }
};
var ToolCallBlock = class {
  element = element("section", "tool-call");
  name = element("code", "tool-name");
  arguments = element("pre", "tool-arguments");
  constructor() {
    const heading = element("p", "tool-call-heading");
    heading.append("Tool call ", this.name);
    this.element.append(heading, this.arguments);
  }
  show(call) {
    this.name.textContent = call.name;
    this.arguments.textContent = formatArguments(call.arguments);
  }
};
function element(tag, className) {
  const node = document.createElement(tag);
  node.className = className;
  return node;
}

// src/chat_page.ts
var CHAT_ENDPOINT = "/v1/chat/completions";
var MODELS_ENDPOINT = "/v1/models";
var MODELS_RETRY_MS = 2e3;
var NO_OUTPUT = { text: "", reasoning: "", toolCalls: [] };
var ChatPage = class {
  constructor(el) {
    this.el = el;
    this.conversation = new ConversationView(el.conversation);
    this.status = new StatusLine(el.status);
    this.turns = this.storage.loadConversation();
  }
  el;
  storage = new ChatStorage(window.localStorage);
  conversation;
  status;
  turns;
  inFlight = null;
  modelsRetry = null;
  // The model chosen last time, selected again once the server lists it.
  savedModel = "";
  start() {
    this.showSettings(this.storage.loadSettings());
    this.el.apiKey.value = takeHandedKey(window.location, window.history) ?? this.storage.loadApiKey();
    this.conversation.show(this.turns);
    this.listen();
    void this.loadModels();
    this.el.prompt.focus();
  }
  listen() {
    const el = this.el;
    el.composer.addEventListener("submit", (event) => {
      event.preventDefault();
      void this.send();
    });
    el.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        el.composer.requestSubmit();
      } else if (event.key === "Escape" && this.inFlight !== null) {
        this.stop();
      }
    });
    el.stop.addEventListener("click", () => this.stop());
    el.newChat.addEventListener("click", () => this.newChat());
    for (const input of [el.model, el.systemPrompt, el.temperature, el.maxTokens]) {
      input.addEventListener("change", () => this.storage.saveSettings(this.readSettings()));
    }
    el.apiKey.addEventListener("change", () => {
      this.storage.saveApiKey(el.apiKey.value.trim());
      void this.loadModels();
    });
    window.addEventListener("pagehide", () => this.storage.saveConversation(this.turnsWithInFlight()));
  }
  async send() {
    const text = this.el.prompt.value.trim();
    if (text === "" || this.inFlight !== null) {
      return;
    }
    const settings = this.readSettings();
    if (settings.model === "") {
      this.status.show("No model to send to yet: the server has not listed one.", "error");
      return;
    }
    this.addTurn({ role: "user", content: text, reasoning: "", toolCalls: [], note: "", error: null });
    this.el.prompt.value = "";
    this.el.prompt.focus();
    const view = this.conversation.append("assistant");
    const flight = { view, controller: new AbortController(), shown: NO_OUTPUT };
    this.inFlight = flight;
    this.setBusy(true);
    view.setStreaming(true);
    this.conversation.scrollToEnd(true);
    const request = {
      endpoint: CHAT_ENDPOINT,
      apiKey: this.el.apiKey.value,
      model: settings.model,
      messages: this.messagesFor(settings),
      temperature: settings.temperature,
      maxTokens: settings.maxTokens
    };
    let turn;
    try {
      const answer2 = await streamChat(request, this.observerFor(flight), flight.controller.signal, DEFAULT_RETRY_POLICY, browserDeps());
      turn = this.finishedTurn(flight, answer2);
    } catch (error) {
      turn = this.failedTurn(flight, error);
    }
    view.setStreaming(false);
    view.setStale(false);
    view.showTurn(turn);
    this.inFlight = null;
    this.turns.push(turn);
    this.storage.saveConversation(this.turns);
    this.setBusy(false);
    this.el.prompt.focus();
  }
  observerFor(flight) {
    return {
      onAttempt: (attempt) => {
        if (attempt > 1) {
          this.status.show(`Trying again (try ${attempt} of ${DEFAULT_RETRY_POLICY.maxAttempts})…`);
        }
      },
      onOutput: (output) => {
        flight.shown = output;
        flight.view.setOutput(output);
        flight.view.setStale(false);
        this.conversation.scrollToEnd();
      },
      onRetry: (notice) => {
        flight.view.setStale(hasOutput(flight.shown));
        this.status.countdown(
          notice.delayMs,
          (seconds) => `${notice.reason} (request id ${notice.failedRequestId}); trying again in ${seconds} s (try ${notice.nextAttempt} of ${notice.maxAttempts})…`
        );
      }
    };
  }
  finishedTurn(flight, answer2) {
    const parts = [formatStats(answerStats(answer2))];
    if (answer2.finishReason === "length") {
      parts.push("max tokens reached");
    }
    if (answer2.attempt > 1) {
      parts.push(`after ${answer2.attempt} tries`);
    }
    if (answer2.stopped) {
      parts.push("stopped");
      this.status.show("Stopped.");
    } else {
      this.status.clear();
    }
    return { ...assistantTurn(hasOutput(answer2) ? answer2 : flight.shown), note: parts.join(" · ") };
  }
  failedTurn(flight, error) {
    const failure = error instanceof RequestError ? { message: error.message, requestId: error.requestId } : { message: error instanceof Error ? error.message : String(error), requestId: "none" };
    this.status.show(`The request failed (request id ${failure.requestId}).`, "error");
    return { ...assistantTurn(flight.shown), error: failure };
  }
  stop() {
    this.inFlight?.controller.abort();
  }
  newChat() {
    if (this.inFlight !== null) {
      return;
    }
    this.turns = [];
    this.storage.saveConversation(this.turns);
    this.conversation.show(this.turns);
    this.status.clear();
    this.el.prompt.focus();
  }
  addTurn(turn) {
    this.turns.push(turn);
    this.storage.saveConversation(this.turns);
    this.conversation.append(turn.role).showTurn(turn);
  }
  /**
   * The system prompt, then every turn with text: a stopped or partial answer is context too.
   * Reasoning stays out (the server leaves it out of the prompt anyway), and so do tool calls:
   * the page has no tool results to answer them with.
   */
  messagesFor(settings) {
    const messages = [];
    if (settings.systemPrompt.trim() !== "") {
      messages.push({ role: "system", content: settings.systemPrompt });
    }
    for (const turn of this.turns) {
      if (turn.content !== "") {
        messages.push({ role: turn.role, content: turn.content });
      }
    }
    return messages;
  }
  turnsWithInFlight() {
    if (this.inFlight === null || !hasOutput(this.inFlight.shown)) {
      return this.turns;
    }
    return [...this.turns, { ...assistantTurn(this.inFlight.shown), note: "interrupted" }];
  }
  setBusy(busy) {
    this.el.send.disabled = busy;
    this.el.newChat.disabled = busy;
    this.el.stop.disabled = !busy;
  }
  showSettings(settings) {
    this.el.systemPrompt.value = settings.systemPrompt;
    this.el.temperature.value = String(settings.temperature);
    this.el.maxTokens.value = String(settings.maxTokens);
    this.savedModel = settings.model;
  }
  readSettings() {
    const temperature = Number(this.el.temperature.value);
    const maxTokens = Math.round(Number(this.el.maxTokens.value));
    return {
      model: this.el.model.value || this.savedModel,
      systemPrompt: this.el.systemPrompt.value,
      temperature: Number.isFinite(temperature) ? Math.min(2, Math.max(0, temperature)) : DEFAULT_SETTINGS.temperature,
      maxTokens: Number.isFinite(maxTokens) && maxTokens >= 1 ? maxTokens : DEFAULT_SETTINGS.maxTokens
    };
  }
  /** Fill the picker; while the server is still loading (503) or unreachable, ask again shortly. */
  async loadModels() {
    if (this.modelsRetry !== null) {
      clearTimeout(this.modelsRetry);
      this.modelsRetry = null;
    }
    let models;
    try {
      models = await listModels(MODELS_ENDPOINT, this.el.apiKey.value, newRequestId());
    } catch (error) {
      this.reportModelsFailure(error instanceof RequestError ? error : new RequestError(String(error), "none", null));
      return;
    }
    const chosen = pickModel(models, this.readSettings().model);
    this.el.model.replaceChildren(...models.map((id) => new Option(id, id, id === chosen, id === chosen)));
    this.el.model.value = chosen;
    if (this.inFlight === null) {
      this.status.clear();
    }
  }
  reportModelsFailure(error) {
    if (error.status === 401) {
      this.status.show(`The server needs an API key: enter it under Settings (request id ${error.requestId}).`, "error");
      return;
    }
    const waiting = error.status === 503 ? "The server is loading its models" : error.message;
    this.status.show(`${waiting}; asking again shortly (request id ${error.requestId}).`, error.status === 503 ? "info" : "error");
    this.modelsRetry = setTimeout(() => void this.loadModels(), MODELS_RETRY_MS);
  }
};
function hasOutput(output) {
  return output.text !== "" || output.reasoning !== "" || output.toolCalls.length > 0;
}
function assistantTurn(output) {
  const { text, reasoning, toolCalls } = output;
  return { role: "assistant", content: text, reasoning, toolCalls, note: "", error: null };
}
function browserDeps() {
  return {
    fetch: (input, init) => fetch(input, init),
    sleep: abortableSleep,
    random: Math.random,
    now: () => performance.now(),
    wallClock: Date.now,
    newRequestId
  };
}
function abortableSleep(ms, signal) {
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      signal.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal.addEventListener("abort", done, { once: true });
  });
}

// src/document_summary.ts
function emptySummary() {
  return { numChunks: 0, progress: "", requestsDone: 0, sections: [], done: false, cached: false, error: null };
}
function cite(pages) {
  if (pages.length === 0) {
    return "no source found";
  }
  return (pages.length === 1 ? "p. " : "pp. ") + pages.join(", ");
}
function numbers(value) {
  return Array.isArray(value) ? value.filter((n) => typeof n === "number") : [];
}
function currentSection(state) {
  let section = state.sections[state.sections.length - 1];
  if (section === void 0) {
    section = { title: null, pages: [], statements: [] };
    state.sections.push(section);
  }
  return section;
}
function applyEvent2(state, event) {
  const data = JSON.parse(event.data);
  switch (event.event) {
    case "planned":
      state.numChunks = Number(data["num_chunks"] ?? 0);
      state.cached = data["cached"] === true;
      state.progress = state.cached ? "from the cache" : `${state.numChunks} chunk(s)`;
      break;
    case "progress": {
      state.requestsDone += 1;
      const level = data["stage"] === "combine" ? ` (level ${String(data["level"])})` : "";
      state.progress = `${String(data["stage"])}${level} ${String(data["done"])}/${String(data["total"])} (${cite(numbers(data["pages"]))})`;
      break;
    }
    case "section":
      state.sections.push({ title: String(data["title"]), pages: numbers(data["pages"]), statements: [] });
      break;
    case "statement":
      currentSection(state).statements.push({ text: String(data["text"]), pages: numbers(data["pages"]) });
      break;
    case "summary":
      state.done = true;
      state.cached = data["cached"] === true;
      break;
    case "error": {
      const error = data["error"];
      state.error = typeof error?.message === "string" ? error.message : "the summary failed";
      break;
    }
  }
  return state;
}
function summaryText(state) {
  const lines = [];
  for (const section of state.sections) {
    if (section.title !== null) {
      lines.push(`${section.title} (${cite(section.pages)}):`);
    }
    for (const statement of section.statements) {
      lines.push(`- ${statement.text} [${cite(statement.pages)}]`);
    }
  }
  return lines.join("\n");
}
async function readSummary(body, state, onChange) {
  const parser = new SSEParser();
  const reader = body.getReader();
  for (; ; ) {
    const { done, value } = await reader.read();
    const messages = done ? parser.end() : parser.push(value);
    for (const message of messages) {
      if (message.kind === "event") {
        onChange(applyEvent2(state, message));
      }
    }
    if (done) {
      return state;
    }
  }
}

// src/documents_panel.ts
var SUMMARIZE_ENDPOINT = "/v1/documents/summarize";
var DocumentsPanel = class {
  constructor(el) {
    this.el = el;
  }
  el;
  controller = null;
  state = emptySummary();
  fileName = "";
  start() {
    const el = this.el;
    el.summarize.addEventListener("click", () => void this.summarize());
    el.stop.addEventListener("click", () => this.controller?.abort());
    el.ask.addEventListener("click", () => this.askInChat());
    el.dropZone.addEventListener("dragover", (event) => event.preventDefault());
    el.dropZone.addEventListener("drop", (event) => {
      event.preventDefault();
      if (event.dataTransfer !== null && event.dataTransfer.files.length > 0) {
        el.file.files = event.dataTransfer.files;
        void this.summarize();
      }
    });
    el.ask.disabled = true;
    el.stop.disabled = true;
  }
  async summarize() {
    const file = this.el.file.files?.[0];
    if (file === void 0 || this.controller !== null) {
      return;
    }
    this.fileName = file.name;
    this.state = emptySummary();
    this.setBusy(true);
    const controller = new AbortController();
    this.controller = controller;
    const form = new FormData();
    form.append("file", file, file.name);
    form.append("style", this.el.style.value);
    if (this.el.model.value !== "") {
      form.append("model", this.el.model.value);
    }
    const requestId = newRequestId();
    try {
      const response = await fetch(SUMMARIZE_ENDPOINT, {
        method: "POST",
        headers: requestHeaders(this.el.apiKey.value, requestId),
        body: form,
        signal: controller.signal
      });
      if (!response.ok || response.body === null) {
        throw new RequestError(await errorMessage(response), requestId, response.status);
      }
      await readSummary(response.body, this.state, (state) => this.show(state));
    } catch (error) {
      this.state.error = controller.signal.aborted ? "stopped" : error instanceof Error ? error.message : String(error);
    } finally {
      this.controller = null;
      this.setBusy(false);
      this.show(this.state);
    }
  }
  setBusy(busy) {
    this.el.summarize.disabled = busy;
    this.el.stop.disabled = !busy;
    this.el.ask.disabled = busy || !this.state.done;
  }
  show(state) {
    const name = this.fileName;
    const status = state.error !== null ? `error: ${state.error}` : state.done ? "done" : state.progress;
    this.el.progress.textContent = `${name}: ${status}`;
    this.el.summary.replaceChildren(...state.sections.map((section) => sectionElement(section)));
    this.el.ask.disabled = !state.done;
  }
  /** The summary as the chat's system prompt, and the prompt box ready for a question. */
  askInChat() {
    const intro = `You answer questions about the document "${this.fileName}". Its summary, with page references:`;
    this.el.systemPrompt.value = `${intro}
${summaryText(this.state)}`;
    this.el.systemPrompt.dispatchEvent(new Event("change", { bubbles: true }));
    this.el.prompt.focus();
  }
};
function sectionElement(section) {
  const block = document.createElement("section");
  block.className = "document-section";
  if (section.title !== null) {
    const heading = document.createElement("h3");
    heading.textContent = `${section.title} (${cite(section.pages)})`;
    block.append(heading);
  }
  const list = document.createElement("ul");
  for (const statement of section.statements) {
    const item = document.createElement("li");
    item.className = "statement";
    const text = document.createElement("span");
    text.textContent = statement.text;
    const pages = document.createElement("span");
    pages.className = "pages";
    pages.textContent = ` [${cite(statement.pages)}]`;
    item.append(text, pages);
    list.append(item);
  }
  block.append(list);
  return block;
}

// src/main.ts
function byId(id, type) {
  const node = document.getElementById(id);
  if (!(node instanceof type)) {
    throw new Error(`the page has no <${type.name}> with id "${id}"`);
  }
  return node;
}
var elements = {
  model: byId("model", HTMLSelectElement),
  newChat: byId("new-chat", HTMLButtonElement),
  systemPrompt: byId("system-prompt", HTMLTextAreaElement),
  temperature: byId("temperature", HTMLInputElement),
  maxTokens: byId("max-tokens", HTMLInputElement),
  apiKey: byId("api-key", HTMLInputElement),
  conversation: byId("conversation", HTMLElement),
  status: byId("status", HTMLElement),
  composer: byId("composer", HTMLFormElement),
  prompt: byId("prompt", HTMLTextAreaElement),
  send: byId("send", HTMLButtonElement),
  stop: byId("stop", HTMLButtonElement)
};
new ChatPage(elements).start();
new DocumentsPanel({
  file: byId("document-file", HTMLInputElement),
  dropZone: byId("document-drop", HTMLElement),
  style: byId("document-style", HTMLSelectElement),
  summarize: byId("document-summarize", HTMLButtonElement),
  stop: byId("document-stop", HTMLButtonElement),
  progress: byId("document-progress", HTMLElement),
  summary: byId("document-summary", HTMLElement),
  ask: byId("document-ask", HTMLButtonElement),
  model: elements.model,
  apiKey: elements.apiKey,
  systemPrompt: elements.systemPrompt,
  prompt: elements.prompt
}).start();
