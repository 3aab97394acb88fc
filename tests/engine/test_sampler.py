"""The sampler against hand-computed expectations: filters, penalties, logit_bias, logprobs, and
seeded rows that draw the same tokens alone or in any batch."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from rebar import SamplingParams
from rebar.engine import token_draw
from rebar.engine.sampler import SampleRequest, make_generator, sample_batch

LOGITS = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))


def draw_one(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """One draw from a single row through the engine's batched sampler."""
    return sample_batch(logits[None], [SampleRequest(params, generator, [], [])])[0].token_id


def frequencies(logits: torch.Tensor, params: SamplingParams, num_draws: int) -> torch.Tensor:
    """How often each token is drawn from one seeded row, as a fraction of `num_draws`."""
    generator = make_generator(params)
    counts = torch.zeros(logits.shape[-1])
    for _ in range(num_draws):
        counts[draw_one(logits, params, generator)] += 1
    return counts / num_draws


def test_greedy_takes_the_argmax() -> None:
    assert draw_one(torch.tensor([0.1, 3.0, -1.0]), SamplingParams(temperature=0), None) == 1


def test_temperature_sharpens_and_flattens() -> None:
    # p ** (1 / T), renormalised: token 0 goes from 0.4 to 0.16 / 0.285 cold and 0.632 / 2.107 hot.
    cold = frequencies(LOGITS, SamplingParams(temperature=0.5, seed=1), 4000)
    hot = frequencies(LOGITS, SamplingParams(temperature=2.0, seed=2), 4000)
    assert float(cold[0]) == pytest.approx(0.16 / 0.285, abs=0.03)
    assert float(hot[0]) == pytest.approx(0.632 / 2.107, abs=0.03)


