"""Run one step's plan on the model, so that a fault fails only the requests it belongs to."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from rebar.engine.runner import ModelRunner
from rebar.engine.scheduler import ScheduledRequest

logger = logging.getLogger("rebar.engine")


def execute_isolated(
    runner: ModelRunner, items: Sequence[ScheduledRequest]
) -> tuple[torch.Tensor, list[str]]:
    """The step's logits (one row per surviving item with `sample`, in order) and the failed
    request ids.

    When the batch fails, each item runs alone, in order, so only the requests that fail by
    themselves fail. Rerunning an item is harmless: the runner writes K/V only at the item's own
    slots, computed from its tokens and positions, so a rerun rewrites the same values.
    """
    try:
        return runner.execute(items), []
    except Exception:
        logger.exception(
            "model step failed for requests %s; running each alone",
            [i.request_id for i in items],
        )
    rows: list[torch.Tensor] = [torch.empty(0, runner.config.vocab_size)]
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
        item_logits = None if depends_on_failed else _execute_alone(runner, item)
        if item_logits is None:
            failed.append(item.request_id)
            unwritten.update(_blocks_written(item, runner.block_size))
        else:
            rows.append(item_logits)
    return torch.cat(rows), failed


def _execute_alone(runner: ModelRunner, item: ScheduledRequest) -> torch.Tensor | None:
    try:
        return runner.execute([item])
    except Exception:
        logger.exception("model step failed for request %s alone", item.request_id)
        return None


def _blocks_written(item: ScheduledRequest, block_size: int) -> tuple[int, ...]:
    first, last = (
        item.start_position // block_size,
        (item.start_position + item.num_rows - 1) // block_size,
    )
    return item.block_ids[first : last + 1]
