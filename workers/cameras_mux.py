"""The camera service's muxer (workers/cameras.py composes it): one dispatcher thread that
groups the cameras' frames and submits each group to the Runtime, as DeepStream's stream muxer
does.

It takes a frame of every camera that has one and is due under its rate cap, and holds the
group until it has one frame of every live camera or the window (`batch_timeout_ms`, else
derived from the cameras' rates) since its first frame ran out, then submits it to the
Runtime's dynamic batcher back to back, so the group shares one forward pass. A camera that is
down, stalled, capped or slower than the window never holds a group. A camera's optional
motion gate (runtime/vision/motion.py) keeps unchanged frames from the detector: they are
settled at once as carried over. Each camera's outcomes are settled in its frame order and
handed to `emit` (the publisher's queue) under the cond, so they stay in that order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial

from sources.base import Frame
from workers.camera_checks import redact
from workers.cameras_state import Camera, Result

log = logging.getLogger("tandem.cameras")

# The muxer's default window: one frame period of the fastest live camera, DeepStream's advice
# for batched-push-timeout (1 / max fps): every camera at that rate has a frame inside it,
# whatever its phase, where half a period would split cameras more than half a frame apart
# into groups of one. At most MAX_WINDOW_S (a frame-to-result budget of ~250 ms leaves it
# little more); DEFAULT_WINDOW_S before any camera has shown its rate.
WINDOW_FRACTION = 1.0
MAX_WINDOW_S = 0.04
LATE_FRACTION = 1.5  # a camera whose next frame is this many periods past its last is not waited for
DEFAULT_WINDOW_S = 0.02


class MuxStats:
    """The muxer's groups: how many of each size, and what closed them (cond held)."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.closed = {"complete": 0, "timeout": 0}
        self.window_s = DEFAULT_WINDOW_S

    def observe(self, size: int, complete: bool) -> None:
        self.sizes[size] = self.sizes.get(size, 0) + 1
        self.closed["complete" if complete else "timeout"] += 1

    def to_dict(self) -> dict:
        n = sum(self.sizes.values())
        mean = sum(k * v for k, v in self.sizes.items()) / n if n else None
        return {
            "window_ms": round(self.window_s * 1000, 3),
            "batches": n,
            "batch_size_mean": None if mean is None else round(mean, 3),
            "batch_sizes": {str(k): v for k, v in sorted(self.sizes.items())},
            "closed": dict(self.closed),
        }


