"""The job API: POST /v1/jobs, GET /v1/jobs/{id} and its events, DELETE /v1/jobs/{id}. Jobs
live in Redis, so this needs workers (not --embedded)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from server.common import context
from server.protocol import APIError

router = APIRouter()
_STREAM_ID = re.compile(r"\d{1,20}(-\d{1,20})?")


def jobs_backend(request: Request):
    backend = context(request).backend
    if backend.mode != "jobs":
        raise APIError(
            501,
            "the job API keeps jobs in Redis: start `tandem serve` over workers, without --embedded",
            type_="not_implemented",
        )
    return backend


def checked_job_id(job_id: str) -> str:
    from workers.store import check_job_id

    try:
        return check_job_id(job_id)
    except ValueError as exc:
        raise APIError(400, str(exc), "job_id") from None


@router.post("/v1/jobs", status_code=202)
async def submit_job(request: Request) -> dict:
    b = jobs_backend(request)
    body = await context(request).read_json(request)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", "body")
    body = dict(body)
    task = body.pop("task", "generate")
    job_id = body.pop("job_id", None)
    if task not in ("generate", "detect"):
        raise APIError(400, f"task must be 'generate' or 'detect', got {task!r}", "task")
    from workers.jobspec import parse_detect, parse_generate

    if task == "generate":
        spec = parse_generate(body)
        queue, name, max_tokens = "llm", "tandem.generate", spec.params.max_tokens
    else:
        spec = parse_detect(body)
        queue, name, max_tokens = "vision", "tandem.detect", 0
    await b.check_capacity(queue)
    try:
        job_id, created, state = await b.submit(
            name, body, job_id=job_id, priority=spec.priority, max_tokens=max_tokens
        )
    except ValueError as exc:
        if "already used" in str(exc):  # the same job id with other arguments
            raise APIError(409, str(exc), "job_id", type_="conflict") from None
        raise
    return {"job_id": job_id, "state": state, "created": created}


@router.get("/v1/jobs/{job_id}")
async def job_status(job_id: str, request: Request) -> dict:
    out = await jobs_backend(request).status(checked_job_id(job_id))
    if out is None:
        raise APIError(404, f"job {job_id} does not exist (or expired)", "job_id")
    return out


@router.get("/v1/jobs/{job_id}/events")
async def job_events(job_id: str, request: Request) -> Response:
    b = jobs_backend(request)
    job_id = checked_job_id(job_id)
    if await b.state(job_id) is None:
        raise APIError(404, f"job {job_id} does not exist (or expired)", "job_id")
    field = "Last-Event-ID" if request.headers.get("last-event-id") else "after"
    after = request.headers.get("last-event-id") or request.query_params.get("after") or "0-0"
    if not _STREAM_ID.fullmatch(after):
        raise APIError(400, f"{field} must be an event id as sent (like 1700000000000-0), got {after[:40]!r}", field)

    async def events() -> AsyncIterator[bytes]:
        async for event_id, event in b.read_events(job_id, after):
            yield f"id: {event_id}\nevent: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(job_id: str, request: Request) -> dict:
    outcome = await jobs_backend(request).cancel(checked_job_id(job_id))
    if outcome == "missing":
        raise APIError(404, f"job {job_id} does not exist (or expired)", "job_id")
    state = outcome.split(":", 1)[-1]  # "final:done": it had ended already
    return {"job_id": job_id, "cancelled": outcome in ("cancelled", "cancelling"), "state": state}