def test_sampling_follows_the_distribution() -> None:
    drawn = frequencies(LOGITS, SamplingParams(temperature=1.0, seed=7), 4000)
    assert torch.allclose(drawn, LOGITS.exp(), atol=0.03)


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = torch.randn(1000)

    def draw(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed)
        generator = make_generator(params)
        return [draw_one(logits, params, generator) for _ in range(20)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_filtered_tokens_are_never_sampled() -> None:
    params = SamplingParams(temperature=1.0, top_k=2, seed=3)
    generator = make_generator(params)
    assert {draw_one(LOGITS, params, generator) for _ in range(500)} == {0, 1}


# --- the batched API -------------------------------------------------------------------------


def request(
    params: SamplingParams,
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    seeded: bool = True,
) -> SampleRequest:
    return SampleRequest(
        params, make_generator(params) if seeded else None, list(prompt), list(output)
    )


def processed(values: list[float], params: SamplingParams, prompt=(), output=()) -> list[float]:
    """Each token's logit after logit_bias and penalties, read back through greedy choices.

    Token t competes alone against a probe token (in no history, so untouched): a probe one float32
    step above the processed value wins, a probe equal to it loses (argmax takes the first id).
    Returns the value at which the choice flips, which is exactly the processed logit.
    """
    greedy = dataclasses.replace(params, temperature=0.0)
    probe = len(values)

    def winner(token: int, probe_value: torch.Tensor) -> int:
        row = torch.full((1, probe + 1), -math.inf)
        row[0, token], row[0, probe] = values[token], probe_value
        result = sample_batch(row, [request(greedy, prompt, output)])[0]
        assert result is not None
        return result.token_id

    def flip_point(token: int) -> float:
        low, high = torch.tensor(-1e6), torch.tensor(1e6)  # the probe loses at low, wins at high
        assert winner(token, low) == token and winner(token, high) == probe
        while torch.nextafter(low, high) != high:  # bisect on float32 values
            middle = (low + high) / 2
            if middle in (low, high):
                middle = torch.nextafter(low, high)
            if winner(token, middle) == probe:
                high = middle
            else:
                low = middle
        return float(low)

    return [flip_point(token) for token in range(len(values))]


def greedy_token(values: list[float], **kwargs) -> int:
    prompt, output = kwargs.pop("prompt", ()), kwargs.pop("output", ())
    params = SamplingParams(temperature=0, **kwargs)
    return sample_batch(torch.tensor([values]), [request(params, prompt, output)])[0].token_id


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    # token 0: positive, in the output; 1: negative, in the output; 2: positive, prompt only;
    # 3: negative, prompt only; 4: never seen.
    logits = [2.0, -1.0, 0.5, -0.25, 3.0]
    got = processed(logits, SamplingParams(repetition_penalty=2.0), prompt=(2, 3), output=(0, 1, 0))
    assert got == [1.0, -2.0, 0.25, -0.5, 3.0]


def test_repetition_penalty_below_one_rewards_seen_tokens() -> None:
    assert processed([2.0, -1.0, 1.0], SamplingParams(repetition_penalty=0.5), prompt=(0, 1)) == [
        4.0,
        -0.5,
        1.0,
    ]


def test_repetition_penalty_changes_the_greedy_choice_exactly_at_the_hand_computed_value() -> None:
    # 2.0 / 2 = 1.0, so a neighbour at 0.99 still loses and one at 1.01 wins.
    assert greedy_token([2.0, 0.99], repetition_penalty=2.0, prompt=(0,)) == 0
    assert greedy_token([2.0, 1.01], repetition_penalty=2.0, prompt=(0,)) == 1
    # -1.0 * 2 = -2.0 on a negative logit: a neighbour at -1.9 now wins, one at -2.1 does not.
    assert greedy_token([-1.0, -1.9], repetition_penalty=2.0, output=(0,)) == 1
    assert greedy_token([-1.0, -2.1], repetition_penalty=2.0, output=(0,)) == 0


def test_presence_penalty_counts_a_token_once() -> None:
    got = processed(
        [1.0, 1.0, 1.0, 1.0],
        SamplingParams(presence_penalty=0.5),
        prompt=(3, 3),
        output=(0, 0, 0, 1),
    )
    assert got == [0.5, 0.5, 1.0, 1.0]  # the prompt-only token 3 is not penalised


def test_frequency_penalty_scales_with_the_count() -> None:
    got = processed(
        [1.0, 1.0, 1.0, 1.0],
        SamplingParams(frequency_penalty=0.25),
        prompt=(3, 3),
        output=(0, 0, 0, 1),
    )
    assert got == [0.25, 0.75, 1.0, 1.0]


def test_presence_and_frequency_add_up_and_may_be_negative() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25)
    assert processed([1.0, 1.0, 1.0], params, output=(0, 0, 1)) == [
        1.0,
        0.75,
        1.0,
    ]  # 1 - 0.5 + 0.5; 1 - 0.5 + 0.25


def test_repetition_comes_before_presence_and_frequency() -> None:
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    assert processed([4.0, 4.0], params, output=(0, 0)) == [4.0 / 2 - 1.0 - 0.5 * 2, 4.0]


def test_logit_bias_is_added_before_penalties() -> None:
    params = SamplingParams(logit_bias={0: 2.0, 2: -3.0}, repetition_penalty=2.0)
    # token 0: (1 + 2) / 2; token 2: (1 - 3) * 2 (the bias made it negative first)
    assert processed([1.0, 1.0, 1.0], params, prompt=(0, 2)) == [1.5, 1.0, -4.0]


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -5.0]])
    forced = SamplingParams(temperature=1.0, seed=1, logit_bias={3: 100})
    row = request(forced)
    assert {sample_batch(logits, [row])[0].token_id for _ in range(200)} == {3}
    assert greedy_token([5.0, 4.0, 3.0, -5.0], logit_bias={0: -100}) == 1
    banned = request(SamplingParams(temperature=1.0, seed=2, logit_bias={"0": -100}))
    flat = torch.zeros(1, 4)
    drawn = {sample_batch(flat, [banned])[0].token_id for _ in range(300)}
    assert drawn == {1, 2, 3}


