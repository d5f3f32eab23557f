"""What the camera-service tests share: a small random-weights detector, reader timings short
enough for a test, a URL policy that lets loopback cameras in, and a JSON-lines sink a test
waits on (a Condition, never a sleep)."""

from __future__ import annotations

import json
import threading

from sources.stream_reader import StreamConfig
from workers.cameras import camera_policy

SAFETY_S = 30
VISION = {
    "model": "yolo26n.yaml",
    "imgsz": 160,
    "conf": 0.0,
    "max_det": 3,
    "profile": False,
    "batching": {"max_batch_size": 8, "max_queue_delay_ms": 5.0},
}
FAST = StreamConfig(open_timeout_s=0.5, read_timeout_s=0.5, stall_after_s=0.5, backoff_initial_s=0.1, backoff_max_s=0.4)
POLICY = camera_policy(allowed_networks=("127.0.0.1/32",))


class Lines:
    """A JSON-lines sink the test can wait on."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.records: list[dict] = []

    def write(self, text: str) -> None:
        with self.cond:
            self.records.extend(json.loads(line) for line in text.splitlines())
            self.cond.notify_all()

    def flush(self) -> None:
        pass

    def wait(self, predicate, timeout: float = SAFETY_S) -> list[dict]:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self.records), timeout), f"{len(self.records)} records"
            return list(self.records)


def frames_of(records: list[dict], camera: str) -> list[dict]:
    """The records of `camera` that carry a frame (not the camera-down ones)."""
    return [r for r in records if r["camera"] == camera and r["frame"] is not None]
