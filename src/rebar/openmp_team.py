"""The OpenMP team size of the calling thread alone.

`torch.set_num_threads` sets the calling thread's team size and also the process-wide number every
thread that starts later takes at its first parallel operator: an engine that gave its steps fewer
threads for a while that way could leave another model's engine thread, started meanwhile, with that
smaller team for good. OpenMP's own `omp_set_num_threads` sets only the calling thread's, and ATen
and rebar's kernels size their work from it (`at::get_num_threads()` is `omp_get_max_threads()`).

The OpenMP runtime is the one torch loaded (libgomp in the Linux wheels, libomp or Intel's libiomp
elsewhere), found among the process's mapped libraries.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Any

import torch

logger = logging.getLogger("rebar.engine")

_RUNTIMES = ("libgomp", "libomp", "libiomp5")


@functools.cache
def _runtime() -> Any:
    """The loaded OpenMP runtime's library, or None where it cannot be found (no /proc)."""
    torch.get_num_threads()  # torch has loaded its runtime by now
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if len(line.split()) >= 6}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(_RUNTIMES):
            try:
                return ctypes.CDLL(path)
            except OSError as error:
                logger.debug("could not open the OpenMP runtime %s: %s", path, error)
    return None


def available() -> bool:
    """Whether `set_team_size` can work here."""
    return _runtime() is not None


def set_team_size(threads: int) -> bool:
    """Let the calling thread's parallel operators use `threads` threads from now on (other threads
    keep theirs); whether it could."""
    runtime = _runtime()
    if runtime is None:
        return False
    # ATen sets a thread's team size at its first parallel operator (from the process-wide number):
    # that must happen before this call, not after it.
    torch.get_num_threads()
    runtime.omp_set_num_threads(threads)
    return True
