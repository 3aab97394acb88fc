"""One entry of the model registry: its settings, the version it serves, and its state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from rebar.config import ServedModelSettings
from rebar.serving.instances import ModelVersion


def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"


@dataclass(eq=False)
class ModelSlot:
    """One entry of the registry and whichever of its versions is loaded."""

    entry: ServedModelSettings
    path: str
    version: int = 1
    current: ModelVersion | None = None
    draining: bool = False  # a reload is freeing the old version before loading the new one
    reloading: bool = False  # a reload is loading the new version beside the old one
    error: str | None = None  # why its last load failed (cleared by the next success)
    loading: asyncio.Task | None = None  # the load (or drain-first reload) in flight
    last_used: float = 0.0
    reserved_bytes: int = 0  # the estimate held for a load in flight
    retired: list[ModelVersion] = field(default_factory=list)  # old versions still finishing
    last_reload: dict | None = None  # the figures of the last reload that switched versions here
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load/unload/reload at a time

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def servable(self) -> ModelVersion | None:
        return None if self.draining else self.current

    @property
    def state(self) -> str:
        if self.draining or self.reloading:
            return "reloading"
        if self.current is not None:
            return "loaded"
        if self.loading is not None:
            return "loading"
        return "failed" if self.error else "unloaded"

    def describe(self) -> dict:
        """The slot as `/v1/models` and `/admin/models` show it."""
        current = self.current
        return {
            "id": self.name,
            "kind": self.entry.kind,
            "state": self.state,
            "version": self.version,
            "path": self.path,
            "pinned": self.entry.pinned,
            "memory_bytes": current.footprint_bytes if current is not None else 0,
            "memory_budget": self.entry.memory_budget,
            "in_flight": current.num_leases if current is not None else 0,
            "retiring_versions": [old.version for old in self.retired],
            "error": self.error,
            "last_reload": self.last_reload,
        }
