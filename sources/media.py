"""Decoding single images and video files into BGR uint8 arrays, with errors that say why.

Decoding never raises for a bad file: it returns an error string, so one corrupt image in
a directory of thousands costs one error entry, not the run.
"""

from __future__ import annotations

import os
from typing import Iterator

import cv2
import numpy as np

from sources.base import Frame


def read_image(path: str) -> tuple[np.ndarray | None, str | None]:
    """(image, None) or (None, error). np.fromfile + imdecode also reads non-ASCII paths,
    which cv2.imread cannot on every platform."""
    if not os.path.isfile(path):
        return None, f"file not found: {path}"
    try:
        data = np.fromfile(path, dtype=np.uint8)
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"
    if data.size == 0:
        return None, f"cannot decode image {path}: the file is empty"
    image = cv2.imdecode(data, cv2.IMREAD_COLOR)  # always 3-channel uint8, as the models expect
    if image is None:
        return None, f"cannot decode image {path}: not an image, or a corrupt one ({data.size} bytes)"
    return image, None


def to_bgr(value: object, name: str) -> np.ndarray:
    """An in-memory input as a BGR uint8 H x W x 3 array; ValueError names what is wrong.

    numpy arrays are taken as BGR (OpenCV's and Ultralytics' convention); PIL images are RGB
    and are converted, as Ultralytics does.
    """
    if isinstance(value, np.ndarray):
        image = value
    elif type(value).__module__.startswith("PIL."):
        pil = value.convert("RGB") if value.mode != "RGB" else value
        image = np.asarray(pil)[:, :, ::-1]
    else:
        raise ValueError(f"{name}: expected a numpy array, a PIL image or a path, got {type(value).__name__}")
    if image.ndim == 2:
        image = cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    if image.ndim != 3 or image.shape[2] not in (3, 4):
        raise ValueError(f"{name}: expected an H x W x 3 (BGR) array, got shape {tuple(image.shape)}")
    if image.shape[0] < 1 or image.shape[1] < 1:
        raise ValueError(f"{name}: the image is empty, shape {tuple(image.shape)}")
    if image.dtype != np.uint8:
        raise ValueError(f"{name}: expected dtype uint8 (0..255), got {image.dtype}")
    if image.shape[2] == 4:
        image = cv2.cvtColor(image, cv2.COLOR_BGRA2BGR)
    return np.ascontiguousarray(image)


def count_video_frames(path: str, vid_stride: int) -> int | None:
    cap = cv2.VideoCapture(path)
    try:
        n = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) if cap.isOpened() else 0
    finally:
        cap.release()
    return (n + vid_stride - 1) // vid_stride if n > 0 else None


def iter_video(path: str, vid_stride: int = 1) -> Iterator[Frame]:
    """Every `vid_stride`-th frame of a video file (frames 0, s, 2s, ...).

    Skipped frames are only grabbed, not decoded, which is most of a decode's cost. A video
    that cannot be opened yields one error frame; one that breaks midway yields what it read.
    """
    if not os.path.isfile(path):
        yield Frame(path, error=f"file not found: {path}")
        return
    cap = cv2.VideoCapture(path)
    try:
        if not cap.isOpened():
            yield Frame(path, error=f"cannot open video {path}: not a video, or a corrupt one")
            return
        index, produced = 0, 0
        while True:
            if index % vid_stride == 0:
                ok, image = cap.read()
                if not ok:
                    break
                produced += 1
                yield Frame(path, index=index, image=image)
            elif not cap.grab():
                break
            index += 1
        if produced == 0:
            yield Frame(path, error=f"cannot decode video {path}: no frame could be read")
    finally:
        cap.release()
