/**
 * The DOM side of the page: turns in the conversation and the status line.
 *
 * Text is always set through `textContent`, never parsed as HTML, so nothing a model or a server
 * sends can inject markup.
 */

import type { Output } from "./chat_stream";
import type { Turn, TurnError } from "./storage";
import { formatArguments, type ToolCall } from "./tool_calls";

const SPEAKERS = { user: "You", assistant: "Assistant" } as const;

/**
 * One message on screen, updated in place while its answer streams: a collapsed reasoning block
 * above the text and a block per tool call below it, each there only when the answer has one.
 */
export class TurnView {
  readonly element: HTMLElement;
  private readonly reasoning: HTMLDetailsElement;
  private readonly reasoningText: HTMLElement;
  private readonly content: HTMLElement;
  private readonly toolCalls: HTMLElement;
  private readonly callBlocks: ToolCallBlock[] = [];
  private readonly note: HTMLElement;
  private readonly error: HTMLElement;

  constructor(role: Turn["role"]) {
    this.element = element("article", `turn ${role}`);
    this.element.setAttribute("aria-label", SPEAKERS[role]);
    const speaker = element("h2", "speaker");
    speaker.textContent = SPEAKERS[role];
    // Closed by default: the answer is what most readers came for.
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
  showTurn(turn: Turn): void {
    this.setOutput({ text: turn.content, reasoning: turn.reasoning, toolCalls: turn.toolCalls });
    this.setNote(turn.note);
    this.setError(turn.error);
  }

  setOutput(output: Output): void {
    this.reasoningText.textContent = output.reasoning;
    this.reasoning.hidden = output.reasoning === "";
    this.content.textContent = output.text;
    this.setToolCalls(output.toolCalls);
  }

  /** While true, screen readers wait for the answer instead of reading every token. */
  setStreaming(streaming: boolean): void {
    this.element.setAttribute("aria-busy", String(streaming));
    this.element.classList.toggle("streaming", streaming);
  }

  /** Marks output left by a failed try, shown until the next try's output replaces it. */
  setStale(stale: boolean): void {
    this.element.classList.toggle("stale", stale);
  }

  setNote(note: string): void {
    this.note.textContent = note;
    this.note.hidden = note === "";
  }

  setError(error: TurnError | null): void {
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
  private setToolCalls(calls: readonly ToolCall[]): void {
    this.callBlocks.splice(calls.length).forEach((block) => block.element.remove());
    calls.forEach((call, i) => {
      let block = this.callBlocks[i];
      if (block === undefined) {
        block = new ToolCallBlock();
        this.callBlocks.push(block);
        this.toolCalls.append(block.element);
      }
      block.show(call);
    });
    this.toolCalls.hidden = calls.length === 0;
  }
}

export class ConversationView {
  constructor(private readonly container: HTMLElement) {}

  show(turns: readonly Turn[]): void {
    this.container.replaceChildren();
    for (const turn of turns) {
      this.append(turn.role).showTurn(turn);
    }
    this.scrollToEnd(true);
  }

  append(role: Turn["role"]): TurnView {
    const view = new TurnView(role);
    this.container.append(view.element);
    return view;
  }

  /** Follow a growing answer, unless the reader has scrolled up to read something else. */
  scrollToEnd(force = false): void {
    const c = this.container;
    const nearEnd = c.scrollHeight - c.scrollTop - c.clientHeight < 80;
    if (force || nearEnd) {
      c.scrollTop = c.scrollHeight;
    }
  }
}

/** The one line above the composer that says what is happening (retrying, stopped, failed). */
export class StatusLine {
  private timer: ReturnType<typeof setInterval> | null = null;

  constructor(private readonly line: HTMLElement) {}

  show(text: string, kind: "info" | "error" = "info"): void {
    this.stopCountdown();
    this.line.textContent = text;
    this.line.dataset["kind"] = kind;
  }

  /** `render(seconds)` every second until `delayMs` has passed (or the next `show`/`clear`). */
  countdown(delayMs: number, render: (seconds: number) => string): void {
    const endsAt = Date.now() + delayMs;
    const tick = (): void => {
      this.line.textContent = render(Math.max(0, Math.ceil((endsAt - Date.now()) / 1000)));
    };
    this.show("");
    tick();
    this.timer = setInterval(tick, 250);
  }

  clear(): void {
    this.show("");
  }

  private stopCountdown(): void {
    if (this.timer !== null) {
      clearInterval(this.timer);
      this.timer = null;
    }
  }
}

/** One tool call under an answer: "Tool call <name>", then its arguments. */
class ToolCallBlock {
  readonly element = element("section", "tool-call");
  private readonly name = element("code", "tool-name");
  private readonly arguments = element("pre", "tool-arguments");

  constructor() {
    const heading = element("p", "tool-call-heading");
    heading.append("Tool call ", this.name);
    this.element.append(heading, this.arguments);
  }

  show(call: ToolCall): void {
    this.name.textContent = call.name;
    this.arguments.textContent = formatArguments(call.arguments);
  }
}

function element(tag: string, className: string): HTMLElement {
  const node = document.createElement(tag);
  node.className = className;
  return node;
}
