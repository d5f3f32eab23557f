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

On a GPU there is by default one inference worker (the device runs one batch at a time
anyway) and the same hand-off carries the overlap further: the batcher decodes and letterboxes
batch N+1 (its images side by side, on the runner's host thread pool) into page-locked buffers
and issues its copy and cast on the runner's copy stream, which runs beside
batch N's forward on the worker's stream; the worker waits on the host only to read results
back (see runtime/vision/runner.py). `python -m runtime.vision.gpu_check` measures it.

Every accepted request's future resolves: with Detections, or with the error of its own bad
input, its queue timeout, a failed forward, or the engine closing without draining. Failures
stay with their request: no batch, bad input or cancelled future stops a thread (the batch
itself runs through runtime/vision/batch.py, which the Runtime's inline path shares). A future
cancelled while its request waits takes the request out of the queue; once its batch forms
the future is running and can no longer be cancelled.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from runtime.memory import DeviceMemoryManager
from runtime.threads import settle_native_pools
from runtime.vision.batch import ReadyBatch, VisionInputError, VisionJob, decode, infer_batch, prepare_batch, resolve
from runtime.vision.config import VisionConfig
from runtime.vision.runner import YoloRunner
from schedulers import Batch, DynamicBatchConfig, DynamicBatchScheduler

__all__ = ["EngineClosedError", "VisionEngine", "VisionInputError", "decode", "profiled_batching"]

PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64)


class EngineClosedError(RuntimeError):
    """The engine closed before this request ran (close(drain=False))."""


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


def _profile_key(config: VisionConfig, sizes: list[int], threads: int | None) -> str:
    """What the rates depend on: the model (and its file's size and time), the input size, the
    numeric settings, the threads and the machine (CPU model, cores, torch, GPU)."""
    import hashlib
    import json
    import os
    import platform

    model = config.model
    stamp = None
    if os.path.isfile(model):
        st = os.stat(model)
        model, stamp = os.path.abspath(model), [st.st_size, st.st_mtime_ns]
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    gpu = torch.cuda.get_device_name(torch.device(config.device)) if config.device.startswith("cuda") else None
    key = {
        "model": model, "stamp": stamp, "imgsz": config.imgsz, "dtype": config.resolved_dtype(), "device": config.device,
        "channels_last": config.channels_last, "jit": config.jit, "end2end": config.end2end, "sizes": sizes,
        "iters": config.profile_iters, "workers": config.threads()[0], "threads": threads, "host": platform.node(),
        "cpu": cpu, "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__, "gpu": gpu,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _profile_cache_path() -> str:
    import os

    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
    return os.path.join(root, "vision_profiles.json")


def _cached_rates(key: str, measure) -> dict[int, float]:
    """Rates from the profile cache, or measured and stored. Half of `tandem detect image.jpg`
    was this profiling (6 of 13 s); a cache miss or an unreadable cache only costs that."""
    import json
    import os
    import tempfile

    path = _profile_cache_path()
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    hit = cache.get(key)
    if isinstance(hit, dict) and hit:
        try:
            return {int(k): float(v) for k, v in hit.items()}
        except (TypeError, ValueError):
            pass
    rates = measure()
    cache[key] = {str(k): v for k, v in rates.items()}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".profiles-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: profile again next time
    return rates


def profiled_batching(
    runner: YoloRunner, config: VisionConfig, threads: int | None, cache: bool = False
) -> tuple[DynamicBatchConfig, dict[int, float]]:
    """config.batching, with the size profiling finds fastest as the preferred batch size when
    none is configured (and config.profile); and the measured images/s by batch size.
    `cache`: reuse rates measured before for the same model, input size and machine."""
    batching = config.batching
    if batching.preferred_batch_sizes or not config.profile:
        return batching, {}
    top = batching.max_batch_size
    sizes = sorted({b for b in PROFILE_SIZES if b <= top} | {top})
    # One worker's rates, measured the way a worker runs (its own thread and thread count).
    def measure() -> dict[int, float]:
        return _in_thread(lambda: runner.profile(sizes), threads)

    rates = _cached_rates(_profile_key(config, sizes, threads), measure) if cache else measure()
    return dataclasses.replace(batching, preferred_batch_sizes=(runner.best_batch_size(rates),)), rates


class VisionEngine:
    def __init__(self, config: VisionConfig | None = None, module: nn.Module | None = None,
                 memory: DeviceMemoryManager | None = None) -> None:  # fmt: skip
        self.config = c = config or VisionConfig()
        settle_native_pools()  # before any thread of ours touches oneDNN (see runtime/threads.py)
        self.workers, self.threads = c.threads()
        # Built (model load, trace, check) on a helper thread with a worker's thread count, so
        # that the caller's torch thread setting stays its own (the runner applies num_threads).
        self.runner = _in_thread(lambda: YoloRunner(c, module, memory, workers=self.workers), self.threads)
        try:
            # A module passed in is not identified by config.model: measure it, do not cache.
            batching, self.profile_rates = profiled_batching(self.runner, c, self.threads, cache=module is None)
        except BaseException:
            self.runner.release_memory()
            raise
        self.scheduler = DynamicBatchScheduler(batching)
        self._cond = threading.Condition()
        self._jobs: dict[str, VisionJob] = {}
        self._ids = itertools.count()
        self._closed = False
        self._drain = True
        self._slot: queue.Queue[ReadyBatch | None] = queue.Queue(maxsize=1)
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

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]:
        """The sizes the scheduler prefers: configured, or the one profiling found fastest."""
        return self.scheduler.config.preferred_batch_sizes

    def submit(self, item: Any, priority: int = 0, timeout_ms: float | None = None) -> Future:
        """Queue one image (array, PIL image, path or Frame); the future gets its Detections.

        Raises QueueFullError when max_queue_size requests wait (retry later), ValueError
        for a bad priority or timeout, RuntimeError after close(). A bad *input* is not
        raised here: it is decoded on the batcher thread and fails only its own future.
        Cancelling the future while the request still waits takes it out of the queue.
        """
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the vision engine is closed")
            request_id = f"img-{next(self._ids)}"
            now = time.monotonic()
            queued = self.scheduler.add_request(request_id, item, now, priority, timeout_ms)
            self._jobs[request_id] = VisionJob(future, now, queued.deadline)
            future.add_done_callback(lambda f, rid=request_id: self._on_done(rid, f))
            self._cond.notify_all()
        return future

    def _on_done(self, request_id: str, future: Future) -> None:
        # A cancel succeeds only while the request waits (its batch marks it running), so
        # taking it out of the queue here is all there is to do.
        if not future.cancelled():
            return
        with self._cond:
            if self.scheduler.abort(request_id):
                self._jobs.pop(request_id, None)
                self._cond.notify_all()

    # -- batcher thread --
    def _next_batch(self) -> tuple[Batch | None, dict[str, VisionJob], list[tuple[VisionJob, str]], float]:
        """Wait for a due batch: (batch, its jobs, timed-out jobs, when it formed); batch is
        None once closed and (if draining) empty."""
        with self._cond:
            while True:
                now = time.monotonic()
                plan = self.scheduler.schedule(now)
                expired = [(self._jobs.pop(rid), msg) for rid, msg in plan.rejected.items()]
                if plan.size or expired:
                    return plan, {rid: self._jobs[rid] for rid in plan.request_ids}, expired, now
                if self._closed and (not self._drain or len(self.scheduler.queue) == 0):
                    return None, {}, [], now
                self._cond.wait(self.scheduler.next_due(now))

    def _batch_loop(self) -> None:
        torch.set_num_threads(1)  # its torch work (uint8 -> float) is small; cores go to the workers
        try:
            while True:
                self._slot_free.acquire()
                plan, jobs, expired, formed = self._next_batch()
                for job, msg in expired:
                    resolve(job.future, error=TimeoutError(msg))
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
                    self.scheduler.update(ready.batch, results)
                    for rid in ready.batch.request_ids:
                        self._jobs.pop(rid, None)
                    self._cond.notify_all()

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
                dropped = [self._jobs.pop(rid) for rid in list(self._jobs) if self.scheduler.abort(rid)]
            self._cond.notify_all()
        for job in dropped:
            resolve(job.future, error=EngineClosedError("the vision engine closed before this request ran"))
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
            "workers_alive": sum(t.is_alive() for t in self._inferers),
            "threads_per_worker": self.threads,
            "profile_images_per_s": {k: round(v, 2) for k, v in self.profile_rates.items()},
            "batches": len(sizes),
            "batch_size_counts": {s: sizes.count(s) for s in sorted(set(sizes))},
        }

    def __enter__(self) -> "VisionEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
