"""Running one job on this worker: claim it, run it on the Runtime, stream it, finish it.

`run_job` is the same for every task: claim (or find the job already final or taken), run the
body, write the final state fenced by the claim. The bodies turn validated JSON into Runtime
calls. A generation that restarts after its worker died continues from the tokens the stream
already holds (prompt + those tokens as the new prompt, the budget reduced by as many), so its
stream goes on without a token twice or missing; the `restarted` event marks the seam.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError

from runtime.errors import FieldError
from runtime.handles import DeadlineExceededError, error_for
from runtime.vision.records import detection_record
from workers.events import JobEvent
from workers.host import ActiveJob, Cancelled, Fenced, WorkerHost
from workers.jobspec import allowed_path, allowed_url, decode_image_b64, parse_detect, parse_generate
from workers.settings import MODEL_QUEUE_PREFIX, model_queue
from workers.store import prefix_of
from workers.tool_stream import ToolStream, tool_result

DEFAULT_MAX_TOKENS = 16


class Duplicate(Exception):
    """This delivery of the job is a duplicate: another one runs it or has run it."""


class JobCancelled(Exception):
    """The job was cancelled (before this delivery, or while it ran)."""


def run_job(
    host: WorkerHost,
    task: str,
    job_id: str,
    queue: str,
    kwargs: dict,
    body: Callable[[WorkerHost, ActiveJob, dict], tuple[dict, str]],
) -> dict:
    """Returns the job's result; raises ValueError / RuntimeError with the job's error,
    JobCancelled, or Duplicate when there is nothing for this delivery to do."""
    if not host.reserve(job_id):  # one delivery of a job at a time on this worker
        raise Duplicate(f"job {job_id} is already running on this worker")
    try:
        return _run_reserved(host, task, job_id, queue, kwargs, body)
    finally:
        host.release_job(job_id)


def _run_reserved(host: WorkerHost, task: str, job_id: str, queue: str, kwargs: dict, body) -> dict:
    max_tokens = kwargs.get("max_tokens", DEFAULT_MAX_TOKENS)
    token = uuid.uuid4().hex
    claim = host.store.claim(
        job_id,
        host.worker_id,
        token,
        task,
        queue,
        kwargs,
        ttl_s=host.settings.job_ttl_s,
        submitted_at=time.time(),
        max_tokens=max_tokens if isinstance(max_tokens, int) else 0,
    )
    if claim.outcome == "busy":
        raise Duplicate(f"job {job_id} is running on live worker {claim.detail}")
    if claim.outcome == "final":
        return final_result(host, job_id)
    job = ActiveJob(job_id, token, claim)
    job.queue = queue
    host.activate(job)
    result, error, state, trailing, exc_type = None, "", "done", "", RuntimeError
    reason = ""
    try:
        result, trailing = body(host, job, kwargs)
    except Fenced:
        raise Duplicate(f"job {job_id} moved to another worker while this one ran it") from None
    except Cancelled:
        state = "cancelled"
    except ValueError as exc:  # the caller's input, not the worker: `tandem serve` answers 400
        state, error, exc_type, reason = "failed", str(exc), ValueError, "invalid_request"
        if isinstance(exc, FieldError):  # its field and code as data, in the final record's result
            result = {"error": exc.to_dict()}
    except DeadlineExceededError as exc:  # `tandem serve` answers 504
        state, error, reason = "failed", f"DeadlineExceeded: {exc}", "deadline_exceeded"
    except Exception as exc:  # noqa: BLE001 - fail this job, keep serving the rest
        if host.runtime_broken() is not None:
            # The worker's failure, not the job's: write no final state. The host leaves
            # (host._leave_broken) and the job runs again on another worker.
            raise Duplicate(f"job {job_id} abandoned: this worker's runtime broke ({exc})") from None
        state, error = "failed", f"{type(exc).__name__}: {exc}"
    if state == "done":
        reason = result.get("finish_reason", "")
    elif not reason:
        reason = "abort"
    stop = result.get("stop_reason") if state == "done" else None
    if not host.writer.finish(job, state, result, error, reason or "", trailing, stop).result():
        raise Duplicate(f"job {job_id} moved to another worker before it finished here")
    host.count(state)
    if state == "done":
        return result
    if state == "cancelled":
        raise JobCancelled(f"job {job_id} was cancelled")
    raise exc_type(error)


def final_result(host: WorkerHost, job_id: str) -> dict:
    final = host.store.wait_final([job_id], block_ms=None).get(job_id, {})
    if final.get("state") == "done":
        return json.loads(final["result"])
    if final.get("state") == "cancelled":
        raise JobCancelled(f"job {job_id} was cancelled")
    raise RuntimeError(final.get("error") or f"job {job_id} failed")


# ---- tandem.generate ----------------------------------------------------------------------------


def _runtime_serving(host: WorkerHost, part: str, what: str):
    """The worker's Runtime, if it has `part` ("llm" or "vision")."""
    rt = host.runtime
    if rt is None or getattr(rt, part, None) is None:
        raise RuntimeError(f"this worker serves no {what}")
    return rt


