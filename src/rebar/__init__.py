"""rebar: an LLM inference service built from first principles."""

from rebar.engine.llm import LLM
from rebar.engine.outputs import CompletionOutput
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import RebarError

__all__ = ["LLM", "SamplingParams", "CompletionOutput", "RebarError"]
__version__ = "0.1.0"
