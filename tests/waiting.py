"""Waiting for an event in a test, never for a speed.

A test waits until something it can observe happens (the engine reports idle, a version is
swapped in, a message arrives). The timeout only bounds a hang: it is far beyond how long the
event takes on the slowest machine the suite runs on (a shared 2-core host whose speed drifts 2x
within minutes), so reaching it means the event never came, not that the machine was slow.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# How long a test waits for an event before calling it a hang. Well below every test's own time
# limit (pytest-timeout), so a hang fails here, with the event named, rather than there.
HANG_S = 30.0


def wait_until(
    predicate: Callable[[], object], timeout: float = HANG_S, poll_s: float = 0.01
) -> bool:
    """Poll `predicate` until it is true (True) or `timeout` seconds pass (its last value, as a bool)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(poll_s)
    return bool(predicate())


async def wait_until_async(
    predicate: Callable[[], object], timeout: float = HANG_S, poll_s: float = 0.01
) -> bool:
    """`wait_until` for a coroutine: sleeps on the event loop between polls."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        await asyncio.sleep(poll_s)
    return bool(predicate())
