"""`rebar bench http`: the HTTP serving path against llama-server, stream counts 1, 16 and 64.

One run measures, with `rebar bench serve`'s client sharing the machine: a `rebar serve` with the
default settings (only the thread count given), then llama.cpp's own `llama-server` on the same
GGUF and threads (`-np 16` for 1 and 16 streams, `-np 64` for 64). Every request streams a chat
completion of `tokens` tokens (EOS ignored) for a fresh 64-word prompt, so no cache answers one
from another. The rows are the serving path's targets:

- 1 stream: the HTTP inter-token p50 within `step_target` of the engine's own decode step p50
  (read from the server's /metrics over the same requests), and output tokens/s against
  llama-server's;
- 16 streams: aggregate output tokens/s, and p95 time to first token no later than llama-server's;
- 64 streams: no failed request, aggregate output tokens/s, and an inter-token p95 within twice its
  p50 (no stalls behind long prefills).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rebar_bench.compare import CompareReport, Row, compared
from rebar_bench.llamacpp import LlamaServer, PeerUnavailable, find_tool
from rebar_bench.rebar_server import free_port, rebar_server
from rebar_bench.serve import LevelResult, ServeBenchConfig, run_serve_bench


@dataclass(frozen=True)
class HttpCompareConfig:
    model: str = "smollm2"
    threads: int = 2
    tokens: int = 128
    requests: dict[int, int] = field(default_factory=lambda: {1: 8, 16: 32, 64: 64})
    seed: int = 0
    step_target: float = 1.15  # 1 stream: HTTP inter-token p50 / the engine's step p50
    single_target: float = 1.5  # 1 stream: output tok/s against llama-server's
    batched_target: float = 1.3  # 16 and 64 streams: aggregate output tok/s
    llama_server: str | None = None  # its path; None: found as rebar_bench.llamacpp finds it


@dataclass(frozen=True)
class LevelFigures:
    """What one server did at one stream count (`rebar bench serve`'s level, reduced)."""

    streams: int
    output_tokens_per_s: float
    ttft_p95_ms: float | None
    itl_p50_ms: float | None
    itl_p95_ms: float | None
    num_failed: int
    engine_step_p50_ms: float | None = None  # rebar only
    serving_overhead_ms: float | None = None

    @classmethod
    def of(cls, level: LevelResult) -> LevelFigures:
        return cls(
            level.concurrency,
            level.output_tokens_per_s,
            level.ttft_ms.get("p95"),
            level.itl_ms.get("p50"),
            level.itl_ms.get("p95"),
            level.num_failed,
            (level.engine_step_ms or {}).get("p50"),
            level.serving_overhead_ms,
        )


def _levels(url: str, config: HttpCompareConfig, streams: list[int]) -> dict[int, LevelFigures]:
    figures = {}
    for index, count in enumerate(streams):
        bench = ServeBenchConfig(
            url,
            num_prompts=config.requests[count],
            input_words=64,
            output_tokens=config.tokens,
            ignore_eos=True,
            seed=config.seed * 1000 + index,
        )
        warm = ServeBenchConfig(url, num_prompts=2, input_words=8, output_tokens=8, seed=-1)
        asyncio.run(run_serve_bench(warm, [1]))  # first-request costs out of the figures
        figures[count] = LevelFigures.of(asyncio.run(run_serve_bench(bench, [count])).levels[0])
    return figures


def measure_rebar(config: HttpCompareConfig) -> dict[int, LevelFigures]:
    with rebar_server(config.model, config.threads) as url:
        return _levels(url, config, sorted(config.requests))


def measure_llama_server(config: HttpCompareConfig, gguf: Path) -> dict[int, LevelFigures]:
    tool = find_tool("llama-server", config.llama_server)
    figures: dict[int, LevelFigures] = {}
    for slots in sorted({max(16, count) for count in config.requests}):
        streams = [c for c in sorted(config.requests) if max(16, c) == slots]
        with LlamaServer(tool, gguf, config.threads, free_port(), slots) as server:
            figures |= _levels(server.url, config, streams)
    return figures


def rows(
    config: HttpCompareConfig,
    ours: dict[int, LevelFigures],
    theirs: dict[int, LevelFigures] | None,
) -> list[Row]:
    def peer(count: int) -> LevelFigures | None:
        return theirs.get(count) if theirs else None

    out: list[Row] = []
    one = ours.get(1)
    if one is not None:
        ratio = (
            one.itl_p50_ms / one.engine_step_p50_ms
            if one.itl_p50_ms and one.engine_step_p50_ms
            else None
        )
        out.append(
            Row(
                "1 stream: inter-token p50 ms (peer: rebar's step)",
                one.itl_p50_ms,
                one.engine_step_p50_ms,
                ratio,
                f"<= {config.step_target:g}x",
                None if ratio is None else ratio <= config.step_target,
            )
        )
    for count, target in ((1, config.single_target), (16, config.batched_target)):
        if count in ours:
            other = peer(count)
            out.append(
                compared(
                    f"{count} stream{'s' * (count > 1)}: output tok/s",
                    ours[count].output_tokens_per_s,
                    other.output_tokens_per_s if other else None,
                    target,
                    True,
                )
            )
    if 16 in ours:
        other = peer(16)
        out.append(
            compared(
                "16 streams: p95 TTFT ms",
                ours[16].ttft_p95_ms,
                other.ttft_p95_ms if other else None,
                1.0,
                False,
            )
        )
    if 64 in ours:
        out += _wide_rows(config, ours[64], peer(64))
    return out


def _wide_rows(
    config: HttpCompareConfig, wide: LevelFigures, other: LevelFigures | None
) -> list[Row]:
    """The 64-stream rows: no failures, throughput against the peer, a bounded latency tail."""
    spread = wide.itl_p95_ms / wide.itl_p50_ms if wide.itl_p95_ms and wide.itl_p50_ms else None
    return [
        Row("64 streams: failed requests", wide.num_failed, None, None, "0", not wide.num_failed),
        compared(
            "64 streams: output tok/s (peer -np 64)",
            wide.output_tokens_per_s,
            other.output_tokens_per_s if other else None,
            config.batched_target,
            True,
        ),
        Row(
            "64 streams: inter-token p95 / p50",
            wide.itl_p95_ms,
            wide.itl_p50_ms,
            spread,
            "<= 2x",
            None if spread is None else spread <= 2.0,
        ),
    ]


@dataclass
class HttpCompareReport:
    config: HttpCompareConfig
    rebar: dict[int, LevelFigures]
    llama_server: dict[int, LevelFigures] | None
    rows: list[Row]
    notes: list[str]

    def table(self) -> str:
        head = CompareReport(self.config.model, self.config.threads, self.rows, self.notes).table()
        levels = ["", "streams  server        out tok/s  TTFT p95 ms  ITL p50/p95 ms  step p50 ms"]
        for name, figures in (("rebar", self.rebar), ("llama-server", self.llama_server or {})):
            for count, f in sorted(figures.items()):
                step = "-" if f.engine_step_p50_ms is None else f"{f.engine_step_p50_ms:.2f}"
                levels.append(
                    f"{count:>7}  {name:<12}  {f.output_tokens_per_s:>9.1f}  "
                    f"{_ms(f.ttft_p95_ms):>11}  {_ms(f.itl_p50_ms):>6} / {_ms(f.itl_p95_ms):<6}  "
                    f"{step:>11}"
                )
        return "\n".join([head, *levels])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def run_http_compare(config: HttpCompareConfig) -> HttpCompareReport:
    from rebar.model.resolve import resolve_model_path

    notes: list[str] = []
    ours = measure_rebar(config)
    gguf = resolve_model_path(config.model)
    theirs = None
    if gguf.suffix != ".gguf":
        notes.append(f"no llama-server figures: {gguf.name} is not a GGUF file")
    else:
        try:
            theirs = measure_llama_server(config, gguf)
            notes.append(f"peer: llama-server -t {config.threads} -np 16 / 64 on {gguf.name}")
        except PeerUnavailable as exc:
            notes.append(f"no llama-server figures: {exc}")
    return HttpCompareReport(config, ours, theirs, rows(config, ours, theirs), notes)
