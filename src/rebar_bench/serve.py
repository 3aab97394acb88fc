"""`rebar bench serve`: load-test any OpenAI-compatible HTTP server with streaming requests.

For each concurrency level the benchmark sends `num_prompts` streaming requests with at most
`concurrency` of them in flight, and measures per request: time to the first chunk that carries
content text (TTFT), the gaps between successive content chunks (ITL), end-to-end latency and the
number of output tokens (the server's `usage` when it sends one, else the number of content chunks).

Prompts are `input_words` words drawn from a fixed English word list by a seeded RNG; every request
of every level gets its own prompt, so a server's prefix cache cannot answer one request from
another. Words are not tokens: a word is usually one to two tokens.

A failed request never stops the run. Failures are counted by cause: the HTTP status ("429",
"500", ...), "stream_error" (an `error` object inside a 200 stream), "incomplete_stream" (the body
ended without `data: [DONE]` or a finish reason), "bad_chunk" (a data line that is not JSON),
"timeout" (the request outlived `timeout_s`) or the name of the network error ("ConnectError", ...).
Latency statistics cover successful requests only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import httpx

from rebar.errors import RebarError
from rebar_bench.server_metrics import scrape_step_histogram, step_times_ms
from rebar_bench.sse_reader import RequestResult, SseDecoder, StreamReader, error_message

logger = logging.getLogger(__name__)

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

# Plain, common English words; prompts are sampled from these so they look like text to a tokenizer.
WORDS = tuple(
    """
    about above across after again against air all almost alone along already also always among
    animal answer any apple area arm around art ask away baby back ball bank base bear beauty bed
    before begin behind believe bell below best better between bird black blue board boat body book
    both bottom box boy bread bright bring brother brown build burn busy call came camp can car care
    carry case cat catch cause center chair chance change child city class clean clear climb clock
    close cloud coast cold color come common corn cotton could country course cover cross crowd cry
    current cut dance dark day dead deal dear deep desert design develop did differ direct doctor
    dog door double down draw dream dress drink drive dry during early earth east eat edge egg end
    enough even evening event every exact example eye face fact fair fall family far farm fast
    father feel field figure fill final find fine fire first fish five floor flower fly follow food
    foot forest form four free fresh friend front fruit full game garden gather gentle gift give
    glad glass gold good grass great green ground group grow guess half hand happy hard head hear
    heart heat heavy help here high hill history hold home hope horse hot hour house huge hunt idea
    island join journey just keep kind king kitchen know lake land large last late laugh lead learn
    leave letter light line listen little live long look love low machine main make many map mark
    market measure meet middle might mile milk mind minute moon morning mother mountain move music
    name nation near need never new night noise north note number ocean offer often old open order
    other paint paper party path people piece place plain plan plant play point poor power present
    problem pull quiet rain reach read ready real record red remember rest river road rock room
    round rule run safe sail salt same sand save say school science sea season seat second see seed
    serve settle shape share ship shore short show side sign silver simple sing sister sit size sky
    sleep slow small smile snow soft soil song sound south space speak spring square stand star
    start station stay step still stone stop story street strong study summer sun table tail take
    talk teach team tell thank thick thin think through time tiny together tool town track trade
    train travel tree true turn under until valley very visit voice wait walk warm wash watch water
    wave weather week west wheel white whole wide wild wind window winter wish wonder wood word
    work world write yard year yellow young
    """.split()
)


class BenchConfigError(RebarError, ValueError):
    """A benchmark setting that cannot be used (bad concurrency list, non-positive count, bad
    URL)."""


class ServerUnreachableError(RebarError):
    """The server did not answer `GET {url}/v1/models` with a model list."""


@dataclass(frozen=True)
class ServeBenchConfig:
    """What to send. `url` is the server's base URL (a trailing `/v1` is accepted and dropped);
    `model=None` means the first id listed by `GET /v1/models`."""

    url: str
    model: str | None = None
    endpoint: str = "chat"
    num_prompts: int = 32
    input_words: int = 128
    output_tokens: int = 128
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise BenchConfigError(f"--url must start with http:// or https://, got {self.url!r}")
        base = self.url.rstrip("/")
        object.__setattr__(self, "url", base[: -len("/v1")] if base.endswith("/v1") else base)
        if self.endpoint not in ENDPOINTS:
            raise BenchConfigError(
                f"--endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}"
            )
        for name in ("num_prompts", "input_words", "output_tokens"):
            if getattr(self, name) < 1:
                raise BenchConfigError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if not self.timeout_s > 0:
            raise BenchConfigError(f"--timeout must be positive, got {self.timeout_s}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class LevelResult:
    """Everything measured at one concurrency level; `requests` is left out of `to_dict()`."""

    concurrency: int
    num_requests: int
    num_ok: int
    num_failed: int
    errors: dict[str, int]
    error_examples: dict[str, str]  # the first message seen for each failure cause
    duration_s: float
    output_tokens: int  # of successful requests, like every rate and latency below
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    max_in_flight: int  # as seen by the client; never above `concurrency`
    requests: list[RequestResult] = field(default_factory=list, repr=False, compare=False)
    # The engine's decode step while the level ran (p50, mean ms, steps), from a rebar server's
    # /metrics; None for other servers.
    engine_step_ms: dict[str, float | None] | None = None

    @property
    def serving_overhead_ms(self) -> float | None:
        """What the HTTP path adds per token: inter-token p50 minus the engine's step p50 (read
        from histogram buckets 10% wide)."""
        return self._overhead("p50")

    @property
    def serving_overhead_mean_ms(self) -> float | None:
        """The same from means, which the histogram gives exactly (its sum and count): at one
        stream, every decode step yields one chunk, so this is the time added per token."""
        return self._overhead("mean")

    def _overhead(self, statistic: str) -> float | None:
        step = (self.engine_step_ms or {}).get(statistic)
        itl = self.itl_ms.get(statistic)
        return None if step is None or itl is None else itl - step

    def to_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "requests"}
        return values | {
            "serving_overhead_ms": self.serving_overhead_ms,
            "serving_overhead_mean_ms": self.serving_overhead_mean_ms,
        }


@dataclass(frozen=True)
class ServeBenchReport:
    """The resolved configuration (with the model name filled in) and one result per level."""

    config: ServeBenchConfig
    levels: list[LevelResult]

    def to_dicts(self) -> list[dict[str, Any]]:
        c = self.config
        context = {
            "url": c.url,
            "model": c.model,
            "endpoint": c.endpoint,
            "num_prompts": c.num_prompts,
            "input_words": c.input_words,
            "output_tokens_requested": c.output_tokens,
        }
        return [{**context, **level.to_dict()} for level in self.levels]

    def to_json(self) -> str:
        return json.dumps(self.to_dicts(), indent=2)

    def table(self) -> str:
        return format_table(self)


def parse_concurrency_levels(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; raises BenchConfigError for anything else."""
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise BenchConfigError(
            f"--concurrency must be a comma-separated list of positive integers, got {text!r}"
        ) from None
    if not levels or min(levels) < 1:
        raise BenchConfigError(f"--concurrency levels must be at least 1, got {text!r}")
    return levels


