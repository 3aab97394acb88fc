"""The system web view pywebview drives, checked before anything starts: on Linux the GTK backend
over WebKitGTK (no bundled browser), which needs a display."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from rebar.desktop.errors import INSTALL_HINT, DesktopError

GUI = "gtk"  # pywebview's backend on Linux: GTK 3 and WebKitGTK
_GI_VERSIONS = {"Gtk": "3.0", "WebKit2": "4.1"}  # what pywebview's GTK backend loads


def web_view() -> ModuleType:
    """pywebview, once its backend can run here; DesktopError naming what is missing."""
    webview = _import("webview", "pywebview")
    if sys.platform == "linux":
        _check_gtk()
    return webview


def _import(module: str, package: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise DesktopError(f"{package} is not installed ({exc}): {INSTALL_HINT}") from None


def _check_gtk() -> None:
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        raise DesktopError(
            "no display: rebar desktop opens a window, but neither DISPLAY nor WAYLAND_DISPLAY is "
            "set (run it in a desktop session, or under xvfb-run)"
        )
    gi = _import("gi", "PyGObject")
    for namespace, version in _GI_VERSIONS.items():
        try:
            gi.require_version(namespace, version)
        except ValueError:
            raise DesktopError(
                f"the system web view is missing: no {namespace} {version} introspection data "
                f"(Debian: gir1.2-webkit2-4.1): {INSTALL_HINT}"
            ) from None
    gtk = importlib.import_module("gi.repository.Gtk")
    if not gtk.init_check()[0]:
        shown = os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
        raise DesktopError(f"cannot open the display {shown!r}: is its X or Wayland server up?")
