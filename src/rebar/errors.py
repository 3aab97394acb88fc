"""Typed errors. Anything a user can cause raises one of these; never a bare traceback.

The server maps them to OpenAI-style 4xx bodies; the CLI prints their message.
"""

from __future__ import annotations


class RebarError(Exception):
    """Base class for every error rebar raises on purpose."""


class ModelNotFoundError(RebarError):
    """The model name or path does not point at anything loadable."""


class ModelFormatError(RebarError):
    """The file exists but is corrupt, truncated or internally inconsistent."""


class UnsupportedModelError(RebarError):
    """A well-formed model that uses an architecture, tensor type or tokenizer rebar lacks."""


class InvalidRequestError(RebarError, ValueError):
    """A bad value in a request; `param` names the offending parameter."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConfigError(RebarError):
    """A setting is unknown or invalid, or a config file cannot be read; the message names the
    key."""
