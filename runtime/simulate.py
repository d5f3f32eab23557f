"""Static vs continuous batching on the real schedulers, with a model-free runner.

Each request generates exactly its output length (one token per step it runs; its prefill
step yields its first token), which is the seed documents' model: the scheduler under test
decides which requests occupy the slots at every step.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from runtime.block_pool import BlockPool
from schedulers import (
    ContinuousBatchScheduler,
    DynamicBatchConfig,
    Request,
    SchedulerConfig,
    StaticBatchScheduler,
    StepPlan,
    StepResult,
    StopCriteria,
)

PROMPT_LEN = 4
FAKE_TOKEN = 7


def fake_execute(plan: StepPlan) -> StepResult:
    """A runner that samples FAKE_TOKEN wherever the plan asks for a sample."""
    return StepResult([[FAKE_TOKEN] if s else [] for s in plan.sample])


@dataclass(slots=True)
class SimResult:
    name: str
    steps: int  # steps that produced at least one token
    slot_steps: int  # tokens produced = busy slot-steps
    slots: int

    @property
    def busy(self) -> float:
        return self.slot_steps / (self.steps * self.slots) if self.steps else 0.0


def _run(scheduler, lengths: list[int], slots: int, name: str) -> SimResult:
    for i, n in enumerate(lengths):
        scheduler.add_request(
            Request(f"r{i}", [1] * PROMPT_LEN, StopCriteria(max_tokens=n), arrival_time=float(i) * 1e-9)
        )
    steps = tokens = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule(1.0)
        if plan.is_empty:
            raise RuntimeError(f"{name}: the scheduler planned nothing while requests wait")
        outputs = scheduler.update(plan, fake_execute(plan))
        produced = sum(len(t) for t in outputs.new_token_ids)
        if produced > slots:
            raise RuntimeError(f"{name}: {produced} tokens in one step on {slots} slots")
        steps += produced > 0
        tokens += produced
    return SimResult(name, steps, tokens, slots)


def simulate(lengths: list[int], slots: int, block_size: int = 16) -> tuple[SimResult, SimResult]:
    """Run the static and the continuous scheduler on the same requests."""
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of integers >= 1, got {lengths!r}")
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    max_len = PROMPT_LEN + max(lengths) + 1
    num_blocks = slots * -(-max_len // block_size)  # room for every slot: no preemption here
    config = SchedulerConfig(max_num_seqs=slots, max_num_batched_tokens=slots * PROMPT_LEN, max_model_len=max_len)
    static = StaticBatchScheduler(
        config, BlockPool(num_blocks, block_size), DynamicBatchConfig(max_batch_size=slots, max_queue_delay_ms=0.0)
    )
    continuous = ContinuousBatchScheduler(config, BlockPool(num_blocks, block_size))
    return _run(static, lengths, slots, "static"), _run(continuous, lengths, slots, "continuous")


def seed_formula(lengths: list[int], slots: int) -> tuple[int, int]:
    """The seed document's closed form: (static steps, continuous steps)."""
    static = sum(max(lengths[i : i + slots]) for i in range(0, len(lengths), slots))
    free_at = [0] * slots
    for n in lengths:
        heapq.heappush(free_at, heapq.heappop(free_at) + n)
    return static, max(free_at)


def format_report(lengths: list[int], slots: int) -> str:
    static, continuous = simulate(lengths, slots)
    ref_static, ref_cont = seed_formula(lengths, slots)
    lines = [
        f"{len(lengths)} requests, output lengths {lengths}, {slots} slots",
        f"{'scheduler':<12}{'decode steps':>14}{'slots busy':>12}{'seed formula':>14}",
    ]
    for r, ref in ((static, ref_static), (continuous, ref_cont)):
        lines.append(f"{r.name:<12}{r.steps:>14}{r.busy:>12.0%}{ref:>14}")
    lines.append(f"continuous is {static.steps / continuous.steps:.2f}x fewer steps than static")
    return "\n".join(lines)
