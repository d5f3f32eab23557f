"""VisionEngine: futures, dynamic batching, bad inputs, priorities, timeouts, cancellation,
failing batches, memory, close; and the batch path it shares with the Runtime (run_batch).

No test waits for time to pass: a `Gate` holds forward passes and says when batches reached
it, so each test knows where every request is before it acts. Timeouts are safety limits.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import CancelledError, Future

import cv2
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ultralytics.utils import ASSETS

from runtime.memory import DeviceMemoryManager, MemoryConfig
from runtime.vision.batch import VisionJob, resolve, run_batch
from runtime.vision.config import VisionConfig, vision_batching
from runtime.vision.engine import EngineClosedError, VisionEngine, VisionInputError
from runtime.vision.postprocess import Detections
from schedulers import Batch, QueueFullError
from sources.base import Frame

BUS = str(ASSETS / "bus.jpg")
SAFETY_S = 60  # an upper bound on any wait; reaching it means the test failed


def _config(**fields):
    """Small, fast settings; `batching` entries override max_batch_size=4, max_queue_delay_ms=20."""
    batching = {"max_batch_size": 4, "max_queue_delay_ms": 20.0, **fields.pop("batching", {})}
    return VisionConfig.from_dict({"imgsz": 160, "conf": 0.0, "profile": False, "batching": batching, **fields})


def _serial(**fields):
    """One request per batch, released at once: each request's position is known."""
    batching = {"max_batch_size": 1, "max_queue_delay_ms": 0.0, **fields.pop("batching", {})}
    return _config(batching=batching, **fields)


class Gate:
    """Holds every forward pass until opened, and counts batches prepared and forwards begun."""

    def __init__(self, engine: VisionEngine) -> None:
        self.opened = threading.Event()
        self._cond = threading.Condition()
        self.prepared = self.entered = 0
        real_prepare, real_infer = engine.runner.prepare, engine.runner.infer

        def prepare(images):
            out = real_prepare(images)
            with self._cond:
                self.prepared += 1
                self._cond.notify_all()
            return out

        def infer(prepared):
            with self._cond:
                self.entered += 1
                self._cond.notify_all()
            if not self.opened.wait(SAFETY_S):
                raise RuntimeError("the test never opened the gate")
            return real_infer(prepared)

        engine.runner.prepare, engine.runner.infer = prepare, infer

    def wait(self, prepared: int = 0, entered: int = 0) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: self.prepared >= prepared and self.entered >= entered, SAFETY_S)
        assert ok, f"waited for {prepared} prepared / {entered} entered, saw {self.prepared} / {self.entered}"

    def open_when_closing(self, engine: VisionEngine) -> threading.Thread:
        """Open the gate once close() has marked the engine closed (close itself blocks until
        the held batches finish)."""

        def run() -> None:
            with engine._cond:
                engine._cond.wait_for(lambda: engine._closed, SAFETY_S)
            self.opened.set()

        t = threading.Thread(target=run)
        t.start()
        return t


def _alive(engine: VisionEngine) -> bool:
    return engine.stats()["workers_alive"] == engine.workers and engine._batcher.is_alive()


@pytest.fixture(scope="module")
def engine():
    eng = VisionEngine(_config())
    yield eng
    eng.close()


def test_every_input_kind_resolves_and_bad_inputs_fail_only_their_own_future(engine, tmp_path):
    from PIL import Image

    bad_file = tmp_path / "bad.jpg"
    bad_file.write_bytes(b"nope")
    image = cv2.imread(BUS)
    futures = {
        "path": engine.submit(BUS),
        "array": engine.submit(image),
        "pil": engine.submit(Image.open(BUS)),
        "frame": engine.submit(Frame("cam", 3, image=image)),
        "missing": engine.submit(str(tmp_path / "missing.jpg")),
        "corrupt": engine.submit(str(bad_file)),
        "float": engine.submit(np.zeros((8, 8, 3), np.float32)),
        "object": engine.submit(object()),
        "error_frame": engine.submit(Frame("cam", 4, error="stream 0 went away")),
    }
    for key in ("path", "array", "pil", "frame"):
        d = futures[key].result(timeout=SAFETY_S)
        assert d.orig_shape == image.shape[:2] and len(d) > 0
        assert {"preprocess", "inference", "postprocess", "queue"} <= set(d.timings)
    np.testing.assert_allclose(futures["path"].result().boxes, futures["array"].result().boxes, atol=1e-2)
    for key, text in [
        ("missing", "file not found"),
        ("corrupt", "cannot decode"),
        ("float", "uint8"),
        ("object", "expected a numpy array"),
        ("error_frame", "went away"),
    ]:
        with pytest.raises(VisionInputError, match=text):
            futures[key].result(timeout=SAFETY_S)
    assert engine.submit(BUS).result(timeout=SAFETY_S) is not None  # the loop keeps serving
    assert _alive(engine)


