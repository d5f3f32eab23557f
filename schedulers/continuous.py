"""Iteration-level (continuous) batching, as in Orca and vLLM.

Every step is planned afresh under one token budget:
  1. running requests' decode tokens (one each), in order;
  2. running requests still prefilling, a chunk each from what is left of the budget;
  3. waiting requests, while `max_num_seqs` and the budget allow, each with its first chunk.
A request that finishes leaves in the step it finishes and its blocks return at once. When the
pool runs dry, a running request is preempted by recompute and re-queued ahead of new arrivals.

Who goes first (WaitingQueue) and who is preempted (`_victim_key_for`):
  - tiers: interactive requests before batch ones; batch requests take only the slots and
    blocks interactive ones leave, and an interactive request that finds none preempts a
    running batch request (`_make_room`); out of blocks, batch requests are the first victims;
    no batch request starts in a step that computes an interactive request's first token
    (`_first_token_step`), whose length is that request's time to first token;
  - policy "fcfs": arrival order, the latest arrival preempted first;
  - policy "priority": lower Request.priority first, aged by the wait (config.priority_aging_s,
    the bound in WaitingQueue's docstring), the worst aged priority preempted first;
  - policy "fair": per-tenant Virtual Token Counters within a priority level, the prefill
    budget split between tenants, the victim from the tenant furthest over its share; slot
    shares (schedulers/fair.py): no admission past a tenant's share of `max_num_seqs` while
    another tenant below its share waits, and a tenant below its share that finds no slot
    takes one from the tenant furthest over its share (`_make_room`).

Parallel sampling (a request with `followers`, one per further choice): the leader is admitted
only when running requests leave room for all its choices (max_num_seqs), with the blocks its
followers will need to copy its prompt's partial last block; in the step that computes the
last of its prompt, the followers fork from it (`_fork`) and sample from its logits. So the
prompt is computed once, whatever n is.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from schedulers.config import SchedulerConfig
from schedulers.fair import FairQueue, PrefillShares, TenantCounters
from schedulers.interface import BlockAllocator, SchedulerStats
from schedulers.plan import StepOutputs, StepPlan, StepResult
from schedulers.request import Request, RequestStatus
from schedulers.request_table import RequestTable
from schedulers.speculation import NgramProposer, SpeculationStats


class _Fifo:
    """FCFS: a deque; preempted requests go to the front."""

    def __init__(self) -> None:
        self._deque: deque[Request] = deque()
        self.push, self.push_front, self.remove = self._deque.append, self._deque.appendleft, self._deque.remove

    def __len__(self) -> int:
        return len(self._deque)

    def peek(self, skip=None) -> Request:
        return self._deque[0]

    def pop_head(self, req: Request) -> None:
        self._deque.popleft()

    def __iter__(self):
        return iter(self._deque)


class _AgedHeap:
    """Priority order, aged: a heap keyed by priority * aging_s + arrival_time, i.e. by the
    effective priority `priority - wait / aging_s` (a request gains one level per aging_s
    seconds of wait), which orders requests the same at every instant, so the key is fixed at
    push. A preempted request keeps its arrival: it is older than any newcomer of its level.
    aging_s = 0: strict (priority, arrival) order."""

    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s
        self._heap: list[tuple[float, float, int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def key(self, req: Request) -> tuple[float, float]:
        a = self.aging_s
        return (req.priority * a + req.arrival_time, req.arrival_time) if a else (req.priority, req.arrival_time)

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (*self.key(req), next(self._seq), req))

    push_front = push

    def peek(self, skip=None) -> Request:
        return self._heap[0][3]

    def pop_head(self, req: Request) -> None:
        heapq.heappop(self._heap)

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not req]
        heapq.heapify(self._heap)

    def __iter__(self):
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


class WaitingQueue:
    """Waiting requests, interactive ones before batch ones (Request.tier), each tier in the
    policy's order: "fcfs" (_Fifo), "priority" (_AgedHeap), "fair" (schedulers/fair.py's
    FairQueue: the lowest-counter tenant's oldest request of the best priority level).

    The aging bound (policy="priority", aging_s > 0): a request of priority p that arrives at
    t0 has the key p * aging_s + t0; a request arriving after t0 + (p - p_min) * aging_s has a
    larger key whatever its priority (p_min: the best priority in use). So from that moment on
    no newcomer overtakes it, and its wait is at most (p - p_min) * aging_s plus the time to
    serve the requests queued ahead of it by then (their number is bounded by what arrived in
    that window). tests/test_fair_scheduler.py drives a flood of high-priority requests."""

    def __init__(self, policy: str, aging_s: float = 0.0, tenants=None) -> None:
        if policy == "fair":
            self._tiers = (FairQueue(tenants), FairQueue(tenants))
        elif policy == "priority":
            self._tiers = (_AgedHeap(aging_s), _AgedHeap(aging_s))
        else:
            self._tiers = (_Fifo(), _Fifo())

    def __len__(self) -> int:
        return len(self._tiers[0]) + len(self._tiers[1])

    def push(self, req: Request) -> None:
        self._tiers[req.is_batch].push(req)

    def push_front(self, req: Request) -> None:
        self._tiers[req.is_batch].push_front(req)

    def peek(self, skip: set[str] | None = None) -> Request | None:
        """The next request to admit (None: only tenants in `skip` wait, under "fair")."""
        for q in self._tiers:
            if len(q):
                req = q.peek(skip)
                if req is not None:
                    return req
        return None

    def pop(self, req: Request) -> None:
        """Take out `req`, which peek() just returned."""
        self._tiers[req.is_batch].pop_head(req)

    def remove(self, req: Request) -> None:
        self._tiers[req.is_batch].remove(req)

    def tenants(self, batch: bool = True):
        """Under "fair": the tenants with a waiting interactive request, or (`batch`) any; an
        iterable that may name a tenant twice (once per tier), read without building a set."""
        first = self._tiers[0].tenants()
        return itertools.chain(first, self._tiers[1].tenants()) if batch else first

    def demand_total(self) -> int:
        """Under "fair": the tokens of every waiting tenant's head request, together."""
        return self._tiers[0].demand_total() + self._tiers[1].demand_total()

    def demands(self) -> dict[str, int]:
        """Under "fair": each waiting tenant's head request's tokens."""
        out: dict[str, int] = {}
        for q in self._tiers:
            q.demands(out)
        return out

    def __iter__(self):
        return itertools.chain(*self._tiers)


