"""A loopback MJPEG-over-HTTP camera, for tests, the benchmark and the demo.

Binds 127.0.0.1 on a free port and serves the same paced multipart stream to every client,
so `.streams` handling is exercised against a real socket rather than a mock. `stall=True`
makes a camera that accepts connections and sends headers but never a frame.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import cv2
import numpy as np

BOUNDARY = "tandemframe"


def synthetic_frames(n: int = 15, width: int = 320, height: int = 240, seed: int = 0) -> list[np.ndarray]:
    """`n` distinct BGR frames: moving rectangles and a frame number, so they are real JPEGs."""
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(n):
        img = np.full((height, width, 3), 40, np.uint8)
        for k in range(3):
            x = int((i * 7 + k * width // 3) % (width - 40))
            y = int(height // 4 + k * height // 5)
            color = tuple(int(c) for c in rng.integers(60, 255, 3))
            cv2.rectangle(img, (x, y), (x + 40, y + 30), color, -1)
        cv2.putText(img, str(i), (8, 24), cv2.FONT_HERSHEY_SIMPLEX, 0.8, (255, 255, 255), 2)
        frames.append(img)
    return frames


class MjpegServer:
    def __init__(self, frames: list[np.ndarray] | None = None, fps: float = 15.0, stall: bool = False) -> None:
        if fps <= 0:
            raise ValueError(f"fps must be > 0, got {fps!r}")
        jpegs = [
            cv2.imencode(".jpg", f, [cv2.IMWRITE_JPEG_QUALITY, 85])[1].tobytes() for f in frames or synthetic_frames()
        ]
        self.frames_sent = 0
        self._stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test and bench output clean
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY}")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                period, i, next_t = 1.0 / fps, 0, time.monotonic()
                try:
                    while not server._stop.is_set():
                        if stall:
                            server._stop.wait(0.05)
                            continue
                        data = jpegs[i % len(jpegs)]
                        self.wfile.write(
                            f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                            + data
                            + b"\r\n"
                        )
                        server.frames_sent += 1
                        i += 1
                        next_t += period
                        server._stop.wait(max(0.0, next_t - time.monotonic()))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/stream.mjpg"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=f"mjpeg-{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MjpegServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dead_url() -> str:
    """A loopback URL nothing listens on: bind a port, then free it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/stream.mjpg"
