"""GET /health (what the backend serves, 503 when it cannot answer) and GET /metrics (the
fleet's Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from server.common import context, require_api_key

router = APIRouter()


@router.get("/health")
async def health(request: Request, model: str | None = None) -> Response:
    """200 while some live worker serves something (with ?model=NAME: serves NAME), else 503,
    as a load balancer expects: {"status", "mode", "workers", "llm", "vision", "models": {name:
    live workers serving it}}."""
    backend = context(request).backend
    try:
        info = await backend.health()
    except Exception as exc:  # noqa: BLE001 - unhealthy, and why
        return JSONResponse({"status": "unavailable", "mode": backend.mode, "error": str(exc)}, status_code=503)
    body = {"status": "ok", "mode": backend.mode, **info}
    if model is not None and not info["models"].get(model):
        body.update(status="unavailable", error=f"no live worker serves the model {model!r}")
        return JSONResponse(body, status_code=503)
    if not info["workers"]:
        body.update(status="unavailable", error="no live worker")
        return JSONResponse(body, status_code=503)
    return JSONResponse(body)


@router.get("/metrics", dependencies=[Depends(require_api_key)])
async def metrics(request: Request) -> Response:
    from runtime.metrics import render

    payloads = await context(request).backend.payloads()
    return Response(render(payloads), media_type="text/plain; version=0.0.4; charset=utf-8")
