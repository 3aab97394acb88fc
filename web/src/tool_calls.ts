/**
 * Tool calls as an answer streams them: OpenAI's `delta.tool_calls` entries merged into whole
 * calls, and their arguments made readable.
 *
 * The first entry of a call carries its index, id and function name; later ones carry only the
 * index and the next fragment of the arguments' JSON text.
 */

export interface ToolCall {
  /** The call's position in the answer, as the server numbered it. */
  readonly index: number;
  readonly id: string;
  readonly name: string;
  /** The arguments' JSON text as far as it has arrived. */
  readonly arguments: string;
}

/**
 * `calls` with `deltas` (one chunk's `delta.tool_calls`) applied, in index order; `calls` itself
 * when there is nothing to apply.
 */
export function mergeToolCallDeltas(calls: readonly ToolCall[], deltas: unknown): readonly ToolCall[] {
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

function mergeOne(calls: readonly ToolCall[], delta: Record<string, unknown>): readonly ToolCall[] {
  const fn = isRecord(delta["function"]) ? delta["function"] : {};
  const id = stringOr(delta["id"], "");
  // A server that leaves the index out sends one call at a time: a new id starts the next.
  const last = calls[calls.length - 1];
  const startsNext = last === undefined || (id !== "" && id !== last.id);
  const index = typeof delta["index"] === "number" ? delta["index"] : startsNext ? calls.length : last.index;
  const call = calls.find((c) => c.index === index) ?? { index, id: "", name: "", arguments: "" };
  const next: ToolCall = {
    index,
    // As OpenAI's SDK merges them: a name or id that comes again replaces it, arguments add up.
    id: id || call.id,
    name: stringOr(fn["name"], "") || call.name,
    arguments: call.arguments + stringOr(fn["arguments"], ""),
  };
  return [...calls.filter((c) => c.index !== index), next].sort((a, b) => a.index - b.index);
}

/**
 * The arguments pretty-printed once they are a whole JSON object (or array); until then, or when
 * the model wrote something that is not JSON, the text as it came.
 */
export function formatArguments(text: string): string {
  let value: unknown;
  try {
    value = JSON.parse(text) as unknown;
  } catch {
    return text;
  }
  // A lone number or string may still be growing ("1" of "12"): only a closed object is whole.
  return typeof value === "object" && value !== null ? JSON.stringify(value, null, 2) : text;
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

function stringOr(value: unknown, fallback: string): string {
  return typeof value === "string" ? value : fallback;
}
