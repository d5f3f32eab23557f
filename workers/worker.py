"""`tandem worker`: one Celery worker process hosting one Runtime (one per device).

    tandem worker                                   # queues llm and vision, embedded defaults
    tandem worker --queues llm --dtype bfloat16 --max-num-seqs 32
    tandem worker --queues vision --vision-model yolo26n.pt --imgsz 640
    tandem worker --queues llm --model smol=/models/SmolLM2     # served as "smol"
    tandem worker --queues llm --policy fair --tenants tenants.toml   # the tenants' weights

A worker serving model NAME consumes the queue `llm.NAME` (settings.model_queue), where `tandem
serve` sends the requests that name it, and the plain `llm` queue, which it runs on its model.
One worker process serves one model: the device's memory manager holds one KV pool (start one
worker per model; many workers of one model share its queue).

It runs Celery's threads pool: many tasks wait at once on one Runtime, so concurrent jobs
share one continuous batch. Concurrency (and so prefetch, at one message per thread) is sized
from max_num_seqs: the batch, plus half again waiting in the Runtime's queue, so that a
finishing job's slot is refilled at the next step, not after a broker round trip.

--tenants: the file `tandem serve --tenants` reads (workers/tenants_file.py). The server puts
each request's tenant on its job; the worker's engine weighs them (--policy fair). The worker
reads the weights only: keys and limits are the server's admission, passed before a job reaches
Redis (a job a Celery client sends straight to Redis is weighed, never limited). One file for
both, so that the names the server puts on jobs are the names the workers weigh.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from runtime.llm.flags import add_engine_arguments, engine_options
from runtime.vision.detector import WEIGHTS, default_imgsz
from runtime.vision.flags import add_max_image_pixels_argument, max_image_pixels_option
from workers.settings import QUEUES
from workers.tenants_file import check_weights_policy, load_tenants, tenant_weights

log = logging.getLogger(__name__)


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=None, help="broker and job store (default: $TANDEM_REDIS_URL or local)")
    p.add_argument("--concurrency", type=int, default=None, help="task threads (default: from --max-num-seqs)")
    p.add_argument("--hostname", default=None, help="Celery node name (default: tandem-<queues>-<pid>@<host>)")
    p.add_argument("--loglevel", default="INFO")
    p.add_argument(
        "--tenants",
        default=None,
        metavar="TOML",
        help="the tenants file of `tandem serve --tenants` (the same file): each tenant's weight, its share under "
        "--policy fair, is this worker's engine's; keys and limits are the server's, read there",
    )
    add_runtime_arguments(p)


def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    """The Runtime's flags, shared by `tandem worker` and `tandem serve --embedded`."""
    p.add_argument("--queues", default="llm,vision", help="comma-separated: llm, vision or both")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients ask for (default: the model's file name; SmolLM2-135M-Instruct)",
    )
    p.add_argument("--allowed-roots", default=None, help=f"{os.pathsep}-separated folders tandem.detect may read")
    # "resolve": the engine's --model (one PATH) is replaced by the worker's repeatable [NAME=]PATH.
    llm = p.add_argument_group("llm", conflict_handler="resolve")
    add_engine_arguments(llm)
    llm.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="[NAME=]PATH",
        help="local HF folder or .gguf file, served as NAME (default name: the file's; default model: "
        "SmolLM2-135M-Instruct). One per worker process today",
    )
    g = p.add_argument_group("vision")
    g.add_argument(
        "--vision-model",
        default=str(WEIGHTS),
        help="a .pt checkpoint or a .yaml (random weights); default: the shipped shapes detector",
    )
    g.add_argument("--imgsz", type=int, default=None, help="default: the shipped detector's 320, else 640")
    g.add_argument("--vision-max-batch-size", type=int, default=8)
    add_max_image_pixels_argument(g)
    p.add_argument("--no-profile", action="store_true", help="skip start-up profiling (faster start)")


def parse_model_flag(values: list[str] | str | None) -> tuple[str | None, str | None]:
    """(NAME or None, PATH or None) from the --model flags; ValueError names the flag."""
    if values is None:
        return None, None
    values = [values] if isinstance(values, str) else list(values)
    if len(values) > 1:
        raise ValueError(
            f"--model: one worker process serves one model (the device's memory manager holds one KV "
            f"pool); start one worker per model, got {len(values)}: {values}"
        )
    value = values[0]
    name, sep, path = value.partition("=")
    if not sep or os.path.exists(value):  # a plain PATH (one that holds '=' too, if it exists)
        return None, value
    if not name or not path:
        raise ValueError(f"--model must be PATH or NAME=PATH with both parts non-empty, got {value!r}")
    return name, path


