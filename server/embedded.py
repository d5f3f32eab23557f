"""`tandem serve --embedded`: a Runtime in the server's own process (one machine, no Redis),
behind the same interface as the workers' backend (server/backends.py's Stream): `generate()`
returns a HandleStream, whose events are the ones a worker writes for the same generation, made
by the same translation (workers/choices.py), so that the routes cannot tell the two apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from server import protocol
from server.backends import fleet_health
from server.protocol import APIError, Generation
from workers.choices import ChoiceState, OutputEvents
from workers.events import CANCELLED, DONE, FAILED, TOKEN, JobEvent
from workers.tool_stream import TOOL_FIELDS, ToolJob, ToolStream


def token_texts(tokenizer, params):
    """runtime/llm/detokenizer.py's TokenTexts when prompt logprobs are asked (the prompt event
    names the first prompt token), else None."""
    if params.prompt_logprobs is None or tokenizer is None:
        return None
    from runtime.llm.detokenizer import TokenTexts

    return TokenTexts(tokenizer)


class HandleStream:
    """A GenerationHandle read from the event loop: the handle's listener wakes the loop. Its
    outputs become JobEvents through workers/choices.py's OutputEvents, as a worker's do; with a
    `tools` ToolStream (workers/tool_stream.py), a tool job's text becomes content and tool events
    here, as a worker's does."""

    def __init__(self, handle, loop: asyncio.AbstractEventLoop, params, tools=None, texts=None) -> None:
        self.handle = handle
        self.id = handle.request_id
        self._wake = asyncio.Event()
        self._loop = loop
        self.final = None
        self.tools = tools
        num = params.n if params.num_choices > 1 else 1
        self.outputs = OutputEvents(params, [ChoiceState(k) for k in range(num)], texts)
        handle.set_listener(lambda: loop.is_closed() or loop.call_soon_threadsafe(self._wake.set))

    async def events(self) -> AsyncIterator[JobEvent]:
        from concurrent.futures import CancelledError

        while True:
            outputs, error = self.handle.poll()
            for out in outputs:
                for event in self.outputs.feed(out):
                    if event.type == TOKEN and self.tools is not None:
                        event.text, calls = self.tools.feed(event.text)
                        yield event
                        for call in calls:
                            yield call
                    else:
                        yield event
                if out.finished:
                    self.final = out
            if error is not None:
                if isinstance(error, CancelledError):
                    yield JobEvent(CANCELLED, finish_reason="abort")
                else:
                    code = getattr(self.final, "error_code", None)
                    deadline = code == "deadline_exceeded" or isinstance(error, TimeoutError)
                    yield JobEvent(FAILED, error=str(error), finish_reason="deadline_exceeded" if deadline else "abort")
                return
            if self.final is not None:
                text, reason = self.outputs.trailing, self.final.finish_reason
                if self.tools is not None:
                    text, calls = self.tools.feed(text)
                    for event in calls:
                        yield event
                    rest, calls, _, reason = self.tools.finish(reason)
                    text += rest
                    for event in calls:
                        yield event
                yield JobEvent(DONE, text, finish_reason=reason, stop_reason=self.final.stop_reason)
                return
            await self._wake.wait()
            self._wake.clear()

    async def usage(self) -> dict:
        """The prompt once, and every choice's tokens (best_of > n: the n kept)."""
        out = self.final
        if out is None:
            return {}
        n, m = len(out.prompt_token_ids), sum(len(c.ids) for c in self.outputs.choices)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

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
        from runtime.llm.sampling_params import SamplingParams

        rt = self.runtime
        if rt.llm is None:
            raise APIError(404, "this server runs no LLM (start it without --queues vision)", "model")
        waiting = rt.llm_load().num_waiting
        if waiting >= self.max_queued:
            raise APIError(
                503,
                f"the queue is full ({waiting} requests waiting, --max-queued {self.max_queued}); retry later",
                headers={"Retry-After": "1"},
            )
        job = dict(gen.job)
        if gen.tools and self.tool_call_parser is not None:
            job.setdefault("tool_call_parser", self.tool_call_parser)
        tools = ToolJob.from_kwargs(job)  # the same tool job a worker runs (protocol checked it)
        for name in TOOL_FIELDS:
            job.pop(name, None)
        prompt = job.pop("messages", None) or job.pop("prompt")
        priority = job.pop("priority", 0)
        params = SamplingParams(**job)
        texts = token_texts(rt.tokenizer, params)

        def submit():  # the chat template and the tokenizer run off the event loop
            nonlocal prompt, params
            stream = None
            if tools is not None:
                tools.check_params(params)  # as a worker's parse_generate does (n > 1 refused)
                prompt, params, fmt = tools.prepare(rt.tokenizer, prompt, params)
                stream = ToolStream(fmt, tools.request)
            return rt.submit_generate(prompt, params, priority, deadline_s), stream

        try:
            handle, stream = await asyncio.to_thread(submit)
        except ValueError as exc:
            raise protocol.field_error(exc) from None
        return HandleStream(handle, asyncio.get_running_loop(), params, stream, texts)

    async def cancel(self, request_id: str) -> str:
        return "missing"

    async def detect(self, kind: str, value: bytes | str, deadline_s: float | None) -> dict:
        from runtime.vision.records import detection_record
        from schedulers.batch_queue import QueueFullError
        from workers.jobs import decode_upload, fetch_image, max_image_pixels
        from workers.jobspec import allowed_path, allowed_url

        rt = self.runtime
        if rt.vision is None:
            raise APIError(404, "this server runs no vision model", "model")
        try:
            if kind == "path":
                source = item = allowed_path(value, self.allowed_roots)
            elif kind == "url":
                source = allowed_url(value, self.allowed_url_prefixes)
                item = await asyncio.to_thread(
                    lambda: decode_upload(fetch_image(source, self.allowed_url_prefixes), "url", max_image_pixels(rt))
                )
            else:
                source, item = "image", await asyncio.to_thread(decode_upload, value, "image", max_image_pixels(rt))
            future = rt.submit_detect(item, deadline_s=deadline_s)
        except ValueError as exc:
            raise APIError(400, str(exc), kind) from None
        except QueueFullError as exc:
            raise APIError(
                503, f"the vision queue is full ({exc}); retry later", headers={"Retry-After": "1"}
            ) from None
        wrapped = asyncio.wrap_future(future)
        try:
            det = await wrapped
        except asyncio.CancelledError:
            future.cancel()
            raise
        return detection_record(source, 0, det)
