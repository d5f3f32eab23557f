"""One batch of images on the calling thread: decode, letterbox, forward, resolve each future.

Shared by the VisionEngine, which splits a batch across its batcher thread (`prepare_batch`)
and an inference worker (`infer_batch`), and by a Runtime loop that runs a whole batch inline
(`run_batch`), so a request ends the same way on either path:

    schedulers.Batch + {request id: VisionJob} -> prepare_batch -> ReadyBatch -> infer_batch

Failures stay with their request: a bad input fails its own future, a failed letterbox or
forward pass fails the futures of its batch, and a future cancelled before its batch formed
is skipped (its input is not even decoded). None of these functions raises for a batch's
sake, so a thread loop that calls them survives every batch.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.vision.postprocess import Detections
from runtime.vision.runner import Prepared, YoloRunner
from schedulers import Batch
from sources.base import DEFAULT_MAX_IMAGE_PIXELS, Frame
from sources.media import read_image, to_bgr


class VisionInputError(ValueError):
    """This input cannot be run (unreadable file, wrong array shape or type)."""


@dataclass(slots=True)
class VisionJob:
    """What a batch needs to know of one request besides its payload."""

    future: Future
    submitted: float  # time.monotonic() when it was queued
    deadline: float | None = None  # time.monotonic() by which it should be done; None: no deadline


@dataclass(slots=True)
class ReadyBatch:
    """A batch decoded and letterboxed, waiting for its forward pass."""

    batch: Batch
    jobs: dict[str, VisionJob]
    started: float  # time.monotonic() when the batch formed: where queue time ends
    request_ids: list[str]  # the inputs inside `prepared`, in order (failed and cancelled ones left out)
    prepared: Prepared | None  # None when no input is left to run
    decode_ms: float


def decode(item: Any, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray:
    """Any accepted input as a BGR uint8 array; VisionInputError says what is wrong. A path is
    sized from its header and refused over `max_pixels` before it is decoded; an array, a PIL
    image or a frame over it is refused too (it is decoded already: the limit spares the rest)."""
    if isinstance(item, Frame):
        if item.error is not None or item.image is None:
            raise VisionInputError(item.error or f"frame {item.index} of {item.source} has no image")
        item = item.image
    if isinstance(item, (str, os.PathLike)):
        image, error = read_image(os.fspath(item), max_pixels)
        if error:
            raise VisionInputError(error)
        return image
    try:
        return to_bgr(item, "input", max_pixels)
    except ValueError as exc:
        raise VisionInputError(str(exc)) from None


def max_image_pixels(runner: Any) -> int:
    """The runner's configured pixel limit (VisionConfig.max_image_pixels)."""
    return getattr(getattr(runner, "config", None), "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS)


def resolve(future: Future, result: Any = None, error: BaseException | None = None) -> bool:
    """Give the future its result (or `error`); False, raising nothing, when it was cancelled
    or is done already."""
    if future.done():
        return False
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled between the check and the call
        return False
    return True


def _start(job: VisionJob | None) -> bool:
    """Mark the job's future running as its batch forms: from here on it cannot be cancelled.
    False when it was cancelled while queued (or is done already): its input is skipped."""
    if job is None:
        return False
    try:
        return job.future.set_running_or_notify_cancel()
    except RuntimeError:  # not pending: running (a caller started it) or done
        return job.future.running()


def _fail(jobs: dict[str, VisionJob], request_ids: list[str], stage: str, exc: Exception) -> None:
    """Fail every still-open future of the batch; each gets its own error (tracebacks are per raise)."""
    for rid in request_ids:
        job = jobs.get(rid)
        if job is not None and not job.future.done():
            error = RuntimeError(f"{stage} failed for a batch of {len(request_ids)}: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            resolve(job.future, error=error)


def _decode_or_error(payload: Any, max_pixels: int) -> tuple[np.ndarray | None, VisionInputError | None]:
    """(image, None), or (None, what is wrong with this input); raises nothing."""
    try:
        return decode(payload, max_pixels), None
    except VisionInputError as exc:
        return None, exc
    except Exception as exc:  # noqa: BLE001 - an input no decoder expected is still that input's fault
        return None, VisionInputError(f"cannot read this input: {type(exc).__name__}: {exc}")


def prepare_batch(runner: YoloRunner, batch: Batch, jobs: dict[str, VisionJob], started: float) -> ReadyBatch:
    """Start each job's future, decode its input (a bad one fails only itself) and letterbox
    the rest into one Prepared. With a runner.host_pool (CUDA) the inputs decode side by side
    on it; else one after the other here."""
    ids: list[str] = []
    try:
        t0 = time.perf_counter()
        images = []
        pool = getattr(runner, "host_pool", None)  # a stand-in runner (tests) may have none
        limit = max_image_pixels(runner)
        decoding = []
        for rid, payload in zip(batch.request_ids, batch.payloads):
            job = jobs.get(rid)
            if not _start(job):
                continue
            out = (
                pool.submit(_decode_or_error, payload, limit) if pool is not None else _decode_or_error(payload, limit)
            )
            decoding.append((rid, job, out))
        for rid, job, out in decoding:
            image, error = out.result() if pool is not None else out
            if error is not None:
                resolve(job.future, error=error)
            else:
                images.append(image)
                ids.append(rid)
        decode_ms = (time.perf_counter() - t0) * 1000
        prepared = runner.prepare(images) if images else None
    except Exception as exc:  # noqa: BLE001 - one batch's failure stays with that batch
        _fail(jobs, batch.request_ids, "preprocessing", exc)
        return ReadyBatch(batch, jobs, started, [], None, 0.0)
    return ReadyBatch(batch, jobs, started, ids, prepared, decode_ms)


def infer_batch(runner: YoloRunner, ready: ReadyBatch) -> list[Detections | None]:
    """Run the forward pass and resolve each future; one entry per batch member, None for
    those that failed or were cancelled (what `DynamicBatchScheduler.update` takes)."""
    batch, jobs = ready.batch, ready.jobs
    results: dict[str, Detections] = {}
    if ready.prepared is None:
        return [None] * batch.size
    try:
        dets = runner.infer(ready.prepared)
        if len(dets) != len(ready.request_ids):
            raise RuntimeError(f"the runner returned {len(dets)} results for {len(ready.request_ids)} inputs")
        finished = time.monotonic()
        for rid, d in zip(ready.request_ids, dets):
            job = jobs[rid]
            d.timings["preprocess"] += ready.decode_ms / batch.size
            d.timings["queue"] = max(0.0, (ready.started - job.submitted) * 1000)
            if job.deadline is not None and finished > job.deadline:
                d.deadline_missed = True
            results[rid] = d
    except Exception as exc:  # noqa: BLE001 - one batch's failure stays with that batch
        _fail(jobs, batch.request_ids, "inference", exc)
        return [None] * batch.size
    for rid, d in results.items():
        resolve(jobs[rid].future, d)
    return [results.get(rid) for rid in batch.request_ids]


def run_batch(runner: YoloRunner, batch: Batch, jobs: dict[str, VisionJob], started: float) -> None:
    """The whole batch on the calling thread; every job of it is resolved when this returns
    (cancelled ones excepted). `started`: time.monotonic() when the batch formed."""
    infer_batch(runner, prepare_batch(runner, batch, jobs, started))
