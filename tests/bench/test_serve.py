"""`rebar bench serve` against a fake OpenAI-compatible server that streams awkward but valid SSE.

The fake (Starlette under uvicorn, in a background thread on 127.0.0.1) streams a fixed number of
one-token content chunks with small sleeps, sends `: ping` comments, splits some events across
writes and glues others together, ends with a finish chunk, a usage chunk and `data: [DONE]`, and
can answer chosen requests with an HTTP error or an in-stream error. It records every request body
and the most requests it ever had in flight at once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rebar.cli import main
from rebar_bench.serve import (
    BenchConfigError,
    ServeBenchConfig,
    SseDecoder,
    make_prompts,
    parse_concurrency_levels,
    percentiles,
    run_serve_bench,
)

MODEL_ID = "fake-model"


@dataclass
class Behaviour:
    num_tokens: int = 6
    token_delay_s: float = 0.004
    send_usage: bool = True
    reported_tokens: int | None = (
        None  # usage.completion_tokens, when it should differ from num_tokens
    )
    http_errors: dict[int, int] = field(default_factory=dict)  # arrival index -> status
    stream_errors: set[int] = field(
        default_factory=set
    )  # arrival index -> error object after 2 tokens
    hang: set[int] = field(default_factory=set)  # arrival index -> never finishes


class FakeServer:
    """The fake's state lives on the server thread; tests read it only after a run has finished."""

    def __init__(self) -> None:
        self.reset(Behaviour())
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ]
        )
        self.url = ""

    def reset(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}, {"id": "other"}]}
        )

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completions")

    async def _complete(self, request: Request, endpoint: str) -> Response:
        body = await request.json()
        index = len(self.bodies)
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        status = self.behaviour.http_errors.get(index)
        if status is not None:
            await asyncio.sleep(self.behaviour.token_delay_s)
            self.in_flight -= 1
            error = {
                "error": {"message": f"fake says {status}", "type": "fake_error", "code": status}
            }
            return JSONResponse(error, status_code=status)
        return StreamingResponse(self._events(index, endpoint), media_type="text/event-stream")

    def _chunk(self, endpoint: str, text: str | None, finish: str | None = None) -> dict:
        if endpoint == "chat":
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish}
        return {"id": "cmpl-1", "object": "chunk", "model": MODEL_ID, "choices": [choice]}

    async def _events(self, index: int, endpoint: str) -> AsyncIterator[str]:
        behaviour = self.behaviour
        counted = True
        try:
            yield ": ping\n\n"
            if (
                endpoint == "chat"
            ):  # a role-only first chunk: not content, must not stop the TTFT clock
                yield (
                    "data: "
                    + json.dumps(
                        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                    )
                    + "\n\n"
                )
            for i in range(behaviour.num_tokens):
                await asyncio.sleep(behaviour.token_delay_s)
                if index in behaviour.hang:
                    await asyncio.sleep(3600)
                if index in behaviour.stream_errors and i == 2:
                    yield (
                        "data: "
                        + json.dumps({"error": {"message": "fake engine failure", "code": 500}})
                        + "\n\n"
                    )
                    return
                event = "data: " + json.dumps(self._chunk(endpoint, f" tok{i}")) + "\n\n"
                if i % 3 == 1:  # one event over two writes
                    middle = len(event) // 2
                    yield event[:middle]
                    await asyncio.sleep(0.002)
                    yield event[middle:]
                elif i % 3 == 2:  # a ping and an event (with CRLF line ends) in one write
                    yield ": ping\r\n\r\n" + event.replace("\n", "\r\n")
                else:
                    yield event
            yield "data: " + json.dumps(self._chunk(endpoint, None, finish="length")) + "\n\n"
            if behaviour.send_usage:
                tokens = (
                    behaviour.num_tokens
                    if behaviour.reported_tokens is None
                    else behaviour.reported_tokens
                )
                usage = {
                    "prompt_tokens": 10,
                    "completion_tokens": tokens,
                    "total_tokens": 10 + tokens,
                }
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            # Leave the in-flight count before `[DONE]`, so a client that starts its next request
            # the moment it sees `[DONE]` is never counted twice.
            self.in_flight -= 1
            counted = False
            yield ": ping\n\ndata: [DONE]\n\n"
        finally:
            if counted:
                self.in_flight -= 1


