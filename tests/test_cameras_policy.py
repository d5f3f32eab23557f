"""Per-camera frame policy (workers/cameras.py): "freshest" keeps the newest frame, "every_frame"
a bounded FIFO, `max_staleness_ms` drops frames too old to detect; every drop has its reason.

A real Runtime with the test detector and loopback MJPEG cameras; every wait is on records
arriving (a condition) with a deadline.
"""

from __future__ import annotations

import dataclasses

import pytest
from camera_helpers import FAST, POLICY, SAFETY_S, VISION, Lines, frames_of

from server.metrics import render
from sources.loopback import MjpegServer, dead_url, synthetic_frames
from workers.cameras import CameraError, CameraService


@pytest.fixture(scope="module")
def runtime():
    from runtime.runtime import Runtime

    with Runtime(vision=VISION, profile=False) as rt:
        yield rt


@pytest.fixture(scope="module")
def camera():
    with MjpegServer(synthetic_frames(15, seed=4), fps=30) as server:
        yield server.url


def serve(runtime, camera: str, n: int, stream_config=FAST, **options) -> tuple[list[dict], dict]:
    """Records of camera "cam" (added with `options`) until it has `n`, and its row then."""
    lines = Lines()
    service = CameraService(runtime, None, jsonl=lines, stream_config=stream_config, url_policy=POLICY)
    try:
        service.add("cam", camera, **options)
        records = lines.wait(lambda rs: len(frames_of(rs, "cam")) >= n)
        payload = service.payload()
        return frames_of(records, "cam"), payload
    finally:
        service.close()


def test_freshest_under_a_rate_cap_drops_the_waiting_frames_as_rate_cap(runtime, camera):
    records, payload = serve(runtime, camera, 6, max_fps=4)
    row = payload["cameras"][0]
    assert row["policy"] == "freshest" and row["queue"] is None
    # The camera sends faster than the cap lets frames go: a newer frame replaced the waiting one.
    assert row["drops_by_reason"].get("rate_cap", 0) > 0, row["drops_by_reason"]
    assert "queue_full" not in row["drops_by_reason"] and "stale" not in row["drops_by_reason"]
    assert row["drops"] == sum(row["drops_by_reason"].values())
    page = render([{**payload, "instance": "pol"}]).decode()
    assert 'tandem:camera_frames_dropped_by_reason_total{camera="cam",reason="rate_cap",tandem_instance="pol"}' in page


def test_every_frame_detects_each_frame_in_order_when_they_come_faster_than_the_detector(runtime):
    # A 30-frame clip sent at 300 fps, far faster than the detector: a newest-only slot would
    # keep a few; the FIFO keeps all 30, in order.
    # The reader must not reconnect when the clip ends: the camera would send it again from frame
    # 0, and on a busy machine (a slow detector) the replays fill the FIFO and push the first
    # pass's unread frames out (seen: 0..17, 0, 1, 2, 3, 13, ...). Timeouts long for the same
    # reason: this camera shares the test's process, so a starved GIL silences it too.
    once = dataclasses.replace(FAST, max_retries=0, open_timeout_s=SAFETY_S, read_timeout_s=SAFETY_S)
    with MjpegServer(synthetic_frames(30, seed=6), fps=300, loop=False) as burst:
        records, payload = serve(runtime, burst.url, 30, stream_config=once, policy="every_frame", queue=60)
    row = payload["cameras"][0]
    assert row["reconnects"] == 0, row
    assert row["policy"] == "every_frame" and row["queue"] == 60
    assert [r["frame"] for r in records[:30]] == list(range(30)), [r["frame"] for r in records]
    assert not row["drops_by_reason"].get("replaced") and not row["drops_by_reason"].get("queue_full")


