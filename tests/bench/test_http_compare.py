"""`rebar bench http`'s rows: each target of the serving path judged from the figures measured."""

from __future__ import annotations

from rebar_bench.http_compare import HttpCompareConfig, HttpCompareReport, LevelFigures, rows


def level(streams, tok_s, ttft=100.0, itl=(6.0, 9.0), failed=0, step=None) -> LevelFigures:
    return LevelFigures(streams, tok_s, ttft, itl[0], itl[1], failed, step, None)


OURS = {
    1: level(1, 150.0, itl=(6.2, 10.0), step=5.8),
    16: level(16, 400.0, ttft=1500.0),
    64: level(64, 430.0, itl=(50.0, 80.0)),
}
THEIRS = {1: level(1, 90.0), 16: level(16, 140.0, ttft=5000.0), 64: level(64, 150.0)}


def test_every_target_passes_on_figures_that_meet_it() -> None:
    judged = rows(HttpCompareConfig(), OURS, THEIRS)
    assert [r.passed for r in judged] == [True] * 7
    step = judged[0]
    assert step.rebar == 6.2 and step.peer == 5.8 and abs(step.ratio - 6.2 / 5.8) < 1e-9


def test_each_target_fails_on_its_own() -> None:
    config = HttpCompareConfig()
    slow_http = {**OURS, 1: level(1, 150.0, itl=(7.0, 10.0), step=5.8)}  # 1.21x the step
    assert rows(config, slow_http, THEIRS)[0].passed is False
    errors = {**OURS, 64: level(64, 430.0, itl=(50.0, 80.0), failed=2)}
    failed = [r for r in rows(config, errors, THEIRS) if r.figure.startswith("64 streams: failed")]
    assert failed[0].passed is False
    stalls = {**OURS, 64: level(64, 430.0, itl=(50.0, 120.0))}  # p95 2.4x its p50
    spread = [r for r in rows(config, stalls, THEIRS) if "p95 / p50" in r.figure]
    assert spread[0].passed is False and spread[0].ratio == 2.4
    late = {**OURS, 16: level(16, 400.0, ttft=6000.0)}
    ttft = [r for r in rows(config, late, THEIRS) if "TTFT" in r.figure]
    assert ttft[0].passed is False


def test_without_a_peer_the_peer_rows_are_not_judged_and_the_table_says_why() -> None:
    judged = rows(HttpCompareConfig(), OURS, None)
    throughput = [r for r in judged if "tok/s" in r.figure]
    assert throughput and all(r.passed is None and r.peer is None for r in throughput)
    report = HttpCompareReport(HttpCompareConfig(), OURS, None, judged, ["no llama-server figures"])
    table = report.table()
    assert "no llama-server figures" in table and "5.80" in table and "n/a" in table
