"""Admin endpoints, behind their own keys (`server.admin_api_keys`, checked by AdminKeyMiddleware):
POST /admin/profile (the model admin calls are in routes/models.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from rebar.errors import RebarError
from rebar.server.errors import APIError
from rebar.server.model_instance import ModelInstance
from rebar.server.schemas import _Strict
from rebar.server.state import server_state

router = APIRouter()


class ProfileRequest(_Strict):
    model: str | None = None  # the chat model to profile; None: the first one
    steps: int = Field(10, ge=1, le=1000)  # engine steps to profile
    timeout_s: float = Field(
        30.0, gt=0, le=600
    )  # stop early if this passes (an idle engine takes no steps)
    top: int = Field(20, ge=1, le=200)  # operators in the summary


@router.post("/admin/profile", include_in_schema=False)
async def profile(body: ProfileRequest, request: Request) -> Response:
    """Profile the next `steps` engine steps of the live server with the torch profiler.

    Returns the top operators and the Chrome trace (`jq .trace > trace.json`, then open it in
    ui.perfetto.dev); every model layer is a named range in the trace.
    """

    async def build(model: ModelInstance) -> JSONResponse:
        assert model.engine is not None, "a chat model's instance has an engine"
        try:
            result = await model.engine.profile(body.steps, body.timeout_s, body.top)
        except RebarError as exc:
            raise APIError(409, str(exc), code="profile_unavailable") from exc
        return JSONResponse({"object": "profile", **result.summary(), "trace": result.trace})

    return await server_state(request).serve(body.model, "chat", build)
