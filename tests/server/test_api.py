"""The OpenAI-compatible API over real HTTP: shapes, SSE framing, errors, disconnects, backpressure."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from live_server import chat_core, embedding_model, engine_idle
from waiting import HANG_S

CHAT = "/v1/chat/completions"
# SmolLM2's own default system prompt makes this 135M model ramble, in llama.cpp exactly as in rebar
# (their greedy answers are the same); with this one both answer the question.
ASK = [
    {"role": "system", "content": "You are a helpful AI assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def post(url: str, path: str, body: dict | bytes, **kwargs) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(
            url + path,
            content=body,
            headers={"content-type": "application/json"},
            timeout=120,
            **kwargs,
        )
    return httpx.post(url + path, json=body, timeout=120, **kwargs)


def sse_events(response: httpx.Response) -> list[str]:
    """Raw SSE lines (data payloads and comments), checking the blank-line framing."""
    text = response.text
    assert text.endswith("\n\n")
    return [block for block in text.split("\n\n") if block]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_health_ready_models(server) -> None:
    url, _ = server
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/ready").status_code == 200
    ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert ids == ["smollm2", "minilm"]


def test_chat_completion(server) -> None:
    url, _ = server
    response = post(
        url,
        CHAT,
        {"model": "smollm2", "messages": ASK, "max_tokens": 24, "temperature": 0},
        headers={"X-Request-ID": "abc-123"},
    )
    assert response.status_code == 200 and response.headers["x-request-id"] == "abc-123"
    body = response.json()
    # The client's id labels the response; the response's own id is always rebar's.
    assert (
        body["object"] == "chat.completion"
        and body["id"].startswith("chatcmpl-")
        and "abc-123" not in body["id"]
    )
    choice = body["choices"][0]
    assert "Paris" in choice["message"]["content"] and choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


def test_request_id_is_generated_when_absent(server) -> None:
    url, _ = server
    first = httpx.get(url + "/v1/models").headers["x-request-id"]
    second = httpx.get(url + "/v1/models").headers["x-request-id"]
    assert first and second and first != second


def test_chat_stream_framing(server) -> None:
    url, _ = server
    body = {
        "model": "smollm2",
        "messages": ASK,
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = post(url, CHAT, body)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert (
        response.headers["cache-control"] == "no-cache"
        and response.headers["x-accel-buffering"] == "no"
    )
    events = sse_events(response)
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "stop"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    plain = post(url, CHAT, {**body, "stream": False, "stream_options": None}).json()
    assert text == plain["choices"][0]["message"]["content"]


def test_stream_of_japanese_and_emoji_never_breaks_a_character(server) -> None:
    url, _ = server
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "日本語で自己紹介して🎉 and say café"}],
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", url + CHAT, json=body, timeout=120) as response:
        raw = b"".join(response.iter_raw())
    events = [e for e in raw.decode("utf-8").split("\n\n") if e.startswith("data: {")]
    pieces = [json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events]
    assert all("\ufffd" not in p for p in pieces)
    plain = post(url, CHAT, {**body, "stream": False}).json()["choices"][0]["message"]["content"]
    assert "".join(pieces) == plain


def test_completions_with_echo_logprobs_and_n(server) -> None:
    url, _ = server
    body = post(
        url,
        "/v1/completions",
        {
            "model": "smollm2",
            "prompt": "The capital of France is",
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": 2,
        },
    ).json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == choice["text"] and all(len(t) == 2 for t in lp["top_logprobs"])
    echoed = post(
        url,
        "/v1/completions",
        {"model": "smollm2", "prompt": "Hi there", "max_tokens": 3, "echo": True},
    ).json()
    assert echoed["choices"][0]["text"].startswith("Hi there")
    several = post(
        url,
        "/v1/completions",
        {
            "model": "smollm2",
            "prompt": "Once",
            "max_tokens": 8,
            "n": 3,
            "seed": 5,
            "temperature": 1.0,
        },
    ).json()
    assert [c["index"] for c in several["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in several["choices"]}) > 1
    again = post(
        url,
        "/v1/completions",
        {
            "model": "smollm2",
            "prompt": "Once",
            "max_tokens": 8,
            "n": 3,
            "seed": 5,
            "temperature": 1.0,
        },
    ).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in several["choices"]]


def test_each_request_is_checked_once(server, monkeypatch) -> None:
    url, app = server
    checker = chat_core(app).checker
    real_check = checker._check_prompt
    checked = []

    def counting_check(prompt):
        checked.append(len(prompt))
        return real_check(prompt)

    monkeypatch.setattr(checker, "_check_prompt", counting_check)
    random = {"model": "smollm2", "max_tokens": 2, "temperature": 1.0}  # never cached
    assert post(url, CHAT, {**random, "messages": ASK}).status_code == 200
    streamed = post(url, CHAT, {**random, "messages": ASK, "stream": True})
    assert streamed.status_code == 200
    echoed = post(url, "/v1/completions", {**random, "prompt": [1, 2, 3], "echo": True})
    assert echoed.status_code == 200
    assert len(checked) == 3 and checked[-1] == 3


def test_stop_strings(server) -> None:
    url, _ = server
    base = post(
        url,
        "/v1/completions",
        {"model": "smollm2", "prompt": "1, 2, 3, 4,", "max_tokens": 12, "temperature": 0},
    ).json()
    text = base["choices"][0]["text"]
    assert " 7" in text
    cut = post(
        url,
        "/v1/completions",
        {
            "model": "smollm2",
            "prompt": "1, 2, 3, 4,",
            "max_tokens": 12,
            "temperature": 0,
            "stop": [" 7"],
        },
    ).json()
    assert (
        cut["choices"][0]["text"] == text[: text.index(" 7")]
        and cut["choices"][0]["finish_reason"] == "stop"
    )


def test_embeddings_match_the_model(server) -> None:
    url, app = server
    body = post(
        url, "/v1/embeddings", {"model": "minilm", "input": ["hello world", "good morning"]}
    ).json()
    vectors = [d["embedding"] for d in body["data"]]
    expected = embedding_model(app).embedder.embed(["hello world", "good morning"])
    assert len(vectors) == 2 and len(vectors[0]) == 384
    assert max(abs(a - b) for a, b in zip(vectors[0], expected[0].tolist())) < 1e-5
    assert body["usage"]["prompt_tokens"] > 0
    import base64

    import numpy as np

    b64 = post(
        url,
        "/v1/embeddings",
        {"model": "minilm", "input": "hello world", "encoding_format": "base64"},
    ).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype=np.float32)
    assert np.allclose(decoded, vectors[0], atol=1e-6)


def test_embeddings_take_token_ids_as_the_model_reads_them(server) -> None:
    url, app = server
    tokenizer = embedding_model(app).text.tokenizer
    ids = [tokenizer.encode(t, add_special_tokens=True) for t in ("hello world", "good morning")]
    texts = post(
        url, "/v1/embeddings", {"model": "minilm", "input": ["hello world", "good morning"]}
    )
    one = post(url, "/v1/embeddings", {"model": "minilm", "input": ids[0]})
    many = post(url, "/v1/embeddings", {"model": "minilm", "input": ids})
    by_text = [d["embedding"] for d in texts.json()["data"]]
    assert one.json()["data"][0]["embedding"] == pytest.approx(by_text[0], abs=1e-6)
    assert [d["embedding"] for d in many.json()["data"]] == [
        pytest.approx(v, abs=1e-6) for v in by_text
    ]
    assert many.json()["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])


def test_an_embedding_input_past_the_window_is_refused_unless_truncation_is_asked(server) -> None:
    url, app = server
    model = embedding_model(app)
    window = model.max_input_tokens
    long = "word " * 400
    error = assert_error(post(url, "/v1/embeddings", {"model": "minilm", "input": long}), 400)
    assert f"at most {window}" in error["message"] and error["param"] == "input"
    cut = post(
        url,
        "/v1/embeddings",
        {"model": "minilm", "input": long, "truncate_prompt_tokens": -1},
    ).json()
    assert cut["usage"]["prompt_tokens"] == window
    # The reference: the model's own tokenizer truncating to its window ([SEP] kept).
    expected = model.embedder.embed([long])[0].tolist()
    assert cut["data"][0]["embedding"] == pytest.approx(expected, abs=1e-5)
    shorter = post(
        url, "/v1/embeddings", {"model": "minilm", "input": long, "truncate_prompt_tokens": 8}
    ).json()
    assert shorter["usage"]["prompt_tokens"] == 8
    ids = model.text.tokenizer.encode(long, add_special_tokens=True)
    by_ids = post(url, "/v1/embeddings", {"model": "minilm", "input": ids[:7] + ids[-1:]}).json()
    assert shorter["data"][0]["embedding"] == pytest.approx(
        by_ids["data"][0]["embedding"], abs=1e-6
    )


@pytest.mark.parametrize(
    "body",
    [
        {"input": [101, 10**6, 102]},
        {"input": [[101, 102], [-1]]},
        {"input": [101] * 300},
        {"input": "x", "truncate_prompt_tokens": 0},
        {"input": "x", "truncate_prompt_tokens": 100000},
        {"input": [[]]},
        {"input": [True, False]},
    ],
)
def test_bad_embedding_inputs_are_400s(server, body: dict) -> None:
    url, _ = server
    assert_error(post(url, "/v1/embeddings", {"model": "minilm", **body}), 400)


def test_tokenize_and_detokenize(server) -> None:
    url, _ = server
    tokens = post(url, "/tokenize", {"prompt": "<|im_start|>user\nhi"}).json()
    assert (
        tokens["tokens"][0] == 1
        and tokens["count"] == len(tokens["tokens"])
        and tokens["max_model_len"] == 2048
    )
    assert (
        post(url, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
        == "<|im_start|>user\nhi"
    )
    chat = post(url, "/tokenize", {"messages": ASK}).json()
    assert chat["count"] > tokens["count"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"model": "nope", "messages": ASK}, "model"),
        (CHAT, {"model": "smollm2", "messages": ASK, "temperature": -1}, "temperature"),
        (CHAT, {"model": "smollm2", "messages": ASK, "top_p": 0}, "top_p"),
        (CHAT, {"model": "smollm2", "messages": ASK, "top_p": 1.5}, "top_p"),
        (CHAT, {"model": "smollm2", "messages": ASK, "max_tokens": 5000}, "max_tokens"),
        (
            CHAT,
            {"model": "smollm2", "messages": [{"role": "user", "content": "word " * 3000}]},
            "prompt",
        ),
        (CHAT, {"model": "smollm2", "messages": ASK, "temperature": "hot"}, "temperature"),
        (
            CHAT,
            {"model": "smollm2", "messages": ASK, "tools": [{"type": "function"}]},
            "tools.0.function",
        ),
        (CHAT, {"model": "smollm2", "messages": ASK, "usr": "alice"}, "usr"),  # a typo of user
        (
            CHAT,
            {"model": "smollm2", "messages": ASK, "response_format": {"type": "json_schema"}},
            "response_format",
        ),
        (CHAT, {"model": "smollm2", "messages": ASK, "n": 0}, "n"),
        (CHAT, {"model": "smollm2", "messages": ASK, "logit_bias": {"999999": 1}}, "logit_bias"),
        (CHAT, {"model": "smollm2", "messages": [{"role": "wizard", "content": "x"}]}, None),
        (CHAT, {"model": "smollm2"}, "messages"),
        ("/v1/completions", {"model": "smollm2", "prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"model": "smollm2", "prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"model": "smollm2", "prompt": [10**9]}, "prompt"),
        ("/v1/embeddings", {"model": "minilm", "input": []}, "input"),
        ("/v1/embeddings", {"model": "minilm", "input": "x", "dimensions": 8}, "dimensions"),
        ("/v1/embeddings", {"model": "smollm2", "input": "x"}, "model"),
        (CHAT, {"model": "minilm", "messages": ASK}, "model"),
    ],
)
def test_bad_requests_get_openai_400s(server, path: str, body: dict, param: str | None) -> None:
    url, app = server
    assert_error(post(url, path, body), 400, param)
    assert engine_idle(app)


def test_malformed_json_and_wrong_content(server) -> None:
    url, _ = server
    assert_error(post(url, CHAT, b'{"model": "smollm2", "messages": ['), 400)
    assert_error(post(url, CHAT, b"[1, 2, 3]"), 400)


def test_oversized_body_is_413(server) -> None:
    url, _ = server
    huge = json.dumps(
        {"model": "smollm2", "messages": [{"role": "user", "content": "x" * (2 * 2**20)}]}
    ).encode()
    assert_error(post(url, CHAT, huge), 413)


def test_client_disconnect_mid_stream_aborts_within_a_second(server) -> None:
    url, app = server
    body = {
        "model": "smollm2",
        "messages": ASK,
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url + CHAT, json=body, timeout=60) as response:
        data = (line for line in response.iter_lines() if line.startswith("data: "))
        next(data), next(data)  # the role chunk, then generated content
        assert chat_core(app).has_unfinished_requests()
    assert engine_idle(app)


def test_non_streaming_client_that_gives_up_is_aborted(server) -> None:
    url, app = server
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + CHAT, json=body, timeout=httpx.Timeout(60, read=0.5))
    assert engine_idle(app)


def test_pings_keep_a_slow_stream_alive(server) -> None:
    url, app = server
    state = app.state.rebar
    state.ping_interval_s = 0.005
    try:
        response = post(
            url,
            CHAT,
            {
                "model": "smollm2",
                "messages": ASK,
                "max_tokens": 8,
                "stream": True,
                "temperature": 0,
            },
        )
    finally:
        state.ping_interval_s = 10.0
    events = sse_events(response)
    assert ": ping" in events and events[-1] == "data: [DONE]"


def test_overload_gives_503_with_retry_after_and_health_stays_up(server) -> None:
    from rebar.server.pipeline.gate import WaitingRoom

    url, app = server
    state = app.state.rebar
    original = state.gate.waiting
    state.gate.waiting = WaitingRoom(max_requests=1, max_prompt_tokens=10**6, retry_after_s=2)
    statuses: list[int] = []
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 64, "ignore_eos": True}

    def call() -> None:
        response = post(url, CHAT, body)
        statuses.append(response.status_code)
        if response.status_code == 503:
            assert response.headers["retry-after"] == "2"
            assert_error(response, 503)

    threads = [threading.Thread(target=call) for _ in range(6)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(0.05)
        assert httpx.get(url + "/health", timeout=HANG_S).status_code == 200
        for thread in threads:
            thread.join(120)
    finally:
        state.gate.waiting = original
    assert 503 in statuses and 200 in statuses
    assert engine_idle(app)
