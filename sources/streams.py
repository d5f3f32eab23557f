"""Many live streams at once: a `.streams` file, a single URL, or a webcam index.

Each stream has its own reader thread (sources/stream_reader.py). A batch holds the newest
frame of every stream that has one (8 live streams give a batch of 8), plus an error frame
for each stream that has just gone down, so the consumer reports failures in line with
results. Memory is bounded by streams x max(1, buffer) frames.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from sources.base import Frame, SourceError, is_stream_url
from sources.stream_reader import TERMINAL, StreamConfig, StreamHealth, StreamReader

_OPTION = re.compile(r"([a-z_]+)=(\S*)")
_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(slots=True, frozen=True)
class StreamLine:
    """One camera line of a `.streams` file: `SOURCE [key=value ...]`. The options are left as
    text; what each key means and takes is the reader's (`tandem streams`: workers/streams_file.py)."""

    lineno: int
    source: str  # a stream URL, a webcam index or a video file's full path
    options: dict[str, str]


def read_streams_lines(path: str) -> list[StreamLine]:
    """The camera lines of a `.streams` file. A line is a source (a stream URL: rtsp, rtmp,
    http(s), tcp, udp; a webcam index; or a local video file, relative to the file's folder)
    followed by optional `key=value` words; blank lines and # comments are skipped. Anything
    else is a SourceError naming the line. The words are taken from the right, so a file name
    with spaces still works; a URL has no spaces, so its own '=' never counts as one."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError as exc:
        raise SourceError(f"source not found: {path}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"cannot read streams file {path}: {exc}") from exc
    folder = os.path.dirname(os.path.abspath(path))
    out = []
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        options: dict[str, str] = {}
        while len(words) > 1 and (m := _OPTION.fullmatch(words[-1])):
            key, value = m.groups()
            if key in options:
                raise SourceError(f"{path} line {lineno}: {key}= given twice")
            if not value:
                raise SourceError(f"{path} line {lineno}: {key}= has no value")
            options[key] = value
            words.pop()
        out.append(
            StreamLine(lineno, _line_source(path, folder, lineno, " ".join(words)), dict(reversed(options.items())))
        )
    if not out:
        raise SourceError(f"streams file {path} lists no streams (blank lines and # comments are skipped)")
    return out


def _line_source(path: str, folder: str, lineno: int, text: str) -> str:
    if is_stream_url(text) or text.isdigit():
        if "://" in text and not text.split("://", 1)[1].strip("/"):
            raise SourceError(f"{path} line {lineno}: stream URL {text!r} has no host")
        if any(c.isspace() for c in text):
            raise SourceError(f"{path} line {lineno}: {text!r}: a URL has no spaces; options are key=value words")
        return text
    full = text if os.path.isabs(text) else os.path.join(folder, text)
    if os.path.isfile(full):
        return full
    raise SourceError(
        f"{path} line {lineno}: {text!r} is neither a stream URL (rtsp://, rtmp://, http(s)://, tcp://, "
        f"udp://), a webcam index nor an existing video file"
    )


def parse_streams_file(path: str) -> list[str]:
    """The sources of a `.streams` file (read_streams_lines), for `tandem detect`: see
    parse_streams_ids, which also gives each line's `id=`."""
    return [source for source, _ in parse_streams_ids(path)]


def parse_streams_ids(path: str) -> list[tuple[str, str | None]]:
    """(source, id or None) per line of a `.streams` file, for `tandem detect`, which reads each
    line's source and its `id=` (checked: 1-64 characters of [A-Za-z0-9._-], unique): the id
    names the stream in what detect reports of it ("camera door"), as tandem streams does.
    Every other option (max_fps=, policy=, tracker=, ...) belongs to `tandem streams`, and is
    an error naming the line here rather than a setting silently not applied."""
    entries = read_streams_lines(path)
    seen: dict[str, int] = {}
    for e in entries:
        other = sorted(set(e.options) - {"id"})
        if other:
            raise SourceError(
                f"{path} line {e.lineno}: {other[0]}= is a `tandem streams` option; `tandem detect` reads only "
                f"the source and id= (remove it, or run tandem streams)"
            )
        camera_id = e.options.get("id")
        if camera_id is not None:
            if not _ID.fullmatch(camera_id):
                raise SourceError(f"{path} line {e.lineno}: id must be 1-64 characters of [A-Za-z0-9._-]")
            if camera_id in seen:
                raise SourceError(f"{path} line {e.lineno}: id {camera_id} is taken by line {seen[camera_id]}")
            seen[camera_id] = e.lineno
    return [(e.source, e.options.get("id")) for e in entries]


