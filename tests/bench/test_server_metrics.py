"""The engine's step times read from /metrics: the exposition rebar writes, parsed back."""

from __future__ import annotations

import pytest

from rebar.timing import STEP_BUCKETS, DurationHistogram
from rebar_bench.server_metrics import StepHistogram, parse_step_histogram, step_times_ms


def exposition(decode: DurationHistogram, prefill: DurationHistogram | None = None) -> str:
    """What the server's collector renders for these histograms."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import HistogramMetricFamily

    class One:
        def collect(self):
            family = HistogramMetricFamily("rebar_engine_step_seconds", "steps", labels=["kind"])
            for kind, h in (("decode", decode), ("prefill", prefill or DurationHistogram.empty())):
                family.add_metric([kind], h.cumulative(), h.total_s)
            yield family

    registry = CollectorRegistry()
    registry.register(One())
    return generate_latest(registry).decode()


def observed(*seconds: float) -> DurationHistogram:
    histogram = DurationHistogram.empty()
    for s in seconds:
        histogram.observe(s)
    return histogram


def test_the_p50_of_a_level_comes_from_the_difference_of_two_scrapes() -> None:
    before = parse_step_histogram(exposition(observed(*[0.050] * 100)))  # an earlier, slow level
    after = parse_step_histogram(exposition(observed(*[0.050] * 100, *[0.006] * 99, 0.2)))
    times = step_times_ms(before, after)
    assert times is not None and times["steps"] == 100
    # Within the bucket that holds 6 ms (buckets are ~19% wide), never near the old level's 50 ms.
    assert 6.0 / 1.19 < times["p50"] < 6.0 * 1.19
    assert times["mean"] == pytest.approx((99 * 6 + 200) / 100)


def test_the_prefill_series_and_an_idle_level_are_left_out() -> None:
    text = exposition(observed(0.004), prefill=observed(*[0.3] * 10))
    histogram = parse_step_histogram(text)
    assert histogram is not None and histogram.count == 1
    assert step_times_ms(histogram, histogram) is None  # no decode step between the scrapes


def test_a_server_without_the_metric_gives_none() -> None:
    assert parse_step_histogram("# HELP other x\n# TYPE other counter\nother_total 3\n") is None
    assert step_times_ms(None, None) is None


def test_quantiles_interpolate_within_a_bucket_and_stop_at_the_last_bound() -> None:
    h = StepHistogram(((0.001, 0.0), (0.002, 10.0), (float("inf"), 10.0)), 0.015, 10.0)
    assert h.quantile(0.5) == pytest.approx(0.0015)
    tail = StepHistogram(((0.001, 0.0), (float("inf"), 4.0)), 40.0, 4.0)
    assert tail.quantile(0.5) == 0.001
    assert StepHistogram(((float("inf"), 0.0),), 0.0, 0.0).quantile(0.5) is None


def test_buckets_cover_sub_millisecond_to_seconds_steps() -> None:
    assert STEP_BUCKETS[0] == 0.0005 and STEP_BUCKETS[-1] > 5
    h = observed(0.0001, 0.0005, 0.00051, 100.0)
    assert h.counts[0] == 2 and h.counts[1] == 1 and h.counts[-1] == 1 and h.num == 4
    assert [n for _, n in h.cumulative()][-1] == 4
