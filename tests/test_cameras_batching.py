"""The camera muxer (workers/cameras_mux.py): frames of several cameras share one forward pass,
and a camera that is dead, stalled or slow never holds a group back.

A real Runtime with the test detector and loopback MJPEG cameras: two live at 30 fps, one
live at 3 fps, one that connects and never sends a frame, one URL nothing listens on. Every
wait is on a condition (records arriving) with a deadline.
"""

from __future__ import annotations

import threading

import pytest
from camera_helpers import FAST, POLICY, SAFETY_S, VISION, Lines

from server.metrics import render
from sources.loopback import MjpegServer, dead_url, synthetic_frames
from sources.stream_reader import StreamConfig
from workers.cameras import CameraService


def count(records: list[dict], camera: str) -> int:
    return sum(r["camera"] == camera and r["frame"] is not None for r in records)


@pytest.fixture(scope="module")
def runtime():
    from runtime.runtime import Runtime

    with Runtime(vision=VISION, profile=False) as rt:
        yield rt


@pytest.fixture(scope="module")
def cams():
    servers = {
        "a": MjpegServer(synthetic_frames(15, seed=1), fps=30),
        "b": MjpegServer(synthetic_frames(15, seed=2), fps=30),
        "slow": MjpegServer(synthetic_frames(15, seed=3), fps=3),
        "stalled": MjpegServer(stall=True),
    }
    yield {**{name: s.url for name, s in servers.items()}, "dead": dead_url()}
    for s in servers.values():
        s.close()


def run(runtime, cams, names, n: int, **kw) -> tuple[list[dict], dict, CameraService]:
    """Records of `names` until cameras a and b have `n` each past their first 10, and the payload."""
    lines = Lines()
    service = CameraService(runtime, None, jsonl=lines, stream_config=FAST, url_policy=POLICY, **kw)
    try:
        for name in names:
            service.add(name, cams[name])
        lines.wait(lambda rs: min(count(rs, "a"), count(rs, "b")) >= 10)  # past connecting
        start = len(lines.records)
        records = lines.wait(lambda rs: min(count(rs[start:], "a"), count(rs[start:], "b")) >= n)[start:]
        return records, service.payload(), service
    finally:
        service.close()


def test_a_group_holds_a_frame_of_every_live_camera_and_never_waits_for_a_dead_one(runtime, cams):
    records, payload, _ = run(runtime, cams, ["a", "b", "slow", "stalled", "dead"], 40)
    live = [r for r in records if r["camera"] in ("a", "b") and r["frame"] is not None]
    rows = {row["camera"]: row for row in payload["cameras"]}
    assert rows["stalled"]["up"] == rows["dead"]["up"] == 0 and rows["a"]["up"] == rows["b"]["up"] == 1

    # The two 30 fps cameras go together: a group holds a frame of each, and the group shares
    # one forward pass (the batch size the detector reports is the pass's).
    groups = [r["group_size"] for r in live]
    assert sum(g >= 2 for g in groups) >= 0.8 * len(groups), groups
    assert sum(r["batch_size"] >= 2 for r in live) >= 0.8 * len(live), [r["batch_size"] for r in live]
    assert rows["a"]["batch_size_mean"] > 1.5 and rows["b"]["batch_size_mean"] > 1.5

    # Neither the stalled, the dead nor the 3 fps camera holds groups back: groups close as
    # soon as the live cameras due in the window are in, not when the window runs out.
    mux = payload["batching"]
    assert mux["batches"] > 0 and mux["closed"]["complete"] >= 0.8 * mux["batches"], mux
    assert 0 < mux["window_ms"] <= 40 and mux["batch_size_mean"] > 1.5
    assert count(records, "slow") >= 1  # the slow camera's frames still go, in whatever group is open

    # Batch size and window are in /metrics.
    page = render([{**payload, "instance": "mux"}]).decode()
    assert 'tandem:camera_mux_window_seconds{tandem_instance="mux"}' in page
    assert 'tandem:camera_mux_batch_size_bucket{le="2.0",tandem_instance="mux"}' in page
    assert 'tandem:camera_batch_size_mean{camera="a",tandem_instance="mux"}' in page


def test_the_service_refuses_a_bad_window(runtime):
    for bad in (-1, 1001, "5", True):
        with pytest.raises(ValueError, match="batch_timeout_ms"):
            CameraService(runtime, None, batch_timeout_ms=bad)


class FreezingCamera:
    """An MJPEG camera that sends `n` frames at 30 fps, then keeps the connection open and sends
    nothing more: a camera that froze, which health calls "stalled" only after stall_after_s."""

    def __init__(self, n: int = 10) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from sources.loopback import BOUNDARY, encode

        jpegs, stop = encode(synthetic_frames(n, seed=7)), threading.Event()
        self.stop, self.frozen = stop, threading.Event()
        frozen = self.frozen

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY}")
                self.end_headers()
                for data in jpegs:
                    head = f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(data)}\r\n\r\n"
                    self.wfile.write(head.encode() + data + b"\r\n")
                    self.wfile.flush()
                    if stop.wait(1 / 30):
                        return
                frozen.set()
                stop.wait()

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/stream.mjpg"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()


def test_a_camera_that_froze_holds_no_group_before_it_shows_stalled(runtime, cams):
    frozen = FreezingCamera()
    lines = Lines()
    slow_to_stall = StreamConfig(open_timeout_s=0.5, read_timeout_s=30, stall_after_s=30, backoff_initial_s=0.1)
    service = CameraService(runtime, None, jsonl=lines, stream_config=slow_to_stall, url_policy=POLICY)
    try:
        for name in ("a", "b"):
            service.add(name, cams[name])
        service.add("frozen", frozen.url)
        assert frozen.frozen.wait(SAFETY_S)
        start = len(lines.wait(lambda rs: count(rs, "frozen") >= 1))
        before = dict(service.payload()["batching"]["closed"])
        lines.wait(lambda rs: min(count(rs[start:], "a"), count(rs[start:], "b")) >= 30)
        payload = service.payload()
    finally:
        frozen.close()  # first: its reader's read ends with the connection, not at read_timeout_s
        service.close()
    rows = {row["camera"]: row for row in payload["cameras"]}
    assert rows["frozen"]["state"] == "live"  # not yet stalled by its health, 30 s away
    closed = {k: v - before[k] for k, v in payload["batching"]["closed"].items()}
    # Groups after the freeze close as soon as a and b are in, not at the end of the window.
    assert closed["complete"] >= 0.8 * sum(closed.values()), closed
