"""Fair shares between tenants: the Virtual Token Counter (VTC; Sheng et al., "Fairness in
Serving Large Language Models", OSDI '24, arXiv 2401.00588), inside the continuous batch.

Each tenant has a counter of the service it got, normalized by its weight:

    counter += (INPUT_WEIGHT * prompt tokens computed + OUTPUT_WEIGHT * output tokens) / weight

Prompt tokens served from the prefix cache are not charged, nor is a recompute after a
preemption (the scheduler's choice, not the tenant's): each prompt position is charged once,
when first computed (`Request.num_charged_prompt_tokens`). Followers of an n > 1 request share
their leader's prompt and pay for none of it.

  - Admission serves the waiting request of the tenant with the lowest counter (within a tier
    and a priority level), plus what this step already planned for it (`pending`), so that
    several admissions in one step alternate between tenants as VTC's per-request charge does.
  - A tenant that becomes active (it had no waiting or running request) is lifted to the lowest
    counter of the active tenants (the last idle one's when none is active): idle time is not
    saved up as credit to take the engine over later.
  - The step's prefill budget is split between the tenants that want some, max-min fair by
    weight (`PrefillShares`); what a tenant leaves is free for the others.
  - The preemption victim comes from the running tenant with the highest counter.
  - Slot shares: each active tenant is owed `max_num_seqs` times its weight over the active
    tenants' weights of the batch's slots. Admission does not take a tenant past its share
    while another tenant below its share waits (work-conserving otherwise), and a tenant below
    its share that finds no slot takes one from the tenant furthest over its own (`slot_donor`,
    a preemption). VTC alone never preempts: a light tenant arriving beside a flood that holds
    every slot would wait for flood requests to finish, however low its counter. A donor keeps
    at least its share, and nobody is admitted past a share that another waits for, so two
    backlogged tenants never take slots back and forth.

The weights: VTC's evaluation uses w_p = 1 and w_q = 2, the ratio OpenAI priced input and
output tokens at then; on this engine a decode token costs a whole forward's weight reads for
one token while prompt tokens share them in chunks, so output tokens are the dearer. We keep
1 and 2. The bound on the service difference of two backlogged tenants (VTC's theorem) is
2 * max(INPUT_WEIGHT * longest prompt, OUTPUT_WEIGHT * tokens a batch holds).

Cost per step: O(tenants + prefill rows). Output tokens are charged from per-tenant counts of
running requests kept at status changes (admit, fork, preempt, finish), not by walking the
batch, which at 1,024 running requests would cost as much as the decode loop itself.
"""

from __future__ import annotations

from collections import deque

from schedulers.request import Request, RequestStatus

INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class TenantCounters:
    """The VTC counters, and which tenants are active (have unfinished requests)."""

    def __init__(
        self, weights: dict[str, float], input_weight: float = INPUT_WEIGHT, output_weight: float = OUTPUT_WEIGHT
    ) -> None:
        # Missing: weight 1. A copy, fixed for the scheduler's life (the slot shares cache the
        # active tenants' total weight below).
        self.weights = dict(weights)
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}
        self.pending: dict[str, float] = {}  # prompt tokens admitted this step, charged by update
        self.num_unfinished: dict[str, int] = {}  # waiting or running requests per tenant
        self.num_running: dict[str, int] = {}
        self.lift = True  # VTC's counter lift (tests switch it off to see it matter)
        self.slot_shares = True  # the slot shares below (tests switch them off, as the lift)
        # Requests whose prompt lacks its last token: a one-token rest runs in the decode loop,
        # which records no prefill row, so `settle` charges it once the table has applied it.
        self.owed: list[Request] = []
        self._floor = 0.0  # the counter of the last tenant to go idle with nobody active
        # The active tenants' total weight, summed when first asked for after the active set
        # changed, not on every admission: at 1,024 running requests the per-admission sum was
        # most of what the slot shares cost a step.
        self._active_weight: float | None = None

    def value(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0) + self.pending.get(tenant, 0.0)

    # ---- activity, from the request table's status changes ------------------------------------

    def arrive(self, tenant: str) -> None:
        n = self.num_unfinished.get(tenant, 0)
        if n == 0:
            self._active_weight = None
            if self.lift:
                active = [self.counters[t] for t, k in self.num_unfinished.items() if k]
                base = min(active) if active else self._floor
                self.counters[tenant] = max(self.counters.get(tenant, 0.0), base)
            else:
                self.counters.setdefault(tenant, 0.0)
        self.num_unfinished[tenant] = n + 1

    def leave(self, tenant: str) -> None:
        n = self.num_unfinished[tenant] - 1
        self.num_unfinished[tenant] = n
        if n == 0:
            self._active_weight = None
            if not any(self.num_unfinished.values()):
                self._floor = self.counters[tenant]

    def started(self, tenant: str) -> None:
        self.num_running[tenant] = self.num_running.get(tenant, 0) + 1

    def stopped(self, tenant: str) -> None:
        self.num_running[tenant] -= 1

    # ---- slot shares ------------------------------------------------------------------------

    def _per_weight(self, slots: int) -> float:
        """Slots owed per unit of weight. The total weight is summed again only after a tenant
        became active or idle (`arrive`, `leave`): admission and preemption change who runs,
        not who is active."""
        total = self._active_weight
        if total is None:
            weights = self.weights
            total = self._active_weight = sum(weights.get(t, 1.0) for t, k in self.num_unfinished.items() if k)
        return slots / total if total > 0 else 0.0

    def within_share(self, tenant: str, need: int, slots: int) -> bool:
        """Whether `tenant` running `need` more stays within its share of the `slots`."""
        share = self._per_weight(slots) * self.weights.get(tenant, 1.0)
        return self.num_running.get(tenant, 0) + need <= share + 1e-9

    def share_held(self, tenant: str, need: int, slots: int, waiting, skip: set[str] | None) -> bool:
        """Whether admitting `need` more of `tenant` is held back: it would take `tenant` past
        its share while another tenant of `waiting` (tenant names; repeats allowed), not in
        `skip`, waits within its own share for one more. One pass over `waiting`, no sets
        built: this runs for every admission."""
        if not self.slot_shares:
            return False
        per_weight, weights, running = self._per_weight(slots), self.weights, self.num_running
        if running.get(tenant, 0) + need <= per_weight * weights.get(tenant, 1.0) + 1e-9:
            return False
        for t in waiting:
            if t != tenant and not (skip and t in skip):
                if running.get(t, 0) + 1 <= per_weight * weights.get(t, 1.0) + 1e-9:
                    return True
        return False

    def any_over_share(self, slots: int) -> bool:
        """Whether some running tenant holds more than its share: without one, `slot_donor`
        finds no donor for anybody."""
        if not self.slot_shares:
            return False
        per_weight, weights = self._per_weight(slots), self.weights
        for t, k in self.num_running.items():
            if k and k - per_weight * weights.get(t, 1.0) > 1e-9:
                return True
        return False

    def slot_donor(self, tenant: str, need: int, slots: int) -> str | None:
        """The tenant to take a running request from so that `tenant` runs `need` more, or
        None: only when `tenant` stays within its share after it, and the donor (the tenant
        furthest over its own share) holds more than its share now."""
        if not self.slot_shares or not self.within_share(tenant, need, slots):
            return None
        per_weight, weights = self._per_weight(slots), self.weights
        donor, excess = None, 1e-9
        for t, k in self.num_running.items():
            if k and t != tenant:
                over = k - per_weight * weights.get(t, 1.0)
                if over > excess:
                    donor, excess = t, over
        return donor

    # ---- charging ---------------------------------------------------------------------------

    def plan_prompt(self, tenant: str, num_tokens: int) -> None:
        """An admission planned `num_tokens` of a prompt: seen by the next choice this step."""
        w = self.weights.get(tenant, 1.0)
        self.pending[tenant] = self.pending.get(tenant, 0.0) + self.input_weight * num_tokens / w

    def charge_step(
        self,
        reqs: list[Request],
        sampled: list[list[int]],
        prefill_rows: list[tuple[Request, int, int]],
        all_running_planned: bool,
        speculated: bool,
    ) -> None:
        """Charge one step, before the table applies it. `reqs` are the planned requests and
        `sampled` their tokens; `prefill_rows` (request, start, tokens) are the rows planned
        through the prefill paths (running prefills and admissions), the only ones that can
        compute prompt tokens or sample nothing. `all_running_planned`: every running request
        is in the plan, so each tenant's running count is its number of sampling rows, less
        its prefill rows that sample nothing."""
        running = RequestStatus.RUNNING
        if all_running_planned:
            outputs = {t: k for t, k in self.num_running.items() if k}
        else:  # the budget ran out before every running request got its token (rare)
            outputs = {}
            for req in reqs:
                outputs[req.tenant] = outputs.get(req.tenant, 0) + 1
        prompts: dict[str, int] = {}
        for req, start, n in prefill_rows:
            if req.status is not running:
                continue
            end = start + n
            if end < len(req.token_ids) or len(req.token_ids) >= req.max_len:
                outputs[req.tenant] -= 1  # a chunk that ends inside the prompt samples nothing
            lo = max(start, req.num_charged_prompt_tokens)
            hi = min(end, req.num_prompt_tokens)
            if hi > lo:
                prompts[req.tenant] = prompts.get(req.tenant, 0) + hi - lo
                req.num_charged_prompt_tokens = hi
                if hi == req.num_prompt_tokens - 1:
                    self.owed.append(req)
        if speculated:  # a verified decode may bring several tokens
            for req, tokens in zip(reqs, sampled):
                if len(tokens) > 1:
                    outputs[req.tenant] += len(tokens) - 1
        wp, wq, weights, counters = self.input_weight, self.output_weight, self.weights, self.counters
        for t, k in outputs.items():
            counters[t] = counters.get(t, 0.0) + wq * k / weights.get(t, 1.0)
        for t, k in prompts.items():
            counters[t] = counters.get(t, 0.0) + wp * k / weights.get(t, 1.0)
        self.pending.clear()

    def settle(self) -> None:
        """After the table applied a step: charge the owed last prompt token of each request
        that computed it in the decode loop."""
        keep = []
        for req in self.owed:
            if req.num_charged_prompt_tokens >= req.num_prompt_tokens or req.status.finished:
                continue
            if req.status is RequestStatus.RUNNING and req.num_computed_tokens >= req.num_prompt_tokens:
                req.num_charged_prompt_tokens = req.num_prompt_tokens
                t = req.tenant
                self.counters[t] = self.counters.get(t, 0.0) + self.input_weight / self.weights.get(t, 1.0)
            else:
                keep.append(req)
        self.owed = keep

    def shares(self, demands: dict[str, int], budget: int) -> PrefillShares:
        return PrefillShares(demands, self.weights, budget)


