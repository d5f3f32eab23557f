"""OpenAI's endpoints: /v1/completions and /v1/chat/completions, as JSON or as server-sent
events. Requests are checked by server/protocol.py, answers shaped by server/responses.py; the
backend runs them. A chat answer's tool calls come as the job's tool_call / tool_args events
(workers/events.py), parsed where the model ran: message.tool_calls, or delta.tool_calls
entries as they stream.

n choices are n jobs, each with its own seed (protocol.choice_seed), run at once and merged:
the answer lists them by index, a stream interleaves their chunks (each names its choice), and
usage counts the prompt once. A client that goes away, a deadline, or one choice failing
cancels them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server import openapi, protocol, responses
from server.common import (
    KEEPALIVE,
    TICK,
    ServerContext,
    close_stream,
    context,
    failure,
    log,
    owner_of,
    sse_data,
    ticking,
    within,
)
from server.protocol import APIError, Generation
from server.routes.models import resolve_model
from workers.events import CANCELLED, DONE, FAILED, TOOL_KINDS, JobEvent

router = APIRouter()


@router.post("/v1/completions", openapi_extra=openapi.request_body("Completion"))
async def completions(request: Request) -> Response:
    return await run(protocol.parse_completion(await context(request).read_json(request)), request)


@router.post("/v1/chat/completions", openapi_extra=openapi.request_body("ChatCompletion"))
async def chat_completions(request: Request) -> Response:
    return await run(protocol.parse_chat(await context(request).read_json(request)), request)


@dataclasses.dataclass(slots=True)
class Choice:
    """One choice's job, and how far its answer has come."""

    index: int
    stream: object  # backends.Stream
    events: AsyncIterator[JobEvent]
    text_offset: int = 0  # characters sent so far (the completions API's text_offset)
    done: bool = False


def check_fits(gen: Generation, max_model_len: int | None) -> None:
    """What the served model's context refuses without a tokenizer: max_tokens past the whole
    context, and a prompt whose size alone proves it too long (the prompt-dependent check is the
    engine's, and comes back as the job's failure)."""
    if not max_model_len:
        return
    mt = gen.job.get("max_tokens")
    if mt is not None and mt > max_model_len:
        name = gen.max_tokens_name
        raise protocol.bad(name, f"{name} must be at most max_model_len ({max_model_len}), got {protocol.clip(mt)}")
    prompt = gen.job.get("prompt")
    if isinstance(prompt, list) and len(prompt) > max_model_len:
        raise protocol.bad("prompt", f"prompt has {len(prompt)} tokens; max_model_len is {max_model_len}")
    size = gen.prompt_bytes()
    if size > max_model_len * protocol.MAX_BYTES_PER_TOKEN:
        name = "messages" if gen.kind == "chat" else "prompt"
        raise protocol.bad(
            name,
            f"{name} has {size} bytes: longer than max_model_len ({max_model_len} tokens) whatever the tokenizer",
        )


