"""The n-gram drafter's index against a brute-force search, and the draft-length policy."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rebar.engine.request import Request
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.spec.ngram import COPY_MATCH, MAX_NGRAM, MIN_NGRAM, NgramDrafter, NgramIndex
from rebar.engine.spec.policy import Acceptance, Candidate, StepCost, choose_draft_lengths
from rebar.engine.spec.speculator import (
    MAX_PROBE_INTERVAL,
    PROBE_INTERVAL,
    Drafting,
    SequenceSpeculation,
    Speculator,
)


def brute_force(tokens: list[int], max_tokens: int) -> tuple[int, ...]:
    """The longest suffix (MAX_NGRAM down to MIN_NGRAM tokens) found earlier, its latest earlier
    occurrence, and what followed it, read on past the end as a loop."""
    length = len(tokens)
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if n > length:
            continue
        suffix = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                extended = list(tokens)
                for i in range(max_tokens):
                    extended.append(extended[end + 1 + i])
                return tuple(extended[length:])
    return ()


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    splits=st.lists(st.integers(1, 60), max_size=6),
    max_tokens=st.integers(1, 8),
)
def test_incremental_index_proposes_what_a_full_search_finds(tokens, splits, max_tokens) -> None:
    """Grown a few tokens at a time (as a request grows), the index agrees with a search of the
    whole sequence at every point it is asked."""
    index = NgramIndex()
    for stop in sorted({min(s, len(tokens)) for s in splits} | {len(tokens)}):
        prefix = tokens[:stop]
        assert index.propose(prefix, max_tokens) == brute_force(prefix, max_tokens)


def brute_force_reach(tokens: list[int]) -> int:
    """How far back (up to COPY_MATCH) the match `brute_force` proposes from agrees with the end."""
    length = len(tokens)
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        for end in range(length - 2, n - 2, -1):
            if n <= length and tokens[end - n + 1 : end + 1] == tokens[length - n :]:
                reach = 0
                while (
                    reach < COPY_MATCH
                    and end - reach >= 0
                    and tokens[end - reach] == tokens[-1 - reach]
                ):
                    reach += 1
                return reach
    return 0


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=40))
def test_the_reach_of_a_match_is_how_far_back_it_agrees(tokens) -> None:
    index = NgramIndex()
    proposal = index.propose(tokens, 3)
    assert index.matched == (brute_force_reach(tokens) if proposal else 0)


def test_a_copy_in_progress_and_a_short_cue_are_told_apart() -> None:
    text = list(range(100, 120))
    copying = Drafting(
        Request("c", [*text, 1, *text[:10]], SamplingParams(), 200), SequenceSpeculation(), None
    )
    cue = Drafting(
        Request("s", [5, 6, 9, 1, 2, 7, 5, 6], SamplingParams(), 200), SequenceSpeculation(), None
    )
    drafter = NgramDrafter()
    assert drafter.outlook(copying, 4) == 4 and copying.speculation.cue == "copy"
    assert drafter.outlook(cue, 4) == 4 and cue.speculation.cue == "ngram"


def test_each_cue_keeps_its_own_record() -> None:
    """Short matches that fail do not hold back a copy: the sequence drafts long on its copies."""

    class Cued(FixedDrafter):
        cue = "ngram"

        def outlook(self, sequence, max_tokens):
            found = super().outlook(sequence, max_tokens)
            sequence.speculation.cue = self.cue
            return found

    memory_bound = StepCost([(1, 10.0), (2, 11.0), (8, 17.0)])
    drafter = Cued()
    speculator = Speculator(drafter, memory_bound, max_draft_tokens=4)
    sequence = decoding()
    for _ in range(30):  # short cues: always refused
        assert speculator.lookahead([sequence], 1, 1) in (
            {},
            {"r": 1},
            {"r": 2},
            {"r": 3},
            {"r": 4},
        )
        speculator.record(sequence.speculation, 4, 0)
    assert speculator.lookahead([sequence], 1, 1) == {}
    drafter.cue = "copy"
    # A copy starts from the prior, not from the short cues' failures, and earns longer drafts.
    lengths = []
    for _ in range(5):
        lengths.append(speculator.lookahead([sequence], 1, 1).get("r", 0))
        speculator.record(sequence.speculation, lengths[-1], lengths[-1])
    assert lengths[0] >= 1 and lengths[-1] == 4
    assert speculator.overall_rate("copy") > 0.5 > speculator.overall_rate("ngram")
    drafter.cue = "ngram"
    assert speculator.lookahead([sequence], 1, 1) == {}  # still refused on short cues


def test_the_longest_and_latest_match_wins() -> None:
    tokens = [1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3]
    # "1 2 3" occurred once (then 9); "2 3" also occurred later (then 8): the longer one wins.
    assert NgramIndex().propose(tokens, 2) == (9, 7)
    tokens = [4, 5, 6, 4, 5, 7, 4, 5]
    assert NgramIndex().propose(tokens, 1) == (7,)  # the latest "4 5" was followed by 7


def test_no_proposal_without_a_repeated_suffix() -> None:
    assert NgramIndex().propose([1, 2, 3, 4], 4) == ()
    assert NgramIndex().propose([1, 2, 3, 1], 4) == ()  # one token is too weak a cue
    assert NgramIndex().propose([7], 4) == ()


def test_step_cost_is_the_lower_hull_of_its_points() -> None:
    cost = StepCost([(1, 10.0), (2, 11.0), (4, 13.0), (8, 17.0)])  # on a line: kept
    assert [cost(r) for r in (1, 2, 3, 4, 8)] == [10.0, 11.0, 12.0, 13.0, 17.0]
    assert cost(16) == pytest.approx(25.0)  # the last segment's slope
    noisy = StepCost([(1, 10.0), (3, 14.0), (5, 13.0), (6, 16.0)])
    # (3, 14) was slowed down (5 rows measured cheaper); (5, 13) lies under the line to (6, 16)
    assert noisy.rows == [1, 5, 6] and noisy(3) == pytest.approx(11.5)
    flat = StepCost([(1, 2.0), (2, 1.0)])  # more rows never cost less
    assert flat(1) == flat(2) == 1.0
    assert StepCost([(1, 1.0), (2, 2.0)])(10) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        StepCost([(1, 1.0)])


def test_memory_bound_steps_draft_and_compute_bound_ones_do_not() -> None:
    candidate = [Candidate("a", 0.8, 8)]
    flat = StepCost([(1, 1.0), (64, 1.0)])  # every row free: draft all that may hold
    assert choose_draft_lengths(candidate, 1, 1, flat) == {"a": 8}
    linear = StepCost([(1, 1.0), (2, 2.0)])  # a row costs a step: drafts never pay
    assert choose_draft_lengths(candidate, 1, 1, linear) == {}
    # A 1-token step of 10 ms, each more token 2 ms: the k-th slot pays while 0.8^k beats the
    # tokens per ms so far times 2 ms.
    cpu = StepCost([(1, 10.0), (2, 12.0)])
    lengths = choose_draft_lengths(candidate, 1, 1, cpu)
    k = lengths["a"]
    tokens = sum(0.8**j for j in range(k + 1))
    assert 0.8 ** (k + 1) * (10 + 2 * k) <= tokens * 2 < 0.8**k * (10 + 2 * (k - 1)) + 0.8**k * 2
    # Sixteen sequences sharing the step's fixed cost: each extra row is a larger share of it.
    many = [Candidate(i, 0.8, 8) for i in range(16)]
    assert sum(choose_draft_lengths(many, 16, 16, cpu).values()) < 16 * k


def test_a_step_that_pays_only_past_a_costly_row_is_still_found() -> None:
    """The kernels take rows four at a time: the third row costs a lot, the fourth nothing."""
    blocky = StepCost([(1, 10.0), (2, 10.5), (3, 16.0), (4, 16.5), (5, 22.0)])
    assert choose_draft_lengths([Candidate("a", 0.99, 8)], 1, 1, blocky) == {"a": 3}


def every_prefix_search(candidates, base_rows, base_tokens, cost, seconds_per_draft):
    """The policy's definition, without its early end: slots best-first until their gain falls
    under MIN_GAIN, and the prefix with the most expected tokens per second."""
    slots = []
    for c in candidates:
        slots += [(c.rate ** (j + 1), c.key) for j in range(c.max_tokens) if c.rate > 0]
    slots.sort(key=lambda slot: -slot[0])  # stable: ties keep the candidates' order
    best_rate, best_count, tokens = base_tokens / cost(base_rows), 0, float(base_tokens)
    for count, (gain, _) in enumerate(slots, start=1):
        if gain < 0.01:
            break
        tokens += gain
        rate = tokens / (cost(base_rows + count) + count * seconds_per_draft)
        if rate > best_rate:
            best_rate, best_count = rate, count
    chosen: dict = {}
    for _, key in slots[:best_count]:
        chosen[key] = chosen.get(key, 0) + 1
    return chosen


@settings(max_examples=300, deadline=None)
@given(
    rates=st.lists(st.floats(0.05, 0.99), min_size=1, max_size=8),
    lengths=st.lists(st.integers(0, 8), min_size=8, max_size=8),
    costs=st.lists(st.floats(0.0, 20.0), min_size=2, max_size=8),
    base=st.integers(1, 16),
    per_draft=st.sampled_from([0.0, 0.5, 3.0]),
)
def test_the_early_end_finds_what_every_prefix_would(rates, lengths, costs, base, per_draft):
    # Distinct rates: equal gains may be taken in either order, with equal results.
    rates = [r + i * 1e-6 for i, r in enumerate(rates)]
    candidates = [Candidate(i, r, lengths[i]) for i, r in enumerate(rates)]
    points, seconds = [], 1.0
    for i, step in enumerate(costs):  # any measured shape; StepCost keeps its lower hull
        seconds += step
        points.append((1 + 3 * i, seconds))
    cost = StepCost(points)
    expected = every_prefix_search(candidates, base, base, cost, per_draft)
    assert choose_draft_lengths(candidates, base, base, cost, per_draft) == expected


def test_a_compute_bound_batch_prices_one_slot_only() -> None:
    calls = []

    class Counted(StepCost):
        def __call__(self, rows: int) -> float:
            calls.append(rows)
            return super().__call__(rows)

    linear = Counted([(1, 1.0), (2, 2.0)])
    many = [Candidate(i, 0.9, 8) for i in range(16)]
    assert choose_draft_lengths(many, 16, 16, linear) == {}
    assert len(calls) <= 3  # the base step, and the first slot's two ends


def test_a_drafting_cost_and_a_low_rate_hold_drafts_back() -> None:
    cpu = StepCost([(1, 10.0), (2, 12.0)])
    assert choose_draft_lengths([Candidate("a", 0.1, 8)], 1, 1, cpu) == {}
    free = choose_draft_lengths([Candidate("a", 0.8, 8)], 1, 1, cpu)
    costly = choose_draft_lengths([Candidate("a", 0.8, 8)], 1, 1, cpu, seconds_per_draft=5.0)
    assert costly.get("a", 0) < free["a"]


def test_acceptance_rate_follows_recent_verdicts() -> None:
    record = Acceptance()
    assert record.rate(0.5) == 0.5  # nothing seen yet: the prior
    for _ in range(20):
        record.update(4, 4)
    assert record.rate(0.5) > 0.9
    for _ in range(20):
        record.update(4, 0)
    assert record.rate(0.5) < 0.3
    assert math.isclose(Acceptance(kept=3.0, refused=1.0).rate(0.0), 3.0 / 5.0)


class FixedDrafter:
    """Proposes the same tokens every step."""

    name = "fixed"

    def outlook(self, sequence, max_tokens: int) -> int:
        sequence.speculation.planned = (1, 2, 3, 4)[:max_tokens]
        return len(sequence.speculation.planned)

    def draft(self, batch):
        return [sequence.speculation.planned[: item.num_lookahead] for sequence, item in batch]


def decoding(request_id: str = "r") -> Drafting:
    request = Request(request_id, [5, 6, 7], SamplingParams(max_tokens=100), 103)
    request.num_computed_tokens = 2  # its last token is the one to compute: it may draft
    return Drafting(request, SequenceSpeculation(), None)


def test_a_sequence_whose_drafts_fail_stops_drafting_then_probes_now_and_then() -> None:
    memory_bound = StepCost([(1, 10.0), (2, 11.0), (8, 17.0)])
    speculator = Speculator(FixedDrafter(), memory_bound, max_draft_tokens=4)
    sequence = decoding()
    assert speculator.lookahead([sequence], 1, 1).get("r", 0) >= 2  # the prior: worth drafting
    for _ in range(30):
        speculator.record(sequence.speculation, 4, 0)
    probes = [speculator.lookahead([sequence], 1, 1) for _ in range(PROBE_INTERVAL + 1)]
    assert probes[:PROBE_INTERVAL] == [{}] * PROBE_INTERVAL  # refused too often to pay
    assert probes[-1] == {"r": 1}  # then one token, to see whether that changed
    for _ in range(3):
        speculator.record(sequence.speculation, 1, 1)  # it did
    assert speculator.lookahead([sequence], 1, 1).get("r", 0) >= 1  # drafting again


def probe_waits(speculator: Speculator, sequence: Drafting, probes: int, kept: bool) -> list[int]:
    """Steps offered nothing before each of `probes` probes, each probe's verdict `kept`."""
    waits = []
    for _ in range(probes):
        wait = 0
        while speculator.lookahead([sequence], 1, 1) == {}:
            wait += 1
            assert wait <= MAX_PROBE_INTERVAL, "never probed"
        waits.append(wait)
        speculator.record(sequence.speculation, 1, 1 if kept else 0)
    return waits


