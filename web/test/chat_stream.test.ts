import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { streamChat, type ChatRequest, type Output, type RetryNotice, type StreamDeps } from "../src/chat_stream";
import { RequestError } from "../src/http";
import type { RetryPolicy } from "../src/retry";

const POLICY: RetryPolicy = { maxAttempts: 3, baseDelayMs: 100, maxDelayMs: 1_000, maxRetryAfterMs: 60_000 };
const REQUEST: ChatRequest = {
  endpoint: "http://rebar.test/v1/chat/completions",
  apiKey: "sk-test",
  model: "smollm2",
  messages: [{ role: "user", content: "Hi" }],
  temperature: 0.5,
  maxTokens: 16,
};
const encoder = new TextEncoder();

function sse(...texts: string[]): string {
  return deltas(...texts.map((text) => ({ content: text })));
}

/** One event per delta, as the server streams a choice. */
function deltas(...items: object[]): string {
  return items.map((delta) => `data: ${JSON.stringify({ choices: [{ index: 0, delta, finish_reason: null }] })}\n\n`).join("");
}

const FINISH = 'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\ndata: {"choices":[],"usage":{"completion_tokens":3}}\n\ndata: [DONE]\n\n';

/** A streamed 200 whose body arrives in `pieces`, one per read, then ends (or breaks, when `breakAfter`). */
function streamed(pieces: readonly string[], breakAfter = false): Response {
  const queue = [...pieces];
  const body = new ReadableStream<Uint8Array>({
    pull(controller) {
      const piece = queue.shift();
      if (piece !== undefined) {
        controller.enqueue(encoder.encode(piece));
      } else if (breakAfter) {
        controller.error(new TypeError("network error"));
      } else {
        controller.close();
      }
    },
  });
  return new Response(body, { status: 200, headers: { "Content-Type": "text/event-stream" } });
}

function failed(status: number, headers: Record<string, string> = {}): Response {
  const body = JSON.stringify({ error: { message: `status ${status} from the test`, type: "error" } });
  return new Response(body, { status, headers: { "Content-Type": "application/json", ...headers } });
}

/** Deps whose fetch answers from `responses` in order and records each call; sleeping is instant. */
function fakeDeps(responses: (Response | Error)[]) {
  const calls: { url: string; init: RequestInit }[] = [];
  const sleeps: number[] = [];
  let clock = 0;
  let nextId = 0;
  const deps: StreamDeps = {
    fetch: async (url, init) => {
      calls.push({ url: String(url), init: init ?? {} });
      const next = responses.shift();
      if (next === undefined) {
        throw new Error("no more responses");
      }
      if (next instanceof Error) {
        throw next;
      }
      return next;
    },
    sleep: async (ms) => {
      sleeps.push(ms);
    },
    random: () => 0.5,
    now: () => (clock += 10),
    wallClock: () => 0,
    newRequestId: () => `id-${++nextId}`,
  };
  return { deps, calls, sleeps };
}

function recorder() {
  const outputs: Output[] = [];
  const texts: string[] = [];
  const retries: RetryNotice[] = [];
  const attempts: [number, string][] = [];
  const observer = {
    onAttempt: (attempt: number, requestId: string) => void attempts.push([attempt, requestId]),
    onOutput: (output: Output) => void (outputs.push(output), texts.push(output.text)),
    onRetry: (notice: RetryNotice) => void retries.push(notice),
  };
  return { observer, outputs, texts, retries, attempts };
}

function header(init: RequestInit, name: string): string | undefined {
  return (init.headers as Record<string, string>)[name];
}

