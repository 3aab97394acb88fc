"""A request's one check, before any of it runs: the prompt fits the vocabulary and the context
window, the params name only tokens the model has, and a structured output's schema or grammar
compiles. Pure (no torch; the grammar check is handed in), so a front end in another process
checks requests exactly as the core would."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rebar.engine.request import AdmittedRequest
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.structured import StructuredOutput
from rebar.errors import InvalidRequestError


class GrammarCheck(Protocol):
    """Raises InvalidRequestError when a structured output cannot be followed
    (`rebar.engine.grammar.Grammars`)."""

    def check(self, spec: StructuredOutput) -> None: ...


class RequestChecker:
    """Admits requests for one model: `vocab_size` token ids, a context window of
    `max_model_len`."""

    def __init__(
        self, vocab_size: int, max_model_len: int, grammars: GrammarCheck | None = None
    ) -> None:
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.grammars = grammars
        self._key = object()  # marks the AdmittedRequests this checker made

    def admit(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> AdmittedRequest:
        """Raises InvalidRequestError naming the parameter, else returns what the core queues
        without checking again. Thread-safe."""
        prompt = self._check_prompt(prompt_token_ids)
        params.check_vocab(self.vocab_size)
        if params.structured is not None:
            if self.grammars is None:
                raise InvalidRequestError(
                    "this engine does not constrain outputs", params.structured.param
                )
            self.grammars.check(params.structured)  # compiled once per schema, then cached
        max_total = self._max_total_tokens(len(prompt), params)
        return AdmittedRequest(tuple(prompt), params, max_total, self._key)

    def issued(self, admitted: AdmittedRequest) -> bool:
        return admitted.issuer is self._key

    def _check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        prompt = list(prompt_token_ids)
        if not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {vocab})", "prompt"
            )
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens; the context window "
                f"of {self.max_model_len} leaves no room to generate",
                "prompt",
            )
        return prompt

    def _max_total_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        if params.max_tokens is None:
            return self.max_model_len
        if num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the context window of {self.max_model_len}",
                "max_tokens",
            )
        return num_prompt + params.max_tokens