class StreamsSource:
    kind = "streams"

    def __init__(self, source: str | Sequence[str], config: StreamConfig | None = None, start: bool = True) -> None:
        """`start=False` defers reading until start() or the first iteration, so frames read
        while the consumer is still loading its model are not dropped."""
        self.config = config or StreamConfig()
        if isinstance(source, str):
            entries = parse_streams_ids(source) if source.endswith(".streams") else [(source, None)]
        else:
            entries = [(u, None) for u in source]
        if not entries:
            raise SourceError("no streams given")
        self.urls = urls = [u for u, _ in entries]
        self._cond = threading.Condition()
        self._errors: deque[Frame] = deque(maxlen=4 * len(urls))  # bounded even if nobody reads
        self._closed = False
        self.readers = [
            StreamReader(i, u, self.config, self._cond, self._report, name=None if cid is None else f"camera {cid}")
            for i, (u, cid) in enumerate(entries)
        ]
        if start:
            self.start()

    def start(self) -> None:
        """Start every reader thread (idempotent)."""
        for r in self.readers:
            r.start()

    @property
    def total(self) -> None:
        return None  # live: unknown length

    def _report(self, frame: Frame) -> None:
        with self._cond:
            self._errors.append(frame)
            self._cond.notify_all()

    def _finished(self) -> bool:
        return self._closed or (
            all(r.state in TERMINAL for r in self.readers)
            and not any(r.has_frame() for r in self.readers)
            and not self._errors
        )

    def next_batch(self, timeout: float | None = None) -> list[Frame]:
        """Error frames for streams that went down, then one frame from each stream that has
        one (the newest, or the oldest of its FIFO). Waits up to `timeout` seconds (None:
        until something arrives or every stream has ended); [] on timeout or at the end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.start()
        with self._cond:
            while not (self._errors or any(r.has_frame() for r in self.readers) or self._finished()):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return []
                self._cond.wait(remaining)
            batch = list(self._errors)
            self._errors.clear()
            batch.extend(f for r in self.readers if (f := r.take()) is not None)
            return batch

    @property
    def finished(self) -> bool:
        with self._cond:
            return self._finished()

    def __iter__(self) -> Iterator[Frame]:
        while True:
            batch = self.next_batch(timeout=0.5)
            if not batch and self.finished:
                return
            yield from batch

    def health(self) -> list[StreamHealth]:
        now = time.monotonic()
        with self._cond:
            return [r.health(now) for r in self.readers]

    def wait_for(self, predicate: Callable[[list[StreamHealth]], bool], timeout: float | None = None) -> bool:
        """Block until `predicate(health())` holds or the source closes; whether it holds.

        The predicate is re-checked whenever a reader changes state, reads a frame or reports
        an error (each notifies the source's condition), so a supervisor or a test waits on
        the streams' progress instead of sleeping and polling. It takes no frames: while
        nobody consumes, newest-only readers drop frames and FIFOs fill. "stalled" is the
        absence of events, so a predicate on it is only re-checked at the next event.
        `timeout` (seconds, None: no limit) bounds the wait; False if it ran out first.
        """

        def holds() -> bool:
            now = time.monotonic()
            return predicate([r.health(now) for r in self.readers])

        self.start()
        with self._cond:
            self._cond.wait_for(lambda: self._closed or holds(), timeout)
            return holds()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for r in self.readers:
            r.close(join_s=0.0)
        for r in self.readers:
            r.join(2.0)

    def __enter__(self) -> StreamsSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
