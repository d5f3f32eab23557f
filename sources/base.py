"""The one shape every input takes on its way to a model: a `Frame` with its origin.

Every source kind (image files, directories, globs, `.txt` lists, arrays, videos, live
streams) yields `Frame`s through the `FrameSource` protocol, so the detector loop is the same
for all of them. A bad input becomes a `Frame` whose `error` says what is wrong and whose
`image` is None; the source goes on with the next input. Only a source that cannot start at
all (a missing path, an empty directory, a malformed `.streams` line) raises `SourceError`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol, runtime_checkable

import numpy as np

IMAGE_EXTENSIONS = frozenset(
    {"bmp", "dng", "jpeg", "jpg", "jpe", "jp2", "mpo", "png", "tif", "tiff", "webp", "pfm", "pbm", "pgm", "ppm"}
)
VIDEO_EXTENSIONS = frozenset({"asf", "avi", "gif", "m4v", "mkv", "mov", "mp4", "mpeg", "mpg", "ts", "wmv", "webm"})
STREAM_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://", "tcp://", "udp://")


class SourceError(ValueError):
    """A source that cannot start at all; the message names the path, line or field at fault."""


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