describe("streamChat", () => {
  it("streams the answer, sending the request id, the key and the settings", async () => {
    const body = sse("Hel", "lo ", "🙂") + FINISH;
    const { deps, calls } = fakeDeps([streamed([body.slice(0, 30), body.slice(30, 100), body.slice(100)])]);
    const { observer, texts } = recorder();
    const answer = await streamChat(REQUEST, observer, new AbortController().signal, POLICY, deps);

    assert.deepEqual(texts, ["Hel", "Hello ", "Hello 🙂"]);
    assert.equal(answer.text, "Hello 🙂");
    assert.equal(answer.finishReason, "stop");
    assert.equal(answer.stopped, false);
    assert.equal(answer.numTokens, 3);
    assert.equal(answer.requestId, "id-1");
    assert.ok(answer.firstTokenAt !== null && answer.firstTokenAt > answer.startedAt);

    const [call] = calls;
    assert.ok(call);
    assert.equal(header(call.init, "X-Request-ID"), "id-1");
    assert.equal(header(call.init, "Authorization"), "Bearer sk-test");
    assert.deepEqual(JSON.parse(String(call.init.body)), {
      model: "smollm2",
      messages: [{ role: "user", content: "Hi" }],
      temperature: 0.5,
      max_tokens: 16,
      stream: true,
      stream_options: { include_usage: true },
    });
  });

  it("waits out a 429's Retry-After, then succeeds with a new request id", async () => {
    const { deps, calls, sleeps } = fakeDeps([failed(429, { "Retry-After": "2" }), streamed([sse("ok") + FINISH])]);
    const { observer, retries, attempts } = recorder();
    const answer = await streamChat(REQUEST, observer, new AbortController().signal, POLICY, deps);

    assert.equal(answer.text, "ok");
    assert.equal(answer.attempt, 2);
    assert.deepEqual(sleeps, [2_000]);
    assert.deepEqual(attempts, [[1, "id-1"], [2, "id-2"]]);
    assert.equal(retries.length, 1);
    assert.equal(retries[0]?.reason, "Rate limited");
    assert.equal(retries[0]?.failedRequestId, "id-1");
    assert.equal(retries[0]?.nextAttempt, 2);
    assert.deepEqual(calls.map((c) => header(c.init, "X-Request-ID")), ["id-1", "id-2"]);
  });

  it("gives up after maxAttempts with the last request id and the server's message", async () => {
    const { deps, sleeps } = fakeDeps([failed(503), failed(503), failed(503)]);
    const { observer } = recorder();
    await assert.rejects(streamChat(REQUEST, observer, new AbortController().signal, POLICY, deps), (error) => {
      assert.ok(error instanceof RequestError);
      assert.equal(error.status, 503);
      assert.equal(error.requestId, "id-3");
      assert.equal(error.message, "503: status 503 from the test (after 3 tries)");
      return true;
    });
    assert.deepEqual(sleeps, [75, 150]);
  });

  it("does not retry a 400", async () => {
    const { deps, calls } = fakeDeps([failed(400)]);
    const { observer } = recorder();
    await assert.rejects(streamChat(REQUEST, observer, new AbortController().signal, POLICY, deps), /400: status 400/);
    assert.equal(calls.length, 1);
  });

  it("retries a refused connection and a stream that breaks mid-answer, replacing the partial text", async () => {
    const { deps } = fakeDeps([
      new TypeError("Failed to fetch"),
      streamed([sse("Partial", " answ")], true),
      streamed([sse("Whole answer") + FINISH]),
    ]);
    const { observer, texts, retries } = recorder();
    const answer = await streamChat(REQUEST, observer, new AbortController().signal, POLICY, deps);

    assert.deepEqual(texts, ["Partial", "Partial answ", "Whole answer"]);
    assert.deepEqual(retries.map((r) => r.reason), ["Connection lost", "Connection lost"]);
    assert.equal(answer.text, "Whole answer");
    assert.equal(answer.attempt, 3);
  });

  it("retries a stream that ends without [DONE]", async () => {
    const { deps } = fakeDeps([streamed([sse("cut")]), streamed([sse("done") + FINISH])]);
    const { observer, retries } = recorder();
    const answer = await streamChat(REQUEST, observer, new AbortController().signal, POLICY, deps);
    assert.equal(retries.length, 1);
    assert.equal(answer.text, "done");
  });

  it("returns what had arrived, marked stopped, when the caller aborts mid-stream", async () => {
    const controller = new AbortController();
    const body = new ReadableStream<Uint8Array>({
      start(stream) {
        stream.enqueue(encoder.encode(sse("Once upon")));
        controller.signal.addEventListener("abort", () => stream.error(new DOMException("aborted", "AbortError")));
      },
    });
    const { deps, calls } = fakeDeps([new Response(body, { status: 200 })]);
    const { observer } = recorder();
    const observing = { ...observer, onOutput: (output: Output) => (observer.onOutput(output), controller.abort()) };
    const answer = await streamChat(REQUEST, observing, controller.signal, POLICY, deps);

    assert.equal(answer.stopped, true);
    assert.equal(answer.text, "Once upon");
    assert.equal(calls.length, 1);
  });

  it("stops during a retry wait without trying again", async () => {
    const controller = new AbortController();
    const { deps, calls } = fakeDeps([failed(503)]);
    const waiting: StreamDeps = { ...deps, sleep: async () => controller.abort() };
    const { observer } = recorder();
    const answer = await streamChat(REQUEST, observer, controller.signal, POLICY, waiting);
    assert.equal(answer.stopped, true);
    assert.equal(calls.length, 1);
  });
});

