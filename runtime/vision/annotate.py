"""Drawing detections and writing annotated images and videos for `tandem detect --save`; drawing a
camera's lines and zones (runtime/vision/analytics.py) over its live view (workers/cameras_views.py)."""

from __future__ import annotations

import math
import os

import cv2
import numpy as np

from runtime.vision.postprocess import Detections
from sources.base import VIDEO_EXTENSIONS, Frame, extension


def _color(cls: int) -> tuple[int, int, int]:
    # A fixed pseudo-random colour per class, so a class keeps its colour across frames.
    h = (cls * 2654435761) & 0xFFFFFF
    return (h & 255, (h >> 8) & 255, (h >> 16) & 255)


def draw(image: np.ndarray, det: Detections) -> np.ndarray:
    out = image.copy()
    thickness = max(1, round(sum(out.shape[:2]) / 600))
    for (x1, y1, x2, y2), conf, cls, name in zip(det.boxes, det.conf, det.cls, det.names):
        color = _color(int(cls))
        p1, p2 = (int(x1), int(y1)), (int(x2), int(y2))
        cv2.rectangle(out, p1, p2, color, thickness, cv2.LINE_AA)
        label = f"{name} {conf:.2f}"
        (tw, th), _ = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, thickness / 3, max(1, thickness - 1))
        top = p1[1] - th - 3 if p1[1] - th - 3 >= 0 else p1[1] + th + 3
        cv2.rectangle(out, (p1[0], top), (p1[0] + tw, p1[1]), color, -1, cv2.LINE_AA)
        cv2.putText(
            out,
            label,
            (p1[0], p1[1] - 2 if top < p1[1] else top),
            cv2.FONT_HERSHEY_SIMPLEX,
            thickness / 3,
            (255, 255, 255),
            max(1, thickness - 1),
            cv2.LINE_AA,
        )
    return out


LINE_COLOR = (0, 215, 255)  # amber (BGR): far from the class colours' usual greys and the scenes'
ZONE_COLOR = (255, 128, 0)  # blue
ZONE_ALPHA = 0.25  # the fill: the objects inside stay visible


def draw_analytics(out: np.ndarray, lines=(), zones=(), counts: dict | None = None) -> np.ndarray:
    """Draw lines and zones (LineSpec, ZoneSpec: fractions of the image) on `out`, in place, with
    their running counts (CameraAnalytics.counts; None: names only). A line gets an arrow to
    its "in" side; a zone a translucent fill, its outline and its occupancy."""
    h, w = out.shape[:2]
    t = max(1, round(sum(out.shape[:2]) / 600))
    counts = counts or {}
    for zone in zones:
        pts = _pixels(zone.points, w, h)
        x0, y0 = pts.min(axis=0)
        x1, y1 = pts.max(axis=0) + 1
        roi = out[y0:y1, x0:x1]  # blend the polygon's box only: the rest of the frame is not copied
        fill = roi.copy()
        cv2.fillPoly(fill, [pts - (x0, y0)], ZONE_COLOR, cv2.LINE_AA)
        out[y0:y1, x0:x1] = cv2.addWeighted(fill, ZONE_ALPHA, roi, 1 - ZONE_ALPHA, 0)
        cv2.polylines(out, [pts], True, ZONE_COLOR, t + 1, cv2.LINE_AA)
        n = counts.get("zones", {}).get(zone.name)
        top = tuple(int(v) for v in pts[pts[:, 1].argmin()])
        _label(out, zone.name if n is None else f"{zone.name}: {n['occupancy']} in zone", top, ZONE_COLOR, t)
    for line in lines:
        a, b = (tuple(int(v) for v in p) for p in _pixels((line.a, line.b), w, h))
        cv2.line(out, a, b, LINE_COLOR, t + 1, cv2.LINE_AA)
        # "in" is the side on the right walking from a to b (analytics.side_of); x and y scale by
        # positive factors, so the pixels' normal points to the same side.
        dx, dy = b[0] - a[0], b[1] - a[1]
        norm = math.hypot(dx, dy) or 1.0
        size = max(12.0, 0.06 * min(w, h))
        mid = ((a[0] + b[0]) // 2, (a[1] + b[1]) // 2)
        tip = (round(mid[0] - dy / norm * size), round(mid[1] + dx / norm * size))
        cv2.arrowedLine(out, mid, tip, LINE_COLOR, t, cv2.LINE_AA, tipLength=0.35)
        past = size + 16 * t  # the label just past the tip, clear of the arrow whichever way it points
        _label(out, "in", (round(mid[0] - dy / norm * past), round(mid[1] + dx / norm * past)), LINE_COLOR, t)
        n = counts.get("lines", {}).get(line.name)
        _label(out, line.name if n is None else f"{line.name}: in {n['in']} out {n['out']}", a, LINE_COLOR, t)
    return out


def _pixels(points, w: int, h: int) -> np.ndarray:
    xy = np.asarray(points, dtype=np.float64) * (w, h)
    return np.clip(np.round(xy), 0, (w - 1, h - 1)).astype(np.int32)


def _label(out: np.ndarray, text: str, at: tuple[int, int], color, t: int) -> None:
    """`text` on a dark box just above `at` (below it at the image's top edge), kept inside the
    image: the box never covers the line or edge it names."""
    scale, weight = t / 3, max(1, t - 1)
    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, scale, weight)
    h, w = out.shape[:2]
    x = min(max(2, at[0] + 3), max(2, w - tw - 4))
    y = at[1] - base - 3 - t if at[1] - base - th - 5 - t >= 0 else at[1] + th + 5 + t
    y = min(y, h - base - 1)
    cv2.rectangle(out, (x - 2, y - th - 2), (x + tw + 2, y + base), (0, 0, 0), -1)
    cv2.putText(out, text, (x, y), cv2.FONT_HERSHEY_SIMPLEX, scale, color, weight, cv2.LINE_AA)


