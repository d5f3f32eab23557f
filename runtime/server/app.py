"""The HTTP layer of `tandem serve`: OpenAI's endpoints, the job API, detection, health and
metrics, over a backend (backends.py). It only translates: requests are checked here
(protocol.py), the work runs in the workers or the embedded Runtime.

    POST /v1/completions, /v1/chat/completions     OpenAI, JSON or server-sent events
    GET  /v1/models
    POST /v1/jobs   GET /v1/jobs/{id}   GET /v1/jobs/{id}/events   DELETE /v1/jobs/{id}
    POST /v1/detect                                 an uploaded image, or {"url"} / {"path"}
    GET  /health    GET /metrics

A client that goes away cancels its work: a stream's generator is closed by the server when
the client disconnects; a plain request's wait races a disconnect watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.server import protocol
from runtime.server.protocol import APIError, Generation

log = logging.getLogger("tandem.serve")
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@dataclass(slots=True)
class ServeConfig:
    request_timeout_s: float = 600.0  # a request still unanswered then gets 504 and its job is cancelled
    max_body_bytes: int = 32 << 20  # bigger bodies get 413
    served_model_name: str | None = None  # the name to answer to (default: what the workers serve)


def create_app(backend, config: ServeConfig | None = None) -> FastAPI:
    config = config or ServeConfig()
    background: set[asyncio.Task] = set()  # cancellations started while a request went away

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        if background:
            await asyncio.gather(*background, return_exceptions=True)
        await backend.close()

    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.backend = backend

    def later(coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        background.add(task)
        task.add_done_callback(background.discard)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ValueError)
    async def _value_error(_request: Request, exc: ValueError) -> JSONResponse:
        message = str(exc)
        return JSONResponse(APIError(400, message, protocol.param_of(message)).body(), status_code=400)

    @app.exception_handler(ClientGone)
    async def _client_gone(_request: Request, _exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody to answer; its work was cancelled

    async def _redis_down(_request: Request, exc: Exception) -> JSONResponse:
        # A Redis restart, usually: worth a retry, and no reason for a traceback per request.
        err = APIError(503, f"the job store (Redis) is unreachable: {exc}", headers={"Retry-After": "2"})
        return JSONResponse(err.body(), status_code=503, headers=err.headers)

    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    app.add_exception_handler(RedisConnectionError, _redis_down)
    app.add_exception_handler(RedisTimeoutError, _redis_down)

    @app.exception_handler(Exception)
    async def _internal(request: Request, _exc: Exception) -> JSONResponse:
        # One request's bug, not the server's end. (A plain exception handler, not an HTTP
        # middleware: Starlette's BaseHTTPMiddleware would hide a client's disconnect.)
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, "internal server error", type_="server_error").body(), status_code=500)

    def check_length(request: Request) -> None:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise APIError(413, f"the request body has {length} bytes; at most {config.max_body_bytes} are allowed")

    async def read_json(request: Request) -> Any:
        body = await read_body(request)
        try:
            return json.loads(body)
        except ValueError:
            raise APIError(400, "the request body must be JSON", "body") from None

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes the limit (chunked uploads too)."""
        check_length(request)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise APIError(413, f"the request body is larger than {config.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    # ---- models ---------------------------------------------------------------------------------

    async def served_models() -> dict[str, dict]:
        models: dict[str, dict] = {}
        for w in await backend.workers():
            if w.get("model_name"):
                name = config.served_model_name or w["model_name"]
                models.setdefault(name, {"id": name, "max_model_len": w.get("max_model_len")})
        return models

    async def resolve_model(gen: Generation) -> dict:
        """The served model the request names (the only one, if it names none)."""
        models = await served_models()
        if not models:
            raise APIError(503, "no worker serving an LLM is up yet; retry later", headers={"Retry-After": "2"})
        if gen.model is None:
            return next(iter(models.values()))
        if gen.model not in models:
            raise APIError(404, f"the model {gen.model!r} does not exist; served: {sorted(models)}", "model")
        return models[gen.model]

    @app.get("/v1/models")
    async def list_models() -> dict:
        now = int(time.time())
        data = [{"id": m["id"], "object": "model", "created": now, "owned_by": "tandem",
                 "max_model_len": m["max_model_len"]} for m in (await served_models()).values()]  # fmt: skip
        return {"object": "list", "data": data}

    # ---- completions ------------------------------------------------------------------------------

    def timeout_of(gen: Generation) -> float:
        return min(gen.timeout_s or config.request_timeout_s, config.request_timeout_s)

    async def run(gen: Generation, request: Request) -> Response:
        served = await resolve_model(gen)
        model = served["id"]
        if gen.kind == "chat" and "max_tokens" not in gen.job:
            # As vLLM: a chat answer may use what the context leaves (the engine caps it there).
            gen.job["max_tokens"] = int(served["max_model_len"] or 2048)
        timeout = timeout_of(gen)
        deadline = time.monotonic() + timeout
        stream = await backend.generate(gen, timeout)
        events = stream.events()
        try:
            first = await _within(events.__anext__(), deadline, request)
        except StopAsyncIteration:
            first = {"type": "failed", "error": "the job ended without a result"}
        except BaseException:
            later(_close(stream, events))
            raise
        if first["type"] in ("failed", "cancelled"):
            await events.aclose()
            raise _failure(first)
        if gen.stream:
            return StreamingResponse(sse(gen, model, stream, events, first, deadline), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip

        async def collect() -> tuple[str, str | None]:
            parts, event = [], first
            while True:
                parts.append(event.get("text", ""))
                if event["type"] == "done":
                    return "".join(parts), event.get("finish_reason")
                if event["type"] in ("failed", "cancelled"):
                    raise _failure(event)
                event = await events.__anext__()

        try:  # one watch over the whole answer: its deadline, and the client still being there
            text, finish = await _within(collect(), deadline, request)
        except BaseException:
            later(_close(stream, events))
            raise
        return JSONResponse(protocol.response(gen, model, text, finish, await stream.usage()))

    async def sse(gen: Generation, model: str, stream, events: AsyncIterator[dict], first: dict,
                  deadline: float) -> AsyncIterator[bytes]:  # fmt: skip
        finished = False
        try:
            if gen.kind == "chat":
                yield _data(protocol.chunk(gen, model, "", role=True))
            event = first
            while True:
                kind = event["type"]
                if kind in ("failed", "cancelled"):
                    yield _data(_failure(event).body())
                    finished = True
                    break
                text = event.get("text", "")
                if kind == "done":
                    yield _data(protocol.chunk(gen, model, text, event.get("finish_reason")))
                    finished = True
                    if gen.include_usage:
                        yield _data(protocol.chunk(gen, model, None, use=await stream.usage(), no_choices=True))
                    break
                if text:
                    yield _data(protocol.chunk(gen, model, text))
                try:
                    event = await asyncio.wait_for(events.__anext__(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    yield _data(APIError(504, f"the request took longer than its {timeout_of(gen):g} s").body())
                    break
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away, or the deadline passed: stop the work
                later(_close(stream, events))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(protocol.parse_completion(await read_json(request)), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(protocol.parse_chat(await read_json(request)), request)

    # ---- jobs -------------------------------------------------------------------------------------

    def jobs_backend():
        if backend.mode != "jobs":
            raise APIError(501, "the job API keeps jobs in Redis: start `tandem serve` over workers, "
                                "without --embedded", type_="not_implemented")  # fmt: skip
        return backend

    @app.post("/v1/jobs", status_code=202)
    async def submit_job(request: Request) -> dict:
        b = jobs_backend()
        body = await read_json(request)
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
            job_id, created, state = await b.submit(name, body, job_id=job_id, priority=spec.priority,
                                                    max_tokens=max_tokens)  # fmt: skip
        except ValueError as exc:
            if "already used" in str(exc):  # the same job id with other arguments
                raise APIError(409, str(exc), "job_id", type_="conflict") from None
            raise
        return {"job_id": job_id, "state": state, "created": created}

    @app.get("/v1/jobs/{job_id}")
    async def job_status(job_id: str) -> dict:
        out = await jobs_backend().status(_job_id(job_id))
        if out is None:
            raise APIError(404, f"job {job_id} does not exist (or expired)", "job_id")
        return out

    @app.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: str, request: Request) -> Response:
        b = jobs_backend()
        job_id = _job_id(job_id)
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

    @app.delete("/v1/jobs/{job_id}")
    async def cancel_job(job_id: str) -> dict:
        outcome = await jobs_backend().cancel(_job_id(job_id))
        if outcome == "missing":
            raise APIError(404, f"job {job_id} does not exist (or expired)", "job_id")
        state = outcome.split(":", 1)[-1]  # "final:done": it had ended already
        return {"job_id": job_id, "cancelled": outcome in ("cancelled", "cancelling"), "state": state}

    # ---- vision -----------------------------------------------------------------------------------

    @app.post("/v1/detect")
    async def detect(request: Request) -> dict:
        ctype = request.headers.get("content-type", "")
        timeout = config.request_timeout_s
        if ctype.startswith("multipart/form-data"):
            # Read the body within the limit first (a chunked upload has no Content-Length to
            # check); the form parser then reads it from memory.
            request._body = await read_body(request)
            form = await request.form(max_part_size=config.max_body_bytes)
            try:
                upload = form.get("file") or form.get("image")
                if upload is None or isinstance(upload, str):
                    raise APIError(400, "upload the image as the form field 'file'", "file")
                data = await upload.read()
            finally:
                await form.close()
            if not data:
                raise APIError(400, "file: the uploaded image is empty", "file")
            kind, value = "image", data
        elif ctype.startswith("application/json"):
            body = await read_json(request)
            given = [k for k in ("url", "path", "image") if isinstance(body, dict) and body.get(k) is not None]
            if len(given) != 1:
                raise APIError(400, "give exactly one of url, path or image (base64), or upload a file", "body")
            kind, value = given[0], body[given[0]]
            if not isinstance(value, str) or not value:
                raise APIError(400, f"{kind} must be a non-empty string", kind)
            if kind == "image":
                from workers.jobspec import decode_image_b64

                value = decode_image_b64(value)
        else:
            kind, value = "image", await read_body(request)  # the raw image bytes
            if not value:
                raise APIError(400, "send an image: multipart field 'file', JSON {url|path|image}, or raw bytes")
        return await _within(backend.detect(kind, value, timeout), time.monotonic() + timeout, request)

    # ---- health and metrics -------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        try:
            info = await backend.health()
        except Exception as exc:  # noqa: BLE001 - unhealthy, and why
            return JSONResponse({"status": "unavailable", "mode": backend.mode, "error": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok", "mode": backend.mode, **info})

    @app.get("/metrics")
    async def metrics() -> Response:
        from runtime.metrics import render

        payloads = await backend.payloads()
        return Response(render(payloads), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


# ---- helpers --------------------------------------------------------------------------------------


_STREAM_ID = re.compile(r"\d{1,20}(-\d{1,20})?")


def _data(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _job_id(job_id: str) -> str:
    from workers.store import check_job_id

    try:
        return check_job_id(job_id)
    except ValueError as exc:
        raise APIError(400, str(exc), "job_id") from None


def _failure(event: dict) -> APIError:
    from runtime.server.backends import _job_error

    if event["type"] == "cancelled":
        return APIError(503, "the request was cancelled")
    return _job_error(event)


async def _close(stream, events) -> None:
    try:
        await stream.cancel()
    except Exception:  # noqa: BLE001 - best effort: a job left running finishes by itself
        log.warning("could not cancel %s", stream.id, exc_info=True)
    try:
        await events.aclose()
    except Exception:  # noqa: BLE001
        pass


async def _within(awaitable: Awaitable, deadline: float, request: Request):
    """Await `awaitable` until `deadline` (504) or until the client disconnects (ClientGone, so
    that the caller cancels the work behind it)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise APIError(504, "the request took longer than its timeout; it was cancelled")
            done, _ = await asyncio.wait({task}, timeout=min(left, DISCONNECT_POLL_S))
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
