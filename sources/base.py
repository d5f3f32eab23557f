"""The one shape every input takes on its way to a model: a `Frame` with its origin.

Every source kind (image files, directories, globs, `.txt` lists, arrays, videos, live
streams) yields `Frame`s through the `FrameSource` protocol, so the detector loop is the same
for all of them. A bad input becomes a `Frame` whose `error` says what is wrong and whose
`image` is None; the source goes on with the next input. Only a source that cannot start at
all (a missing path, an empty directory, a malformed `.streams` line) raises `SourceError`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

IMAGE_EXTENSIONS = frozenset(
    {"bmp", "dng", "jpeg", "jpg", "jpe", "jp2", "mpo", "png", "tif", "tiff", "webp", "pfm", "pbm", "pgm", "ppm"}
)
VIDEO_EXTENSIONS = frozenset({"asf", "avi", "gif", "m4v", "mkv", "mov", "mp4", "mpeg", "mpg", "ts", "wmv", "webm"})
STREAM_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://", "tcp://", "udp://")

# The most pixels (width x height) an image or frame may have, from any entry point: uploads,
# URLs, files, directories, videos and streams. It is read from the image's header (or the
# video's reported frame size) before anything is decoded, because a few hundred KB of PNG
# or a fabricated JPEG header can say 20000 x 20000 and decoding that costs gigabytes.
# 8192 x 8192 = 67.1 Mpx: 8x a 4K UHD frame (8.3 Mpx), 2x 8K UHD (33.2 Mpx) and above a
# 50 Mpx camera's stills, so no real camera or photo meets it, while the largest image it
# lets through costs about 200 MB decoded (BGR uint8). Raise it with max_image_pixels
# (VisionConfig, StreamConfig, load_source, `tandem streams --max-image-pixels`).
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192


class SourceError(ValueError):
    """A source that cannot start at all; the message names the path, line or field at fault."""


def check_max_pixels(value: object, name: str = "max_image_pixels") -> int:
    """`value` if it is a valid pixel limit (an integer >= 1), else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be an integer >= 1 (width x height; default {DEFAULT_MAX_IMAGE_PIXELS} "
            f"= 8192 x 8192), got {value!r}"
        )
    return value


@dataclass(slots=True)
class Frame:
    """One image on its way to the model, with where it came from.

    `source` is the path, the stream URL or `array:<i>` for in-memory inputs; `index` is the
    frame number within that source (0 for a still image; the decoder's frame number for a
    video, so `vid_stride` skips show up as gaps); `stream` is the stream's position in a
    `.streams` file (None elsewhere). `timestamp` is `time.monotonic()` when the frame was
    read, so frame-to-result latency can be measured against it.
    """

    source: str
    index: int = 0
    image: np.ndarray | None = None  # BGR uint8, H x W x 3
    error: str | None = None
    stream: int | None = None
    timestamp: float = field(default_factory=time.monotonic)

    @property
    def ok(self) -> bool:
        return self.error is None


@runtime_checkable
class FrameSource(Protocol):
    """What the detector loop needs from any source.

    `total` is the number of frames a finite source will yield, if known up front (videos
    count their frames after `vid_stride`), or None for live streams. `close()` ends any
    reader threads and releases files; it is safe to call twice.
    """

    kind: str

    @property
    def total(self) -> int | None: ...

    def __iter__(self) -> Iterator[Frame]: ...

    def close(self) -> None: ...


def extension(path: str) -> str:
    return path.rsplit(".", 1)[-1].lower() if "." in path.rsplit("/", 1)[-1] else ""


def is_stream_url(text: str) -> bool:
    return text.lower().startswith(STREAM_SCHEMES)
