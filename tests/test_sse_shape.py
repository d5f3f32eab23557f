"""The shape of Tandem's SSE streams against the readers real clients use (tests/sse_readers.py):
a stream that waits in the queue begins with keep-alives and has keep-alives between its
events, and each reader still gets every event, whether the keep-alives arrive as network chunks
of their own or merged with the events around them. The same stream over a real server, queued
behind a running job: tests/test_bad_requests.py."""

from __future__ import annotations

import itertools
import json

from sse_readers import data_lines, strip_then_split

from server.common import KEEPALIVE, sse_data

EVENTS = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("Hello", ",", " world")]
DONE = b"data: [DONE]\n\n"


def _stream() -> list[bytes]:
    """What the server writes for a stream queued past two keep-alive intervals, with one more
    quiet interval mid-stream: one write per item."""
    first, *rest = EVENTS
    return [KEEPALIVE, KEEPALIVE, sse_data(first), KEEPALIVE, *(sse_data(e) for e in rest), DONE]


def _expected() -> list[str]:
    return [json.dumps(e, separators=(",", ":")) for e in EVENTS] + ["[DONE]"]


def test_a_strip_then_split_reader_gets_every_event_when_each_write_is_a_chunk():
    assert strip_then_split(_stream()) == _expected()


def test_a_strip_then_split_reader_gets_every_event_however_writes_merge():
    """Loopback and proxies deliver several writes as one chunk: every grouping of the stream's
    consecutive writes into chunks reads the same."""
    writes = _stream()
    for cuts in itertools.product((False, True), repeat=len(writes) - 1):
        chunks, current = [], writes[0]
        for cut, write in zip(cuts, writes[1:]):
            if cut:
                chunks.append(current)
                current = write
            else:
                current += write
        chunks.append(current)
        assert strip_then_split(chunks) == _expected(), chunks


def test_a_line_reader_gets_every_event():
    lines = b"".join(_stream()).decode().split("\n")
    assert data_lines(lines) == _expected()


def test_the_keep_alive_is_white_space_only():
    """Why the readers above hold: a stripped keep-alive is empty, so it cannot glue onto the
    next event. A comment (": keep-alive") would: red seen with it, every event lost."""
    assert KEEPALIVE.strip() == b"" and KEEPALIVE.endswith(b"\n")
