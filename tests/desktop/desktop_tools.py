"""A private X display for the desktop window's tests: Xvfb on a free display number (it picks
one itself: -displayfd), stopped afterwards."""

from __future__ import annotations

import os
import select
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

SCREEN = (1280, 900)
_START_TIMEOUT_S = 30.0


@contextmanager
def xvfb(xvfb_path: str) -> Iterator[str]:
    """A running Xvfb; yields its DISPLAY value (":N")."""
    read_end, write_end = os.pipe()
    width, height = SCREEN
    screen = ["-screen", "0", f"{width}x{height}x24"]
    process = subprocess.Popen(
        [xvfb_path, "-displayfd", str(write_end), *screen, "-nolisten", "tcp"],
        pass_fds=(write_end,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], _START_TIMEOUT_S)
        number = os.read(read_end, 64).decode().strip() if ready else ""
        assert number.isdigit(), f"Xvfb did not report a display within {_START_TIMEOUT_S}s"
        yield f":{number}"
    finally:
        os.close(read_end)
        process.terminate()
        process.wait(10)
