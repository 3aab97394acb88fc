"""`rebar bench compare`: rebar and llama.cpp side by side — same machine, same GGUF, same threads, same prompts.

Figures (each a median of `repeats` runs on fresh random prompts, so no prefix cache helps either side):

- single-stream decode tokens/s: 64-token prompt, `output_len` greedy tokens with EOS ignored, rate
  measured from the first token to the last (prefill excluded);
- prefill: time to the first token of a 512-token prompt;
- HTTP: aggregate output tokens/s and p95 time to first token with 16 concurrent streaming requests
  of 64-word prompts to a `rebar serve` started for the run (`rebar bench serve` logic). llama.cpp's
  own server is no concurrency peer (it interrupts a running stream for a new request), so the
  target compares with llama.cpp's in-process single-stream decode rate.

The peer is `llama-cpp-python` (`pip install -e .[bench]`); without it rebar's figures are still
measured and the peer's columns say why they are empty.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

PREFILL_LEN = 512
DECODE_PROMPT_LEN = 64


@dataclass(frozen=True)
class EngineFigures:
    decode_tokens_per_s: float
    prefill_ttft_s: float


@dataclass(frozen=True)
class HttpFigures:
    """Medians over `runs` benchmark runs (each with fresh prompts); failures summed over them."""

    concurrency: int
    output_tokens_per_s: float
    ttft_p95_s: float
    num_failed: int
    runs: int = 1


def median_http_figures(concurrency: int, runs: list[tuple[float, float, int]]) -> HttpFigures:
    """(output tok/s, p95 TTFT s, failed requests) per run -> their medians and the total failures."""
    if not runs:
        raise ValueError("no HTTP benchmark runs to summarise")
    return HttpFigures(concurrency, statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                       sum(r[2] for r in runs), len(runs))


@dataclass
class Row:
    figure: str
    rebar: float | None
    peer: float | None
    ratio: float | None  # rebar relative to the peer, in the target's direction
    target: str
    passed: bool | None


@dataclass
class CompareReport:
    model: str
    threads: int
    rebar: EngineFigures
    peer: EngineFigures | None
    peer_note: str
    http: HttpFigures | None
    rows: list[Row] = field(default_factory=list)
    kv_cache_dtype: str = "auto"  # rebar's KV cache storage for the run

    def table(self) -> str:
        header = f"{'figure':<38} {'rebar':>10} {'llama.cpp':>10} {'ratio':>7}  target      result"
        lines = [f"model {self.model}, {self.threads} threads, rebar KV cache {self.kv_cache_dtype}; peer: {self.peer_note}",
                 header, "-" * len(header)]
        for r in self.rows:
            def cell(value: float | None, digits: int = 2) -> str:
                return f"{value:>10.{digits}f}" if value is not None else f"{'-':>10}"
            ratio = f"{r.ratio:>7.2f}" if r.ratio is not None else f"{'-':>7}"
            result = {True: "pass", False: "FAIL", None: "n/a"}[r.passed]
            lines.append(f"{r.figure:<38} {cell(r.rebar)} {cell(r.peer)} {ratio}  {r.target:<11} {result}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def random_prompt(vocab_size: int, special: set[int], length: int, rng: random.Random) -> list[int]:
    allowed = [t for t in range(vocab_size) if t not in special]
    return [rng.choice(allowed) for _ in range(length)]


# ----- rebar ------------------------------------------------------------------------------------

def _rebar_run(core, prompt: list[int], max_tokens: int, request_id: str) -> list[float]:
    """Token arrival times of one request on an otherwise idle engine core (started at times[0] - ttft)."""
    from rebar.engine.sampling_params import SamplingParams

    started = time.perf_counter()
    core.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    times = [started]
    while core.has_unfinished_requests():
        for output in core.step():
            times.extend([time.perf_counter()] * len(output.new_token_ids))
    return times


def measure_rebar(core, prompts: list[list[int]], prefill_prompts: list[list[int]], output_len: int) -> EngineFigures:
    _rebar_run(core, prompts[0][:8], 4, "warm-up")
    decode, prefill = [], []
    for i, prompt in enumerate(prompts):
        times = _rebar_run(core, prompt, output_len, f"decode-{i}")
        decode.append((len(times) - 2) / (times[-1] - times[1]))
    for i, prompt in enumerate(prefill_prompts):
        times = _rebar_run(core, prompt, 1, f"prefill-{i}")
        prefill.append(times[1] - times[0])
    return EngineFigures(statistics.median(decode), statistics.median(prefill))


# ----- llama.cpp --------------------------------------------------------------------------------

def load_llamacpp(gguf_path: Path, threads: int):
    """A llama.cpp model, or (None, why not)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, "llama-cpp-python is not installed (pip install -e '.[bench]')"
    llm = Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=PREFILL_LEN,
                verbose=False)
    import llama_cpp

    return llm, f"llama.cpp via llama-cpp-python {llama_cpp.__version__}"


def _llamacpp_run(llm, prompt: list[int], max_tokens: int) -> list[float]:
    llm.reset()  # no reuse of an earlier prompt's KV cache
    started = time.perf_counter()
    times = [started]
    for _token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        if len(times) > max_tokens:
            break
    return times


