"""Event clips with pre-roll for `tandem streams` (issue 32; DeepStream's Smart Record,
Frigate's event clips): the seconds before and after a line crossing or a zone entry, as an MP4.

    reader thread ──add()──> ClipRing (per camera: the last pre_s + RING_SLACK_S seconds of
                                       JPEGs, bounded by bytes too)
    publisher ──trigger()──> ClipWriter's bounded queue of clips to start (full: dropped, counted)
    ClipWriter thread        the pre-roll the trigger took from the ring, then the ring's newer
                             frames until post_s after the last event, into the MP4 as they are

The ring keeps the JPEGs the camera sent (MJPEG parts, as they came off the socket), not
decoded frames: a 640x480 frame is 900 KB decoded and 30-60 KB as JPEG. A source that gives
decoded frames only (RTSP, files, webcams through FFmpeg) is encoded at CLIP_JPEG_QUALITY on
its reader's thread. Nothing here runs on the detection path: the publisher's trigger takes a
lock and copies a list of references; the disk is the writer thread's.

The MP4 holds those JPEGs as they are (MJPEG in MP4, FFmpeg's stream copy through OpenCV's
raw-video mode), as DeepStream's Smart Record and Frigate keep a camera's own stream: no decode
and no encode, 0.02 ms of CPU a frame where decoding and encoding mp4v cost 0.7 ms (320x240;
at 24 cameras recording, 0.1 of this 2-core machine's cores, taken from the detector). The
price is disk: about 5 times mp4v's bytes. A frame whose size differs from the clip's (the
camera changed its resolution) is decoded, resized and encoded again; an OpenCV without the
raw mode decodes and encodes every frame as mp4v. The writer thread runs at a lower CPU
priority (Linux: BACKGROUND_NICE) so that what it still costs waits for the detector.

An event within a clip's post window extends that clip (its path goes into the event too), so
a busy door gives one long clip, not one per person (up to MAX_CLIP_S, then a new one starts).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

log = logging.getLogger("tandem.cameras")

CLIP_JPEG_QUALITY = 80  # frames a source gave decoded only: about 1/15 of their decoded size
# The ring holds this much past pre_s, so the writer can fall this far behind the camera
# before post-event frames leave the ring unwritten (counted as frames_missed).
RING_SLACK_S = 2.0
FINISH_GRACE_S = 1.0  # a camera that sends nothing this long after a clip's end: the clip ends
MAX_CLIP_S = 300.0  # events keep extending a clip up to this length; the next event starts a new one
MAX_PENDING = 8  # clips triggered and not yet taken up by the writer; more are dropped, counted
POLL_S = 0.05  # how often the writer looks for new frames of the clips it records
PRUNE_EVERY_S = 30.0
# The writer thread's niceness above the process's (Linux, per thread): it runs when the
# detector leaves a core, and the ring's RING_SLACK_S lets it catch up afterwards.
BACKGROUND_NICE = 10
COPY_JPEGS = True  # False: every frame decoded and encoded as mp4v (what an older OpenCV does)
TRIGGERS = ("line_cross", "zone_enter")  # the events that start (or extend) a clip
# <camera>-<event id>.mp4, the event id as Frigate's: the event's Unix time and 6 random characters.
CLIP_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}-\d+\.\d{6}-[a-z0-9]{6}\.mp4")


@dataclass(slots=True)
class ClipConfig:
    """Where clips go and how much of the disk and memory they may take; checked without I/O.

    `max_bytes`: all clips in `clips_dir` together (oldest pruned first; None: no bound).
    `max_age_s`: clips older than this are pruned (None: kept). `buffer_bytes`: each camera's
    ring of recent JPEGs (its time bound is the camera's clip_pre_s + RING_SLACK_S)."""

    clips_dir: str
    max_bytes: int | None = 10 * 2**30
    max_age_s: float | None = 7 * 86400.0
    buffer_bytes: int = 32 * 2**20

    def __post_init__(self) -> None:
        if not isinstance(self.clips_dir, str) or not self.clips_dir.strip():
            raise ValueError(f"clips_dir must be a directory path, got {self.clips_dir!r}")
        b = self.max_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 2**20):
            raise ValueError(f"clips_max_bytes must be an integer >= 1048576 (1 MiB; unset: no bound), got {b!r}")
        a = self.max_age_s
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0):
            raise ValueError(f"clips_max_age_s must be a number > 0 seconds (unset: kept), got {a!r}")
        n = self.buffer_bytes
        if isinstance(n, bool) or not isinstance(n, int) or not 2**16 <= n <= 2**32:
            raise ValueError(f"clips_buffer_bytes must be an integer in [65536, 4294967296] per camera, got {n!r}")


