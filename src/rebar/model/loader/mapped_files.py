"""Safetensors files opened once each, so that all tensors read from a file share one memory
mapping."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


class MappedSafetensors:
    """One open handle per file, kept for the owner's lifetime: every tensor read from a file is a
    view of the same mapping. (A handle opened per read maps the whole file again, and each tensor
    read through it keeps that map alive: hundreds of mappings of one file, each counted in the
    process's resident memory.)"""

    def __init__(self) -> None:
        self._handles: dict[Path, Any] = {}
        self._lock = threading.Lock()

    def get_tensor(self, path: Path, name: str) -> torch.Tensor:
        with self._lock:
            handle = self._handles.get(path)
            if handle is None:
                handle = self._handles[path] = safe_open(path, framework="pt")
        return handle.get_tensor(name)
