"""Track IDs across a camera's frames with the trackers Ultralytics ships (ByteTrack, BoT-SORT).

    tracker = make_tracker("bytetrack", frame_rate=15)
    for image in frames:                      # one camera, in frame order
        det = runner.predict([image])[0]
        track_ids = tracker.update(det, image)  # one per box of det, same order; None: not confirmed

Tandem's detections go to Ultralytics' own BYTETracker / BOTSORT with the settings of their
default config files (ultralytics/cfg/trackers/*.yaml), so IDs match what `yolo track` gives on
the same boxes. BoT-SORT runs without ReID (its default: ReID needs another model), but its
global motion compensation (sparse optical flow) needs the frame, so pass the image.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np

from runtime.vision.postprocess import Detections

TRACKERS = ("bytetrack", "botsort")
_BASE_FRAME_RATE = 30.0  # the frame rate track_buffer is given for (Ultralytics' own convention)


class _Boxes:
    """The part of Ultralytics' `Boxes` (after .cpu().numpy()) that its trackers read: conf,
    cls, xyxy, xywh, len() and boolean-mask indexing."""

    __slots__ = ("xyxy", "conf", "cls")

    def __init__(self, xyxy: np.ndarray, conf: np.ndarray, cls: np.ndarray) -> None:
        self.xyxy, self.conf, self.cls = xyxy, conf, cls

    @property
    def xywh(self) -> np.ndarray:
        xy = (self.xyxy[:, :2] + self.xyxy[:, 2:]) / 2
        return np.concatenate((xy, self.xyxy[:, 2:] - self.xyxy[:, :2]), axis=1)

    def __len__(self) -> int:
        return len(self.conf)

    def __getitem__(self, mask: np.ndarray) -> _Boxes:
        return _Boxes(self.xyxy[mask], self.conf[mask], self.cls[mask])


def missing_dependency() -> str | None:
    """Why the trackers cannot run here, or None. Ultralytics' matching needs `lap`, and without
    it would try to pip-install it at import, from inside the serving process."""
    if importlib.util.find_spec("lap") is None:
        return "tracking needs the 'lap' package (Ultralytics' tracker requirement): pip install 'lap>=0.5.12'"
    return None


def _settings(kind: str, frame_rate: float) -> SimpleNamespace:
    from ultralytics.utils import YAML
    from ultralytics.utils.checks import check_yaml

    cfg = SimpleNamespace(**YAML.load(check_yaml(f"{kind}.yaml")))
    # Lost tracks are kept track_buffer frames at 30 fps: the same time (about 1 s) at this rate.
    # (Older Ultralytics took frame_rate and scaled it so; the current one no longer does.)
    cfg.track_buffer = max(1, round(cfg.track_buffer * frame_rate / _BASE_FRAME_RATE))
    cfg.with_reid = False
    return cfg


class Tracker:
    """One camera's tracker; not thread-safe (a camera's frames arrive in order, one at a time)."""

    def __init__(self, kind: str, frame_rate: float = _BASE_FRAME_RATE) -> None:
        if kind not in TRACKERS:
            raise ValueError(f"tracker must be one of {TRACKERS}, got {kind!r}")
        if isinstance(frame_rate, bool) or not isinstance(frame_rate, (int, float)) or not frame_rate > 0:
            raise ValueError(f"tracker frame_rate must be a number > 0, got {frame_rate!r}")
        problem = missing_dependency()
        if problem:
            raise ImportError(problem)
        from runtime.vision.ultralytics_import import import_ultralytics

        import_ultralytics()  # before any ultralytics submodule, for its OMP_NUM_THREADS side effect
        from ultralytics.trackers import BOTSORT, BYTETracker

        self.kind = kind
        self._tracker = (BYTETracker if kind == "bytetrack" else BOTSORT)(_settings(kind, float(frame_rate)))

    def update(self, det: Detections, image: np.ndarray | None) -> list[int | None]:
        """The track id of each box of `det`, in det's order (None: a box no confirmed track
        took this frame, e.g. an object seen for the first time after the first frame)."""
        boxes = _Boxes(
            np.asarray(det.boxes, dtype=np.float32).reshape(-1, 4),
            np.asarray(det.conf, dtype=np.float32).reshape(-1),
            np.asarray(det.cls).reshape(-1).astype(np.float32),
        )
        tracks = self._tracker.update(boxes, image)
        ids: list[int | None] = [None] * len(boxes)
        # Rows are [x1, y1, x2, y2, track_id, score, cls, idx], idx being the box's index in det
        # (an empty frame gives a 1-d empty array).
        for row in tracks.reshape(-1, 8):
            ids[int(row[7])] = int(row[4])
        return ids

    def reset(self) -> None:
        self._tracker.reset()


def make_tracker(kind: str, frame_rate: float = _BASE_FRAME_RATE) -> Tracker:
    return Tracker(kind, frame_rate)
