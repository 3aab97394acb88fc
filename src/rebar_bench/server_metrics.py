"""The engine's own step times, read from a rebar server's /metrics around a benchmark level.

`rebar_engine_step_seconds{kind="decode"}` is a histogram of whole engine steps in which every
scheduled request computed one token. Its change over a level is the engine's per-token step time
while the level ran, so the HTTP inter-token time minus it is what the serving path adds. A server
without that histogram (llama-server, or rebar with no chat model) gives None.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rebar.timing import DurationHistogram

STEP_METRIC = "rebar_engine_step_seconds"


@dataclass(frozen=True)
class StepHistogram:
    """Cumulative counts at each upper bound (seconds, +Inf last), with the sum and count."""

    buckets: tuple[tuple[float, float], ...]
    total_s: float
    count: float

    @classmethod
    def of(cls, histogram: DurationHistogram) -> StepHistogram:
        """The engine's own histogram (read in-process, not scraped)."""
        buckets = tuple((float(bound), float(n)) for bound, n in histogram.cumulative())
        return cls(buckets, histogram.total_s, float(histogram.num))

    def minus(self, earlier: StepHistogram) -> StepHistogram:
        if [b for b, _ in earlier.buckets] != [b for b, _ in self.buckets]:
            raise ValueError("the step histogram's buckets changed between two scrapes")
        return StepHistogram(
            tuple(
                (bound, n - m)
                for (bound, n), (_, m) in zip(self.buckets, earlier.buckets, strict=True)
            ),
            self.total_s - earlier.total_s,
            self.count - earlier.count,
        )

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket that holds rank q * count."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if bound == float("inf"):
                    return lower_bound  # past the last finite bound: that bound is all we know
                inside = cumulative - lower_count
                fraction = (rank - lower_count) / inside if inside > 0 else 1.0
                return lower_bound + (bound - lower_bound) * fraction
            lower_bound, lower_count = bound, cumulative
        return lower_bound

    @property
    def mean(self) -> float | None:
        return self.total_s / self.count if self.count > 0 else None


def parse_step_histogram(text: str, kind: str = "decode") -> StepHistogram | None:
    """The `kind` series of rebar_engine_step_seconds in a Prometheus text exposition, or None."""
    for family in text_string_to_metric_families(text):
        if family.name != STEP_METRIC:
            continue
        buckets, total, count = [], None, None
        for sample in family.samples:
            if sample.labels.get("kind") != kind:
                continue
            if sample.name.endswith("_bucket"):
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_count"):
                count = sample.value
        if buckets and total is not None and count is not None:
            return StepHistogram(tuple(sorted(buckets)), total, count)
    return None


async def scrape_step_histogram(client: httpx.AsyncClient, base_url: str) -> StepHistogram | None:
    """GET {base_url}/metrics; None when the server has no such endpoint or metric."""
    try:
        response = await client.get(base_url + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return parse_step_histogram(response.text)
    except ValueError:  # not Prometheus' text format
        return None


def step_times_ms(
    before: StepHistogram | None, after: StepHistogram | None
) -> dict[str, float | None] | None:
    """p50 and mean decode step time (ms) and the number of steps between two scrapes."""
    if before is None or after is None:
        return None
    level = after.minus(before)
    if level.count <= 0:
        return None
    p50, mean = level.quantile(0.5), level.mean
    return {
        "p50": None if p50 is None else p50 * 1000,
        "mean": None if mean is None else mean * 1000,
        "steps": level.count,
    }
