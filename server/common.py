"""What every route of `tandem serve` shares: its settings, the context routes reach through the
request (the backend, the body limits, the clean-up of work whose client went away), and the
helpers that bound a wait by a deadline and by the client still being there."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from server.admission import TenantAdmission
from server.protocol import APIError, Generation
from server.tenants import DEFAULT_TENANT, Tenant, TenantTable

log = logging.getLogger("tandem.serve")
DISCONNECT_POLL_S = 0.25


@dataclass(slots=True)
class ServeConfig:
    request_timeout_s: float = 600.0  # a request still unanswered then gets 504 and its job is cancelled
    max_body_bytes: int = 32 << 20  # bigger bodies get 413
    served_model_name: str | None = None  # the name to answer to (default: what the workers serve)
    # When set, every endpoint but /health wants "Authorization: Bearer <api_key>" (vLLM's --api-key);
    # several keys, separated by commas, give several clients each their own jobs.
    api_key: str | None = None
    # Tenants (--tenants FILE, server/tenants.py): each one's keys, weight and limits. Their keys
    # are accepted too; a key of api_key not named here is a tenant of its own.
    tenants: tuple[Tenant, ...] = ()
    # A stream with nothing to send sends an SSE comment this often, so that proxies and clients
    # with read timeouts do not take a long prompt's wait (or a queued job) for a dead server.
    keepalive_s: float = 10.0
    # A request body not received in full this long after its headers gets 408 (a client that
    # trickles its body, or never ends a chunked one, would hold the request open forever).
    body_timeout_s: float = 30.0
    # A connection that has not sent a request's headers this long after it opened (or after its
    # previous answer) is closed (server/h11_guard.py; uvicorn has no such limit).
    header_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "keepalive_s", "body_timeout_s", "header_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")
        if not isinstance(self.tenants, tuple) or not all(isinstance(t, Tenant) for t in self.tenants):
            raise ValueError(f"tenants must be a tuple of server.tenants.Tenant, got {self.tenants!r}")


# An answer before the whole body was read closes the connection: uvicorn would otherwise go on
# reading (and dropping) the rest, forever for a chunked body that never ends.
_CLOSE = {"Connection": "close"}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class ServerContext:
    """One per app (`app.state.tandem`): the backend, the settings, and the tasks started to
    cancel the work of requests that went away (awaited when the app stops)."""

    def __init__(self, backend, config: ServeConfig, clock=time.monotonic) -> None:
        self.backend = backend
        self.config = config
        self.background: set[asyncio.Task] = set()
        self.tenants = TenantTable.build(config.tenants, api_keys(config))
        self.admission = TenantAdmission(self.tenants.tenants, clock)

    async def payloads(self) -> list[dict]:
        """What /metrics renders: the backend's payloads, and this server's tenants'."""
        tenants = {"instance": "server", "kind": "tenants", "tenants": self.admission.payload()}
        return [*await self.backend.payloads(), tenants]

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
            raise APIError(413, f"the request body has {length} bytes; at most {limit} are allowed", headers=_CLOSE)

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes the limit (chunked uploads too), and
        with 408 when it has not all come within body_timeout_s."""
        self.check_length(request)
        limit, timeout = self.config.max_body_bytes, self.config.body_timeout_s
        chunks, size = [], 0
        try:
            async with asyncio.timeout(timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise APIError(413, f"the request body is larger than {limit} bytes", headers=_CLOSE)
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(
                408, f"the request body did not arrive within {timeout:g} s", "body", headers=_CLOSE
            ) from None
        return b"".join(chunks)

    async def read_json(self, request: Request) -> Any:
        body = await self.read_body(request)
        try:
            obj = json.loads(body)
        except ValueError:
            raise APIError(400, "the request body must be JSON (UTF-8)", "body") from None
        except RecursionError:  # json's C scanner recurses per nesting level: 100,000 '[' hit the limit
            raise APIError(400, "the request body nests too deeply", "body") from None
        if _SURROGATE.search(body):  # only a \u escape can make one: the bytes were valid UTF-8
            where = lone_surrogate(obj)
            if where is not None:
                raise APIError(400, f"{where} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is no text", where)
        return obj


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate(obj: Any) -> str | None:
    """The path (like messages[0].content) of the first string in `obj` with a lone surrogate,
    which json.loads lets through and every encoder after it refuses; None if there is none.
    Iterative: the body may nest as deeply as json.loads allows."""
    todo: list[tuple[str, Any]] = [("", obj)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for k, v in value.items():
                todo.append((f"{path}.{k}" if path else str(k), k))  # a key may hold one too
                todo.append((f"{path}.{k}" if path else str(k), v))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def owner_of(request: Request) -> str | None:
    """Contract G's job owner: a hash of the caller's API key (None when the server has none),
    so that one key's jobs are invisible to another. The key has passed require_api_key."""
    if not context(request).tenants.keyed:
        return None
    given = request.headers.get("authorization", "").partition(" ")[2].strip()
    return hashlib.sha256(b"tandem-owner:" + given.encode()).hexdigest()[:32]


