"""`rebar bench compare`: ratios in each target's direction, a peer that is absent, and a real (small) run."""

from __future__ import annotations

import json
import sys

import pytest

from markers import requires_smollm2
from rebar.bench import compare
from rebar.bench.compare import CompareReport, EngineFigures, HttpFigures, build_rows, median_http_figures


def test_rows_put_each_ratio_in_its_targets_direction() -> None:
    rebar, peer = EngineFigures(100.0, 0.4), EngineFigures(80.0, 1.0)
    rows = {r.figure: r for r in build_rows(rebar, peer, HttpFigures(16, 170.0, 0.8, 0))}
    decode = rows["single-stream decode tok/s"]
    assert decode.ratio == pytest.approx(1.25) and decode.passed
    prefill = rows["prefill 512 tokens, TTFT s"]
    assert prefill.ratio == pytest.approx(0.4) and prefill.passed  # lower is better: 0.4x <= 0.5x
    http = rows["HTTP 16 streams, output tok/s"]
    assert http.ratio == pytest.approx(170.0 / 80.0) and http.passed
    assert rows["HTTP 16 streams, p95 TTFT s"].passed

    slow = {r.figure: r for r in build_rows(EngineFigures(50.0, 0.9), peer, HttpFigures(16, 100.0, 1.5, 2))}
    assert not slow["single-stream decode tok/s"].passed and not slow["prefill 512 tokens, TTFT s"].passed
    assert not slow["HTTP 16 streams, output tok/s"].passed and not slow["HTTP 16 streams, p95 TTFT s"].passed


def test_http_figures_are_medians_of_the_runs() -> None:
    figures = median_http_figures(16, [(150.0, 2.6, 0), (170.0, 2.4, 1), (140.0, 3.0, 0)])
    assert figures == HttpFigures(16, 150.0, 2.6, 1, 3)  # failures add up
    with pytest.raises(ValueError, match="no HTTP"):
        median_http_figures(16, [])


def test_without_a_peer_the_table_says_why(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    llm, note = compare.load_llamacpp("model.gguf", 2)
    assert llm is None and "pip install -e '.[bench]'" in note
    rebar = EngineFigures(20.0, 1.0)
    report = CompareReport("smollm2", 2, rebar, None, note, None, build_rows(rebar, None, None))
    table = report.table()
    assert note in table and "n/a" in table and "FAIL" not in table
    assert json.loads(report.to_json())["peer"] is None


@requires_smollm2
def test_small_real_comparison_measures_both_engines() -> None:
    pytest.importorskip("llama_cpp", reason="the llama.cpp peer is an optional extra (pip install -e '.[bench]')")
    report = compare.run_compare("smollm2", threads=2, output_len=8, repeats=1, http=False)
    assert report.rebar.decode_tokens_per_s > 0 and report.peer.decode_tokens_per_s > 0
    assert report.rebar.prefill_ttft_s > 0 and report.peer.prefill_ttft_s > 0
    assert [r.figure for r in report.rows] == ["single-stream decode tok/s", "prefill 512 tokens, TTFT s"]
    assert report.kv_cache_dtype == "float16" and "rebar KV cache float16" in report.table()
