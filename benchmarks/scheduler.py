"""`tandem bench scheduler`: the time one step of schedule + update costs, with no model.

Steady state at N running requests: every request decodes one token a step; requests finish
at random lengths and waiting ones join in their place (with their prompt prefilled through
the prefix cache, all sharing a system prompt), so admission, block growth, block publishing
and freeing are all on the measured path.

Requests belong to NUM_TENANTS tenants in turn under every policy, so the "fair" rows
(schedulers/fair.py) pay for their counters, shares and tenant queues against the same load;
issue 31 asks fair's median within 10% of FCFS's at 256 and 1,024 running requests.

One run's median moves by tens of percent with what else the machine does, more than the
policies differ. So each row is `repeats` runs of each policy, alternated (fcfs, fair, then
fair, fcfs, ...: neither always runs first nor last), run r of both policies on seed r; the
row's figure is the median of its runs' medians, and fair's ratio is its figure over FCFS's.
The ratios of the pairs (run r of each policy) are kept too, to show the noise.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from runtime.block_pool import BlockPool
from runtime.simulate import fake_execute
from schedulers import ContinuousBatchScheduler, Request, SchedulerConfig, StopCriteria

SYSTEM_PROMPT = list(range(100, 164))  # 64 shared tokens: four full blocks at block_size 16
NUM_TENANTS = 4
FAIR_TARGET = 1.10  # fair's median per step over FCFS's, at most
REPEATS = 5  # runs of each policy per row, alternated
TARGETS_MS = {256: 0.2, 1024: 1.0}  # FCFS's median per step, at most


def _request(i: int, rng: random.Random) -> Request:
    prompt = SYSTEM_PROMPT + [rng.randrange(1000, 30000) for _ in range(rng.randrange(8, 64))]
    return Request(
        f"r{i}",
        prompt,
        StopCriteria(max_tokens=rng.randrange(64, 512)),
        arrival_time=float(i),
        tenant=f"t{i % NUM_TENANTS}",
    )


def bench_steps(
    num_running: int, num_steps: int, prefix_caching: bool = True, seed: int = 0, policy: str = "fcfs"
) -> dict:
    rng = random.Random(seed)
    block_size = 16
    blocks_per_req = -(-(128 + 512) // block_size)
    pool = BlockPool(num_running * blocks_per_req + 64, block_size, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=num_running, max_num_batched_tokens=max(2048, 2 * num_running), max_model_len=1024, policy=policy
    )
    sched = ContinuousBatchScheduler(config, pool)
    next_id = 0
    for _ in range(num_running * 2):
        sched.add_request(_request(next_id, rng))
        next_id += 1
    # Warm up until the batch is full of decodes.
    for _ in range(4 * num_running):
        plan = sched.schedule()
        sched.update(plan, fake_execute(plan))
        if len(sched.running) == num_running and all(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running):
            break
    times_ns: list[int] = []
    running_counts: list[int] = []
    perf = time.perf_counter_ns
    for _ in tqdm(range(num_steps), desc=f"{num_running} running, {policy}", leave=False):
        while len(sched.waiting) < num_running // 4:  # keep arrivals coming (outside the timing)
            sched.add_request(_request(next_id, rng))
            next_id += 1
        t0 = perf()
        plan = sched.schedule()
        t1 = perf()
        result = fake_execute(plan)  # the runner's time is not the scheduler's
        t2 = perf()
        sched.update(plan, result)
        t3 = perf()
        times_ns.append((t1 - t0) + (t3 - t2))
        running_counts.append(plan.num_reqs)
    pool.check_invariants()
    ms = sorted(t / 1e6 for t in times_ns)
    return {
        "num_running": num_running,
        "policy": policy,
        "prefix_caching": prefix_caching,
        "steps": num_steps,
        "median_ms": statistics.median(ms),
        "p90_ms": ms[int(0.9 * (len(ms) - 1))],
        "p99_ms": ms[int(0.99 * (len(ms) - 1))],
        "mean_requests_per_step": statistics.fmean(running_counts),
        "preemptions": sched.table.num_preemptions,
        "prefix_cache_block_hits": pool.num_cache_hits,
    }


def interleaved(sizes: tuple[int, ...], num_steps: int, policies: tuple[str, ...], repeats: int) -> list[dict]:
    """Every row (size, prefix cache on/off, policy) as `summarize` makes it from `repeats`
    runs, the policies alternated run by run: ABBA order, so that a machine growing busier or
    quieter through a row weighs on both alike."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    rows = []
    for n in sizes:
        for caching in (True, False):
            runs: dict[str, list[dict]] = {p: [] for p in policies}
            for r in range(repeats):
                for policy in policies if r % 2 == 0 else policies[::-1]:
                    runs[policy].append(bench_steps(n, num_steps, caching, seed=r, policy=policy))
            rows.extend(summarize(runs[p]) for p in policies)
    compare(rows)
    return rows


