"""The `tandem` command: the top of the house, wiring every package below it (runtime, workers,
server). Building the parser imports nothing heavy; each subcommand loads what it needs when
it runs."""

from __future__ import annotations

import argparse
import os
import sys

# These modules keep torch out of their top level, so building the parser stays cheap.
from runtime.llm.flags import add_llm_arguments
from runtime.vision.cli import add_detect_arguments
from tandem.serve_cli import add_serve_arguments
from tandem.streams_cli import add_streams_arguments
from workers.worker import add_worker_arguments


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows each flag's default, unless the help already says it or it is unset."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or any(action.default is v for v in (None, False, argparse.SUPPRESS))
        ):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"tandem {version('tandem')}"
    except PackageNotFoundError:
        return "tandem (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="LLM and YOLO serving on one device.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = _DefaultsFormatter

    p = sub.add_parser("simulate", help="static vs continuous batching on the real schedulers (no model)")
    p.add_argument("--lengths", type=int_list, default=[5, 50, 8, 12, 40, 3, 30, 7], help="output lengths, e.g. 5,50,8")
    p.add_argument("--slots", type=int, default=4, help="sequences decoded together per step")

    p = sub.add_parser("demo", help="the mixed workload on embedded defaults")
    p.add_argument("--skip-vision", action="store_true")
    p.add_argument("--skip-llm", action="store_true")

    p = sub.add_parser("generate", help="generate from a prompt, streaming the text", formatter_class=defaults)
    p.add_argument("prompt", help="the prompt, or - to read it from standard input")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    add_llm_arguments(p)

    p = sub.add_parser("chat", help="interactive chat", formatter_class=defaults)
    add_llm_arguments(p)

    p = sub.add_parser(
        "detect", help="YOLO detection over images, directories, lists, videos or .streams", formatter_class=defaults
    )
    add_detect_arguments(p)

    add_worker_arguments(sub.add_parser("worker", help="a Celery worker hosting one Runtime (queues llm, vision)"))
    add_streams_arguments(
        sub.add_parser(
            "streams", help="camera ingestion as a service: .streams to detections in Redis", formatter_class=defaults
        )
    )
    add_serve_arguments(
        sub.add_parser(
            "serve", help="OpenAI-compatible HTTP server over the workers (or --embedded)", formatter_class=defaults
        )
    )

    # The benchmarks live beside the product (benchmarks/), which never imports them: this runs
    # `python -m benchmarks ...` in this process's place.
    p = sub.add_parser(
        "bench",
        help="benchmarks and GPU checks, with peers measured in the same run "
        "(python -m benchmarks; `tandem bench --help` lists them)",
        add_help=False,
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # before parsing: every flag after it is the benchmark's own
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks", *argv[1:]])
    args = build_parser().parse_args(argv)
    if args.command == "simulate":
        from runtime.simulate import format_report

        if args.slots < 1:
            print("--slots must be >= 1", file=sys.stderr)
            return 2
        print(format_report(args.lengths, args.slots))
        return 0
    if args.command == "demo":
        from runtime.demo import run_demo

        return run_demo(vision=not args.skip_vision, llm=not args.skip_llm)
    if args.command in ("generate", "chat"):
        from runtime.llm import cli as llm_cli

        return llm_cli.run_generate(args) if args.command == "generate" else llm_cli.run_chat(args)
    if args.command == "detect":
        from runtime.vision.cli import run_detect

        return run_detect(args)
    if args.command == "worker":
        from workers.worker import run_worker

        return run_worker(args)
    if args.command == "streams":
        from tandem.streams_cli import run_streams

        return run_streams(args)
    if args.command == "serve":
        from tandem.serve_cli import run_serve

        return run_serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