def test_sampling_leaves_the_input_alone() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.0, 0.25]])
    bias_and_penalty = SamplingParams(temperature=0, logit_bias={0: 5}, presence_penalty=1.0)
    penalised = SamplingParams(temperature=0.7, top_k=2, seed=1, repetition_penalty=1.5)
    reqs = [request(bias_and_penalty, output=(2,)), request(penalised, prompt=(0,))]
    assert processed([1.0, 2.0, 3.0], bias_and_penalty, output=(2,)) == [6.0, 2.0, 2.0]
    assert sample_batch(logits, reqs)[0].token_id == 0
    assert logits.tolist() == [[1.0, 2.0, 3.0], [0.5, 0.0, 0.25]]


def test_logprobs_come_from_the_raw_logits_sorted_and_of_the_requested_length() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    params = SamplingParams(
        temperature=0.5,
        seed=4,
        logprobs=5,
        logit_bias={7: 3.0},
        presence_penalty=1.0,
        repetition_penalty=1.5,
    )
    result = sample_batch(logits, [request(params, prompt=(1, 2), output=(3, 7))])[0]
    reference = torch.log_softmax(logits[0], -1)
    assert result.logprobs is not None
    assert result.logprobs.token_id == result.token_id
    assert result.logprobs.logprob == pytest.approx(float(reference[result.token_id]), abs=1e-6)
    top = result.logprobs.top
    assert len(top) == 5
    assert [t for t, _ in top] == torch.argsort(reference, descending=True)[:5].tolist()
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    for token_id, logprob in top:
        assert logprob == pytest.approx(float(reference[token_id]), abs=1e-6)


def test_the_chosen_token_is_reported_even_outside_the_top_list() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0, logprobs=1, logit_bias={3: 100})
    result = sample_batch(logits, [request(params)])[0]
    reference = torch.log_softmax(logits[0], -1)
    assert result.token_id == 3
    assert result.logprobs is not None
    assert result.logprobs.logprob == pytest.approx(float(reference[3]), abs=1e-6)
    assert result.logprobs.top == ((0, pytest.approx(float(reference[0]), abs=1e-6)),)


def test_logprobs_zero_reports_only_the_chosen_token_and_none_means_off() -> None:
    logits = torch.tensor([[0.0, 1.0]])
    zero = sample_batch(logits, [request(SamplingParams(temperature=0, logprobs=0))])[0]
    assert zero.logprobs is not None and zero.logprobs.top == ()
    assert zero.logprobs.logprob == pytest.approx(math.log(math.e / (1 + math.e)), abs=1e-6)
    assert sample_batch(logits, [request(SamplingParams(temperature=0))])[0].logprobs is None


def test_each_row_gets_its_own_number_of_alternatives() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    reqs = [request(SamplingParams(temperature=0, logprobs=k)) for k in (2, None, 5)]
    results = sample_batch(logits, reqs)
    assert results[0].logprobs is not None and results[2].logprobs is not None
    assert [t for t, _ in results[0].logprobs.top] == torch.argsort(logits[0], descending=True)[
        :2
    ].tolist()
    assert results[1].logprobs is None
    assert [t for t, _ in results[2].logprobs.top] == torch.argsort(logits[2], descending=True)[
        :5
    ].tolist()


def test_plain_greedy_batch_takes_each_rows_argmax() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, -1.0, 4.0], [0.0, 0.0, 9.0]])
    reqs = [request(SamplingParams(temperature=0)) for _ in range(3)]
    assert [t.token_id for t in sample_batch(logits, reqs)] == [1, 0, 2]


def _neighbours(vocab_size: int) -> list[tuple[SamplingParams, torch.Tensor]]:
    """Seven rows with assorted params and their own logits, to surround the row under test."""
    g = torch.Generator().manual_seed(99)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3),  # unseeded: the global RNG
        SamplingParams(temperature=0.7, seed=5, top_p=0.5, logprobs=3),
        SamplingParams(temperature=0, presence_penalty=1.5, logit_bias={1: 2.0}),
        SamplingParams(temperature=1.0, seed=6, min_p=0.1, frequency_penalty=0.4),
        SamplingParams(temperature=2.0, top_k=3, repetition_penalty=1.8),
        SamplingParams(temperature=0.9, seed=7, top_k=10, top_p=0.8, min_p=0.05, logprobs=20),
    ]
    return [(p, torch.randn(vocab_size, generator=g) * 3) for p in params]