def test_refused_probes_come_ever_more_rarely_and_a_kept_one_brings_them_back() -> None:
    memory_bound = StepCost([(1, 10.0), (2, 11.0), (8, 17.0)])
    speculator = Speculator(FixedDrafter(), memory_bound, max_draft_tokens=4)
    sequence = decoding()
    for _ in range(30):
        speculator.record(sequence.speculation, 4, 0)
    refused = probe_waits(speculator, sequence, 6, kept=False)
    assert refused == [PROBE_INTERVAL * 2**i for i in range(5)] + [MAX_PROBE_INTERVAL]
    probe_waits(speculator, sequence, 1, kept=True)  # the text turned predictable
    for _ in range(30):  # and then not again
        speculator.record(sequence.speculation, 4, 0)
    assert probe_waits(speculator, sequence, 1, kept=False) == [PROBE_INTERVAL]


def test_a_compute_bound_step_never_probes() -> None:
    compute_bound = StepCost([(1, 10.0), (2, 20.0)])  # a token costs a step: no probe pays
    busy = Speculator(FixedDrafter(), compute_bound, max_draft_tokens=4)
    quiet = decoding()
    for _ in range(30):
        busy.record(quiet.speculation, 4, 0)
    assert all(busy.lookahead([quiet], 1, 1) == {} for _ in range(3 * PROBE_INTERVAL))


def test_a_compute_bound_batch_does_not_ask_the_drafter() -> None:
    class Counting(FixedDrafter):
        asked = 0

        def outlook(self, sequence, max_tokens):
            Counting.asked += 1
            return super().outlook(sequence, max_tokens)

    sequences = [decoding(str(i)) for i in range(16)]
    for sequence in sequences:
        sequence.speculation.planned = (9,)  # last step's plan: cleared either way
    busy = Speculator(Counting(), StepCost([(1, 10.0), (2, 20.0)]), max_draft_tokens=4)
    assert busy.lookahead(sequences, 16, 16) == {}
    assert Counting.asked == 0
    assert all(s.speculation.planned == () for s in sequences)
    # Sixteen rows of a memory-bound step: a draft may pay, so the drafter is asked.
    quiet = Speculator(Counting(), StepCost([(1, 10.0), (2, 10.1), (64, 20.0)]), max_draft_tokens=4)
    assert quiet.lookahead(sequences, 16, 16)
    assert Counting.asked == 16