def test_every_frame_with_a_full_queue_drops_the_oldest_as_queue_full(runtime, camera):
    # 4 frames a second out of a faster camera: the 3-frame FIFO overflows.
    records, payload = serve(runtime, camera, 5, policy="every_frame", queue=3, max_fps=4)
    row = payload["cameras"][0]
    assert row["drops_by_reason"].get("queue_full", 0) > 0, row["drops_by_reason"]
    assert "replaced" not in row["drops_by_reason"]


def test_max_staleness_drops_frames_older_than_asked_before_inference(runtime, camera):
    # A FIFO that never fills (30) behind a rate cap: frames wait, and those older than 100 ms go.
    records, payload = serve(runtime, camera, 5, policy="every_frame", queue=30, max_fps=4, max_staleness_ms=100)
    row = payload["cameras"][0]
    assert row["max_staleness_ms"] == 100
    assert row["drops_by_reason"].get("stale", 0) > 0, row["drops_by_reason"]
    assert "queue_full" not in row["drops_by_reason"]
    # What reached the detector was fresh: its wait before inference is within the bound (the
    # record's latency also holds the forward, well under a second here).
    assert all(r["latency_ms"] < 100 + 1000 for r in records), [r["latency_ms"] for r in records]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"policy": "newest"}, "policy"),
        ({"queue": 0}, "queue"),
        ({"queue": True}, "queue"),
        ({"max_staleness_ms": -5}, "max_staleness_ms"),
        ({"motion_threshold": 2}, "motion_threshold"),
        ({"tracker": "sort"}, "tracker"),
        ({"max_fps": 0}, "max_fps"),
    ],
)
def test_a_bad_option_is_refused_naming_its_field(runtime, options, field):
    service = CameraService(runtime, None, stream_config=FAST, url_policy=POLICY, control=False)
    try:
        with pytest.raises(CameraError) as err:
            service.apply({"op": "add", "camera": "cam", "url": "http://127.0.0.1:1/x", **options})
        assert err.value.field == field and field in str(err.value)
        assert service.cameras() == []
    finally:
        service.close()


def test_a_dead_camera_is_named_by_its_id(runtime):
    lines = Lines()
    service = CameraService(runtime, None, jsonl=lines, stream_config=FAST, url_policy=POLICY)
    try:
        # The operator's cameras (a .streams file's): their records keep the reader's whole text,
        # where a remotely added camera's say only the kind of failure (test_streams_security).
        service.add("cam0", dead_url(), allow_local=True)
        service.add("cam2", dead_url(), allow_local=True)
        records = lines.wait(lambda rs: {r["camera"] for r in rs if r["error"]} >= {"cam0", "cam2"})
        rows = {row["camera"]: row for row in service.cameras()}
    finally:
        service.close()
    errors = [r["error"] for r in records if r["camera"] == "cam2" and r["error"]] + [rows["cam2"]["last_error"]]
    assert all("camera cam2" in e and "stream" not in e.split("(")[0] for e in errors), errors


def test_a_tracker_gives_each_record_one_track_id_per_box_in_frame_order(runtime, camera):
    pytest.importorskip("runtime.vision.tracking")
    lines = Lines()
    service = CameraService(runtime, None, jsonl=lines, stream_config=FAST, url_policy=POLICY)
    try:
        service.add("tracked", camera, tracker="bytetrack")
        service.add("plain", camera)
        records = lines.wait(lambda rs: min(len(frames_of(rs, "tracked")), len(frames_of(rs, "plain"))) >= 10)
        rows = {row["camera"]: row for row in service.cameras()}
    finally:
        service.close()
    assert rows["tracked"]["tracker"] == "bytetrack" and rows["plain"]["tracker"] is None
    tracked = frames_of(records, "tracked")
    assert all(len(r["track_ids"]) == len(r["boxes"]) for r in tracked)
    assert all(r["track_ids"] is None for r in frames_of(records, "plain"))
    # The publisher feeds the tracker in frame order, whatever order the workers finished in.
    seqs = [r["seq"] for r in tracked]
    assert seqs == sorted(seqs)
