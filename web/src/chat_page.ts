/**
 * The chat page's behaviour: sending, streaming into the conversation, stopping, retry status,
 * settings and the model picker. The page's elements are looked up once, by id, in `PageElements`.
 */

import { answerStats, formatStats } from "./answer_stats";
import {
  streamChat,
  type Answer,
  type ChatMessage,
  type Output,
  type RetryNotice,
  type StreamDeps,
  type StreamObserver,
} from "./chat_stream";
import { takeHandedKey } from "./handed_key";
import { RequestError } from "./http";
import { listModels, pickModel } from "./models";
import { newRequestId } from "./request_id";
import { DEFAULT_RETRY_POLICY } from "./retry";
import { ChatStorage, DEFAULT_SETTINGS, type Settings, type Turn } from "./storage";
import { ConversationView, StatusLine, TurnView } from "./view";

const CHAT_ENDPOINT = "/v1/chat/completions";
const MODELS_ENDPOINT = "/v1/models";
const MODELS_RETRY_MS = 2_000;

export interface PageElements {
  readonly model: HTMLSelectElement;
  readonly newChat: HTMLButtonElement;
  readonly systemPrompt: HTMLTextAreaElement;
  readonly temperature: HTMLInputElement;
  readonly maxTokens: HTMLInputElement;
  readonly apiKey: HTMLInputElement;
  readonly conversation: HTMLElement;
  readonly status: HTMLElement;
  readonly composer: HTMLFormElement;
  readonly prompt: HTMLTextAreaElement;
  readonly send: HTMLButtonElement;
  readonly stop: HTMLButtonElement;
}

const NO_OUTPUT: Output = { text: "", reasoning: "", toolCalls: [] };

/** An answer being streamed: its view, what it shows, and how to stop it. */
interface InFlight {
  readonly view: TurnView;
  readonly controller: AbortController;
  shown: Output;
}

export class ChatPage {
  private readonly storage = new ChatStorage(window.localStorage);
  private readonly conversation: ConversationView;
  private readonly status: StatusLine;
  private turns: Turn[];
  private inFlight: InFlight | null = null;
  private modelsRetry: ReturnType<typeof setTimeout> | null = null;
  // The model chosen last time, selected again once the server lists it.
  private savedModel = "";

  constructor(private readonly el: PageElements) {
    this.conversation = new ConversationView(el.conversation);
    this.status = new StatusLine(el.status);
    this.turns = this.storage.loadConversation();
  }

  start(): void {
    this.showSettings(this.storage.loadSettings());
    // A key handed over in the address (`rebar desktop`'s window) is used, never stored.
    this.el.apiKey.value = takeHandedKey(window.location, window.history) ?? this.storage.loadApiKey();
    this.conversation.show(this.turns);
    this.listen();
    void this.loadModels();
    this.el.prompt.focus();
  }

  private listen(): void {
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
    // A reload mid-answer keeps what had arrived.
    window.addEventListener("pagehide", () => this.storage.saveConversation(this.turnsWithInFlight()));
  }

