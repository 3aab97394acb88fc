import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { backoffDelayMs, decideRetry, describeFailure, parseRetryAfter, type Failure, type RetryPolicy } from "../src/retry";
import { seededRandom } from "./seeded_random";

const POLICY: RetryPolicy = { maxAttempts: 4, baseDelayMs: 500, maxDelayMs: 8_000, maxRetryAfterMs: 60_000 };
const NOW = Date.UTC(2025, 0, 15, 12, 0, 0);

function http(status: number, retryAfter: string | null = null): Failure {
  return { kind: "http", status, retryAfter };
}

const NETWORK: Failure = { kind: "network" };

describe("parseRetryAfter", () => {
  it("reads delay-seconds", () => {
    assert.equal(parseRetryAfter("3", NOW), 3_000);
    assert.equal(parseRetryAfter(" 0 ", NOW), 0);
    assert.equal(parseRetryAfter("120", NOW), 120_000);
  });

  it("reads an HTTP date, and a past one as no wait", () => {
    assert.equal(parseRetryAfter("Wed, 15 Jan 2025 12:00:05 GMT", NOW), 5_000);
    assert.equal(parseRetryAfter("Wed, 15 Jan 2025 11:59:00 GMT", NOW), 0);
  });

  it("treats a missing or malformed value as absent", () => {
    for (const value of [null, "", "soon", "-1", "1.5", "in 5 s"]) {
      assert.equal(parseRetryAfter(value, NOW), null, String(value));
    }
  });
});

describe("backoffDelayMs", () => {
  it("doubles per failed try, capped at maxDelayMs, within the upper half of its ceiling", () => {
    const ceilings = [500, 1_000, 2_000, 4_000, 8_000, 8_000, 8_000];
    ceilings.forEach((ceiling, i) => {
      assert.equal(backoffDelayMs(i + 1, POLICY, () => 0), ceiling / 2);
      assert.equal(backoffDelayMs(i + 1, POLICY, () => 0.999999), ceiling);
    });
  });

  it("spreads clients that failed together", () => {
    const random = seededRandom(7);
    const delays = new Set(Array.from({ length: 50 }, () => backoffDelayMs(3, POLICY, random)));
    assert.ok(delays.size > 40, `only ${delays.size} distinct delays`);
    for (const delay of delays) {
      assert.ok(delay >= 1_000 && delay <= 2_000, String(delay));
    }
  });
});

describe("decideRetry", () => {
  const half = () => 0.5;

  it("waits exactly as long as a 429's Retry-After asks", () => {
    assert.deepEqual(decideRetry(http(429, "3"), 1, POLICY, Math.random, NOW), { retry: true, delayMs: 3_000 });
    assert.deepEqual(decideRetry(http(429, "Wed, 15 Jan 2025 12:00:02 GMT"), 2, POLICY, Math.random, NOW), {
      retry: true,
      delayMs: 2_000,
    });
  });

  it("backs off on a 429 without Retry-After", () => {
    assert.deepEqual(decideRetry(http(429), 2, POLICY, half, NOW), { retry: true, delayMs: 750 });
  });

  it("backs off exponentially with jitter on 503, 504 and network failures", () => {
    for (const failure of [http(503), http(504), NETWORK]) {
      assert.deepEqual(decideRetry(failure, 1, POLICY, half, NOW), { retry: true, delayMs: 375 });
      assert.deepEqual(decideRetry(failure, 3, POLICY, half, NOW), { retry: true, delayMs: 1_500 });
    }
  });

  it("never comes back sooner than a 503's Retry-After", () => {
    assert.deepEqual(decideRetry(http(503, "5"), 1, POLICY, half, NOW), { retry: true, delayMs: 5_000 });
    assert.deepEqual(decideRetry(http(503, "1"), 3, POLICY, half, NOW), { retry: true, delayMs: 1_500 });
  });

  it("stops after maxAttempts tries", () => {
    for (const failure of [http(429, "1"), http(503), http(504), NETWORK]) {
      assert.equal(decideRetry(failure, POLICY.maxAttempts - 1, POLICY, half, NOW).retry, true);
      const last = decideRetry(failure, POLICY.maxAttempts, POLICY, half, NOW);
      assert.deepEqual(last, { retry: false, reason: "gave up after 4 tries" });
    }
  });

  it("gives up at once on a Retry-After longer than maxRetryAfterMs", () => {
    const decision = decideRetry(http(429, "3600"), 1, POLICY, half, NOW);
    assert.deepEqual(decision, { retry: false, reason: "the server asks to wait 3600 s" });
  });

  it("never retries other statuses", () => {
    for (const status of [400, 401, 403, 404, 413, 422, 500, 502]) {
      assert.deepEqual(decideRetry(http(status, "1"), 1, POLICY, half, NOW), { retry: false, reason: "not retryable" });
    }
  });
});

describe("describeFailure", () => {
  it("names each retryable failure", () => {
    assert.equal(describeFailure(http(429)), "Rate limited");
    assert.equal(describeFailure(http(503)), "Server busy");
    assert.equal(describeFailure(http(504)), "Gateway timed out");
    assert.equal(describeFailure(NETWORK), "Connection lost");
  });
});
