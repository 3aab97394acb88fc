"""Structured outputs (`response_format`) through the live server, driven by the official `openai`
SDK (raw httpx where the SDK hides the HTTP): sampled, streamed and cached answers on smollm2
follow their schema, checked by `jsonschema` (an independent validator); unusable formats are
OpenAI-shaped 400s naming the problem; a client that goes away leaves nothing behind.

The engine side (masks, batching, preemption) is covered by tests/engine/test_structured_outputs.py.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from live_server import assert_idle, chat_core
from needs import need_module

openai = need_module("openai")

SCHEMA_PARAM = "response_format.json_schema.schema"

# Every property is required, so with strict (closed objects) the keys are exactly these.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "job": {"enum": ["engineer", "artist", "doctor", "teacher"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "job", "hobbies"],
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "population"],
}
# A string that cannot end soon: the generation is still running when the client leaves.
LONG_STORY = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 400}},
    "required": ["story"],
}


@pytest.fixture(scope="module")
def app_of(server):
    return server[1]


# --- helpers ------------------------------------------------------------------------------------


def json_schema_format(schema, name: str = "answer", strict: bool | None = True) -> dict:
    spec = {"name": name, "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def ask(content: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are a helpful AI assistant."},
        {"role": "user", "content": content},
    ]


def follows(text: str, schema: dict) -> dict:
    """The document `text` holds, checked against `schema` with its objects closed (strict)."""
    document = json.loads(text)
    jsonschema.validate(document, schema)
    assert set(document) == set(schema["properties"]), document  # strict: no other keys
    return document


def streamed_texts(chunks) -> tuple[dict[int, str], dict[int, str]]:
    """(text, finish_reason) per choice index of a streamed chat completion."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons


def requests_added(app) -> int:
    return chat_core(app).stats().num_requests_added


def error_of(exc: openai.APIStatusError) -> dict:
    """The OpenAI-shaped `error` object of an SDK exception."""
    error = exc.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and exc.param == error["param"]
    return error


# --- json_schema --------------------------------------------------------------------------------


def test_sampled_outputs_follow_a_strict_schema(client) -> None:
    prompts = [
        "Describe a fictional person.",
        "Invent a character for a novel.",
        "Tell me about a new colleague of mine.",
        "Create a profile for the hero of a video game.",
    ]
    choices = []
    for seed, prompt in enumerate(prompts, start=11):
        completion = client.chat.completions.create(
            model="smollm2",
            messages=ask(prompt),
            response_format=json_schema_format(PERSON, "person"),
            n=4,
            temperature=1.0,
            seed=seed,
            max_tokens=150,
        )
        assert [c.index for c in completion.choices] == [0, 1, 2, 3]
        choices += completion.choices
    finished = [c.message.content for c in choices if c.finish_reason == "stop"]
    assert len(finished) >= 0.8 * len(choices), [c.finish_reason for c in choices]
    documents = [follows(text, PERSON) for text in finished]
    assert len({json.dumps(d, sort_keys=True) for d in documents}) > 1  # really sampled


def test_streamed_outputs_follow_the_schema(client) -> None:
    request = {
        "model": "smollm2",
        "messages": ask("Describe a person you admire."),
        "response_format": json_schema_format(PERSON, "person"),
        "temperature": 1.0,
        "max_tokens": 150,
        "stream": True,
    }
    texts, reasons = streamed_texts(client.chat.completions.create(**request, seed=5))
    assert reasons == {0: "stop"}
    follows(texts[0], PERSON)

    texts, reasons = streamed_texts(client.chat.completions.create(**request, seed=6, n=2))
    assert reasons == {0: "stop", 1: "stop"} and texts[0] != texts[1]
    for text in texts.values():
        follows(text, PERSON)


