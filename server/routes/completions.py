"""OpenAI's endpoints: /v1/completions and /v1/chat/completions, as JSON or as
server-sent events. Requests are checked by server/protocol.py; the backend runs them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server import protocol
from server.common import ServerContext, close_stream, context, failure, sse_data, within
from server.protocol import APIError, Generation
from server.routes.models import resolve_model

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await run(protocol.parse_completion(await context(request).read_json(request)), request)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await run(protocol.parse_chat(await context(request).read_json(request)), request)


async def run(gen: Generation, request: Request) -> Response:
    ctx = context(request)
    served = await resolve_model(ctx, gen)
    model = served["id"]
    if gen.kind == "chat" and "max_tokens" not in gen.job:
        # As vLLM: a chat answer may use what the context leaves (the engine caps it there).
        gen.job["max_tokens"] = int(served["max_model_len"] or 2048)
    timeout = ctx.timeout_of(gen)
    deadline = time.monotonic() + timeout
    stream = await ctx.backend.generate(gen, timeout)
    events = stream.events()
    try:
        first = await within(events.__anext__(), deadline, request)
    except StopAsyncIteration:
        first = {"type": "failed", "error": "the job ended without a result"}
    except BaseException:
        ctx.later(close_stream(stream, events))
        raise
    if first["type"] in ("failed", "cancelled"):
        await events.aclose()
        raise failure(first)
    if gen.stream:
        return StreamingResponse(
            sse(ctx, gen, model, stream, events, first, deadline),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def collect() -> tuple[str, str | None]:
        parts, event = [], first
        while True:
            parts.append(event.get("text", ""))
            if event["type"] == "done":
                return "".join(parts), event.get("finish_reason")
            if event["type"] in ("failed", "cancelled"):
                raise failure(event)
            event = await events.__anext__()

    try:  # one watch over the whole answer: its deadline, and the client still being there
        text, finish = await within(collect(), deadline, request)
    except BaseException:
        ctx.later(close_stream(stream, events))
        raise
    return JSONResponse(protocol.response(gen, model, text, finish, await stream.usage()))


async def sse(
    ctx: ServerContext, gen: Generation, model: str, stream, events: AsyncIterator[dict], first: dict, deadline: float
) -> AsyncIterator[bytes]:
    finished = False
    try:
        if gen.kind == "chat":
            yield sse_data(protocol.chunk(gen, model, "", role=True))
        event = first
        while True:
            kind = event["type"]
            if kind in ("failed", "cancelled"):
                yield sse_data(failure(event).body())
                finished = True
                break
            text = event.get("text", "")
            if kind == "done":
                yield sse_data(protocol.chunk(gen, model, text, event.get("finish_reason")))
                finished = True
                if gen.include_usage:
                    yield sse_data(protocol.chunk(gen, model, None, use=await stream.usage(), no_choices=True))
                break
            if text:
                yield sse_data(protocol.chunk(gen, model, text))
            try:
                event = await asyncio.wait_for(events.__anext__(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                yield sse_data(APIError(504, f"the request took longer than its {ctx.timeout_of(gen):g} s").body())
                break
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away, or the deadline passed: stop the work
            ctx.later(close_stream(stream, events))
