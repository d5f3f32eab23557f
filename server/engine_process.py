"""The engine process of `tandem serve --embedded`: the Runtime of one device (its LLM and vision
engines, the owner of its memory) in a process of its own, apart from the HTTP event loop, as
vLLM keeps its EngineCore apart from its API server. The server (server/engine_client.py)
starts it and talks to it over one socket (server/engine_wire.py has the frames):

    python -m server.engine_process --fd N --config JSON      # N: this end of a socket pair

It does for a request what the in-process backend does next to its Runtime, with the same
functions (server/embedded.py: start_generation, GenerationEvents, detect_item), so a
generation's JobEvents are the ones a worker or the in-process backend makes.

Threads: the main thread reads frames and hands each request to a small pool (a chat template,
a tokenizer, an image decode or fetch must not hold up a cancel); one sender thread writes every
frame. A generation's handle only marks it ready (on the Runtime's loop thread: nothing more);
the sender then takes what every ready generation has and sends it as one `ev` frame. The
Runtime keeps torch's threads: nothing else here computes.

It ends when the server says `close` or its end of the socket closes (the server died): either
way it closes the Runtime and exits, so an engine never outlives its server. SIGINT and SIGTERM
are ignored: Ctrl-C, or a supervisor's SIGTERM to the process group, reaches both processes, and
the server decides when its engine stops (after its graceful shutdown has let the requests in
flight finish, as they would in one process). SIGKILL still ends it, and the server says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from server import engine_wire as wire
from server import protocol
from server.engine_wire import APIError
from workers.events import FAILED, JobEvent

log = logging.getLogger("tandem.serve.engine")
NUM_CALL_THREADS = 8  # requests being prepared at once (templates, tokenizers, image decodes)
MAX_EARLY_CANCELS = 4096  # cancels remembered for requests not started yet


class Sender:
    """The one writer of the socket. `send()` queues a message; `add()` registers a generation,
    whose handle then marks it ready on every change. The thread sends queued messages, then one
    `ev` frame with the events of every ready generation, in one write."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._cond = threading.Condition()
        self._messages: list[dict] = []
        self._ready: OrderedDict[str, None] = OrderedDict()
        self._gens: dict = {}  # id -> GenerationEvents, until its final event is sent
        self._stopping = False
        self._last: dict | None = None
        self._thread = threading.Thread(target=self._run, name="tandem-engine-sender", daemon=True)
        self._thread.start()

    def send(self, message: dict) -> None:
        with self._cond:
            self._messages.append(message)
            self._cond.notify()

    def add(self, rid: str, gen) -> None:
        with self._cond:
            self._gens[rid] = gen
        gen.handle.set_listener(lambda: self._wake(rid))

    def _wake(self, rid: str) -> None:
        with self._cond:
            self._ready[rid] = None
            self._cond.notify()

    def stop(self, last: dict | None = None, timeout: float = 30) -> None:
        """Send what is queued and ready, then `last`, and end the thread."""
        with self._cond:
            self._stopping, self._last = True, last
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._messages or self._ready or self._stopping)
                messages, self._messages = self._messages, []
                ready, self._ready = list(self._ready), OrderedDict()
                gens = [(rid, self._gens.get(rid)) for rid in ready]
                last = self._stopping and not messages and not ready
            data = b"".join(wire.pack(m) for m in messages)
            items = self._events(gens)
            if items:
                data += self._pack_events(items)
            if last and self._last is not None:
                data += wire.pack(self._last)
            try:
                if data:
                    self._sock.sendall(data)
            except OSError:  # the server is gone: the reader sees the end and closes the Runtime
                return
            if last:
                return

    def _events(self, gens: list) -> list[list]:
        items = []
        for rid, gen in gens:
            if gen is None:
                continue
            try:
                events = gen.take()
            except Exception as exc:  # one request's bug ends that request alone
                log.exception("translating the outputs of %s failed", rid)
                gen.handle.cancel()
                gen.ended = True
                events = [JobEvent(FAILED, error=f"the engine failed on this request: {exc!r}", finish_reason="abort")]
            if gen.ended:
                with self._cond:
                    self._gens.pop(rid, None)
            if events or gen.ended:
                items.append([rid, [wire.event_to_wire(e) for e in events], gen.usage() if gen.ended else None])
        return items

    @staticmethod
    def _pack_events(items: list[list]) -> bytes:
        try:
            return wire.pack({"t": wire.EV, "items": items})
        except (TypeError, ValueError, OverflowError):  # one request's odd value: it fails alone
            data = b""
            for rid, events, usage in items:
                try:
                    data += wire.pack({"t": wire.EV, "items": [[rid, events, usage]]})
                except (TypeError, ValueError, OverflowError) as exc:
                    failed = JobEvent(FAILED, error=f"an event could not be sent: {exc}", finish_reason="abort")
                    data += wire.pack({"t": wire.EV, "items": [[rid, [failed.to_dict()], {}]]})
            return data


