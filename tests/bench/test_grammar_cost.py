"""`rebar bench grammar`'s measurement on a tiny random model: full batches in every run, and the
mask's time read from the engine's own histogram."""

from __future__ import annotations

import json

from rebar_bench.grammar_cost import run_grammar_cost, to_json
from tiny_engine import make_core


def test_the_grammar_bench_reports_the_mask_against_the_plain_step(tmp_path) -> None:
    core = make_core(tmp_path, characters=True, num_blocks=512, max_model_len=256)
    result = run_grammar_cost(core, batch=3, output_len=10, seed=1)
    assert result.constrained_tokens == 30  # the schema cannot finish early: every row runs
    assert result.plain_step_ms > 0 and result.constrained_step_ms > 0
    assert result.mask_ms_p50 > 0 and 0 < result.mask_ms_mean < result.constrained_step_ms
    assert result.mask_share == result.mask_ms_mean / result.plain_step_ms
    assert core.stats().grammar_mask_seconds.num == 10  # one mask per constrained step
    assert json.loads(to_json([result]))[0]["batch"] == 3
    assert not core.has_unfinished_requests()
