"""`tandem streams`: live cameras as a long-lived service on one Runtime.

    tandem streams cams.streams --redis-url redis://127.0.0.1:6379/0 --max-fps 5
    curl -X POST localhost:8100/cameras -d '{"camera": "door", "url": "rtsp://10.0.0.7/live"}'
    curl -X DELETE localhost:8100/cameras/door

One StreamReader per camera (sources/stream_reader.py: its own thread, reconnect with
backoff, health), holding the newest frame only (policy "freshest") or a FIFO of `queue`
frames ("every_frame"); frames older than `max_staleness_ms` are dropped before inference.
CameraService keeps the cameras (cameras_state.py) and composes three parts, each a thread
with one job:

    cameras_mux.py       the muxer: groups the cameras' frames and submits each group to the
                         Runtime's dynamic batcher, so the group shares one forward pass
    cameras_publish.py   the publisher: results to records in each camera's frame order (track
                         ids, an XADD per frame, JSON lines), and the /metrics heartbeat
    cameras_control.py   the control: add and remove commands from the Redis control list

A camera that is dead, stalled or gone shows up=0 in /metrics and keeps being retried; the
others go on. Every dropped frame is counted with its reason (cameras_state.DROP_REASONS).

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
the last detected frame's). A camera with lines or zones (runtime/vision/analytics.py) adds
"events": [{"type": "line_cross", "line", "direction", "track_id", "cls", "at", "point"},
{"type": "zone_enter", "zone", ...}, {"type": "zone_exit", ..., "dwell_s", "lost"}], and its
row the running "counts" and "last_events". With clips (config.clips, workers/camera_clips.py)
a crossing or an entry also has "clip": the MP4 from clip_pre_s before it to clip_post_s after.
With webhooks or MQTT (config.push, a camera's webhook=; workers/camera_push.py) each event is
also pushed there, and the row's "push" counts what each sink sent, failed, dropped and held back.

`frame` is the decoder's frame number since the camera's last (re)connect, `seq` counts the
frames this service sent to the detector for the camera, the times are Unix seconds. A
camera going down adds one record with "frame": null and the reason in "error". Passwords in
URLs are masked in everything this service writes or serves.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from functools import partial
from typing import IO, Any

from sources.stream_reader import StreamConfig, StreamReader
from workers import cameras_control
from workers.camera_checks import (  # noqa: F401 - re-exported: workers.cameras is where callers find them
    CAMERA_ID,
    OPTION_FIELDS,
    POLICIES,
    CameraConflict,
    CameraError,
    CameraNotFound,
    CameraOptions,
    CameraServiceConfig,
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
from workers.camera_clips import ClipWriter
from workers.camera_push import Pusher
from workers.cameras_control import CONTROL_KEY, Control  # noqa: F401 - CONTROL_KEY: re-exported
from workers.cameras_mux import Muxer
from workers.cameras_publish import STREAM_KEY, Publisher  # noqa: F401 - STREAM_KEY: re-exported
from workers.cameras_state import Camera
from workers.urlguard import check_url

log = logging.getLogger("tandem.cameras")


class CameraService:
    """Cameras added and removed at any time, detected on `runtime`, published per camera.

    `config` (a CameraServiceConfig, or its fields as keywords) says how. `redis_client` (or
    None) gets the records and, every `publish_interval_s`, this service's payload for `tandem
    serve`'s /metrics; it also answers commands pushed to the control list when `control` is
    set. `jsonl`: a text file that gets every record as a JSON line (None: none). The Runtime
    stays the caller's: close() leaves it open.
    """

    def __init__(
        self,
        runtime,
        redis_client=None,
        config: CameraServiceConfig | None = None,
        *,
        jsonl: IO[str] | None = None,
        **fields: Any,
    ) -> None:
        if config is not None and fields:
            raise TypeError(f"give the settings in config or as keywords, not both (got {', '.join(fields)})")
        self.config = config = CameraServiceConfig(**fields) if config is None else config
        self.runtime, self.redis = runtime, redis_client
        self.instance = config.instance or check_instance(f"cameras-{socket.gethostname()}-{os.getpid()}")
        stream_config = config.stream_config
        if stream_config is None:
            vision_config = getattr(getattr(runtime, "vision", None), "config", None)
            limit = getattr(vision_config, "max_image_pixels", None)
            stream_config = StreamConfig() if limit is None else StreamConfig(max_image_pixels=limit)
        self.stream_config = stream_config
        # Cameras a remote caller adds pass this guard (workers/urlguard.py) when added and at
        # every reconnect; the default: any public host (or under allowed_url_prefixes).
        self.url_policy = config.url_policy or camera_policy(config.allowed_url_prefixes)
        self._thread_failure: str | None = None
        self._num_streams = 0
        self.publisher = Publisher(
            redis_client, jsonl, config.maxlen, self.instance, config.publish_interval_s, self.payload
        )
        self.muxer = Muxer(runtime, self.publisher.queue, config.max_in_flight, config.batch_timeout_s)
        self.control = Control(self, redis_client, self.instance)
        self.clips = None if config.clips is None else ClipWriter(config.clips)
        self.pusher = Pusher(config.push, self.instance)
        loops = [("dispatch", self.muxer.run), ("publish", self.publisher.run)]
        if self.clips is not None:
            loops.append(("clips", self.clips.run))
        if config.control and redis_client is not None:
            loops.append(("control", self.control.run))
        self._threads = [
            threading.Thread(target=self._guard, args=(f,), name=f"tandem-cameras-{name}", daemon=True)
            for name, f in loops
        ]
        for t in self._threads:
            t.start()

    @property
    def failure(self) -> str | None:
        """Why the service cannot go on (the Runtime refuses frames for good, or one of its
        threads died), else None: the health check and the CLI's exit code say so."""
        return self.muxer.failure or self._thread_failure

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
        lines=None,
        zones=None,
        clips: bool | str | None = None,
        clip_pre_s: float = 5.0,
        clip_post_s: float = 5.0,
        webhook=None,
        webhook_cooldown_s: float | None = None,
    ) -> dict:
        """Start reading a camera; its row. Only network stream URLs unless `allow_local` (a
        `.streams` file's local videos and webcams). CameraError names the bad field.

        `policy` "freshest" keeps the newest frame only (a live view: late frames are worth
        nothing), "every_frame" a FIFO of `queue` frames (recorded files, counting); frames
        older than `max_staleness_ms` are dropped before inference either way.
        `motion_threshold` (a fraction in (0, 1]) gates the detector on motion; `tracker`
        ("bytetrack", "botsort") adds track ids to the records. `lines` and `zones` (text or
        lists, runtime/vision/analytics.py; they need a tracker) add crossing and zone events
        to the records and their counts to the row. With the service's clips, such a camera
        records a clip around its events (`clips` "off": not this one), from `clip_pre_s`
        before to `clip_post_s` after (workers/camera_clips.py). Its events go to the
        service's webhooks and MQTT broker, and to its own `webhook`s (text "[TYPE,...=]URL",
        objects or a list; a remote caller's pass the URL guard), each event type and line or
        zone at most once per `webhook_cooldown_s` (None: the service's; workers/camera_push.py)."""
        check_camera_id(camera_id)
        options = CameraOptions(
            policy,
            queue,
            max_staleness_ms,
            motion_threshold,
            tracker,
            lines or (),
            zones or (),
            clips,
            clip_pre_s,
            clip_post_s,
            webhook or (),
            webhook_cooldown_s,
        )
        options = options.check()
        want_clips = options.clips is not False and bool(options.lines or options.zones)
        if options.clips and not want_clips:
            raise CameraError("clips", "clips are cut around line and zone events: add lines= or zones=")
        if options.clips and self.clips is None:
            raise CameraError("clips", "clips need a directory: start tandem streams with --clips-dir")
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
        for hook in () if allow_local else options.webhook:  # a remote caller's: now, and at each delivery
            try:
                check_url(hook.url, self.pusher.policy(remote=True))
            except ValueError as exc:
                raise CameraError("webhook", f"webhook: {redact(str(exc))}") from None
        cap = check_max_fps(max_fps)
        cap = self.config.max_fps if cap is None else cap
        mux = self.muxer
        with mux.cond:
            if mux.closing:
                raise RuntimeError("the camera service is closed")
            if camera_id in mux.cameras:
                raise CameraConflict("camera", f"camera {camera_id!r} exists already (remove it first)")
            if len(mux.cameras) >= self.config.max_cameras:
                raise CameraConflict("camera", f"this service has {self.config.max_cameras} cameras, its max_cameras")
            self._num_streams += 1
            cam = Camera(camera_id, url, redact(url), 1.0 / cap if cap else 0.0, None, time.monotonic(), options)
            if motion_threshold is not None:
                from runtime.vision.motion import MotionGate

                cam.gate = MotionGate(motion_threshold)
            if tracker is not None:
                from runtime.vision.tracking import make_tracker

                try:
                    cam.tracker = make_tracker(tracker, frame_rate=cap or 30.0)
                except ValueError as exc:
                    raise CameraError("tracker", str(exc)) from None
            if options.lines or options.zones:
                from runtime.vision.analytics import CameraAnalytics

                cam.analytics = CameraAnalytics(options.lines, options.zones)
            if want_clips and self.clips is not None:
                cam.clips = self.clips.camera(camera_id, options.clip_pre_s, options.clip_post_s)
            if cam.analytics is not None:
                remote, cool = not allow_local, options.webhook_cooldown_s
                cam.push = self.pusher.camera(camera_id, options.webhook, remote=remote, cooldown_s=cool)
            down = partial(mux.camera_down, cam)
            dial = None if allow_local else partial(dial_camera, self.url_policy)  # a .streams file is the operator's
            buffer = options.queue if options.policy == "every_frame" else 0
            config = dataclasses.replace(self.stream_config, buffer=buffer)
            name = f"camera {camera_id}"
            tap = None if cam.clips is None else cam.clips.ring.add  # every frame read, as sent
            cam.reader = StreamReader(self._num_streams, url, config, mux.cond, down, dial, name=name, tap=tap)
            mux.cameras[camera_id] = cam
            cam.reader.start()
            row = cam.row(time.monotonic())
        log.info(
            "camera %s added: %s (max_fps %s, policy %s)", camera_id, cam.public_url, cap or "none", options.policy
        )
        return row

    def remove(self, camera_id: str) -> dict:
        """Stop reading a camera; its last row. Frames of it already in the detector are still
        published. CameraNotFound if no camera has this id."""
        with self.muxer.cond:
            cam = self.muxer.cameras.pop(camera_id, None) if isinstance(camera_id, str) else None
            if cam is None:
                raise CameraNotFound("camera", f"no camera {camera_id!r} (GET /cameras lists them)")
            row = cam.row(time.monotonic())
        cam.reader.close(join_s=0.0)  # a blocked read ends at its timeout; the thread is a daemon
        self.pusher.release(cam.push)  # its own webhooks' sinks, if no other camera uses them
        log.info("camera %s removed", camera_id)
        return row

    def cameras(self) -> list[dict]:
        """One row per camera (Camera.row), as server/metrics.py renders them."""
        now = time.monotonic()
        with self.muxer.cond:
            return [c.row(now) for c in self.muxer.cameras.values()]

    def latest(self, camera_id: str) -> tuple[Any, dict] | None:
        """The newest published frame of a camera (BGR) and its record, for the views; None
        before its first record, or if no camera has this id. A carried-over frame counts:
        the motion gate found it unchanged, so its record's boxes hold for it."""
        with self.muxer.cond:
            cam = self.muxer.cameras.get(camera_id) if isinstance(camera_id, str) else None
            return None if cam is None else cam.latest

    def payload(self) -> dict:
        """This service's /metrics payload: its cameras, the muxer's batches, and its Runtime's
        serving metrics."""
        counts = self.publisher.counts_now()
        metrics = self.runtime.metrics_snapshot()
        with self.muxer.cond:
            batching = self.muxer.stats.to_dict()
        return {
            "kind": "cameras",
            "cameras": self.cameras(),
            "service": counts,
            "batching": batching,
            "push": self.pusher.stats(),
            "metrics": metrics,
        }

    def command(self, raw: str | bytes) -> dict:
        """One control command, as the Redis control list takes them (Control.command)."""
        return self.control.command(raw)

    def apply(self, cmd: dict) -> dict:
        """{"op": "add" | "remove", ...}: the camera's row (cameras_control.apply)."""
        return cameras_control.apply(self, cmd)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every camera, publish what the detector still returns (up to `timeout`), and
        take this service's payload out of Redis. The Runtime stays open."""
        cams = self.muxer.close()
        if cams is None:  # closed before
            return
        self.control.stop()
        for cam in cams:
            cam.reader.close(join_s=0.0)
        deadline = time.monotonic() + timeout
        self.muxer.wait_idle(timeout)  # results still in the Runtime: wait for them, so they are published
        self.publisher.close()
        if self.clips is not None:  # after the publisher's last events: clips end with the frames they have
            self._threads[1].join(max(0.1, deadline - time.monotonic()))
            self.clips.close()
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))
        self.pusher.close(min(2.0, max(0.1, deadline - time.monotonic())))  # after the publisher's last events
        for cam in cams:
            cam.reader.join(max(0.0, deadline - time.monotonic()))
        self.publisher.withdraw()

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
            name = threading.current_thread().name
            log.exception("%s ended by an error", name)
            self._thread_failure = self._thread_failure or f"{name} failed: {type(exc).__name__}: {exc}"
