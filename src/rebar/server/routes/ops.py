"""Health, readiness and metrics: open without an API key, for load balancers and scrapers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from rebar.server.state import server_state
from rebar.serving.registry import NOT_READY_RETRY_S

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: the process answers, and its engine (when it runs in a process of its own) has not
    exited."""
    failure = server_state(request).registry.engine_failure()
    if failure is not None:
        return JSONResponse({"status": "failed", "error": failure}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once every model is loaded and a warm-up generation has run."""
    state = server_state(request)
    registry = state.registry
    error = registry.engine_failure() or registry.load_error
    if registry.ready and error is None:
        return JSONResponse({"status": "ready", "models": state.registry.loaded_names()})
    body = {"status": "failed" if error else "loading", "error": error}
    headers = {"Retry-After": str(NOT_READY_RETRY_S)}
    return JSONResponse(body, status_code=503, headers=headers)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition of this server's registry (open without an API key)."""
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