async def run(gen: Generation, request: Request) -> Response:
    ctx = context(request)
    served = await resolve_model(ctx, gen)
    model = served["id"]
    check_fits(gen, served.get("max_model_len"))
    if gen.kind == "chat" and "max_tokens" not in gen.job:
        gen.job["max_tokens"] = None  # contract A: what the context leaves after the prompt (vLLM's chat default)
    timeout = ctx.timeout_of(gen)
    deadline = time.monotonic() + timeout
    owner = owner_of(request)  # contract G: with several API keys, this key's jobs are its own
    choices: list[Choice] = []
    firsts: list[asyncio.Future] = []
    try:
        for i in range(gen.n):
            stream = await ctx.backend.generate(dataclasses.replace(gen, job=gen.choice_job(i)), timeout, owner=owner)
            choices.append(Choice(i, stream, stream.events()))
            firsts.append(asyncio.ensure_future(_next(choices[-1])))
        # A refusal (a prompt too long, say) comes at once, and is an HTTP error even for a
        # stream; a stream whose first token takes longer (a queued job) starts anyway, so that
        # it can send keep-alives while it waits, and reports a later failure in the stream.
        wait = min(deadline, time.monotonic() + ctx.config.keepalive_s) if gen.stream else deadline
        try:
            await within(asyncio.wait(firsts), wait, request)
        except APIError:
            if not gen.stream or time.monotonic() >= deadline:
                raise
        for f in firsts:
            event = f.result() if f.done() else None
            if event is not None and event.type in (FAILED, CANCELLED):
                raise failure(event)
    except BaseException:
        for f in firsts:
            f.cancel()
        cancel(ctx, choices)
        raise
    if gen.stream:
        return StreamingResponse(
            sse(ctx, gen, model, choices, firsts, deadline),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:  # one watch over the whole answer: its deadline, and the client still being there
        answers = await within(
            asyncio.gather(*(_collect(gen, c, f.result()) for c, f in zip(choices, firsts))), deadline, request
        )
    except BaseException:
        cancel(ctx, choices)
        raise
    use = responses.merged_usage([await x.stream.usage() for x in choices])
    return JSONResponse(responses.response(gen, model, answers, use))


def cancel(ctx: ServerContext, choices: list[Choice]) -> None:
    """Stop the jobs of the choices not done (later: this may run where awaiting is cancelled)."""
    for c in choices:
        if not c.done:
            c.done = True
            ctx.later(close_stream(c.stream, c.events))


async def _next(c: Choice) -> JobEvent:
    try:
        event = await c.events.__anext__()
    except StopAsyncIteration:
        event = JobEvent(FAILED, error="the job ended without a result")
    if event.final:
        c.done = True
    return event


async def _collect(gen: Generation, c: Choice, first: JobEvent) -> dict:
    parts, entries, calls, event = [], [], responses.ToolCalls(), first
    while True:
        if event.type in TOOL_KINDS:
            calls.add(event)
        parts.append(event.text)
        entries.extend(event.logprobs or ())
        if event.type == DONE:
            text = (gen.job["prompt"] if gen.echo else "") + "".join(parts)
            lp = responses.logprobs_of(gen, entries)
            reason, stop, tool_calls = event.finish_reason, event.stop_reason, calls.to_openai()
            return responses.choice(gen, c.index, text, reason, stop, lp, tool_calls)
        if event.type in (FAILED, CANCELLED):
            raise failure(event)
        event = await _next(c)


async def _pump(c: Choice, first: asyncio.Future, queue: asyncio.Queue) -> None:
    """Choice c's events into the shared queue, until its final one. A read that fails (the
    job's key gone after a Redis restart without its AOF: 404; a replica after a failover:
    ReadOnlyError) ends the choice with a failed event naming the job: nobody awaits this task,
    and without that event the stream would send keep-alives until the request's timeout."""
    try:
        event = await first
        while True:
            await queue.put((c, event))
            if event.final:
                return
            event = await _next(c)
    except Exception as exc:  # noqa: BLE001 - reported in the stream, as the choice's failure
        await queue.put((c, lost_event(c.stream.id, exc)))


def lost_event(job_id: str, exc: BaseException) -> JobEvent:
    """The final event of a choice whose events could no longer be read."""
    why = exc.message if isinstance(exc, APIError) else f"{type(exc).__name__}: {exc}"
    return JobEvent(
        FAILED,
        job_id=job_id,
        finish_reason="abort",
        error=f"lost the events of job {job_id} ({why}); GET /v1/jobs/{job_id} for its state",
    )


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def _drain(queue: asyncio.Queue) -> AsyncIterator:
    while True:
        yield await queue.get()


async def sse(
    ctx: ServerContext,
    gen: Generation,
    model: str,
    choices: list[Choice],
    firsts: list[asyncio.Future],
    deadline: float,
) -> AsyncIterator[bytes]:
    queue: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(c, f, queue)) for c, f in zip(choices, firsts)]
    ended = False  # the answer (or its error) was sent: anything left running is not a disconnect
    try:
        for c in choices:
            if gen.kind == "chat":
                yield sse_data(responses.chunk(gen, model, "", index=c.index, role=True))
            elif gen.echo:
                yield sse_data(responses.chunk(gen, model, gen.job["prompt"], index=c.index))
        left = len(choices)
        try:
            ticks = contextlib.aclosing(ticking(_drain(queue), ctx.config.keepalive_s, deadline))
            async with ticks as items:
                async for item in items:
                    if item is TICK:
                        yield KEEPALIVE
                        continue
                    c, event = item
                    kind = event.type
                    if kind in (FAILED, CANCELLED):
                        ended = True
                        yield sse_data(failure(event).body())
                        break
                    if kind in TOOL_KINDS:
                        delta = [responses.tool_call_delta(event)]
                        yield sse_data(responses.chunk(gen, model, None, index=c.index, tool_calls=delta))
                        continue
                    text = event.text
                    lp = responses.logprobs_of(gen, event.logprobs, c.text_offset)
                    c.text_offset += sum(len(e["token"]) for e in event.logprobs or ())
                    if kind == DONE:
                        c.done = True
                        left -= 1
                        reason, stop = event.finish_reason, event.stop_reason
                        yield sse_data(
                            responses.chunk(gen, model, text, reason, index=c.index, logprobs=lp, stop_reason=stop)
                        )
                        if not left:
                            ended = True
                            if gen.include_usage:
                                use = responses.merged_usage([await x.stream.usage() for x in choices])
                                yield sse_data(responses.chunk(gen, model, None, use=use, no_choices=True))
                            break
                    elif text or lp:
                        yield sse_data(responses.chunk(gen, model, text, index=c.index, logprobs=lp))
        except TimeoutError:
            ended = True
            yield sse_data(APIError(504, f"the request took longer than its {ctx.timeout_of(gen):g} s").body())
        yield b"data: [DONE]\n\n"
    finally:
        # No awaiting here: when the client went away this runs inside a cancelled scope.
        for p in [*pumps, *firsts]:
            p.cancel()
            p.add_done_callback(_retrieve)  # a first that failed is the pump's to report: not logged again
        running = [c.stream.id for c in choices if not c.done]
        cancel(ctx, choices)
        if running and not ended:
            log.info("client went away mid-stream; cancelled %s", ", ".join(running))
