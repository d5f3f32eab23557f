"""Fair shares (policy="fair", the Virtual Token Counter), aged priorities and the batch tier,
driven with the model-free runner of tests/scheduler_harness.py; and one engine run that checks
fair scheduling leaves every request's greedy tokens as FCFS makes them."""

from __future__ import annotations

import random

import pytest
from scheduler_harness import MirrorRunner, check_invariants

from runtime.block_pool import BlockPool
from schedulers import ContinuousBatchScheduler, Request, SchedulerConfig, StepResult, StopCriteria
from schedulers.fair import INPUT_WEIGHT, OUTPUT_WEIGHT, PrefillShares

BLOCK_SIZE = 4


def make(num_blocks=64, **cfg):
    cfg.setdefault("max_model_len", 256)
    return ContinuousBatchScheduler(SchedulerConfig(**cfg), BlockPool(num_blocks, BLOCK_SIZE, True))


def req(rid, n_prompt, max_tokens, tenant="", arrival=0.0, priority=0, tier="interactive"):
    prompt = [1000 + (sum(map(ord, rid)) * 7 + i) % 500 for i in range(n_prompt)]
    return Request(
        rid,
        prompt,
        StopCriteria(max_tokens=max_tokens),
        priority=priority,
        arrival_time=arrival,
        tenant=tenant,
        tier=tier,
    )


class Service:
    """Each tenant's service as the plans and outputs show it (not the scheduler's counters):
    prompt tokens computed (cache hits are never planned) and output tokens, VTC's weights."""

    def __init__(self, sched) -> None:
        self.sched = sched
        self.total: dict[str, float] = {}

    def step(self, now: float, runner: MirrorRunner):
        sched = self.sched
        runner.block_size = sched.table.block_size
        plan = sched.schedule(now)
        check_invariants(sched, plan)
        reqs = {r.request_id: r for r in sched.running}
        before = {rid: (r.tenant, r.num_prompt_tokens) for rid, r in reqs.items()}
        out = sched.update(plan, runner.execute(plan))
        check_invariants(sched, plan, runner)
        for i, rid in enumerate(plan.req_ids):
            tenant, n_prompt = before[rid]
            start, n = plan.num_computed_tokens[i], plan.num_scheduled_tokens[i]
            prompt = max(0, min(start + n, n_prompt) - start)
            self.total[tenant] = self.total.get(tenant, 0.0) + INPUT_WEIGHT * prompt
        for rid, toks in zip(out.req_ids, out.new_token_ids):
            tenant = before[rid][0]
            self.total[tenant] += OUTPUT_WEIGHT * len(toks)
        return plan, out


def backlogged(sched, tenant: str) -> bool:
    return any(r.tenant == tenant for r in sched.waiting)


def heavy_and_light(policy: str, lift: bool = True, slot_shares: bool = True):
    """One heavy tenant with 10x the light one's load: 'heavy' queues 400 requests at once and
    runs alone for 150 steps (its counter grows), then 'light' queues 40. Returns the service
    difference (heavy minus light, since light arrived) at every step both are backlogged,
    and VTC's bound, 2 * max(w_p * longest prompt, w_q * tokens a batch holds)."""
    rng = random.Random(0)
    num_blocks = 48
    sched = make(num_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=32, policy=policy)
    if sched.tenants is not None:
        sched.tenants.lift = lift
        sched.tenants.slot_shares = slot_shares
    prompts = []
    for i in range(400):
        n = rng.randrange(4, 24)
        prompts.append(n)
        sched.add_request(req(f"h{i}", n, rng.randrange(8, 24), "heavy", arrival=0.0))
    service, runner = Service(sched), MirrorRunner()
    for t in range(150):
        service.step(float(t), runner)
    for i in range(40):
        n = rng.randrange(4, 24)
        prompts.append(n)
        sched.add_request(req(f"l{i}", n, rng.randrange(8, 24), "light", arrival=150.0))
    base = dict(service.total)
    diffs = []
    for t in range(150, 3000):
        if not (backlogged(sched, "heavy") and backlogged(sched, "light")):
            break
        service.step(float(t), runner)
        got = {k: service.total.get(k, 0.0) - base.get(k, 0.0) for k in ("heavy", "light")}
        diffs.append(got["heavy"] - got["light"])
    bound = 2 * max(INPUT_WEIGHT * max(prompts), OUTPUT_WEIGHT * num_blocks * BLOCK_SIZE)
    return diffs, bound


