"""`tandem bench jobs`: the trace of `tandem bench llm` sent as jobs through Redis and Celery,
against the same trace on the in-process Runtime, in one run.

    in-process   all requests submitted at once to a Runtime in this process
    jobs         all requests submitted at once with JobClient to one `tandem worker` process
                 (its own Runtime, same model, dtype and slots) over a private redis-server

Throughput is useful tokens / wall seconds from the first submit to the last result, the best
of `--repeats` runs per path; runs alternate between the paths (both stay loaded), so that a
neighbour's load on a shared machine hits both alike. The jobs path must keep the batch as
full as the in-process one does across tasks (the engine steps of both are reported).

Added latency per job is measured apart, on short jobs sent one at a time (so no queueing
hides in it): the client-seen latency of each job less the time it spent in the Runtime,
through Redis and Celery against in process, at p50. Subtracting each job's own Runtime time
keeps the model's speed (and a shared machine's noise) out of it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RedisServer, chat_workload


def add_jobs_bench_arguments(p) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dist", choices=["loguniform", "uniform"], default="loguniform", help="output lengths")
    p.add_argument("--slots", type=int, default=16, help="max_num_seqs of both Runtimes")
    p.add_argument("--latency-jobs", type=int, default=30, help="short jobs sent one at a time for added latency")
    p.add_argument("--repeats", type=int, default=2, help="runs of the trace on each path (the best counts)")
    p.add_argument("--redis-url", default=None, help="use this Redis (default: start a private redis-server)")
    p.add_argument(
        "--fsync",
        choices=["always", "everysec"],
        default="always",
        help="appendfsync of the private redis-server (always: what submit's durability needs)",
    )
    p.add_argument("--out", default="bench_out")
    p.add_argument("--seed", type=int, default=0)


class _InProcess:
    name = "in-process"

    def __init__(self, args) -> None:
        from runtime.runtime import Runtime

        self.rt = Runtime(llm={"model": args.model, "dtype": args.dtype, "max_num_seqs": args.slots})

    def short_job(self, prompt: list[int]) -> tuple[float, float]:
        """(client-seen latency, of which outside the Runtime) of one 8-token job."""
        from runtime.llm.sampling_params import SamplingParams

        t0 = time.perf_counter()
        out = self.rt.submit_generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)).result()
        latency = time.perf_counter() - t0
        return latency, latency - out.metrics.e2e_latency

    def trace(self, prompts, lengths) -> dict:
        from runtime.llm.sampling_params import SamplingParams

        steps0 = self.rt.stats()["llm"]["steps"]
        t0 = time.perf_counter()
        handles = [
            self.rt.submit_generate(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for p, n in zip(prompts, lengths)
        ]
        token_ids = [h.result().token_ids for h in handles]
        wall = time.perf_counter() - t0
        return {"seconds": wall, "steps": self.rt.stats()["llm"]["steps"] - steps0, "token_ids": token_ids}

    def close(self) -> None:
        self.rt.close(drain=False)


class _Jobs:
    name = "jobs (Redis + Celery)"

    def __init__(self, args, url: str) -> None:
        from workers.app import make_app
        from workers.client import JobClient
        from workers.settings import JobSettings

        settings = JobSettings(redis_url=url)
        self.node = f"bench-{os.getpid()}@{socket.gethostname()}"
        cmd = [
            sys.executable,
            "-m",
            "workers.worker",
            "--queues",
            "llm",
            "--max-num-seqs",
            str(args.slots),
            "--dtype",
            args.dtype,
            "--hostname",
            self.node,
            "--loglevel",
            "WARNING",
            "--redis-url",
            url,
        ]
        if args.model:
            cmd += ["--model", args.model]
        self.log = open(Path(args.out) / "jobs-worker.log", "w")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.worker = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.control = make_app(settings).control
        self.jobs = JobClient(settings=settings)
        deadline = time.monotonic() + 600
        while not self.control.ping(destination=[self.node], timeout=0.5):
            if self.worker.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the bench worker did not start; see {self.log.name}")

    def _steps(self) -> int:
        reply = self.control.broadcast("tandem_stats", reply=True, destination=[self.node], timeout=10)
        return reply[0][self.node]["runtime"]["llm"]["steps"]

    def short_job(self, prompt: list[int]) -> tuple[float, float]:
        t0 = time.perf_counter()
        result = self.jobs.result(self.jobs.submit(prompt, max_tokens=8, temperature=0, ignore_eos=True))
        latency = time.perf_counter() - t0
        return latency, latency - result["timings"]["runtime_s"]

    def trace(self, prompts, lengths) -> dict:
        steps0 = self._steps()
        t0 = time.perf_counter()
        ids = [self.jobs.submit(p, max_tokens=n, temperature=0, ignore_eos=True) for p, n in zip(prompts, lengths)]
        submit_s = time.perf_counter() - t0
        self.jobs.wait(ids)
        wall = time.perf_counter() - t0
        token_ids = [self.jobs.result(j)["token_ids"] for j in ids]
        return {"seconds": wall, "steps": self._steps() - steps0, "token_ids": token_ids, "submit_seconds": submit_s}

    def close(self) -> None:
        self.jobs.close()
        self.worker.send_signal(signal.SIGTERM)
        try:
            self.worker.wait(60)
        except subprocess.TimeoutExpired:
            self.worker.kill()
        self.log.close()


def run_jobs_bench(args) -> int:
    from runtime.llm.loader import load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_model(args.model).tokenizer
    prompts, lengths = chat_workload(tok, args.num_requests, args.min_tokens, args.max_tokens, args.seed, args.dist)
    short = [tok.encode(f"Say hello number {i}.", add_special_tokens=False) for i in range(args.latency_jobs)]
    print(
        f"{len(prompts)} requests, {args.dist} output lengths {min(lengths)}..{max(lengths)} "
        f"(sum {sum(lengths)}), {args.slots} slots, {args.dtype}, {args.repeats} runs of each path, "
        f"interleaved; added latency on {len(short)} 8-token jobs"
    )
    redis = paths = None
    try:
        url = args.redis_url
        if url is None:
            redis = RedisServer(args.fsync)
            url = redis.url
        paths = [_InProcess(args), _Jobs(args, url)]
        for path in paths:  # warm-up
            path.short_job(short[0])
        # Both paths stay loaded; each run alternates between them, so a neighbour's load on a
        # shared machine hits both alike. Latency: one job on each path in turn.
        latency: dict[str, list[tuple[float, float]]] = {p.name: [] for p in paths}
        for q in short:
            for p in paths:
                latency[p.name].append(p.short_job(q))
        runs = {p.name: [] for p in paths}
        for _ in range(args.repeats):
            for p in paths:
                runs[p.name].append(p.trace(prompts, lengths))
    finally:
        for p in paths or []:
            p.close()
        if redis is not None:
            redis.close()
    report = _report(args, prompts, lengths, paths, runs, latency)
    _print(report)
    (out / "jobs.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "jobs.png")
    print(f"wrote {out / 'jobs.json'} and {out / 'jobs.png'}")
    return 0


def _report(args, prompts, lengths, paths, runs, latency) -> dict:
    useful = sum(lengths)
    rows = []
    for p in paths:
        best = min(runs[p.name], key=lambda r: r["seconds"])
        lat = [x[0] for x in latency[p.name]]
        over = [x[1] for x in latency[p.name]]
        rows.append(
            {
                "name": p.name,
                "useful_tokens": useful,
                "seconds": best["seconds"],
                "tokens_per_s": useful / best["seconds"],
                "steps": best["steps"],
                "runs_tokens_per_s": [useful / r["seconds"] for r in runs[p.name]],
                "submit_seconds": best.get("submit_seconds"),
                "short_latency_s": lat,
                "short_overhead_s": over,
            }
        )
    local, remote = rows
    first = [runs[p.name][0]["token_ids"] for p in paths]
    return {
        "num_requests": len(prompts),
        "useful_tokens": useful,
        "slots": args.slots,
        "dtype": args.dtype,
        "dist": args.dist,
        "repeats": args.repeats,
        "redis_fsync": args.fsync if args.redis_url is None else "external",
        "throughput_ratio": remote["tokens_per_s"] / local["tokens_per_s"],
        # What a job spends outside the Runtime (submit, broker, claim, result), less what an
        # in-process caller spends outside it (handle hand-offs): each job's own Runtime time is
        # subtracted, so the model's speed and a neighbour's load stay out of it.
        "added_latency_p50_ms": 1000
        * (statistics.median(remote["short_overhead_s"]) - statistics.median(local["short_overhead_s"])),
        "same_tokens": first[0] == first[1],
        "runs": rows,
    }


def _print(report: dict) -> None:
    local, remote = report["runs"]
    print(
        f"\n{'path':<24}{'useful tok/s':>14}{'seconds':>10}{'steps':>8}{'8-token job p50':>18}"
        f"{'outside Runtime p50':>22}"
    )
    for r in (local, remote):
        lat = 1000 * statistics.median(r["short_latency_s"])
        over = 1000 * statistics.median(r["short_overhead_s"])
        print(
            f"{r['name']:<24}{r['tokens_per_s']:>14.1f}{r['seconds']:>10.1f}{r['steps']:>8}{lat:>15.1f} ms"
            f"{over:>19.2f} ms   runs: {', '.join(f'{x:.1f}' for x in r['runs_tokens_per_s'])} tok/s"
        )
    ok_tp = "meets" if report["throughput_ratio"] >= 0.9 else "misses"
    ok_lat = "meets" if report["added_latency_p50_ms"] <= 5 else "misses"
    print(
        f"throughput ratio {report['throughput_ratio']:.3f} (target >= 0.9: {ok_tp}); added latency p50 "
        f"{report['added_latency_p50_ms']:.2f} ms (target <= 5 ms: {ok_lat}); "
        f"same tokens: {report['same_tokens']}; submit of {report['num_requests']} jobs took "
        f"{remote['submit_seconds'] * 1000:.0f} ms; Redis appendfsync {report['redis_fsync']}"
    )


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    local, remote = report["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.5))
    names = ["in-process", "jobs"]
    ax1.bar(names, [local["tokens_per_s"], remote["tokens_per_s"]], color=["tab:blue", "tab:orange"])
    ax1.set_ylabel("useful tokens/s")
    ax1.set_title(f"{report['num_requests']} requests, {report['slots']} slots")
    ax2.boxplot(
        [[1000 * x for x in local["short_latency_s"]], [1000 * x for x in remote["short_latency_s"]]], tick_labels=names
    )
    ax2.set_ylabel("8-token job latency (ms)")
    ax2.set_title(f"added p50 {report['added_latency_p50_ms']:.1f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="tandem bench jobs", description=__doc__.split("\n\n")[0])
    add_jobs_bench_arguments(parser)
    return run_jobs_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
