"""Give freed heap memory back to the operating system, where the C library can (glibc's
malloc_trim).

glibc raises its mmap threshold after a large block is freed, so later temporaries of that size come
from the heap and stay resident after they are freed. Loading a model makes many such temporaries
(decoding and repacking a tensor a few MiB at a time); without a trim, a 1 B model's load left
~130 MiB of freed heap resident. Elsewhere (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def trim() -> None:
    """Return the heap's free memory to the OS (a no-op without glibc)."""
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)
