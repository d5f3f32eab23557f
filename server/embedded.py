"""`tandem serve --embedded` in one process (`--no-engine-process`): a Runtime in the server's
own process, behind the same interface as the workers' backend (server/backends.py's Stream):
`generate()` returns a HandleStream, whose events are the ones a worker writes for the same
generation, made by the same translation (workers/choices.py), so that the routes cannot tell
the two apart.

The pieces that run next to the Runtime (starting a generation, its outputs as JobEvents, an
image checked and decoded for detection) are plain functions and classes with no event loop,
so that the engine process (server/engine_process.py) runs the very same ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import CancelledError, Future

from server import protocol
from server.backends import fleet_health
from server.protocol import APIError, Generation
from workers.choices import ChoiceState, OutputEvents
from workers.events import CANCELLED, DONE, FAILED, TOKEN, JobEvent
from workers.jobspec import check_tenancy, tenancy_kwargs
from workers.tool_stream import TOOL_FIELDS, ToolJob, ToolStream


def token_texts(tokenizer, params):
    """runtime/llm/detokenizer.py's TokenTexts when prompt logprobs are asked (the prompt event
    names the first prompt token), else None."""
    if params.prompt_logprobs is None or tokenizer is None:
        return None
    from runtime.llm.detokenizer import TokenTexts

    return TokenTexts(tokenizer)


class GenerationEvents:
    """A GenerationHandle's outputs as JobEvents, without waiting: `take()` turns what the handle
    holds now into events (workers/choices.py's OutputEvents, as a worker's; with a `tools`
    ToolStream, a tool job's text becomes content and tool events, as a worker's does), the last
    of them final once the generation ended (`ended`)."""

    def __init__(self, handle, params, tools=None, texts=None) -> None:
        self.handle = handle
        self.final = None  # the final RequestOutput, once it came
        self.tools = tools
        self.ended = False
        num = params.n if params.num_choices > 1 else 1
        self.outputs = OutputEvents(params, [ChoiceState(k) for k in range(num)], texts)

    def take(self) -> list[JobEvent]:
        if self.ended:
            return []
        events: list[JobEvent] = []
        outputs, error = self.handle.poll()
        for out in outputs:
            for event in self.outputs.feed(out):
                if event.type == TOKEN and self.tools is not None:
                    event.text, calls = self.tools.feed(event.text)
                    events.append(event)
                    events += calls
                else:
                    events.append(event)
            if out.finished:
                self.final = out
        if error is not None:
            self.ended = True
            if isinstance(error, CancelledError):
                events.append(JobEvent(CANCELLED, finish_reason="abort"))
            else:
                code = getattr(self.final, "error_code", None)
                deadline = code == "deadline_exceeded" or isinstance(error, TimeoutError)
                reason = "deadline_exceeded" if deadline else "abort"
                events.append(JobEvent(FAILED, error=str(error), finish_reason=reason))
        elif self.final is not None:
            self.ended = True
            text, reason = self.outputs.trailing, self.final.finish_reason
            if self.tools is not None:
                text, calls = self.tools.feed(text)
                events += calls
                rest, calls, _, reason = self.tools.finish(reason)
                text += rest
                events += calls
            events.append(JobEvent(DONE, text, finish_reason=reason, stop_reason=self.final.stop_reason))
        return events

    def usage(self) -> dict:
        """The prompt once, and every choice's tokens (best_of > n: the n kept); {} before the end."""
        out = self.final
        if out is None:
            return {}
        n, m = len(out.prompt_token_ids), sum(len(c.ids) for c in self.outputs.choices)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def start_generation(rt, job: dict, deadline_s: float | None, max_queued: int) -> GenerationEvents:
    """Submit the job (a Generation's job dict, tool_call_parser set where the server has one,
    its tenant and tier) to `rt`. Raises APIError (no LLM 404, the queue full 503) or ValueError
    naming the field. The chat template and the tokenizer run here: call it off any event loop."""
    from runtime.llm.sampling_params import SamplingParams

    if rt.llm is None:
        raise APIError(404, "this server runs no LLM (start it without --queues vision)", "model")
    waiting = rt.llm_load().num_waiting
    if waiting >= max_queued:
        raise APIError(
            503,
            f"the queue is full ({waiting} requests waiting, --max-queued {max_queued}); retry later",
            headers={"Retry-After": "1"},
        )
    job = dict(job)
    tools = ToolJob.from_kwargs(job)  # the same tool job a worker runs (protocol checked it)
    for name in TOOL_FIELDS:
        job.pop(name, None)
    prompt = job.pop("messages", None) or job.pop("prompt")
    priority = job.pop("priority", 0)
    tenancy = tenancy_kwargs(*check_tenancy(job))  # the route named the tenant: its API key's
    job.pop("tenant", None)
    job.pop("tier", None)
    params = SamplingParams(**job)
    texts = token_texts(rt.tokenizer, params)
    stream = None
    if tools is not None:
        tools.check_params(params)  # as a worker's parse_generate does (n > 1 refused)
        prompt, params, fmt = tools.prepare(rt.tokenizer, prompt, params)
        stream = ToolStream(fmt, tools.request)
    handle = rt.submit_generate(prompt, params, priority, deadline_s, **tenancy)
    return GenerationEvents(handle, params, stream, texts)


