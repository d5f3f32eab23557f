"""A stream reader under load (sources/stream_reader.py over sources/mjpeg.py): a reader whose
process cannot run keeps its connection; a camera that froze with its connection open is still
given up; and why a clip that ends must not be retried by a test that counts its frames.

Issue 27: test_cameras_policy's every_frame test read frames 0..17, then 0, 1, 2, 3, 13, 14, 0,
1 on a busy machine. A mid-burst reconnect cannot skip 4..12 inside one connection: a full FIFO
can. The clip ends, the reader reconnects (an HTTP camera that closes is down), the loopback
serves the clip again from frame 0, and a detector slowed by the busy CPU lets the replays fill
the 60-frame FIFO, which pushes out the first pass's frames ("queue_full"). The last test shows
it with a consumer that takes nothing. Every wait is on the readers' condition, with a deadline.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import threading
import time

import pytest
from camera_helpers import SAFETY_S
from test_loopback_cli import Loopback

from sources.loopback import MjpegServer, synthetic_frames
from sources.stream_reader import StreamConfig, StreamReader

READ_TIMEOUT_S = 0.5
CONFIG = StreamConfig(
    buffer=1000,  # a FIFO that never fills here: every frame read is kept, in order
    open_timeout_s=READ_TIMEOUT_S,
    read_timeout_s=READ_TIMEOUT_S,
    stall_after_s=READ_TIMEOUT_S,
    backoff_initial_s=0.1,
    backoff_max_s=0.4,
)


class Watched:
    """A started reader, the errors it reported, and waits on its condition."""

    def __init__(self, url: str, config: StreamConfig = CONFIG) -> None:
        self.cond = threading.Condition()
        self.errors: list[str] = []
        self.reader = StreamReader(0, url, config, self.cond, self._down)
        self.reader.start()

    def _down(self, frame) -> None:  # the reader's thread, cond not held
        with self.cond:
            self.errors.append(frame.error)
            self.cond.notify_all()

    def wait(self, predicate, what: str) -> None:
        with self.cond:
            r = self.reader
            assert self.cond.wait_for(predicate, SAFETY_S), (
                f"{what}: {r.health(time.monotonic())}, errors {self.errors}"
            )

    def taken(self) -> list[int]:
        with self.cond:
            frames = []
            while (frame := self.reader.take()) is not None:
                frames.append(frame.index)
            return frames

    def close(self) -> None:
        self.reader.close()


@pytest.fixture
def camera():
    """A 30 fps camera in another process, as a real one is: it sends while this one cannot run."""
    cam = Loopback("--fps", "30")
    try:
        yield cam
    finally:
        os.kill(cam.proc.pid, signal.SIGCONT)  # a test that froze it: let it see stdin close
        cam.close()


@pytest.fixture
def watched(camera):
    """A reader of `camera` that has read its first frames."""
    (url,) = camera.ready_urls(1)
    watched = Watched(url)
    try:
        watched.wait(lambda: watched.reader.frames_read >= 5, "the first frames")
        yield watched
    finally:
        watched.close()


def hold_the_gil(seconds: float) -> None:
    """Keep every other Python thread of this process from running for `seconds`: a C call
    through PyDLL keeps the GIL, so the reader's thread cannot run however ready its socket is
    (what a busy CPU or a long GIL-holding call does to it), and no CPU is burnt meanwhile."""
    ctypes.PyDLL(None).usleep(int(seconds * 1_000_000))


def test_a_reader_whose_process_cannot_run_keeps_its_connection(watched):
    reader = watched.reader
    # Three read timeouts without running: the camera went on sending, the kernel kept the
    # bytes, and the reader must read them on its first connection, not time out and redial.
    hold_the_gil(3 * READ_TIMEOUT_S)
    after = reader.frames_read
    watched.wait(lambda: reader.frames_read >= after + 15, "frames after the hold")
    assert reader.reconnects == 0 and watched.errors == [], (reader.reconnects, watched.errors)
    indices = watched.taken()
    assert indices == list(range(len(indices))), indices  # one connection: 0, 1, 2, ... unbroken


def test_a_camera_that_froze_with_its_connection_open_is_given_up_after_the_read_timeout(camera, watched):
    os.kill(camera.proc.pid, signal.SIGSTOP)  # the camera stops; its socket stays open
    watched.wait(lambda: watched.errors, "the frozen camera reported down")
    assert "timed out" in watched.errors[0].lower(), watched.errors
    watched.wait(lambda: watched.reader.reconnects >= 1, "a reconnect to the frozen camera")


def test_a_clip_that_ends_is_replayed_into_a_fifo_unless_the_reader_gives_up():
    # The every_frame test's camera (30 frames at 300 fps, not looping) and FIFO (60), read by a
    # consumer slower than the replays: here one that takes nothing until the reader is done.
    fifo = dataclasses.replace(CONFIG, buffer=60)
    with MjpegServer(synthetic_frames(30, seed=6), fps=300, loop=False) as clip:
        retried = Watched(clip.url, fifo)
        try:
            r = retried.reader
            retried.wait(lambda: r.reconnects >= 2 and r.frames_read > 60, "two replays of the clip")
            indices = retried.taken()
        finally:
            retried.close()
        # Each replay starts at frame 0 again, and the full FIFO pushed out the first pass's frames.
        assert r.drops.get("queue_full", 0) > 0 and indices[:30] != list(range(30)), (r.drops, indices)

        once = Watched(clip.url, dataclasses.replace(fifo, max_retries=0))
        try:
            r = once.reader
            once.wait(lambda: r.state == "failed", "the reader giving up when the clip ended")
            # No retry, no replay: the clip's frames once, in order, however slow the consumer.
            assert once.taken() == list(range(30)) and r.drops == {} and r.reconnects == 0
            assert "ended" in once.errors[0], once.errors
        finally:
            once.close()
