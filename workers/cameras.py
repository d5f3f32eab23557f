"""`tandem streams`: live cameras as a long-lived service on one Runtime.

    tandem streams cams.streams --redis-url redis://127.0.0.1:6379/0 --max-fps 5
    curl -X POST localhost:8100/cameras -d '{"camera": "door", "url": "rtsp://10.0.0.7/live"}'
    curl -X DELETE localhost:8100/cameras/door

One StreamReader per camera (sources/stream_reader.py: its own thread, newest frame only,
reconnect with backoff, health). One dispatcher thread takes the newest frame of every camera
that has one and is due under its rate cap, and submits them all to the Runtime's dynamic
batcher, so the frames of many cameras share a forward pass. One publisher thread turns the
results into records, off the vision workers' threads: an XADD per frame to the Redis Stream
of its camera, and a JSON line if asked. A camera that is dead, stalled or gone shows up=0 in
/metrics and keeps being retried; the others go on.

Redis keys (`instance` names this process; camera ids are [A-Za-z0-9._-]{1,64}):

    tandem:cameras:{camera}                  stream, MAXLEN ~ maxlen; field "data" = one record
    tandem:metrics:{instance}                this service's /metrics payload (runtime/metrics.py)
    tandem:control:cameras:{instance}        list: JSON commands {"op": "add"|"remove", ...}
    tandem:control:cameras:{instance}:reply:{id}   list: the answer to the command with "id"

A record is `tandem detect`'s JSON line plus where and when the frame came from:

    {"camera": "door", "source": "rtsp://10.0.0.7/live", "frame": 41, "seq": 17,
     "boxes": [[x1, y1, x2, y2], ...], "conf": [...], "cls": [...], "names": [...], "error": null,
     "captured_at": 1718000000.12, "finished_at": 1718000000.16, "latency_ms": 40.1, "batch_size": 3}

`frame` is the decoder's frame number since the camera's last (re)connect, `seq` counts the
frames this service sent to the detector for the camera, the times are Unix seconds. A
camera going down adds one record with "frame": null and the reason in "error". Passwords in
URLs are masked in everything this service writes or serves.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import IO, Any

from runtime.vision.records import detection_record
from sources.base import Frame, is_stream_url
from sources.stream_reader import Dialled, StreamConfig, StreamReader
from workers.urlguard import CAMERA_SCHEMES, UrlPolicy, check_url

log = logging.getLogger("tandem.cameras")

STREAM_KEY = "tandem:cameras:"
# Not under tandem:cameras:, where a camera named "control" would collide with it.
CONTROL_KEY = "tandem:control:cameras:"
_CAMERA_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_INSTANCE = re.compile(r"[A-Za-z0-9._:@-]{1,200}")
_MAX_URL = 2048
FPS_WINDOW_S = 5.0  # the "fps" a camera row shows: frames detected over the last few seconds
MAX_PENDING_RECORDS = 10_000  # records waiting for Redis (an outage): older ones are dropped
REPLY_TTL_S = 60


class CameraError(ValueError):
    """Bad input for a camera; `field` names the field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class CameraNotFound(CameraError):
    pass


class CameraConflict(CameraError):
    """The id is taken, or the service has all the cameras it may have."""


