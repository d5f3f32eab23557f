"""`tandem serve --embedded` with its engine in a process of its own (the default): the server
process runs the HTTP event loop and never imports torch; the engine process
(server/engine_process.py) runs the Runtime with every core's threads. One socket joins them
(server/engine_wire.py's frames), and every request and stream shares it:

    generate()  ->  gen (job)   <-  ok / err (400 naming the field, 503 queue full)
                                <-  ev frames: the generation's JobEvents, pushed as they come
    a stream closed early       ->  cancel (the engine aborts the request within a step)
    detect()    ->  detect      <-  ok (the record) / err
    health(), payloads()        ->  health / payload  <-  ok

One reader task dispatches the frames: a generation's events to its own asyncio queue, answers
to their callers' futures. It never waits on a caller, so a slow or dead client holds up nobody
else. When the engine process dies, the reader sees the socket end: every open stream ends with
a failed event saying how it died, every call waiting gets 503, and so do later requests and
/health (a supervisor restarts the server).

Why a process: on the CPU the HTTP event loop and the engine's OpenMP threads shared the cores
(with the server on one torch thread, TPOT at 2 requests/s fell from 47.7 to 30.1 ms), and in
one process they share one GIL too. Measured on 2 cores (SmolLM2 bfloat16, 32 requests of 128 +
64 tokens, `tandem bench serve --embedded --compare-engine-process`), the quietest run: 225
against 150 output tokens/s at rate inf, TTFT p50 193 against 315 ms and TPOT p50 40 against
76 ms at 2 requests/s; under neighbours' load (load average 7 to 9) throughput came out even
(0.92 to 1.02x) and latency still better. `--no-engine-process` keeps the Runtime in the
server's process (server/embedded.py), for comparison.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

from server import engine_wire as wire
from server.backends import fleet_health
from server.common import log
from server.embedded import job_of
from server.protocol import APIError, Generation
from workers.events import FAILED, JobEvent

HEALTH_TIMEOUT_S = 10.0  # an engine that does not answer /health within this is unhealthy
_GONE = object()  # a stream's queue item: the engine process is gone


class EngineStartError(RuntimeError):
    """The engine process failed to start for a reason other than a bad value (its traceback is
    on stderr): a model that does not load, say."""


def exit_reason(code: int | None) -> str:
    if code is None:
        return "is not answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class EngineProcess:
    """The engine process, started and waited for (blocking, before any event loop): the
    constructor returns once its Runtime is built (model loaded, profiles done) and `info` says
    what it serves. A bad value raises ValueError, another failure EngineStartError, with the
    engine's message, as the Runtime in this process would have."""

    def __init__(self, config: dict) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [sys.executable, "-m", "server.engine_process", "--fd", str(theirs.fileno())]
        try:
            self.proc = subprocess.Popen(
                [*cmd, "--config", json.dumps(config)], stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),)
            )
        finally:
            theirs.close()
        self.sock = ours
        try:
            msg = wire.read_frame(ours)
        except BaseException:  # Ctrl-C while the model loads: the engine exits at our socket's end
            self.stop(5)
            raise
        if msg is None or msg.get("t") != wire.READY:
            self.stop(10)
            if msg is not None and msg.get("t") == wire.FATAL:
                raise (ValueError if msg.get("value_error") else EngineStartError)(msg["message"])
            raise EngineStartError(f"the engine process {exit_reason(self.proc.poll())} before it was ready")
        self.info: dict = msg["info"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 30) -> None:
        """Close our end (the engine closes its Runtime and exits), wait, then kill."""
        try:
            self.sock.close()
        except OSError:
            pass
        if self.wait(timeout) is None:
            self.proc.kill()
            self.proc.wait(10)


class EngineStream:
    """One generation's events as the engine sends them (server/backends.py's Stream)."""

    def __init__(self, backend: EngineProcessBackend, rid: str, queue: asyncio.Queue) -> None:
        self.backend = backend
        self.id = rid
        self._queue = queue
        self._usage: dict = {}
        self.final: JobEvent | None = None

    async def events(self) -> AsyncIterator[JobEvent]:
        try:
            while self.final is None:
                item = await self._queue.get()
                if item is _GONE:
                    self.final = JobEvent(FAILED, error=self.backend.dead, finish_reason="abort")
                    yield self.final
                    return
                events, usage = item
                if usage is not None:
                    self._usage = usage
                for data in events:
                    event = wire.event_from_wire(data)
                    if event.final:
                        self.final = event
                    yield event
        finally:
            self.backend._forget(self.id, cancel=self.final is None)

    async def usage(self) -> dict:
        return self._usage

    async def cancel(self) -> None:
        if self.final is None:
            self.backend._forget(self.id, cancel=True)


