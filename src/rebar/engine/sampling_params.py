"""Per-request generation settings, validated once at construction."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from rebar.engine.structured import StructuredOutput
from rebar.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_N = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_ABS_PENALTY = 2.0
MAX_REPETITION_PENALTY = 2.0
# Below this the penalty's reciprocal (up to 100x on a logit) could overflow float32 logits to inf.
MIN_REPETITION_PENALTY = 0.01
# Temperatures below this are greedy: dividing float32 logits by them overflows (vLLM's rule too).
GREEDY_TEMPERATURE = 1e-5
# Per stop string. Matching costs time in the new text only, whatever the length; the cap bounds
# what one request may hold (its stops and the text held back while a long prefix matches) and is
# far beyond any real stop sequence.
MAX_STOP_LENGTH = 4096
_SEED_LIMIT = 2**63
_DECIMAL = re.compile(r"[+-]?[0-9]+")


class LogitBias(Mapping[int, float]):
    """An immutable, hashable map from token id to the bias added to that token's logit.

    Callers may rely on: iteration in ascending token id order, equality with any mapping holding
    the same pairs, and `token_ids` / `biases` being parallel tuples in that same order.
    """

    __slots__ = ("_items", "_lookup")

    def __init__(self, items: Mapping[int, float]) -> None:
        self._items: tuple[tuple[int, float], ...] = tuple(sorted(items.items()))
        self._lookup: dict[int, float] = dict(self._items)

    def __getitem__(self, token_id: int) -> float:
        return self._lookup[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(token_id for token_id, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __repr__(self) -> str:
        return f"LogitBias({self._lookup!r})"

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(token_id for token_id, _ in self._items)

    @property
    def biases(self) -> tuple[float, ...]:
        return tuple(bias for _, bias in self._items)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _finite_float(value: object) -> float | None:
    """`value` as a float when it is a finite real number (not a bool), else None."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float: outside every interval here
        return None
    return number if math.isfinite(number) else None


def _checked_real(
    name: str, value: object, low: float, high: float, low_open: bool = False
) -> float:
    """`value` as a float when it is a finite number within the interval, else
    InvalidRequestError."""
    number = _finite_float(value)
    if number is None or not (number > low if low_open else number >= low) or number > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise InvalidRequestError(f"{name} must be a number in {interval}, got {value!r}", name)
    return number


def _checked_int(name: str, value: object, low: int, high: int | None, hint: str = "") -> int:
    """`value` as an int when it is an integer (not a bool) within [low, high], else
    InvalidRequestError."""
    if not _is_int(value) or value < low or (high is not None and value > high):  # type: ignore[operator]
        interval = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequestError(
            f"{name} must be an integer {interval}{hint}, got {value!r}", name
        )
    return int(value)  # type: ignore[call-overload]


def _token_id_key(key: object) -> int:
    """A logit_bias key as a token id; JSON object keys arrive as decimal strings."""
    if isinstance(key, str) and _DECIMAL.fullmatch(key.strip()):
        key = int(key)
    if not _is_int(key) or key < 0:  # type: ignore[operator]
        raise InvalidRequestError(
            f"logit_bias keys must be non-negative token ids, got {key!r}", "logit_bias"
        )
    return int(key)  # type: ignore[call-overload]


