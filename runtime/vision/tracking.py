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

The rest of ByteTrack's step is Ultralytics' BYTETracker.update done with fewer numpy calls
(_ByteTrackStep): the boxes of all tracks as one array instead of a property call per track and
cost matrix, and, through track_many, the Kalman prediction, corrections and new tracks of many
cameras' trackers each in one batched call (the camera service's publisher tracks a round of
results at once). Same operations on the same values in the same order, so the same bits and
ids (tests/test_tracking.py and tests/test_tracking_batch.py compare every track's state with
Ultralytics' own update over busy scenes).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np

from runtime.vision.postprocess import Detections

TRACKERS = ("bytetrack", "botsort")
_BASE_FRAME_RATE = 30.0  # the frame rate track_buffer is given for (Ultralytics' own convention)


class _Boxes:
    """The part of Ultralytics' `Boxes` (after .cpu().numpy()) that its trackers read: conf,
    cls, xyxy, xywh, len() and boolean-mask indexing. xywh is computed once (row by row, so a
    subset's rows are the same numbers as computed on their own)."""

    __slots__ = ("xyxy", "conf", "cls", "xywh")

    def __init__(self, xyxy: np.ndarray, conf: np.ndarray, cls: np.ndarray, xywh: np.ndarray | None = None) -> None:
        self.xyxy, self.conf, self.cls = xyxy, conf, cls
        if xywh is None:
            xy = (xyxy[:, :2] + xyxy[:, 2:]) / 2
            xywh = np.concatenate((xy, xyxy[:, 2:] - xyxy[:, :2]), axis=1)
        self.xywh = xywh

    def __len__(self) -> int:
        return len(self.conf)

    def __getitem__(self, mask: np.ndarray) -> _Boxes:
        return _Boxes(self.xyxy[mask], self.conf[mask], self.cls[mask], self.xywh[mask])


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
        from ultralytics.trackers.byte_tracker import STrack

        self.kind = kind
        self._tracker = (BYTETracker if kind == "bytetrack" else BOTSORT)(_settings(kind, float(frame_rate)))
        self._step = None  # Ultralytics' own update; or ByteTrack's, with fewer numpy calls
        if kind == "bytetrack" and _block_motion(self._tracker.kalman_filter):
            self._tracker.multi_predict = _predict_xyah  # the instance's: Ultralytics' classes stay as they are
            kf, shared = self._tracker.kalman_filter, STrack.shared_kalman
            same_noise = (kf._std_weight_position, kf._std_weight_velocity) == (
                shared._std_weight_position,
                shared._std_weight_velocity,
            )
            if type(self._tracker) is BYTETracker and _block_motion(shared) and same_noise and _update_verified():
                self._step = _ByteTrackStep(self._tracker)

    def update(self, det: Detections, image: np.ndarray | None) -> list[int | None]:
        """The track id of each box of `det`, in det's order (None: a box no confirmed track
        took this frame, e.g. an object seen for the first time after the first frame)."""
        if self._step is not None:
            ids = track_many([(self, det, image)])[0]
            if isinstance(ids, Exception):
                raise ids
            return ids
        boxes = _boxes(det)
        tracks = self._tracker.update(boxes, image)  # Ultralytics' own update
        ids: list[int | None] = [None] * len(boxes)
        # Rows are [x1, y1, x2, y2, track_id, score, cls, idx], idx being the box's index in det
        # (an empty frame gives a 1-d empty array).
        for row in tracks.reshape(-1, 8):
            ids[int(row[7])] = int(row[4])
        return ids

    def reset(self) -> None:
        self._tracker.reset()


# The Ultralytics releases whose BYTETracker.update _ByteTrackStep redoes, checked to the bit by
# tests/test_tracking.py; another release (its update may have changed) gets its own update.
VERIFIED_ULTRALYTICS = ("8.4.",)


def _update_verified() -> bool:
    import ultralytics

    return ultralytics.__version__.startswith(VERIFIED_ULTRALYTICS)


def _boxes(det: Detections) -> _Boxes:
    return _Boxes(
        np.asarray(det.boxes, dtype=np.float32).reshape(-1, 4),
        np.asarray(det.conf, dtype=np.float32).reshape(-1),
        np.asarray(det.cls).reshape(-1).astype(np.float32),
    )


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
    mean = np.array([st.mean for st in stracks])  # fresh arrays: worked on in place below
    cov = np.array([st.covariance for st in stracks])
    # A track not seen this frame keeps its height: no height velocity.
    mean[[i for i, st in enumerate(stracks) if st.state != TrackState.Tracked], 7] = 0
    h = mean[:, 3]
    q = np.empty((len(stracks), 8))  # the process noise's standard deviations, squared below
    q[:, 0] = q[:, 1] = q[:, 3] = kf._std_weight_position * h
    q[:, 2] = 1e-2
    q[:, 4] = q[:, 5] = q[:, 7] = kf._std_weight_velocity * h
    q[:, 6] = 1e-5
    mean[:, :4] += mean[:, 4:]  # mean F^T (the blocks read are not the ones written)
    cov[:, :4, :] += cov[:, 4:, :]  # F P: rows
    cov[:, :, :4] += cov[:, :, 4:]  # (F P) F^T: columns
    cov.reshape(len(stracks), 64)[:, ::9] += np.square(q)  # + Q, on the diagonal (a view)
    for st, m, c in zip(stracks, mean, cov):
        st.mean, st.covariance = m, c


def track_many(jobs: Sequence[tuple[Tracker, Detections, np.ndarray | None]]) -> list:
    """Tracker.update of each (tracker, det, image), the trackers all different: for each, its
    ids or the exception it raised. ByteTrack trackers go in lockstep (_ByteTrackStep.steps):
    the Kalman prediction, corrections and new tracks of all of them each in one numpy call,
    which at 30 cameras is most of the work (tests/test_tracking_batch.py: the same bits)."""
    out: list = [None] * len(jobs)
    lockstep = []
    for k, (tracker, det, image) in enumerate(jobs):
        step = getattr(tracker, "_step", None)  # None: BoT-SORT, or any object with update()
        try:
            if step is None:
                out[k] = list(tracker.update(det, image))
            else:
                boxes = _boxes(det)
                lockstep.append((k, step.steps(boxes), len(boxes)))
        except Exception as exc:  # noqa: BLE001 - the caller's to report, per tracker
            out[k] = exc
    if lockstep:
        _run_lockstep(lockstep, out)
    return out


def _run_lockstep(steps: list, out: list) -> None:
    """Drive each (k, generator, number of boxes) of `steps` through its phases; what each
    phase asks for is done for all of them at once (_BATCHED), in their order."""
    from ultralytics.trackers.byte_tracker import STrack

    kf = STrack.shared_kalman  # the noise weights of every stepped tracker (Tracker.__init__)
    for phase in _PHASES:
        asked, live = [], []
        for k, gen, n in steps:
            try:
                name, payload = next(gen)
            except Exception as exc:  # noqa: BLE001 - this tracker's, not the others'
                out[k] = exc
                continue
            assert name == phase, (name, phase)
            asked.append(payload)
            live.append((k, gen, n))
        try:
            _BATCHED[phase](kf, [x for payload in asked for x in payload])
        except Exception as exc:  # noqa: BLE001 - shared by the trackers of this round
            for k, _, _ in live:
                out[k] = exc
            return
        steps = live
    for k, gen, n in steps:
        try:
            next(gen)
        except StopIteration as stop:
            ids: list[int | None] = [None] * n
            for track in stop.value:
                ids[int(track.idx)] = track.track_id
            out[k] = ids
        except Exception as exc:  # noqa: BLE001
            out[k] = exc


class _ByteTrackStep:
    """Ultralytics' BYTETracker.update (8.4: _split_detections, the three associations,
    _init_new_tracks, _remove_stale_lost, merge_track_pools) on `tracker`'s own pools, with
    fewer numpy calls per frame: one array of boxes per list of tracks (iou_distance computes
    each track's box with two property calls and a copy), new tracks without a per-box
    xywh2ltwh, and its Kalman prediction, corrections and initiations left to track_many's
    driver, which does them for all the trackers of a round at once. Each number is computed
    by the same operations, in the same order, on the same values, so states and ids are
    Ultralytics' to the bit."""

    def __init__(self, tracker) -> None:
        import lap
        from ultralytics.trackers.basetrack import BaseTrack, TrackState
        from ultralytics.trackers.byte_tracker import STrack

        self.t = tracker
        self._base_init, self._strack, self._state = BaseTrack.__init__, STrack, TrackState
        self._lapjv = lap.lapjv

    def steps(self, boxes: _Boxes):
        """One frame, as a generator for _run_lockstep: it yields ("predict", tracks),
        ("correct", [(track, box)]) and ("activate", [(track, frame_id, filter)]) for the
        driver to do (with other trackers' alike), and returns the confirmed tracks now tracked (each .idx
        the index of its box). Deferring the corrections to after the three associations
        changes nothing they read: the second takes the tracks the first left, the third
        tracks outside the pool."""
        t, args, tracked_state = self.t, self.t.args, self._state.Tracked
        t.frame_id += 1
        activated, refind, lost, removed = [], [], [], []
        scores, wh = boxes.conf, boxes.xywh[:, 2:4]
        valid = (wh[:, 0] > 0) & (wh[:, 1] > 0)  # Ultralytics' _split_detections
        high = valid & (scores >= args.track_high_thresh)
        low = valid & (scores > args.track_low_thresh) & (scores < args.track_high_thresh)
        detections, detections_second = self._new_tracks(boxes, high), self._new_tracks(boxes, low)
        unconfirmed = [x for x in t.tracked_stracks if not x.is_activated]
        confirmed = [x for x in t.tracked_stracks if x.is_activated]
        a_ids = {x.track_id for x in confirmed}
        pool = confirmed + [x for x in t.lost_stracks if x.track_id not in a_ids]  # joint_stracks
        yield "predict", pool  # t.multi_predict (_predict_xyah)
        corrections: list = []
        # First association: high boxes, IoU fused with the score.
        matches, u_track, u_detection = self._assign(self._fused(pool, detections), thresh=args.match_thresh)
        self._matched(matches, pool, detections, activated, refind, corrections)
        # Second: the tracks left, with the low boxes, IoU only.
        r_tracked = [pool[i] for i in u_track if pool[i].state == tracked_state]
        if r_tracked and detections_second:
            matches, u_track, _ = self._assign(self._iou_cost(r_tracked, detections_second), thresh=0.5)
            self._matched(matches, r_tracked, detections_second, activated, refind, corrections)
        else:
            u_track = range(len(r_tracked))
        for i in u_track:
            r_tracked[i].mark_lost()
            lost.append(r_tracked[i])
        # Tracks seen on one frame only, with the high boxes left.
        detections = [detections[i] for i in u_detection]
        if unconfirmed:
            matches, u_unconfirmed, u_detection = self._assign(self._fused(unconfirmed, detections), thresh=0.7)
            self._matched(matches, unconfirmed, detections, activated, activated, corrections)  # all Tracked
            for i in u_unconfirmed:
                unconfirmed[i].mark_removed()
                removed.append(unconfirmed[i])
        else:
            u_detection = range(len(detections))
        born = [detections[i] for i in u_detection if detections[i].score >= args.new_track_thresh]
        yield "correct", corrections
        yield "activate", [(track, t.frame_id, t.kalman_filter) for track in born]
        activated.extend(born)
        for track in t.lost_stracks:
            if t.frame_id - track.frame_id > t.max_frames_lost:
                track.mark_removed()
                removed.append(track)
        self._merge(activated, refind, lost, removed)
        return [x for x in t.tracked_stracks if x.is_activated]

    def _assign(self, cost: np.ndarray, thresh: float) -> tuple[list, Sequence[int], Sequence[int]]:
        """matching.linear_assignment with lap: (matches, unmatched rows, unmatched columns)."""
        if cost.size == 0:
            return [], range(cost.shape[0]), range(cost.shape[1])
        _, x, y = self._lapjv(cost, extend_cost=True, cost_limit=thresh)
        x, y = x.tolist(), y.tolist()
        matches = [(i, j) for i, j in enumerate(x) if j >= 0]
        return matches, [i for i, j in enumerate(x) if j < 0], [j for j, i in enumerate(y) if i < 0]

    def _new_tracks(self, boxes: _Boxes, mask: np.ndarray) -> list:
        """init_track: an STrack per box of `mask`, its _tlwh as STrack's __init__ computes it
        (xywh2ltwh in float64 from parse_bboxes' float64 rows, then float32)."""
        index = np.flatnonzero(mask)
        if not len(index):
            return []
        xywh = boxes.xywh[index].astype(np.float64)
        tlwh = xywh.copy()
        tlwh[:, 0] = xywh[:, 0] - xywh[:, 2] / 2
        tlwh[:, 1] = xywh[:, 1] - xywh[:, 3] / 2
        tlwh = tlwh.astype(np.float32)
        out = []
        next_id = self.t._ids.__next__  # ids are per tracker (Ultralytics sets it so on each new track)
        for row, score, cls, i in zip(tlwh, boxes.conf[index], boxes.cls[index], index):
            track = self._strack.__new__(self._strack)
            self._base_init(track)
            track._tlwh, track.kalman_filter, track.mean, track.covariance = row, None, None, None
            track.score, track.tracklet_len, track.cls, track.idx, track.angle = score, 0, cls, i, None
            track.next_id = next_id
            out.append(track)
        return out

    @staticmethod
    def _xyxy(tracks: list) -> np.ndarray:
        """np.ascontiguousarray([t.xyxy for t in tracks], float32), one array op per step."""
        if all(x.mean is not None for x in tracks):
            ret = np.array([x.mean[:4] for x in tracks])
            ret[:, 2] *= ret[:, 3]  # STrack.tlwh
            ret[:, :2] -= ret[:, 2:] / 2
        elif all(x.mean is None for x in tracks):
            ret = np.array([x._tlwh for x in tracks])
        else:
            return np.ascontiguousarray([x.xyxy for x in tracks], dtype=np.float32)
        ret[:, 2:] += ret[:, :2]  # STrack.xyxy
        return np.ascontiguousarray(ret, dtype=np.float32)

    def _iou_cost(self, a: list, b: list) -> np.ndarray:
        """matching.iou_distance."""
        if not (a and b):
            return 1 - np.zeros((len(a), len(b)), dtype=np.float32)
        return 1 - _iou(self._xyxy(a), self._xyxy(b))

    def _fused(self, tracks: list, detections: list) -> np.ndarray:
        """get_dists: iou_distance, then fuse_score where the settings ask for it."""
        cost = self._iou_cost(tracks, detections)
        if not self.t.args.fuse_score or cost.size == 0:
            return cost
        scores = np.array([d.score for d in detections])[None].repeat(cost.shape[0], axis=0)
        return 1 - (1 - cost) * scores

    def _matched(self, matches, pool: list, detections: list, activated: list, refind: list, corrections: list) -> None:
        """_apply_matches' bookkeeping, in match order (STrack.update for a tracked track,
        re_activate for a lost one); the Kalman corrections are queued for _correct_all."""
        frame_id, tracked = self.t.frame_id, self._state.Tracked
        for i, j in matches:
            track, det = pool[i], detections[j]
            if track.state == tracked:  # STrack.update: one more frame of this tracklet
                track.tracklet_len += 1
                activated.append(track)
            else:  # re_activate (a lost track found again, same id): a new tracklet
                track.tracklet_len = 0
                refind.append(track)
            track.state, track.is_activated, track.frame_id = tracked, True, frame_id
            track.score, track.cls, track.idx = det.score, det.cls, det.idx
            corrections.append((track, det))

    def _merge(self, activated: list, refind: list, lost: list, removed: list) -> None:
        """stracks.merge_track_pools, its remove_duplicate_stracks with _iou_cost."""
        t, tracked = self.t, self._state.Tracked
        pool = [x for x in t.tracked_stracks if x.state == tracked]
        for more in (activated, refind):  # joint_stracks
            ids = {x.track_id for x in pool}
            pool = pool + [x for x in more if x.track_id not in ids]
        ids = {x.track_id for x in pool}
        lost_pool = [x for x in t.lost_stracks if x.track_id not in ids]  # sub_stracks
        lost_pool.extend(lost)
        ids = {x.track_id for x in t.removed_stracks}
        lost_pool = [x for x in lost_pool if x.track_id not in ids]
        dupa, dupb = set(), set()  # remove_duplicate_stracks: IoU above 0.85, the younger goes
        pairs = np.where(self._iou_cost(pool, lost_pool) < 0.15) if pool and lost_pool else ((), ())
        for p, q in zip(*pairs):
            if pool[p].frame_id - pool[p].start_frame > lost_pool[q].frame_id - lost_pool[q].start_frame:
                dupb.add(q)
            else:
                dupa.add(p)
        t.tracked_stracks = [x for i, x in enumerate(pool) if i not in dupa]
        t.lost_stracks = [x for i, x in enumerate(lost_pool) if i not in dupb]
        t.removed_stracks_frame = removed
        t.removed_stracks.extend(removed)
        if len(t.removed_stracks) > 1000:
            t.removed_stracks = t.removed_stracks[-1000:]


def _predict_all(kf, tracks: list) -> None:
    _predict_xyah(tracks)


def _correct_all(kf, pairs: list) -> None:
    """KalmanFilterXYAH.update of each (track, fresh box), the same to the bit: its solve on a
    stack (np.linalg.solve runs LAPACK's gesv on each matrix of a stack as on one), its
    products with np.matmul (each matrix of a stack by the BLAS call np.dot makes for one)."""
    if not pairs:
        return
    tracks = [track for track, _ in pairs]
    xyah = np.array([det._tlwh for _, det in pairs])  # det.tlwh, then tlwh_to_xyah, in float32
    xyah[:, :2] += xyah[:, 2:] / 2
    xyah[:, 2] /= xyah[:, 3]
    mean = np.array([x.mean for x in tracks])
    cov = np.array([x.covariance for x in tracks])
    std = kf._std_weight_position * mean[:, 3]  # project(): the innovation covariance's diagonal
    noise = np.zeros((len(tracks), 4, 4))
    noise[:, 0, 0] = noise[:, 1, 1] = noise[:, 3, 3] = np.square(std)
    noise[:, 2, 2] = np.square(1e-1)
    projected_cov = cov[:, :4, :4] + noise
    gains_t = np.linalg.solve(projected_cov, cov[:, :, :4].transpose(0, 2, 1))  # kalman_gain.T each
    mean += np.matmul((xyah - mean[:, :4])[:, None, :], gains_t)[:, 0]
    # multi_dot((K, S, K.T)) multiplies as K (S K.T): its two orders cost the same here.
    cov -= np.matmul(gains_t.transpose(0, 2, 1), np.matmul(projected_cov, gains_t))
    for k, track in enumerate(tracks):
        track.mean, track.covariance = mean[k], cov[k]


def _activate_all(kf, born: list) -> None:
    """STrack.activate of each (new track, frame id, its tracker's filter), in order (so each tracker's ids in
    order), KalmanFilterXYAH.initiate done for all at once: the same products of the same
    numbers."""
    if not born:
        return
    from ultralytics.trackers.basetrack import TrackState

    tracks = [track for track, _, _ in born]
    xyah = np.array([x._tlwh for x in tracks])  # convert_coords: tlwh_to_xyah, in float32
    xyah[:, :2] += xyah[:, 2:] / 2
    xyah[:, 2] /= xyah[:, 3]
    mean = np.zeros((len(tracks), 8))
    mean[:, :4] = xyah  # initiate(): the measurement as float64, zero velocities
    h = mean[:, 3]
    std = np.empty((len(tracks), 8))
    std[:, 0] = std[:, 1] = std[:, 3] = 2 * kf._std_weight_position * h  # (2 * weight) * h, as written there
    std[:, 2] = 1e-2
    std[:, 4] = std[:, 5] = std[:, 7] = 10 * kf._std_weight_velocity * h
    std[:, 6] = 1e-5
    cov = np.zeros((len(tracks), 8, 8))
    cov.reshape(len(tracks), 64)[:, ::9] = np.square(std)
    for k, (track, frame_id, its_kf) in enumerate(born):
        track.kalman_filter, track.track_id = its_kf, track.next_id()
        track.mean, track.covariance = mean[k], cov[k]
        track.tracklet_len, track.state = 0, TrackState.Tracked
        if frame_id == 1:
            track.is_activated = True
        track.frame_id = track.start_frame = frame_id


_PHASES = ("predict", "correct", "activate")
_BATCHED = {"predict": _predict_all, "correct": _correct_all, "activate": _activate_all}


def _iou(box1: np.ndarray, box2: np.ndarray) -> np.ndarray:
    """ultralytics.utils.metrics.bbox_ioa(box1, box2, iou=True) written out, its .clip(0) as
    the np.maximum(x, 0) that ndarray.clip calls for a lower bound alone."""
    b1_x1, b1_y1, b1_x2, b1_y2 = box1.T
    b2_x1, b2_y1, b2_x2, b2_y2 = box2.T
    w = np.maximum(np.minimum(b1_x2[:, None], b2_x2) - np.maximum(b1_x1[:, None], b2_x1), 0)
    inter = w * np.maximum(np.minimum(b1_y2[:, None], b2_y2) - np.maximum(b1_y1[:, None], b2_y1), 0)
    area = (b2_x2 - b2_x1) * (b2_y2 - b2_y1)
    area = area + ((b1_x2 - b1_x1) * (b1_y2 - b1_y1))[:, None] - inter
    return inter / (area + 1e-7)


def make_tracker(kind: str, frame_rate: float = _BASE_FRAME_RATE) -> Tracker:
    return Tracker(kind, frame_rate)
