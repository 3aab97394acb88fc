"""The engine core in a process of its own, so Python work on either side never waits for the
other's GIL.

`EngineProcess` spawns a child that loads the model and runs the same `CoreLoop` as `AsyncEngine`'s
thread. Commands go down one pipe, and each step's `Delivery` (every output of the step and the
engine's counters) comes back up another as one pickled message, which a reader thread here hands
to the event loops. The front end keeps only the model's text side (`ModelText`: tokenizer, chat
template) and checks requests with the same `RequestChecker` as the core.

When the child exits unexpectedly every open stream ends with an error, `failure` says why and
nothing new is accepted: readiness reports it, and a supervisor restarts the server.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

from rebar.engine.admission import RequestChecker
from rebar.engine.async_engine import EngineFront, EngineUnavailableError
from rebar.engine.core_loop import Command, CoreLoop, Delivery, Stop
from rebar.engine.engine_config import EngineConfig
from rebar.engine.grammar import Grammars
from rebar.engine.model_text import ModelText
from rebar.engine.prompt import Prompt, prompt_token_ids
from rebar.engine.request import AdmittedRequest
from rebar.engine.sampling_params import SamplingParams
from rebar.engine.stats import EngineStats
from rebar.errors import ConfigError, ModelNotFoundError, RebarError

logger = logging.getLogger("rebar.engine")


@dataclass(frozen=True)
class EngineSpec:
    """Everything the child needs to load the model as this process would
    (`rebar.engine.builder.load_model`)."""

    model: str
    engine_config: EngineConfig
    dtype: str = "float32"
    device: str = "auto"
    dequantize: bool = False
    num_threads: int | None = None  # None: torch's default
    log_level: str = "info"
    log_format: str = "json"
    memory_budget: int | None = None  # bytes for weights + KV cache (see load_model)


@dataclass(frozen=True)
class _Ready:
    max_model_len: int
    load_seconds: float
    footprint_bytes: int  # the child's weights + KV cache
    stats: EngineStats
    vocab_size: int  # logits per row (a grammar's mask width)


@dataclass(frozen=True)
class _LoadFailed:
    message: str
    kind: str = "RebarError"  # the error's class, one of _LOAD_ERRORS

    def error(self) -> RebarError:
        return _LOAD_ERRORS.get(self.kind, RebarError)(self.message)


# What a load can fail with, raised again in the server as the same class: a bad setting, a
# missing model, or anything else (a bug: the child logged its traceback).
_LOAD_ERRORS: dict[str, type[RebarError]] = {
    cls.__name__: cls for cls in (ConfigError, ModelNotFoundError, RebarError)
}


class EngineProcess(EngineFront):
    """Start with `EngineProcess.spawn(spec)`: returns once the child has loaded the model."""

    def __init__(self, text: ModelText, ready: _Ready, process, commands, results) -> None:
        super().__init__()
        self.text = text
        self.tokenizer = text.tokenizer
        self.max_model_len = ready.max_model_len
        self.load_seconds = ready.load_seconds
        self.footprint_bytes = ready.footprint_bytes
        # Schemas are checked here too (before a response starts); the child compiles its own.
        self.checker = RequestChecker(
            self.tokenizer.vocab_size,
            self.max_model_len,
            Grammars(self.tokenizer, ready.vocab_size),
        )
        self._stats = ready.stats
        self._process = process
        self._commands: Connection = commands
        self._results: Connection = results
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader = threading.Thread(
            target=self._read_results, name="rebar-engine-results", daemon=True
        )
        self._reader.start()

    @classmethod
    def spawn(cls, spec: EngineSpec, timeout_s: float = 1800.0) -> EngineProcess:
        """Start the child and wait until it has loaded the model; if it cannot, raises what the
        load raised there (ConfigError, ModelNotFoundError, else RebarError) with its message."""
        context = multiprocessing.get_context("spawn")  # a fork would copy this process's threads
        commands_out, commands_in = context.Pipe(duplex=False)
        results_out, results_in = context.Pipe(duplex=False)
        process = context.Process(
            target=_child_main,
            args=(spec, commands_out, results_in),
            name="rebar-engine",
            daemon=True,  # never outlives the server
        )
        process.start()
        commands_out.close()  # only the child's copies stay open: its exit closes the pipes
        results_in.close()
        try:
            text = ModelText.open(spec.model, max_model_len=None)  # meanwhile, the text side
            if not results_out.poll(timeout_s):
                raise RebarError(f"the engine process did not load {spec.model} in {timeout_s} s")
            message = results_out.recv()
        except EOFError:  # it died without a word (killed, or a crash in native code)
            process.join(10)
            message = _LoadFailed(f"the engine process exited (exit code {process.exitcode})")
        except BaseException:
            process.kill()
            raise
        if isinstance(message, _LoadFailed):
            process.join(10)
            raise message.error()
        text = ModelText(text.checkpoint, message.max_model_len)
        text.load_seconds, text.dtype = message.load_seconds, spec.dtype
        return cls(text, message, process, commands_in, results_out)

    # ----- EngineFront ---------------------------------------------------------------------------
    def admit(self, prompt: Prompt, params: SamplingParams) -> AdmittedRequest:
        return self.checker.admit(prompt_token_ids(self.tokenizer, prompt), params)

    def start(self) -> None:
        pass  # running since `spawn`

    @property
    def is_running(self) -> bool:
        return self.failure is None and self._process.is_alive()

    def stats(self) -> EngineStats:
        assert self._stats is not None, "the child sends its counters before it is ready"
        return self._stats

    def _submit(self, command: Command) -> None:
        if self.failure is not None:
            raise EngineUnavailableError(self.failure)
        try:
            with self._send_lock:
                self._commands.send(command)
        except (OSError, ValueError) as exc:  # the child is gone (the reader reports why)
            raise EngineUnavailableError("the engine process is not running") from exc

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child (requests still running end with ENGINE_SHUTDOWN) and wait for it."""
        if self._stopping:
            return
        self._stopping = True
        try:
            with self._send_lock:
                self._commands.send(Stop())
        except (OSError, ValueError):
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join(5)
        self._reader.join(timeout)
        self._commands.close()

    # ----- the reader thread ---------------------------------------------------------------------
    def _read_results(self) -> None:
        while True:
            try:
                delivery: Delivery = self._results.recv()
            except (EOFError, OSError):
                break
            self._deliver(delivery)
        self._process.join(5)
        why = f"the engine process exited (exit code {self._process.exitcode})"
        self.failure = "the engine stopped" if self._stopping else why
        if not self._stopping:
            logger.error("%s; failing every request in flight", why)
        self._fail_all_streams(EngineUnavailableError(self.failure))
        self._results.close()