def test_dynamic_batching_groups_concurrent_requests():
    # A delay no test reaches: a batch is released only once max_batch_size requests wait.
    with VisionEngine(_config(batching={"max_queue_delay_ms": 600_000.0})) as eng:
        futures = [eng.submit(BUS) for _ in range(8)]
        results = [f.result(timeout=SAFETY_S) for f in futures]
        assert eng.scheduler.batch_sizes == [4, 4]
        assert [d.batch_size for d in results] == [4] * 8
        for d in results[1:]:  # grouped, every image still gets its own detections
            np.testing.assert_allclose(d.boxes, results[0].boxes, atol=1e-3)


def test_priority_zero_runs_first():
    # One worker, held at the gate: the order requests finish in is the order they ran in.
    eng = VisionEngine(_serial(workers=1))
    gate = Gate(eng)
    order: list[str] = []
    try:
        blocker = eng.submit(BUS)
        gate.wait(entered=1)  # the worker holds the blocker
        second = eng.submit(BUS, priority=1)
        gate.wait(prepared=2)  # the batcher took `second` before the rest arrived
        low = [eng.submit(BUS, priority=1) for _ in range(2)]
        high = eng.submit(BUS, priority=0)
        named = [("blocker", blocker), ("second", second), ("low0", low[0]), ("low1", low[1]), ("high", high)]
        for name, f in named:
            f.add_done_callback(lambda _, n=name: order.append(n))
        gate.opened.set()
        for _, f in named:
            f.result(timeout=SAFETY_S)
        assert order == ["blocker", "second", "high", "low0", "low1"]  # priority 0 first, then FIFO
    finally:
        gate.opened.set()
        eng.close()


def test_a_deadline_failure_runs_its_callbacks_outside_the_engine_lock():
    """A caller's done-callback that calls into the engine from another thread must not find
    the engine's lock held by the thread that failed the request (it used to be)."""
    eng = VisionEngine(_serial(workers=1))
    gate = Gate(eng)
    try:
        first = eng.submit(BUS)
        gate.wait(entered=1)  # the one worker is busy: the next request waits in the queue
        timed = eng.submit(BUS, deadline_s=1e-6)
        in_time: list[bool] = []
        called = threading.Event()

        def callback(_future) -> None:  # runs on whichever thread resolves the future
            t = threading.Thread(target=lambda: eng.submit(BUS).cancel())  # submit takes the engine's lock
            t.start()
            t.join(5)
            in_time.append(not t.is_alive())
            called.set()

        timed.add_done_callback(callback)
        gate.opened.set()
        with pytest.raises(TimeoutError):
            timed.result(timeout=SAFETY_S)
        assert called.wait(SAFETY_S)
        assert in_time == [True], "the callback's thread could not take the engine's lock"
        assert first.result(timeout=SAFETY_S) is not None
    finally:
        gate.opened.set()
        eng.close()


def test_queue_timeout_and_queue_full():
    eng = VisionEngine(_serial(workers=1, batching={"max_queue_size": 2}))
    gate = Gate(eng)
    try:
        first = eng.submit(BUS)
        gate.wait(entered=1)
        second = eng.submit(BUS)
        gate.wait(prepared=2)  # `second` waits in the hand-off slot; the rest stay queued
        # Due long before the batcher next looks: that is only once the first forward is done.
        timed = eng.submit(BUS, deadline_s=1e-6)
        kept = eng.submit(BUS)
        with pytest.raises(QueueFullError, match="max_queue_size=2"):
            eng.submit(BUS)
        with pytest.raises(ValueError, match="priority"):
            eng.submit(BUS, priority=5)
        assert len(eng.scheduler.queue) == 2
        gate.opened.set()
        with pytest.raises(TimeoutError, match="timed out after waiting"):
            timed.result(timeout=SAFETY_S)
        for f in (first, second, kept):
            assert f.result(timeout=SAFETY_S) is not None
        assert eng.scheduler.batch_sizes == [1, 1, 1]  # the timed-out request never ran
    finally:
        gate.opened.set()
        eng.close()