class Muxer:
    """The cameras (added and removed by the service under `cond`, which their readers push
    under too) and the dispatcher over them. `emit(result)` queues a settled result for the
    publisher; `failure` is set when the Runtime refuses frames for good (broken, closed)."""

    def __init__(
        self, runtime, emit: Callable[[Result], None], max_in_flight: int, batch_timeout_s: float | None
    ) -> None:
        self.runtime, self.emit = runtime, emit
        self.max_in_flight, self.batch_timeout_s = max_in_flight, batch_timeout_s
        # Readers push under this condition; the dispatcher waits on it for any camera's frame.
        self.cond = threading.Condition()
        self.cameras: dict[str, Camera] = {}
        self.in_flight = 0
        self.closing = False
        self.stats = MuxStats()
        self.failure: str | None = None

    def close(self) -> list[Camera] | None:
        """Stop taking frames (those in the Runtime are still settled and emitted, see
        wait_idle); the cameras it had, for the caller to close. None the second time."""
        with self.cond:
            if self.closing:
                return None
            self.closing = True
            cams = list(self.cameras.values())
            self.cameras.clear()
            self.cond.notify_all()
        return cams

    def wait_idle(self, timeout: float) -> None:
        """Until every frame sent is back (so its record is emitted), at most `timeout`."""
        with self.cond:
            self.cond.wait_for(lambda: self.in_flight == 0, timeout)

    def _window(self, now: float) -> float:
        """How long a group waits for the live cameras still to come (cond held)."""
        if self.batch_timeout_s is not None:
            return self.batch_timeout_s
        periods = []
        for cam in self.cameras.values():
            r = cam.reader
            if r.state == "live" and r.frame_interval:
                periods.append(max(cam.period, r.frame_interval))
        return min(MAX_WINDOW_S, WINDOW_FRACTION * min(periods)) if periods else DEFAULT_WINDOW_S

    def _expected(self, cam: Camera, now: float, close_at: float) -> bool:
        """Should an open group wait for this camera's next frame? Only a live camera (not
        down, not stalled) with room in flight, whose rate cap lets a frame go and whose next
        frame should arrive before the window closes: a dead or slow camera never holds one.
        (cond held)"""
        r = cam.reader
        if cam.in_flight >= self.max_in_flight or r.state != "live" or r.last_frame_at is None:
            return False
        if now - r.last_frame_at > r.config.stall_after_s or not r.frame_interval:
            return False
        # A camera already half a frame late has likely stopped: waiting for it until it shows
        # "stalled" (stall_after_s, seconds) would hold every group for its whole window.
        if now - r.last_frame_at > LATE_FRACTION * r.frame_interval:
            return False
        return cam.due_by(close_at) and r.last_frame_at + r.frame_interval <= close_at

    def _next_group(self) -> tuple[list[tuple[Camera, Frame, int]], bool] | None:
        """A group of frames, at most one per camera, to submit together, and whether it is
        complete (every live camera in it); waits until one is due. None once closing.

        Frames are taken as their cameras allow (a frame, room in flight, due under the rate
        cap, fresh enough); the group closes when no camera it waits for is left (see
        _expected) or `_window()` after its first frame. A frame the motion gate stops is
        settled at once as carried over and serves its camera for this group. (cond held)"""
        picks: list[tuple[Camera, Frame, int]] = []
        served: set[str] = set()
        opened = None
        while not self.closing:
            now, wait = time.monotonic(), None
            for cam in self.cameras.values():
                r = cam.reader
                if cam.camera_id in served:
                    continue
                if cam.in_flight >= self.max_in_flight:
                    r.drop_reason = "replaced"  # the detector is behind: a newer frame replaces it
                    continue
                if cam.options.max_staleness_ms is not None:
                    r.drop_stale(cam.options.max_staleness_ms / 1000.0, now)
                if not r.has_frame():
                    continue
                due, after = cam.take_due(now)
                if not due:
                    r.drop_reason = "rate_cap"
                    wait = after if wait is None else min(wait, after)
                    continue
                r.drop_reason = "replaced"
                frame = r.take()
                cam.seq += 1
                served.add(cam.camera_id)
                if cam.gate is not None and not cam.gate.changed(frame.image):
                    self._carry(cam, frame, cam.seq)
                    continue
                cam.in_flight += 1
                picks.append((cam, frame, cam.seq))
                opened = now if opened is None else opened
            if picks:
                self.stats.window_s = window = self._window(now)
                close_at = opened + window
                waiting = [
                    c for c in self.cameras.values() if c.camera_id not in served and self._expected(c, now, close_at)
                ]
                if not waiting or now >= close_at:
                    self.in_flight += len(picks)
                    self.stats.observe(len(picks), not waiting)
                    return picks, not waiting
                wait = close_at - now if wait is None else min(wait, close_at - now)
            elif served:  # only carried-over frames: a new round
                served.clear()
                continue
            self.cond.wait(wait)
        for cam, _, _ in picks:  # closing: these are never sent
            cam.in_flight -= 1
        return None

    def _carry(self, cam: Camera, frame: Frame, seq: int) -> None:
        """A frame the motion gate found unchanged: its record re-publishes the last detections,
        in its place in the camera's frame order. (cond held)"""
        cam.carried += 1
        now = time.monotonic()
        cam.latencies_ms.append((now - frame.timestamp) * 1000)
        finished = time.time()
        captured = finished - (now - frame.timestamp)
        self._emit_ready(cam.settle(seq, Result(cam, frame, seq, None, None, captured, finished, carried=True)))

    def run(self) -> None:
        """The dispatcher thread: group, submit, until close()."""
        from schedulers import QueueFullError

        while True:
            with self.cond:
                got = self._next_group()
            if got is None:
                return
            picks, _ = got
            for (cam, frame, seq), outcome in zip(picks, self._submit([frame for _, frame, _ in picks])):
                if isinstance(outcome, BaseException):
                    exc = outcome
                    if not isinstance(exc, (QueueFullError, ValueError)) and self.failure is None:
                        self.failure = f"the runtime refuses frames (camera {cam.camera_id} first): {exc}"
                        log.error("%s", self.failure)
                    with self.cond:
                        cam.in_flight -= 1
                        cam.lost += 1
                        cam.drop("runtime_refused")
                        self.in_flight -= 1
                        self._emit_ready(cam.settle(seq, None))
                        self.cond.notify_all()
                    continue
                outcome.add_done_callback(partial(self._detected, cam, frame, seq, len(picks)))

    def _submit(self, frames: list[Frame]) -> list:
        """A group's frames to the Runtime, outside our lock (submit takes the Runtime's): per
        frame its Future, or the exception that refused it.

        A Runtime with submit_detect_group queues them under one hold of its lock, so the vision
        batcher cannot release a batch between them. Otherwise back to back: the batcher releases
        a batch when it is full, at a preferred size, or max_queue_delay_ms after its first
        request, so the group joins one batch unless one of those falls inside the loop."""
        group = getattr(self.runtime, "submit_detect_group", None)
        if group is not None and len(frames) > 1:
            try:
                return list(group(frames, priority=0))
            except (RuntimeError, ValueError) as exc:  # the whole group refused (closed)
                return [exc] * len(frames)
        outcomes: list = []
        for frame in frames:
            try:
                outcomes.append(self.runtime.submit_detect(frame, priority=0))
            except (RuntimeError, ValueError) as exc:  # QueueFullError is a RuntimeError too
                outcomes.append(exc)
        return outcomes

    def _detected(self, cam: Camera, frame: Frame, seq: int, group_size: int, future) -> None:
        """A frame's result (a vision worker's thread): count it, queue its record."""
        finished, now = time.time(), time.monotonic()
        captured = finished - (now - frame.timestamp)  # the reader stamps frames with time.monotonic()
        try:
            det, error = future.result(), None
        except Exception as exc:  # noqa: BLE001 - the error belongs to this frame's record
            det, error = None, f"{type(exc).__name__}: {exc}"
        with self.cond:
            cam.in_flight -= 1
            self.in_flight -= 1
            if det is not None:
                cam.frames += 1
                cam.detections += len(det)
                cam.done_at.append(now)
                cam.latencies_ms.append((now - frame.timestamp) * 1000)
                cam.batch_sizes.append(getattr(det, "batch_size", 1))
            else:
                cam.failed += 1
                cam.drop("failed")
            self._emit_ready(
                cam.settle(seq, Result(cam, frame, seq, det, error, captured, finished, False, group_size))
            )
            self.cond.notify_all()

    def camera_down(self, cam: Camera, frame: Frame) -> None:
        """A reader's report that its camera went down (its thread); it retries by itself."""
        error = redact(frame.error)
        log.warning("camera %s down, retrying with backoff: %s", cam.camera_id, error)
        if cam.reader.dial is not None:
            # A camera a remote caller added: its record says the kind of failure, not what the
            # target answered (a Redis banner, an admin page's headers), as GET /cameras does;
            # the log above keeps the whole text. A .streams camera is the operator's own.
            from workers.cameras_security import public_error

            error = public_error(error)
        self.emit(Result(cam, None, None, None, error, None, time.time()))

    def _emit_ready(self, ready: list[Result]) -> None:
        """Queue a camera's settled results, in its frame order: called with cond held, so two
        workers settling the same camera cannot queue their parts the other way round (the
        tracker and the Redis stream see frames in order)."""
        for item in ready:
            self.emit(item)
