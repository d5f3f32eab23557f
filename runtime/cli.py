"""The `tandem` command. Building the parser imports nothing heavy; each subcommand loads
what it needs when it runs."""

from __future__ import annotations

import argparse
import sys

# These modules keep torch out of their top level, so building the parser stays cheap.
from runtime.bench_mixed import add_bench_arguments as add_mixed_bench
from runtime.llm.bench import add_bench_arguments as add_llm_bench
from runtime.vision.bench import add_bench_arguments as add_vision_bench
from runtime.vision.cli import add_detect_arguments
from runtime.server.cli import add_serve_arguments
from workers.bench import add_jobs_bench_arguments
from workers.bench_serve import add_bench_serve_arguments
from workers.cameras_http import add_streams_arguments
from workers.worker import add_worker_arguments


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _add_llm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weight and KV cache type (auto: bfloat16 on CPUs with AMX or AVX512-BF16 and on GPUs, else float32)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda if available)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + answer in tokens (default: the model's, capped at 2048)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step (default: 16 on CPU, 256 on GPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: 256 on CPU, 2048 on GPU)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before EOS or a stop token may end")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 makes tokens of the prompt and answer less likely (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from tokens already generated, in [-2, 2] (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per earlier occurrence in the answer, in [-2, 2] (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="per-request seed, for repeatable sampling")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the answer at TEXT (not printed); repeat for several")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows each flag's default, unless the help already says it or it is unset."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or any(
            action.default is v for v in (None, False, argparse.SUPPRESS)
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
    p.add_argument("--lengths", type=_int_list, default=[5, 50, 8, 12, 40, 3, 30, 7], help="output lengths, e.g. 5,50,8")
    p.add_argument("--slots", type=int, default=4, help="sequences decoded together per step")

    p = sub.add_parser("demo", help="the mixed workload on embedded defaults")
    p.add_argument("--skip-vision", action="store_true")
    p.add_argument("--skip-llm", action="store_true")

    p = sub.add_parser("generate", help="generate from a prompt, streaming the text", formatter_class=defaults)
    p.add_argument("prompt", help="the prompt, or - to read it from standard input")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    _add_llm_arguments(p)

    p = sub.add_parser("chat", help="interactive chat", formatter_class=defaults)
    _add_llm_arguments(p)

    p = sub.add_parser("detect", help="YOLO detection over images, directories, lists, videos or .streams",
                       formatter_class=defaults)
    add_detect_arguments(p)

    add_worker_arguments(sub.add_parser("worker", help="a Celery worker hosting one Runtime (queues llm, vision)"))
    add_streams_arguments(sub.add_parser("streams", help="camera ingestion as a service: .streams to detections in Redis",
                                         formatter_class=defaults))  # fmt: skip
    add_serve_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server over the workers (or --embedded)",
                                       formatter_class=defaults))  # fmt: skip

    bench = sub.add_parser("bench", help="benchmarks, with peers measured in the same run").add_subparsers(
        dest="bench", required=True
    )
    p = bench.add_parser("scheduler", help="schedule + update time per step, no model")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sizes", type=_int_list, default=[256, 1024])
    p.add_argument("--out", default="bench_out")
    add_vision_bench(bench.add_parser("vision", help="images/s and latency against Ultralytics"))
    add_llm_bench(bench.add_parser("llm", help="useful tokens/s, steps, KV use, TTFT: continuous vs static vs vLLM"))
    add_mixed_bench(bench.add_parser("mixed", help="chat + cameras: one Runtime vs two processes, deadlines met"))
    add_jobs_bench_arguments(bench.add_parser("jobs", help="LLM jobs through Redis + Celery vs the in-process Runtime"))
    add_bench_serve_arguments(bench.add_parser("serve", help="tandem serve vs vLLM's OpenAI server: output tok/s and TTFT"))
    return parser


def main(argv: list[str] | None = None) -> int:
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
        from workers.cameras_http import run_streams

        return run_streams(args)
    if args.command == "serve":
        from runtime.server.cli import run_serve

        return run_serve(args)
    if args.command == "bench":
        if args.bench == "scheduler":
            from runtime.bench_scheduler import run

            run(tuple(args.sizes), args.steps, args.out)
            return 0
        if args.bench == "vision":
            from runtime.vision.bench import run_bench

            return run_bench(args)
        if args.bench == "llm":
            from runtime.llm.bench import run_bench as run_llm_bench

            return run_llm_bench(args)
        if args.bench == "mixed":
            from runtime.bench_mixed import run_bench as run_mixed_bench

            return run_mixed_bench(args)
        if args.bench == "serve":
            from workers.bench_serve import run_bench_serve

            return run_bench_serve(args)
        if args.bench == "jobs":
            from workers.bench import run_jobs_bench

            return run_jobs_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
