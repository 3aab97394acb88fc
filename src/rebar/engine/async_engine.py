"""The engine core bridged to asyncio: `EngineFront` is what the server talks to; `AsyncEngine` runs
the core in a thread of this process (`rebar.engine.engine_process.EngineProcess` runs it in a
process of its own).

The event loop never runs a matmul: `generate` sends a command to the core's loop
(`rebar.engine.core_loop`) and awaits a per-request queue. The core's loop hands each step's
results over in one `Delivery`, which reaches each event loop with one `call_soon_threadsafe` per
step, whatever the number of streams. Leaving the async iterator early (client gone, task
cancelled) aborts the request, which frees its KV blocks within one step.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator

from rebar.engine.core import EngineCore, EngineStats
from rebar.engine.core_loop import Abort, Add, Command, CoreLoop, Delivery, StartProfile, Stop
from rebar.engine.outputs import ENGINE_FAULT, RequestOutput
from rebar.engine.prompt import Prompt, prompt_token_ids
from rebar.engine.request import AdmittedRequest
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import RebarError
from rebar.model.tokenizer import Tokenizer
from rebar.obs.profiling import ProfileResult

Loop = asyncio.AbstractEventLoop
Routed = tuple[asyncio.Queue | asyncio.Future, object]  # an item and where it goes


class EngineUnavailableError(RebarError):
    """The engine cannot take requests: it stopped, or its process exited."""


class EngineFront:
    """The asyncio side of an engine: per-request streams, aborts, profiles, the latest counters.

    Subclasses say how commands reach the core's loop (`_submit`) and how it starts and stops.
    """

    tokenizer: Tokenizer
    max_model_len: int
    shares_memory_with_core = False  # whether commands reach the core as the objects sent

    def __init__(self) -> None:
        self._streams: dict[str, tuple[Loop, asyncio.Queue]] = {}
        self._profiles: dict[int, tuple[Loop, asyncio.Future]] = {}
        self._lock = threading.Lock()  # the maps above: the delivering thread reads them
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]  # tells this engine's ids from another's in logs
        self._stats: EngineStats | None = None
        self.failure: str | None = None  # why the engine stopped serving, once it has

    # ----- what subclasses provide ---------------------------------------------------------------
    def admit(self, prompt: Prompt, params: SamplingParams) -> AdmittedRequest:
        """The request's one check, in the caller's thread; text is tokenized first.

        Raises InvalidRequestError naming the parameter.
        """
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    def _submit(self, command: Command) -> None:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        """The engine's counters, as of its latest step."""
        raise NotImplementedError

    # ----- public API ----------------------------------------------------------------------------
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
        with self._lock:
            assert engine_id not in self._streams, f"engine id {engine_id} reused"
            self._streams[engine_id] = (asyncio.get_running_loop(), stream)
        deadline = None if timeout is None else time.monotonic() + timeout
        unfinished = set(range(request.params.n))
        try:
            self._submit(self._add_command(engine_id, request, deadline, cache_salt))
            while unfinished:
                item = await stream.get()
                if isinstance(item, EngineUnavailableError):  # the engine went away mid-request
                    for index in sorted(unfinished):
                        yield _failed(engine_id, index)
                    return
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(item.index)
                yield item
        finally:
            with self._lock:
                self._streams.pop(engine_id, None)
            if unfinished:
                self.abort(engine_id)

    def _add_command(
        self,
        engine_id: str,
        request: AdmittedRequest,
        deadline: float | None,
        cache_salt: str | None,
    ) -> Add:
        # In-process, the admission itself goes along: the core that made it queues it without
        # checking again. Across processes only its values do, and the core checks them again.
        admitted = request if self.shares_memory_with_core else None
        return Add(
            engine_id, request.prompt_token_ids, request.params, deadline, cache_salt, admitted
        )

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
        try:
            self._submit(Abort(request_id))
        except EngineUnavailableError:
            pass  # nothing runs there any more

    async def profile(self, num_steps: int, timeout_s: float, top: int = 20) -> ProfileResult:
        """Profile the next `num_steps` engine steps (fewer if `timeout_s` passes first) where the
        core runs.

        Raises RebarError if a profile is already being taken.
        """
        self.start()
        profile_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._profiles[profile_id] = (asyncio.get_running_loop(), future)
        try:
            self._submit(StartProfile(profile_id, num_steps, time.monotonic() + timeout_s, top))
            return await future
        finally:
            with self._lock:
                self._profiles.pop(profile_id, None)

    # ----- results from the core's loop (any thread) ----------------------------------------------
    def _deliver(self, delivery: Delivery) -> None:
        """Route a step's results to the streams and profiles waiting for them: one callback per
        event loop."""
        if delivery.stats is not None:
            self._stats = delivery.stats
        per_loop: dict[Loop, list[Routed]] = defaultdict(list)
        with self._lock:
            items: list[tuple[str, object]] = [(o.request_id, o) for o in delivery.outputs]
            items += delivery.refused
            for request_id, item in items:
                target = self._streams.get(request_id)
                if target is not None:  # else the caller left; its abort is already queued
                    per_loop[target[0]].append((target[1], item))
            for profile_id, result in delivery.profiles:
                waiting = self._profiles.get(profile_id)
                if waiting is not None:
                    per_loop[waiting[0]].append((waiting[1], result))
        _call_each(per_loop)

    def _fail_all_streams(self, error: BaseException) -> None:
        """Every open stream and profile ends with `error` (the engine is gone)."""
        per_loop: dict[Loop, list[Routed]] = defaultdict(list)
        with self._lock:
            targets: list[tuple[Loop, asyncio.Queue | asyncio.Future]] = [
                *self._streams.values(),
                *self._profiles.values(),
            ]
        for loop, target in targets:
            per_loop[loop].append((target, error))
        _call_each(per_loop)