# The keep-alive is a blank line, not an SSE comment (": keep-alive"). Both are valid SSE, but
# readers that strip each network chunk before splitting on the blank line (`vllm bench serve`'s,
# and many hand-written ones) keep a stripped comment in their buffer, where it merges with every
# later event and none of them parses: a queued stream then read as empty. Whitespace strips to
# nothing, so it cannot merge; and it still resets a client's read timeout, as the comment did.
KEEPALIVE = b"\n\n"
TICK = None  # what `ticking` yields when `interval` passed without an item


async def ticking(items: AsyncIterator, interval: float, deadline: float | None = None) -> AsyncIterator:
    """The items of `items`, and TICK whenever `interval` seconds pass without one (the caller
    sends KEEPALIVE then); TimeoutError at `deadline`. The pending read is a task kept
    across ticks: cancelling an async generator's __anext__ on each tick would end it."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(items.__anext__())
            wait = interval if deadline is None else min(interval, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError()
            done, _ = await asyncio.wait({pending}, timeout=wait)
            if not done:
                if deadline is None or time.monotonic() < deadline:
                    yield TICK
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        # No await: this may run in a cancelled scope (the client went away), where it would raise.
        if pending is not None:
            pending.cancel()
            pending.add_done_callback(_retrieve)


def context(request: Request) -> ServerContext:
    return request.app.state.tandem


def sse_data(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def failure(event) -> APIError:
    """The HTTP error of a job's final failed or cancelled event (a workers.events.JobEvent)."""
    from server.backends import job_error

    if event.type == "cancelled":
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
            # The work may still end with its own error (a job cancelled as the client left):
            # retrieved here, so that asyncio logs no "exception was never retrieved" traceback.
            task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def api_keys(config: ServeConfig) -> tuple[str, ...]:
    """The keys the server accepts: `api_key` holds one, or several separated by commas (one
    per client, so that each client's jobs are its own: see owner_of)."""
    if config.api_key is None:
        return ()
    return tuple(k.strip() for k in config.api_key.split(",") if k.strip())


def require_api_key(request: Request) -> None:
    """The API key check, a dependency of every router but /health's, which also names the
    request's tenant (request.state.tenant, server/tenants.py: the key's). Compared in constant
    time (hmac.compare_digest), so the answer's timing says nothing of how much of a guess was
    right; a missing or wrong key is 401 in OpenAI's shape, with the same message."""
    table = context(request).tenants
    if not table.keyed:
        request.state.tenant = DEFAULT_TENANT
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    tenant = table.tenant_of(given.strip())
    if scheme.lower() != "bearer" or tenant is None:
        raise APIError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            type_="invalid_request_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
    request.state.tenant = tenant.name


def tenant_of(request: Request) -> str:
    """The request's tenant, as require_api_key named it."""
    return getattr(request.state, "tenant", None) or DEFAULT_TENANT


def claimed_tenant(request: Request, claimed: object, field: str = "tenant") -> str:
    """The request's tenant, checked against a `tenant` field it sent: the tenant comes from the
    API key, so a field naming another tenant is refused (400 naming it), never obeyed nor
    dropped; naming its own tenant is allowed."""
    tenant = tenant_of(request)
    if claimed is not None and claimed != tenant:
        who = "your API key's" if context(request).tenants.keyed else "anonymous traffic's (this server has no keys)"
        raise APIError(
            400,
            f"{field} must be absent or {tenant!r} ({who} tenant): a request cannot name another tenant",
            field,
        )
    return tenant
