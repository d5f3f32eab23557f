"""Fair shares end to end (issue 31's latency targets): Redis, one `tandem worker` per policy,
jobs submitted through Celery (JobClient) with a tenant and a tier, times to first token read from
each job's record.

    flood   a light tenant's 4 chats alone (its idle TTFT), then beside a heavy tenant's 40 jobs
            queued just before them: target, light TTFT p50 within 2x idle under fair (and not
            under fcfs)
    batch   a backlog of 100 batch jobs alone, then again with 4 interactive chats sent after it:
            targets, the chats' TTFT p50 within 1.5x idle, the backlog's time within 1.10x alone

    python -m benchmarks tenants [--max-num-seqs 8] [--policies fair,fcfs] [--model DIR] [--out DIR]

Latency figures belong here, not in tests (tests/test_tenants_e2e.py asserts the order the
engine served the jobs in, which a busy machine does not change). Writes tenants.json and
tenants.png (TTFT ratios per policy against their targets)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RedisServer, cpu_info, python_env, write_tiny_llama

TARGETS = {"flood_ttft": 2.0, "batch_ttft": 1.5, "backlog_time": 1.10}


def add_arguments(p) -> None:
    p.add_argument("--policies", default="fair,fcfs", help="comma-separated, each its own worker")
    p.add_argument("--max-num-seqs", type=int, default=8, help="the worker's slots")
    p.add_argument("--model", default=None, help="an HF folder (default: a tiny random Llama, seconds a run)")
    p.add_argument("--heavy", type=int, default=40, help="the heavy tenant's jobs")
    p.add_argument("--backlog", type=int, default=100, help="batch jobs in the backlog")
    p.add_argument("--max-tokens", type=int, default=48, help="output tokens of each chat and heavy job")
    p.add_argument("--out", default="bench_out/tenants")


class _Fleet:
    """A private Redis and one worker with `policy`; JobClient helpers over it."""

    def __init__(self, policy: str, model: str, args, folder: Path) -> None:
        from workers.client import JobClient
        from workers.settings import JobSettings

        self.redis = RedisServer(folder=str(folder / f"redis-{policy}"), start=False)
        (folder / f"redis-{policy}").mkdir()
        self.redis.start()
        self.jobs = JobClient(settings=JobSettings(redis_url=self.redis.url))
        cmd = [sys.executable, "-m", "tandem", "worker", "--redis-url", self.redis.url, "--queues", "llm"]
        cmd += ["--hostname", f"tenants-{policy}@%h", "--dtype", "float32", "--no-profile", "--model", model]
        cmd += ["--max-num-seqs", str(args.max_num_seqs), "--kv-cache-bytes", str(256 << 20)]
        cmd += ["--concurrency", "256", "--policy", policy]
        self.log = open(folder / f"worker-{policy}.log", "w")
        self.worker = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=python_env())
        warm = self.jobs.submit("Hello", max_tokens=2)
        if self.jobs.wait([warm], timeout=300) != {warm}:
            raise RuntimeError(f"the {policy} worker did not answer within 300 s (see {self.log.name})")

    def ttfts(self, ids: list[str]) -> list[float]:
        if self.jobs.wait(ids, timeout=900) != set(ids):
            raise RuntimeError("jobs did not finish within 900 s")
        return [self.jobs.result(i, timeout=0)["timings"]["ttft_s"] for i in ids]

    def chats(self, tenant: str, n: int, max_tokens: int) -> list[str]:
        return [
            self.jobs.submit(
                messages=[{"role": "user", "content": f"Tell me story number {i}."}],
                tenant=tenant,
                max_tokens=max_tokens,
                ignore_eos=True,
            )
            for i in range(n)
        ]

    def backlog(self, n: int) -> list[str]:
        return [
            self.jobs.submit(f"Summarise document {i}.", tenant="offline", tier="batch", max_tokens=16, ignore_eos=True)
            for i in range(n)
        ]

    def close(self) -> None:
        self.jobs.close()
        self.worker.terminate()
        try:
            self.worker.wait(30)
        except subprocess.TimeoutExpired:
            self.worker.kill()
        self.log.close()
        self.redis.close()


def one_policy(policy: str, model: str, args, folder: Path) -> dict:
    fleet = _Fleet(policy, model, args, folder)
    try:
        n, k = 4, args.max_tokens
        fleet.ttfts(fleet.chats("light", n, k))  # warm-up
        idle = statistics.median(fleet.ttfts(fleet.chats("light", n, k)))
        heavy = [
            fleet.jobs.submit(f"Once upon a time, {i}", tenant="heavy", max_tokens=k, ignore_eos=True)
            for i in range(args.heavy)
        ]
        flood = statistics.median(fleet.ttfts(fleet.chats("light", n, k)))
        fleet.ttfts(heavy)
        t0 = time.monotonic()
        fleet.ttfts(fleet.backlog(args.backlog))
        alone = time.monotonic() - t0
        t0 = time.monotonic()
        backlog = fleet.backlog(args.backlog)
        beside = statistics.median(fleet.ttfts(fleet.chats("online", n, k)))
        fleet.ttfts(backlog)
        with_chats = time.monotonic() - t0
    finally:
        fleet.close()
    return {
        "policy": policy,
        "idle_ttft_s": idle,
        "flood_ttft_s": flood,
        "flood_ttft": flood / idle,
        "batch_chat_ttft_s": beside,
        "batch_ttft": beside / idle,
        "backlog_alone_s": alone,
        "backlog_with_chats_s": with_chats,
        "backlog_time": with_chats / alone,
    }


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(TARGETS)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(rows))
    for i, row in enumerate(rows):
        ax.bar([x + i * width for x in range(len(keys))], [row[k] for k in keys], width, label=row["policy"])
    for x, k in enumerate(keys):
        ax.hlines(TARGETS[k], x - 0.1, x + 0.8, colors="black", linestyles="dashed")
    ax.set_xticks(
        [x + 0.4 - width / 2 for x in range(len(keys))],
        ["light TTFT beside a flood", "chat TTFT beside a backlog", "backlog time"],
    )
    ax.set_yscale("log")
    ax.set_ylabel("x idle (dashed: target)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    print(f"cpu: {cpu['model']}, {cpu['cores']} cores, flags: {cpu['flags']}")
    with tempfile.TemporaryDirectory(prefix="tandem-tenants-") as tmp:
        folder = Path(tmp)
        model = args.model or write_tiny_llama(str(folder / "tiny-llama"))
        rows = [one_policy(p.strip(), model, args, folder) for p in args.policies.split(",") if p.strip()]
    print(f"{args.max_num_seqs} slots; {args.heavy} heavy jobs; {args.backlog} batch jobs; 4 chats")
    print(f"{'policy':>7} {'idle ms':>8} {'flood':>16} {'chats by backlog':>18} {'backlog time':>14}")
    for r in rows:
        marks = {k: "met" if r[k] <= t else "NOT met" for k, t in TARGETS.items()}
        print(
            f"{r['policy']:>7} {r['idle_ttft_s'] * 1000:8.0f} "
            f"{r['flood_ttft']:6.2f}x {marks['flood_ttft']:>8} {r['batch_ttft']:8.2f}x {marks['batch_ttft']:>8} "
            f"{r['backlog_time']:6.2f}x {marks['backlog_time']:>7}"
        )
    t = TARGETS
    print(
        f"targets: flood <= {t['flood_ttft']}x idle, chats <= {t['batch_ttft']}x idle, backlog <= {t['backlog_time']}x alone"
    )
    (out / "tenants.json").write_text(json.dumps({"cpu": cpu, "args": vars(args), "rows": rows}, indent=2))
    _plot(rows, out / "tenants.png")
    print(f"wrote {out / 'tenants.json'} and {out / 'tenants.png'}")
    return 0
