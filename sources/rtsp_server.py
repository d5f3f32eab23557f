"""A loopback RTSP camera: Debian's GStreamer RTSP server serving a generated video.

The server side runs under the *system* Python, the one python3-gi and the GStreamer
typelibs are installed for (they are apt packages, not pip ones, so .venv cannot import
them). As a script it serves a test camera by hand:

    /usr/bin/python3 sources/rtsp_server.py --port 8554     # rtsp://127.0.0.1:8554/cam
    .venv/bin/tandem detect rtsp://127.0.0.1:8554/cam --max-frames 100

It needs gir1.2-gst-rtsp-server-1.0, gstreamer1.0-plugins-base, gstreamer1.0-plugins-good
and python3-gi (`.ci/run` installs them). Only base and good plugins are used, so the video
is Motion JPEG over RTP (videotestsrc ! jpegenc ! rtpjpegpay, RFC 2435): no x264enc, which
lives in plugins-ugly. Once the server listens it prints one line, `ready rtsp://HOST:PORT/PATH`,
so whoever starts it waits on that line instead of sleeping; `--port 0` takes a free port
and the line names it.

`RtspCamera` starts the script as a subprocess from the project's Python (tests, demos): it
can be stopped (the camera drops) and started again on the same port (it comes back).

This module imports only the standard library at the top: the system Python runs it as a
script without the project's dependencies, and .venv imports RtspCamera without gi.
"""

from __future__ import annotations

import argparse
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

SYSTEM_PYTHON = "/usr/bin/python3"
APT_PACKAGES = ("gir1.2-gst-rtsp-server-1.0", "gstreamer1.0-plugins-base", "gstreamer1.0-plugins-good", "python3-gi")
MISSING_EXIT = 3  # the script's exit code when GStreamer's RTSP server or a plugin is missing
NEEDS = (
    f"the loopback RTSP camera needs Debian's GStreamer RTSP server for {SYSTEM_PYTHON}: "
    f"apt-get install {' '.join(APT_PACKAGES)}"
)


# -- server side: runs under the system Python -------------------------------------------------
def _pipeline(width: int, height: int, fps: int, pattern: str) -> str:
    # is-live: frames come at the camera's rate, not as fast as jpegenc can make them.
    # I420: RTP/JPEG carries 4:2:0 or 4:2:2 only; left to negotiate, jpegenc may pick 4:4:4
    # and rtpjpegpay drops every frame ("Invalid component"), so the client never gets one.
    # pay0 is the name the RTSP media factory looks for; pt 26 is JPEG's static payload type.
    return (
        f"( videotestsrc is-live=true pattern={pattern} ! video/x-raw,width={width},height={height},"
        f"framerate={fps}/1 ! videoconvert ! video/x-raw,format=I420 ! jpegenc quality=85 "
        f"! rtpjpegpay name=pay0 pt=26 )"
    )


def _gstreamer():
    """(GLib, Gst, GstRtsp, GstRtspServer), initialised; SystemExit(MISSING_EXIT) naming the
    apt packages when the bindings, the RTSP server or one of the pipeline's elements is missing."""
    try:
        import gi

        gi.require_version("Gst", "1.0")
        gi.require_version("GstRtsp", "1.0")
        gi.require_version("GstRtspServer", "1.0")
        from gi.repository import GLib, Gst, GstRtsp, GstRtspServer
    except (ImportError, ValueError) as exc:
        print(f"{NEEDS} ({type(exc).__name__}: {exc})", file=sys.stderr)
        raise SystemExit(MISSING_EXIT) from None
    Gst.init(None)
    missing = [e for e in ("videotestsrc", "videoconvert", "jpegenc", "rtpjpegpay") if not Gst.ElementFactory.find(e)]
    if missing:
        print(f"{NEEDS} (missing GStreamer elements: {', '.join(missing)})", file=sys.stderr)
        raise SystemExit(MISSING_EXIT)
    return GLib, Gst, GstRtsp, GstRtspServer


