"""Grammar-constrained decoding in the engine core (tiny random model, character tokenizer):
every sampled output follows its schema (checked by `jsonschema`, an independent validator), and
batching, n > 1, preemption, aborts and errors behave as for free text."""

from __future__ import annotations

import json

import jsonschema
import pytest

from rebar.engine import grammar
from rebar.engine.grammar import Grammars
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.structured import StructuredOutput, closed_objects
from rebar.errors import InvalidRequestError
from tiny_engine import make_core, run_to_completion, tokens_of

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "points": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -99, "maximum": 99},
                    "y": {"type": "boolean"},
                },
                "required": ["x", "y"],
            },
            "maxItems": 2,
        },
    },
    "required": ["id", "tag", "ok", "name", "points"],
}
STRICT = StructuredOutput.json_schema(SCHEMA, strict=True)
PROMPT = [5, 9, 20, 33]


def char_core(tmp_path, **engine):
    return make_core(tmp_path, characters=True, max_model_len=256, **engine)


def text_of(outputs) -> str:
    return "".join(o.text_delta for o in outputs)


def test_every_sampled_output_parses_and_follows_the_schema(tmp_path) -> None:
    core = char_core(tmp_path, num_blocks=512, max_num_seqs=16)
    for i in range(12):
        params = SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured=STRICT)
        core.add_request(str(i), PROMPT, params)
    core.add_request(
        "n",
        PROMPT,
        SamplingParams(max_tokens=200, temperature=1.5, seed=99, n=4, structured=STRICT),
    )
    results = run_to_completion(core)
    assert len(results) == 16
    texts = set()
    for outputs in results.values():
        assert outputs[-1].finish_reason == "stop", text_of(outputs)
        document = json.loads(text_of(outputs))
        jsonschema.validate(document, SCHEMA)
        assert set(document) == set(SCHEMA["properties"])  # strict: no key beyond the schema's
        texts.add(text_of(outputs))
    assert len(texts) > 8  # sampled, not one answer over and over
    assert core.stats().grammar_mask_seconds.num > 0


def test_a_lark_grammar_and_json_object_are_followed(tmp_path) -> None:
    core = char_core(tmp_path)
    core.add_request(
        "lark",
        PROMPT,
        SamplingParams(
            max_tokens=40,
            temperature=1.0,
            seed=1,
            structured=StructuredOutput.lark('start: w w? w? "!"\nw: "ab" | "x"'),
        ),
    )
    core.add_request(
        "object",
        PROMPT,
        SamplingParams(
            max_tokens=120, temperature=0.7, seed=2, structured=StructuredOutput.json_object()
        ),
    )
    results = run_to_completion(core)
    lark_text = text_of(results[("lark", 0)])
    assert lark_text.endswith("!") and set(lark_text[:-1]) <= {"a", "b", "x"}
    assert results[("lark", 0)][-1].finish_reason == "stop"
    object_text = text_of(results[("object", 0)])
    if results[("object", 0)][-1].finish_reason == "stop":
        assert isinstance(json.loads(object_text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert object_text.startswith("{")


def test_free_text_requests_in_the_same_batch_are_unchanged(tmp_path) -> None:
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = char_core(tmp_path)
    alone.add_request("free", PROMPT, free)
    expected = tokens_of(run_to_completion(alone)[("free", 0)])
    mixed = char_core(tmp_path)
    mixed.add_request(
        "json", PROMPT, SamplingParams(max_tokens=60, temperature=0, structured=STRICT)
    )
    mixed.add_request("free", PROMPT, free)
    assert tokens_of(run_to_completion(mixed)[("free", 0)]) == expected


def test_preemption_keeps_the_grammar_where_it_was(tmp_path) -> None:
    params = SamplingParams(max_tokens=150, temperature=0, structured=STRICT)
    prompts = [[3 + i, 40, 41 + i, 7] * 3 for i in range(8)]
    runs = {}
    for name, blocks in (("roomy", 512), ("tight", 70)):
        core = char_core(tmp_path, num_blocks=blocks, enable_prefix_caching=False)
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, params)
        runs[name] = run_to_completion(core)
        if name == "tight":
            assert core.stats().num_preemptions > 0
            assert core.stats().num_free_blocks == 70
    for i in range(len(prompts)):
        tight = runs["tight"][(str(i), 0)]
        assert tokens_of(tight) == tokens_of(runs["roomy"][(str(i), 0)])
        jsonschema.validate(json.loads(text_of(tight)), SCHEMA)


def test_aborting_constrained_requests_frees_everything(tmp_path) -> None:
    core = char_core(tmp_path)
    for i in range(4):
        params = SamplingParams(max_tokens=150, temperature=1.0, seed=i, n=2, structured=STRICT)
        core.add_request(str(i), PROMPT, params)
    for _ in range(5):
        core.step()
    for i in range(4):
        finished = core.abort_request(str(i))
        assert {o.finish_reason for o in finished} <= {"abort", "stop"}
    core.check_integrity()
    assert not core.has_unfinished_requests()
    assert core.stats().num_free_blocks == core.stats().num_blocks


def test_a_complete_output_stops_even_when_eos_is_ignored(tmp_path) -> None:
    core = char_core(tmp_path)
    spec = StructuredOutput.lark('start: "ab"')
    core.add_request("x", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True, structured=spec))
    outputs = run_to_completion(core)[("x", 0)]
    assert text_of(outputs) == "ab" and outputs[-1].finish_reason == "stop"
    assert outputs[-1].num_output_tokens == 2


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput.json_schema({"type": "strin"}), "strin"),
        (StructuredOutput.json_schema({"not": {"type": "string"}}), "not"),
        (StructuredOutput.json_schema({"type": "string", "pattern": "[a-"}), "regex"),
        (StructuredOutput.json_schema({"$ref": "http://example.com/s.json"}), "example.com"),
        (StructuredOutput.lark("start: undefined_rule"), "undefined_rule"),
    ],
)
def test_an_unusable_schema_is_refused_at_admission_naming_the_problem(
    tmp_path, spec, message
) -> None:
    core = char_core(tmp_path)
    with pytest.raises(InvalidRequestError) as caught:
        core.add_request("bad", PROMPT, SamplingParams(max_tokens=5, structured=spec))
    assert caught.value.param == spec.param
    assert message in str(caught.value)
    assert not core.has_unfinished_requests()


