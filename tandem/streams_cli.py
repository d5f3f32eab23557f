"""`tandem streams SOURCE`: the camera service (workers/cameras.py) as a process, with its HTTP
control (server/streams_app.py, which documents the endpoints and the API key).

    tandem streams cams.streams --max-fps 5 --jsonl -        # Redis at $TANDEM_REDIS_URL
    python -m tandem.streams_cli rtsp://10.0.0.7/live --port 0 --duration 60

The SOURCE may list local videos and webcams besides stream URLs; cameras added later over HTTP
or the Redis control list must be network stream URLs on public addresses (private and
loopback ones need --allow-private-urls or --allowed-url-networks).

A .streams SOURCE is reloaded when it changes (checked every --reload-interval s) or at SIGHUP:
cameras added, removed or changed without a restart (workers/streams_file.py has the syntax).

Exit codes: 0 stopped (SIGINT, SIGTERM or --duration), 1 the service failed (Redis unreachable
at start, the Runtime broke), 2 bad arguments or input.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from runtime.devices import checked_device  # torch loads when it checks a device
from runtime.vision.detector import WEIGHTS, default_imgsz  # pathlib only
from runtime.vision.flags import add_backend_argument, add_max_image_pixels_argument, max_image_pixels_option
from server.streams_app import ControlServer, create_app  # FastAPI and uvicorn load when they start
from workers.cameras_security import Security, is_loopback

# Nothing heavy at import: tandem/cli.py builds its parser from add_streams_arguments.

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_streams_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a .streams file (one camera per line: cam0, cam1, ...) or one stream URL")
    p.add_argument("--redis-url", default=None, help="where detections go (default: $TANDEM_REDIS_URL or local)")
    p.add_argument("--no-redis", action="store_true", help="publish JSON lines only (needs --jsonl)")
    p.add_argument("--maxlen", type=int, default=1000, help="records kept per camera stream (approximate trimming)")
    p.add_argument(
        "--max-fps", type=float, default=None, help="frames per second detected per camera (default: no cap)"
    )
    p.add_argument(
        "--batch-timeout-ms",
        type=float,
        default=None,
        help="how long a batch waits for a frame of every live camera after its first frame "
        "(default: one frame period of the fastest camera, at most 40 ms)",
    )
    p.add_argument("--jsonl", metavar="PATH", default=None, help="also append each record as a JSON line ('-': stdout)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP control address (not loopback: needs --api-key)")
    p.add_argument(
        "--api-key",
        default=None,
        help="KEY or KEY1,KEY2: every endpoint but /health wants 'Authorization: Bearer KEY' (the page: open "
        "/?key=KEY once, which sets an HttpOnly cookie); default $TANDEM_STREAMS_API_KEY; none: loopback --host only",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="run the control API and the page without a key: only with a loopback --host (any local "
        "process, and any page the user's browser opens, can then reach them; the Host and JSON checks stay)",
    )
    p.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated names the service answers to in the Host header besides --host (and localhost, "
        "127.0.0.1, [::1] on loopback), e.g. the name a proxy or browser uses",
    )
    p.add_argument("--view-fps", type=float, default=None, help="most frames a second of a camera's /view (default 10)")
    p.add_argument(
        "--reload-interval",
        type=float,
        default=1.0,
        help="seconds between checks of the .streams file for changes (0: only at SIGHUP)",
    )
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
    c = p.add_argument_group("event clips (workers/camera_clips.py)")
    c.add_argument(
        "--clips-dir",
        default=None,
        help="record an MP4 around each line crossing and zone entry of the cameras with lines or zones, "
        "from the camera's clip_pre_s (5) before to clip_post_s (5) after, here (default: no clips)",
    )
    c.add_argument(
        "--clips-max-bytes",
        type=_size,
        default="10G",
        help="all clips together, e.g. 500M or 10G: the oldest are pruned past it (0: no bound)",
    )
    c.add_argument(
        "--clips-max-age-s", type=float, default=7 * 86400.0, help="clips older than this are pruned (0: kept)"
    )
    c.add_argument(
        "--clips-buffer-bytes",
        type=_size,
        default="32M",
        help="memory per camera for its last seconds of JPEGs, e.g. 32M (its time bound: clip_pre_s + 2 s)",
    )
    w = p.add_argument_group("webhooks and MQTT (workers/camera_push.py)")
    w.add_argument(
        "--webhook",
        action="append",
        default=None,
        metavar="[TYPE,...=]URL",
        help="POST each line and zone event of every camera to URL (repeatable); TYPE,...= limits it to "
        "those of line_cross, zone_enter, zone_exit (a camera's own: webhook= in its .streams line)",
    )
    w.add_argument(
        "--webhook-secret",
        default=None,
        help="sign each POST: X-Tandem-Signature: sha256=HMAC-SHA256(secret, '<X-Tandem-Timestamp>.<body>') "
        "(default $TANDEM_WEBHOOK_SECRET; none: unsigned)",
    )
    w.add_argument(
        "--webhook-cooldown-s",
        type=float,
        default=0.0,
        help="send a camera's events of one type and line or zone at most once per this many seconds "
        "(0: every event; a camera's webhook_cooldown_s wins)",
    )
    w.add_argument("--webhook-timeout-s", type=float, default=5.0, help="one POST's deadline, connect to answer")
    w.add_argument(
        "--webhook-retry-s",
        type=float,
        default=30.0,
        help="how long an event is retried after no connection, a timeout, 429 or 5xx (0: tried once)",
    )
    w.add_argument(
        "--push-queue",
        type=int,
        default=256,
        help="events each webhook and the broker may have waiting; past it the oldest is dropped, counted",
    )
    w.add_argument(
        "--mqtt",
        default=None,
        metavar="HOST[:PORT]",
        help="publish tandem/<camera>/events and retained tandem/<camera>/counts to this MQTT broker "
        "(port 1883 by default; $TANDEM_MQTT_USERNAME, $TANDEM_MQTT_PASSWORD)",
    )
    w.add_argument("--mqtt-topic-prefix", default="tandem", help="the topics' first words (default: tandem)")
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
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda if available)")
    g.add_argument("--classes", default=None, help="comma-separated class ids to keep, e.g. 0,2 (default: every class)")
    g.add_argument("--max-batch-size", type=int, default=8, help="most frames (of any cameras) in one forward pass")
    g.add_argument("--no-profile", action="store_true", help="skip the start-up batch-size profiling")
    add_max_image_pixels_argument(g)
    add_backend_argument(g)


def _size(text: str) -> int:
    """Bytes from 123, 64K, 32M or 10G (powers of 1024)."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    text = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = units.get(text[-1:], 1)
    try:
        value = float(text[:-1] if scale > 1 else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size in bytes like 500M or 10G, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {text!r}")
    return int(value * scale)


def _source_urls(source: str) -> list[str]:
    from sources import SourceError
    from sources.base import is_stream_url

    if source.endswith(".streams"):
        from workers.streams_file import parse

        return [ln.url for ln in parse(source)]
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


def api_keys(args: argparse.Namespace, env=None) -> tuple[str, ...]:
    raw = (
        args.api_key if args.api_key is not None else (os.environ if env is None else env).get("TANDEM_STREAMS_API_KEY")
    )
    return tuple(k.strip() for k in (raw or "").split(",") if k.strip())


def security(args: argparse.Namespace, env=None) -> Security:
    """The control's guard from the flags; ValueError naming --api-key when a non-loopback
    host would be open to anyone who reaches it."""
    keys = api_keys(args, env)
    if keys and args.no_auth:
        raise ValueError("--no-auth and --api-key (or $TANDEM_STREAMS_API_KEY) contradict: give one")
    if not keys and not is_loopback(args.host):
        raise ValueError(
            f"--host {args.host} is reachable from other machines: give --api-key KEY (or "
            "$TANDEM_STREAMS_API_KEY), or bind a loopback --host"
        )
    if not keys and not args.no_auth:
        # Even on loopback every local process and web page reaches the port: no key only on request.
        raise ValueError(
            "the control API and the page need a key: give --api-key KEY (or $TANDEM_STREAMS_API_KEY), "
            f"or --no-auth to run without one on this loopback --host {args.host}"
        )
    return Security(keys, args.host, tuple((args.allowed_hosts or "").split(",")))


def push_config(args: argparse.Namespace, env=None):
    """Where events go (workers/camera_push.py PushConfig) from the flags over the environment.
    A webhook a remote caller gives passes the guard cameras pass (private addresses as
    --allow-private-urls and --allowed-url-networks say), with the http(s) schemes."""
    from workers.camera_push import PushConfig
    from workers.urlguard import DETECT_SCHEMES, UrlPolicy

    env = os.environ if env is None else env
    cams = url_policy(args, env)  # its private-address rules; its prefixes name stream URLs, not webhooks
    remote = UrlPolicy(
        schemes=DETECT_SCHEMES, any_host=True, allow_private=cams.allow_private, allowed_networks=cams.allowed_networks
    )
    secret = args.webhook_secret if args.webhook_secret is not None else env.get("TANDEM_WEBHOOK_SECRET") or None
    return PushConfig(
        webhook=tuple(args.webhook or ()),
        webhook_secret=secret,
        webhook_cooldown_s=args.webhook_cooldown_s,
        webhook_timeout_s=args.webhook_timeout_s,
        webhook_retry_s=args.webhook_retry_s,
        push_queue=args.push_queue,
        mqtt=args.mqtt,
        mqtt_topic_prefix=args.mqtt_topic_prefix,
        mqtt_username=env.get("TANDEM_MQTT_USERNAME") or None,
        mqtt_password=env.get("TANDEM_MQTT_PASSWORD") or None,
        remote_policy=remote,
    )


def service_config(args: argparse.Namespace):
    """The camera service's CameraServiceConfig from the flags; ValueError naming the flag."""
    from workers.camera_checks import CameraServiceConfig
    from workers.camera_clips import ClipConfig

    policy = url_policy(args)  # its errors name their flags already
    try:
        clips = None
        if args.clips_dir is not None:
            clips = ClipConfig(
                args.clips_dir,
                max_bytes=args.clips_max_bytes or None,
                max_age_s=args.clips_max_age_s or None,
                buffer_bytes=args.clips_buffer_bytes,
            )
        return CameraServiceConfig(
            maxlen=args.maxlen,
            max_fps=args.max_fps,
            instance=args.instance,
            max_cameras=args.max_cameras,
            url_policy=policy,
            batch_timeout_ms=args.batch_timeout_ms,
            clips=clips,
            push=push_config(args),
        )
    except ValueError as exc:  # "max_fps must be ...", "webhook: ...": each message starts with its field
        field, _, rest = str(exc).partition(" ")
        flag = field.rstrip(":").replace("_", "-")
        raise ValueError(f"--{flag}{':' if field.endswith(':') else ''} {rest}") from None


def _classes(text: str | None) -> list[int] | None:
    from runtime.vision.flags import parse_class_ids

    return None if text is None else list(parse_class_ids(text))


def _plan(args: argparse.Namespace) -> tuple[list[str], dict, str | None]:
    """(camera urls, Runtime vision config, Redis URL or None); ValueError names the flag."""
    from workers.settings import JobSettings

    service_config(args)  # a bad prefix or network too: usage errors before anything loads
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.duration is not None and not args.duration > 0:
        raise ValueError(f"--duration must be > 0 seconds, got {args.duration}")
    if args.no_redis and args.jsonl is None:
        raise ValueError("--no-redis needs --jsonl: the detections must go somewhere")
    if args.view_fps is not None and not 0 < args.view_fps <= 60:
        raise ValueError(f"--view-fps must be in (0, 60], got {args.view_fps}")
    if not args.reload_interval >= 0:
        raise ValueError(f"--reload-interval must be >= 0 seconds, got {args.reload_interval}")
    if args.clips_dir is not None:
        try:
            os.makedirs(args.clips_dir, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--clips-dir: cannot create {args.clips_dir}: {exc}") from None
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
        "device": checked_device("--device", args.device),
        "backend": args.backend,
        "batching": {"max_batch_size": args.max_batch_size},
        "profile": not args.no_profile,
    }
    classes = _classes(args.classes)
    if classes is not None:
        vision["classes"] = classes
    vision.update(max_image_pixels_option(args))  # the Runtime's, which the camera service's readers take
    try:
        VisionConfig.from_dict(vision)  # every field checked before anything loads
    except ValueError as exc:
        message = str(exc)
        raise ValueError("--" + message if message.startswith(("classes", "device", "backend")) else message) from None
    security(args)  # last: a bad flag above is named first, whatever the key
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
    from sources import SourceError
    from workers.cameras import CameraService

    logging.basicConfig(level=logging.INFO, format="tandem streams: %(message)s", stream=sys.stderr)
    quiet_opencv()  # a dead camera is reported once per outage, not in OpenCV's words at every retry
    try:
        runtime = Runtime(vision=vision, profile=not args.no_profile)
    except (OSError, ValueError) as exc:
        print(f"tandem streams: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stop, hup = threading.Event(), threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
        if hasattr(signal, "SIGHUP"):
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *_: hup.set())
    service = None
    try:
        service = CameraService(runtime, redis_client, service_config(args), jsonl=jsonl)
        streams_file = None
        if args.source.endswith(".streams"):
            from workers.streams_file import StreamsFile

            streams_file = StreamsFile(args.source, service, args.max_cameras)
            streams_file.load()
        else:
            for i, url in enumerate(urls):
                service.add(f"cam{i}", url, allow_local=True)
        server.start(create_app(service, security(args), server.stop, args.view_fps))
        sink = "Redis streams tandem:cameras:<camera>" if redis_client is not None else "JSON lines"
        ready = f"tandem streams: ready, control {server.url}, {len(urls)} cameras, instance {service.instance}"
        ready += f", records to {sink}" + (" and JSON lines" if jsonl is not None and redis_client is not None else "")
        ready += f", page {server.url}/" + ("?key=KEY" if api_keys(args) else "")
        print(ready, file=sys.stderr if jsonl is sys.stdout else sys.stdout, flush=True)
        deadline = None if args.duration is None else time.monotonic() + args.duration
        next_poll = time.monotonic() + args.reload_interval
        while not stop.is_set() and service.failure is None:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if streams_file is not None:
                if hup.is_set():
                    hup.clear()
                    streams_file.reload()
                elif args.reload_interval and now >= next_poll:
                    next_poll = now + args.reload_interval
                    streams_file.poll()
            stop.wait(0.2 if deadline is None else min(0.2, max(0.0, deadline - time.monotonic())))
        code = EXIT_FAILED if service.failure else EXIT_OK
        if service.failure:
            print(f"tandem streams: error: {service.failure}", file=sys.stderr)
        return code
    except (ValueError, SourceError) as exc:  # a camera of the source refused (an id, url or option)
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