def test_cancelled_futures_leave_the_queue_and_never_stop_a_worker():
    eng = VisionEngine(_serial(workers=2))
    gate = Gate(eng)
    try:
        running = [eng.submit(BUS) for _ in range(2)]
        gate.wait(entered=2)  # both workers hold a batch
        slotted = eng.submit(BUS)
        gate.wait(prepared=3)  # formed and prepared: its future is running
        queued = [eng.submit(BUS) for _ in range(6)]
        assert len(eng.scheduler.queue) == 6
        # Cancelled while both batches run: each leaves the queue at once.
        assert all(f.cancel() for f in queued[::2])
        assert len(eng.scheduler.queue) == 3
        assert not running[0].cancel() and not slotted.cancel()  # formed batches run to the end
        gate.opened.set()
        for f in [*running, slotted, *queued[1::2]]:
            assert isinstance(f.result(timeout=SAFETY_S), Detections)
        assert all(f.cancelled() for f in queued[::2])
        assert eng.scheduler.batch_sizes == [1] * 6  # the cancelled requests never formed a batch
        # Cancel some of a second wave too, then check that every later request completes.
        more = [eng.submit(BUS) for _ in range(8)]
        for f in more[:3]:
            f.cancel()  # True if still queued; False if its batch formed, and then it runs
        later = [eng.submit(BUS) for _ in range(6)]
        for f in more:
            assert f.cancelled() or isinstance(f.result(timeout=SAFETY_S), Detections)
        assert all(isinstance(f.result(timeout=SAFETY_S), Detections) for f in later)
        assert _alive(eng) and not eng.scheduler.has_unfinished()
    finally:
        gate.opened.set()
        eng.close()


def test_a_future_cancelled_as_its_batch_forms_is_skipped_and_the_worker_goes_on():
    eng = VisionEngine(_serial(workers=1))
    formed, release = threading.Event(), threading.Event()
    real_schedule = eng.scheduler.schedule

    def schedule(now):  # holds the batcher between forming the first batch and starting it
        plan = real_schedule(now)
        if plan.size and not formed.is_set():
            formed.set()
            release.wait(SAFETY_S)
        return plan

    eng.scheduler.schedule = schedule
    try:
        first = eng.submit(BUS)
        assert formed.wait(SAFETY_S)
        # The cancel succeeds (the future is not running yet); its callback then waits for the
        # engine's lock, which the held batcher owns, so it runs on a thread of its own.
        canceller = threading.Thread(target=first.cancel)
        canceller.start()
        with pytest.raises(CancelledError):
            first.result(timeout=SAFETY_S)
        release.set()
        canceller.join(SAFETY_S)
        later = [eng.submit(BUS) for _ in range(4)]
        assert all(isinstance(f.result(timeout=SAFETY_S), Detections) for f in later)
        assert eng.scheduler.batch_sizes == [1] * 5  # the cancelled one formed a batch, then was skipped
        assert _alive(eng) and not eng.scheduler.has_unfinished()
    finally:
        release.set()
        eng.close()


def test_a_failing_batch_fails_only_its_own_requests_and_the_threads_go_on():
    eng = VisionEngine(_serial(workers=1))
    real_prepare, real_infer = eng.runner.prepare, eng.runner.infer
    faults = ["prepare", "infer", "short"]  # one fault per batch, in this order

    def prepare(images):
        if faults and faults[0] == "prepare":
            faults.pop(0)
            raise RuntimeError("staging buffer lost")
        return real_prepare(images)

    def infer(prepared):
        if faults and faults[0] == "infer":
            faults.pop(0)
            raise RuntimeError("device lost")
        if faults and faults[0] == "short":
            faults.pop(0)
            return []
        return real_infer(prepared)

    eng.runner.prepare, eng.runner.infer = prepare, infer
    try:
        for message in [
            "preprocessing failed .*staging buffer lost",
            "inference failed .*device lost",
            "inference failed .*returned 0 results for 1 inputs",
        ]:
            with pytest.raises(RuntimeError, match=message):
                eng.submit(BUS).result(timeout=SAFETY_S)
        assert all(isinstance(f.result(timeout=SAFETY_S), Detections) for f in [eng.submit(BUS) for _ in range(4)])
        assert _alive(eng) and not eng.scheduler.has_unfinished()
    finally:
        eng.close()


