"""Track IDs (runtime/vision/tracking.py) on a generated scene of moving shapes, detected by the
shipped detector: each object keeps one ID over the clip, and different objects get different
IDs, with both of Ultralytics' trackers."""

from __future__ import annotations

import dataclasses
import math
import os

import cv2
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from runtime.vision.config import VisionConfig
from runtime.vision.detector import IMGSZ, WEIGHTS
from runtime.vision.evaluate import box_iou
from runtime.vision.runner import YoloRunner
from runtime.vision.tracking import TRACKERS, make_tracker

NUM_FRAMES = 30
# (class, start centre, velocity px/frame, half size, BGR colour): a circle going right, a
# square going down, a triangle going up and right; their paths never cross.
OBJECTS = (
    (0, (50.0, 80.0), (4.0, 0.0), 22, (30, 30, 230)),
    (1, (220.0, 40.0), (0.0, 3.0), 24, (230, 200, 30)),
    (2, (60.0, 240.0), (3.0, -2.0), 26, (40, 220, 40)),
)


def scene(t: int, size: int = IMGSZ) -> tuple[np.ndarray, np.ndarray]:
    """Frame t (BGR) and its objects' true boxes (len(OBJECTS), 4), drawn as
    runtime/vision/synthetic.py draws its shapes (so the shipped detector knows them)."""
    rng = np.random.default_rng(t)
    img = np.clip(np.array([90, 110, 100]) + rng.normal(0, 18, (size, size, 3)), 0, 255).astype(np.uint8)
    boxes = []
    for cls, (x0, y0), (vx, vy), r, colour in OBJECTS:
        cx, cy = x0 + vx * t, y0 + vy * t
        if cls == 0:
            cv2.circle(img, (round(cx), round(cy)), r, colour, -1, cv2.LINE_AA)
            boxes.append((cx - r, cy - r, cx + r, cy + r))
            continue
        n = 4 if cls == 1 else 3
        pts = np.array(
            [
                (cx + r * math.cos(0.3 + 2 * math.pi * k / n), cy + r * math.sin(0.3 + 2 * math.pi * k / n))
                for k in range(n)
            ]
        )
        cv2.fillPoly(img, [np.round(pts).astype(np.int32)], colour, cv2.LINE_AA)
        boxes.append((pts[:, 0].min(), pts[:, 1].min(), pts[:, 0].max(), pts[:, 1].max()))
    return img, np.asarray(boxes, dtype=np.float32)


@pytest.fixture(scope="module")
def clip():
    """[(image, true boxes, Detections)] per frame. The one-to-many head with NMS: the
    end-to-end head of the shipped detector often puts a second box on an object (see
    runtime/vision/postprocess.py), which is the detector's matter, not the tracker's."""
    runner = YoloRunner(VisionConfig(model=str(WEIGHTS), imgsz=IMGSZ, profile=False, dtype="float32", end2end=False))
    frames = [scene(t) for t in range(NUM_FRAMES)]
    return [(img, truth, runner.predict([img])[0]) for img, truth in frames]


def object_track_ids(tracker, clip) -> list[list[int | None]]:
    """Per frame, the track id of the detection of each true object's class that overlaps it
    most (the detector now and then adds a weak box of another class on a square)."""
    classes = np.array([o[0] for o in OBJECTS])
    per_frame = []
    for img, truth, det in clip:
        ids = tracker.update(det, img)
        assert len(ids) == len(det)
        iou = box_iou(truth, det.boxes) * (classes[:, None] == det.cls[None, :])
        assert (iou.max(1) > 0.5).all(), "the detector missed an object: the scene, not the tracker, is wrong"
        per_frame.append([ids[j] for j in iou.argmax(1)])
    return per_frame


@pytest.mark.parametrize("kind", TRACKERS)
def test_each_object_keeps_one_id_and_objects_get_distinct_ids(clip, kind):
    per_frame = object_track_ids(make_tracker(kind, frame_rate=30), clip)
    first = per_frame[0]
    assert None not in first, f"{kind}: the first frame's objects start confirmed tracks, got {first}"
    assert len(set(first)) == len(OBJECTS), f"{kind}: objects share an id: {first}"
    changed = [(t, ids) for t, ids in enumerate(per_frame) if ids != first]
    assert not changed, f"{kind}: ids changed from {first} at (frame, ids) {changed[:3]}"


def test_ids_follow_the_boxes_when_the_detections_come_in_another_order(clip):
    """The tracker's output is in its own order; ids must come back in det's order. (The ids
    themselves are numbered in first-seen order, so the two runs agree up to one renaming.)"""
    straight = object_track_ids(make_tracker("bytetrack"), clip)
    rng = np.random.default_rng(0)
    shuffled = []
    for img, truth, det in clip:
        order = rng.permutation(len(det))
        moved = dataclasses.replace(
            det, boxes=det.boxes[order], conf=det.conf[order], cls=det.cls[order], names=[det.names[i] for i in order]
        )
        shuffled.append((img, truth, moved))
    moved_ids = object_track_ids(make_tracker("bytetrack"), shuffled)
    rename = dict(zip(moved_ids[0], straight[0], strict=True))
    assert [[rename.get(i) for i in ids] for ids in moved_ids] == straight


