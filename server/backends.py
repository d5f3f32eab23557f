"""Where `tandem serve` sends its work: the Celery workers through Redis (`JobsBackend`, the
default: the server stays thin and scales with the workers), or a Runtime in its own process
(server/embedded.py's `EmbeddedBackend`, `--embedded`: one machine, no Redis).

Both give the HTTP layer the same things: `generate()` returns a `Stream` of JobEvents
(workers/events.py), the type a job's Redis Stream carries: token events (content text, ids,
logprobs), tool_call / tool_args events for a tool job's calls, and last one of done, failed
(with the error's field and code when it was a FieldError) or cancelled; then
`await stream.usage()` for the token counts. Nothing here blocks the event loop: Redis is
read with redis.asyncio; the Runtime's handles wake the loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from runtime import errors
from runtime.errors import FieldError
from server import protocol
from server.protocol import APIError, Generation
from workers.events import CANCELLED, FAILED, JobEvent

log = logging.getLogger("tandem.serve")
MODELS_TTL_S = 1.0  # how long the list of served models (read from Redis) is reused


class Stream(Protocol):
    """One generation's events: iterate `events()`; `cancel()` stops the work behind it;
    `usage()` gives the token counts once it is done. JobStream and HandleStream are the two."""

    id: str

    def events(self) -> AsyncIterator[JobEvent]: ...

    async def usage(self) -> dict: ...

    async def cancel(self) -> None: ...


# ---- jobs over Redis and Celery -----------------------------------------------------------------


class JobStream:
    def __init__(self, backend: JobsBackend, job_id: str, deadline: float | None = None, owner: str | None = None):
        self.backend = backend
        self.id = job_id
        self.deadline = deadline  # time.monotonic() past which a lost Redis is not waited for
        self.owner = owner
        self.final: JobEvent | None = None
        self._usage: dict | None = None

    async def events(self) -> AsyncIterator[JobEvent]:
        async for _, event in self.backend.read_events(self.id, "0-0", owner=self.owner, deadline=self.deadline):
            if event.type == FAILED and event.field is None and event.finish_reason == "invalid_request":
                await self._error_detail(event)
            if event.final:
                self.final = event
            yield event
            if self.final is not None:
                return

    async def _error_detail(self, event: JobEvent) -> None:
        """A job failed by a FieldError keeps the error's field and code in its final record
        (workers/jobs.py: the event is the Lua scripts' and has no room for them): read there."""
        from redis.exceptions import RedisError

        try:
            detail = ((await self.backend.result(self.id, owner=self.owner)) or {}).get("error")
        except (RedisError, OSError, ValueError):
            return
        if isinstance(detail, dict) and detail.get("field"):
            event.field, event.code = str(detail["field"]), str(detail.get("code") or "invalid")

    async def usage(self) -> dict:
        """The final result's usage, read once (the route reads it for the answer and for its
        tenant's count)."""
        from redis.exceptions import RedisError

        if self._usage is not None:
            return self._usage
        try:
            result = await self.backend.result(self.id, owner=self.owner)
        except (RedisError, OSError) as exc:  # Redis gone past reconnect_s: the tokens were all sent
            log.warning("job %s: no usage for its last chunk, Redis unreachable: %s", self.id, exc)
            return {}
        use = (result or {}).get("usage") or {}
        if use:
            self._usage = use
        return use

    async def cancel(self) -> None:
        await self.backend.cancel(self.id, owner=self.owner)


class JobsBackend:
    mode = "jobs"

    def __init__(self, settings=None, max_queued: int = 256, tool_call_parser: str | None = None) -> None:
        import redis.asyncio as aioredis

        from workers import lua
        from workers.settings import JobSettings

        self.settings = settings or JobSettings.from_env()
        self.max_queued = max_queued
        self.tool_call_parser = tool_call_parser  # --tool-call-parser: sent with each tool job
        self.redis = aioredis.Redis.from_url(
            self.settings.redis_url,
            decode_responses=True,
            socket_timeout=10.0,
            socket_connect_timeout=2.0,
            health_check_interval=15,
        )
        self._submit = self.redis.register_script(lua.SUBMIT)
        self._cancel = self.redis.register_script(lua.CANCEL)
        self._models: tuple[float, list[dict]] = (0.0, [])
        self._client = None  # a sync JobClient for status reads, made on first use

    async def close(self) -> None:
        await self.redis.aclose()
        if self._client is not None:
            self._client.close()

    # ---- what the fleet serves --------------------------------------------------------------

    async def payloads(self) -> list[dict]:
        from workers.fleet_metrics import METRICS_INDEX, METRICS_KEY

        instances = await self.redis.zrange(METRICS_INDEX, 0, -1)
        if not instances:
            return []
        bodies = await self.redis.mget([METRICS_KEY + i for i in instances])
        return [json.loads(b) for b in bodies if b]

    async def workers(self) -> list[dict]:
        """The live workers' payloads (model, max_model_len, what they serve), cached briefly."""
        at, cached = self._models
        if time.monotonic() - at < MODELS_TTL_S:
            return cached
        workers = [p for p in await self.payloads() if p.get("kind") == "runtime"]
        self._models = (time.monotonic(), workers)
        return workers

    async def health(self) -> dict:
        await self.redis.ping()
        return fleet_health(await self.workers())

    # ---- jobs ---------------------------------------------------------------------------------

    async def check_capacity(self, queue: str) -> None:
        """503 with Retry-After when `max_queued` jobs already wait for a worker."""
        from workers.settings import MODEL_QUEUE_PREFIX
        from workers.store import PREFIX

        queues = [queue]
        if queue.startswith(MODEL_QUEUE_PREFIX):  # the model's workers take the plain llm queue's jobs too
            queues.append("llm")
        pipe = self.redis.pipeline(transaction=False)
        for q in queues:
            pipe.zcard(f"{PREFIX}queued:{q}")
        waiting = sum(await pipe.execute())
        if waiting >= self.max_queued:
            raise APIError(
                503,
                f"the {queue} queue is full ({waiting} jobs waiting for a worker, --max-queued "
                f"{self.max_queued}); retry later",
                headers={"Retry-After": "1"},
            )

    async def submit(
        self,
        task: str,
        kwargs: dict,
        *,
        job_id: str | None = None,
        queue: str | None = None,
        priority: int = 0,
        max_tokens: int = 0,
        ttl_s: int | None = None,
        owner: str | None = None,
    ) -> tuple[str, bool, str]:
        """Record and queue a job (idempotent on job_id). Returns (job_id, created, state).
        `owner` (contract G): the job is then invisible to any other owner, and its job_id
        refused to them (JobOwnedError, a ValueError: 409)."""
        from workers.store import check_job_id, submit_args, submit_outcome

        queue = queue or ("llm" if task == "tandem.generate" else "vision")
        job_id = check_job_id(job_id) if job_id is not None else uuid.uuid4().hex
        args = submit_args(
            job_id,
            task,
            queue,
            kwargs,
            ttl_s=ttl_s or self.settings.job_ttl_s,
            max_tokens=max_tokens,
            priority=priority,
            owner=owner,
        )
        created, state = submit_outcome(job_id, *await self._submit(args=args))
        return job_id, created, state

    async def generate(self, gen: Generation, deadline_s: float | None, owner: str | None = None) -> JobStream:
        """Queue the generation on the queue of the model `gen.model` names (the workers' name,
        as resolve_model sets it; None: the plain `llm` queue, which any LLM worker takes).
        `owner` (contract G, server.common.owner_of): the job is readable, streamable and
        cancellable through /v1/jobs by that owner only."""
        from workers.jobspec import queue_priority
        from workers.settings import model_queue

        queue = model_queue(gen.model) if gen.model else "llm"
        await self.check_capacity(queue)
        kwargs = dict(gen.job)
        if deadline_s is not None:
            kwargs["deadline_s"] = deadline_s  # a job still queued then never runs
        if gen.tools and self.tool_call_parser is not None:
            kwargs.setdefault("tool_call_parser", self.tool_call_parser)
        max_tokens = kwargs.get("max_tokens", 16)
        job_id, _, _ = await self.submit(
            "tandem.generate",
            kwargs,
            queue=queue,
            priority=queue_priority(kwargs.get("priority", 0), kwargs.get("tier", "interactive")),
            max_tokens=max_tokens if isinstance(max_tokens, int) else 0,
            owner=owner,
        )
        return JobStream(self, job_id, None if deadline_s is None else time.monotonic() + deadline_s, owner)

    async def read_events(
        self, job_id: str, after: str = "0-0", owner: str | None = None, deadline: float | None = None
    ) -> AsyncIterator[tuple[str, JobEvent]]:
        """(stream id, event) from `after` on, until the final event. A lost connection to
        Redis (a restart) is retried from the last id seen, until `deadline` (time.monotonic();
        None: settings.reconnect_s from the loss); past it the stream ends with a "failed" event
        that names the job, whose result GET /v1/jobs/{id} gives once Redis is back."""
        from workers.retry import Backoff
        from workers.store import events_key

        if owner is not None and not await self.visible(job_id, owner):
            raise APIError(404, f"job {job_id} does not exist (or expired)", "job_id")
        key = events_key(job_id)
        last = after or "0-0"
        block: int | None = None  # the first read never blocks: a finished job needs no wait
        backoff = Backoff(0.05, budget_s=self.settings.reconnect_s, until=deadline)
        while True:
            try:
                reply = await self.redis.xread({key: last}, count=512, block=block)
                entries = reply[0][1] if reply else []
                ended = False
                if not entries:
                    state = await self.state(job_id)
                    if state is None:
                        raise APIError(404, f"job {job_id} does not exist (or expired)", "job_id")
                    ended = state in ("done", "failed", "cancelled") and not await self.redis.xread(
                        {key: last}, count=1
                    )
            except _redis_lost() as exc:
                delay = backoff.next_s()
                if delay is None:
                    yield last, lost_stream_event(job_id, exc)
                    return
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            for event_id, fields in entries:
                last = event_id
                event = JobEvent.from_fields(fields, event_id)
                yield event_id, event
                if event.final:
                    return
            if ended:
                return  # resumed after the final event
            block = 2000

    async def visible(self, job_id: str, owner: str | None) -> bool:
        """Does the job exist for `owner` (contract G: another owner's job is no job)?"""
        from workers.store import job_key, visible

        rec = await self.redis.hmget(job_key(job_id), ["state", "submitter"])
        return rec[0] is not None and visible({"submitter": rec[1]}, owner)

    async def state(self, job_id: str) -> str | None:
        from workers.store import job_key

        return await self.redis.hget(job_key(job_id), "state")

    async def result(self, job_id: str, owner: str | None = None) -> dict | None:
        """The job's final result, or None. A lost connection to Redis (a restart) is retried
        for settings.reconnect_s, as read_events does: a stream that has delivered every token
        must not break at its last read (the usage chunk) because Redis is coming back."""
        from workers.store import end_key

        async def read() -> dict | None:
            if owner is not None and not await self.visible(job_id, owner):
                return None
            final = await self.redis.xrange(end_key(job_id), count=1)
            if not final or not final[0][1].get("result"):
                return None
            return json.loads(final[0][1]["result"])

        return await self._through_outage(read)

    async def _through_outage(self, read):
        """`await read()`, retried with backoff while Redis is unreachable, for up to
        settings.reconnect_s; past that the last error is raised."""
        from workers.retry import Backoff, retry_async

        return await retry_async(read, Backoff(0.05, budget_s=self.settings.reconnect_s), _redis_lost())

    async def cancel(self, job_id: str, owner: str | None = None) -> str:
        """ "cancelled", "cancelling" (running: it stops within a step), a final state, or
        "missing" (none, or another owner's)."""
        from workers.store import PREFIX

        return await self._cancel(args=[PREFIX, job_id, time.time(), self.settings.stream_maxlen, owner or ""])

    async def status(self, job_id: str, owner: str | None = None) -> dict | None:
        from workers.client import JobClient, JobNotFoundError

        if self._client is None:  # one pool of sync connections, shared by the status threads
            # A request waits a little for a restarting Redis, not the workers' full minute.
            settings = dataclasses.replace(self.settings, reconnect_s=min(2.0, self.settings.reconnect_s))
            self._client = JobClient(settings=settings)

        def read() -> dict | None:
            try:
                out = self._client.status(job_id, owner=owner)
            except JobNotFoundError:
                return None
            if out["state"] == "done":
                out["result"] = self._client.result(job_id, timeout=0, owner=owner)
            return out

        return await asyncio.to_thread(read)

    # ---- vision -------------------------------------------------------------------------------

    async def detect(self, kind: str, value: bytes | str, deadline_s: float | None) -> dict:
        await self.check_capacity("vision")
        kwargs: dict[str, Any] = {kind: base64.b64encode(value).decode() if kind == "image" else value}
        if deadline_s is not None:
            kwargs["deadline_s"] = deadline_s
        job_id, _, _ = await self.submit("tandem.detect", kwargs)
        stream = JobStream(self, job_id)
        try:
            async for event in stream.events():
                if event.type == FAILED:
                    raise job_error(event)
                if event.type == CANCELLED:
                    raise APIError(503, "the detection was cancelled")
        except asyncio.CancelledError:
            await asyncio.shield(self.cancel(job_id))
            raise
        return await self.result(job_id) or {}


def worker_models(worker: dict) -> list[dict]:
    """[{"name", "max_model_len"}] a worker's payload advertises (older payloads: model_name)."""
    if worker.get("models"):
        return [m for m in worker["models"] if m.get("name")]
    if worker.get("model_name"):
        return [{"name": worker["model_name"], "max_model_len": worker.get("max_model_len")}]
    return []


def fleet_health(workers: list[dict]) -> dict:
    """/health's body from the live workers' payloads: how many serve each model and vision.
    The route answers 503 when no live worker serves anything."""
    models: dict[str, int] = {}
    for w in workers:
        for m in worker_models(w):
            models[m["name"]] = models.get(m["name"], 0) + 1
    return {
        "workers": len(workers),
        "llm": sum("llm" in w.get("serves", ()) for w in workers),
        "vision": sum("vision" in w.get("serves", ()) for w in workers),
        "models": models,
    }


def _redis_lost() -> tuple[type[BaseException], ...]:
    """What a read raises while Redis restarts or is unreachable (imported on first use, as this
    module imports workers and redis: only a jobs backend needs them)."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return (RedisConnectionError, RedisTimeoutError, OSError)


def lost_stream_event(job_id: str, exc: BaseException) -> JobEvent:
    """The last event of a stream whose Redis stayed away past the request's deadline: the job
    itself may well finish, so the event names it for GET /v1/jobs/{id}."""
    return JobEvent(
        FAILED,
        job_id=job_id,
        finish_reason="abort",
        error=f"lost the job store (Redis: {exc}) while streaming job {job_id}; it may still finish: "
        f"GET /v1/jobs/{job_id} for its state and result",
    )


def job_error(event: JobEvent) -> APIError:
    """The HTTP error of a failed job's final event, from its data: a FieldError's field and
    code (400, or its code's status), 504 past a deadline (finish_reason deadline_exceeded),
    else 500. A job refused by a check that raises a plain ValueError still (finish_reason
    invalid_request, no field: runtime/llm's checks) is named by protocol.fallback_param."""
    message = event.error or "the job failed"
    if event.field is not None:
        return protocol.field_error(FieldError(event.field, message, event.code or errors.INVALID))
    if event.finish_reason == "invalid_request":
        return APIError(400, message, protocol.fallback_param(message))
    if event.finish_reason == "deadline_exceeded":
        return APIError(504, message)
    return APIError(500, message, type_="server_error")
