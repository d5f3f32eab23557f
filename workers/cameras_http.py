"""`tandem streams SOURCE`: the camera service (workers/cameras.py) as a process, with its HTTP
control.

    tandem streams cams.streams --max-fps 5 --jsonl -        # Redis at $TANDEM_REDIS_URL
    python -m workers.cameras_http rtsp://10.0.0.7/live --port 0 --duration 60

HTTP (default 127.0.0.1:8100; nothing here authenticates callers, so bind it where only
trusted callers reach it):

    GET    /cameras             {"cameras": [row, ...]}
    POST   /cameras             {"camera": id, "url": stream URL, "max_fps": optional} -> 201 {"camera": row}
    DELETE /cameras/{id}        {"camera": row}
    GET    /metrics             Prometheus text: every camera's up/state, fps, frames, drops, ...
    GET    /health              {"status": "ok" | "failing", ...}; 503 once the Runtime refuses frames

Errors are {"error": message, "field": name}: 400 bad input, 404 unknown camera, 409 an id in
use or no room for another camera. Cameras added over HTTP (or the Redis control list) must be
network stream URLs; the SOURCE may also list local videos and webcams.

Exit codes: 0 stopped (SIGINT, SIGTERM or --duration), 1 the service failed (Redis unreachable
at start, the Runtime broke), 2 bad arguments or input.
"""

import argparse
import os
import signal
import socket
import sys
import threading
import time

from runtime.vision.detector import WEIGHTS, default_imgsz  # pathlib only
from runtime.vision.flags import add_max_image_pixels_argument, max_image_pixels_option

# Nothing heavy at import: runtime/cli.py builds its parser from add_streams_arguments. (And no
# `from __future__ import annotations`: FastAPI must see the endpoints' annotations as objects.)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
MAX_BODY = 64 * 1024


