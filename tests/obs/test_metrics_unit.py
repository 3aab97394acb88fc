"""ServerMetrics without a model: per-request timing from outputs, registry isolation, route
templates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rebar.engine.spec.speculator import DraftCounts
from rebar.obs.metrics import ServerMetrics
from rebar.server.middleware import route_template
from rebar.timing import FINE_BUCKETS, STEP_BUCKETS, DurationHistogram, RequestTiming


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def output(
    index: int,
    tokens: int,
    finished: bool = False,
    reason: str | None = None,
    timing: RequestTiming | None = None,
) -> SimpleNamespace:
    return SimpleNamespace(
        index=index,
        new_token_ids=(1,) * tokens,
        finished=finished,
        finish_reason=reason,
        num_prompt_tokens=7,
        num_cached_tokens=0,
        timing=timing,
    )


def test_request_timer_records_ttft_itl_e2e_tokens_and_reasons() -> None:
    clock = FakeClock()
    metrics = ServerMetrics(clock)
    timer = metrics.request_timer(arrived_at=99.5, n=2)
    clock.now = 100.25
    timer.on_output(output(0, 1))
    clock.now = 100.30
    timer.on_output(output(1, 1))
    clock.now = 100.35
    # engine instants: arrived 10.0, scheduled 10.2, first token 10.5, finished 11.0
    timer.on_output(output(0, 2, True, "stop", RequestTiming(10.0, 10.2, 10.5, 11.0)))
    clock.now = 101.0
    timer.close()
    timer.close()  # idempotent
    s = samples(metrics)
    assert s[("rebar_time_to_first_token_seconds_count", ())] == 1
    assert abs(s[("rebar_time_to_first_token_seconds_sum", ())] - 0.75) < 1e-9
    assert abs(s[("rebar_request_queue_seconds_sum", ())] - 0.2) < 1e-9
    assert abs(s[("rebar_request_prefill_seconds_sum", ())] - 0.3) < 1e-9
    assert abs(s[("rebar_request_decode_seconds_sum", ())] - 0.5) < 1e-9
    assert (
        s[("rebar_inter_token_latency_seconds_count", ())] == 1
    )  # only choice 0 had a second output
    assert abs(s[("rebar_inter_token_latency_seconds_sum", ())] - 0.10) < 1e-9
    assert abs(s[("rebar_e2e_request_latency_seconds_sum", ())] - 1.5) < 1e-9
    assert s[("rebar_generation_tokens_total", ())] == 4
    assert s[("rebar_prompt_tokens_total", ())] == 7
    assert s[("rebar_requests_finished_total", (("finish_reason", "stop"),))] == 1
    assert (
        s[("rebar_requests_finished_total", (("finish_reason", "abort"),))] == 1
    )  # choice 1 never finished


def test_each_metrics_object_has_its_own_registry() -> None:
    first, second = ServerMetrics(), ServerMetrics()
    first.observe_http("/health", "GET", 200, 0.01)
    assert (
        samples(first)[
            (
                "rebar_http_requests_total",
                (("method", "GET"), ("route", "/health"), ("status", "200")),
            )
        ]
        == 1
    )
    assert not any(name == "rebar_http_requests_total" for name, _ in samples(second))


def test_state_collector_reads_engine_caches_store_and_models() -> None:
    decode_steps = DurationHistogram.empty()
    masks = DurationHistogram.empty(FINE_BUCKETS)
    masks.observe(0.00005)
    masks.observe(0.0003)
    for seconds in (0.004, 0.005, 0.2):
        decode_steps.observe(seconds)
    stats = SimpleNamespace(
        num_running=2,
        num_waiting=3,
        num_free_blocks=6,
        num_blocks=8,
        kv_usage=0.25,
        num_prefix_queries=10,
        num_prefix_hits=4,
        num_preemptions=1,
        num_requests_added=5,
        step_seconds={"decode": decode_steps, "prefill": DurationHistogram.empty()},
        grammar_mask_seconds=masks,
        drafts={"ngram": DraftCounts(num_drafted=10, num_accepted=7, num_steps=4)},
    )
    engine = SimpleNamespace(stats=lambda: stats)
    chat = SimpleNamespace(
        dtype="torch.float32", config=SimpleNamespace(source_architecture="LlamaForCausalLM")
    )

    def instance(engine, queue=None):
        return SimpleNamespace(
            entry=SimpleNamespace(name="tiny"),
            engine=engine,
            queue=queue,
            closed=False,
            text=chat,
            load_seconds=1.5,
            footprint_bytes=3 * 2**20,
        )

    # The version being replaced still runs one request; its other counters are not added.
    old_stats = SimpleNamespace(**{**vars(stats), "num_running": 1, "num_requests_added": 99})
    current, retiring = instance(engine), instance(SimpleNamespace(stats=lambda: old_stats))
    embedder = instance(None, SimpleNamespace(num_rejected=5, num_waiting_inputs=7))
    slot = SimpleNamespace(
        name="tiny", current=current, retired=[retiring], version=2, state="reloading"
    )
    registry = SimpleNamespace(
        loaded=lambda: [current, retiring, embedder], slots={"tiny": slot}, total_bytes=2**30
    )
    state = SimpleNamespace(
        registry=registry,
        response_cache=SimpleNamespace(stats=SimpleNamespace(hits=2, stale_hits=1, misses=4)),
        embedding_cache=None,
        gate=SimpleNamespace(num_rate_limited=3, waiting=SimpleNamespace(num_rejected=4)),
        store=SimpleNamespace(num_errors=2, circuit_open=True),
    )
    metrics = ServerMetrics()
    metrics.attach(state)
    s = samples(metrics)
    M = (("model", "tiny"),)  # engine series carry the model's name
    assert s[("rebar_requests_running", M)] == 3 and s[("rebar_requests_waiting", M)] == 6
    assert s[("rebar_engine_requests_added_total", M)] == 5
    D = (("drafter", "ngram"), *M)
    assert s[("rebar_spec_draft_tokens_total", D)] == 10
    assert s[("rebar_spec_accepted_tokens_total", D)] == 7
    assert s[("rebar_spec_acceptance_ratio", D)] == pytest.approx(0.7)
    assert s[("rebar_kv_cache_usage_ratio", M)] == 0.25
    assert (
        s[("rebar_prefix_cache_queries_total", M)] == 10
        and s[("rebar_prefix_cache_hits_total", M)] == 4
    )
    assert s[("rebar_preemptions_total", M)] == 1
    assert s[("rebar_engine_step_seconds_count", (("kind", "decode"), *M))] == 3
    assert s[("rebar_engine_step_seconds_sum", (("kind", "decode"), *M))] == pytest.approx(0.209)
    under_a_tenth = repr(next(b for b in STEP_BUCKETS if b >= 0.1))
    assert (
        s[("rebar_engine_step_seconds_bucket", (("kind", "decode"), ("le", under_a_tenth), *M))]
        == 2
    )
    assert s[("rebar_engine_step_seconds_count", (("kind", "prefill"), *M))] == 0
    assert s[("rebar_engine_grammar_mask_seconds_count", M)] == 2
    assert s[("rebar_engine_grammar_mask_seconds_sum", M)] == pytest.approx(0.00035)
    fine = repr(next(b for b in FINE_BUCKETS if b >= 0.0001))
    assert s[("rebar_engine_grammar_mask_seconds_bucket", (("le", fine), *M))] == 1
    assert s[("rebar_response_cache_total", (("result", "hit"),))] == 3
    assert s[("rebar_response_cache_total", (("result", "miss"),))] == 4
    assert s[("rebar_embedding_cache_total", (("result", "hit"),))] == 0
    assert s[("rebar_rate_limited_total", ())] == 3 and s[("rebar_store_errors_total", ())] == 2
    assert s[("rebar_overload_rejected_total", ())] == 4 + 5
    assert s[("rebar_embedding_inputs_waiting", ())] == 7
    assert s[("rebar_store_circuit_open", ())] == 1
    assert s[("rebar_model_load_seconds", (("model", "tiny"),))] == 1.5
    assert (
        s[
            (
                "rebar_model_info",
                (
                    ("architecture", "LlamaForCausalLM"),
                    ("dtype", "float32"),
                    ("model", "tiny"),
                    ("state", "reloading"),
                    ("version", "2"),
                ),
            )
        ]
        == 1
    )
    assert s[("rebar_model_memory_bytes", M)] == 6 * 2**20  # the current and the retiring version
    assert s[("rebar_models_memory_budget_bytes", ())] == 2**30


def test_route_template_bounds_cardinality() -> None:
    from fastapi import APIRouter, FastAPI

    router = APIRouter()

    @router.get("/v1/items/{item_id}")
    async def item(item_id: str) -> dict:
        return {}

    app = FastAPI()
    app.include_router(router)

    def scope(path: str, method: str = "GET") -> dict:
        return {"type": "http", "path": path, "method": method, "root_path": "", "headers": []}

    assert route_template(app.routes, scope("/v1/items/42")) == "/v1/items/{item_id}"
    assert (
        route_template(app.routes, scope("/v1/items/42", "POST")) == "/v1/items/{item_id}"
    )  # 405, still templated
    assert route_template(app.routes, scope("/no/such/path")) == "other"


def test_request_timing_splits_and_combines_choices() -> None:
    a = RequestTiming(arrival=1.0, scheduled=1.5, first_token=2.0, finished=4.0)
    b = RequestTiming(arrival=1.1, scheduled=1.4, first_token=2.5, finished=5.0)
    assert (a.queue_s, a.prefill_s, a.decode_s) == (0.5, 0.5, 2.0)
    both = RequestTiming.combine([a, b])
    assert (both.arrival, both.scheduled, both.first_token, both.finished) == (1.0, 1.4, 2.0, 5.0)
    never_ran = RequestTiming(arrival=1.0, scheduled=None, first_token=None, finished=3.0)
    assert (never_ran.queue_s, never_ran.prefill_s, never_ran.decode_s) == (2.0, 0.0, 0.0)
    assert RequestTiming.combine([]) is None