def _draw_sequence(
    row_logits: torch.Tensor, params: SamplingParams, neighbours, position: int
) -> list[int]:
    """50 tokens for one row, fed back as its output history, optionally among neighbour rows."""
    target = request(params, prompt=(1, 2, 3))
    others = [request(p, prompt=(4,)) for p, _ in neighbours]
    tokens = []
    for _ in range(50):
        reqs = [*others[:position], target, *others[position:]]
        rows = [row for _, row in neighbours]
        logits = torch.stack([*rows[:position], row_logits, *rows[position:]])
        results = sample_batch(logits, reqs)
        token = results[position].token_id
        tokens.append(token)
        target.output_token_ids.append(token)
        for other, result in zip(reqs, results):
            if other is not target:
                other.output_token_ids.append(result.token_id)
    return tokens


@pytest.mark.parametrize("vocab_size", [64, 4096])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=1234),
        SamplingParams(temperature=0.8, seed=1234, top_k=20, top_p=0.9, min_p=0.02),
        SamplingParams(
            temperature=1.5, seed=9, top_p=0.9
        ),  # in 4096 tokens: wider than the candidates
        SamplingParams(
            temperature=1.1,
            seed=77,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            logit_bias={0: 1.0},
        ),
    ],
)
def test_a_seeded_row_draws_the_same_tokens_alone_or_in_a_batch(
    params: SamplingParams, vocab_size: int
) -> None:
    row_logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(3))
    alone = _draw_sequence(row_logits, params, [], 0)
    in_batch = _draw_sequence(row_logits, params, _neighbours(vocab_size), 5)
    assert alone == in_batch
    assert len(set(alone)) > 5  # the row really samples, so the comparison means something


def test_greedy_rows_are_unaffected_by_their_neighbours() -> None:
    vocab_size = 64
    plain = torch.randn(vocab_size, generator=torch.Generator().manual_seed(8))
    penalised_params = SamplingParams(temperature=0, frequency_penalty=2.0)
    for position in (0, 3, 7):
        neighbours = _neighbours(vocab_size)
        logits = [row for _, row in neighbours]
        reqs = [request(p) for p, _ in neighbours]
        logits.insert(position, plain)
        reqs.insert(position, request(SamplingParams(temperature=0)))
        logits.append(plain)
        reqs.append(request(penalised_params, output=(int(plain.argmax()),) * 2))
        results = sample_batch(torch.stack(logits), reqs)
        assert results[position].token_id == int(plain.argmax())
        expected = plain.clone()
        expected[int(plain.argmax())] -= 4.0  # frequency 2.0 * count 2
        assert results[-1].token_id == int(expected.argmax())


