import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { formatArguments, mergeToolCallDeltas, type ToolCall } from "../src/tool_calls";

/** Each chunk's `delta.tool_calls` applied in turn, as a stream does. */
function merged(...chunks: unknown[]): readonly ToolCall[] {
  return chunks.reduce<readonly ToolCall[]>((calls, deltas) => mergeToolCallDeltas(calls, deltas), []);
}

describe("mergeToolCallDeltas", () => {
  it("keeps the first entry's id and name and adds up the argument fragments", () => {
    const calls = merged(
      [{ index: 0, id: "call_1", type: "function", function: { name: "get_weather", arguments: "" } }],
      [{ index: 0, function: { arguments: '{"ci' } }],
      [{ index: 0, function: { arguments: 'ty": "Rome"' } }],
      [{ index: 0, function: { arguments: "}" } }],
    );
    assert.deepEqual(calls, [{ index: 0, id: "call_1", name: "get_weather", arguments: '{"city": "Rome"}' }]);
  });

  it("keeps several calls apart by index, in index order, however their entries arrive", () => {
    const calls = merged(
      [
        { index: 1, id: "call_b", function: { name: "add", arguments: '{"a":' } },
        { index: 0, id: "call_a", function: { name: "get_weather", arguments: "{" } },
      ],
      [{ index: 0, function: { arguments: "}" } }],
      [{ index: 1, function: { arguments: "1}" } }],
    );
    assert.deepEqual(calls, [
      { index: 0, id: "call_a", name: "get_weather", arguments: "{}" },
      { index: 1, id: "call_b", name: "add", arguments: '{"a":1}' },
    ]);
  });

  it("starts the next call at a new id when the server leaves the index out", () => {
    const calls = merged(
      [{ id: "call_a", function: { name: "f", arguments: "{" } }],
      [{ function: { arguments: "}" } }],
      [{ id: "call_b", function: { name: "g", arguments: "{}" } }],
    );
    assert.deepEqual(
      calls.map((c) => [c.index, c.id, c.name, c.arguments]),
      [
        [0, "call_a", "f", "{}"],
        [1, "call_b", "g", "{}"],
      ],
    );
  });

  it("returns the calls unchanged when a chunk has no tool-call entries", () => {
    const calls = merged([{ index: 0, id: "call_a", function: { name: "f", arguments: "{}" } }]);
    for (const nothing of [undefined, null, "text", [], [null, 3]]) {
      assert.equal(mergeToolCallDeltas(calls, nothing), calls);
    }
    assert.deepEqual(mergeToolCallDeltas([], undefined), []);
  });
});

describe("formatArguments", () => {
  it("pretty-prints whole JSON arguments", () => {
    assert.equal(formatArguments('{"city":"Paris","days":[1,2]}'), '{\n  "city": "Paris",\n  "days": [\n    1,\n    2\n  ]\n}');
  });

  it("shows arguments still arriving, or not JSON at all, as they came", () => {
    for (const text of ["", '{"city": "Par', "city=Paris", "12", '"a string"']) {
      assert.equal(formatArguments(text), text);
    }
  });
});
