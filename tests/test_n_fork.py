"""n > 1 forks one prefill: the choices share the prompt's KV blocks (copy on write at the
partial block where they part), the prompt is computed once, and each choice's tokens equal a
single request with that choice's seed, through preemption by recompute too. best_of > n keeps
the n choices of highest cumulative logprob. Every test ends with the pool whole."""

from __future__ import annotations

import pytest

from runtime.block_pool import BlockPool
from runtime.llm.api import LLM
from runtime.llm.sampling_params import SamplingParams, choice_seed
from schedulers import ContinuousBatchScheduler, Request, SchedulerConfig, StepResult, StopCriteria

BS = 16
PROMPT = [1000 + (i * 37) % 4000 for i in range(512)]  # 512 tokens: 32 full blocks


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(
        model=tiny_llama_dir,
        device="cpu",
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        num_kv_blocks=160,
        enable_prefix_caching=False,  # so that no request's prompt is served by another's
    )


def assert_pool_whole(engine) -> None:
    pool = engine.runner.kv_pool
    pool.check_invariants()
    assert not engine.has_unfinished()
    assert pool.num_used_blocks == 0 and not any(pool.ref_cnt), "a block is still referenced"


def run(engine, prompt, params: list[SamplingParams]):
    """Run requests to completion on the engine's own steps: (outputs in order, the most KV
    blocks in use after any step, prompt tokens computed)."""
    before = engine.num_computed_prompt_tokens
    ids = [engine.add_request(prompt, p) for p in params]
    done, peak = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
        peak = max(peak, engine.scheduler.stats().kv_blocks_used)
    return [done[i] for i in ids], peak, engine.num_computed_prompt_tokens - before


def singles(seed: int, n: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(seed=choice_seed(seed, k), **kw) for k in range(n)]


