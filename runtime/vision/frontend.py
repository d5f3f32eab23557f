"""What every vision front-end shares, written once: the YOLO runner (built and profiled on a
thread of a worker's thread count), the dynamic batcher, and the jobs of accepted requests
with their futures: submit, cancel, deadlines, failing what is queued, stats.

Two front-ends differ only in who runs the batches, so each adds just its threads:

- `VisionEngine` (runtime/vision/engine.py), standalone: a batcher thread prepares batch N+1
  while inference threads run batch N;
- `VisionLane` (runtime/vision/lane.py), inside a Runtime: worker threads take due batches
  when the arbiter lets vision use a lane of the device beside the LLM.

State (scheduler, jobs) is guarded by `cond`: the front-end's own, or the Runtime's. It is a
re-entrant condition, so a caller that holds it (the Runtime) may call `submit`. With
`defer_failures`, the futures of requests that fail while the condition is held (deadlines,
close) are resolved only by `resolve_failed()`, which the front-end calls once it has let go of
the condition: a caller's done-callback then never runs under the front-end's lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

from torch import nn

from runtime.handles import DeadlineExceededError
from runtime.memory import DeviceMemoryManager
from runtime.threads import run_in_thread
from runtime.vision.batch import VisionJob, resolve
from runtime.vision.config import VisionConfig
from runtime.vision.profiling import profiled_batching
from runtime.vision.runner import YoloRunner
from schedulers import Batch, DynamicBatchScheduler

log = logging.getLogger("tandem.vision")  # `tandem streams` and the workers show INFO; `tandem detect` prints the line


class VisionFrontEnd:
    def __init__(
        self,
        config: VisionConfig,
        memory: DeviceMemoryManager | None,
        cond: threading.Condition,
        module: nn.Module | None = None,
        defer_failures: bool = False,
    ) -> None:
        self.config = c = config
        self.workers, self.threads = c.threads()
        t0 = time.perf_counter()
        # Built (model load, trace, check) on a helper thread with a worker's thread count, so
        # that the caller's torch thread setting stays its own (the runner applies num_threads).
        self.runner = run_in_thread(lambda: YoloRunner(c, module, memory, workers=self.workers), self.threads)
        try:
            # A module passed in is not identified by config.model: measure it, do not cache.
            batching, self.profile_rates = profiled_batching(self.runner, c, self.threads, cache=module is None)
        except BaseException:
            self.runner.release_memory()
            raise
        self.startup_s = time.perf_counter() - t0
        log.info(self.startup_line())
        self.scheduler = DynamicBatchScheduler(batching)
        self._cond = cond
        self._defer = defer_failures
        self._failed: list[tuple[Future, BaseException]] = []  # to resolve once cond is let go
        self.jobs: dict[str, VisionJob] = {}
        self._ids = itertools.count()

    @property
    def names(self) -> dict[int, str]:
        return self.runner.names

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]:
        """The sizes the scheduler prefers: configured, or the one profiling found fastest."""
        return self.scheduler.config.preferred_batch_sizes

    def startup(self) -> dict:
        """What the start-up chose to run on, why, and what it cost: seconds in all, of them
        exporting (0.0 where the exports were cached) and timing forwards (0.0 where the rates
        were cached); the rest loads and traces the model and opens the backend."""
        return {**self.runner.choice.summary(), "startup_s": round(self.startup_s, 2)}

    def startup_line(self) -> str:
        """One line for a start-up log: 'vision backend openvino (auto: ...); start-up 12.3 s
        (exports 7.1 s, profile 2.4 s)'."""
        s = self.startup()
        return (
            f"vision backend {s['backend']} ({s['why']}); start-up {s['startup_s']:.1f} s "
            f"(exports {s['export_s']:.1f} s, profile {s['profile_s']:.1f} s)"
        )

    def profile_costs(self) -> list[tuple[int, float]]:
        """(batch size, seconds per batch) from the start-up profile, for the arbiter."""
        return [(bs, bs / rate) for bs, rate in self.profile_rates.items() if rate > 0]

    # ---- callers' threads -------------------------------------------------------------------

    def submit(
        self, item: Any, priority: int = 0, deadline_s: float | None = None, request_id: str | None = None
    ) -> Future:
        """Queue one image (array, PIL image, path or Frame); the future gets its Detections.

        Raises QueueFullError when max_queue_size requests wait (retry later), ValueError for
        a bad priority, deadline or id. A bad *input* is not raised here: it is decoded when its
        batch forms and fails only its own future. `deadline_s`: if the request still waits
        then, it fails with DeadlineExceededError. Cancelling the future while the request
        waits takes it out of the queue; once its batch forms it can no longer be cancelled.
        """
        if deadline_s is not None and (
            isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0
        ):
            raise ValueError(f"deadline_s must be a number of seconds > 0 or None, got {deadline_s!r}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string or None, got {request_id!r}")
        future: Future = Future()
        with self._cond:
            self._check_open()
            rid = request_id if request_id is not None else f"img-{next(self._ids)}"
            if rid in self.jobs:
                raise ValueError(f"request_id {rid!r} is already in use")
            now = time.monotonic()
            timeout_ms = None if deadline_s is None else deadline_s * 1000
            queued = self.scheduler.add_request(rid, item, now, priority, timeout_ms)
            self.jobs[rid] = VisionJob(future, now, queued.deadline)
            future.add_done_callback(lambda f, rid=rid: f.cancelled() and self._cancelled(rid))
            self._cond.notify_all()
        return future

    def _check_open(self) -> None:
        """Raise if no request may be queued now (cond held)."""

    def _cancelled(self, rid: str) -> None:
        # A cancel succeeds only while the request waits (its batch marks the future running),
        # so taking it out of the queue is all there is to do.
        with self._cond:
            if self.scheduler.abort(rid):
                self.jobs.pop(rid, None)
                self._cond.notify_all()

    # ---- the threads that run batches (cond held) -------------------------------------------

    def _fail(self, future: Future, error: BaseException) -> None:
        if self._defer:
            self._failed.append((future, error))
        else:
            resolve(future, error=error)

    def resolve_failed(self) -> None:
        """Resolve the futures failed while the condition was held (call without holding it)."""
        with self._cond:
            failed, self._failed = self._failed, []
        for future, error in failed:
            resolve(future, error=error)

    def _reject(self, rid: str, msg: str) -> None:
        job = self.jobs.pop(rid, None)
        if job is not None:
            self._fail(job.future, DeadlineExceededError(msg + " (past its deadline)"))

    def expire(self, now: float) -> None:
        """Fail the queued requests whose deadline has passed."""
        for item, msg in self.scheduler.queue.expire(now):
            self._reject(item.request_id, msg)

    def next_expiry(self, now: float) -> float | None:
        """Seconds until the earliest deadline of a queued request (None: no deadline queued),
        so that a thread waiting for something else still rejects it on time."""
        in_flight = self.scheduler.in_flight
        deadlines = [j.deadline for rid, j in self.jobs.items() if j.deadline is not None and rid not in in_flight]
        return max(0.0, min(deadlines) - now) if deadlines else None

    def schedule(self, now: float) -> tuple[Batch, dict[str, VisionJob]]:
        """The batch due now (possibly empty) and its jobs; requests that timed out meanwhile fail."""
        batch = self.scheduler.schedule(now)
        for rid, msg in batch.rejected.items():
            self._reject(rid, msg)
        return batch, {rid: self.jobs[rid] for rid in batch.request_ids if rid in self.jobs}

    def finish(self, batch: Batch, results: list) -> None:
        """A batch ran: its members leave (their futures are resolved already)."""
        self.scheduler.update(batch, results)
        for rid in batch.request_ids:
            self.jobs.pop(rid, None)

    def fail_queued(self, error: BaseException) -> int:
        """Take every queued request out and fail it with `error`; returns how many."""
        dropped = [
            self.jobs.pop(rid)
            for rid in list(self.jobs)
            if rid not in self.scheduler.in_flight and self.scheduler.abort(rid)
        ]
        for job in dropped:
            self._fail(job.future, error)
        return len(dropped)

    def fail_all(self, error: BaseException) -> None:
        """Fail every request still open (once the threads that run batches are gone)."""
        for job in self.jobs.values():
            self._fail(job.future, error)
        self.jobs.clear()

    def stats(self) -> dict:
        sizes = self.scheduler.batch_sizes
        load = self.scheduler.stats()
        return {
            "model": self.runner.description,
            "backend": self.runner.backend,
            "startup": self.startup(),
            "queued": load.num_waiting,
            "in_flight": load.num_running,
            "workers": self.workers,
            "threads_per_worker": self.threads,
            "preferred_batch_sizes": list(self.preferred_batch_sizes),
            "profile_images_per_s": {k: round(v, 2) for k, v in self.profile_rates.items()},
            "batches": len(sizes),
            "batch_size_counts": {s: sizes.count(s) for s in sorted(set(sizes))},
        }
