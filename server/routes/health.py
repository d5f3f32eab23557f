"""GET /health (what the backend serves, 503 when it cannot answer) and GET /metrics (the
fleet's Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from server.common import context, require_api_key
from server.protocol import APIError, clip
from server.routes.models import served_models

router = APIRouter()


_UNAVAILABLE = {
    503: {
        "description": "no live worker (serving the model asked for): a load balancer's signal, not a crash",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"status": {"const": "unavailable"}, "error": {"type": "string"}},
                    "required": ["status", "error"],
                }
            }
        },
    }
}


@router.get("/health", responses=_UNAVAILABLE)
async def health(request: Request, model: str | None = None) -> Response:
    """200 while some live worker serves something (with ?model=NAME: serves NAME), else 503,
    as a load balancer expects: {"status", "mode", "workers", "llm", "vision", "models": {name:
    live workers serving it}}."""
    ctx = context(request)
    backend = ctx.backend
    try:
        info = await backend.health()
        # The names clients use (--served-model-name), as /v1/models lists them: a load balancer
        # asks for the name its clients send, not the workers' own.
        info["models"] = {name: m["num_workers"] for name, m in (await served_models(ctx)).items()}
    except APIError as exc:  # a rename that cannot apply (several models served): say so
        return JSONResponse({"status": "unavailable", "mode": backend.mode, "error": exc.message}, status_code=503)
    except Exception as exc:  # noqa: BLE001 - unhealthy, and why
        return JSONResponse({"status": "unavailable", "mode": backend.mode, "error": str(exc)}, status_code=503)
    body = {"status": "ok", "mode": backend.mode, **info}
    if model is not None and not info["models"].get(model):
        body.update(status="unavailable", error=f"no live worker serves the model {clip(model)}")
        return JSONResponse(body, status_code=503)
    if not info["workers"]:
        body.update(status="unavailable", error="no live worker")
        return JSONResponse(body, status_code=503)
    return JSONResponse(body)


@router.get("/metrics", dependencies=[Depends(require_api_key)])
async def metrics(request: Request) -> Response:
    from server.metrics import render

    payloads = await context(request).payloads()  # the backend's, and the tenants' (server/admission.py)
    return Response(render(payloads), media_type="text/plain; version=0.0.4; charset=utf-8")
