"""Iteration-level (continuous) batching, as in Orca and vLLM.

Every step is planned afresh under one token budget:
  1. running requests' decode tokens (one each), in order;
  2. running requests still prefilling, a chunk each from what is left of the budget;
  3. waiting requests, while `max_num_seqs` and the budget allow, each with its first chunk.
A request that finishes leaves in the step it finishes and its blocks return at once. When the
pool runs dry, a running request is preempted by recompute (lowest priority, then latest
arrival) and re-queued ahead of new arrivals.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from schedulers.config import SchedulerConfig
from schedulers.interface import BlockAllocator
from schedulers.plan import StepOutputs, StepPlan, StepResult
from schedulers.request import Request, RequestStatus
from schedulers.request_table import RequestTable


class WaitingQueue:
    """FCFS (a deque: preempted requests go to the front) or priority order (a heap keyed by
    priority, then arrival: a preempted request is older than any newcomer of its level)."""

    def __init__(self, policy: str) -> None:
        self.by_priority = policy == "priority"
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap) if self.by_priority else len(self._deque)

    def push(self, req: Request) -> None:
        if self.by_priority:
            heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))
        else:
            self._deque.append(req)

    def push_front(self, req: Request) -> None:
        if self.by_priority:
            self.push(req)
        else:
            self._deque.appendleft(req)

    def peek(self) -> Request:
        return self._heap[0][3] if self.by_priority else self._deque[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.by_priority else self._deque.popleft()

    def remove(self, req: Request) -> None:
        if self.by_priority:
            self._heap = [e for e in self._heap if e[3] is not req]
            heapq.heapify(self._heap)
        else:
            self._deque.remove(req)

    def __iter__(self):
        return (e[3] for e in sorted(self._heap)) if self.by_priority else iter(self._deque)


class ContinuousBatchScheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockAllocator) -> None:
        self.config = config
        self.table = RequestTable(pool, config.max_model_len)
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.num_steps = 0
        self._planned: dict[int, list[Request]] = {}  # the last plan's requests, in plan order
        self._step_preemptions = 0

    # ---- the Scheduler protocol --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.table.validate(request)
        request.status = RequestStatus.WAITING
        self.table.requests[request.request_id] = request
        self.waiting.push(request)

    def abort(self, request_id: str) -> bool:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """End a request from outside the step (abort, or a stop string the engine found)."""
        req = self.table.requests.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.table.finish(req, status)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def next_due(self, now: float = 0.0) -> float | None:
        return 0.0 if self.has_unfinished() else None

    def schedule(self, now: float = 0.0) -> StepPlan:
        plan = StepPlan(freed_req_ids=self.table.take_freed())
        self._scheduled: list[Request] = []  # plan order, for update (not sent to the runner)
        self._budget = self.config.max_num_batched_tokens
        self._preempted = False
        preemptions_before = self.table.num_preemptions
        self._schedule_running(plan)
        if not self._preempted:  # admitting now would only feed the next preemption
            self._admit_waiting(plan)
        self.num_steps += 1
        self._planned = {id(plan): self._scheduled}
        self._step_preemptions = self.table.num_preemptions - preemptions_before
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> StepOutputs:
        out = StepOutputs(plan.req_ids, result.sampled_token_ids)
        reqs = self._planned.pop(id(plan), None)
        if reqs is None:
            raise ValueError("update() takes the plan returned by this scheduler's last schedule()")
        self.table.apply(plan, reqs, result, out)
        out.num_preempted = self._step_preemptions
        if out.finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return out

    # ---- policy --------------------------------------------------------------------------------

    def _schedule_running(self, plan: StepPlan) -> None:
        running_status = RequestStatus.RUNNING
        bs = self.table.block_size
        scheduled = self._scheduled
        prefilling: list[Request] = []
        # The decode loop runs once per running request per step: plain appends, no calls on
        # the common path (a new block is needed once every block_size steps).
        add_id, add_num, add_computed, add_sample = (
            plan.req_ids.append, plan.num_scheduled_tokens.append, plan.num_computed_tokens.append, plan.sample.append
        )
        budget = self._budget
        for req in list(self.running):  # a snapshot: preemption edits self.running
            if budget <= 0:
                break
            if req.status is not running_status:
                continue  # preempted earlier in this loop
            computed = req.num_computed_tokens
            if len(req.token_ids) - computed != 1:
                prefilling.append(req)
                continue
            if computed >= len(req.block_ids) * bs or req.needs_full_state:
                self._budget = budget
                if not self._allocate(plan, req, 1):
                    budget = self._budget
                    continue
                budget = self._budget
                if req.needs_full_state:
                    self.table.add_to_plan(plan, req, 1)
                    scheduled.append(req)
                    budget -= 1
                    continue
            add_id(req.request_id)
            add_num(1)
            add_computed(computed)
            add_sample(True)
            scheduled.append(req)
            budget -= 1
        self._budget = budget
        threshold = self.config.long_prefill_token_threshold
        for req in prefilling:
            if self._budget <= 0:
                break
            if req.status is not running_status:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, self._budget)
            if threshold:
                n = min(n, threshold)
            if self._allocate(plan, req, n):
                self.table.add_to_plan(plan, req, n)
                scheduled.append(req)
                self._budget -= n

    def _allocate(self, plan: StepPlan, req: Request, num_new: int) -> bool:
        """Blocks for `num_new` more tokens of `req`, preempting others if the pool is dry;
        False if `req` itself had to be preempted."""
        new = self.table.grow(req, num_new)
        while new is None:
            victim = self._pick_victim()
            self._preempt(plan, victim)
            if victim is req:
                return False
            new = self.table.grow(req, num_new)
        if new and not req.needs_full_state:  # the runner holds its table: send the diff
            plan.new_block_ids[req.request_id] = new
        return True

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return max(self.running, key=lambda r: r.arrival_time)

    def _preempt(self, plan: StepPlan, victim: Request) -> None:
        self.running.remove(victim)
        rid = victim.request_id
        if rid in plan.req_ids:  # scheduled earlier this step: take it back out
            i = plan.req_ids.index(rid)
            self._budget += plan.num_scheduled_tokens[i]
            for column in (plan.req_ids, plan.num_scheduled_tokens, plan.num_computed_tokens, plan.sample, self._scheduled):
                del column[i]
            plan.new_block_ids.pop(rid, None)
            plan.new_requests = [r for r in plan.new_requests if r.request_id != rid]
        self.table.preempt(victim)
        self.waiting.push_front(victim)
        self._preempted = True

    def _admit_waiting(self, plan: StepPlan) -> None:
        table, waiting, running = self.table, self.waiting, self.running
        max_seqs = self.config.max_num_seqs
        threshold = self.config.long_prefill_token_threshold
        while len(waiting) and len(running) < max_seqs and self._budget > 0:
            req = waiting.peek()
            n = table.admit(req, min(self._budget, threshold) if threshold else self._budget)
            if n == 0:
                break  # not enough free blocks: wait for running requests to finish
            waiting.pop()
            running.append(req)
            table.add_to_plan(plan, req, n)
            self._scheduled.append(req)
            self._budget -= n
