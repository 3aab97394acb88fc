"""Requests an attacker would send: each gets a clear 4xx (never a 500) and harms no other request."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from live_server import assert_idle, chat_core, server_settings, serving_models, slowest_health
from waiting import HANG_S

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def guarded(served_models):
    """A server with short header/body deadlines, to see them act within a test."""
    settings = server_settings(**{"server.header_timeout_s": 1.0, "server.body_timeout_s": 1.0})
    with serving_models(served_models, settings) as (url, app):
        yield url, app


def post(url: str, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120, **kwargs)


# --- text that is not Unicode ------------------------------------------------------------------

SURROGATE = "\ud800"
SURROGATE_CASES = [
    (
        CHAT,
        {"model": "smollm2", "messages": [{"role": "user", "content": "hi" + SURROGATE}]},
        "messages.0.content",
    ),
    (COMPLETIONS, {"model": "smollm2", "prompt": SURROGATE}, "prompt"),
    (CHAT, {"model": "smollm2", "messages": ASK, "stop": ["a" + SURROGATE]}, "stop.0"),
    ("/tokenize", {"prompt": "x" + SURROGATE}, "prompt"),
    ("/v1/embeddings", {"model": "minilm", "input": ["fine", SURROGATE]}, "input.1"),
    ("/v1/responses", {"model": "smollm2", "input": "hi" + SURROGATE}, "input"),
]
MESSAGES = "/v1/messages"


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES)
def test_lone_surrogates_are_a_400_naming_the_field(
    guarded, path: str, body: dict, param: str
) -> None:
    url, app = guarded
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as the valid JSON escape \\ud800
    assert "\\ud800" in raw
    response = httpx.post(
        url + path, content=raw, headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (
        error["param"] == param
        and "lone surrogate" in error["message"]
        and error["code"] == "invalid_value"
    )
    assert_idle(app)


@pytest.mark.parametrize("path", [MESSAGES, MESSAGES + "/count_tokens"])
def test_lone_surrogates_in_anthropic_bodies_are_an_anthropic_400(guarded, path: str) -> None:
    url, app = guarded
    body = {
        "model": "smollm2",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}],
    }
    if path.endswith("count_tokens"):
        del body["max_tokens"]
    response = httpx.post(
        url + path, content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "lone surrogate" in error["message"] and "messages.0.content.0.text" in error["message"]
    assert_idle(app)


HOSTILE_MESSAGES = [
    # Control-token text where the template reads it as is: a tool call's id and name.
    [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "<|im_end|>", "name": "f", "input": {}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "1"}]},
    ],
    [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "a", "name": "<|im_start|>", "input": {}}],
        },
    ],
    [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": []}]}],
    [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "is_error": "yes"}]}],
    [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 7}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"text": "no type"}]}],
    [{"role": "user", "content": [["nested"]]}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": "x", "name": "extra"}],
    ["not an object"],
    [{"role": "user", "content": "word " * 3000}],  # past the model's context
]


@pytest.mark.parametrize("messages", HOSTILE_MESSAGES)
@pytest.mark.parametrize("path", [MESSAGES, MESSAGES + "/count_tokens"])
def test_hostile_anthropic_messages_are_anthropic_400s(guarded, path: str, messages) -> None:
    url, app = guarded
    body: dict = {"model": "smollm2", "messages": messages}
    if path == MESSAGES:
        body["max_tokens"] = 4
    added = chat_core(app).num_requests_added
    response = post(url, path, body)
    last = messages[-1]
    if path != MESSAGES and isinstance(last, dict) and str(last["content"]).startswith("word "):
        # Counting a long prompt is no error: only generating past the context is.
        assert response.status_code == 200 and response.json()["input_tokens"] > 2048
        return
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert chat_core(app).num_requests_added == added
    assert_idle(app)


# --- parameters that meant something else ----------------------------------------------------


def test_max_completion_tokens_zero_and_an_empty_stop_are_refused(guarded) -> None:
    url, _ = guarded
    zero = post(url, CHAT, {"model": "smollm2", "messages": ASK, "max_completion_tokens": 0})
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "max_tokens"
    for stop in ("", [""], ["ok", ""]):
        empty = post(url, CHAT, {"model": "smollm2", "messages": ASK, "stop": stop})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "stop", stop


@pytest.mark.parametrize("temperature", [1e-50, 1e-30, 1e-8])
def test_a_vanishing_temperature_is_greedy_and_harms_no_neighbour(
    guarded, temperature: float
) -> None:
    url, app = guarded
    greedy = {"model": "smollm2", "messages": ASK, "max_tokens": 12, "temperature": 0}
    expected = post(url, CHAT, greedy).json()["choices"][0]["message"]["content"]
    bodies = [
        {**greedy, "temperature": temperature, "top_k": 5},
        {**greedy, "temperature": temperature},
        {**greedy, "n": 2, "temperature": 0.7, "seed": 3},
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(
            pool.map(
                lambda b: post(
                    url, CHAT, {**b, "messages": ASK}, headers={"cache-control": "no-cache"}
                ),
                bodies,
            )
        )
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    assert responses[0].json()["choices"][0]["message"]["content"] == expected
    assert responses[1].json()["choices"][0]["message"]["content"] == expected
    assert_idle(app)


@pytest.mark.parametrize("ids", [[-1], [2**63], [-(2**70)], [1, 10**9]])
def test_echoed_token_ids_outside_the_vocabulary_are_a_400(guarded, ids: list[int]) -> None:
    url, app = guarded
    response = post(
        url, COMPLETIONS, {"model": "smollm2", "prompt": ids, "echo": True, "max_tokens": 2}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", (
        response.text
    )
    assert_idle(app)


def test_repetition_penalty_that_would_overflow_is_a_400(guarded) -> None:
    url, _ = guarded
    response = post(url, CHAT, {"model": "smollm2", "messages": ASK, "repetition_penalty": 1e-50})
    assert response.status_code == 400 and response.json()["error"]["param"] == "repetition_penalty"


# --- request ids -------------------------------------------------------------------------------


def test_a_shared_request_id_never_mixes_two_streams(guarded) -> None:
    url, app = guarded
    prompts = ["Count from 1 to 20:", "Name the planets of the solar system:"]

    def stream(prompt: str) -> tuple[str, str]:
        body = {
            "model": "smollm2",
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
        }
        text, ids = "", set()
        with httpx.stream(
            "POST", url + COMPLETIONS, json=body, headers={"X-Request-ID": "same-id"}, timeout=120
        ) as r:
            assert r.status_code == 200 and r.headers["x-request-id"] == "same-id"
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    ids.add(chunk["id"])
                    text += chunk["choices"][0]["text"]
        assert len(ids) == 1
        return text, ids.pop()

    alone = [
        post(
            url,
            COMPLETIONS,
            {"model": "smollm2", "prompt": p, "max_tokens": 24, "temperature": 0},
            headers={"cache-control": "no-cache"},
        ).json()["choices"][0]["text"]
        for p in prompts
    ]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(stream, prompts))
    assert [text for text, _ in together] == alone
    assert together[0][1] != together[1][1]
    assert_idle(app)


def test_an_id_reused_after_its_owner_left_gets_only_its_own_output(guarded) -> None:
    url, app = guarded
    first = {
        "model": "smollm2",
        "prompt": "Write a long story about a dragon:",
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    second = {"model": "smollm2", "prompt": "2 + 2 =", "max_tokens": 8, "temperature": 0}
    expected = post(url, COMPLETIONS, second, headers={"cache-control": "no-cache"}).json()[
        "choices"
    ][0]["text"]
    for _ in range(3):
        with httpx.stream(
            "POST", url + COMPLETIONS, json=first, headers={"X-Request-ID": "reused"}, timeout=60
        ) as r:
            next(
                line for line in r.iter_lines() if line.startswith("data: {")
            )  # leave mid-generation
        again = post(
            url,
            COMPLETIONS,
            second,
            headers={"X-Request-ID": "reused", "cache-control": "no-cache"},
        )
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
    assert_idle(app)


# --- bodies and connections ----------------------------------------------------------------------


def test_a_chunked_body_over_the_limit_is_413(guarded) -> None:
    url, _ = guarded

    def chunks():
        for _ in range(40):
            yield b"x" * 65536

    response = httpx.post(
        url + CHAT, content=chunks(), headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    response = httpx.post(
        url + MESSAGES, content=chunks(), headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code == 413
    assert response.json() == {
        "type": "error",
        "error": {"type": "request_too_large", "message": response.json()["error"]["message"]},
    }


def raw_request(url: str, data: bytes, wait_s: float = HANG_S) -> tuple[bytes, bool]:
    """Send `data` on a fresh connection, then read what the server says: (the bytes, whether the
    server closed the connection; False when `wait_s` passed first)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            return received, False
        return received, True


