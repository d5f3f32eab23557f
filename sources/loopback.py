"""A loopback MJPEG-over-HTTP camera: a test camera for users, tests and `tandem bench streams`.

    python -m sources.loopback --port 8090 --fps 15          # http://127.0.0.1:8090/cam0.mjpg
    python -m sources.loopback --clip walk.mp4 --loop        # a local clip, looped
    python -m sources.loopback --cameras 4 --streams-file cams.streams   # 4 cameras, 4 free ports
    python -m sources.loopback --rtsp --port 8554            # the same picture over RTSP

The generated picture is sources/scene.py's moving scene: circles, squares and
triangles gliding over a still background, the classes the shipped detector was trained on.
Once every camera listens it prints one line per camera, `ready URL`, so a parent waits on the
lines rather than sleeping; `--port 0` takes a free port and the line names it.

Every client of a camera gets the frame due on the camera's clock (a live camera: a client
that falls behind misses frames, none queue up). `--stamp` writes the camera number and the
frame number (mod the loop's length, at most 256) into a strip of 16 black or white cells at the top of each frame, and
`--send-log PATH` appends `camera frame unix_time` for each frame when it is first sent: a
client can then tell which frame a result is of and how old it is (`read_stamp`).

RTSP (`--rtsp`) is sources/rtsp_server.py: pure Python (RTP/JPEG interleaved over TCP), so it
needs nothing beyond the project's own dependencies; clients need OpenCV's FFmpeg backend.

In-process (tests): `MjpegServer(frames, fps)` binds 127.0.0.1 on a free port and serves the
same paced multipart stream to every client; `stall=True` makes a camera that accepts
connections and sends headers but never a frame.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import cv2
import numpy as np

BOUNDARY = "tandemframe"
STAMP_CELLS, STAMP_CELL_PX = 16, 12  # 8 bits of camera number, then 8 of frame number
STAMP_PERIOD = 256  # stamped frame numbers wrap here


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


def stamp(img: np.ndarray, camera: int, index: int) -> np.ndarray:
    """`img` with `camera` (mod 256) and `index` (mod 256) as 16 black/white cells, top left:
    cells of 12 px survive JPEG and any decoder, and cost the picture one thin strip."""
    out = img.copy()
    bits = ((camera % 256) << 8) | (index % STAMP_PERIOD)
    for k in range(STAMP_CELLS):
        on = (bits >> (STAMP_CELLS - 1 - k)) & 1
        out[:STAMP_CELL_PX, k * STAMP_CELL_PX : (k + 1) * STAMP_CELL_PX] = 255 if on else 0
    return out


def read_stamp(img: np.ndarray) -> tuple[int, int] | None:
    """(camera, frame mod 256) of a frame `stamp` marked; None if the strip is not there."""
    if img is None or img.shape[0] < STAMP_CELL_PX or img.shape[1] < STAMP_CELLS * STAMP_CELL_PX:
        return None
    c = STAMP_CELL_PX // 2
    centres = img[c - 2 : c + 2, : STAMP_CELLS * STAMP_CELL_PX].reshape(4, STAMP_CELLS, STAMP_CELL_PX, -1)
    means = centres[:, :, c - 2 : c + 2].mean(axis=(0, 2, 3))
    if np.any((means > 60) & (means < 195)):  # not a clean black/white cell: no stamp
        return None
    bits = 0
    for m in means:
        bits = (bits << 1) | int(m > 127)
    return bits >> 8, bits & 0xFF


def encode(frames: list[np.ndarray]) -> list[bytes]:
    return [cv2.imencode(".jpg", f, [cv2.IMWRITE_JPEG_QUALITY, 85])[1].tobytes() for f in frames]


class MjpegServer:
    """One camera. `live`: frame n is the one due at n / fps since the server started, for
    every client (a real camera); otherwise each client gets the frames from the first (tests).
    `loop` False ends each stream after the last frame. `send_log(n, unix_time)` is called the
    first time frame n goes out."""

    def __init__(
        self,
        frames: list[np.ndarray] | None = None,
        fps: float = 15.0,
        stall: bool = False,
        *,
        jpegs: list[bytes] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        path: str = "stream.mjpg",
        loop: bool = True,
        live: bool = False,
        send_log: Callable[[int, float], None] | None = None,
    ) -> None:
        if fps <= 0:
            raise ValueError(f"fps must be > 0, got {fps!r}")
        jpegs = jpegs or encode(frames or synthetic_frames())
        self.frames_sent = 0
        self._stop = threading.Event()
        self._epoch = time.monotonic()
        self._logged = -1
        self._log_lock = threading.Lock()
        server = self

        def logged(n: int) -> None:
            if send_log is None:
                return
            with server._log_lock:
                if n > server._logged:
                    server._logged = n
                    send_log(n, time.time())

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test and bench output clean
                pass

            def do_GET(self) -> None:
                if self.path.split("?")[0].lstrip("/") != path:
                    self.send_error(404, f"this camera is /{path}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY}")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                period = 1.0 / fps
                i, next_t = 0, time.monotonic()
                if live:
                    i = int((next_t - server._epoch) / period)
                    next_t = server._epoch + i * period
                try:
                    while not server._stop.is_set():
                        if stall:
                            server._stop.wait(0.05)
                            continue
                        if not loop and i >= len(jpegs):
                            return  # the clip is over: end of stream
                        data = jpegs[i % len(jpegs)]
                        self.wfile.write(
                            f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                            + data
                            + b"\r\n"
                        )
                        logged(i)
                        server.frames_sent += 1
                        next_t += period
                        server._stop.wait(max(0.0, next_t - time.monotonic()))
                        i += 1
                        if live:  # a client that fell behind gets the frame due now, as from a camera
                            i = max(i, int((time.monotonic() - server._epoch) / period))
                            next_t = server._epoch + i * period
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://{host}:{self.port}/{path}"
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


# -- the command line -----------------------------------------------------------------------------
def clip_frames(path: str, limit: int = 3000) -> list[np.ndarray]:
    """The frames of a local clip (at most `limit`, held in memory as the camera's loop)."""
    cap = cv2.VideoCapture(path)
    frames = []
    try:
        while len(frames) < limit:
            ok, img = cap.read()
            if not ok:
                break
            frames.append(img)
    finally:
        cap.release()
    if not frames:
        raise SystemExit(f"loopback: no frames could be read from {path!r}")
    return frames


def _picture(a) -> list[np.ndarray]:
    if a.clip:
        return clip_frames(a.clip)
    from sources.scene import moving_scene

    return moving_scene(a.frames, a.width, a.height, seed=a.seed)


class _SendLog:
    """`camera frame unix_time` lines, buffered and flushed about every second."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1 << 16)  # lives as long as the process
        self._lock = threading.Lock()
        self._last = time.monotonic()

    def __call__(self, camera: int, n: int, t: float) -> None:
        with self._lock:
            self._f.write(f"{camera} {n} {t:.6f}\n")
            if time.monotonic() - self._last > 1.0:
                self._f.flush()
                self._last = time.monotonic()

    def flush(self) -> None:
        with self._lock:
            self._f.flush()


def _rtsp(a, frames: list[np.ndarray]) -> int:
    from sources import rtsp_server

    def picture(n: int, t: float) -> np.ndarray:
        return frames[n % len(frames)]

    servers = []
    for k in range(a.cameras):
        port = a.port + k if a.port else 0
        server = rtsp_server.CameraServer(a.host, port, f"cam{k}", a.width, a.height, int(a.fps), picture=picture)
        threading.Thread(target=server.serve_forever, name=f"rtsp-{k}", daemon=True).start()
        servers.append(f"rtsp://{a.host}:{server.server_address[1]}/cam{k}")
    return _announce(a, servers)


def _announce(a, urls: list[str]) -> int:
    for url in urls:
        print(f"ready {url}", flush=True)
    if a.streams_file:
        with open(a.streams_file, "w") as f:
            f.write("".join(u + "\n" for u in urls))
        print(f"wrote {a.streams_file}", flush=True)
    if a.stop_on_eof:
        while os.read(sys.stdin.fileno(), 4096):
            pass  # input is ignored; only its end matters
        return 0
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sources.loopback",
        description="Serve a test camera over MJPEG (HTTP) or RTSP: a generated scene of moving circles, squares "
        "and triangles (the shipped detector's classes) or a local clip. Prints `ready URL` per camera.",
        epilog="Example: `python -m sources.loopback --cameras 2 --fps 10 --streams-file cams.streams &` "
        "then, once it prints its URLs, `tandem streams cams.streams`.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="first camera's port; camera k gets port+k (0: free ports)")
    p.add_argument("--fps", type=float, default=15.0, help="frames per second of every camera (default 15)")
    p.add_argument("--cameras", type=int, default=1, help="how many cameras, each on its own port (default 1)")
    p.add_argument("--clip", help="serve this local video instead of the generated scene")
    p.add_argument("--loop", action="store_true", help="with --clip: loop it (otherwise the stream ends with it)")
    p.add_argument("--streams-file", help="also write the cameras' URLs to this .streams file")
    p.add_argument("--rtsp", action="store_true", help="serve RTSP (RTP/JPEG over TCP) instead of MJPEG")
    p.add_argument("--width", type=int, default=320, help="generated scene's width (default 320)")
    p.add_argument("--height", type=int, default=240, help="generated scene's height (default 240)")
    p.add_argument("--frames", type=int, default=STAMP_PERIOD, help="generated scene's loop length in frames")
    p.add_argument("--seed", type=int, default=0, help="generated scene's seed")
    p.add_argument("--stamp", action="store_true", help="mark camera and frame number in each frame (read_stamp)")
    p.add_argument("--send-log", help="append `camera frame unix_time` for each frame sent to this file")
    p.add_argument("--stop-on-eof", action="store_true", help="exit when stdin closes (for a parent process)")
    a = p.parse_args(argv)
    if a.fps <= 0:
        p.error("--fps must be > 0")
    if a.cameras < 1:
        p.error("--cameras must be >= 1")
    if a.loop and not a.clip:
        p.error("--loop applies to --clip (the generated scene always loops)")
    frames = _picture(a)
    if a.stamp and len(frames) > STAMP_PERIOD:
        p.error(f"--stamp numbers frames mod {STAMP_PERIOD}: use --frames <= {STAMP_PERIOD} or a shorter clip")
    if a.rtsp:
        if a.stamp or a.send_log or (a.clip and not a.loop):
            p.error("--rtsp serves a looping picture without --stamp or --send-log")
        return _rtsp(a, frames)
    log = _SendLog(a.send_log) if a.send_log else None
    plain = None if a.stamp else encode(frames)
    urls = []
    for k in range(a.cameras):
        jpegs = encode([stamp(f, k, i) for i, f in enumerate(frames)]) if a.stamp else plain
        send = None if log is None else (lambda n, t, k=k: log(k, n, t))
        server = MjpegServer(
            jpegs=jpegs,
            fps=a.fps,
            host=a.host,
            port=a.port + k if a.port else 0,
            path=f"cam{k}.mjpg",
            loop=a.loop or not a.clip,
            live=a.loop or not a.clip,  # a clip played once starts from its first frame for each client
            send_log=send,
        )
        urls.append(server.url)
    try:
        return _announce(a, urls)
    finally:
        if log is not None:
            log.flush()


if __name__ == "__main__":
    sys.exit(main())
