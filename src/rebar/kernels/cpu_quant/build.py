"""Builds and loads the C++ extension once per process, on first use.

The extension is compiled by `torch.utils.cpp_extension.load` (ninja + the system C++ compiler)
into torch's extension directory (`TORCH_EXTENSIONS_DIR` when set), so later processes only load
it. Nothing here raises: a CPU without AVX2/FMA, a missing compiler or ninja, a failed build, or
`REBAR_DISABLE_CPU_KERNELS=1` (read once, on first use) make `load_extension()` return no module,
and the reason is logged once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "REBAR_DISABLE_CPU_KERNELS"
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "activation_quant.cpp", "quant_linear.cpp", "quant_gemm.cpp", "decoder.cpp",
           "elementwise.cpp", "worker_pool.cpp")
HEADERS = ("kernels.h", "simd.h", "decoder.h", "elementwise.h", "worker_pool.h")
# OpenMP only so that at::parallel_for (inline in torch's headers) runs large matmuls on torch's own
# thread pool; the libgomp this links has torch's soname, so the process keeps one OpenMP runtime.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-pthread", "-fopenmp"]

_build_lock = threading.Lock()


@dataclass(frozen=True)
class BuildResult:
    module: ModuleType | None
    reason: str  # why module is None; "" when it loaded


def disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def missing_requirement() -> str:
    """Why the extension cannot be built here, or "" when it can be tried."""
    flags = cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        return "the CPU lacks AVX2/FMA/F16C (or /proc/cpuinfo is unreadable)"
    compiler = (os.environ.get("CXX") or "c++").split()[0]  # torch's choice; CXX may carry a wrapper's args
    if shutil.which(compiler) is None:
        return "no C++ compiler on PATH (install g++)"
    if shutil.which("ninja") is None:
        return "ninja is not on PATH (apt-get install ninja-build, or pip install ninja)"
    return ""


def extension_name() -> str:
    """A name that changes with the sources, so an edited kernel never loads a stale build."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    return f"rebar_cpu_quant_{digest.hexdigest()[:12]}"


@functools.cache
def _build_once() -> BuildResult:
    # Cached outside the lock so a loaded extension costs one dictionary lookup per call; callers
    # racing on the first call queue on the lock and share _build_locked's single result.
    with _build_lock:
        return _build_locked()


@functools.cache
def _build_locked() -> BuildResult:
    if disabled_by_env():
        logger.info("rebar CPU quantized kernels disabled by %s", DISABLE_ENV)
        return BuildResult(None, f"disabled by {DISABLE_ENV}=1")
    reason = missing_requirement()
    if reason:
        logger.warning("rebar CPU quantized kernels unavailable: %s", reason)
        return BuildResult(None, reason)
    from torch.utils import cpp_extension

    logger.info("loading rebar CPU quantized kernels (the first build on a machine takes half a minute or more)")
    try:
        module = cpp_extension.load(
            name=extension_name(),
            sources=[str(CSRC / name) for name in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-pthread", "-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a compiler error is a reason to fall back, never a crash
        reason = f"building the extension failed: {type(exc).__name__}: {str(exc)[-2000:]}"
        logger.warning("rebar CPU quantized kernels unavailable: %s", reason)
        return BuildResult(None, reason)
    logger.info("rebar CPU quantized kernels loaded (%s, torch %s)", module.__name__, torch.__version__)
    return BuildResult(module, "")


def loaded_extension() -> ModuleType | None:
    """The extension if this process has already loaded it, else None; never builds or loads it."""
    if _build_once.cache_info().currsize == 0:
        return None
    return _build_once().module


def load_extension() -> BuildResult:
    """The extension, built or loaded on the first call in this process (thread-safe); later calls
    return the same result."""
    return _build_once()
