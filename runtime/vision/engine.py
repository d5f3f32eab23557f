"""VisionEngine: dynamic batching of images onto a YOLO runner, behind futures.

    engine = VisionEngine(VisionConfig(model="yolo26n.yaml"))
    future = engine.submit("bus.jpg", priority=0, deadline_s=0.5)
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

On a GPU there is by default one inference worker (the device runs one batch at a time
anyway) and the same hand-off carries the overlap further: the batcher decodes and letterboxes
batch N+1 (its images side by side, on the runner's host thread pool) into page-locked buffers
and issues its copy and cast on the runner's copy stream, which runs beside
batch N's forward on the worker's stream; the worker waits on the host only to read results
back (see runtime/vision/runner.py). `python -m benchmarks.gpu_vision` measures it.

Every accepted request's future resolves: with Detections, or with the error of its own bad
input, its queue timeout, a failed forward, or the engine closing without draining. Failures
stay with their request: no batch, bad input or cancelled future stops a thread (the batch
itself runs through runtime/vision/batch.py, which the Runtime's inline path shares). A future
cancelled while its request waits takes the request out of the queue; once its batch forms
the future is running and can no longer be cancelled.
"""

from __future__ import annotations

import queue
import threading
import time

import torch
from torch import nn

from runtime.memory import DeviceMemoryManager
from runtime.threads import settle_native_pools
from runtime.vision.batch import ReadyBatch, VisionInputError, decode, infer_batch, prepare_batch
from runtime.vision.config import VisionConfig
from runtime.vision.frontend import VisionFrontEnd
from runtime.vision.profiling import profiled_batching

__all__ = ["EngineClosedError", "VisionEngine", "VisionInputError", "decode", "profiled_batching"]


class EngineClosedError(RuntimeError):
    """The engine closed before this request ran (close(drain=False))."""


class VisionEngine(VisionFrontEnd):
    def __init__(
        self,
        config: VisionConfig | None = None,
        module: nn.Module | None = None,
        memory: DeviceMemoryManager | None = None,
    ) -> None:
        settle_native_pools()  # before any thread of ours touches oneDNN (see runtime/threads.py)
        # Failures found under the condition are resolved outside it: a caller's callback
        # never runs under the engine's lock (see runtime/vision/frontend.py).
        super().__init__(config or VisionConfig(), memory, threading.Condition(), module, defer_failures=True)
        self._closed = False
        self._drain = True
        self._slot: queue.Queue[ReadyBatch | None] = queue.Queue(maxsize=1)
        # The batcher forms the next batch only once the inference thread has taken the last
        # one: batches are formed as late as possible (as large as the queue allows) and are
        # prepared while the previous one runs, never two ahead.
        self._slot_free = threading.Semaphore(1)
        self._batcher = threading.Thread(target=self._batch_loop, name="vision-batcher", daemon=True)
        self._inferers = [
            threading.Thread(target=self._infer_loop, name=f"vision-infer-{k}", daemon=True)
            for k in range(self.workers)
        ]
        self._batcher.start()
        for t in self._inferers:
            t.start()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the vision engine is closed")

    # -- batcher thread --
    def _next_batch(self):
        """Wait for a due batch, or for requests past their deadline to fail: (batch, its jobs,
        when it formed), the batch possibly empty; batch is None once closed and (if draining)
        empty."""
        with self._cond:
            while True:
                now = time.monotonic()
                plan, jobs = self.schedule(now)
                if plan.size or self._failed:
                    return plan, jobs, now
                if self._closed and (not self._drain or not self.scheduler.stats().num_waiting):
                    return None, {}, now
                self._cond.wait(self.scheduler.next_due(now))

    def _batch_loop(self) -> None:
        torch.set_num_threads(1)  # its torch work (uint8 -> float) is small; cores go to the workers
        try:
            while True:
                self._slot_free.acquire()
                plan, jobs, formed = self._next_batch()
                self.resolve_failed()  # past their deadline: resolved outside the lock
                if plan is None:
                    return
                if plan.size:  # prepare_batch fails its own batch's futures, never the loop
                    self._slot.put(prepare_batch(self.runner, plan, jobs, formed))
                else:
                    self._slot_free.release()
        finally:
            for _ in self._inferers:
                self._slot.put(None)  # tells each inference worker no more batches come

    # -- inference threads --
    def _infer_loop(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # per thread (OpenMP's setting is the calling thread's)
        while (ready := self._slot.get()) is not None:
            self._slot_free.release()
            results: list = [None] * ready.batch.size
            try:
                results = infer_batch(self.runner, ready)  # resolves the batch's futures, never raises
            finally:
                with self._cond:
                    self.finish(ready.batch, results)
                    self._cond.notify_all()

    # -- lifecycle --
    def close(self, drain: bool = True, timeout: float | None = 60.0) -> None:
        """Stop accepting requests. drain=True runs everything queued first; drain=False
        fails queued requests with EngineClosedError (running batches still finish)."""
        with self._cond:
            if self._closed:
                return
            self._closed, self._drain = True, drain
            if not drain:
                self.fail_queued(EngineClosedError("the vision engine closed before this request ran"))
            self._cond.notify_all()
        self.resolve_failed()
        self._batcher.join(timeout)
        for t in self._inferers:
            t.join(timeout)
        self.runner.release_memory()

    def stats(self) -> dict:
        return {**super().stats(), "workers_alive": sum(t.is_alive() for t in self._inferers)}

    def __enter__(self) -> VisionEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
