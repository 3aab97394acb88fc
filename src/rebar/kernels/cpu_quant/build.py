"""Builds and loads the C++ extension once per process, on first use.

The extension is compiled by `torch.utils.cpp_extension.load` (ninja + the system C++ compiler)
into torch's extension directory (`TORCH_EXTENSIONS_DIR` when set), so later processes only load
it. Nothing here raises: a CPU without AVX2/FMA, a missing compiler or ninja, a failed build, or
`REBAR_DISABLE_CPU_KERNELS=1` (read once, on first use) make `load_extension()` return no module,
and the reason is logged once.

The build is for the CPU it runs on: the widest integer dot products the CPU reports (in
`/proc/cpuinfo`, else through CPUID) are chosen (AVX-512 VNNI, else AVX-VNNI, else AVX2's byte
multiply-adds), and the extension's name
carries the flags, so each instruction set has its own cached build. `REBAR_CPU_ISA=avx2` (or
`avx-vnni`, `avx512-vnni`) asks for a narrower one, e.g. to compare them; asking for one the CPU
lacks falls back to what it has, with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "REBAR_DISABLE_CPU_KERNELS"
ISA_ENV = "REBAR_CPU_ISA"
CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "bindings.cpp",
    "activation_quant.cpp",
    "quant_linear.cpp",
    "quant_gemm.cpp",
    "pair_rows.cpp",
    "best_outputs.cpp",
    "decoder.cpp",
    "elementwise.cpp",
    "worker_pool.cpp",
)
HEADERS = (
    "kernels.h",
    "simd.h",
    "block_dots.h",
    "pair_dots.h",
    "decoder.h",
    "best_outputs.h",
    "elementwise.h",
    "worker_pool.h",
)
# OpenMP only so that at::parallel_for (inline in torch's headers) runs large matmuls on torch's own
# thread pool; the libgomp this links has torch's soname, so the process keeps one OpenMP runtime.
BASE_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-pthread", "-fopenmp")
# Integer dot-product instruction sets, widest first: (name, /proc/cpuinfo flags needed, extra
# compiler flags). AVX-512 is used on 256-bit vectors (VL), which keeps the AVX2 kernels' layout and
# clock speed.
ISAS: tuple[tuple[str, set[str], tuple[str, ...]], ...] = (
    (
        "avx512-vnni",
        {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256"),
    ),
    ("avx-vnni", {"avx_vnni"}, ("-mavxvnni",)),
    ("avx2", set(), ()),
)

_build_lock = threading.Lock()


@dataclass(frozen=True)
class BuildResult:
    module: ModuleType | None
    reason: str  # why module is None; "" when it loaded


def disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them; where /proc/cpuinfo is unreadable or has
    no flags line (some VMs and sandboxes), the ones torch's own CPUID probe reports."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return cpuid_flags()


def cpuid_flags() -> set[str]:
    """The flags this module asks about, from torch's CPUID probe (the cpuinfo library): AVX2,
    AVX-512 and AVX-512 VNNI. AVX-VNNI (without AVX-512) is not probed, so such a CPU builds for
    AVX2 here."""
    probes = {
        # Every x86 CPU with AVX2 also has FMA and F16C.
        "_is_avx2_supported": {"avx2", "fma", "f16c"},
        "_is_avx512_supported": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
        "_is_vnni_supported": {"avx512_vnni"},
    }
    flags: set[str] = set()
    for probe, names in probes.items():
        supported = getattr(torch.cpu, probe, None)  # private torch API: absent on other builds
        if supported is not None and supported():
            flags |= names
    return flags


def missing_requirement() -> str:
    """Why the extension cannot be built here, or "" when it can be tried."""
    flags = cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        return "the CPU lacks AVX2/FMA/F16C (neither /proc/cpuinfo nor CPUID lists them)"
    compiler = (os.environ.get("CXX") or "c++").split()[
        0
    ]  # torch's choice; CXX may carry a wrapper's args
    if shutil.which(compiler) is None:
        return "no C++ compiler on PATH (install g++)"
    if shutil.which("ninja") is None:
        return "ninja is not on PATH (apt-get install ninja-build, or pip install ninja)"
    return ""


def chosen_isa(flags: set[str] | None = None) -> str:
    """The instruction set to build for: the widest the CPU has, or the narrower one REBAR_CPU_ISA
    asks for."""
    flags = cpu_flags() if flags is None else flags
    available = [name for name, needs, _ in ISAS if needs <= flags]
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if not wanted:
        return available[0]
    if wanted in available:
        return wanted
    known = [name for name, _, _ in ISAS]
    why = (
        "is not one of " + ", ".join(known)
        if wanted not in known
        else "is not supported by this CPU"
    )
    logger.warning("%s=%s %s; building for %s", ISA_ENV, wanted, why, available[0])
    return available[0]


def compiler_flags(isa: str) -> list[str]:
    return [*BASE_CFLAGS, *next(extra for name, _, extra in ISAS if name == isa)]


def extension_name(isa: str) -> str:
    """A name that changes with the sources and flags, so an edited kernel never loads a stale build
    and each instruction set keeps its own."""
    # The sources' folder counts too: torch's build folder names them by path, so two checkouts of
    # rebar sharing one extension cache would otherwise rebuild it each time the other loads it.
    digest = hashlib.sha256(str(CSRC).encode())
    for name in SOURCES + HEADERS:
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join(compiler_flags(isa)).encode())
    return f"rebar_cpu_quant_{isa.replace('-', '_')}_{digest.hexdigest()[:12]}"


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

    isa = chosen_isa()
    logger.info(
        "loading rebar CPU quantized kernels for %s (the "
        "first build on a machine takes a minute or more)",
        isa,
    )
    name = extension_name(isa)
    _clear_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock")
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(CSRC / name) for name in SOURCES],
            extra_cflags=compiler_flags(isa),
            extra_ldflags=["-pthread", "-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a compiler error is a reason to fall back, never a crash
        reason = f"building the extension failed: {type(exc).__name__}: {str(exc)[-2000:]}"
        logger.warning("rebar CPU quantized kernels unavailable: %s", reason)
        return BuildResult(None, reason)
    logger.info(
        "rebar CPU quantized kernels loaded (%s, %s, torch %s)",
        module.__name__,
        module.isa(),
        torch.__version__,
    )
    return BuildResult(module, "")


STALE_LOCK_S = 15 * 60  # no build takes this long; a lock this old was left by a killed build


def _clear_stale_lock(lock: Path) -> None:
    """Remove the build folder's lock when a killed build left it behind: torch waits on it
    forever, so every later start would hang."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a stale build lock %s (%.0f s old)", lock, age)
        lock.unlink(missing_ok=True)


def loaded_extension() -> ModuleType | None:
    """The extension if this process has already loaded it, else None; never builds or loads it."""
    if _build_once.cache_info().currsize == 0:
        return None
    return _build_once().module


def load_extension() -> BuildResult:
    """The extension, built or loaded on the first call in this process (thread-safe); later calls
    return the same result."""
    return _build_once()
