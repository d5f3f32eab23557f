"""The `.streams` file is reloaded while `tandem streams` runs: cameras added, removed and changed
without a restart, unnamed cameras keeping their ids, and a broken edit changing nothing.

The StreamsFile tests drive a recording fake service (what was added and removed is the
subject); the CLI test runs the real process on loopback cameras and waits on its GET /cameras
after an edit (mtime poll) and after SIGHUP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from test_jobs_support import REPO, wait_for

from sources import SourceError, parse_streams_file
from sources.loopback import MjpegServer, dead_url, synthetic_frames
from workers.cameras import CameraConflict, CameraNotFound
from workers.streams_file import StreamsFile, parse

SAFETY_S = 30


class FakeService:
    def __init__(self) -> None:
        self.cams: dict[str, tuple] = {}
        self.log: list[tuple] = []

    def add(self, camera_id, url, max_fps=None, *, allow_local=False, **options):
        if camera_id in self.cams:
            raise CameraConflict("camera", f"camera {camera_id!r} exists already (remove it first)")
        self.cams[camera_id] = (url, max_fps, options)
        self.log.append(("add", camera_id))
        return {"camera": camera_id}

    def remove(self, camera_id):
        if self.cams.pop(camera_id, None) is None:
            raise CameraNotFound("camera", f"no camera {camera_id!r}")
        self.log.append(("remove", camera_id))
        return {"camera": camera_id}


def _write(path, text: str) -> None:
    # A new mtime for sure: the poll compares (mtime_ns, size, inode), and two writes within
    # the filesystem's timestamp resolution could otherwise look the same.
    st = os.stat(path) if os.path.exists(path) else None
    path.write_text(text)
    if st is not None:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_a_reload_adds_removes_and_changes_cameras(tmp_path):
    f = tmp_path / "cams.streams"
    _write(f, "rtsp://a.example/1\nrtsp://b.example/2 max_fps=5\nrtsp://c.example/3 id=door policy=every_frame\n")
    service = FakeService()
    sf = StreamsFile(str(f), service)
    sf.load()
    assert service.cams == {
        "cam0": ("rtsp://a.example/1", None, {}),
        "cam1": ("rtsp://b.example/2", 5.0, {}),
        "door": ("rtsp://c.example/3", None, {"policy": "every_frame"}),
    }
    assert sf.poll() is None  # unchanged: nothing happens
    service.log.clear()
    # a removed, b's rate changed, door kept, e added: b keeps its id cam1 (same URL) though its
    # line moved, and e gets cam2, its place.
    _write(f, "rtsp://b.example/2 max_fps=2\nrtsp://c.example/3 id=door policy=every_frame\nrtsp://e.example/5\n")
    summary = sf.poll()
    assert summary == {"added": ["cam2"], "removed": ["cam0"], "changed": ["cam1"], "error": None}
    assert service.cams == {
        "cam1": ("rtsp://b.example/2", 2.0, {}),
        "door": ("rtsp://c.example/3", None, {"policy": "every_frame"}),
        "cam2": ("rtsp://e.example/5", None, {}),
    }
    assert ("add", "door") not in service.log and ("remove", "door") not in service.log  # untouched
    # A camera added over HTTP is not the file's: a reload leaves it alone.
    service.add("http-cam", "rtsp://h.example/x")
    # A broken edit (a half-saved file) changes nothing, and says why.
    _write(f, "rtsp://b.example/2 max_fps=fast\n")
    bad = sf.reload()
    assert (
        "line 1" in bad["error"]
        and "max_fps" in bad["error"]
        and set(service.cams)
        == {
            "cam1",
            "door",
            "cam2",
            "http-cam",
        }
    )
    # An id taken by the HTTP camera is refused for that line only.
    _write(f, "rtsp://b.example/2 max_fps=2\nrtsp://z.example/9 id=http-cam\n")
    summary = sf.reload()
    assert summary["removed"] == ["door", "cam2"] and "line 2" in summary["error"] and "exists" in summary["error"]
    assert service.cams["http-cam"] == ("rtsp://h.example/x", None, {}) and set(service.cams) == {"cam1", "http-cam"}


def test_the_line_syntax_is_checked_naming_the_line(tmp_path):
    f = tmp_path / "cams.streams"
    cases = [
        ("rtsp://a/1 fps=5\n", "line 1", "unknown option 'fps'"),
        ("# c\nrtsp://a/1 queue=1.5\n", "line 2", "queue must be an integer"),
        ("rtsp://a/1 id=x\nrtsp://b/2 id=x\n", "line 2", "used by line 1"),
        ("rtsp://a/1 id=no/slash\n", "line 1", "camera must be"),
        ("rtsp://a/1 max_fps\n", "line 1", "key=value"),
        ("rtsp://a/1 max_fps=1 max_fps=2\n", "line 1", "twice"),
    ]
    for text, line, words in cases:
        _write(f, text)
        with pytest.raises(SourceError) as exc:
            parse(str(f))
        assert line in str(exc.value) and words in str(exc.value), (text, str(exc.value))
    _write(f, "rtsp://a/1 id=gate max_fps=2.5 queue=7 policy=every_frame max_staleness_ms=300\n")
    (ln,) = parse(str(f))
    assert ln.camera_id == "gate" and ln.options == {
        "max_fps": 2.5,
        "queue": 7,
        "policy": "every_frame",
        "max_staleness_ms": 300.0,
    }


def test_tandem_detect_refuses_options_it_would_ignore(tmp_path):
    f = tmp_path / "cams.streams"
    _write(f, "rtsp://a/1 id=door\nrtsp://b/2\n")
    assert parse_streams_file(str(f)) == ["rtsp://a/1", "rtsp://b/2"]  # id names the camera (next test)
    _write(f, "rtsp://a/1\nrtsp://b/2 max_fps=5\n")
    with pytest.raises(SourceError) as exc:
        parse_streams_file(str(f))
    assert "line 2" in str(exc.value) and "max_fps" in str(exc.value) and "tandem streams" in str(exc.value)


def test_tandem_detect_names_a_stream_by_its_id(tmp_path):
    """id= is not accepted and ignored by detect: a stream that fails is reported by its id."""
    import socket

    from sources.stream_reader import StreamConfig
    from sources.streams import StreamsSource

    with socket.socket() as s:  # a port nobody listens on: the camera is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    f = tmp_path / "cams.streams"
    _write(f, f"http://127.0.0.1:{port}/cam.mjpg id=door\n")
    with StreamsSource(str(f), StreamConfig(max_retries=0, open_timeout_s=2.0)) as src:
        errors = [fr.error for fr in src.next_batch(timeout=30) if fr.error]
    assert errors and "camera door" in errors[0], errors


def _ready_url(proc, lines: list[str], log) -> str | None:
    for line in lines:
        if "ready, control " in line:
            return line.split("ready, control ", 1)[1].split(",", 1)[0]
    if proc.poll() is not None:
        raise AssertionError(f"tandem streams exited {proc.returncode}: {log.read_text()}")
    return None


def test_the_running_service_follows_edits_and_sighup(tmp_path):
    import httpx

    a, b = MjpegServer(synthetic_frames(6, seed=1), fps=15), MjpegServer(synthetic_frames(6, seed=2), fps=15)
    f = tmp_path / "cams.streams"
    _write(f, f"{a.url} max_fps=5\n{dead_url()} id=gone\n")
    out = tmp_path / "records.jsonl"
    args = (
        f"{f} --no-redis --jsonl {out} --port 0 --imgsz 160 --no-profile --device cpu --reload-interval 0.2 --no-auth"
    )
    log = tmp_path / "streams.log"
    with open(log, "w") as err:
        command = [sys.executable, "-m", "tandem.streams_cli", *args.split()]
        proc = subprocess.Popen(command, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=err)
    try:
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        url = wait_for(lambda: _ready_url(proc, lines, log), 120, "the ready line")

        def rows() -> dict:
            return {c["camera"]: c for c in httpx.get(f"{url}/cameras").json()["cameras"]}

        assert set(rows()) == {"cam0", "gone"}
        # An edit, seen by the mtime poll: gone removed, b added, cam0's rate changed.
        _write(f, f"{a.url} max_fps=2\n{b.url} id=yard\n")
        wait_for(lambda: set(rows()) == {"cam0", "yard"} and rows()["cam0"]["max_fps"] == 2.0, SAFETY_S, "the edit")
        wait_for(lambda: rows()["yard"]["frames"] >= 2, SAFETY_S, "frames of the added camera")
        # SIGHUP reloads whatever the poll sees: here an edit the poll cannot see (same size,
        # same inode, the old mtime put back), so only the signal can make the service notice.
        before, st = f.read_text(), os.stat(f)
        edited = f"{b.url} id=yard\n"
        f.write_text(edited + "#" * (len(before) - len(edited) - 1) + "\n")
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(f).st_size == st.st_size
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: set(rows()) == {"yard"}, SAFETY_S, "the reload at SIGHUP")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(SAFETY_S) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        a.close()
        b.close()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {"cam0", "yard"} <= {r["camera"] for r in records}
    assert "reloaded" in log.read_text()
