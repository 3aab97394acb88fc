/**
 * One streamed chat completion, tried again per the retry policy until it finishes, fails for
 * good, or the caller aborts it.
 *
 * A try that fails mid-stream leaves its output with the observer: the caller keeps showing it
 * until the next try produces output of its own, which then replaces it.
 */

import { errorMessage, RequestError, requestHeaders } from "./http";
import { decideRetry, describeFailure, type Failure, type RetryPolicy } from "./retry";
import { SSEParser } from "./sse";
import { mergeToolCallDeltas, type ToolCall } from "./tool_calls";

export interface ChatMessage {
  readonly role: "system" | "user" | "assistant";
  readonly content: string;
}

export interface ChatRequest {
  readonly endpoint: string;
  readonly apiKey: string;
  readonly model: string;
  readonly messages: readonly ChatMessage[];
  readonly temperature: number;
  readonly maxTokens: number;
}

export interface RetryNotice {
  readonly failure: Failure;
  /** What went wrong, in words ("Rate limited"). */
  readonly reason: string;
  /** The try that comes next, counting from 1. */
  readonly nextAttempt: number;
  readonly maxAttempts: number;
  readonly delayMs: number;
  readonly failedRequestId: string;
}

/** What a try has produced. An ordinary answer has only text: no reasoning, no tool calls. */
export interface Output {
  readonly text: string;
  /** A reasoning model's thinking, streamed before the text. */
  readonly reasoning: string;
  readonly toolCalls: readonly ToolCall[];
}

export interface StreamObserver {
  onAttempt(attempt: number, requestId: string): void;
  /** The whole output of the current try so far, each time it grows. */
  onOutput(output: Output): void;
  onRetry(notice: RetryNotice): void;
}

/** The outcome of the last try; times are on `StreamDeps.now`'s clock. */
export interface Answer extends Output {
  /** Set when the stream ended normally ("stop", "length", "tool_calls"). */
  readonly finishReason: string | null;
  /** True when the caller aborted: the output is what had arrived by then. */
  readonly stopped: boolean;
  readonly requestId: string;
  readonly attempt: number;
  readonly startedAt: number;
  readonly firstTokenAt: number | null;
  readonly lastTokenAt: number | null;
  /** The server's completion_tokens when it reported usage, else the chunks that carried output. */
  readonly numTokens: number;
}

export interface StreamDeps {
  readonly fetch: typeof fetch;
  /** Resolves after `ms`, or as soon as `signal` aborts. */
  readonly sleep: (ms: number, signal: AbortSignal) => Promise<void>;
  readonly random: () => number;
  /** A monotonic clock in milliseconds, for the answer's timings. */
  readonly now: () => number;
  /** Wall-clock milliseconds, for Retry-After dates. */
  readonly wallClock: () => number;
  readonly newRequestId: () => string;
}

/** Raised (and caught in `streamChat`) when a try fails in a way the retry policy may retry. */
class TryFailed extends Error {
  constructor(
    readonly failure: Failure,
    message: string,
  ) {
    super(message);
  }
}

interface TryState {
  text: string;
  reasoning: string;
  toolCalls: readonly ToolCall[];
  finishReason: string | null;
  firstTokenAt: number | null;
  lastTokenAt: number | null;
  numOutputChunks: number;
  usageTokens: number | null;
  done: boolean;
}

export async function streamChat(
  request: ChatRequest,
  observer: StreamObserver,
  signal: AbortSignal,
  policy: RetryPolicy,
  deps: StreamDeps,
): Promise<Answer> {
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
        failedRequestId: requestId,
      });
      await deps.sleep(decision.delayMs, signal);
      if (signal.aborted) {
        return answer(state, requestId, attempt, startedAt, true);
      }
    }
  }
}

function newTryState(): TryState {
  return {
    text: "",
    reasoning: "",
    toolCalls: [],
    finishReason: null,
    firstTokenAt: null,
    lastTokenAt: null,
    numOutputChunks: 0,
    usageTokens: null,
    done: false,
  };
}

function answer(state: TryState, requestId: string, attempt: number, startedAt: number, stopped: boolean): Answer {
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
    numTokens: state.usageTokens ?? state.numOutputChunks,
  };
}

async function runTry(
  request: ChatRequest,
  requestId: string,
  state: TryState,
  observer: StreamObserver,
  signal: AbortSignal,
  deps: StreamDeps,
): Promise<void> {
  let response: Response;
  try {
    response = await deps.fetch(request.endpoint, {
      method: "POST",
      headers: {
        ...requestHeaders(request.apiKey, requestId),
        "Content-Type": "application/json",
        Accept: "text/event-stream",
      },
      body: JSON.stringify(requestBody(request)),
      signal,
    });
  } catch (error) {
    throw new TryFailed({ kind: "network" }, `Could not reach the server: ${messageOf(error)}`);
  }
  if (!response.ok) {
    const failure: Failure = { kind: "http", status: response.status, retryAfter: response.headers.get("Retry-After") };
    throw new TryFailed(failure, `${response.status}: ${await errorMessage(response)}`);
  }
  if (response.body === null) {
    throw new RequestError("The server sent an empty response", requestId, response.status);
  }
  await readEvents(response.body, requestId, state, observer, deps);
}

function requestBody(request: ChatRequest): object {
  return {
    model: request.model,
    messages: request.messages,
    temperature: request.temperature,
    max_tokens: request.maxTokens,
    stream: true,
    stream_options: { include_usage: true },
  };
}

async function readEvents(
  body: ReadableStream<Uint8Array>,
  requestId: string,
  state: TryState,
  observer: StreamObserver,
  deps: StreamDeps,
): Promise<void> {
  const reader = body.getReader();
  const parser = new SSEParser();
  try {
    for (;;) {
      let chunk: ReadableStreamReadResult<Uint8Array>;
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

interface ChatDelta {
  content?: string | null;
  reasoning_content?: string | null;
  /** Checked entry by entry in `mergeToolCallDeltas`. */
  tool_calls?: unknown;
}

interface ChatChunk {
  choices?: { delta?: ChatDelta; finish_reason?: string | null }[];
  usage?: { completion_tokens?: number } | null;
  error?: { message?: string };
}

function applyEvent(data: string, requestId: string, state: TryState, observer: StreamObserver, deps: StreamDeps): void {
  if (data === "[DONE]") {
    state.done = true;
    return;
  }
  let chunk: ChatChunk;
  try {
    chunk = JSON.parse(data) as ChatChunk;
  } catch {
    throw new RequestError("The server sent an event that is not JSON", requestId, null);
  }
  if (chunk.error !== undefined) {
    throw new RequestError(chunk.error.message ?? "The server reported an error mid-stream", requestId, null);
  }
  if (typeof chunk.usage?.completion_tokens === "number") {
    state.usageTokens = chunk.usage.completion_tokens;
  }
  const choice = chunk.choices?.[0];
  if (applyDelta(choice?.delta ?? {}, state)) {
    // Reasoning and tool calls are tokens too: they count for the first token and the speed.
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

/** Adds one delta's reasoning, text and tool-call fragments to `state`; false when it had none. */
function applyDelta(delta: ChatDelta, state: TryState): boolean {
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

function messageOf(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}