def numbered_dir(directory: str) -> str:
    """`directory` if it is missing or empty, else the first of directory2, directory3, ...
    that is: a second run never overwrites the first one's files (Ultralytics numbers its
    run folders the same way)."""
    path = directory.rstrip("/\\") or directory
    n = 1
    candidate = path
    while os.path.exists(candidate) and (not os.path.isdir(candidate) or os.listdir(candidate)):
        n += 1
        candidate = f"{path}{n}"
    return candidate


def video_fps(path: str) -> float | None:
    """The frame rate a video file's container declares, or None where it declares none
    (OpenCV reports 0, or a NaN for some streams)."""
    cap = cv2.VideoCapture(path)
    try:
        fps = cap.get(cv2.CAP_PROP_FPS) if cap.isOpened() else 0.0
    finally:
        cap.release()
    return float(fps) if fps and fps == fps and 0 < fps < 1000 else None


class AnnotatedWriter:
    """Images go to DIR/<name>; frames of a video or stream go to DIR/<name>.mp4, one writer
    per source, opened on its first frame and closed by close().

    A video's annotated copy plays at the source's speed: its fps is the file's own, divided by
    `vid_stride` (every n-th frame was kept). Streams declare no rate we can read without a
    second connection, so theirs is `fps`."""

    def __init__(self, directory: str, fps: float = 15.0, vid_stride: int = 1) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.fps = fps
        self.vid_stride = vid_stride
        self._videos: dict[str, cv2.VideoWriter] = {}
        self._names: dict[tuple[str, int | None], str] = {}  # (source, stream) -> its file name
        self.written: list[str] = []

    def _name(self, frame: Frame) -> tuple[str, bool]:
        if frame.stream is not None:
            return f"stream{frame.stream}.mp4", True
        base = os.path.basename(frame.source.rstrip("/")) or "frame"
        if frame.source.startswith("array:"):
            return f"array_{frame.source.split(':', 1)[1]}.jpg", False
        if extension(frame.source) in VIDEO_EXTENSIONS:
            return os.path.splitext(base)[0] + ".mp4", True
        return base if "." in base else base + ".jpg", False

    def _unique_name(self, frame: Frame) -> tuple[str, bool]:
        """The file name for frame's source, made unique in this run: two inputs called
        bus.jpg from different folders give bus.jpg and bus_2.jpg, not one overwritten file."""
        name, is_video = self._name(frame)
        key = (frame.source, frame.stream)
        known = self._names.get(key)
        if known is not None:
            return known, is_video
        taken = set(self._names.values())
        stem, ext = os.path.splitext(name)
        n = 1
        while name in taken:
            n += 1
            name = f"{stem}_{n}{ext}"
        self._names[key] = name
        return name, is_video

    def write(self, frame: Frame, det: Detections) -> None:
        if frame.image is None:
            return
        image = draw(frame.image, det)
        name, is_video = self._unique_name(frame)
        path = os.path.join(self.directory, name)
        if not is_video:
            cv2.imwrite(path, image)
            self.written.append(path)
            return
        writer = self._videos.get(path)
        if writer is None:
            h, w = image.shape[:2]
            source_fps = video_fps(frame.source) if frame.stream is None else None
            fps = source_fps / self.vid_stride if source_fps else self.fps
            writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
            self._videos[path] = writer
            self.written.append(path)
        writer.write(image)

    def close(self) -> None:
        for writer in self._videos.values():
            writer.release()
        self._videos.clear()
