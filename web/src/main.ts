/** Entry point of the chat page: find its elements and start it. */

import { ChatPage, type PageElements } from "./chat_page";
import { DocumentsPanel } from "./documents_panel";

function byId<T extends HTMLElement>(id: string, type: new () => T): T {
  const node = document.getElementById(id);
  if (!(node instanceof type)) {
    throw new Error(`the page has no <${type.name}> with id "${id}"`);
  }
  return node;
}

const elements: PageElements = {
  model: byId("model", HTMLSelectElement),
  newChat: byId("new-chat", HTMLButtonElement),
  systemPrompt: byId("system-prompt", HTMLTextAreaElement),
  temperature: byId("temperature", HTMLInputElement),
  maxTokens: byId("max-tokens", HTMLInputElement),
  apiKey: byId("api-key", HTMLInputElement),
  conversation: byId("conversation", HTMLElement),
  status: byId("status", HTMLElement),
  composer: byId("composer", HTMLFormElement),
  prompt: byId("prompt", HTMLTextAreaElement),
  send: byId("send", HTMLButtonElement),
  stop: byId("stop", HTMLButtonElement),
};

new ChatPage(elements).start();
new DocumentsPanel({
  file: byId("document-file", HTMLInputElement),
  dropZone: byId("document-drop", HTMLElement),
  style: byId("document-style", HTMLSelectElement),
  summarize: byId("document-summarize", HTMLButtonElement),
  stop: byId("document-stop", HTMLButtonElement),
  progress: byId("document-progress", HTMLElement),
  summary: byId("document-summary", HTMLElement),
  ask: byId("document-ask", HTMLButtonElement),
  model: elements.model,
  apiKey: elements.apiKey,
  systemPrompt: elements.systemPrompt,
  prompt: elements.prompt,
}).start();
