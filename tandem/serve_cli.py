"""`tandem serve`: the HTTP front's flags and process (the app is server/app.py).

tandem serve --port 8000                      # over the workers: TANDEM_REDIS_URL, `tandem worker`
tandem serve --port 8000 --embedded           # a Runtime of its own; no Redis, no workers

--embedded runs the Runtime in an engine process of its own (server/engine_client.py), so that
the HTTP event loop and the engine's threads do not share a process; --no-engine-process keeps
it in the server's process (server/embedded.py), for comparison.
"""

from __future__ import annotations

import argparse
import os
import sys

from runtime.llm.tools import TOOL_FORMATS
from workers.worker import add_runtime_arguments


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--redis-url", default=None, help="the workers' Redis (default: $TANDEM_REDIS_URL or local)")
    p.add_argument("--embedded", action="store_true", help="host a Runtime of its own instead of using workers")
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --embedded: run the Runtime in a child process of its own, joined to the server by a Unix socket "
        "(the HTTP event loop then never shares a GIL or cores' threads with the engine; the default); "
        "--no-engine-process: in the server's own process, as before (for comparison: `tandem bench serve "
        "--embedded --compare-engine-process`)",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=256,
        help="requests waiting for a worker (or, embedded, for a slot) beyond which new ones get 503",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds before an unanswered request gets 504 and its job is cancelled",
    )
    p.add_argument("--max-body-bytes", type=int, default=32 << 20, help="larger request bodies get 413")
    p.add_argument("--allowed-url-prefixes", default=None, help="comma-separated URL prefixes /v1/detect may fetch")
    p.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'Authorization: Bearer KEY' on every endpoint but /health; KEY1,KEY2,...: one key "
        "per client, each seeing only its own jobs (default: $TANDEM_API_KEY; none: no check)",
    )
    p.add_argument(
        "--tenants",
        default=None,
        metavar="TOML",
        help="a tenants file: each [tenants.NAME] its keys, weight (its share under --policy fair) and optional "
        "requests_per_minute, tokens_per_minute, max_concurrent, max_queued (past one: 429 with Retry-After); "
        "its keys are accepted besides --api-key's. The weights are the engine's: with --embedded, give --policy "
        "fair; over workers, start each `tandem worker` with --tenants and the same file and --policy fair "
        "(README, production)",
    )
    p.add_argument(
        "--keepalive", type=float, default=10.0, help="seconds between SSE keep-alives (a blank line) on a quiet stream"
    )
    p.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds a request body may take to arrive before 408"
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request's headers before it is closed",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_FORMATS,
        help="the tool-call format (prompt, grammar and parser) of chat requests with tools; default: the one the "
        "model's chat template renders (hermes: Qwen2.5 and Hermes-style <tool_call>; llama3_json: Llama 3.1's "
        "JSON calls), else generic, a documented prompt with <tool_call> tags (runtime/llm/tools_formats.py)",
    )
    p.add_argument("--log-level", default="warning", help="the log level of uvicorn and of tandem serve's own lines")
    add_runtime_arguments(p)  # the Runtime's flags, used with --embedded


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queued < 1:
        raise ValueError(f"--max-queued must be >= 1, got {args.max_queued}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    for flag in ("keepalive", "body_timeout", "header_timeout"):
        v = getattr(args, flag)
        if not 0 < v < float("inf"):
            raise ValueError(f"--{flag.replace('_', '-')} must be a number of seconds > 0, got {v}")
    if args.engine_process is not None and not args.embedded:
        flag = "--engine-process" if args.engine_process else "--no-engine-process"
        raise ValueError(f"{flag} goes with --embedded (without it the workers run the engines)")
    api_key(args)
    tenant_table(args)


def tenant_table(args: argparse.Namespace):
    """The tenants of --tenants and --api-key (server/tenants.py); ValueError naming the file,
    the tenant and the field. A weight is the engine's scheduler's: with --embedded this process
    builds the engine, so a weight needs --policy fair here, else it would be read and ignored.
    Over workers the engines are theirs: `tandem worker --tenants` reads the same file's weights
    and checks their --policy (workers/worker.py); run_serve says so when the file has weights."""
    from server.common import api_keys
    from server.tenants import TenantTable, load_tenants
    from workers.tenants_file import check_weights_policy

    tenants = load_tenants(args.tenants) if args.tenants else []
    table = TenantTable.build(tenants, api_keys(argparse.Namespace(api_key=api_key(args))))
    if args.embedded:
        check_weights_policy(args.tenants, table.weights(), args.policy)
    return table


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $TANDEM_API_KEY; None (no check) when neither is set."""
    key = args.api_key if args.api_key is not None else os.environ.get("TANDEM_API_KEY")
    if key is not None and not all(k.strip() for k in key.split(",")):
        raise ValueError("--api-key (or TANDEM_API_KEY) must not be empty, nor hold an empty key between commas")
    return key.strip() if key is not None else None


def build_backend(args: argparse.Namespace):
    """The backend the flags ask for (loads the Runtime when --embedded: in the engine process,
    whose start-up errors come back as ValueError or EngineStartError)."""
    from server.backends import JobsBackend
    from workers.settings import JobSettings

    overrides = {"redis_url": args.redis_url}
    if args.allowed_roots is not None:
        overrides["allowed_roots"] = tuple(args.allowed_roots.split(os.pathsep))
    if args.allowed_url_prefixes is not None:
        overrides["allowed_url_prefixes"] = tuple(p.strip() for p in args.allowed_url_prefixes.split(","))
    settings = JobSettings.from_env(**overrides)
    if not args.embedded:
        return JobsBackend(settings, max_queued=args.max_queued, tool_call_parser=args.tool_call_parser)
    from workers.host import served_model_name
    from workers.worker import worker_plan

    config, _, _ = worker_plan(args)  # with the --tenants file's weights, as a worker's (tenants_option)
    name = args.served_model_name or served_model_name((config.get("llm") or {}).get("model"))
    if args.engine_process is not False:
        from server.engine_client import EngineProcessBackend

        return EngineProcessBackend.start(
            config,
            name,
            args.max_queued,
            settings.allowed_roots,
            settings.allowed_url_prefixes,
            tool_call_parser=args.tool_call_parser,
        )
    from runtime.runtime import Runtime
    from server.embedded import EmbeddedBackend

    runtime = Runtime(**config)
    return EmbeddedBackend(
        runtime,
        name,
        args.max_queued,
        settings.allowed_roots,
        settings.allowed_url_prefixes,
        tool_call_parser=args.tool_call_parser,
    )


def run_serve(args: argparse.Namespace) -> int:
    from server.engine_client import EngineStartError

    try:
        _check(args)
        weighted = sorted(tenant_table(args).weights()) if args.tenants and not args.embedded else []
        backend = build_backend(args)
    except ValueError as exc:
        print(f"tandem serve: error: {exc}", file=sys.stderr)
        return 2
    except EngineStartError as exc:  # its traceback is on stderr already, from the engine process
        print(f"tandem serve: error: the engine process failed to start: {exc}", file=sys.stderr)
        return 1
    if weighted:
        # Not an error: the weights are right, only read elsewhere. Said at start, since a worker
        # started without the file would give every tenant weight 1 and nothing here could tell.
        print(
            f"tandem serve: --tenants {args.tenants}: the weights of {', '.join(map(repr, weighted))} are the "
            f"workers' engines': start each `tandem worker` with --tenants {args.tenants} --policy fair",
            file=sys.stderr,
        )
    engine = getattr(backend, "engine", None)
    try:
        return _serve(args, backend)
    finally:
        if engine is not None:  # closed by the app's shutdown already, unless uvicorn never started it
            engine.stop(30)


def _serve(args: argparse.Namespace, backend) -> int:
    import socket

    import uvicorn

    from server.app import ServeConfig, create_app
    from server.h11_guard import guarded_h11
    from server.tenants import load_tenants

    config = ServeConfig(
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        served_model_name=args.served_model_name,
        api_key=api_key(args),
        tenants=tuple(load_tenants(args.tenants)) if args.tenants else (),
        keepalive_s=args.keepalive,
        body_timeout_s=args.body_timeout,
        header_timeout_s=args.header_timeout,
    )
    app = create_app(backend, config)
    _log_to_stderr(args.log_level)
    # Bind first, so that --port 0 can say which port it got before serving.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"tandem serve: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    print(f"tandem serve: {backend.mode} mode, listening on http://{host}:{port}", flush=True)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            access_log=False,
            http=guarded_h11(config.header_timeout_s),
        )
    )
    server.run(sockets=[sock])
    return 0


def _log_to_stderr(level: str) -> None:
    import logging

    from server.common import log

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False
