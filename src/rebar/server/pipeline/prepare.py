"""The prepare stage: a neutral request made into what the engine runs — the prompt's token ids
(the conversation in the model's own chat template, or the bare prompt), its tools in the prompt
and as a grammar, and the sampling parameters — admitted by the engine's one check. Also how the
answer is to be read (`AnswerReader`).

Large inputs are tokenized off the event loop: a megabyte of text takes the tokenizer a second or
two, and on the loop that would stall every other client (even /health).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rebar.engine.async_engine import EngineFront
from rebar.engine.model_text import ModelText
from rebar.engine.prompt import prompt_token_ids
from rebar.engine.request import AdmittedRequest
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import InvalidRequestError
from rebar.server.pipeline.answer import AnswerReader
from rebar.server.pipeline.call import Call, Next, Outcome
from rebar.server.pipeline.reasoning import thinking_start
from rebar.server.pipeline.request import GenerationRequest, Message, PastToolCall
from rebar.server.pipeline.results import Completion
from rebar.server.pipeline.tools import ToolPlan, plan_tools, with_system_prompt

INLINE_CHARS = 8192  # below this, tokenizing costs less than the hop to a worker thread
T = TypeVar("T")


@dataclass(frozen=True)
class Prepared:
    """The request as the engine runs it, how its answers are read, and the text `echo` puts
    before each answer."""

    admitted: AdmittedRequest
    reader: AnswerReader
    echo_text: str = ""


async def run(call: Call, next: Next) -> Outcome:
    """Down: the prompt, sampling and tools as the engine runs them. Up: the answer read for the
    client (whole, or as stream items), and its figures noted for the access log."""
    model, state, context = call.model, call.state, call.context
    assert model is not None, "the lease stage comes first"
    call.prepared = prepared = await prepare(model.front, model.text, call.request)
    prompt_ids = list(prepared.admitted.prompt_token_ids)
    if state.log_prompts:
        context.log["prompt"] = model.text.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    outcome = await next(call)
    reader = prepared.reader

    def note(completion: Completion) -> None:
        context.log.update(reader.log_fields(completion, state.log_prompts))

    if outcome.live is not None:
        outcome.items = reader.live(outcome.live, note)
        return outcome
    assert outcome.completion is not None, "a stage below answered"
    note(outcome.completion)
    if call.request.stream:
        outcome.items = reader.replayed(outcome.completion)
    else:
        outcome.answer = reader.read(outcome.completion)
    return outcome


async def prepare(engine: EngineFront, text: ModelText, request: GenerationRequest) -> Prepared:
    """Raises InvalidRequestError naming the parameter for anything the model cannot run."""
    params = request.params
    with_logprobs = params.logprobs is not None
    if request.messages is None:
        assert request.prompt is not None, "a generation request has messages or a prompt"
        prompt = request.prompt
        ids = await off_loop(
            len(prompt) if isinstance(prompt, str) else 0, prompt_token_ids, text.tokenizer, prompt
        )
        admitted = await admit(engine, ids, params)
        # Admitted first: only ids the model has can be decoded for the echo.
        echo = "" if not request.echo else (prompt if isinstance(prompt, str) else None)
        if echo is None:
            echo = text.tokenizer.decode(list(admitted.prompt_token_ids))
        return Prepared(admitted, AnswerReader(text.tokenizer, with_logprobs), echo)
    ids, plan = await conversation_prompt(text, request)
    if plan is not None:
        if plan.forced is not None:
            if params.structured is not None:
                choice = request.tools.choice_param if request.tools else "tool_choice"
                fmt = params.structured.param.split(".")[0]
                raise InvalidRequestError(
                    f"a forced {choice} cannot be combined with {fmt}", choice
                )
            params = dataclasses.replace(params, structured=plan.forced)
        if plan.reader is not None and plan.reader.format == "mistral":
            # Its calls start with a special token, which the answer's text must keep.
            params = dataclasses.replace(params, skip_special_tokens=False)
    admitted = await admit(engine, ids, params)
    thinking = thinking_start(text, ids)
    reader = AnswerReader(
        text.tokenizer, with_logprobs, thinking, plan.reader if plan is not None else None
    )
    return Prepared(admitted, reader)


async def conversation_prompt(
    text: ModelText, request: GenerationRequest
) -> tuple[list[int], ToolPlan | None]:
    """The prompt's token ids for a request's conversation (its tools in the template's `tools`
    or a system prompt), and what its tools do (None: no tools)."""
    assert request.messages is not None, "a conversation"
    messages = template_messages(request.messages, text)
    plan = plan_tools(request.tools, text)
    if plan is not None and plan.system_prompt is not None:
        messages = with_system_prompt(messages, plan.system_prompt)
    template_tools = plan.template_tools if plan is not None else None
    return await chat_prompt(text, messages, tools=template_tools), plan


async def admit(
    engine: EngineFront, prompt_ids: list[int], params: SamplingParams
) -> AdmittedRequest:
    """`engine.admit`; on a worker thread when a schema must be compiled (milliseconds, and the
    model's grammar tokenizer on first use: up to seconds), so other clients are not stalled."""
    if params.structured is None:
        return engine.admit(prompt_ids, params)
    return await asyncio.to_thread(engine.admit, prompt_ids, params)


async def off_loop(size: int, function: Callable[..., T], *args: Any) -> T:
    """`function(*args)`, on a worker thread when `size` (characters of input) is large."""
    if size <= INLINE_CHARS:
        return function(*args)
    return await asyncio.to_thread(function, *args)


async def chat_prompt(
    text: ModelText,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """`ModelText.chat_prompt_ids`, off the loop for long conversations (/tokenize passes
    bos=False: bare ids)."""
    size = sum(len(m.get("content") or "") for m in messages)
    return await off_loop(size, text.chat_prompt_ids, messages, add_generation_prompt, bos, tools)


def template_messages(messages: Sequence[Message], text: ModelText) -> list[dict[str, Any]]:
    """The messages as the chat template reads them: names and tool_call_ids kept, and an
    assistant's tool calls with their arguments parsed (as templates expect). A template that never
    reads tool_calls gets them written into the assistant's content instead (Hermes-style
    `<tool_call>` JSON), so the model still sees them.

    Everything a client wrote outside `content` reaches the template as is, so control-token
    text there (a typed `<|im_start|>`) is refused; content is always tokenized as text.
    """
    template = text.checkpoint.chat_template or ""
    reads_tool_calls = "tool_calls" in template
    rendered = []
    for message in messages:
        out: dict[str, Any] = {"role": message.role, "content": message.content}
        for key in ("name", "tool_call_id"):
            value = getattr(message, key)
            if value is not None:
                out[key] = _plain(text, value, f"{message.param}.{key}")
        calls = [
            _tool_call(text, call, f"{message.param}.tool_calls.{j}")
            for j, call in enumerate(message.tool_calls)
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


def _tool_call(text: ModelText, call: PastToolCall, param: str) -> dict[str, Any]:
    name = _plain(text, call.name, f"{param}.function.name")
    _plain(text, call.arguments, f"{param}.function.arguments")
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        raise InvalidRequestError(
            f"{param}.function.arguments must be JSON text (an object)",
            f"{param}.function.arguments",
        ) from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(
            f"{param}.function.arguments must be a JSON object", f"{param}.function.arguments"
        )
    call_id = _plain(text, call.id, f"{param}.id")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _plain(text: ModelText, value: str, param: str) -> str:
    if text.tokenizer.holds_special_text(value):
        raise InvalidRequestError(f"{param} holds control-token text", param)
    return value