class PrefillShares:
    """One step's prefill budget split max-min fair by weight (water-filling): each tenant gets
    its demand or its level times its weight, whichever is less, and the levels use the whole
    budget. A tenant's allowance is its quota plus the budget nobody reserved (rounding, a
    demand smaller than guessed, tokens a preemption gave back): work-conserving."""

    __slots__ = ("quota", "reserved")

    def __init__(self, demands: dict[str, int], weights: dict[str, float], budget: int) -> None:
        self.quota: dict[str, int] = {}
        left = budget
        order = sorted(demands, key=lambda t: demands[t] / weights.get(t, 1.0))
        total_w = sum(weights.get(t, 1.0) for t in order)
        for t in order:
            w = weights.get(t, 1.0)
            q = min(demands[t], int(left * w / total_w)) if total_w > 0 else 0
            self.quota[t] = q
            left -= q
            total_w -= w
        self.reserved = budget - left

    def allowance(self, tenant: str, budget: int) -> int:
        return min(budget, self.quota.get(tenant, 0) + max(0, budget - self.reserved))

    def take(self, tenant: str, num_tokens: int) -> None:
        q = self.quota.get(tenant, 0)
        used = min(q, num_tokens)
        if used:
            self.quota[tenant] = q - used
            self.reserved -= used


