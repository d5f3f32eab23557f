"""Many live streams at once: a `.streams` file, a single URL, or a webcam index.

Each stream has its own reader thread (sources/stream_reader.py). A batch holds the newest
frame of every stream that has one (8 live streams give a batch of 8), plus an error frame
for each stream that has just gone down, so the consumer reports failures in line with
results. Memory is bounded by streams x max(1, buffer) frames.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from sources.base import Frame, SourceError, is_stream_url
from sources.stream_reader import TERMINAL, StreamConfig, StreamHealth, StreamReader


def parse_streams_file(path: str) -> list[str]:
    """One source per line: a stream URL (rtsp, rtmp, http(s), tcp, udp), a webcam index or
    a local video file (relative to the file's folder). Blank lines and # comments are skipped;
    anything else is an error naming the line."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError as exc:
        raise SourceError(f"source not found: {path}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"cannot read streams file {path}: {exc}") from exc
    folder = os.path.dirname(os.path.abspath(path))
    urls = []
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if is_stream_url(line) or line.isdigit():
            if "://" in line and not line.split("://", 1)[1].strip("/"):
                raise SourceError(f"{path} line {lineno}: stream URL {line!r} has no host")
            urls.append(line)
            continue
        full = line if os.path.isabs(line) else os.path.join(folder, line)
        if os.path.isfile(full):
            urls.append(full)
            continue
        raise SourceError(
            f"{path} line {lineno}: {line!r} is neither a stream URL (rtsp://, rtmp://, http(s)://, tcp://, "
            f"udp://), a webcam index nor an existing video file"
        )
    if not urls:
        raise SourceError(f"streams file {path} lists no streams (blank lines and # comments are skipped)")
    return urls


class StreamsSource:
    kind = "streams"

    def __init__(self, source: str | Sequence[str], config: StreamConfig | None = None, start: bool = True) -> None:
        """`start=False` defers reading until start() or the first iteration, so frames read
        while the consumer is still loading its model are not dropped."""
        self.config = config or StreamConfig()
        if isinstance(source, str):
            urls = parse_streams_file(source) if source.endswith(".streams") else [source]
        else:
            urls = list(source)
        if not urls:
            raise SourceError("no streams given")
        self.urls = urls
        self._cond = threading.Condition()
        self._errors: deque[Frame] = deque(maxlen=4 * len(urls))  # bounded even if nobody reads
        self._closed = False
        self.readers = [StreamReader(i, u, self.config, self._cond, self._report) for i, u in enumerate(urls)]
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
