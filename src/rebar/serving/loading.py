"""Loading one version of a served model: its weights within its budget, its contract, its engine
or embedder, and a warm-up run. Blocking work runs in the caller's thread (the registry runs it in
a thread of its own)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rebar.config import ServedModelSettings, Settings
from rebar.engine.async_engine import AsyncEngine
from rebar.engine.builder import LoadedModel, load_model, resolve_device
from rebar.engine.contract import enforce_beside
from rebar.engine.engine_config import EngineConfig, available_memory, kv_cache_budget
from rebar.engine.engine_process import EngineProcess, EngineSpec
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import ConfigError, RebarError
from rebar.model.resolve import resolve_model_path
from rebar.serving.embedding_queue import EmbeddingQueue
from rebar.serving.instances import ChatModel, EmbeddingModel, ModelVersion


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's own values of the [engine] settings."""
    return EngineConfig(**settings.engine.engine_fields())


def load_instance(
    settings: Settings, entry: ServedModelSettings, path: str, version: int
) -> ModelVersion:
    """Load `path` as version `version` of `entry`; raises ConfigError (or another RebarError)
    naming what is wrong: a model of the wrong kind, one over its budget, one that breaks its
    contract."""
    if entry.kind == "chat" and settings.engine.separate_process:
        process = EngineProcess.spawn(engine_spec(settings, path, entry.memory_budget))
        return ChatModel(
            entry,
            version,
            path,
            process.text,
            process.footprint_bytes,
            process.load_seconds,
            engine=process,
        )
    m = settings.models
    loaded = load_model(
        path, m.dtype, m.device, engine_config(settings), m.dequantize, entry.memory_budget
    )
    where = f"models.serve {entry.name!r}"
    if entry.kind == "chat" and loaded.engine is None:
        raise ConfigError(f"{where}: {path} is an embedding model; it cannot generate")
    if entry.kind == "embedding" and loaded.engine is not None:
        raise ConfigError(f"{where}: {path} generates text; kind = 'embedding' needs an encoder")
    enforce_beside(loaded)  # before anything serves: a model that breaks its contract never does
    return serve_loaded(settings, entry, version, path, loaded)


def serve_loaded(
    settings: Settings,
    entry: ServedModelSettings,
    version: int,
    path: str,
    loaded: LoadedModel,
    engine: AsyncEngine | None = None,
) -> ModelVersion:
    """A version serving a model loaded in this process: through `engine` (chat; a new engine
    thread when None) or an embedding queue of its own."""
    common = (entry, version, path, loaded.text, loaded.footprint_bytes, loaded.load_seconds)
    if loaded.engine is not None:
        front = engine or AsyncEngine(loaded.engine, name=f"rebar-engine-{entry.name}")
        return ChatModel(*common, engine=front)
    embedder = loaded.embedder
    assert embedder is not None, "a loaded model has an engine or an embedder"
    queue = EmbeddingQueue(
        lambda texts: [v.numpy() for v in embedder.embed(texts)],
        settings.limits.max_waiting_embedding_inputs,
        settings.limits.retry_after_s,
    )
    return EmbeddingModel(*common, embedder=embedder, queue=queue)


def engine_spec(settings: Settings, path: str, memory_budget: int | None = None) -> EngineSpec:
    """How the engine process loads a chat model: as this process would, and logs as it does."""
    m = settings.models
    return EngineSpec(
        path,
        dtype=m.dtype,
        device=m.device,
        engine_config=engine_config(settings),
        dequantize=m.dequantize,
        num_threads=settings.engine.num_threads,
        log_level=settings.logging.level,
        log_format=settings.logging.format,
        memory_budget=memory_budget,
    )


async def warm_up(version: ModelVersion) -> None:
    """One short generation (or embedding), so the first request does not pay for lazy set-up."""
    if isinstance(version, ChatModel):
        version.front.start()
        async for _ in version.front.generate(
            "Hello", SamplingParams(max_tokens=2, temperature=0), "warm-up"
        ):
            pass
    elif isinstance(version, EmbeddingModel):
        assert version.embedder is not None
        await asyncio.to_thread(version.embedder.embed, ["warm-up"])


def estimate_bytes(settings: Settings, entry: ServedModelSettings, path: str) -> int:
    """What loading `path` for `entry` will hold, before loading it: its budget when it has one,
    else its files' size plus the KV cache [engine] would give it (an estimate: quantized weights
    repacked for the CPU kernels take more than the file)."""
    if entry.memory_budget is not None:
        return entry.memory_budget
    try:
        files = Path(resolve_model_path(path))
        size = (
            files.stat().st_size
            if files.is_file()
            else sum(f.stat().st_size for f in files.iterdir() if f.is_file())
        )
    except (OSError, RebarError):
        size = 0  # the load itself will say what is wrong
    if entry.kind == "embedding":
        return size
    device = resolve_device(settings.models.device)
    return size + kv_cache_budget(engine_config(settings), device)


def total_budget(settings: Settings) -> int:
    """`models.memory_budget`, or 90% of the memory available now on the models' device."""
    if settings.models.memory_budget is not None:
        return settings.models.memory_budget
    return int(0.9 * available_memory(resolve_device(settings.models.device)))
