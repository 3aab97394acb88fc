"""Grammar-constrained decoding: a `StructuredOutput` compiled into a matcher that says, before
every token, which tokens keep the output valid.

The work is llguidance's (a Rust library made for it: JSON Schema, Lark and regex grammars, a
token mask in tens of microseconds; measured against xgrammar in docs/structured-outputs.md).
`Grammars` holds one model's grammar tokenizer and a cache of compiled grammars: a schema is
checked and compiled once, then every request using it starts from a copy of the compiled
matcher. `TokenMasks` fills the step's bitmasks for the constrained rows; the sampler applies them.

A matcher follows one sequence: the core feeds it each token appended (`consume`). Preemption
keeps a request's tokens, so its matcher stays where it was; abort and finish simply drop it.
Draft tokens (speculative decoding) never move it: `valid_drafts` and the masks of positions after
drafts consume them for a moment and roll them back, so only tokens the sequence keeps advance it.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import torch

from rebar.engine.structured import StructuredOutput
from rebar.errors import InvalidRequestError
from rebar.kernels.token_mask import apply_token_bitmask_, bitmask_words
from rebar.model.tokenizer import Tokenizer
from rebar.timing import FINE_BUCKETS, DurationHistogram

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON is written with json.dumps' separators and no other whitespace: a small model given free
# whitespace can spend its whole budget on newlines, and these are the spellings models know best.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
CACHE_SIZE = 128  # compiled grammars kept (least recently used dropped first)


class Grammars:
    """Compiled grammars for one model: `check` before admitting, `matcher` per sequence.

    Thread-safe: the server checks on a worker thread while the engine thread makes matchers. The
    grammar tokenizer is built on first use (0.2-0.4 s for a 49k vocabulary, 2.4-3.4 s for 262k),
    so a service that never sees a structured request never pays for it.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # logits per row: may exceed the tokenizer's ids
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()

    def check(self, spec: StructuredOutput) -> None:
        """Raise InvalidRequestError naming the problem when `spec` cannot be followed."""
        self._compiled_matcher(spec)

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one sequence (raises InvalidRequestError like `check`)."""
        return GrammarMatcher(self._compiled_matcher(spec).deep_copy())

    def _compiled_matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
            compiled = self._compile(spec)
            self._compiled[spec] = compiled
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return compiled

    def _compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        try:
            grammar = grammar_text(spec)
        except ValueError as exc:
            raise InvalidRequestError(f"{_what(spec)} cannot be used: {exc}", spec.param) from exc
        tokenizer = self._grammar_tokenizer(spec.param)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidRequestError(f"{_what(spec)} cannot be used: {error.strip()}", spec.param)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"{_what(spec)} cannot be used: {matcher.get_error()}", spec.param
            )
        return matcher

    def _grammar_tokenizer(self, param: str) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            try:
                self._lltokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(),
                    n_vocab=self.vocab_size,
                    eos_token=list(self._tokenizer.special.eos_token_ids),
                )
            except ValueError as exc:  # a tokenizer whose token bytes it cannot work out
                raise InvalidRequestError(
                    f"this model's tokenizer does not support constrained outputs: {exc}", param
                ) from exc
        return self._lltokenizer


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar for `spec`."""
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    return llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(spec.schema()), defaults=JSON_OPTIONS
    )


def _what(spec: StructuredOutput) -> str:
    return "the grammar" if spec.kind == "lark" else "the JSON schema"


class GrammarMatcher:
    """Where one sequence stands in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def consume(self, token_id: int) -> bool:
        """Advance past `token_id`; False when the grammar does not allow it (the matcher is then
        in error and the sequence cannot go on)."""
        return self._matcher.consume_token(token_id)

    def valid_drafts(self, draft_token_ids: tuple[int, ...]) -> int:
        """How many leading draft tokens the grammar allows from here, stopping before the output
        would be complete (nothing may follow that); the matcher is left as it was."""
        count = self._matcher.validate_tokens(list(draft_token_ids))
        if count == 0:
            return 0
        # validate_tokens does not say where the grammar ends: walk the allowed ones to find out.
        consumed = 0
        for token_id in draft_token_ids[:count]:
            self._matcher.consume_token(token_id)
            consumed += 1
            if self._matcher.is_stopped():
                break
        stopped = self._matcher.is_stopped()
        self.rollback(consumed)
        return consumed - 1 if stopped else consumed

    @property
    def done(self) -> bool:
        """The output is complete: the grammar allows nothing more but the end of sequence."""
        return self._matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` consumed."""
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"the grammar could not roll back {num_tokens} tokens")

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` ([rows, words] int32,
        contiguous)."""
        row_bytes = bitmask.shape[1] * 4
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)


class TokenMasks:
    """Fills each step's bitmasks for the constrained rows; `seconds` times the mask work of a step
    (filling plus applying: what structured outputs add to it)."""

    def __init__(self, vocab_size: int) -> None:
        self.words = bitmask_words(vocab_size)
        self.seconds = DurationHistogram.empty(FINE_BUCKETS)

    def fill(self, matchers: list[tuple[int, GrammarMatcher]]) -> StepMask:
        """What row `matchers[j][0]` of the step's logits may take next, from `matchers[j][1]`."""
        return self.fill_with_drafts([(row, matcher, ()) for row, matcher in matchers])

    def fill_with_drafts(
        self, matchers: list[tuple[int, GrammarMatcher, tuple[int, ...]]]
    ) -> StepMask:
        """Masks for a sequence's rows `row, row + 1, ...`: what its grammar allows next, then
        after each of its draft tokens in turn (which it must allow; see `valid_drafts`)."""
        started = time.perf_counter()
        num_rows = sum(1 + len(drafts) for _, _, drafts in matchers)
        bitmask = torch.empty((num_rows, self.words), dtype=torch.int32)
        rows: list[int] = []
        for row, matcher, drafts in matchers:
            for offset in range(len(drafts) + 1):
                if offset:
                    consumed = matcher.consume(drafts[offset - 1])
                    assert consumed, "drafts are checked with valid_drafts first"
                matcher.fill(bitmask, len(rows))
                rows.append(row + offset)
            matcher.rollback(len(drafts))
        return StepMask(rows, bitmask, started, self.seconds)


@dataclass
class StepMask:
    """One step's bitmasks: `bitmask[j]` for row `rows[j]` of the step's logits."""

    rows: list[int]
    bitmask: torch.Tensor
    started: float  # time.perf_counter() when filling began
    seconds: DurationHistogram

    def for_row(self, row: int) -> StepMask | None:
        """This mask for row `row` alone, as row 0 (None when it does not constrain that row)."""
        if row not in self.rows:
            return None
        j = self.rows.index(row)
        return StepMask([0], self.bitmask[j : j + 1], self.started, self.seconds)

    def apply_(self, logits: torch.Tensor) -> list[int]:
        """Forbidden tokens of the masked rows to -inf, in place (the sampler's processed copy);
        returns how many tokens each row still allows."""
        allowed = apply_token_bitmask_(logits, self.bitmask, self.rows)
        self.seconds.observe(time.perf_counter() - self.started)
        return allowed
