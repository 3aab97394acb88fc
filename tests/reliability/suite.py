"""How long the reliability suite runs: short under `make test` (CI), long under `make reliability`."""

from __future__ import annotations

import os
import resource

FULL = os.environ.get("RELIABILITY_MODE", "short") == "full"


def scaled(short: float, full: float) -> float:
    """`full` under `make reliability`, `short` otherwise; RELIABILITY_SOAK_S overrides soak
    lengths."""
    return full if FULL else short


def resident_mib(pid: int | None = None) -> float:
    """Current resident memory of a process (this one by default), from /proc."""
    with open(f"/proc/{pid or os.getpid()}/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() / 2**20
