import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { SSEParser, type SSEMessage } from "../src/sse";
import { seededRandom } from "./seeded_random";

const encoder = new TextEncoder();

function parseChunks(chunks: readonly Uint8Array[]): SSEMessage[] {
  const parser = new SSEParser();
  return [...chunks.flatMap((chunk) => parser.push(chunk)), ...parser.end()];
}

function parseText(text: string): SSEMessage[] {
  return parseChunks([encoder.encode(text)]);
}

function event(data: string, extra: { event?: string; id?: string } = {}): SSEMessage {
  return { kind: "event", event: extra.event ?? "message", data, id: extra.id ?? null };
}

/** `bytes` cut at `numCuts` random offsets (a cut may fall inside a UTF-8 character). */
function randomSplit(bytes: Uint8Array, numCuts: number, random: () => number): Uint8Array[] {
  const cuts = Array.from({ length: numCuts }, () => Math.floor(random() * (bytes.length + 1))).sort((a, b) => a - b);
  const chunks: Uint8Array[] = [];
  let start = 0;
  for (const cut of [...cuts, bytes.length]) {
    chunks.push(bytes.subarray(start, cut)); // empty chunks included: the parser must take them
    start = cut;
  }
  return chunks;
}

// A chat stream as rebar sends it, with pings, multi-byte text (2-, 3- and 4-byte UTF-8) and the end marker.
const CHAT_STREAM = [
  'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n',
  ": ping\n\n",
  'data: {"choices":[{"delta":{"content":"Café "}}]}\n\n',
  'data: {"choices":[{"delta":{"content":"北京 "}}]}\n\n',
  ": ping\n\n",
  'data: {"choices":[{"delta":{"content":"🙂🚀"}}]}\n\n',
  'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n',
  "data: [DONE]\n\n",
].join("");

const CHAT_MESSAGES: SSEMessage[] = [
  event('{"choices":[{"delta":{"role":"assistant"}}]}'),
  { kind: "comment", text: "ping" },
  event('{"choices":[{"delta":{"content":"Café "}}]}'),
  event('{"choices":[{"delta":{"content":"北京 "}}]}'),
  { kind: "comment", text: "ping" },
  event('{"choices":[{"delta":{"content":"🙂🚀"}}]}'),
  event('{"choices":[{"delta":{},"finish_reason":"stop"}]}'),
  event("[DONE]"),
];

describe("SSEParser", () => {
  it("parses a whole chat stream: events, ping comments and [DONE]", () => {
    assert.deepEqual(parseText(CHAT_STREAM), CHAT_MESSAGES);
  });

  it("gives the same messages however the bytes are split", () => {
    const bytes = encoder.encode(CHAT_STREAM);
    const random = seededRandom(20240521);
    for (let round = 0; round < 300; round++) {
      const chunks = randomSplit(bytes, 1 + Math.floor(random() * 40), random);
      assert.deepEqual(parseChunks(chunks), CHAT_MESSAGES, `round ${round}`);
    }
  });

  it("keeps a multi-byte character whole when any cut falls inside it", () => {
    const text = 'data: {"content":"a🙂é中"}\n\n';
    const bytes = encoder.encode(text);
    for (let cut = 0; cut <= bytes.length; cut++) {
      const messages = parseChunks([bytes.subarray(0, cut), bytes.subarray(cut)]);
      assert.deepEqual(messages, [event('{"content":"a🙂é中"}')], `cut at byte ${cut}`);
    }
  });

  it("takes the stream one byte at a time", () => {
    const bytes = encoder.encode(CHAT_STREAM);
    const chunks = Array.from(bytes, (_, i) => bytes.subarray(i, i + 1));
    assert.deepEqual(parseChunks(chunks), CHAT_MESSAGES);
  });

  it("emits each event as soon as its blank line arrives", () => {
    const parser = new SSEParser();
    assert.deepEqual(parser.push(encoder.encode("data: one\n")), []);
    assert.deepEqual(parser.push(encoder.encode("\ndata: tw")), [event("one")]);
    assert.deepEqual(parser.push(encoder.encode("o\n\n")), [event("two")]);
  });

  it("accepts LF, CRLF and CR line endings, also with CRLF split across chunks", () => {
    const expected = [event("a"), event("b"), event("c")];
    assert.deepEqual(parseText("data: a\n\ndata: b\n\ndata: c\n\n"), expected);
    assert.deepEqual(parseText("data: a\r\n\r\ndata: b\r\n\r\ndata: c\r\n\r\n"), expected);
    assert.deepEqual(parseText("data: a\r\rdata: b\r\rdata: c\r\r"), expected);
    const split = ["data: a\r", "\n\r", "\ndata: b\r", "", "\n\r\n", "data: c\r\n\r", "\n"].map((s) => encoder.encode(s));
    assert.deepEqual(parseChunks(split), expected);
  });

  it("joins data lines with newlines and reads event and id fields", () => {
    const text = "event: update\nid: 7\ndata: first\ndata:second\ndata\n\n";
    assert.deepEqual(parseText(text), [event("first\nsecond\n", { event: "update", id: "7" })]);
  });

  it("keeps the last event id for later events, and resets the event type", () => {
    assert.deepEqual(parseText("id: 1\nevent: x\ndata: a\n\ndata: b\n\n"), [
      event("a", { event: "x", id: "1" }),
      event("b", { id: "1" }),
    ]);
  });

  it("ignores blank lines without data, retry fields and unknown fields", () => {
    assert.deepEqual(parseText("\n\nretry: 100\n\nfoo: bar\ndata: x\n\n"), [event("x")]);
  });

  it("reports comments, with or without a space after the colon", () => {
    assert.deepEqual(parseText(": ping\n:keep-alive\n\n"), [
      { kind: "comment", text: "ping" },
      { kind: "comment", text: "keep-alive" },
    ]);
  });

  it("drops an event cut off before its blank line", () => {
    assert.deepEqual(parseText("data: whole\n\ndata: cut off"), [event("whole")]);
    assert.deepEqual(parseText("data: whole\n\ndata: cut off\n"), [event("whole")]);
  });

  it("strips a byte order mark at the start", () => {
    const bytes = new Uint8Array([0xef, 0xbb, 0xbf, ...encoder.encode("data: x\n\n")]);
    assert.deepEqual(parseChunks([bytes.subarray(0, 2), bytes.subarray(2)]), [event("x")]);
  });
});
