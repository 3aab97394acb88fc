"""Build data/corpus/{calib,heldout}.jsonl from the Python standard library's own source (dev tool).

Records are English prose (module, class and function docstrings of at least MIN_DOC_CHARS) and
code (whole function definitions of MIN_CODE_CHARS..MAX_CODE_CHARS), read with `ast` from the
stdlib's .py files; nothing is imported or executed. Whole modules go to one split (a stable hash
of the module name decides), so held-out text never shares a module with calibration text. Within
a split, records are ordered by a stable hash of their id and taken until the split's byte budget
for each kind is spent. The output depends only on the stdlib's files: the same Python version
gives the same bytes.

    python scripts/build_corpus.py [--out data/corpus]

The stdlib is distributed under the PSF License Agreement; its text is copied to OUT/LICENSE.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import shutil
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

MIN_DOC_CHARS = 200
MIN_CODE_CHARS = 400
MAX_CODE_CHARS = 2000
HELDOUT_ONE_IN = 5  # modules whose hash is 0 mod 5 are held out
# Bytes of text per split and kind.
BUDGETS = {
    "calib": {"prose": 200_000, "code": 80_000},
    "heldout": {"prose": 100_000, "code": 40_000},
}
# Folders with generated data, tests, demos or vendored code rather than library prose.
SKIPPED_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "turtledemo",
    "ensurepip",
    "pydoc_data",
    "encodings",
    "__pycache__",
    "config-3.11-x86_64-linux-gnu",
}


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def module_files(stdlib: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if any(part in SKIPPED_DIRS or part.startswith("test") for part in relative.parts[:-1]):
            continue
        if relative.name.startswith("test"):
            continue
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        yield module, path


def records_of(module: str, source: str) -> Iterator[dict[str, str]]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    doc = ast.get_docstring(tree)
    if doc and len(doc) >= MIN_DOC_CHARS:
        yield {"text": doc, "source": module, "kind": "prose"}
    for node, qualname in walk_definitions(tree, ""):
        doc = ast.get_docstring(node)
        if doc and len(doc) >= MIN_DOC_CHARS:
            yield {"text": doc, "source": f"{module}:{qualname}", "kind": "prose"}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            segment = ast.get_source_segment(source, node, padded=True)
            code = textwrap.dedent(segment) if segment else None
            if code and MIN_CODE_CHARS <= len(code) <= MAX_CODE_CHARS:
                yield {"text": code, "source": f"{module}:{qualname}", "kind": "code"}


def walk_definitions(node: ast.AST, prefix: str) -> Iterator[tuple[ast.AST, str]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qualname = f"{prefix}{child.name}"
            yield child, qualname
            yield from walk_definitions(child, qualname + ".")


def build(stdlib: Path) -> dict[str, list[dict[str, str]]]:
    candidates: dict[str, list[dict[str, str]]] = {"calib": [], "heldout": []}
    for module, path in module_files(stdlib):
        split = "heldout" if stable_hash(module) % HELDOUT_ONE_IN == 0 else "calib"
        source = path.read_text(encoding="utf-8", errors="replace")
        candidates[split].extend(records_of(module, source))
    chosen: dict[str, list[dict[str, str]]] = {}
    for split, records in candidates.items():
        records.sort(key=lambda r: (stable_hash(r["source"] + r["kind"]), r["source"], r["kind"]))
        spent = dict.fromkeys(BUDGETS[split], 0)
        chosen[split] = []
        for record in records:
            size = len(record["text"].encode())
            if spent[record["kind"]] + size <= BUDGETS[split][record["kind"]]:
                spent[record["kind"]] += size
                chosen[split].append(record)
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/corpus"))
    args = parser.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    args.out.mkdir(parents=True, exist_ok=True)
    for split, records in build(stdlib).items():
        with open(args.out / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as out:
            for record in records:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
        size = (args.out / f"{split}.jsonl").stat().st_size
        print(f"{split}: {len(records)} records, {size / 1000:.0f} kB")
    shutil.copyfile(stdlib / "LICENSE.txt", args.out / "LICENSE")
    print(f"from the standard library of Python {platform.python_version()} at {stdlib}")


if __name__ == "__main__":
    main()
