"""A loopback RTSP camera: a small pure-Python RTSP server serving a generated video.

It needs nothing but the project's own dependencies (numpy, OpenCV), so it runs under the
project's Python on any machine. By hand:

    .venv/bin/python -m sources.rtsp_server --port 8554        # rtsp://127.0.0.1:8554/cam
    .venv/bin/tandem detect rtsp://127.0.0.1:8554/cam --max-frames 100

The video is a white ball moving on black (like GStreamer's videotestsrc pattern=ball), JPEG
encoded by OpenCV and sent as RTP/JPEG (RFC 2435) interleaved in the RTSP TCP connection
(RFC 2326 section 10.12). Only TCP is offered: over UDP a JPEG frame is a burst of packets that
a busy loopback can drop (a torn frame), and a server that dies leaves the client waiting on a
UDP port until its read timeout, whereas over TCP a kill is an immediate end of stream. OpenCV's
FFmpeg backend asks for TCP anyway, and FFmpeg retries over TCP after "461 Unsupported
Transport". Once the server listens it prints one line, `ready rtsp://HOST:PORT/PATH`, so
whoever starts it waits on that line instead of sleeping; `--port 0` takes a free port and
the line names it.

`RtspCamera` starts this module as a subprocess (tests, demos): it can be stopped (the camera
drops), frozen (it hangs) and started again on the same port (it comes back).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import select
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass

import cv2
import numpy as np

SERVER = "tandem-test-camera"
PUBLIC = "OPTIONS, DESCRIBE, SETUP, PLAY, PAUSE, TEARDOWN, GET_PARAMETER, SET_PARAMETER"
PAYLOAD_TYPE = 26  # JPEG's static RTP payload type (RFC 3551)
CLOCK_HZ = 90000  # RTP clock of every video payload
MAX_SCAN_BYTES = 1400  # scan data per packet: what would fit an Ethernet MTU were this UDP
SEND_TIMEOUT_S = 10  # a client that takes nothing for this long is gone: drop it, free the thread
# A client that sends nothing for this long is gone too (a half-open connection, or one that
# never PLAYs). Playing clients keep the session alive well within it: FFmpeg sends RTCP
# receiver reports every few seconds and a keep-alive at half the session timeout (60 s).
RECV_TIMEOUT_S = 120


# -- the picture -------------------------------------------------------------------------------
def ball_frame(t: float, width: int, height: int) -> np.ndarray:
    """The frame at `t` seconds: a white disc on black on a Lissajous path, so every frame
    differs, and a decoded one is neither blank nor grey mush (the tests check both)."""
    img = np.zeros((height, width, 3), np.uint8)
    r = max(2, min(width, height) // 8)
    x = width / 2 + (width / 2 - r - 1) * math.sin(2 * math.pi * t / 4.0)
    y = height / 2 + (height / 2 - r - 1) * math.sin(2 * math.pi * t / 3.0)
    cv2.circle(img, (round(x), round(y)), r, (255, 255, 255), -1, cv2.LINE_AA)
    return img


def encode_jpeg(img: np.ndarray) -> bytes:
    # RTP/JPEG carries 4:2:0 (Type 1) or 4:2:2 (Type 0) only, and the receiver rebuilds the
    # JPEG headers with the standard Huffman tables: so baseline, no optimised tables, 4:2:0.
    params = [cv2.IMWRITE_JPEG_QUALITY, 85, cv2.IMWRITE_JPEG_OPTIMIZE, 0, cv2.IMWRITE_JPEG_PROGRESSIVE, 0]
    if hasattr(cv2, "IMWRITE_JPEG_SAMPLING_FACTOR"):  # OpenCV >= 4.5.5; older ones write 4:2:0
        params += [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420]
    ok, buf = cv2.imencode(".jpg", img, params)
    if not ok:
        raise RuntimeError("cv2.imencode failed")
    return buf.tobytes()


# -- RFC 2435: what of a JPEG goes on the wire -------------------------------------------------
@dataclass(frozen=True, slots=True)
class JpegScan:
    width: int
    height: int
    qtables: bytes  # 128 bytes: luma table (id 0) then chroma (id 1), zigzag order as stored
    scan: bytes  # entropy-coded data between the SOS header and EOI


def parse_jpeg(data: bytes) -> JpegScan:
    """The parts RFC 2435 sends; ValueError for a JPEG it cannot carry as Type 1 (4:2:0)."""
    if data[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG (no SOI)")
    tables: dict[int, bytes] = {}
    size = None
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            raise ValueError(f"no marker at byte {pos}")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        seg = data[pos + 4 : pos + 2 + length]
        if marker == 0xDB:  # DQT: one segment may hold several tables
            i = 0
            while i < len(seg):
                precision, tid = seg[i] >> 4, seg[i] & 0x0F
                if precision:
                    raise ValueError("16-bit quantization tables are not RTP/JPEG's Q=255 8-bit ones")
                tables[tid] = seg[i + 1 : i + 65]
                i += 65
        elif marker == 0xC0:  # SOF0, baseline
            bits, height, width, ncomp = struct.unpack("!BHHB", seg[:6])
            comps = [tuple(seg[6 + 3 * k : 9 + 3 * k]) for k in range(ncomp)]
            # Type 1: Y sampled 2x2 with table 0, Cb and Cr 1x1 with table 1, in that order
            if bits != 8 or [(c[1], c[2]) for c in comps] != [(0x22, 0), (0x11, 1), (0x11, 1)]:
                raise ValueError(f"not 8-bit YCbCr 4:2:0 (components {comps})")
            if width % 8 or height % 8 or not 0 < width <= 2040 or not 0 < height <= 2040:
                raise ValueError(f"{width}x{height}: RTP/JPEG needs multiples of 8, at most 2040")
            size = (width, height)
        elif 0xC1 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            raise ValueError(f"SOF{marker - 0xC0}: only baseline JPEG (SOF0) is carried")
        elif marker == 0xDD and int.from_bytes(seg[:2], "big"):
            raise ValueError("restart intervals (DRI) need RTP/JPEG types 64-127, not sent here")
        elif marker == 0xDA:  # SOS: the scan runs from after its header to EOI
            end = data.rfind(b"\xff\xd9")
            if size is None or sorted(tables) != [0, 1] or end < pos:
                raise ValueError("a JPEG without SOF0, both quantization tables and EOI")
            return JpegScan(size[0], size[1], tables[0] + tables[1], data[pos + 2 + length : end])
        pos += 2 + length
    raise ValueError("no SOS in JPEG")


def rtp_jpeg_packets(frame: JpegScan, seq: int, timestamp: int, ssrc: int) -> list[bytes]:
    """The RTP packets of one frame (RFC 3550 header + RFC 2435 JPEG header), sequence numbers
    from `seq`, the marker bit on the last: that is how the receiver knows the frame is whole."""
    packets = []
    scan = frame.scan
    for offset in range(0, len(scan), MAX_SCAN_BYTES):
        chunk = scan[offset : offset + MAX_SCAN_BYTES]
        last = offset + MAX_SCAN_BYTES >= len(scan)
        rtp = struct.pack(
            "!BBHII",
            0x80,
            (0x80 if last else 0) | PAYLOAD_TYPE,
            (seq + len(packets)) & 0xFFFF,
            timestamp & 0xFFFFFFFF,
            ssrc,
        )
        # type-specific 0, fragment offset, Type 1 (4:2:0), Q 255 (tables in band), size in 8-pixel blocks
        jpeg = struct.pack("!I4B", offset, 1, 255, frame.width // 8, frame.height // 8)
        if offset == 0:  # Q >= 128: the tables come with the first fragment of every frame
            jpeg += struct.pack("!BBH", 0, 0, len(frame.qtables)) + frame.qtables
        packets.append(rtp + jpeg + chunk)
    return packets


def interleaved(channel: int, packet: bytes) -> bytes:
    return b"$" + bytes([channel]) + len(packet).to_bytes(2, "big") + packet  # RFC 2326 10.12


# -- the camera: one clock and one encoder for every client, as a real camera has ----------------
class FrameClock:
    """Makes frame n at its due time and keeps only the newest: a client that falls behind
    skips frames, as with a live camera, rather than queueing them."""

    def __init__(self, width: int, height: int, fps: float, picture=None) -> None:
        self.width, self.height, self.fps = width, height, fps
        # picture(n, t) -> BGR frame n at t seconds (sources/loopback.py's scene or clip); the ball by default
        self.picture = picture or (lambda n, t: ball_frame(t, width, height))
        self.cond = threading.Condition()
        self.index = -1  # of the newest frame
        self.frame: JpegScan | None = None
        self.rtp_time = 0  # 90 kHz capture time of the newest frame
        self._epoch = time.monotonic()
        threading.Thread(target=self._run, name="frame-clock", daemon=True).start()

    def _run(self) -> None:
        period, n, due = 1.0 / self.fps, 0, time.monotonic()
        while True:
            now = time.monotonic()
            if now < due:
                time.sleep(due - now)
            elif now - due > 1.0:  # woken from SIGSTOP: carry on from now, not with a burst
                due = now
            t = due - self._epoch
            frame = parse_jpeg(encode_jpeg(self.picture(n, t)))
            with self.cond:
                self.index, self.frame, self.rtp_time = n, frame, round(t * CLOCK_HZ)
                self.cond.notify_all()
            n += 1
            due += period

    def next_after(self, index: int, timeout: float) -> tuple[int, JpegScan, int] | None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.index > index, timeout):
                return None
            return self.index, self.frame, self.rtp_time


# -- RTSP --------------------------------------------------------------------------------------
REASONS = {
    200: "OK",
    404: "Not Found",
    455: "Method Not Valid in This State",
    461: "Unsupported Transport",
    501: "Not Implemented",
}


class Session:
    """One RTSP connection: requests are read on the handler's thread, RTP is sent from a
    thread of its own after PLAY; both write to the socket, so under one lock."""

    def __init__(self, sock: socket.socket, camera: CameraServer) -> None:
        self.sock, self.camera = sock, camera
        self.lock = threading.Lock()
        self.playing = threading.Event()
        self.closed = threading.Event()
        self.session_id: str | None = None
        self.channel = 0
        self.seq = random.getrandbits(16)  # RFC 3550: random initial sequence number, timestamp
        self.ts_offset = random.getrandbits(32)
        self.ssrc = random.getrandbits(32)
        self.streamer: threading.Thread | None = None

    def send(self, data: bytes) -> None:
        with self.lock:
            self.sock.sendall(data)

    def respond(self, cseq: str, code: int, headers: dict[str, str] | None = None, body: bytes = b"") -> None:
        lines = [f"RTSP/1.0 {code} {REASONS[code]}", f"CSeq: {cseq}", f"Server: {SERVER}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body:
            lines.append(f"Content-Length: {len(body)}")
        self.send(("\r\n".join(lines) + "\r\n\r\n").encode() + body)

    def serve(self) -> None:
        reader = self.sock.makefile("rb")
        try:
            while (request := read_request(reader)) is not None:
                if not self.handle(*request):
                    break
        except (OSError, ValueError):
            pass  # the client went away or sent garbage: either way this connection is over
        finally:
            self.closed.set()
            self.playing.clear()
            reader.close()

    def handle(self, method: str, url: str, headers: dict[str, str]) -> bool:
        """Answer one request; False when the connection is to close."""
        cseq = headers.get("cseq", "0")
        path = urllib.parse.urlsplit(url).path.rstrip("/")
        mount = "/" + self.camera.path
        session = {"Session": f"{self.session_id};timeout=60"} if self.session_id else {}
        if method == "OPTIONS":
            self.respond(cseq, 200, {"Public": PUBLIC})
        elif method == "DESCRIBE":
            if path != mount:
                self.respond(cseq, 404)
            else:
                base = url.rstrip("/")
                body = self.camera.sdp().encode()
                self.respond(cseq, 200, {"Content-Type": "application/sdp", "Content-Base": f"{base}/"}, body)
        elif method == "SETUP":
            # The track's URL (…/cam/track0) or, from clients that ignore a=control, the mount's
            if path != mount and not path.startswith(mount + "/"):
                self.respond(cseq, 404)
                return True
            # Transport may list alternatives, most preferred first: take the first over TCP
            tcp = [t for t in headers.get("transport", "").split(",") if "RTP/AVP/TCP" in t.upper()]
            if not tcp:
                self.respond(cseq, 461)
                return True
            a, b = 0, 1
            for param in tcp[0].split(";"):
                if param.strip().lower().startswith("interleaved="):
                    lo, _, hi = param.split("=", 1)[1].partition("-")
                    a = int(lo)
                    b = int(hi) if hi else a + 1
            self.channel = a
            self.session_id = self.session_id or f"{random.getrandbits(48):012x}"
            self.respond(
                cseq,
                200,
                {"Transport": f"RTP/AVP/TCP;unicast;interleaved={a}-{b}", "Session": f"{self.session_id};timeout=60"},
            )
        elif method == "PLAY":
            if not self.session_id:
                self.respond(cseq, 455)
                return True
            with self.camera.clock.cond:
                rtptime = (self.ts_offset + self.camera.clock.rtp_time + round(CLOCK_HZ / self.camera.fps)) & 0xFFFFFFFF
            base = url.rstrip("/")
            track = base if base.endswith("/track0") else f"{base}/track0"
            self.respond(cseq, 200, {**session, "RTP-Info": f"url={track};seq={self.seq & 0xFFFF};rtptime={rtptime}"})
            self.playing.set()
            if self.streamer is None:
                self.streamer = threading.Thread(target=self.stream, name="rtp", daemon=True)
                self.streamer.start()
        elif method == "PAUSE":
            self.playing.clear()
            self.respond(cseq, 200, session)
        elif method in ("GET_PARAMETER", "SET_PARAMETER"):  # FFmpeg's keep-alive
            self.respond(cseq, 200, session)
        elif method == "TEARDOWN":
            self.playing.clear()
            self.respond(cseq, 200)
            return False
        else:
            self.respond(cseq, 501, {"Public": PUBLIC})
        return True

    def stream(self) -> None:
        index = self.camera.clock.index  # start with the next frame, not a stale one
        try:
            while not self.closed.is_set():
                if not self.playing.wait(timeout=0.5):
                    continue
                got = self.camera.clock.next_after(index, timeout=0.5)
                if got is None or not self.playing.is_set():
                    continue
                index, frame, rtp_time = got
                packets = rtp_jpeg_packets(frame, self.seq, self.ts_offset + rtp_time, self.ssrc)
                self.seq += len(packets)
                self.send(b"".join(interleaved(self.channel, p) for p in packets))
        except OSError:
            pass  # the client closed (or stopped reading): the request thread sees the end too
        finally:
            self.closed.set()
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes the request thread's read
            except OSError:
                pass


def read_request(reader) -> tuple[str, str, dict[str, str]] | None:
    """The next RTSP request as (method, url, headers), or None at the end of the connection.
    Interleaved binary frames from the client (RTCP receiver reports on the odd channel)
    share the connection: they start with '$' and are skipped."""
    while True:
        first = reader.read(1)
        if not first:
            return None
        if first == b"$":  # '$', channel, 2-byte length, payload
            head = reader.read(3)
            length = int.from_bytes(head[1:], "big")
            if len(head) < 3 or len(reader.read(length)) < length:
                return None
            continue
        if first in b"\r\n":  # stray line ends between requests
            continue
        parts = (first + reader.readline(8192)).decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("RTSP/"):
            raise ValueError(f"not an RTSP request line: {parts}")
        headers: dict[str, str] = {}
        while line := reader.readline(8192).decode("latin-1").strip():
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0") or 0)
        if not 0 <= length <= 1 << 16:  # read(-1) would read to the end of the connection
            raise ValueError(f"Content-Length {length} is not a body size this server takes")
        if length:  # SET_PARAMETER and the like may carry a body; nothing here reads it
            reader.read(length)
        return parts[0].upper(), parts[1], headers


class CameraServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # come back on the same port at once, whatever is in TIME_WAIT
    daemon_threads = True
    request_queue_size = 32  # a frozen camera's kernel still accepts retries into the backlog

    def __init__(self, host: str, port: int, path: str, width: int, height: int, fps: int, picture=None) -> None:
        self.path, self.fps = path.strip("/"), fps
        self.sdp_id = random.getrandbits(32)
        super().__init__((host, port), Handler)
        self.clock = FrameClock(width, height, fps, picture)

    def sdp(self) -> str:
        return "\r\n".join(
            [
                "v=0",
                f"o=- {self.sdp_id} 1 IN IP4 127.0.0.1",
                "s=Tandem test camera",
                "c=IN IP4 0.0.0.0",
                "t=0 0",
                f"m=video 0 RTP/AVP {PAYLOAD_TYPE}",
                "a=control:track0",
                f"a=framerate:{self.fps}",
                f"a=rtpmap:{PAYLOAD_TYPE} JPEG/{CLOCK_HZ}",
                "",
            ]
        )


class Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A blocked sendall would hold the write lock for ever; with a send timeout it fails
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", RECV_TIMEOUT_S, 0))
        Session(sock, self.server).serve()


def serve(host: str, port: int, path: str, width: int, height: int, fps: int, stop_on_eof: bool) -> int:
    try:
        server = CameraServer(host, port, path, width, height, fps)
    except OSError as exc:
        print(f"rtsp_server: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    if stop_on_eof:  # the parent holds our stdin: when it goes away, so do we (no orphans)

        def watch_stdin() -> None:
            while os.read(sys.stdin.fileno(), 4096):
                pass  # input is ignored; only its end matters
            os._exit(0)

        threading.Thread(target=watch_stdin, name="stdin", daemon=True).start()
    print(f"ready rtsp://{host}:{server.server_address[1]}/{server.path}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve a generated test video over RTSP (RTP/JPEG over TCP).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8554, help="0: a free port (the ready line names it)")
    p.add_argument("--path", default="cam")
    p.add_argument("--width", type=int, default=320)
    p.add_argument("--height", type=int, default=240)
    p.add_argument("--fps", type=int, default=15)
    p.add_argument("--stop-on-eof", action="store_true", help="exit when stdin closes (for a parent process)")
    a = p.parse_args(argv)
    if a.width % 8 or a.height % 8 or not 0 < a.width <= 2040 or not 0 < a.height <= 2040:
        p.error("RTP/JPEG (RFC 2435) needs width and height multiples of 8, at most 2040")
    if a.fps <= 0:
        p.error("--fps must be > 0")
    return serve(a.host, a.port, a.path, a.width, a.height, a.fps, a.stop_on_eof)


# -- client side: the project's Python starts and stops the server -------------------------------
def _free_port() -> int:
    """A free loopback port below the ephemeral range. The camera comes back on its port
    after a stop, and meanwhile the port must stay free: a port from the ephemeral range
    could be taken as the source port of some outgoing connection, even of a reader's own
    reconnect (TCP connects to itself when source and destination port coincide)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all taken (or an odd range): any free port will do
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RtspCamera:
    """The server above as a subprocess of this Python (`-m sources.rtsp_server`), on 127.0.0.1.

    start() returns once the server prints its ready line (RuntimeError with the server's
    stderr when it fails); stop() kills it, as a camera losing power would; start() again
    serves on the same port. `port=0`: a free one, chosen at the first start.
    """

    def __init__(
        self,
        port: int = 0,
        path: str = "cam",
        width: int = 320,
        height: int = 240,
        fps: int = 15,
        python: str = sys.executable,
        start_timeout_s: float = 20.0,
    ) -> None:
        self.port, self.path, self.width, self.height, self.fps = port, path, width, height, fps
        self.python, self.start_timeout_s = python, start_timeout_s
        self.starts = 0
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("the camera has no port until it has started once")
        return f"rtsp://127.0.0.1:{self.port}/{self.path}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> str:
        if self.running:
            return self.url
        if not self.port:
            self.port = _free_port()
        cmd = [
            self.python,
            "-m",
            "sources.rtsp_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--path",
            self.path,
            "--width",
            str(self.width),
            "--height",
            str(self.height),
            "--fps",
            str(self.fps),
            "--stop-on-eof",
        ]
        # From the directory that holds the `sources` package, `-m` finds it installed or not
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        err = tempfile.TemporaryFile()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=root)
        self._proc = proc
        try:
            line = self._ready_line(proc)
        except BaseException as exc:
            self.stop()
            err.seek(0)
            detail = err.read().decode(errors="replace").strip()[-2000:]
            err.close()
            if isinstance(exc, RuntimeError) and detail:
                raise RuntimeError(f"{exc}: {detail}") from None
            raise
        err.close()  # the server keeps its own descriptor; ours is no longer needed
        self.port = int(line.rsplit(":", 1)[1].split("/", 1)[0])
        self.starts += 1
        return self.url

    def _ready_line(self, proc: subprocess.Popen) -> str:
        deadline = time.monotonic() + self.start_timeout_s
        assert proc.stdout is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"the RTSP server did not report ready within {self.start_timeout_s:g} s")
            readable, _, _ = select.select([proc.stdout], [], [], remaining)
            if not readable:
                continue
            line = proc.stdout.readline().decode(errors="replace").strip()
            if line.startswith("ready rtsp://"):
                return line
            if not line:  # end of its stdout: it exited
                proc.wait(timeout=5)
                raise RuntimeError(f"the RTSP server exited with code {proc.returncode} before it was ready")

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its sockets open and sends nothing, like a hung camera."""
        if not self.running:
            raise RuntimeError("the camera is not running")
        os.kill(self._proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT: a frozen camera carries on."""
        if self.running:
            os.kill(self._proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()  # SIGKILL: no goodbye to clients, the kernel just closes the sockets
        proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    close = stop

    def __enter__(self) -> RtspCamera:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
