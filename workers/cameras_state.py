"""A camera of the camera service (workers/cameras.py) and the outcome of one of its frames:
the state the muxer (cameras_mux.py), the publisher (cameras_publish.py) and the service's rows
share, one object per camera."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sources.base import Frame
from sources.stream_reader import StreamReader
from workers.camera_checks import CameraOptions, redact

LAST_EVENTS = 10  # a camera row's "last_events": its newest line and zone events, with their clips
FPS_WINDOW_S = 5.0  # the "fps" a camera row shows: frames detected over the last few seconds
STATS_WINDOW = 512  # recent frames a camera's latency percentiles and batch size mean are over
# Why a frame read never reached a record: a newer one took its newest-only slot while the
# detector was busy; the rate cap kept it waiting until a newer one came; a full every_frame
# FIFO pushed it out; older than max_staleness_ms; the Runtime refused it (queue full, closed);
# the detector failed it.
DROP_REASONS = ("replaced", "rate_cap", "queue_full", "stale", "runtime_refused", "failed")


@dataclass(slots=True, eq=False)
class Camera:
    """A camera as the service keeps it: its reader, its rate cap and options, what it sent
    and what came back (counted under the muxer's cond), and the publisher's part (its
    tracker, last detections, newest record)."""

    camera_id: str
    url: str
    public_url: str
    period: float  # seconds between frames sent to the detector; 0: no cap
    reader: StreamReader
    added_at: float
    options: CameraOptions = field(default_factory=CameraOptions)
    gate: Any = None  # a MotionGate, or None
    tracker: Any = None  # a Tracker (runtime/vision/tracking.py), or None; the publisher's
    analytics: Any = None  # a CameraAnalytics (runtime/vision/analytics.py), or None; the publisher's
    clips: Any = None  # its CameraClips (workers/camera_clips.py), or None
    push: Any = None  # its CameraPush (workers/camera_push.py), or None; the publisher's
    events: tuple = ()  # the newest LAST_EVENTS events, swapped whole by the publisher
    next_due: float = 0.0
    in_flight: int = 0
    seq: int = 0
    frames: int = 0  # detected
    detections: int = 0
    failed: int = 0  # sent but the detector failed them
    lost: int = 0  # taken but refused by the Runtime (queue full, closed)
    carried: int = 0  # kept from the detector by the motion gate
    drops: dict = field(default_factory=dict)  # drops after the reader: reason -> frames
    done_at: deque = field(default_factory=lambda: deque(maxlen=4096))
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    batch_sizes: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    # The publisher's: the last detections (carried over by the motion gate) and the newest
    # published frame with its record (latest()).
    last_det: Any = None
    latest: tuple | None = None
    # Results wait here for the frames sent before them (two workers may finish out of order),
    # so each camera's stream is in frame order; None marks a frame the Runtime refused.
    settled: dict = field(default_factory=dict)
    next_seq: int = 1

    def settle(self, seq: int, item: Result | None) -> list[Result]:
        """Record `seq`'s outcome; the records now publishable, in frame order."""
        self.settled[seq] = item
        ready = []
        while self.next_seq in self.settled:
            item = self.settled.pop(self.next_seq)
            self.next_seq += 1
            if item is not None:
                ready.append(item)
        return ready

    def drop(self, reason: str, n: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + n

    def due_by(self, t: float) -> bool:
        """Will the rate cap let a frame go by `t`? (take_due's test, without taking)"""
        return not self.period or t >= self.next_due

    def take_due(self, now: float) -> tuple[bool, float | None]:
        """(whether a frame may go now, else seconds until it may). Frames skipped meanwhile are
        replaced in the reader's newest-only slot, which counts them as dropped.

        Due times sit on a grid `period` apart, so a frame that arrives a little late does not
        push every later one back (the rate stays at the cap, not below it); after a gap longer
        than a period the grid restarts at now. Either way no window of T seconds holds more
        than T / period + 1 frames."""
        if not self.period:
            return True, None
        if now < self.next_due:
            return False, self.next_due - now
        late = now - self.next_due
        self.next_due = self.next_due + self.period if late < self.period else now + self.period
        return True, None

    def fps(self, now: float) -> float:
        while self.done_at and now - self.done_at[0] > FPS_WINDOW_S:
            self.done_at.popleft()
        span = min(FPS_WINDOW_S, now - self.added_at)
        return len(self.done_at) / span if span > 0.05 else 0.0

    def row(self, now: float) -> dict:
        """This camera as GET /cameras lists it and server/metrics.py renders it. (cond held)"""
        h = self.reader.health(now)
        since = h.seconds_since_frame
        drops = dict(h.drops_by_reason)
        for reason, n in self.drops.items():
            drops[reason] = drops.get(reason, 0) + n
        latencies = sorted(self.latencies_ms)
        sizes = self.batch_sizes
        o = self.options
        return {
            "camera": self.camera_id,
            "url": self.public_url,
            "up": int(h.state == "live"),
            "state": h.state,
            "fps": round(self.fps(now), 2),
            "frames": self.frames,
            "drops": sum(drops.values()),
            "drops_by_reason": drops,
            "detections": self.detections,
            "reconnects": h.reconnects,
            "max_fps": round(1.0 / self.period, 3) if self.period else None,
            "frames_read": h.frames_read,
            "in_flight": self.in_flight,
            "last_error": redact(h.last_error),
            "seconds_since_frame": None if since is None else round(since, 3),
            "policy": o.policy,
            "queue": o.queue if o.policy == "every_frame" else None,
            "max_staleness_ms": o.max_staleness_ms,
            "motion_threshold": o.motion_threshold,
            "tracker": o.tracker,
            "lines": [s.to_dict() for s in o.lines],
            "zones": [s.to_dict() for s in o.zones],
            # Running counts, {"lines": {name: {"in", "out"}}, "zones": {name: {"occupancy",
            # "entries", "exits"}}} (None: no lines or zones); the publisher swaps it whole.
            "counts": None if self.analytics is None else self.analytics.counts,
            "last_events": list(self.events),
            # Its clip ring and clips (workers/camera_clips.py CameraClips.stats; None: no clips).
            "clips": None if self.clips is None else self.clips.stats(),
            "webhooks": [w.to_dict() for w in o.webhook],
            # Per sink: {"sent", "failed", "dropped", "suppressed"} (workers/camera_push.py; None: no push).
            "push": None if self.push is None else self.push.stats(),
            "carried_over": self.carried,
            "latency_ms_p50": _percentile(latencies, 0.5),
            "latency_ms_p99": _percentile(latencies, 0.99),
            "batch_size_mean": round(sum(sizes) / len(sizes), 3) if sizes else None,
        }


@dataclass(slots=True, eq=False)
class Result:
    """One frame's outcome on its way to the publisher (or a camera going down: frame None)."""

    cam: Camera
    frame: Frame | None
    seq: int | None
    det: Any = None
    error: str | None = None
    captured: float | None = None  # Unix seconds
    finished: float = 0.0
    carried: bool = False
    group_size: int | None = None


def _percentile(ordered: list[float], q: float) -> float | None:
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))], 3) if ordered else None
