"""`python -m benchmarks worker-start`: a `tandem worker` process's time from its start to ready.

    registered  its payload is in Redis (fleet_metrics.METRICS_INDEX and its key): what `tandem
                serve`'s /health and /v1/models count as a live worker
    ready       it took a job: a one-token job queued before the worker starts (and again after
                each Redis restart) is claimed (the job record's claimed_at: the lease is then
                held and the consumer consumes)
    load        the worker's own "runtime ready in X s" line: its model's load, the C++
                attention op's build or load inside it ("tandem_cpu_attention ready in X s")

Cases, each on a private redis-server (append-only, as in production) on a free loopback port:

    alone          nothing else
    redis-restart  Redis SIGKILLed 1 s after the worker's start and again as soon as the worker
                   registers (its model is loaded: the moment its Celery consumer connects), each
                   time started again on its port and folder --down-s later
    cpu-busy       one `nice -n 19` busy loop per core for the whole start
    smollm2        alone, on the default SmolLM2-135M-Instruct (the other cases: a tiny random
                   Llama of SmolLM2's tokenizer, built in a temporary folder, so that the load is
                   small and what is left is the worker's own start)

Figures are medians of --runs runs per case. On a shared machine they are noisy: the load of the
other processes is printed beside them (load average at each case's start).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RedisServer, cpu_info, no_nan, python_env, write_tiny_llama

CASES = ("alone", "redis-restart", "cpu-busy", "smollm2")


def add_arguments(p) -> None:
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--runs", type=int, default=3, help="runs per case (the table shows medians)")
    p.add_argument("--down-s", type=float, default=3.0, help="seconds Redis stays down at each restart")
    p.add_argument("--timeout-s", type=float, default=180.0, help="a run not ready by then counts as failed")
    p.add_argument("--tiny-model", default=None, help="an HF folder to use as the tiny model (default: built)")
    p.add_argument("--out", default="bench_out/worker_start")


class Probe:
    """What the fleet sees of one starting worker, polled every 50 ms through Redis outages."""

    def __init__(self, url: str, job_id: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=0.3, socket_timeout=1)
        self.job_id = job_id

    def registered(self) -> bool:
        from workers.fleet_metrics import METRICS_INDEX, METRICS_KEY

        instances = self.client.zrange(METRICS_INDEX, 0, -1)
        bodies = self.client.mget([METRICS_KEY + i for i in instances]) if instances else []
        return any(b and json.loads(b).get("kind") == "runtime" for b in bodies)

    def claimed_at(self) -> float | None:
        from workers.store import job_key

        value = self.client.hget(job_key(self.job_id), "claimed_at")
        return float(value) if value else None


def one_run(case: str, model: str | None, args, folder: Path, index: int) -> dict:
    """Start one worker and time it; every process it started is gone when it returns."""
    import redis

    from workers.client import JobClient
    from workers.settings import JobSettings

    redis_dir = folder / f"redis-{case}-{index}"
    redis_dir.mkdir()
    server = RedisServer(folder=str(redis_dir), start=False)
    server.start()
    jobs = JobClient(settings=JobSettings(redis_url=server.url))
    busy: list[subprocess.Popen] = []
    worker = None
    log_path = folder / f"worker-{case}-{index}.log"
    out: dict = {"case": case, "run": index, "restarts": [], "log": str(log_path)}
    try:
        job_id = jobs.submit("Hi", max_tokens=1)
        if case == "cpu-busy":
            loop = [sys.executable, "-c", "while True: pass"]
            busy = [subprocess.Popen(["nice", "-n", "19", *loop]) for _ in range(os.cpu_count() or 1)]
        cmd = [sys.executable, "-m", "tandem", "worker", "--redis-url", server.url, "--queues", "llm"]
        cmd += ["--hostname", f"start-{case}-{index}@%h", "--dtype", "float32", "--no-profile"]
        cmd += ["--max-num-seqs", "4", "--kv-cache-bytes", str(64 << 20), "--loglevel", "INFO"]
        cmd += ["--model", model] if model else []
        log = open(log_path, "w")
        t0 = time.time()
        worker = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=python_env())
        log.close()
        probe = Probe(server.url, job_id)
        kills = [1.0] if case == "redis-restart" else []  # and one more at registration
        registered = claimed = None
        while claimed is None:
            now = time.time() - t0
            if worker.poll() is not None:
                out["error"] = f"the worker exited with {worker.returncode}"
                break
            if now > args.timeout_s:
                out["error"] = f"not ready within {args.timeout_s:.0f} s"
                break
            if kills and now >= kills[0]:
                kills.pop(0)
                server.kill()
                time.sleep(args.down_s)
                server.start()
                out["restarts"].append([round(now, 2), round(time.time() - t0, 2)])
                # A job queued now, after the outage: the worker's readiness, not the orphan sweep
                # that queues again (within 2 heartbeats) a message the outage took from a worker.
                probe.job_id = jobs.submit("Hi", max_tokens=1)
                continue
            try:
                if registered is None and probe.registered():
                    registered = now
                    if case == "redis-restart":
                        kills.append(now)
                claimed = probe.claimed_at()
            except redis.RedisError:  # down, or still loading its append-only file
                pass
            time.sleep(0.05)
        probe.client.close()
        out["registered_s"] = round(registered, 2) if registered is not None else None
        out["ready_s"] = round(claimed - t0, 2) if claimed is not None else None
    finally:
        for p in busy:
            p.kill()
            p.wait()
        if worker is not None:
            # SIGKILL: its shutdown is not measured (a warm one took seconds a run), and what it
            # leaves in Redis goes with the private Redis.
            worker.kill()
            worker.wait()
        server.close()
        jobs.close()
    text = log_path.read_text(errors="replace")
    for key, pattern in (
        ("load_s", r"runtime ready in ([\d.]+) s"),
        ("attention_op_s", r"cpu_attention ready in ([\d.]+) s"),
    ):
        found = re.search(pattern, text)
        out[key] = float(found.group(1)) if found else None
    out["consumer_retries"] = len(re.findall(r"Trying again in", text))
    return out


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 2) if values else None


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for case in dict.fromkeys(r["case"] for r in runs):
        mine = [r for r in runs if r["case"] == case]
        row = {"case": case, "runs": len(mine), "failed": sum("error" in r for r in mine)}
        for key in ("load_s", "registered_s", "ready_s", "attention_op_s"):
            row[key] = _median(mine, key)
        row["ready_after_load_s"] = _median([{"x": r["ready_s"] - r["load_s"]} for r in mine if _done(r)], "x")
        after = [{"x": r["ready_s"] - r["restarts"][-1][1]} for r in mine if r["restarts"] and r.get("ready_s")]
        row["ready_after_redis_s"] = _median(after, "x")  # from Redis's last start (it answered) to ready
        row["max_ready_s"] = max((r["ready_s"] for r in mine if r.get("ready_s") is not None), default=None)
        row["load_average"] = mine[0].get("load_average")
        rows.append(row)
    return rows


def _done(run: dict) -> bool:
    return run.get("ready_s") is not None and run.get("load_s") is not None


def _print(rows: list[dict]) -> None:
    head = ("case", "runs", "failed", "load s", "registered s", "ready s", "ready - load s", "ready - Redis back s")
    head += ("max ready s", "load avg")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in rows:
        cells = [r["case"], r["runs"], r["failed"], r["load_s"], r["registered_s"], r["ready_s"]]
        cells += [r["ready_after_load_s"], r["ready_after_redis_s"], r["max_ready_s"], r["load_average"]]
        print(" | ".join("-" if c is None else str(c) for c in cells))


def run(args) -> int:
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or set(cases) - set(CASES):
        print(f"worker-start: error: --cases must name some of {', '.join(CASES)}, got {args.cases!r}", file=sys.stderr)
        return 2
    if args.runs < 1 or args.down_s < 0 or args.timeout_s <= 0:
        print("worker-start: error: --runs must be >= 1, --down-s >= 0 and --timeout-s > 0", file=sys.stderr)
        return 2
    if shutil.which("redis-server") is None:
        print("worker-start: error: redis-server not found", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="tandem-worker-start-"))
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {cpu['flags']}", flush=True)
    try:
        tiny = args.tiny_model or write_tiny_llama(str(folder / "tiny-llama"))
        runs = []
        for case in cases:
            load_average = round(os.getloadavg()[0], 2)
            for i in range(args.runs):
                r = one_run(case, None if case == "smollm2" else tiny, args, folder, i)
                r["load_average"] = load_average
                runs.append(r)
                print(
                    f"  {case} #{i}: " + ", ".join(f"{k} {r.get(k)}" for k in ("load_s", "registered_s", "ready_s")),
                    flush=True,
                )
        rows = summarize(runs)
        logs = out / "logs"
        logs.mkdir(exist_ok=True)
        for r in runs:  # the evidence (timestamps of every phase) outlives the temporary folder
            r["log"] = str(shutil.copy(r["log"], logs))
        report = {"cpu": cpu, "command": " ".join(sys.argv), "down_s": args.down_s, "rows": rows, "runs": runs}
        (out / "worker_start.json").write_text(json.dumps(no_nan(report), indent=1, allow_nan=False))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print()
    _print(rows)
    print(f"\nwrote {out / 'worker_start.json'}; worker logs in {logs}")
    return 0
