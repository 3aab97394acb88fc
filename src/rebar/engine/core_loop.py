"""The loop that owns an EngineCore: take commands, run steps, hand each step's results on at once.

The same loop runs in `AsyncEngine`'s thread and in `EngineProcess`'s child process; only where
commands come from (`Inbox`) and where results go (`Outbox`) differ. Commands and results are
plain picklable values, so they cross a process boundary unchanged.

A step's results leave as one `Delivery`: every output of the step, every request that failed to
queue, the profile that ended, and the engine's counters. One hand-off per step, not one per token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from rebar import heap
from rebar.engine.core import EngineCore
from rebar.engine.outputs import ENGINE_FAULT, ENGINE_SHUTDOWN, RequestOutput
from rebar.engine.request import AdmittedRequest
from rebar.engine.stats import EngineStats
from rebar.errors import RebarError
from rebar.obs.profiling import ProfileResult, ProfileSession

logger = logging.getLogger("rebar.engine")


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: object  # SamplingParams; `object` keeps this module's commands free of checks
    deadline: float | None  # time.monotonic() of this host (both processes share the clock)
    cache_salt: str | None
    admitted: AdmittedRequest | None = None  # the same core's admission, when in-process


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class StartProfile:
    """Profile the next `num_steps` steps, or the steps that run before `deadline` (monotonic)."""

    profile_id: int
    num_steps: int
    deadline: float
    top: int


@dataclass(frozen=True)
class Stop:
    pass


Command = Add | Abort | StartProfile | Stop


@dataclass
class Delivery:
    """What one turn of the loop produced, handed on in one piece."""

    outputs: list[RequestOutput] = field(default_factory=list)
    refused: list[tuple[str, RebarError]] = field(default_factory=list)  # could not be queued
    profiles: list[tuple[int, ProfileResult | RebarError]] = field(default_factory=list)
    stats: EngineStats | None = None

    def __bool__(self) -> bool:
        return bool(self.outputs or self.refused or self.profiles)


class Inbox(Protocol):
    def take(self, block: bool, timeout: float | None) -> list[Command]:
        """Every command waiting; with `block`, wait (up to `timeout`, None: forever) for one."""
        ...


Outbox = Callable[[Delivery], None]


@dataclass
class _OpenProfile:
    command: StartProfile
    session: ProfileSession

    def is_over(self) -> bool:
        return (
            self.session.num_steps >= self.command.num_steps
            or time.monotonic() >= self.command.deadline
        )


class CoreLoop:
    def __init__(
        self, core: EngineCore, inbox: Inbox, outbox: Outbox, with_stats: bool = True
    ) -> None:
        """`with_stats`: attach the core's counters to every delivery (another process cannot
        read them in place; a thread of this one can, and skips the copy each step)."""
        self.core, self.inbox, self.outbox = core, inbox, outbox
        self.with_stats = with_stats
        self._profile: _OpenProfile | None = None

    def run(self) -> None:
        """Until a Stop command: every request still running then ends with ENGINE_SHUTDOWN."""
        while True:
            delivery = Delivery()
            idle = not self.core.has_unfinished_requests()
            # Idle with a profile open: wake up now and then to honour its deadline.
            commands = self.inbox.take(idle, 0.05 if self._profile is not None else None)
            if any(isinstance(command, Stop) for command in commands):
                delivery.outputs += self.core.fail_all(ENGINE_SHUTDOWN)
                self._end_profile(delivery)
                self._hand_on(delivery)
                return
            for command in commands:
                self._apply(command, delivery)
            stepped = self.core.has_unfinished_requests()
            if stepped:
                try:
                    delivery.outputs += self.core.step()
                except Exception:  # a bug in the step itself: fail what is in flight, keep serving
                    logger.exception("engine step failed; failing every request in flight")
                    delivery.outputs += self.core.fail_all(ENGINE_FAULT)
                if self._profile is not None:
                    self._profile.session.step_done()
            if self._profile is not None and self._profile.is_over():
                self._end_profile(delivery)
            self._hand_on(delivery)
            if stepped and not self.core.has_unfinished_requests():
                heap.trim()  # gone idle, outputs delivered: the steps' freed temporaries go back

    def _hand_on(self, delivery: Delivery) -> None:
        if delivery or (self.with_stats and not self.core.has_unfinished_requests()):
            if self.with_stats:
                delivery.stats = self.core.stats()
            self.outbox(delivery)

    def _apply(self, command: Command, delivery: Delivery) -> None:
        if isinstance(command, StartProfile):
            self._start_profile(command, delivery)
        elif isinstance(command, Abort):
            delivery.outputs += self.core.abort_request(command.request_id)
        elif isinstance(command, Add):
            self._add(command, delivery)

    def _add(self, command: Add, delivery: Delivery) -> None:
        try:
            # Checked again here when the admission was another process's (cheap, pure).
            admitted = command.admitted or self.core.admit(
                command.prompt_token_ids,
                command.params,  # type: ignore[arg-type]
            )
            self.core.add_admitted(
                command.request_id, admitted, command.deadline, command.cache_salt
            )
        except RebarError as exc:
            delivery.refused.append((command.request_id, exc))
        except Exception:  # whatever slipped past admission fails its own request, not the engine
            logger.exception("request %s could not be queued", command.request_id)
            n = getattr(command.params, "n", 1)
            delivery.outputs += failed_outputs(command.request_id, n)

    def _start_profile(self, command: StartProfile, delivery: Delivery) -> None:
        if self._profile is not None:
            error = RebarError("a profile is already being taken")
            delivery.profiles.append((command.profile_id, error))
            return
        try:
            session = ProfileSession(
                self.core.runner.model, self.core.runner.device, command.top
            ).start()
        except Exception as exc:
            failed = RebarError(f"profiling failed to start: {exc}")
            delivery.profiles.append((command.profile_id, failed))
            return
        self._profile = _OpenProfile(command, session)

    def _end_profile(self, delivery: Delivery) -> None:
        profile, self._profile = self._profile, None
        if profile is None:
            return
        try:
            result: ProfileResult | RebarError = profile.session.finish()
        except Exception as exc:
            result = RebarError(f"profiling failed: {exc}")
        delivery.profiles.append((profile.command.profile_id, result))


def failed_outputs(
    request_id: str, num_choices: int, error: str = ENGINE_FAULT
) -> list[RequestOutput]:
    return [
        RequestOutput(request_id, index, (), "", finished=True, finish_reason="error", error=error)
        for index in range(num_choices)
    ]
