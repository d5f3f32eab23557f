"""GET /clips/{name} of `tandem streams`: an event clip from --clips-dir, behind the API key like
every endpoint but /health, whole or by byte range (a <video> seeks with Range requests); and
nothing else: no `../`, no absolute path, no symlink out of the directory, 404 for the rest.
GET /clips/{name}/play replays it as MJPEG, every frame in order (browsers decode no mp4v).

The requests go over a real socket (http.client sends the path as written: no client tidies
`../` away first) to the real app on a CameraService with clips and no camera (a stub Runtime:
nothing loads a model).
"""

from __future__ import annotations

import http.client
import os
from urllib.parse import urlsplit

import pytest

from server.streams_app import ControlServer, create_app
from workers.camera_clips import ClipConfig
from workers.cameras import CameraService
from workers.cameras_security import KEY_COOKIE, Security
from workers.cameras_views import clip_file

KEY = "clips-key"
CLIP = "door-1764900000.123456-abc123.mp4"  # a name the clip writer gives (camera_clips.CLIP_NAME)
SECRET = "door-1764900001.000000-zzz999.mp4"  # clip-shaped, but outside the clips dir


class StubRuntime:
    vision = None

    def metrics_snapshot(self) -> dict:
        return {}


@pytest.fixture
def served(tmp_path):
    clips_dir, outside = tmp_path / "clips", tmp_path / "outside"
    outside.mkdir()
    (outside / SECRET).write_bytes(b"not yours" * 100)
    service = CameraService(StubRuntime(), None, clips=ClipConfig(str(clips_dir)), control=False)
    body = os.urandom(5000)
    (clips_dir / CLIP).write_bytes(body)
    server = ControlServer("127.0.0.1", 0)
    server.start(create_app(service, Security((KEY,), "127.0.0.1"), server.stop))
    try:
        yield server.url, clips_dir, outside, body
    finally:
        server.close()
        service.close()


