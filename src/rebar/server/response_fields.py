"""Fields of OpenAI responses built from engine results: finish reasons, usage, logprobs, timing."""

from __future__ import annotations

import time

from rebar.engine.sampler import TokenLogprobs
from rebar.model.tokenizer import Tokenizer
from rebar.timing import RequestTiming

OUT_OF_TOKENS = "rate_limited"  # the finish reason of a choice cut by the tokens-per-minute limit


def openai_finish_reason(reason: str | None) -> str | None:
    # OpenAI knows "stop" and "length": a choice cut by the tokens-per-minute limit ran out of
    # length; an aborted or failed one is reported as stopped.
    if reason == OUT_OF_TOKENS:
        return "length"
    return reason if reason in (None, "stop", "length") else "stop"


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> dict | None:
    if not entries:
        return None

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprobs], text_offset: int = 0
) -> dict | None:
    if not entries:
        return None
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(text_offset)
        piece = token_text(tokenizer, entry.token_id)
        tokens.append(piece)
        text_offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def now() -> int:
    return int(time.time())


def timing_fields(timing: RequestTiming | None, num_cached: int) -> dict:
    """The engine's time split of one answer, in milliseconds, and the prompt tokens the prefix
    cache served."""
    if timing is None:
        return {
            "queue_ms": 0.0,
            "prefill_ms": 0.0,
            "decode_ms": 0.0,
            "cached_prompt_tokens": num_cached,
        }
    return {
        "queue_ms": round(timing.queue_s * 1e3, 2),
        "prefill_ms": round(timing.prefill_s * 1e3, 2),
        "decode_ms": round(timing.decode_s * 1e3, 2),
        "cached_prompt_tokens": num_cached,
    }


def timing_header(fields: dict) -> str:
    """`x-rebar-timing: queue_ms=1.2, prefill_ms=30.5, decode_ms=410.0, cached_prompt_tokens=0`."""
    return ", ".join(f"{key}={value}" for key, value in fields.items())
