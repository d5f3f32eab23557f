"""Fair shares end to end (issue 31's latency targets): Redis, one `tandem worker` per policy,
jobs submitted through Celery (JobClient) with a tenant and a tier, times to first token read from
each job's record.

    flood   a light tenant's 4 chats alone (its idle TTFT), then beside a heavy tenant's 40 jobs
            queued just before them: target, light TTFT p50 within 2x idle under fair (and not
            under fcfs)
    batch   a backlog of 100 batch jobs alone, then again with 4 interactive chats sent after it:
            targets, the chats' TTFT p50 within 1.5x idle, the backlog's time within 1.10x alone

    python -m benchmarks tenants [--max-num-seqs 8] [--policies fair,fcfs] [--model DIR|tiny] [--rounds 3] [--out DIR]

Every phase runs `--rounds` times (idle, flood, backlog alone, backlog with chats, in turn); the
TTFT medians are over all rounds' chats and the backlog's ratio is the median round's.

The model is the worker's default, SmolLM2-135M, as served; `--model tiny` (a random two-layer
Llama whose forward pass takes about a millisecond) leaves nothing but the path a job takes
through Redis and the worker's threads, and shows what that path costs. Each TTFT is split at
the job's claim: submit -> claim (Redis, the worker's pop, its thread pool) and claim -> first
token (the engine, and the job thread that reads the token).

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
    p.add_argument(
        "--model",
        default=None,
        help="an HF folder or .gguf; 'tiny': a random two-layer Llama (default: SmolLM2, as served)",
    )
    p.add_argument("--heavy", type=int, default=40, help="the heavy tenant's jobs")
    p.add_argument("--backlog", type=int, default=100, help="batch jobs in the backlog")
    p.add_argument("--max-tokens", type=int, default=48, help="output tokens of each chat and heavy job")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every phase; TTFTs pooled, ratios' median")
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
        cmd += ["--hostname", f"tenants-{policy}@%h", "--dtype", "float32", "--no-profile"]
        cmd += ["--model", model] if model else []  # None: the worker's default, SmolLM2
        cmd += ["--max-num-seqs", str(args.max_num_seqs), "--kv-cache-bytes", str(256 << 20)]
        cmd += ["--concurrency", "256", "--policy", policy]
        self.log = open(folder / f"worker-{policy}.log", "w")
        self.worker = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=python_env())
        warm = self.jobs.submit("Hello", max_tokens=2)
        if self.jobs.wait([warm], timeout=300) != {warm}:
            raise RuntimeError(f"the {policy} worker did not answer within 300 s (see {self.log.name})")

    def ttfts(self, ids: list[str]) -> list[float]:
        return [t["ttft_s"] for t in self.timings(ids)]

    def timings(self, ids: list[str]) -> list[dict]:
        """Each job's timings once all are done: ttft_s, and its two parts (seconds)."""
        if self.jobs.wait(ids, timeout=900) != set(ids):
            raise RuntimeError("jobs did not finish within 900 s")
        out = []
        for i in ids:
            ttft = self.jobs.result(i, timeout=0)["timings"]["ttft_s"]
            record = self.jobs.status(i)["timings"]  # the job record's epoch seconds
            claim = record["started_at"] - record["submitted_at"]
            out.append({"ttft_s": ttft, "claim_s": claim, "engine_s": ttft - claim})
        return out

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

    def aof_rewrites(self) -> int:
        """How many times Redis has rewritten its append-only file (a fork and a file's worth of
        writes beside the fsyncs every job waits on)."""
        import redis

        with redis.Redis.from_url(self.redis.url) as client:
            return int(client.info("persistence").get("aof_rewrites", 0))

    def close(self) -> None:
        self.jobs.close()
        self.worker.terminate()
        try:
            self.worker.wait(30)
        except subprocess.TimeoutExpired:
            self.worker.kill()
        self.log.close()
        self.redis.close()


def _medians(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in ("ttft_s", "claim_s", "engine_s")}