def detect_item(rt, kind: str, value: bytes | str, allowed_roots: tuple, allowed_url_prefixes: tuple):
    """(the record's source, the image to detect) of a /v1/detect request: a path under the
    allowed roots, a URL under the allowed prefixes (fetched), or uploaded bytes, decoded within
    the model's pixel limit. APIError 404 without a vision model, 400 naming `kind` else. Blocks
    (a fetch, a decode): call it off any event loop."""
    from workers.jobs import decode_upload, fetch_image, max_image_pixels
    from workers.jobspec import allowed_path, allowed_url

    if rt.vision is None:
        raise APIError(404, "this server runs no vision model", "model")
    try:
        if kind == "path":
            return (path := allowed_path(value, allowed_roots)), path
        if kind == "url":
            source = allowed_url(value, allowed_url_prefixes)
            return source, decode_upload(fetch_image(source, allowed_url_prefixes), "url", max_image_pixels(rt))
        return "image", decode_upload(value, "image", max_image_pixels(rt))
    except ValueError as exc:
        raise APIError(400, str(exc), kind) from None


def submit_detect(rt, item, kind: str, deadline_s: float | None) -> Future:
    """rt.submit_detect, its refusals as APIError (400 naming `kind`, 503 with the queue full)."""
    from schedulers.batch_queue import QueueFullError

    try:
        return rt.submit_detect(item, deadline_s=deadline_s)
    except ValueError as exc:
        raise APIError(400, str(exc), kind) from None
    except QueueFullError as exc:
        raise APIError(503, f"the vision queue is full ({exc}); retry later", headers={"Retry-After": "1"}) from None


class HandleStream:
    """A generation of this process's Runtime, read from the event loop: the handle's listener
    wakes the loop, and GenerationEvents turns its outputs into JobEvents."""

    def __init__(self, gen: GenerationEvents, loop: asyncio.AbstractEventLoop) -> None:
        self.gen = gen
        self.handle = gen.handle
        self.id = gen.handle.request_id
        self._wake = asyncio.Event()
        self.handle.set_listener(lambda: loop.is_closed() or loop.call_soon_threadsafe(self._wake.set))

    @property
    def final(self):
        return self.gen.final

    async def events(self) -> AsyncIterator[JobEvent]:
        while True:
            for event in self.gen.take():
                yield event
            if self.gen.ended:
                return
            await self._wake.wait()
            self._wake.clear()

    async def usage(self) -> dict:
        return self.gen.usage()

    async def cancel(self) -> None:
        self.handle.cancel()


class EmbeddedBackend:
    mode = "embedded"

    def __init__(
        self,
        runtime,
        model_name: str,
        max_queued: int = 256,
        allowed_roots: tuple[str, ...] = (),
        allowed_url_prefixes: tuple[str, ...] = (),
        tool_call_parser: str | None = None,
    ) -> None:
        self.runtime = runtime
        self.model_name = model_name
        self.max_queued = max_queued
        self.allowed_roots = allowed_roots
        self.allowed_url_prefixes = allowed_url_prefixes
        self.tool_call_parser = tool_call_parser  # --tool-call-parser (None: the chat template's family)

    async def close(self) -> None:
        await asyncio.to_thread(self.runtime.close, False, 30)

    def _payload(self) -> dict:
        from runtime.metrics import runtime_payload

        return {**runtime_payload(self.runtime, self.model_name), "instance": "embedded"}

    async def payloads(self) -> list[dict]:
        return [self._payload()]

    async def workers(self) -> list[dict]:
        return [self._payload()]

    async def health(self) -> dict:
        stats = self.runtime.stats()
        if stats.get("broken"):
            raise RuntimeError(stats["broken"])
        return fleet_health([self._payload()])

    async def generate(self, gen: Generation, deadline_s: float | None, owner: str | None = None) -> HandleStream:
        """`owner` is taken and not used: an embedded generation is no job, its request id is
        seen by nobody but its own request (the job API refuses --embedded, and cancel here
        finds nothing), so there is nothing another key could reach."""
        job = job_of(gen, self.tool_call_parser)
        try:  # the chat template and the tokenizer run off the event loop
            started = await asyncio.to_thread(start_generation, self.runtime, job, deadline_s, self.max_queued)
        except ValueError as exc:
            raise protocol.field_error(exc) from None
        return HandleStream(started, asyncio.get_running_loop())

    async def cancel(self, request_id: str) -> str:
        return "missing"

    async def detect(self, kind: str, value: bytes | str, deadline_s: float | None) -> dict:
        from runtime.vision.records import detection_record

        rt = self.runtime
        roots, prefixes = self.allowed_roots, self.allowed_url_prefixes
        source, item = await asyncio.to_thread(detect_item, rt, kind, value, roots, prefixes)
        future = submit_detect(rt, item, kind, deadline_s)
        wrapped = asyncio.wrap_future(future)
        try:
            det = await wrapped
        except asyncio.CancelledError:
            future.cancel()
            raise
        return detection_record(source, 0, det)


def job_of(gen: Generation, tool_call_parser: str | None) -> dict:
    """The job a generation runs: the request's, with --tool-call-parser for a tool job."""
    job = dict(gen.job)
    if gen.tools and tool_call_parser is not None:
        job.setdefault("tool_call_parser", tool_call_parser)
    return job
