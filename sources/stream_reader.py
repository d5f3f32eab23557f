"""One live stream, read by its own thread, with health, retries and a bounded buffer.

Unlike Ultralytics' LoadStreams, where a camera that fails stops the whole source, a reader
here turns every failure into a reported state ("retrying" with the error) and reconnects
with exponential backoff, so one dead camera never stalls the others.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import cv2
import numpy as np

from sources.base import DEFAULT_MAX_IMAGE_PIXELS, Frame, check_max_pixels
from sources.media import ImageTooLarge, capture_size_error, check_pixels
from sources.mjpeg import NotMjpeg, iter_mjpeg_parts

TERMINAL = ("ended", "failed", "closed")


class Dialled(NamedTuple):
    """What a guarded reader connects to, as the URL guard answered at this (re)connect."""

    url: str  # the checked, normalised URL: its path is the one the guard matched, so it is sent
    pinned: str  # the same with the checked address in place of the host, for FFmpeg
    address: str  # the checked address the MJPEG client dials (the name goes in Host and SNI)


@dataclass(slots=True)
class StreamConfig:
    buffer: int = 0  # 0: keep only the newest frame; n >= 1: a FIFO of up to n frames (oldest dropped)
    open_timeout_s: float = 5.0  # connecting must succeed within this
    # A connected stream that sends nothing this long is broken. For MJPEG the socket measures
    # it (the kernel's poll), not the reader's clock: a reader that could not run for longer (a
    # busy CPU, a thread holding the GIL) finds the bytes waiting and keeps its connection
    # (tests/test_stream_reader_load.py; FFmpeg's RTSP reads rode out a 3 s SIGSTOP as well).
    read_timeout_s: float = 5.0
    stall_after_s: float = 2.0  # health says "stalled" when a live stream sends nothing this long
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    max_retries: int | None = None  # None: live cameras come back, so retry forever
    pace_files: bool = True  # play a local video listed in .streams at its own fps, like a camera
    # Frames over this many pixels are refused before decoding (an MJPEG part's header, a
    # capture's reported size): the stream goes down with an error naming the limit, and
    # retries like any failure. See sources.base.DEFAULT_MAX_IMAGE_PIXELS (8192 x 8192).
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        if not isinstance(self.buffer, int) or self.buffer < 0:
            raise ValueError(f"buffer must be an integer >= 0 (0 = newest frame only), got {self.buffer!r}")
        for name in ("open_timeout_s", "read_timeout_s", "stall_after_s", "backoff_initial_s", "backoff_max_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_initial_s ({self.backoff_initial_s})"
            )
        if self.max_retries is not None and (not isinstance(self.max_retries, int) or self.max_retries < 0):
            raise ValueError(f"max_retries must be an integer >= 0 or None (forever), got {self.max_retries!r}")
        check_max_pixels(self.max_image_pixels)


@dataclass(slots=True)
class StreamHealth:
    stream: int
    url: str
    state: str  # connecting | live | stalled | retrying | ended | failed | closed
    frames_read: int
    frames_dropped: int  # replaced (newest-only) or pushed out of a full FIFO before anyone took them
    reconnects: int
    last_error: str | None
    seconds_since_frame: float | None
    drops_by_reason: dict[str, int] = field(default_factory=dict)  # frames_dropped, by why
    frame_interval_s: float | None = None  # seconds between frames, a moving average


class StreamReader:
    """Reads `url` on a daemon thread into a one-frame slot or a bounded FIFO.

    The thread starts with start(), not on construction, so a consumer can build its model
    first: a reader started early fills its slot while nobody takes, and with newest-only
    the first frames of a clip are gone before the detector sees any.

    `cond` is shared by all readers of a source so a consumer can wait for any of them.
    The thread is a daemon because a blocking FFmpeg read cannot be interrupted; close()
    stops it at the next frame or timeout and never waits longer than `join_s`.

    `name` is how messages call it ("camera door"); without one, "stream N", its position in
    a `.streams` file. Drops are counted by reason: "queue_full" (a full FIFO pushed its oldest
    out), "stale" (take() found it older than asked), and for a newest-only slot the consumer's
    `drop_reason` ("replaced" unless it says why it left the frame waiting, e.g. "rate_cap").
    """

    def __init__(
        self,
        stream: int,
        url: str,
        config: StreamConfig,
        cond: threading.Condition,
        on_error: Callable[[Frame], None],
        dial: Callable[[str], Dialled] | None = None,
        name: str | None = None,
        tap: Callable[[Frame, bytes | None], None] | None = None,
    ) -> None:
        self.stream, self.url, self.config = stream, url, config
        self.name = name or f"stream {stream}"
        # `dial` (a URL a remote caller gave): called at every (re)connect, it checks the URL
        # again (raising ValueError when refused) and answers what to connect to (Dialled).
        self.dial = dial
        # `tap(frame, jpeg)`: every frame read, on this thread, with its JPEG as the camera sent
        # it (MJPEG) or None (decoded by FFmpeg): the camera's clip ring (workers/camera_clips.py).
        self.tap = tap
        self._cond = cond
        self._on_error = on_error
        self._frames: deque[Frame] = deque(maxlen=max(1, config.buffer))
        self.state = "connecting"
        self.frames_read = self.frames_dropped = self.reconnects = 0
        self.drops: dict[str, int] = {}
        self.drop_reason = "replaced"  # the consumer's word for why a slot's frame waits (cond held)
        self.frame_interval: float | None = None
        self.last_error: str | None = None
        self.last_frame_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stream-{self.name.replace(' ', '-')}", daemon=True)

    def start(self) -> None:
        """Start reading; a second call, or one after close(), does nothing."""
        if not self._thread.is_alive() and self._thread.ident is None and not self._stop.is_set():
            self._thread.start()

    # -- consumer side (call with cond held) --
    def take(self, max_age_s: float | None = None, now: float | None = None) -> Frame | None:
        """The oldest frame waiting; with `max_age_s`, frames older than that are dropped
        first (counted "stale"), so a backlog never reaches the detector late."""
        if max_age_s is not None:
            self.drop_stale(max_age_s, time.monotonic() if now is None else now)
        return self._frames.popleft() if self._frames else None

    def drop_stale(self, max_age_s: float, now: float) -> int:
        """Drop the waiting frames older than `max_age_s`; how many went."""
        n = 0
        while self._frames and now - self._frames[0].timestamp > max_age_s:
            self._frames.popleft()
            n += 1
        if n:
            self._drop("stale", n)
        return n

    def _drop(self, reason: str, n: int = 1) -> None:
        self.frames_dropped += n
        self.drops[reason] = self.drops.get(reason, 0) + n

    def has_frame(self) -> bool:
        return bool(self._frames)

    def health(self, now: float) -> StreamHealth:
        since = None if self.last_frame_at is None else now - self.last_frame_at
        state = self.state
        if state == "live" and since is not None and since > self.config.stall_after_s:
            state = "stalled"
        return StreamHealth(
            self.stream,
            self.url,
            state,
            self.frames_read,
            self.frames_dropped,
            self.reconnects,
            self.last_error,
            since,
            dict(self.drops),
            self.frame_interval,
        )

    def close(self, join_s: float = 2.0) -> None:
        self._stop.set()
        with self._cond:
            if self.state not in TERMINAL:
                self.state = "closed"
            self._frames.clear()  # memory goes with the stream
            self._cond.notify_all()
        self.join(join_s)

    def join(self, timeout: float) -> None:
        if self._thread.ident is not None:  # never started: nothing to wait for
            self._thread.join(timeout=timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- reader thread --
    def _set_state(self, state: str) -> None:
        with self._cond:
            if self.state != "closed":
                self.state = state
            self._cond.notify_all()

    def _push(self, image: np.ndarray, index: int, encoded: bytes | None = None) -> None:
        frame = Frame(self.url, index=index, image=image, stream=self.stream)
        if self.tap is not None and not self._stop.is_set():
            self.tap(frame, encoded)
        with self._cond:
            if self._stop.is_set():
                return
            if len(self._frames) == self._frames.maxlen:  # the deque drops the oldest on append
                self._drop("queue_full" if self.config.buffer else self.drop_reason)
            self._frames.append(frame)
            self.frames_read += 1
            if self.last_frame_at is not None and self.state == "live":
                # A moving average, so a consumer can tell when the next frame should come
                # (the camera muxer waits only for cameras whose frame is due within its window).
                dt = frame.timestamp - self.last_frame_at
                self.frame_interval = dt if self.frame_interval is None else 0.8 * self.frame_interval + 0.2 * dt
            self.last_frame_at = frame.timestamp
            self.state = "live"
            self._cond.notify_all()

    def _run(self) -> None:
        failures, attempts = 0, 0
        is_file = not (self.url.isdigit() or "://" in self.url)
        while not self._stop.is_set():
            self.reconnects += attempts > 0
            attempts += 1
            self._set_state("connecting")
            frames = self._open()
            try:
                for index, (image, encoded) in enumerate(frames):
                    if self._stop.is_set():
                        return
                    self._push(image, index, encoded)
                    failures = 0  # a frame arrived: the next failure starts the backoff afresh
                if is_file:
                    self._set_state("ended")
                    return
                raise ConnectionError("the stream ended (server closed the connection)")
            except Exception as exc:  # noqa: BLE001 - every failure is reported, none kills the thread
                if self._stop.is_set():
                    return
                failures += 1
                self.last_error = f"{self.name} ({self.url}): {type(exc).__name__}: {exc}"
                give_up = self.config.max_retries is not None and failures > self.config.max_retries
                if failures == 1 or give_up:  # report going down once, not every retry
                    final = f"{self.last_error} (gave up after {failures - 1} retries)" if give_up else self.last_error
                    self._on_error(Frame(self.url, error=final, stream=self.stream))
                if give_up:
                    self._set_state("failed")
                    return
                self._set_state("retrying")
                delay = min(self.config.backoff_max_s, self.config.backoff_initial_s * 2 ** (failures - 1))
                self._stop.wait(delay)
            finally:
                frames.close()

    def _open(self) -> Iterator[tuple[np.ndarray, bytes | None]]:
        """(frame, its JPEG as sent, or None where FFmpeg decoded it) until the stream ends."""
        url = self.url
        if self.dial is not None:
            return self._dialled(url)
        if url.lower().startswith(("http://", "https://")):
            return self._http(url)
        return self._capture(int(url) if url.isdigit() else url, pace="://" not in url and not url.isdigit())

    def _dialled(self, url: str) -> Iterator[tuple[np.ndarray, bytes | None]]:
        checked = self.dial(url)  # in the generator: a refusal is a failure like any other
        if checked.url.startswith(("http://", "https://")):  # the guard lower-cases the scheme
            # The checked URL, not the caller's text: nginx serves GET /cams//../admin as /admin,
            # while the guard matched /cams/admin against the prefix.
            yield from self._http(checked.url, checked.address)
        else:
            yield from self._capture(checked.pinned, pace=False)

    def _http(self, url: str, address: str | None = None) -> Iterator[tuple[np.ndarray, bytes | None]]:
        c = self.config
        try:
            yield from iter_mjpeg_parts(url, c.open_timeout_s, c.read_timeout_s, c.max_image_pixels, address=address)
        except NotMjpeg as exc:
            if address is not None:
                # FFmpeg follows HTTP redirects and HLS playlists by itself, to hosts nobody
                # checked: a guarded (remotely added) http camera must be MJPEG.
                raise ConnectionError(
                    f"{exc}; only MJPEG is read from http(s) cameras added remotely (FFmpeg would "
                    "follow redirects and playlists past the URL guard): use rtsp, or list it in the .streams file"
                ) from None
            yield from self._capture(url, pace=False)  # e.g. HLS or MP4 over HTTP: FFmpeg reads it

    def _capture(self, target: int | str, pace: bool) -> Iterator[tuple[np.ndarray, None]]:
        c = self.config
        live = isinstance(target, str) and "://" in target
        opening = time.monotonic()
        if isinstance(target, int):
            cap = cv2.VideoCapture(target)
        else:
            params = [
                cv2.CAP_PROP_OPEN_TIMEOUT_MSEC,
                int(c.open_timeout_s * 1000),
                cv2.CAP_PROP_READ_TIMEOUT_MSEC,
                int(c.read_timeout_s * 1000),
            ]
            cap = cv2.VideoCapture(target, cv2.CAP_FFMPEG, params)
        try:
            if not cap.isOpened():
                if isinstance(target, int):
                    raise ConnectionError(f"cannot open webcam {target}: no such camera here, or it is busy")
                if not live:
                    raise ConnectionError(f"cannot open {target!r}: not a video FFmpeg can read")
                # FFmpeg says only "failed". A failure at once is a refusal (nothing listens, no such
                # path, not a stream); one at the deadline is a server that accepted and never answered.
                if time.monotonic() - opening >= 0.9 * c.open_timeout_s:
                    raise TimeoutError(f"cannot open {target!r}: no answer within {c.open_timeout_s:g} s (timed out)")
                raise ConnectionError(f"cannot open {target!r}: refused (nothing listening, no such stream or not one)")
            too_large = capture_size_error(cap, self.name, c.max_image_pixels)
            if too_large:  # checked before the first frame is read
                raise ImageTooLarge(too_large)
            fps = cap.get(cv2.CAP_PROP_FPS)
            period = 1.0 / fps if pace and c.pace_files and 0 < fps < 1000 else 0.0
            next_t = time.monotonic()
            while not self._stop.is_set():
                asked = time.monotonic()
                ok, image = cap.read()
                if not ok:
                    # read() is False alike for a closed connection and for READ_TIMEOUT_MSEC (an
                    # RTSP camera that froze but keeps its socket open): tell them apart by the
                    # wait, so the error says "timed out" as the HTTP reader's does for a stall.
                    if live and time.monotonic() - asked >= 0.9 * c.read_timeout_s:
                        raise TimeoutError(f"no frame within {c.read_timeout_s:g} s: the read timed out (stalled)")
                    return
                check_pixels(image.shape[1], image.shape[0], self.name, c.max_image_pixels)
                yield image, None
                if period:
                    next_t += period
                    self._stop.wait(max(0.0, next_t - time.monotonic()))
        finally:
            cap.release()
