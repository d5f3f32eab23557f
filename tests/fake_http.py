"""A fake streaming HTTP server on loopback, what the benchmark clients' tests run against in
place of vLLM, Tandem or llama-server: each test's subclass says what its server answers.

The base does what every fake shares: a threaded server that takes a whole phase's requests
at once, each POST body recorded, a streaming POST counted while it is open (`max_open`: the
most streams at once, which says whether the client really sends concurrently), a body that
`reject(body)` accepts answered 400 with `rejected`. A subclass gives `stream_path` (the POST
that streams), `rejected`, `get(handler)` and `stream(handler, body)`, and may speak HTTP/1.1.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Handler(BaseHTTPRequestHandler):
    """One request: the fake's `get`, or its `post`, answers it through `json`, `text` and `event`."""

    server: _Server

    def setup(self) -> None:
        # Read when the request line is parsed (keep-alive or not), so it is set before.
        self.protocol_version = self.server.fake.protocol_version
        super().setup()

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.fake.get(self)

    def do_POST(self) -> None:
        self.server.fake.post(self)

    def json(self, status: int, obj: object) -> None:
        self.text(status, json.dumps(obj), "application/json")

    def text(self, status: int, text: str, content_type: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def event(self, obj: object) -> None:
        """One server-sent event: `data: <obj as JSON, or the string itself>`."""
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # every request of a phase connects at once
    fake: FakeServer


class FakeServer:
    """Subclasses define get(handler) and stream(handler, body): the GET answers, and the body
    of a stream (its 200 and headers are sent)."""

    stream_path = "/v1/completions"
    rejected: object = {"error": {"message": "bad request"}}
    protocol_version = "HTTP/1.0"

    def __init__(self, port: int = 0, reject: Callable[[dict], bool] = lambda body: False) -> None:
        self.reject = reject
        self.bodies: list[dict] = []
        self.open = self.max_open = 0
        self.lock = threading.Lock()
        self.httpd = _Server(("127.0.0.1", port), Handler)
        self.httpd.fake = self
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def post(self, h: Handler) -> None:
        body = json.loads(h.rfile.read(int(h.headers["Content-Length"])))
        with self.lock:
            self.bodies.append(body)
        if h.path != self.stream_path or self.reject(body):
            return h.json(400, self.rejected)
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        # A stream has no length: its end is the connection's (HTTP/1.0 closes anyway).
        h.send_header("Connection", "close")
        h.end_headers()
        with self.lock:
            self.open += 1
            self.max_open = max(self.max_open, self.open)
        try:
            self.stream(h, body)
        finally:
            with self.lock:
                self.open -= 1
        h.close_connection = True
        return None

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def fake_binary(path: Path, module: str, main: str) -> Path:
    """An executable at `path` that calls `main(sys.argv[1:])` of the test module `module`: a
    fake server binary, started by the benchmark under test as it starts the real one."""
    path.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        f"from {module} import {main}\n"
        f"{main}(sys.argv[1:])\n"
    )
    path.chmod(0o755)
    return path
