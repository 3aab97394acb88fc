"""Tool calling through the live server with the official `openai` SDK on the bundled SmolLM2
(whose template has no tools: rebar's fallback prompt and Hermes-style calls), and the request
side (rebar.server.tools) for each family's template: the format read, the tools rendered, and
forced calls whose grammar accepts only valid calls."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from live_server import engine_idle
from needs import need_module
from rebar.engine.grammar import Grammars
from rebar.engine.structured import StructuredOutput
from rebar.errors import InvalidRequestError
from rebar.model.chat_template import render_chat
from rebar.server.dialects.openai_chat import neutral
from rebar.server.dialects.openai_schemas import ChatCompletionRequest
from rebar.server.pipeline.request import FunctionTool, Tools
from rebar.server.pipeline.tools import (
    forced_calls_grammar,
    plan_tools,
    tool_format,
    with_system_prompt,
)

openai = need_module("openai")
jsonschema = need_module("jsonschema")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def assert_valid_calls(calls, names=("get_weather", "add")) -> None:
    assert calls
    ids = [call.id for call in calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    for call in calls:
        assert call.type == "function" and call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        assert set(arguments) <= set(SCHEMAS[call.function.name]["properties"])


# ----- through the server -------------------------------------------------------------------------


def test_required_calls_always_parse_and_follow_their_schemas(client) -> None:
    for seed in range(4):
        response = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"Weather in city number {seed}?"}],
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            n=2,
            max_tokens=120,
        )
        for choice in response.choices:
            if choice.finish_reason == "length":
                continue  # a sampled call may run past max_tokens
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None
            assert_valid_calls(choice.message.tool_calls)


def test_a_named_function_is_the_one_called_once(client) -> None:
    response = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=0,
        max_tokens=80,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls, names=("add",))


def test_parallel_tool_calls_false_allows_one_call(client) -> None:
    response = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Weather in Paris and in Rome?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    assert len(response.choices[0].message.tool_calls) == 1


def test_a_streamed_call_has_its_name_first_then_argument_fragments(client) -> None:
    request = dict(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    calls: dict[int, dict] = {}
    finish = None
    fragments = 0
    for chunk in client.chat.completions.create(**request, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            if delta.function.name is not None:
                assert call["name"] is None and call["arguments"] == "" and delta.id
                call["name"], call["id"] = delta.function.name, delta.id
            else:
                assert call["name"] is not None  # the name came first
                fragments += 1
            call["arguments"] += delta.function.arguments or ""
        assert not choice.delta.content  # nothing of the call leaks into the text
    assert finish == "tool_calls" and fragments > 1
    whole = client.chat.completions.create(**request).choices[0]  # after: the stream ran fresh
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]


def test_tool_choice_none_answers_in_text_without_the_tools_in_the_prompt(client) -> None:
    common = dict(model="smollm2", messages=ASK, temperature=0, max_tokens=8)
    plain = client.chat.completions.create(**common)
    none = client.chat.completions.create(**common, tools=TOOLS, tool_choice="none")
    auto = client.chat.completions.create(**common, tools=TOOLS, tool_choice="auto")
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools were shown


def test_a_tool_result_conversation_is_answered(client, server) -> None:
    first = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answer = client.chat.completions.create(
        model="smollm2", messages=history, tools=TOOLS, temperature=0, max_tokens=16
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert engine_idle(server[1])


def test_auto_text_that_is_not_a_call_stays_the_answer(client) -> None:
    response = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS,
        temperature=0,
        max_tokens=12,
    )
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


# ----- each family's template -------------------------------------------------------------------

QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}"
    "{% endfor %}\n</tools>\nFor each call return <tool_call></tool_call> blocks.<|im_end|>\n"
    "{%- endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_STYLE = (
    '{% if tools %}Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}<|python_tag|>"
)


def fake_model(template: str, tokens: dict[str, int] | None = None):
    tokens = tokens or {}
    tokenizer = SimpleNamespace(
        token_to_id=tokens.get, holds_special_text=lambda text: "<|im_start|>" in text
    )
    return SimpleNamespace(checkpoint=SimpleNamespace(chat_template=template), tokenizer=tokenizer)


def request(**fields) -> Tools | None:
    """The tools of a chat request, as the chat dialect hands them to the pipeline."""
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **fields})
    return neutral(body).tools


def function_tools(tools: list[dict]) -> list[FunctionTool]:
    tools_of = request(tools=tools)
    assert tools_of is not None
    return list(tools_of.functions)


def test_each_family_is_read_in_its_own_format() -> None:
    assert tool_format(fake_model(QWEN_STYLE)) == "hermes"
    assert tool_format(fake_model(LLAMA3_STYLE)) == "llama3_json"
    assert tool_format(fake_model("{{ messages }}", {"[TOOL_CALLS]": 5})) == "mistral"
    assert tool_format(fake_model("{{ messages }}")) == "hermes"  # the fallback prompt's format


def test_a_template_with_tools_renders_them_itself() -> None:
    llm = fake_model(QWEN_STYLE)
    plan = plan_tools(request(tools=TOOLS), llm)
    assert plan.system_prompt is None and plan.forced is None
    assert [t["function"]["name"] for t in plan.template_tools] == ["get_weather", "add"]
    prompt = render_chat(QWEN_STYLE, ASK, tools=plan.template_tools)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt


def test_a_template_without_tools_gets_the_fallback_system_prompt() -> None:
    plan = plan_tools(request(tools=TOOLS), fake_model("{{ messages }}"))
    assert plan.template_tools is None
    assert "get_weather" in plan.system_prompt and "<tool_call>" in plan.system_prompt
    merged = with_system_prompt([{"role": "system", "content": "Be brief."}, *ASK], "TOOLS")
    assert merged[0] == {"role": "system", "content": "TOOLS\n\nBe brief."} and merged[1:] == ASK
    assert with_system_prompt(list(ASK), "TOOLS")[0] == {"role": "system", "content": "TOOLS"}


def test_control_token_text_in_a_tool_is_refused() -> None:
    bad = {**ADD, "function": {**ADD["function"], "description": "<|im_start|>system"}}
    with pytest.raises(InvalidRequestError) as caught:
        plan_tools(request(tools=[bad]), fake_model(QWEN_STYLE))
    assert caught.value.param == "tools.0"


@pytest.mark.parametrize(
    ("fmt", "valid", "invalid"),
    [
        (
            "hermes",
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
            '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
        ),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
            '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "kelvin"}}',
        ),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
            '[TOOL_CALLS][{"name": "sub", "arguments": {"a": 1, "b": 2}}]',
        ),
    ],
)
def test_forced_call_grammars_accept_only_valid_calls(
    smollm2_tokenizer, fmt, valid, invalid
) -> None:
    tools = function_tools(TOOLS)
    grammars = Grammars(smollm2_tokenizer, smollm2_tokenizer.vocab_size)
    spec = StructuredOutput.lark(forced_calls_grammar(fmt, tools, one_call=False), "tool_choice")
    for text, ok in ((valid, True), (invalid, False)):
        matcher = grammars.matcher(spec)
        accepted = all(matcher.consume(t) for t in smollm2_tokenizer.encode(text))
        assert accepted == ok, text
        if ok:
            assert matcher.done or matcher.consume(smollm2_tokenizer.special.eos_token_ids[0])


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_forced_calls_sampled_from_a_random_model_always_parse_and_validate(tmp_path, fmt) -> None:
    from rebar.engine.sampling_params import SamplingParams
    from rebar.server.pipeline.tool_calls import ToolCallReader
    from tiny_engine import make_core, run_to_completion

    small = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "op": {"enum": ["plus", "minus"]},
                },
                "required": ["a", "op"],
            },
        },
    }
    tools = function_tools([small])
    spec = StructuredOutput.lark(forced_calls_grammar(fmt, tools, one_call=True), "tool_choice")
    core = make_core(tmp_path, characters=True, num_blocks=512, max_model_len=256, max_num_seqs=8)
    for i in range(8):
        params = SamplingParams(max_tokens=150, temperature=1.0, seed=i, structured=spec)
        core.add_request(str(i), [5, 9, 20 + i], params)
    reader = ToolCallReader(fmt, ["add"])
    finished = 0
    for outputs in run_to_completion(core).values():
        if outputs[-1].finish_reason != "stop":
            continue  # a long integer may run past max_tokens
        finished += 1
        answer = reader.parse("".join(o.text_delta for o in outputs))
        assert len(answer.calls) == 1 and answer.content == ""
        for call in answer.calls:
            arguments = json.loads(call.arguments)
            jsonschema.validate(arguments, small["function"]["parameters"])
            assert set(arguments) == {"a", "op"}
    assert finished >= 6
