"""An MJPEG-over-HTTP client with real timeouts.

OpenCV's FFmpeg backend can read MJPEG too, but a server that accepts the connection and
then stalls can block its read for a long time, and the error it gives is "read failed".
Reading the multipart stream ourselves bounds every wait by a socket timeout and names the
failure (refused, HTTP status, wrong content type, stalled). Each part is sized from its
JPEG header before it is decoded: one over `max_pixels` raises ImageTooLarge, decoding nothing.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import urllib.parse
from collections.abc import Iterator

import numpy as np

from sources.base import DEFAULT_MAX_IMAGE_PIXELS
from sources.media import decode_image


class NotMjpeg(Exception):
    """The server answered, but with something other than multipart JPEG (let FFmpeg try)."""


def _boundary(content_type: str) -> bytes | None:
    for part in content_type.split(";")[1:]:
        key, _, value = part.strip().partition("=")
        if key.lower() == "boundary" and value:
            value = value.strip('"')
            return value.encode() if value.startswith("--") else b"--" + value.encode()
    return None


def iter_mjpeg(
    url: str,
    open_timeout_s: float,
    read_timeout_s: float,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    address: str | None = None,
) -> Iterator[np.ndarray]:
    """Decoded BGR frames from an MJPEG HTTP stream until it ends (iter_mjpeg_parts, images only)."""
    for image, _ in iter_mjpeg_parts(url, open_timeout_s, read_timeout_s, max_pixels, address):
        yield image


def iter_mjpeg_parts(
    url: str,
    open_timeout_s: float,
    read_timeout_s: float,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    address: str | None = None,
) -> Iterator[tuple[np.ndarray, bytes]]:
    """(decoded BGR frame, its JPEG as sent) from an MJPEG HTTP stream until it ends: the bytes
    go to event clips (workers/camera_clips.py), which would otherwise encode the frame again.
    Raises on any failure, and ImageTooLarge (a ValueError naming the limit) for a part whose
    header is over `max_pixels`.

    Raises NotMjpeg when the resource is not multipart (e.g. an HLS playlist or an MP4 file
    served over HTTP) so the caller can hand the URL to FFmpeg instead. `address`: the IP to
    connect to (one workers.urlguard checked) instead of resolving the host again; the host
    still goes into Host and, for https, into SNI and the certificate check.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=open_timeout_s, context=ssl.create_default_context()
        )
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=open_timeout_s)
    if address is not None:  # http.client dials through this hook; TLS wraps what it returns
        conn._create_connection = lambda addr, *args: socket.create_connection((address, addr[1]), *args)
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Accept": "multipart/x-mixed-replace, image/jpeg"})
        sock = conn.sock  # an HTTP/1.0 response detaches it from conn; the response still reads it
        resp = conn.getresponse()
        if resp.status != 200:
            raise ConnectionError(f"HTTP {resp.status} {resp.reason}")
        content_type = resp.getheader("Content-Type", "")
        boundary = _boundary(content_type)
        if not content_type.lower().startswith("multipart/") or boundary is None:
            raise NotMjpeg(f"Content-Type {content_type!r} is not multipart MJPEG")
        sock.settimeout(read_timeout_s)  # from here on a stalled server times out per read
        while True:
            line = resp.readline()
            if not line:
                return  # the server closed the stream
            if not line.startswith(boundary):
                continue
            headers = {}
            while line := resp.readline().strip():
                key, _, value = line.decode("latin-1").partition(":")
                headers[key.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0") or 0)
            if length <= 0:
                raise ConnectionError("MJPEG part without Content-Length")
            data = resp.read(length)
            if len(data) < length:
                return  # truncated by a closing server
            yield decode_image(data, f"MJPEG part ({length} bytes)", max_pixels), data  # ValueError: undecodable
    finally:
        conn.close()
