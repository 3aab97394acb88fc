/**
 * What the page keeps in localStorage: settings, the API key and the conversation.
 *
 * Every read is validated field by field: a value written by an older page, edited by hand or
 * cut short falls back to the default instead of breaking the page.
 */

import type { ToolCall } from "./tool_calls";

export interface Settings {
  readonly model: string;
  readonly systemPrompt: string;
  readonly temperature: number;
  readonly maxTokens: number;
}

export const DEFAULT_SETTINGS: Settings = { model: "", systemPrompt: "", temperature: 0.7, maxTokens: 256 };

export interface TurnError {
  readonly message: string;
  readonly requestId: string;
}

/** One message on screen. `note` is the line under an answer (timings, "stopped"). */
export interface Turn {
  readonly role: "user" | "assistant";
  readonly content: string;
  /** A reasoning model's thinking before `content`; "" for every other turn. */
  readonly reasoning: string;
  readonly toolCalls: readonly ToolCall[];
  readonly note: string;
  readonly error: TurnError | null;
}

const KEYS = { settings: "rebar.chat.settings", apiKey: "rebar.chat.apiKey", conversation: "rebar.chat.conversation" };

export class ChatStorage {
  constructor(private readonly storage: Storage) {}

  loadSettings(): Settings {
    const raw = this.readJson(KEYS.settings);
    if (!isRecord(raw)) {
      return DEFAULT_SETTINGS;
    }
    return {
      model: typeof raw["model"] === "string" ? raw["model"] : DEFAULT_SETTINGS.model,
      systemPrompt: typeof raw["systemPrompt"] === "string" ? raw["systemPrompt"] : DEFAULT_SETTINGS.systemPrompt,
      temperature: finiteOr(raw["temperature"], DEFAULT_SETTINGS.temperature),
      maxTokens: finiteOr(raw["maxTokens"], DEFAULT_SETTINGS.maxTokens),
    };
  }

  saveSettings(settings: Settings): void {
    this.write(KEYS.settings, JSON.stringify(settings));
  }

  loadApiKey(): string {
    return this.read(KEYS.apiKey) ?? "";
  }

  saveApiKey(apiKey: string): void {
    this.write(KEYS.apiKey, apiKey);
  }

  loadConversation(): Turn[] {
    const raw = this.readJson(KEYS.conversation);
    return Array.isArray(raw) ? raw.flatMap((item) => turnFrom(item) ?? []) : [];
  }

  saveConversation(turns: readonly Turn[]): void {
    this.write(KEYS.conversation, JSON.stringify(turns));
  }

  private read(key: string): string | null {
    try {
      return this.storage.getItem(key);
    } catch {
      return null; // storage disabled by the browser: behave as if empty
    }
  }

  private readJson(key: string): unknown {
    const text = this.read(key);
    if (text === null) {
      return null;
    }
    try {
      return JSON.parse(text) as unknown;
    } catch {
      return null;
    }
  }

  private write(key: string, value: string): void {
    try {
      this.storage.setItem(key, value);
    } catch {
      // Full or disabled storage: the page still works, it just forgets on reload.
    }
  }
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

function finiteOr(value: unknown, fallback: number): number {
  return typeof value === "number" && Number.isFinite(value) ? value : fallback;
}

/** A stored turn, or null when it is not one; an older page's turn has no reasoning or tool calls. */
function turnFrom(value: unknown): Turn | null {
  if (!isRecord(value)) {
    return null;
  }
  const { role, content, note, error } = value;
  const errorOk =
    error === null || (isRecord(error) && typeof error["message"] === "string" && typeof error["requestId"] === "string");
  if ((role !== "user" && role !== "assistant") || typeof content !== "string" || typeof note !== "string" || !errorOk) {
    return null;
  }
  const reasoning = typeof value["reasoning"] === "string" ? value["reasoning"] : "";
  const toolCalls = Array.isArray(value["toolCalls"]) ? value["toolCalls"].filter(isToolCall) : [];
  return { role, content, reasoning, toolCalls, note, error: error as TurnError | null };
}

function isToolCall(value: unknown): value is ToolCall {
  return (
    isRecord(value) &&
    typeof value["index"] === "number" &&
    typeof value["id"] === "string" &&
    typeof value["name"] === "string" &&
    typeof value["arguments"] === "string"
  );
}
