/**
 * A fresh id for one HTTP request, sent as X-Request-ID so the server's logs and the error a user
 * quotes name the same request.
 *
 * Built from `crypto.getRandomValues`, which (unlike `crypto.randomUUID`) also exists when the
 * page is served over plain HTTP from a non-local address.
 */
export function newRequestId(): string {
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return "web-" + Array.from(bytes, (byte) => byte.toString(16).padStart(2, "0")).join("");
}