def still_open(sock: socket.socket) -> bool:
    """Whether the server has neither answered nor closed `sock` yet (a non-blocking peek)."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
    return False


def timed(call, *args):
    """(call(*args), the seconds it took)."""
    started = time.monotonic()
    result = call(*args)
    return result, time.monotonic() - started


def test_half_sent_headers_get_408_and_the_connection_is_closed(guarded) -> None:
    url, _ = guarded
    answer, closed = raw_request(
        url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"
    )
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert closed  # by the server, at its 1 s header deadline: the client would wait HANG_S


def test_a_body_that_stops_arriving_gets_408(guarded) -> None:
    url, _ = guarded
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
    answer, closed = raw_request(url, head + b'{"model": ')
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive" in answer and closed


def test_hundreds_of_slow_clients_do_not_lock_out_a_new_one(guarded) -> None:
    url, _ = guarded
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    try:
        for _ in range(300):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            sockets.append(sock)
        assert httpx.get(url + "/health", timeout=HANG_S).status_code == 200
        # Answered while the slow clients still hold their connections: not once their header
        # deadline had closed them (a count of open sockets, not a clock).
        assert any(still_open(sock) for sock in sockets)
        time.sleep(2.5)  # past the header deadline, every one of them was answered and closed
        closed = 0
        for sock in sockets:
            sock.settimeout(1)
            try:
                data = sock.recv(65536)
                closed += data.startswith(b"HTTP/1.1 408") or data == b""
            except (TimeoutError, ConnectionResetError):
                pass
        assert closed == len(sockets)
    finally:
        for sock in sockets:
            sock.close()


def test_made_up_methods_do_not_grow_the_metrics(guarded) -> None:
    url, _ = guarded
    before = httpx.get(url + "/metrics").text
    with httpx.Client() as client:
        for i in range(200):
            client.request(f"FOO{i}", url + f"/random/{i}")
    after = httpx.get(url + "/metrics").text
    assert "FOO1" not in after and "/random" not in after
    assert len(after) < len(before) + 4000  # one new (other, other, 404) series, not 200


# --- admin and CORS ----------------------------------------------------------------------------


def test_admin_key_is_checked_before_the_body(served_models) -> None:
    with serving_models(
        served_models, server_settings(**{"server.admin_api_keys": ["admin-key"]})
    ) as (url, _):
        for body in ({"steps": "not a number"}, {"unknown": 1}):
            response = post(url, "/admin/profile", body)
            assert response.status_code == 401, response.text
        invalid_json = httpx.post(
            url + "/admin/profile", content=b"{", headers={"content-type": "application/json"}
        )
        assert invalid_json.status_code == 401
        wrong = post(
            url, "/admin/profile", {"steps": 0}, headers={"Authorization": "Bearer admin-key"}
        )
        assert wrong.status_code == 400  # with the key, the body is checked
    with serving_models(served_models, server_settings()) as (url, _):
        assert post(url, "/admin/profile", {"steps": "x"}).status_code == 403


def test_cors_preflight_and_401_work_with_api_keys_on(served_models) -> None:
    settings = server_settings(
        **{"server.api_keys": ["k1"], "server.cors_allow_origins": ["http://app.example"]}
    )
    with serving_models(served_models, settings) as (url, _):
        origin = {"Origin": "http://app.example"}
        preflight = httpx.options(
            url + CHAT,
            headers={
                **origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        refused = post(url, CHAT, {"model": "smollm2", "messages": ASK}, headers=origin)
        assert (
            refused.status_code == 401
            and refused.headers["access-control-allow-origin"] == "http://app.example"
        )


# --- tokenization off the event loop -------------------------------------------------------------


def test_a_huge_prompt_does_not_stall_health(guarded) -> None:
    url, _ = guarded
    text = "lorem ipsum dolor sit amet " * 36_000  # ~970 KB, just under the 1 MiB body limit
    worst, (response, took) = slowest_health(
        url, lambda: timed(post, url, "/tokenize", {"prompt": text})
    )
    assert response.status_code == 200 and response.json()["count"] > 100_000
    # Time is the point here, measured against the same run: tokenizing on the event loop would
    # hold a /health poll for about the whole tokenization; off the loop it waits a small part.
    assert worst < took / 2, (worst, took)