class Entry(NamedTuple):
    seq: int  # the ring's count of frames added: a gap between two a clip wrote is frames it missed
    t: float  # the frame's Frame.timestamp (time.monotonic() when read), as the records' frames
    jpeg: bytes


class ClipRing:
    """A camera's last `seconds` of JPEGs, at most `max_bytes` of them (a frame larger than that
    alone is not kept). Its reader's thread adds; the publisher and the writer read."""

    def __init__(self, seconds: float, max_bytes: int) -> None:
        self.seconds, self.max_bytes = seconds, max_bytes
        self._lock = threading.Lock()
        self._entries: deque[Entry] = deque()
        self._seq = 0
        self.nbytes = 0
        self.skipped = 0  # frames not kept: over max_bytes alone, or not encodable

    def add(self, frame, encoded: bytes | None) -> None:
        """(the reader's tap) One frame just read: its JPEG as the camera sent it, or None
        (a decoded-only source: encoded here, on the reader's thread)."""
        if encoded is None:
            encoded = _encode(frame.image)
        with self._lock:
            if encoded is None or len(encoded) > self.max_bytes:
                self.skipped += 1
                return
            self._seq += 1
            e = self._entries
            e.append(Entry(self._seq, frame.timestamp, encoded))
            self.nbytes += len(encoded)
            while e and (self.nbytes > self.max_bytes or frame.timestamp - e[0].t > self.seconds):
                self.nbytes -= len(e.popleft().jpeg)

    def since(self, t: float) -> list[Entry]:
        """The frames read at or after `t` (monotonic), oldest first."""
        with self._lock:
            out = []
            for entry in reversed(self._entries):
                if entry.t < t:
                    break
                out.append(entry)
        out.reverse()
        return out

    def after(self, seq: int) -> list[Entry]:
        """The frames added after the one numbered `seq`, oldest first."""
        with self._lock:
            if not self._entries or self._entries[-1].seq <= seq:
                return []
            first = max(0, len(self._entries) - (self._entries[-1].seq - seq))
            return [self._entries[i] for i in range(first, len(self._entries))]

    def fps(self) -> float | None:
        """Frames per second over what the ring holds (None: too few to tell)."""
        with self._lock:
            if len(self._entries) < 2:
                return None
            span = self._entries[-1].t - self._entries[0].t
            return (len(self._entries) - 1) / span if span > 0 else None

    def stats(self) -> tuple[int, int, float]:
        """(bytes, frames, seconds) held now."""
        with self._lock:
            e = self._entries
            return self.nbytes, len(e), (e[-1].t - e[0].t) if e else 0.0


@dataclass(slots=True, eq=False)
class Clip:
    """One MP4 being recorded: frames read in [start_t, end_t] (monotonic); end_t moves on with
    each event inside it (under the writer's cond)."""

    camera: CameraClips
    path: str
    start_t: float
    end_t: float
    pending: list  # the pre-roll, taken from the ring when the clip was triggered
    last_seq: int = 0
    frames: int = 0
    fps: float = 10.0
    video: object = None  # cv2.VideoWriter, opened at the first frame (its size)
    size: tuple = ()  # (width, height)
    raw: bool = False  # the writer takes the JPEGs as they are (else decoded frames, encoded mp4v)
    failed: bool = False


@dataclass(slots=True, eq=False)
class CameraClips:
    """A camera's part: its ring, its clip options, the clip it records now (the writer's cond
    guards it) and what became of its clips."""

    camera_id: str
    pre_s: float
    post_s: float
    ring: ClipRing
    writer: ClipWriter
    active: Clip | None = None
    written: int = 0
    dropped: int = 0  # triggered while the writer's queue was full
    failed: int = 0  # the disk or the encoder refused
    frames_missed: int = 0  # left the ring before the writer reached them
    last_clip: str | None = None

    def on_events(self, events: list[dict], t: float) -> None:
        """(the publisher) Each line crossing and zone entry of a frame read at `t` gets its
        clip's path, "clip" (None: dropped); the first one starts the clip, the rest extend it."""
        for event in events:
            if event.get("type") in TRIGGERS:
                event["clip"] = self.writer.trigger(self, t, float(event.get("at") or time.time()))

    def stats(self) -> dict:
        nbytes, frames, seconds = self.ring.stats()
        return {
            "buffer_bytes": nbytes,
            "buffer_frames": frames,
            "buffer_seconds": round(seconds, 3),
            "buffer_max_bytes": self.ring.max_bytes,
            "pre_s": self.pre_s,
            "post_s": self.post_s,
            "written": self.written,
            "dropped": self.dropped,
            "failed": self.failed,
            "frames_missed": self.frames_missed,
            "last_clip": self.last_clip,
        }