def test_batched_sampling_follows_the_distribution() -> None:
    row = request(SamplingParams(temperature=1.0, seed=11))
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample_batch(LOGITS.unsqueeze(0), [row])[0].token_id] += 1
    assert torch.allclose(counts / 4000, LOGITS.exp(), atol=0.03)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(top_k=2, seed=1), {0, 1}),
        (SamplingParams(top_k=0, seed=1), {0, 1, 2, 3, 4}),
        (SamplingParams(top_p=0.5, seed=2), {0, 1}),  # 0.4 < 0.5, 0.4 + 0.3 >= 0.5
        (SamplingParams(top_p=0.4, seed=2), {0}),
        (SamplingParams(top_p=0.86, seed=2), {0, 1, 2, 3}),
        (SamplingParams(min_p=0.5, seed=3), {0, 1}),  # threshold 0.2
        (SamplingParams(min_p=0.3, seed=3), {0, 1, 2}),  # threshold 0.12
        (SamplingParams(top_k=3, top_p=0.6, seed=4), {0, 1}),
        (SamplingParams(seed=5), {0, 1, 2, 3, 4}),
    ],
)
def test_batched_filters_keep_exactly_the_hand_computed_set(
    params: SamplingParams, expected: set[int]
) -> None:
    row = request(params)
    assert {sample_batch(LOGITS.unsqueeze(0), [row])[0].token_id for _ in range(1500)} == expected


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(top_k=2, seed=1), {0, 1, 2}),  # token 2 ties the 2nd best
        # token 0 holds 0.53 < 0.6, so the next best stays: token 1, and token 2 tied with it
        (SamplingParams(top_p=0.6, seed=2), {0, 1, 2}),
        (SamplingParams(top_p=0.5, seed=3), {0}),
    ],
)
def test_tokens_tied_with_the_last_kept_one_are_kept(
    params: SamplingParams, expected: set[int]
) -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    row = request(params)
    assert {sample_batch(logits, [row])[0].token_id for _ in range(600)} == expected


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, top_k=50, seed=1),
        SamplingParams(temperature=1.2, top_p=0.9, seed=2),
        SamplingParams(temperature=0.8, top_k=200, top_p=0.95, min_p=0.01, seed=3),
        SamplingParams(temperature=1.0, top_k=1500, seed=4),  # past the candidates: always wide
    ],
)
def test_a_row_draws_the_same_tokens_from_its_candidates_or_its_whole_vocabulary(
    params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    logits = torch.randn(1, 2048, generator=torch.Generator().manual_seed(4)) * 2

    def draws() -> list[int]:
        row = request(params)
        return [sample_batch(logits, [row])[0].token_id for _ in range(50)]

    from_candidates = draws()
    monkeypatch.setattr(token_draw, "CANDIDATE_WIDTHS", (1,))  # no kept set fits: all go wide
    assert draws() == from_candidates
    assert len(set(from_candidates)) > 5


def _draw_many(logits: torch.Tensor, params: SamplingParams, num_draws: int) -> list[int]:
    row = request(params)
    return [sample_batch(logits.unsqueeze(0), [row])[0].token_id for _ in range(num_draws)]


def _first_dropped(step: float, top_k: int, top_p: float) -> int:
    """For logits -step * i, the first token top-k then top-p drop, from the geometric series.

    p_i is proportional to r**i (r = exp(-step)) over the k kept tokens, so the mass ranked before
    token i is (1 - r**i) / (1 - r**k); the first token where that reaches top_p is dropped.
    """
    r = math.exp(-step)
    return min(top_k, math.ceil(math.log(1 - top_p * (1 - r**top_k)) / math.log(r)))


@pytest.mark.parametrize(
    ("step", "top_k", "top_p"),
    [
        (1e-4, 0, 0.5),  # the nucleus (~2048 tokens) is wider than the candidates
        (1e-3, 0, 0.5),  # the candidates hold enough mass; normalised over the whole vocabulary
        (1e-3, 2000, 0.5),  # top-k wider than the candidates, then top-p within those k
        (1e-3, 1000, 0.5),  # top-k within the candidates, top-p normalised over those k
        (1e-3, 2000, 1.0),  # top-k alone, wider than the candidates
    ],
)
def test_top_k_then_top_p_keep_the_hand_computed_prefix_in_a_large_vocabulary(
    step: float, top_k: int, top_p: float
) -> None:
    vocab_size = 4096
    first_dropped = _first_dropped(step, top_k or vocab_size, top_p)
    logits = -step * torch.arange(vocab_size, dtype=torch.float32)
    drawn = _draw_many(logits, SamplingParams(top_k=top_k, top_p=top_p, seed=1), 300)
    assert max(drawn) <= first_dropped  # one token of slack for float32 round-off at the boundary
    assert max(drawn) > 0.85 * first_dropped  # the whole prefix is reachable, not a smaller one


def test_a_narrow_nucleus_in_a_large_vocabulary_keeps_the_hand_computed_set() -> None:
    logits = torch.full((4096,), -30.0)
    logits[[7, 900, 3000, 4000]] = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert set(_draw_many(logits, SamplingParams(top_p=0.75, seed=3), 200)) == {7, 900}
    assert set(_draw_many(logits, SamplingParams(top_p=0.85, seed=4), 300)) == {7, 900, 3000}
    assert set(_draw_many(logits, SamplingParams(top_k=3, seed=5), 300)) == {7, 900, 3000}


def test_a_tiny_temperature_behaves_like_greedy() -> None:
    # 30 / 1e-38 overflows float32; the sampler must still pick the best token, not a NaN.
    logits = torch.tensor([[10.0, 30.0, 20.0]])
    row = request(SamplingParams(temperature=1e-38, seed=1))
    assert {sample_batch(logits, [row])[0].token_id for _ in range(20)} == {1}


def test_same_seed_repeats_and_other_seeds_differ_in_a_batch() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))

    def draw(seed: int) -> list[int]:
        row = request(SamplingParams(temperature=1.0, seed=seed))
        return [sample_batch(logits, [row])[0].token_id for _ in range(20)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_bad_shapes_and_history_ids_are_rejected() -> None:
    with pytest.raises(ValueError):
        sample_batch(torch.zeros(2, 4), [request(SamplingParams())])
    with pytest.raises(ValueError):
        sample_batch(torch.zeros(4), [request(SamplingParams())])
    with pytest.raises(ValueError):
        sample_batch(
            torch.zeros(1, 4), [request(SamplingParams(presence_penalty=1.0), output=(4,))]
        )


# --- extreme settings and broken logits -------------------------------------------------------

VOCAB = 2048  # past the candidate widths, so the whole-vocabulary draw runs too


def extreme_params() -> list[SamplingParams]:
    """Every corner of the numeric settings, each one valid by itself."""
    combos = itertools.product(
        (1e-50, 1e-5, 1.0, 100.0),  # temperature
        (1e-50, 1e-30, 0.5, 1.0),  # top_p
        (0, 1, 5, 1500),  # top_k
        (0.0, 1e-50, 1.0),  # min_p
        ((1.0, 0.0, 0.0), (0.01, 2.0, 2.0), (2.0, -2.0, -2.0)),  # repetition, presence, frequency
        (None, {7: 100.0, 8: -100.0}),  # logit_bias
    )
    return [
        SamplingParams(
            temperature=t,
            top_p=p,
            top_k=k,
            min_p=m,
            repetition_penalty=r,
            presence_penalty=pr,
            frequency_penalty=f,
            logit_bias=bias,
            seed=i,
        )
        for i, (t, p, k, m, (r, pr, f), bias) in enumerate(combos)
    ]


def test_no_valid_setting_can_produce_an_invalid_token() -> None:
    torch.manual_seed(0)
    params = extreme_params()
    logits = torch.randn(len(params), VOCAB) * 30  # large, model-like spreads
    rows = [request(p, prompt=(7, 8, 9), output=(9, 9, 10)) for p in params]
    for token in sample_batch(logits, rows):
        assert token is not None and 0 <= token.token_id < VOCAB


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"top_k": 5},
        {"top_p": 0.5},
        {"top_p": 1e-50},
        {"min_p": 0.2},
        {
            "repetition_penalty": 1.5,
            "presence_penalty": 2.0,
            "frequency_penalty": -1.0,
            "logit_bias": {3: 2.0},
        },
    ],
)
def test_a_vanishing_temperature_picks_the_greedy_token(extra: dict) -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 50)
    history = {"prompt": (1, 2, 3), "output": (3, 4)}
    tiny = sample_batch(logits, [request(SamplingParams(temperature=1e-50, **extra), **history)])[0]
    greedy = sample_batch(logits, [request(SamplingParams(temperature=0, **extra), **history)])[0]
    assert tiny is not None and greedy is not None and tiny.token_id == greedy.token_id


