/** Time to first token and decode speed of one answer, for the line under it. */

import type { Answer } from "./chat_stream";

export interface AnswerStats {
  /** From the start of the try that produced the answer to its first output (reasoning included). */
  readonly ttftMs: number | null;
  /** Tokens after the first one, over the time between the first and the last. */
  readonly tokensPerSecond: number | null;
  readonly numTokens: number;
}

export function answerStats(answer: Answer): AnswerStats {
  const { firstTokenAt, lastTokenAt, numTokens } = answer;
  const ttftMs = firstTokenAt === null ? null : firstTokenAt - answer.startedAt;
  let tokensPerSecond: number | null = null;
  if (firstTokenAt !== null && lastTokenAt !== null && lastTokenAt > firstTokenAt && numTokens > 1) {
    tokensPerSecond = ((numTokens - 1) * 1000) / (lastTokenAt - firstTokenAt);
  }
  return { ttftMs, tokensPerSecond, numTokens };
}

export function formatStats(stats: AnswerStats): string {
  const parts: string[] = [];
  if (stats.ttftMs !== null) {
    parts.push(`first token ${(stats.ttftMs / 1000).toFixed(2)} s`);
  }
  if (stats.tokensPerSecond !== null) {
    parts.push(`${stats.tokensPerSecond.toFixed(1)} tokens/s`);
  }
  parts.push(`${stats.numTokens} ${stats.numTokens === 1 ? "token" : "tokens"}`);
  return parts.join(" · ");
}
