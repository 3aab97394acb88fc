"""Why a desktop window could not open or run."""

from __future__ import annotations

from rebar.errors import RebarError

# The one place that says how to get the window's dependencies.
INSTALL_HINT = "run `make desktop` (Debian's WebKitGTK and Xvfb, and pip install 'rebar[desktop]')"


class DesktopError(RebarError):
    """The window cannot open (no display, no web view backend) or its server failed."""
