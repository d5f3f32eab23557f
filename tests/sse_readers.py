"""Two SSE readers that real clients use and that the SSE specification does not describe, so
that the tests can hold Tandem's streams to them (the server's own parser, test_serve.sse, reads
what the specification says).

- `strip_then_split`: the reader of `vllm bench serve` (and of many hand-written clients): each
  network chunk is stripped of white space before it joins a buffer that is split on the blank
  line; a buffer that starts with "data: " and holds a whole JSON value (or [DONE]) counts as
  an event even without its blank line; messages that start with ":" are skipped. A comment
  chunk stripped of its blank line stays in the buffer and glues onto every later event.
- `data_lines`: a naive line reader: each line that starts with "data: " is an event.
"""

from __future__ import annotations

import json
from collections.abc import Iterable


def _whole(payload: str) -> bool:
    if payload == "[DONE]":
        return True
    try:
        json.loads(payload)
    except ValueError:
        return False
    return True


def strip_then_split(chunks: Iterable[bytes]) -> list[str]:
    """The data payloads that a strip-then-split reader gets from these network chunks."""
    buffer, payloads = "", []

    def take(message: str) -> None:
        if message and not message.startswith(":"):
            payloads.append(message.removeprefix("data: "))

    for chunk in chunks:
        chunk = chunk.strip()
        if not chunk:
            continue
        buffer += chunk.decode()
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            take(message.strip())
        if buffer.startswith("data: ") and _whole(buffer.removeprefix("data: ").strip()):
            take(buffer.strip())
            buffer = ""
    return payloads


def data_lines(lines: Iterable[str]) -> list[str]:
    """The data payloads that a reader of "data: " lines gets."""
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