def measure_llamacpp(llm, prompts: list[list[int]], prefill_prompts: list[list[int]], output_len: int) -> EngineFigures:
    _llamacpp_run(llm, prompts[0][:8], 4)
    decode = []
    for prompt in prompts:
        times = _llamacpp_run(llm, prompt, output_len)
        decode.append((len(times) - 2) / (times[-1] - times[1]))
    prefill = [(lambda t: t[1] - t[0])(_llamacpp_run(llm, p, 1)) for p in prefill_prompts]
    return EngineFigures(statistics.median(decode), statistics.median(prefill))


# ----- HTTP -------------------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_http(model: str, threads: int, concurrency: int = 16, num_prompts: int = 32, input_words: int = 64,
                 output_tokens: int = 64, repeats: int = 1, seed: int = 0, kv_cache_dtype: str = "auto") -> HttpFigures:
    """Start `rebar serve` for `model`, run the streaming benchmark at `concurrency` `repeats` times
    (fresh prompts each time, so the prefix cache never helps), stop the server; the medians."""
    import httpx

    from rebar.bench.serve import ServeBenchConfig, run_serve_bench

    port = _free_port()
    env = {**os.environ, "REBAR_ENGINE__NUM_THREADS": str(threads), "REBAR_LOGGING__LEVEL": "warning",
           "REBAR_MODELS__QUANTIZED_GGUF": "true", "REBAR_ENGINE__KV_CACHE_DTYPE": kv_cache_dtype}
    server = subprocess.Popen(
        [sys.executable, "-m", "rebar.cli", "serve", "--model", model, "--embedding-model", "none", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"rebar serve exited: {server.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("rebar serve was not ready within 300 s")
            time.sleep(0.2)
        runs = []
        for run in range(repeats):
            config = ServeBenchConfig(url=url, num_prompts=num_prompts, input_words=input_words,
                                      output_tokens=output_tokens, ignore_eos=True, seed=seed + run)
            level = asyncio.run(run_serve_bench(config, [concurrency])).levels[0]
            ttfts = sorted(r.ttft_s for r in level.requests if r.ok and r.ttft_s is not None)
            p95 = ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else float("nan")
            runs.append((level.output_tokens_per_s, p95, level.num_failed))
        return median_http_figures(concurrency, runs)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


# ----- the comparison ---------------------------------------------------------------------------

def build_rows(rebar: EngineFigures, peer: EngineFigures | None, http: HttpFigures | None) -> list[Row]:
    rows = [
        Row("single-stream decode tok/s", rebar.decode_tokens_per_s, peer and peer.decode_tokens_per_s,
            peer and rebar.decode_tokens_per_s / peer.decode_tokens_per_s, ">= 1.0x", None),
        Row(f"prefill {PREFILL_LEN} tokens, TTFT s", rebar.prefill_ttft_s, peer and peer.prefill_ttft_s,
            peer and rebar.prefill_ttft_s / peer.prefill_ttft_s, "<= 0.5x", None),
    ]
    rows[0].passed = None if peer is None else rows[0].ratio >= 1.0
    rows[1].passed = None if peer is None else rows[1].ratio <= 0.5
    if http is not None:
        ratio = http.output_tokens_per_s / peer.decode_tokens_per_s if peer else None
        rows.append(Row(f"HTTP {http.concurrency} streams, output tok/s", http.output_tokens_per_s,
                        peer and peer.decode_tokens_per_s, ratio, ">= 2.0x", None if ratio is None else ratio >= 2.0))
        rows.append(Row(f"HTTP {http.concurrency} streams, p95 TTFT s", http.ttft_p95_s, None, None, "< 1 s",
                        http.ttft_p95_s < 1.0 and http.num_failed == 0))
    return rows


def run_compare(model: str, threads: int, output_len: int = 128, repeats: int = 3, http: bool = True,
                seed: int = 0, kv_cache_dtype: str = "float16") -> CompareReport:
    from rebar.engine.engine_config import EngineConfig
    from rebar.engine.llm import LLM

    torch.set_num_threads(threads)
    # The fast path: GGUF weights stay 4-bit and run on rebar's int4/int8 kernels, as llama.cpp's do.
    # And its KV cache in float16 by default, as llama.cpp's (f16 unless told otherwise).
    config = EngineConfig(max_model_len=2048, max_num_batched_tokens=2048, kv_cache_dtype=kv_cache_dtype)
    llm = LLM(model, engine_config=config, quantized_gguf=True)
    if llm.engine is None:
        raise ValueError(f"{model} is an embedding model; compare needs a generator")
    tokenizer = llm.tokenizer
    special = {i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)}
    rng = random.Random(seed)
    prompts = [random_prompt(tokenizer.vocab_size, special, DECODE_PROMPT_LEN, rng) for _ in range(repeats)]
    prefill_prompts = [random_prompt(tokenizer.vocab_size, special, PREFILL_LEN, rng) for _ in range(repeats)]

    rebar_figures = measure_rebar(llm.engine, prompts, prefill_prompts, output_len)
    gguf_path = Path(llm.checkpoint.path)
    del llm
    peer, note = (None, f"{gguf_path.name} is not a GGUF file") if gguf_path.suffix != ".gguf" else load_llamacpp(gguf_path, threads)
    peer_figures = None
    if peer is not None:
        peer_figures = measure_llamacpp(peer, prompts, prefill_prompts, output_len)
        del peer
    http_figures = measure_http(model, threads, repeats=repeats, seed=seed, kv_cache_dtype=kv_cache_dtype) if http else None
    return CompareReport(model, threads, rebar_figures, peer_figures, note, http_figures,
                         build_rows(rebar_figures, peer_figures, http_figures), kv_cache_dtype)