class EngineServer:
    """Answers the server's requests on one Runtime until `close` or the end of the socket."""

    def __init__(self, rt, sock: socket.socket, config: dict) -> None:
        self.rt = rt
        self.sock = sock
        self.model_name = config["model_name"]
        self.max_queued = config["max_queued"]
        self.allowed_roots = tuple(config["allowed_roots"])
        self.allowed_url_prefixes = tuple(config["allowed_url_prefixes"])
        self.sender = Sender(sock)
        self._pool = ThreadPoolExecutor(NUM_CALL_THREADS, thread_name_prefix="tandem-engine-call")
        self._lock = threading.Lock()
        self._running: dict = {}  # id -> a GenerationHandle or a detection's Future, to cancel
        self._early: OrderedDict[str, None] = OrderedDict()  # cancelled before they started

    def info(self) -> dict:
        """What this engine serves, as the server lists it (no metrics: those are asked for)."""
        payload = self._payload()
        payload.pop("metrics", None)
        return {**payload, "pid": os.getpid()}

    def serve(self) -> None:
        close = None
        try:
            while True:
                msg = wire.read_frame(self.sock)
                if msg is None:
                    break
                if msg["t"] == wire.CLOSE:
                    close = msg
                    break
                self._dispatch(msg)
        finally:
            drain, timeout = (bool(close.get("drain")), close.get("timeout", 30)) if close else (False, 30)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.rt.close(drain, timeout)  # fails what has not finished: its streams end with the reason
            self.sender.stop({"t": wire.CLOSED} if close else None)

    def _dispatch(self, msg: dict) -> None:
        kind, rid = msg["t"], msg.get("id")
        if kind == wire.CANCEL:
            self._cancel(rid)
        elif kind == wire.GEN:
            self._pool.submit(self._call, rid, self._generate, msg)
        elif kind == wire.DETECT:
            self._pool.submit(self._call, rid, self._detect, msg)
        elif kind == wire.HEALTH:
            self._pool.submit(self._call, rid, lambda _: {"broken": self.rt.broken, "payload": self._payload()}, msg)
        elif kind == wire.PAYLOAD:
            self._pool.submit(self._call, rid, lambda _: self._payload(), msg)
        else:
            log.warning("unknown message kind %r from the server", kind)

    def _call(self, rid: str, fn, msg: dict) -> None:
        """fn(msg)'s answer to the server: `ok` with its value (unless it answers later itself:
        `...`), or `err` with an APIError's fields."""
        try:
            value = fn(msg)
        except APIError as exc:
            self.sender.send({"t": wire.ERR, "id": rid, "error": wire.error_to_wire(exc)})
        except ValueError as exc:
            self.sender.send({"t": wire.ERR, "id": rid, "error": wire.error_to_wire(protocol.field_error(exc))})
        except Exception:  # this request's failure, answered as the in-process server's app does
            log.exception("request %s failed in the engine process", rid)
            self.sender.send({"t": wire.ERR, "id": rid, "error": wire.error_to_wire(internal_error())})
        else:
            if value is not ...:
                self.sender.send({"t": wire.OK, "id": rid, "value": value})

    def _payload(self) -> dict:
        from runtime.metrics import runtime_payload

        return {**runtime_payload(self.rt, self.model_name), "instance": "embedded"}

    def _generate(self, msg: dict):
        from server.embedded import start_generation

        rid = msg["id"]
        gen = start_generation(self.rt, json.loads(msg["job"]), msg.get("deadline_s"), self.max_queued)
        self.sender.send({"t": wire.OK, "id": rid, "value": None})  # before its events: accepted
        if self._started(rid, gen.handle):
            gen.handle.add_done_callback(lambda _h: self._finished(rid))
        self.sender.add(rid, gen)
        return ...

    def _detect(self, msg: dict):
        from runtime.vision.records import detection_record
        from server.embedded import detect_item, submit_detect

        rid, kind = msg["id"], msg["kind"]
        source, item = detect_item(self.rt, kind, msg["value"], self.allowed_roots, self.allowed_url_prefixes)
        future = submit_detect(self.rt, item, kind, msg.get("deadline_s"))

        def answer(f) -> None:
            self._finished(rid)
            if f.cancelled():
                return  # the server stopped waiting: nobody to answer
            try:
                self.sender.send({"t": wire.OK, "id": rid, "value": detection_record(source, 0, f.result())})
            except ValueError as exc:  # a bad image fails alone: 400, as the app's handler answers
                self.sender.send({"t": wire.ERR, "id": rid, "error": wire.error_to_wire(protocol.field_error(exc))})
            except Exception:  # 500, as the app's handler answers
                log.exception("detection %s failed in the engine process", rid)
                self.sender.send({"t": wire.ERR, "id": rid, "error": wire.error_to_wire(internal_error())})

        if self._started(rid, future):
            future.add_done_callback(answer)
        return ...

    def _started(self, rid: str, work) -> bool:
        """Register `work` for cancels; False (and `work` cancelled) if its cancel came first."""
        with self._lock:
            early = rid in self._early
            if early:
                del self._early[rid]
            else:
                self._running[rid] = work
        if early:
            work.cancel()
        return not early

    def _finished(self, rid: str) -> None:
        with self._lock:
            self._running.pop(rid, None)

    def _cancel(self, rid: str) -> None:
        with self._lock:
            work = self._running.get(rid)
            if work is None:
                self._early[rid] = None
                while len(self._early) > MAX_EARLY_CANCELS:
                    self._early.popitem(last=False)
        if work is not None:
            work.cancel()


