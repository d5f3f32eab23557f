"""`python -m sources.loopback`, the documented test camera, run as a user runs it: a subprocess
whose `ready URL` lines are waited on, read by a plain MJPEG client (and OpenCV over RTSP)."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import cv2
import numpy as np
import pytest

from sources.loopback import BOUNDARY, read_stamp, stamp

REPO = Path(__file__).resolve().parents[1]


class Loopback:
    """The command as a subprocess; its stdout lines, waited on with a deadline."""

    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "sources.loopback", "--stop-on-eof", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def ready_urls(self, n: int, timeout: float = 60.0) -> list[str]:
        urls, deadline = [], time.monotonic() + timeout
        while len(urls) < n:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            assert line is not None, f"the loopback exited (rc {self.proc.wait()}) after {urls}"
            if line.startswith("ready "):
                urls.append(line.split()[1])
        return urls

    def line(self, timeout: float = 10.0) -> str | None:
        return self.lines.get(timeout=timeout)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def loopback():
    started = []

    def start(*args: str) -> Loopback:
        started.append(Loopback(*args))
        return started[-1]

    yield start
    for lb in started:
        lb.close()


def mjpeg_frames(url: str, count: int, timeout: float = 20.0) -> tuple[list[np.ndarray], list[float], bool]:
    """Up to `count` decoded frames of a multipart MJPEG stream, their arrival times, and
    whether the server ended the stream (before `count`)."""
    frames, times, buf = [], [], b""
    marker = f"--{BOUNDARY}".encode()
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        while len(frames) < count:
            chunk = resp.read1(65536)
            if not chunk:
                return frames, times, True
            buf += chunk
            while True:
                head = buf.find(b"\r\n\r\n", buf.find(marker))
                if buf.find(marker) < 0 or head < 0:
                    break
                headers = buf[buf.find(marker) : head].decode()
                length = int(headers.lower().split("content-length:")[1].split()[0])
                if len(buf) < head + 4 + length:
                    break
                jpeg = buf[head + 4 : head + 4 + length]
                buf = buf[head + 4 + length :]
                frames.append(cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR))
                times.append(time.monotonic())
    return frames, times, False


def test_help_documents_the_test_camera():
    out = subprocess.run(
        [sys.executable, "-m", "sources.loopback", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for flag in ("--port", "--fps", "--cameras", "--clip", "--loop", "--streams-file", "--rtsp"):
        assert flag in out.stdout, flag
    assert "shipped detector" in out.stdout


def test_cameras_print_urls_write_streams_file_and_serve_at_fps(loopback, tmp_path):
    streams = tmp_path / "cams.streams"
    lb = loopback("--cameras", "2", "--fps", "10", "--streams-file", str(streams))
    urls = lb.ready_urls(2)
    assert lb.line() == f"wrote {streams}"
    assert streams.read_text().split() == urls
    assert len({u.split(":")[2].split("/")[0] for u in urls}) == 2, "one port per camera"
    frames, times, ended = mjpeg_frames(urls[1], 21)
    assert not ended and len(frames) == 21
    rate = (len(times) - 1) / (times[-1] - times[0])
    assert 7.0 <= rate <= 13.0, f"{rate:.1f} frames/s from a 10 fps camera"
    assert frames[0].shape == (240, 320, 3)
    assert np.abs(frames[0].astype(int) - frames[-1].astype(int)).mean() > 1, "the shapes move"


def test_stamped_cameras_carry_their_number(loopback):
    lb = loopback("--cameras", "2", "--fps", "20", "--stamp")
    urls = lb.ready_urls(2)
    frames, _, _ = mjpeg_frames(urls[1], 5)
    stamps = [read_stamp(f) for f in frames]
    assert all(s is not None and s[0] == 1 for s in stamps), stamps
    assert [s[1] for s in stamps] == list(range(stamps[0][1], stamps[0][1] + 5)), "consecutive frame numbers"


def _clip(path: Path, n: int) -> None:
    """A clip of `n` frames whose frame numbers are stamped in their pixels."""
    w = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10, (320, 240))
    for i in range(n):
        w.write(stamp(np.full((240, 320, 3), 90, np.uint8), 0, i))
    w.release()


def test_clip_loops_on_request_and_ends_without(loopback, tmp_path):
    clip = tmp_path / "clip.avi"
    _clip(clip, 6)
    looped = loopback("--clip", str(clip), "--loop", "--fps", "30")
    frames, _, ended = mjpeg_frames(looped.ready_urls(1)[0], 15)
    numbers = [read_stamp(f)[1] for f in frames]
    assert not ended and len(numbers) == 15
    assert all(b == (a + 1) % 6 for a, b in zip(numbers, numbers[1:])), f"the clip loops: {numbers}"
    once = loopback("--clip", str(clip), "--fps", "30")
    frames, _, ended = mjpeg_frames(once.ready_urls(1)[0], 15)
    assert ended and [read_stamp(f)[1] for f in frames] == list(range(6)), "played once, then end of stream"


def test_rtsp_serves_the_generated_scene(loopback):
    lb = loopback("--rtsp", "--fps", "10")
    url = lb.ready_urls(1)[0]
    assert url.startswith("rtsp://")
    cap = cv2.VideoCapture(url, cv2.CAP_FFMPEG)
    try:
        ok, img = cap.read()
    finally:
        cap.release()
    assert ok and img.shape == (240, 320, 3)
    assert img.std() > 10, "the scene, not a blank frame"


def test_the_scene_draws_the_shipped_detectors_classes_in_its_label_order():
    from runtime.vision.detector import CLASSES
    from sources.scene import SHAPES

    assert SHAPES == CLASSES  # sources/ may not import the runtime, so the names are repeated
