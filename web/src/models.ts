/** The model picker's list, from the server's OpenAI-style `GET /v1/models`. */

import { errorMessage, RequestError, requestHeaders } from "./http";

export async function listModels(endpoint: string, apiKey: string, requestId: string): Promise<string[]> {
  let response: Response;
  try {
    response = await fetch(endpoint, { headers: requestHeaders(apiKey, requestId) });
  } catch (error) {
    throw new RequestError(`Could not reach the server: ${error instanceof Error ? error.message : String(error)}`, requestId, null);
  }
  if (!response.ok) {
    throw new RequestError(await errorMessage(response), requestId, response.status);
  }
  let body: { data?: { id?: unknown }[] };
  try {
    body = (await response.json()) as typeof body;
  } catch {
    throw new RequestError("The model list is not JSON", requestId, response.status);
  }
  return (body.data ?? []).flatMap((model) => (typeof model.id === "string" ? [model.id] : []));
}

/** The saved choice when the server still offers it, else the server's first model. */
export function pickModel(available: readonly string[], saved: string): string {
  return available.includes(saved) ? saved : (available[0] ?? "");
}