def get(url: str, path: str, headers: dict | None = None, key: str | None = KEY) -> tuple[int, dict, bytes]:
    """GET `path` exactly as written (http.client does not resolve dot segments)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        conn.request("GET", path, headers={**auth, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_a_clip_is_served_whole_and_by_range_behind_the_api_key(served):
    url, _, _, body = served
    assert get(url, f"/clips/{CLIP}", key=None)[0] == 401
    assert get(url, f"/clips/{CLIP}", key="wrong")[0] == 401
    status, headers, got = get(url, f"/clips/{CLIP}")
    assert status == 200 and got == body
    assert headers["content-type"] == "video/mp4" and headers["x-content-type-options"] == "nosniff"
    assert headers["accept-ranges"] == "bytes"
    status, headers, got = get(url, f"/clips/{CLIP}", {"Range": "bytes=100-199"})
    assert status == 206 and got == body[100:200] and headers["content-range"] == f"bytes 100-199/{len(body)}"
    # The page's <video> carries the login cookie, not a header.
    status, _, got = get(url, f"/clips/{CLIP}", {"Cookie": f"{KEY_COOKIE}={KEY}"}, key=None)
    assert status == 200 and got == body


def test_only_clip_files_inside_the_clips_dir_are_served(served):
    url, clips_dir, outside, body = served
    link = "door-1764900002.000000-lnk000.mp4"
    os.symlink(outside / SECRET, clips_dir / link)  # clip-shaped, inside, and leading out
    os.mkdir(clips_dir / "door-1764900003.000000-dir000.mp4")
    (clips_dir / "notes.txt").write_text("not a clip")
    refused = [
        f"/clips/../outside/{SECRET}",
        f"/clips/..%2Foutside%2F{SECRET}",
        "/clips/..%2F..%2F..%2F..%2Fetc%2Fpasswd",
        f"/clips/%2F{str(outside / SECRET).lstrip('/').replace('/', '%2F')}",  # an absolute path
        f"/clips/{link}",
        "/clips/door-1764900003.000000-dir000.mp4",
        "/clips/notes.txt",
        "/clips/door-1764900009.000000-nope00.mp4",  # no such clip
        "/clips/..",
        "/clips/",
    ]
    for path in refused:
        status, _, got = get(url, path)
        assert status == 404, (path, status, got[:200])
        assert b"not yours" not in got
    assert get(url, f"/clips/{CLIP}")[2] == body  # and the real one still is
    # The check itself, below the router (which already refuses a name with a slash):
    for name in (f"../outside/{SECRET}", str(outside / SECRET), "..", link, "notes.txt", "", CLIP + "/"):
        assert clip_file(str(clips_dir), name) is None, name
    assert clip_file(str(clips_dir), CLIP) == os.path.join(os.path.realpath(clips_dir), CLIP)


def test_a_clip_replays_as_mjpeg_frame_by_frame_behind_the_key(served):
    import cv2
    import numpy as np

    url, clips_dir, _, _ = served
    name = "door-1764900004.000000-mp4v00.mp4"
    frames = [np.full((48, 64, 3), 40 * k, np.uint8) for k in range(5)]  # five greys, darkest first
    video = cv2.VideoWriter(str(clips_dir / name), cv2.VideoWriter_fourcc(*"mp4v"), 25.0, (64, 48))
    for f in frames:
        video.write(f)
    video.release()
    assert get(url, f"/clips/{name}/play", key=None)[0] == 401
    for path in (f"/clips/..%2Foutside%2F{SECRET}/play", "/clips/door-1764900009.000000-nope00.mp4/play"):
        assert get(url, path)[0] == 404, path
    status, headers, body = get(url, f"/clips/{name}/play")  # the stream ends with the clip
    assert status == 200 and headers["content-type"].startswith("multipart/x-mixed-replace")
    parts = [p for p in body.split(b"--tandemframe\r\n") if p]
    greys = [
        int(cv2.imdecode(np.frombuffer(p.split(b"\r\n\r\n", 1)[1], np.uint8), cv2.IMREAD_GRAYSCALE).mean())
        for p in parts
    ]
    assert len(greys) == len(frames), greys
    assert all(abs(g - 40 * k) <= 6 for k, g in enumerate(greys)), greys  # every frame, in order


def test_without_a_clips_dir_every_clip_is_a_404_naming_the_option(tmp_path):
    service = CameraService(StubRuntime(), None, control=False)
    server = ControlServer("127.0.0.1", 0)
    server.start(create_app(service, Security((KEY,), "127.0.0.1"), server.stop))
    try:
        status, _, got = get(server.url, f"/clips/{CLIP}")
        assert status == 404 and b"--clips-dir" in got
    finally:
        server.close()
        service.close()


def test_a_replay_left_mid_frame_releases_its_capture_only_after_the_read():
    """A viewer who leaves cancels the replay while a worker thread still reads a frame
    (workers/cameras_views.py _Clip): releasing the capture under that read freed FFmpeg's
    context beneath it, a segfault of the server. The release waits for the read; a read after
    it reads nothing."""
    import threading

    from workers.cameras_views import _Clip

    reading, finish = threading.Event(), threading.Event()
    order = []

    class Capture:  # a VideoCapture whose read blocks until told to finish
        def read(self):
            order.append("read")
            reading.set()
            assert finish.wait(30)
            order.append("read done")
            return False, None

        def release(self):
            order.append("released")

    clip = _Clip(Capture())
    got = []
    reader = threading.Thread(target=lambda: got.append(clip.next_jpeg()))
    reader.start()
    assert reading.wait(30)
    closer = threading.Thread(target=clip.close)
    closer.start()
    try:
        closer.join(1.0)
        assert closer.is_alive(), "the release did not wait for the read in flight"
    finally:
        finish.set()
    reader.join(30)
    closer.join(30)
    assert order == ["read", "read done", "released"] and got == [None]
    assert clip.next_jpeg() is None and order.count("read") == 1  # closed: no read at all
