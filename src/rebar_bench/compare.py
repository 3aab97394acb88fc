"""`rebar bench compare`: rebar and llama.cpp side by side, in one run, on the same GGUF and
threads.

The peer is llama.cpp as its users run it (`rebar_bench.llamacpp`: `llama-bench`,
`llama-batched-bench`, `llama-server`, native builds). rebar runs with its defaults (what `make
run` gives: weights kept quantized, float16 KV cache on the CPU). Each figure is the median of
`repeats` runs, rebar's and llama.cpp's alternating (one of each per repeat, so the host's drift
falls on both alike), rebar's on fresh random prompts so no prefix cache helps (save where said),
each step computing one token per stream (speculation off: llama-bench does not speculate, and a
model looping over a random prompt would flatter n-gram drafts; `rebar bench spec` measures it).

- decode: one stream, a one-token prompt, `gen_tokens` greedy tokens with EOS ignored, the rate from
  the first token to the last; llama-bench's `tg` test (an empty context, one token at a time);
- prefill: time to the first token of a `prompt_tokens`-token prompt; llama-bench's `pp` test;
- decode at depth (with `depth`): one stream generating `depth_gen_tokens` after a `depth`-token
  random prompt, each step attending over the whole context; llama-bench's `tg` with `-d depth`;
- batched decode: `batch` streams of `batch_prompt_tokens`-token prompts each generating
  `batch_gen_tokens`, decode tokens per second once every stream has its first token, the
  prompts prefilled beforehand (the streams then find them in the prefix cache and decode side by
  side from the start); llama-batched-bench's S_TG for the same `-npl -npp -ntg`;
- peak memory: the peak resident set of a fresh process that loads the model and generates a few
  tokens, against the file's size plus the KV cache it used plus 400 MiB;
- HTTP: `concurrency` streaming chat requests at once (64-word prompts, `http_tokens` tokens each,
  `rebar bench serve`'s client) to a `rebar serve` started with its defaults and to `llama-server
  -np concurrency`: aggregate output tokens/s and p95 time to first token.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import torch

from rebar_bench.llamacpp import (
    LlamaServer,
    PeerUnavailable,
    cache_type_args,
    find_tool,
    run_batched_bench,
    run_llama_bench,
    run_llama_bench_at_depth,
)
from rebar_bench.rebar_server import free_port, rebar_server_process

Figures = TypeVar("Figures")
MEMORY_ALLOWANCE = 400 * 2**20  # bytes above the file and the KV cache a loaded model may take


@dataclass(frozen=True)
class CompareConfig:
    model: str
    threads: int = 2
    repeats: int = 3
    prompt_tokens: int = 512
    gen_tokens: int = 128
    batch: int = 16
    batch_prompt_tokens: int = 90
    batch_gen_tokens: int = 64
    http: bool = True
    concurrency: int = 16
    http_requests: int = 32
    http_tokens: int = 64
    depth: int = 0  # context tokens before the decode-at-depth figure (0: no such figure)
    depth_gen_tokens: int = 32
    # `[engine] kv_cache_dtype` for rebar, and llama.cpp's -ctk/-ctv to match (None: both defaults)
    kv_cache_dtype: str | None = None
    seed: int = 0
    # Targets: rebar's figure relative to llama.cpp's (higher is better for rates, lower for times).
    decode_target: float = 1.0
    prefill_target: float = 1.0
    batched_target: float = 1.0
    http_target: float = 1.0
    depth_target: float = 1.0
    tools: dict[str, str | None] = field(default_factory=dict)  # tool name -> explicit path


@dataclass
class Row:
    figure: str
    rebar: float | None
    peer: float | None
    ratio: float | None  # rebar / llama.cpp
    target: str
    passed: bool | None


@dataclass
class CompareReport:
    model: str
    threads: int
    rows: list[Row]
    notes: list[str]  # what the peer is, and why a figure is missing

    def table(self) -> str:
        header = (
            f"{'figure':<44} {'rebar':>10} {'llama.cpp':>10} {'ratio':>7}  {'target':<10} result"
        )
        lines = [
            f"model {self.model}, {self.threads} threads",
            *self.notes,
            header,
            "-" * len(header),
        ]
        for r in self.rows:

            def cell(value: float | None) -> str:
                return f"{value:>10.2f}" if value is not None else f"{'-':>10}"

            ratio = f"{r.ratio:>7.2f}" if r.ratio is not None else f"{'-':>7}"
            result = {True: "pass", False: "FAIL", None: "n/a"}[r.passed]
            lines.append(
                f"{r.figure:<44} {cell(r.rebar)} {cell(r.peer)} {ratio}  {r.target:<10} {result}"
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def compared(
    figure: str, rebar: float | None, peer: float | None, target: float, higher_is_better: bool
) -> Row:
    """A row whose ratio is rebar / peer, passing at >= target (rates) or <= target (times)."""
    ratio = rebar / peer if rebar is not None and peer else None
    sign = ">=" if higher_is_better else "<="
    passed = None if ratio is None else (ratio >= target if higher_is_better else ratio <= target)
    return Row(figure, rebar, peer, ratio, f"{sign} {target:g}x", passed)


def random_prompt(allowed: list[int], length: int, rng: random.Random) -> list[int]:
    return [rng.choice(allowed) for _ in range(length)]


# ----- rebar, in process --------------------------------------------------------------------------


def _token_times(core, requests: dict[str, list[int]], max_tokens: int) -> dict[str, list[float]]:
    """Arrival time of every token of each request, all added at once to an idle engine core;
    times[request][0] is when the requests were added."""
    from rebar.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, speculative=False
    )
    started = time.perf_counter()
    for request_id, prompt in requests.items():
        core.add_request(request_id, prompt, params)
    times = {request_id: [started] for request_id in requests}
    while core.has_unfinished_requests():
        for output in core.step():
            times[output.request_id].extend([time.perf_counter()] * len(output.new_token_ids))
    return times


@dataclass(frozen=True)
class RebarFigures:
    decode_tokens_per_s: float
    prefill_s: float
    batched_decode_tokens_per_s: float
    depth_decode_tokens_per_s: float = 0.0  # 0 without a depth


def _decode_rate(times: list[float]) -> float:
    """Tokens per second from the first generated token to the last (times[0]: when added)."""
    return (len(times) - 2) / (times[-1] - times[1])


def measure_rebar(
    core, config: CompareConfig, allowed: list[int], rng: random.Random, run: int
) -> RebarFigures:
    """One run of each figure, on fresh random prompts."""
    (times,) = _token_times(
        core, {f"decode-{run}": random_prompt(allowed, 1, rng)}, config.gen_tokens
    ).values()
    decode = _decode_rate(times)
    (times,) = _token_times(
        core, {f"prefill-{run}": random_prompt(allowed, config.prompt_tokens, rng)}, 1
    ).values()
    prefill = times[1] - times[0]
    streams = {
        f"batch-{run}-{i}": random_prompt(allowed, config.batch_prompt_tokens, rng)
        for i in range(config.batch)
    }
    # The prompts are prefilled once beforehand, so the timed streams find them in the prefix cache
    # and decode side by side from their first steps, as llama-batched-bench's do (its S_TG is the
    # decode alone); otherwise the first streams would be done before the last had prefilled.
    _token_times(core, {f"{name}-prefill": prompt for name, prompt in streams.items()}, 1)
    per_stream = _token_times(core, streams, config.batch_gen_tokens).values()
    decode_start = max(t[1] for t in per_stream)  # every stream has its first token
    decode_end = max(t[-1] for t in per_stream)
    tokens = sum(sum(1 for stamp in t[2:] if stamp > decode_start) for t in per_stream)
    depth = 0.0
    if config.depth:
        (times,) = _token_times(
            core,
            {f"depth-{run}": random_prompt(allowed, config.depth, rng)},
            config.depth_gen_tokens + 1,
        ).values()
        depth = _decode_rate(times)
    return RebarFigures(decode, prefill, tokens / (decode_end - decode_start), depth)


def medians(runs: list[Figures]) -> Figures:
    """The field-wise median of dataclass instances of one type."""
    kind = type(runs[0])
    names = [f.name for f in fields(kind)]  # type: ignore[arg-type]  # Figures are dataclasses
    return kind(*(statistics.median(getattr(r, name) for r in runs) for name in names))


# ----- rebar's memory, in a fresh process ---------------------------------------------------------

# The peak less the file pages still mapped at the end, as the perf gate takes it
# (gate_measure.peak_private_kib): how many pages of its shared libraries a process maps depends on
# the page cache (libtorch_cpu.so alone: 61 MiB from an older venv, 126 MiB right after a fresh
# install), not on rebar.
_MEMORY_CHILD = """
import json, sys
from rebar import LLM, SamplingParams
from rebar.engine.engine_config import kv_bytes_per_token
from rebar_bench.gate_measure import peak_private_kib, private_kib
llm = LLM(model=sys.argv[1], **json.loads(sys.argv[2]))
loaded = private_kib()
out = llm.generate(["The capital of France is"], \
SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
tokens = len(out.prompt_token_ids) + len(out.token_ids)
kv_dtype = llm.engine.runner.kv_cache.keys[0].dtype
print(json.dumps({"peak_private": peak_private_kib() * 1024, "loaded": loaded * 1024, \
"kv_bytes": kv_bytes_per_token(llm.config, kv_dtype) * tokens}))
"""


@dataclass(frozen=True)
class MemoryFigures:
    peak_bytes: int  # the peak resident set, less the file pages mapped at the end
    file_bytes: int
    kv_bytes: int
    loaded_bytes: int = 0  # resident, less mapped files, once loaded (before any request)

    @property
    def bound_bytes(self) -> int:
        return self.file_bytes + self.kv_bytes + MEMORY_ALLOWANCE


def measure_memory(
    model: str, path: Path, threads: int, settings: dict[str, object] | None = None
) -> MemoryFigures:
    """The peak private memory of a fresh process loading `model` with the defaults (`settings`
    overriding `[engine]` ones) and generating 16 tokens."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHILD, model, json.dumps(settings or {})],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the memory measurement failed: {done.stderr[-1500:]}")
    values = json.loads(done.stdout.strip().splitlines()[-1])
    return MemoryFigures(
        values["peak_private"], path.stat().st_size, values["kv_bytes"], values["loaded"]
    )


