"""Measure, once at load, what a step costs by the number of tokens it computes (`StepCost`).

Only the shape of the curve matters to the draft-length policy (how much a step of r + 1 tokens
costs against one of r), and that shape is the machine's and the model's: how far a step stays
bound by reading the weights before arithmetic takes over. Each point is one sequence verifying
r - 1 drafts over a short context, run exactly as the engine runs a greedy step (the same runner
and kernels, each row's best token found by the head), on KV blocks no request holds yet.
"""

from __future__ import annotations

import logging
import time

from rebar import heap
from rebar.engine.runner import ModelRunner
from rebar.engine.scheduler import ScheduledRequest
from rebar.engine.spec.policy import StepCost

logger = logging.getLogger("rebar.engine")

CONTEXT_TOKENS = 64  # what the measured rows attend over
# Past 32 rows a step is bound by arithmetic on any model worth drafting for: the curve goes on
# along its last segment. Fewer, smaller points keep what this adds to a cold start small (about
# half a second on SmolLM2, one on Gemma 3 270M, on 2 busy cores).
ROW_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)
TIME_LIMIT_S = 0.5  # the first pass stops adding larger steps past this
REPEATS = 2  # the fastest of these per point (interference only ever slows a step down)


def measure_step_cost(runner: ModelRunner, num_blocks: int, max_rows: int) -> StepCost:
    """The step-cost curve of `runner` for steps of 1 to `max_rows` tokens (fewer when the time
    limit or the first `num_blocks` blocks of its cache run out), the last segment extended."""
    block_size = runner.block_size
    context = min(CONTEXT_TOKENS, max(1, num_blocks * block_size // 2))
    max_rows = max(2, min(max_rows, num_blocks * block_size - context))
    blocks = tuple(range(-(-(context + max_rows) // block_size)))
    token = 1 % runner.config.vocab_size
    runner.execute([ScheduledRequest("calibration", (token,) * context, 0, blocks, True)])

    def step_seconds(rows: int) -> float:
        item = ScheduledRequest(
            "calibration", (token,), context, blocks, True, rows - 1, (token,) * (rows - 1)
        )
        started = time.perf_counter()
        runner.execute_greedy([item])
        seconds = time.perf_counter() - started
        heap.trim()  # the step's logits (a MiB a row on a wide vocabulary) stay resident otherwise
        return seconds

    began = time.perf_counter()
    step_seconds(1)  # first-call allocations
    counts = [r for r in ROW_COUNTS if r <= max_rows] or [1, 2]
    if counts[-1] < 2:
        counts.append(2)
    seconds: dict[int, float] = {}
    spent = time.perf_counter()
    for rows in counts:
        seconds[rows] = step_seconds(rows)
        if time.perf_counter() - spent > TIME_LIMIT_S and len(seconds) >= 2:
            break
    for _ in range(REPEATS - 1):
        for rows in seconds:
            seconds[rows] = min(seconds[rows], step_seconds(rows))
    cost = StepCost(sorted(seconds.items()))
    logger.info(
        "speculative decoding: a step of 1 token takes %.2f ms, of 2 %.2f ms, of %d %.2f ms "
        "(measured in %.2f s)",
        cost(1) * 1e3,
        cost(2) * 1e3,
        max(seconds),
        cost(max(seconds)) * 1e3,
        time.perf_counter() - began,
    )
    return cost
