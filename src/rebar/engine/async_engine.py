"""The engine core in its own thread, bridged to asyncio.

The event loop never runs a matmul: `generate` puts commands on a thread-safe inbox and awaits
per-request queues that the core thread fills after each step. Leaving the async iterator early
(client gone, task cancelled) aborts the request, which frees its KV blocks within one step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from rebar.engine.core import EngineCore
from rebar.engine.outputs import ENGINE_FAULT, ENGINE_SHUTDOWN, RequestOutput
from rebar.engine.prompt import Prompt, prompt_token_ids
from rebar.engine.request import AdmittedRequest
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import RebarError
from rebar.obs.profiling import ProfileResult, ProfileSession

logger = logging.getLogger("rebar.engine")


@dataclass(frozen=True)
class _Add:
    request_id: str
    admitted: AdmittedRequest
    deadline: float | None
    cache_salt: str | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass
class _Profile:
    """Profile the next `num_steps` steps, or the steps that run before `deadline` (monotonic)."""

    num_steps: int
    deadline: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    top: int
    session: ProfileSession | None = None  # set before the profile becomes the engine's

    def is_over(self) -> bool:
        return (
            self.session is None
            or self.session.num_steps >= self.num_steps
            or time.monotonic() >= self.deadline
        )


_STOP = object()


class AsyncEngine:
    """Thread-owning front of an EngineCore. Create it inside a running event loop, or call
    `start()` there."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[
            :8
        ]  # tells this engine's ids from another's in shared logs
        self._profile: _Profile | None = None  # owned by the core thread

    # ----- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rebar-engine-core", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ----- public API ----------------------------------------------------------------------------
    def admit(self, prompt: Prompt, params: SamplingParams) -> AdmittedRequest:
        """The request's one check, in the caller's thread (`EngineCore.admit`); text is tokenized
        first.

        Raises InvalidRequestError naming the parameter.
        """
        return self.core.admit(prompt_token_ids(self.core.tokenizer, prompt), params)

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """`admit`, then `generate_admitted`: raises InvalidRequestError here, before any output."""
        return self.generate_admitted(self.admit(prompt, params), request_id, timeout, cache_salt)

    async def generate_admitted(
        self,
        request: AdmittedRequest,
        request_id: str | None = None,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of an admitted request until each of its `params.n` choices has
        finished.

        `timeout` (seconds) finishes it with reason "timeout" if it runs longer. `cache_salt`: only
        requests with the same salt share prefix-cache blocks (see `EngineCore.add_admitted`).

        Each call gets its own engine id, which its outputs carry in `request_id` and `abort` takes;
        outputs only ever reach the call that created the request. `request_id` is a label: it
        starts the engine id, so logs show it, but any number of calls may use the same one.
        """
        self.start()
        engine_id = self._engine_id(request_id)
        stream: asyncio.Queue = asyncio.Queue()
        with self._streams_lock:
            assert engine_id not in self._streams, f"engine id {engine_id} reused"
            self._streams[engine_id] = (asyncio.get_running_loop(), stream)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._inbox.put(_Add(engine_id, request, deadline, cache_salt))
        remaining = request.params.n
        try:
            while remaining:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= item.finished
                yield item
        finally:
            with self._streams_lock:
                self._streams.pop(engine_id, None)
            if remaining:
                self.abort(engine_id)

    def _engine_id(self, label: str | None) -> str:
        """A new id, never used before by this engine: the caller's label (shortened) + prefix +
        counter.

        Unique whatever the label holds: the counter is unique, and the text after the last "@" is
        always this engine's prefix and counter.
        """
        return f"{str(label)[:64] if label else 'req'}@{self._id_prefix}-{next(self._ids)}"

    def abort(self, request_id: str) -> None:
        """Finish the request as aborted at the start of the next step (no-op if it already ended).

        `request_id` is the engine id its outputs carry, not the label given to `generate`.
        """
        self._inbox.put(_Abort(request_id))

    async def profile(self, num_steps: int, timeout_s: float, top: int = 20) -> ProfileResult:
        """Profile the next `num_steps` engine steps (fewer if `timeout_s` passes first) in the core
        thread.

        Raises RebarError if a profile is already being taken.
        """
        self.start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(_Profile(num_steps, time.monotonic() + timeout_s, loop, future, top))
        return await future

    # ----- the core thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            idle = not self.core.has_unfinished_requests()
            # Idle with a profile open: wake up now and then to honour its deadline.
            commands = self._drain(block=idle, timeout=0.05 if self._profile is not None else None)
            if any(command is _STOP for command in commands):
                self._fail_everything(ENGINE_SHUTDOWN)
                self._end_profile()
                return
            for command in commands:
                self._apply(command)
            if self.core.has_unfinished_requests():
                try:
                    self._deliver(self.core.step())
                except Exception:  # a bug in the step itself: fail what is in flight, keep serving
                    logger.exception("engine step failed; failing every request in flight")
                    self._fail_everything(ENGINE_FAULT)
                if self._profile is not None and self._profile.session is not None:
                    self._profile.session.step_done()
            if self._profile is not None and self._profile.is_over():
                self._end_profile()

    def _drain(self, block: bool, timeout: float | None = None) -> list:
        commands = []
        try:
            commands.append(self._inbox.get(block=block, timeout=timeout if block else None))
            while True:
                commands.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _start_profile(self, command: _Profile) -> None:
        if self._profile is not None:
            _call_soon(
                command.loop,
                _settle(command.future),
                RebarError("a profile is already being taken"),
            )
            return
        try:
            command.session = ProfileSession(
                self.core.runner.model, self.core.runner.device, command.top
            ).start()
        except Exception as exc:
            _call_soon(
                command.loop,
                _settle(command.future),
                RebarError(f"profiling failed to start: {exc}"),
            )
            return
        self._profile = command

    def _end_profile(self) -> None:
        command, self._profile = self._profile, None
        if command is None:
            return
        assert command.session is not None, "only a started profile becomes the engine's"
        try:
            result: ProfileResult | BaseException = command.session.finish()
        except Exception as exc:
            result = RebarError(f"profiling failed: {exc}")
        _call_soon(command.loop, _settle(command.future), result)

    def _apply(self, command: _Add | _Abort | _Profile) -> None:
        if isinstance(command, _Profile):
            self._start_profile(command)
            return
        if isinstance(command, _Abort):
            self._deliver(self.core.abort_request(command.request_id))
            return
        try:
            self.core.add_admitted(
                command.request_id, command.admitted, command.deadline, command.cache_salt
            )
        except RebarError as exc:
            self._send(command.request_id, exc)
        except Exception:  # whatever slipped past admission fails its own request, not the engine
            logger.exception("request %s could not be queued", command.request_id)
            self._deliver(_failed(command.request_id, command.admitted.params.n))

    def _fail_everything(self, message: str) -> None:
        self._deliver(self.core.fail_all(message))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._send(output.request_id, output)

    def _send(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._streams_lock:
            target = self._streams.get(request_id)
        if target is None:
            return  # the caller left; its abort is already queued
        loop, stream = target
        _call_soon(loop, stream.put_nowait, item)


def _failed(request_id: str, num_choices: int) -> list[RequestOutput]:
    return [
        RequestOutput(
            request_id, index, (), "", finished=True, finish_reason="error", error=ENGINE_FAULT
        )
        for index in range(num_choices)
    ]


def _call_soon(loop: asyncio.AbstractEventLoop, function: Callable, item: object) -> None:
    try:
        loop.call_soon_threadsafe(function, item)
    except RuntimeError:  # the caller's event loop is closed
        pass


def _settle(future: asyncio.Future) -> Callable[[object], None]:
    """A callback for the future's loop: set a result or an exception, unless the waiter gave up."""

    def settle(item: object) -> None:
        if future.done():
            return
        if isinstance(item, BaseException):
            future.set_exception(item)
        else:
            future.set_result(item)

    return settle
