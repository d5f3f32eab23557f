"""EngineCore: one scheduler and one model runner, and the step between them:

    plan = scheduler.schedule(now)
    result = runner.execute(plan)
    outputs = scheduler.update(plan, result)

Token ids in, token ids out: no text, no sinks (runtime/llm/output_processor.py), no request
checks (runtime/llm/input_processor.py). Failures stay with their requests, as
runtime/llm/failures.py decides; the step reports them as data and goes on.

A request's own data that outlives its runner state (a grammar matcher, a resumed request's
count of earlier outputs) is handed to the runner when the request is added and taken back when
it ends: a preempted request is dropped from the runner and re-admitted later, and finds it
there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.llm import failures
from runtime.llm.failures import Failure
from runtime.llm.input_processor import PreparedRequest
from schedulers import Request, RequestStatus
from schedulers.plan import StepOutputs, StepPlan


@dataclass(slots=True)
class CoreStep:
    """What one step did. `outputs` is None when nothing ran (an empty plan, or a runner
    exception: every request of the plan is then in `failed_step`)."""

    plan: StepPlan
    rejected: dict[str, Failure] = field(default_factory=dict)  # refused while queued
    failed_step: dict[str, Failure] = field(default_factory=dict)  # the plan's, when the runner raised
    refused: dict[str, Failure] = field(default_factory=dict)  # newcomers the runner could not admit
    outputs: StepOutputs | None = None
    logprobs: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[list[int]], list[list[float]]]] = field(default_factory=dict)


class EngineCore:
    def __init__(self, scheduler, runner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.num_steps = 0
        self.num_failed_steps = 0
        self.last_step_shape = (0, 0)  # (requests, tokens) of the last step, for cost models

    def add_request(
        self, req: Request, p: PreparedRequest, grammar_compiler, followers: Sequence[PreparedRequest] = ()
    ) -> None:
        """Queue a request, and give the runner what it needs of it beyond the plan; with n > 1,
        `req.followers` are the other choices, and `followers` their prepared requests."""
        self.scheduler.add_request(req)
        for q in (p, *followers):
            self.runner.keep_request_data(
                q.request_id,
                grammar=q.grammar,
                grammar_compiler=grammar_compiler,
                num_resumed_outputs=q.num_resumed_outputs,
            )

    def release(self, request_id: str) -> None:
        """The request ended: the runner forgets its data (unknown ids are fine)."""
        self.runner.forget_request_data(request_id)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def stop(self, request_id: str) -> bool:
        """End a request "stop" from outside the step (a stop string, a terminated grammar)."""
        return self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def next_step_shape(self) -> tuple[int, int]:
        """A guess of the next step's (requests, tokens), before planning it: running requests
        decode one token each, and if anyone waits for a slot, a prefill fills the budget."""
        s = self.scheduler
        load = s.stats()
        running, waiting = load.num_running, load.num_waiting
        if waiting and running < s.config.max_num_seqs:
            return min(s.config.max_num_seqs, running + waiting), s.config.max_num_batched_tokens
        return running, running

    def step(self, now: float) -> CoreStep:
        plan = self.scheduler.schedule(now)
        step = CoreStep(plan, rejected=failures.rejected_in_queue(plan))
        if plan.is_empty:
            return step
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # noqa: BLE001 - one step's failure stays with its requests
            self.num_failed_steps += 1
            step.failed_step = failures.step_failed(self.scheduler, self.runner, plan, exc)
            return step
        if result.failed:  # they alone fail, before the scheduler takes the result; the step went on
            step.refused = failures.refused_by_runner(self.scheduler, result.failed)
        step.outputs = self.scheduler.update(plan, result)
        step.logprobs = result.logprobs
        step.prompt_logprobs = result.prompt_logprobs
        self.num_steps += 1
        self.last_step_shape = (plan.num_reqs, plan.total_tokens)
        return step
