"""The CPU kernels' build folder: each checkout of rebar gets its own, and a lock left by a killed
build does not hang every later start."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rebar.kernels.cpu_quant import build


def test_a_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    build._clear_stale_lock(lock)
    assert lock.exists()  # a build may be running right now
    old = time.time() - build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    build._clear_stale_lock(lock)
    assert not lock.exists()
    build._clear_stale_lock(lock)  # no lock: nothing to do


def test_the_extension_name_changes_with_the_sources_folder(monkeypatch, tmp_path: Path) -> None:
    here = build.extension_name("avx2")
    copy = tmp_path / "csrc"
    copy.mkdir()
    for name in build.SOURCES + build.HEADERS:
        (copy / name).write_bytes((build.CSRC / name).read_bytes())
    monkeypatch.setattr(build, "CSRC", copy)
    assert build.extension_name("avx2") != here  # the same sources elsewhere build apart
