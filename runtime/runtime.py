"""Runtime: one per device. Both engines under one loop thread and one memory budget.

    with Runtime(llm={"dtype": "bfloat16"}, vision={"model": "yolo26n.yaml"}) as rt:
        handle = rt.submit_generate("Hello", SamplingParams(max_tokens=32))   # any thread
        future = rt.submit_detect(frame, deadline_s=0.1)                      # any thread
        print(handle.result().text, future.result().boxes)

One loop thread owns the device. Each time something arrives or finishes, it asks the
arbiter (schedulers/arbiter.py) whether the next due vision batch or the next LLM step goes,
by deadline and predicted cost. The device has lanes: on a CPU one per core, on a GPU one.
A vision batch runs on one lane (a single-threaded vision worker that takes due batches
itself, runtime/vision/lane.py); an LLM step runs on the loop thread with every core. So on
a CPU the two workloads run side by side, a frame never waits for an LLM step, and the only
OpenMP pool is the loop thread's: never two pools competing. While a vision batch runs, its
worker shares a core with one of the step's threads (measured cheaper than re-sizing the
LLM's pool from step to step, see `_run`). On a GPU (one lane) they take turns. Either way,
when a vision backlog would miss its deadline if one more LLM step ran first, the arbiter
holds the LLM step until that batch has run (within a bounded share of the time).

Callers never touch the engines: submissions are checked on the caller's thread (bad input
raises ValueError there, naming the field), then handed to the loop through an inbox. A
failing step or batch fails only its own requests; an error the loop cannot survive marks
the Runtime broken, and every pending and later call fails at once with the reason.

Memory: the vision path is built first, so its measured peak is reserved before the LLM's KV
pool takes the rest of the budget, whatever order the configs were given in.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from runtime.handles import GenerationHandle, RuntimeClosedError
from runtime.llm.engine import EngineConfig, LLMEngine
from runtime.llm.sampling_params import SamplingParams
from runtime.memory import DeviceMemoryManager, MemoryConfig
from runtime.metrics import ServingMetrics
from runtime.threads import settle_native_pools
from schedulers.arbiter import LLM, VISION, WAIT, Arbiter, ArbiterConfig, LLMState

Prompt = str | list[int] | list[dict]


def _config(cls, value: Any, name: str):
    """A config object from itself, a dict of its fields, or None."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        if hasattr(cls, "from_dict"):
            return cls.from_dict(value)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{name}: unknown field(s) {unknown}; allowed: {sorted(known)}")
        return cls(**value)
    raise ValueError(f"{name} must be a {cls.__name__}, a dict of its fields, or None, got {type(value).__name__}")


def _cancellable(inner: Future) -> Future:
    """A future of `inner`'s outcome that can be cancelled until it has one. The vision
    front-end's own future refuses a cancel once its batch forms (it is marked running then);
    a caller (a cancelled job, a client gone) must not wait for that batch to be told no."""
    outer: Future = Future()

    def relay(f: Future) -> None:
        try:
            if f.cancelled():
                outer.cancel()
            elif f.exception() is not None:
                outer.set_exception(f.exception())
            else:
                outer.set_result(f.result())
        except InvalidStateError:  # cancelled meanwhile: the outcome is dropped
            pass

    outer.add_done_callback(lambda f: f.cancelled() and inner.cancel())
    inner.add_done_callback(relay)
    return outer


