"""VisionEngine: futures, dynamic batching, bad inputs, priorities, timeouts, memory, close."""

from __future__ import annotations

import os
import threading
import time

import cv2
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ultralytics.utils import ASSETS  # noqa: E402

from runtime.memory import DeviceMemoryManager, MemoryConfig  # noqa: E402
from runtime.vision.config import VisionConfig  # noqa: E402
from runtime.vision.engine import EngineClosedError, VisionEngine, VisionInputError  # noqa: E402
from schedulers import QueueFullError  # noqa: E402
from sources.base import Frame  # noqa: E402

BUS = str(ASSETS / "bus.jpg")


def _config(**kw):
    base = dict(imgsz=160, conf=0.0, profile=False, max_batch_size=4, max_queue_delay_ms=20.0)
    base.update(kw)
    return VisionConfig(**base)


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
        d = futures[key].result(timeout=30)
        assert d.orig_shape == image.shape[:2] and len(d) > 0
        assert {"preprocess", "inference", "postprocess", "queue"} <= set(d.timings)
    np.testing.assert_allclose(futures["path"].result().boxes, futures["array"].result().boxes, atol=1e-2)
    for key, text in [("missing", "file not found"), ("corrupt", "cannot decode"), ("float", "uint8"),
                      ("object", "expected a numpy array"), ("error_frame", "went away")]:  # fmt: skip
        with pytest.raises(VisionInputError, match=text):
            futures[key].result(timeout=30)
    assert engine.submit(BUS).result(timeout=30) is not None  # the loop keeps serving


def test_dynamic_batching_groups_concurrent_requests(engine):
    before = len(engine.scheduler.batch_sizes)
    futures = [engine.submit(BUS) for _ in range(8)]
    sizes = {f.result(timeout=60).batch_size for f in futures}
    assert max(sizes) > 1 and max(engine.scheduler.batch_sizes[before:]) <= 4


def test_priority_zero_runs_first():
    # One worker: the blocked batch holds it, so every later request waits in the queue.
    eng = VisionEngine(_config(max_batch_size=1, max_queue_delay_ms=0.0, workers=1))
    gate = threading.Event()
    real_infer = eng.runner.infer
    order = []

    def slow_infer(prepared):
        gate.wait(10)
        return real_infer(prepared)

    eng.runner.infer = slow_infer
    try:
        blocker = eng.submit(BUS)  # occupies the inference thread
        time.sleep(0.3)
        second = eng.submit(BUS, priority=1)
        low = [eng.submit(BUS, priority=1) for _ in range(2)]
        high = eng.submit(BUS, priority=0)
        for name, f in [("low0", low[0]), ("low1", low[1]), ("high", high)]:
            f.add_done_callback(lambda _, n=name: order.append(n))
        gate.set()
        for f in [blocker, second, high, *low]:
            f.result(timeout=60)
        assert order[0] == "high"
    finally:
        eng.close()


def test_queue_timeout_and_queue_full():
    eng = VisionEngine(_config(max_batch_size=1, max_queue_delay_ms=0.0, max_queue_size=2, workers=1))
    gate = threading.Event()
    real_infer = eng.runner.infer
    eng.runner.infer = lambda p: (gate.wait(10), real_infer(p))[1]
    try:
        first = eng.submit(BUS)
        time.sleep(0.3)
        second = eng.submit(BUS)  # prepared while the first runs; the rest stay queued
        time.sleep(0.3)
        timed = eng.submit(BUS, timeout_ms=50)
        kept = eng.submit(BUS)
        with pytest.raises(QueueFullError, match="max_queue_size=2"):
            eng.submit(BUS)
        with pytest.raises(ValueError, match="priority"):
            eng.submit(BUS, priority=5)
        time.sleep(0.2)
        gate.set()
        with pytest.raises(TimeoutError, match="timed out"):
            timed.result(timeout=30)
        for f in (first, second, kept):
            assert f.result(timeout=60) is not None
    finally:
        eng.close()


def test_close_drains_by_default_and_fails_pending_without_drain():
    eng = VisionEngine(_config(max_batch_size=1, max_queue_delay_ms=0.0))
    futures = [eng.submit(BUS) for _ in range(4)]
    eng.close()
    assert all(f.result(timeout=1) is not None for f in futures)  # no accepted job lost
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(BUS)

    eng = VisionEngine(_config(max_batch_size=1, max_queue_delay_ms=0.0))
    futures = [eng.submit(BUS) for _ in range(6)]
    eng.close(drain=False)
    outcomes = []
    for f in futures:
        try:
            outcomes.append(f.result(timeout=30) is not None)
        except EngineClosedError:
            outcomes.append("closed")
    assert "closed" in outcomes and all(o in (True, "closed") for o in outcomes)


def test_profiling_picks_a_preferred_size_and_memory_is_reserved():
    memory = DeviceMemoryManager(MemoryConfig(budget_bytes=2**30))
    eng = VisionEngine(_config(profile=True, max_batch_size=2, profile_iters=1), memory=memory)
    try:
        assert set(eng.profile_rates) == {1, 2} and all(r > 0 for r in eng.profile_rates.values())
        assert eng.preferred_batch_sizes == (eng.runner.best_batch_size(eng.profile_rates),)
        owners = memory.stats()["owners"]
        # a batch being prepared plus one per worker, of uint8 staging + float32 input each
        assert owners["vision.batch_buffers"] == (eng.workers + 1) * 2 * 160 * 160 * 3 * 5
        assert owners["vision.activations"] > 160 * 160 * 3 * 4 * 2  # more than the input itself
    finally:
        eng.close()
    assert not any(k.startswith("vision.") for k in memory.stats()["owners"])
    with pytest.raises(MemoryError, match="vision"):
        VisionEngine(_config(), memory=DeviceMemoryManager(MemoryConfig(budget_bytes=1024)))


def test_best_batch_size_needs_a_clear_win(engine):
    assert engine.runner.best_batch_size({1: 10.0, 2: 10.3, 4: 9.0}) == 1
    assert engine.runner.best_batch_size({1: 10.0, 2: 10.3, 4: 12.0}) == 4


@pytest.mark.parametrize("field, value, message", [
    ("imgsz", 100, "multiple of 32"), ("conf", 1.5, r"conf must be a number in \[0, 1\]"),
    ("max_batch_size", 0, "max_batch_size must be an integer >= 1"),
    ("preferred_batch_sizes", (16,), r"\[1, max_batch_size=8\]"), ("dtype", "int8", "dtype must be one of"),
    ("device", "tpu", "device must be"), ("max_queue_delay_ms", -1, "max_queue_delay_ms"),
])  # fmt: skip
def test_config_errors_name_the_field_and_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        VisionConfig(**{field: value})
