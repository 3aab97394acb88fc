/** What every call to the rebar API shares: headers, and reading an OpenAI-style error body. */

export function requestHeaders(apiKey: string, requestId: string): Record<string, string> {
  const headers: Record<string, string> = { "X-Request-ID": requestId };
  if (apiKey.trim() !== "") {
    headers["Authorization"] = `Bearer ${apiKey.trim()}`;
  }
  return headers;
}

/** The `error.message` of an OpenAI-style body, or the status line when the body is not one. */
export async function errorMessage(response: Response): Promise<string> {
  const fallback = `HTTP ${response.status}${response.statusText ? " " + response.statusText : ""}`;
  let body: unknown;
  try {
    body = await response.json();
  } catch {
    return fallback;
  }
  if (typeof body === "object" && body !== null && "error" in body) {
    const error = (body as { error: unknown }).error;
    if (typeof error === "object" && error !== null && "message" in error && typeof error.message === "string") {
      return error.message;
    }
  }
  return fallback;
}

/** An error a user can quote: the message and the id of the request that failed. */
export class RequestError extends Error {
  constructor(
    message: string,
    readonly requestId: string,
    readonly status: number | null,
  ) {
    super(message);
    this.name = "RequestError";
  }
}
