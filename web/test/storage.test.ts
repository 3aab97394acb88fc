import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { ChatStorage, type Turn } from "../src/storage";

/** localStorage's interface over a Map. */
function memoryStorage(entries: Record<string, string> = {}): Storage {
  const map = new Map(Object.entries(entries));
  return {
    get length() {
      return map.size;
    },
    clear: () => map.clear(),
    getItem: (key) => map.get(key) ?? null,
    key: (i) => [...map.keys()][i] ?? null,
    removeItem: (key) => void map.delete(key),
    setItem: (key, value) => void map.set(key, value),
  };
}

const ANSWER: Turn = {
  role: "assistant",
  content: "Checking.",
  reasoning: "Need the weather.",
  toolCalls: [{ index: 0, id: "call_a", name: "get_weather", arguments: '{"city":"Oslo"}' }],
  note: "3 tokens",
  error: null,
};

describe("ChatStorage conversation", () => {
  it("keeps an answer's reasoning and tool calls across a reload", () => {
    const storage = memoryStorage();
    new ChatStorage(storage).saveConversation([ANSWER]);
    assert.deepEqual(new ChatStorage(storage).loadConversation(), [ANSWER]);
  });

  it("reads an older page's turns as having no reasoning and no tool calls, and drops bad calls", () => {
    const older = { role: "assistant", content: "Hi", note: "", error: null };
    const badCalls = { ...ANSWER, toolCalls: [{ name: "f" }, ANSWER.toolCalls[0], "call"] };
    const storage = memoryStorage({ "rebar.chat.conversation": JSON.stringify([older, badCalls, { role: "x" }]) });
    assert.deepEqual(new ChatStorage(storage).loadConversation(), [
      { ...older, reasoning: "", toolCalls: [] },
      ANSWER,
    ]);
  });
});
