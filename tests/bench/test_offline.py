"""`rebar bench offline` on a tiny engine: every request completes and the numbers are consistent."""

from __future__ import annotations

import pytest

from rebar_bench.offline import run_offline, summarize
from tiny_engine import make_core


def test_offline_run_reports_consistent_numbers(tmp_path) -> None:
    core = make_core(tmp_path, num_blocks=128)
    result = run_offline(core, num_prompts=6, input_len=10, output_len=5, concurrency=3)
    assert result.output_tokens_per_s * result.duration_s == pytest.approx(6 * 5)
    assert result.prompt_tokens_per_s * result.duration_s == pytest.approx(6 * 10)
    assert 0 < result.ttft_ms["p50"] <= result.ttft_ms["p99"]
    assert 0 < result.peak_kv_usage <= 1
    assert not core.has_unfinished_requests() and core.stats().num_free_blocks == 128
    assert "generation throughput" in result.table()


def test_percentiles() -> None:
    stats = summarize([float(i) for i in range(1, 101)])
    assert stats["p50"] == 51 and stats["p90"] == 91 and stats["p99"] == 100
    assert summarize([])["p50"] == 0.0


def test_decode_steps_compute_one_token_each_unless_speculation_is_asked_for(tmp_path) -> None:
    core = make_core(tmp_path, num_blocks=128)
    assert core.speculator is not None  # on by default
    asked: list[bool] = []
    add_request = core.add_request

    def recording(request_id, prompt, params):
        asked.append(params.speculative)
        return add_request(request_id, prompt, params)

    core.add_request = recording  # type: ignore[method-assign]
    run_offline(core, num_prompts=2, input_len=10, output_len=4, concurrency=2)
    run_offline(core, num_prompts=2, input_len=10, output_len=4, concurrency=2, speculative=True)
    assert asked == [False, False, True, True]
