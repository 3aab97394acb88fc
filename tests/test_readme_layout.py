"""The README's layout section names every module under src/rebar (it is generated from the tree)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "readme_layout", ROOT / "scripts" / "readme_layout.py"
)
assert spec and spec.loader
readme_layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_layout)


def test_the_committed_layout_is_the_generated_one() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme_layout.with_layout(readme) == readme, (
        "README's layout is stale: run `python scripts/readme_layout.py`"
    )


def test_every_module_is_listed_under_its_own_package() -> None:
    source = ROOT / "src" / "rebar"
    for init in source.rglob("__init__.py"):
        package = init.parent
        if package == source or "static" in package.parts:
            continue
        listed = " ".join(readme_layout.package_lines(package))
        for module in package.glob("*.py"):
            if module.name != "__init__.py":
                assert f" {module.name}" in listed, (module, listed)
        assert listed in " ".join(readme_layout.layout().splitlines()), package
    top = " ".join(readme_layout.top_level_lines())
    for module in source.glob("*.py"):
        if module.name != "__init__.py":
            assert f"{module.name}:" in top, module


def test_a_package_without_a_docstring_is_refused(tmp_path: Path, monkeypatch) -> None:
    source = tmp_path / "rebar"
    shutil.copytree(ROOT / "src" / "rebar" / "store", source / "store")
    (source / "__init__.py").write_text('"""rebar."""\n')
    (source / "undescribed").mkdir()
    (source / "undescribed" / "__init__.py").write_text("")
    monkeypatch.setattr(readme_layout, "SOURCE", source)
    monkeypatch.setattr(readme_layout, "ROOT", tmp_path)
    with pytest.raises(readme_layout.LayoutError, match="undescribed"):
        readme_layout.layout()