class FairQueue:
    """Waiting requests of one tier: per priority level, a FIFO per tenant; the head served is
    that of the lowest-counter tenant of the best level (ties: the earlier arrival).

    `peek` scans the waiting tenants, O(waiting tenants) per admission. A heap by counter would
    not be cheaper: every running tenant's counter moves every step (`charge_step`), so it
    would be rebuilt each step, and `pending` moves the admitted tenant's key within one."""

    def __init__(self, counters: TenantCounters) -> None:
        self.counters = counters
        self._levels: dict[int, dict[str, deque[Request]]] = {}
        self._len = 0
        # Waiting requests per tenant, all levels together: the slot-share check reads the
        # waiting tenants at every admission, without walking the levels.
        self._per_tenant: dict[str, int] = {}
        # The heads' tokens (`demands` summed), kept as heads change: every step asks whether
        # the prefill budget must be split. A waiting request's tokens do not change.
        self._head_tokens = 0

    def __len__(self) -> int:
        return self._len

    def push(self, req: Request) -> None:
        fifo = self._levels.setdefault(req.priority, {}).setdefault(req.tenant, deque())
        if not fifo:
            self._head_tokens += req.num_tokens
        fifo.append(req)
        self._added(req.tenant)

    def push_front(self, req: Request) -> None:
        fifo = self._levels.setdefault(req.priority, {}).setdefault(req.tenant, deque())
        self._head_tokens += req.num_tokens - (fifo[0].num_tokens if fifo else 0)
        fifo.appendleft(req)
        self._added(req.tenant)

    def _added(self, tenant: str) -> None:
        self._len += 1
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1

    def peek(self, skip: set[str] | None = None) -> Request | None:
        counters, pending = self.counters.counters, self.counters.pending
        levels = self._levels
        for level in sorted(levels) if len(levels) > 1 else levels:
            best, best_value, best_arrival = None, 0.0, 0.0
            for tenant, fifo in levels[level].items():
                if skip and tenant in skip:
                    continue
                head = fifo[0]
                value = counters.get(tenant, 0.0)
                if pending:
                    value += pending.get(tenant, 0.0)
                # (value, arrival) order without building a tuple per tenant: ties keep the
                # first seen, as the tuples' `<` did.
                if best is None or value < best_value or (value == best_value and head.arrival_time < best_arrival):
                    best, best_value, best_arrival = head, value, head.arrival_time
            if best is not None:
                return best
        return None

    def remove(self, req: Request) -> None:
        tenants = self._levels[req.priority]
        fifo = tenants[req.tenant]
        if fifo[0] is req:
            self._head_tokens -= req.num_tokens
            fifo.popleft()
            if fifo:
                self._head_tokens += fifo[0].num_tokens
        else:
            fifo.remove(req)
        self._len -= 1
        if not fifo:
            del tenants[req.tenant]
            if not tenants:
                del self._levels[req.priority]
        n = self._per_tenant[req.tenant] - 1
        if n:
            self._per_tenant[req.tenant] = n
        else:
            del self._per_tenant[req.tenant]

    pop_head = remove  # the head of its tenant's FIFO: O(1)

    def tenants(self):
        """The tenants with a waiting request in this queue (a live view: do not change the
        queue while reading it)."""
        return self._per_tenant.keys()

    def demand_total(self) -> int:
        """The tokens of every tenant's head request, together (`demands` summed)."""
        return self._head_tokens

    def demands(self, out: dict[str, int]) -> None:
        """Add each tenant's head request's tokens to `out` (the prefill it would want)."""
        for tenants in self._levels.values():
            for tenant, fifo in tenants.items():
                out[tenant] = out.get(tenant, 0) + fifo[0].num_tokens

    def __iter__(self):
        for level in sorted(self._levels):
            for fifo in self._levels[level].values():
                yield from fifo
