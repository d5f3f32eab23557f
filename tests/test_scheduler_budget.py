"""The step's token budget (issue 18): one owner per schedule() call, tokens given back when a
request planned earlier in the step is preempted, and nothing about a step left on the
scheduler once it is planned. Random workloads on a pool small enough to preempt often."""

from __future__ import annotations

import random

import pytest
from scheduler_harness import MirrorRunner, check_invariants

from runtime.block_pool import BlockPool
from schedulers import (
    ContinuousBatchScheduler,
    DynamicBatchConfig,
    Request,
    SchedulerConfig,
    StaticBatchScheduler,
    StopCriteria,
)


def make(kind, policy, caching, seed):
    rng = random.Random(seed)
    cfg = SchedulerConfig(
        max_num_seqs=rng.choice((6, 10)),
        max_num_batched_tokens=rng.choice((5, 8, 16)),  # decodes alone can use it all
        max_model_len=96,
        policy=policy,
        long_prefill_token_threshold=rng.choice((0, 8)),
    )
    pool = BlockPool(rng.choice((16, 24)), 4, caching)  # a request needs up to 15 blocks
    if kind == "static":
        return StaticBatchScheduler(
            cfg, pool, DynamicBatchConfig(max_batch_size=cfg.max_num_seqs, max_queue_delay_ms=0.0, priority_levels=3)
        )
    return ContinuousBatchScheduler(cfg, pool)


def add(sched, rng, i, shared):
    # Arrival times out of queue order: the preemption victim (the latest arrival) is then
    # often a request planned earlier in the same step, which must give its tokens back.
    prompt = shared[: rng.randrange(0, len(shared))] + [1000 + rng.randrange(50) for _ in range(rng.randrange(1, 20))]
    sched.add_request(
        Request(
            f"r{i}",
            prompt,
            StopCriteria(max_tokens=rng.randrange(1, 30)),
            priority=rng.randrange(3),
            arrival_time=rng.random(),
        )
    )


@pytest.mark.parametrize("kind", ["continuous", "static"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("caching", [True, False])
def test_budget_is_spent_whenever_a_running_request_is_left_out(kind, policy, caching):
    preemptions = 0
    for seed in range(4):
        sched = make(kind, policy, caching, seed)
        rng = random.Random(seed)
        shared = [rng.randrange(100, 200) for _ in range(8)]
        runner = MirrorRunner()
        runner.block_size = sched.table.block_size
        budget = sched.config.max_num_batched_tokens
        attrs = set(vars(sched))
        n = 0
        for _ in range(400):
            for _ in range(rng.choice((0, 0, 1, 3))):
                add(sched, rng, n, shared)
                n += 1
            running_before = set(map(id, sched.running))
            preempted_before = sched.table.num_preemptions
            plan = sched.schedule(1.0)
            check_invariants(sched, plan)
            planned = set(plan.req_ids)
            left_out = [r.request_id for r in sched.running if r.request_id not in planned]
            # A running request is left out only when the budget ran out; a request taken back
            # out of the plan by a preemption gives its tokens back for the others.
            if left_out:
                assert plan.total_tokens == budget, (left_out, plan)
            if sched.table.num_preemptions > preempted_before:  # nobody is admitted then
                assert set(map(id, sched.running)) <= running_before
            out = sched.update(plan, runner.execute(plan))
            check_invariants(sched, plan, runner)
            preemptions += out.num_preempted
            assert set(vars(sched)) == attrs, "schedule() left per-step state on the scheduler"
    assert preemptions > 0, "the workload never preempted: the test proves nothing"


def test_a_request_taken_back_out_of_the_plan_gives_its_tokens_back():
    # Queue order v, a but v arrived last: v is the preemption victim though it runs first.
    sched = ContinuousBatchScheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64), BlockPool(3, 16, False)
    )
    sched.add_request(Request("v", [1], StopCriteria(max_tokens=20), arrival_time=10.0))
    sched.add_request(Request("a", [2] * 15, StopCriteria(max_tokens=20), arrival_time=0.0))
    runner = MirrorRunner()
    runner.block_size = 16
    plans = []
    for n in range(5):
        if n == 3:
            sched.add_request(Request("p", [3] * 40, StopCriteria(max_tokens=1), arrival_time=1.0))
        plan = sched.schedule()
        check_invariants(sched, plan)
        out = sched.update(plan, runner.execute(plan))
        check_invariants(sched, plan, runner)
        plans.append((plan.req_ids, plan.num_scheduled_tokens, out.num_preempted))
    assert plans[3] == (["v", "a", "p"], [1, 1, 6], 0)  # all 3 blocks taken, a's is full
    # Last step: v decodes, then a needs a block and the pool is dry: v (planned, latest
    # arrival) is taken back out, its block goes to a, and its token to p's chunk (7, not 6).
    assert plans[4] == (["a", "p"], [1, 7], 1)
    assert sched.table.requests["v"].status.name == "PREEMPTED" and sched.waiting.peek().request_id == "v"
