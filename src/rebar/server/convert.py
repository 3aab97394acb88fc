"""Between the HTTP schemas and the engine: an OpenAI request becomes one admitted engine request
(prompt ids and SamplingParams, checked once), and outputs become response fields."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import cast

from rebar.engine.async_engine import AsyncEngine
from rebar.engine.llm import LLM
from rebar.engine.outputs import RequestTiming
from rebar.engine.request import AdmittedRequest
from rebar.engine.sampler import TokenLogprobs
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import InvalidRequestError
from rebar.model.tokenizer import Tokenizer
from rebar.server import prompts
from rebar.server.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields


async def chat_input(engine: AsyncEngine, llm: LLM, body: ChatCompletionRequest) -> AdmittedRequest:
    """The chat request as the engine runs it: its messages in the model's template, admitted."""
    params = chat_params(body)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    return engine.admit(await prompts.chat_prompt(llm, messages), params)


async def completion_input(
    engine: AsyncEngine, llm: LLM, body: CompletionRequest
) -> tuple[AdmittedRequest, str]:
    """The completions request as the engine runs it, and the text `echo` puts before each answer."""
    params = completion_params(body)
    prompt = single_prompt(body.prompt)
    admitted = engine.admit(await prompts.text_prompt(llm, prompt), params)
    if not body.echo:
        return admitted, ""
    # Admitted first: only ids the model has can be decoded for the echo.
    return admitted, prompt if isinstance(prompt, str) else llm.tokenizer.decode(prompt)


def single_prompt(prompt: str | list) -> str | list[int]:
    """rebar serves one prompt per request (use `n` for several completions of it)."""
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if len(prompt) == 1:
        return prompt[0]
    raise InvalidRequestError(
        "send one prompt per request (a string or a list of token ids); batches are not supported",
        "prompt",
    )


def sampling_params(
    body: _SamplingFields, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """Raises InvalidRequestError naming the parameter for any out-of-range value."""
    return SamplingParams(
        n=body.n,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        # JSON keys are strings; SamplingParams reads decimal ones as token ids and refuses others.
        logit_bias=cast(Mapping[int, float] | None, body.logit_bias),
        logprobs=logprobs,
    )


def chat_params(body: ChatCompletionRequest) -> SamplingParams:
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise InvalidRequestError(
            "give max_tokens or max_completion_tokens, not both", "max_tokens"
        )
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs=true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    return sampling_params(body, max_tokens, logprobs)


def completion_params(body: CompletionRequest) -> SamplingParams:
    if body.echo and body.logprobs is not None:
        raise InvalidRequestError(
            "echo together with logprobs (prompt logprobs) is not supported", "echo"
        )
    return sampling_params(body, body.max_tokens, body.logprobs)


def openai_finish_reason(reason: str | None) -> str | None:
    # OpenAI knows "stop" and "length": a choice cut by the tokens-per-minute limit ran out of
    # length; an aborted or failed one is reported as stopped.
    if reason == OUT_OF_TOKENS:
        return "length"
    return reason if reason in (None, "stop", "length") else "stop"


OUT_OF_TOKENS = (
    "rate_limited"  # the finish reason of a choice cut by the client's tokens-per-minute limit
)


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
    """The engine's time split of one answer, in milliseconds, and the prompt tokens the prefix cache served."""
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