def tenants_option(args: argparse.Namespace, queues: list[str]) -> dict:
    """{"tenant_weights": {tenant: weight}} for the LLM engine from --tenants, or {} (no file, or
    every weight 1). A weight needs the llm queue and --policy fair, or it would be read and
    ignored: ValueError naming the file, the tenant and the flag. `tandem serve --embedded`
    comes here too (its own --tenants), through worker_plan."""
    path = getattr(args, "tenants", None)
    if not path:
        return {}
    weights = tenant_weights(load_tenants(path))
    if weights and "llm" not in queues:
        raise ValueError(
            f"--tenants {path}: tenant {sorted(weights)[0]!r} has a weight, which only the LLM engine reads; "
            f"--queues {args.queues} has no llm"
        )
    check_weights_policy(path, weights, args.policy)
    return {"tenant_weights": weights} if weights else {}


def worker_plan(args: argparse.Namespace) -> tuple[dict, list[str], int]:
    """(Runtime keyword arguments, queues, concurrency) from the flags; ValueError names the flag.
    --model NAME=PATH sets args.served_model_name to NAME (the name the model is served as)."""
    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    if not queues or set(queues) - set(QUEUES):
        raise ValueError(f"--queues must name some of {list(QUEUES)}, got {args.queues!r}")
    name, path = parse_model_flag(getattr(args, "model", None))
    if name is not None:
        if args.served_model_name not in (None, name):
            raise ValueError(
                f"--served-model-name {args.served_model_name!r} and --model {name}=... name the model twice"
            )
        args.served_model_name = name
    llm = vision = None
    if "llm" in queues:
        llm = engine_options(argparse.Namespace(**{**vars(args), "model": path}))
    tenants = tenants_option(args, queues)
    if tenants:
        llm.update(tenants)  # the engine's fair scheduler (schedulers/fair.py)
    if "vision" in queues:
        batching = {"max_batch_size": args.vision_max_batch_size}
        vision = {
            "model": args.vision_model,
            "imgsz": args.imgsz or default_imgsz(args.vision_model),
            "batching": batching,
            **max_image_pixels_option(args),
        }
        if args.device is not None:
            vision["device"] = args.device
        if args.no_profile:
            vision["profile"] = False
    concurrency = getattr(args, "concurrency", None)
    if concurrency is None:
        concurrency = 0
        if llm is not None:
            seqs = args.max_num_seqs or (256 if (args.device or "").startswith("cuda") else 16)
            concurrency += seqs + max(2, seqs // 2)
        if vision is not None:
            concurrency += 2 * args.vision_max_batch_size
    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    return {"llm": llm, "vision": vision, "profile": not args.no_profile}, queues, concurrency


def run_worker(args: argparse.Namespace) -> int:
    try:
        runtime, queues, concurrency = worker_plan(args)
    except ValueError as exc:
        print(f"tandem worker: error: {exc}", file=sys.stderr)
        return 2
    weights = (runtime.get("llm") or {}).get("tenant_weights")
    # The host reads these when the worker starts (workers/host.py), in this process.
    os.environ["TANDEM_WORKER_RUNTIME"] = json.dumps(runtime)
    if args.redis_url:
        os.environ["TANDEM_REDIS_URL"] = args.redis_url
    if args.allowed_roots is not None:
        os.environ["TANDEM_ALLOWED_ROOTS"] = args.allowed_roots
    if args.served_model_name:
        os.environ["TANDEM_SERVED_MODEL_NAME"] = args.served_model_name
    from workers.settings import JobSettings

    try:
        JobSettings.from_env()  # fail here, not inside Celery, on a bad TANDEM_* value
    except ValueError as exc:
        print(f"tandem worker: error: {exc}", file=sys.stderr)
        return 2
    from workers.app import app

    # Celery sets up its logging only after worker_init, where the Runtime loads: without a
    # handler of our own, the load's lines ("runtime ready in X s", the C++ attention op's build)
    # went nowhere, and a slow start could not be told from a slow broker. Celery replaces this
    # root handler with its own once it starts (worker_hijack_root_logger), so no line is doubled.
    logging.basicConfig(level=args.loglevel.upper(), format="[%(asctime)s: %(levelname)s/%(processName)s] %(message)s")
    if args.tenants:
        # Said once at start: the file's keys and limits are read by the server, not here.
        log.info(
            "--tenants %s: tenant weights %s (others 1); its keys and limits are tandem serve's",
            args.tenants,
            weights or {},
        )
    name = args.hostname or f"tandem-{'-'.join(queues)}-{os.getpid()}@%h"
    argv = [
        "worker",
        "--pool",
        "threads",
        "--concurrency",
        str(concurrency),
        "--queues",
        ",".join(queues),
        "--hostname",
        name,
        "--loglevel",
        args.loglevel,
        "--prefetch-multiplier",
        "1",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    app.worker_main(argv)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem worker", description=__doc__.split("\n\n")[0])
    add_worker_arguments(parser)
    return run_worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