def _free_socket() -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they
    # are TCP, and with Nagle on, small SSE writes on a reused connection wait ~40 ms for delayed
    # ACKs.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    server_state = FakeServer()
    sock = _free_socket()
    config = uvicorn.Config(
        server_state.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    server_state.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield server_state
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def _run(fake: FakeServer, behaviour: Behaviour, levels: list[int], **overrides):
    fake.reset(behaviour)
    settings = {
        "url": fake.url,
        "num_prompts": 8,
        "input_words": 12,
        "output_tokens": behaviour.num_tokens,
        **overrides,
    }
    return asyncio.run(run_serve_bench(ServeBenchConfig(**settings), levels))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_request_is_measured(fake: FakeServer, endpoint: str) -> None:
    report = _run(fake, Behaviour(num_tokens=6), [2], endpoint=endpoint)
    (level,) = report.levels
    assert report.config.model == MODEL_ID  # the first id from /v1/models
    assert (level.num_requests, level.num_ok, level.num_failed, level.errors) == (8, 8, 0, {})
    assert len(fake.bodies) == 8
    for result in level.requests:
        assert result.ok and result.error is None
        assert (
            result.output_tokens == 6 and result.num_content_chunks == 6
        )  # pings and role chunk ignored
        assert len(result.itl_s) == 6 - 1
        assert 0 < result.ttft_s < result.e2e_s
        assert all(gap > 0 for gap in result.itl_s)
    assert level.output_tokens == 8 * 6
    assert level.output_tokens_per_s == pytest.approx(48 / level.duration_s)
    assert level.requests_per_s == pytest.approx(8 / level.duration_s)
    assert (
        0
        < level.ttft_ms["p50"]
        <= level.ttft_ms["p90"]
        <= level.ttft_ms["p99"]
        < level.e2e_ms["p50"] * 2
    )
    assert level.itl_ms["p50"] >= 0.5 * 1000 * 0.004  # the fake sleeps 4 ms between tokens


def test_request_bodies_are_openai_streaming_requests(fake: FakeServer) -> None:
    _run(
        fake,
        Behaviour(num_tokens=3),
        [1, 2],
        endpoint="chat",
        num_prompts=4,
        input_words=9,
        model="chosen",
    )
    prompts = [body["messages"][0]["content"] for body in fake.bodies]
    assert len(set(prompts)) == 8  # distinct across requests and across levels
    assert all(len(prompt.split()) == 9 for prompt in prompts)
    for body in fake.bodies:
        assert body["model"] == "chosen" and body["max_tokens"] == 3 and body["temperature"] == 0
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["messages"][0]["role"] == "user" and "ignore_eos" not in body
    _run(fake, Behaviour(num_tokens=3), [1], endpoint="completions", num_prompts=2, ignore_eos=True)
    assert all(
        isinstance(body["prompt"], str) and body["ignore_eos"] is True for body in fake.bodies
    )


def test_usage_chunk_wins_and_chunk_count_is_the_fallback(fake: FakeServer) -> None:
    with_usage = _run(fake, Behaviour(num_tokens=4, reported_tokens=7), [2], num_prompts=4).levels[
        0
    ]
    assert [r.output_tokens for r in with_usage.requests] == [7] * 4
    without_usage = _run(
        fake, Behaviour(num_tokens=4, send_usage=False), [2], num_prompts=4
    ).levels[0]
    assert [r.output_tokens for r in without_usage.requests] == [4] * 4
    assert all(r.usage_output_tokens is None for r in without_usage.requests)


@pytest.mark.parametrize("concurrency", [1, 3, 4])
def test_concurrency_is_reached_and_never_exceeded(fake: FakeServer, concurrency: int) -> None:
    level = _run(fake, Behaviour(num_tokens=5), [concurrency], num_prompts=8).levels[0]
    assert fake.max_in_flight == concurrency
    assert level.max_in_flight == concurrency and level.num_ok == 8


def test_errors_are_counted_by_cause_without_stopping_the_run(fake: FakeServer) -> None:
    behaviour = Behaviour(num_tokens=4, http_errors={1: 429, 4: 429, 6: 500}, stream_errors={2})
    level = _run(fake, behaviour, [3], num_prompts=10).levels[0]
    assert level.num_requests == 10 and len(fake.bodies) == 10
    assert level.errors == {"429": 2, "500": 1, "stream_error": 1}
    assert (level.num_ok, level.num_failed) == (6, 4)
    assert level.error_examples["429"] == "fake says 429"
    assert level.error_examples["stream_error"] == "fake engine failure"
    assert level.output_tokens == 6 * 4  # only successful requests count
    assert all(r.output_tokens == 0 for r in level.requests if not r.ok)


def test_a_request_past_the_timeout_fails_alone(fake: FakeServer) -> None:
    level = _run(fake, Behaviour(num_tokens=3, hang={0}), [2], num_prompts=4, timeout_s=0.5).levels[
        0
    ]
    assert level.errors == {"timeout": 1} and level.num_ok == 3


def test_cli_prints_a_table_and_writes_json(fake: FakeServer, tmp_path, capsys) -> None:
    fake.reset(Behaviour(num_tokens=3))
    out = tmp_path / "serve.json"
    code = main(
        [
            "bench",
            "serve",
            "--url",
            fake.url + "/v1/",
            "--concurrency",
            "1,2",
            "--num-prompts",
            "3",
            "--input-words",
            "5",
            "--output-tokens",
            "3",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "TTFT p50/p90/p99 ms" in table and MODEL_ID in table
    rows = [line.split() for line in table.splitlines()[2:]]
    assert [row[:3] for row in rows] == [["1", "3", "0"], ["2", "3", "0"]]
    results = json.loads(out.read_text())
    assert [r["concurrency"] for r in results] == [1, 2]
    for r in results:
        assert (
            r["model"] == MODEL_ID
            and r["endpoint"] == "chat"
            and r["num_ok"] == 3
            and r["output_tokens"] == 9
        )
        assert set(r["ttft_ms"]) == {"p50", "p90", "p95", "p99", "mean"} and "requests" not in r


def test_cli_reports_request_errors_and_still_succeeds(fake: FakeServer, capsys) -> None:
    fake.reset(Behaviour(num_tokens=2, http_errors={0: 500}))
    code = main(
        [
            "bench",
            "serve",
            "--url",
            fake.url,
            "--concurrency",
            "1",
            "--num-prompts",
            "2",
            "--input-words",
            "3",
            "--output-tokens",
            "2",
            "--endpoint",
            "completions",
        ]
    )
    assert code == 0
    assert "1 x 500: fake says 500" in capsys.readouterr().out


def test_unreachable_server_exits_2_with_a_clear_message(capsys) -> None:
    with _free_socket() as sock:  # bound but never listening: connections are refused
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        code = main(["bench", "serve", "--url", url, "--concurrency", "1", "--num-prompts", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot reach the server" in err and f"{url}/v1/models" in err


@pytest.mark.parametrize(
    "bad",
    [
        ["--concurrency", "1,x"],
        ["--concurrency", "0"],
        ["--num-prompts", "0"],
        ["--url", "localhost:8000"],
    ],
)
def test_bad_arguments_exit_2(bad: list[str], capsys) -> None:
    args = {"--url": "http://127.0.0.1:9", "--concurrency": "1", "--num-prompts": "1"}
    args.update(dict(zip(bad[::2], bad[1::2])))
    code = main(["bench", "serve", *[item for pair in args.items() for item in pair]])
    assert code == 2
    assert bad[0] in capsys.readouterr().err


def test_helpers() -> None:
    assert parse_concurrency_levels("1, 4,16") == [1, 4, 16]
    with pytest.raises(BenchConfigError):
        parse_concurrency_levels("")
    assert make_prompts(3, 7, seed=1) == make_prompts(3, 7, seed=1) != make_prompts(3, 7, seed=2)
    assert make_prompts(2, 7, seed=1, level=0) != make_prompts(2, 7, seed=1, level=1)
    assert percentiles([float(i) for i in range(101)]) == {
        "p50": 50.0,
        "p90": 90.0,
        "p95": 95.0,
        "p99": 99.0,
        "mean": 50.0,
    }
    assert percentiles([])["p50"] is None
    decoder = SseDecoder()
    assert [decoder.feed(line) for line in [": ping", 'data: {"a":', "data: 1}", "event: x", ""]][
        -1
    ] == ['{"a":\n1}']
    assert (
        decoder.feed('data: {"a": 1}') == []
        and decoder.feed("data: [DONE]") == []
        and decoder.flush() == ['{"a": 1}', "[DONE]"]
    )