class EngineProcessBackend:
    mode = "embedded"

    def __init__(self, engine: EngineProcess, tool_call_parser: str | None = None) -> None:
        self.engine = engine
        self.info = engine.info
        self.tool_call_parser = tool_call_parser  # --tool-call-parser (None: the chat template's family)
        self.dead: str | None = None  # why the engine serves no more, once it does not
        self._closing = False  # close() asked the engine to stop: its end is no failure
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._connecting = asyncio.Lock()
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[str, asyncio.Future] = {}

    @classmethod
    def start(
        cls,
        runtime: dict,
        model_name: str,
        max_queued: int = 256,
        allowed_roots: tuple[str, ...] = (),
        allowed_url_prefixes: tuple[str, ...] = (),
        tool_call_parser: str | None = None,
    ) -> EngineProcessBackend:
        """Start the engine process on the Runtime's keyword arguments and wait until it is ready."""
        config = {
            "runtime": runtime,
            "model_name": model_name,
            "max_queued": max_queued,
            "allowed_roots": list(allowed_roots),
            "allowed_url_prefixes": list(allowed_url_prefixes),
        }
        return cls(EngineProcess(config), tool_call_parser)

    # ---- the channel -------------------------------------------------------------------------

    async def _connect(self) -> None:
        """Attach the socket to this event loop (on first use) and start the reader; 503 once
        the engine is gone."""
        if self._writer is None:
            async with self._connecting:
                if self._writer is None and self.dead is None:
                    reader, self._writer = await asyncio.open_unix_connection(sock=self.engine.sock)
                    self._reading = asyncio.create_task(self._read(reader))
        if self.dead is not None:
            raise APIError(503, self.dead, headers={"Retry-After": "5"})

    def _send(self, message: dict) -> None:
        if self.dead is None and self._writer is not None and not self._writer.is_closing():
            self._writer.write(wire.pack(message))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (msg := await wire.read_frame_async(reader)) is not None:
                self._dispatch(msg)
        except Exception:  # noqa: BLE001 - a channel out of step is an engine lost
            log.exception("the channel to the engine process broke")
        await self._gone()

    def _dispatch(self, msg: dict) -> None:
        kind = msg["t"]
        if kind == wire.EV:
            for rid, events, usage in msg["items"]:
                queue = self._streams.get(rid)
                if queue is not None:  # else its stream was closed: the engine was told to cancel
                    queue.put_nowait((events, usage))
        elif kind in (wire.OK, wire.ERR):
            future = self._calls.pop(msg["id"], None)
            if future is not None and not future.done():
                if kind == wire.OK:
                    future.set_result(msg.get("value"))
                else:
                    future.set_exception(wire.error_from_wire(msg["error"]))

    async def _gone(self) -> None:
        """The socket ended: say why to every open stream and waiting call, and to later ones."""
        self.dead = "the engine process is gone"  # at once: no new request registers meanwhile
        code = await asyncio.to_thread(self.engine.wait, 5)
        if self._closing:
            self.dead = "the server is shutting down"
        else:
            self.dead = f"the engine process {exit_reason(code)}; restart tandem serve"
            log.error("%s", self.dead)
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.put_nowait(_GONE)
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(APIError(503, self.dead, headers={"Retry-After": "5"}))
        if self._writer is not None:
            self._writer.close()

    async def _call(self, message_kind: str, **fields):
        """A request that the engine answers once: its `ok` value, or its error raised."""
        await self._connect()
        rid = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._calls[rid] = future
        self._send({"t": message_kind, "id": rid, **fields})
        try:
            return await future
        except asyncio.CancelledError:  # the caller went away (a client gone, a timeout)
            self._calls.pop(rid, None)
            self._send({"t": wire.CANCEL, "id": rid})
            raise

    def _forget(self, rid: str, cancel: bool) -> None:
        """A stream is closed: drop its queue, and stop its generation if it still runs."""
        if self._streams.pop(rid, None) is not None and cancel:
            self._send({"t": wire.CANCEL, "id": rid})

    # ---- the backend's interface (server/backends.py) ----------------------------------------

    async def generate(self, gen: Generation, deadline_s: float | None, owner: str | None = None) -> EngineStream:
        """`owner` is taken and not used, as server/embedded.py's EmbeddedBackend says."""
        await self._connect()
        if "llm" not in self.info.get("serves", ()):
            raise APIError(404, "this server runs no LLM (start it without --queues vision)", "model")
        rid = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue  # before the request: its events may come before its `ok`
        future = asyncio.get_running_loop().create_future()
        self._calls[rid] = future
        job = json.dumps(job_of(gen, self.tool_call_parser))
        self._send({"t": wire.GEN, "id": rid, "job": job, "deadline_s": deadline_s})
        try:
            await future
        except APIError:  # refused (a field, a full queue), or the engine is gone: nothing runs
            self._streams.pop(rid, None)
            raise
        except BaseException:  # the caller went away while it started
            self._calls.pop(rid, None)
            self._forget(rid, cancel=True)
            raise
        return EngineStream(self, rid, queue)

    async def cancel(self, request_id: str) -> str:
        return "missing"  # no job API with --embedded (server/embedded.py)

    async def detect(self, kind: str, value: bytes | str, deadline_s: float | None) -> dict:
        await self._connect()
        if "vision" not in self.info.get("serves", ()):
            raise APIError(404, "this server runs no vision model", "model")
        return await self._call(wire.DETECT, kind=kind, value=value, deadline_s=deadline_s)

    async def health(self) -> dict:
        try:
            answer = await asyncio.wait_for(self._call(wire.HEALTH), HEALTH_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"the engine process did not answer within {HEALTH_TIMEOUT_S:g} s") from None
        if answer.get("broken"):
            raise RuntimeError(answer["broken"])
        return fleet_health([answer["payload"]])

    async def payloads(self) -> list[dict]:
        return [await self._call(wire.PAYLOAD)]

    async def workers(self) -> list[dict]:
        """What the engine serves, as it said when ready (each request asks: no round trip)."""
        await self._connect()
        return [{**self.info, "instance": "embedded"}]

    async def close(self) -> None:
        """Close the engine's Runtime (what has not finished fails) and wait for it to exit."""
        self._closing = True
        if self._writer is not None and self.dead is None:
            self._send({"t": wire.CLOSE, "drain": False, "timeout": 30})
            try:
                await asyncio.wait_for(asyncio.shield(self._reading), 40)
            except TimeoutError:
                pass
        await asyncio.to_thread(self.engine.stop, 10)
