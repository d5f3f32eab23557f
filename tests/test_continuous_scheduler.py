"""The continuous (iteration-level) scheduler, driven with a fake runner: exact per-step token
and block counts, invariants after every step, preemption, chunked prefill, prefix caching,
abort, priorities and admission errors."""

from __future__ import annotations

import random

import pytest
from scheduler_harness import MirrorRunner, check_invariants, drive, token_at

from runtime.block_pool import BlockPool
from schedulers import ContinuousBatchScheduler, Request, SchedulerConfig, StopCriteria


def make(num_blocks=64, block_size=4, caching=True, **cfg):
    cfg.setdefault("max_model_len", 256)
    return ContinuousBatchScheduler(SchedulerConfig(**cfg), BlockPool(num_blocks, block_size, caching))


def req(rid, n_prompt, max_tokens=4, arrival=0.0, priority=0, prompt=None, **stop):
    prompt = prompt if prompt is not None else [1000 + (sum(map(ord, rid)) + i) % 50 for i in range(n_prompt)]
    return Request(
        rid, list(prompt), StopCriteria(max_tokens=max_tokens, **stop), priority=priority, arrival_time=arrival
    )


def step(sched, runner):
    runner.block_size = sched.table.block_size
    plan = sched.schedule()
    check_invariants(sched, plan)
    out = sched.update(plan, runner.execute(plan))
    check_invariants(sched, plan, runner)
    return plan, out


def test_exact_tokens_and_blocks_per_step_with_chunked_prefill():
    sched = make(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, caching=False)
    for i, rid in enumerate(["a", "b", "c"]):
        sched.add_request(req(rid, 10, max_tokens=3, arrival=i))
    runner = MirrorRunner()
    plan, out = step(sched, runner)
    # a's whole prompt, then b's first chunk fills the budget; c waits.
    assert (plan.req_ids, plan.num_scheduled_tokens, plan.sample) == (["a", "b"], [10, 6], [True, False])
    assert [len(r.block_ids) for r in sched.running] == [3, 2]
    assert [rid for rid, toks in zip(out.req_ids, out.new_token_ids) if toks] == ["a"]
    plan, out = step(sched, runner)
    # Decodes first (a), then the running prefill (b's last 4), then a newcomer (c) in what is left.
    assert (plan.req_ids, plan.num_scheduled_tokens) == (["a", "b", "c"], [1, 4, 10])
    assert plan.num_computed_tokens == [10, 6, 0]
    assert [len(r.block_ids) for r in sched.running] == [3, 3, 3]
    assert plan.new_block_ids == {"b": [5]}  # b grew by one block, sent as a diff
    plan, out = step(sched, runner)
    assert (plan.req_ids, plan.num_scheduled_tokens) == (["a", "b", "c"], [1, 1, 1])
    assert out.finished == {"a": "length"}  # 3 tokens: prefill step + 2 decodes
    assert sched.table.pool.num_used_blocks == 6  # a's 3 blocks came back at once
    plan, out = step(sched, runner)
    assert plan.req_ids == ["b", "c"] and plan.freed_req_ids == ["a"]
    assert out.finished == {"b": "length", "c": "length"}


def test_decodes_are_never_starved_by_a_long_prefill():
    sched = make(max_num_seqs=4, max_num_batched_tokens=8, num_blocks=128, max_model_len=512)
    sched.add_request(req("short", 2, max_tokens=30))
    runner = MirrorRunner()
    step(sched, runner)
    sched.add_request(req("long", 100, max_tokens=2, arrival=1))
    chunks = []
    while any(r.request_id == "long" for r in sched.running + list(sched.waiting)) and len(chunks) < 40:
        plan, _ = step(sched, runner)
        assert plan.req_ids[0] == "short" and plan.num_scheduled_tokens[0] == 1, "the decode must come first"
        if "long" in plan.req_ids:
            chunks.append(plan.num_scheduled_tokens[plan.req_ids.index("long")])
        if sum(chunks) >= 100:
            break
    assert chunks == [7] * 14 + [2]  # 100 prompt tokens in chunks of what the decode leaves


def test_long_prefill_token_threshold_caps_chunks():
    sched = make(max_num_seqs=2, max_num_batched_tokens=64, long_prefill_token_threshold=10, num_blocks=64)
    sched.add_request(req("a", 25, max_tokens=1))
    plans, tokens, _ = drive(sched)
    assert [p.num_scheduled_tokens for p in plans] == [[10], [10], [5]]
    assert len(tokens["a"]) == 1


def test_finished_request_leaves_in_its_step_and_waiting_one_joins_next_step():
    sched = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i, n in enumerate([1, 5, 3]):
        sched.add_request(req(f"r{i}", 3, max_tokens=n, arrival=i))
    plans, tokens, reasons = drive(sched)
    assert [p.req_ids for p in plans[:3]] == [["r0", "r1"], ["r1", "r2"], ["r1", "r2"]]
    assert {k: len(v) for k, v in tokens.items()} == {"r0": 1, "r1": 5, "r2": 3}
    assert set(reasons.values()) == {"length"}
    assert tokens["r1"] == [token_at("r1", 3 + i) for i in range(5)]


