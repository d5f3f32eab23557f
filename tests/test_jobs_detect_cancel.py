"""A detection can be cancelled at any point before its result: while its batch is still forming
in the vision scheduler's queue (it leaves the queue), and once its batch formed and runs (the
caller's future is cancelled at once, the batch's result for it is dropped); the Runtime goes on
serving. A cancelled detect job rests on this: job.attach(future) cancels the future."""

from __future__ import annotations

import time
from concurrent.futures import CancelledError

import numpy as np
import pytest
from test_jobs_support import wait_for


@pytest.fixture(scope="module")
def runtime():
    from runtime.runtime import Runtime

    rt = Runtime(
        vision={
            "model": "yolo26n.yaml",
            "imgsz": 640,
            "batching": {"max_batch_size": 4, "preferred_batch_sizes": [4], "max_queue_delay_ms": 60_000},
        },
        profile=False,
    )
    yield rt
    rt.close(drain=False, timeout=30)


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (640, 640, 3), dtype=np.uint8)


def test_a_detection_cancelled_while_its_batch_forms_leaves_the_queue(runtime):
    future = runtime.submit_detect(_image(0))  # waits up to a minute for three more to fill its batch
    wait_for(lambda: runtime.stats()["vision"]["queued"] == 1, 10, "the image to wait in the queue")
    assert future.cancel() and future.cancelled()
    wait_for(lambda: runtime.stats()["vision"]["queued"] == 0, 10, "the cancelled image to leave the queue")
    with pytest.raises(CancelledError):
        future.result(0)


def test_a_detection_cancelled_while_its_batch_runs_is_cancelled_at_once(runtime):
    hit = False
    for attempt in range(5):  # a batch of four 640x640 images runs long enough to be caught in flight
        futures = [runtime.submit_detect(_image(10 * attempt + k)) for k in range(4)]
        try:
            wait_for(lambda: runtime.stats()["vision"]["in_flight"] > 0, 10, "the batch to form", interval=0.0005)
        except AssertionError:
            continue
        t0 = time.monotonic()
        cancelled = futures[0].cancel()
        if not cancelled and futures[0].done():
            continue  # the batch was done already: try again
        assert cancelled, "a detection whose batch runs refused the cancel"
        assert futures[0].cancelled() and time.monotonic() - t0 < 0.05
        with pytest.raises(CancelledError):
            futures[0].result(0)
        for f in futures[1:]:  # the rest of the batch is unharmed
            assert f.result(60) is not None
        hit = True
        break
    assert hit, "never caught a batch in flight"
    # The Runtime serves on; with its batch-of-four preference, four more fill a batch at once.
    assert all(f.result(60) is not None for f in [runtime.submit_detect(_image(99 + k)) for k in range(4)])
