/**
 * The Documents view: pick (or drop) a file, summarise it on the server with progress per chunk,
 * read the summary with its page references, then ask about it in the chat (the summary becomes
 * the chat's system prompt). Text is set through `textContent` only.
 */

import { RequestError, errorMessage, requestHeaders } from "./http";
import { cite, emptySummary, readSummary, summaryText, type SummaryState } from "./document_summary";
import { newRequestId } from "./request_id";

const SUMMARIZE_ENDPOINT = "/v1/documents/summarize";

export interface DocumentsElements {
  readonly file: HTMLInputElement;
  readonly dropZone: HTMLElement;
  readonly style: HTMLSelectElement;
  readonly summarize: HTMLButtonElement;
  readonly stop: HTMLButtonElement;
  readonly progress: HTMLElement;
  readonly summary: HTMLElement;
  readonly ask: HTMLButtonElement;
  readonly model: HTMLSelectElement;
  readonly apiKey: HTMLInputElement;
  readonly systemPrompt: HTMLTextAreaElement;
  readonly prompt: HTMLTextAreaElement;
}

export class DocumentsPanel {
  private controller: AbortController | null = null;
  private state: SummaryState = emptySummary();
  private fileName = "";

  constructor(private readonly el: DocumentsElements) {}

  start(): void {
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

  private async summarize(): Promise<void> {
    const file = this.el.file.files?.[0];
    if (file === undefined || this.controller !== null) {
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
        signal: controller.signal,
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

  private setBusy(busy: boolean): void {
    this.el.summarize.disabled = busy;
    this.el.stop.disabled = !busy;
    this.el.ask.disabled = busy || !this.state.done;
  }

  private show(state: SummaryState): void {
    const name = this.fileName;
    const status = state.error !== null ? `error: ${state.error}` : state.done ? "done" : state.progress;
    this.el.progress.textContent = `${name}: ${status}`;
    this.el.summary.replaceChildren(...state.sections.map((section) => sectionElement(section)));
    this.el.ask.disabled = !state.done;
  }

  /** The summary as the chat's system prompt, and the prompt box ready for a question. */
  private askInChat(): void {
    const intro = `You answer questions about the document "${this.fileName}". Its summary, with page references:`;
    this.el.systemPrompt.value = `${intro}\n${summaryText(this.state)}`;
    this.el.systemPrompt.dispatchEvent(new Event("change", { bubbles: true }));
    this.el.prompt.focus();
  }
}

function sectionElement(section: SummaryState["sections"][number]): HTMLElement {
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
