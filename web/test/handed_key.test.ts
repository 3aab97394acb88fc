import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { keyFromFragment } from "../src/handed_key";

describe("keyFromFragment", () => {
  it("reads the key of #key=...", () => {
    assert.equal(keyFromFragment("#key=k3y-A_b"), "k3y-A_b");
    assert.equal(keyFromFragment("key=abc"), "abc");
  });

  it("decodes it and ignores other parameters", () => {
    assert.equal(keyFromFragment("#view=docs&key=a%2Bb"), "a+b");
  });

  it("is null when no usable key is there", () => {
    assert.equal(keyFromFragment(""), null);
    assert.equal(keyFromFragment("#"), null);
    assert.equal(keyFromFragment("#section-2"), null);
    assert.equal(keyFromFragment("#key="), null);
    assert.equal(keyFromFragment("#key=a%20b"), null); // a key holds no whitespace
  });
});