def create_app(service):
    """The HTTP control of a workers.cameras.CameraService."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    from workers.cameras import CameraConflict, CameraError, CameraNotFound, json_object

    app = FastAPI(title="tandem streams", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(CameraError)
    async def camera_error(_request, exc: CameraError):
        status = 404 if isinstance(exc, CameraNotFound) else 409 if isinstance(exc, CameraConflict) else 400
        return JSONResponse({"error": str(exc), "field": exc.field}, status_code=status)

    @app.get("/cameras")
    def list_cameras():
        return {"cameras": service.cameras()}

    @app.post("/cameras", status_code=201)
    async def add_camera(request: Request):
        body = await request.body()
        if len(body) > MAX_BODY:
            raise CameraError("body", f"the body must be a JSON object under {MAX_BODY} bytes")
        cmd = json_object(body, "body", 'the body must be a JSON object {"camera", "url", "max_fps"?}')
        if "op" in cmd:
            raise CameraError("op", "op is for the Redis control list; POST adds, DELETE removes")
        return {"camera": service.apply({**cmd, "op": "add"})}

    @app.delete("/cameras/{camera_id}")
    def remove_camera(camera_id: str):
        return {"camera": service.remove(camera_id)}

    @app.get("/metrics")
    def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        from runtime.metrics import render

        return Response(render([{**service.payload(), "instance": service.instance}]), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    def health():
        cams = service.cameras()
        body = {
            "status": "failing" if service.failure else "ok",
            "failure": service.failure,
            "instance": service.instance,
            "cameras": len(cams),
            "cameras_up": sum(c["up"] for c in cams),
        }
        return JSONResponse(body, status_code=503 if service.failure else 200)

    return app


class ControlServer:
    """uvicorn on its own thread, on a socket bound at construction: a port in use is an error
    before the model loads, and port 0 is resolved to the one the kernel picked."""

    def __init__(self, host: str, port: int) -> None:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(address)
            self.sock.listen(128)
        except OSError:
            self.sock.close()
            raise
        bound = self.sock.getsockname()
        self.url = f"http://{f'[{bound[0]}]' if family == socket.AF_INET6 else bound[0]}:{bound[1]}"
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self, app, timeout: float = 30.0) -> None:
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        # Off the main thread uvicorn leaves the signals alone: run_streams handles them.
        run = lambda: self._server.run(sockets=[self.sock])  # noqa: E731
        self._thread = threading.Thread(target=run, name="tandem-cameras-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP control did not start on {self.url}")
            time.sleep(0.01)

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
        self.sock.close()


# ---- the CLI ----------------------------------------------------------------------------------


def add_streams_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a .streams file (one camera per line: cam0, cam1, ...) or one stream URL")
    p.add_argument("--redis-url", default=None, help="where detections go (default: $TANDEM_REDIS_URL or local)")
    p.add_argument("--no-redis", action="store_true", help="publish JSON lines only (needs --jsonl)")
    p.add_argument("--maxlen", type=int, default=1000, help="records kept per camera stream (approximate trimming)")
    p.add_argument(
        "--max-fps", type=float, default=None, help="frames per second detected per camera (default: no cap)"
    )
    p.add_argument("--jsonl", metavar="PATH", default=None, help="also append each record as a JSON line ('-': stdout)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP control address")
    p.add_argument("--port", type=int, default=8100, help="HTTP control port (0: a free one, printed)")
    p.add_argument("--instance", default=None, help="this service's name in Redis and /metrics (default: host and pid)")
    p.add_argument("--max-cameras", type=int, default=64, help="most cameras at once")
    p.add_argument(
        "--allowed-url-prefixes",
        default=None,
        help="comma-separated URL prefixes cameras added over HTTP or Redis must start with (default: any public host)",
    )
    p.add_argument(
        "--allow-private-urls",
        action="store_true",
        help="let remotely added cameras be on loopback, private, link-local or CGNAT addresses "
        "(default: refused; also $TANDEM_ALLOW_PRIVATE_URLS=1)",
    )
    p.add_argument(
        "--allowed-url-networks",
        default=None,
        help="comma-separated CIDRs remotely added cameras may be on even when private, e.g. 10.0.0.0/8 "
        "(default: $TANDEM_ALLOWED_URL_NETWORKS)",
    )
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: at a signal)")
    g = p.add_argument_group("vision")
    g.add_argument(
        "--vision-model",
        default=str(WEIGHTS),
        help="a local .pt or a model .yaml (random weights); default: the shipped shapes detector",
    )
    g.add_argument(
        "--imgsz",
        type=int,
        default=None,
        help="letterbox size, a multiple of 32 (default: the shipped detector's 320, else 640)",
    )
    g.add_argument("--conf", type=float, default=0.25, help="confidence threshold")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    g.add_argument("--max-batch-size", type=int, default=8, help="most frames (of any cameras) in one forward pass")
    g.add_argument("--no-profile", action="store_true", help="skip the start-up batch-size profiling")
    add_max_image_pixels_argument(g)


def _source_urls(source: str) -> list[str]:
    from sources import SourceError, parse_streams_file
    from sources.base import is_stream_url

    if source.endswith(".streams"):
        return parse_streams_file(source)
    if is_stream_url(source) or source.isdigit() or os.path.isfile(source):
        return [source]
    raise SourceError(f"source must be a .streams file, a stream URL, a webcam index or a video file, got {source!r}")


def url_policy(args: argparse.Namespace, env=None):
    """The URL guard of remotely added cameras, from the flags over the environment."""
    from workers.cameras import camera_policy

    overrides: dict = {}
    if args.allow_private_urls:
        overrides["allow_private"] = True
    if args.allowed_url_networks is not None:
        overrides["allowed_networks"] = tuple(n for n in args.allowed_url_networks.split(",") if n.strip())
    prefixes = tuple((args.allowed_url_prefixes or "").split(","))
    try:
        return camera_policy(prefixes, os.environ if env is None else env, **overrides)
    except ValueError as exc:
        message = str(exc).replace("prefixes:", "--allowed-url-prefixes:", 1)
        raise ValueError(message.replace("allowed_networks", "--allowed-url-networks", 1)) from None


def _plan(args: argparse.Namespace) -> tuple[list[str], dict, str | None]:
    """(camera urls, Runtime vision config, Redis URL or None); ValueError names the flag."""
    from workers.cameras import check_instance, check_max_fps
    from workers.settings import JobSettings

    if args.maxlen < 1:
        raise ValueError(f"--maxlen must be >= 1, got {args.maxlen}")
    if args.max_cameras < 1:
        raise ValueError(f"--max-cameras must be >= 1, got {args.max_cameras}")
    check_max_fps(args.max_fps, "--max-fps")
    if args.instance is not None:
        check_instance(args.instance, "--instance")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.duration is not None and not args.duration > 0:
        raise ValueError(f"--duration must be > 0 seconds, got {args.duration}")
    if args.no_redis and args.jsonl is None:
        raise ValueError("--no-redis needs --jsonl: the detections must go somewhere")
    url_policy(args)  # a bad prefix or network is a usage error before anything loads
    redis_url = None
    if not args.no_redis:
        redis_url = JobSettings.from_env(**({"redis_url": args.redis_url} if args.redis_url else {})).redis_url
    urls = _source_urls(args.source)
    if len(urls) > args.max_cameras:
        raise ValueError(f"{args.source} lists {len(urls)} cameras, more than --max-cameras {args.max_cameras}")
    from runtime.vision.config import VisionConfig

    vision = {
        "model": args.vision_model,
        "imgsz": args.imgsz or default_imgsz(args.vision_model),
        "conf": args.conf,
        "device": args.device,
        "batching": {"max_batch_size": args.max_batch_size},
        "profile": not args.no_profile,
    }
    vision.update(max_image_pixels_option(args))  # the Runtime's, which the camera service's readers take
    VisionConfig.from_dict(vision)  # every field checked before anything loads
    return urls, vision, redis_url


def run_streams(args: argparse.Namespace) -> int:
    from sources import SourceError
    from workers.cameras import redact

    def fail(code: int, message: str) -> int:
        print(f"tandem streams: error: {message}", file=sys.stderr)
        return code

    try:
        urls, vision, redis_url = _plan(args)
    except (ValueError, SourceError) as exc:
        return fail(EXIT_USAGE, str(exc))
    redis_client = None
    if redis_url is not None:
        from redis.exceptions import RedisError

        from workers.store import connect

        try:
            redis_client = connect(redis_url)
            redis_client.ping()
        except RedisError as exc:
            return fail(EXIT_FAILED, f"cannot reach Redis at {redact(redis_url)}: {exc}")
    try:
        server = ControlServer(args.host, args.port)
    except OSError as exc:
        return fail(EXIT_USAGE, f"--host/--port: cannot listen on {args.host}:{args.port}: {exc}")
    jsonl = None
    try:
        jsonl = sys.stdout if args.jsonl == "-" else open(args.jsonl, "a", encoding="utf-8") if args.jsonl else None
    except OSError as exc:
        server.close()
        return fail(EXIT_USAGE, f"--jsonl: cannot open {args.jsonl}: {exc}")
    try:
        return _serve(args, urls, vision, redis_client, server, jsonl)
    finally:
        server.close()
        if jsonl is not None and jsonl is not sys.stdout:
            jsonl.close()


def _serve(args, urls: list[str], vision: dict, redis_client, server: ControlServer, jsonl) -> int:
    import logging

    from runtime.runtime import Runtime
    from runtime.vision.cli import quiet_opencv
    from workers.cameras import CameraService

    logging.basicConfig(level=logging.INFO, format="tandem streams: %(message)s", stream=sys.stderr)
    quiet_opencv()  # a dead camera is reported once per outage, not in OpenCV's words at every retry
    try:
        runtime = Runtime(vision=vision, profile=not args.no_profile)
    except (OSError, ValueError) as exc:
        print(f"tandem streams: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    service = None
    try:
        service = CameraService(
            runtime,
            redis_client,
            maxlen=args.maxlen,
            max_fps=args.max_fps,
            jsonl=jsonl,
            instance=args.instance,
            max_cameras=args.max_cameras,
            url_policy=url_policy(args),
        )
        for i, url in enumerate(urls):
            service.add(f"cam{i}", url, allow_local=True)
        server.start(create_app(service))
        sink = "Redis streams tandem:cameras:<camera>" if redis_client is not None else "JSON lines"
        ready = f"tandem streams: ready, control {server.url}, {len(urls)} cameras, instance {service.instance}"
        ready += f", records to {sink}" + (" and JSON lines" if jsonl is not None and redis_client is not None else "")
        print(ready, file=sys.stderr if jsonl is sys.stdout else sys.stdout, flush=True)
        deadline = None if args.duration is None else time.monotonic() + args.duration
        while not stop.is_set() and service.failure is None:
            if deadline is not None and time.monotonic() >= deadline:
                break
            stop.wait(0.2 if deadline is None else min(0.2, max(0.0, deadline - time.monotonic())))
        code = EXIT_FAILED if service.failure else EXIT_OK
        if service.failure:
            print(f"tandem streams: error: {service.failure}", file=sys.stderr)
        return code
    except ValueError as exc:  # a camera of the source refused (an id or url)
        print(f"tandem streams: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        server.close()
        if service is not None:
            rows = service.cameras()
            service.close()
            frames = sum(r["frames"] for r in rows)
            print(f"tandem streams: stopped; {frames} frames detected from {len(rows)} cameras", file=sys.stderr)
        runtime.close(drain=False, timeout=30)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem streams", description=__doc__.split("\n\n")[0])
    add_streams_arguments(parser)
    return run_streams(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