def test_a_top_p_that_rounds_to_zero_keeps_the_best_token() -> None:
    for top_k in (0, 3):
        params = SamplingParams(temperature=1.0, top_p=1e-50, top_k=top_k, seed=5)
        generator = make_generator(params)
        assert {draw_one(LOGITS, params, generator) for _ in range(50)} == {0}
    big = torch.randn(VOCAB)
    assert draw_one(big, SamplingParams(temperature=1.0, top_p=1e-50, seed=5), None) == int(
        big.argmax()
    )


NAN_ROW, POSITIVE_INF_ROW, ALL_NEGATIVE_INF_ROW = 1, 3, 5


def broken_batch() -> tuple[torch.Tensor, list[SampleRequest]]:
    """Six rows: plain greedy, sampled, penalised greedy, ... with three rows broken in different
    ways."""
    torch.manual_seed(2)
    logits = torch.randn(6, 64)
    logits[NAN_ROW, 10] = float("nan")
    logits[POSITIVE_INF_ROW, 11] = float("inf")
    logits[ALL_NEGATIVE_INF_ROW] = float("-inf")
    settings = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, presence_penalty=1.0),
        SamplingParams(temperature=0.7, top_k=5, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, seed=2, logprobs=2),
        SamplingParams(temperature=0.7, seed=3),
    ]
    return logits, [request(p, output=(1, 2)) for p in settings]