def test_fair_keeps_backlogged_tenants_within_the_vtc_bound_and_fcfs_does_not():
    fair, bound = heavy_and_light("fair")
    assert len(fair) > 50, "both tenants should stay backlogged for a while"
    assert max(abs(d) for d in fair) <= bound, (max(fair, key=abs), bound)
    fcfs, _ = heavy_and_light("fcfs")
    assert len(fcfs) > 200
    # Under FCFS the light tenant waits behind every heavy request: the gap grows step after
    # step, far past the bound, for as long as both stay backlogged.
    assert fcfs[-1] > 5 * bound
    assert all(b >= a for a, b in zip(fcfs, fcfs[1:]))


def test_the_counter_lift_is_what_keeps_a_returning_tenant_from_taking_over():
    """Without the lift, 'light' arrives with counter 0 against heavy's 40 steps of service and
    takes every slot until it catches up: the service gap (light ahead) passes the bound. (The
    slot shares, which cap light at its share while heavy waits, are off to see the lift alone.)"""
    diffs, bound = heavy_and_light("fair", lift=False, slot_shares=False)
    assert min(diffs) < -bound


@pytest.mark.parametrize("slot_shares", [True, False], ids=["shares", "vtc-alone"])
def test_a_tenant_arriving_beside_a_flood_gets_its_share_of_the_slots_at_once(slot_shares):
    """'heavy' holds all four slots with long requests and 36 more wait; 'light' sends two:
    the next step runs both (its share: two of four), taking the slots of heavy's latest
    arrivals, which wait again ahead of heavy's others. Under VTC alone (no slot shares) light
    waits for heavy requests to finish, however low its counter."""
    sched = make(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64, policy="fair")
    sched.tenants.slot_shares = slot_shares
    for i in range(40):
        sched.add_request(req(f"h{i}", 8, 200, "heavy", arrival=float(i)))
    service, runner = Service(sched), MirrorRunner()
    for t in range(5):
        service.step(float(t), runner)
    assert sorted(r.request_id for r in sched.running) == ["h0", "h1", "h2", "h3"]
    for i in range(2):
        sched.add_request(req(f"l{i}", 8, 8, "light", arrival=5.0))
    plan, _ = service.step(5.0, runner)
    light_rows = [rid for rid in plan.req_ids if rid.startswith("l")]
    if not slot_shares:
        assert light_rows == [] and sched.table.num_preemptions == 0
        return
    assert sorted(light_rows) == ["l0", "l1"]
    assert sorted(r.request_id for r in sched.running) == ["h0", "h1", "l0", "l1"]
    assert sched.table.num_preemptions == 2
    # Heavy keeps its share: its waiting requests take no slot back from light.
    for t in range(6, 12):
        service.step(float(t), runner)
        assert sum(r.tenant == "light" for r in sched.running) == 2
    assert sched.table.num_preemptions == 2


def test_fair_shares_the_slots_and_prefill_budget_between_tenants():
    sched = make(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64, policy="fair")
    for i in range(8):
        sched.add_request(req(f"a{i}", 40, 4, "a", arrival=float(i)))
    sched.add_request(req("b0", 40, 4, "b", arrival=10.0))
    plan, _ = Service(sched).step(0.0, MirrorRunner())
    # One long prompt of 'a' does not take the step: 'b' gets half the prefill budget.
    got = dict(zip(plan.req_ids, plan.num_scheduled_tokens))
    assert got == {"a0": 32, "b0": 32}


