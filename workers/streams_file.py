"""The `.streams` file of `tandem streams`, read at start and again whenever it changes.

    rtsp://10.0.0.7/live  id=door  max_fps=5  tracker=bytetrack
    http://10.0.0.8/video.mjpg  policy=every_frame  queue=60
    clips/parking.mp4

A line is `SOURCE [key=value ...]` (sources/streams.py read_streams_lines; the third line above is cam2); the keys are id
and CameraService.add's options (workers/cameras.py OPTION_FIELDS), lines= and zones= parsed here
(runtime/vision/analytics.py), webhook= too (workers/camera_push.py), plus analytics=FILE: a
JSON file of lines and zones, relative to this file's folder, watched with it (an edit reloads the camera). A line without id= is
camN, N its place among the camera lines; on a reload a camera whose source is unchanged keeps
the id it had, so moving a line does not rename its camera (and its Redis stream).

StreamsFile.reload() reads the file again and applies the difference to the service: cameras
gone are removed, new ones added, and one whose source or options changed is removed and added
again. A file that no longer parses changes nothing: the error is logged, naming the line, and
the cameras go on as they were. run_streams calls it when the file's mtime, size or inode
changes (StreamsFile.poll, every --reload-interval s) and at SIGHUP (run_streams).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from sources.base import SourceError
from sources.streams import read_streams_lines

log = logging.getLogger("tandem.cameras")

FLOAT_OPTIONS = ("max_fps", "max_staleness_ms", "motion_threshold", "clip_pre_s", "clip_post_s", "webhook_cooldown_s")
INT_OPTIONS = ("queue",)
TEXT_OPTIONS = ("policy", "tracker", "clips")  # clips=on|off: CameraOptions checks it
SHAPE_OPTIONS = ("lines", "zones")  # parsed here, so a bad one refuses the file naming its line
PUSH_OPTIONS = ("webhook",)  # "[TYPE,...=]URL" (workers/camera_push.py), parsed here likewise
KEYS = ("id", *FLOAT_OPTIONS, *INT_OPTIONS, *TEXT_OPTIONS, *SHAPE_OPTIONS, *PUSH_OPTIONS, "analytics")


@dataclass(slots=True)
class CameraLine:
    camera_id: str
    url: str
    options: dict  # CameraService.add's keyword options (max_fps, policy, ...), typed
    lineno: int
    analytics_path: str | None = None  # its analytics= file, watched like the .streams file

    def setup(self) -> tuple:
        return self.url, sorted(self.options.items())  # not the line number: a moved line is the same camera


def _file_stamp(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _typed(path: str, lineno: int, key: str, text: str) -> object:
    """An option's value as add() takes it; its range is add()'s to check (CameraError)."""
    try:
        if key in FLOAT_OPTIONS:
            return float(text)
        if key in INT_OPTIONS:
            return int(text)
    except ValueError:
        kind = "a number" if key in FLOAT_OPTIONS else "an integer"
        raise SourceError(f"{path} line {lineno}: {key} must be {kind}, got {text!r}") from None
    if key in SHAPE_OPTIONS:
        from runtime.vision.analytics import parse_lines, parse_zones

        try:
            return (parse_lines if key == "lines" else parse_zones)(text)
        except ValueError as exc:  # names the option
            raise SourceError(f"{path} line {lineno}: {exc}") from None
    if key in PUSH_OPTIONS:
        from workers.camera_push import parse_webhooks

        try:
            return parse_webhooks(text, key)
        except ValueError as exc:  # names the option
            raise SourceError(f"{path} line {lineno}: {exc}") from None
    return text


def analytics_path(path: str, text: str) -> str:
    """An analytics= file, relative to the `.streams` file's folder."""
    return text if os.path.isabs(text) else os.path.join(os.path.dirname(os.path.abspath(path)), text)


def _with_analytics(path: str, lineno: int, options: dict, file: str) -> dict:
    """`options` with the lines and zones of an analytics= JSON file (runtime/vision/analytics.py
    read_analytics_file) before those of lines= and zones=."""
    from runtime.vision.analytics import parse_lines, parse_zones, read_analytics_file

    try:
        shapes = read_analytics_file(file)
        merged = {
            "lines": parse_lines([*shapes["lines"], *options.get("lines", ())]),
            "zones": parse_zones([*shapes["zones"], *options.get("zones", ())]),
        }
    except ValueError as exc:
        raise SourceError(f"{path} line {lineno}: {exc}") from None
    return {**options, **{k: v for k, v in merged.items() if v}}


