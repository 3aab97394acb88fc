"""The committed chat page build (src/rebar/web/static) matches web/'s sources, and the page is
served."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from fastapi.testclient import TestClient
from web_tools import STATIC_DIR, WEB_DIR

from suite_tiers import limit

pytestmark = limit("browser")  # tests/suite_tiers.py

REBUILD = "run `make web` (or `npm --prefix web run build`) and commit src/rebar/web/static"


def files_under(root: Path, entry: str) -> list[Path]:
    path = root / entry
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def source_hash(sources: list[str]) -> str:
    """The hash web/build.mjs writes: sha256 over "<posix path>\\n<sha256 of its bytes>\\n" in path
    order."""
    paths = sorted(
        p.relative_to(WEB_DIR).as_posix() for entry in sources for p in files_under(WEB_DIR, entry)
    )
    digest = hashlib.sha256()
    for path in paths:
        digest.update(
            f"{path}\n{hashlib.sha256((WEB_DIR / path).read_bytes()).hexdigest()}\n".encode()
        )
    return digest.hexdigest()


def test_committed_build_was_made_from_the_current_sources() -> None:
    info = json.loads((STATIC_DIR / "build-info.json").read_text())
    assert source_hash(info["sources"]) == info["source_sha256"], (
        f"web/ changed since the last build: {REBUILD}"
    )


def test_rebuilding_reproduces_the_committed_files_byte_for_byte(npm: str, tmp_path: Path) -> None:
    subprocess.run(
        ["node", "build.mjs", "--out", str(tmp_path)],
        cwd=WEB_DIR,
        check=True,
        capture_output=True,
        timeout=120,
    )
    built = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    committed = {p.name: p.read_bytes() for p in STATIC_DIR.iterdir() if p.is_file()}
    assert sorted(built) == sorted(committed), REBUILD
    stale = [name for name in built if built[name] != committed[name]]
    assert not stale, f"{stale} differ from a fresh build: {REBUILD}"


def test_page_and_static_files_are_served_without_an_api_key() -> None:
    from rebar.config import load_settings
    from rebar.server.app import create_app

    client = TestClient(
        create_app(load_settings(None, {"server.api_keys": ["secret"]}))
    )  # no lifespan: nothing loads
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-cache"
    assert page.headers["x-request-id"]
    for asset, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        response = client.get(f"/static/{asset}?v=any")
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
        assert f"/static/{asset}?v=" in page.text
    assert client.get("/v1/models").status_code == 401  # the API itself stays closed


def test_node_unit_tests_pass(npm: str) -> None:
    """SSE parser, retry policy and streaming client (web/test), type-checked and run with `node
    --test`."""
    result = subprocess.run([npm, "test"], cwd=WEB_DIR, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "# fail 0" in result.stdout
