"""Track IDs across a camera's frames with the trackers Ultralytics ships (ByteTrack, BoT-SORT).

    tracker = make_tracker("bytetrack", frame_rate=15)
    for image in frames:                      # one camera, in frame order
        det = runner.predict([image])[0]
        track_ids = tracker.update(det, image)  # one per box of det, same order; None: not confirmed

Tandem's detections go to Ultralytics' own BYTETracker / BOTSORT with the settings of their
default config files (ultralytics/cfg/trackers/*.yaml), so IDs match what `yolo track` gives on
the same boxes. BoT-SORT runs without ReID (its default: ReID needs another model), but its
global motion compensation (sparse optical flow) needs the frame, so pass the image.

ByteTrack's prediction step is Ultralytics' own arithmetic done faster (_predict_xyah): its
N-d np.dot calls a BLAS dot product per matrix element, 8 x 8 x 2 of them per track and frame,
where the motion matrix [[I, I], [0, I]] makes F P F^T two block additions. The result is the
same to the bit (tests/test_tracking.py), so the ids are too; at 24 cameras every camera's
tracker runs on the camera service's one publisher thread, and this step was a quarter of it.
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
        if kind == "bytetrack" and _block_motion(self._tracker.kalman_filter):
            self._tracker.multi_predict = _predict_xyah  # the instance's: Ultralytics' classes stay as they are

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


def _block_motion(kf) -> bool:
    """Is `kf` the constant-velocity filter _predict_xyah assumes (Ultralytics' KalmanFilterXYAH,
    dt 1: state x, y, a, h and their velocities; motion matrix [[I, I], [0, I]])?"""
    expected = np.eye(8)
    expected[:4, 4:] = np.eye(4)
    motion = getattr(kf, "_motion_mat", None)
    return motion is not None and motion.shape == (8, 8) and bool(np.array_equal(motion, expected))


def _predict_xyah(stracks: list) -> None:
    """Ultralytics' STrack.multi_predict (KalmanFilterXYAH.multi_predict) in place, the same to
    the bit: mean F^T and F P F^T + Q with F = [[I, I], [0, I]] as block additions. Each output
    element of Ultralytics' products is a sum with one or two non-zero terms (the others are
    exact zeros, the ones exact), so adding the blocks in the same order rounds the same."""
    if not stracks:
        return
    from ultralytics.trackers.basetrack import TrackState
    from ultralytics.trackers.byte_tracker import STrack

    kf = STrack.shared_kalman
    mean = np.asarray([st.mean for st in stracks])
    cov = np.asarray([st.covariance for st in stracks])
    for i, st in enumerate(stracks):
        if st.state != TrackState.Tracked:
            mean[i][7] = 0  # a track not seen this frame keeps its height: no height velocity
    h = mean[:, 3]
    q = np.empty((len(stracks), 8))  # the process noise's standard deviations, squared below
    q[:, 0] = q[:, 1] = q[:, 3] = kf._std_weight_position * h
    q[:, 2] = 1e-2
    q[:, 4] = q[:, 5] = q[:, 7] = kf._std_weight_velocity * h
    q[:, 6] = 1e-5
    q = np.square(q)
    predicted = mean.copy()
    predicted[:, :4] += mean[:, 4:]  # mean F^T
    left = cov.copy()
    left[:, :4, :] += cov[:, 4:, :]  # F P: rows
    out = left.copy()
    out[:, :, :4] += left[:, :, 4:]  # (F P) F^T: columns
    diag = np.arange(8)
    out[:, diag, diag] += q  # + Q (diagonal)
    for st, m, c in zip(stracks, predicted, out):
        st.mean, st.covariance = m, c


def make_tracker(kind: str, frame_rate: float = _BASE_FRAME_RATE) -> Tracker:
    return Tracker(kind, frame_rate)