def summarize(runs: list[dict]) -> dict:
    """One row from the runs of one policy: the median of the runs' medians (and of their p90
    and p99), each run's median kept in `run_median_ms`."""
    row = dict(runs[0])
    medians = [r["median_ms"] for r in runs]
    row.update(
        repeats=len(runs),
        median_ms=statistics.median(medians),
        p90_ms=statistics.median(r["p90_ms"] for r in runs),
        p99_ms=statistics.median(r["p99_ms"] for r in runs),
        mean_requests_per_step=statistics.fmean(r["mean_requests_per_step"] for r in runs),
        preemptions=sum(r["preemptions"] for r in runs),
        prefix_cache_block_hits=sum(r["prefix_cache_block_hits"] for r in runs),
        run_median_ms=medians,
    )
    return row


def compare(rows: list[dict]) -> None:
    """Give every non-FCFS row its ratio to the FCFS row of the same size and prefix cache
    (`vs_fcfs`, medians over medians), the ratios of its pairs of runs (`pair_ratios`), and
    whether the ratio is within FAIR_TARGET (`fair_target_met`)."""
    fcfs = {(r["num_running"], r["prefix_caching"]): r for r in rows if r["policy"] == "fcfs"}
    for r in rows:
        base = fcfs.get((r["num_running"], r["prefix_caching"]))
        if r["policy"] == "fcfs" or base is None:
            continue
        r["vs_fcfs"] = r["median_ms"] / base["median_ms"]
        r["pair_ratios"] = [a / b for a, b in zip(r["run_median_ms"], base["run_median_ms"])]
        r["fair_target_met"] = r["vs_fcfs"] <= FAIR_TARGET


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def report(rows: list[dict], targets: dict[int, float] = TARGETS_MS) -> list[str]:
    """The table's lines: each row's median, its p99, and against its targets (FCFS: the
    milliseconds of TARGETS_MS; any other policy: its ratio to FCFS, FAIR_TARGET)."""
    lines = [
        f"{'running':>8} {'policy':>8} {'prefix cache':>13} {'runs':>5} {'median ms':>10} {'p99 ms':>8} "
        f"{'reqs/step':>10}  against the target"
    ]
    for r in rows:
        if "vs_fcfs" in r:
            pairs = r["pair_ratios"]
            against = (
                f"{r['vs_fcfs']:.3f}x fcfs (target <= {FAIR_TARGET:.2f}x): {verdict(r['fair_target_met'])}"
                f"  [pairs {min(pairs):.2f}-{max(pairs):.2f}x]"
            )
        elif r["policy"] == "fcfs" and r["num_running"] in targets:
            target = targets[r["num_running"]]
            against = f"{target} ms: {verdict(r['median_ms'] < target)}"
        else:
            against = "-"
        lines.append(
            f"{r['num_running']:>8} {r['policy']:>8} {'on' if r['prefix_caching'] else 'off':>13} {r['repeats']:>5} "
            f"{r['median_ms']:>10.4f} {r['p99_ms']:>8.4f} {r['mean_requests_per_step']:>10.1f}  {against}"
        )
    return lines


def run(
    sizes: tuple[int, ...] = (256, 1024),
    num_steps: int = 500,
    out_dir: str = "bench_out",
    policies: tuple[str, ...] = ("fcfs", "fair"),
    repeats: int = REPEATS,
) -> list[dict]:
    from benchmarks.common import cpu_info

    cpu = cpu_info()
    load_before = os.getloadavg()[0]
    print(f"cpu: {cpu['model']}, {cpu['cores']} cores, flags: {cpu['flags']}; load average {load_before:.2f}")
    print(f"{repeats} runs of {num_steps} steps per policy and row, alternated; figures: medians of the runs' medians")
    results = interleaved(tuple(sizes), num_steps, tuple(policies), repeats)
    load_after = os.getloadavg()[0]
    for line in report(results):
        print(line)
    print(f"load average {load_before:.2f} before, {load_after:.2f} after")
    for r in results:
        r["cpu"] = cpu["flags"]
        r["load_average"] = [load_before, load_after]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scheduler.json").write_text(json.dumps(results, indent=2))
    _plot(results, out / "scheduler.png", TARGETS_MS)
    print(f"wrote {out / 'scheduler.json'} and {out / 'scheduler.png'}")
    return results


def _plot(results: list[dict], path: Path, targets: dict[int, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r.get("policy", "fcfs") for r in results):
        for caching in (True, False):
            rs = [r for r in results if r["prefix_caching"] == caching and r.get("policy", "fcfs") == policy]
            ax.plot(
                [r["num_running"] for r in rs],
                [r["median_ms"] for r in rs],
                "o-" if policy == "fcfs" else "s--",
                label=f"{policy}, prefix cache {'on' if caching else 'off'} (median)",
            )
    ax.plot(list(targets), list(targets.values()), "k--", label="target")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("running requests")
    ax.set_ylabel("schedule + update per step (ms)")
    ax.set_title("Continuous scheduler cost per step (no model)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