# ----- HTTP ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HttpFigures:
    output_tokens_per_s: float
    ttft_p95_s: float
    num_failed: int


def _serve_bench(url: str, config: CompareConfig) -> HttpFigures:
    """The median over `repeats` runs of `rebar bench serve` at `concurrency` (fresh prompts each
    run)."""
    from rebar_bench.serve import ServeBenchConfig, run_serve_bench

    runs = []
    for run in range(config.repeats):
        bench = ServeBenchConfig(
            url=url,
            num_prompts=config.http_requests,
            input_words=64,
            output_tokens=config.http_tokens,
            ignore_eos=True,
            seed=config.seed + run,
        )
        level = asyncio.run(run_serve_bench(bench, [config.concurrency])).levels[0]
        ttfts = sorted(r.ttft_s for r in level.requests if r.ok and r.ttft_s is not None)
        p95 = ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else float("nan")
        runs.append((level.output_tokens_per_s, p95, level.num_failed))
    return HttpFigures(
        statistics.median(r[0] for r in runs),
        statistics.median(r[1] for r in runs),
        sum(r[2] for r in runs),
    )


def engine_settings(config: CompareConfig) -> dict[str, Any]:
    """The `[engine]` settings rebar runs with besides its defaults."""
    return {} if config.kv_cache_dtype is None else {"kv_cache_dtype": config.kv_cache_dtype}


