"""Frame sources: every input kind Ultralytics' predict accepts, behind one protocol.

    source = load_source("videos/*.mp4", vid_stride=2)
    for frame in source:          # Frame(source, index, image, error, stream, timestamp)
        ...
    source.close()

Kinds: an image file, a directory, a glob, a `.txt` list of paths, a video file, numpy arrays
and PIL images (one or a list), a `.streams` file, a single stream URL or a webcam index.
"""

from __future__ import annotations

import os
from typing import Any

from sources.base import Frame, FrameSource, SourceError, is_stream_url
from sources.files import ArraySource, FileSource
from sources.stream_reader import StreamConfig, StreamHealth
from sources.streams import StreamsSource, parse_streams_file


def _in_memory(value: Any) -> bool:
    return type(value).__module__ in ("numpy",) or type(value).__module__.startswith("PIL.")


def load_source(
    source: Any, vid_stride: int = 1, stream_config: StreamConfig | None = None, start_streams: bool = True
) -> FrameSource:
    """The FrameSource for `source`; SourceError names what is wrong if it cannot start.
    `start_streams=False`: live streams start reading at the first iteration (or start())."""
    if isinstance(source, (list, tuple)) and source and all(_in_memory(s) for s in source):
        return ArraySource(source)
    if _in_memory(source):
        return ArraySource([source])
    if isinstance(source, int) and not isinstance(source, bool):
        return StreamsSource(str(source), stream_config, start=start_streams)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str):
        if not source.strip():
            raise SourceError("source is an empty string")
        if source.endswith(".streams") or is_stream_url(source) or source.isdigit():
            return StreamsSource(source, stream_config, start=start_streams)
        return FileSource(source, vid_stride)
    if isinstance(source, (list, tuple)) and source and all(isinstance(s, (str, os.PathLike)) for s in source):
        return FileSource(source, vid_stride)
    raise SourceError(
        f"unsupported source of type {type(source).__name__}: expected a path, directory, glob, .txt list, "
        f"video, .streams file, stream URL, webcam index, numpy array or PIL image (or a list of them)"
    )


__all__ = [
    "ArraySource", "FileSource", "Frame", "FrameSource", "SourceError", "StreamConfig", "StreamHealth",
    "StreamsSource", "load_source", "parse_streams_file",
]  # fmt: skip