# ----- the child ---------------------------------------------------------------------------------


class _PipeInbox:
    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def take(self, block: bool, timeout: float | None) -> list[Command]:
        try:
            if block and not self.connection.poll(timeout):
                return []
            commands = []
            while self.connection.poll(0):
                commands.append(self.connection.recv())
            return commands
        except (EOFError, OSError):  # the server is gone: stop
            return [Stop()]


def _child_main(spec: EngineSpec, commands: Connection, results: Connection) -> None:
    import signal

    import torch

    from rebar.engine.builder import load_model
    from rebar.engine.contract import enforce_beside
    from rebar.obs.logs import configure_logging

    # Ctrl-C reaches the whole process group; the server stops this process itself, after its
    # drain, so the requests in flight finish.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(spec.log_level, spec.log_format)
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    try:
        loaded = load_model(
            spec.model,
            spec.dtype,
            spec.device,
            spec.engine_config,
            spec.dequantize,
            spec.memory_budget,
        )
        if loaded.engine is None:
            raise ConfigError(
                f"models.chat: {spec.model} is an embedding model; it cannot generate"
            )
        enforce_beside(loaded)
    except RebarError as exc:
        kind = next(k for k, cls in _LOAD_ERRORS.items() if isinstance(exc, cls))
        results.send(_LoadFailed(str(exc), kind))
        return
    except Exception as exc:
        logger.exception("the engine process could not load %s", spec.model)
        results.send(_LoadFailed(f"{type(exc).__name__}: {exc}"))
        return
    core = loaded.engine
    results.send(
        _Ready(
            core.max_model_len,
            loaded.load_seconds,
            loaded.footprint_bytes,
            core.stats(),
            core.grammars.vocab_size,
        )
    )
    try:
        CoreLoop(core, _PipeInbox(commands), results.send).run()
    except (BrokenPipeError, EOFError, OSError):
        pass  # the server went away mid-send
