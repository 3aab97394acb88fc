"""How long torch's idle OpenMP threads busy-wait, set before torch (and libgomp) is imported.

After each parallel torch operator, libgomp's worker threads poll for the next one: 300,000 pause
loops by default, milliseconds on this hardware. rebar's fused decode step and int8 lm_head run on
rebar's own worker pool, so a torch operator just before them (sampling over the logits, the
embedding gather) leaves OpenMP threads spinning on the very cores the pool is using. A 16-sequence
decode step measured ~18% slower with the default than with 30,000 loops, while a 512-token prefill
(back-to-back OpenMP regions) did not change; with no spinning at all (`OMP_WAIT_POLICY=PASSIVE`)
that prefill was ~10% slower (docs/benchmarks.md).

libgomp reads its settings once, when it is loaded, so this only works when called before torch is
imported; a value the user set is kept. Importing rebar never calls it: the `rebar` command does,
first thing, and a program embedding rebar calls it itself (or sets GOMP_SPINCOUNT) if it wants the
same; the model runner warns when it builds the fused decode step with the spin left at its default
(single-stream Gemma 3 decode through `LLM.generate` measured 81.7-89.4 tokens/s that way against
113.1-140.9 with 30,000 loops, three rounds alternated).
"""

from __future__ import annotations

import os

SPIN_COUNT = "30000"
_set_here: set[str] = set()  # the variables shorten_openmp_spin set (not the user)


def shorten_openmp_spin() -> None:
    """Set GOMP_SPINCOUNT for libgomp unless the user chose it, or chose a wait policy."""
    if spin_left_at_default():
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        _set_here.add("GOMP_SPINCOUNT")


def spin_left_at_default() -> bool:
    """Whether the environment leaves libgomp's busy-wait at its default (neither GOMP_SPINCOUNT nor
    OMP_WAIT_POLICY set): what a program embedding rebar gets unless it chose otherwise."""
    return "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ


def environment_as_the_user_set_it() -> dict[str, str]:
    """os.environ without what shorten_openmp_spin added: for another program started from rebar
    (llama.cpp's tools, which use libgomp too, are measured as their users run them)."""
    return {name: value for name, value in os.environ.items() if name not in _set_here}
