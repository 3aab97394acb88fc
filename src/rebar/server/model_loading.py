"""Loading one version of a served model: its weights within its budget, its contract, its engine
or embedder, and a warm-up run. Blocking work runs in the caller's thread (the registry runs it in
a thread of its own)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

from rebar.config import ServedModelSettings, Settings
from rebar.engine.async_engine import AsyncEngine, EngineFront
from rebar.engine.contract import enforce_beside
from rebar.engine.engine_config import available_memory, kv_cache_budget
from rebar.engine.engine_process import EngineProcess, EngineSpec
from rebar.engine.llm import LLM, resolve_device
from rebar.engine.model_text import ModelText
from rebar.engine.sampling_params import SamplingParams
from rebar.errors import ConfigError, RebarError
from rebar.model.resolve import resolve_model_path
from rebar.server.embedding_queue import EmbeddingQueue
from rebar.server.model_instance import ModelInstance


def load_instance(
    settings: Settings, entry: ServedModelSettings, path: str, version: int
) -> ModelInstance:
    """Load `path` as version `version` of `entry`; raises ConfigError (or another RebarError)
    naming what is wrong: a model of the wrong kind, one over its budget, one that breaks its
    contract."""
    m = settings.models
    where = f"models.serve {entry.name!r}"
    if entry.kind == "chat" and settings.engine.separate_process:
        process = EngineProcess.spawn(engine_spec(settings, path, entry.memory_budget))
        instance = instance_of(settings, entry, version, path, process.text, process)
        instance.footprint_bytes = process.footprint_bytes
        return instance
    llm = LLM(
        path,
        dtype=m.dtype,
        device=m.device,
        engine_config=settings.engine.to_engine_config() if entry.kind == "chat" else None,
        dequantize=m.dequantize,
        memory_budget=entry.memory_budget,
    )
    if entry.kind == "chat" and llm.engine is None:
        raise ConfigError(f"{where}: {path} is an embedding model; it cannot generate")
    if entry.kind == "embedding" and llm.engine is not None:
        raise ConfigError(f"{where}: {path} generates text; kind = 'embedding' needs an encoder")
    enforce_beside(llm)  # before anything serves: a model that breaks its contract never does
    engine: EngineFront | None = None
    if llm.engine is not None:
        engine = AsyncEngine(llm.engine, name=f"rebar-engine-{entry.name}")
    return instance_of(settings, entry, version, path, llm, engine)


def instance_of(
    settings: Settings,
    entry: ServedModelSettings,
    version: int,
    path: str,
    model: ModelText,
    engine: EngineFront | None = None,
) -> ModelInstance:
    """An instance serving a loaded `model`: through `engine` (chat), or an embedding queue of its
    own (embedding: `model` is the LLM)."""
    footprint = getattr(model, "footprint_bytes", 0)
    instance = ModelInstance(entry, version, path, model, footprint, model.load_seconds)
    if entry.kind == "chat":
        instance.engine = engine
    else:
        embedder = cast(LLM, model)
        instance.embedder = embedder
        instance.embedding_queue = EmbeddingQueue(
            lambda texts: [v.numpy() for v in embedder.embed(texts)],
            settings.limits.max_waiting_embedding_inputs,
            settings.limits.retry_after_s,
        )
    return instance


def engine_spec(settings: Settings, path: str, memory_budget: int | None = None) -> EngineSpec:
    """How the engine process loads a chat model: as this process would, and logs as it does."""
    m = settings.models
    return EngineSpec(
        path,
        dtype=m.dtype,
        device=m.device,
        engine_config=settings.engine.to_engine_config(),
        dequantize=m.dequantize,
        num_threads=settings.engine.num_threads,
        log_level=settings.logging.level,
        log_format=settings.logging.format,
        memory_budget=memory_budget,
    )


async def warm_up(instance: ModelInstance) -> None:
    """One short generation (or embedding), so the first request does not pay for lazy set-up."""
    if instance.engine is not None:
        instance.engine.start()
        async for _ in instance.engine.generate(
            "Hello", SamplingParams(max_tokens=2, temperature=0), "warm-up"
        ):
            pass
    if instance.embedder is not None:
        await asyncio.to_thread(instance.embedder.embed, ["warm-up"])


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
    return size + kv_cache_budget(settings.engine.to_engine_config(), device)


def total_budget(settings: Settings) -> int:
    """`models.memory_budget`, or 90% of the memory available now on the models' device."""
    if settings.models.memory_budget is not None:
        return settings.models.memory_budget
    return int(0.9 * available_memory(resolve_device(settings.models.device)))