def _checked_logit_bias(value: object) -> LogitBias | None:
    """The bias map as a LogitBias (None when absent or empty), else InvalidRequestError."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            f"logit_bias must map token ids to biases, got {type(value).__name__}", "logit_bias"
        )
    biases: dict[int, float] = {}
    for key, bias in value.items():
        token_id = _token_id_key(key)
        if token_id in biases:
            raise InvalidRequestError(f"logit_bias names token {token_id} twice", "logit_bias")
        biases[token_id] = _checked_real("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return LogitBias(biases) if biases else None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Every field is honoured; bad values raise
    InvalidRequestError.

    temperature 0 means greedy, and so does any temperature below GREEDY_TEMPERATURE (1e-5): it is
    stored as 0.0, since dividing logits by it would overflow them. `max_tokens=None` generates
    until a stop condition or the end of the context window. `seed` makes sampling reproducible for
    this request alone.

    At most MAX_STOP_STRINGS (16) stop strings, each non-empty and at most MAX_STOP_LENGTH (4096)
    characters long.

    `n` is how many independent completions to return; `child(i)` gives the params for the i-th.
    `repetition_penalty` (CTRL style) scales the logit of every token already seen in the prompt or
    the output: positive logits are divided by it, negative ones multiplied; it lies in
    [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY] = [0.01, 2]. `presence_penalty` and
    `frequency_penalty` (OpenAI style) look at output tokens only: a token's logit is lowered by
    `presence_penalty * (count > 0) + frequency_penalty * count`. `logit_bias` is added to the raw
    logits of the named tokens first; it is stored as a hashable, read-only `LogitBias` (string keys
    holding decimal integers are accepted, as JSON sends them; an empty map becomes None).
    `logprobs=None` returns no log-probabilities; k in [0, 20] returns the chosen token's plus the k
    most likely alternatives, all taken from the model's raw logits. `structured` constrains the
    output to a JSON schema, any JSON object or a grammar (`rebar.engine.structured`): each token
    is sampled among those that keep the output valid. `speculative=False` keeps the request out of
    speculative decoding (its tokens are the same either way; only the time they take changes).

    After construction every numeric field holds a plain `int` or `float` and every sequence a
    tuple, so the object is safely immutable and hashable.
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
    n: int = 1
    repetition_penalty: float = 1.0  # 1 = disabled
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    logprobs: int | None = None  # None = disabled
    structured: StructuredOutput | None = None
    speculative: bool = True  # may the engine check drafted tokens for it (when it drafts at all)

    def __post_init__(self) -> None:
        # Accept a single string or any sequence for the tuple fields, as the OpenAI API does.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name, value in {
            **self._checked_limits(),
            **self._checked_sampling(),
            **self._checked_extras(),
        }.items():
            object.__setattr__(self, name, value)
        self._validate_stops()

    def _checked_limits(self) -> dict[str, object]:
        max_tokens = self.max_tokens
        if max_tokens is not None:
            max_tokens = _checked_int("max_tokens", max_tokens, 1, None, " (a positive integer)")
        seed = None if self.seed is None else _checked_int("seed", self.seed, 0, _SEED_LIMIT - 1)
        for name in ("ignore_eos", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(
                    f"{name} must be a boolean, got {getattr(self, name)!r}", name
                )
        return {"max_tokens": max_tokens, "seed": seed, "n": _checked_int("n", self.n, 1, MAX_N)}

    def _checked_sampling(self) -> dict[str, object]:
        temperature = _checked_real("temperature", self.temperature, 0.0, 100.0)
        return {
            "temperature": 0.0 if temperature < GREEDY_TEMPERATURE else temperature,
            "top_p": _checked_real("top_p", self.top_p, 0.0, 1.0, low_open=True),
            "top_k": _checked_int("top_k", self.top_k, 0, None, " (0 disables it)"),
            "min_p": _checked_real("min_p", self.min_p, 0.0, 1.0),
        }

    def _checked_extras(self) -> dict[str, object]:
        logprobs = (
            None
            if self.logprobs is None
            else _checked_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        )
        repetition = self.repetition_penalty
        repetition = _checked_real(
            "repetition_penalty", repetition, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY
        )
        presence = _checked_real(
            "presence_penalty", self.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY
        )
        frequency = _checked_real(
            "frequency_penalty", self.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY
        )
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError(
                f"structured must be a StructuredOutput, got {type(self.structured).__name__}",
                "structured",
            )
        return {
            "repetition_penalty": repetition,
            "presence_penalty": presence,
            "frequency_penalty": frequency,
            "logit_bias": _checked_logit_bias(self.logit_bias),
            "logprobs": logprobs,
        }

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        if any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise InvalidRequestError(
                f"stop strings may be at most {MAX_STOP_LENGTH} characters long", "stop"
            )
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(
                "stop_token_ids must be non-negative integers", "stop_token_ids"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequestError when a token id named by these params is not below
        `vocab_size`."""
        for name, token_ids in (
            ("logit_bias", self.logit_bias or ()),
            ("stop_token_ids", self.stop_token_ids),
        ):
            too_big = [t for t in token_ids if t >= vocab_size]
            if too_big:
                raise InvalidRequestError(
                    f"{name} names token {too_big[0]}, but the vocabulary has {vocab_size} tokens",
                    name,
                )

    def child(self, index: int) -> SamplingParams:
        """Params for completion `index` of `n`: n=1, and a seed offset by `index` when seeded.

        Sibling completions therefore differ from each other, yet each stays reproducible.
        """
        if not 0 <= index < self.n:
            raise IndexError(f"child index {index} out of range for n={self.n}")
        seed = None if self.seed is None else (self.seed + index) % _SEED_LIMIT
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any repetition, presence or frequency penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
