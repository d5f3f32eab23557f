"""The channel between `tandem serve --embedded` and its engine process (server/engine_client.py
and server/engine_process.py): a Unix socket pair carrying frames, each a 4-byte big-endian
length and one msgpack map, as vLLM's API server and engine core talk over ZMQ and msgpack.

    server -> engine                                   engine -> server
    gen     id, job (JSON text), deadline_s            ready   info (what it serves, its model)
    cancel  id (a generation or a detection)           fatal   type, message, value_error
    detect  id, kind, value (str or bytes), deadline_s ok      id, value (a call's answer)
    health  id          payload  id                    err     id, error (an APIError's fields)
    close                                              ev      items: [[id, [event, ...], usage], ...]
                                                       closed

`ok`/`err` answer gen (accepted or refused: 400 naming the field, 503 with the queue full),
detect, health and payload. A generation's events come in `ev` frames, pushed as the engine
makes them: one frame carries what every ready generation has, so a decode step of 16
sequences is one frame, and no token waits for a request from the server. An event is
JobEvent.to_dict() (workers/events.py, what a client of the job API reads); `usage` rides with a
generation's final event, None before. A job travels as JSON text inside its frame: it came
from JSON, and msgpack would refuse what JSON takes (an integer past 64 bits, which must reach
SamplingParams to be refused there, naming its field).

Strings may hold lone surrogates (a request's text, quoted in an error): both sides pass them
through (`surrogatepass`).
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

from server.protocol import APIError
from workers.events import JobEvent

# server -> engine
GEN, CANCEL, DETECT, HEALTH, PAYLOAD, CLOSE = "gen", "cancel", "detect", "health", "payload", "close"
# engine -> server
READY, FATAL, OK, ERR, EV, CLOSED = "ready", "fatal", "ok", "err", "ev", "closed"

_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30  # a frame longer than this is a broken channel, not a message


def _plain(value: Any) -> Any:
    """What msgpack cannot pack as is: numpy scalars and arrays, tuples' kin."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot send a {type(value).__name__} to the engine process")


def pack(message: dict) -> bytes:
    """One frame: its length, then the message."""
    body = msgpack.packb(message, default=_plain, unicode_errors="surrogatepass")
    return _HEADER.pack(len(body)) + body


def unpack(body: bytes) -> dict:
    return msgpack.unpackb(body, raw=False, unicode_errors="surrogatepass", strict_map_key=False)


def body_length(header: bytes) -> int:
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes: the channel is out of step")
    return n


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """n bytes from a blocking socket; None at the end of the stream (the other side is gone)."""
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> dict | None:
    """The next message from a blocking socket; None at the end of the stream."""
    header = recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    n = body_length(header)
    body = recv_exactly(sock, n) if n else b""
    return None if body is None else unpack(body)


async def read_frame_async(reader) -> dict | None:
    """The next message from an asyncio StreamReader; None at the end of the stream."""
    import asyncio

    try:
        header = await reader.readexactly(_HEADER.size)
        body = await reader.readexactly(body_length(header))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return unpack(body)


def event_to_wire(event: JobEvent) -> dict:
    return event.to_dict()


def event_from_wire(data: dict) -> JobEvent:
    return JobEvent.from_dict(data)


def error_to_wire(exc: APIError) -> dict:
    return {"status": exc.status, "message": exc.message, "param": exc.param, "type": exc.type, "headers": exc.headers}


def error_from_wire(data: dict) -> APIError:
    return APIError(data["status"], data["message"], data.get("param"), data.get("type"), data.get("headers") or None)