def engine_env(config: CompareConfig) -> dict[str, str]:
    """`engine_settings` as the REBAR_* environment variables `rebar serve` reads."""
    from rebar.config.settings import ENV_NESTED_DELIMITER, ENV_PREFIX

    section = f"{ENV_PREFIX}ENGINE{ENV_NESTED_DELIMITER}"
    return {section + name.upper(): str(value) for name, value in engine_settings(config).items()}


def measure_rebar_http(model: str, config: CompareConfig) -> HttpFigures:
    """`rebar serve` with its defaults (only the thread count, a quiet log and `engine_settings`
    set) under the HTTP load."""
    with rebar_server_process(model, config.threads, env=engine_env(config)) as (url, _process):
        return _serve_bench(url, config)


def measure_peer_http(path: Path, config: CompareConfig) -> HttpFigures:
    tool = find_tool("llama-server", config.tools.get("llama-server"))
    extra = cache_type_args(config.kv_cache_dtype)
    port = free_port()
    with LlamaServer(
        tool, path, config.threads, port, config.concurrency, extra_args=extra
    ) as server:
        return _serve_bench(server.url, config)


# ----- the comparison -----------------------------------------------------------------------------


def _peer(notes: list[str], what: str, measure):
    """`measure()`, or None with a note saying why the peer's figure is missing."""
    try:
        return measure()
    except PeerUnavailable as exc:
        notes.append(f"no llama.cpp {what}: {exc}")
        return None


