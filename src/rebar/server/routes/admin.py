"""Admin endpoints, behind their own keys (`server.admin_api_keys`, checked by AdminKeyMiddleware):
POST /admin/profile."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import Field

from rebar.errors import RebarError
from rebar.server.errors import APIError
from rebar.server.schemas import _Strict
from rebar.server.state import server_state

router = APIRouter()


class ProfileRequest(_Strict):
    steps: int = Field(10, ge=1, le=1000)  # engine steps to profile
    timeout_s: float = Field(
        30.0, gt=0, le=600
    )  # stop early if this passes (an idle engine takes no steps)
    top: int = Field(20, ge=1, le=200)  # operators in the summary


@router.post("/admin/profile", include_in_schema=False)
async def profile(body: ProfileRequest, request: Request) -> dict:
    """Profile the next `steps` engine steps of the live server with the torch profiler.

    Returns the top operators and the Chrome trace (`jq .trace > trace.json`, then open it in
    ui.perfetto.dev); every model layer is a named range in the trace.
    """
    state = server_state(request)
    _, engine = state.chat_model(state.models.chat_name)
    try:
        result = await engine.profile(body.steps, body.timeout_s, body.top)
    except RebarError as exc:
        raise APIError(409, str(exc), code="profile_unavailable") from exc
    return {"object": "profile", **result.summary(), "trace": result.trace}
