"""VisionEngine: dynamic batching of images onto a YOLO runner, behind futures.

    engine = VisionEngine(VisionConfig(model="yolo26n.yaml"))
    future = engine.submit("bus.jpg", priority=0, timeout_ms=500)
    detections = future.result()
    engine.close()

Two threads, so that decoding and letterboxing of the next batch overlap the forward pass of
the current one (a one-slot hand-off bounds the memory to two batches). Queue timeouts are
checked whenever the batcher forms a batch, i.e. at the latest when the running batch ends:

    submit() -> DynamicBatchScheduler -> [batcher: schedule, decode, letterbox] -> slot
             -> [inference: forward, postprocess] -> futures

Every accepted request's future resolves: with Detections, or with the error of its own bad
input, its queue timeout, a failed forward, or the engine closing without draining.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from runtime.memory import DeviceMemoryManager
from runtime.vision.config import VisionConfig
from runtime.vision.runner import YoloRunner
from schedulers import Batch, DynamicBatchConfig, DynamicBatchScheduler
from sources.base import Frame
from sources.media import read_image, to_bgr

PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64)


class VisionInputError(ValueError):
    """This input cannot be run (unreadable file, wrong array shape or type)."""


class EngineClosedError(RuntimeError):
    """The engine closed before this request ran (close(drain=False))."""


@dataclass(slots=True)
class _Job:
    future: Future
    submitted: float


def decode(item: Any) -> np.ndarray:
    """Any accepted input as a BGR uint8 array; VisionInputError says what is wrong."""
    if isinstance(item, Frame):
        if item.error is not None or item.image is None:
            raise VisionInputError(item.error or f"frame {item.index} of {item.source} has no image")
        item = item.image
    if isinstance(item, (str, os.PathLike)):
        image, error = read_image(os.fspath(item))
        if error:
            raise VisionInputError(error)
        return image
    try:
        return to_bgr(item, "input")
    except ValueError as exc:
        raise VisionInputError(str(exc)) from None


class VisionEngine:
    def __init__(self, config: VisionConfig | None = None, module: nn.Module | None = None,
                 memory: DeviceMemoryManager | None = None) -> None:  # fmt: skip
        self.config = c = config or VisionConfig()
        self.runner = YoloRunner(c, module, memory)
        self.profile_rates: dict[int, float] = {}
        preferred = c.preferred_batch_sizes
        if not preferred and c.profile:
            sizes = sorted({b for b in PROFILE_SIZES if b <= c.max_batch_size} | {c.max_batch_size})
            self.profile_rates = self.runner.profile(sizes)
            preferred = (self.runner.best_batch_size(self.profile_rates),)
        self.preferred_batch_sizes = tuple(preferred)
        self.scheduler = DynamicBatchScheduler(DynamicBatchConfig(
            c.max_batch_size, self.preferred_batch_sizes, c.max_queue_delay_ms, c.max_queue_size,
            c.default_timeout_ms, c.priority_levels,
        ))  # fmt: skip
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}
        self._ids = itertools.count()
        self._closed = False
        self._drain = True
        self._slot: queue.Queue = queue.Queue(maxsize=1)
        # The batcher forms the next batch only once the inference thread has taken the last
        # one: batches are formed as late as possible (as large as the queue allows) and are
        # prepared while the previous one runs, never two ahead.
        self._slot_free = threading.Semaphore(1)
        self._batcher = threading.Thread(target=self._batch_loop, name="vision-batcher", daemon=True)
        self._inferer = threading.Thread(target=self._infer_loop, name="vision-infer", daemon=True)
        self._batcher.start()
        self._inferer.start()

    @property
    def names(self) -> dict[int, str]:
        return self.runner.names

    def submit(self, item: Any, priority: int = 0, timeout_ms: float | None = None) -> Future:
        """Queue one image (array, PIL image, path or Frame); the future gets its Detections.

        Raises QueueFullError when max_queue_size requests wait (retry later), ValueError
        for a bad priority or timeout, RuntimeError after close(). A bad *input* is not
        raised here: it is decoded on the batcher thread and fails only its own future.
        """
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the vision engine is closed")
            request_id = f"img-{next(self._ids)}"
            now = time.monotonic()
            self.scheduler.add_request(request_id, item, now, priority, timeout_ms)
            self._jobs[request_id] = _Job(future, now)
            self._cond.notify_all()
        return future

    # -- batcher thread --
    def _next_batch(self) -> tuple[Batch | None, list[tuple[Future, BaseException]]]:
        """Wait for a due batch; (None, ...) once closed and (if draining) empty."""
        with self._cond:
            while True:
                now = time.monotonic()
                plan = self.scheduler.schedule(now)
                failed = [(self._jobs.pop(rid).future, TimeoutError(msg)) for rid, msg in plan.rejected.items()]
                if plan.size or failed:
                    return plan, failed
                if self._closed and (not self._drain or len(self.scheduler.queue) == 0):
                    return None, []
                self._cond.wait(self.scheduler.next_due(now))

    def _batch_loop(self) -> None:
        try:
            while True:
                self._slot_free.acquire()
                plan, failed = self._next_batch()
                for future, exc in failed:
                    future.set_exception(exc)
                if plan is None:
                    return
                if plan.size:
                    self._prepare(plan)
                else:
                    self._slot_free.release()
        finally:
            self._slot.put(None)  # tells the inference thread no more batches come

    def _prepare(self, plan: Batch) -> None:
        t0 = time.perf_counter()
        images, ok, bad = [], [], []
        for rid, payload in zip(plan.request_ids, plan.payloads):
            try:
                images.append(decode(payload))
                ok.append(rid)
            except VisionInputError as exc:
                bad.append((rid, exc))
        decode_ms = (time.perf_counter() - t0) * 1000
        try:
            prepared = self.runner.prepare(images) if images else None
        except Exception as exc:  # noqa: BLE001 - one batch's failure must not stop the loop
            bad.extend((rid, RuntimeError(f"preprocessing failed: {exc}")) for rid in ok)
            ok, prepared = [], None
        with self._cond:
            jobs = {rid: self._jobs[rid] for rid in plan.request_ids}
        for rid, exc in bad:
            jobs[rid].future.set_exception(exc)
        self._slot.put((plan, ok, prepared, decode_ms, jobs, time.monotonic()))

    # -- inference thread --
    def _infer_loop(self) -> None:
        while (item := self._slot.get()) is not None:
            plan, ok, prepared, decode_ms, jobs, started = item
            self._slot_free.release()
            results: dict[str, Any] = {}
            if prepared is not None:
                try:
                    dets = self.runner.infer(prepared)
                except Exception as exc:  # noqa: BLE001
                    for rid in ok:
                        jobs[rid].future.set_exception(RuntimeError(f"inference failed: {exc}"))
                else:
                    for rid, d in zip(ok, dets):
                        d.timings["preprocess"] += decode_ms / plan.size
                        d.timings["queue"] = max(0.0, (started - jobs[rid].submitted) * 1000)
                        results[rid] = d
            with self._cond:
                self.scheduler.update(plan, [results.get(rid) for rid in plan.request_ids])
                for rid in plan.request_ids:
                    self._jobs.pop(rid, None)
                self._cond.notify_all()
            for rid, d in results.items():
                jobs[rid].future.set_result(d)

    # -- lifecycle --
    def close(self, drain: bool = True, timeout: float | None = 60.0) -> None:
        """Stop accepting requests. drain=True runs everything queued first; drain=False
        fails queued requests with EngineClosedError (running batches still finish)."""
        dropped = []
        with self._cond:
            if self._closed:
                return
            self._closed, self._drain = True, drain
            if not drain:
                for rid in [r for r in self._jobs if r not in self.scheduler.in_flight]:
                    if self.scheduler.abort(rid):
                        dropped.append(self._jobs.pop(rid).future)
            self._cond.notify_all()
        for future in dropped:
            future.set_exception(EngineClosedError("the vision engine closed before this request ran"))
        self._batcher.join(timeout)
        self._inferer.join(timeout)
        self.runner.release_memory()

    def stats(self) -> dict:
        sizes = self.scheduler.batch_sizes
        return {
            "model": self.runner.description,
            "preferred_batch_sizes": list(self.preferred_batch_sizes),
            "profile_images_per_s": {k: round(v, 2) for k, v in self.profile_rates.items()},
            "batches": len(sizes),
            "batch_size_counts": {s: sizes.count(s) for s in sorted(set(sizes))},
        }

    def __enter__(self) -> "VisionEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