class _Step:
    """What one `schedule()` call builds, handed to the helpers; dropped when the call returns
    (only `scheduled` lives on, in `_planned`, for `update`). The single owner of the step's
    token budget: `_allocate`, `_preempt` (which gives a victim's tokens back),
    `_schedule_running` and `_admit_waiting` all read and change `budget` here."""

    __slots__ = ("budget", "plan", "preempted", "scheduled", "shares", "prefill_rows")

    def __init__(self, plan: StepPlan, budget: int) -> None:
        self.plan = plan
        self.scheduled: list[Request] = []  # plan order, for update (not sent to the runner)
        self.budget = budget  # tokens still free this step
        self.preempted = False  # a preemption happened: admit nobody this step
        # policy="fair": the prefill budget's split between tenants, and the rows planned
        # through the prefill paths, (request, start, tokens), for update's charge.
        self.shares = None
        self.prefill_rows: list[tuple[Request, int, int]] | None = None


class ContinuousBatchScheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockAllocator) -> None:
        self.config = config
        self.table = RequestTable(pool, config.max_model_len)
        # policy="fair": the tenants' counters, told of status changes by the table.
        self.tenants = TenantCounters(config.tenant_weights) if config.policy == "fair" else None
        self.table.tenants = self.tenants
        self.waiting = WaitingQueue(config.policy, config.priority_aging_s, self.tenants)
        self._victim_key = self._victim_key_for(config.policy)
        self.running: list[Request] = []
        self.num_steps = 0
        self._planned: dict[int, list[Request]] = {}  # the last plan's requests, in plan order
        self._prefill_rows: list[tuple[Request, int, int]] = []  # the last plan's, under "fair"
        self._all_running_planned = True
        self._step_preemptions = 0
        self._leaders: list[Request] = []  # running requests whose followers have not forked yet
        spec = config.speculative_config
        self.proposer = NgramProposer(spec) if spec is not None else None
        self.spec_stats = SpeculationStats()

    # ---- the Scheduler protocol --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request (with its followers, for n > 1: they are not queued themselves)."""
        self.validate(request)
        request.status = RequestStatus.WAITING
        self.table.register(request)
        self.waiting.push(request)

    def validate(self, request: Request) -> None:
        """Raise ValueError if `request` (with its followers) can never run."""
        self.table.validate(request)
        if len(request.followers) >= self.config.max_num_seqs:
            raise ValueError(
                f"a request of {len(request.followers) + 1} choices needs that many of max_num_seqs "
                f"({self.config.max_num_seqs}) at once"
            )

    def abort(self, request_id: str) -> bool:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """End a request from outside the step (abort, or a stop string the engine found)."""
        req = self.table.requests.get(request_id)
        if req is None:
            return False
        if self.proposer is not None:
            self.proposer.forget(request_id)
        if req.leader is not None:  # a follower not forked yet: it never ran
            leader = self.table.detach_follower(req)
            if not leader.followers and leader in self._leaders:
                self._leaders.remove(leader)
            self.table.finish(req, status)
            return True
        if req in self._leaders:
            self._leaders.remove(req)
        heir = self.table.hand_over(req)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.table.finish(req, status)
        if heir is not None:  # its followers go on without it: the first leads, from scratch
            self.waiting.push_front(heir)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def next_due(self, now: float = 0.0) -> float | None:
        return 0.0 if self.has_unfinished() else None

    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> SchedulerStats:
        pool = self.table.pool
        return SchedulerStats(
            self.num_waiting(),
            len(self.running),
            self.table.num_preemptions,
            pool.num_blocks - pool.num_free_blocks,
            pool.num_blocks,
            self.table.num_computed_prompt_tokens,
            self.spec_stats.num_drafts,
            self.spec_stats.num_draft_tokens,
            self.spec_stats.num_accepted_tokens,
        )

    def schedule(self, now: float = 0.0) -> StepPlan:
        step = _Step(StepPlan(freed_req_ids=self.table.take_freed()), self.config.max_num_batched_tokens)
        if self.tenants is not None:
            step.prefill_rows = []
        preemptions_before = self.table.num_preemptions
        if self.table.trims:
            step.plan.trimmed_block_ids, self.table.trims = self.table.trims, {}
        self._schedule_running(step, self._propose(step) if self.proposer is not None else None)
        if not step.preempted:  # admitting now would only feed the next preemption
            self._admit_waiting(step)
        if self._leaders:
            self._fork(step)
        self.num_steps += 1
        self._planned = {id(step.plan): step.scheduled}
        if self.tenants is not None:
            self._prefill_rows = step.prefill_rows
            self._all_running_planned = len(step.scheduled) == len(self.running)
        self._step_preemptions = self.table.num_preemptions - preemptions_before
        return step.plan

    def update(self, plan: StepPlan, result: StepResult) -> StepOutputs:
        out = StepOutputs(plan.req_ids, result.sampled_token_ids)
        reqs = self._planned.pop(id(plan), None)
        if reqs is None:
            raise ValueError("update() takes the plan returned by this scheduler's last schedule()")
        if self.tenants is not None:
            self.tenants.charge_step(
                reqs, result.sampled_token_ids, self._prefill_rows, self._all_running_planned, bool(plan.spec_token_ids)
            )
        self.table.apply(plan, reqs, result, out)
        if self.tenants is not None and self.tenants.owed:
            self.tenants.settle()
        if self.table.verified:
            for rid, drafted, accepted in self.table.verified:
                self.spec_stats.record(drafted, accepted)
                self.proposer.record(rid, drafted, accepted)
            self.table.verified.clear()
        if self.proposer is not None:
            for rid in out.finished:
                self.proposer.forget(rid)
        out.num_preempted = self._step_preemptions
        if out.finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return out

    # ---- policy --------------------------------------------------------------------------------

    def _propose(self, step: _Step) -> dict[str, list[int]] | None:
        """Draft tokens for decoding requests that may speculate, within what the step's
        budget has beyond one token for every running request (schedulers/speculation.py)."""
        k = self.proposer.config.k_for(len(self.running))
        if not k:
            return None
        spare = step.budget - len(self.running)
        drafts: dict[str, list[int]] = {}
        for req in self.running:
            if spare <= 0:
                break
            n = len(req.token_ids)
            # Before min_tokens the runner masks stop ids in the one row it samples: drafts wait
            # until then (a request with no stop ids, e.g. ignore_eos, has nothing masked).
            if not req.spec_ok or n - req.num_computed_tokens != 1 or (n < req.min_len and req.stop_token_ids):
                continue
            room = min(k, spare, req.max_len - n - 1)  # the bonus token must fit too
            if room > 0:
                d = self.proposer.propose(req.request_id, req.token_ids, room)
                if d:
                    drafts[req.request_id] = d
                    spare -= len(d)
        return drafts or None

    def _schedule_running(self, step: _Step, drafts: dict[str, list[int]] | None = None) -> None:
        running_status = RequestStatus.RUNNING
        bs = self.table.block_size
        plan, scheduled = step.plan, step.scheduled
        prefilling: list[Request] = []
        # The decode loop runs once per running request per step, so it is kept to plain local
        # appends and a local `budget`. That local IS the step's budget while the inner loop
        # runs (nothing else can read or change the budget meanwhile). The inner loop leaves
        # only for the rare path: a request that needs a new block (once every block_size
        # steps) or must be sent to the runner in full. The one write-back below hands the
        # budget to `step` first; the rare path then works on `step.budget` alone (`_allocate`
        # and `_preempt`, which gives a victim's tokens back, change it), and the next run of
        # the inner loop takes it up again, going on through the same snapshot.
        add_id, add_num, add_computed, add_sample = (
            plan.req_ids.append,
            plan.num_scheduled_tokens.append,
            plan.num_computed_tokens.append,
            plan.sample.append,
        )
        snapshot = iter(list(self.running))  # a snapshot: preemption edits self.running
        while True:
            budget = step.budget
            rare = None
            for req in snapshot:
                if budget <= 0:
                    break
                if req.status is not running_status:
                    continue  # preempted earlier in this loop
                computed = req.num_computed_tokens
                if len(req.token_ids) - computed != 1:
                    prefilling.append(req)
                    continue
                if computed >= len(req.block_ids) * bs or req.needs_full_state or drafts and req.request_id in drafts:
                    rare = req
                    break
                add_id(req.request_id)
                add_num(1)
                add_computed(computed)
                add_sample(True)
                scheduled.append(req)
                budget -= 1
            step.budget = budget  # the one write-back (see above)
            if rare is None:
                break  # the snapshot is done, or the budget is
            d = drafts.get(rare.request_id) if drafts else None
            n = 1 + len(d) if d else 1  # a decode verifying drafts computes them too
            if self._allocate(step, rare, n):  # False: `rare` itself was preempted
                if rare.needs_full_state:
                    self.table.add_to_plan(plan, rare, n)
                else:  # the inner loop's appends (cheaper than add_to_plan, same columns)
                    add_id(rare.request_id)
                    add_num(n)
                    add_computed(rare.num_computed_tokens)
                    add_sample(True)
                if d:
                    plan.spec_token_ids[rare.request_id] = d
                scheduled.append(rare)
                step.budget -= n
        threshold = self.config.long_prefill_token_threshold
        shares = None
        if self.tenants is not None and (prefilling or len(self.waiting)):
            shares = step.shares = self._prefill_shares(step, prefilling)
        for req in prefilling:
            if step.budget <= 0:
                break
            if req.status is not running_status:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, step.budget)
            if threshold:
                n = min(n, threshold)
            if shares is not None:
                n = min(n, shares.allowance(req.tenant, step.budget))
                if n <= 0:
                    continue
            start = req.num_computed_tokens
            if self._allocate(step, req, n):
                self.table.add_to_plan(plan, req, n)
                scheduled.append(req)
                step.budget -= n
                if step.prefill_rows is not None:  # policy "fair"
                    step.prefill_rows.append((req, start, n))
                    if shares is not None:
                        shares.take(req.tenant, n)

    def _prefill_shares(self, step: _Step, prefilling: list[Request]) -> PrefillShares | None:
        """Policy "fair": split what the decodes left of the budget between the tenants that
        want prefill (running prefills, and each waiting tenant's next request), and order the
        running prefills by counter, lowest first; None when the budget covers every demand."""
        # The total first, without a dict per tenant: most steps' demands fit the budget.
        total = self.waiting.demand_total()
        for req in prefilling:
            total += req.num_tokens - req.num_computed_tokens
        if total <= step.budget:
            return None  # everyone gets all it asks for: nothing to split
        demands = self.waiting.demands()
        for req in prefilling:
            demands[req.tenant] = demands.get(req.tenant, 0) + req.num_tokens - req.num_computed_tokens
        value = self.tenants.value
        prefilling.sort(key=lambda r: value(r.tenant))
        return self.tenants.shares(demands, step.budget)

    def _allocate(self, step: _Step, req: Request, num_new: int) -> bool:
        """Blocks for `num_new` more tokens of `req`, preempting others if the pool is dry;
        False if `req` itself had to be preempted."""
        new = self.table.grow(req, num_new)
        while new is None:
            victim = self._pick_victim()
            self._preempt(step, victim)
            if victim is req:
                return False
            new = self.table.grow(req, num_new)
        if new and not req.needs_full_state:  # the runner holds its table: send the diff
            step.plan.new_block_ids[req.request_id] = new
        return True

    def _victim_key_for(self, policy: str):
        """Preemption victims: batch before interactive; then, by policy, the latest arrival
        (fcfs), the worst aged priority (priority: the request the queue would admit last), or
        the tenant furthest over its share, its latest arrival (fair)."""
        if policy == "priority":
            aged = _AgedHeap(self.config.priority_aging_s).key
            return lambda r: (r.is_batch, aged(r))
        if policy == "fair":
            counters = self.tenants.counters
            return lambda r: (r.is_batch, counters.get(r.tenant, 0.0), r.arrival_time)
        return lambda r: (r.is_batch, r.arrival_time)

    def _pick_victim(self) -> Request:
        return max(self.running, key=self._victim_key)

    def _make_room(self, step: _Step, req: Request) -> bool:
        """A request that cannot be admitted (no slot, or no blocks) preempts, if it is
        interactive, a running batch request; else, under "fair", a request of the tenant
        furthest over its share of the slots if its own tenant stays within its share (never an
        interactive request for a batch one). False if it preempted nothing."""
        if not req.is_batch and self.table.num_batch:
            batch = [r for r in self.running if r.is_batch]
            if batch:
                self._preempt(step, max(batch, key=self._victim_key))
                return True
        if self.tenants is None:
            return False
        donor = self.tenants.slot_donor(req.tenant, 1 + len(req.followers), self.config.max_num_seqs)
        if donor is None:
            return False
        victims = [r for r in self.running if r.tenant == donor and (r.is_batch or not req.is_batch)]
        if not victims:
            return False
        self._preempt(step, max(victims, key=self._victim_key))
        return True

    def _preempt(self, step: _Step, victim: Request) -> None:
        self.running.remove(victim)
        plan = step.plan
        rid = victim.request_id
        if rid in plan.req_ids:  # scheduled earlier this step: take it back out
            i = plan.req_ids.index(rid)
            step.budget += plan.num_scheduled_tokens[i]
            for column in (
                plan.req_ids,
                plan.num_scheduled_tokens,
                plan.num_computed_tokens,
                plan.sample,
                step.scheduled,
            ):
                del column[i]
            plan.new_block_ids.pop(rid, None)
            plan.spec_token_ids.pop(rid, None)
            plan.new_requests = [r for r in plan.new_requests if r.request_id != rid]
            if step.prefill_rows:
                step.prefill_rows[:] = [row for row in step.prefill_rows if row[0] is not victim]
        if victim in self._leaders:
            self._leaders.remove(victim)
        self.table.preempt(victim)
        self.waiting.push_front(victim)
        step.preempted = True

    def _admit_waiting(self, step: _Step) -> None:
        table, waiting, running = self.table, self.waiting, self.running
        plan, scheduled = step.plan, step.scheduled
        max_seqs = self.config.max_num_seqs
        threshold = self.config.long_prefill_token_threshold
        # Slots held for the followers of leaders still prefilling: they join at their fork.
        held = sum(len(r.followers) for r in self._leaders) if self._leaders else 0
        tenants = self.tenants
        shares, skip, made_room_for = step.shares, None, None
        no_batch = None  # whether this step computes an interactive first token (asked once, lazily)
        while len(waiting) and step.budget > 0:
            if (
                made_room_for is None
                and len(running) + held >= max_seqs
                and not table.num_batch
                and (tenants is None or not tenants.any_over_share(max_seqs))
            ):
                # No slot, and nothing `_make_room` could free (no running batch request, no
                # tenant over its share): whoever the queue would put first breaks below. Said
                # here once, instead of after the peeks and share checks of every tenant.
                break
            # After a preemption made room for a request, that request, not whoever the queue
            # puts first now (the victim, pushed back to the front, may win a tie).
            req, made_room_for = (made_room_for, None) if made_room_for is not None else (waiting.peek(skip), None)
            if req is None:
                break  # under "fair", every waiting tenant has used its share of the budget
            if req.is_batch:  # the waiting queue's last tier: every later request is batch too
                if no_batch is None:
                    no_batch = self._first_token_step(scheduled)
                if no_batch:
                    break
            # Under "fair": admitting `req` would take its tenant past its share of the slots
            # while another tenant below its share waits (in req's tier or a better one).
            if tenants is not None and tenants.share_held(
                req.tenant, 1 + len(req.followers), max_seqs, waiting.tenants(req.is_batch), skip
            ):
                skip = (skip or set()) | {req.tenant}
                continue
            if len(running) + held + 1 + len(req.followers) > max_seqs:
                if self._make_room(step, req):
                    made_room_for = req
                    continue
                break  # not room for all its choices yet
            cap = min(step.budget, threshold) if threshold else step.budget
            if shares is not None:
                cap = min(cap, shares.allowance(req.tenant, step.budget))
                if cap <= 0:
                    skip = (skip or set()) | {req.tenant}
                    continue
            n = table.admit(req, cap)
            if n == 0:
                if self._make_room(step, req):
                    made_room_for = req
                    continue
                break  # not enough free blocks: wait for running requests to finish
            waiting.pop(req)
            running.append(req)
            if step.prefill_rows is not None:  # policy "fair"
                step.prefill_rows.append((req, req.num_computed_tokens, n))
                self.tenants.plan_prompt(req.tenant, n)
                if shares is not None:
                    shares.take(req.tenant, n)
            table.add_to_plan(plan, req, n)
            scheduled.append(req)
            step.budget -= n
            if req.followers:
                self._leaders.append(req)
                held += len(req.followers)

    @staticmethod
    def _first_token_step(scheduled: list[Request]) -> bool:
        """Whether this step computes (the last of) an interactive request's prompt, or part of it.

        Such a step's length is that request's time to first token, and a batch request
        starting in it would lengthen it by its own prefill: measured on SmolLM2 (CPU, 8 slots,
        a backlog of 16-token prompts), a chat's first step took 61-65 ms with three batch
        prefills beside it against 45 ms without (BENCHMARKS.md, issue 31). The batch
        request starts a step later instead, which costs the backlog one step per chat."""
        return any(not r.is_batch and r.num_tokens == r.num_prompt_tokens for r in scheduled)

    def _fork(self, step: _Step) -> None:
        """Fork the followers of every leader whose prompt this step completes: they run from
        now on, sampling this step from the leader's last logits (plan.forks), with its prompt
        blocks shared and their copies of its partial last block (plan.copy_blocks) made after
        the forward. Nothing is allocated here: the leader took the blocks at admission."""
        plan = step.plan
        where = {rid: i for i, rid in enumerate(plan.req_ids)}
        for leader in list(self._leaders):
            i = where.get(leader.request_id)
            if i is None or not plan.sample[i]:
                continue  # still prefilling (or not scheduled this step)
            self._leaders.remove(leader)
            for f, source in self.table.fork(leader):
                self.running.append(f)
                self.table.add_to_plan(plan, f, 0)
                step.scheduled.append(f)
                plan.forks[f.request_id] = leader.request_id
                if source is not None:
                    plan.copy_blocks.append((source, f.block_ids[-1]))