const FINISH_TOOL_CALLS = 'data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\ndata: [DONE]\n\n';
const DONE = "data: [DONE]\n\n";

/** rebar's first chunk of every stream. */
const OPENING = { role: "assistant", content: "" };

describe("streamChat: reasoning and tool calls", () => {
  it("gives an ordinary answer no reasoning and no tool calls", async () => {
    const { deps } = fakeDeps([streamed([deltas(OPENING) + sse("Hi", " there") + FINISH])]);
    const { observer, outputs } = recorder();
    const answer = await streamChat(REQUEST, observer, new AbortController().signal, POLICY, deps);

    assert.equal(answer.text, "Hi there");
    assert.equal(answer.reasoning, "");
    assert.deepEqual(answer.toolCalls, []);
    assert.deepEqual(outputs, [
      { text: "Hi", reasoning: "", toolCalls: [] },
      { text: "Hi there", reasoning: "", toolCalls: [] },
    ]);
  });

  it("streams reasoning before the text, each growing on its own", async () => {
    const body =
      deltas(OPENING, { reasoning_content: "Let me" }, { reasoning_content: " think." }, { content: "Paris" }, { content: "." }) +
      'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n' +
      DONE;
    const { deps } = fakeDeps([streamed([body.slice(0, 70), body.slice(70)])]);
    const { observer, outputs } = recorder();
    const answer = await streamChat(REQUEST, observer, new AbortController().signal, POLICY, deps);

    assert.deepEqual(
      outputs.map((o) => [o.reasoning, o.text]),
      [
        ["Let me", ""],
        ["Let me think.", ""],
        ["Let me think.", "Paris"],
        ["Let me think.", "Paris."],
      ],
    );
    assert.equal(answer.reasoning, "Let me think.");
    assert.equal(answer.text, "Paris.");
    assert.equal(answer.finishReason, "stop");
    // Thinking is output: the first token is the first reasoning chunk, and every chunk counts.
    assert.equal(answer.numTokens, 4);
    assert.ok(answer.firstTokenAt !== null && answer.lastTokenAt !== null && answer.lastTokenAt > answer.firstTokenAt);
  });

  it("takes reasoning and text from one delta (an answer replayed from the cache)", async () => {
    const body = deltas({ reasoning_content: "hm", content: "Paris." }) + FINISH;
    const { deps } = fakeDeps([streamed([body])]);
    const { observer, outputs } = recorder();
    const answer = await streamChat(REQUEST, observer, new AbortController().signal, POLICY, deps);
    assert.deepEqual(outputs, [{ text: "Paris.", reasoning: "hm", toolCalls: [] }]);
    assert.equal(answer.reasoning, "hm");
  });

  it("builds tool calls by index: name first, then the argument fragments in order", async () => {
    const call = (index: number, id: string, name: string) => ({
      tool_calls: [{ index, id, type: "function", function: { name, arguments: "" } }],
    });
    const fragment = (index: number, args: string) => ({ tool_calls: [{ index, function: { arguments: args } }] });
    const body =
      deltas(
        OPENING,
        call(0, "call_a", "get_weather"),
        fragment(0, '{"city": '),
        fragment(0, '"Paris"}'),
        call(1, "call_b", "add"),
        fragment(1, '{"a": 1, '),
        fragment(1, '"b": 2}'),
      ) + FINISH_TOOL_CALLS;
    const { deps } = fakeDeps([streamed([body.slice(0, 200), body.slice(200, 420), body.slice(420)])]);
    const { observer, outputs } = recorder();
    const answer = await streamChat(REQUEST, observer, new AbortController().signal, POLICY, deps);

    const weather = { index: 0, id: "call_a", name: "get_weather" };
    const add = { index: 1, id: "call_b", name: "add" };
    assert.deepEqual(
      outputs.map((o) => o.toolCalls),
      [
        [{ ...weather, arguments: "" }],
        [{ ...weather, arguments: '{"city": ' }],
        [{ ...weather, arguments: '{"city": "Paris"}' }],
        [{ ...weather, arguments: '{"city": "Paris"}' }, { ...add, arguments: "" }],
        [{ ...weather, arguments: '{"city": "Paris"}' }, { ...add, arguments: '{"a": 1, ' }],
        [{ ...weather, arguments: '{"city": "Paris"}' }, { ...add, arguments: '{"a": 1, "b": 2}' }],
      ],
    );
    assert.equal(answer.finishReason, "tool_calls");
    assert.equal(answer.text, "");
    assert.equal(answer.reasoning, "");
    assert.deepEqual(answer.toolCalls, outputs.at(-1)?.toolCalls);
    assert.equal(answer.numTokens, 6);
  });

  it("keeps text, reasoning and tool calls of one answer side by side", async () => {
    const body =
      deltas(
        { reasoning_content: "Need the weather." },
        { content: "Checking." },
        { tool_calls: [{ index: 0, id: "call_a", type: "function", function: { name: "get_weather", arguments: '{"city":"Oslo"}' } }] },
      ) + FINISH_TOOL_CALLS;
    const { deps } = fakeDeps([streamed([body])]);
    const { observer } = recorder();
    const answer = await streamChat(REQUEST, observer, new AbortController().signal, POLICY, deps);
    assert.equal(answer.reasoning, "Need the weather.");
    assert.equal(answer.text, "Checking.");
    assert.deepEqual(answer.toolCalls, [{ index: 0, id: "call_a", name: "get_weather", arguments: '{"city":"Oslo"}' }]);
  });

  it("starts a retried try with no reasoning or tool calls of the failed one", async () => {
    const failedTry = deltas(
      { reasoning_content: "Half a thought" },
      { tool_calls: [{ index: 0, id: "call_x", type: "function", function: { name: "f", arguments: "{" } }] },
    );
    const { deps } = fakeDeps([streamed([failedTry], true), streamed([sse("Fine.") + FINISH])]);
    const { observer, outputs } = recorder();
    const answer = await streamChat(REQUEST, observer, new AbortController().signal, POLICY, deps);
    assert.equal(answer.attempt, 2);
    assert.deepEqual(outputs.at(-1), { text: "Fine.", reasoning: "", toolCalls: [] });
    assert.equal(answer.reasoning, "");
    assert.deepEqual(answer.toolCalls, []);
  });
});
