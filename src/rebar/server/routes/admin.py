"""Admin endpoints, behind their own keys (`server.admin_api_keys`, checked by AdminKeyMiddleware):
the served models (list, load, unload, reload; `rebar models ...` drives these) and a profile of
the live engine."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from rebar.errors import RebarError
from rebar.server.body import StrictBody
from rebar.server.errors import APIError
from rebar.server.pipeline.lease import with_chat_model
from rebar.server.routes.models import listing
from rebar.server.state import ServerState, server_state
from rebar.serving.errors import InsufficientMemory, LoadRefused, ServingError
from rebar.serving.instances import ChatModel

router = APIRouter(include_in_schema=False)


@router.get("/admin/models")
async def admin_list(request: Request) -> dict:
    registry = server_state(request).registry
    return listing(registry, list(registry.slots.values())) | {
        "memory_bytes": registry.used_bytes(),
        "memory_budget": registry.total_bytes,
    }


@router.post("/admin/models/{name}/load")
async def admin_load(name: str, request: Request) -> dict:
    registry = _ready(request).registry
    try:
        slot = await registry.load(name)
    except InsufficientMemory as exc:
        # an admin asked: a conflict to resolve, not a wait
        raise APIError(409, str(exc), code="insufficient_memory") from None
    except ServingError:
        raise
    except Exception as exc:
        raise LoadRefused(f"model {name!r} failed to load: {exc}") from None
    return listing(registry, [slot])["data"][0]


@router.post("/admin/models/{name}/unload")
async def admin_unload(name: str, request: Request) -> dict:
    registry = _ready(request).registry
    slot = await registry.unload(name)
    return listing(registry, [slot])["data"][0]


class ReloadRequest(StrictBody):
    # A new file or folder for the model; None: the one it serves now (e.g. replaced in place).
    path: str | None = Field(None, min_length=1)


@router.post("/admin/models/{name}/reload")
async def admin_reload(name: str, request: Request, body: ReloadRequest | None = None) -> dict:
    """Load a new version here beside the old one, switch new requests to it, and announce it to
    every server process sharing the store; 409 (the old version still serving) when it cannot
    load or breaks its contract."""
    state = _ready(request)
    outcome = await state.reloads.reload(name, body.path if body else None)
    return {"object": "model.reload", **outcome.to_json()}


def _ready(request: Request) -> ServerState:
    state = server_state(request)
    state.registry.check_ready()
    return state


class ProfileRequest(StrictBody):
    model: str | None = None  # the chat model to profile; None: the first one
    steps: int = Field(10, ge=1, le=1000)  # engine steps to profile
    # stop early if this passes (an idle engine takes no steps)
    timeout_s: float = Field(30.0, gt=0, le=600)
    top: int = Field(20, ge=1, le=200)  # operators in the summary


@router.post("/admin/profile")
async def profile(body: ProfileRequest, request: Request) -> Response:
    """Profile the next `steps` engine steps of the live server with the torch profiler.

    Returns the top operators and the Chrome trace (`jq .trace > trace.json`, then open it in
    ui.perfetto.dev); every model layer is a named range in the trace.
    """

    async def answer(model: ChatModel) -> JSONResponse:
        try:
            result = await model.front.profile(body.steps, body.timeout_s, body.top)
        except RebarError as exc:
            raise APIError(409, str(exc), code="profile_unavailable") from exc
        return JSONResponse({"object": "profile", **result.summary(), "trace": result.trace})

    return await with_chat_model(server_state(request), body.model, answer)