def test_counters_charge_exactly_the_service_the_plans_show():
    """Chunked prefills (rows that sample nothing), shared prompts (prefix-cache hits, never
    charged), finishes and admissions every step: each counter equals the service seen from
    outside, step by step (no preemption here: a recompute is not charged, by design)."""
    sched = make(num_blocks=256, max_num_seqs=6, max_num_batched_tokens=24, policy="fair", tenant_weights={"b": 2})
    rng = random.Random(3)
    shared = [7] * 16
    for i in range(30):
        for tenant in ("a", "b"):
            r = req(f"{tenant}{i}", 1, rng.randrange(2, 12), tenant)
            r = Request(r.request_id, shared + [i] * rng.randrange(1, 40), r.stop, tenant=tenant)
            sched.add_request(r)
    service, runner = Service(sched), MirrorRunner()
    for t in range(400):
        if not sched.has_unfinished():
            break
        service.step(float(t), runner)
        assert sched.tenants.counters["a"] == service.total.get("a", 0.0)
        assert sched.tenants.counters["b"] == service.total.get("b", 0.0) / 2
    assert not sched.has_unfinished() and sched.table.num_preemptions == 0
    assert sched.table.pool.num_cache_hits > 0


def test_the_books_kept_for_speed_match_a_recount_every_step():
    """The fair scheduler keeps running books instead of recounting at every admission: the
    active tenants' total weight (summed again only when a tenant becomes active or idle), the
    waiting tenants per tier, the waiting heads' tokens. Through arrivals in bursts (tenants go
    idle and come back), priorities, both tiers, n > 1, preemptions (a small pool) and aborts,
    each is checked against a recount from the requests themselves, before and after every step."""
    rng = random.Random(5)
    weights = {"a": 0.5, "b": 2.0, "c": 3.0}  # sums of these are exact: no rounding to tell apart
    slots = 6
    sched = make(num_blocks=40, max_num_seqs=slots, max_num_batched_tokens=24, policy="fair", tenant_weights=weights)
    tenants = ["a", "b", "c", "d"]

    def recount() -> None:
        waiting = list(sched.waiting)
        assert set(sched.waiting.tenants()) == {r.tenant for r in waiting}
        assert set(sched.waiting.tenants(batch=False)) == {r.tenant for r in waiting if not r.is_batch}
        assert sched.waiting.demand_total() == sum(sched.waiting.demands().values())
        active = {r.tenant for r in sched.table.requests.values()}
        total = sum(weights.get(t, 1.0) for t in active)
        for t in tenants:
            running = sum(r.tenant == t for r in sched.running)
            assert sched.tenants.num_running.get(t, 0) == running
            share = slots / total * weights.get(t, 1.0) if total else 0.0
            assert sched.tenants.within_share(t, 1, slots) == (running + 1 <= share + 1e-9), (t, running, share)

    n = 0
    seen = {"idle": 0, "preempted": 0, "aborted": 0, "forked": 0}
    for t in range(400):
        burst = tenants[(t // 40) % len(tenants) :][:2]  # two tenants at a time, in turn
        for tenant in burst:
            if rng.random() < 0.3:
                choices = [
                    req(
                        f"{tenant}{n}#{k}",
                        rng.randrange(2, 20),
                        rng.randrange(1, 12),
                        tenant,
                        arrival=float(t),
                        priority=rng.choice([0, 0, 1]),
                        tier=rng.choice(["interactive", "interactive", "batch"]),
                    )
                    for k in range(rng.choice([1, 1, 1, 2]))
                ]
                for c in choices[1:]:  # the same prompt for every choice, as the engine sends it
                    c.prompt_token_ids, c.token_ids = choices[0].prompt_token_ids, list(choices[0].token_ids)
                choices[0].followers = choices[1:]
                sched.add_request(choices[0])
                n += 1
        waiting = [r.request_id for r in sched.waiting]
        if waiting and rng.random() < 0.1:  # often behind its tenant's head
            seen["aborted"] += sched.abort(rng.choice(waiting))
        if sched.table.requests and rng.random() < 0.05:
            seen["aborted"] += sched.abort(rng.choice(sorted(sched.table.requests)))
        recount()
        plan = sched.schedule(float(t))
        # A runner of its own (MirrorRunner, and check_invariants' block count, know no forks):
        # every sampling row gets a token; the pool checks its own books.
        out = sched.update(plan, StepResult([[7] if sample else [] for sample in plan.sample]))
        sched.table.pool.check_invariants()
        recount()
        seen["idle"] += sum(1 for k in sched.tenants.num_unfinished.values() if k == 0)
        seen["preempted"] += out.num_preempted
        seen["forked"] += len(plan.forks)
    assert all(seen.values()), seen  # every path the books follow was taken


def test_prefill_shares_are_max_min_fair_by_weight():
    s = PrefillShares({"a": 100, "b": 10, "c": 100}, {"c": 2.0}, 100)
    assert s.quota == {"b": 10, "a": 30, "c": 60}
    assert s.allowance("a", 100) == 30
    s.take("b", 4)  # b left 6 of its quota: still reserved for it
    assert s.allowance("a", 96) == 30


def test_tenant_weights_scale_the_share():
    sched = make(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64, policy="fair", tenant_weights={"a": 3})
    for i in range(60):
        sched.add_request(req(f"a{i}", 8, 8, "a"))
        sched.add_request(req(f"b{i}", 8, 8, "b"))
    service, runner = Service(sched), MirrorRunner()
    for t in range(150):
        service.step(float(t), runner)
    ratio = service.total["a"] / service.total["b"]
    assert 2.5 < ratio < 3.5, ratio


def test_aging_bounds_the_wait_of_a_low_priority_request_under_a_flood():
    """Two priority-0 requests arrive every step (the engine serves 0.5 a step) and one of
    priority 5 at t=0. With aging_s = 2 steps, only requests that arrive before
    t0 + (5 - 0) * 2 = 10 can overtake it (the docstring's bound): 20 of them, 4 steps each on
    2 slots, so it starts by step 40 and finishes 4 steps later. Without aging it never runs."""

    def run(aging_s: float) -> int | None:
        sched = make(
            num_blocks=128, max_num_seqs=2, max_num_batched_tokens=64, policy="priority", priority_aging_s=aging_s
        )
        sched.add_request(req("low", 4, 4, priority=5, arrival=0.0))
        runner = MirrorRunner()
        for t in range(120):
            for k in range(2):
                sched.add_request(req(f"hi{t}-{k}", 4, 4, priority=0, arrival=float(t)))
            plan = sched.schedule(float(t))
            out = sched.update(plan, runner.execute(plan))
            if "low" in out.finished:
                return t
        return None

    overtakers, steps_each, slots = 2 * 10, 4, 2
    bound = overtakers * steps_each // slots + steps_each
    finished = run(2.0)
    assert finished is not None and finished <= bound, (finished, bound)
    assert run(0.0) is None  # strict priorities: starved for all 120 steps


def test_batch_requests_fill_free_slots_and_are_preempted_first():
    sched = make(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(6):
        sched.add_request(req(f"batch{i}", 8, 30, tier="batch", arrival=float(i)))
    runner = MirrorRunner()
    service = Service(sched)
    service.step(0.0, runner)
    assert sorted(r.request_id for r in sched.running) == ["batch0", "batch1", "batch2", "batch3"]
    # Interactive requests arrive later, yet go before the waiting batch and take the slots
    # of the latest batch arrivals at once.
    sched.add_request(req("chat0", 8, 4, arrival=10.0))
    sched.add_request(req("chat1", 8, 4, arrival=11.0))
    plan, out = service.step(1.0, runner)
    assert "chat0" in plan.req_ids and "chat1" in plan.req_ids
    assert out.num_preempted == 2
    assert sorted(r.request_id for r in sched.running) == ["batch0", "batch1", "chat0", "chat1"]
    assert [r.request_id for r in sched.waiting][:4] == ["batch2", "batch3", "batch4", "batch5"]
    # When the chats finish, the batch backlog drains into every slot again.
    for t in range(2, 300):
        if not sched.has_unfinished():
            break
        service.step(float(t), runner)
    assert not sched.has_unfinished()


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_no_batch_request_starts_in_the_step_of_a_chats_first_token(policy):
    """That step's length is the chat's time to first token: a batch prefill beside it would
    lengthen it. The batch request waits one step; decodes of running batch requests go on."""
    sched = make(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, policy=policy)
    for i in range(6):
        sched.add_request(req(f"batch{i}", 8, 30, tier="batch", arrival=float(i)))
    service, runner = Service(sched), MirrorRunner()
    service.step(0.0, runner)
    assert sorted(r.request_id for r in sched.running) == ["batch0", "batch1", "batch2", "batch3"]
    sched.abort("batch2")
    sched.abort("batch3")  # two free slots, two batch requests waiting
    sched.add_request(req("chat", 8, 4, arrival=10.0))
    plan, _ = service.step(1.0, runner)
    assert "chat" in plan.req_ids and "batch0" in plan.req_ids and "batch1" in plan.req_ids
    assert not [r for r in plan.req_ids if r in ("batch4", "batch5")], plan.req_ids  # the free slot waits
    plan, _ = service.step(2.0, runner)  # the chat decodes now: the batch backlog takes the slot
    assert "batch4" in plan.req_ids and "chat" in plan.req_ids


def test_out_of_blocks_the_batch_request_is_the_victim():
    """Both need 10 of the pool's 12 blocks; the chat arrived later (FCFS alone would preempt
    it), but the batch request is the one preempted, and both finish."""
    sched = make(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    chat, batch = req("chat", 8, 30, arrival=1.0), req("batch", 8, 30, tier="batch", arrival=0.0)
    sched.add_request(chat)
    sched.add_request(batch)
    service, runner = Service(sched), MirrorRunner()
    for t in range(200):
        if not sched.has_unfinished():
            break
        service.step(float(t), runner)
    assert not sched.has_unfinished()
    assert (chat.num_preemptions, batch.num_preemptions) == (0, 1)


def test_bad_tenant_and_tier_name_the_field():
    with pytest.raises(ValueError, match="tier"):
        req("x", 4, 4, tier="bulk")
    with pytest.raises(ValueError, match="tenant"):
        Request("x", [1, 2], tenant=None)
    with pytest.raises(ValueError, match="tenant_weights"):
        SchedulerConfig(policy="fair", tenant_weights={"a": 0})
    with pytest.raises(ValueError, match="priority_aging_s"):
        SchedulerConfig(priority_aging_s=-1)


def test_fair_policy_gives_the_engine_the_same_greedy_tokens_as_fcfs(tiny_llama_dir):
    from runtime.llm.engine import EngineConfig, LLMEngine
    from runtime.llm.sampling_params import SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randrange(4, 40))] for _ in range(10)]

    def run(policy: str) -> dict[str, list[int]]:
        engine = LLMEngine(
            EngineConfig(
                model=tiny_llama_dir,
                device="cpu",
                dtype="float32",
                max_num_seqs=4,
                max_num_batched_tokens=32,
                max_model_len=128,
                policy=policy,
            )
        )
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        with pytest.raises(ValueError, match="tier"):
            engine.add_request(prompts[0], params, tier="bulk")
        with pytest.raises(ValueError, match="tenant"):
            engine.add_request(prompts[0], params, tenant=7)
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=f"r{i}", tenant="heavy" if i < 8 else "light")
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    tokens[o.request_id] = list(o.token_ids)
        return tokens

    fcfs, fair = run("fcfs"), run("fair")
    assert len(fcfs) == 10 and fair == fcfs