def test_close_drains_by_default():
    eng = VisionEngine(_serial(workers=1))
    gate = Gate(eng)
    futures = [eng.submit(BUS) for _ in range(4)]
    gate.wait(prepared=2, entered=1)  # one running, one in the slot, two queued
    assert len(eng.scheduler.queue) == 2
    opener = gate.open_when_closing(eng)
    eng.close()
    opener.join(SAFETY_S)
    assert all(isinstance(f.result(timeout=0), Detections) for f in futures)  # no accepted job lost
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(BUS)


def test_close_without_drain_fails_queued_requests_and_finishes_running_ones():
    eng = VisionEngine(_serial(workers=1))
    gate = Gate(eng)
    futures = [eng.submit(BUS) for _ in range(6)]
    gate.wait(prepared=2, entered=1)  # futures[0] running, futures[1] in the slot, four queued
    opener = gate.open_when_closing(eng)
    eng.close(drain=False)
    opener.join(SAFETY_S)
    assert all(isinstance(f.result(timeout=0), Detections) for f in futures[:2])
    for f in futures[2:]:
        with pytest.raises(EngineClosedError):
            f.result(timeout=0)
    assert eng.scheduler.batch_sizes == [1, 1]


def test_profiling_picks_a_preferred_size_and_memory_is_reserved():
    memory = DeviceMemoryManager(MemoryConfig(budget_bytes=2**30))
    eng = VisionEngine(
        _config(profile=True, batching={"max_batch_size": 2}, profile_iters=1, dtype="float32"), memory=memory
    )
    try:
        assert set(eng.profile_rates) == {1, 2} and all(r > 0 for r in eng.profile_rates.values())
        assert eng.preferred_batch_sizes == (eng.runner.best_batch_size(eng.profile_rates),)
        assert eng.scheduler.config.preferred_batch_sizes == eng.preferred_batch_sizes
        # VisionConfig's backend stays torch (the parity path); its start-up cost is reported
        startup = eng.stats()["startup"]
        assert eng.stats()["backend"] == startup["backend"] == startup["requested"] == "torch"
        assert startup["why"] == "configured" and startup["export_s"] == 0.0 and startup["skipped"] == {}
        assert 0 <= startup["profile_s"] < startup["startup_s"]  # 0.0 where the profile cache had the rates
        owner = eng.runner.memory_owner
        assert owner == "vision"
        owners = memory.stats()["owners"]
        assert set(owners) == {f"{owner}.weights", f"{owner}.batch_buffers", f"{owner}.activations"}
        # a batch being prepared plus one per worker, of uint8 staging + float32 input each
        assert owners[f"{owner}.batch_buffers"] == (eng.workers + 1) * 2 * 160 * 160 * 3 * 5
        assert owners[f"{owner}.activations"] > 160 * 160 * 3 * 4 * 2  # more than the input itself
        assert owners[f"{owner}.weights"] > 0
    finally:
        eng.close()
    assert memory.stats()["owners"] == {}


def test_engines_on_one_device_reserve_apart_and_release_only_their_own():
    memory = DeviceMemoryManager(MemoryConfig(budget_bytes=2**30))
    first = VisionEngine(_config(), memory=memory)
    second = VisionEngine(_config(), memory=memory)
    try:
        assert (first.runner.memory_owner, second.runner.memory_owner) == ("vision", "vision#2")
        mine = {k: v for k, v in memory.stats()["owners"].items() if k.startswith("vision#2.")}
        first.close()
        assert memory.stats()["owners"] == mine
        third = VisionEngine(_config(), memory=memory)  # takes the freed name "vision"
        assert third.runner.memory_owner == "vision"
        reserved = memory.reserved_bytes
        first.runner.release_memory()  # again: must not release the new "vision"
        assert memory.reserved_bytes == reserved
        third.close()
    finally:
        first.close()
        second.close()
    assert memory.stats()["owners"] == {}


def test_a_reservation_that_does_not_fit_fails_and_leaves_nothing_behind():
    memory = DeviceMemoryManager(MemoryConfig(budget_bytes=1024))
    with pytest.raises(MemoryError, match="vision"):
        VisionEngine(_config(), memory=memory)
    assert memory.stats()["owners"] == {} and memory.claim("vision") == "vision"