SAMPLED = dict(max_tokens=8, temperature=0.8, top_p=0.95, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("length", [512, 500])  # whole blocks; a partial block copied on write
def test_n4_computes_the_prompt_once_and_each_choice_equals_its_single_request(llm, length):
    # A prompt no other test uses: a choice's block that missed its copy would hold another
    # prompt's K/V (or zeros), never this one's by chance.
    engine, prompt = llm.engine, [t + length for t in PROMPT[:length]]
    (group,), group_peak, group_prompt = run(engine, prompt, [SamplingParams(n=4, seed=11, **SAMPLED)])
    assert_pool_whole(engine)
    alone, alone_peak, alone_prompt = run(engine, prompt, singles(11, 4, **SAMPLED))
    assert_pool_whole(engine)
    full = length // BS
    # One prefill: the prompt's tokens counted once, and its full blocks held once (each choice
    # adds its own partial block: the leader's, or a copy of it, then one for its 8 tokens).
    assert (group_prompt, alone_prompt) == (length, 4 * length)
    choice_blocks = -(-(length + 8) // BS) - full
    assert group_peak == full + 4 * choice_blocks
    # Four single requests hold four copies of the prompt (their prefills are staggered, so
    # the first may finish before the last takes its own last blocks).
    assert alone_peak >= 4 * full + 1
    print(f"\nn=4, {length}-token prompt: prompt tokens computed {group_prompt} (4 single requests: {alone_prompt}), ")
    print(f"KV blocks in use at most {group_peak} (4 single requests: {alone_peak})")
    assert [c.index for c in group.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in group.outputs] == [o.token_ids for o in alone]
    assert [c.text for c in group.outputs] == [o.text for o in alone]
    for c, o in zip(group.outputs, alone):  # the same K/V read: the same logprobs
        assert [e["logprob"] for e in c.logprobs] == pytest.approx([e["logprob"] for e in o.logprobs], abs=1e-5)
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1  # the seeds do differ
    assert group.token_ids == group.outputs[0].token_ids and group.finish_reason == "length"
    assert group.prompt_token_ids == prompt


def test_greedy_choices_all_equal_the_single_greedy_request(llm):
    params = dict(max_tokens=10, temperature=0, ignore_eos=True)
    (group,), _, computed = run(llm.engine, PROMPT[:100], [SamplingParams(n=3, **params)])
    (single,), _, _ = run(llm.engine, PROMPT[:100], [SamplingParams(**params)])
    assert computed == 100
    assert [c.token_ids for c in group.outputs] == [single.token_ids] * 3
    assert_pool_whole(llm.engine)


def test_best_of_keeps_the_n_of_highest_cumulative_logprob(llm):
    prompt = PROMPT[:70]
    (group,), _, computed = run(
        llm.engine, prompt, [SamplingParams(n=2, best_of=4, seed=5, max_tokens=6, temperature=1.0, ignore_eos=True)]
    )
    assert computed == 70
    alone, _, _ = run(llm.engine, prompt, singles(5, 4, max_tokens=6, temperature=1.0, ignore_eos=True, logprobs=0))
    totals = [sum(e["logprob"] for e in o.logprobs) for o in alone]
    ranked = sorted(range(4), key=lambda k: -totals[k])[:2]
    assert [c.index for c in group.outputs] == [0, 1]
    assert [c.token_ids for c in group.outputs] == [alone[k].token_ids for k in ranked]
    assert [c.cumulative_logprob for c in group.outputs] == pytest.approx([totals[k] for k in ranked], abs=1e-4)
    assert all(c.logprobs is None for c in group.outputs)  # computed for the ranking only
    assert_pool_whole(llm.engine)


def test_a_forked_choice_preempted_by_recompute_gives_the_same_tokens(tiny_llama_dir):
    """A pool too small for all: the group arrived last, so its forked choices are the victims."""
    llm = LLM(
        model=tiny_llama_dir,
        device="cpu",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_kv_blocks=22,  # the group alone needs 2 + 4 * 5 blocks at most; the first request 7 more
    )
    engine = llm.engine
    preempted: list[str] = []
    table = engine.scheduler.table
    preempt = table.preempt
    table.preempt = lambda req: (preempted.append(req.request_id), preempt(req))[1]
    prompt = PROMPT[:40]
    params = dict(max_tokens=60, temperature=0.9, ignore_eos=True)
    first = engine.add_request(PROMPT[100:140], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    outs, _, _ = run(engine, prompt, [SamplingParams(n=4, seed=3, **params)])
    assert first not in engine.outputs.requests
    forked = {f"{outs[0].request_id}#{k}" for k in (1, 2, 3)}
    assert forked & set(preempted), f"no forked choice was preempted: {preempted}"
    table.preempt = preempt
    alone, _, _ = run(engine, prompt, singles(3, 4, **params))
    assert [c.token_ids for c in outs[0].outputs] == [o.token_ids for o in alone]
    assert_pool_whole(engine)


def test_abort_before_and_after_the_fork_frees_every_block(llm):
    engine = llm.engine
    params = SamplingParams(n=4, seed=1, max_tokens=50, temperature=0.7, ignore_eos=True)
    rid = engine.add_request(PROMPT, params)
    engine.step()  # the first half of the prompt: the followers have not forked
    assert engine.abort(rid)
    assert_pool_whole(engine)
    rid = engine.add_request(PROMPT, params)
    for _ in range(4):  # forked, decoding
        engine.step()
    assert engine.abort(rid)
    assert_pool_whole(engine)


def test_one_aborted_choice_leaves_the_others_running(llm):
    engine = llm.engine
    params = SamplingParams(n=3, seed=2, max_tokens=6, temperature=0.7, ignore_eos=True)
    rid = engine.add_request(PROMPT[:48], params)
    engine.step()
    assert engine.abort(f"{rid}#1")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (out,) = outs
    assert [c.finish_reason for c in out.outputs] == ["length", "abort", "length"]
    assert out.finish_reason == "length" and out.error is None
    assert_pool_whole(engine)


def test_streamed_choices_carry_their_index_and_deltas(llm):
    engine = llm.engine
    got = []
    rid = engine.add_request(PROMPT[:30], SamplingParams(n=2, seed=4, max_tokens=5, temperature=0.8), sink=got.append)
    while engine.has_unfinished():
        engine.step()
    final = got[-1]
    assert final.finished and final.request_id == rid and len(final.outputs) == 2
    assert all(not o.finished and len(o.outputs) == 1 for o in got[:-1])
    for k in range(2):
        streamed = [t for o in got[:-1] for c in o.outputs if c.index == k for t in c.delta_token_ids]
        assert streamed == final.outputs[k].token_ids
    assert_pool_whole(engine)


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(n=0), "n"), (dict(n=3, best_of=2), "best_of"), (dict(n=9), "n"), (dict(best_of=9), "best_of")],
)
def test_bad_choice_counts_are_named(llm, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        llm.engine.add_request(PROMPT[:10], SamplingParams(**kwargs))  # 9 > max_num_seqs (8)
    assert not llm.engine.has_unfinished()


def test_the_scheduler_forks_with_shared_blocks_and_copies_the_partial_one():
    """Model-free: the plan of the fork step, the blocks' reference counts, and the pool's books
    after every step."""
    pool = BlockPool(40, 4)
    sched = ContinuousBatchScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64), pool)
    choices = [Request(f"g#{k}", list(range(10, 20)), StopCriteria(max_tokens=3)) for k in range(3)]
    choices[0].followers = choices[1:]
    sched.add_request(choices[0])
    sched.add_request(Request("late", [1, 2, 3], StopCriteria(max_tokens=2)))  # 1 + 3 choices: room for it
    plans = []
    while sched.has_unfinished():
        plan = sched.schedule()
        plans.append(plan)
        out = [[7] if s else [] for s in plan.sample]
        sched.update(plan, StepResult(out))
        pool.check_invariants()
        if plan.forks:
            shared = choices[0].block_ids[:2]  # 10 tokens: two full blocks of 4, then a partial one
            assert all(pool.ref_cnt[b] == 3 for b in shared)
            assert [c.block_ids[:2] for c in choices] == [shared] * 3
            tails = [c.block_ids[2] for c in choices]
            assert len(set(tails)) == 3
            assert plan.copy_blocks == [(tails[0], tails[1]), (tails[0], tails[2])]
    fork = next(p for p in plans if p.forks)
    assert fork.forks == {"g#1": "g#0", "g#2": "g#0"}
    i = fork.req_ids.index("g#1")
    assert fork.num_scheduled_tokens[i] == 0 and fork.sample[i]
    assert sum(p.num_scheduled_tokens[p.req_ids.index("g#0")] for p in plans if "g#0" in p.req_ids) == 12
    assert sched.table.num_computed_prompt_tokens == 10 + 3
    assert pool.num_used_blocks == 0 and not any(pool.ref_cnt)