def _time_left(job: ActiveJob, deadline_s: float | None) -> float | None:
    """Seconds left of the job's deadline (counted from submission); None: no deadline."""
    if deadline_s is None:
        return None
    remaining = job.submitted_at + deadline_s - time.time()
    if remaining <= 0:
        raise DeadlineExceededError(f"deadline_s={deadline_s} passed before the job started")
    return remaining


def _check_model(host: WorkerHost, job: ActiveJob) -> None:
    """A job on `llm.NAME` asks for model NAME: refuse it on a worker serving another (a
    misrouted message must not answer with the wrong model)."""
    if job.queue.startswith(MODEL_QUEUE_PREFIX) and job.queue != model_queue(host.model_name or "-"):
        asked = job.queue[len(MODEL_QUEUE_PREFIX) :]
        raise RuntimeError(f"model {asked!r} is not served by this worker (it serves {host.model_name!r})")


class _JobTools:
    """A tool job's ToolStream and what it writes: content rides the job's next token event (or
    its end), tool events are appended after it, each with the next seq (lua_events.APPEND)."""

    def __init__(self, host: WorkerHost, job: ActiveJob, stream: ToolStream) -> None:
        self.host, self.job, self.stream = host, job, stream
        self.pending = ""  # content read from text whose tokens went out already (a resume)

    def replay(self, raw: str) -> None:
        """Text whose tokens an earlier attempt streamed: what it did not send goes out now."""
        content, events = self.stream.feed(raw)
        self.pending += content
        self._append(events)

    def emit(self, start: int, new: list[int], delta_text: str, prompt_ids, lp) -> None:
        content, events = self.stream.feed(delta_text)
        self.host.writer.emit(self.job, start, new, self.pending + content, prompt_ids, lp)
        self.pending = ""
        self._append(events)

    def finish(self, trailing: str, reason: str | None):
        """(the content still to send, as the end's text; the message; OpenAI's finish_reason)."""
        self.replay(trailing)
        content, events, message, reason = self.stream.finish(reason)
        self._append(events)
        text, self.pending = self.pending + content, ""
        return text, message, reason

    def _append(self, events: list[JobEvent]) -> None:
        first = self.stream.num_events - len(events)
        for k, event in enumerate(events):
            event.attempt = self.job.attempt
            self.host.writer.append(self.job, first + k, event)


def _tool_result(result: dict, message, reason: str | None) -> dict:
    """A tool job's result: content as `text` ("" for none), its calls, OpenAI's finish_reason."""
    return {**result, "text": message.content or "", **tool_result(message), "finish_reason": reason}


