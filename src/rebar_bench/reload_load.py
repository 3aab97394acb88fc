"""`rebar bench reload`: hot reloads under streaming load across server processes that share one
Redis, as an operator would run them.

N `rebar serve` processes on the same model and store; S clients stream chat completions in a
loop, spread over the processes; R reloads, each asked of the next process in turn (it loads the
new version, then announces it; the others follow). Reported: failed requests, streams that saw
more than one version (there must be none), how long each reload took to reach every process,
the swap itself, the longest pause between chunks a client saw during a reload against the usual
one, and each process's memory: at its peak during the reloads (under load), and idle just before
the first reload and once the old versions are freed. Both idle figures are taken with the streams
paused and the engine's freed temporaries given back, so they compare what each process holds, not
how far its heap grew under load (that varied by ~100 MiB from run to run).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from rebar_bench.rebar_server import rebar_server_process
from rebar_bench.serve import percentiles

ADMIN_KEY = "rebar-bench-reload"
SETTLE_S = 0.25
SETTLE_KIB = 1024


@dataclass
class StreamRecord:
    server: int
    version: str = ""  # the X-Rebar-Model-Version header
    fingerprints: set[str] = field(default_factory=set)  # every chunk's system_fingerprint
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class ReloadFigures:
    asked_of: int  # which process published it
    version: int
    load_s: float  # that process: loading and warming the new version
    swap_ms: float  # that process: switching new requests to it
    drained_first: bool
    reached_every_process_s: float  # from the call to every process serving the new version
    follower_swap_ms: list[float]  # the other processes' own switch


@dataclass
class MemoryFigures:
    """Resident memory of one process, MiB: all of it, and its private (anonymous) part."""

    rss_before: float
    rss_peak: float
    rss_after: float
    anon_before: float
    anon_peak: float
    anon_after: float


@dataclass
class ReloadLoadReport:
    model: str
    servers: int
    streams: int
    requests: int
    failed: int
    mixed_version_streams: int
    versions_seen: list[str]
    reloads: list[ReloadFigures]
    gap_ms_steady: dict[str, float | None]  # between chunks, outside reload windows
    gap_ms_during_reloads: dict[str, float | None]
    memory: list[MemoryFigures]
    retiring_after: list[list[int]]  # per process: versions not yet freed at the end (none)
    errors: list[str]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def table(self) -> str:
        lines = [
            f"{self.model}: {self.servers} processes, {self.streams} streams, "
            f"{self.requests} requests, {self.failed} failed, "
            f"{self.mixed_version_streams} streams with more than one version",
            "reload  asked of  load s  swap ms  every process after s  followers' swap ms",
        ]
        for r in self.reloads:
            followers = ", ".join(f"{ms:.3f}" for ms in r.follower_swap_ms)
            lines.append(
                f"v{r.version:<6} {r.asked_of:>8}  {r.load_s:6.2f}  {r.swap_ms:7.3f}  "
                f"{r.reached_every_process_s:21.2f}  {followers}"
                + ("  (drained first)" if r.drained_first else "")
            )
        steady, during = self.gap_ms_steady, self.gap_ms_during_reloads
        lines.append(
            f"chunk gaps ms p50/p99/max: steady {_triple(steady)}, during reloads {_triple(during)}"
        )
        for i, m in enumerate(self.memory):
            lines.append(
                f"process {i} RSS MiB before/peak/after {m.rss_before:.0f}/{m.rss_peak:.0f}/"
                f"{m.rss_after:.0f}, private {m.anon_before:.0f}/{m.anon_peak:.0f}/"
                f"{m.anon_after:.0f}"
            )
        return "\n".join(lines)


def _triple(values: dict[str, float | None]) -> str:
    return "/".join(
        "-" if values.get(k) is None else f"{values[k]:.0f}" for k in ("p50", "p99", "max")
    )


def _memory_kib(pid: int) -> tuple[int, int]:
    fields = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon"):
                fields[name] = int(value.split()[0])
    return fields["VmRSS"], fields["RssAnon"]


class MemorySampler:
    """Samples the processes' memory every `interval_s` in a thread, keeping each one's peak."""

    def __init__(self, pids: list[int], interval_s: float = 0.05) -> None:
        self.pids, self.interval_s = pids, interval_s
        self.peaks = [(0, 0)] * len(pids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def reset_peaks(self) -> None:
        self.peaks = self.now()

    def now(self) -> list[tuple[int, int]]:
        return [_memory_kib(pid) for pid in self.pids]

    async def settled(self, timeout_s: float = 10.0) -> list[tuple[int, int]]:
        """The processes' memory once it stops falling (an engine gives its freed temporaries back
        as it goes idle): two samples SETTLE_S apart within SETTLE_KIB of each other."""
        deadline = time.monotonic() + timeout_s
        last = self.now()
        while time.monotonic() < deadline:
            await asyncio.sleep(SETTLE_S)
            sample = self.now()
            if all(abs(a[1] - b[1]) <= SETTLE_KIB for a, b in zip(sample, last)):
                return sample
            last = sample
        return last

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for i, (rss, anon) in enumerate(self.now()):
                self.peaks[i] = (max(self.peaks[i][0], rss), max(self.peaks[i][1], anon))

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _stream_once(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    record: StreamRecord,
) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "stream": True,
    }
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"{response.status_code} {(await response.aread())[:200]!r}"
                return
            record.version = response.headers.get("x-rebar-model-version", "")
            done = False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        record.error = str(chunk["error"])
                    record.fingerprints.add(chunk.get("system_fingerprint", ""))
                    record.chunk_times.append(time.monotonic())
            if not done and record.error is None:
                record.error = "the stream ended without [DONE]"
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"


async def _wait_for_version(
    client: httpx.AsyncClient, urls: list[str], model: str, version: int
) -> float:
    started = time.monotonic()
    while True:
        states = []
        for url in urls:
            listing = (await client.get(url + "/v1/models")).json()["data"]
            states.append(next(m for m in listing if m["id"] == model))
        if all(s["version"] >= version and s["state"] == "loaded" for s in states):
            return time.monotonic() - started
        if time.monotonic() - started > 600:
            raise RuntimeError(f"not every process serves v{version} after 600 s: {states}")
        await asyncio.sleep(0.05)


async def _admin_models(client: httpx.AsyncClient, url: str, model: str) -> dict:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    listing = (await client.get(url + "/admin/models", headers=headers)).json()["data"]
    return next(m for m in listing if m["id"] == model)


class _Clients:
    """`streams` clients streaming chat completions in a loop, spread over the servers; they can
    be paused between requests (to measure the servers idle) and stopped."""

    def __init__(
        self, client: httpx.AsyncClient, urls: list[str], model: str, max_tokens: int
    ) -> None:
        self.client, self.urls, self.model, self.max_tokens = client, urls, model, max_tokens
        self.records: list[StreamRecord] = []
        self.in_flight = 0
        self._running = asyncio.Event()  # cleared: the clients pause between requests
        self._running.set()
        self._stopping = False
        self._request_ended = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, streams: int) -> None:
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(streams)]

    async def pause(self) -> None:
        """Returns once no request is in flight, and none starts until `resume` or `stop`."""
        self._running.clear()
        async with self._request_ended:
            await self._request_ended.wait_for(lambda: self.in_flight == 0)

    def resume(self) -> None:
        self._running.set()

    async def stop(self) -> None:
        self._stopping = True
        self._running.set()
        await asyncio.gather(*self._tasks)

    async def _loop(self, i: int) -> None:
        for n in itertools.count(1):
            await self._running.wait()
            if self._stopping:
                return
            record = StreamRecord(server=i % len(self.urls))
            self.records.append(record)
            prompt = f"Client {i}, request {n}: tell me a short story about a lighthouse."
            self.in_flight += 1
            try:
                url = self.urls[record.server]
                await _stream_once(self.client, url, self.model, prompt, self.max_tokens, record)
            finally:
                self.in_flight -= 1
                async with self._request_ended:
                    self._request_ended.notify_all()


async def _drive(
    urls: list[str],
    model: str,
    streams: int,
    reloads: int,
    interval_s: float,
    max_tokens: int,
    sampler: MemorySampler,
) -> tuple[
    list[StreamRecord],
    list[ReloadFigures],
    list[tuple[float, float]],
    list[list[int]],
    tuple[list[tuple[int, int]], list[tuple[int, int]]],
]:
    windows: list[tuple[float, float]] = []
    figures: list[ReloadFigures] = []
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        clients = _Clients(client, urls, model, max_tokens)
        clients.start(streams)
        await asyncio.sleep(interval_s)  # every step's working set reached
        await clients.pause()
        before = await sampler.settled()
        clients.resume()
        await asyncio.sleep(interval_s)
        sampler.reset_peaks()
        for r in range(reloads):
            window, figure = await _reload_once(client, urls, model, r)
            windows.append(window)
            figures.append(figure)
            await asyncio.sleep(interval_s)
        # The old versions are freed once their last streams end.
        retiring = await _wait_retired(client, urls, model, timeout_s=60)
        await clients.pause()
        after = await sampler.settled()
        await clients.stop()
    return clients.records, figures, windows, retiring, (before, after)


async def _reload_once(
    client: httpx.AsyncClient, urls: list[str], model: str, r: int
) -> tuple[tuple[float, float], ReloadFigures]:
    """Reload number `r` asked of one server in turn, until every server serves the new version:
    its time window and figures."""
    asked = r % len(urls)
    started = time.monotonic()
    reply = await client.post(
        urls[asked] + f"/admin/models/{model}/reload",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        json={},
    )
    if reply.status_code != 200:
        raise RuntimeError(f"reload {r + 1} refused: {reply.status_code} {reply.text}")
    outcome = reply.json()
    await _wait_for_version(client, urls, model, outcome["version"])
    reached = time.monotonic() - started
    followers = [
        (await _admin_models(client, url, model))["last_reload"]["swap_ms"]
        for i, url in enumerate(urls)
        if i != asked
    ]
    figures = ReloadFigures(
        asked,
        outcome["version"],
        outcome["load_s"],
        outcome["swap_ms"],
        outcome["drained_first"],
        reached,
        followers,
    )
    return (started, time.monotonic()), figures


async def _wait_retired(
    client: httpx.AsyncClient, urls: list[str], model: str, timeout_s: float
) -> list[list[int]]:
    """Each server's retiring versions, once none is left (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        retiring = [(await _admin_models(client, url, model))["retiring_versions"] for url in urls]
        if not any(retiring) or time.monotonic() > deadline:
            return retiring
        await asyncio.sleep(0.1)


