"""The job API: POST /v1/jobs, GET /v1/jobs/{id} and its events, DELETE /v1/jobs/{id}. Jobs
live in Redis, so this needs workers (not --embedded).

A generate job passes the same checks as the OpenAI endpoints (protocol.check_job: finite
numbers, known roles, ...) before workers/jobspec.py's, and names its model as they do (`model`:
a served name, which picks that model's queue, workers.settings.model_queue). Chat messages may
come with tools (tools, tool_choice, parallel_tool_calls): the job's events then carry the calls
(tool_call / tool_args, workers/events.py) and its result `content` and `tool_calls`. A job of
`n` > 1 choices (or best_of) names each token event's `choice` and ends each choice with a
choice_end event; its result lists `choices`. `prompt_logprobs` adds a prompt event and the
result's `prompt_logprobs`. With an API key,
each job belongs to the key that submitted it (contract G): another key gets 404, as if it did
not exist. A generate job is its key's tenant's (server/tenants.py: a `tenant` field naming
another is 400), may set `tier` ("interactive" or "batch"), and counts against its tenant's
requests and tokens per minute (429 with Retry-After past them).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from server import openapi, protocol
from server.admission import Rejected, estimate_tokens
from server.common import KEEPALIVE, TICK, claimed_tenant, context, owner_of, ticking
from server.protocol import APIError
from server.routes.models import pick_model, served_models
from server.tenants import DEFAULT_TENANT

router = APIRouter()
_STREAM_ID = re.compile(r"(\d{1,20})(?:-(\d{1,20}))?")
_U64 = 1 << 64


def jobs_backend(request: Request):
    backend = context(request).backend
    if backend.mode != "jobs":
        raise APIError(
            501,
            "the job API keeps jobs in Redis: start `tandem serve` over workers, without --embedded",
            type_="not_implemented",
        )
    return backend


def owned(request: Request, method) -> dict:
    """{"owner": ...} for a backend method that takes contract G's owner, else {} (a backend
    without ownership yet: passing it would be a TypeError)."""
    if "owner" not in inspect.signature(method).parameters:
        return {}
    return {"owner": owner_of(request)}


def checked_job_id(job_id: str) -> str:
    from workers.store import check_job_id

    try:
        return check_job_id(job_id)
    except ValueError:
        raise APIError(
            400, f"job_id must be 1-200 characters of [A-Za-z0-9._:@-], got {protocol.clip(job_id)}", "job_id"
        ) from None


def charge(request: Request, tenant: str, body: dict, max_tokens: int) -> None:
    """A generate job's request and tokens against its tenant's per-minute limits (429 with
    Retry-After past one). A job outlives its request, so it holds no slot of max_concurrent
    or max_queued: those caps are the OpenAI endpoints' (server/admission.py)."""
    prompt = body.get("prompt") if body.get("prompt") is not None else body.get("messages")
    size = len(json.dumps(prompt)) if not isinstance(prompt, str) else len(prompt.encode("utf-8", "surrogatepass"))
    try:
        context(request).admission.charge(tenant, estimate_tokens(prompt, size, max_tokens, 0))
    except Rejected as exc:
        raise APIError(429, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from None


def _missing(job_id: str) -> APIError:
    return APIError(404, f"job {job_id} does not exist (or expired)", "job_id")


async def _generate_queue(request: Request, model: object, body: dict) -> str:
    """The queue of the model the job names, resolved as the OpenAI endpoints resolve it
    (models.pick_model: 404 for a model nobody serves, 400 for none named among several), and
    max_tokens past that model's context refused now (400), not failed later. With no LLM worker
    up, a job naming no model waits on the plain `llm` queue for the first one; one naming a
    model cannot be checked, so it gets pick_model's 503."""
    from workers.settings import model_queue

    if model is not None and (not isinstance(model, str) or not model):
        raise protocol.bad("model", f"model must be a non-empty string, got {protocol.clip(model)}")
    models = await served_models(context(request))
    if model is None and not models:
        return "llm"
    served = pick_model(models, model)
    mt, max_len = body.get("max_tokens"), served.get("max_model_len")
    if max_len and isinstance(mt, int) and not isinstance(mt, bool) and mt > max_len:
        raise protocol.bad(
            "max_tokens", f"max_tokens must be at most max_model_len ({max_len}), got {protocol.clip(mt)}"
        )
    return model_queue(served["model_name"])


@router.post("/v1/jobs", status_code=202, openapi_extra=openapi.request_body("Job"))
async def submit_job(request: Request) -> dict:
    b = jobs_backend(request)
    body = await context(request).read_json(request)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", "body")
    body = dict(body)
    task = body.pop("task", "generate")
    job_id = body.pop("job_id", None)
    if task not in ("generate", "detect"):
        raise APIError(400, f"task must be 'generate' or 'detect', got {protocol.clip(task)}", "task")
    if job_id is not None:
        job_id = checked_job_id(job_id)
    from workers.jobspec import parse_detect, parse_generate, queue_priority

    if task == "generate":
        model = body.pop("model", None)  # routing, not a job field: it picks the queue
        tenant = claimed_tenant(request, body.pop("tenant", None))  # the API key's, never another
        if tenant != DEFAULT_TENANT:
            body["tenant"] = tenant
        protocol.check_job(body)  # the OpenAI endpoints' checks; messages come back cleaned
        queue = await _generate_queue(request, model, body)
        spec = parse_generate(body)
        name, max_tokens = "tandem.generate", spec.params.max_tokens or 0
        charge(request, tenant, body, max_tokens * max(spec.params.n, spec.params.best_of or 1))
        waits_as = queue_priority(spec.priority, spec.tier)  # a batch job waits behind interactive ones
    else:
        for key in ("url", "path"):
            if isinstance(body.get(key), str):
                protocol.check_text(key, body[key])
        deadline = body.get("deadline_s")
        if deadline is not None:
            protocol.check_job({"deadline_s": deadline})
        spec = parse_detect(body)
        queue, name, max_tokens = "vision", "tandem.detect", 0
        waits_as = spec.priority
    await b.check_capacity(queue)
    try:
        job_id, created, state = await b.submit(
            name,
            body,
            job_id=job_id,
            queue=queue,
            priority=waits_as,
            max_tokens=max_tokens,
            **owned(request, b.submit),
        )
    except ValueError as exc:
        if "already used" in str(exc):  # the same job id with other arguments (or another owner's)
            raise APIError(409, str(exc), "job_id", type_="conflict") from None
        raise
    return {"job_id": job_id, "state": state, "created": created}


@router.get("/v1/jobs/{job_id}", openapi_extra=openapi.errors_only())
async def job_status(job_id: str, request: Request) -> dict:
    b = jobs_backend(request)
    job_id = checked_job_id(job_id)
    out = await b.status(job_id, **owned(request, b.status))
    if out is None:
        raise _missing(job_id)
    return out


def checked_event_id(value: str, field: str) -> str:
    """A Redis stream id as the events carry it: ms[-seq], each part a 64-bit unsigned integer
    (Redis answers anything else with an error, which would be a 500)."""
    m = _STREAM_ID.fullmatch(value)
    if not m or int(m.group(1)) >= _U64 or int(m.group(2) or 0) >= _U64:
        raise APIError(
            400, f"{field} must be an event id as sent (like 1700000000000-0), got {protocol.clip(value[:60])}", field
        )
    return value


@router.get("/v1/jobs/{job_id}/events", openapi_extra=openapi.errors_only())
async def job_events(job_id: str, request: Request) -> Response:
    b = jobs_backend(request)
    job_id = checked_job_id(job_id)
    field = "Last-Event-ID" if request.headers.get("last-event-id") else "after"
    after = checked_event_id(request.headers.get("last-event-id") or request.query_params.get("after") or "0-0", field)
    owner = owned(request, b.read_events)
    if owner and await b.status(job_id, **owned(request, b.status)) is None:
        raise _missing(job_id)  # another key's job is no job
    if await b.state(job_id) is None:
        raise _missing(job_id)
    interval = context(request).config.keepalive_s

    async def events() -> AsyncIterator[bytes]:
        async for item in ticking(b.read_events(job_id, after, **owner), interval):
            if item is TICK:
                yield KEEPALIVE
                continue
            event_id, event = item
            yield f"id: {event_id}\nevent: {event.type}\ndata: {json.dumps(event.to_dict())}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.delete("/v1/jobs/{job_id}", openapi_extra=openapi.errors_only())
async def cancel_job(job_id: str, request: Request) -> dict:
    b = jobs_backend(request)
    job_id = checked_job_id(job_id)
    outcome = await b.cancel(job_id, **owned(request, b.cancel))
    if outcome == "missing":
        raise _missing(job_id)
    state = outcome.split(":", 1)[-1]  # "final:done": it had ended already
    return {"job_id": job_id, "cancelled": outcome in ("cancelled", "cancelling"), "state": state}