def test_stop_token_and_min_tokens():
    sched = make(max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(req("early", 3, max_tokens=10, stop_token_ids=frozenset({2})))
    sched.add_request(req("held", 3, max_tokens=10, min_tokens=5, stop_token_ids=frozenset({2})))
    runner = MirrorRunner(stop_at={"early": 3, "held": 2})
    _, tokens, reasons = drive(sched, runner)
    assert reasons["early"] == "stop" and tokens["early"][-1] == 2 and len(tokens["early"]) == 4
    # The stop token came at output 3, before min_tokens=5: ignored, so it runs to max_tokens.
    assert reasons["held"] == "length" and len(tokens["held"]) == 10


def test_preemption_by_recompute_with_a_tiny_pool_keeps_outputs_exact():
    # 6 blocks of 4 tokens: three requests of 8-token prompts cannot all grow to 8 + 10 tokens.
    sched = make(num_blocks=6, block_size=4, max_num_seqs=3, max_num_batched_tokens=32, caching=False)
    for i in range(3):
        sched.add_request(req(f"r{i}", 8, max_tokens=10, arrival=i))
    events = []

    def on_step(step, plan, outputs):
        events.append(outputs.num_preempted)

    plans, tokens, reasons = drive(sched, on_step=on_step)
    # Every preemption is reported in the outputs of the step that made it.
    assert sum(events) == sched.table.num_preemptions > 0
    # By recompute: a preempted request is sent to the runner again whole, with the tokens it
    # had generated, and none of it counted as computed (its KV cache was dropped).
    sent = [new for plan in plans for new in plan.new_requests]
    assert len(sent) == 3 + sched.table.num_preemptions
    resent = [new for new in sent if len(new.token_ids) > 8]
    assert resent, "no request was preempted after generating"
    for new in sent:
        assert new.num_computed_tokens == 0 and new.num_prompt_tokens == 8
        assert new.token_ids[8:] == tokens[new.request_id][: len(new.token_ids) - 8]
    for i in range(3):
        rid = f"r{i}"
        assert tokens[rid] == [token_at(rid, 8 + k) for k in range(10)], f"{rid} lost or changed tokens"
        assert reasons[rid] == "length"


def test_preemption_victim_is_latest_arrival_and_requeued_ahead_of_newcomers():
    sched = make(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, caching=False)
    sched.add_request(req("old", 4, max_tokens=8, arrival=0))
    sched.add_request(req("young", 4, max_tokens=8, arrival=1))
    runner = MirrorRunner()
    step(sched, runner)  # both prefilled: 1 block each, then each grows
    sched.add_request(req("newcomer", 4, max_tokens=2, arrival=2))
    preempted_at = None
    for n in range(12):
        plan, _ = step(sched, runner)
        if sched.table.num_preemptions and preempted_at is None:
            preempted_at = n
            assert [r.request_id for r in sched.running] == ["old"]
            assert [r.request_id for r in sched.waiting][:2] == ["young", "newcomer"]
            assert "young" not in plan.req_ids
    assert preempted_at is not None


def test_priority_policy_preempts_lowest_priority_first_and_admits_by_priority():
    sched = make(
        num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, policy="priority", caching=False
    )
    sched.add_request(req("low", 4, max_tokens=8, arrival=0, priority=5))
    sched.add_request(req("high", 4, max_tokens=8, arrival=1, priority=0))
    runner = MirrorRunner()
    plan, _ = step(sched, runner)
    assert plan.req_ids == ["high", "low"]  # admitted by priority, not arrival
    while not sched.table.num_preemptions:
        step(sched, runner)
    assert [r.request_id for r in sched.running] == ["high"]
    _, tokens, _ = drive(sched, runner)


def test_prefix_cache_hit_shares_blocks_and_skips_their_compute():
    sched = make(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    system = list(range(500, 510))  # 10 tokens: two full blocks of 4
    sched.add_request(req("first", 0, prompt=system + [1, 2], max_tokens=3))
    runner = MirrorRunner()
    step(sched, runner)
    sched.add_request(req("second", 0, prompt=system + [7, 8, 9], max_tokens=3, arrival=1))
    plan, _ = step(sched, runner)
    i = plan.req_ids.index("second")
    assert plan.num_computed_tokens[i] == 8 and plan.num_scheduled_tokens[i] == 5
    first, second = sched.running
    assert first.block_ids[:2] == second.block_ids[:2]
    assert [sched.table.pool.ref_cnt[b] for b in second.block_ids[:2]] == [2, 2]
    drive(sched, runner)
    # After both finish, the cached blocks stay cached (free but evictable) for a third.
    assert len(sched.table.pool.free_cached) >= 2
    sched.add_request(req("third", 0, prompt=system + [3], max_tokens=1, arrival=2))
    plan = sched.schedule()
    assert plan.num_computed_tokens == [8] and plan.num_scheduled_tokens == [3]


def test_prefix_cache_full_prompt_hit_still_computes_one_token():
    sched = make(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    prompt = list(range(600, 608))  # exactly two blocks
    sched.add_request(req("a", 0, prompt=prompt, max_tokens=1))
    drive(sched)
    sched.add_request(req("b", 0, prompt=prompt, max_tokens=1, arrival=1))
    plan = sched.schedule()
    assert plan.num_computed_tokens == [4] and plan.num_scheduled_tokens == [4]


def test_cached_blocks_are_evicted_lru_only_when_needed():
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    pool.publish_blocks([1, 2, 3, 4], a, hashes := [], 0, 2)
    pool.free(a)
    assert pool.num_free_blocks == 4 and len(pool.free_cached) == 2
    b = pool.allocate(2)  # the two never-cached blocks go first
    assert set(b).isdisjoint(a) and len(pool.cached) == 2
    c = pool.allocate(1)  # now one cached block must go: the least recently used
    assert c == [a[1]]  # freed in reverse, so the tail block is evicted before the prefix
    assert pool.find_cached_prefix(hashes, [1, 2, 3, 4]) == [a[0]]
    pool.check_invariants()


def test_hash_collision_is_ruled_out_by_comparing_token_ids():
    pool = BlockPool(4, 2)
    blocks = pool.allocate(1)
    pool.publish_blocks([1, 2], blocks, hashes := [], 0, 1)
    assert pool.find_cached_prefix(hashes, [1, 2]) == blocks
    assert pool.find_cached_prefix(hashes, [9, 9]) == []  # same hash, other tokens: a miss


def test_abort_frees_everything_at_once_wherever_the_request_is():
    sched = make(max_num_seqs=1, max_num_batched_tokens=64)
    sched.add_request(req("run", 6, max_tokens=50))
    sched.add_request(req("wait", 6, max_tokens=50, arrival=1))
    runner = MirrorRunner()
    step(sched, runner)
    used = sched.table.pool.num_used_blocks
    assert used > 0
    assert sched.abort("run") and sched.abort("wait") and not sched.abort("nobody")
    assert sched.table.pool.num_used_blocks == 0
    plan = sched.schedule()
    assert plan.freed_req_ids == ["run"] and plan.is_empty
    assert not sched.has_unfinished()


def test_abort_between_schedule_and_update_is_safe():
    sched = make(max_num_seqs=2, max_num_batched_tokens=64)
    sched.add_request(req("a", 4, max_tokens=5))
    sched.add_request(req("b", 4, max_tokens=5, arrival=1))
    runner = MirrorRunner()
    plan = sched.schedule()
    result = runner.execute(plan)
    a = sched.table.requests["a"]
    sched.abort("a")
    out = sched.update(plan, result)
    assert a.num_output_tokens == 0 and a.num_computed_tokens == 0 and not a.block_ids
    assert sched.table.requests["b"].num_output_tokens == 1 and not out.finished
    check_invariants(sched, plan)


def test_admission_errors_name_the_limit():
    sched = make(num_blocks=4, block_size=4, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="max_model_len is 64"):
        sched.add_request(req("long", 64))
    with pytest.raises(ValueError, match="whole pool has 4"):
        sched.add_request(req("big", 10, max_tokens=20))  # 30 tokens = 8 blocks > 4
    with pytest.raises(ValueError, match="empty"):
        Request("empty", [], StopCriteria())
    with pytest.raises(ValueError, match="max_tokens"):
        StopCriteria(max_tokens=-1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="random")
    sched.add_request(req("ok", 4, max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("ok", 4))
    assert sched.has_unfinished()  # the valid request is still queued


def test_generation_stops_at_max_model_len():
    sched = make(max_model_len=12, max_num_batched_tokens=64, max_num_seqs=2)
    sched.add_request(req("a", 8, max_tokens=100))
    _, tokens, reasons = drive(sched)
    assert len(tokens["a"]) == 4 and reasons["a"] == "length"


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_with_tiny_pool_and_aborts_keeps_invariants(policy, seed):
    rng = random.Random(seed)
    sched = make(
        num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=24, policy=policy, max_model_len=64
    )
    expected = {}
    shared = [rng.randrange(50) for _ in range(8)]
    for i in range(40):
        n = rng.randrange(1, 20)
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(50) for _ in range(n)]
        m = rng.randrange(1, 20)
        sched.add_request(req(f"q{i}", 0, prompt=prompt, max_tokens=m, arrival=i, priority=rng.randrange(3)))
        expected[f"q{i}"] = (len(prompt), m)
    aborted = set()

    def on_step(step, plan, outputs):
        if rng.random() < 0.05 and sched.running:
            victim = rng.choice(sched.running).request_id
            sched.abort(victim)
            aborted.add(victim)

    _, tokens, reasons = drive(sched, on_step=on_step)
    for rid, (n_prompt, m) in expected.items():
        if rid in aborted:
            continue
        assert reasons[rid] == "length"
        assert tokens[rid] == [token_at(rid, n_prompt + k) for k in range(m)]
