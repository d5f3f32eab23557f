"""What every route of `tandem serve` shares: its settings, the context routes reach through the
request (the backend, the body limits, the clean-up of work whose client went away), and the
helpers that bound a wait by a deadline and by the client still being there."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from server.protocol import APIError, Generation

log = logging.getLogger("tandem.serve")
DISCONNECT_POLL_S = 0.25


@dataclass(slots=True)
class ServeConfig:
    request_timeout_s: float = 600.0  # a request still unanswered then gets 504 and its job is cancelled
    max_body_bytes: int = 32 << 20  # bigger bodies get 413
    served_model_name: str | None = None  # the name to answer to (default: what the workers serve)
    # When set, every endpoint but /health wants "Authorization: Bearer <api_key>" (vLLM's --api-key).
    api_key: str | None = None


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class ServerContext:
    """One per app (`app.state.tandem`): the backend, the settings, and the tasks started to
    cancel the work of requests that went away (awaited when the app stops)."""

    def __init__(self, backend, config: ServeConfig) -> None:
        self.backend = backend
        self.config = config
        self.background: set[asyncio.Task] = set()

    def later(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def timeout_of(self, gen: Generation) -> float:
        return min(gen.timeout_s or self.config.request_timeout_s, self.config.request_timeout_s)

    def check_length(self, request: Request) -> None:
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body has {length} bytes; at most {limit} are allowed")

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes the limit (chunked uploads too)."""
        self.check_length(request)
        limit = self.config.max_body_bytes
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_json(self, request: Request) -> Any:
        body = await self.read_body(request)
        try:
            return json.loads(body)
        except ValueError:
            raise APIError(400, "the request body must be JSON", "body") from None


def context(request: Request) -> ServerContext:
    return request.app.state.tandem


def sse_data(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def failure(event: dict) -> APIError:
    """The HTTP error of a job's final failed or cancelled event."""
    from server.backends import job_error

    if event["type"] == "cancelled":
        return APIError(503, "the request was cancelled")
    return job_error(event)


async def close_stream(stream, events) -> None:
    """Cancel a generation whose client went away, and close its event iterator."""
    try:
        await stream.cancel()
    except Exception:
        log.warning("could not cancel %s", stream.id, exc_info=True)
    try:
        await events.aclose()
    except Exception:  # noqa: BLE001
        pass


async def within(awaitable: Awaitable, deadline: float, request: Request):
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


def require_api_key(request: Request) -> None:
    """The API key check, a dependency of every router but /health's. Compared in constant
    time (hmac.compare_digest), so the answer's timing says nothing of how much of a guess
    was right; a missing or wrong key is 401 in OpenAI's shape, with the same message."""
    key = context(request).config.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            type_="invalid_request_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
