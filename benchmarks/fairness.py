"""`python -m benchmarks fairness`: each tenant's service over steps, FCFS against fair (the
Virtual Token Counter, schedulers/fair.py), the scheduler alone with a fake runner (no model).

A heavy tenant queues 10x the light one's requests at step 0 and runs alone until the light
one arrives (`--light-at`). Service is what the plans show, VTC's weighting: prompt tokens
computed (prefix-cache hits are never planned) times INPUT_WEIGHT plus output tokens times
OUTPUT_WEIGHT, over the tenant's weight. Reported, over the steps from the light tenant's
arrival while both tenants have waiting requests (both backlogged):
  - the fairness spread: max minus min of the tenants' normalized service in that window;
  - Jain's index of the same: (sum x)^2 / (n * sum x^2), 1 when equal, 1/n when one gets all;
  - VTC's bound on the spread, 2 * max(w_p * longest prompt, w_q * tokens the KV pool holds).
Writes fairness.json and fairness.png (each tenant's cumulative service, one panel a policy).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heavy", type=int, default=400, help="requests the heavy tenant queues at step 0")
    p.add_argument("--light", type=int, default=40, help="requests the light tenant queues at --light-at")
    p.add_argument("--light-at", type=int, default=150, help="the step the light tenant arrives")
    p.add_argument("--steps", type=int, default=1200, help="steps simulated per policy")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=48, help="KV blocks of 4 tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out")


def simulate(policy: str, args: argparse.Namespace) -> dict:
    from runtime.block_pool import BlockPool
    from runtime.simulate import fake_execute
    from schedulers import ContinuousBatchScheduler, Request, SchedulerConfig, StopCriteria
    from schedulers.fair import INPUT_WEIGHT, OUTPUT_WEIGHT

    block_size = 4
    rng = random.Random(args.seed)
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=256,
        policy=policy,
    )
    sched = ContinuousBatchScheduler(config, BlockPool(args.num_blocks, block_size, True))
    longest = 0

    def add(tenant: str, i: int, at: float) -> None:
        nonlocal longest
        n = rng.randrange(4, 24)
        longest = max(longest, n)
        prompt = [1000 + (sum(map(ord, tenant)) * 31 + i * 7 + k) % 500 for k in range(n)]
        sched.add_request(
            Request(f"{tenant}{i}", prompt, StopCriteria(rng.randrange(8, 24)), arrival_time=at, tenant=tenant)
        )

    for i in range(args.heavy):
        add("heavy", i, 0.0)
    tenants = ("heavy", "light")
    total = dict.fromkeys(tenants, 0.0)
    curves: dict[str, list[float]] = {t: [] for t in tenants}
    window: list[int] = []  # steps where both tenants were backlogged, from the light one's arrival
    for step in range(args.steps):
        if step == args.light_at:
            for i in range(args.light):
                add("light", i, float(step))
        if not sched.has_unfinished():
            break
        waiting = {r.tenant for r in sched.waiting}
        if step >= args.light_at and waiting >= set(tenants):
            window.append(step)
        owner = {r.request_id: (r.tenant, r.num_prompt_tokens) for r in sched.running}
        plan = sched.schedule(float(step))
        owner.update({r.request_id: (r.tenant, r.num_prompt_tokens) for r in sched.running})
        out = sched.update(plan, fake_execute(plan))
        for i, rid in enumerate(plan.req_ids):
            tenant, n_prompt = owner[rid]
            start, n = plan.num_computed_tokens[i], plan.num_scheduled_tokens[i]
            total[tenant] += INPUT_WEIGHT * max(0, min(start + n, n_prompt) - start)
        for rid, toks in zip(out.req_ids, out.new_token_ids):
            total[owner[rid][0]] += OUTPUT_WEIGHT * len(toks)
        for t in tenants:
            curves[t].append(total[t])
    lo, hi = (window[0], window[-1]) if window else (args.light_at, args.light_at)
    got = [curves[t][hi] - (curves[t][lo - 1] if lo else 0.0) for t in tenants]
    jain = sum(got) ** 2 / (len(got) * sum(x * x for x in got)) if any(got) else 1.0
    return {
        "policy": policy,
        "steps": len(curves["heavy"]),
        "window": [lo, hi],
        "service_in_window": dict(zip(tenants, got)),
        "spread": max(got) - min(got),
        "jain": jain,
        "vtc_bound": 2 * max(INPUT_WEIGHT * longest, OUTPUT_WEIGHT * args.num_blocks * block_size),
        "preemptions": sched.table.num_preemptions,
        "curves": curves,
    }


def run(args: argparse.Namespace) -> int:
    from benchmarks.common import cpu_info

    cpu = cpu_info()
    print(f"cpu: {cpu['model']}, {cpu['cores']} cores, flags: {cpu['flags']}")
    results = [simulate(policy, args) for policy in ("fcfs", "fair")]
    print(
        f"heavy: {args.heavy} requests at step 0; light: {args.light} at step {args.light_at}; "
        f"max_num_seqs {args.max_num_seqs}, {args.max_num_batched_tokens} tokens a step, {args.num_blocks} blocks of 4"
    )
    print(f"{'policy':>6} {'window':>11} {'heavy':>8} {'light':>8} {'spread':>8} {'VTC bound':>10} {'Jain':>6}")
    for r in results:
        s = r["service_in_window"]
        flag = "  within bound" if r["spread"] <= r["vtc_bound"] else "  past bound"
        print(
            f"{r['policy']:>6} {r['window'][0]:>5}-{r['window'][1]:<5} {s['heavy']:>8.0f} {s['light']:>8.0f} "
            f"{r['spread']:>8.0f} {r['vtc_bound']:>10.0f} {r['jain']:>6.3f}{flag}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fairness.json").write_text(json.dumps({"cpu": cpu["flags"], "args": vars(args), "results": results}))
    _plot(results, args, out / "fairness.png")
    print(f"wrote {out / 'fairness.json'} and {out / 'fairness.png'}")
    return 0


def _plot(results: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(11, 4), sharey=True)
    for ax, r in zip(axes, results):
        for tenant, ys in r["curves"].items():
            ax.plot(range(len(ys)), ys, label=f"{tenant} tenant")
        ax.axvline(args.light_at, color="gray", linestyle=":", label="light tenant arrives")
        lo, hi = r["window"]
        ax.axvspan(lo, hi, color="gray", alpha=0.1, label="both backlogged")
        ax.set_title(f"{r['policy']}: spread {r['spread']:.0f}, Jain {r['jain']:.3f}")
        ax.set_xlabel("step")
        ax.legend(loc="upper left")
    axes[0].set_ylabel("cumulative weighted service")
    fig.suptitle("Each tenant's service, heavy at 10x the light one's load (scheduler only, no model)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
