"""`tandem streams`: live cameras as a long-lived service on one Runtime.

    tandem streams cams.streams --redis-url redis://127.0.0.1:6379/0 --max-fps 5
    curl -X POST localhost:8100/cameras -d '{"camera": "door", "url": "rtsp://10.0.0.7/live"}'
    curl -X DELETE localhost:8100/cameras/door

One StreamReader per camera (sources/stream_reader.py: its own thread, reconnect with
backoff, health), holding the newest frame only (policy "freshest") or a FIFO of `queue`
frames ("every_frame"); frames older than `max_staleness_ms` are dropped before inference.
One dispatcher thread muxes the cameras as DeepStream's stream muxer does: it takes a frame of
every camera that has one and is due under its rate cap, and holds the group until it has one
frame of every live camera or `batch_timeout_ms` since its first frame ran out, then submits
it to the Runtime's dynamic batcher back to back, so the group shares one forward pass. A
camera that is down, stalled, capped or slower than the window never holds a group. A
camera's optional motion gate (runtime/vision/motion.py) keeps unchanged frames from the
detector: their record carries the last detections over. One publisher thread turns results
into records in each camera's frame order, off the vision workers' threads: track ids from
the camera's tracker if it has one, an XADD per frame to the Redis Stream of its camera, and
a JSON line if asked. A camera that is dead, stalled or gone shows up=0 in /metrics and keeps
being retried; the others go on. Every dropped frame is counted with its reason (DROP_REASONS).

Redis keys (`instance` names this process; camera ids are [A-Za-z0-9._-]{1,64}):

    tandem:cameras:{camera}                  stream, MAXLEN ~ maxlen; field "data" = one record
    tandem:metrics:{instance}                this service's /metrics payload (workers/fleet_metrics.py)
    tandem:control:cameras:{instance}        list: JSON commands {"op": "add"|"remove", ...}
    tandem:control:cameras:{instance}:reply:{id}   list: the answer to the command with "id"

A record is `tandem detect`'s JSON line plus where and when the frame came from:

    {"camera": "door", "source": "rtsp://10.0.0.7/live", "frame": 41, "seq": 17,
     "boxes": [[x1, y1, x2, y2], ...], "conf": [...], "cls": [...], "names": [...], "error": null,
     "captured_at": 1718000000.12, "finished_at": 1718000000.16, "latency_ms": 40.1, "batch_size": 3,
     "group_size": 3, "carried_over": false, "track_ids": [4, 9, null] or null (no tracker)}

`batch_size` is the forward pass's, `group_size` how many cameras' frames the muxer sent
together; `carried_over` marks a frame the motion gate kept from the detector (its boxes are
the last detected frame's).

`frame` is the decoder's frame number since the camera's last (re)connect, `seq` counts the
frames this service sent to the detector for the camera, the times are Unix seconds. A
camera going down adds one record with "frame": null and the reason in "error". Passwords in
URLs are masked in everything this service writes or serves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import IO, Any

from runtime.vision.records import detection_record
from sources.base import Frame
from sources.stream_reader import StreamConfig, StreamReader
from workers.camera_checks import (  # noqa: F401 - re-exported: workers.cameras is where callers find them
    CAMERA_ID,
    OPTION_FIELDS,
    POLICIES,
    CameraConflict,
    CameraError,
    CameraNotFound,
    CameraOptions,
    camera_policy,
    check_camera_id,
    check_instance,
    check_max_fps,
    check_stream_url,
    dial_camera,
    is_number,
    json_object,
    redact,
)
from workers.urlguard import UrlPolicy, check_url

log = logging.getLogger("tandem.cameras")

STREAM_KEY = "tandem:cameras:"
# Not under tandem:cameras:, where a camera named "control" would collide with it.
CONTROL_KEY = "tandem:control:cameras:"
FPS_WINDOW_S = 5.0  # the "fps" a camera row shows: frames detected over the last few seconds
MAX_PENDING_RECORDS = 10_000  # records waiting for Redis (an outage): older ones are dropped
REPLY_TTL_S = 60
# Why a frame read never reached a record: a newer one took its newest-only slot while the
# detector was busy; the rate cap kept it waiting until a newer one came; a full every_frame
# FIFO pushed it out; older than max_staleness_ms; the Runtime refused it (queue full, closed);
# the detector failed it.
DROP_REASONS = ("replaced", "rate_cap", "queue_full", "stale", "runtime_refused", "failed")
# The muxer's default window: one frame period of the fastest live camera, DeepStream's advice
# for batched-push-timeout (1 / max fps): every camera at that rate has a frame inside it,
# whatever its phase, where half a period would split cameras more than half a frame apart
# into groups of one. At most MAX_WINDOW_S (a frame-to-result budget of ~250 ms leaves it
# little more); DEFAULT_WINDOW_S before any camera has shown its rate.
WINDOW_FRACTION = 1.0
MAX_WINDOW_S = 0.04
LATE_FRACTION = 1.5  # a camera whose next frame is this many periods past its last is not waited for
DEFAULT_WINDOW_S = 0.02
STATS_WINDOW = 512  # recent frames a camera's latency percentiles and batch size mean are over


@dataclass(slots=True, eq=False)
class _Camera:
    camera_id: str
    url: str
    public_url: str
    period: float  # seconds between frames sent to the detector; 0: no cap
    reader: StreamReader
    added_at: float
    options: CameraOptions = field(default_factory=CameraOptions)
    gate: Any = None  # a MotionGate, or None
    tracker: Any = None  # a Tracker (runtime/vision/tracking.py), or None; the publisher's
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

    def settle(self, seq: int, item: tuple | None) -> list[tuple]:
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


@dataclass(slots=True, eq=False)
class _Result:
    """One frame's outcome on its way to the publisher (or a camera going down: frame None)."""

    cam: _Camera
    frame: Frame | None
    seq: int | None
    det: Any = None
    error: str | None = None
    captured: float | None = None  # Unix seconds
    finished: float = 0.0
    carried: bool = False
    group_size: int | None = None


