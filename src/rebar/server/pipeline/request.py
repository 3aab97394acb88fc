"""What a dialect hands the pipeline: a generation or embedding request in no API's shape.

Each dialect module parses its own body into these and checks what is its own (field names,
mutually exclusive fields); everything below it — prompts, sampling, tools, caching, limits — works
on these types only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rebar.engine.sampling_params import SamplingParams
from rebar.engine.structured import StructuredOutput

__all__ = [
    "EmbeddingRequest",
    "FunctionTool",
    "GenerationRequest",
    "Message",
    "PastToolCall",
    "SamplingParams",
    "StructuredOutput",
    "Tools",
]

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class PastToolCall:
    """A call an earlier assistant turn made; `arguments` is JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    """One turn of a conversation. `param` names where it came from in the request body
    (`messages.2`), so an error about it points there."""

    role: Role
    content: str
    param: str
    name: str | None = None
    tool_calls: tuple[PastToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call; `parameters` is a JSON schema (None: no arguments).
    `strict` False leaves the schema's objects open to more keys."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def template_form(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's shape, which templates are written for)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class Tools:
    """The request's tools and what it allows: `choice` "auto" (the model decides), "none",
    "required" (at least one call) or `forced` (a call of that function). `parallel` False allows
    one call per answer."""

    functions: tuple[FunctionTool, ...]
    choice: Literal["auto", "none", "required"] = "auto"
    forced: str | None = None  # the function a named tool_choice forces
    parallel: bool = True
    param: str = "tools"  # where the tools are in the body, for errors
    choice_param: str = "tool_choice"


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: a conversation (`messages`) or a bare prompt (text or token ids).

    `endpoint` names the kind of answer for the response cache (two dialects asking the same of
    the same model share entries only when they render from the same result). `echo` puts the
    prompt's text before each answer (completions). A `detached` request runs on after its HTTP
    request has been answered (a background response): the client leaving does not abort it.
    """

    model: str | None
    params: SamplingParams
    endpoint: str
    messages: tuple[Message, ...] | None = None
    prompt: str | list[int] | None = None
    tools: Tools | None = None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    detached: bool = False


@dataclass(frozen=True)
class EmbeddingRequest:
    """Texts or token-id lists to embed. An input longer than the model's window is refused
    unless `truncate` is set: then it is cut to `truncate` tokens (-1: to the window)."""

    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    dimensions: int | None = None
    truncate: int | None = None
