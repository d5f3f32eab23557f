"""OpenAI's endpoints: /v1/completions and /v1/chat/completions, as JSON or as server-sent
events. Requests are checked by server/protocol.py, answers shaped by server/responses.py; the
backend runs them. A chat answer's tool calls come as the job's tool_call / tool_args events
(workers/events.py), parsed where the model ran: message.tool_calls, or delta.tool_calls
entries as they stream.

n choices are one job (the engine forks them from one prefill; best_of > n keeps the n of
highest cumulative logprob): its token events name their choice, each choice ends with a
choice_end event, and the answer lists the choices by index, or a stream sends each choice's
chunks under its index. Usage is the job's: the prompt once, every choice's tokens. echo puts
the prompt's text (and with logprobs, the prompt event's logprobs) before each choice's.
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
from server.admission import Rejected, Ticket, estimate_tokens
from server.common import (
    KEEPALIVE,
    TICK,
    ServerContext,
    claimed_tenant,
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
from server.tenants import DEFAULT_TENANT
from workers.events import CANCELLED, CHOICE_END, DONE, FAILED, PROMPT, TOKEN, TOOL_KINDS, JobEvent

# Tokens a request without max_tokens (a chat's default: what the context leaves) is charged
# at admission against its tenant's tokens_per_minute, before its usage reconciles them.
DEFAULT_MAX_TOKENS_ESTIMATE = 256

router = APIRouter()


@router.post("/v1/completions", openapi_extra=openapi.request_body("Completion"))
async def completions(request: Request) -> Response:
    return await run(protocol.parse_completion(await context(request).read_json(request)), request)


@router.post("/v1/chat/completions", openapi_extra=openapi.request_body("ChatCompletion"))
async def chat_completions(request: Request) -> Response:
    return await run(protocol.parse_chat(await context(request).read_json(request)), request)


@dataclasses.dataclass(slots=True)
class Job:
    """The request's job, and whether its events have ended."""

    stream: object  # backends.Stream
    events: AsyncIterator[JobEvent]
    ticket: Ticket | None = None  # its tenant's admission (server/admission.py), until it ends
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
    ticket = admit(ctx, request, gen)
    job: Job | None = None
    first: asyncio.Future | None = None
    try:
        stream = await ctx.backend.generate(gen, timeout, owner=owner)
        job = Job(stream, stream.events(), ticket)
        first = asyncio.ensure_future(_next(job))
        # A refusal (a prompt too long, say) comes at once, and is an HTTP error even for a
        # stream; a stream whose first event takes longer (a queued job) starts anyway, so that
        # it can send keep-alives while it waits, and reports a later failure in the stream.
        wait = min(deadline, time.monotonic() + ctx.config.keepalive_s) if gen.stream else deadline
        try:
            await within(asyncio.wait({first}), wait, request)
        except APIError:
            if not gen.stream or time.monotonic() >= deadline:
                raise
        event = first.result() if first.done() else None
        if event is not None and event.type in (FAILED, CANCELLED):
            raise failure(event)
    except BaseException:
        if first is not None:
            first.cancel()
        if ticket.queued:  # refused, or gone, before anything ran: its tokens go back
            ticket.finish(0, 0)
        cancel(ctx, job)
        ticket.finish()
        raise
    if gen.stream:
        return StreamingResponse(
            sse(ctx, gen, model, job, first, deadline),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:  # one watch over the whole answer: its deadline, and the client still being there
        answer = await within(_collect(gen, job, first.result()), deadline, request)
    except BaseException:
        cancel(ctx, job)
        raise
    use = await job.stream.usage()
    return JSONResponse(responses.response(gen, model, answer.to_choices(), use, answer.prompt))


def admit(ctx: ServerContext, request: Request, gen: Generation) -> Ticket:
    """The request's place among its tenant's (server/admission.py): its tenant from its API
    key (a `tenant` field naming another is 400), its tokens estimated; 429 with Retry-After
    past one of the tenant's limits."""
    tenant = claimed_tenant(request, gen.job.pop("tenant", None))
    if tenant != DEFAULT_TENANT:  # the anonymous tenant is the engine's default: nothing to send
        gen.job["tenant"] = tenant
    choices = max(gen.n, gen.job.get("best_of") or 1)
    mt = gen.job.get("max_tokens")
    mt = (mt if isinstance(mt, int) else DEFAULT_MAX_TOKENS_ESTIMATE) * choices
    num_tokens = estimate_tokens(gen.job.get("prompt"), gen.prompt_bytes(), mt, 0)
    try:
        return ctx.admission.admit(tenant, num_tokens)
    except Rejected as exc:
        raise APIError(429, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from None


def cancel(ctx: ServerContext, job: Job | None) -> None:
    """Stop the job if its events have not ended (later: this may run where awaiting is cancelled)."""
    if job is not None and not job.done:
        job.done = True
        if job.ticket is not None:
            job.ticket.finish()  # its slot back; the tokens estimated stay charged
        ctx.later(close_stream(job.stream, job.events))


async def _next(job: Job) -> JobEvent:
    try:
        event = await job.events.__anext__()
    except StopAsyncIteration:
        event = JobEvent(FAILED, error="the job ended without a result")
    ticket = job.ticket
    if ticket is not None:
        ticket.started()
        if event.type in (TOKEN, DONE, *TOOL_KINDS):
            ticket.token()
    if event.final:
        job.done = True
        if ticket is not None:
            use = await job.stream.usage() if event.type == DONE else {}
            ticket.finish(use.get("prompt_tokens"), use.get("completion_tokens"))
    return event


async def _collect(gen: Generation, job: Job, event: JobEvent) -> responses.Answer:
    answer = responses.Answer(gen)
    while True:
        answer.add(event)
        if event.type == DONE:
            return answer
        if event.type in (FAILED, CANCELLED):
            raise failure(event)
        event = await _next(job)


async def _events(job: Job, first: asyncio.Future) -> AsyncIterator[JobEvent]:
    """The job's events, from its first, until its final one. A read that fails (the job's key
    gone after a Redis restart without its AOF: 404; a replica after a failover: ReadOnlyError)
    ends them with a failed event naming the job: without it the stream would send keep-alives
    until the request's timeout."""
    try:
        event = await first
        while True:
            yield event
            if event.final:
                return
            event = await _next(job)
    except Exception as exc:  # noqa: BLE001 - reported in the stream, as the job's failure
        yield lost_event(job.stream.id, exc)


def lost_event(job_id: str, exc: BaseException) -> JobEvent:
    """The final event of a job whose events could no longer be read."""
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


def _chunks(gen: Generation, model: str, answer: responses.Answer, event: JobEvent) -> list[dict]:
    """The chunks one event makes: a choice's text (and logprobs), its tool call deltas, its end;
    the echoed prompt of each choice, when its logprobs come (the prompt event)."""
    chunk = responses.chunk
    kind = event.type
    if kind == DONE:  # a job of one: its choice's end (a job of n ended each with choice_end)
        left = [x for x in answer.choices if not x.ended]
        answer.add(event)
        reason, stop = event.finish_reason, event.stop_reason
        return [chunk(gen, model, event.text, reason, index=x.index, stop_reason=stop) for x in left]
    c = answer.add(event)
    if kind == PROMPT:
        if not (gen.echo and gen.logprobs is not None):
            return []
        lp = responses.logprobs_of(gen, answer.prompt)
        width = sum(len(e["token"]) for e in answer.prompt or ())
        for x in answer.choices:
            x.text_offset = width
        return [chunk(gen, model, answer.echoed(), index=x.index, logprobs=lp) for x in answer.choices]
    if c is None:
        return []
    if kind in TOOL_KINDS:
        return [chunk(gen, model, None, index=c.index, tool_calls=[responses.tool_call_delta(event)])]
    lp = responses.logprobs_of(gen, event.logprobs, c.text_offset)
    c.text_offset += sum(len(e["token"]) for e in event.logprobs or ())
    if kind == CHOICE_END:
        return [chunk(gen, model, event.text, event.finish_reason, index=c.index, stop_reason=event.stop_reason)]
    if event.text or lp:
        return [chunk(gen, model, event.text, index=c.index, logprobs=lp)]
    return []


async def sse(
    ctx: ServerContext,
    gen: Generation,
    model: str,
    job: Job,
    first: asyncio.Future,
    deadline: float,
) -> AsyncIterator[bytes]:
    answer = responses.Answer(gen)
    events = _events(job, first)
    ended = False  # the answer (or its error) was sent: anything left running is not a disconnect
    try:
        for x in answer.choices:
            if gen.kind == "chat":
                yield sse_data(responses.chunk(gen, model, "", index=x.index, role=True))
            elif gen.echo and gen.logprobs is None:  # with logprobs: when the prompt's come
                yield sse_data(responses.chunk(gen, model, gen.job["prompt"], index=x.index))
        try:
            ticks = contextlib.aclosing(ticking(events, ctx.config.keepalive_s, deadline))
            async with ticks as items:
                async for event in items:
                    if event is TICK:
                        yield KEEPALIVE
                        continue
                    if event.type in (FAILED, CANCELLED):
                        ended = True
                        yield sse_data(failure(event).body())
                        break
                    for item in _chunks(gen, model, answer, event):
                        yield sse_data(item)
                    if event.type == DONE:
                        ended = True
                        if gen.include_usage:
                            use = await job.stream.usage()
                            yield sse_data(responses.chunk(gen, model, None, use=use, no_choices=True))
                        break
        except TimeoutError:
            ended = True
            yield sse_data(APIError(504, f"the request took longer than its {ctx.timeout_of(gen):g} s").body())
        yield b"data: [DONE]\n\n"
    finally:
        # No awaiting here: when the client went away this runs inside a cancelled scope.
        first.cancel()
        first.add_done_callback(_retrieve)  # a first that failed is the events' to report: not logged again
        running = job.stream.id if not job.done else None
        cancel(ctx, job)
        if running and not ended:
            log.info("client went away mid-stream; cancelled %s", running)
