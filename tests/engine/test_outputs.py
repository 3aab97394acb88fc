"""OutputAccumulator: incremental outputs gathered into whole choices."""

from __future__ import annotations

from rebar.engine.outputs import OutputAccumulator, RequestOutput, RequestTiming
from rebar.engine.sampler import TokenLogprobs


def output(index: int, tokens: tuple[int, ...], text: str, **fields) -> RequestOutput:
    return RequestOutput("r", index, tokens, text, num_prompt_tokens=5, **fields)


def test_choices_gather_text_ids_logprobs_and_how_they_ended() -> None:
    lp = [TokenLogprobs(t, -0.5 * t, ((t, -0.5 * t),)) for t in (7, 8, 9)]
    timing = RequestTiming(1.0, 2.0, 3.0, 4.0)
    collected = OutputAccumulator()
    collected.add(output(1, (9,), "c", logprobs=(lp[2],), num_cached_tokens=4))
    collected.add(output(0, (7,), "a", logprobs=(lp[0],)))
    collected.add(
        output(0, (8,), "b", logprobs=(lp[1],), finished=True, finish_reason="stop", stop_reason=8)
    )
    collected.add(
        output(
            1,
            (),
            "",
            finished=True,
            finish_reason="error",
            error="failed",
            timing=timing,
            num_cached_tokens=4,
        )
    )
    first, second = collected.choices()
    assert (first.index, first.text, first.token_ids, first.logprobs) == (
        0,
        "ab",
        [7, 8],
        tuple(lp[:2]),
    )
    assert (first.finish_reason, first.stop_reason, first.error) == ("stop", 8, None)
    assert (second.index, second.text, second.finish_reason, second.error) == (
        1,
        "c",
        "error",
        "failed",
    )
    assert collected.num_choices == 2 and collected.num_completion_tokens == 3
    assert collected.num_prompt_tokens == 5
    assert collected.num_cached_tokens == 0  # the first choice's count
    assert collected.timing() == timing


def test_a_choice_that_never_finished_counts_as_aborted() -> None:
    collected = OutputAccumulator()
    collected.add(output(0, (7,), "a"))
    assert collected.choices()[0].finish_reason == "abort"
    assert collected.timing() is None
