"""rebar: an LLM inference service built from first principles.

`LLM`, `SamplingParams` and `CompletionOutput` load lazily, so `import rebar` (and commands that
need no model, such as `rebar config show`) do not pay for importing torch. Importing rebar changes
nothing in the process: a program that wants rebar's OpenMP setting calls `shorten_openmp_spin()`
before it imports torch, as the `rebar` command does.
"""

from typing import TYPE_CHECKING, Any

from rebar.errors import RebarError
from rebar.openmp_env import shorten_openmp_spin

__all__ = [
    "LLM",
    "CompletionOutput",
    "RebarError",
    "SamplingParams",
    "shorten_openmp_spin",
]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "rebar.llm",
    "SamplingParams": "rebar.engine.sampling_params",
    "CompletionOutput": "rebar.engine.outputs",
}

if TYPE_CHECKING:
    from rebar.engine.outputs import CompletionOutput
    from rebar.engine.sampling_params import SamplingParams
    from rebar.llm import LLM


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rebar' has no attribute {name!r}")
