"""`python -m benchmarks NAME ...` (also `tandem bench NAME ...`): one subcommand per benchmark
or GPU check. Building the parser imports nothing heavy; each command loads what it needs."""

from __future__ import annotations

import argparse
import sys

# These modules keep torch out of their top level, so building the parser stays cheap.
from benchmarks.chaos import add_chaos_arguments
from benchmarks.fairness import add_arguments as add_fairness
from benchmarks.jobs import add_jobs_bench_arguments
from benchmarks.llm import add_bench_arguments as add_llm_bench
from benchmarks.mixed import add_bench_arguments as add_mixed_bench
from benchmarks.serve import add_bench_serve_arguments
from benchmarks.single import add_arguments as add_single
from benchmarks.step import add_arguments as add_step
from benchmarks.streams import add_bench_streams_arguments
from benchmarks.tenants import add_arguments as add_tenants
from benchmarks.vision import add_bench_arguments as add_vision_bench
from benchmarks.weight_kernels import add_arguments as add_weight_kernels
from benchmarks.worker_start import add_arguments as add_worker_start
from tandem.cli import int_list

# The GPU checks keep their own parsers (they also run as `python -m benchmarks.gpu_kernels`).
GPU_CHECKS = {
    "gpu-kernels": "benchmarks.gpu_kernels",
    "gpu-vision": "benchmarks.gpu_vision",
    "gpu-engine": "benchmarks.gpu_engine",
}


def build_parser(prog: str = "python -m benchmarks") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Benchmarks, with peers measured in the same run.")
    bench = parser.add_subparsers(dest="bench", required=True)
    p = bench.add_parser("scheduler", help="schedule + update time per step, no model")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sizes", type=int_list, default=[256, 1024])
    p.add_argument("--policies", type=lambda v: tuple(v.split(",")), default=("fcfs", "fair"))
    p.add_argument("--repeats", type=int, default=5, help="alternated runs of each policy per row (medians)")
    p.add_argument("--out", default="bench_out")
    p = bench.add_parser("fairness", help="each tenant's service over steps, FCFS against fair (VTC), no model")
    add_fairness(p)
    p = bench.add_parser("tenants", help="fair shares end to end: TTFT beside a flood and a batch backlog, per policy")
    add_tenants(p)
    add_vision_bench(bench.add_parser("vision", help="images/s and latency against Ultralytics"))
    add_llm_bench(bench.add_parser("llm", help="useful tokens/s, steps, KV use, TTFT: continuous vs static vs vLLM"))
    add_mixed_bench(bench.add_parser("mixed", help="chat + cameras: one Runtime vs two processes, deadlines met"))
    add_jobs_bench_arguments(bench.add_parser("jobs", help="LLM jobs through Redis + Celery vs the in-process Runtime"))
    add_bench_serve_arguments(
        bench.add_parser("serve", help="tandem serve vs vLLM's OpenAI server: output tok/s and TTFT")
    )
    add_chaos_arguments(
        bench.add_parser("chaos", help="a soak under faults: worker SIGKILLs, Redis restarts, dropped clients")
    )
    add_single(
        bench.add_parser("single", help="one sequence: decode and prefill tokens/s against llama.cpp on the GGUF")
    )
    add_bench_streams_arguments(
        bench.add_parser("streams", help="cameras per machine within a p99 latency bound, against Ultralytics")
    )
    add_step(bench.add_parser("step", help="a decode step against its linear floor, eager and captured; start-up"))
    add_weight_kernels(
        bench.add_parser(
            "weight-kernels", help="the linear layers: oneDNN-packed vs torch's int4/int8 weight-only kernels"
        )
    )
    add_worker_start(
        bench.add_parser("worker-start", help="a worker's start to ready: alone, through Redis restarts, on a busy CPU")
    )
    for name, module in GPU_CHECKS.items():
        bench.add_parser(name, help=f"GPU check (python -m {module} --help); exits 2 without CUDA", add_help=False)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks") -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in GPU_CHECKS:
        import importlib

        return importlib.import_module(GPU_CHECKS[argv[0]]).main(argv[1:])
    args = build_parser(prog).parse_args(argv)
    if args.bench == "scheduler":
        from benchmarks.scheduler import run

        run(tuple(args.sizes), args.steps, args.out, args.policies, args.repeats)
        return 0
    if args.bench == "fairness":
        from benchmarks.fairness import run as run_fairness

        return run_fairness(args)
    if args.bench == "tenants":
        from benchmarks.tenants import run as run_tenants

        return run_tenants(args)
    if args.bench == "vision":
        from benchmarks.vision import run_bench

        return run_bench(args)
    if args.bench == "llm":
        from benchmarks.llm import run_bench as run_llm_bench

        return run_llm_bench(args)
    if args.bench == "mixed":
        from benchmarks.mixed import run_bench as run_mixed_bench

        return run_mixed_bench(args)
    if args.bench == "serve":
        from benchmarks.serve import run_bench_serve

        return run_bench_serve(args)
    if args.bench == "single":
        from benchmarks.single import run as run_single

        return run_single(args)
    if args.bench == "step":
        from benchmarks.step import run as run_step

        return run_step(args)
    if args.bench == "streams":
        from benchmarks.streams import run_bench as run_streams

        return run_streams(args)
    if args.bench == "weight-kernels":
        from benchmarks.weight_kernels import run as run_weight_kernels

        return run_weight_kernels(args)
    if args.bench == "chaos":
        from benchmarks.chaos import run_chaos

        return run_chaos(args)
    if args.bench == "worker-start":
        from benchmarks.worker_start import run as run_worker_start

        return run_worker_start(args)
    if args.bench == "jobs":
        from benchmarks.jobs import run_jobs_bench

        return run_jobs_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
