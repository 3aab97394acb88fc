/**
 * When to try a failed request again, and how long to wait first.
 *
 * 429 waits as long as the server's Retry-After asks; 503, 504 and network failures back off
 * exponentially with jitter, so clients that failed together do not come back together. Every
 * other status is final: trying again would get the same answer.
 */

export interface RetryPolicy {
  /** Tries in all, the first one included. */
  readonly maxAttempts: number;
  /** The backoff before the second try; it doubles for each try after that. */
  readonly baseDelayMs: number;
  /** The longest backoff between two tries. */
  readonly maxDelayMs: number;
  /** The longest Retry-After worth waiting for; a longer one ends the request at once. */
  readonly maxRetryAfterMs: number;
}

export const DEFAULT_RETRY_POLICY: RetryPolicy = {
  maxAttempts: 4,
  baseDelayMs: 500,
  maxDelayMs: 8_000,
  maxRetryAfterMs: 120_000,
};

/** Why one try failed: an HTTP status (with its Retry-After header), or no response at all. */
export type Failure =
  | { readonly kind: "http"; readonly status: number; readonly retryAfter: string | null }
  | { readonly kind: "network" };

export type RetryDecision =
  | { readonly retry: true; readonly delayMs: number }
  | { readonly retry: false; readonly reason: string };

/** Retry-After in milliseconds from `nowMs`: delay-seconds or an HTTP date; null when absent or malformed. */
export function parseRetryAfter(value: string | null, nowMs: number): number | null {
  if (value === null) {
    return null;
  }
  const text = value.trim();
  if (/^\d+$/.test(text)) {
    return Number(text) * 1000;
  }
  const date = Date.parse(text);
  if (Number.isNaN(date) || !/[a-z]/i.test(text)) {
    return null;
  }
  return Math.max(0, date - nowMs);
}

/**
 * The wait after `numFailed` failed tries: an exponential ceiling (base, 2 base, 4 base, ... up to
 * maxDelayMs) of which a random upper half is taken, so the wait is never zero but always spread.
 */
export function backoffDelayMs(numFailed: number, policy: RetryPolicy, random: () => number): number {
  const ceiling = Math.min(policy.maxDelayMs, policy.baseDelayMs * 2 ** Math.max(0, numFailed - 1));
  return Math.round(ceiling / 2 + random() * (ceiling / 2));
}

/** Whether to try again after `numFailed` tries have failed, the last one with `failure`. */
export function decideRetry(
  failure: Failure,
  numFailed: number,
  policy: RetryPolicy,
  random: () => number,
  nowMs: number,
): RetryDecision {
  if (!isRetryable(failure)) {
    return { retry: false, reason: "not retryable" };
  }
  if (numFailed >= policy.maxAttempts) {
    return { retry: false, reason: `gave up after ${numFailed} tries` };
  }
  const backoff = backoffDelayMs(numFailed, policy, random);
  if (failure.kind === "network") {
    return { retry: true, delayMs: backoff };
  }
  const retryAfter = parseRetryAfter(failure.retryAfter, nowMs);
  if (retryAfter !== null && retryAfter > policy.maxRetryAfterMs) {
    return { retry: false, reason: `the server asks to wait ${Math.ceil(retryAfter / 1000)} s` };
  }
  if (failure.status === 429) {
    return { retry: true, delayMs: retryAfter ?? backoff };
  }
  // 503/504: back off, but never come back sooner than the server asked.
  return { retry: true, delayMs: Math.max(backoff, retryAfter ?? 0) };
}

export function isRetryable(failure: Failure): boolean {
  return failure.kind === "network" || failure.status === 429 || failure.status === 503 || failure.status === 504;
}

/** Words for the status line while waiting to try again. */
export function describeFailure(failure: Failure): string {
  if (failure.kind === "network") {
    return "Connection lost";
  }
  switch (failure.status) {
    case 429:
      return "Rate limited";
    case 503:
      return "Server busy";
    case 504:
      return "Gateway timed out";
    default:
      return `HTTP ${failure.status}`;
  }
}
