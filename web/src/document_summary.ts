/**
 * The events of `POST /v1/documents/summarize`, read from its server-sent events into a summary
 * being built: progress per finished request, statements with their pages, sections, the end.
 * Pure: no DOM, so it is unit-tested under Node.
 */

import { SSEParser, type SSEEvent } from "./sse";

export interface Statement {
  readonly text: string;
  readonly pages: readonly number[];
}

export interface Section {
  readonly title: string | null;
  readonly pages: readonly number[];
  readonly statements: Statement[];
}

/** What the panel shows: the plan, the latest progress line, the sections so far, the outcome. */
export interface SummaryState {
  numChunks: number;
  progress: string;
  requestsDone: number;
  sections: Section[];
  done: boolean;
  cached: boolean;
  error: string | null;
}

export function emptySummary(): SummaryState {
  return { numChunks: 0, progress: "", requestsDone: 0, sections: [], done: false, cached: false, error: null };
}

/** "p. 3" or "pp. 3, 4"; "no source found" for a statement no page supports. */
export function cite(pages: readonly number[]): string {
  if (pages.length === 0) {
    return "no source found";
  }
  return (pages.length === 1 ? "p. " : "pp. ") + pages.join(", ");
}

function numbers(value: unknown): number[] {
  return Array.isArray(value) ? value.filter((n): n is number => typeof n === "number") : [];
}

function currentSection(state: SummaryState): Section {
  let section = state.sections[state.sections.length - 1];
  if (section === undefined) {
    section = { title: null, pages: [], statements: [] };
    state.sections.push(section);
  }
  return section;
}

/** `state` after one event of the stream (unknown events are ignored, as SSE readers do). */
export function applyEvent(state: SummaryState, event: SSEEvent): SummaryState {
  const data = JSON.parse(event.data) as Record<string, unknown>;
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
      const error = data["error"] as { message?: unknown } | undefined;
      state.error = typeof error?.message === "string" ? error.message : "the summary failed";
      break;
    }
  }
  return state;
}

/** The summary as plain text, one statement per line with its pages: what a chat is given. */
export function summaryText(state: SummaryState): string {
  const lines: string[] = [];
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

/** Every event of `body`, applied to `state` in order; `onChange` after each. */
export async function readSummary(
  body: ReadableStream<Uint8Array>,
  state: SummaryState,
  onChange: (state: SummaryState) => void,
): Promise<SummaryState> {
  const parser = new SSEParser();
  const reader = body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    const messages = done ? parser.end() : parser.push(value);
    for (const message of messages) {
      if (message.kind === "event") {
        onChange(applyEvent(state, message));
      }
    }
    if (done) {
      return state;
    }
  }
}