def json_object(raw: str | bytes, field: str, message: str) -> dict:
    """`raw` parsed as a JSON object, else CameraError(field, message)."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CameraError(field, message) from None
    if not isinstance(obj, dict):
        raise CameraError(field, message)
    return obj


def check_camera_id(camera_id: object) -> str:
    if not isinstance(camera_id, str) or not _CAMERA_ID.fullmatch(camera_id):
        raise CameraError("camera", f"camera must be 1-64 characters of [A-Za-z0-9._-], got {camera_id!r}")
    return camera_id


def check_instance(instance: object, name: str = "instance") -> str:
    if not isinstance(instance, str) or not _INSTANCE.fullmatch(instance):
        raise ValueError(f"{name} must be 1-200 characters of [A-Za-z0-9._:@-], got {instance!r}")
    return instance


def check_max_fps(max_fps: object, name: str = "max_fps") -> float | None:
    if max_fps is None:
        return None
    if isinstance(max_fps, bool) or not isinstance(max_fps, (int, float)) or not 0 < max_fps <= 1000:
        message = f"{name} must be a number in (0, 1000] frames per second (unset: no cap), got {max_fps!r}"
        raise CameraError(name, message)
    return float(max_fps)


def check_stream_url(url: object) -> str:
    """A network stream URL, the only kind a remote caller may add: a local path or a webcam
    index would let anyone who reaches the control endpoint open files on this host."""
    kinds = "rtsp://, rtsps://, rtmp://, http(s)://, tcp:// or udp://"
    if not isinstance(url, str) or not url.strip():
        raise CameraError("url", f"url must be a stream URL ({kinds}), got {url!r}")
    url = url.strip()
    if len(url) > _MAX_URL or any(c.isspace() or ord(c) < 32 for c in url):
        raise CameraError("url", f"url must be at most {_MAX_URL} characters without spaces or control characters")
    if not is_stream_url(url):
        raise CameraError(
            "url",
            f"url must be a stream URL ({kinds}); local files and webcams only come from the .streams file, "
            f"got {redact(url)!r}",
        )
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise CameraError("url", f"url is malformed ({exc}): {redact(url)!r}") from None
    if not parts.hostname:
        raise CameraError("url", f"url has no host: {redact(url)!r}")
    return url


def camera_policy(prefixes: tuple[str, ...] = (), env=None, **overrides) -> UrlPolicy:
    """The URL guard for cameras a remote caller adds: the stream schemes, any host unless
    `prefixes`, user:password@ allowed (RTSP cameras take credentials only there), and
    TANDEM_ALLOW_PRIVATE_URLS / TANDEM_ALLOWED_URL_NETWORKS from `env` (None: none read; the
    CLI passes os.environ). Cameras on a LAN need one of those: private addresses are refused."""
    prefixes = tuple(p.strip() for p in prefixes if p and p.strip())
    kw = {"schemes": CAMERA_SCHEMES, "prefixes": prefixes, "any_host": not prefixes, "allow_userinfo": True}
    if env is None:
        return UrlPolicy(**{**kw, **overrides})
    return UrlPolicy.from_env(env, **kw, **overrides)


def _dial(policy: UrlPolicy, url: str) -> Dialled:
    """What a camera's reader connects to, checked again at every (re)connect, so a name that
    moves to a refused address is refused then (and the camera shows down, naming why).

    FFmpeg opens the URL with the checked IP in place of the name, so it does not resolve the
    name again. What stays outside the guard: the RTSP server's own redirects, which FFmpeg
    follows; rtsps:// then has no SNI (FFmpeg does not verify certificates by default anyway)."""
    checked = check_url(url, policy)
    return Dialled(checked.url, checked.pinned(), checked.addresses[0])


def redact(text: str | None) -> str | None:
    """`text` with the password of any URL in it masked (rtsp://user:***@host/...)."""
    return None if text is None else re.sub(r"(://[^/\s:@]*):[^/\s@]*@", r"\1:***@", text)