def test_best_batch_size_needs_a_clear_win(engine):
    assert engine.runner.best_batch_size({1: 10.0, 2: 10.3, 4: 9.0}) == 1
    assert engine.runner.best_batch_size({1: 10.0, 2: 10.3, 4: 12.0}) == 4


# -- the batch path on the calling thread (what the Runtime runs inline) --


def _jobs(n: int, now: float, deadline: float | None = None) -> dict[str, VisionJob]:
    return {f"r{i}": VisionJob(Future(), now, deadline) for i in range(n)}


def test_run_batch_resolves_every_job_on_the_calling_thread(engine):
    now = time.monotonic()
    jobs = _jobs(4, now - 0.5)  # queued half a second before the batch formed
    jobs["r3"].deadline = now - 0.25  # overdue before it even ran
    assert jobs["r2"].future.cancel()  # cancelled while queued, before the batch formed
    batch = Batch(list(jobs), [BUS, "/no/such/image.jpg", BUS, BUS])
    run_batch(engine.runner, batch, jobs, started=now)
    ok = jobs["r0"].future.result(timeout=0)
    assert ok.batch_size == 2 and ok.timings["queue"] == pytest.approx(500.0, abs=1e-6)
    with pytest.raises(VisionInputError, match="file not found"):
        jobs["r1"].future.result(timeout=0)
    assert jobs["r2"].future.cancelled()
    late = jobs["r3"].future.result(timeout=0)
    if "deadline_missed" in Detections.__dataclass_fields__:
        assert late.deadline_missed and not ok.deadline_missed
    else:
        assert not hasattr(late, "deadline_missed")  # no field yet: nothing is set


def test_run_batch_fails_the_batch_when_the_forward_fails():
    class BrokenRunner:
        def prepare(self, images):
            return object()

        def infer(self, prepared):
            raise RuntimeError("out of device memory")

    jobs = _jobs(3, time.monotonic())
    run_batch(BrokenRunner(), Batch(list(jobs), [BUS] * 3), jobs, started=time.monotonic())  # does not raise
    for job in jobs.values():
        with pytest.raises(RuntimeError, match="inference failed for a batch of 3: .*out of device memory"):
            job.future.result(timeout=0)


def test_resolve_skips_cancelled_and_done_futures():
    cancelled, done, fresh = Future(), Future(), Future()
    cancelled.cancel()
    done.set_result(1)
    assert not resolve(cancelled, 2) and not resolve(done, error=ValueError("late"))
    assert done.result() == 1 and cancelled.cancelled()
    assert resolve(fresh, error=ValueError("bad")) and isinstance(fresh.exception(), ValueError)


# -- config --


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"imgsz": 100}, "multiple of 32"),
        ({"conf": 1.5}, r"conf must be a number in \[0, 1\]"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"device": "tpu"}, "device must be"),
        ({"batching": {"max_batch_size": 0}}, "batching.max_batch_size must be an integer >= 1"),
        ({"batching": {"preferred_batch_sizes": [16]}}, r"batching.preferred_batch_sizes .*\[1, max_batch_size=8\]"),
        ({"batching": {"max_queue_delay_ms": -1}}, "batching.max_queue_delay_ms must be a number >= 0"),
        ({"batching": {"max_batch": 4}}, "unknown batching field.*'batching.max_batch'"),
        ({"max_batch_size": 4, "color": 1}, "unknown VisionConfig field.*'color', 'max_batch_size'.*under 'batching'"),
        ({"batching": [4]}, "batching must be a schedulers.DynamicBatchConfig"),
    ],
)
def test_config_errors_name_the_field_and_range(fields, message):
    with pytest.raises(ValueError, match=message):
        VisionConfig.from_dict(fields)


def test_from_dict_nests_batching_over_the_vision_defaults():
    config = VisionConfig.from_dict({"model": "yolo26n.yaml", "batching": {"max_batch_size": 4}})
    assert config == VisionConfig(batching=vision_batching(max_batch_size=4))
    b = config.batching
    assert (b.max_batch_size, b.max_queue_size, b.priority_levels) == (4, 256, 2)  # the vision defaults beneath
    assert VisionConfig.from_dict({}) == VisionConfig()
    with pytest.raises(ValueError, match="from_dict takes a dict"):
        VisionConfig(batching={"max_batch_size": 4})