class ClipWriter:
    """The service's clips: one thread writes them to `config.clips_dir` and prunes it."""

    def __init__(self, config: ClipConfig) -> None:
        self.config = config
        self.clips_dir = os.path.abspath(config.clips_dir)
        os.makedirs(self.clips_dir, exist_ok=True)
        self._cond = threading.Condition()
        self._pending: deque[Clip] = deque()
        self._closing = False
        self._active: list[Clip] = []  # the writer thread's

    def camera(self, camera_id: str, pre_s: float, post_s: float) -> CameraClips:
        ring = ClipRing(pre_s + RING_SLACK_S, self.config.buffer_bytes)
        return CameraClips(camera_id, pre_s, post_s, ring, self)

    def trigger(self, cam: CameraClips, t: float, at: float) -> str | None:
        """An event in a frame read at `t` (monotonic; `at`: its Unix time): the path of the clip
        it is in, which it extends or starts, or None when the writer's queue is full. Never
        waits on the writer."""
        with self._cond:
            clip = cam.active
            if clip is not None and t <= clip.end_t and t - clip.start_t < MAX_CLIP_S:
                clip.end_t = max(clip.end_t, t + cam.post_s)
                return clip.path
            if self._closing or len(self._pending) >= MAX_PENDING:
                cam.dropped += 1
                return None
            name = f"{cam.camera_id}-{at:.6f}-{_random_id()}.mp4"
            start = t - cam.pre_s
            clip = Clip(cam, os.path.join(self.clips_dir, name), start, t + cam.post_s, cam.ring.since(start))
            clip.fps = cam.ring.fps() or clip.fps
            cam.active = clip
            self._pending.append(clip)
            self._cond.notify_all()
        return clip.path

    def close(self) -> None:
        """run() ends after closing the clips it records with the frames it has."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def run(self) -> None:
        """The writer thread, until close()."""
        _background_priority()
        next_prune = time.monotonic()
        while True:
            with self._cond:
                if not self._pending and not self._closing:
                    self._cond.wait(POLL_S if self._active else max(0.0, next_prune - time.monotonic()))
                self._active.extend(self._pending)
                self._pending.clear()
                closing = self._closing
            for clip in list(self._active):
                if self._advance(clip, closing):
                    self._active.remove(clip)
                    self._finish(clip)
                    next_prune = time.monotonic()
            if time.monotonic() >= next_prune:
                self.prune()
                next_prune = time.monotonic() + PRUNE_EVERY_S
            if closing and not self._active:
                return

    def prune(self) -> list[str]:
        keep = {c.path for c in self._active}
        return prune_clips(self.clips_dir, self.config.max_bytes, self.config.max_age_s, keep)

    # ---- the writer thread's ----------------------------------------------------------------

    def _advance(self, clip: Clip, closing: bool) -> bool:
        """Write the frames of `clip` that came since the last look; whether it is done."""
        entries, clip.pending = clip.pending or clip.camera.ring.after(clip.last_seq), []
        with self._cond:
            end_t = clip.end_t
        past_end = False
        for entry in entries:
            if entry.t < clip.start_t:
                clip.last_seq = entry.seq
                continue
            if entry.t > end_t:
                past_end = True
                break
            if clip.last_seq and entry.seq > clip.last_seq + 1:
                clip.camera.frames_missed += entry.seq - clip.last_seq - 1
            clip.last_seq = entry.seq
            if not self._write(clip, entry):
                break
        with self._cond:  # done, and no event may extend it any more: the next one starts a clip
            done = closing or clip.failed or (past_end and clip.end_t == end_t)
            done = done or time.monotonic() > clip.end_t + FINISH_GRACE_S
            if done and clip.camera.active is clip:
                clip.camera.active = None
        return done

    def _write(self, clip: Clip, entry: Entry) -> bool:
        """One frame into the clip's MP4 (opened at its first frame); False if that failed: the
        clip ends there, counted as failed, and the service goes on."""
        import cv2
        import numpy as np

        try:
            size, image = jpeg_size(entry.jpeg), None
            if size is None or (clip.video is not None and size != clip.size):
                image = cv2.imdecode(np.frombuffer(entry.jpeg, np.uint8), cv2.IMREAD_COLOR)
                if image is None:
                    clip.camera.frames_missed += 1
                    return True
            if clip.video is None:
                clip.size = size if image is None else (image.shape[1], image.shape[0])
                self._open(clip)
            if clip.raw:
                data = entry.jpeg
                if image is not None:  # not the clip's size (or no header we could read): encoded again
                    if (image.shape[1], image.shape[0]) != clip.size:
                        image = cv2.resize(image, clip.size)
                    data = _encode(image)
                    if data is None:
                        raise OSError("could not encode a resized frame as JPEG")
                clip.video.write(np.frombuffer(data, np.uint8).reshape(1, -1))
            else:
                if image is None:
                    image = cv2.imdecode(np.frombuffer(entry.jpeg, np.uint8), cv2.IMREAD_COLOR)
                    if image is None:
                        clip.camera.frames_missed += 1
                        return True
                if (image.shape[1], image.shape[0]) != clip.size:  # the camera changed its resolution
                    image = cv2.resize(image, clip.size)
                clip.video.write(image)
        except (cv2.error, OSError) as exc:
            log.warning("camera %s: the clip %s failed: %s", clip.camera.camera_id, clip.path, exc)
            clip.failed = True
            clip.camera.failed += 1
            return False
        clip.frames += 1
        return True

    def _open(self, clip: Clip) -> None:
        """The clip's VideoWriter at clip.size: MJPEG copied as it is where OpenCV's FFmpeg
        backend has the raw mode, else mp4v encoded from decoded frames. OSError if neither opens."""
        import cv2

        fps = min(120.0, max(1.0, clip.fps))
        raw_mode = getattr(cv2, "VIDEOWRITER_PROP_RAW_VIDEO", None) if COPY_JPEGS else None  # OpenCV >= 4.10
        if raw_mode is not None:
            # OpenCV says once per clip on stderr that the mp4 muxer tags MJPEG "mp4v" (its
            # MPEG-4 object type for JPEG), which is what is wanted here.
            params = [raw_mode, 1]
            video = cv2.VideoWriter(clip.path, cv2.CAP_FFMPEG, cv2.VideoWriter_fourcc(*"MJPG"), fps, clip.size, params)
            if video.isOpened():
                clip.video, clip.raw = video, True
                return
            video.release()
        video = cv2.VideoWriter(clip.path, cv2.VideoWriter_fourcc(*"mp4v"), fps, clip.size)
        if not video.isOpened():
            raise OSError("the MP4 writer did not open (a full disk, no write permission, no mp4v)")
        clip.video, clip.raw = video, False

    def _finish(self, clip: Clip) -> None:
        cam = clip.camera
        if clip.video is not None:
            clip.video.release()
        if clip.failed:  # counted when it failed
            return
        if clip.frames:
            cam.written += 1
            cam.last_clip = clip.path
            log.info("camera %s: clip %s (%d frames)", cam.camera_id, clip.path, clip.frames)
        else:
            cam.failed += 1  # not one frame to write: the camera went quiet


def prune_clips(
    clips_dir: str, max_bytes: int | None, max_age_s: float | None, keep=frozenset(), now: float | None = None
) -> list[str]:
    """Remove the clips (CLIP_NAME files only) of `clips_dir` older than `max_age_s`, then the
    oldest until the rest take at most `max_bytes`; never those in `keep` (being written). The
    paths removed."""
    now = time.time() if now is None else now
    clips = []
    try:
        with os.scandir(clips_dir) as it:
            for e in it:
                if CLIP_NAME.fullmatch(e.name) and e.path not in keep and e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    clips.append((st.st_mtime, st.st_size, e.path))
    except OSError as exc:
        log.warning("cannot list the clips in %s: %s", clips_dir, exc)
        return []
    clips.sort()
    total = sum(size for _, size, _ in clips)
    removed = []
    for mtime, size, path in clips:
        old = max_age_s is not None and now - mtime > max_age_s
        if not old and (max_bytes is None or total <= max_bytes):
            continue
        try:
            os.remove(path)
        except OSError as exc:
            log.warning("cannot prune the clip %s: %s", path, exc)
            continue
        total -= size
        removed.append(path)
    return removed


# JPEG's start-of-frame markers (baseline, extended, progressive, lossless...): not DHT (C4),
# JPG (C8) or DAC (CC), which share the range.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG's start-of-frame header, without decoding it; None if the
    bytes hold no such header before the first scan (not a JPEG, or a damaged one)."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    i = 2
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte before the marker
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # the end, or the first scan: no size came before it
            return None
        if marker in _SOF:
            if i + 9 > n:
                return None
            height, width = (data[i + 5] << 8) | data[i + 6], (data[i + 7] << 8) | data[i + 8]
            return (width, height) if width and height else None
        i += 2 + ((data[i + 2] << 8) | data[i + 3])
    return None


def _background_priority() -> None:
    """The calling thread's CPU priority down by BACKGROUND_NICE (Linux: niceness is per thread;
    elsewhere setpriority would take the whole process, so nothing is done)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except OSError as exc:  # a sandbox without setpriority: the writer runs at the usual priority
        log.warning("could not lower the clip writer's priority: %s", exc)


def _encode(image) -> bytes | None:
    import cv2

    if image is None:
        return None
    ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, CLIP_JPEG_QUALITY])
    return buf.tobytes() if ok else None


def _random_id() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(6))