def one_policy(policy: str, model: str | None, args, folder: Path) -> dict:
    """`args.rounds` rounds of: 4 idle chats, the flood, the backlog alone, the backlog with
    chats. The TTFTs are pooled over the rounds (4 chats a round all meet the same moment of the
    engine's step, so one round is nearly one sample); the backlog's ratio is the median of the
    rounds' (with chats / alone), each pair back to back."""
    fleet = _Fleet(policy, model, args, folder)
    n, k = 4, args.max_tokens
    idle, flood, beside, backlog_ratios, alone_s, with_s, rewrites = [], [], [], [], [], [], []
    try:
        fleet.ttfts(fleet.chats("light", n, k))  # warm-up
        for _ in range(args.rounds):
            idle += fleet.timings(fleet.chats("light", n, k))
            heavy = [
                fleet.jobs.submit(f"Once upon a time, {i}", tenant="heavy", max_tokens=k, ignore_eos=True)
                for i in range(args.heavy)
            ]
            flood += fleet.timings(fleet.chats("light", n, k))
            fleet.ttfts(heavy)
            t0 = time.monotonic()
            fleet.ttfts(fleet.backlog(args.backlog))
            alone_s.append(time.monotonic() - t0)
            t0 = time.monotonic()
            backlog = fleet.backlog(args.backlog)
            beside += fleet.timings(fleet.chats("online", n, k))
            fleet.ttfts(backlog)
            with_s.append(time.monotonic() - t0)
            backlog_ratios.append(with_s[-1] / alone_s[-1])
            rewrites.append(fleet.aof_rewrites())
    finally:
        fleet.close()
    idle_m, flood_m, beside_m = _medians(idle), _medians(flood), _medians(beside)
    return {
        "policy": policy,
        "rounds": args.rounds,
        "idle_ttft_s": idle_m["ttft_s"],
        "flood_ttft_s": flood_m["ttft_s"],
        "flood_ttft": flood_m["ttft_s"] / idle_m["ttft_s"],
        "batch_chat_ttft_s": beside_m["ttft_s"],
        "batch_ttft": beside_m["ttft_s"] / idle_m["ttft_s"],
        "backlog_alone_s": alone_s,
        "backlog_with_chats_s": with_s,
        "backlog_time": statistics.median(backlog_ratios),
        "per_round": {
            "flood_ttft_ms": [
                statistics.median(t["ttft_s"] for t in flood[i : i + n]) * 1000 for i in range(0, len(flood), n)
            ],
            "batch_ttft_ms": [
                statistics.median(t["ttft_s"] for t in beside[i : i + n]) * 1000 for i in range(0, len(beside), n)
            ],
            "idle_ttft_ms": [
                statistics.median(t["ttft_s"] for t in idle[i : i + n]) * 1000 for i in range(0, len(idle), n)
            ],
            "backlog_time": backlog_ratios,
            "aof_rewrites": rewrites,  # Redis's count after each round
        },
        "parts_ms": {
            name: {"claim": m["claim_s"] * 1000, "engine": m["engine_s"] * 1000}
            for name, m in (("idle", idle_m), ("flood", flood_m), ("batch", beside_m))
        },
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
        model = write_tiny_llama(str(folder / "tiny-llama")) if args.model == "tiny" else args.model
        rows = [one_policy(p.strip(), model, args, folder) for p in args.policies.split(",") if p.strip()]
    print(f"model: {args.model or 'SmolLM2-135M (the worker default)'}, float32")
    print(
        f"{args.max_num_seqs} slots; {args.heavy} heavy jobs; {args.backlog} batch jobs; 4 chats; {args.rounds} rounds"
    )
    print(f"{'policy':>7} {'idle ms':>8} {'flood':>16} {'chats by backlog':>18} {'backlog time':>14}")
    for r in rows:
        marks = {k: "met" if r[k] <= t else "NOT met" for k, t in TARGETS.items()}
        print(
            f"{r['policy']:>7} {r['idle_ttft_s'] * 1000:8.0f} "
            f"{r['flood_ttft']:6.2f}x {marks['flood_ttft']:>8} {r['batch_ttft']:8.2f}x {marks['batch_ttft']:>8} "
            f"{r['backlog_time']:6.2f}x {marks['backlog_time']:>7}"
        )
    print("per round (TTFT p50 ms of its 4 chats; backlog with chats / alone):")
    for r in rows:
        pr = r["per_round"]
        fmt = lambda xs: ", ".join(f"{x:.0f}" for x in xs)  # noqa: E731
        print(
            f"{r['policy']:>7} idle {fmt(pr['idle_ttft_ms'])}   flood {fmt(pr['flood_ttft_ms'])}   "
            f"batch {fmt(pr['batch_ttft_ms'])}   backlog {', '.join(f'{x:.2f}' for x in pr['backlog_time'])}   "
            f"Redis AOF rewrites so far {fmt(pr['aof_rewrites'])}"
        )
    print("TTFT p50 in two parts, ms: submit -> claim (Redis, the worker's pop and threads) + claim -> first token")
    for r in rows:
        parts = "   ".join(f"{k} {v['claim']:.0f} + {v['engine']:.0f}" for k, v in r["parts_ms"].items())
        print(f"{r['policy']:>7} {parts}")
    t = TARGETS
    print(
        f"targets: flood <= {t['flood_ttft']}x idle, chats <= {t['batch_ttft']}x idle, backlog <= {t['backlog_time']}x alone"
    )
    (out / "tenants.json").write_text(json.dumps({"cpu": cpu, "args": vars(args), "rows": rows}, indent=2))
    _plot(rows, out / "tenants.png")
    print(f"wrote {out / 'tenants.json'} and {out / 'tenants.png'}")
    return 0