def serve(host: str, port: int, path: str, width: int, height: int, fps: int, pattern: str, transport: str,
          stop_on_eof: bool) -> int:  # fmt: skip
    GLib, _, GstRtsp, GstRtspServer = _gstreamer()
    server = GstRtspServer.RTSPServer()
    server.set_address(host)
    server.set_service(str(port))
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(_pipeline(width, height, fps, pattern))
    factory.set_shared(True)  # one encoder for every client, as a camera has
    # RTP interleaved in the RTSP TCP connection by default. Over UDP a JPEG frame is a burst
    # of packets that a busy loopback can drop (a torn frame), and a server that dies can
    # leave the client waiting on a UDP port until its read timeout; over TCP a kill is an
    # immediate end of stream. OpenCV's FFmpeg backend asks for TCP anyway (it sets
    # rtsp_transport=tcp unless OPENCV_FFMPEG_CAPTURE_OPTIONS says otherwise) and FFmpeg falls
    # back to UDP when a server answers "461 Unsupported transport", so `--transport udp`
    # serves a camera that takes UDP only.
    protocols = {
        "tcp": GstRtsp.RTSPLowerTrans.TCP,
        "udp": GstRtsp.RTSPLowerTrans.UDP,
        "any": GstRtsp.RTSPLowerTrans.TCP | GstRtsp.RTSPLowerTrans.UDP,
    }[transport]
    factory.set_protocols(protocols)
    server.get_mount_points().add_factory("/" + path.strip("/"), factory)
    try:
        if server.attach(None) == 0:
            raise GLib.Error(f"cannot listen on {host}:{port}")
    except GLib.Error as exc:
        print(f"rtsp_server: {exc.message}", file=sys.stderr)
        return 1

    loop = GLib.MainLoop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, sig, loop.quit)
    if stop_on_eof:  # the parent holds our stdin: when it goes away, so do we (no orphans)

        def on_stdin(fd: int, condition: int) -> bool:
            if condition & GLib.IO_IN and os.read(fd, 4096):
                return True  # input is ignored; only its end matters
            loop.quit()
            return False

        watch = GLib.IO_IN | GLib.IO_HUP | GLib.IO_ERR
        GLib.io_add_watch(sys.stdin.fileno(), GLib.PRIORITY_DEFAULT, watch, on_stdin)
    print(f"ready rtsp://{host}:{server.get_bound_port()}/{path.strip('/')}", flush=True)
    loop.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve a generated test video over RTSP (GStreamer).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8554, help="0: a free port (the ready line names it)")
    p.add_argument("--path", default="cam")
    p.add_argument("--width", type=int, default=320)
    p.add_argument("--height", type=int, default=240)
    p.add_argument("--fps", type=int, default=15)
    p.add_argument("--pattern", default="ball", help="a videotestsrc pattern: ball, smpte, snow, ...")
    p.add_argument("--transport", choices=("tcp", "udp", "any"), default="tcp", help="RTP lower transports offered")
    p.add_argument("--stop-on-eof", action="store_true", help="exit when stdin closes (for a parent process)")
    p.add_argument("--check", action="store_true",
                   help=f"only check that GStreamer has what this needs (exit {MISSING_EXIT} if not)")
    a = p.parse_args(argv)
    if a.check:
        _gstreamer()
        return 0
    if a.width % 8 or a.height % 8 or not 0 < a.width <= 2040 or not 0 < a.height <= 2040:
        p.error("RTP/JPEG (RFC 2435) needs width and height multiples of 8, at most 2040")
    if a.fps <= 0:
        p.error("--fps must be > 0")
    return serve(a.host, a.port, a.path, a.width, a.height, a.fps, a.pattern, a.transport, a.stop_on_eof)


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
    """The script above as a subprocess of the system Python, on 127.0.0.1.

    start() returns once the server prints its ready line (RuntimeError naming the apt
    packages when GStreamer is missing, or with the server's stderr when it fails);
    stop() kills it, as a camera losing power would; start() again serves on the same port.
    `port=0`: a free one, chosen at the first start.
    """

    def __init__(self, port: int = 0, path: str = "cam", width: int = 320, height: int = 240, fps: int = 15,
                 transport: str = "tcp", python: str = SYSTEM_PYTHON,
                 start_timeout_s: float = 20.0) -> None:  # fmt: skip
        self.port, self.path, self.width, self.height, self.fps = port, path, width, height, fps
        self.transport = transport
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
        if not os.access(self.python, os.X_OK):
            raise RuntimeError(f"{NEEDS} ({self.python} not found)")
        if not self.port:
            self.port = _free_port()
        cmd = [self.python, os.path.abspath(__file__), "--host", "127.0.0.1", "--port", str(self.port),
               "--path", self.path, "--width", str(self.width), "--height", str(self.height),
               "--fps", str(self.fps), "--transport", self.transport, "--stop-on-eof"]  # fmt: skip
        err = tempfile.TemporaryFile()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env)
        self._proc = proc
        try:
            line = self._ready_line(proc)
        except BaseException as exc:
            self.stop()
            err.seek(0)
            detail = err.read().decode(errors="replace").strip()[-2000:]
            err.close()
            if proc.returncode == MISSING_EXIT:
                raise RuntimeError(detail or NEEDS) from None
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

    def __enter__(self) -> "RtspCamera":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
