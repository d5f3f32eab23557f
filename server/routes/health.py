"""GET /health (what the backend serves, 503 when it cannot answer) and GET /metrics (the
fleet's Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from server.common import context, require_api_key

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    backend = context(request).backend
    try:
        info = await backend.health()
    except Exception as exc:  # noqa: BLE001 - unhealthy, and why
        return JSONResponse({"status": "unavailable", "mode": backend.mode, "error": str(exc)}, status_code=503)
    return JSONResponse({"status": "ok", "mode": backend.mode, **info})


@router.get("/metrics", dependencies=[Depends(require_api_key)])
async def metrics(request: Request) -> Response:
    from runtime.metrics import render

    payloads = await context(request).backend.payloads()
    return Response(render(payloads), media_type="text/plain; version=0.0.4; charset=utf-8")