@dataclass(slots=True, eq=False)
class _Camera:
    camera_id: str
    url: str
    public_url: str
    period: float  # seconds between frames sent to the detector; 0: no cap
    reader: StreamReader
    added_at: float
    next_due: float = 0.0
    in_flight: int = 0
    seq: int = 0
    frames: int = 0  # detected
    detections: int = 0
    failed: int = 0  # sent but the detector failed them
    lost: int = 0  # taken but refused by the Runtime (queue full, closed)
    done_at: deque = field(default_factory=lambda: deque(maxlen=4096))
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
    frame is decoded. The Runtime stays the caller's: close() leaves it open.
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
    ) -> None:
        for name, value in (("maxlen", maxlen), ("max_in_flight", max_in_flight), ("max_cameras", max_cameras)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_fps = check_max_fps(max_fps)
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
        # Results on their way to Redis / JSON lines, appended by the vision workers' callbacks.
        self._out_cond = threading.Condition()
        self._out: deque[tuple] = deque()
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

    def add(self, camera_id: str, url: str, max_fps: float | None = None, *, allow_local: bool = False) -> dict:
        """Start reading a camera; its row. Only network stream URLs unless `allow_local` (a
        `.streams` file's local videos and webcams). CameraError names the bad field."""
        check_camera_id(camera_id)
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
            cam = _Camera(camera_id, url, redact(url), 1.0 / cap if cap else 0.0, None, time.monotonic())
            down = partial(self._camera_down, cam)
            dial = None if allow_local else partial(_dial, self.url_policy)  # a .streams file is the operator's
            cam.reader = StreamReader(self._num_streams, url, self.stream_config, self._cond, down, dial)
            self._cameras[camera_id] = cam
            cam.reader.start()
            row = self._row(cam, time.monotonic())
        log.info("camera %s added: %s (max_fps %s)", camera_id, cam.public_url, cap or "none")
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
        """One row per camera, as runtime/metrics.py's camera families read them."""
        now = time.monotonic()
        with self._cond:
            return [self._row(c, now) for c in self._cameras.values()]

    def payload(self) -> dict:
        """This service's /metrics payload: its cameras and its Runtime's serving metrics."""
        with self._out_cond:
            counts = dict(self.counts)
        metrics = self.runtime.metrics_snapshot()
        return {"kind": "cameras", "cameras": self.cameras(), "service": counts, "metrics": metrics}

    def _row(self, cam: _Camera, now: float) -> dict:
        h = cam.reader.health(now)
        since = h.seconds_since_frame
        return {
            "camera": cam.camera_id,
            "url": cam.public_url,
            "up": int(h.state == "live"),
            "state": h.state,
            "fps": round(cam.fps(now), 2),
            "frames": cam.frames,
            "drops": h.frames_dropped + cam.lost + cam.failed,
            "detections": cam.detections,
            "reconnects": h.reconnects,
            "max_fps": round(1.0 / cam.period, 3) if cam.period else None,
            "frames_read": h.frames_read,
            "in_flight": cam.in_flight,
            "last_error": redact(h.last_error),
            "seconds_since_frame": None if since is None else round(since, 3),
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

            from runtime import metrics

            try:
                metrics.withdraw(self.redis, self.instance)
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

    def _due_frames(self) -> list[tuple[_Camera, Frame, int]] | None:
        """The newest frame of every camera that has one, is due and has room in flight; waits
        until there is one. None once closing. (cond held)"""
        while not self._closing:
            now, wait, picks = time.monotonic(), None, []
            for cam in self._cameras.values():
                if cam.in_flight >= self.max_in_flight or not cam.reader.has_frame():
                    continue
                due, after = cam.take_due(now)
                if not due:
                    wait = after if wait is None else min(wait, after)
                    continue
                cam.in_flight += 1
                cam.seq += 1
                picks.append((cam, cam.reader.take(), cam.seq))
            if picks:
                self._in_flight += len(picks)
                return picks
            self._cond.wait(wait)
        return None

    def _dispatch(self) -> None:
        from schedulers import QueueFullError

        while True:
            with self._cond:
                picks = self._due_frames()
            if picks is None:
                return
            for cam, frame, seq in picks:  # outside our lock: submit takes the Runtime's
                try:
                    future = self.runtime.submit_detect(frame, priority=0)
                except (RuntimeError, ValueError) as exc:  # QueueFullError is a RuntimeError too
                    if not isinstance(exc, (QueueFullError, ValueError)) and self.failure is None:
                        self.failure = f"the runtime refuses frames: {exc}"
                        log.error("%s", self.failure)
                    with self._cond:
                        cam.in_flight -= 1
                        cam.lost += 1
                        self._in_flight -= 1
                        ready = cam.settle(seq, None)
                        self._cond.notify_all()
                    for item in ready:
                        self._queue(item)
                    continue
                future.add_done_callback(partial(self._detected, cam, frame, seq))

    def _detected(self, cam: _Camera, frame: Frame, seq: int, future) -> None:
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
            else:
                cam.failed += 1
            ready = cam.settle(seq, (cam.camera_id, cam.public_url, frame.index, seq, det, error, captured, finished))
            self._cond.notify_all()
        for item in ready:
            self._queue(item)

    def _camera_down(self, cam: _Camera, frame: Frame) -> None:
        """A reader's report that its camera went down (its thread); it retries by itself."""
        error = redact(frame.error)
        log.warning("camera %s down, retrying with backoff: %s", cam.camera_id, error)
        self._queue((cam.camera_id, cam.public_url, None, None, None, error, None, time.time()))

    # ---- publisher thread -------------------------------------------------------------------

    def _queue(self, item: tuple) -> None:
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
                self._write([_record(*item) for item in items])
            if closing:
                return
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.publish_interval_s
                self._heartbeat()

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

        from runtime import metrics

        try:  # kept for a few beats: a scrape never misses a live service
            metrics.publish(self.redis, self.instance, self.payload(), ttl_s=3 * self.publish_interval_s + 1)
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
        """Run one control command, JSON {"op": "add", "camera", "url", "max_fps"?} or {"op":
        "remove", "camera"}, with an optional "id" ([A-Za-z0-9._-]{1,64}) under which the answer
        {"ok", "camera" row | "error", "field"} is pushed for the sender (kept REPLY_TTL_S)."""
        reply_id = None
        try:
            cmd = json_object(raw, "command", "a command must be a JSON object")
            if "id" in cmd:
                if not isinstance(cmd["id"], str) or not _CAMERA_ID.fullmatch(cmd["id"]):
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
        """{"op": "add", "camera", "url", "max_fps"?} or {"op": "remove", "camera"}: the camera's
        row. Shared by the Redis and HTTP control; remote urls must be stream URLs."""
        op = cmd.get("op")
        allowed = {"add": {"op", "camera", "url", "max_fps"}, "remove": {"op", "camera"}}.get(op)
        if allowed is None:
            raise CameraError("op", f"op must be 'add' or 'remove', got {op!r}")
        unknown = sorted(set(cmd) - allowed)
        if unknown:
            names = ", ".join(map(repr, unknown))
            message = f"unknown field(s) {names} for op {op!r}; allowed: {', '.join(sorted(allowed))}"
            raise CameraError(unknown[0], message)
        for name in sorted(allowed - {"max_fps"}):
            if name not in cmd:
                raise CameraError(name, f"{name} is required for op {op!r}")
        if op == "add":
            return self.add(cmd["camera"], cmd["url"], cmd.get("max_fps"))
        return self.remove(check_camera_id(cmd["camera"]))


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
    return out
