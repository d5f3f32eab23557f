"""A model-free runner and invariant checks for driving the LLM schedulers in tests.

MirrorRunner keeps its own copy of every request's token ids and block table, built only from
the plans (new requests, block diffs, freed ids), and checks it against the scheduler's state:
so the tests check the plan protocol, not just the scheduler's books.
"""

from __future__ import annotations

from schedulers import StepPlan, StepResult
from schedulers.request import RequestStatus


def token_at(request_id: str, position: int) -> int:
    """The token a deterministic fake model produces at `position` of request `request_id`:
    the same whatever else is in the batch and however often the request is preempted."""
    return 100 + (sum(map(ord, request_id)) * 31 + position * 7) % 900


class MirrorRunner:
    def __init__(self, stop_at: dict[str, int] | None = None, stop_token: int = 2) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.stop_at = stop_at or {}  # request id -> output position at which to emit stop_token
        self.stop_token = stop_token
        self.prompt_len: dict[str, int] = {}
        # Plans do not carry the block size: drive() (or a test) sets it from the scheduler,
        # so that the runner can check block capacity.
        self.block_size: int | None = None

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.freed_req_ids:
            self.tokens.pop(rid, None)
            self.blocks.pop(rid, None)
        for new in plan.new_requests:
            self.tokens[new.request_id] = list(new.token_ids)
            self.blocks[new.request_id] = list(new.block_ids)
            self.prompt_len[new.request_id] = new.num_prompt_tokens
        out = []
        for i, rid in enumerate(plan.req_ids):
            assert rid in self.tokens, f"{rid} planned but the runner was never sent it"
            self.blocks[rid].extend(plan.new_block_ids.get(rid, []))
            end = plan.num_computed_tokens[i] + plan.num_scheduled_tokens[i]
            assert end <= len(self.tokens[rid]), f"{rid}: computing past its known tokens"
            if self.block_size is not None:
                assert end <= len(self.blocks[rid]) * self.block_size, f"{rid}: not enough blocks for {end} tokens"
            assert plan.sample[i] == (end == len(self.tokens[rid]))
            if plan.sample[i]:
                n_out = end - self.prompt_len[rid]
                tok = self.stop_token if self.stop_at.get(rid) == n_out else token_at(rid, end)
                self.tokens[rid].append(tok)
                out.append([tok])
            else:
                out.append([])
        return StepResult(out)


class KVRunner(MirrorRunner):
    """A MirrorRunner that also tracks what each KV slot holds: the whole prefix of token ids
    whose last token was computed into it (attention makes a slot depend on all of them).

    Every step, before writing, it checks that each planned request's computed tokens sit in
    its blocks with their own prefix: a prefix-cache hit on a block with the same tokens but
    another prefix, or a shared block overwritten, fails at the step it would corrupt."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block id, slot) -> prefix

    def execute(self, plan: StepPlan) -> StepResult:
        result = super().execute(plan)  # applies the plan's diffs; only appends sampled tokens
        bs = self.block_size
        assert bs is not None, "KVRunner needs block_size (drive() sets it)"
        for i, rid in enumerate(plan.req_ids):
            tokens, blocks = tuple(self.tokens[rid]), self.blocks[rid]
            for p in range(plan.num_computed_tokens[i]):
                held = self.kv.get((blocks[p // bs], p % bs))
                assert held == tokens[: p + 1], f"{rid}: KV of token {p} (block {blocks[p // bs]}) holds another prefix"
        for i, rid in enumerate(plan.req_ids):
            tokens, blocks = tuple(self.tokens[rid]), self.blocks[rid]
            start = plan.num_computed_tokens[i]
            for p in range(start, start + plan.num_scheduled_tokens[i]):
                self.kv[blocks[p // bs], p % bs] = tokens[: p + 1]
        return result


def check_invariants(sched, plan: StepPlan, runner: MirrorRunner | None = None) -> None:
    pool = sched.table.pool
    pool.check_invariants()
    cfg = sched.config
    assert plan.total_tokens <= cfg.max_num_batched_tokens, "token budget exceeded"
    assert len(sched.running) <= cfg.max_num_seqs, "max_num_seqs exceeded"
    assert len(set(plan.req_ids)) == len(plan.req_ids), "a request planned twice in one step"
    holders: dict[int, int] = {}
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        for b in req.block_ids:
            holders[b] = holders.get(b, 0) + 1
        assert len(req.block_ids) * pool.block_size >= req.num_computed_tokens
        if runner is not None and req.request_id in runner.blocks:
            assert runner.blocks[req.request_id] == req.block_ids, f"{req.request_id}: runner's block table drifted"
    for b in range(pool.num_blocks):
        assert pool.ref_cnt[b] == holders.get(b, 0), f"block {b}: ref {pool.ref_cnt[b]} but {holders.get(b, 0)} holders"
    for req in sched.waiting:
        assert not req.block_ids, f"waiting {req.request_id} holds blocks"


def drive(sched, runner: MirrorRunner | None = None, max_steps: int = 10_000, on_step=None):
    """Run to completion, checking invariants every step. Returns (plans, outputs by request)."""
    runner = runner or MirrorRunner()
    runner.block_size = sched.table.block_size
    plans, tokens, reasons = [], {}, {}
    for step in range(max_steps):
        if not sched.has_unfinished():
            break
        plan = sched.schedule(float(step))
        check_invariants(sched, plan)
        outputs = sched.update(plan, runner.execute(plan))
        check_invariants(sched, plan, runner)
        for rid, toks in zip(outputs.req_ids, outputs.new_token_ids):
            if toks:
                tokens.setdefault(rid, []).extend(toks)
        reasons.update(outputs.finished)
        plans.append(plan)
        if on_step is not None:
            on_step(step, plan, outputs)
    else:
        raise AssertionError(f"not finished after {max_steps} steps")
    pool = sched.table.pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks still held after every request finished"
    return plans, tokens, reasons