@pytest.mark.parametrize("broken", [NAN_ROW, POSITIVE_INF_ROW, ALL_NEGATIVE_INF_ROW])
def test_a_row_with_broken_logits_fails_alone(broken: int) -> None:
    logits, rows = broken_batch()
    for row in {NAN_ROW, POSITIVE_INF_ROW, ALL_NEGATIVE_INF_ROW} - {broken}:
        logits[row] = torch.randn(64)  # repair the others: only `broken` is broken
    tokens = sample_batch(logits, rows)
    assert tokens[broken] is None
    for i, token in enumerate(tokens):
        if i != broken:
            fresh = [SampleRequest(rows[i].params, make_generator(rows[i].params), (), (1, 2))]
            assert token == sample_batch(logits[i : i + 1], fresh)[0]  # what the row gets alone


def test_every_broken_row_fails_and_no_healthy_one_does() -> None:
    logits, rows = broken_batch()
    broken = {NAN_ROW, POSITIVE_INF_ROW, ALL_NEGATIVE_INF_ROW}
    tokens = sample_batch(logits, rows)
    assert {i for i, token in enumerate(tokens) if token is None} == broken
    assert all(0 <= tokens[i].token_id < 64 for i in set(range(6)) - broken)


def test_penalties_that_overflow_the_logits_fail_that_row_alone() -> None:
    """Defence in depth: SamplingParams bounds the penalty, but a huge logit can still overflow it."""
    logits = torch.tensor([[3e38, 1.0, 0.0], [0.0, 1.0, 0.0]])
    rows = [
        request(SamplingParams(temperature=0, repetition_penalty=0.01), prompt=(0,)),
        request(SamplingParams(temperature=0)),
    ]
    tokens = sample_batch(logits, rows)
    assert tokens[0] is None and tokens[1] is not None and tokens[1].token_id == 1


def test_whole_row_sums_are_the_same_bits_alone_or_in_a_batch() -> None:
    # top_p measures a row against its whole mass; a lone long row must add up exactly as it does
    # among others, or the nucleus boundary could move with the batch.
    values = (torch.randn(9, 49152 + 77, generator=torch.Generator().manual_seed(6)) * 3).exp()
    together = token_draw.row_sums(values)
    for start, size in ((0, 1), (4, 1), (2, 3), (8, 1)):
        alone = token_draw.row_sums(values[start : start + size].clone())
        assert torch.equal(alone, together[start : start + size])
    assert torch.allclose(together, values.double().sum(-1, keepdim=True), rtol=1e-12)


# ----- grammar masks --------------------------------------------------------------------------------


