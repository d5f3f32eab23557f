"""RTSP on loopback: sources/rtsp_server.py, a small pure-Python RTSP server, serves a generated
video (a white ball on black, RTP/JPEG per RFC 2435, interleaved in the RTSP TCP connection),
the project's stream reader decodes it with OpenCV's FFmpeg, and a camera that drops and comes
back, or hangs and recovers, is reconnected with backoff. Raw-socket sessions check the wire
format itself: the RTSP answers and the RTP packets of a frame.

The server needs only the project's own dependencies (numpy, OpenCV), so these tests run on
any machine `make test` has set up.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import sys
import urllib.parse
from typing import NamedTuple

import cv2
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stream_helpers import take_until

from sources import StreamConfig, load_source
from sources.rtsp_server import RtspCamera
from sources.stream_reader import TERMINAL

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
    # the test camera's ball: a white disc on black, so a decoded frame is neither blank nor grey mush
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


# -- the wire format, over a raw socket ---------------------------------------------------------
class Interleaved(NamedTuple):  # a `$` frame: RTP or RTCP on a channel of the RTSP connection
    channel: int
    payload: bytes


class RawRtsp:
    """A bare RTSP client: requests and their responses, and the interleaved frames between."""

    def __init__(self, url: str) -> None:
        u = urllib.parse.urlsplit(url)
        # the timeout bounds every read: a server that never answers fails the test, not hangs it
        self.sock = socket.create_connection((u.hostname, u.port), timeout=5)
        self.reader = self.sock.makefile("rb")
        self.cseq = 0
        self.skipped: list[Interleaved] = []  # read while awaiting a response

    def close(self) -> None:
        self.reader.close()
        self.sock.close()

    def send(self, method: str, url: str, **headers: str) -> int:
        self.cseq += 1
        lines = [f"{method} {url} RTSP/1.0", f"CSeq: {self.cseq}"]
        lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        return self.cseq

    def request(self, method: str, url: str, **headers: str) -> tuple[str, dict[str, str], bytes]:
        cseq = self.send(method, url, **headers)
        while True:
            item = self.read()
            assert item is not None, f"the server closed the connection instead of answering {method}"
            if isinstance(item, Interleaved):
                self.skipped.append(item)
                continue
            status, got, body = item
            assert got.get("cseq") == str(cseq), (status, got)
            return status, got, body

    def read(self):
        """The next thing on the connection: Interleaved for a `$` frame,
        (status line, headers, body) for a response, None at the end."""
        first = self.reader.read(1)
        if not first:
            return None
        if first == b"$":
            channel, length = struct.unpack("!BH", self.reader.read(3))
            return Interleaved(channel, self.reader.read(length))
        status = (first + self.reader.readline()).decode().strip()
        headers = {}
        while line := self.reader.readline().decode().strip():
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        body = self.reader.read(int(headers.get("content-length", 0)))
        return status, headers, body

    def packet(self, channel: int = 0) -> bytes:
        while True:
            item = self.read()
            assert item is not None, "the connection ended while streaming"
            if isinstance(item, Interleaved) and item.channel == channel:
                return item.payload


def _rtp(packet: bytes) -> dict:
    """RFC 3550 header and RFC 2435 JPEG header of one RTP/JPEG packet."""
    b0, b1, seq, ts, ssrc = struct.unpack("!BBHII", packet[:12])
    tspec, off_hi, off_lo, typ, q, w8, h8 = struct.unpack("!BBHBBBB", packet[12:20])
    p = dict(
        version=b0 >> 6,
        pt=b1 & 0x7F,
        marker=b1 >> 7,
        seq=seq,
        ts=ts,
        ssrc=ssrc,
        type_specific=tspec,
        offset=(off_hi << 16) | off_lo,
        type=typ,
        q=q,
        width=w8 * 8,
        height=h8 * 8,
        data=packet[20:],
    )
    if p["offset"] == 0 and q >= 128:  # the quantization table header comes with the first fragment
        mbz, precision, length = struct.unpack("!BBH", packet[20:24])
        p.update(qheader=(mbz, precision, length), tables=packet[24 : 24 + length], data=packet[24 + length :])
    return p


def _frame_packets(client: RawRtsp) -> list[dict]:
    """The packets of the next whole frame: from a fragment at offset 0 to the marker bit."""
    p = _rtp(client.packet())
    while p["offset"] != 0:  # joined mid-frame: wait for the next one
        p = _rtp(client.packet())
    packets = [p]
    while not packets[-1]["marker"]:
        assert len(packets) < 200, "no marker bit after 200 packets: the frame never ends"
        packets.append(_rtp(client.packet()))
    return packets


def _check_frame(packets: list[dict]) -> bytes:
    first = packets[0]
    seqs = [p["seq"] for p in packets]
    assert seqs == [(first["seq"] + i) & 0xFFFF for i in range(len(packets))], seqs  # no gaps, no repeats
    assert [p["marker"] for p in packets] == [0] * (len(packets) - 1) + [1]  # only the last ends the frame
    for p in packets:
        assert (p["version"], p["pt"], p["type_specific"]) == (2, 26, 0)
        assert (p["ts"], p["ssrc"]) == (first["ts"], first["ssrc"])  # one frame, one timestamp
        assert (p["type"], p["q"], p["width"], p["height"]) == (1, 255, W, H)  # Type 1: 4:2:0
    assert first["qheader"] == (0, 0, 128) and len(first["tables"]) == 128  # two 8-bit tables in band
    # luma's first: JPEG's standard chroma table (Annex K), at any quality, quantizes more coarsely
    luma, chroma = first["tables"][:64], first["tables"][64:]
    assert sum(chroma) > sum(luma), (list(luma), list(chroma))
    assert all("qheader" not in p for p in packets[1:])
    scan = b""
    for p in packets:
        assert p["offset"] == len(scan), "fragments must follow each other"
        scan += p["data"]
    assert 0 < len(scan) and not scan.endswith(b"\xff\xd9")  # scan data only: the receiver adds EOI
    return scan


def test_raw_session_streams_rtp_jpeg_frames_interleaved(camera):
    url = camera.url
    client = RawRtsp(url)
    try:
        status, headers, _ = client.request("OPTIONS", url)
        assert status == "RTSP/1.0 200 OK" and headers["server"] == "tandem-test-camera"
        public = {m.strip() for m in headers["public"].split(",")}
        assert public >= {"OPTIONS", "DESCRIBE", "SETUP", "PLAY", "PAUSE", "TEARDOWN", "GET_PARAMETER", "SET_PARAMETER"}

        status, headers, body = client.request("DESCRIBE", url, Accept="application/sdp")
        assert status == "RTSP/1.0 200 OK" and headers["content-type"] == "application/sdp"
        assert headers["content-base"] == url + "/"
        sdp = body.decode().splitlines()
        assert sdp[0] == "v=0"
        assert {"m=video 0 RTP/AVP 26", "a=rtpmap:26 JPEG/90000", "a=control:track0", f"a=framerate:{FPS}"} <= set(sdp)

        status, headers, _ = client.request("SETUP", url + "/track0", Transport="RTP/AVP/TCP;unicast;interleaved=0-1")
        assert status == "RTSP/1.0 200 OK", status
        assert headers["transport"] == "RTP/AVP/TCP;unicast;interleaved=0-1"
        session = headers["session"].split(";")[0]

        status, headers, _ = client.request("PLAY", url + "/", Session=session, Range="npt=0.000-")
        assert status == "RTSP/1.0 200 OK", status
        info = dict(kv.split("=", 1) for kv in headers["rtp-info"].split(";"))
        assert info["url"] == url + "/track0"

        first_packet = _rtp(client.packet())
        assert first_packet["seq"] == int(info["seq"])  # RTP-Info names the first packet's sequence number
        a = _check_frame(_frame_packets(client))
        b_packets = _frame_packets(client)
        b = _check_frame(b_packets)
        assert a != b  # the ball moves
        # frames on the camera's 90 kHz clock: a whole number of frame periods apart
        period = 90000 // FPS
        step = (b_packets[0]["ts"] - first_packet["ts"]) % 2**32
        assert step > 0 and abs(step / period - round(step / period)) < 0.01, step

        # While streaming, the client sends RTCP receiver reports on the odd channel: the server
        # must skip them and still answer a keep-alive on the same connection.
        rr = struct.pack("!BBHI", 0x80, 201, 1, 0x1234)
        client.sock.sendall(b"$\x01" + len(rr).to_bytes(2, "big") + rr)
        status, _, _ = client.request("GET_PARAMETER", url + "/", Session=session)
        assert status == "RTSP/1.0 200 OK"
        assert client.request("TEARDOWN", url + "/", Session=session)[0] == "RTSP/1.0 200 OK"
        while (item := client.read()) is not None:  # the server closes; at most packets in flight before that
            assert isinstance(item, Interleaved)
    finally:
        client.close()


def test_udp_only_setup_is_refused_with_461_and_tcp_then_works(camera):
    url = camera.url
    client = RawRtsp(url)
    try:
        assert client.request("DESCRIBE", url)[0] == "RTSP/1.0 200 OK"
        status, _, _ = client.request("SETUP", url + "/track0", Transport="RTP/AVP;unicast;client_port=5000-5001")
        assert status == "RTSP/1.0 461 Unsupported Transport"
        # FFmpeg's answer to 461: the same SETUP over TCP, on the same connection
        status, headers, _ = client.request("SETUP", url + "/track0", Transport="RTP/AVP/TCP;unicast;interleaved=2-3")
        assert status == "RTSP/1.0 200 OK" and headers["transport"] == "RTP/AVP/TCP;unicast;interleaved=2-3"
        session = headers["session"].split(";")[0]
        assert client.request("PLAY", url, Session=session)[0] == "RTSP/1.0 200 OK"
        assert _rtp(client.packet(channel=2))["pt"] == 26  # on the channel asked for
    finally:
        client.close()


def test_wrong_path_is_404_and_the_reader_reports_it(camera):
    wrong = camera.url.rsplit("/", 1)[0] + "/no-such-camera"
    client = RawRtsp(wrong)
    try:
        status, headers, body = client.request("DESCRIBE", wrong)
        assert status.startswith("RTSP/1.0 404"), status
        assert headers["server"] == "tandem-test-camera" and body == b""
    finally:
        client.close()
    src = load_source(wrong, stream_config=StreamConfig(**FAST, max_retries=0))
    try:
        frames = take_until(src, lambda fr: any(f.error for f in fr), 15.0)
        assert not _ok(frames)
        (error,) = [fr for fr in frames if fr.error]
        assert "refused" in error.error and wrong in error.error
        assert src.wait_for(lambda hs: hs[0].state == "failed", timeout=10), _health(src)
    finally:
        src.close()


def test_opencv_decodes_the_ball(camera):
    """OpenCV's FFmpeg, the client the project uses, rebuilds the JPEG from the RTP/JPEG headers
    and tables: a wrong type or table would give a torn or discoloured picture, not a clean disc."""
    params = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, 10000, cv2.CAP_PROP_READ_TIMEOUT_MSEC, 5000]
    cap = cv2.VideoCapture(camera.url, cv2.CAP_FFMPEG, params)
    try:
        assert cap.isOpened()
        assert cap.get(cv2.CAP_PROP_FPS) == FPS  # from the SDP's a=framerate
        ok, image = cap.read()
    finally:
        cap.release()
    assert ok and image.shape == (H, W, 3)
    disc = image.min(axis=2) > 200  # white: every channel bright
    r = min(W, H) // 8
    assert 0.8 * np.pi * r * r < disc.sum() < 1.2 * np.pi * r * r, disc.sum()
    ys, xs = np.nonzero(disc)
    assert xs.max() - xs.min() <= 2 * r + 2 and ys.max() - ys.min() <= 2 * r + 2  # one disc, not streaks
    spread = image.max(axis=2).astype(int) - image.min(axis=2)
    assert spread.max() < 40, spread.max()  # white on black is grey throughout: no colour cast
    assert (image.max(axis=2) <= 40).sum() > 0.95 * (W * H - np.pi * r * r)  # black around it


def test_script_serves_by_hand_and_exits_when_stdin_closes():
    """`python sources/rtsp_server.py --port 0` as a person would run it (not -m): it prints the
    ready line naming the port it took, and with --stop-on-eof it goes when its parent does."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sources", "rtsp_server.py")
    proc = subprocess.Popen(
        [sys.executable, script, "--port", "0", "--path", "by-hand", "--stop-on-eof"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "no ready line within 20 s"
        line = proc.stdout.readline().decode().strip()
        assert line.startswith("ready rtsp://127.0.0.1:") and line.endswith("/by-hand"), (line, proc.stderr.read())
        url = line.split()[1]
        client = RawRtsp(url)
        try:
            assert client.request("DESCRIBE", url)[0] == "RTSP/1.0 200 OK"
        finally:
            client.close()
        proc.stdin.close()  # the parent goes away
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