def test_objects_are_closed_unless_strict_is_false(client) -> None:
    named = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}},
        "required": ["name"],
    }

    def sampled(strict: bool | None) -> list[str]:
        completion = client.chat.completions.create(
            model="smollm2",
            messages=ask("Introduce a neighbour of mine: name, age and job."),
            response_format=json_schema_format(named, "person", strict=strict),
            n=4,
            temperature=1.0,
            seed=21,
            max_tokens=150,
        )
        return [c.message.content for c in completion.choices if c.finish_reason == "stop"]

    closed = sampled(strict=None)  # strict left out: closed, as with strict: true
    assert len(closed) == 4  # a closed object with one bounded string always ends
    for text in closed:
        follows(text, named)
    opened = [json.loads(text) for text in sampled(strict=False)]
    for document in opened:  # the schema as JSON Schema reads it: other keys are allowed...
        jsonschema.validate(document, named)
    assert any(set(d) > {"name"} for d in opened)  # ...and asked for more, this model adds some


# --- json_object ----------------------------------------------------------------------------


def test_json_object_answers_are_json_objects(client) -> None:
    messages = ask("Reply in JSON: give the name of the capital of France and its country.")
    greedy = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=100,
    ).choices[0]
    assert greedy.finish_reason == "stop"
    assert isinstance(json.loads(greedy.message.content), dict)

    sampled = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=3,
        n=3,
        max_tokens=100,
    ).choices
    finished = [c.message.content for c in sampled if c.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(text), dict) for text in finished)


# --- /v1/completions ------------------------------------------------------------------------


def test_completions_honour_response_format(client) -> None:
    request = {
        "model": "smollm2",
        "prompt": "A short profile of a person, written as JSON:\n",
        "max_tokens": 150,
        "temperature": 0,
    }
    schema = client.completions.create(
        **request, extra_body={"response_format": json_schema_format(PERSON, "person")}
    ).choices[0]
    assert schema.finish_reason == "stop"
    follows(schema.text, PERSON)

    anything = client.completions.create(
        **request, extra_body={"response_format": {"type": "json_object"}}
    ).choices[0]
    assert anything.finish_reason == "stop"
    assert isinstance(json.loads(anything.text), dict)

    streamed = client.completions.create(
        **request,
        stream=True,
        extra_body={"response_format": json_schema_format(CITY, "city")},
    )
    chunks = [c for c in streamed if c.choices]
    assert chunks[-1].choices[0].finish_reason == "stop"
    follows("".join(c.choices[0].text for c in chunks), CITY)


# --- errors ---------------------------------------------------------------------------------


def with_property(sub: dict) -> dict:
    return {"type": "object", "properties": {"a": sub}, "required": ["a"]}


# (response_format, the error's param, a regex its message must match)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(
    ("response_format", "param", "says"),
    [
        pytest.param(
            json_schema_format(with_property({"not": {"type": "string"}})),
            SCHEMA_PARAM,
            r'Unimplemented keys: \["not"\]',
            id="unsupported-keyword",
        ),
        pytest.param(
            json_schema_format(with_property({"type": "strin"})),
            SCHEMA_PARAM,
            "Invalid type: strin",
            id="invalid-type",
        ),
        pytest.param(
            json_schema_format(with_property({"type": "string", "pattern": "[a-"})),
            SCHEMA_PARAM,
            "regex parse error",
            id="bad-pattern",
        ),
        pytest.param(
            {"type": "json_schema"}, "response_format", "needs a json_schema", id="no-json-schema"
        ),
        pytest.param(
            json_schema_format(CITY, name="my schema"),
            "response_format.json_schema.name",
            "pattern",
            id="name-with-spaces",
        ),
        pytest.param(
            json_schema_format([CITY]), SCHEMA_PARAM, "object|dictionary", id="schema-is-a-list"
        ),
        pytest.param(json_schema_format(False), SCHEMA_PARAM, "admits nothing", id="schema-false"),
    ],
)
def test_unusable_formats_are_400s_naming_the_problem(
    client, app_of, endpoint, response_format, param, says
) -> None:
    """A 400 before anything reaches the engine, and the server keeps generating."""
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            client.chat.completions.create(
                model="smollm2",
                messages=ask("hi"),
                max_tokens=4,
                response_format=response_format,
            )
        else:
            client.completions.create(
                model="smollm2",
                prompt="hi",
                max_tokens=4,
                extra_body={"response_format": response_format},
            )
    assert caught.value.status_code == 400
    error = error_of(caught.value)
    assert error["param"] == param and re.search(says, error["message"]), error
    assert_idle(app_of)
    # The server still generates (no-cache: the engine runs, not the response cache).
    answer = client.chat.completions.create(
        model="smollm2",
        messages=ask("What is the capital of France?"),
        max_tokens=4,
        temperature=0,
        extra_headers={"Cache-Control": "no-cache"},
    )
    assert answer.choices[0].message.content
    assert_idle(app_of)


