"""ModelRunner under hostile conditions, on the tiny Llama: a KV cache full of NaN/inf outside
what the running requests own, an execute() that dies partway, and memory given back per
owner instance."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import write_kv
from runtime.llm.loader import load_model
from runtime.llm.runner import ModelRunner
from runtime.memory import DeviceMemoryManager, MemoryConfig
from schedulers.plan import NewRequestData, StepPlan

BLOCK = 4
NUM_BLOCKS = 48


def make_runner(model_dir: str, memory: DeviceMemoryManager | None = None) -> ModelRunner:
    memory = memory or DeviceMemoryManager(MemoryConfig(budget_bytes=256 * 2**20))
    limits = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128)
    return ModelRunner(load_model(model_dir), memory, block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, **limits)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Driver:
    """A scheduler's bookkeeping, minimal and deterministic: blocks come off the top of the free
    list (block 0 last, so it is free in every test here), freed blocks go back on top, so a
    new request reuses the blocks of the last one freed."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.free_ids = list(range(runner.kv_pool.num_blocks))
        self.reqs: dict[str, dict] = {}
        self.freed: list[str] = []
        self.logits: list[dict[str, torch.Tensor]] = []  # per step, request id -> logits

    def add(self, rid: str, tokens: list[int]) -> None:
        self.reqs[rid] = {"tokens": list(tokens), "computed": 0, "blocks": [], "new": True, "prompt": len(tokens)}

    def remove(self, rid: str) -> None:
        """Finish or abort: the blocks go back, the runner hears of it in the next plan."""
        self.free_ids += self.reqs.pop(rid)["blocks"][::-1]
        self.freed.append(rid)

    def plan(self, schedule: dict[str, int]) -> StepPlan:
        plan = StepPlan(freed_req_ids=self.freed)
        self.freed = []
        for rid, n in schedule.items():
            r = self.reqs[rid]
            need = -(-(r["computed"] + n) // BLOCK) - len(r["blocks"])
            new = [self.free_ids.pop() for _ in range(max(need, 0))]
            r["blocks"] += new
            if r["new"]:
                plan.new_requests.append(
                    NewRequestData(rid, list(r["tokens"]), list(r["blocks"]), r["computed"], r["prompt"])
                )
                r["new"] = False
            elif new:
                plan.new_block_ids[rid] = new
            plan.req_ids.append(rid)
            plan.num_scheduled_tokens.append(n)
            plan.num_computed_tokens.append(r["computed"])
            plan.sample.append(r["computed"] + n >= len(r["tokens"]))
        return plan

    def step(self, schedule: dict[str, int]) -> dict[str, list[int]]:
        plan = self.plan(schedule)
        result = self.runner.execute(plan)
        sampling = [rid for rid, s in zip(plan.req_ids, plan.sample) if s]
        self.logits.append({rid: self.runner.last_logits[i].clone() for i, rid in enumerate(sampling)})
        out = {}
        for rid, n, toks in zip(plan.req_ids, plan.num_scheduled_tokens, result.sampled_token_ids):
            self.reqs[rid]["computed"] += n
            self.reqs[rid]["tokens"] += toks
            out[rid] = toks
        return out

    def owned_blocks(self) -> set[int]:
        return {b for r in self.reqs.values() for b in r["blocks"]}


def run_mixed(runner: ModelRunner) -> Driver:
    """Sequences of different lengths: a whole prefill, a chunked prefill between decodes, and
    batched decodes across block boundaries, so padding of every kind is read."""
    d = Driver(runner)
    d.add("a", prompt(1, 3))
    d.add("b", prompt(2, 9))
    d.step({"a": 3, "b": 9})
    d.add("c", prompt(3, 14))
    d.step({"a": 1, "c": 6, "b": 1})  # c's first chunk does not sample
    d.step({"c": 8, "a": 1, "b": 1})  # its second reads the first from the cache
    for _ in range(6):
        d.step({"a": 1, "b": 1, "c": 1})
    return d


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_poisoned_unowned_kv_blocks_cannot_reach_any_output(tiny_llama_dir, poison):
    clean = run_mixed(make_runner(tiny_llama_dir))
    runner = make_runner(tiny_llama_dir)
    # Every pool block starts as garbage (block 0, which decode padding used to read, never
    # gets an owner here): only what the requests write themselves may be read.
    runner.kv_cache[:, :, : runner.kv_pool.num_blocks] = poison
    dirty = run_mixed(runner)
    assert 0 not in dirty.owned_blocks()
    assert torch.isnan(runner.kv_cache[:, :, 0]).all() or torch.isinf(runner.kv_cache[:, :, 0]).all()
    assert [r["tokens"] for r in dirty.reqs.values()] == [r["tokens"] for r in clean.reqs.values()]
    for got, want in zip(dirty.logits, clean.logits, strict=True):
        assert got.keys() == want.keys()
        for rid in got:
            assert torch.isfinite(got[rid]).all(), rid
            assert torch.equal(got[rid], want[rid]), rid


def _fail_partway(runner: ModelRunner, monkeypatch) -> None:
    """The model's forward runs its first layer for real, leaves NaN K/V in the plan's slots of
    every other layer, then raises; once."""
    real = runner.model.forward

    def forward(input_ids, positions, meta, kv_caches, sample_rows):
        monkeypatch.setattr(runner.model, "forward", real)
        real(input_ids, positions, meta, kv_caches[:1], None)
        junk = torch.full((len(meta.slot_mapping), runner.spec.num_kv_heads, runner.spec.head_dim), float("nan"))
        for k_cache, v_cache in kv_caches[1:]:
            write_kv(k_cache, v_cache, junk, junk, meta.slot_mapping)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(runner.model, "forward", forward)


def test_failed_execute_then_drop_leaves_other_requests_exact(tiny_llama_dir, monkeypatch):
    def run(fail: bool) -> Driver:
        runner = make_runner(tiny_llama_dir)
        d = Driver(runner)
        d.add("keep", prompt(10, 7))
        d.add("victim", prompt(11, 5))
        d.step({"keep": 7, "victim": 5})
        d.step({"keep": 1, "victim": 1})
        if fail:
            keep_state = (list(runner.requests["keep"].token_ids), list(runner.requests["keep"].block_ids))
            keep_kv = runner.kv_cache[:, :, d.reqs["keep"]["blocks"]].clone()
            d.add("doomed", prompt(12, 12))  # three full blocks, left NaN: new1 (5 tokens) gets a NaN tail
            _fail_partway(runner, monkeypatch)
            with pytest.raises(RuntimeError, match="injected"):
                d.step({"victim": 1, "doomed": 12})  # "keep" sits this step out
            # What the engine does: abort the plan's requests in the scheduler, then drop them.
            d.remove("victim")
            d.remove("doomed")
            runner.drop_requests(["victim", "doomed"])
            runner.drop_requests(["victim", "never-existed"])  # again, and unknown: both fine
            assert runner.requests.keys() == {"keep"}
            assert (runner.requests["keep"].token_ids, runner.requests["keep"].block_ids) == keep_state
            assert torch.equal(runner.kv_cache[:, :, d.reqs["keep"]["blocks"]], keep_kv)
            d.logits.clear()
        else:
            d.remove("victim")
            d.logits.clear()
        # The next plan frees ids the runner already dropped; new requests take the blocks
        # the failed step left NaN in.
        d.add("new1", prompt(13, 5))
        d.add("new2", prompt(14, 3))
        d.step({"keep": 1, "new1": 5, "new2": 3})
        for _ in range(5):
            d.step({"keep": 1, "new1": 1, "new2": 1})
        return d

    clean, failed = run(fail=False), run(fail=True)
    assert {rid: r["tokens"] for rid, r in failed.reqs.items()} == {rid: r["tokens"] for rid, r in clean.reqs.items()}
    for got, want in zip(failed.logits, clean.logits, strict=True):
        for rid in want:
            assert torch.isfinite(got[rid]).all(), rid
            torch.testing.assert_close(got[rid], want[rid], atol=1e-6, rtol=1e-6)


def test_plan_that_only_frees_dropped_ids(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    d = Driver(runner)
    d.add("x", prompt(20, 5))
    d.step({"x": 5})
    runner.drop_requests(iter(["x"]))
    assert runner.execute(StepPlan(freed_req_ids=["x", "x"])).sampled_token_ids == []
    assert runner.requests == {}


def test_memory_reserved_under_the_claimed_instance(tiny_llama_dir):
    mem = DeviceMemoryManager(MemoryConfig(budget_bytes=256 * 2**20))
    assert mem.claim("llm") == "llm"  # someone else's instance: the runner must not touch it
    mem.reserve("llm.weights", 1000)
    runner = make_runner(tiny_llama_dir, mem)
    assert runner.memory_owner == "llm#2"
    spec = runner.spec
    per_block = 2 * spec.num_layers * BLOCK * spec.num_kv_heads * spec.head_dim * 4
    owners = mem.stats()["owners"]
    assert owners["llm.weights"] == 1000
    assert owners["llm#2.weights"] == runner.model.num_parameter_bytes() and owners["llm#2.activations"] > 0
    assert owners["llm#2.kv_cache"] == NUM_BLOCKS * per_block and owners["llm#2.kv_scratch"] == per_block
    assert mem.kv_owner == "llm#2.kv_cache"
    # A runner that cannot start (one KV pool per device) keeps neither a name nor a byte.
    with pytest.raises(RuntimeError, match="KV pool"):
        make_runner(tiny_llama_dir, mem)
    assert mem.stats()["owners"] == owners
    assert mem.claim("llm") == "llm#3"


def test_release_memory_is_per_instance_and_idempotent(tiny_llama_dir):
    mem = DeviceMemoryManager(MemoryConfig(budget_bytes=256 * 2**20))
    runner = make_runner(tiny_llama_dir, mem)
    assert runner.memory_owner == "llm"
    mem.reserve("vision.weights", 1000)
    runner.release_memory()
    assert mem.stats()["owners"] == {"vision.weights": 1000} and mem.kv_pool is None
    with pytest.raises(RuntimeError, match="release_memory"):
        runner.execute(StepPlan())
    newer = make_runner(tiny_llama_dir, mem)  # takes the name "llm" again
    assert newer.memory_owner == "llm"
    reserved = mem.reserved_bytes
    runner.release_memory()  # must not release the newer runner's reservations
    assert mem.reserved_bytes == reserved and mem.kv_pool is newer.kv_pool