def test_unknown_tracker_is_a_value_error_naming_tracker():
    with pytest.raises(ValueError, match="tracker must be one of"):
        make_tracker("sort")
    with pytest.raises(ValueError, match="tracker frame_rate"):
        make_tracker("bytetrack", frame_rate=0)


def test_without_lap_the_tracker_says_what_to_install_instead_of_pip_installing_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lap" else real(name, *a))
    with pytest.raises(ImportError, match="pip install 'lap>=0.5.12'"):
        make_tracker("bytetrack")


def _busy_scene(frames: int = 120, seed: int = 7, num_objects: int = 10, min_conf: float = 0.2, doubled: float = 0.0):
    """Detections of a busy scene: objects that come and go, vanish for a few frames (lost
    tracks, predicted without being seen), jitter, and weak boxes (ByteTrack's second pass);
    with `doubled`, that share of boxes comes with a second box on the same object (the
    detector's duplicates: duplicate tracks, unconfirmed tracks dropped)."""
    from runtime.vision.postprocess import Detections

    rng = np.random.default_rng(seed)
    objects = [(rng.uniform(20, 280, 2), rng.uniform(-6, 6, 2), rng.uniform(15, 40), rng.integers(0, 3), a, a + 60)
               for a in rng.integers(0, frames - 20, num_objects)]  # fmt: skip
    out = []
    for t in range(frames):
        boxes, conf, cls = [], [], []
        for (x, y), (vx, vy), r, c, born, dies in objects:
            if not born <= t < dies or rng.random() < 0.15:  # not there, or missed this frame
                continue
            cx, cy = x + vx * (t - born) + rng.normal(0, 1.5), y + vy * (t - born) + rng.normal(0, 1.5)
            boxes.append((cx - r, cy - r, cx + r, cy + r * rng.uniform(0.9, 1.1)))
            conf.append(rng.uniform(min_conf, 0.95))
            cls.append(c)
            if rng.random() < doubled:
                d = rng.normal(0, 2, 4)
                boxes.append((cx - r + d[0], cy - r + d[1], cx + r + d[2], cy + r + d[3]))
                conf.append(rng.uniform(min_conf, 0.95))
                cls.append(c)
        out.append(
            Detections(
                np.asarray(boxes, np.float32).reshape(-1, 4),
                np.asarray(conf, np.float32),
                np.asarray(cls, np.int64),
                [str(c) for c in cls],
                (320, 320),
            )
        )
    return out


SCENES = {  # (seed, objects, lowest confidence, doubled boxes)
    "sparse": (7, 10, 0.2, 0.0),
    "weak boxes": (11, 24, 0.05, 0.0),
    "crowded, doubled boxes": (23, 40, 0.05, 0.3),
}


@pytest.mark.parametrize("scene", list(SCENES))
def test_bytetrack_step_is_ultralytics_own_to_the_bit(scene):
    """The fast step (tracking._ByteTrackStep with _predict_xyah) against Ultralytics' own
    BYTETracker.update on the same detections: the same ids every frame, the same tracks in
    each pool in the same order, and every track's state equal to the bit."""
    pytest.importorskip("lap")
    fast, plain = make_tracker("bytetrack", frame_rate=5), make_tracker("bytetrack", frame_rate=5)
    assert "multi_predict" in vars(fast._tracker) and fast._step is not None, "the fast step is in use"
    del plain._tracker.multi_predict  # Ultralytics' own (the class's) again
    plain._step = None
    refound = _count_refound(plain._tracker)
    image = np.zeros((320, 320, 3), np.uint8)
    predicted = 0
    seed, num_objects, min_conf, doubled = SCENES[scene]
    for t, det in enumerate(_busy_scene(200, seed, num_objects, min_conf, doubled)):
        assert fast.update(det, image) == plain.update(det, image), f"frame {t}"
        a, b = fast._tracker, plain._tracker
        for pool in ("tracked_stracks", "lost_stracks"):
            ours, theirs = getattr(a, pool), getattr(b, pool)
            assert [s.track_id for s in ours] == [s.track_id for s in theirs], (t, pool)
            for s, r in zip(ours, theirs):
                assert np.array_equal(s.mean, r.mean) and np.array_equal(s.covariance, r.covariance), (t, s.track_id)
                assert np.array_equal(s._tlwh, r._tlwh) and _bookkeeping(s) == _bookkeeping(r), (t, s.track_id)
            predicted += len(ours)
        for pool in ("removed_stracks", "removed_stracks_frame"):
            assert [s.track_id for s in getattr(a, pool)] == [s.track_id for s in getattr(b, pool)], (t, pool)
    assert predicted > 200 and len(b.lost_stracks) + len(b.removed_stracks) > 0, "lost tracks were predicted too"
    assert refound[0] > 0, "lost tracks were found again (re_activate) too"


BOOKKEEPING = ("state", "is_activated", "score", "cls", "idx", "frame_id", "start_frame", "tracklet_len")


def _bookkeeping(track) -> tuple:
    return tuple(getattr(track, k) for k in BOOKKEEPING)


def _count_refound(tracker) -> list[int]:
    """How many times Ultralytics' `tracker` finds a lost track again, counted as it runs."""
    from ultralytics.trackers.basetrack import TrackState

    count, apply = [0], tracker._apply_match

    def counted(track, det, activated, refind):
        count[0] += track.state != TrackState.Tracked
        apply(track, det, activated, refind)

    tracker._apply_match = counted
    return count
