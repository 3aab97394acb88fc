"""From the HTTP schemas to the engine: an OpenAI request becomes one admitted engine request
(prompt ids and SamplingParams, checked once). This is the only place that conversion happens."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

from rebar.engine.async_engine import EngineFront
from rebar.engine.model_text import ModelText
from rebar.engine.request import AdmittedRequest
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.structured import StructuredOutput
from rebar.errors import InvalidRequestError
from rebar.server import prompts
from rebar.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ToolCall,
    _SamplingFields,
)
from rebar.server.tools import ToolPlan, plan_tools, with_system_prompt


async def chat_input(
    engine: EngineFront, llm: ModelText, body: ChatCompletionRequest
) -> tuple[AdmittedRequest, ToolPlan | None]:
    """The chat request as the engine runs it (its messages and tools in the model's template,
    admitted), and how its tools read the answer."""
    plan = plan_tools(body, llm)
    params = chat_params(body)
    messages = template_messages(body.messages, llm)
    tools = None
    if plan is not None:
        if plan.forced is not None:
            if params.structured is not None:
                raise InvalidRequestError(
                    "a forced tool_choice cannot be combined with response_format", "tool_choice"
                )
            params = dataclasses.replace(params, structured=plan.forced)
        if plan.reader is not None and plan.reader.format == "mistral":
            # Its calls start with a special token, which the answer's text must keep.
            params = dataclasses.replace(params, skip_special_tokens=False)
        if plan.system_prompt is not None:
            messages = with_system_prompt(messages, plan.system_prompt)
        tools = plan.template_tools
    ids = await prompts.chat_prompt(llm, messages, tools=tools)
    return await admit(engine, ids, params), plan


async def admit(
    engine: EngineFront, prompt_ids: list[int], params: SamplingParams
) -> AdmittedRequest:
    """`engine.admit`; on a worker thread when a schema must be compiled (milliseconds, and the
    model's grammar tokenizer on first use: up to seconds), so other clients are not stalled."""
    if params.structured is None:
        return engine.admit(prompt_ids, params)
    return await asyncio.to_thread(engine.admit, prompt_ids, params)


def template_messages(messages: Sequence[ChatMessage], llm: ModelText) -> list[dict[str, Any]]:
    """The messages as the chat template reads them: `developer` as `system`, a null content as
    "", names and tool_call_ids kept, and an assistant's tool_calls with their arguments parsed
    (as templates expect). A template that never reads tool_calls gets them written into the
    assistant's content instead (Hermes-style `<tool_call>` JSON), so the model still sees them.

    Everything a client wrote outside `content` reaches the template as is, so control-token
    text there (a typed `<|im_start|>`) is refused; content is always tokenized as text.
    """
    template = llm.checkpoint.chat_template or ""
    reads_tool_calls = "tool_calls" in template
    rendered = []
    for i, message in enumerate(messages):
        out: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": message.content or "",
        }
        for key in ("name", "tool_call_id"):
            value = getattr(message, key)
            if value is not None:
                out[key] = _plain(llm, value, f"messages.{i}.{key}")
        calls = [
            _tool_call(llm, call, f"messages.{i}.tool_calls.{j}")
            for j, call in enumerate(message.tool_calls or ())
        ]
        if calls and reads_tool_calls:
            out["tool_calls"] = calls
        elif calls:
            out["content"] += "".join(
                "\n<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False,
                )
                + "\n</tool_call>"
                for c in calls
            )
        rendered.append(out)
    return rendered


def _tool_call(llm: ModelText, call: ToolCall, param: str) -> dict[str, Any]:
    name = _plain(llm, call.function.name, f"{param}.function.name")
    _plain(llm, call.function.arguments, f"{param}.function.arguments")
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise InvalidRequestError(
            f"{param}.function.arguments must be JSON text (an object)",
            f"{param}.function.arguments",
        ) from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(
            f"{param}.function.arguments must be a JSON object", f"{param}.function.arguments"
        )
    call_id = _plain(llm, call.id, f"{param}.id")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _plain(llm: ModelText, text: str, param: str) -> str:
    if llm.tokenizer.holds_special_text(text):
        raise InvalidRequestError(f"{param} holds control-token text", param)
    return text


async def completion_input(
    engine: EngineFront, llm: ModelText, body: CompletionRequest
) -> tuple[AdmittedRequest, str]:
    """The completions request as the engine runs it, and the text `echo` puts before each
    answer."""
    params = completion_params(body)
    prompt = single_prompt(body.prompt)
    admitted = await admit(engine, await prompts.text_prompt(llm, prompt), params)
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
        structured=structured_output(body),
    )


def structured_output(body: _SamplingFields) -> StructuredOutput | None:
    """What `response_format` asks the output to be (None: free text)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput.json_object()
    assert fmt.json_schema is not None  # the schema's validator requires it
    schema = fmt.json_schema.schema_
    return StructuredOutput.json_schema(
        {"type": "object"} if schema is None else schema,
        # Objects are closed unless the client says strict: false (as vLLM and llama.cpp close
        # them): a small model given room for more keys keeps adding them.
        strict=fmt.json_schema.strict is not False,
        param="response_format.json_schema.schema",
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