def parse(path: str, previous: dict[str, str] | None = None) -> list[CameraLine]:
    """The cameras of a `.streams` file, ids assigned. `previous`: source -> id of the cameras
    the file runs now (a reload), so an unchanged source keeps its id. SourceError names the line."""
    from workers.cameras import CameraError, check_camera_id

    lines = read_streams_lines(path)
    explicit: dict[str, int] = {}
    for e in lines:
        unknown = sorted(set(e.options) - set(KEYS))
        if unknown:
            raise SourceError(f"{path} line {e.lineno}: unknown option {unknown[0]!r}; the keys are {', '.join(KEYS)}")
        if "id" in e.options:
            camera_id = e.options["id"]
            try:
                check_camera_id(camera_id)
            except CameraError as exc:
                raise SourceError(f"{path} line {e.lineno}: id: {exc}") from None
            if camera_id in explicit:
                raise SourceError(f"{path} line {e.lineno}: id {camera_id} is used by line {explicit[camera_id]}")
            explicit[camera_id] = e.lineno
    taken = set(explicit)
    kept = {}  # line index -> the id its unchanged source had
    for i, e in enumerate(lines):
        old = (previous or {}).get(e.source)
        if "id" not in e.options and old is not None and old not in taken:
            kept[i] = old
            taken.add(old)
    out = []
    for i, e in enumerate(lines):
        camera_id = e.options.get("id") or kept.get(i)
        if camera_id is None:
            camera_id, n = f"cam{i}", len(lines)
            while camera_id in taken:  # an explicit or a kept id holds this line's default
                camera_id, n = f"cam{n}", n + 1
            taken.add(camera_id)
        options = {k: _typed(path, e.lineno, k, v) for k, v in e.options.items() if k not in ("id", "analytics")}
        file = None
        if "analytics" in e.options:
            file = analytics_path(path, e.options["analytics"])
            options = _with_analytics(path, e.lineno, options, file)
        out.append(CameraLine(camera_id, e.source, options, e.lineno, file))
    return out


class StreamsFile:
    """A `.streams` file and the cameras it put on a CameraService (cameras added over HTTP or
    Redis are not the file's: a reload leaves them alone)."""

    def __init__(self, path: str, service, max_cameras: int | None = None) -> None:
        self.path, self.service, self.max_cameras = path, service, max_cameras
        self.cameras: dict[str, CameraLine] = {}
        self.stamp: tuple | None = None
        self._lock = threading.Lock()

    def _stamp(self) -> tuple:
        """The file's, and its cameras' analytics= files': an edited zone reloads its camera."""
        files = [self.path, *sorted({c.analytics_path for c in self.cameras.values() if c.analytics_path})]
        return tuple(_file_stamp(f) for f in files)

    def load(self) -> None:
        """Start the file's cameras; SourceError or CameraError (a ValueError) to the caller,
        which is a usage error at start-up."""
        with self._lock:
            self.stamp = stamp = self._stamp()
            for cam in self._parse():
                self.service.add(cam.camera_id, cam.url, **cam.options, allow_local=True)
                self.cameras[cam.camera_id] = cam
            self.stamp = stamp[:1] + self._stamp()[1:]  # the analytics= files are known now

    def _parse(self) -> list[CameraLine]:
        cams = parse(self.path, {c.url: c.camera_id for c in self.cameras.values()})
        if self.max_cameras is not None and len(cams) > self.max_cameras:
            raise SourceError(f"{self.path} lists {len(cams)} cameras, more than --max-cameras {self.max_cameras}")
        return cams

    def poll(self) -> dict | None:
        """reload() if the file's mtime, size or inode changed since it was read; else None."""
        if self._stamp() == self.stamp:
            return None
        return self.reload()

    def reload(self) -> dict:
        """Read the file again and apply the difference: {"added", "removed", "changed": [ids],
        "error": None or why (each line's or camera's message)}. A file that does not parse
        changes nothing."""
        with self._lock:
            self.stamp = stamp = self._stamp()
            try:
                wanted = {c.camera_id: c for c in self._parse()}
            except SourceError as exc:
                log.error("reload of %s refused, cameras unchanged: %s", self.path, exc)
                return {"added": [], "removed": [], "changed": [], "error": str(exc)}
            removed = [i for i in self.cameras if i not in wanted]
            changed = [i for i, c in wanted.items() if i in self.cameras and self.cameras[i].setup() != c.setup()]
            added = [i for i in wanted if i not in self.cameras]
            for camera_id in removed + changed:
                self._remove(camera_id)
            errors = []
            for camera_id in changed + added:
                cam = wanted[camera_id]
                try:
                    self.service.add(camera_id, cam.url, **cam.options, allow_local=True)
                    self.cameras[camera_id] = cam
                except (ValueError, RuntimeError) as exc:  # CameraError names the field
                    errors.append(f"{self.path} line {cam.lineno}: camera {camera_id}: {exc}")
            for camera_id in self.cameras:  # a moved line: its new number, for later messages
                self.cameras[camera_id].lineno = wanted[camera_id].lineno
                self.cameras[camera_id].analytics_path = wanted[camera_id].analytics_path
            self.stamp = stamp[:1] + self._stamp()[1:]
            for e in errors:
                log.error("reload of %s: %s", self.path, e)
            log.info(
                "reloaded %s: added %s, removed %s, changed %s",
                self.path,
                ", ".join(added) or "none",
                ", ".join(removed) or "none",
                ", ".join(changed) or "none",
            )
            return {"added": added, "removed": removed, "changed": changed, "error": "; ".join(errors) or None}

    def _remove(self, camera_id: str) -> None:
        from workers.cameras import CameraNotFound

        self.cameras.pop(camera_id, None)
        try:
            self.service.remove(camera_id)
        except CameraNotFound:  # removed over HTTP meanwhile
            pass
