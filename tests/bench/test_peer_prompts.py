"""The benchmarks' peer answers the same prompts as rebar: llama-server started with the template
options `chat_template_args` picks renders a chat into the tokens rebar renders (checked against
what llama.cpp's own server rendered, tests/fixtures/gemma3_llamacpp_chat_template.json, made by
scripts/make_llamacpp_template_fixtures.py), and `rebar bench spec` stops when its servers render
a request differently."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from markers import requires_gemma3, requires_smollm2
from rebar_bench import spec_bench
from rebar_bench.llamacpp import BUILT_IN_TEMPLATES, chat_template_args, rendered_chat
from rebar_bench.spec_bench import check_same_prompts, rendered_prompt
from rebar_bench.spec_prompts import SpecRequest

FIXTURE = json.loads(
    (Path(__file__).parent.parent / "fixtures" / "gemma3_llamacpp_chat_template.json").read_text(
        "utf-8"
    )
)


@requires_gemma3
def test_gemma3_renders_each_chat_as_llama_servers_gemma_template_does() -> None:
    from rebar.engine.prompt import with_bos
    from rebar.model.chat_prompt import chat_prompt_ids
    from rebar.model.loader import open_checkpoint
    from rebar.model.resolve import resolve_model_path

    # The fixture was made with the options the benchmarks start llama-server with today.
    assert FIXTURE["server_args"] == chat_template_args(resolve_model_path("gemma3"))
    checkpoint = open_checkpoint("gemma3")
    tokenizer = checkpoint.tokenizer
    roles = {message["role"] for case in FIXTURE["cases"] for message in case["messages"]}
    assert roles == {"system", "user", "assistant"}
    for case in FIXTURE["cases"]:
        ids = chat_prompt_ids(tokenizer, checkpoint.chat_template, case["messages"])
        assert with_bos(tokenizer, ids) == case["ids"], case["prompt"]


@requires_gemma3
def test_a_file_without_a_template_gets_llama_cpps_renderer_of_the_same_format() -> None:
    from rebar.model.resolve import resolve_model_path

    assert chat_template_args(resolve_model_path("gemma3")) == [
        "--no-jinja",
        "--chat-template",
        "gemma",
    ]


@requires_smollm2
def test_a_file_with_its_own_template_gets_no_template_options() -> None:
    from rebar.model.resolve import resolve_model_path

    assert chat_template_args(resolve_model_path("smollm2")) == []


def test_every_family_rebar_gives_a_template_has_a_peer_template() -> None:
    from rebar.model.loader.gguf_families import DEFAULT_TEMPLATES

    assert set(DEFAULT_TEMPLATES) <= set(BUILT_IN_TEMPLATES)


def test_servers_rendering_a_request_differently_stop_the_bench(monkeypatch) -> None:
    asked: list[tuple[str, str, bool]] = []

    def rendering(url, model, message, llama_server):
        asked.append((url, message, llama_server))
        return (2, 105, 7) if llama_server and message == "second" else (2, 105)

    monkeypatch.setattr(spec_bench, "rendered_prompt", rendering)
    served = {"rebar": ("http://a", "m"), "llama-server": ("http://b", "m")}
    first = [SpecRequest("chat", "first")]
    check_same_prompts(served, {"llama-server"}, first)
    assert asked == [("http://a", "first", False), ("http://b", "first", True)]
    with pytest.raises(RuntimeError, match=r"rename request into different prompts.*rebar 2"):
        check_same_prompts(served, {"llama-server"}, [*first, SpecRequest("rename", "second")])


def test_rebar_renders_for_the_check_the_tokens_its_chat_completions_generate_from(
    served_models,
) -> None:
    from live_server import server_settings, serving_models

    messages = [{"role": "user", "content": "Rewrite this function, please."}]
    with serving_models(served_models, server_settings()) as (url, _app):
        tokens = rendered_prompt(url, "", messages[0]["content"], llama_server=False)
    # What the chat completions prompt is: BOS added as they add it.
    assert tokens == tuple(served_models.chat.text.chat_prompt_ids(messages))


def test_llama_servers_prompt_is_tokenized_as_its_chat_completions_tokenize_it(monkeypatch) -> None:
    sent: list[tuple[str, dict]] = []

    class Reply:
        def __init__(self, body: dict) -> None:
            self.body = body

        def raise_for_status(self) -> None:
            pass

        def json(self) -> dict:
            return self.body

    def post(url: str, json: dict, timeout: float) -> Reply:
        sent.append((url, json))
        return Reply(
            {"prompt": "<turn>hi"} if url.endswith("/apply-template") else {"tokens": [2, 7]}
        )

    monkeypatch.setattr(httpx, "post", post)
    messages = [{"role": "user", "content": "hi"}]
    assert rendered_chat("http://peer", messages) == ("<turn>hi", [2, 7])
    assert sent == [
        ("http://peer/apply-template", {"messages": messages}),
        (
            "http://peer/tokenize",
            {"content": "<turn>hi", "add_special": True, "parse_special": True},
        ),
    ]