class _MuxStats:
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


class CameraService:
    """Cameras added and removed at any time, detected on `runtime`, published per camera.

    `redis_client` (or None) gets the records and, every `publish_interval_s`, this service's
    payload for `tandem serve`'s /metrics; it also answers commands pushed to the control list
    when `control` is set. `jsonl`: a text file that gets every record as a JSON line (None:
    none). `max_fps`: the default rate cap of a camera (None: as fast as the detector takes
    them). `max_in_flight`: frames of one camera in the Runtime at once; newer frames replace
    older ones in the reader's slot meanwhile, so a slow detector drops frames instead of
    queueing them. `stream_config` None: the defaults, with the Runtime's max_image_pixels
    (VisionConfig), so a camera whose frames are over it goes down naming the limit before a
    frame is decoded. `batch_timeout_ms`: how long the muxer holds a group for the live
    cameras still to come (None: derived from their rates, see WINDOW_FRACTION; 0: no holding).
    The Runtime stays the caller's: close() leaves it open.
    """

    def __init__(
        self,
        runtime,
        redis_client=None,
        *,
        maxlen: int = 1000,
        max_fps: float | None = None,
        jsonl: IO[str] | None = None,
        instance: str | None = None,
        stream_config: StreamConfig | None = None,
        max_in_flight: int = 2,
        max_cameras: int = 64,
        publish_interval_s: float = 2.0,
        control: bool = True,
        allowed_url_prefixes: tuple[str, ...] = (),
        url_policy: UrlPolicy | None = None,
        batch_timeout_ms: float | None = None,
    ) -> None:
        for name, value in (("maxlen", maxlen), ("max_in_flight", max_in_flight), ("max_cameras", max_cameras)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_fps = check_max_fps(max_fps)
        if batch_timeout_ms is not None and (not is_number(batch_timeout_ms) or not 0 <= batch_timeout_ms <= 1000):
            raise ValueError(
                f"batch_timeout_ms must be a number in [0, 1000] (None: derived), got {batch_timeout_ms!r}"
            )
        self.batch_timeout_s = None if batch_timeout_ms is None else batch_timeout_ms / 1000.0
        interval = publish_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise ValueError(f"publish_interval_s must be a number > 0, got {publish_interval_s!r}")
        instance = check_instance(instance or f"cameras-{socket.gethostname()}-{os.getpid()}")
        self.runtime, self.redis, self.jsonl = runtime, redis_client, jsonl
        self.maxlen, self.max_in_flight, self.max_cameras = maxlen, max_in_flight, max_cameras
        self.instance, self.publish_interval_s = instance, float(publish_interval_s)
        if stream_config is None:
            vision_config = getattr(getattr(runtime, "vision", None), "config", None)
            limit = getattr(vision_config, "max_image_pixels", None)
            stream_config = StreamConfig() if limit is None else StreamConfig(max_image_pixels=limit)
        self.stream_config = stream_config
        # Cameras a remote caller adds pass this guard (workers/urlguard.py) when added and at
        # every reconnect; the default: any public host (or under allowed_url_prefixes).
        if url_policy is not None and any(allowed_url_prefixes):
            raise ValueError("allowed_url_prefixes: give them in url_policy (camera_policy(prefixes)), not both")
        self.url_policy = url_policy or camera_policy(allowed_url_prefixes)
        self.failure: str | None = None  # set when the Runtime refuses work for good (broken, closed)
        # Readers push under this condition; the dispatcher waits on it for any camera's frame.
        self._cond = threading.Condition()
        self._cameras: dict[str, _Camera] = {}
        self._num_streams = 0
        self._in_flight = 0
        self._closing = False
        self.mux = _MuxStats()
        # Results on their way to Redis / JSON lines, appended by the vision workers' callbacks.
        self._out_cond = threading.Condition()
        self._out: deque[_Result] = deque()
        self._out_closing = False
        self.counts = {"records": 0, "records_lost": 0, "publish_errors": 0}
        self._stop_control = threading.Event()
        loops = [self._dispatch, self._publish] + ([self._control] if control and redis_client is not None else [])
        self._threads = [
            threading.Thread(
                target=self._guard, args=(f,), name="tandem-cameras" + f.__name__.replace("_", "-"), daemon=True
            )
            for f in loops
        ]
        for t in self._threads:
            t.start()

    # ---- cameras (any thread) ---------------------------------------------------------------

    def add(
        self,
        camera_id: str,
        url: str,
        max_fps: float | None = None,
        *,
        allow_local: bool = False,
        policy: str = "freshest",
        queue: int = 30,
        max_staleness_ms: float | None = None,
        motion_threshold: float | None = None,
        tracker: str | None = None,
    ) -> dict:
        """Start reading a camera; its row. Only network stream URLs unless `allow_local` (a
        `.streams` file's local videos and webcams). CameraError names the bad field.

        `policy` "freshest" keeps the newest frame only (a live view: late frames are worth
        nothing), "every_frame" a FIFO of `queue` frames (recorded files, counting); frames
        older than `max_staleness_ms` are dropped before inference either way.
        `motion_threshold` (a fraction in (0, 1]) gates the detector on motion; `tracker`
        ("bytetrack", "botsort") adds track ids to the records."""
        check_camera_id(camera_id)
        options = CameraOptions(policy, queue, max_staleness_ms, motion_threshold, tracker).check()
        if allow_local:
            if not isinstance(url, str) or not url.strip():
                raise CameraError("url", f"url must be a non-empty string, got {url!r}")
            url = url.strip()
        else:
            url = check_stream_url(url)
            try:
                check_url(url, self.url_policy)  # now, so the caller hears it; the reader checks again
            except ValueError as exc:
                raise CameraError("url", redact(str(exc))) from None
        cap = check_max_fps(max_fps)
        cap = self.max_fps if cap is None else cap
        with self._cond:
            if self._closing:
                raise RuntimeError("the camera service is closed")
            if camera_id in self._cameras:
                raise CameraConflict("camera", f"camera {camera_id!r} exists already (remove it first)")
            if len(self._cameras) >= self.max_cameras:
                raise CameraConflict("camera", f"this service has {self.max_cameras} cameras, its max_cameras")
            self._num_streams += 1
            cam = _Camera(camera_id, url, redact(url), 1.0 / cap if cap else 0.0, None, time.monotonic(), options)
            if motion_threshold is not None:
                from runtime.vision.motion import MotionGate

                cam.gate = MotionGate(motion_threshold)
            if tracker is not None:
                from runtime.vision.tracking import make_tracker

                try:
                    cam.tracker = make_tracker(tracker, frame_rate=cap or 30.0)
                except ValueError as exc:
                    raise CameraError("tracker", str(exc)) from None
            down = partial(self._camera_down, cam)
            dial = None if allow_local else partial(dial_camera, self.url_policy)  # a .streams file is the operator's
            buffer = options.queue if options.policy == "every_frame" else 0
            config = dataclasses.replace(self.stream_config, buffer=buffer)
            name = f"camera {camera_id}"
            cam.reader = StreamReader(self._num_streams, url, config, self._cond, down, dial, name=name)
            self._cameras[camera_id] = cam
            cam.reader.start()
            row = self._row(cam, time.monotonic())
        log.info(
            "camera %s added: %s (max_fps %s, policy %s)", camera_id, cam.public_url, cap or "none", options.policy
        )
        return row

    def remove(self, camera_id: str) -> dict:
        """Stop reading a camera; its last row. Frames of it already in the detector are still
        published. CameraNotFound if no camera has this id."""
        with self._cond:
            cam = self._cameras.pop(camera_id, None) if isinstance(camera_id, str) else None
            if cam is None:
                raise CameraNotFound("camera", f"no camera {camera_id!r} (GET /cameras lists them)")
            row = self._row(cam, time.monotonic())
        cam.reader.close(join_s=0.0)  # a blocked read ends at its timeout; the thread is a daemon
        log.info("camera %s removed", camera_id)
        return row

    def cameras(self) -> list[dict]:
        """One row per camera, as server/metrics.py's camera families read them."""
        now = time.monotonic()
        with self._cond:
            return [self._row(c, now) for c in self._cameras.values()]

    def latest(self, camera_id: str) -> tuple[Any, dict] | None:
        """The newest published frame of a camera (BGR) and its record, for the views; None
        before its first record, or if no camera has this id. A carried-over frame counts:
        the motion gate found it unchanged, so its record's boxes hold for it."""
        with self._cond:
            cam = self._cameras.get(camera_id) if isinstance(camera_id, str) else None
            return None if cam is None else cam.latest

    def payload(self) -> dict:
        """This service's /metrics payload: its cameras, the muxer's batches, and its Runtime's
        serving metrics."""
        with self._out_cond:
            counts = dict(self.counts)
        metrics = self.runtime.metrics_snapshot()
        with self._cond:
            batching = self.mux.to_dict()
        return {
            "kind": "cameras",
            "cameras": self.cameras(),
            "service": counts,
            "batching": batching,
            "metrics": metrics,
        }

    def _row(self, cam: _Camera, now: float) -> dict:
        h = cam.reader.health(now)
        since = h.seconds_since_frame
        drops = dict(h.drops_by_reason)
        for reason, n in cam.drops.items():
            drops[reason] = drops.get(reason, 0) + n
        latencies = sorted(cam.latencies_ms)
        sizes = cam.batch_sizes
        o = cam.options
        return {
            "camera": cam.camera_id,
            "url": cam.public_url,
            "up": int(h.state == "live"),
            "state": h.state,
            "fps": round(cam.fps(now), 2),
            "frames": cam.frames,
            "drops": sum(drops.values()),
            "drops_by_reason": drops,
            "detections": cam.detections,
            "reconnects": h.reconnects,
            "max_fps": round(1.0 / cam.period, 3) if cam.period else None,
            "frames_read": h.frames_read,
            "in_flight": cam.in_flight,
            "last_error": redact(h.last_error),
            "seconds_since_frame": None if since is None else round(since, 3),
            "policy": o.policy,
            "queue": o.queue if o.policy == "every_frame" else None,
            "max_staleness_ms": o.max_staleness_ms,
            "motion_threshold": o.motion_threshold,
            "tracker": o.tracker,
            "carried_over": cam.carried,
            "latency_ms_p50": _percentile(latencies, 0.5),
            "latency_ms_p99": _percentile(latencies, 0.99),
            "batch_size_mean": round(sum(sizes) / len(sizes), 3) if sizes else None,
        }

    def close(self, timeout: float = 10.0) -> None:
        """Stop every camera, publish what the detector still returns (up to `timeout`), and
        take this service's payload out of Redis. The Runtime stays open."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            cams = list(self._cameras.values())
            self._cameras.clear()
            self._cond.notify_all()
        self._stop_control.set()
        for cam in cams:
            cam.reader.close(join_s=0.0)
        deadline = time.monotonic() + timeout
        with self._cond:  # results still in the Runtime: wait for them, so they are published
            self._cond.wait_for(lambda: self._in_flight == 0, timeout)
        with self._out_cond:
            self._out_closing = True
            self._out_cond.notify_all()
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))
        for cam in cams:
            cam.reader.join(max(0.0, deadline - time.monotonic()))
        if self.redis is not None:
            from redis.exceptions import RedisError

            from workers import fleet_metrics

            try:
                fleet_metrics.withdraw(self.redis, self.instance)
            except RedisError as exc:  # it expires by itself
                log.warning("could not withdraw metrics of %s: %s", self.instance, exc)

    def __enter__(self) -> CameraService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _guard(self, loop) -> None:
        """Run one of the service's threads; a bug that ends it fails the service loudly (the
        health check and the CLI's exit code say so) instead of leaving it half alive."""
        try:
            loop()
        except Exception as exc:
            log.exception("%s ended by an error", threading.current_thread().name)
            self.failure = self.failure or f"{threading.current_thread().name} failed: {type(exc).__name__}: {exc}"

    # ---- dispatcher thread ------------------------------------------------------------------

    def _window(self, now: float) -> float:
        """How long a group waits for the live cameras still to come (cond held)."""
        if self.batch_timeout_s is not None:
            return self.batch_timeout_s
        periods = []
        for cam in self._cameras.values():
            r = cam.reader
            if r.state == "live" and r.frame_interval:
                periods.append(max(cam.period, r.frame_interval))
        return min(MAX_WINDOW_S, WINDOW_FRACTION * min(periods)) if periods else DEFAULT_WINDOW_S

    def _expected(self, cam: _Camera, now: float, close_at: float) -> bool:
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

    def _next_group(self) -> tuple[list[tuple[_Camera, Frame, int]], bool] | None:
        """A group of frames, at most one per camera, to submit together, and whether it is
        complete (every live camera in it); waits until one is due. None once closing.

        Frames are taken as their cameras allow (a frame, room in flight, due under the rate
        cap, fresh enough); the group closes when no camera it waits for is left (see
        _expected) or `_window()` after its first frame. A frame the motion gate stops is
        settled at once as carried over and serves its camera for this group. (cond held)"""
        picks: list[tuple[_Camera, Frame, int]] = []
        served: set[str] = set()
        opened = None
        while not self._closing:
            now, wait = time.monotonic(), None
            for cam in self._cameras.values():
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
                self.mux.window_s = window = self._window(now)
                close_at = opened + window
                waiting = [
                    c for c in self._cameras.values() if c.camera_id not in served and self._expected(c, now, close_at)
                ]
                if not waiting or now >= close_at:
                    self._in_flight += len(picks)
                    self.mux.observe(len(picks), not waiting)
                    return picks, not waiting
                wait = close_at - now if wait is None else min(wait, close_at - now)
            elif served:  # only carried-over frames: a new round
                served.clear()
                continue
            self._cond.wait(wait)
        for cam, _, _ in picks:  # closing: these are never sent
            cam.in_flight -= 1
        return None

    def _carry(self, cam: _Camera, frame: Frame, seq: int) -> None:
        """A frame the motion gate found unchanged: its record re-publishes the last detections,
        in its place in the camera's frame order. (cond held)"""
        cam.carried += 1
        now = time.monotonic()
        cam.latencies_ms.append((now - frame.timestamp) * 1000)
        finished = time.time()
        captured = finished - (now - frame.timestamp)
        self._queue_ready(cam.settle(seq, _Result(cam, frame, seq, None, None, captured, finished, carried=True)))

    def _dispatch(self) -> None:
        from schedulers import QueueFullError

        while True:
            with self._cond:
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
                    with self._cond:
                        cam.in_flight -= 1
                        cam.lost += 1
                        cam.drop("runtime_refused")
                        self._in_flight -= 1
                        self._queue_ready(cam.settle(seq, None))
                        self._cond.notify_all()
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

    def _detected(self, cam: _Camera, frame: Frame, seq: int, group_size: int, future) -> None:
        """A frame's result (a vision worker's thread): count it, queue its record."""
        finished, now = time.time(), time.monotonic()
        captured = finished - (now - frame.timestamp)  # the reader stamps frames with time.monotonic()
        try:
            det, error = future.result(), None
        except Exception as exc:  # noqa: BLE001 - the error belongs to this frame's record
            det, error = None, f"{type(exc).__name__}: {exc}"
        with self._cond:
            cam.in_flight -= 1
            self._in_flight -= 1
            if det is not None:
                cam.frames += 1
                cam.detections += len(det)
                cam.done_at.append(now)
                cam.latencies_ms.append((now - frame.timestamp) * 1000)
                cam.batch_sizes.append(getattr(det, "batch_size", 1))
            else:
                cam.failed += 1
                cam.drop("failed")
            self._queue_ready(
                cam.settle(seq, _Result(cam, frame, seq, det, error, captured, finished, False, group_size))
            )
            self._cond.notify_all()

    def _camera_down(self, cam: _Camera, frame: Frame) -> None:
        """A reader's report that its camera went down (its thread); it retries by itself."""
        error = redact(frame.error)
        log.warning("camera %s down, retrying with backoff: %s", cam.camera_id, error)
        if cam.reader.dial is not None:
            # A camera a remote caller added: its record says the kind of failure, not what the
            # target answered (a Redis banner, an admin page's headers), as GET /cameras does;
            # the log above keeps the whole text. A .streams camera is the operator's own.
            from workers.cameras_security import public_error

            error = public_error(error)
        self._queue(_Result(cam, None, None, None, error, None, time.time()))

    # ---- publisher thread -------------------------------------------------------------------

    def _queue_ready(self, ready: list[_Result]) -> None:
        """Queue a camera's settled results, in its frame order: called with cond held, so two
        workers settling the same camera cannot queue their parts the other way round (the
        tracker and the Redis stream see frames in order)."""
        for item in ready:
            self._queue(item)

    def _queue(self, item: _Result) -> None:
        with self._out_cond:
            if len(self._out) >= MAX_PENDING_RECORDS:
                self._out.popleft()
                self.counts["records_lost"] += 1  # counts: guarded by _out_cond
            self._out.append(item)
            self._out_cond.notify_all()

    def _count(self, name: str, n: int = 1) -> None:
        with self._out_cond:
            self.counts[name] += n

    def _publish(self) -> None:
        next_beat = time.monotonic() if self.redis is not None else float("inf")
        while True:
            with self._out_cond:
                while not (self._out or self._out_closing) and time.monotonic() < next_beat:
                    self._out_cond.wait(None if next_beat == float("inf") else next_beat - time.monotonic())
                items = [self._out.popleft() for _ in range(min(len(self._out), 512))]
                closing = self._out_closing and not self._out
            if items:
                self._write([self._build(item) for item in items])
            if closing:
                return
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.publish_interval_s
                self._heartbeat()

    def _build(self, item: _Result) -> dict:
        """The record of one result, in its camera's frame order: carried-over frames take the
        last detections, and the camera's tracker sees every published frame in turn."""
        cam, det = item.cam, item.det
        if item.carried:
            det = cam.last_det
        elif det is not None:
            cam.last_det = det
        track_ids = None
        if cam.tracker is not None and det is not None and item.frame is not None:
            try:
                track_ids = list(cam.tracker.update(det, item.frame.image))
            except Exception as exc:  # noqa: BLE001 - a tracker bug costs this camera its ids, not the service
                log.warning("camera %s: tracker failed on frame %s: %s", cam.camera_id, item.frame.index, exc)
        frame = item.frame
        record = _record(
            cam.camera_id,
            cam.public_url,
            None if frame is None else frame.index,
            item.seq,
            det,
            item.error,
            item.captured,
            item.finished,
        )
        record["batch_size"] = None if det is None or item.carried else getattr(det, "batch_size", 1)
        record["group_size"] = item.group_size
        record["carried_over"] = item.carried
        record["track_ids"] = track_ids  # None: no tracker (or nothing to track)
        if frame is not None and det is not None:
            cam.latest = (frame.image, record)  # one reference swap: latest() reads it whole
        return record

    def _write(self, records: list[dict]) -> None:
        bodies = [json.dumps(r) for r in records]
        if self.redis is not None:
            from redis.exceptions import RedisError

            pipe = self.redis.pipeline(transaction=False)
            for r, body in zip(records, bodies):
                pipe.xadd(STREAM_KEY + r["camera"], {"data": body}, maxlen=self.maxlen, approximate=True)
            try:
                pipe.execute()
                self._count("records", len(records))
            except RedisError as exc:  # an outage loses these records, not the service
                self._count("records_lost", len(records))
                self._count("publish_errors")
                log.warning("could not publish %d records to Redis: %s", len(records), exc)
        if self.jsonl is not None:
            try:
                self.jsonl.write("".join(b + "\n" for b in bodies))
                self.jsonl.flush()
            except (OSError, ValueError) as exc:  # a closed pipe: stop writing lines, keep serving
                log.warning("JSON lines output failed (%s); no more lines are written", exc)
                self.jsonl = None

    def _heartbeat(self) -> None:
        from redis.exceptions import RedisError

        from workers import fleet_metrics

        try:  # kept for a few beats: a scrape never misses a live service
            fleet_metrics.publish(self.redis, self.instance, self.payload(), ttl_s=3 * self.publish_interval_s + 1)
        except RedisError as exc:
            self._count("publish_errors")
            log.warning("could not publish metrics to Redis: %s", exc)

    # ---- control thread: commands pushed to a Redis list -------------------------------------

    def _control(self) -> None:
        from redis.exceptions import RedisError

        key = CONTROL_KEY + self.instance
        while not self._stop_control.is_set():
            try:
                item = self.redis.blpop([key], timeout=0.25)  # short: close() waits for it
            except RedisError as exc:
                log.warning("control list %s: %s; retrying", key, exc)
                self._stop_control.wait(1.0)
                continue
            if item is not None:
                self.command(item[1])

    def command(self, raw: str | bytes) -> dict:
        """Run one control command, JSON {"op": "add", "camera", "url", options?} or {"op":
        "remove", "camera"}, with an optional "id" ([A-Za-z0-9._-]{1,64}) under which the answer
        {"ok", "camera" row | "error", "field"} is pushed for the sender (kept REPLY_TTL_S)."""
        reply_id = None
        try:
            cmd = json_object(raw, "command", "a command must be a JSON object")
            if "id" in cmd:
                if not isinstance(cmd["id"], str) or not CAMERA_ID.fullmatch(cmd["id"]):
                    raise CameraError("id", f"id must be 1-64 characters of [A-Za-z0-9._-], got {cmd['id']!r}")
                reply_id = cmd["id"]
            answer = {"ok": True, "camera": self.apply({k: v for k, v in cmd.items() if k != "id"})}
        except CameraError as exc:
            answer = {"ok": False, "error": str(exc), "field": exc.field}
            log.warning("control command refused: %s", exc)
        except RuntimeError as exc:  # closed
            answer = {"ok": False, "error": str(exc), "field": None}
        if reply_id is not None and self.redis is not None:
            from redis.exceptions import RedisError

            reply_key = f"{CONTROL_KEY}{self.instance}:reply:{reply_id}"
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(reply_key, json.dumps(answer))
            pipe.expire(reply_key, REPLY_TTL_S)
            try:
                pipe.execute()
            except RedisError as exc:
                log.warning("could not answer command %s: %s", reply_id, exc)
        return answer

    def apply(self, cmd: dict) -> dict:
        """{"op": "add", "camera", "url", and optionally OPTION_FIELDS (see add())} or {"op":
        "remove", "camera"}: the camera's row. Shared by the Redis and HTTP control; remote urls
        must be stream URLs."""
        op = cmd.get("op")
        allowed = {"add": {"op", "camera", "url", *OPTION_FIELDS}, "remove": {"op", "camera"}}.get(op)
        if allowed is None:
            raise CameraError("op", f"op must be 'add' or 'remove', got {op!r}")
        unknown = sorted(set(cmd) - allowed)
        if unknown:
            names = ", ".join(map(repr, unknown))
            message = f"unknown field(s) {names} for op {op!r}; allowed: {', '.join(sorted(allowed))}"
            raise CameraError(unknown[0], message)
        for name in sorted(allowed - set(OPTION_FIELDS)):
            if name not in cmd:
                raise CameraError(name, f"{name} is required for op {op!r}")
        if op == "add":
            options = {k: cmd[k] for k in OPTION_FIELDS[1:] if k in cmd}
            return self.add(cmd["camera"], cmd["url"], cmd.get("max_fps"), **options)
        return self.remove(check_camera_id(cmd["camera"]))


def _percentile(ordered: list[float], q: float) -> float | None:
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))], 3) if ordered else None


def _record(
    camera_id: str,
    url: str,
    frame: int | None,
    seq: int | None,
    det,
    error: str | None,
    captured: float | None,
    finished: float,
) -> dict:
    """The JSON record of one result (or of a camera going down), as the module doc shows."""
    out: dict[str, Any] = {"camera": camera_id, "seq": seq, **detection_record(url, frame, det, error)}
    out["captured_at"] = None if captured is None else round(captured, 6)
    out["finished_at"] = round(finished, 6)
    out["latency_ms"] = None if captured is None else round((finished - captured) * 1000, 3)
    out["batch_size"] = None if det is None else det.batch_size
    out["group_size"] = None
    out["carried_over"] = False
    out["track_ids"] = None
    return out
