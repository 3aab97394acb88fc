/**
 * The DOM side of the page: turns in the conversation and the status line.
 *
 * Text is always set through `textContent`, never parsed as HTML, so nothing a model or a server
 * sends can inject markup.
 */

import type { Turn, TurnError } from "./storage";

const SPEAKERS = { user: "You", assistant: "Assistant" } as const;

/** One message on screen, updated in place while its answer streams. */
export class TurnView {
  readonly element: HTMLElement;
  private readonly content: HTMLElement;
  private readonly note: HTMLElement;
  private readonly error: HTMLElement;

  constructor(role: Turn["role"]) {
    this.element = element("article", `turn ${role}`);
    this.element.setAttribute("aria-label", SPEAKERS[role]);
    const speaker = element("h2", "speaker");
    speaker.textContent = SPEAKERS[role];
    this.content = element("div", "content");
    this.note = element("p", "note");
    this.error = element("p", "error");
    this.note.hidden = true;
    this.error.hidden = true;
    this.element.append(speaker, this.content, this.note, this.error);
  }

  setText(text: string): void {
    this.content.textContent = text;
  }

  /** While true, screen readers wait for the answer instead of reading every token. */
  setStreaming(streaming: boolean): void {
    this.element.setAttribute("aria-busy", String(streaming));
    this.element.classList.toggle("streaming", streaming);
  }

  /** Marks text left by a failed try, shown until the next try's text replaces it. */
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
}

export class ConversationView {
  constructor(private readonly container: HTMLElement) {}

  show(turns: readonly Turn[]): void {
    this.container.replaceChildren();
    for (const turn of turns) {
      const view = this.append(turn.role);
      view.setText(turn.content);
      view.setNote(turn.note);
      view.setError(turn.error);
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

function element(tag: string, className: string): HTMLElement {
  const node = document.createElement(tag);
  node.className = className;
  return node;
}