def engine_rows(
    config: CompareConfig, rebar: RebarFigures, bench, batched, depth: float | None = None
) -> list[Row]:
    """Decode, prefill, batched decode and decode at depth: rebar's engine against llama-bench and
    batched-bench (`depth`: llama-bench's tokens/s at config.depth)."""
    batch_shape = f"{config.batch} x {config.batch_prompt_tokens}+{config.batch_gen_tokens}"
    rows = [
        compared(
            f"decode tok/s (tg{config.gen_tokens})",
            rebar.decode_tokens_per_s,
            bench and bench.gen_tokens_per_s,
            config.decode_target,
            True,
        ),
        compared(
            f"prefill {config.prompt_tokens} tokens, s (pp{config.prompt_tokens})",
            rebar.prefill_s,
            bench and bench.prefill_s,
            config.prefill_target,
            False,
        ),
        compared(
            f"batched decode tok/s ({batch_shape})",
            rebar.batched_decode_tokens_per_s,
            batched and batched.decode_tokens_per_s,
            config.batched_target,
            True,
        ),
    ]
    if config.depth:
        rows.append(
            compared(
                f"decode tok/s at depth {config.depth} "
                f"(tg{config.depth_gen_tokens} @ d{config.depth})",
                rebar.depth_decode_tokens_per_s,
                depth,
                config.depth_target,
                True,
            )
        )
    return rows


def memory_row(memory: MemoryFigures) -> Row:
    mib = 2**20
    return Row(
        "peak private MiB (file + KV + 400 MiB)",
        memory.peak_bytes / mib,
        None,
        None,
        f"<= {memory.bound_bytes / mib:.0f}",
        memory.peak_bytes <= memory.bound_bytes,
    )


def http_rows(config: CompareConfig, ours: HttpFigures, theirs: HttpFigures | None) -> list[Row]:
    """Streamed throughput and p95 TTFT against llama-server; any failed request fails the TTFT
    row."""
    throughput = compared(
        f"HTTP {config.concurrency} streams, output tok/s",
        ours.output_tokens_per_s,
        theirs.output_tokens_per_s if theirs else None,
        config.http_target,
        True,
    )
    ttft = compared(
        f"HTTP {config.concurrency} streams, p95 TTFT s",
        ours.ttft_p95_s,
        theirs.ttft_p95_s if theirs else None,
        1.0,
        False,
    )
    if ours.num_failed:
        ttft.passed = False
    return [throughput, ttft]


def build_rows(
    config: CompareConfig,
    rebar: RebarFigures,
    bench,
    batched,
    memory: MemoryFigures | None,
    http: tuple[HttpFigures, HttpFigures | None] | None,
    depth: float | None = None,
) -> list[Row]:
    rows = engine_rows(config, rebar, bench, batched, depth)
    if memory is not None:
        rows.append(memory_row(memory))
    if http is not None:
        rows += http_rows(config, *http)
    return rows


