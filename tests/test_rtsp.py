"""RTSP on loopback: Debian's GStreamer RTSP server serves a generated video (Motion JPEG over
RTP, sources/rtsp_server.py, run by the system Python), the project's stream reader decodes
it with OpenCV's FFmpeg, and a camera that drops and comes back, or hangs and recovers, is
reconnected with backoff.

The server needs apt packages (gir1.2-gst-rtsp-server-1.0, gstreamer1.0-plugins-base,
gstreamer1.0-plugins-good, python3-gi; `.ci/run` installs them). Where they are missing these
tests fail and name them: a skip would hide that RTSP went untested.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from sources import StreamConfig, load_source  # noqa: E402
from sources.rtsp_server import APT_PACKAGES, RtspCamera  # noqa: E402
from sources.stream_reader import TERMINAL  # noqa: E402
from stream_helpers import take_until  # noqa: E402

W, H, FPS = 320, 240, 30  # 30 fps: FFmpeg probes ~20 frames on open, so each connect takes ~0.7 s

# Backoff small enough that a reconnect comes within a fraction of a second; the read timeout
# is only exercised by the hang test, the open timeout stays well above FFmpeg's probe.
FAST = dict(open_timeout_s=4.0, read_timeout_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.2)


@pytest.fixture
def camera():
    cam = RtspCamera(width=W, height=H, fps=FPS)
    try:
        try:
            cam.start()
        except RuntimeError as exc:
            pytest.fail(f"cannot start the loopback RTSP camera: {exc}", pytrace=False)
        yield cam
    finally:
        cam.stop()


def _ok(frames):
    return [fr for fr in frames if fr.ok]


def _assert_camera_frames(frames, url):
    for fr in frames:
        assert fr.source == url and fr.stream == 0
        assert fr.image.shape == (H, W, 3) and fr.image.dtype == np.uint8
    # videotestsrc's ball: a white disc on black, so a decoded frame is neither blank nor grey mush
    assert all(fr.image.max() > 200 and fr.image.min() < 50 for fr in frames)


def _health(src):
    (h,) = src.health()
    return h


def test_camera_that_drops_and_comes_back_is_reconnected(camera):
    url = camera.url
    src = load_source(url, stream_config=StreamConfig(**FAST))
    try:
        first = take_until(src, lambda fr: len(_ok(fr)) >= 5, 15.0)
        assert not any(fr.error for fr in first)
        _assert_camera_frames(_ok(first), url)
        h = _health(src)
        assert h.state == "live" and h.reconnects == 0 and h.last_error is None

        camera.stop()  # the camera drops: SIGKILL, the kernel closes its sockets
        # The reader drains what FFmpeg had buffered, sees the end, reports it, and retries
        # with backoff; every retry is refused while nothing listens.
        assert src.wait_for(lambda hs: hs[0].reconnects >= 3 or hs[0].state in TERMINAL, timeout=10), _health(src)
        h = _health(src)
        assert h.state in ("retrying", "connecting"), h  # never "live" while the camera is away; never given up
        assert "refused" in h.last_error and url in h.last_error
        down = src.next_batch(timeout=0)  # at most the last buffered frame and the error
        errors = [fr for fr in down if fr.error]
        assert len(errors) == 1, errors  # reported once when it went down, not on every retry
        assert errors[0].stream == 0 and "stream ended" in errors[0].error and errors[0].image is None

        read_while_down = h.frames_read
        assert camera.start() == url  # the camera comes back on the same port
        back = src.wait_for(lambda hs: hs[0].state == "live" and hs[0].frames_read >= read_while_down + 5, timeout=15)
        assert back, _health(src)
        again = take_until(src, lambda fr: len(_ok(fr)) >= 5, 15.0)
        assert not any(fr.error for fr in again)  # coming back is not an error
        _assert_camera_frames(_ok(again), url)
        h = _health(src)
        assert h.state == "live" and h.reconnects >= 3 and h.frames_read >= read_while_down + 5
    finally:
        src.close()
    assert not any(r.alive for r in src.readers)


def test_hung_camera_times_out_and_is_reconnected_when_it_recovers(camera):
    """A camera that hangs keeps its TCP connection open and sends nothing: only the read
    timeout (CAP_PROP_READ_TIMEOUT_MSEC) notices, and reconnecting meets a server that accepts
    but never answers, so the open timeout bounds each try."""
    url = camera.url
    src = load_source(url, stream_config=StreamConfig(**FAST))
    try:
        take_until(src, lambda fr: len(_ok(fr)) >= 3, 15.0)
        camera.freeze()
        # "retrying" (or the reconnect after it) comes after the error is queued and last_error set
        went_down = src.wait_for(lambda hs: hs[0].state in ("retrying", *TERMINAL) or hs[0].reconnects >= 1, timeout=10)
        h = _health(src)
        assert went_down and h.state in ("retrying", "connecting"), h
        assert "timed out" in h.last_error
        (error,) = [fr for fr in src.next_batch(timeout=0) if fr.error]
        assert "no frame within 1 s" in error.error

        read_while_hung = h.frames_read
        camera.thaw()
        back = src.wait_for(lambda hs: hs[0].state == "live" and hs[0].frames_read >= read_while_hung + 5, timeout=15)
        assert back, _health(src)
        again = take_until(src, lambda fr: len(_ok(fr)) >= 3, 15.0)
        _assert_camera_frames(_ok(again), url)
        assert _health(src).reconnects >= 1
    finally:
        src.close()
    assert not any(r.alive for r in src.readers)


def test_missing_gstreamer_fails_naming_the_apt_packages(tmp_path):
    # The system Python without its site packages cannot import gi: the same as a machine
    # without python3-gi. The camera must say what to install, not time out.
    shim = tmp_path / "python-without-gi"
    shim.write_text("#!/bin/sh\nexec /usr/bin/python3 -S \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    cam = RtspCamera(python=str(shim))
    try:
        with pytest.raises(RuntimeError) as info:
            cam.start()
    finally:
        cam.stop()
    assert all(pkg in str(info.value) for pkg in APT_PACKAGES) and "apt-get install" in str(info.value)
    assert not cam.running