@dataclasses.dataclass
class AllowOnly:
    """A LogitsMask allowing, in row `rows[j]`, only the tokens `allowed[j]`."""

    rows: list[int]
    allowed: list[set[int]]
    applied: int = 0

    def apply_(self, logits: torch.Tensor) -> list[int]:
        self.applied += 1
        for row, tokens in zip(self.rows, self.allowed):
            keep = torch.zeros(logits.shape[1], dtype=torch.bool)
            keep[list(tokens)] = True
            logits[row] = logits[row].masked_fill(~keep, float("-inf"))
        return [len(tokens) for tokens in self.allowed]


def test_a_mask_limits_greedy_and_sampled_rows_and_leaves_the_rest_alone() -> None:
    logits = LOGITS.repeat(3, 1)
    original = logits.clone()
    greedy = SamplingParams(temperature=0)
    sampled = SamplingParams(temperature=1.0, seed=3)
    rows = [
        SampleRequest(greedy, None, [], []),
        SampleRequest(sampled, make_generator(sampled), [], []),
        SampleRequest(greedy, None, [], []),
    ]
    for _ in range(50):
        mask = AllowOnly([0, 1], [{3}, {2, 4}])
        got = [t.token_id for t in sample_batch(logits, rows, mask)]
        assert got[0] == 3 and got[1] in {2, 4} and got[2] == 0
        assert mask.applied == 1
    assert torch.equal(logits, original)  # the caller's logits are never written


def test_a_mask_draws_in_proportion_among_what_it_allows() -> None:
    params = SamplingParams(temperature=1.0, seed=11)
    generator = make_generator(params)
    counts = {2: 0, 4: 0}
    for _ in range(3000):
        row = [SampleRequest(params, generator, [], [])]
        counts[sample_batch(LOGITS[None], row, AllowOnly([0], [{2, 4}]))[0].token_id] += 1
    assert counts[2] / 3000 == pytest.approx(0.15 / 0.2, abs=0.03)  # p2 / (p2 + p4)


def test_logprobs_under_a_mask_are_the_models_own() -> None:
    params = SamplingParams(temperature=0, logprobs=2)
    token = sample_batch(LOGITS[None], [SampleRequest(params, None, [], [])], AllowOnly([0], [{3}]))
    assert token[0].token_id == 3
    assert token[0].logprobs.logprob == pytest.approx(math.log(0.1), abs=1e-5)
    assert [t for t, _ in token[0].logprobs.top] == [0, 1]


def test_a_mask_that_allows_nothing_fails_only_its_row() -> None:
    greedy = SamplingParams(temperature=0)
    rows = [SampleRequest(greedy, None, [], []), SampleRequest(greedy, None, [], [])]
    got = sample_batch(LOGITS.repeat(2, 1), rows, AllowOnly([1], [set()]))
    assert got[0] is not None and got[0].token_id == 0
    assert got[1] is None


@pytest.mark.parametrize("num_allowed", [1, 3, 63, 64, 200, 1023, 2000])
@pytest.mark.parametrize("extra", [{}, {"min_p": 0.05}, {"top_p": 0.8}, {"top_k": 20}])
def test_a_masked_row_draws_what_the_whole_row_would(num_allowed, extra) -> None:
    """Few allowed tokens are drawn among the best candidates, not over the whole row: the same
    tokens from the same uniforms, whichever way is taken."""
    gen = torch.Generator().manual_seed(num_allowed)
    logits = torch.randn(1, 5000, generator=gen) * 3
    allowed = set(torch.randperm(5000, generator=gen)[:num_allowed].tolist())
    forbidden = torch.ones(5000, dtype=torch.bool)
    forbidden[list(allowed)] = False
    params = SamplingParams(temperature=0.9, seed=7, **extra)
    masked_gen, plain_gen = make_generator(params), make_generator(params)
    pre_masked = logits.masked_fill(forbidden, float("-inf"))
    for _ in range(40):
        row = [SampleRequest(params, masked_gen, [], [])]
        with_mask = sample_batch(logits, row, AllowOnly([0], [allowed]))[0].token_id
        plain = sample_batch(pre_masked, [SampleRequest(params, plain_gen, [], [])])[0].token_id
        assert with_mask == plain and with_mask in allowed