def test_a_schema_is_compiled_once_then_served_from_the_cache(tmp_path, monkeypatch) -> None:
    core = char_core(tmp_path)
    compiled = []
    original = Grammars._compile
    monkeypatch.setattr(
        Grammars, "_compile", lambda self, spec: compiled.append(spec) or original(self, spec)
    )
    for i in range(3):
        core.add_request(str(i), PROMPT, SamplingParams(max_tokens=8, structured=STRICT))
    core.add_request(
        "other", PROMPT, SamplingParams(max_tokens=8, structured=StructuredOutput.json_object())
    )
    run_to_completion(core)
    assert compiled == [STRICT, StructuredOutput.json_object()]


def test_the_cache_drops_the_least_recently_used_grammar(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(grammar, "CACHE_SIZE", 2)
    core = char_core(tmp_path)
    specs = [StructuredOutput.lark(f'start: "{word}"') for word in ("a", "b", "c")]
    for spec in specs:
        core.grammars.check(spec)
    core.grammars.check(specs[1])
    assert list(core.grammars._compiled) == [specs[2], specs[1]]


def test_strict_closes_objects_the_schema_leaves_open() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "c": {"type": "array", "items": {"type": "object", "properties": {"d": {}}}},
            "e": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "$defs": {"f": {"type": "object", "properties": {"g": {}}}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert closed["properties"]["e"]["additionalProperties"] is True  # said so: kept
    assert closed["$defs"]["f"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is not changed
    assert StructuredOutput.json_schema(schema).schema() == schema  # not strict: as written


def test_schema_key_order_is_kept_and_sizes_are_bounded() -> None:
    spec = StructuredOutput.json_schema({"properties": {"z": {}, "a": {}}})
    assert list(spec.schema()["properties"]) == ["z", "a"]
    assert StructuredOutput.json_schema(True).schema() == {}
    with pytest.raises(InvalidRequestError, match="admits nothing"):
        StructuredOutput.json_schema(False)
    with pytest.raises(InvalidRequestError) as caught:
        StructuredOutput.json_schema([1, 2])
    assert caught.value.param == "response_format"
    with pytest.raises(InvalidRequestError, match="characters"):
        StructuredOutput.json_schema({"description": "x" * 200_000})
    with pytest.raises(InvalidRequestError):
        StructuredOutput.lark("  ")
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(structured={"type": "json_object"})  # type: ignore[arg-type]
    assert caught.value.param == "structured"


def test_a_tokenizer_without_token_bytes_is_refused_clearly(tmp_path) -> None:
    core = make_core(tmp_path)  # word-level tokenizer, no decoder
    with pytest.raises(InvalidRequestError, match="does not support constrained outputs"):
        core.add_request("x", PROMPT, SamplingParams(max_tokens=4, structured=STRICT))


def test_a_prefix_cache_hit_changes_no_constrained_token(tmp_path) -> None:
    core = char_core(tmp_path)
    prompt = [3 + (i * 7) % 90 for i in range(30)]
    params = SamplingParams(max_tokens=150, temperature=0, structured=STRICT)
    runs = []
    for name in ("first", "second"):
        core.add_request(name, prompt, params)
        runs.append(run_to_completion(core)[(name, 0)])
    assert runs[0][-1].num_cached_tokens == 0 and runs[1][-1].num_cached_tokens >= 24
    assert tokens_of(runs[1]) == tokens_of(runs[0])
    jsonschema.validate(json.loads(text_of(runs[1])), SCHEMA)
