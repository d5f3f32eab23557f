"""GET /v1/models and the model a request names: what live workers serve.

Each live worker advertises the models it serves (its metrics payload's "models", published at
every heartbeat, workers/fleet_metrics.py); a model is listed while at least one live worker serves
it. A request names a model by its served name, and the backend sends the job to that model's
queue (workers.settings.model_queue), where any of its workers takes it: a model whose workers
are all busy queues, one that nobody serves is 404.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from server.backends import worker_models
from server.common import ServerContext, context
from server.protocol import APIError, Generation, clip

router = APIRouter()


async def served_models(ctx: ServerContext) -> dict[str, dict]:
    """Served name -> {"id", "max_model_len", "model_name" (the workers' name: its queue's),
    "num_workers"}, for the models at least one live worker serves."""
    models: dict[str, dict] = {}
    for w in await ctx.backend.workers():
        for m in worker_models(w):
            entry = models.setdefault(
                m["name"], {"id": m["name"], "model_name": m["name"], "max_model_len": m.get("max_model_len")}
            )
            entry["num_workers"] = entry.get("num_workers", 0) + 1
    rename = ctx.config.served_model_name
    if rename and len(models) == 1:  # --served-model-name: the one model answers to that name
        (entry,) = models.values()
        models = {rename: {**entry, "id": rename}}
    elif rename and len(models) > 1:
        raise APIError(
            500,
            f"--served-model-name {rename!r} renames the one model served, but the workers serve "
            f"{sorted(models)}: name each with `tandem worker --model NAME=PATH` instead",
            type_="server_error",
        )
    return models


async def resolve_model(ctx: ServerContext, gen: Generation) -> dict:
    """The served model the request names (the only one, if it names none), and `gen.model` set
    to the workers' name for it: what backend.generate routes by."""
    served = pick_model(await served_models(ctx), gen.model)
    gen.model = served["model_name"]
    return served


def pick_model(models: dict[str, dict], name: str | None) -> dict:
    """The entry of served_models' `models` that `name` names (the only one, if None): the one
    rule the OpenAI endpoints and the job API share, with their 503, 400 and 404 answers."""
    if not models:
        raise APIError(503, "no worker serving an LLM is up yet; retry later", headers={"Retry-After": "2"})
    if name is None:
        if len(models) > 1:
            raise APIError(400, f"model: required when several models are served; served: {sorted(models)}", "model")
        return next(iter(models.values()))
    if name not in models:
        raise APIError(404, f"the model {clip(name)} does not exist; served: {sorted(models)}", "model")
    return models[name]


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    now = int(time.time())
    data = [
        {"id": m["id"], "object": "model", "created": now, "owned_by": "tandem", "max_model_len": m["max_model_len"]}
        for m in (await served_models(context(request))).values()
    ]
    return {"object": "list", "data": data}