def _failed(engine_id: str, index: int) -> RequestOutput:
    return RequestOutput(
        engine_id, index, (), "", finished=True, finish_reason="error", error=ENGINE_FAULT
    )


def _call_each(per_loop: dict[Loop, list[Routed]]) -> None:
    for loop, routed in per_loop.items():
        try:
            loop.call_soon_threadsafe(_hand_out, routed)
        except RuntimeError:  # the caller's event loop is closed
            pass


def _hand_out(routed: list[Routed]) -> None:
    """On the owning event loop: each item to its stream, each profile result to its future."""
    for target, item in routed:
        if isinstance(target, asyncio.Queue):
            target.put_nowait(item)
        elif not target.done():
            if isinstance(item, BaseException):
                target.set_exception(item)
            else:
                target.set_result(item)


class _QueueInbox:
    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()

    def take(self, block: bool, timeout: float | None) -> list[Command]:
        commands = []
        try:
            commands.append(self.queue.get(block=block, timeout=timeout if block else None))
            while True:
                commands.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        return commands


class AsyncEngine(EngineFront):
    """An EngineCore run by a thread of this process. Create it inside a running event loop, or
    call `start()` there."""

    shares_memory_with_core = True

    def __init__(self, core: EngineCore, name: str = "rebar-engine-core") -> None:
        """`name` names its thread (one per served model), for stacks and profiles."""
        super().__init__()
        self.core = core
        self.thread_name = name
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self._inbox = _QueueInbox()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            loop = CoreLoop(self.core, self._inbox, self._deliver, with_stats=False)
            self._thread = threading.Thread(target=loop.run, name=self.thread_name, daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._inbox.queue.put(Stop())
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def admit(self, prompt: Prompt, params: SamplingParams) -> AdmittedRequest:
        return self.core.admit(prompt_token_ids(self.core.tokenizer, prompt), params)

    def stats(self) -> EngineStats:
        return self.core.stats()  # read in place: the thread shares this process's memory

    def _submit(self, command: Command) -> None:
        self._inbox.queue.put(command)
