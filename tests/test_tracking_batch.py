"""Many cameras' ByteTrack trackers in lockstep (runtime/vision/tracking.py track_many, as the
camera service's publisher calls it): the same ids and the same track states, to the bit, as
each camera's tracker run alone with Ultralytics' own update."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from runtime.vision.tracking import make_tracker, track_many
from tests.test_tracking import BOOKKEEPING, _busy_scene
from workers.cameras_publish import Publisher
from workers.cameras_state import Result

pytest.importorskip("lap")

NUM_CAMERAS, NUM_FRAMES = 12, 120
IMAGE = np.zeros((320, 320, 3), np.uint8)


def scenes() -> list[list]:
    """A camera's detections per frame: sparse, weak and crowded scenes with doubled boxes."""
    return [
        _busy_scene(NUM_FRAMES, seed=100 + k, num_objects=6 + 4 * (k % 5), min_conf=0.05, doubled=0.1 * (k % 3))
        for k in range(NUM_CAMERAS)
    ]


def plain_tracker():
    tracker = make_tracker("bytetrack", frame_rate=5)
    del tracker._tracker.multi_predict  # Ultralytics' own update and prediction
    tracker._step = None
    return tracker


def assert_same_tracks(ours, theirs, where) -> None:
    for pool in ("tracked_stracks", "lost_stracks", "removed_stracks"):
        a, b = getattr(ours._tracker, pool), getattr(theirs._tracker, pool)
        assert [s.track_id for s in a] == [s.track_id for s in b], (where, pool)
        for s, r in zip(a, b):
            assert np.array_equal(s.mean, r.mean) and np.array_equal(s.covariance, r.covariance), (where, s.track_id)
            assert [getattr(s, k) for k in BOOKKEEPING] == [getattr(r, k) for k in BOOKKEEPING], (where, s.track_id)


def test_trackers_in_lockstep_are_each_ultralytics_own_to_the_bit():
    per_camera = scenes()
    ours = [make_tracker("bytetrack", frame_rate=5) for _ in range(NUM_CAMERAS)]
    theirs = [plain_tracker() for _ in range(NUM_CAMERAS)]
    tracked = 0
    for t in range(NUM_FRAMES):
        # Cameras drop in and out of a round, as results come to the publisher.
        cams = [k for k in range(NUM_CAMERAS) if (t + k) % 4]
        ids = track_many([(ours[k], per_camera[k][t], IMAGE) for k in cams])
        for k, got in zip(cams, ids):
            assert got == theirs[k].update(per_camera[k][t], IMAGE), (t, k)
            assert_same_tracks(ours[k], theirs[k], (t, k))
            tracked += sum(i is not None for i in got)
    assert tracked > 2000


def test_a_failing_tracker_costs_only_its_camera_its_ids():
    good, bad = make_tracker("bytetrack", frame_rate=5), make_tracker("bytetrack", frame_rate=5)
    det = next(d for d in _busy_scene(40, seed=3) if len(d) > 1)
    broken = SimpleNamespace(boxes=det.boxes, conf=det.conf[:-1], cls=det.cls)  # one score short
    ids = track_many([(bad, broken, IMAGE), (good, det, IMAGE)])
    assert isinstance(ids[0], Exception) and ids[1] == plain_tracker().update(det, IMAGE)


def test_the_publisher_tracks_each_cameras_frames_in_order_within_a_round(caplog):
    """A round of queued results holding several frames of each camera, interleaved: each
    camera's records carry the ids its tracker gives its frames one by one."""
    per_camera = scenes()[:4]
    cams = [
        SimpleNamespace(camera_id=f"cam{k}", public_url="u", last_det=None, tracker=make_tracker("bytetrack", 5),
                        analytics=None, clips=None, push=None, events=(), latest=None)
        for k in range(4)
    ]  # fmt: skip
    alone = [plain_tracker() for _ in range(4)]
    publisher = Publisher(None, None, 100, "x", 5.0, dict)
    order = [(k, t) for t in range(NUM_FRAMES) for k in range(4)]
    for start in range(0, len(order), 11):  # rounds of 11 results: 2 or 3 frames of each camera
        items = [
            Result(cams[k], SimpleNamespace(image=IMAGE, index=t, timestamp=t), t, per_camera[k][t], None, t, t)
            for k, t in order[start : start + 11]
        ]
        for item, record in zip(items, publisher._build(items)):
            k, t = int(item.cam.camera_id[3:]), item.frame.index
            assert record["track_ids"] == alone[k].update(per_camera[k][t], IMAGE), (k, t)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
