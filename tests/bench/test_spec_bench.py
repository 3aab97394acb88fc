"""`rebar bench spec`'s schedule: every request goes to every server in turn, the order rotated by
round and by request, so no configuration always runs first (when the host is freshest)."""

from __future__ import annotations

from rebar_bench import spec_bench
from rebar_bench.spec_bench import (
    Answer,
    Batch,
    ServerFigures,
    SpecBenchConfig,
    batch_pairs,
    detail_lines,
    interleave,
    many_chats,
    paired,
    rotated,
)
from rebar_bench.spec_prompts import SpecRequest


def test_rotated_leads_with_each_name_in_turn() -> None:
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert rotated(["a", "b", "c"], 5) == ["c", "a", "b"]
    assert rotated([], 3) == []


def test_each_request_goes_to_every_server_in_a_rotating_order(monkeypatch) -> None:
    calls: list[tuple[str, str, str]] = []

    def answering(url, model, message, tokens, nonce, ignore_eos=False):
        calls.append((url, model, message))
        return Answer(tokens, "text", 10.0)

    monkeypatch.setattr(spec_bench, "stream_chat", answering)
    servers = {"on": ("http://a", "m-a"), "off": ("http://b", "m-b")}
    requests = [SpecRequest("chat", "first"), SpecRequest("rename", "second")]
    figures: dict[str, ServerFigures] = {}
    for round_index in range(2):
        interleave(servers, requests, SpecBenchConfig(tokens=7), figures, round_index)
    assert calls == [
        ("http://a", "m-a", "first"),
        ("http://b", "m-b", "first"),  # round 0
        ("http://b", "m-b", "second"),
        ("http://a", "m-a", "second"),
        ("http://b", "m-b", "first"),
        ("http://a", "m-a", "first"),  # round 1
        ("http://a", "m-a", "second"),
        ("http://b", "m-b", "second"),
    ]
    assert {name: len(f.answers["chat"]) for name, f in figures.items()} == {"on": 2, "off": 2}
    assert figures["on"].rate("rename") == 10.0


def test_batches_run_in_pairs_whose_first_alternates(monkeypatch) -> None:
    calls: list[tuple[str, int, int]] = []

    def batch(url, model, count, tokens, ignore_eos):
        calls.append((url, count, tokens))
        return Batch(float(len(calls)))

    monkeypatch.setattr(spec_bench, "many_chats", batch)
    servers = {spec_bench.REBAR: ("http://on", "m"), spec_bench.REBAR_PLAIN: ("http://off", "m")}
    figures: dict[str, ServerFigures] = {}
    config = SpecBenchConfig(batch=5, batch_pairs=3, tokens=9)
    for round_index in range(2):
        batch_pairs(servers, config, figures, round_index)
    order = [url for url, _, _ in calls]
    assert order[:6] == [
        "http://on",
        "http://off",
        "http://off",
        "http://on",
        "http://on",
        "http://off",
    ]
    assert order[6:] == [
        "http://off",
        "http://on",
        "http://on",
        "http://off",
        "http://off",
        "http://on",
    ]
    assert {(count, tokens) for _, count, tokens in calls} == {(5, 9)}
    assert len(figures[spec_bench.REBAR].batch_tokens_per_s) == 6  # three pairs, two rounds
    assert figures[spec_bench.REBAR].batch_tokens_per_s[:2] == [1.0, 4.0]  # paired by index


def test_batches_are_judged_by_the_ratios_of_their_pairs() -> None:
    # The host slowed down mid-run (the third pair straddles the change): the medians apart say
    # 0.55x, the pairs' ratios 0.52 to 1.03 with a median of 0.99.
    ours = [300.0, 290.0, 150.0, 155.0, 149.0]
    plain = [305.0, 284.0, 290.0, 151.0, 150.0]
    row = paired("16 streams", ours, plain, 0.97)
    assert row.rebar == 155.0 and row.peer == 284.0
    assert row.ratio == sorted(a / b for a, b in zip(ours, plain))[2]
    assert row.passed
    slower = paired("16 streams", [0.95 * x for x in plain], plain, 0.97)
    assert slower.ratio is not None and abs(slower.ratio - 0.95) < 1e-12 and not slower.passed
    assert paired("16 streams", [], [], 0.97).passed is None


def test_a_batch_counts_the_drafts_of_all_its_chats(monkeypatch) -> None:
    answers = iter([Answer(10, "a", 5.0, 4, 3), Answer(20, "b", 5.0, 0, 0)])
    monkeypatch.setattr(spec_bench, "stream_chat", lambda *args: next(answers))
    batch = many_chats("http://on", "m", 2, 32, False)
    assert (batch.drafted, batch.accepted) == (4, 3) and batch.tokens_per_s > 0
    unreported = iter([Answer(10, "a", 5.0, 4, 3), Answer(20, "b", 5.0)])
    monkeypatch.setattr(spec_bench, "stream_chat", lambda *args: next(unreported))
    assert many_chats("http://off", "m", 2, 32, False).drafted is None


def test_the_details_say_what_the_batches_drafted() -> None:
    # A batch row with nothing drafted compares two servers doing the same work: the details say so.
    figures = {
        spec_bench.REBAR: ServerFigures(batches=[Batch(500.0, 0, 0), Batch(480.0, 6, 5)]),
        spec_bench.REBAR_PLAIN: ServerFigures(batches=[Batch(505.0), Batch(470.0)]),
    }
    lines = detail_lines("smollm2", figures)
    assert lines[-1] == "rebar, batches of streams: kept / drafted 5/6"
    assert figures[spec_bench.REBAR].batch_tokens_per_s == [500.0, 480.0]
    assert figures[spec_bench.REBAR_PLAIN].batch_acceptance() is None
    quiet = detail_lines("smollm2", {spec_bench.REBAR: ServerFigures()})
    assert not any("batches" in line for line in quiet)