def make_prompts(num_prompts: int, input_words: int, seed: int, level: int = 0) -> list[str]:
    """`num_prompts` prompts of exactly `input_words` words; the same arguments give the same
    prompts."""
    rng = random.Random(f"rebar-bench-serve:{seed}:{level}")
    return [" ".join(rng.choices(WORDS, k=input_words)) for _ in range(num_prompts)]


def percentiles(samples: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p95/p99 (linear interpolation between closest ranks) and mean; all None without
    samples."""
    if not samples:
        return {"p50": None, "p90": None, "p95": None, "p99": None, "mean": None}
    ordered = sorted(samples)

    def at(q: float) -> float:
        rank = q * (len(ordered) - 1)
        low, high = math.floor(rank), math.ceil(rank)
        return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)

    return {
        "p50": at(0.5),
        "p90": at(0.9),
        "p95": at(0.95),
        "p99": at(0.99),
        "mean": sum(ordered) / len(ordered),
    }


def _request_body(config: ServeBenchConfig, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": config.output_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _stream(
    client: httpx.AsyncClient,
    config: ServeBenchConfig,
    prompt: str,
    result: RequestResult,
    start: float,
) -> None:
    url = config.url + ENDPOINTS[config.endpoint]
    async with client.stream(
        "POST", url, json=_request_body(config, prompt), headers=config.headers()
    ) as response:
        if response.status_code != 200:
            result.error = str(response.status_code)
            result.error_message = error_message(await response.aread())
            return
        reader, decoder = StreamReader(result, config.endpoint, start), SseDecoder()
        # Keep reading after `[DONE]` so the body ends cleanly and the connection goes back to the
        # pool.
        async for line in response.aiter_lines():
            now = time.perf_counter()
            if not reader.handle_all(decoder.feed(line), now):
                return
        if not reader.handle_all(decoder.flush(), time.perf_counter()):
            return
    if not reader.finished:
        result.error = "incomplete_stream"
        result.error_message = (
            "body ended without data: [DONE] (content-type "
            f"{response.headers.get('content-type')!r})"
        )
        return
    result.ok = True
    reported = result.usage_output_tokens
    result.output_tokens = reported if reported is not None else result.num_content_chunks


async def run_request(
    client: httpx.AsyncClient, config: ServeBenchConfig, prompt: str
) -> RequestResult:
    """Sends one streaming request and measures it; never raises for anything the server does."""
    result = RequestResult()
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, config, prompt, result, start), config.timeout_s)
    except TimeoutError:
        result.error, result.error_message = (
            "timeout",
            f"no complete answer within {config.timeout_s:g} s",
        )
    except (httpx.HTTPError, OSError) as exc:
        result.error, result.error_message = type(exc).__name__, str(exc)[:200]
    result.e2e_s = time.perf_counter() - start
    if result.error is not None:
        result.ok = False
    return result


async def run_level(
    client: httpx.AsyncClient, config: ServeBenchConfig, prompts: Sequence[str], concurrency: int
) -> LevelResult:
    """Sends every prompt with at most `concurrency` requests in flight."""
    semaphore = asyncio.Semaphore(concurrency)
    in_flight = max_in_flight = 0

    async def one(prompt: str) -> RequestResult:
        nonlocal in_flight, max_in_flight
        async with semaphore:
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                return await run_request(client, config, prompt)
            finally:
                in_flight -= 1

    started = time.perf_counter()
    results = await asyncio.gather(*(one(prompt) for prompt in prompts))
    return summarize_level(concurrency, list(results), time.perf_counter() - started, max_in_flight)


def summarize_level(
    concurrency: int, results: list[RequestResult], duration_s: float, max_in_flight: int
) -> LevelResult:
    ok = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if not r.ok and r.error is not None)
    examples: dict[str, str] = {}
    for r in results:
        if r.error is not None:
            examples.setdefault(r.error, r.error_message)
    output_tokens = sum(r.output_tokens for r in ok)
    return LevelResult(
        concurrency=concurrency,
        num_requests=len(results),
        num_ok=len(ok),
        num_failed=len(results) - len(ok),
        errors=dict(errors.most_common()),
        error_examples=examples,
        duration_s=duration_s,
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / duration_s if duration_s > 0 else 0.0,
        requests_per_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        ttft_ms=percentiles([r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
        itl_ms=percentiles([gap * 1000 for r in ok for gap in r.itl_s]),
        e2e_ms=percentiles([r.e2e_s * 1000 for r in ok]),
        max_in_flight=max_in_flight,
        requests=results,
    )


async def list_models(client: httpx.AsyncClient, config: ServeBenchConfig) -> list[str]:
    """The model ids from `GET {url}/v1/models`; raises ServerUnreachableError when that fails."""
    url = f"{config.url}/v1/models"
    try:
        response = await client.get(
            url, headers=config.headers(), timeout=min(config.timeout_s, 10.0)
        )
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(
            f"cannot reach the server: GET {url} failed ({type(exc).__name__}: {exc})"
        ) from None
    if response.status_code != 200:
        hint = " (check --api-key)" if response.status_code in (401, 403) else ""
        raise ServerUnreachableError(
            f"GET {url} answered HTTP {response.status_code}{hint}: "
            f"{error_message(response.content)}"
        )
    try:
        entries = response.json().get("data") or []
    except (ValueError, AttributeError):
        raise ServerUnreachableError(
            f"GET {url} did not return an OpenAI-style model list"
        ) from None
    return [str(entry["id"]) for entry in entries if isinstance(entry, dict) and "id" in entry]


async def run_serve_bench(
    config: ServeBenchConfig, concurrency_levels: Sequence[int]
) -> ServeBenchReport:
    """Checks the server, resolves the model, then runs each concurrency level in order."""
    if not concurrency_levels or min(concurrency_levels) < 1:
        raise BenchConfigError(
            f"concurrency levels must be at least 1, got {list(concurrency_levels)}"
        )
    widest = max(concurrency_levels)
    limits = httpx.Limits(max_connections=widest, max_keepalive_connections=widest)
    timeout = httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 30.0))
    # trust_env=False: proxy variables would put a proxy between the benchmark and the server.
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model_ids = await list_models(client, config)
        if config.model is None:
            if not model_ids:
                raise ServerUnreachableError(f"{config.url}/v1/models lists no model; pass --model")
            config = replace(config, model=model_ids[0])
        levels = []
        for index, concurrency in enumerate(concurrency_levels):
            logger.info(
                "concurrency %d: %d requests to %s",
                concurrency,
                config.num_prompts,
                config.url + ENDPOINTS[config.endpoint],
            )
            prompts = make_prompts(config.num_prompts, config.input_words, config.seed, level=index)
            before = await scrape_step_histogram(client, config.url)
            level = await run_level(client, config, prompts, concurrency)
            after = await scrape_step_histogram(client, config.url)
            levels.append(replace(level, engine_step_ms=step_times_ms(before, after)))
    return ServeBenchReport(config, levels)


def _triple(values: dict[str, float | None]) -> str:
    picked = [values[key] for key in ("p50", "p90", "p99")]
    return "-" if picked[0] is None else " / ".join(f"{v:.1f}" for v in picked if v is not None)


def _pair(first: float | None, second: float | None) -> str:
    if first is None or second is None:
        return "-"
    return f"{first:.2f} / {second:.2f}"


def format_table(report: ServeBenchReport) -> str:
    """A header line, one row per concurrency level, then one line per failure cause."""
    c = report.config
    header = (
        f"model {c.model} via {c.url}{ENDPOINTS[c.endpoint]}: {c.num_prompts} requests per level, "
        f"{c.input_words} words in, max {c.output_tokens} tokens out"
    )
    columns = (
        "concurrency",
        "ok",
        "failed",
        "duration s",
        "req/s",
        "out tok/s",
        "TTFT p50/p90/p99 ms",
        "ITL p50/p90/p99 ms",
        "E2E p50/p90/p99 ms",
        "step p50/mean ms",
        "overhead p50/mean ms",
    )
    rows = [
        (
            str(r.concurrency),
            str(r.num_ok),
            str(r.num_failed),
            f"{r.duration_s:.2f}",
            f"{r.requests_per_s:.2f}",
            f"{r.output_tokens_per_s:.1f}",
            _triple(r.ttft_ms),
            _triple(r.itl_ms),
            _triple(r.e2e_ms),
            _pair((r.engine_step_ms or {}).get("p50"), (r.engine_step_ms or {}).get("mean")),
            _pair(r.serving_overhead_ms, r.serving_overhead_mean_ms),
        )
        for r in report.levels
    ]
    widths = [max(len(col), *(len(row[i]) for row in rows)) for i, col in enumerate(columns)]
    lines = [header, "  ".join(col.rjust(w) for col, w in zip(columns, widths))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    for r in report.levels:
        for cause, count in r.errors.items():
            lines.append(
                f"concurrency {r.concurrency}: {count} x {cause}: {r.error_examples.get(cause, '')}"
            )
    return "\n".join(lines)
