"""glibc's heap as the engine wants it: a step's freed temporaries kept for the next, given back to
the OS when the engine goes idle or a model has loaded.

Elsewhere (musl, macOS) both calls do nothing.

glibc serves a block larger than its mmap threshold with a fresh mapping and unmaps it on free, so
the next step's tensor of that size faults in every page again. The threshold slides up to 32 MiB
as such blocks are freed, but trimming the heap's top and the order of a prefill's allocations kept
pulling it back: a 16,384-token Gemma 3 prefill took 1.27-1.33 million page faults and 22.2-24.6 s,
against 0.46-0.49 million and 20.8-22.5 s with the threshold fixed at 32 MiB and no automatic trim
(three runs each, alternated; docs/benchmarks.md). Loading a model makes many temporaries too
(decoding and repacking a tensor a few MiB at a time); without a trim, a 1 B model's load left ~130
MiB of freed heap resident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap and are reused (glibc's own ceiling for its sliding
# threshold); larger ones still get their own mapping.
HEAP_BLOCKS_UP_TO = 32 << 20
# Free memory at the heap's top up to this much stays until `trim` (mallopt takes an int).
KEEP_FREE_UP_TO = 1 << 30


@functools.cache
def _libc_function(name: str) -> Any:
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Keep freed blocks up to HEAP_BLOCKS_UP_TO in the heap for reuse, with no automatic trim
    (process-wide, once); whether the C library took both settings."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO)) and bool(
        mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_UP_TO)
    )


def trim() -> None:
    """Return the heap's free memory to the OS (a no-op without glibc): ~17 ms after a
    16,384-token prefill, which leaves ~200 MiB free."""
    malloc_trim = _libc_function("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)
