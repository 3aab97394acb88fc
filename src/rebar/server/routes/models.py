"""The served models: GET /v1/models for every client, and the admin calls that load, unload and
reload them (`rebar models list|load|unload|reload` drives these)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import Field

from rebar.server.errors import APIError
from rebar.server.registry import InsufficientMemory, ModelSlot
from rebar.server.schemas import _Strict
from rebar.server.state import ServerState, server_state

router = APIRouter()


def _listing(state: ServerState, slots: list[ModelSlot]) -> dict:
    assert state.registry is not None
    created = state.registry.created
    return {
        "object": "list",
        "data": [
            {"object": "model", "created": created, "owned_by": "rebar", **slot.describe()}
            for slot in slots
        ],
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    """Every model this server may serve, with its state (loaded, loading, reloading, unloaded,
    failed) and the version it serves."""
    state = server_state(request)
    assert state.registry is not None
    return _listing(state, list(state.registry.slots.values()))


@router.get("/admin/models", include_in_schema=False)
async def admin_list(request: Request) -> dict:
    state = server_state(request)
    assert state.registry is not None
    listing = _listing(state, list(state.registry.slots.values()))
    return listing | {
        "memory_bytes": state.registry.used_bytes(),
        "memory_budget": state.registry.total_bytes,
    }


@router.post("/admin/models/{name}/load", include_in_schema=False)
async def admin_load(name: str, request: Request) -> dict:
    state = _ready(request)
    assert state.registry is not None
    try:
        slot = await state.registry.load(name)
    except InsufficientMemory as exc:
        raise APIError(409, exc.message, code="insufficient_memory") from None
    except APIError:
        raise
    except Exception as exc:
        raise APIError(409, f"model {name!r} failed to load: {exc}", code="load_failed") from None
    return _listing(state, [slot])["data"][0]


@router.post("/admin/models/{name}/unload", include_in_schema=False)
async def admin_unload(name: str, request: Request) -> dict:
    state = _ready(request)
    assert state.registry is not None
    slot = await state.registry.unload(name)
    return _listing(state, [slot])["data"][0]


class ReloadRequest(_Strict):
    # A new file or folder for the model; None: the one it serves now (e.g. replaced in place).
    path: str | None = Field(None, min_length=1)


@router.post("/admin/models/{name}/reload", include_in_schema=False)
async def admin_reload(name: str, request: Request, body: ReloadRequest | None = None) -> dict:
    """Load a new version here beside the old one, switch new requests to it, and announce it to
    every server process sharing the store; 409 (the old version still serving) when it cannot
    load or breaks its contract."""
    state = _ready(request)
    assert state.reloads is not None
    outcome = await state.reloads.reload(name, body.path if body else None)
    return {"object": "model.reload", **outcome.to_json()}


def _ready(request: Request) -> ServerState:
    state = server_state(request)
    state.require_ready()
    return state
