"""`rebar desktop`: the chat page in a native window on a private server."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rebar.desktop.errors import DesktopError


def _pixels(text: str) -> int:
    value = int(text)
    if not 200 <= value <= 10000:
        raise argparse.ArgumentTypeError(f"must be 200..10000 pixels, got {value}")
    return value


def add_desktop_parser(commands: Any) -> None:
    desktop = commands.add_parser(
        "desktop",
        help="open the chat page in a native window, on a private server that stops with it",
    )
    desktop.add_argument(
        "--model",
        default=None,
        help="models.chat of the window's server: alias, .gguf file or HF folder",
    )
    desktop.add_argument(
        "--embedding-model",
        default="none",
        help="models.embedding of the window's server (default none: the page uses no embeddings)",
    )
    desktop.add_argument(
        "--config", type=Path, default=None, help="TOML settings file for the window's server"
    )
    desktop.add_argument("--width", type=_pixels, default=1100, help="window width in pixels")
    desktop.add_argument("--height", type=_pixels, default=800, help="window height in pixels")
    desktop.set_defaults(handler=cmd_desktop)


def cmd_desktop(args: argparse.Namespace) -> int:
    from rebar.desktop.server import EmbeddedServer
    from rebar.desktop.window import WindowOptions, run_window

    if args.config is not None and not args.config.is_file():
        raise DesktopError(f"--config {str(args.config)!r} is not a file")
    server = EmbeddedServer(args.model, args.config, args.embedding_model)
    run_window(server, WindowOptions(width=args.width, height=args.height))
    return 0
