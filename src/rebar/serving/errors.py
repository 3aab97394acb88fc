"""Why a model cannot serve a request now. The HTTP layer turns each class into a status code in
one table (`rebar.server.errors`); nothing here knows about HTTP."""

from __future__ import annotations

from rebar.errors import RebarError


class ServingError(RebarError):
    """A model or the service cannot take this request now. `retry_after_s`: when trying again
    may help (None: it will not by itself)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnknownModel(ServingError):
    """A request named a model that is not served (for its kind of work)."""


class NoSuchEntry(UnknownModel):
    """An admin call named a model the service has no entry for."""


class ModelLoading(ServingError):
    """The model is loading (or reloading) and did not finish within the wait."""


class ModelFailed(ServingError):
    """The model's last load failed; the message says why."""


class NotReady(ServingError):
    """The service is still loading its pinned models, or their load failed."""


class EngineStopped(ServingError):
    """A chat engine stopped serving (its process exited)."""


class InsufficientMemory(ServingError):
    """No room for a model in the memory budget; `ever` is False when it could never fit."""

    def __init__(self, message: str, ever: bool = True) -> None:
        super().__init__(message, retry_after_s=5 if ever else None)
        self.ever = ever


class Overloaded(ServingError):
    """A waiting queue is full (generation or embeddings)."""


class ShuttingDown(ServingError):
    """The model is being stopped; its queued work was dropped."""


class LoadRefused(ServingError):
    """An admin load failed; the message says why."""


class ReloadRefused(ServingError):
    """A reload could not load, or broke the contract of, the new version: the old one serves."""


class ReloadSuperseded(ServingError):
    """A newer version was announced while this reload waited."""
