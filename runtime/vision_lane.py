"""The vision side of a Runtime: a YOLO runner, the dynamic batcher, and inference workers,
one per lane of the device, that take due batches themselves.

    submit_detect() -> DynamicBatchScheduler -> worker thread (when its lane is allowed):
                       form the batch, decode, letterbox, forward, resolve futures

A worker takes a batch as soon as one is due and vision may use another lane
(`allowed()`, from the arbiter: every lane while the LLM is idle, all but one while it
works), or when the loop grants the LLM's last lane to an urgent batch (`grant()`). So a
frame never waits for an LLM step to end. Each worker runs with `threads` torch threads (1
on CPU: see runtime/vision/engine.py for the measurements behind one single-threaded worker
per core); single-threaded workers create no OpenMP pool, so the LLM step beside them is the
only pool in the process. With no LLM work, every worker is fed, as in the standalone
VisionEngine.

State (scheduler, jobs, busy count, grants) is guarded by the Runtime's condition.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import torch

from runtime.handles import DeadlineExceededError, RuntimeClosedError
from runtime.memory import DeviceMemoryManager
from runtime.vision.batch import VisionJob, infer_batch, prepare_batch, resolve
from runtime.vision.config import VisionConfig
from runtime.vision.engine import _in_thread, profiled_batching
from runtime.vision.runner import YoloRunner
from schedulers import DynamicBatchScheduler
from schedulers.arbiter import VisionState


class VisionLane:
    def __init__(self, config: VisionConfig, memory: DeviceMemoryManager, cond: threading.Condition,
                 on_batch: Callable[[int, float, float, list[float]], None], allowed: Callable[[], int]) -> None:  # fmt: skip
        """on_batch(size, start, end, queue_delays_s) after each batch; allowed() -> lanes vision may fill on
        its own now. Both are called with `cond` held."""
        self.config = c = config
        self.workers, self.threads = c.threads()
        self.runner = _in_thread(lambda: YoloRunner(c, None, memory, workers=self.workers), self.threads)
        try:
            batching, self.profile_rates = profiled_batching(self.runner, c, self.threads, cache=True)
        except BaseException:
            self.runner.release_memory()
            raise
        self.scheduler = DynamicBatchScheduler(batching)
        self._cond = cond
        self._on_batch, self._allowed = on_batch, allowed
        self._grants = 0  # batches the loop allowed beyond allowed()
        self._stopping = False
        self.jobs: dict[str, VisionJob] = {}
        self._ids = itertools.count()
        self.busy = 0
        self.batch_ms: deque[float] = deque(maxlen=256)
        self.num_batches = 0
        self._threads = [threading.Thread(target=self._work, name=f"tandem-vision-{k}", daemon=True)
                         for k in range(self.workers)]  # fmt: skip
        for t in self._threads:
            t.start()

    @property
    def names(self) -> dict[int, str]:
        return self.runner.names

    def profile_costs(self) -> list[tuple[int, float]]:
        """(batch size, seconds per batch) from the start-up profile, for the arbiter."""
        return [(bs, bs / rate) for bs, rate in self.profile_rates.items() if rate > 0]

    # ---- callers' threads -------------------------------------------------------------------

    def submit(self, item: Any, priority: int, deadline_s: float | None, request_id: str | None) -> Future:
        """Queue one image (cond held by the caller)."""
        if deadline_s is not None and (
            isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0
        ):
            raise ValueError(f"deadline_s must be a number of seconds > 0 or None, got {deadline_s!r}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string or None, got {request_id!r}")
        rid = request_id if request_id is not None else f"img-{next(self._ids)}"
        if rid in self.jobs:
            raise ValueError(f"request_id {rid!r} is already in use")
        now = time.monotonic()
        self.scheduler.add_request(rid, item, now, priority, None if deadline_s is None else deadline_s * 1000)
        future: Future = Future()
        self.jobs[rid] = VisionJob(future, now, None if deadline_s is None else now + deadline_s)
        future.add_done_callback(lambda f, rid=rid: f.cancelled() and self._cancelled(rid))
        return future

    def _cancelled(self, rid: str) -> None:
        with self._cond:
            if self.scheduler.abort(rid):  # still queued: it leaves the queue now
                self.jobs.pop(rid, None)

    # ---- the loop (cond held) ---------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.jobs)

    def state(self, now: float, target_latency_s: float) -> VisionState:
        """What the arbiter needs. Requests whose deadline passed while queued are rejected here."""
        q = self.scheduler.queue
        for item, msg in q.expire(now):
            self._reject(item.request_id, msg)
        if not len(q):
            return VisionState(0)
        in_flight = self.scheduler.in_flight
        oldest = min(
            (j.deadline if j.deadline is not None else j.submitted + target_latency_s)
            for rid, j in self.jobs.items() if rid not in in_flight
        )  # fmt: skip
        due = self.scheduler.next_due(now)
        size = q.release_size(now) if due == 0 else 0
        return VisionState(size, oldest, due)

    def next_expiry(self, now: float) -> float | None:
        """Seconds until the earliest deadline of a queued request (None: no deadline queued),
        so that a loop waiting for busy workers still rejects it on time."""
        in_flight = self.scheduler.in_flight
        deadlines = [j.deadline for rid, j in self.jobs.items() if j.deadline is not None and rid not in in_flight]
        return max(0.0, min(deadlines) - now) if deadlines else None

    def grant(self) -> None:
        """Let one due batch take a lane beyond allowed() (the loop's urgent turn)."""
        self._grants += 1
        self._cond.notify_all()

    def _take(self, now: float):
        """A due batch for a worker, if its lane is allowed (cond held); None otherwise."""
        for item, msg in self.scheduler.queue.expire(now):
            self._reject(item.request_id, msg)
        allowed = self._allowed()
        if self.scheduler.next_due(now) != 0:
            if self._grants:
                self._grants = 0  # a grant is for a batch due now, not for later ones
                self._cond.notify_all()  # the loop waits to see it used or dropped
            return None
        if self.busy >= allowed + self._grants:
            return None
        batch = self.scheduler.schedule(now)
        for rid, msg in batch.rejected.items():
            self._reject(rid, msg)
        if not batch.size:
            return None
        if self.busy >= allowed:
            self._grants -= 1
            self._cond.notify_all()  # the loop waits to see its grant used
        self.busy += 1
        return batch, {rid: self.jobs[rid] for rid in batch.request_ids if rid in self.jobs}, time.monotonic()

    def _reject(self, rid: str, msg: str) -> None:
        job = self.jobs.pop(rid, None)
        if job is not None:
            resolve(job.future, error=DeadlineExceededError(msg + " (past its deadline)"))

    def fail_queued(self, error: BaseException) -> None:
        """Take every queued request out and fail it (close without draining, or a broken runtime)."""
        for rid in [r for r in self.jobs if r not in self.scheduler.in_flight]:
            if self.scheduler.abort(rid):
                resolve(self.jobs.pop(rid).future, error=error)

    # ---- worker threads ---------------------------------------------------------------------

    def _work(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # OpenMP: this thread's own; MKL: see Runtime._run
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        return
                    now = time.monotonic()
                    taken = self._take(now)
                    if taken is not None:
                        break
                    due = self.scheduler.next_due(now) if self.busy < self._allowed() + self._grants else None
                    self._cond.wait(due)
            batch, jobs, started = taken
            t0 = time.monotonic()
            results: list = [None] * batch.size
            try:
                results = infer_batch(self.runner, prepare_batch(self.runner, batch, jobs, started))
            except BaseException as exc:  # noqa: BLE001 - infer_batch raises nothing; belt and braces
                for job in jobs.values():
                    resolve(job.future, error=RuntimeError(f"vision batch failed: {exc}"))
            t1 = time.monotonic()
            with self._cond:
                self.scheduler.update(batch, results)
                for rid in batch.request_ids:
                    self.jobs.pop(rid, None)
                self.busy -= 1
                self.num_batches += 1
                self.batch_ms.append((t1 - t0) * 1000)
                self._on_batch(batch.size, t0, t1, [started - job.submitted for job in jobs.values()])
                self._cond.notify_all()

    def close(self, error: BaseException | None = None, timeout: float | None = 60.0) -> None:
        """Stop the workers (after the batches they run) and fail anything still open."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
        with self._cond:
            error = error or RuntimeClosedError("the runtime closed before this request ran")
            for job in self.jobs.values():
                resolve(job.future, error=error)
            self.jobs.clear()
        self.runner.release_memory()

    def stats(self) -> dict:
        sizes = self.scheduler.batch_sizes
        ms = sorted(self.batch_ms)
        return {
            "queued": len(self.scheduler.queue),
            "in_flight": len(self.scheduler.in_flight),
            "workers": self.workers,
            "threads_per_worker": self.threads,
            "busy_workers": self.busy,
            "batches": self.num_batches,
            "preferred_batch_sizes": list(self.scheduler.config.preferred_batch_sizes),
            "batch_size_counts": {s: sizes.count(s) for s in sorted(set(sizes))},
            "batch_ms_p50": ms[len(ms) // 2] if ms else None,
            "profile_images_per_s": {k: round(v, 2) for k, v in self.profile_rates.items()},
        }