def peer_measures(config: CompareConfig, path: Path) -> dict[str, Callable[[], object]]:
    """What each repeat runs of llama.cpp (nothing for a file llama.cpp cannot read)."""
    if path.suffix != ".gguf":
        return {}
    tools = config.tools
    cache_args = cache_type_args(config.kv_cache_dtype)
    measures: dict[str, Callable[[], object]] = {
        "llama-bench": lambda: run_llama_bench(
            find_tool("llama-bench", tools.get("llama-bench")),
            path,
            config.threads,
            config.prompt_tokens,
            config.gen_tokens,
            repetitions=1,
            extra_args=cache_args,
        ),
        "llama-batched-bench": lambda: run_batched_bench(
            find_tool("llama-batched-bench", tools.get("llama-batched-bench")),
            path,
            config.threads,
            config.batch,
            config.batch_prompt_tokens,
            config.batch_gen_tokens,
            extra_args=cache_args,
        ),
    }
    if config.depth:
        measures["llama-bench at depth"] = lambda: run_llama_bench_at_depth(
            find_tool("llama-bench", tools.get("llama-bench")),
            path,
            config.threads,
            config.depth,
            config.depth_gen_tokens,
            extra_args=cache_args,
        )
    return measures


def alternate_runs(
    llm, config: CompareConfig, path: Path, notes: list[str]
) -> tuple[list[RebarFigures], dict[str, list]]:
    """rebar's engine and each llama.cpp tool, one run of each per repeat; a tool that fails once
    is not tried again."""
    tokenizer = llm.tokenizer
    allowed = [t for t in range(tokenizer.vocab_size) if not tokenizer.is_special(t)]
    rng = random.Random(config.seed)
    _token_times(llm.engine, {"warm-up": allowed[:8]}, 4)
    peers = peer_measures(config, path)
    rebar_runs: list[RebarFigures] = []
    peer_runs: dict[str, list] = {name: [] for name in peers}
    for run in range(config.repeats):
        rebar_runs.append(measure_rebar(llm.engine, config, allowed, rng, run))
        for name, measure in list(peers.items()):
            figures = _peer(notes, name, measure)
            if figures is None:
                del peers[name]
            else:
                peer_runs[name].append(figures)
    return rebar_runs, peer_runs


def run_compare(config: CompareConfig) -> CompareReport:
    """rebar's and llama.cpp's runs alternate, one of each per repeat, so that this host's drift (it
    moves by 20-30% over minutes) falls on both alike; each figure is the median of its repeats."""
    from rebar.kernels import kv_quant
    from rebar.llm import LLM

    torch.set_num_threads(config.threads)
    llm = LLM(config.model, **engine_settings(config))
    if llm.engine is None:
        raise ValueError(f"{config.model} is an embedding model; compare needs a generator")
    path = Path(llm.checkpoint.path)
    kv_cache = (
        f"KV cache: rebar {kv_quant.setting_name(llm.engine.runner.kv_cache.dtype)}, llama.cpp "
        + (" ".join(cache_type_args(config.kv_cache_dtype)) or "its default (f16)")
    )
    notes = [kv_cache]
    if path.suffix != ".gguf":
        notes.append(f"no llama.cpp figures: {path.name} is not a GGUF file")
    rebar_runs, peer_runs = alternate_runs(llm, config, path, notes)
    del llm
    bench, batched = (
        medians(peer_runs[name]) if peer_runs.get(name) else None
        for name in ("llama-bench", "llama-batched-bench")
    )
    depth_runs = peer_runs.get("llama-bench at depth")
    depth = statistics.median(depth_runs) if depth_runs else None
    memory = measure_memory(config.model, path, config.threads, engine_settings(config))
    http = None
    if config.http:
        ours = measure_rebar_http(config.model, config)
        theirs = None
        if path.suffix == ".gguf":
            theirs = _peer(notes, "llama-server", lambda: measure_peer_http(path, config))
        http = (ours, theirs)
    rows = build_rows(config, medians(rebar_runs), bench, batched, memory, http, depth)
    return CompareReport(config.model, config.threads, rows, notes)
