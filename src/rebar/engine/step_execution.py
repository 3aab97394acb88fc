"""Run one step's plan on the model, so that a fault fails only the requests it belongs to."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from rebar.engine.runner import ModelRunner
from rebar.engine.scheduler import ScheduledRequest
from rebar.kernels.best_logits import BestTokens

logger = logging.getLogger("rebar.engine")


def execute_isolated(
    runner: ModelRunner, items: Sequence[ScheduledRequest], greedy: bool = False
) -> tuple[torch.Tensor | BestTokens, list[str]]:
    """The step's logits (one row per surviving item with `sample`, in order), or with `greedy`
    each such row's best token (`ModelRunner.execute_greedy`), and the failed request ids.

    When the batch fails, each item runs alone, in order, so only the requests that fail by
    themselves fail. Rerunning an item is harmless: the runner writes K/V only at the item's own
    slots, computed from its tokens and positions, so a rerun rewrites the same values.
    """
    execute = runner.execute_greedy if greedy else runner.execute
    try:
        return execute(items), []
    except Exception:
        logger.exception(
            "model step failed for requests %s; running each alone",
            [i.request_id for i in items],
        )
    rows: list = []  # each item's logits, or its best tokens with `greedy`
    failed: list[str] = []
    unwritten: set[int] = set()  # blocks whose K/V a failed item was to write this step
    for item in items:
        # A prefix hit taken this step may read blocks that an earlier item was to fill.
        depends_on_failed = not unwritten.isdisjoint(item.block_ids)
        if depends_on_failed:
            logger.error(
                "request %s reads KV blocks that a failed request was to write; failing it too",
                item.request_id,
            )
        item_rows = None if depends_on_failed else _execute_alone(execute, item)
        if item_rows is None:
            failed.append(item.request_id)
            unwritten.update(_blocks_written(item, runner.block_size))
        else:
            rows.append(item_rows)
    if greedy:
        return BestTokens.cat(rows), failed
    return torch.cat([torch.empty(0, runner.config.vocab_size), *rows]), failed


def _execute_alone(
    execute: Callable[[Sequence[ScheduledRequest]], torch.Tensor | BestTokens],
    item: ScheduledRequest,
) -> torch.Tensor | BestTokens | None:
    try:
        return execute([item])
    except Exception:
        logger.exception("model step failed for request %s alone", item.request_id)
        return None


def _blocks_written(item: ScheduledRequest, block_size: int) -> tuple[int, ...]:
    first, last = (
        item.start_position // block_size,
        (item.start_position + item.num_rows - 1) // block_size,
    )
    return item.block_ids[first : last + 1]
