"""Finite sources: image files, directories, globs, `.txt` lists, videos, arrays and PIL images.

The inputs are resolved to a list of entries up front (cheap: paths only), so that a source
that cannot start fails at once with a clear `SourceError`, and a progress bar knows its
total. Decoding happens lazily, one frame at a time, so memory stays at one frame.
"""

from __future__ import annotations

import glob as globlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sources.base import (
    DEFAULT_MAX_IMAGE_PIXELS,
    IMAGE_EXTENSIONS,
    VIDEO_EXTENSIONS,
    Frame,
    SourceError,
    check_max_pixels,
    extension,
)
from sources.media import count_video_frames, iter_video, read_image, to_bgr


@dataclass(slots=True)
class Entry:
    """One input of a file source: an image, a video, or an input already known to be bad."""

    path: str
    kind: str  # "image" | "video" | "error"
    error: str | None = None


def _classify(path: str) -> Entry:
    ext = extension(path)
    if ext in IMAGE_EXTENSIONS:
        return Entry(path, "image")
    if ext in VIDEO_EXTENSIONS:
        return Entry(path, "video")
    # An explicitly named file with an unknown suffix is still tried as an image: a decode
    # error then says precisely whether it is one.
    return Entry(path, "image")


def _media_in(paths: Sequence[str]) -> list[Entry]:
    """Images and videos among `paths` (other files in a directory or glob are skipped, as
    Ultralytics does, so a README next to the images is no error)."""
    return [_classify(p) for p in sorted(paths) if extension(p) in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS]


def _from_list_file(path: str) -> list[Entry]:
    """A `.txt` file naming one image or video per line; relative paths are resolved against
    the list's own folder, so a list works from any working directory."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"cannot read list file {path}: {exc}") from exc
    entries = []
    for lineno, line in enumerate(lines, 1):
        name = line.strip()
        if not name or name.startswith("#"):
            continue
        full = name if os.path.isabs(name) else os.path.normpath(os.path.join(folder, name))
        if not os.path.isfile(full):
            entries.append(Entry(full, "error", f"{path} line {lineno}: file not found: {name}"))
        else:
            entries.append(_classify(full))
    if not entries:
        raise SourceError(f"list file {path} names no files (blank lines and # comments are skipped)")
    return entries


def resolve(source: str) -> list[Entry]:
    """Entries for one path-like source; SourceError if it names nothing at all."""
    if any(ch in source for ch in "*?[") and not os.path.exists(source):
        matches = [p for p in globlib.glob(source, recursive=True) if os.path.isfile(p)]
        entries = _media_in(matches)
        if not entries:
            raise SourceError(f"glob {source!r} matches no images or videos ({len(matches)} other files)")
        return entries
    if os.path.isdir(source):
        names = [os.path.join(source, n) for n in os.listdir(source)]
        entries = _media_in([p for p in names if os.path.isfile(p)])
        if not entries:
            raise SourceError(f"directory {source} holds no images or videos")
        return entries
    if not os.path.exists(source):
        raise SourceError(f"source not found: {source} (no such file, directory or glob match)")
    if extension(source) == "txt":
        return _from_list_file(source)
    return [_classify(source)]


class FileSource:
    """Images and videos from paths, directories, globs and `.txt` lists, in order. An image
    or video over `max_image_pixels` (from its header, before decoding) is an error frame."""

    kind = "files"

    def __init__(
        self,
        sources: str | os.PathLike | Sequence[str | os.PathLike],
        vid_stride: int = 1,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> None:
        if not isinstance(vid_stride, int) or vid_stride < 1:
            raise SourceError(f"vid_stride must be an integer >= 1, got {vid_stride!r}")
        try:
            self.max_image_pixels = check_max_pixels(max_image_pixels)
        except ValueError as exc:
            raise SourceError(str(exc)) from None
        items = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
        if not items:
            raise SourceError("no sources given")
        self.vid_stride = vid_stride
        self.entries: list[Entry] = [e for item in items for e in resolve(os.fspath(item))]
        self._total: int | None = None
        self._closed = False

    @property
    def total(self) -> int | None:
        """Frames this source will yield; unknown (None) if a video does not report its length."""
        if self._total is None:
            n = 0
            for e in self.entries:
                if e.kind == "video":
                    count = count_video_frames(e.path, self.vid_stride)
                    if count is None:
                        return None
                    n += count
                else:
                    n += 1
            self._total = n
        return self._total

    def __iter__(self) -> Iterator[Frame]:
        for entry in self.entries:
            if self._closed:
                return
            if entry.kind == "error":
                yield Frame(entry.path, error=entry.error)
            elif entry.kind == "video":
                for frame in iter_video(entry.path, self.vid_stride, self.max_image_pixels):
                    if self._closed:
                        return
                    yield frame
            else:
                image, error = read_image(entry.path, self.max_image_pixels)
                yield Frame(entry.path, image=image, error=error)

    def close(self) -> None:
        self._closed = True


class ArraySource:
    """In-memory numpy arrays (BGR) and PIL images (RGB, converted); a bad one becomes an
    error frame naming its position, as does one over `max_image_pixels`, for the same limit
    holds for every input (it is decoded already: the limit spares the work after)."""

    kind = "arrays"

    def __init__(self, images: Sequence[object], max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        try:
            self.max_image_pixels = check_max_pixels(max_image_pixels)
        except ValueError as exc:
            raise SourceError(str(exc)) from None
        self.images = list(images)
        if not self.images:
            raise SourceError("no images given")

    @property
    def total(self) -> int:
        return len(self.images)

    def __iter__(self) -> Iterator[Frame]:
        for i, value in enumerate(self.images):
            name = f"array:{i}"
            try:
                yield Frame(name, image=to_bgr(value, name, self.max_image_pixels))
            except ValueError as exc:
                yield Frame(name, error=str(exc))

    def close(self) -> None:
        self.images = []
