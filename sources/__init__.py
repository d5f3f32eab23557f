"""Frame sources: every input kind Ultralytics' predict accepts, behind one protocol.

    source = load_source("videos/*.mp4", vid_stride=2)
    for frame in source:          # Frame(source, index, image, error, stream, timestamp)
        ...
    source.close()

Kinds: an image file, a directory, a glob, a `.txt` list of paths, a video file, numpy arrays
and PIL images (one or a list), a `.streams` file, a single stream URL or a webcam index.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from sources.base import DEFAULT_MAX_IMAGE_PIXELS, Frame, FrameSource, SourceError, check_max_pixels, is_stream_url
from sources.files import ArraySource, FileSource
from sources.stream_reader import StreamConfig, StreamHealth
from sources.streams import StreamsSource, parse_streams_file


def _in_memory(value: Any) -> bool:
    return type(value).__module__ in ("numpy",) or type(value).__module__.startswith("PIL.")


def load_source(
    source: Any,
    vid_stride: int = 1,
    stream_config: StreamConfig | None = None,
    start_streams: bool = True,
    max_image_pixels: int | None = None,
) -> FrameSource:
    """The FrameSource for `source`; SourceError names what is wrong if it cannot start.
    `start_streams=False`: live streams start reading at the first iteration (or start()).
    `max_image_pixels`: the most pixels an image or frame may have, checked before decoding
    (None: stream_config's for streams, else DEFAULT_MAX_IMAGE_PIXELS, 8192 x 8192); given, it
    replaces stream_config's too."""
    if max_image_pixels is None:
        max_image_pixels = stream_config.max_image_pixels if stream_config is not None else DEFAULT_MAX_IMAGE_PIXELS
    try:
        check_max_pixels(max_image_pixels)
    except ValueError as exc:
        raise SourceError(str(exc)) from None
    if stream_config is None:
        stream_config = StreamConfig(max_image_pixels=max_image_pixels)
    elif stream_config.max_image_pixels != max_image_pixels:
        stream_config = dataclasses.replace(stream_config, max_image_pixels=max_image_pixels)
    if isinstance(source, (list, tuple)) and source and all(_in_memory(s) for s in source):
        return ArraySource(source, max_image_pixels)
    if _in_memory(source):
        return ArraySource([source], max_image_pixels)
    if isinstance(source, int) and not isinstance(source, bool):
        return StreamsSource(str(source), stream_config, start=start_streams)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str):
        if not source.strip():
            raise SourceError("source is an empty string")
        if source.endswith(".streams") or is_stream_url(source) or source.isdigit():
            return StreamsSource(source, stream_config, start=start_streams)
        return FileSource(source, vid_stride, max_image_pixels)
    if isinstance(source, (list, tuple)) and source and all(isinstance(s, (str, os.PathLike)) for s in source):
        return FileSource(source, vid_stride, max_image_pixels)
    raise SourceError(
        f"unsupported source of type {type(source).__name__}: expected a path, directory, glob, .txt list, "
        f"video, .streams file, stream URL, webcam index, numpy array or PIL image (or a list of them)"
    )


__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ArraySource",
    "FileSource",
    "Frame",
    "FrameSource",
    "SourceError",
    "StreamConfig",
    "StreamHealth",
    "StreamsSource",
    "load_source",
    "parse_streams_file",
]