def generate_body(host: WorkerHost, job: ActiveJob, kwargs: dict) -> tuple[dict, str]:
    spec = parse_generate(kwargs)
    rt = _runtime_serving(host, "llm", "an LLM (start it with the llm queue)")
    _check_model(host, job)
    remaining = _time_left(job, spec.deadline_s)
    prompt, params = spec.prompt, spec.params
    tools = None
    if spec.tools is not None:  # the tool format's prompt and grammar; its parser over the text
        prompt, params, fmt = spec.tools.prepare(rt.tokenizer, spec.prompt, params)
        tools = (fmt, spec.tools.request)
    prefix_ids: list[int] = []
    prefix_text = ""
    prefix_logprobs: list[dict] | None = None
    rec = None
    written: list[JobEvent] = []
    if job.resumed_from:
        rec = host.store.record(job.job_id)  # the first attempt's timings
        if tools:  # its calls, too
            written = host.store.events(job.job_id)
            prefix_ids, prefix_text, prefix_logprobs = prefix_of(written)
        else:
            prefix_ids, prefix_text, prefix_logprobs = host.store.prefix(job.job_id)
    calls = _JobTools(host, job, ToolStream(*tools, written)) if tools else None
    if calls is not None and prefix_ids:  # a tool job's token events hold content, not the text
        prefix_text = rt.tokenizer.decode(prefix_ids, skip_special_tokens=params.skip_special_tokens)
        calls.replay(prefix_text)
    if job.resumed_from:
        reason = _finished_already(rt, params, job.prompt_token_ids, prefix_ids)
        if reason is not None:
            result = _result(host.worker_id, job, rec, job.prompt_token_ids, prefix_ids, prefix_text, reason, None)
            result["logprobs"] = prefix_logprobs if getattr(params, "logprobs", None) is not None else None
            result["stop_reason"] = _stop_reason_of(params, prefix_ids, prefix_text) if reason == "stop" else None
            if calls is None:
                return result, ""
            trailing, message, reason = calls.finish("", reason)
            return _tool_result(result, message, reason), trailing
        # The engine counts the earlier outputs itself (max_tokens and min_tokens, penalties, the
        # seeded stream, the grammar, stop strings across the resume point): the job's own params
        # go unchanged, and its k-th new token is what the uninterrupted job's (n + k)-th would be.
        prompt = job.prompt_token_ids + prefix_ids
    handle = rt.submit_generate(
        prompt,
        params,
        priority=spec.priority,
        deadline_s=remaining,
        request_id=f"{job.job_id}#{job.attempt}",
        num_resumed_outputs=len(prefix_ids),
    )
    job.attach(handle)
    sent, emitted = 0, []
    first_token_at = None
    out = None
    try:
        for out in handle:
            if job.fenced:
                raise Fenced()
            new = out.token_ids[sent:]
            if new:
                start = len(prefix_ids) + sent
                lp = _new_logprobs(out, sent, len(new))
                prompt_ids = out.prompt_token_ids if start == 0 else None
                if calls is not None:
                    calls.emit(start, new, out.delta_text, prompt_ids, lp)
                else:
                    host.writer.emit(job, start, new, out.delta_text, prompt_ids, lp)
                if first_token_at is None:
                    first_token_at = time.time()
                sent += len(new)
                emitted.append(out.delta_text)
    except CancelledError:
        if job.fenced:
            raise Fenced() from None
        raise Cancelled() from None
    if job.fenced or out is None:
        raise Fenced()
    if job.cancel_requested and out.finish_reason == "abort":
        raise Cancelled()
    if out.error:
        raise error_for(out)  # DeadlineExceededError for a deadline: the job's finish_reason says so
    streamed = "".join(emitted)
    trailing = out.text[len(streamed) :] if out.text.startswith(streamed) else ""
    prompt_ids = job.prompt_token_ids if job.resumed_from else out.prompt_token_ids
    ids, text = prefix_ids + out.token_ids, prefix_text + out.text
    result = _result(host.worker_id, job, rec, prompt_ids, ids, text, out.finish_reason, out, first_token_at)
    logprobs = getattr(out, "logprobs", None)
    result["logprobs"] = None if logprobs is None else (prefix_logprobs or []) + list(logprobs)
    result["stop_reason"] = getattr(out, "stop_reason", None)
    if calls is None:
        return result, trailing
    trailing, message, reason = calls.finish(trailing, out.finish_reason)
    return _tool_result(result, message, reason), trailing


def _new_logprobs(out, sent: int, count: int) -> list[dict] | None:
    """The logprobs of out.token_ids[sent:sent + count] (contract B), None when none were asked."""
    whole = getattr(out, "logprobs", None)  # one per token generated so far
    if whole is not None and len(whole) >= sent + count:
        return whole[sent : sent + count]
    delta = getattr(out, "delta_logprobs", None)  # those of the outputs merged into this one
    if delta is not None and len(delta) >= count:
        return delta[len(delta) - count :]
    return None


def _stop_reason_of(params, ids: list[int], text: str) -> str | int | None:
    """What ended a generation whose last attempt stopped it (the stop token id or string)."""
    if ids and ids[-1] in set(params.stop_token_ids):
        return ids[-1]
    for s in params.stop:
        if s in text:
            return s
    return None


