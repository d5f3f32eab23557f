"""Running one job on this worker: claim it, run it on the Runtime, stream it, finish it.

`run_job` is the same for every task: claim (or find the job already final or taken), run the
body, write the final state fenced by the claim. The bodies turn validated JSON into Runtime
calls: tandem.generate's is workers/generate.py's (with how a generation resumes after its
worker died), tandem.detect's is here.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError

from runtime.errors import FieldError
from runtime.handles import DeadlineExceededError
from runtime.vision.records import detection_record
from workers.generate import generate_body, runtime_serving, time_left
from workers.host import ActiveJob, Cancelled, Fenced, WorkerHost
from workers.jobspec import allowed_path, allowed_url, decode_image_b64, parse_detect

DEFAULT_MAX_TOKENS = 16
__all__ = ["Duplicate", "JobCancelled", "detect_body", "generate_body", "run_job"]  # generate_body: generate.py's


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


# ---- tandem.detect ------------------------------------------------------------------------------


def detect_body(host: WorkerHost, job: ActiveJob, kwargs: dict) -> tuple[dict, str]:
    spec = parse_detect(kwargs)
    settings = host.settings
    rt = runtime_serving(host, "vision", "a vision model (start it with the vision queue)")
    limit = max_image_pixels(rt)
    if spec.kind == "path":  # read on the Runtime's batcher, sized from its header against the same limit
        source = item = allowed_path(spec.value, settings.allowed_roots)
    elif spec.kind == "url":
        source = allowed_url(spec.value, settings.allowed_url_prefixes)
        item = decode_upload(fetch_image(source, settings.allowed_url_prefixes), "url", limit)
    else:
        source, item = "image", decode_upload(decode_image_b64(spec.value), "image", limit)
    remaining = time_left(job, spec.deadline_s)
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
