"""Per-request generation settings, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from rebar.errors import InvalidRequestError

MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Every field is honoured; bad values raise InvalidRequestError.

    temperature 0 means greedy. `max_tokens=None` generates until a stop condition or the end of
    the context window. `seed` makes sampling reproducible for this request alone.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept a single string or any sequence for the tuple fields, as the OpenAI API does.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be a non-negative integer (0 disables it), got {self.top_k!r}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}", "seed")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
