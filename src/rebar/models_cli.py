"""`rebar models list | load | unload | reload`: drive a running server's model registry through
its admin endpoints (the admin key from --admin-key or REBAR_ADMIN_KEY)."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from rebar.errors import ConfigError, RebarError

DEFAULT_URL = "http://127.0.0.1:8000"


def _call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    key = args.admin_key or os.environ.get("REBAR_ADMIN_KEY")
    if not key:
        raise ConfigError("give the server's admin key with --admin-key or REBAR_ADMIN_KEY")
    request = urllib.request.Request(
        args.url.rstrip("/") + path,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise RebarError(f"{method} {path}: {exc.code} {message}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RebarError(f"cannot reach {args.url}: {reason}") from None


def _quoted(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _line(model: dict) -> str:
    memory = f"{model['memory_bytes'] / 2**20:,.0f} MiB" if model["memory_bytes"] else "-"
    flags = " pinned" if model["pinned"] else ""
    error = f"  error: {model['error']}" if model.get("error") else ""
    return (
        f"{model['id']:<24} {model['kind']:<9} {model['state']:<9} v{model['version']:<4} "
        f"{memory:>10}  {model['path']}{flags}{error}"
    )


def cmd_list(args: argparse.Namespace) -> int:
    listing = _call(args, "GET", "/admin/models")
    print(f"{'MODEL':<24} {'KIND':<9} {'STATE':<9} {'VER':<5} {'MEMORY':>10}  PATH")
    for model in listing["data"]:
        print(_line(model))
    used, budget = listing["memory_bytes"] / 2**20, listing["memory_budget"] / 2**20
    print(f"memory: {used:,.0f} of {budget:,.0f} MiB")
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    print(_line(_call(args, "POST", f"/admin/models/{_quoted(args.name)}/load")))
    return 0


def cmd_unload(args: argparse.Namespace) -> int:
    print(_line(_call(args, "POST", f"/admin/models/{_quoted(args.name)}/unload")))
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    body = {"path": args.path} if args.path else {}
    outcome = _call(args, "POST", f"/admin/models/{_quoted(args.name)}/reload", body)
    drained = "; drained the old version first" if outcome["drained_first"] else ""
    print(
        f"{outcome['name']}: v{outcome['previous_version']} -> v{outcome['version']} "
        f"({outcome['path']}), loaded in {outcome['load_s']:.1f}s, swapped in "
        f"{outcome['swap_ms']:.3f} ms{drained}; announced to "
        f"{outcome['processes_reached']} other server processes"
    )
    return 0


def add_models_parser(commands: Any) -> None:
    models = commands.add_parser(
        "models", help="list, load, unload or reload the models of a running server"
    ).add_subparsers(dest="models_command", required=True)

    def command(name: str, help_text: str, handler) -> argparse.ArgumentParser:
        parser = models.add_parser(name, help=help_text)
        parser.add_argument("--url", default=os.environ.get("REBAR_URL", DEFAULT_URL))
        parser.add_argument("--admin-key", help="default: $REBAR_ADMIN_KEY")
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds")
        parser.set_defaults(handler=handler)
        return parser

    command("list", "every model with its state, version and memory", cmd_list)
    command("load", "load a model now", cmd_load).add_argument("name")
    command("unload", "unload a model (its requests in flight finish)", cmd_unload).add_argument(
        "name"
    )
    reload = command(
        "reload",
        "load a new version beside the old one and switch every server process to it",
        cmd_reload,
    )
    reload.add_argument("name")
    reload.add_argument("--path", help="a new file or folder (default: the one it serves)")
