"""Admin endpoints, behind their own keys (`server.admin_api_keys`): POST /admin/profile."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import Field

from rebar.errors import RebarError
from rebar.server.auth import ApiKeyChecker
from rebar.server.errors import APIError
from rebar.server.schemas import _Strict

router = APIRouter()


class ProfileRequest(_Strict):
    steps: int = Field(10, ge=1, le=1000)  # engine steps to profile
    timeout_s: float = Field(30.0, gt=0, le=600)  # stop early if this passes (an idle engine takes no steps)
    top: int = Field(20, ge=1, le=200)  # operators in the summary


def require_admin(request: Request) -> None:
    """403 while no admin key is configured; 401 unless `Authorization: Bearer <admin key>`."""
    checker = ApiKeyChecker(request.app.state.rebar.admin_key_hashes)
    if not checker.enabled:
        raise APIError(403, "admin endpoints are disabled; set server.admin_api_keys to enable them", code="admin_disabled")
    if not checker.check(request.headers.get("authorization")):
        raise APIError(401, "invalid or missing admin key (Authorization: Bearer <admin key>)", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


@router.post("/admin/profile", include_in_schema=False)
async def profile(body: ProfileRequest, request: Request) -> dict:
    """Profile the next `steps` engine steps of the live server with the torch profiler.

    Returns the top operators and the Chrome trace (`jq .trace > trace.json`, then open it in
    ui.perfetto.dev); every model layer is a named range in the trace.
    """
    require_admin(request)
    state = request.app.state.rebar
    _, engine = state.chat_model(state.models.chat_name)
    try:
        result = await engine.profile(body.steps, body.timeout_s, body.top)
    except RebarError as exc:
        raise APIError(409, str(exc), code="profile_unavailable") from exc
    return {"object": "profile", **result.summary(), "trace": result.trace}
