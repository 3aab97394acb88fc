import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { applyEvent, cite, emptySummary, readSummary, summaryText } from "../src/document_summary";

const encoder = new TextEncoder();

function body(text: string, pieces: number): ReadableStream<Uint8Array> {
  const bytes = encoder.encode(text);
  const size = Math.ceil(bytes.length / pieces);
  return new ReadableStream({
    start(controller) {
      for (let start = 0; start < bytes.length; start += size) {
        controller.enqueue(bytes.subarray(start, start + size));
      }
      controller.close();
    },
  });
}

const STREAM = [
  'event: planned\ndata: {"num_chunks": 2, "chunk_tokens": 300, "num_sections": 2, "cached": false}\n\n',
  'event: progress\ndata: {"stage": "chunk", "done": 1, "total": 2, "pages": [1, 2], "level": 0}\n\n',
  'event: progress\ndata: {"stage": "chunk", "done": 2, "total": 2, "pages": [3], "level": 0}\n\n',
  'event: section\ndata: {"title": "Queens", "pages": [1, 2]}\n\n',
  'event: statement\ndata: {"text": "A queen lays eggs.", "pages": [1], "rendered": "x"}\n\n',
  'event: section\ndata: {"title": "Drones", "pages": [3]}\n\n',
  'event: statement\ndata: {"text": "Drones mate \\u00e9.", "pages": [], "rendered": "x"}\n\n',
  'event: summary\ndata: {"style": "per_section", "cached": false}\n\n',
].join("");

describe("document summary events", () => {
  it("builds sections, statements and progress in order, however the body is cut", async () => {
    for (const pieces of [1, 7, STREAM.length]) {
      const seen: string[] = [];
      const state = await readSummary(body(STREAM, pieces), emptySummary(), (s) => seen.push(s.progress));
      assert.equal(state.done, true);
      assert.equal(state.numChunks, 2);
      assert.equal(state.requestsDone, 2);
      assert.deepEqual(
        state.sections.map((s) => [s.title, s.statements.map((t) => t.text)]),
        [["Queens", ["A queen lays eggs."]], ["Drones", ["Drones mate é."]]],
      );
      assert.ok(seen.includes("chunk 2/2 (p. 3)"));
      assert.equal(
        summaryText(state),
        "Queens (pp. 1, 2):\n- A queen lays eggs. [p. 1]\nDrones (p. 3):\n- Drones mate é. [no source found]",
      );
    }
  });

  it("puts statements without a section in an untitled one, and reads errors", () => {
    const state = emptySummary();
    applyEvent(state, { kind: "event", event: "statement", data: '{"text": "Bees.", "pages": [2, 5]}', id: null });
    applyEvent(state, { kind: "event", event: "error", data: '{"error": {"message": "engine failed"}}', id: null });
    assert.equal(summaryText(state), "- Bees. [pp. 2, 5]");
    assert.equal(state.error, "engine failed");
    assert.equal(state.done, false);
  });

  it("cites pages as the server renders them", () => {
    assert.equal(cite([4]), "p. 4");
    assert.equal(cite([1, 3]), "pp. 1, 3");
    assert.equal(cite([]), "no source found");
  });
});
