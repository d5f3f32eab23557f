"""Motion gating, Frigate's lever: run the detector only on frames that changed.

    gate = MotionGate(0.01)          # 1% of the (downscaled) picture must change
    if gate.changed(frame):          # True: detect it (it becomes the reference)
        ...                          # False: re-publish the last detections

The comparison is against the last frame the gate let through (the last *detected* one),
not the previous frame: a slow pan or a person walking in at a few pixels per frame adds up
until it passes the threshold, where frame-to-frame differencing would never see it.

Cost: a 64-pixel-wide grayscale copy, a blur and an absolute difference, about 0.1 ms for a
1080p frame on one core (the resize reads the frame once, INTER_AREA); a detector forward at
320 costs ~25 ms on the same core, so a still scene saves nearly all of it.
"""

from __future__ import annotations

import cv2
import numpy as np

WIDTH = 64  # the downscaled width; noise and JPEG artefacts average out at this size
PIXEL_DELTA = 12  # grey levels a downscaled pixel must move by to count as changed


def check_threshold(threshold: object, name: str = "motion_threshold") -> float:
    """A fraction of the picture in (0, 1]; ValueError naming `name` otherwise."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ValueError(
            f"{name} must be a number in (0, 1], the fraction of the picture that must change "
            f"for a frame to be detected (unset: no gate), got {threshold!r}"
        )
    return float(threshold)


class MotionGate:
    """`changed(image)`: does `image` differ from the last frame let through by more than
    `threshold`, the fraction of downscaled pixels whose grey level moved by > PIXEL_DELTA?
    The first frame, and a frame of another size, always pass. One gate per camera; not
    thread-safe (a camera's frames come one at a time)."""

    def __init__(self, threshold: float) -> None:
        self.threshold = check_threshold(threshold, "threshold")
        self._reference: np.ndarray | None = None
        self._shape: tuple[int, ...] | None = None
        self.num_changed = 0
        self.num_unchanged = 0

    def _small(self, image: np.ndarray) -> np.ndarray:
        h, w = image.shape[:2]
        size = (WIDTH, max(1, round(h * WIDTH / max(w, 1))))
        grey = image if image.ndim == 2 else cv2.cvtColor(image, cv2.COLOR_BGR2GRAY)
        return cv2.GaussianBlur(cv2.resize(grey, size, interpolation=cv2.INTER_AREA), (3, 3), 0)

    def changed(self, image: np.ndarray) -> bool:
        small = self._small(image)
        if self._reference is None or image.shape != self._shape:
            passed = True
        else:
            moved = cv2.absdiff(small, self._reference) > PIXEL_DELTA
            passed = float(np.count_nonzero(moved)) / moved.size > self.threshold
        if passed:
            self._reference, self._shape = small, image.shape
            self.num_changed += 1
        else:
            self.num_unchanged += 1
        return passed
