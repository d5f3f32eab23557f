"""The camera service's publisher (workers/cameras.py composes it): one thread that turns the
muxer's results into records, in each camera's frame order and off the vision workers'
threads: track ids from the camera's tracker if it has one, an XADD per frame to the Redis
Stream of its camera, and a JSON line if asked. Every `interval_s` it also publishes the
service's /metrics payload to Redis (workers/fleet_metrics.py), and withdraws it at close.

    tandem:cameras:{camera}      stream, MAXLEN ~ maxlen; field "data" = one record

Redis down loses records (counted: records_lost, publish_errors), not the service.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any

from runtime.vision.records import detection_record
from workers import fleet_metrics
from workers.cameras_state import LAST_EVENTS, Result

log = logging.getLogger("tandem.cameras")

STREAM_KEY = "tandem:cameras:"
MAX_PENDING_RECORDS = 10_000  # records waiting for Redis (an outage): older ones are dropped


class Publisher:
    """Records to `redis_client` (or None) and `jsonl` (a text file, or None); `payload()` is
    the service's /metrics payload, published as `instance`. The muxer queues results with
    queue(); close() lets run() end once they are all written."""

    def __init__(
        self,
        redis_client,
        jsonl: IO[str] | None,
        maxlen: int,
        instance: str,
        interval_s: float,
        payload: Callable[[], dict],
    ) -> None:
        self.redis, self.jsonl, self.maxlen = redis_client, jsonl, maxlen
        self.instance, self.interval_s, self.payload = instance, interval_s, payload
        # Results on their way to Redis / JSON lines, appended by the vision workers' callbacks.
        self._cond = threading.Condition()
        self._out: deque[Result] = deque()
        self._closing = False
        self.counts = {"records": 0, "records_lost": 0, "publish_errors": 0}  # guarded by _cond

    def counts_now(self) -> dict:
        with self._cond:
            return dict(self.counts)

    def close(self) -> None:
        """run() ends once the queued results are written."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def withdraw(self) -> None:
        """This service's payload out of Redis (it would expire by itself)."""
        if self.redis is None:
            return
        from redis.exceptions import RedisError

        try:
            fleet_metrics.withdraw(self.redis, self.instance)
        except RedisError as exc:  # it expires by itself
            log.warning("could not withdraw metrics of %s: %s", self.instance, exc)

    def queue(self, item: Result) -> None:
        """(the muxer's emit) One result to publish; past MAX_PENDING_RECORDS the oldest goes."""
        with self._cond:
            if len(self._out) >= MAX_PENDING_RECORDS:
                self._out.popleft()
                self.counts["records_lost"] += 1
            self._out.append(item)
            self._cond.notify_all()

    def count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self.counts[name] += n

    def run(self) -> None:
        """The publisher thread: write what the muxer queued, beat, until close()."""
        next_beat = time.monotonic() if self.redis is not None else float("inf")
        while True:
            with self._cond:
                while not (self._out or self._closing) and time.monotonic() < next_beat:
                    self._cond.wait(None if next_beat == float("inf") else next_beat - time.monotonic())
                items = [self._out.popleft() for _ in range(min(len(self._out), 512))]
                closing = self._closing and not self._out
            if items:
                self._write(self._build(items))
            if closing:
                return
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.interval_s
                self._heartbeat()

    def _build(self, items: list[Result]) -> list[dict]:
        """The records of results, in each camera's frame order: carried-over frames take the
        last detections, and each camera's tracker sees every published frame in turn."""
        dets = [_detections(item) for item in items]
        track_ids = _track(items, dets)
        return [self._record(item, det, ids) for item, det, ids in zip(items, dets, track_ids)]

    def _record(self, item: Result, det, track_ids: list | None) -> dict:
        """The record of one result, with its detections and track ids, and its events."""
        cam = item.cam
        frame = item.frame
        events = None
        if cam.analytics is not None and track_ids is not None:
            events = cam.analytics.update(det.boxes, det.names, track_ids, _frame_time(item), frame.image.shape[1::-1])
            if events:
                if cam.clips is not None:  # "clip": its path, known now (workers/camera_clips.py)
                    cam.clips.on_events(events, frame.timestamp)
                cam.events = (*cam.events, *events)[-LAST_EVENTS:]  # one swap: the row reads it whole
                if cam.push is not None:  # webhooks and MQTT: queued, never waited on (camera_push.py)
                    cam.push.on_events(events, cam.analytics.counts)
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
        if cam.analytics is not None:  # line_cross, zone_enter, zone_exit (runtime/vision/analytics.py)
            record["events"] = events or []
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
                self.count("records", len(records))
            except RedisError as exc:  # an outage loses these records, not the service
                self.count("records_lost", len(records))
                self.count("publish_errors")
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

        try:  # kept for a few beats: a scrape never misses a live service
            fleet_metrics.publish(self.redis, self.instance, self.payload(), ttl_s=3 * self.interval_s + 1)
        except RedisError as exc:
            self.count("publish_errors")
            log.warning("could not publish metrics to Redis: %s", exc)


def _detections(item: Result):
    """The detections of a result: carried-over frames take the camera's last ones (called in
    the order of each camera's frames)."""
    if item.carried:
        return item.cam.last_det
    if item.det is not None:
        item.cam.last_det = item.det
    return item.det


def _track(items: list[Result], dets: list) -> list[list | None]:
    """The track ids of each result (None: no tracker, nothing to track, or its tracker
    failed). A camera's tracker sees each of its published frames in turn; the trackers of
    different cameras go together (track_many: one numpy call for all of them per step), in
    rounds of one frame per camera."""
    from runtime.vision.tracking import track_many

    out: list[list | None] = [None] * len(items)
    todo = [
        k
        for k, item in enumerate(items)
        if item.cam.tracker is not None and dets[k] is not None and item.frame is not None
    ]
    while todo:
        now, later, cams = [], [], set()
        for k in todo:  # each camera's first frame now, its next ones in a later round
            (later if id(items[k].cam) in cams else now).append(k)
            cams.add(id(items[k].cam))
        results = track_many([(items[k].cam.tracker, dets[k], items[k].frame.image) for k in now])
        for k, ids in zip(now, results):
            if isinstance(ids, Exception):  # a tracker bug costs this camera its ids, not the service
                log.warning(
                    "camera %s: tracker failed on frame %s: %s", items[k].cam.camera_id, items[k].frame.index, ids
                )
            else:
                out[k] = ids
        todo = later
    return out


def _frame_time(item: Result) -> float:
    """When the frame was captured (Unix seconds): dwell is measured in the camera's time, not
    in when the detector happened to finish."""
    return item.finished if item.captured is None else item.captured


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
