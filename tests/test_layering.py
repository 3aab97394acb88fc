"""Imports run one way, as docs/architecture.md states: its import table is read here and every
import in src/rebar is checked against it.

Every module under src/rebar is parsed (AST), and every `import` in it counts, the ones inside
functions and under `TYPE_CHECKING` included. Each module belongs to a unit: a top-level package or
module of rebar (`model`, `engine`, `errors`, ...). `ALLOWED`, read from the document, is the whole
graph: which units each unit may import besides itself. The foundation modules import nothing of rebar and everyone
may import them. The root package `rebar` itself (`__version__`, the lazy public API) may be
imported from anywhere: Python initialises it before any of its submodules in any case.

Within the engine, the scheduler's side (requests, the block pool, the KV-cache manager, the
scheduler) is pure Python: it imports no torch and nothing of the engine's tensor side.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = "rebar"

ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
TOP = frozenset({"rebar", "cli"})  # the public facade and the command line: may import any unit


def architecture_graph(text: str) -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """(the foundation modules, unit -> units it may import) as docs/architecture.md states them:
    the table between its `imports` markers and its "Foundation modules:" line."""
    table = text.split("<!-- imports: begin -->")[1].split("<!-- imports: end -->")[0]
    allowed = {}
    for line in table.strip().splitlines()[2:]:  # past the header and its rule
        unit, _job, imports = (cell.strip() for cell in line.strip().strip("|").split("|"))
        names = frozenset(n.strip() for n in imports.split(",")) - {"-"}
        allowed[unit.strip("`")] = names
    foundation_line = next(x for x in text.splitlines() if x.startswith("Foundation modules:"))
    paragraph = text[text.index(foundation_line) :].split("\n\n")[0]
    foundation = frozenset(re.findall(r"`(\w+)`", paragraph))
    return foundation, allowed


FOUNDATION, ALLOWED = architecture_graph(ARCHITECTURE.read_text(encoding="utf-8"))
# The engine's pure-Python side: may import only one another and the foundation, and never torch.
PURE_PYTHON = frozenset(
    {
        "rebar.engine.block_pool",
        "rebar.engine.kv_cache_manager",
        "rebar.engine.request",
        "rebar.engine.sampling_params",
        "rebar.engine.scheduler",
        "rebar.engine.structured",
    }
)
TENSOR_LIBRARIES = frozenset({"torch", "numpy"})
# Tooling packages beside the service (benchmarks, the llama.cpp driver, the CI gate): they may
# import rebar; rebar never imports them (the `rebar bench` command finds them by entry point).
TOOLING = frozenset({"rebar_bench"})
# The engine's plain config: the pure side may read it (it imports torch only inside the functions
# that size the KV cache, never at import).
SETTING_DEFINITIONS = frozenset({"rebar.engine.engine_config"})


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name, e.g. "rebar.kernels.attention"
    imported: str  # dotted module name, e.g. "rebar.model.llama" or "torch.nn"
    line: int


def module_names(src: Path) -> dict[str, Path]:
    """Dotted name -> file for every module under `src`/rebar (a package as its `__init__.py`)."""
    names = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: set[str]) -> list[Import]:
    """Every import in the module: `from a import b` names `a.b` when that is a module itself."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(name, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, name, path.name == "__init__.py")
            targets = {
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                for alias in node.names
            }
            found += [Import(name, target, node.lineno) for target in sorted(targets)]
    return found


def all_imports(src: Path) -> list[Import]:
    modules = module_names(src)
    return [edge for name, path in modules.items() for edge in imports_of(name, path, set(modules))]