def _gaps(
    records: list[StreamRecord], windows: list[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    steady: list[float] = []
    during: list[float] = []
    for record in records:
        times = record.chunk_times
        for earlier, later in itertools.pairwise(times):
            in_reload = any(start <= later and earlier <= end for start, end in windows)
            (during if in_reload else steady).append((later - earlier) * 1000)
    return steady, during


def run_reload_load(
    model: str,
    redis_url: str,
    servers: int = 2,
    streams: int = 16,
    reloads: int = 3,
    interval_s: float = 2.0,
    max_tokens: int = 64,
    threads: int | None = None,
    settings_env: dict[str, str] | None = None,
) -> ReloadLoadReport:
    """Start `servers` processes of `rebar serve --model MODEL` on `redis_url`, stream, reload,
    and measure (see the module's docstring). `settings_env` adds REBAR_* settings."""
    env = {
        "REBAR_STORE__BACKEND": "redis",
        "REBAR_STORE__URL": redis_url,
        "REBAR_SERVER__ADMIN_API_KEYS": json.dumps([ADMIN_KEY]),
        "REBAR_CACHE__ENABLED": "false",
        "REBAR_LOGGING__LEVEL": "info",
        **(settings_env or {}),
    }
    with ExitStack() as stack:
        started = [
            stack.enter_context(rebar_server_process(model, threads, env=env))
            for _ in range(servers)
        ]
        urls = [url for url, _ in started]
        pids = [process.pid for _, process in started]
        sampler = stack.enter_context(MemorySampler(pids))
        name = _entry_name(urls[0])
        records, figures, windows, retiring, (before, after) = asyncio.run(
            _drive(urls, name, streams, reloads, interval_s, max_tokens, sampler)
        )
        peaks = list(sampler.peaks)
    steady, during = _gaps(records, windows)
    failed = [r for r in records if r.error is not None]
    mixed = [r for r in records if r.error is None and r.fingerprints != {r.version}]
    return ReloadLoadReport(
        model=name,
        servers=servers,
        streams=streams,
        requests=len(records),
        failed=len(failed),
        mixed_version_streams=len(mixed),
        versions_seen=sorted({r.version for r in records if r.version}),
        reloads=figures,
        gap_ms_steady=_gap_figures(steady),
        gap_ms_during_reloads=_gap_figures(during),
        memory=[
            MemoryFigures(
                b[0] / 1024, p[0] / 1024, a[0] / 1024, b[1] / 1024, p[1] / 1024, a[1] / 1024
            )
            for b, p, a in zip(before, peaks, after)
        ],
        retiring_after=retiring,
        errors=[r.error for r in failed[:10] if r.error],
    )


def _gap_figures(gaps: list[float]) -> dict[str, Any]:
    figures: dict[str, Any] = dict(percentiles(gaps))
    figures["max"] = max(gaps) if gaps else None
    figures["count"] = len(gaps)
    return figures


def _entry_name(url: str) -> str:
    listing = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return next(m["id"] for m in listing if m["kind"] == "chat")


def cmd_bench_reload(args: Any) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    report = run_reload_load(
        args.model,
        args.redis_url,
        servers=args.servers,
        streams=args.streams,
        reloads=args.reloads,
        interval_s=args.interval,
        max_tokens=args.tokens,
        threads=args.threads,
    )
    print(report.table())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            out.write(report.to_json())
    return 0 if report.failed == 0 and report.mixed_version_streams == 0 else 1