def _is_messages(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and isinstance(p[0], dict)


class Runtime:
    def __init__(
        self,
        llm: EngineConfig | dict | None = None,
        vision: Any = None,
        memory: DeviceMemoryManager | None = None,
        arbiter: ArbiterConfig | dict | None = None,
        profile: bool = True,
    ) -> None:
        """llm / vision: an EngineConfig / VisionConfig, a dict of its fields, or None (that
        workload is absent). profile: time LLM steps at start-up for the arbiter's cost model
        (it learns from every step either way)."""
        from runtime.vision.config import VisionConfig

        llm_config = _config(EngineConfig, llm, "llm")
        if isinstance(vision, dict) and "device" not in vision and llm_config is not None:
            vision = {**vision, "device": llm_config.resolved_device()}
        vision_config = _config(VisionConfig, vision, "vision")
        if llm_config is None and vision_config is None:
            raise ValueError("Runtime needs llm, vision or both (each a config, a dict of its fields, or None)")
        devices = {
            c.resolved_device() if isinstance(c, EngineConfig) else c.device
            for c in (llm_config, vision_config)
            if c is not None
        }
        if len(devices) > 1:
            raise ValueError(
                f"llm.device and vision.device must name one device (one Runtime per device), got {devices}"
            )
        self.device = devices.pop()
        arbiter_config = _config(ArbiterConfig, arbiter, "arbiter")
        self.memory = memory or DeviceMemoryManager(MemoryConfig(device=self.device))
        # Built on this thread, stepped on the loop thread. OpenMP (libgomp) then keeps two pools,
        # and with more pool threads than cores it throttles their spinning: a lone Runtime's
        # step runs on about 1.3 cores (measured: building on the loop thread instead made it
        # 1.2x faster). But beside a co-located server, Redis and client on two cores, the
        # served throughput was better this way (65 to 85 against 47 to 53 tokens/s), since
        # spinning workers stall whenever another process takes their core. See BENCHMARKS.md.
        settle_native_pools()  # on this thread, before any engine thread touches oneDNN
        self._cond = threading.Condition()
        self._inbox: deque[Callable[[], None]] = deque()
        self._handles: dict[str, GenerationHandle] = {}
        self._closing = False
        self._drain = True
        self._broken: str | None = None
        self.step_ms: deque[float] = deque(maxlen=256)
        self.metrics = ServingMetrics()  # Prometheus figures, as vLLM names them (runtime/metrics.py)
        self._num_preemptions = 0
        self._spec_counted: dict[str, int] = {}  # speculation's SchedulerStats totals already counted
        self._num_computed_prompt = 0  # SchedulerStats.num_computed_prompt_tokens, fed as num_preemptions is
        self.vision = self.llm = None
        self._blocked_since: float | None = None  # vision holds every lane while the LLM waits
        self._llm_active = False  # the LLM has work: vision leaves it a lane
        import torch

        self._cpu_threads = torch.get_num_threads()
        self.arbiter = Arbiter(arbiter_config)  # its lanes are known once vision is built
        try:
            if vision_config is not None:  # first: the KV pool is sized from what vision leaves
                from runtime.vision.lane import VisionLane

                self.vision = VisionLane(
                    vision_config,
                    self.memory,
                    self._cond,
                    self._on_vision_batch,
                    lambda: self.arbiter.vision_lanes(self._llm_active),
                )
                self.arbiter.lanes = self.vision.workers
                for size, seconds in self.vision.profile_costs():
                    self.arbiter.vision_cost.observe((size,), seconds)
            if llm_config is not None:
                self.llm = LLMEngine(llm_config, self.memory)
                if self.vision is None:
                    self.arbiter.lanes = 1  # no vision: the LLM step always gets every thread
                if profile:
                    from runtime.llm.profile import profile_steps

                    for shape, seconds in profile_steps(self.llm):
                        self.arbiter.llm_cost(self.arbiter.lanes).observe(shape, seconds)
        except BaseException:
            self._release()
            raise
        self._loop = threading.Thread(target=self._run, name="tandem-runtime", daemon=True)
        self._loop.start()

    # ---- entry points (any thread) ----------------------------------------------------------

    @property
    def tokenizer(self):
        return None if self.llm is None else self.llm.tokenizer

    @property
    def max_model_len(self) -> int | None:
        return None if self.llm is None else self.llm.max_model_len

    def submit_generate(
        self,
        prompt_or_messages: Prompt,
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
        request_id: str | None = None,
        num_resumed_outputs: int = 0,
        *,
        tenant: str = "",
        tier: str = "interactive",
    ) -> GenerationHandle:
        """Queue a generation: a prompt (text or token ids) or chat messages. Bad input raises
        ValueError here, naming the field. Iterate the handle for streamed outputs; its
        `result()` gives the final RequestOutput. `num_resumed_outputs` (a resumed job): the
        prompt's last n token ids are the request's earlier outputs, `sampling_params` the
        original ones, and the outputs hold only what is new (LLMEngine's docstring). `tenant`
        and `tier`: the scheduler's fair shares (LLMEngine.prepare)."""
        engine = self._require("llm")
        prompt = (
            engine.apply_chat_template(prompt_or_messages) if _is_messages(prompt_or_messages) else prompt_or_messages
        )
        prepared = engine.prepare(
            prompt, sampling_params, request_id, priority, deadline_s, num_resumed_outputs, tenant=tenant, tier=tier
        )
        rid = prepared.request_id
        handle = GenerationHandle(rid, self._cancel_generate)
        with self._cond:
            self._check_open()
            if rid in self._handles:
                raise ValueError(f"request_id {rid!r} is already in use")
            self._handles[rid] = handle
            self._post(lambda: self._add_generate(prepared, handle))
        handle.add_done_callback(self._forget)
        return handle

    def submit_detect(
        self, item: Any, priority: int = 0, deadline_s: float | None = None, request_id: str | None = None
    ) -> Future:
        """Queue one image (array, PIL image, path or Frame); the future gets its Detections.
        Cancelling the future succeeds at any point before its result: a queued request is
        taken out of the queue; one whose batch formed already runs on, its result dropped. Raises QueueFullError when the queue
        is full, ValueError for bad fields; a bad *image* fails only its own future."""
        lane = self._require("vision")
        with self._cond:
            self._check_open()
            inner = lane.submit(item, priority, deadline_s, request_id)
            self._cond.notify_all()
        return _cancellable(inner)

    def submit_detect_group(self, items: list, priority: int = 0, deadline_s: float | None = None) -> list:
        """Queue images that belong together (a frame of each camera, workers/cameras_mux.py) under
        one hold of the lock the loop schedules under, so no batch is released between them:
        they share a forward pass unless max_batch_size or a preferred batch size splits them.
        Per item its Future, or the exception that refused it (QueueFullError, ValueError), so
        one bad frame does not refuse the others; RuntimeClosedError when closed, as submit_detect."""
        lane = self._require("vision")
        outcomes: list = []
        with self._cond:
            self._check_open()
            for item in items:
                try:
                    outcomes.append(_cancellable(lane.submit(item, priority, deadline_s, None)))
                except (RuntimeError, ValueError) as exc:  # QueueFullError is a RuntimeError
                    outcomes.append(exc)
            self._cond.notify_all()
        return outcomes

    @property
    def broken(self) -> str | None:
        """Why this Runtime serves no more requests (its loop hit an error it cannot survive, or
        its thread is gone); None while it works. A host polls this to leave and be restarted."""
        if self._broken is None and not self._closing and not self._loop.is_alive():
            return "the runtime's loop thread is gone"
        return self._broken

    def fail_loop(self, reason: str) -> None:
        """Break the loop thread as an error it cannot survive would (fault drills: what a
        worker does when its Runtime breaks)."""

        def fail() -> None:
            raise RuntimeError(reason)

        self._post(fail)

    def llm_load(self):
        """The LLM scheduler's SchedulerStats now (queue depth, running, KV use); None without an LLM."""
        if self.llm is None:
            return None
        with self._cond:
            return self.llm.scheduler.stats()

    def stats(self) -> dict:
        """The memory budget by owner, queue depths, running counts, recent timings."""
        with self._cond:
            out: dict[str, Any] = {"memory": self.memory.stats(), "broken": self._broken}
            if self.llm is not None:
                load = self.llm.scheduler.stats()
                ms = sorted(self.step_ms)
                usage = load.kv_cache_usage
                out["llm"] = {
                    "waiting": load.num_waiting,
                    "running": load.num_running,
                    "kv_cache_usage": None if usage is None else round(usage, 4),
                    "preemptions": load.num_preemptions,
                    "steps": self.llm.num_steps,
                    "failed_steps": self.llm.num_failed_steps,
                    "step_ms_p50": ms[len(ms) // 2] if ms else None,
                    "step_ms_p99": ms[int(len(ms) * 0.99)] if ms else None,
                }
            if self.vision is not None:
                out["vision"] = self.vision.stats()
            now = time.monotonic()
            out["arbiter"] = {
                "lanes": self.arbiter.lanes,
                "turns": dict(self.arbiter.counts),
                "reasons": dict(self.arbiter.reasons),
                "vision_share": round(self.arbiter.vision_share(now), 3),
            }
        return out

    def metrics_snapshot(self) -> dict:
        """runtime/metrics.py's JSON snapshot: counters and histograms, and the gauges now."""
        gauges: dict[str, float] = {}
        with self._cond:
            if self.llm is not None:
                load = self.llm.scheduler.stats()
                gauges["num_requests_running"] = load.num_running
                gauges["num_requests_waiting"] = load.num_waiting
                if load.kv_cache_usage is not None:
                    gauges["kv_cache_usage_perc"] = load.kv_cache_usage
                # The scheduler counts preemptions since start; the metric is a counter of them.
                self.metrics.add("num_preemptions", load.num_preemptions - self._num_preemptions)
                self._num_preemptions = load.num_preemptions
                self.metrics.add("prompt_tokens_computed", load.num_computed_prompt_tokens - self._num_computed_prompt)
                self._num_computed_prompt = load.num_computed_prompt_tokens
                for name, total in (
                    ("spec_decode_num_drafts", load.spec_num_drafts),
                    ("spec_decode_num_draft_tokens", load.spec_num_draft_tokens),
                    ("spec_decode_num_accepted_tokens", load.spec_num_accepted_tokens),
                ):
                    self.metrics.add(name, total - self._spec_counted.get(name, 0))
                    self._spec_counted[name] = total
            if self.vision is not None:
                gauges["vision_queue_depth"] = self.vision.scheduler.stats().num_waiting
        return self.metrics.snapshot(gauges)

    def close(self, drain: bool = True, timeout: float | None = 120.0) -> None:
        """Stop accepting work. drain=True finishes everything accepted first; drain=False
        fails what has not finished with RuntimeClosedError. Then the loop stops and every
        memory reservation is released."""
        with self._cond:
            if self._closing:
                return
            self._closing, self._drain = True, drain
            if not drain:
                self._fail_pending(RuntimeClosedError("the runtime closed before this request finished"))
            self._cond.notify_all()
        self._loop.join(timeout)
        stuck = self._loop.is_alive()
        if stuck:
            self._broken = self._broken or f"close() timed out after {timeout} s with work pending"
        self._fail_pending(RuntimeClosedError(f"the runtime closed: {self._broken or 'closed'}"))
        if not stuck:
            self._release()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- helpers of the entry points --------------------------------------------------------

    def _require(self, kind: str):
        engine = self.llm if kind == "llm" else self.vision
        if engine is None:
            raise RuntimeError(f"this Runtime has no {kind} workload (pass {kind}=... when creating it)")
        self._check_open()
        return engine

    def _check_open(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"the runtime is broken and serves no more requests: {self._broken}")
        if self._closing:
            raise RuntimeError("the runtime is closed")

    def _post(self, command: Callable[[], None]) -> None:
        """Run `command` on the loop thread at its next turn (the engines are single-threaded)."""
        with self._cond:
            self._inbox.append(command)
            self._cond.notify_all()

    def _cancel_generate(self, request_id: str) -> None:
        self._post(lambda: self.llm.abort(request_id))

    def _forget(self, handle: GenerationHandle) -> None:
        with self._cond:
            if self._handles.get(handle.request_id) is handle:
                del self._handles[handle.request_id]

    def _add_generate(self, prepared, handle: GenerationHandle) -> None:
        try:
            self.llm.add_prepared(prepared, sink=lambda out: self._deliver(handle, out))
        except Exception as exc:  # noqa: BLE001 - e.g. more KV blocks than the pool has: that request's error
            handle._fail(exc)

    def _deliver(self, handle: GenerationHandle, out) -> None:
        """The engine's sink (loop thread): hand the output over; count a finished request."""
        if out.finish_reason is not None:
            self.metrics.observe_request(out)
        handle._push(out)

    def _fail_pending(self, error: BaseException) -> None:
        """Fail every request not yet finished (close without draining, or a broken loop)."""
        with self._cond:
            handles = list(self._handles.values())
            self._handles.clear()
            self._inbox.clear()
            if self.vision is not None:
                self.vision.fail_queued(error)
        for h in handles:
            h._fail(error)
        loop = getattr(self, "_loop", None)
        if self.llm is not None and (loop is None or loop is threading.current_thread() or not loop.is_alive()):
            self.llm.abort_all(str(error), "runtime_closed")  # nobody steps the engine any more: free their blocks
        elif self.llm is not None:
            self._post(lambda: self.llm.abort_all(str(error), "runtime_closed"))

    def _release(self) -> None:
        if self.vision is not None:
            self.vision.close(RuntimeClosedError("the runtime closed before this request ran"))
        if self.llm is not None:
            self.llm.close()

    # ---- the loop thread --------------------------------------------------------------------

    def _on_vision_batch(self, size: int, start: float, end: float, queue_delays_s: list[float]) -> None:
        """A vision worker finished a batch (cond held)."""
        self.metrics.observe_vision_batch(size, queue_delays_s)
        self.arbiter.record(VISION, start, end, (size,))
        if self._blocked_since is not None:  # a lane is free for the LLM again
            self.arbiter.add_busy(VISION, self._blocked_since, end)
            self._blocked_since = None

    def _next_expiry(self, now: float) -> float | None:
        """Seconds until some queued request's deadline (cond held)."""
        times = []
        if self.llm is not None and self.llm.next_deadline() is not None:
            times.append(max(0.0, self.llm.next_deadline() - now))
        if self.vision is not None:
            times.append(self.vision.next_expiry(now))
        times = [t for t in times if t is not None]
        return min(times) if times else None

    def _done(self) -> bool:
        """Closing and nothing left to do (cond held)."""
        if not self._closing:
            return False
        if not self._drain:
            return not self._inbox and (self.vision is None or self.vision.busy == 0)
        llm_idle = self.llm is None or not self.llm.has_unfinished()
        vision_idle = self.vision is None or not self.vision.has_work()
        return not self._inbox and llm_idle and vision_idle

    def _run(self) -> None:
        import torch

        # Every LLM step gets every core, whatever vision runs beside it: changing the thread
        # count from step to step cost more (a 16-sequence bfloat16 decode step went from 45
        # to 58 ms when alternating 1 and 2 threads) than a vision worker sharing a core for a
        # while (the mixed bench: inter-token p50 47 ms this way, 71 ms with the split).
        # With vision beside it, this thread keeps OpenMP's default (every core) and does not
        # call torch.set_num_threads: that also sets MKL's thread count for the whole process,
        # and the single-threaded vision workers' matmuls would then each start a second pool
        # (measured: a yolo26n forward at 320 went from 19 to 24 ms idle and 37 ms beside LLM
        # steps; the LLM step, whose MKL calls then run on one thread, from 52 to 60 ms).
        if self.vision is None:
            torch.set_num_threads(self._cpu_threads)
        target_s = self.arbiter.config.vision_target_latency_ms / 1000
        try:
            while True:
                with self._cond:
                    commands = list(self._inbox)
                    self._inbox.clear()
                for command in commands:
                    command()
                with self._cond:
                    if commands:
                        continue  # new work may change the choice
                    if self._done():
                        return
                    now = time.monotonic()
                    llm_state = None
                    if self.llm is not None:
                        if self.llm.next_deadline() is not None and self.llm.next_deadline() <= now:
                            self._post(lambda: self.llm.expire_queued(time.monotonic()))
                            continue
                        ready = self.llm.has_unfinished()
                        reqs, tokens = self.llm.next_step_shape() if ready else (0, 0)
                        llm_state = LLMState(ready, reqs, tokens)
                    ready = llm_state is not None and llm_state.ready
                    if ready != self._llm_active:
                        self._llm_active = ready
                        self._cond.notify_all()  # the lanes vision may use changed
                    busy = 0
                    vision_state = None
                    if self.vision is not None:
                        vision_state = self.vision.state(now, target_s)
                        busy = self.vision.busy
                    turn = self.arbiter.choose(now, llm_state, vision_state, busy)
                    if turn.kind == VISION:
                        self.vision.grant()
                        if self._blocked_since is None:
                            self._blocked_since = now
                        self._cond.wait(self._next_expiry(now))  # until the batch takes the lane
                        continue
                    if turn.kind == WAIT:
                        # Wake in time to reject a queued request at its deadline, too.
                        waits = [w for w in (turn.wait_s, self._next_expiry(now)) if w is not None]
                        if not self._inbox:
                            self._cond.wait(min(waits) if waits else None)
                        continue
                t0 = time.monotonic()
                self.llm.step()
                t1 = time.monotonic()
                with self._cond:
                    self.arbiter.record(LLM, t0, t1, self.llm.last_step_shape, lanes=turn.lanes)
                self.step_ms.append((t1 - t0) * 1000)
        except BaseException as exc:  # noqa: BLE001 - the loop cannot go on: say why, everywhere
            self._broken = f"{type(exc).__name__}: {exc}"
            self._fail_pending(RuntimeClosedError(f"the runtime broke: {self._broken}"))