def internal_error() -> APIError:
    """What the server's app answers to an exception it did not expect (server/app.py)."""
    return APIError(500, "internal server error", type_="server_error")


def _watch_for_eof(sock: socket.socket) -> None:
    """While the model loads (nothing is read yet), exit as soon as the server is gone: a Ctrl-C
    or a kill of the server during start-up must not leave an engine loading behind it. The
    server sends nothing before `ready`, so the first byte it sends ends the watch."""
    try:
        if not sock.recv(1, socket.MSG_PEEK):
            os._exit(1)
    except OSError:
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.engine_process", description=__doc__.split("\n\n")[0])
    p.add_argument("--fd", type=int, required=True, help="this process's end of the socket pair")
    p.add_argument("--config", required=True, help="JSON: runtime, model_name, max_queued, allowed_*")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(True)
    threading.Thread(target=_watch_for_eof, args=(sock,), name="tandem-engine-watch", daemon=True).start()
    config = json.loads(args.config)
    try:
        from runtime.heap import freeze_startup_heap
        from runtime.runtime import Runtime

        rt = Runtime(**config["runtime"])
    except BaseException as exc:  # noqa: BLE001 - told to the server, which exits with it
        value_error = isinstance(exc, ValueError)
        if not value_error:
            traceback.print_exc()
        message = str(exc) if value_error else f"{type(exc).__name__}: {exc}"
        try:
            sock.sendall(wire.pack({"t": wire.FATAL, "message": message, "value_error": value_error}))
        except OSError:
            pass
        return 2 if value_error else 1
    freeze_startup_heap()  # the model and imports out of the collector's full passes
    engine = EngineServer(rt, sock, config)
    try:
        sock.sendall(wire.pack({"t": wire.READY, "info": engine.info()}))
    except OSError:  # the server went away while the model loaded
        rt.close(False, 30)
        return 1
    engine.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
