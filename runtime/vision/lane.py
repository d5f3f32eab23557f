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
VisionEngine. Submitting, cancelling, deadlines and stats are the shared front-end's
(runtime/vision/frontend.py).

State (scheduler, jobs, busy count, grants) is guarded by the Runtime's condition.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from runtime.handles import RuntimeClosedError
from runtime.memory import DeviceMemoryManager
from runtime.vision.batch import infer_batch, prepare_batch, resolve
from runtime.vision.config import VisionConfig
from runtime.vision.frontend import VisionFrontEnd
from schedulers.arbiter import VisionState


class VisionLane(VisionFrontEnd):
    def __init__(
        self,
        config: VisionConfig,
        memory: DeviceMemoryManager,
        cond: threading.Condition,
        on_batch: Callable[[int, float, float, list[float]], None],
        allowed: Callable[[], int],
    ) -> None:
        """on_batch(size, start, end, queue_delays_s) after each batch; allowed() -> lanes vision may fill on
        its own now. Both are called with `cond` held."""
        super().__init__(config, memory, cond)
        self._on_batch, self._allowed = on_batch, allowed
        self._grants = 0  # batches the loop allowed beyond allowed()
        self._stopping = False
        self.busy = 0
        self.batch_ms: deque[float] = deque(maxlen=256)
        self._threads = [
            threading.Thread(target=self._work, name=f"tandem-vision-{k}", daemon=True) for k in range(self.workers)
        ]
        for t in self._threads:
            t.start()

    # ---- the loop (cond held) ---------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.jobs)

    def state(self, now: float, target_latency_s: float) -> VisionState:
        """What the arbiter needs. Requests whose deadline passed while queued are rejected here."""
        self.expire(now)
        q = self.scheduler.queue
        if not len(q):
            return VisionState(0)
        in_flight = self.scheduler.in_flight
        oldest = min(
            (j.deadline if j.deadline is not None else j.submitted + target_latency_s)
            for rid, j in self.jobs.items()
            if rid not in in_flight
        )
        due = self.scheduler.next_due(now)
        size = q.release_size(now) if due == 0 else 0
        return VisionState(size, oldest, due)

    def grant(self) -> None:
        """Let one due batch take a lane beyond allowed() (the loop's urgent turn)."""
        self._grants += 1
        self._cond.notify_all()

    def _take(self, now: float):
        """A due batch for a worker, if its lane is allowed (cond held); None otherwise."""
        self.expire(now)
        allowed = self._allowed()
        if self.scheduler.next_due(now) != 0:
            if self._grants:
                self._grants = 0  # a grant is for a batch due now, not for later ones
                self._cond.notify_all()  # the loop waits to see it used or dropped
            return None
        if self.busy >= allowed + self._grants:
            return None
        batch, jobs = self.schedule(now)
        if not batch.size:
            return None
        if self.busy >= allowed:
            self._grants -= 1
            self._cond.notify_all()  # the loop waits to see its grant used
        self.busy += 1
        return batch, jobs, time.monotonic()

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
                self.finish(batch, results)
                self.busy -= 1
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
            self.fail_all(error or RuntimeClosedError("the runtime closed before this request ran"))
        self.runner.release_memory()

    def stats(self) -> dict:
        ms = sorted(self.batch_ms)
        return {**super().stats(), "busy_workers": self.busy, "batch_ms_p50": ms[len(ms) // 2] if ms else None}
