"""`GET /v1/models`: every model this server may serve, with its state and version."""

from __future__ import annotations

from fastapi import APIRouter, Request

from rebar.server.state import server_state
from rebar.serving.registry import ModelRegistry
from rebar.serving.slots import ModelSlot

router = APIRouter()


def listing(registry: ModelRegistry, slots: list[ModelSlot]) -> dict:
    return {
        "object": "list",
        "data": [
            {"object": "model", "created": registry.created, "owned_by": "rebar", **s.describe()}
            for s in slots
        ],
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    """Every model this server may serve, with its state (loaded, loading, reloading, unloaded,
    failed) and the version it serves."""
    registry = server_state(request).registry
    return listing(registry, list(registry.slots.values()))