  private async send(): Promise<void> {
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
    this.el.prompt.focus(); // Send is about to be disabled: keep the keyboard where the next message goes
    const view = this.conversation.append("assistant");
    const flight: InFlight = { view, controller: new AbortController(), shown: NO_OUTPUT };
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
      maxTokens: settings.maxTokens,
    };
    let turn: Turn;
    try {
      const answer = await streamChat(request, this.observerFor(flight), flight.controller.signal, DEFAULT_RETRY_POLICY, browserDeps());
      turn = this.finishedTurn(flight, answer);
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

  private observerFor(flight: InFlight): StreamObserver {
    return {
      onAttempt: (attempt: number) => {
        if (attempt > 1) {
          this.status.show(`Trying again (try ${attempt} of ${DEFAULT_RETRY_POLICY.maxAttempts})…`);
        }
      },
      onOutput: (output: Output) => {
        flight.shown = output;
        flight.view.setOutput(output);
        flight.view.setStale(false);
        this.conversation.scrollToEnd();
      },
      onRetry: (notice: RetryNotice) => {
        flight.view.setStale(hasOutput(flight.shown));
        this.status.countdown(notice.delayMs, (seconds) =>
          `${notice.reason} (request id ${notice.failedRequestId}); trying again in ${seconds} s ` +
          `(try ${notice.nextAttempt} of ${notice.maxAttempts})…`,
        );
      },
    };
  }

  private finishedTurn(flight: InFlight, answer: Answer): Turn {
    const parts = [formatStats(answerStats(answer))];
    if (answer.finishReason === "length") {
      parts.push("max tokens reached");
    }
    if (answer.attempt > 1) {
      parts.push(`after ${answer.attempt} tries`);
    }
    if (answer.stopped) {
      parts.push("stopped");
      this.status.show("Stopped.");
    } else {
      this.status.clear();
    }
    // A try stopped during a retry wait has no output of its own: keep the earlier try's.
    return { ...assistantTurn(hasOutput(answer) ? answer : flight.shown), note: parts.join(" · ") };
  }

  private failedTurn(flight: InFlight, error: unknown): Turn {
    const failure =
      error instanceof RequestError
        ? { message: error.message, requestId: error.requestId }
        : { message: error instanceof Error ? error.message : String(error), requestId: "none" };
    this.status.show(`The request failed (request id ${failure.requestId}).`, "error");
    return { ...assistantTurn(flight.shown), error: failure };
  }

  private stop(): void {
    this.inFlight?.controller.abort();
  }

  private newChat(): void {
    if (this.inFlight !== null) {
      return; // the button is disabled while an answer streams
    }
    this.turns = [];
    this.storage.saveConversation(this.turns);
    this.conversation.show(this.turns);
    this.status.clear();
    this.el.prompt.focus();
  }

  private addTurn(turn: Turn): void {
    this.turns.push(turn);
    this.storage.saveConversation(this.turns);
    this.conversation.append(turn.role).showTurn(turn);
  }

  /**
   * The system prompt, then every turn with text: a stopped or partial answer is context too.
   * Reasoning stays out (the server leaves it out of the prompt anyway), and so do tool calls:
   * the page has no tool results to answer them with.
   */
  private messagesFor(settings: Settings): ChatMessage[] {
    const messages: ChatMessage[] = [];
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

  private turnsWithInFlight(): Turn[] {
    if (this.inFlight === null || !hasOutput(this.inFlight.shown)) {
      return this.turns;
    }
    return [...this.turns, { ...assistantTurn(this.inFlight.shown), note: "interrupted" }];
  }

  private setBusy(busy: boolean): void {
    this.el.send.disabled = busy;
    this.el.newChat.disabled = busy;
    this.el.stop.disabled = !busy;
  }

  private showSettings(settings: Settings): void {
    this.el.systemPrompt.value = settings.systemPrompt;
    this.el.temperature.value = String(settings.temperature);
    this.el.maxTokens.value = String(settings.maxTokens);
    this.savedModel = settings.model;
  }

  private readSettings(): Settings {
    const temperature = Number(this.el.temperature.value);
    const maxTokens = Math.round(Number(this.el.maxTokens.value));
    return {
      model: this.el.model.value || this.savedModel,
      systemPrompt: this.el.systemPrompt.value,
      temperature: Number.isFinite(temperature) ? Math.min(2, Math.max(0, temperature)) : DEFAULT_SETTINGS.temperature,
      maxTokens: Number.isFinite(maxTokens) && maxTokens >= 1 ? maxTokens : DEFAULT_SETTINGS.maxTokens,
    };
  }

  /** Fill the picker; while the server is still loading (503) or unreachable, ask again shortly. */
  private async loadModels(): Promise<void> {
    if (this.modelsRetry !== null) {
      clearTimeout(this.modelsRetry);
      this.modelsRetry = null;
    }
    let models: string[];
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

  private reportModelsFailure(error: RequestError): void {
    if (error.status === 401) {
      this.status.show(`The server needs an API key: enter it under Settings (request id ${error.requestId}).`, "error");
      return; // the key field's change event tries again
    }
    const waiting = error.status === 503 ? "The server is loading its models" : error.message;
    this.status.show(`${waiting}; asking again shortly (request id ${error.requestId}).`, error.status === 503 ? "info" : "error");
    this.modelsRetry = setTimeout(() => void this.loadModels(), MODELS_RETRY_MS);
  }
}

function hasOutput(output: Output): boolean {
  return output.text !== "" || output.reasoning !== "" || output.toolCalls.length > 0;
}

/** An answer's turn with no note and no error yet. */
function assistantTurn(output: Output): Turn {
  const { text, reasoning, toolCalls } = output;
  return { role: "assistant", content: text, reasoning, toolCalls, note: "", error: null };
}

function browserDeps(): StreamDeps {
  return {
    fetch: (input, init) => fetch(input, init),
    sleep: abortableSleep,
    random: Math.random,
    now: () => performance.now(),
    wallClock: Date.now,
    newRequestId,
  };
}

function abortableSleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const done = (): void => {
      clearTimeout(timer);
      signal.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal.addEventListener("abort", done, { once: true });
  });
}