def unit_of(module: str) -> str:
    """`rebar.model.llama` -> "model"; the root package -> "rebar"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def may_import(importer: str, imported: str) -> bool:
    if importer in PURE_PYTHON:
        return _pure_may_import(imported)
    if imported.split(".")[0] in TOOLING:
        return False
    if imported.split(".")[0] != ROOT:
        return True  # the standard library and third-party packages
    source, target = unit_of(importer), unit_of(imported)
    if imported == ROOT or source == target or source in TOP:
        return True
    if source in FOUNDATION:
        return False
    return target in FOUNDATION or target in ALLOWED.get(source, frozenset())


def _pure_may_import(imported: str) -> bool:
    top = imported.split(".")[0]
    if top in TENSOR_LIBRARIES:
        return False
    if top != ROOT:
        return True
    return (
        imported == ROOT
        or imported in PURE_PYTHON | SETTING_DEFINITIONS
        or unit_of(imported) in FOUNDATION
    )


def violations(edges: list[Import]) -> list[str]:
    return [
        f"{edge.importer} (line {edge.line}) imports {edge.imported}"
        for edge in sorted(edges, key=lambda e: (e.importer, e.line))
        if not may_import(edge.importer, edge.imported)
    ]


def test_every_import_in_rebar_runs_the_allowed_way() -> None:
    found = violations(all_imports(SRC))
    assert not found, "imports against the allowed direction:\n" + "\n".join(found)


def test_the_graph_names_every_unit_of_rebar() -> None:
    """A new top-level package must be placed in the graph, not pass unchecked."""
    units = {unit_of(name) for name in module_names(SRC)}
    assert units <= FOUNDATION | TOP | set(ALLOWED), units - (FOUNDATION | TOP | set(ALLOWED))
    assert units >= FOUNDATION and set(ALLOWED) <= units  # and the graph names no stale unit


DIALECTS = "rebar.server.dialects"
DIALECT_HELPERS = frozenset({f"{DIALECTS}.openai_schemas", f"{DIALECTS}.openai_fields"})
PIPELINE = "rebar.server.pipeline"


def dialect_of(module: str) -> str | None:
    """The dialect a module belongs to (a dialect may be a package of modules); None outside the
    dialects and for their shared helpers."""
    if not module.startswith(DIALECTS + ".") or module in DIALECT_HELPERS:
        return None
    return module.split(".")[3]


def dialect_violations(edges: list[Import]) -> list[str]:
    """Dialects import no other dialect; the pipeline imports no dialect and no route."""
    found = []
    for edge in edges:
        importer, imported = edge.importer, edge.imported
        mine, theirs = dialect_of(importer), dialect_of(imported)
        if importer.startswith(DIALECTS + ".") and theirs is not None and theirs != mine:
            found.append(f"{importer} (line {edge.line}) imports the dialect {imported}")
        if importer.startswith(PIPELINE) and imported.startswith((DIALECTS, "rebar.server.routes")):
            found.append(f"{importer} (line {edge.line}) imports {imported}")
    return sorted(found)


def test_dialects_never_import_one_another_and_the_pipeline_no_dialect() -> None:
    found = dialect_violations(all_imports(SRC))
    assert not found, "\n".join(found)


def test_a_dialect_importing_another_is_named(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "rebar/__init__.py": "",
            "rebar/server/__init__.py": "",
            "rebar/server/dialects/__init__.py": "",
            "rebar/server/dialects/openai_fields.py": "",
            "rebar/server/dialects/a.py": "from rebar.server.dialects import openai_fields\n",
            "rebar/server/dialects/b.py": "from rebar.server.dialects import a\n",
            "rebar/server/dialects/c/__init__.py": "from rebar.server.dialects.c import parts\n",
            "rebar/server/dialects/c/parts.py": "from rebar.server.dialects import openai_fields\n",
            "rebar/server/pipeline/__init__.py": "",
            "rebar/server/pipeline/respond.py": "import rebar.server.dialects.b\n",
        },
    )
    assert dialect_violations(all_imports(tmp_path)) == [
        "rebar.server.dialects.b (line 1) imports the dialect rebar.server.dialects.a",
        "rebar.server.pipeline.respond (line 1) imports rebar.server.dialects.b",
    ]


MAX_MODULE_LINES = 400  # in the server and serving packages
MAX_FUNCTION_LINES = 60  # anywhere but the kernels


def oversized(src: Path) -> list[str]:
    """Modules of the server and serving packages over MAX_MODULE_LINES, and functions outside
    the kernels over MAX_FUNCTION_LINES (their `def` line to their last)."""
    found = []
    for path in sorted(src.rglob("*.py")):
        relative = path.relative_to(src)
        lines = path.read_text(encoding="utf-8").count("\n")
        in_shell = relative.parts[:2] in (("rebar", "server"), ("rebar", "serving"))
        if in_shell and lines > MAX_MODULE_LINES:
            found.append(f"{relative}: {lines} lines")
        if "kernels" in relative.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{relative}:{node.lineno} {node.name}: {length} lines")
    return found


def test_modules_and_functions_stay_small() -> None:
    found = oversized(SRC)
    assert not found, "split these along their seams:\n" + "\n".join(found)


def test_an_oversized_function_is_named(tmp_path: Path) -> None:
    body = "".join(f"    x = {i}\n" for i in range(MAX_FUNCTION_LINES))
    write_tree(tmp_path, {"rebar/engine/long.py": "def long():\n" + body})
    assert oversized(tmp_path) == [f"rebar/engine/long.py:1 long: {MAX_FUNCTION_LINES + 1} lines"]


def write_tree(src: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = src / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_a_forbidden_import_is_named_with_its_module_and_line(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "rebar/__init__.py": "",
            "rebar/errors.py": "",
            "rebar/kernels/__init__.py": "",
            "rebar/kernels/fast.py": (
                "import torch\n"
                "from rebar.errors import X\n"
                "\n"
                "def step():\n"
                "    from rebar.model.llama import LlamaModel\n"  # line 5: lazy, still counted
                "    return LlamaModel\n"
            ),
            "rebar/model/__init__.py": "",
            "rebar/model/llama.py": "from rebar.kernels import fast\nimport rebar\n",
            "rebar/obs/__init__.py": "",
            "rebar/obs/metrics.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from ..engine import outputs\n"  # line 3: relative, resolved to the module
            ),
            "rebar/engine/__init__.py": "",
            "rebar/engine/outputs.py": "from rebar import errors\n",
            "rebar/engine/scheduler.py": "import torch\nfrom rebar.engine import outputs\n",
            "rebar/cli.py": "def bench():\n    import rebar_bench.gate\n",
        },
    )
    assert violations(all_imports(tmp_path)) == [
        "rebar.cli (line 2) imports rebar_bench.gate",
        "rebar.engine.scheduler (line 1) imports torch",
        "rebar.engine.scheduler (line 2) imports rebar.engine.outputs",
        "rebar.kernels.fast (line 5) imports rebar.model.llama",
        "rebar.obs.metrics (line 3) imports rebar.engine.outputs",
    ]


def test_foundation_modules_import_nothing_of_rebar(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "rebar/__init__.py": "",
            "rebar/errors.py": "",
            "rebar/timing.py": "from rebar.errors import RebarError\n",
        },
    )
    assert violations(all_imports(tmp_path)) == ["rebar.timing (line 1) imports rebar.errors"]