def _finished_already(rt, params, prompt_ids: list[int], ids: list[int]) -> str | None:
    """Did the previous attempt make the job's last token before its worker died? Length
    first, as the engine decides it: the budget spent, or the context full (max_tokens None
    takes what the context leaves; resuming there would hand the engine a prompt of
    max_model_len tokens, which it refuses, and a finished job would end failed)."""
    if params.max_tokens is not None and len(ids) >= params.max_tokens:
        return "length"
    max_model_len = getattr(rt, "max_model_len", None)  # the Runtime's: its LLM engine's
    if max_model_len and len(prompt_ids) + len(ids) >= max_model_len:
        return "length"
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids |= set(getattr(rt.llm, "eos_token_ids", ()))
    if ids and ids[-1] in stop_ids and len(ids) >= params.min_tokens:
        return "stop"
    if params.stop and rt.tokenizer is not None:
        full = rt.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if any(s in full for s in params.stop):
            return "stop"
    return None


def _result(
    worker_id: str,
    job: ActiveJob,
    rec: dict | None,
    prompt_ids: list[int],
    ids: list[int],
    text: str,
    reason: str,
    out,
    first_token_at: float | None = None,
) -> dict:
    """The task's result. `rec` (the job record) only for a resumed job: its first attempt's
    start and first token; a first attempt knows its own."""
    now = time.time()
    submitted = job.submitted_at or now
    started, first = job.claimed_at, first_token_at
    if rec is not None:
        started = float(rec.get("started_at") or started)
        first = float(rec["first_token_at"]) if rec.get("first_token_at") else first
    timings = {
        "queue_s": round(started - submitted, 6),
        "total_s": round(now - submitted, 6),
        "attempts": job.attempt,
    }
    if first is not None:
        timings["ttft_s"] = round(first - submitted, 6)
    if out is not None and out.metrics.e2e_latency is not None:
        timings["runtime_s"] = round(out.metrics.e2e_latency, 6)  # in the Runtime: its queue and steps
    if out is not None and out.metrics.decode_tokens_per_s:
        timings["decode_tokens_per_s"] = round(out.metrics.decode_tokens_per_s, 3)
    return {
        "job_id": job.job_id,
        "worker": worker_id,
        "text": text,
        "token_ids": ids,
        "finish_reason": reason,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt_ids) + len(ids),
        },
        "timings": timings,
    }


# ---- tandem.detect ------------------------------------------------------------------------------


def detect_body(host: WorkerHost, job: ActiveJob, kwargs: dict) -> tuple[dict, str]:
    spec = parse_detect(kwargs)
    settings = host.settings
    rt = _runtime_serving(host, "vision", "a vision model (start it with the vision queue)")
    limit = max_image_pixels(rt)
    if spec.kind == "path":  # read on the Runtime's batcher, sized from its header against the same limit
        source = item = allowed_path(spec.value, settings.allowed_roots)
    elif spec.kind == "url":
        source = allowed_url(spec.value, settings.allowed_url_prefixes)
        item = decode_upload(fetch_image(source, settings.allowed_url_prefixes), "url", limit)
    else:
        source, item = "image", decode_upload(decode_image_b64(spec.value), "image", limit)
    remaining = _time_left(job, spec.deadline_s)
    future = rt.submit_detect(item, priority=spec.priority, deadline_s=remaining, request_id=job.job_id)
    job.attach(future)
    try:
        det = future.result()
    except CancelledError:
        if job.fenced:
            raise Fenced() from None
        raise Cancelled() from None
    return detection_record(source, 0, det), ""


def max_image_pixels(rt) -> int:
    """The pixel limit of `rt`'s vision model (VisionConfig.max_image_pixels)."""
    from sources.base import DEFAULT_MAX_IMAGE_PIXELS

    return getattr(getattr(getattr(rt, "vision", None), "config", None), "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS)


def decode_upload(data: bytes, field: str, max_pixels: int | None = None):
    """Uploaded or fetched bytes as a BGR image. The header is read first: bytes that are no
    image format, or an image over `max_pixels` (None: sources.base.DEFAULT_MAX_IMAGE_PIXELS),
    raise a ValueError naming `field` (400 / invalid_request) without being decoded."""
    from sources.base import DEFAULT_MAX_IMAGE_PIXELS
    from sources.media import decode_image

    return decode_image(data, field, DEFAULT_MAX_IMAGE_PIXELS if max_pixels is None else max_pixels)


def fetch_image(url: str, prefixes: tuple[str, ...], env=None) -> bytes:
    """The bytes at `url` through the URL guard (workers/urlguard.py): the checked address is
    dialled, every redirect re-checked, size and time limited; ValueError naming url."""
    from workers.urlguard import UrlPolicy, fetch

    return fetch(url, UrlPolicy.from_env(os.environ if env is None else env, prefixes=prefixes))
