"""VisionEngine: dynamic batching of images onto a YOLO runner, behind futures.

    engine = VisionEngine(VisionConfig(model="yolo26n.yaml"))
    future = engine.submit("bus.jpg", priority=0, timeout_ms=500)
    detections = future.result()
    engine.close()

A batcher thread decodes and letterboxes the next batch while inference workers run earlier
ones (a one-slot hand-off: at most one prepared batch waits, so memory is bounded by
workers + 1 batches). Queue timeouts are checked whenever the batcher forms a batch, i.e. at
the latest when a running batch ends:

    submit() -> DynamicBatchScheduler -> [batcher: schedule, decode, letterbox] -> slot
             -> [inference worker x N: forward, postprocess] -> futures

Why several single-threaded workers on CPU rather than one worker with all cores (measured
on a 2-core AVX-512 Xeon, yolo26n at 640x480, traced graph): one forward at batch 1 gets
~1.4x from a second intra-op thread at best, while two batches side by side get ~2x. And
torch's OpenMP pool belongs to the thread that uses it: once the caller's thread has a pool
(any torch work there, as with Ultralytics in the same process), a second pool in an engine
thread puts libgomp over its CPU count, where its threads sleep at every barrier instead of
spinning (~700 wake-ups per forward). Forward passes at batch 1: one 2-thread worker ran at
14 images/s, two 1-thread workers, which use no pool at all, at 38.

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
import torch
from torch import nn

from runtime.memory import DeviceMemoryManager
from runtime.threads import settle_native_pools
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


def _in_thread(fn, threads: int | None):
    """fn() on a fresh thread with `threads` torch threads: the caller's thread count stays
    its own, and with 1 thread no OpenMP pool is created."""
    out: dict[str, Any] = {}

    def run() -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = exc

    t = threading.Thread(target=run, name="vision-setup")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class VisionEngine:
    def __init__(self, config: VisionConfig | None = None, module: nn.Module | None = None,
                 memory: DeviceMemoryManager | None = None) -> None:  # fmt: skip
        self.config = c = config or VisionConfig()
        settle_native_pools()  # before any thread of ours touches oneDNN (see runtime/threads.py)
        self.workers, self.threads = c.threads()
        # Built (model load, trace, check) on a helper thread with a worker's thread count, so
        # that the caller's torch thread setting stays its own (the runner applies num_threads).
        self.runner = _in_thread(lambda: YoloRunner(c, module, memory, workers=self.workers), self.threads)
        self.profile_rates: dict[int, float] = {}
        preferred = c.preferred_batch_sizes
        if not preferred and c.profile:
            sizes = sorted({b for b in PROFILE_SIZES if b <= c.max_batch_size} | {c.max_batch_size})
            # One worker's rates, measured the way a worker runs (its own thread and thread count).
            self.profile_rates = _in_thread(lambda: self.runner.profile(sizes), self.threads)
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
        self._inferers = [threading.Thread(target=self._infer_loop, name=f"vision-infer-{k}", daemon=True)
                          for k in range(self.workers)]  # fmt: skip
        self._batcher.start()
        for t in self._inferers:
            t.start()

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
        torch.set_num_threads(1)  # its torch work (uint8 -> float) is small; cores go to the workers
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
            for _ in self._inferers:
                self._slot.put(None)  # tells each inference worker no more batches come

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
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # per thread (OpenMP's setting is the calling thread's)
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
        for t in self._inferers:
            t.join(timeout)
        self.runner.release_memory()

    def stats(self) -> dict:
        sizes = self.scheduler.batch_sizes
        return {
            "model": self.runner.description,
            "preferred_batch_sizes": list(self.preferred_batch_sizes),
            "workers": self.workers,
            "threads_per_worker": self.threads,
            "profile_images_per_s": {k: round(v, 2) for k, v in self.profile_rates.items()},
            "batches": len(sizes),
            "batch_size_counts": {s: sizes.count(s) for s in sorted(set(sizes))},
        }

    def __enter__(self) -> "VisionEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