def test_a_true_schema_admits_any_json_value(client) -> None:
    def answer(max_tokens: int):
        return client.chat.completions.create(
            model="smollm2",
            messages=ask("Give me the first three prime numbers as a JSON array."),
            max_tokens=max_tokens,
            temperature=0,
            frequency_penalty=0.5,  # this small model's unconstrained JSON tends to repeat itself
            response_format=json_schema_format(True),
        ).choices[0]

    # The first answer computes the prompt cold, the second after a prefix hit on it: the same
    # bits (docs/kernels.md, "Prompt attention and the prefix cache"), as this near-tie first token
    # needs.
    short, whole = answer(4), answer(200)
    # Given room, the answer is a whole JSON value; cut short, it is the start of that same value
    # (greedy), never other text.
    assert whole.finish_reason == "stop", whole.message.content
    json.loads(whole.message.content)
    assert short.finish_reason == "length" and short.message.content
    assert whole.message.content.startswith(short.message.content)


# --- disconnects ----------------------------------------------------------------------------


def test_client_leaving_a_constrained_stream_aborts_it(client, server) -> None:
    url, app = server
    body = {
        "model": "smollm2",
        "messages": ask("Tell me a very long story about a dragon."),
        "response_format": json_schema_format(LONG_STORY, "story"),
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        data = (line for line in response.iter_lines() if line.startswith("data: "))
        next(data), next(data)  # the role chunk, then generated content
        assert chat_core(app).has_unfinished_requests()
    assert_idle(app)

    # The same schema serves the next request from a fresh matcher.
    again = client.chat.completions.create(**{**body, "stream": False, "max_tokens": 12})
    answer = again.choices[0]
    assert answer.finish_reason == "length" and answer.message.content.startswith('{"story": "')


# --- the response cache ---------------------------------------------------------------------


def test_identical_constrained_requests_are_cached_per_schema(client, app_of) -> None:
    def create(schema: dict | None):
        fields = {} if schema is None else {"response_format": json_schema_format(schema)}
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2",
            messages=ask("Describe a famous scientist."),
            temperature=0,
            max_tokens=150,
            **fields,
        )
        return raw.headers.get("x-cache"), raw.parse().choices[0]

    before = requests_added(app_of)
    header, first = create(PERSON)
    assert header == "MISS" and first.finish_reason == "stop"
    follows(first.message.content, PERSON)
    assert requests_added(app_of) == before + 1

    header, second = create(PERSON)
    assert header == "HIT" and requests_added(app_of) == before + 1  # no generation
    assert second.message.content == first.message.content
    assert second.finish_reason == first.finish_reason

    # The same prompt under another schema (or none) is another answer, never the cached one.
    header, city = create(CITY)
    assert header == "MISS" and requests_added(app_of) == before + 2
    assert city.finish_reason == "stop"
    follows(city.message.content, CITY)

    header, free = create(None)
    assert header == "MISS" and requests_added(app_of) == before + 3
    assert free.message.content != first.message.content
