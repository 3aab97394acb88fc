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
