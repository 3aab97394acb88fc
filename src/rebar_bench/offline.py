"""`rebar bench offline`: drive the engine core directly with a fixed concurrency and report latency
and throughput.

Prompts are random token ids (seeded) of exactly `input_len` tokens, and every request generates
exactly `output_len` tokens (EOS ignored), so runs are comparable across models and machines.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from rebar.engine.core import EngineCore
from rebar.engine.sampling_params import SamplingParams


@dataclass
class _Timing:
    start: float
    token_times: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class OfflineResult:
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int
    duration_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]  # request added -> its last token
    decode_tokens_per_s_per_stream: (
        float  # mean over requests of (tokens after the first) / decode time
    )
    peak_kv_usage: float
    num_preemptions: int
    num_prefix_hits: int

    def table(self) -> str:
        rows = [
            (
                "requests x (input, output)",
                f"{self.num_prompts} x ({self.input_len}, "
                f"{self.output_len}), concurrency {self.concurrency}",
            ),
            ("duration", f"{self.duration_s:.2f} s"),
            ("prompt throughput", f"{self.prompt_tokens_per_s:.1f} tok/s"),
            ("generation throughput", f"{self.output_tokens_per_s:.1f} tok/s"),
            ("decode per stream", f"{self.decode_tokens_per_s_per_stream:.1f} tok/s"),
            ("TTFT p50 / p90 / p99", _percentiles(self.ttft_ms)),
            ("ITL p50 / p90 / p99", _percentiles(self.itl_ms)),
            ("end-to-end p50 / p90 / p99", _percentiles(self.e2e_ms)),
            ("peak KV usage", f"{100 * self.peak_kv_usage:.1f}%"),
            ("preemptions / prefix hits", f"{self.num_preemptions} / {self.num_prefix_hits}"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _percentiles(values: dict[str, float]) -> str:
    return f"{values['p50']:.1f} / {values['p90']:.1f} / {values['p99']:.1f} ms"


def summarize(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"p50": 0.0, "p90": 0.0, "p95": 0.0, "p99": 0.0, "mean": 0.0}
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "p50": pick(0.5),
        "p90": pick(0.9),
        "p95": pick(0.95),
        "p99": pick(0.99),
        "mean": statistics.fmean(ordered),
    }


def random_prompts(
    num_prompts: int, input_len: int, vocab_size: int, special_ids: set[int], seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    return [[rng.choice(allowed) for _ in range(input_len)] for _ in range(num_prompts)]


def run_offline(
    core: EngineCore,
    num_prompts: int,
    input_len: int,
    output_len: int,
    concurrency: int,
    seed: int = 0,
    speculative: bool = False,
) -> OfflineResult:
    """Random prompts through `core`, greedy, EOS ignored. Without `speculative` every decode step
    computes one token per stream: the figure of the step itself, what llama-bench's tg measures
    (a model looping over a random prompt would flatter n-gram drafts; `rebar bench spec` measures
    speculation on real requests)."""
    tokenizer = core.tokenizer
    specials = {i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)}
    prompts = random_prompts(num_prompts, input_len, tokenizer.vocab_size, specials, seed)
    params = SamplingParams(
        max_tokens=output_len, temperature=0, ignore_eos=True, speculative=speculative
    )
    timings: dict[str, _Timing] = {}
    pending = list(enumerate(prompts))
    peak_usage = 0.0
    stats_before = core.stats()
    started = time.perf_counter()
    in_flight = 0
    while pending or in_flight:
        while pending and in_flight < concurrency:
            index, prompt = pending.pop(0)
            core.add_request(f"bench-{index}", prompt, params)
            timings[f"bench-{index}"] = _Timing(time.perf_counter())
            in_flight += 1
        outputs = core.step()
        now = time.perf_counter()
        peak_usage = max(peak_usage, core.stats().kv_usage)
        for output in outputs:
            timings[output.request_id].token_times.extend([now] * len(output.new_token_ids))
            in_flight -= output.finished
    duration = time.perf_counter() - started
    return _result(
        core,
        timings,
        stats_before,
        num_prompts,
        input_len,
        output_len,
        concurrency,
        duration,
        peak_usage,
    )


def _result(
    core,
    timings,
    stats_before,
    num_prompts,
    input_len,
    output_len,
    concurrency,
    duration,
    peak_usage,
) -> OfflineResult:
    ttft = [(t.token_times[0] - t.start) * 1000 for t in timings.values()]
    itl = [
        (b - a) * 1000 for t in timings.values() for a, b in zip(t.token_times, t.token_times[1:])
    ]
    e2e = [(t.token_times[-1] - t.start) * 1000 for t in timings.values()]
    decode_rates = [
        (len(t.token_times) - 1) / (t.token_times[-1] - t.token_times[0])
        for t in timings.values()
        if len(t.token_times) > 1 and t.token_times[-1] > t.token_times[0]
    ]
    stats = core.stats()
    return OfflineResult(
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        concurrency=concurrency,
        duration_s=duration,
        prompt_tokens_per_s=num_prompts * input_len / duration,
        output_tokens_per_s=sum(len(t.token_times) for t in timings.values()) / duration,
        ttft_ms=summarize(ttft),
        itl_ms=summarize(itl),
        e2e_ms=summarize(e2e),
        decode_tokens_per_s_per_stream=statistics.fmean(decode_rates) if decode_rates else 0.0,
        peak_kv_usage=peak_usage,
        num_preemptions=stats.num_preemptions - stats_before.num_preemptions,
        num_prefix_hits=stats.num_prefix_hits - stats_before.num_prefix_hits,
    )
