"""GET /v1/models and the model a request names: what live workers serve."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from server.common import ServerContext, context
from server.protocol import APIError, Generation

router = APIRouter()


async def served_models(ctx: ServerContext) -> dict[str, dict]:
    models: dict[str, dict] = {}
    for w in await ctx.backend.workers():
        if w.get("model_name"):
            name = ctx.config.served_model_name or w["model_name"]
            models.setdefault(name, {"id": name, "max_model_len": w.get("max_model_len")})
    return models


async def resolve_model(ctx: ServerContext, gen: Generation) -> dict:
    """The served model the request names (the only one, if it names none)."""
    models = await served_models(ctx)
    if not models:
        raise APIError(503, "no worker serving an LLM is up yet; retry later", headers={"Retry-After": "2"})
    if gen.model is None:
        return next(iter(models.values()))
    if gen.model not in models:
        raise APIError(404, f"the model {gen.model!r} does not exist; served: {sorted(models)}", "model")
    return models[gen.model]


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    now = int(time.time())
    data = [
        {"id": m["id"], "object": "model", "created": now, "owned_by": "tandem", "max_model_len": m["max_model_len"]}
        for m in (await served_models(context(request))).values()
    ]
    return {"object": "list", "data": data}
